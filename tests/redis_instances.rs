//! Several runtimes in one process sharing real Redis servers, as several
//! instances behind a load balancer would: the coalescing throttle (S5), the
//! leading throttle (S10) and what happens when Redis goes away (S6, S7).
#![cfg(feature = "redis")]

mod support;

use std::sync::{Arc, Mutex};
use std::time::Duration;

use support::redis::{RedisCluster, RedisNode};
use throttlebeam::store::Redis;
use throttlebeam::{
    IdempotencyOptions, IdempotencyOutcome, Runtime, coalesce::Phase,
    idempotency::IdempotencyReserved,
};
use tokio::time::Instant;

/// Each "instance": its own connection to Redis and its own runtime,
/// whose primitives share their state through it.
async fn instance(urls: &[String], cluster: bool) -> (Runtime, Redis) {
    let redis = if cluster {
        Redis::cluster(urls.to_vec())
    } else {
        Redis::builder(urls[0].clone())
    }
    .connect()
    .await
    .expect("connects");
    let runtime = Runtime::builder()
        .with_redis(redis.clone())
        .start()
        .await
        .expect("runtime starts");
    (runtime, redis)
}

type Runs = Arc<Mutex<Vec<(Phase, Instant, Instant)>>>;

async fn s5_one_leads_the_other_trails_never_overlapping(urls: Vec<String>, cluster: bool) {
    let window = Duration::from_millis(300);
    let work = Duration::from_millis(100);
    let (rt_a, redis_a) = instance(&urls, cluster).await;
    let (rt_b, redis_b) = instance(&urls, cluster).await;
    let a = rt_a
        .coalesce("sync:")
        .with_window(window)
        .with_store(redis_a.clone())
        .build::<u32>()
        .expect("throttle a");
    let b = rt_b
        .coalesce("sync:")
        .with_window(window)
        .with_store(redis_b.clone())
        .build::<u32>()
        .expect("throttle b");
    let runs: Runs = Arc::default();
    let job = |id: u32, runs: Runs| {
        move |phase: Phase| async move {
            let start = Instant::now();
            tokio::time::sleep(work).await;
            runs.lock().unwrap().push((phase, start, Instant::now()));
            Ok::<_, std::io::Error>(id)
        }
    };
    for key in ["room:1", "room:2", "room:3"] {
        runs.lock().unwrap().clear();
        let (va, vb) = tokio::join!(
            a.call_and_wait(key, job(1, runs.clone())),
            b.call_and_wait(key, job(2, runs.clone()))
        );
        let (va, vb) = (va.expect("a's call runs"), vb.expect("b's call runs"));
        assert_ne!(va, vb, "each instance's call ran once, on its own instance");
        let mut runs = runs.lock().unwrap().clone();
        runs.sort_by_key(|r| r.1);
        assert_eq!(runs.len(), 2, "{key}: exactly two runs: {runs:?}");
        let (first, second) = (runs[0], runs[1]);
        assert!(
            second.1 >= first.2 + window - Duration::from_millis(5),
            "{key}: the second run started {:?} after the first ended; the window is {window:?}",
            second.1 - first.2
        );
    }
    assert_eq!(redis_a.stats().breaker.failures, 0);
    assert_eq!(redis_b.stats().breaker.failures, 0);
    rt_a.shutdown(Duration::from_secs(1)).await;
    rt_b.shutdown(Duration::from_secs(1)).await;
}

#[tokio::test]
async fn s5_two_instances_on_one_node() {
    let Some(node) = RedisNode::start("s5_two_instances_on_one_node") else {
        return;
    };
    s5_one_leads_the_other_trails_never_overlapping(vec![node.url()], false).await;
}

#[tokio::test]
async fn s5_two_instances_on_a_cluster() {
    let Some(cluster) = RedisCluster::start("s5_two_instances_on_a_cluster") else {
        return;
    };
    s5_one_leads_the_other_trails_never_overlapping(cluster.urls(), true).await;
}

/// S10: the leading throttle opens its window in Redis; another instance is
/// throttled for the time left, then answers locally until the window ends.
async fn s10_one_run_per_window_across_instances(urls: Vec<String>, cluster: bool) {
    let (rt_a, _redis_a) = instance(&urls, cluster).await;
    let (rt_b, redis_b) = instance(&urls, cluster).await;
    let interval = Duration::from_secs(30);
    for key in ["mail:1", "mail:2", "mail:3", "mail:4"] {
        let ran = rt_a
            .throttle()
            .call(key, interval, || async { Ok::<_, std::io::Error>(1) })
            .await
            .expect("a runs");
        assert_eq!(ran.executed(), Some(1), "{key}: the first instance runs");
        let before = redis_b.stats().commands;
        let turned = rt_b
            .throttle()
            .call(key, interval, || async { Ok::<_, std::io::Error>(2) })
            .await
            .expect("b is throttled");
        let left = turned.retry_after().expect("throttled across instances");
        assert!(
            left > Duration::from_secs(29) && left <= interval,
            "{left:?}"
        );
        assert_eq!(redis_b.stats().commands, before + 1, "one round trip");
        // Known closed until the shared window ends: no round trip.
        let again = rt_b
            .throttle()
            .call(key, interval, || async { Ok::<_, std::io::Error>(3) })
            .await
            .expect("b is throttled");
        assert!(again.is_throttled());
        assert_eq!(redis_b.stats().commands, before + 1, "answered locally");
    }
    let stats = rt_b.stats().throttle;
    assert_eq!((stats.executed, stats.throttled_remotely), (0, 4));
    rt_a.shutdown(Duration::from_secs(1)).await;
    rt_b.shutdown(Duration::from_secs(1)).await;
}

#[tokio::test]
async fn s10_leading_throttle_on_one_node() {
    let Some(node) = RedisNode::start("s10_leading_throttle_on_one_node") else {
        return;
    };
    s10_one_run_per_window_across_instances(vec![node.url()], false).await;
}

#[tokio::test]
async fn s10_leading_throttle_on_a_cluster() {
    let Some(cluster) = RedisCluster::start("s10_leading_throttle_on_a_cluster") else {
        return;
    };
    s10_one_run_per_window_across_instances(cluster.urls(), true).await;
}

/// S6/S7: Redis killed mid-burst: the throttle keeps deciding per instance
/// (fail open), the breaker opens, nothing hangs, and it recovers.
#[tokio::test]
async fn s7_a_dead_redis_fails_open_and_recovers() {
    let Some(mut node) = RedisNode::start("s7_a_dead_redis_fails_open_and_recovers") else {
        return;
    };
    let redis = Redis::builder(node.url())
        .with_command_timeout(Duration::from_millis(200))
        .with_breaker(
            throttlebeam::store::BreakerConfig::default()
                .with_failures(5)
                .with_cooldown(Duration::from_millis(300)),
        )
        .connect()
        .await
        .expect("connects");
    let rt = Runtime::builder()
        .with_redis(redis.clone())
        .start()
        .await
        .expect("runtime starts");
    let throttle = rt.throttle();
    let interval = Duration::from_secs(60);
    let call = |key: String| {
        let throttle = throttle.clone();
        async move {
            let started = std::time::Instant::now();
            let outcome = throttle
                .call(&key, interval, || async { Ok::<_, std::io::Error>(()) })
                .await
                .expect("never an error: fails open");
            assert!(
                started.elapsed() < Duration::from_millis(400),
                "a call hung"
            );
            outcome
        }
    };
    assert!(call("before".to_owned()).await.is_executed());
    node.kill();
    for i in 0..20 {
        // Fresh keys run (per instance), a repeated key is throttled locally.
        assert!(call(format!("down:{i}")).await.is_executed());
        assert!(call(format!("down:{i}")).await.is_throttled());
    }
    let breaker = redis.stats().breaker;
    assert_eq!(breaker.state, throttlebeam::store::BreakerState::Open);
    assert!(breaker.opened >= 1);
    assert!(rt.stats().throttle.store_errors >= 5);
    node.restart();
    // Recovery is automatic: within a few cooldowns the shared window is back.
    let deadline = std::time::Instant::now() + Duration::from_secs(5);
    for attempt in 0.. {
        tokio::time::sleep(Duration::from_millis(100)).await;
        let key = format!("after:{attempt}");
        let before = rt.stats().throttle.store_errors;
        assert!(call(key).await.is_executed());
        if rt.stats().throttle.store_errors == before
            && redis.stats().breaker.state == throttlebeam::store::BreakerState::Closed
        {
            break;
        }
        assert!(std::time::Instant::now() < deadline, "did not recover");
    }
    rt.shutdown(Duration::from_secs(1)).await;
}

// ------------------------------------------------ S16: the pub/sub listener

/// A tokio runtime of its own, on real time (0 workers: current thread).
fn tokio_runtime(workers: usize) -> tokio::runtime::Runtime {
    if workers == 0 {
        tokio::runtime::Builder::new_current_thread()
    } else {
        let mut builder = tokio::runtime::Builder::new_multi_thread();
        builder.worker_threads(workers);
        builder
    }
    .enable_all()
    .build()
    .expect("a tokio runtime")
}

/// Waits (real time, bounded for a busy machine) until `done` holds.
async fn eventually(what: &str, within: Duration, done: impl Fn() -> bool) {
    let deadline = std::time::Instant::now() + within;
    while !done() {
        assert!(
            std::time::Instant::now() < deadline,
            "timed out after {within:?} waiting: {what}"
        );
        tokio::time::sleep(Duration::from_millis(5)).await;
    }
}

fn long_wait() -> IdempotencyOptions {
    IdempotencyOptions::new()
        .with_lease(Duration::from_secs(30))
        .with_wait_timeout(Duration::from_secs(20))
}

/// `owner` reserves `key` (retrying while its Redis comes back); then a
/// duplicate on `waiter` waits for it, on the tokio runtime this is
/// awaited on. Once the waiter's listener has subscribed `subscriptions`
/// times in all (on a cluster, once it also confirmed the key's shard
/// channel), the owner completes the key: the duplicate replays it,
/// and the waiter's backend counts the completion's pub/sub notice (on a
/// cluster a sharded one, on the key's shard channel).
async fn duplicate_wakes_by_notice(
    owner: &Runtime,
    waiter: &Runtime,
    waiter_redis: &Redis,
    key: &str,
    subscriptions: u64,
    on_cluster: bool,
) {
    let deadline = std::time::Instant::now() + Duration::from_secs(20);
    let reservation = loop {
        match owner.idempotency().reserve::<u64>(key, long_wait()).await {
            Ok(IdempotencyReserved::Fresh(reservation)) => break reservation,
            Ok(IdempotencyReserved::Replay(_)) => panic!("{key} is fresh"),
            Err(error) => {
                assert!(std::time::Instant::now() < deadline, "{key}: {error}");
                tokio::time::sleep(Duration::from_millis(50)).await;
            }
        }
    };
    let sharded = waiter_redis.stats().sharded_subscriptions;
    let duplicate = {
        let (waiter, key) = (waiter.clone(), key.to_owned());
        tokio::spawn(async move {
            waiter
                .idempotency()
                .run_with(&key, long_wait(), || async {
                    Ok::<_, std::io::Error>(0u64)
                })
                .await
        })
    };
    eventually(
        "the waiter's listener subscribes",
        Duration::from_secs(20),
        || waiter_redis.stats().subscriptions >= subscriptions,
    )
    .await;
    assert_eq!(waiter_redis.stats().subscriptions, subscriptions);
    if on_cluster {
        // The completion goes to the key's shard channel: complete only once
        // the duplicate's subscription to it is confirmed, or the notice may
        // be published before anyone listens (and the duplicate replays by
        // polling, which this test does not measure).
        eventually(
            "the waiter subscribes to the key's shard channel",
            Duration::from_secs(20),
            || waiter_redis.stats().sharded_subscriptions > sharded,
        )
        .await;
    }
    let notices = || {
        let stats = waiter_redis.stats();
        stats.notices + stats.sharded_notices
    };
    let heard = notices();
    reservation.complete(7).await.expect("the owner completes");
    let replay = tokio::time::timeout(Duration::from_secs(20), duplicate)
        .await
        .expect("the duplicate is woken")
        .unwrap()
        .expect("the duplicate replays");
    assert_eq!(replay, IdempotencyOutcome::Replay(7));
    // (On a busy machine the duplicate may have looked again by itself
    // just before the notice landed: wait for it rather than race it.)
    eventually(
        "the completion notice reaches the waiter's listener",
        Duration::from_secs(20),
        || notices() > heard,
    )
    .await;
}

/// Issue 30 item 3, S16: the pub/sub listener runs on the tokio runtime of
/// the first waiter. When that runtime ends, the next waiter restarts it on
/// its own runtime, and completions from another instance reach it again;
/// after its node is killed and restarted, it subscribes again by itself.
#[test]
fn s16_the_listener_restarts_after_its_runtime_ends_and_after_its_node_restarts() {
    let Some(mut node) = RedisNode::start(
        "s16_the_listener_restarts_after_its_runtime_ends_and_after_its_node_restarts",
    ) else {
        return;
    };
    let urls = vec![node.url()];
    let home = tokio_runtime(2);
    let (owner, _owner_redis) = home.block_on(instance(&urls, false));
    let (waiter, waiter_redis) = home.block_on(instance(&urls, false));

    // The first waiter is on runtime A: the listener starts there.
    let a = tokio_runtime(0);
    a.block_on(duplicate_wakes_by_notice(
        &owner,
        &waiter,
        &waiter_redis,
        "order:1",
        1,
        false,
    ));
    drop(a);
    // A waiter on the home runtime restarts the listener there.
    home.block_on(duplicate_wakes_by_notice(
        &owner,
        &waiter,
        &waiter_redis,
        "order:2",
        2,
        false,
    ));
    // The node dies and comes back: the listener subscribes again.
    node.restart();
    home.block_on(async {
        // The waiter's command connection finds the restart on its first
        // command: that one fails, not what this test is about.
        let deadline = std::time::Instant::now() + Duration::from_secs(20);
        while waiter_redis.ping().await.is_err() {
            assert!(std::time::Instant::now() < deadline, "redis is back");
            tokio::time::sleep(Duration::from_millis(50)).await;
        }
        eventually(
            "the listener subscribes again after the restart",
            Duration::from_secs(20),
            || waiter_redis.stats().subscriptions >= 3,
        )
        .await;
        duplicate_wakes_by_notice(&owner, &waiter, &waiter_redis, "order:3", 3, false).await;
    });
}

/// Which cluster nodes have a subscriber on the completion channel.
fn listening_nodes(cluster: &RedisCluster, alive: &[bool]) -> Vec<usize> {
    (0..cluster.nodes.len())
        .filter(|&i| {
            alive[i]
                && cluster.nodes[i]
                    .cli(&["PUBSUB", "NUMSUB", "throttlebeam:idempotency"])
                    .is_some_and(|out| out.lines().nth(1).is_some_and(|n| n.trim() != "0"))
        })
        .collect()
}

/// Issue 30 item 3: on a cluster, the listener moves to another seed node
/// when its node dies, and still hears completions once the cluster heals.
#[test]
fn s16_the_listener_moves_to_another_cluster_node_when_its_node_dies() {
    let Some(mut cluster) =
        RedisCluster::start("s16_the_listener_moves_to_another_cluster_node_when_its_node_dies")
    else {
        return;
    };
    let urls = cluster.urls();
    let home = tokio_runtime(2);
    let (owner, _owner_redis) = home.block_on(instance(&urls, true));
    let (waiter, waiter_redis) = home.block_on(instance(&urls, true));
    home.block_on(duplicate_wakes_by_notice(
        &owner,
        &waiter,
        &waiter_redis,
        "order:1",
        1,
        true,
    ));
    let mut alive = vec![true; 3];
    let first = listening_nodes(&cluster, &alive);
    assert_eq!(first.len(), 1, "one listener, on one node: {first:?}");
    let dead = first[0];
    cluster.nodes[dead].kill();
    alive[dead] = false;
    home.block_on(eventually(
        "the listener subscribes on another node",
        Duration::from_secs(20),
        || waiter_redis.stats().subscriptions >= 2,
    ));
    let moved = listening_nodes(&cluster, &alive);
    assert_eq!(moved.len(), 1, "{moved:?}");
    assert_ne!(moved[0], dead);
    // The moved listener hears what is broadcast (debounce notices, rate
    // limit resets, claims channel): a PUBLISH reaches every live node.
    let heard = waiter_redis.stats().notices;
    let sender = (0..alive.len()).find(|&i| alive[i]).expect("a live node");
    assert!(
        cluster.nodes[sender]
            .cli(&["PUBLISH", "throttlebeam:idempotency", "nobody:waits"])
            .is_some(),
        "the broadcast is sent"
    );
    home.block_on(eventually(
        "a broadcast reaches the moved listener",
        Duration::from_secs(20),
        || waiter_redis.stats().notices > heard,
    ));
    cluster.nodes[dead].restart();
    assert!(
        cluster.wait_ok(Duration::from_secs(30)),
        "the cluster heals"
    );
    home.block_on(duplicate_wakes_by_notice(
        &owner,
        &waiter,
        &waiter_redis,
        "order:2",
        2,
        true,
    ));
}

// ------------------------------------- issue 30 item 4: window and run, one unit

/// Polls `fut` once; whether it finished.
async fn poll_once<F: std::future::Future + Unpin>(fut: &mut F) -> bool {
    std::future::poll_fn(|cx| {
        std::task::Poll::Ready(std::pin::Pin::new(&mut *fut).poll(cx).is_ready())
    })
    .await
}

/// S10, S15: a leading throttle's shared window and its run are one unit.
/// A caller dropped right after its window opened in Redis (before its
/// function started) still leaves the function to run, exactly once: the
/// window is never used up cluster-wide with nothing run. Dropped after
/// one poll only (the window may be opening), the same holds: the window
/// is open exactly when the function ran.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn s10_a_caller_dropped_once_its_shared_window_opened_still_runs_its_function() {
    let Some(node) = RedisNode::start(
        "s10_a_caller_dropped_once_its_shared_window_opened_still_runs_its_function",
    ) else {
        return;
    };
    let urls = vec![node.url()];
    let (rt, _redis) = instance(&urls, false).await;
    let (other, _other_redis) = instance(&urls, false).await;
    let interval = Duration::from_secs(60);
    let throttle = rt.throttle();
    let window_open = |key: &str| {
        node.cli(&["EXISTS", &format!("{{throttlebeam:{key}}}:t")])
            .as_deref()
            == Some("1")
    };
    for (key, until_open) in [("mail:1", true), ("mail:2", false)] {
        let runs = Arc::new(std::sync::atomic::AtomicUsize::new(0));
        let counted = runs.clone();
        let mut call = Box::pin(throttle.call(key, interval, move || async move {
            counted.fetch_add(1, std::sync::atomic::Ordering::SeqCst);
            Ok::<_, std::io::Error>(())
        }));
        let mut finished = poll_once(&mut call).await;
        if until_open {
            let deadline = std::time::Instant::now() + Duration::from_secs(10);
            while !finished && !window_open(key) {
                assert!(std::time::Instant::now() < deadline, "the window opens");
                tokio::time::sleep(Duration::from_millis(1)).await;
                finished = poll_once(&mut call).await;
            }
        }
        drop(call);
        eventually(
            "the function runs once the window is open",
            Duration::from_secs(10),
            || runs.load(std::sync::atomic::Ordering::SeqCst) == 1,
        )
        .await;
        eventually("the run ends", Duration::from_secs(10), || {
            rt.stats().processes == 0
        })
        .await;
        assert!(window_open(key), "{key}: the window is open in Redis");
        let turned = other
            .throttle()
            .call(key, interval, || async { Ok::<_, std::io::Error>(()) })
            .await
            .expect("the other instance is throttled");
        assert!(turned.is_throttled(), "{key}: one run per window");
        assert_eq!(runs.load(std::sync::atomic::Ordering::SeqCst), 1, "{key}");
        assert_eq!(
            rt.stats().throttle.executed,
            if key == "mail:1" { 1 } else { 2 }
        );
    }
}

/// S15: the coalescing throttle's leading run on a shared store claims its
/// window and runs in the same process: a caller dropped right after the
/// claim landed in Redis still leaves the function to run, once.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn s15_a_leading_caller_dropped_once_its_window_is_claimed_still_runs_its_function() {
    let Some(node) = RedisNode::start(
        "s15_a_leading_caller_dropped_once_its_window_is_claimed_still_runs_its_function",
    ) else {
        return;
    };
    let urls = vec![node.url()];
    let (rt, redis) = instance(&urls, false).await;
    let t = rt
        .coalesce("sync:")
        .with_window(Duration::from_secs(60))
        .with_store(redis)
        .build::<u32>()
        .expect("throttle");
    let runs = Arc::new(std::sync::atomic::AtomicUsize::new(0));
    let counted = runs.clone();
    let mut call = Box::pin(t.call("room", move |_| async move {
        counted.fetch_add(1, std::sync::atomic::Ordering::SeqCst);
        Ok::<_, std::io::Error>(1)
    }));
    let claimed = || {
        node.cli(&["EXISTS", "{throttlebeam:sync:room}:w"])
            .as_deref()
            == Some("1")
    };
    let deadline = std::time::Instant::now() + Duration::from_secs(10);
    while !poll_once(&mut call).await && !claimed() {
        assert!(
            std::time::Instant::now() < deadline,
            "the window is claimed"
        );
        tokio::time::sleep(Duration::from_millis(1)).await;
    }
    drop(call);
    eventually("the function runs", Duration::from_secs(10), || {
        runs.load(std::sync::atomic::Ordering::SeqCst) == 1
    })
    .await;
    eventually("the run ends", Duration::from_secs(10), || {
        let s = t.stats();
        (s.active, s.pending) == (0, 0)
    })
    .await;
    assert_eq!(t.stats().leading_runs, 1);
    assert_eq!(runs.load(std::sync::atomic::Ordering::SeqCst), 1);
}
