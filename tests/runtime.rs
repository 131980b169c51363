//! Runtime-wide behaviour: races, panics, leaks, embedding, shutdown and the
//! default runtime.

mod support;

use std::sync::Arc;
use std::sync::atomic::{AtomicBool, AtomicUsize, Ordering};
use std::time::Duration;

use ractor::{Actor, ActorProcessingErr, ActorRef, SupervisionEvent};
use support::{Oops, Runs, ms, runtime};
use throttlebeam::rate_limit::{
    FirstKeyHook, FixedWindow, FixedWindowState, Limiter, MemoryRateLimitStore, RateLimitError,
    RateLimitReply, RateLimitRequest, RateLimitStore,
};
use throttlebeam::{
    Debounce, Error, Idempotency, IdempotencyOptions, IdempotencyOutcome, Runtime, Throttle,
    ThrottleOutcome,
};
use tokio::sync::mpsc;
use tokio::time::{Instant, sleep};

/// Many tasks hammer one key while its process keeps exiting on idle: every
/// call is covered by exactly one run, runs never overlap, nothing is stuck.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn hammering_one_key_while_its_process_exits_loses_nothing() {
    let rt = runtime().await;
    let d = rt.debounce();
    let running = Arc::new(AtomicBool::new(false));
    let runs = Arc::new(AtomicUsize::new(0));
    let overlaps = Arc::new(AtomicUsize::new(0));
    let mut tasks = Vec::new();
    for _ in 0..8 {
        let d = d.clone();
        let (running, runs, overlaps) = (running.clone(), runs.clone(), overlaps.clone());
        tasks.push(tokio::spawn(async move {
            let mut covered = 0;
            for _ in 0..250 {
                let (running, runs, overlaps) = (running.clone(), runs.clone(), overlaps.clone());
                let call = d
                    .call("hot", Duration::from_millis(1), move || async move {
                        if running.swap(true, Ordering::SeqCst) {
                            overlaps.fetch_add(1, Ordering::SeqCst);
                        }
                        let run = runs.fetch_add(1, Ordering::SeqCst) + 1;
                        tokio::task::yield_now().await;
                        running.store(false, Ordering::SeqCst);
                        Ok::<_, Oops>(run)
                    })
                    .expect("accepted");
                let run = tokio::time::timeout(Duration::from_secs(10), call)
                    .await
                    .expect("no stuck key")
                    .expect("covered by a run");
                assert!(run >= 1);
                covered += 1;
            }
            covered
        }));
    }
    let mut covered = 0;
    for t in tasks {
        covered += t.await.unwrap();
    }
    assert_eq!(covered, 2000, "every call resolved");
    assert_eq!(
        overlaps.load(Ordering::SeqCst),
        0,
        "runs of one key never overlap"
    );
    let runs = runs.load(Ordering::SeqCst);
    assert!((1..=2000).contains(&runs), "runs: {runs}");
    // Let the last process exit on idle.
    tokio::time::timeout(Duration::from_secs(5), async {
        while rt.stats().keys != 0 || rt.stats().processes != 0 {
            tokio::task::yield_now().await;
        }
    })
    .await
    .expect("the key goes idle");
}

#[tokio::test(start_paused = true)]
async fn ten_thousand_panics_leave_nothing_tracked_and_the_runtime_serving() {
    let rt = runtime().await;
    let d = rt.debounce();
    let mut calls = Vec::new();
    for i in 0..10_000 {
        calls.push(
            d.call(&format!("p{i}"), ms(10), || async {
                if true {
                    panic!("user bug");
                }
                Ok::<u8, Oops>(0)
            })
            .unwrap(),
        );
    }
    for call in calls {
        assert!(matches!(call.await, Err(Error::Panicked { .. })));
    }
    let stats = rt.stats();
    assert_eq!(
        (stats.keys, stats.processes, stats.timers),
        (0, 0, 0),
        "{stats:?}"
    );
    let ok = d
        .call("after", ms(10), || async { Ok::<_, Oops>(7) })
        .unwrap();
    assert_eq!(ok.await.unwrap(), 7);
    let t = rt.throttle();
    for i in 0..1000 {
        let r = t
            .call(&format!("t{i}"), ms(10), || async {
                if true {
                    panic!("user bug");
                }
                Ok::<u8, Oops>(0)
            })
            .await;
        assert!(matches!(r, Err(Error::Panicked { .. })));
    }
    assert_eq!(rt.stats().processes, 0);
}

#[tokio::test(start_paused = true)]
async fn a_hundred_thousand_idle_keys_leave_nothing_behind() {
    let rt = Runtime::builder()
        .with_sweep_interval(ms(1000))
        .start()
        .await
        .unwrap();
    let d = rt.debounce();
    let t = rt.throttle();
    let runs = Runs::default();
    let mut calls = Vec::with_capacity(100_000);
    for i in 0..100_000 {
        let r = runs.clone();
        calls.push(
            d.call(&format!("d{i}"), ms(100), move || async move {
                r.hit();
                Ok::<_, Oops>(())
            })
            .unwrap(),
        );
    }
    let busy = rt.stats();
    assert_eq!(busy.keys, 100_000);
    assert_eq!(busy.processes, 100_000);
    for call in calls {
        call.await.unwrap();
    }
    assert_eq!(runs.get(), 100_000);
    for i in 0..100_000 {
        let outcome = t
            .call(&format!("t{i}"), ms(100), || async { Ok::<_, Oops>(()) })
            .await
            .unwrap();
        assert!(!outcome.is_throttled());
    }
    assert_eq!(rt.stats().keys, 100_000, "open windows are tracked");
    sleep(ms(1001)).await;
    let idle = rt.stats();
    assert_eq!(
        (idle.keys, idle.processes, idle.timers, idle.ttl_entries),
        (0, 0, 0, 0),
        "{idle:?}"
    );
}

#[tokio::test(start_paused = true)]
async fn shutdown_waits_for_running_functions_without_cancelling_them() {
    let rt = runtime().await;
    let t = rt.throttle();
    let t2 = t.clone();
    let slow = tokio::spawn(async move {
        t2.call("slow", ms(10), || async {
            sleep(ms(500)).await;
            Ok::<_, Oops>("done")
        })
        .await
    });
    sleep(ms(1)).await;
    let start = Instant::now();
    let report = rt.shutdown(ms(100)).await;
    assert_eq!(
        report.still_running, 1,
        "deadline passed with the function running"
    );
    assert_eq!(start.elapsed(), ms(100));
    assert_eq!(
        slow.await.unwrap().unwrap(),
        ThrottleOutcome::Executed("done"),
        "not cancelled"
    );
    assert!(matches!(
        t.call("other", ms(10), || async { Ok::<_, Oops>("late") })
            .await,
        Err(Error::ShutDown { .. })
    ));
    assert!(rt.is_shut_down());
    assert_eq!(rt.stats().processes, 0);
}

/// A host supervisor that records the supervision events it receives.
struct Host {
    events: mpsc::UnboundedSender<String>,
}

#[cfg_attr(feature = "async-trait", ractor::async_trait)]
impl Actor for Host {
    type Msg = ();
    type State = ();
    type Arguments = ();

    async fn pre_start(&self, _: ActorRef<()>, (): ()) -> Result<(), ActorProcessingErr> {
        Ok(())
    }

    async fn handle_supervisor_evt(
        &self,
        _: ActorRef<()>,
        event: SupervisionEvent,
        (): &mut (),
    ) -> Result<(), ActorProcessingErr> {
        let line = match event {
            SupervisionEvent::ActorStarted(_) => "started".to_owned(),
            SupervisionEvent::ActorFailed(_, e) => format!("failed: {e}"),
            SupervisionEvent::ActorTerminated(_, _, reason) => {
                format!("terminated: {}", reason.unwrap_or_default())
            }
            _ => return Ok(()),
        };
        let _ = self.events.send(line);
        Ok(())
    }
}

/// A host supervisor with a runtime started under it, past its start event.
async fn embedded() -> (
    Runtime,
    ActorRef<()>,
    tokio::task::JoinHandle<()>,
    mpsc::UnboundedReceiver<String>,
) {
    let (tx, mut events) = mpsc::unbounded_channel();
    let (host, host_join) = Actor::spawn(None, Host { events: tx }, ()).await.unwrap();
    let rt = Runtime::builder()
        .start_linked(host.get_cell())
        .await
        .unwrap();
    assert_eq!(next_event(&mut events).await, "started");
    (rt, host, host_join, events)
}

async fn next_event(events: &mut mpsc::UnboundedReceiver<String>) -> String {
    tokio::time::timeout(Duration::from_secs(5), events.recv())
        .await
        .expect("an event within 5 s")
        .expect("the host is alive")
}

#[tokio::test]
async fn embedded_under_a_host_supervisor() {
    let (rt, host, host_join, mut events) = embedded().await;

    // A crash inside a key stays inside the key.
    let d = rt.debounce();
    let crash = d
        .call("k", ms(1), || async {
            if true {
                panic!("inside a key");
            }
            Ok::<u8, Oops>(0)
        })
        .unwrap();
    assert!(matches!(crash.await, Err(Error::Panicked { .. })));
    let t = rt.throttle();
    assert!(
        t.call("k", ms(1), || async { Ok::<_, Oops>(()) })
            .await
            .is_ok()
    );
    assert_eq!(
        events.try_recv().ok(),
        None,
        "the host heard nothing of the key's crash"
    );

    // The runtime's own exit reaches the host.
    rt.shutdown(ms(100)).await;
    let event = next_event(&mut events).await;
    assert!(event.starts_with("terminated"), "{event}");
    host.stop(None);
    host_join.await.unwrap();
}

#[tokio::test]
async fn runtime_failure_is_reported_to_the_host() {
    let (rt, host, _join, mut events) = embedded().await;
    rt.root_actor().kill();
    let event = next_event(&mut events).await;
    // A killed root is reported as terminated; a root that exceeds its
    // restart intensity is reported as failed (see the supervisors crate's
    // tree tests).
    assert_eq!(event, "terminated: killed");
    host.stop(None);
}

#[tokio::test]
async fn the_default_runtime_needs_no_setup() {
    let outcome = Throttle::call("global:throttle", Duration::from_secs(60), || async {
        Ok::<_, Oops>(1)
    })
    .await
    .unwrap();
    assert_eq!(outcome, ThrottleOutcome::Executed(1));
    let debounced = Debounce::call("global:debounce", Duration::from_millis(1), || async {
        Ok::<_, Oops>("ran")
    })
    .unwrap();
    assert_eq!(debounced.await.unwrap(), "ran");
    assert!(!Debounce::is_pending("global:debounce").unwrap());
    let runs = Runs::default();
    for expect_fresh in [true, false] {
        let r = runs.clone();
        let outcome = Idempotency::run_with(
            "global:idem",
            IdempotencyOptions::new(),
            move || async move { Ok::<_, Oops>(r.hit()) },
        )
        .await
        .unwrap();
        assert_eq!(outcome.is_fresh(), expect_fresh);
        assert_eq!(
            outcome,
            if expect_fresh {
                IdempotencyOutcome::Fresh(1)
            } else {
                IdempotencyOutcome::Replay(1)
            }
        );
    }
}

#[tokio::test]
async fn the_default_runtime_outlives_the_tokio_runtime_that_started_it() {
    // Started (possibly) by another test's runtime, it still serves this one.
    let outcome = Throttle::call("global:second", Duration::from_secs(60), || async {
        Ok::<_, Oops>(2)
    })
    .await
    .unwrap();
    assert_eq!(outcome, ThrottleOutcome::Executed(2));
}

/// A host supervisor that restarts the runtime it supervises, OTP-style,
/// once `gate` lets it (so the test can look at the runtime while down).
struct RestartingHost {
    events: mpsc::UnboundedSender<String>,
    gate: Arc<tokio::sync::Semaphore>,
    /// The runtime to supervise, set once started.
    runtime: Arc<std::sync::OnceLock<Runtime>>,
}

#[cfg_attr(feature = "async-trait", ractor::async_trait)]
impl Actor for RestartingHost {
    type Msg = ();
    type State = ();
    type Arguments = ();

    async fn pre_start(&self, _: ActorRef<()>, (): ()) -> Result<(), ActorProcessingErr> {
        Ok(())
    }

    async fn handle_supervisor_evt(
        &self,
        _: ActorRef<()>,
        event: SupervisionEvent,
        (): &mut (),
    ) -> Result<(), ActorProcessingErr> {
        let exited = matches!(
            event,
            SupervisionEvent::ActorFailed(..) | SupervisionEvent::ActorTerminated(..)
        );
        if let (true, Some(runtime)) = (exited, self.runtime.get())
            && runtime.is_down()
        {
            let _ = self.events.send("down".to_owned());
            self.gate.acquire().await?.forget();
            let restarted = runtime.restart().await?;
            let _ = self.events.send(format!("restarted: {restarted}"));
        }
        Ok(())
    }
}

/// Issue 7 item 3: a failed root leaves no zombie. Until the host restarts
/// the runtime every call fails fast with a typed error; after one call to
/// `restart` from the host's supervision handler, handles held elsewhere
/// work again, and what the old root's processes held is gone as after an
/// expiry (idempotency keeps its results: they never lived in the tree).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_failed_root_fails_calls_fast_until_the_host_restarts_it() {
    let (tx, mut events) = mpsc::unbounded_channel();
    let gate = Arc::new(tokio::sync::Semaphore::new(0));
    let supervised = Arc::new(std::sync::OnceLock::new());
    let (host, host_join) = Actor::spawn(
        None,
        RestartingHost {
            events: tx,
            gate: Arc::clone(&gate),
            runtime: Arc::clone(&supervised),
        },
        (),
    )
    .await
    .unwrap();
    let rt = Runtime::builder()
        .start_linked(host.get_cell())
        .await
        .unwrap();
    supervised.set(rt.clone()).unwrap();

    // Handles held elsewhere, made before the failure.
    let clone = rt.clone();
    let throttle = rt.throttle();
    let debounce = rt.debounce();
    let idempotency = rt.idempotency();
    let trailing = rt.coalesce("t:").with_window(ms(10)).build::<u8>().unwrap();
    let ok = || async { Ok::<_, Oops>(1u8) };
    assert!(
        throttle
            .call("k", ms(3_600_000), ok)
            .await
            .unwrap()
            .is_executed()
    );
    assert!(
        throttle
            .call("k", ms(3_600_000), ok)
            .await
            .unwrap()
            .is_throttled()
    );
    let fresh = idempotency.run("i", ok).await.unwrap();
    assert!(fresh.is_fresh());
    let pending = debounce.call("d", ms(3_600_000), ok).unwrap();

    rt.root_actor().kill();
    assert_eq!(next_event(&mut events).await, "down");
    assert!(clone.is_down() && clone.stats().down);
    // Down: every primitive fails fast with a typed error that names the key.
    let down = |e: &Error, key: &str| matches!(e, Error::RuntimeDown { key: k } if k == key);
    let e = throttle.call("k2", ms(10), ok).await.unwrap_err();
    assert!(down(&e, "k2"), "{e}");
    assert_eq!(
        e.to_string(),
        "runtime is down until restarted; call for key \"k2\" was not accepted"
    );
    assert!(down(&debounce.call("d2", ms(10), ok).unwrap_err(), "d2"));
    let e = idempotency.run("i2", ok).await.unwrap_err();
    assert!(down(&e, "i2"), "{e}");
    assert!(down(
        &trailing.call("x", move |_| ok()).await.unwrap_err(),
        "x"
    ));

    gate.add_permits(1);
    assert_eq!(next_event(&mut events).await, "restarted: true");
    assert!(!clone.is_down());
    let stats = clone.stats();
    assert_eq!((stats.down, stats.restarts), (false, 1));
    assert_ne!(rt.root_actor().get_status(), ractor::ActorStatus::Stopped);

    // Every handle works again; in-memory state is gone as after an expiry.
    let e = pending.await.unwrap_err();
    assert!(
        matches!(
            &e,
            Error::Discarded {
                reason: "the runtime restarted",
                ..
            }
        ),
        "{e}"
    );
    assert!(
        throttle
            .call("k", ms(3_600_000), ok)
            .await
            .unwrap()
            .is_executed()
    );
    // Idempotency lost nothing with the root: the stored result replays.
    let again = idempotency.run("i", || async { Ok::<_, Oops>(2u8) }).await;
    assert_eq!(again.unwrap(), IdempotencyOutcome::Replay(1));
    assert_eq!(debounce.call("d", ms(1), ok).unwrap().await.unwrap(), 1);
    assert!(trailing.call("x", move |_| ok()).await.unwrap());
    // Sweeping and the root work again too.
    clone.sweep_now();
    assert!(
        !clone.restart().await.unwrap(),
        "nothing to restart while up"
    );

    // A graceful shutdown is not a failure: the host does not restart it.
    rt.shutdown(ms(100)).await;
    assert!(!rt.is_down());
    host.stop(None);
    host_join.await.unwrap();
    assert!(events.try_recv().is_err(), "no restart after shutdown");
}

/// Issue 30 item 6: a restart loses no claim. A run still going on when the
/// root fails keeps its key across `restart`: a retry made after the restart
/// waits for it and replays its value instead of running a second time.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_run_in_flight_across_a_restart_is_not_run_again() {
    let rt = Runtime::builder().start().await.unwrap();
    let idempotency = rt.idempotency();
    let runs = Arc::new(AtomicUsize::new(0));
    let (release, gate) = tokio::sync::oneshot::channel::<()>();
    let (started, mut has_started) = mpsc::unbounded_channel::<()>();
    let first = {
        let (idempotency, runs) = (idempotency.clone(), Arc::clone(&runs));
        tokio::spawn(async move {
            idempotency
                .run("op", move || async move {
                    runs.fetch_add(1, Ordering::SeqCst);
                    let _ = started.send(());
                    let _ = gate.await;
                    Ok::<_, Oops>(1u32)
                })
                .await
        })
    };
    tokio::time::timeout(Duration::from_secs(10), has_started.recv())
        .await
        .expect("the first run starts")
        .unwrap();

    rt.root_actor().kill();
    tokio::time::timeout(Duration::from_secs(10), async {
        while !rt.is_down() {
            sleep(ms(1)).await;
        }
    })
    .await
    .expect("the kill lands");
    assert!(rt.restart().await.unwrap());

    // The retry finds the key still held by the live run and waits for it.
    let retry = {
        let (idempotency, runs) = (idempotency.clone(), Arc::clone(&runs));
        tokio::spawn(async move {
            idempotency
                .run("op", move || async move {
                    runs.fetch_add(1, Ordering::SeqCst);
                    Ok::<_, Oops>(2u32)
                })
                .await
        })
    };
    sleep(ms(50)).await;
    assert!(!retry.is_finished(), "the retry waits for the live run");
    assert_eq!(runs.load(Ordering::SeqCst), 1, "not run a second time");

    release.send(()).unwrap();
    assert_eq!(first.await.unwrap().unwrap(), IdempotencyOutcome::Fresh(1));
    assert_eq!(retry.await.unwrap().unwrap(), IdempotencyOutcome::Replay(1));
    let later = idempotency
        .run("op", || async { Ok::<_, Oops>(3u32) })
        .await;
    assert_eq!(later.unwrap(), IdempotencyOutcome::Replay(1));
    assert_eq!(runs.load(Ordering::SeqCst), 1);
    let stats = idempotency.stats();
    assert_eq!((stats.fresh, stats.replays), (1, 2), "{stats:?}");
    rt.shutdown(Duration::from_secs(1)).await;
}

/// Opens `n` pending debounced keys with an hour's delay.
fn pending_keys(rt: &Runtime, n: usize) {
    let d = rt.debounce();
    for i in 0..n {
        drop(
            d.call(
                &format!("pending:{i}"),
                Duration::from_secs(3600),
                || async { Ok::<_, Oops>(()) },
            )
            .unwrap(),
        );
    }
}

/// How long `shutdown(1 ms)` takes with `n` pending keys, on real time.
async fn shutdown_time(policy: throttlebeam::runtime::ShutdownPolicy, n: usize) -> Duration {
    let rt = Runtime::builder()
        .with_shutdown_policy(policy)
        .start()
        .await
        .unwrap();
    pending_keys(&rt, n);
    // Let every process start and arm its timer.
    while rt.stats().timers < n {
        tokio::time::sleep(Duration::from_millis(5)).await;
    }
    let start = std::time::Instant::now();
    rt.shutdown(Duration::from_millis(1)).await;
    let took = start.elapsed();
    eprintln!("shutdown(1 ms) with {n} pending keys, {policy:?}: {took:?}");
    took
}

/// Issue 7 item 14: shutdown keeps its deadline. With 1 ms of grace and
/// 50,000 pending keys it took 70 ms (every key was woken before the
/// shutdown waited); the work per key now runs beside the shutdown.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn shutdown_keeps_its_deadline_with_fifty_thousand_pending_keys() {
    for policy in [
        throttlebeam::runtime::ShutdownPolicy::Drop,
        throttlebeam::runtime::ShutdownPolicy::Flush,
    ] {
        let took = shutdown_time(policy, 50_000).await;
        // Debug build on a shared 2-vCPU machine: 4 to 60 ms now (the
        // higher figures with other tests running), 1.23 s before the fix.
        assert!(took < Duration::from_millis(250), "{policy:?}: {took:?}");
    }
}

/// The same with 200,000 keys (297 ms before); opt-in as it is slow to set
/// up. Run it with `cargo test --release --test runtime -- --ignored`.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
#[ignore = "slow to set up 200,000 pending keys in a debug build; run with --ignored"]
async fn shutdown_keeps_its_deadline_with_two_hundred_thousand_pending_keys() {
    let took = shutdown_time(throttlebeam::runtime::ShutdownPolicy::Drop, 200_000).await;
    assert!(took < Duration::from_millis(25), "{took:?}");
}

/// Issue 7 item 14: nothing is left behind. Pending keys dropped at
/// shutdown go, and throttle windows (expired or not) are not tracked
/// forever by a runtime nobody can call any more.
#[tokio::test(start_paused = true)]
async fn shutdown_leaves_no_window_or_key_tracked() {
    let rt = Runtime::builder()
        .with_shutdown_policy(throttlebeam::runtime::ShutdownPolicy::Drop)
        .start()
        .await
        .unwrap();
    let t = rt.throttle();
    for i in 0..100 {
        let interval = if i % 2 == 0 { ms(10) } else { ms(3_600_000) };
        assert!(
            t.call(&format!("w{i}"), interval, || async { Ok::<_, Oops>(()) })
                .await
                .unwrap()
                .is_executed()
        );
    }
    pending_keys(&rt, 100);
    // Runs happen in this task: let the sweeper's tick start now.
    tokio::task::yield_now().await;
    tokio::time::advance(ms(20)).await;
    // Half the windows are over: held (the sweeper has not run yet) but counted nowhere
    // (W9); the other half and the 100 pending keys count.
    let stats = rt.stats();
    assert_eq!((stats.throttle.windows, stats.keys), (50, 150));
    assert!(stats.sweeping, "the sweeper has not run yet");
    rt.shutdown(ms(100)).await;
    support::settle().await;
    let stats = rt.stats();
    assert_eq!(
        (stats.throttle.windows, stats.debounce.keys, stats.keys),
        (0, 0, 0)
    );
    assert_eq!(stats.processes, 0);
    assert_eq!(rt.sweep_now(), 0, "nothing is held, ended windows included");
}

/// Issue 7 item 19: stats reach a `metrics` recorder under documented names.
#[cfg(feature = "metrics")]
#[tokio::test(start_paused = true)]
async fn stats_are_exported_through_the_metrics_facade() {
    use metrics_util::debugging::{DebugValue, DebuggingRecorder};
    let rt = Runtime::builder().with_name("api").start().await.unwrap();
    let t = rt.throttle();
    for _ in 0..3 {
        let _ = t
            .call("k", ms(100), || async { Ok::<_, Oops>(()) })
            .await
            .unwrap();
    }
    rt.debounce()
        .call("d", ms(1), || async { Ok::<_, Oops>(()) })
        .unwrap()
        .await
        .unwrap();
    let idempotency = rt.idempotency();
    let idempotent = idempotency.run("i", || async { Ok::<_, Oops>(7u8) }).await;
    assert!(idempotent.unwrap().is_fresh());
    let recorder = DebuggingRecorder::new();
    let snapshotter = recorder.snapshotter();
    metrics::with_local_recorder(&recorder, || rt.export_metrics());
    let seen: std::collections::HashMap<String, (Vec<String>, DebugValue)> = snapshotter
        .snapshot()
        .into_vec()
        .into_iter()
        .map(|(key, _, _, value)| {
            let key = key.key();
            let labels = key
                .labels()
                .map(|l| format!("{}={}", l.key(), l.value()))
                .collect();
            (key.name().to_owned(), (labels, value))
        })
        .collect();
    let value = |name: &str| {
        let (labels, value) = seen.get(name).unwrap_or_else(|| panic!("{name} exported"));
        assert_eq!(labels, &vec!["runtime=api".to_owned()]);
        value
    };
    assert_eq!(
        value("throttlebeam_throttle_executed_total"),
        &DebugValue::Counter(1)
    );
    assert_eq!(
        value("throttlebeam_throttle_throttled_total"),
        &DebugValue::Counter(2)
    );
    assert_eq!(
        value("throttlebeam_debounce_runs_total"),
        &DebugValue::Counter(1)
    );
    assert_eq!(
        value("throttlebeam_throttle_windows"),
        &DebugValue::Gauge(1.0.into())
    );
    assert_eq!(value("throttlebeam_down"), &DebugValue::Gauge(0.0.into()));
    // The open window and the stored result keep the sweeper ticking; no key holds a timer.
    assert_eq!(
        value("throttlebeam_sweeping"),
        &DebugValue::Gauge(1.0.into())
    );
    assert_eq!(value("throttlebeam_timers"), &DebugValue::Gauge(0.0.into()));
    // The key "-i" (unscoped), one encoded byte and the entry's 200.
    assert_eq!(
        value("throttlebeam_idempotency_stored_bytes"),
        &DebugValue::Gauge(203.0.into())
    );
}

/// A memory store whose `sweep` panics (a broken custom store).
struct PanickySweep(MemoryRateLimitStore<FixedWindowState>);

impl RateLimitStore<FixedWindow> for PanickySweep {
    fn apply(
        &self,
        request: RateLimitRequest<'_, FixedWindow>,
    ) -> Result<RateLimitReply, RateLimitError> {
        self.0.apply(request)
    }

    fn keys(&self) -> Option<usize> {
        Some(self.0.len())
    }

    fn sweep(&self, _now_ms: u64) -> usize {
        panic!("broken store")
    }

    fn wake_on_first_key(&self, wake: FirstKeyHook) -> bool {
        RateLimitStore::<FixedWindow>::wake_on_first_key(&self.0, wake)
    }
}

#[tokio::test(start_paused = true)]
async fn a_limiter_swept_by_the_runtime_loses_its_keys_at_rest_and_the_sweeper_sleeps() {
    let rt = Runtime::builder()
        .with_sweep_interval(ms(1000))
        .start()
        .await
        .unwrap();
    let limiter = Limiter::new(FixedWindow::new(1, ms(500)).unwrap());
    limiter.sweep_on(&rt);
    sleep(ms(10)).await;
    assert!(!rt.stats().sweeping, "an empty store keeps no timer");
    assert!(limiter.check("a").unwrap().allowed);
    assert!(limiter.check("b").unwrap().allowed);
    assert!(!limiter.check("a").unwrap().allowed);
    sleep(ms(10)).await;
    assert_eq!(limiter.stats().keys, 2);
    assert!(rt.stats().sweeping, "the first key woke the sweeper");
    assert_eq!(
        rt.stats().timers,
        0,
        "the sweeper's tick is not a key's timer"
    );
    // At rest after 500 ms (kept to the next whole second), then swept.
    sleep(ms(3000)).await;
    assert_eq!(limiter.stats().keys, 0);
    assert!(!rt.stats().sweeping, "asleep again once the store is empty");
    // A key after the store emptied wakes it again.
    assert!(limiter.check("a").unwrap().allowed, "a's window is over");
    sleep(ms(10)).await;
    assert!(rt.stats().sweeping);
    sleep(ms(3000)).await;
    assert_eq!(limiter.stats().keys, 0);
    // A dropped limiter is forgotten: nothing keeps the sweeper awake.
    assert!(limiter.check("c").unwrap().allowed);
    drop(limiter);
    sleep(ms(2000)).await;
    assert!(!rt.stats().sweeping);
    // Without the runtime's sweeper the same keys would stay: the test above is the sweeper.
    let unswept = Limiter::new(FixedWindow::new(1, ms(500)).unwrap());
    unswept.check("a").unwrap();
    sleep(ms(3000)).await;
    assert_eq!(unswept.stats().keys, 1);
}

#[tokio::test(start_paused = true)]
async fn a_store_that_panics_when_swept_never_takes_the_runtime_down() {
    let rt = Runtime::builder()
        .with_sweep_interval(ms(1000))
        .start()
        .await
        .unwrap();
    let limiter = Limiter::builder(FixedWindow::new(1, ms(500)).unwrap())
        .with_store(PanickySweep(MemoryRateLimitStore::new()))
        .build();
    limiter.sweep_on(&rt);
    limiter.check("a").unwrap();
    // Ten sweeps, each panicking inside the store.
    sleep(ms(10_500)).await;
    let stats = rt.stats();
    assert!(!stats.down, "{stats:?}");
    assert_eq!(stats.restarts, 0);
    assert!(
        stats.sweeping,
        "still sweeping: the store still holds its key"
    );
    // The runtime's own maps are still swept.
    let t = rt.throttle();
    let outcome = t
        .call("k", ms(100), || async { Ok::<_, Oops>(()) })
        .await
        .unwrap();
    assert!(outcome.is_executed());
    assert_eq!(rt.stats().throttle.windows, 1);
    drop(limiter);
    sleep(ms(2000)).await;
    assert_eq!(rt.stats().throttle.windows, 0);
    assert!(!rt.stats().sweeping);
}
