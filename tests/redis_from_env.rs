//! A runtime whose Redis is unreachable at start (SCENARIOS S17, issue 30
//! item 7): the backend stays configured and connects in the background;
//! meanwhile idempotency fails closed and throttles and debounce decide per
//! instance; once Redis answers, everything shares through it again. The
//! default runtime does this with the Redis its environment names, without
//! making the first caller wait for Redis.
#![cfg(feature = "redis")]

mod support;

use std::io::ErrorKind;
use std::net::{TcpListener, TcpStream};
use std::process::Command;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Arc, Mutex};
use std::time::Duration;

use support::redis::RedisNode;
use support::{Oops, Runs, ms};
use throttlebeam::store::{REDIS_CLUSTER_ENV, REDIS_URL_ENV, Redis};
use throttlebeam::{Error, Idempotency, IdempotencyOutcome, Runtime, Throttle};

const HOUR: Duration = Duration::from_secs(3600);

/// How long a started server may take to be noticed: the backoff between
/// attempts reaches 2 s, and a busy two-core machine adds its own delays.
const NOTICED_WITHIN: Duration = Duration::from_secs(30);

fn counted(
    runs: &Runs,
    value: u64,
) -> impl FnOnce() -> std::future::Ready<Result<u64, Oops>> + Send + use<> {
    let runs = runs.clone();
    move || {
        runs.hit();
        std::future::ready(Ok(value))
    }
}

/// Whether `e` is the fail-closed answer of a backend not connected yet.
fn not_connected(e: &Error, key: &str) -> bool {
    let Error::StoreUnavailable { key: k, source } = e else {
        return false;
    };
    let mut chain = source.to_string();
    let mut cause = source.source();
    while let Some(c) = cause {
        chain.push_str(": ");
        chain.push_str(&c.to_string());
        cause = c.source();
    }
    k == key && chain.contains("redis is not connected yet")
}

/// Runs `key` on `idempotency` until Redis answers it (the backend has
/// connected), at most [`NOTICED_WITHIN`].
async fn once_connected(
    run: impl Fn() -> std::pin::Pin<
        Box<dyn Future<Output = Result<IdempotencyOutcome<u64>, Error>> + Send>,
    >,
    key: &str,
) -> IdempotencyOutcome<u64> {
    let deadline = tokio::time::Instant::now() + NOTICED_WITHIN;
    loop {
        match run().await {
            Ok(outcome) => return outcome,
            Err(e) if not_connected(&e, key) && tokio::time::Instant::now() < deadline => {
                tokio::time::sleep(ms(50)).await;
            }
            Err(e) => panic!("{key}: {e:?}"),
        }
    }
}

/// Another instance, connected to `url` directly.
async fn other_instance(url: String) -> Runtime {
    let redis = Redis::builder(url)
        .with_command_timeout(Duration::from_secs(2))
        .connect()
        .await
        .expect("connects");
    Runtime::builder()
        .with_redis(redis)
        .start()
        .await
        .expect("starts")
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_runtime_connecting_in_the_background_fails_closed_then_shares_once_redis_answers() {
    let Some(mut node) = RedisNode::start("a_runtime_connecting_in_the_background") else {
        return;
    };
    node.kill();
    let started = std::time::Instant::now();
    let rt = Runtime::builder()
        .with_redis_connecting(
            Redis::builder(node.url()).with_command_timeout(Duration::from_secs(2)),
        )
        .start()
        .await
        .expect("starts without Redis");
    assert!(started.elapsed() < Duration::from_secs(1), "did not wait");
    let runs = Runs::default();

    // Unreachable: idempotency fails closed, nothing runs.
    let idempotency = rt.idempotency();
    let refused = idempotency
        .run("pay:1", counted(&runs, 1))
        .await
        .unwrap_err();
    assert!(not_connected(&refused, "pay:1"), "{refused:?}");
    assert_eq!(runs.get(), 0);
    // Throttles and debounce decide per instance.
    let throttle = rt.throttle();
    let ok = || async { Ok::<_, Oops>(()) };
    assert!(throttle.call("t:1", HOUR, ok).await.unwrap().is_executed());
    assert!(throttle.call("t:1", HOUR, ok).await.unwrap().is_throttled());
    let debounced = rt
        .debounce()
        .across_instances()
        .call("d:1", ms(10), counted(&runs, 5));
    assert_eq!(debounced.unwrap().await.unwrap(), 5);
    assert_eq!(runs.get(), 1);

    // The server comes up: within a bound, idempotency goes through Redis.
    node.restart();
    let fresh = once_connected(
        || {
            let (idempotency, runs) = (idempotency.clone(), runs.clone());
            Box::pin(async move { idempotency.run("pay:2", counted(&runs, 2)).await })
        },
        "pay:2",
    )
    .await;
    assert_eq!(fresh, IdempotencyOutcome::Fresh(2));
    // Observable from another instance sharing that Redis: the key is
    // claimed there, and replayed, not run again.
    let other = other_instance(node.url()).await;
    let replay = other.idempotency().run("pay:2", counted(&runs, 3)).await;
    assert_eq!(replay.unwrap(), IdempotencyOutcome::Replay(2));
    assert_eq!(runs.get(), 2);
    // Throttle windows are shared again too.
    assert!(
        other
            .throttle()
            .call("t:2", HOUR, ok)
            .await
            .unwrap()
            .is_executed()
    );
    assert!(throttle.call("t:2", HOUR, ok).await.unwrap().is_throttled());
    assert_eq!(rt.stats().throttle.throttled_remotely, 1);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_connecting_task_lost_with_its_tokio_runtime_is_started_again() {
    let Some(mut node) = RedisNode::start("a_connecting_task_lost_with_its_tokio_runtime") else {
        return;
    };
    node.kill();
    let url = node.url();
    // Started from a tokio runtime that then ends, taking its connecting
    // task with it.
    let rt = std::thread::spawn(move || {
        let tokio = tokio::runtime::Builder::new_current_thread()
            .enable_all()
            .build()
            .unwrap();
        let rt = tokio.block_on(async {
            Runtime::builder()
                .with_redis_connecting(
                    Redis::builder(url).with_command_timeout(Duration::from_secs(2)),
                )
                .start()
                .await
                .unwrap()
        });
        drop(tokio);
        rt
    })
    .join()
    .unwrap();
    node.restart();
    // The next call that needs Redis connects again from this runtime.
    let runs = Runs::default();
    let idempotency = rt.idempotency();
    let fresh = once_connected(
        || {
            let (idempotency, runs) = (idempotency.clone(), runs.clone());
            Box::pin(async move { idempotency.run("late:1", counted(&runs, 1)).await })
        },
        "late:1",
    )
    .await;
    assert_eq!(fresh, IdempotencyOutcome::Fresh(1));
    let other = other_instance(node.url()).await;
    let replay = other.idempotency().run("late:1", counted(&runs, 2)).await;
    assert_eq!(replay.unwrap(), IdempotencyOutcome::Replay(1));
}

/// Set in the process that runs the default runtime's test: the port its
/// Redis will listen on.
const CHILD: &str = "THROTTLEBEAM_TEST_DEFAULT_RUNTIME_PORT";

/// The default runtime is process-global and reads its environment once:
/// its test runs in a process of its own (this test binary again, running
/// [`default_runtime_in_a_process_of_its_own`] only) with
/// `THROTTLEBEAM_REDIS_URL` set.
#[test]
fn the_default_runtime_never_silently_stops_sharing() {
    if std::env::var_os(CHILD).is_some() {
        return;
    }
    // A port a server just ran on, free again.
    let Some(node) = RedisNode::start("the_default_runtime_never_silently_stops_sharing") else {
        return;
    };
    let port = node.port;
    drop(node);
    let test = "default_runtime_in_a_process_of_its_own";
    let out = Command::new(std::env::current_exe().unwrap())
        .args(["--exact", test, "--nocapture", "--test-threads", "1"])
        .env(CHILD, port.to_string())
        .env(REDIS_URL_ENV, format!("redis://127.0.0.1:{port}/1"))
        .env_remove(REDIS_CLUSTER_ENV)
        .output()
        .unwrap();
    let (stdout, stderr) = (
        String::from_utf8_lossy(&out.stdout),
        String::from_utf8_lossy(&out.stderr),
    );
    assert!(
        out.status.success(),
        "the default runtime's test failed:\n{stdout}\n{stderr}"
    );
    let skipped = stderr.contains(&format!("skipped {test}"));
    assert!(
        skipped || stdout.contains("the default runtime shares through Redis"),
        "the default runtime's test did not run:\n{stdout}\n{stderr}"
    );
}

/// Accepts connections and never answers: connecting a Redis client that
/// selects a database on connecting hangs until its connect timeout.
struct Hang {
    port: u16,
    stop: Arc<AtomicBool>,
    thread: Option<std::thread::JoinHandle<()>>,
}

impl Hang {
    fn bind(port: u16) -> Self {
        let listener = TcpListener::bind(("127.0.0.1", port)).expect("the port is free");
        let stop = Arc::new(AtomicBool::new(false));
        let held = Arc::new(Mutex::new(Vec::<TcpStream>::new()));
        let thread = {
            let stop = Arc::clone(&stop);
            std::thread::spawn(move || {
                for stream in listener.incoming() {
                    if stop.load(Ordering::SeqCst) {
                        return;
                    }
                    match stream {
                        Ok(stream) => held.lock().unwrap().push(stream),
                        Err(e) if e.kind() == ErrorKind::Interrupted => {}
                        Err(_) => return,
                    }
                }
            })
        };
        Self {
            port,
            stop,
            thread: Some(thread),
        }
    }
}

impl Drop for Hang {
    fn drop(&mut self) {
        self.stop.store(true, Ordering::SeqCst);
        // Wake the accepting thread; it then drops the listener and every
        // connection it held.
        let _ = TcpStream::connect(("127.0.0.1", self.port));
        if let Some(thread) = self.thread.take() {
            let _ = thread.join();
        }
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn default_runtime_in_a_process_of_its_own() {
    let Some(port) = std::env::var(CHILD).ok() else {
        // Run by the_default_runtime_never_silently_stops_sharing.
        return;
    };
    let port: u16 = port.parse().unwrap();
    let test = "default_runtime_in_a_process_of_its_own";
    let hang = Hang::bind(port);

    // Connecting hangs until the 1 s connect timeout (the URL names
    // database 1, so connecting waits for the reply to `SELECT`): the first
    // caller does not wait for it, on this tokio worker thread.
    let started = std::time::Instant::now();
    let rt = Runtime::global().expect("the default runtime starts");
    let took = started.elapsed();
    assert!(
        took < ms(900),
        "Runtime::global() took {took:?}: it waited for Redis"
    );
    let runs = Runs::default();
    let refused = Idempotency::run("env:1", counted(&runs, 1))
        .await
        .unwrap_err();
    assert!(not_connected(&refused, "env:1"), "{refused:?}");
    let ok = || async { Ok::<_, Oops>(()) };
    assert!(
        Throttle::call("env:t", HOUR, ok)
            .await
            .unwrap()
            .is_executed()
    );
    assert_eq!(runs.get(), 0);

    // Redis comes up on that port: the default runtime connects and shares.
    drop(hang);
    let Some(node) = RedisNode::start_on(test, port) else {
        return;
    };
    let fresh = once_connected(
        || {
            let runs = runs.clone();
            Box::pin(async move { Idempotency::run("env:2", counted(&runs, 2)).await })
        },
        "env:2",
    )
    .await;
    assert_eq!(fresh, IdempotencyOutcome::Fresh(2));
    let other = other_instance(format!("{}/1", node.url())).await;
    let replay = other.idempotency().run("env:2", counted(&runs, 3)).await;
    assert_eq!(replay.unwrap(), IdempotencyOutcome::Replay(2));
    assert_eq!(runs.get(), 1);
    assert!(!rt.is_shut_down());
    println!("the default runtime shares through Redis");
}
