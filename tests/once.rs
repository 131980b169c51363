//! Once means once (SCENARIOS I13–I15, S18), on a real `redis-server` with every setting at
//! its default: whatever ends a run that ran (a short shutdown grace, `OOM` at completion, a
//! user without channel rights, a claim taken over, a store down past the lease), its key is
//! never released for a second run, the caller is told the truth, and waiters wake at once.
#![cfg(feature = "redis")]

mod support;

use std::sync::Arc;
use std::sync::atomic::{AtomicU32, Ordering};
use std::time::Duration;

use support::Events;
use support::redis::RedisNode;
use throttlebeam::idempotency::{Fence, IdempotencyReserved, NotRecorded};
use throttlebeam::rate_limit::{FixedWindow, Limiter};
use throttlebeam::store::Redis;
use throttlebeam::{Error, IdempotencyOptions, IdempotencyOutcome, Runtime};
use tokio::sync::oneshot;
use tokio::time::Instant;

/// One instance: its own connection, default settings, and its own runtime.
async fn instance(url: &str) -> Runtime {
    let redis = Redis::builder(url).connect().await.expect("connects");
    Runtime::builder()
        .with_redis(redis)
        .start()
        .await
        .expect("runtime starts")
}

/// A function that counts its runs, says when it started, waits for `go` (if any), then
/// returns `value`.
fn charge(
    runs: &Arc<AtomicU32>,
    value: u64,
    started: Option<oneshot::Sender<()>>,
    go: Option<oneshot::Receiver<()>>,
) -> impl FnOnce() -> std::pin::Pin<
    Box<dyn std::future::Future<Output = Result<u64, std::io::Error>> + Send>,
> + Send
+ 'static {
    let runs = Arc::clone(runs);
    move || {
        Box::pin(async move {
            runs.fetch_add(1, Ordering::SeqCst);
            if let Some(started) = started {
                let _ = started.send(());
            }
            if let Some(go) = go {
                let _ = go.await;
            }
            Ok(value)
        })
    }
}

/// The record of `key` (no scope) in Redis, as `HGETALL` shows it.
fn record(node: &RedisNode, key: &str) -> String {
    node.cli(&["HGET", &format!("{{throttlebeam:-{key}}}:i"), "s"])
        .unwrap_or_default()
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn i13_a_run_that_outlives_a_short_shutdown_grace_is_stored_not_released() {
    let Some(node) = RedisNode::start("once_shutdown") else {
        return;
    };
    let (a, b) = (instance(&node.url()).await, instance(&node.url()).await);
    let runs = Arc::new(AtomicU32::new(0));
    let (started, running) = oneshot::channel();
    let (go, wait) = oneshot::channel();
    let first = tokio::spawn({
        let (a, f) = (a.clone(), charge(&runs, 7, Some(started), Some(wait)));
        async move { a.idempotency().run("deploy:1", f).await }
    });
    running.await.unwrap();
    // A rollout whose grace is shorter than the payment: the run outlives the shutdown.
    let report = a.shutdown(Duration::from_millis(200)).await;
    assert_eq!(report.still_running, 1);
    go.send(()).unwrap();
    let outcome = first.await.unwrap().expect("the run ends");
    assert_eq!(
        outcome,
        IdempotencyOutcome::Fresh(7),
        "stored in the shared store"
    );
    assert_eq!(record(&node, "deploy:1"), "c", "Redis holds the result");
    // A retry on the instance that replaced it replays; nothing runs twice.
    let retry = b
        .idempotency()
        .run("deploy:1", charge(&runs, 8, None, None))
        .await
        .unwrap();
    assert_eq!(retry, IdempotencyOutcome::Replay(7));
    assert_eq!(runs.load(Ordering::SeqCst), 1);
    // A new call on the stopped instance is refused, and nothing ran for it.
    let refused = a
        .idempotency()
        .run("deploy:2", charge(&runs, 9, None, None))
        .await;
    assert!(
        matches!(refused, Err(Error::ShutDown { .. })),
        "{refused:?}"
    );
    assert_eq!(runs.load(Ordering::SeqCst), 1);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn i13_oom_at_completion_is_an_outage_and_the_result_is_stored_once_memory_is_back() {
    let Some(node) = RedisNode::start("once_oom") else {
        return;
    };
    node.cli(&["CONFIG", "SET", "maxmemory-policy", "noeviction"])
        .unwrap();
    let (a, b) = (instance(&node.url()).await, instance(&node.url()).await);
    let runs = Arc::new(AtomicU32::new(0));
    let (started, running) = oneshot::channel();
    let (go, wait) = oneshot::channel();
    let first = tokio::spawn({
        let (a, f) = (a.clone(), charge(&runs, 11, Some(started), Some(wait)));
        async move { a.idempotency().run("oom:1", f).await }
    });
    running.await.unwrap();
    // Redis reaches maxmemory (noeviction) just as the payment completes.
    node.cli(&["CONFIG", "SET", "maxmemory", "1"]).unwrap();
    go.send(()).unwrap();
    // A new key meanwhile fails closed (its claim cannot be written): nothing runs for it.
    let refused = b
        .idempotency()
        .run("oom:2", charge(&runs, 12, None, None))
        .await;
    assert!(
        matches!(refused, Err(Error::StoreUnavailable { .. })),
        "{refused:?}"
    );
    tokio::time::sleep(Duration::from_millis(400)).await;
    assert!(!first.is_finished(), "the owner keeps trying through OOM");
    node.cli(&["CONFIG", "SET", "maxmemory", "0"]).unwrap();
    let outcome = first.await.unwrap().expect("the run ends");
    assert_eq!(outcome, IdempotencyOutcome::Fresh(11));
    let retry = b
        .idempotency()
        .run("oom:1", charge(&runs, 13, None, None))
        .await
        .unwrap();
    assert_eq!(retry, IdempotencyOutcome::Replay(11));
    assert_eq!(runs.load(Ordering::SeqCst), 1, "OOM never freed the key");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn s18_a_user_without_channel_rights_gets_true_outcomes_and_a_counted_notice_loss() {
    let Some(node) = RedisNode::start("once_acl_channels") else {
        return;
    };
    // A user made the Redis 7 way: every command and key, no channel.
    node.cli(&[
        "ACL",
        "SETUSER",
        "app",
        "on",
        ">secret",
        "+@all",
        "~*",
        "resetchannels",
    ])
    .unwrap();
    let url = format!("redis://app:secret@127.0.0.1:{}", node.port);
    let (a, b) = (instance(&url).await, instance(&url).await);
    let runs = Arc::new(AtomicU32::new(0));
    let (started, running) = oneshot::channel();
    let (go, wait) = oneshot::channel();
    let first = tokio::spawn({
        let (a, f) = (a.clone(), charge(&runs, 21, Some(started), Some(wait)));
        async move { a.idempotency().run("acl:1", f).await }
    });
    running.await.unwrap();
    // A duplicate elsewhere waits; with no notice to wake it, it polls.
    let waiting = tokio::spawn({
        let (b, f) = (b.clone(), charge(&runs, 22, None, None));
        async move { b.idempotency().run("acl:1", f).await }
    });
    tokio::time::sleep(Duration::from_millis(100)).await;
    go.send(()).unwrap();
    let outcome = first.await.unwrap().expect("the run ends");
    assert_eq!(
        outcome,
        IdempotencyOutcome::Fresh(21),
        "stored, and told so"
    );
    let completed = Instant::now();
    assert_eq!(
        waiting.await.unwrap().unwrap(),
        IdempotencyOutcome::Replay(21)
    );
    assert!(
        completed.elapsed() < Duration::from_secs(2),
        "the waiter polled: {:?}",
        completed.elapsed()
    );
    assert_eq!(runs.load(Ordering::SeqCst), 1);
    assert!(a.redis().unwrap().stats().notices_lost >= 1, "counted");

    // A rate-limit reset publishes too: it says what happened (the key was reset).
    let redis = a.redis().unwrap();
    let limiter = Limiter::builder(FixedWindow::new(1, Duration::from_secs(60)).unwrap())
        .with_store(redis)
        .build();
    assert!(limiter.check_async("acl:rl").await.unwrap().allowed);
    assert!(!limiter.check_async("acl:rl").await.unwrap().allowed);
    limiter
        .reset_async("acl:rl")
        .await
        .expect("the reset is reported as done");
    assert!(
        limiter.check_async("acl:rl").await.unwrap().allowed,
        "reset"
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn i14_i15_a_run_taken_over_is_unrecorded_with_its_value_and_its_waiters_wake_at_once() {
    let Some(node) = RedisNode::start("once_taken_over") else {
        return;
    };
    let (a, b) = (instance(&node.url()).await, instance(&node.url()).await);
    let runs = Arc::new(AtomicU32::new(0));
    let (started, running) = oneshot::channel();
    let (go, wait) = oneshot::channel();
    let owner = tokio::spawn({
        let (a, f) = (a.clone(), charge(&runs, 31, Some(started), Some(wait)));
        async move { a.idempotency().run("lost:1", f).await }
    });
    running.await.unwrap();
    // A local duplicate joins the owner's claim on its instance.
    let local = tokio::spawn({
        let (a, f) = (a.clone(), charge(&runs, 32, None, None));
        async move { a.idempotency().run("lost:1", f).await }
    });
    tokio::time::sleep(Duration::from_millis(100)).await;
    // The owner's claim lapses in Redis (as after a pause past the lease) and another instance
    // takes the key over, holding it while its own function runs.
    node.cli(&["DEL", "{throttlebeam:-lost:1}:i"]).unwrap();
    let (taken, taking) = oneshot::channel();
    let (finish, finishing) = oneshot::channel();
    let other = tokio::spawn({
        let (b, f) = (b.clone(), charge(&runs, 33, Some(taken), Some(finishing)));
        async move { b.idempotency().run("lost:1", f).await }
    });
    taking.await.unwrap();
    go.send(()).unwrap();
    let outcome = owner.await.unwrap().expect("the run ends");
    assert_eq!(
        outcome,
        IdempotencyOutcome::Unrecorded(31, NotRecorded::LeaseLost),
        "ran here, not the key's result: told so, with its value"
    );
    // The local duplicate was woken at once: it now waits for the new holder, and replays it.
    let woken = Instant::now();
    finish.send(()).unwrap();
    assert_eq!(other.await.unwrap().unwrap(), IdempotencyOutcome::Fresh(33));
    assert_eq!(
        local.await.unwrap().unwrap(),
        IdempotencyOutcome::Replay(33)
    );
    assert!(
        woken.elapsed() < Duration::from_secs(5),
        "not its 30 s wait timeout: {:?}",
        woken.elapsed()
    );
    assert_eq!(runs.load(Ordering::SeqCst), 2, "the owner and the taker");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn i14_a_store_frozen_past_the_lease_hands_the_value_back_as_unrecorded() {
    let Some(node) = RedisNode::start("once_frozen") else {
        return;
    };
    let a = instance(&node.url()).await;
    let runs = Arc::new(AtomicU32::new(0));
    let (started, running) = oneshot::channel();
    let (go, wait) = oneshot::channel();
    let claimed = Instant::now();
    let owner = tokio::spawn({
        let (a, f) = (a.clone(), charge(&runs, 41, Some(started), Some(wait)));
        async move { a.idempotency().run("frozen:1", f).await }
    });
    running.await.unwrap();
    // Redis stops answering (a VM paused, a snapshot gone wrong) for longer than the lease.
    node.freeze();
    go.send(()).unwrap();
    let outcome = owner.await.unwrap();
    node.thaw();
    assert_eq!(
        outcome.expect("the function ran: an outcome, not an error"),
        // No answer came (a try may still land when the server wakes): unconfirmed.
        IdempotencyOutcome::Unrecorded(41, NotRecorded::Unconfirmed)
    );
    let lease = IdempotencyOptions::new().lease();
    assert!(
        claimed.elapsed() >= lease,
        "tried until the claim lapsed: {:?}",
        claimed.elapsed()
    );
    assert_eq!(runs.load(Ordering::SeqCst), 1);
    assert_eq!(a.stats().keys, 0, "the local claim ended");
}

#[tokio::test(flavor = "current_thread")]
async fn the_eviction_policy_is_checked_at_connect() {
    let Some(node) = RedisNode::start("once_eviction_policy") else {
        return;
    };
    let events = Events::default();
    let _guard = events.install();
    node.cli(&["CONFIG", "SET", "maxmemory-policy", "allkeys-lru"])
        .unwrap();
    let _lru = Redis::builder(node.url()).connect().await.unwrap();
    let warned = events.at(tracing::Level::WARN);
    assert!(
        warned
            .iter()
            .any(|w| w.contains("maxmemory-policy is not noeviction")),
        "{warned:?}"
    );
    node.cli(&["CONFIG", "SET", "maxmemory-policy", "noeviction"])
        .unwrap();
    let before = events.at(tracing::Level::WARN).len();
    let _fine = Redis::builder(node.url()).connect().await.unwrap();
    assert_eq!(events.at(tracing::Level::WARN).len(), before, "no warning");
}

#[tokio::test(flavor = "current_thread")]
async fn failing_closed_logs_one_line_per_interval_with_a_count() {
    let Some(mut node) = RedisNode::start("once_log_noise") else {
        return;
    };
    let events = Events::default();
    let _guard = events.install();
    let a = instance(&node.url()).await;
    node.kill();
    let runs = Arc::new(AtomicU32::new(0));
    for i in 0..200 {
        let refused = a
            .idempotency()
            .run(&format!("noise:{i}"), charge(&runs, 1, None, None))
            .await;
        assert!(
            matches!(refused, Err(Error::StoreUnavailable { .. })),
            "{refused:?}"
        );
    }
    assert_eq!(runs.load(Ordering::SeqCst), 0);
    let lines: Vec<String> = events
        .at(tracing::Level::WARN)
        .into_iter()
        .filter(|w| w.contains("failing closed"))
        .collect();
    assert_eq!(lines.len(), 1, "{lines:?}");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn s22_a_holder_that_took_a_lapsed_key_over_holds_a_larger_fence_than_the_one_it_lost() {
    let Some(node) = RedisNode::start("once_fences") else {
        return;
    };
    let (a, b) = (instance(&node.url()).await, instance(&node.url()).await);
    let IdempotencyReserved::Fresh(lost) = a
        .idempotency()
        .reserve::<u64>("fence:1", IdempotencyOptions::new())
        .await
        .unwrap()
    else {
        panic!("a fresh key");
    };
    // Its claim lapses in Redis (a pause past the lease) and another instance takes over.
    node.cli(&["DEL", "{throttlebeam:-fence:1}:i"]).unwrap();
    let seen = Arc::new(std::sync::Mutex::new(None));
    let taken = b
        .idempotency()
        .run("fence:1", {
            let seen = Arc::clone(&seen);
            move || async move {
                *seen.lock().unwrap() = Fence::current();
                Ok::<_, std::io::Error>(5_u64)
            }
        })
        .await
        .unwrap();
    assert_eq!(taken, IdempotencyOutcome::Fresh(5));
    let taker = seen.lock().unwrap().expect("the run saw its fence");
    assert!(taker > lost.fence(), "{taker} after {}", lost.fence());
    // The lost holder's late result is refused, and it is told so.
    let late = lost.complete(1).await;
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
}
