//! Idempotency across instances: several runtimes in one test process
//! sharing real Redis servers (a node and a 3-node cluster), as instances
//! behind a load balancer would (SCENARIOS I and S8).
#![cfg(feature = "redis")]

mod support;

use std::sync::Arc;
use std::sync::atomic::{AtomicU32, Ordering};
use std::time::Duration;

use support::redis::{RedisCluster, RedisNode};
use throttlebeam::store::{BreakerConfig, Redis};
use throttlebeam::{
    Error, IdempotencyOptions, IdempotencyOutcome, Runtime, idempotency::IdempotencyReserved,
    idempotency::InFlight, idempotency::MemoryIdempotencyStore, idempotency::NotRecorded,
};
use tokio::sync::Semaphore;
use tokio::time::Instant;

/// A connection with a short breaker cooldown, and a command timeout that
/// holds on two busy cores with three servers, four runtimes and 80,000 calls
/// in flight (2 s was exceeded once there under a parallel build): these
/// tests check what runs and what is replayed, not how fast.
async fn connect(urls: &[String], cluster: bool) -> Redis {
    if cluster {
        Redis::cluster(urls.to_vec())
    } else {
        Redis::builder(urls[0].clone())
    }
    .with_breaker(BreakerConfig::default().with_cooldown(Duration::from_millis(200)))
    .with_command_timeout(Duration::from_secs(10))
    .connect()
    .await
    .expect("connects")
}

/// One "instance": its own connection and its own runtime.
async fn instance(redis: Redis) -> Runtime {
    Runtime::builder()
        .with_redis(redis)
        .start()
        .await
        .expect("runtime starts")
}

/// `keys` keys × `dups` concurrent duplicates spread over `runtimes`;
/// returns every call's result by key, and the executions of each key.
async fn flood(
    runtimes: &[Runtime],
    keys: usize,
    dups: usize,
    options: IdempotencyOptions,
    work: Duration,
) -> (
    Vec<Vec<Result<IdempotencyOutcome<u64>, Error>>>,
    Arc<Vec<AtomicU32>>,
) {
    let runs: Arc<Vec<AtomicU32>> = Arc::new((0..keys).map(|_| AtomicU32::new(0)).collect());
    let gate = Arc::new(Semaphore::new(256));
    let mut calls = tokio::task::JoinSet::new();
    for k in 0..keys {
        let permit = Arc::clone(&gate).acquire_owned().await.unwrap();
        let mut dup_calls = Vec::new();
        for d in 0..dups {
            let rt = runtimes[d % runtimes.len()].clone();
            let runs = Arc::clone(&runs);
            let options = options.clone();
            dup_calls.push(async move {
                rt.idempotency()
                    .run_with(&format!("pay:{k}"), options, move || async move {
                        runs[k].fetch_add(1, Ordering::SeqCst);
                        if !work.is_zero() {
                            tokio::time::sleep(work).await;
                        }
                        Ok::<_, std::io::Error>(k as u64 * 100 + d as u64)
                    })
                    .await
            });
        }
        calls.spawn(async move {
            let results = futures_join_all(dup_calls).await;
            drop(permit);
            (k, results)
        });
    }
    let mut by_key: Vec<Vec<_>> = (0..keys).map(|_| Vec::new()).collect();
    while let Some(joined) = calls.join_next().await {
        let (k, results) = joined.expect("no call panics");
        by_key[k] = results;
    }
    (by_key, runs)
}

/// Runs every future concurrently on one task, in order of completion.
async fn futures_join_all<F: std::future::Future>(futures: Vec<F>) -> Vec<F::Output> {
    let mut pinned: Vec<_> = futures.into_iter().map(Box::pin).collect();
    let mut outputs: Vec<Option<F::Output>> = pinned.iter().map(|_| None).collect();
    std::future::poll_fn(|cx| {
        let mut pending = false;
        for (fut, out) in pinned.iter_mut().zip(outputs.iter_mut()) {
            if out.is_none() {
                match fut.as_mut().poll(cx) {
                    std::task::Poll::Ready(v) => *out = Some(v),
                    std::task::Poll::Pending => pending = true,
                }
            }
        }
        if pending {
            std::task::Poll::Pending
        } else {
            std::task::Poll::Ready(())
        }
    })
    .await;
    outputs.into_iter().map(Option::unwrap).collect()
}

fn assert_once_each(by_key: &[Vec<Result<IdempotencyOutcome<u64>, Error>>], runs: &[AtomicU32]) {
    for (k, results) in by_key.iter().enumerate() {
        assert_eq!(runs[k].load(Ordering::SeqCst), 1, "key {k} ran once");
        let outcomes: Vec<_> = results
            .iter()
            .map(|r| r.as_ref().unwrap_or_else(|e| panic!("key {k}: {e:?}")))
            .collect();
        assert_eq!(
            outcomes.iter().filter(|o| o.is_fresh()).count(),
            1,
            "key {k}: one fresh outcome"
        );
        let value = *outcomes[0].value();
        assert!(
            outcomes.iter().all(|o| *o.value() == value),
            "key {k}: every duplicate replays the same value"
        );
    }
}

async fn ten_thousand_keys_eight_duplicates_four_runtimes(redis: Vec<Redis>) {
    let mut runtimes = Vec::new();
    for r in redis {
        runtimes.push(instance(r).await);
    }
    let started = Instant::now();
    let (by_key, runs) = flood(
        &runtimes,
        10_000,
        8,
        IdempotencyOptions::new().with_wait_timeout(Duration::from_secs(30)),
        Duration::ZERO,
    )
    .await;
    assert_once_each(&by_key, &runs);
    println!(
        "80,000 calls on 10,000 keys over 4 runtimes in {:?}",
        started.elapsed()
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn i_s8_each_of_10000_keys_runs_once_across_four_runtimes_on_a_node() {
    let Some(node) =
        RedisNode::start("i_s8_each_of_10000_keys_runs_once_across_four_runtimes_on_a_node")
    else {
        return;
    };
    let urls = vec![node.url()];
    let mut redis = Vec::new();
    for _ in 0..4 {
        redis.push(connect(&urls, false).await);
    }
    ten_thousand_keys_eight_duplicates_four_runtimes(redis).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn i_s8_each_of_10000_keys_runs_once_across_four_runtimes_on_a_cluster() {
    let Some(cluster) =
        RedisCluster::start("i_s8_each_of_10000_keys_runs_once_across_four_runtimes_on_a_cluster")
    else {
        return;
    };
    let mut redis = Vec::new();
    for _ in 0..4 {
        redis.push(connect(&cluster.urls(), true).await);
    }
    ten_thousand_keys_eight_duplicates_four_runtimes(redis).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn runtimes_sharing_a_memory_store_run_each_key_once() {
    let store = MemoryIdempotencyStore::new();
    let mut runtimes = Vec::new();
    for _ in 0..4 {
        runtimes.push(
            Runtime::builder()
                .with_idempotency_store(store.clone())
                .start()
                .await
                .unwrap(),
        );
    }
    let (by_key, runs) = flood(
        &runtimes,
        2_000,
        8,
        IdempotencyOptions::new(),
        Duration::from_millis(1),
    )
    .await;
    assert_once_each(&by_key, &runs);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn s7_redis_killed_for_two_seconds_never_runs_a_key_twice_and_every_key_completes_on_retry() {
    let Some(mut node) = RedisNode::start_durable(
        "s7_redis_killed_for_two_seconds_never_runs_a_key_twice_and_every_key_completes_on_retry",
    ) else {
        return;
    };
    let urls = vec![node.url()];
    let mut runtimes = Vec::new();
    for _ in 0..4 {
        runtimes.push(instance(connect(&urls, false).await).await);
    }
    let keys = 2_000;
    let options = IdempotencyOptions::new()
        .with_lease(Duration::from_secs(3))
        .with_wait_timeout(Duration::from_secs(5));
    let outage = async {
        tokio::time::sleep(Duration::from_millis(150)).await;
        node.kill();
        tokio::time::sleep(Duration::from_secs(2)).await;
        node.restart();
    };
    let ((by_key, runs), ()) = tokio::join!(
        flood(
            &runtimes,
            keys,
            8,
            options.clone(),
            Duration::from_millis(2)
        ),
        outage
    );
    let (mut ok, mut unavailable, mut timeouts) = (0, 0, 0);
    for (k, results) in by_key.iter().enumerate() {
        assert!(runs[k].load(Ordering::SeqCst) <= 1, "key {k} ran twice");
        for result in results {
            match result {
                Ok(_) => ok += 1,
                Err(Error::StoreUnavailable { .. }) => unavailable += 1,
                Err(Error::Timeout { .. }) => timeouts += 1,
                Err(e) => panic!("key {k}: unexpected {e:?}"),
            }
        }
    }
    println!("during the outage: {ok} results, {unavailable} unavailable, {timeouts} timeouts");
    assert!(unavailable > 0, "the outage was seen");
    // After the restart every key completes on retry, still once.
    let deadline = Instant::now() + Duration::from_secs(30);
    for k in 0..keys {
        let rt = &runtimes[k % runtimes.len()];
        loop {
            let runs = Arc::clone(&runs);
            let outcome = rt
                .idempotency()
                .run_with(&format!("pay:{k}"), options.clone(), move || async move {
                    runs[k].fetch_add(1, Ordering::SeqCst);
                    Ok::<_, std::io::Error>(k as u64 * 100 + 99)
                })
                .await;
            match outcome {
                Ok(_) => break,
                Err(Error::StoreUnavailable { .. } | Error::Timeout { .. })
                    if Instant::now() < deadline =>
                {
                    tokio::time::sleep(Duration::from_millis(50)).await;
                }
                Err(e) => panic!("key {k} after the restart: {e:?}"),
            }
        }
        assert_eq!(
            runs[k].load(Ordering::SeqCst),
            1,
            "key {k} ran exactly once"
        );
    }
}

/// S14 (issue 30 item 1): with the default breaker (5 failures open it for
/// 10 s) and a 5 s lease, a durable Redis killed for 2 s in the middle of a
/// flood from four instances (each its own tokio runtime on its own thread)
/// makes no key run twice: owners whose function ran keep renewing and
/// retrying their completion through the open breaker until stored.
#[test]
fn s14_a_durable_redis_killed_for_two_seconds_runs_no_key_twice_with_the_default_breaker() {
    const KEYS: usize = 2_000;
    const DUPS: usize = 4;
    const INSTANCES: usize = 4;
    let Some(mut node) = RedisNode::start_durable(
        "s14_a_durable_redis_killed_for_two_seconds_runs_no_key_twice_with_the_default_breaker",
    ) else {
        return;
    };
    let url = node.url();
    let runs: Arc<Vec<AtomicU32>> = Arc::new((0..KEYS).map(|_| AtomicU32::new(0)).collect());
    let unavailable = Arc::new(AtomicU32::new(0));
    let unexpected = Arc::new(std::sync::Mutex::new(Vec::<String>::new()));
    let ready = Arc::new(std::sync::Barrier::new(INSTANCES + 1));
    let give_up = std::time::Instant::now() + Duration::from_secs(120);
    let instances: Vec<_> = (0..INSTANCES)
        .map(|i| {
            let (url, runs, ready) = (url.clone(), Arc::clone(&runs), Arc::clone(&ready));
            let (unavailable, unexpected) = (Arc::clone(&unavailable), Arc::clone(&unexpected));
            std::thread::spawn(move || {
                let tokio_rt = tokio::runtime::Builder::new_current_thread()
                    .enable_all()
                    .build()
                    .unwrap();
                tokio_rt.block_on(async move {
                    // Every setting of the backend at its default.
                    let redis = Redis::builder(url).connect().await.expect("connects");
                    let rt = instance(redis.clone()).await;
                    ready.wait();
                    let options = IdempotencyOptions::new()
                        .with_lease(Duration::from_secs(5))
                        .with_wait_timeout(Duration::from_secs(10));
                    let gate = Arc::new(Semaphore::new(64));
                    let mut calls = tokio::task::JoinSet::new();
                    for k in 0..KEYS {
                        for _ in 0..DUPS {
                            let permit = Arc::clone(&gate).acquire_owned().await.unwrap();
                            let (rt, options, runs) =
                                (rt.clone(), options.clone(), Arc::clone(&runs));
                            let (unavailable, unexpected) =
                                (Arc::clone(&unavailable), Arc::clone(&unexpected));
                            calls.spawn(async move {
                                let _permit = permit;
                                loop {
                                    let runs = Arc::clone(&runs);
                                    let run = move || async move {
                                        runs[k].fetch_add(1, Ordering::SeqCst);
                                        tokio::time::sleep(Duration::from_millis(20)).await;
                                        Ok::<_, std::io::Error>(k as u64)
                                    };
                                    let outcome = rt
                                        .idempotency()
                                        .run_with(&format!("pay:{k}"), options.clone(), run)
                                        .await;
                                    match outcome {
                                        Ok(outcome) => return (k, *outcome.value()),
                                        Err(
                                            Error::StoreUnavailable { .. } | Error::Timeout { .. },
                                        ) => {
                                            unavailable.fetch_add(1, Ordering::Relaxed);
                                        }
                                        Err(e) => {
                                            unexpected.lock().unwrap().push(format!("key {k}: {e}"))
                                        }
                                    }
                                    assert!(
                                        std::time::Instant::now() < give_up,
                                        "key {k} never completed"
                                    );
                                    tokio::time::sleep(Duration::from_millis(100)).await;
                                }
                            });
                        }
                    }
                    while let Some(done) = calls.join_next().await {
                        let (k, value) = done.expect("no call panics");
                        assert_eq!(
                            value, k as u64,
                            "instance {i}, key {k}: the key's own value"
                        );
                    }
                    redis.stats().breaker
                })
            })
        })
        .collect();
    ready.wait();
    // Mid-flood: once a quarter of the keys ran.
    let ran = || runs.iter().filter(|r| r.load(Ordering::SeqCst) > 0).count();
    while ran() < KEYS / 4 {
        assert!(
            std::time::Instant::now() < give_up,
            "the flood did not start"
        );
        std::thread::sleep(Duration::from_millis(5));
    }
    node.kill();
    let killed_at = ran();
    std::thread::sleep(Duration::from_secs(2));
    node.restart();
    let breakers: Vec<_> = instances
        .into_iter()
        .map(|t| t.join().expect("an instance panicked"))
        .collect();
    let twice: Vec<_> = (0..KEYS)
        .filter(|&k| runs[k].load(Ordering::SeqCst) != 1)
        .map(|k| (k, runs[k].load(Ordering::SeqCst)))
        .collect();
    println!(
        "killed after {killed_at} keys ran; {} calls saw the outage; breakers: {breakers:?}",
        unavailable.load(Ordering::Relaxed)
    );
    assert!(
        twice.is_empty(),
        "keys not run exactly once (key, runs): {twice:?}"
    );
    assert!(
        unexpected.lock().unwrap().is_empty(),
        "{:?}",
        unexpected.lock().unwrap()
    );
    assert!(killed_at < KEYS, "killed mid-flood");
    assert!(
        unavailable.load(Ordering::Relaxed) > 0,
        "the outage was seen"
    );
    assert!(
        breakers.iter().any(|b| b.opened > 0),
        "the default breaker opened: {breakers:?}"
    );
}

/// A run of a key whose function has started and waits for `go`: its claim is held.
struct HeldRun {
    runs: Arc<AtomicU32>,
    go: tokio::sync::oneshot::Sender<()>,
    owner: tokio::task::JoinHandle<Result<IdempotencyOutcome<u64>, Error>>,
}

/// Leases long enough that nothing lapses on a busy machine: only a refusal can free the key.
fn held_options() -> IdempotencyOptions {
    IdempotencyOptions::new()
        .with_lease(Duration::from_secs(60))
        .with_wait_timeout(Duration::from_secs(60))
}

/// Runs `key` on `rt` with a function that comes to 7 once released; returns once the
/// function runs (the claim is in the store).
async fn hold_run(rt: Runtime, key: &'static str) -> HeldRun {
    let runs = Arc::new(AtomicU32::new(0));
    let (go, gate) = tokio::sync::oneshot::channel::<()>();
    let owner = tokio::spawn({
        let runs = Arc::clone(&runs);
        async move {
            rt.idempotency()
                .run_with(key, held_options(), move || async move {
                    runs.fetch_add(1, Ordering::SeqCst);
                    gate.await.expect("released");
                    Ok::<_, std::io::Error>(7u64)
                })
                .await
        }
    });
    let deadline = Instant::now() + Duration::from_secs(30);
    while runs.load(Ordering::SeqCst) == 0 {
        assert!(Instant::now() < deadline, "the function never ran");
        tokio::time::sleep(Duration::from_millis(5)).await;
    }
    HeldRun { runs, go, owner }
}

/// Another instance on `url` replays the owner's 7 for `key` without running it: the key
/// ran once.
async fn assert_replayed_once(url: String, key: &str, runs: &Arc<AtomicU32>) {
    let other = instance(Redis::builder(url).connect().await.expect("connects")).await;
    let replayed = other
        .idempotency()
        .run_with(key, held_options(), {
            let runs = Arc::clone(runs);
            move || async move {
                runs.fetch_add(1, Ordering::SeqCst);
                Ok::<_, std::io::Error>(8u64)
            }
        })
        .await
        .expect("replayed");
    assert_eq!(*replayed.value(), 7, "the owner's value");
    assert_eq!(runs.load(Ordering::SeqCst), 1, "the key ran once");
}

/// S14, a server back but still loading its data: the owner's completion
/// meets `LOADING` (the server is up and cannot serve yet). That is an
/// outage, not a refusal: the completion is tried again until it is stored,
/// and the key is not freed to run a second time. (Under load the loading
/// window after a restart grows; a refused completion there ran the keys in
/// flight twice.)
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn s14_a_completion_that_meets_a_server_still_loading_is_tried_again_not_refused() {
    let Some(mut node) = RedisNode::start_durable(
        "s14_a_completion_that_meets_a_server_still_loading_is_tried_again_not_refused",
    ) else {
        return;
    };
    // 300 keys at 10 ms each: about 3 s of LOADING after the restart.
    node.fill_for_slow_loading(300);
    let url = node.url();
    let owner_rt = instance(
        Redis::builder(url.clone())
            .connect()
            .await
            .expect("connects"),
    )
    .await;
    // The function runs: the claim is in the append-only file.
    let held = hold_run(owner_rt, "pay:loading").await;
    let node = tokio::task::spawn_blocking(move || {
        node.restart_loading(10_000);
        node
    })
    .await
    .expect("restarted");
    // The server answers LOADING: the function ends and its completion goes out now.
    held.go.send(()).expect("the function waits");
    let outcome = tokio::time::timeout(Duration::from_secs(60), held.owner)
        .await
        .expect("the owner ends")
        .expect("no panic");
    let outcome = outcome.expect("the completion was stored once the server had loaded");
    assert_eq!(*outcome.value(), 7);
    assert_eq!(
        node.cli(&["PING"]).as_deref(),
        Some("PONG"),
        "loaded by the time the result was stored"
    );
    assert_replayed_once(url, "pay:loading", &held.runs).await;
}

/// S14, a server busy with another client's slow script: the owner's
/// completion meets `BUSY`. Like `LOADING`, that is the server unable to
/// serve for now, not a refusal: the completion is tried again (each try a
/// failure the breaker counts) until the script ends, and the key runs once.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn s14_a_completion_that_meets_a_busy_server_is_tried_again_not_refused() {
    let Some(node) =
        RedisNode::start("s14_a_completion_that_meets_a_busy_server_is_tried_again_not_refused")
    else {
        return;
    };
    let url = node.url();
    let owner_redis = Redis::builder(url.clone())
        .connect()
        .await
        .expect("connects");
    let HeldRun { runs, go, owner } =
        hold_run(instance(owner_redis.clone()).await, "pay:busy").await;
    let (node, script) = tokio::task::spawn_blocking(move || {
        let script = node.start_busy_script();
        (node, script)
    })
    .await
    .expect("busy");
    go.send(()).expect("the function waits");
    // The completion meets BUSY: a failure the breaker counts (a refusal would end the run).
    let failures = owner_redis.stats().breaker.failures;
    let deadline = Instant::now() + Duration::from_secs(30);
    while owner_redis.stats().breaker.failures == failures && !owner.is_finished() {
        assert!(Instant::now() < deadline, "the completion never went out");
        tokio::time::sleep(Duration::from_millis(5)).await;
    }
    assert!(
        !owner.is_finished(),
        "the completion ended while the server was busy: {:?}",
        owner.await
    );
    let node = tokio::task::spawn_blocking(move || {
        node.end_busy_script(script);
        node
    })
    .await
    .expect("ended");
    let outcome = tokio::time::timeout(Duration::from_secs(60), owner)
        .await
        .expect("the owner ends")
        .expect("no panic")
        .expect("the completion was stored once the script ended");
    assert_eq!(*outcome.value(), 7);
    assert_replayed_once(url, "pay:busy", &runs).await;
    drop(node);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn i6_an_owner_instance_that_dies_is_taken_over_once_after_its_lease_and_its_late_completion_is_refused()
 {
    let Some(node) = RedisNode::start(
        "i6_an_owner_instance_that_dies_is_taken_over_once_after_its_lease_and_its_late_completion_is_refused",
    ) else {
        return;
    };
    let urls = vec![node.url()];
    let lease = Duration::from_millis(600);
    let options = IdempotencyOptions::new()
        .with_lease(lease)
        .with_wait_timeout(Duration::from_secs(10));
    // The owner instance lives on its own tokio runtime, which dies mid-run:
    // its renewals stop, as when a process crashes.
    let owner_redis = connect(&urls, false).await;
    let (tx, rx) = tokio::sync::oneshot::channel();
    let opts = options.clone();
    let owner_thread = std::thread::spawn(move || {
        let tokio_rt = tokio::runtime::Builder::new_multi_thread()
            .worker_threads(1)
            .enable_all()
            .build()
            .unwrap();
        tokio_rt.block_on(async move {
            let rt = instance(owner_redis).await;
            let reserved = rt
                .idempotency()
                .reserve::<u64>("charge:1", opts)
                .await
                .expect("the owner reserves");
            let IdempotencyReserved::Fresh(reservation) = reserved else {
                panic!("a fresh key is reserved")
            };
            tx.send((reservation, Instant::now())).unwrap();
            // Keep the runtime value alive with the dying tokio runtime.
            std::mem::forget(rt);
        });
        tokio_rt.shutdown_background();
    });
    let (reservation, claimed_at) = rx.await.unwrap();
    owner_thread.join().unwrap();
    let mut runtimes = Vec::new();
    for _ in 0..3 {
        runtimes.push(instance(connect(&urls, false).await).await);
    }
    let runs = Arc::new(AtomicU32::new(0));
    let mut calls = Vec::new();
    for i in 0..9 {
        let rt = runtimes[i % 3].clone();
        let (runs, options) = (Arc::clone(&runs), options.clone());
        calls.push(tokio::spawn(async move {
            let outcome = rt
                .idempotency()
                .run_with("charge:1", options, move || async move {
                    runs.fetch_add(1, Ordering::SeqCst);
                    Ok::<_, std::io::Error>(77u64)
                })
                .await
                .expect("a duplicate gets the value");
            (outcome, Instant::now())
        }));
    }
    let mut fresh = 0;
    for call in calls {
        let (outcome, at) = call.await.unwrap();
        assert_eq!(*outcome.value(), 77);
        assert!(
            at >= claimed_at + lease - Duration::from_millis(50),
            "no takeover before the lease"
        );
        fresh += usize::from(outcome.is_fresh());
    }
    assert_eq!(fresh, 1, "exactly one takeover");
    assert_eq!(runs.load(Ordering::SeqCst), 1);
    // The dead owner's late completion is refused.
    let late = reservation.complete(1).await;
    assert!(
        matches!(
            late,
            Err(Error::NotRecorded {
                reason: NotRecorded::LeaseLost,
                ..
            })
        ),
        "{late:?}"
    );
    let replay = runtimes[0]
        .idempotency()
        .run_with("charge:1", options, || async {
            Ok::<_, std::io::Error>(0u64)
        })
        .await
        .unwrap();
    assert_eq!(replay, IdempotencyOutcome::Replay(77));
}

#[tokio::test]
async fn a_reservation_on_one_instance_is_replayed_on_another_and_fail_fast_works_across() {
    let Some(node) = RedisNode::start(
        "a_reservation_on_one_instance_is_replayed_on_another_and_fail_fast_works_across",
    ) else {
        return;
    };
    let urls = vec![node.url()];
    let a = instance(connect(&urls, false).await).await;
    let b = instance(connect(&urls, false).await).await;
    let IdempotencyReserved::Fresh(reservation) = a
        .idempotency()
        .reserve::<String>("order:1", IdempotencyOptions::new())
        .await
        .unwrap()
    else {
        panic!("fresh")
    };
    // Fail fast on the other instance: in flight, with a retry hint.
    let rejected = b
        .idempotency()
        .run_with(
            "order:1",
            IdempotencyOptions::new().with_in_flight(InFlight::Reject),
            || async { Ok::<_, std::io::Error>("b".to_owned()) },
        )
        .await;
    match rejected {
        Err(Error::InFlight { retry_after, .. }) => {
            assert!(retry_after > Duration::ZERO && retry_after <= Duration::from_secs(1));
        }
        other => panic!("{other:?}"),
    }
    // A waiting duplicate on the other instance wakes on the completion.
    let waiter = tokio::spawn({
        let b = b.clone();
        async move {
            let started = Instant::now();
            let outcome = b
                .idempotency()
                .run("order:1", || async {
                    Ok::<_, std::io::Error>("b".to_owned())
                })
                .await
                .unwrap();
            (outcome, started.elapsed())
        }
    });
    tokio::time::sleep(Duration::from_millis(300)).await;
    reservation.complete("a".to_owned()).await.unwrap();
    let (outcome, waited) = waiter.await.unwrap();
    assert_eq!(outcome, IdempotencyOutcome::Replay("a".to_owned()));
    assert!(
        waited < Duration::from_secs(2),
        "woken by the notice: {waited:?}"
    );
    // A replay as another type is refused, not misread.
    let other_type = b
        .idempotency()
        .run("order:1", || async { Ok::<_, std::io::Error>(1u64) })
        .await;
    assert!(
        matches!(other_type, Err(Error::TypeMismatch { .. })),
        "{other_type:?}"
    );
}

#[tokio::test]
async fn duplicates_on_one_instance_share_one_claim_and_a_replay_is_one_round_trip() {
    let Some(node) = RedisNode::start(
        "duplicates_on_one_instance_share_one_claim_and_a_replay_is_one_round_trip",
    ) else {
        return;
    };
    let redis = connect(&[node.url()], false).await;
    let rt = instance(redis.clone()).await;
    let runs = Arc::new(AtomicU32::new(0));
    let before = redis.stats().commands;
    let calls: Vec<_> = (0..8)
        .map(|_| {
            let (rt, runs) = (rt.clone(), Arc::clone(&runs));
            tokio::spawn(async move {
                rt.idempotency()
                    .run("job:1", move || async move {
                        runs.fetch_add(1, Ordering::SeqCst);
                        tokio::time::sleep(Duration::from_millis(20)).await;
                        Ok::<_, std::io::Error>(5u32)
                    })
                    .await
                    .unwrap()
            })
        })
        .collect();
    for call in calls {
        assert_eq!(*call.await.unwrap().value(), 5);
    }
    assert_eq!(runs.load(Ordering::SeqCst), 1);
    assert_eq!(
        redis.stats().commands - before,
        2,
        "one claim and one completion"
    );
    let before = redis.stats().commands;
    let replay = rt
        .idempotency()
        .run("job:1", || async { Ok::<_, std::io::Error>(6u32) })
        .await
        .unwrap();
    assert_eq!(replay, IdempotencyOutcome::Replay(5));
    assert_eq!(
        redis.stats().commands - before,
        1,
        "a replay is one round trip"
    );
}

#[tokio::test]
async fn s7_with_redis_unreachable_idempotency_fails_closed_and_runs_nothing() {
    let Some(mut node) =
        RedisNode::start("s7_with_redis_unreachable_idempotency_fails_closed_and_runs_nothing")
    else {
        return;
    };
    let redis = Redis::builder(node.url())
        .with_command_timeout(Duration::from_millis(500))
        .with_breaker(BreakerConfig::default().with_cooldown(Duration::from_millis(200)))
        .connect()
        .await
        .expect("connects");
    let rt = instance(redis).await;
    node.kill();
    let runs = Arc::new(AtomicU32::new(0));
    for _ in 0..8 {
        let runs = Arc::clone(&runs);
        let started = Instant::now();
        let outcome = rt
            .idempotency()
            .run("pay:down", move || async move {
                runs.fetch_add(1, Ordering::SeqCst);
                Ok::<_, std::io::Error>(1u32)
            })
            .await;
        assert!(
            matches!(outcome, Err(Error::StoreUnavailable { .. })),
            "{outcome:?}"
        );
        assert!(
            started.elapsed() < Duration::from_secs(2),
            "bounded by the command timeout"
        );
    }
    assert_eq!(
        runs.load(Ordering::SeqCst),
        0,
        "nothing runs without the store"
    );
    node.restart();
    let deadline = Instant::now() + Duration::from_secs(10);
    loop {
        match rt
            .idempotency()
            .run("pay:down", || async { Ok::<_, std::io::Error>(2u32) })
            .await
        {
            Ok(outcome) => {
                assert_eq!(outcome, IdempotencyOutcome::Fresh(2));
                break;
            }
            Err(Error::StoreUnavailable { .. }) if Instant::now() < deadline => {
                tokio::time::sleep(Duration::from_millis(50)).await;
            }
            Err(e) => panic!("after the restart: {e:?}"),
        }
    }
}

/// Calls of `command` (as `INFO commandstats` names it, `script|load` say) a node counted
/// since its stats were reset.
fn calls_of(node: &RedisNode, command: &str) -> u64 {
    let stats = node
        .cli(&["INFO", "commandstats"])
        .expect("redis-cli answers");
    let prefix = format!("cmdstat_{command}:calls=");
    stats
        .lines()
        .find_map(|line| line.strip_prefix(&prefix)?.split(',').next()?.parse().ok())
        .unwrap_or(0)
}

/// A cold server (its scripts flushed: a new deployment, a restarted node) met by many calls
/// at once, on a node and on a cluster: every call runs once and in time; a call that finds
/// its script missing sends it once as `EVAL` on its key's node, and nothing sends
/// `SCRIPT LOAD` (in a cluster, a fan-out to every primary that the cluster client can leave
/// undispatched until its timeout: one fresh cluster in about 60 stalled that way).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_cold_server_met_by_many_calls_at_once_runs_each_once_without_loading_scripts() {
    let test = "a_cold_server_met_by_many_calls_at_once_runs_each_once_without_loading_scripts";
    let Some(node) = RedisNode::start(test) else {
        return;
    };
    let Some(cluster) = RedisCluster::start(test) else {
        return;
    };
    let single = (vec![node.url()], std::slice::from_ref(&node), false);
    let nodes = (cluster.urls(), &cluster.nodes[..], true);
    for (urls, servers, is_cluster) in [single, nodes] {
        let runtime = instance(connect(&urls, is_cluster).await).await;
        for round in 0..3 {
            for server in servers {
                assert!(server.cli(&["SCRIPT", "FLUSH"]).is_some());
                assert!(server.cli(&["CONFIG", "RESETSTAT"]).is_some());
            }
            let calls: Vec<_> = (0..400)
                .map(|k| {
                    let runtime = runtime.clone();
                    async move {
                        runtime
                            .idempotency()
                            .run(&format!("cold:{round}:{k}"), move || async move {
                                Ok::<_, std::io::Error>(k)
                            })
                            .await
                    }
                })
                .collect();
            let context = format!("cluster {is_cluster}, round {round}");
            for (k, outcome) in futures_join_all(calls).await.into_iter().enumerate() {
                assert_eq!(
                    outcome.unwrap_or_else(|e| panic!("{context}, call {k}: {e:?}")),
                    IdempotencyOutcome::Fresh(k)
                );
            }
            let count = |command| servers.iter().map(|n| calls_of(n, command)).sum::<u64>();
            assert_eq!(count("script|load"), 0, "{context}");
            // Each run makes two script calls (the claim and the completion); each finds its
            // script missing at most once.
            let evals = count("eval");
            assert!((1..=800).contains(&evals), "{context}: {evals} EVAL");
        }
    }
}
