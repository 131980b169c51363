//! The Redis-backed forms of every public future dropped at every await
//! point (SCENARIOS S15, issue 30 item 15), against a real redis-server:
//! after each drop the next call on the key (from this instance or another)
//! completes with the right outcome, nothing runs twice, the gauges return
//! to zero and the circuit breaker is closed with no failure counted.
//!
//! Real time (Redis answers on its own clock), so every wait is bounded by
//! a deadline sized for a busy 2-core machine, and functions are short.
#![cfg(feature = "redis")]

mod support;

use std::future::IntoFuture;
use std::time::Duration;

use support::cancel::{Cut, cut_lingering, eventually, for_every_cut};
use support::redis::RedisNode;
use support::{Oops, Runs, ms};
use throttlebeam::rate_limit::{Gcra, LeakyBucket, Limiter, ShaperReservation};
use throttlebeam::store::{BreakerState, Redis};
use throttlebeam::{
    IdempotencyOptions, IdempotencyOutcome, Runtime, ThrottleOutcome,
    idempotency::IdempotencyReserved,
};
use tokio::time::{Instant, sleep};

/// How long the harness waits for a future to be woken: a Redis round
/// trip on a busy machine takes far less.
const PATIENCE: Duration = Duration::from_secs(10);

/// Each operation is cut twice at every await: dropped at once, and
/// dropped after lingering a few ms unpolled, so that what it sent has
/// reached the server (and its answer may be back, unread).
const LINGERS: [Duration; 2] = [Duration::ZERO, Duration::from_millis(5)];

/// How long anything here may take to settle.
const SETTLE: Duration = Duration::from_secs(10);

/// The runtimes' sweep interval.
const SWEEP: Duration = Duration::from_millis(200);

/// Results kept this long, so the idle check sees them gone.
const TTL: Duration = Duration::from_secs(2);

/// One "instance": its own connection to the node.
async fn connect(node: &RedisNode) -> Redis {
    Redis::builder(node.url())
        .with_command_timeout(Duration::from_secs(2))
        .connect()
        .await
        .expect("connects")
}

async fn instance(redis: &Redis) -> Runtime {
    Runtime::builder()
        .with_redis(redis.clone())
        .with_sweep_interval(SWEEP)
        .start()
        .await
        .expect("runtime starts")
}

/// No store failure was ever counted, and the breaker is closed.
fn assert_breaker_closed(redis: &Redis, what: &str) {
    let breaker = redis.stats().breaker;
    assert_eq!(breaker.state, BreakerState::Closed, "{what}: {breaker:?}");
    assert_eq!(
        (breaker.failures, breaker.opened),
        (0, 0),
        "{what}: {breaker:?}"
    );
}

/// Waits until the runtime tracks nothing: no key, process or timer, no
/// debounce key, throttle window or trailing gauge.
async fn settle_idle(rt: &Runtime, what: &str) {
    let idle = || {
        let s = rt.stats();
        let t = s.coalesce;
        s.keys + s.processes + s.timers + s.debounce.keys + s.throttle.windows == 0
            && t.active + t.pending + t.keys + t.timers == 0
    };
    eventually(what, SETTLE, ms(20), idle).await;
}

/// A function of two awaits (`half` each) that counts its runs as it
/// ends and returns `value`.
fn slow<T: Send + 'static>(
    runs: &Runs,
    half: Duration,
    value: T,
) -> impl FnOnce() -> std::pin::Pin<Box<dyn Future<Output = Result<T, Oops>> + Send>> + Send + 'static
{
    let runs = runs.clone();
    move || {
        Box::pin(async move {
            sleep(half).await;
            sleep(half).await;
            runs.hit();
            Ok(value)
        })
    }
}

/// Two instances on one fresh node, or a skip.
async fn two_instances(test: &str) -> Option<(RedisNode, [(Redis, Runtime); 2])> {
    let node = RedisNode::start(test)?;
    let (a, b) = (connect(&node).await, connect(&node).await);
    let (ra, rb) = (instance(&a).await, instance(&b).await);
    Some((node, [(a, ra), (b, rb)]))
}

#[tokio::test]
async fn a_shared_debounced_call_dropped_at_every_await_still_runs_once() {
    let Some((_node, [(redis, a), (_, b)])) =
        two_instances("a_shared_debounced_call_dropped_at_every_await_still_runs_once").await
    else {
        return;
    };
    let (da, db) = (a.debounce(), b.debounce());
    for linger in LINGERS {
        for_every_cut(2, 20, |k| {
            let (da, db, a, b) = (da.clone(), db.clone(), a.clone(), b.clone());
            async move {
                let key = format!("d{}-{k}", linger.as_millis());
                let runs = Runs::default();
                let call = da
                    .across_instances()
                    .call(&key, ms(100), slow(&runs, ms(10), k))
                    .expect("scheduled");
                let cut = cut_lingering(call.into_future(), k, PATIENCE, linger).await;
                let finished = cut.finished();
                if let Cut::Finished(v, _) = cut {
                    assert_eq!(v.expect("the run's value"), k);
                }
                eventually("the run", SETTLE, ms(10), || runs.get() == 1).await;
                settle_idle(&a, &format!("debounce cut {k}")).await;
                // The next call, from the other instance, starts a burst of its own.
                let next = db
                    .across_instances()
                    .call(&key, ms(100), slow(&runs, ms(10), 100 + k))
                    .expect("scheduled");
                assert_eq!(next.await.expect("the next call completes"), 100 + k);
                settle_idle(&b, &format!("debounce cut {k}")).await;
                assert_eq!(runs.get(), 2, "cut {k}: nothing ran twice");
                finished
            }
        })
        .await;
    }
    assert_breaker_closed(&redis, "debounce");
}

#[tokio::test]
async fn a_shared_throttled_call_dropped_at_every_await_opens_its_window_with_its_run_or_not_at_all()
 {
    let Some((_node, [(redis, a), (_, b)])) = two_instances(
        "a_shared_throttled_call_dropped_at_every_await_opens_its_window_with_its_run_or_not_at_all",
    )
    .await
    else {
        return;
    };
    let (ta, tb) = (a.throttle(), b.throttle());
    // Long enough to check from the other instance within it on a busy machine.
    let window = Duration::from_secs(5);
    for linger in LINGERS {
        for_every_cut(2, 20, |k| {
            let (ta, tb, a) = (ta.clone(), tb.clone(), a.clone());
            async move {
                let key = format!("t{}-{k}", linger.as_millis());
                let runs = Runs::default();
                let cut = cut_lingering(
                    ta.call(&key, window, slow(&runs, ms(10), k)),
                    k,
                    PATIENCE,
                    linger,
                )
                .await;
                let finished = cut.finished();
                if let Cut::Finished(outcome, _) = cut {
                    assert_eq!(outcome.expect("runs"), ThrottleOutcome::Executed(k));
                }
                // Whatever was started has finished (its window opened in Redis).
                eventually("the run", SETTLE, ms(10), || a.stats().processes == 0).await;
                let ran = runs.get();
                let other = Runs::default();
                let elsewhere = tb
                    .call(&key, window, slow(&other, ms(1), 0))
                    .await
                    .expect("the next call completes");
                match elsewhere {
                    ThrottleOutcome::Throttled { .. } => {
                        assert_eq!(ran, 1, "cut {k}: a window is open only with its run");
                    }
                    ThrottleOutcome::Executed(_) => {
                        assert_eq!(ran, 0, "cut {k}: no window, no run");
                    }
                }
                assert_eq!(ran, usize::from(k > 0), "cut {k}: polled once, it runs");
                assert_eq!(runs.get() + other.get(), 1, "cut {k}: one run per window");
                finished
            }
        })
        .await;
    }
    assert_breaker_closed(&redis, "throttle");
}

/// A leading call on a throttle whose windows live in Redis, dropped at
/// every await: its run still happens once; the next call (on the other
/// instance) is covered by a later run.
async fn shared_trailing_call_dropped(test: &str, wait: bool) {
    let Some((_node, [(redis, a), (redis_b, b)])) = two_instances(test).await else {
        return;
    };
    let window = ms(300);
    let throttle = |rt: &Runtime, redis: &Redis| {
        rt.coalesce("c:")
            .with_window(window)
            .with_store(redis.clone())
            .build::<usize>()
            .expect("builds")
    };
    let (ta, tb) = (throttle(&a, &redis), throttle(&b, &redis_b));
    for linger in LINGERS {
        for_every_cut(3, 30, |k| {
            let (ta, tb, a, b) = (ta.clone(), tb.clone(), a.clone(), b.clone());
            async move {
                let key = format!("c{}-{k}", linger.as_millis());
                let runs = Runs::default();
                let f = slow(&runs, ms(10), k);
                let cut = if wait {
                    match cut_lingering(ta.call_and_wait(&key, move |_| f()), k, PATIENCE, linger)
                        .await
                    {
                        Cut::Finished(v, polls) => Cut::Finished(v.expect("runs") == k, polls),
                        Cut::Dropped => Cut::Dropped,
                    }
                } else {
                    match cut_lingering(ta.call(&key, move |_| f()), k, PATIENCE, linger).await {
                        Cut::Finished(led, polls) => Cut::Finished(led.expect("runs"), polls),
                        Cut::Dropped => Cut::Dropped,
                    }
                };
                let finished = cut.finished();
                if let Cut::Finished(right, _) = cut {
                    assert!(right, "cut {k}: the leading run's outcome");
                }
                eventually("the run", SETTLE, ms(10), || ta.stats().active == 0).await;
                let ran = runs.get();
                assert_eq!(
                    ran,
                    usize::from(k > 0),
                    "cut {k}: taken, the call runs once"
                );
                let g = slow(&runs, ms(10), 100 + k);
                let next = tb
                    .call_and_wait(&key, move |_| g())
                    .await
                    .expect("the next call completes");
                assert_eq!(next, 100 + k);
                assert_eq!(runs.get(), ran + 1, "cut {k}: one more run, no more");
                settle_idle(&a, &format!("trailing cut {k}")).await;
                settle_idle(&b, &format!("trailing cut {k}")).await;
                finished
            }
        })
        .await;
    }
    let stats = ta.stats();
    assert_eq!(
        (stats.store_errors, stats.store_timeouts),
        (0, 0),
        "{stats:?}"
    );
    assert_breaker_closed(&redis, "trailing");
}

#[tokio::test]
async fn a_leading_call_on_shared_windows_dropped_at_every_await_still_runs_once() {
    shared_trailing_call_dropped(
        "a_leading_call_on_shared_windows_dropped_at_every_await_still_runs_once",
        false,
    )
    .await;
}

#[tokio::test]
async fn a_leading_call_and_wait_on_shared_windows_dropped_at_every_await_still_runs_once() {
    shared_trailing_call_dropped(
        "a_leading_call_and_wait_on_shared_windows_dropped_at_every_await_still_runs_once",
        true,
    )
    .await;
}

/// Idempotency options here: results kept [`TTL`], a lease renewed while
/// the function runs, and a wait shorter than the lease (so only a
/// released claim, not a lapsed one, lets the next caller in in time).
fn options() -> IdempotencyOptions {
    IdempotencyOptions::new()
        .with_ttl(TTL)
        .with_lease(Duration::from_secs(30))
        .with_wait_timeout(Duration::from_secs(5))
}

#[tokio::test]
async fn a_shared_idempotent_run_dropped_at_every_await_runs_once_and_replays_everywhere() {
    let Some((_node, [(redis, a), (_, b)])) = two_instances(
        "a_shared_idempotent_run_dropped_at_every_await_runs_once_and_replays_everywhere",
    )
    .await
    else {
        return;
    };
    let (ia, ib) = (a.idempotency(), b.idempotency());
    for linger in LINGERS {
        for_every_cut(3, 30, |k| {
            let (ia, ib, a, b) = (ia.clone(), ib.clone(), a.clone(), b.clone());
            async move {
                let key = format!("i{}-{k}", linger.as_millis());
                let runs = Runs::default();
                let run = ia.run_with(&key, options(), slow(&runs, ms(20), k));
                let cut = cut_lingering(run, k, PATIENCE, linger).await;
                let finished = cut.finished();
                if let Cut::Finished(outcome, _) = cut {
                    assert_eq!(outcome.expect("runs"), IdempotencyOutcome::Fresh(k));
                }
                // The other instance: a replay, or (nothing ran) a run of its own.
                let next = ib
                    .run_with(&key, options(), slow(&runs, ms(20), 100 + k))
                    .await
                    .expect("the next call completes");
                match next {
                    IdempotencyOutcome::Replay(v) => assert_eq!(v, k, "cut {k}"),
                    IdempotencyOutcome::Fresh(v) => assert_eq!(v, 100 + k, "cut {k}"),
                    other => panic!("cut {k}: {other:?}"),
                }
                // And this instance replays the same.
                let again = ia
                    .run_with(&key, options(), slow(&runs, ms(20), 200 + k))
                    .await
                    .expect("replays");
                assert_eq!(again, IdempotencyOutcome::Replay(next.into_inner()));
                assert_eq!(runs.get(), 1, "cut {k}: the function ran once in all");
                settle_idle(&a, &format!("idempotency cut {k}")).await;
                settle_idle(&b, &format!("idempotency cut {k}")).await;
                finished
            }
        })
        .await;
    }
    assert_breaker_closed(&redis, "idempotency run");
}

/// The same cuts with durable claims (issue 33 item 3): every claim and completion goes out
/// pipelined with `WAIT` for the replica, on a connection of its own. A run dropped at any
/// await, the `WAIT` in flight included, still runs once in all: a claim the caller left is
/// released (or its run finishes and completes), never left to lapse, and the other
/// instance replays or runs in time.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_durable_idempotent_run_dropped_at_every_await_runs_once_and_replays_everywhere() {
    let test = "a_durable_idempotent_run_dropped_at_every_await_runs_once_and_replays_everywhere";
    let Some(primary) = RedisNode::start(test) else {
        return;
    };
    let Some(replica) = RedisNode::start_replica_of(test, &primary) else {
        return;
    };
    assert!(
        primary.wait_replicas_online(1, SETTLE),
        "{test}: the replica never came online"
    );
    let durable = || async {
        Redis::builder(primary.url())
            .with_command_timeout(Duration::from_secs(2))
            .with_durable_claims(1, Duration::from_secs(2))
            .connect()
            .await
            .expect("connects")
    };
    let (redis, other) = (durable().await, durable().await);
    let (a, b) = (instance(&redis).await, instance(&other).await);
    let (ia, ib) = (a.idempotency(), b.idempotency());
    let replica = &replica;
    for linger in LINGERS {
        for_every_cut(3, 40, |k| {
            let (ia, ib, a, b) = (ia.clone(), ib.clone(), a.clone(), b.clone());
            async move {
                let key = format!("d{}-{k}", linger.as_millis());
                let runs = Runs::default();
                let run = ia.run_with(&key, options(), slow(&runs, ms(20), k));
                let cut = cut_lingering(run, k, PATIENCE, linger).await;
                let finished = cut.finished();
                // Acknowledged means on the replica already: the durable path ran.
                let record = format!("{{throttlebeam:-{key}}}:i");
                let on_replica = || replica.cli(&["HGET", &record, "s"]);
                if let Cut::Finished(outcome, _) = cut {
                    assert_eq!(outcome.expect("runs"), IdempotencyOutcome::Fresh(k));
                    assert_eq!(on_replica().as_deref(), Some("c"), "cut {k}");
                }
                let next = ib
                    .run_with(&key, options(), slow(&runs, ms(20), 100 + k))
                    .await
                    .expect("the next call completes");
                match next {
                    IdempotencyOutcome::Replay(v) => assert_eq!(v, k, "cut {k}"),
                    IdempotencyOutcome::Fresh(v) => {
                        assert_eq!(v, 100 + k, "cut {k}");
                        assert_eq!(on_replica().as_deref(), Some("c"), "cut {k}");
                    }
                    other => panic!("cut {k}: {other:?}"),
                }
                let again = ia
                    .run_with(&key, options(), slow(&runs, ms(20), 200 + k))
                    .await
                    .expect("replays");
                assert_eq!(again, IdempotencyOutcome::Replay(next.into_inner()));
                assert_eq!(runs.get(), 1, "cut {k}: the function ran once in all");
                settle_idle(&a, &format!("durable cut {k}")).await;
                settle_idle(&b, &format!("durable cut {k}")).await;
                finished
            }
        })
        .await;
    }
    assert_breaker_closed(&redis, "durable idempotency run");
    assert_breaker_closed(&other, "durable idempotency run");
}

#[tokio::test]
async fn a_duplicate_on_another_instance_dropped_at_every_await_leaves_the_owner_to_finish() {
    let Some((_node, [(redis, a), (_, b)])) = two_instances(
        "a_duplicate_on_another_instance_dropped_at_every_await_leaves_the_owner_to_finish",
    )
    .await
    else {
        return;
    };
    let (ia, ib) = (a.idempotency(), b.idempotency());
    for linger in LINGERS {
        for_every_cut(2, 30, |k| {
            let (ia, ib, a, b) = (ia.clone(), ib.clone(), a.clone(), b.clone());
            async move {
                let key = format!("x{}-{k}", linger.as_millis());
                let runs = Runs::default();
                let (owner_started, started) = tokio::sync::oneshot::channel();
                let owner = {
                    let (ia, key, runs) = (ia.clone(), key.clone(), runs.clone());
                    tokio::spawn(async move {
                        ia.run_with(&key, options(), move || async move {
                            let _ = owner_started.send(());
                            sleep(ms(100)).await;
                            runs.hit();
                            Ok::<_, Oops>(k)
                        })
                        .await
                    })
                };
                started.await.expect("the owner runs");
                let dup = ib.run_with(&key, options(), slow(&runs, ms(10), 100 + k));
                let cut = cut_lingering(dup, k, PATIENCE, linger).await;
                let finished = cut.finished();
                if let Cut::Finished(outcome, _) = cut {
                    assert_eq!(outcome.expect("replays"), IdempotencyOutcome::Replay(k));
                }
                let next = ib
                    .run_with(&key, options(), slow(&runs, ms(10), 200 + k))
                    .await
                    .expect("the next call completes");
                assert_eq!(next, IdempotencyOutcome::Replay(k), "cut {k}");
                let owned = owner.await.expect("no panic").expect("runs");
                assert_eq!(owned, IdempotencyOutcome::Fresh(k));
                assert_eq!(runs.get(), 1, "cut {k}: the function ran once in all");
                settle_idle(&a, &format!("owner cut {k}")).await;
                settle_idle(&b, &format!("duplicate cut {k}")).await;
                finished
            }
        })
        .await;
    }
    assert_breaker_closed(&redis, "idempotency duplicate");
}

#[tokio::test]
async fn a_shared_reserve_and_its_completion_dropped_at_every_await_never_wedge_the_key() {
    let Some((_node, [(redis, a), (_, b)])) = two_instances(
        "a_shared_reserve_and_its_completion_dropped_at_every_await_never_wedge_the_key",
    )
    .await
    else {
        return;
    };
    let (ia, ib) = (a.idempotency(), b.idempotency());
    // `reserve` on B while A holds the key, released after 100 ms.
    for linger in LINGERS {
        for_every_cut(2, 30, |k| {
            let (ia, ib, a, b) = (ia.clone(), ib.clone(), a.clone(), b.clone());
            async move {
                let key = format!("r{}-{k}", linger.as_millis());
                let IdempotencyReserved::Fresh(held) = ia
                    .reserve::<usize>(&key, options())
                    .await
                    .expect("reserves")
                else {
                    panic!("a fresh key replayed");
                };
                let releasing = tokio::spawn(async move {
                    sleep(ms(100)).await;
                    held.release().await;
                });
                let cut =
                    cut_lingering(ib.reserve::<usize>(&key, options()), k, PATIENCE, linger).await;
                let finished = cut.finished();
                if let Cut::Finished(reserved, _) = cut {
                    match reserved.expect("reserves") {
                        IdempotencyReserved::Fresh(mine) => mine.release().await,
                        IdempotencyReserved::Replay(v) => panic!("nothing was completed: {v}"),
                    }
                }
                releasing.await.expect("no panic");
                let IdempotencyReserved::Fresh(next) = ib
                    .reserve::<usize>(&key, options())
                    .await
                    .expect("the next call completes")
                else {
                    panic!("cut {k}: nothing was completed");
                };
                next.complete(k).await.expect("completes");
                let replay = ia.reserve::<usize>(&key, options()).await;
                assert!(matches!(replay, Ok(IdempotencyReserved::Replay(v)) if v == k));
                settle_idle(&a, &format!("reserve cut {k}")).await;
                settle_idle(&b, &format!("reserve cut {k}")).await;
                finished
            }
        })
        .await;
    }
    // `complete` on A dropped at every await: B finds the key completed or free.
    for linger in LINGERS {
        for_every_cut(2, 30, |k| {
            let (ia, ib, a, b) = (ia.clone(), ib.clone(), a.clone(), b.clone());
            async move {
                let key = format!("cp{}-{k}", linger.as_millis());
                let IdempotencyReserved::Fresh(held) = ia
                    .reserve::<usize>(&key, options())
                    .await
                    .expect("reserves")
                else {
                    panic!("a fresh key replayed");
                };
                let cut = cut_lingering(held.complete(k), k, PATIENCE, linger).await;
                let finished = cut.finished();
                if let Cut::Finished(done, _) = cut {
                    done.expect("completes");
                }
                match ib.reserve::<usize>(&key, options()).await {
                    Ok(IdempotencyReserved::Replay(v)) => assert_eq!(v, k),
                    Ok(IdempotencyReserved::Fresh(next)) => {
                        assert!(!finished, "cut {k}: a completed key was free again");
                        next.complete(k).await.expect("completes");
                    }
                    Err(e) => panic!("cut {k}: the next call failed: {e}"),
                }
                let replay = ia
                    .run(&key, || async { Ok::<usize, Oops>(999) })
                    .await
                    .expect("replays");
                assert_eq!(replay, IdempotencyOutcome::Replay(k));
                settle_idle(&a, &format!("complete cut {k}")).await;
                settle_idle(&b, &format!("complete cut {k}")).await;
                finished
            }
        })
        .await;
    }
    assert_breaker_closed(&redis, "reserve");
}

#[tokio::test]
async fn a_check_on_redis_dropped_at_every_await_is_charged_once_at_most() {
    let Some(node) =
        RedisNode::start("a_check_on_redis_dropped_at_every_await_is_charged_once_at_most")
    else {
        return;
    };
    let redis = connect(&node).await;
    let limiter = Limiter::builder(Gcra::new(5, Duration::from_secs(60)).expect("valid"))
        .with_store(redis.clone())
        .build();
    for linger in LINGERS {
        for_every_cut(2, 20, |k| {
            let limiter = limiter.clone();
            async move {
                let key = format!("l{}-{k}", linger.as_millis());
                let cut = cut_lingering(limiter.check_async(&key), k, PATIENCE, linger).await;
                let finished = cut.finished();
                // Anything sent has been answered once this is.
                let left = limiter.peek_async(&key).await.expect("peeks").remaining;
                let charged = 5 - left;
                assert!(charged <= 1, "cut {k}: charged {charged} times");
                if finished {
                    assert_eq!(charged, 1, "cut {k}");
                }
                let next = limiter.check_async(&key).await.expect("decides");
                assert_eq!(next.remaining, left - 1, "cut {k}");
                finished
            }
        })
        .await;
    }
    assert_eq!(limiter.stats().errors, 0);
    assert_breaker_closed(&redis, "check");

    // A shaper on Redis: one slot every 2 s, so the next reservation tells
    // how many slots are held whatever the machine's pace.
    let shaper = Limiter::builder(
        LeakyBucket::new(1, Duration::from_secs(2), Duration::from_secs(60)).expect("valid"),
    )
    .with_store(redis.clone())
    .build();
    for linger in LINGERS {
        for_every_cut(2, 20, |k| {
            let shaper = shaper.clone();
            async move {
                let key = format!("s{}-{k}", linger.as_millis());
                let start = Instant::now();
                assert_eq!(
                    shaper.reserve_async(&key, 1).await.expect("reserves"),
                    Duration::ZERO
                );
                let cut = cut_lingering(shaper.reserve_async(&key, 1), k, PATIENCE, linger).await;
                let finished = cut.finished();
                let queued = match shaper.try_reserve_async(&key, 1).await.expect("reserves") {
                    ShaperReservation::Granted { delay_ms } => delay_ms,
                    other => panic!("cut {k}: {other:?}"),
                };
                let since = u64::try_from(start.elapsed().as_millis()).expect("small");
                // The next slot is 2 s after the last one held: the first one's,
                // or the dropped reservation's if it reached the server.
                let held = (queued + since + 1000) / 2000;
                assert!(
                    held == 1 || held == 2,
                    "cut {k}: {queued} ms after {since} ms"
                );
                if finished {
                    assert_eq!(held, 2, "cut {k}");
                }
                finished
            }
        })
        .await;
    }
    assert_eq!(shaper.stats().errors, 0);
    assert_breaker_closed(&redis, "shaper");
}

/// Opens the breaker of `redis` (threshold 1): a command to the frozen node
/// times out. Then lets the cooldown pass, so the next command is a probe.
async fn open_breaker(node: &RedisNode, redis: &Redis, cooldown: Duration) {
    node.freeze();
    let timed_out = redis.ping().await;
    node.thaw();
    assert!(timed_out.is_err(), "a frozen node answers no command");
    assert_eq!(redis.stats().breaker.state, BreakerState::Open);
    sleep(cooldown + ms(20)).await;
}

/// The breaker's probe dropped at every await of each kind of call: the
/// breaker is never left half open (S15). The next call, whatever became
/// of the dropped one, goes through the store (it is the new probe, or the
/// breaker already closed) and the breaker ends closed.
#[tokio::test]
async fn a_probe_dropped_at_every_await_never_leaves_the_breaker_half_open() {
    let Some(node) =
        RedisNode::start("a_probe_dropped_at_every_await_never_leaves_the_breaker_half_open")
    else {
        return;
    };
    let cooldown = ms(100);
    let redis = Redis::builder(node.url())
        .with_command_timeout(ms(300))
        .with_breaker(
            throttlebeam::store::BreakerConfig::default()
                .with_failures(1)
                .with_cooldown(cooldown),
        )
        .connect()
        .await
        .expect("connects");
    let rt = instance(&redis).await;
    let idem = rt.idempotency();
    let limiter = Limiter::builder(Gcra::new(5, Duration::from_secs(60)).expect("valid"))
        .with_store(redis.clone())
        .build();
    let closed = |what: &str| {
        let breaker = redis.stats().breaker;
        assert_eq!(
            (breaker.state, breaker.consecutive_failures),
            (BreakerState::Closed, 0),
            "{what}: {breaker:?}"
        );
    };
    for_every_cut(2, 20, |k| {
        let (limiter, node, redis) = (limiter.clone(), &node, &redis);
        async move {
            open_breaker(node, redis, cooldown).await;
            let key = format!("l{k}");
            let cut = cut_lingering(limiter.check_async(&key), k, PATIENCE, Duration::ZERO).await;
            let next = limiter.check_async(&key).await;
            assert!(next.is_ok(), "check cut {k}: {next:?}");
            closed(&format!("check cut {k}"));
            cut.finished()
        }
    })
    .await;
    for_every_cut(2, 20, |k| {
        let (idem, node, redis) = (idem.clone(), &node, &redis);
        async move {
            open_breaker(node, redis, cooldown).await;
            let key = format!("i{k}");
            let runs = Runs::default();
            let run = idem.run_with(&key, options(), slow(&runs, ms(10), k));
            let cut = cut_lingering(run, k, PATIENCE, Duration::ZERO).await;
            let next = idem
                .run_with(&key, options(), slow(&runs, ms(10), 100 + k))
                .await;
            assert!(next.is_ok(), "run cut {k}: {next:?}");
            assert_eq!(runs.get(), 1, "run cut {k}");
            closed(&format!("run cut {k}"));
            cut.finished()
        }
    })
    .await;
    settle_idle(&rt, "probes").await;
}

#[cfg(all(feature = "tower", feature = "http"))]
mod layers {
    use axum::Router;
    use axum::routing::post;
    use http::{HeaderName, Request, StatusCode};
    use throttlebeam::http::{IdempotencyLayer, RateLimitKey, RateLimitLayer};
    use throttlebeam::rate_limit::Enforcer;
    use tower::ServiceExt as _;

    use super::*;

    fn request(key: &str) -> Request<axum::body::Body> {
        Request::post("/pay")
            .header("idempotency-key", key)
            .header("x-client", key)
            .body(axum::body::Body::from("10 EUR"))
            .expect("valid request")
    }

    /// A handler of two awaits (10 ms each) that counts its runs.
    fn shop(runs: &Runs) -> Router {
        let runs = runs.clone();
        Router::new().route(
            "/pay",
            post(move |body: String| {
                let runs = runs.clone();
                async move {
                    sleep(ms(10)).await;
                    sleep(ms(10)).await;
                    let n = runs.hit();
                    (StatusCode::CREATED, format!("charge {n}: {body}"))
                }
            }),
        )
    }

    #[tokio::test]
    async fn an_idempotent_request_on_redis_dropped_at_every_await_runs_its_handler_once() {
        let Some((_node, [(redis, a), (_, b)])) = two_instances(
            "an_idempotent_request_on_redis_dropped_at_every_await_runs_its_handler_once",
        )
        .await
        else {
            return;
        };
        for linger in LINGERS {
            for_every_cut(3, 30, |k| {
                let (a, b) = (a.clone(), b.clone());
                async move {
                    let key = format!("h{}-{k}", linger.as_millis());
                    let runs = Runs::default();
                    let layer = |rt: &Runtime| {
                        IdempotencyLayer::builder(rt)
                            .with_options(options())
                            .build()
                            .expect("valid settings")
                    };
                    let (app_a, app_b) =
                        (shop(&runs).layer(layer(&a)), shop(&runs).layer(layer(&b)));
                    let cut =
                        cut_lingering(app_a.oneshot(request(&key)), k, PATIENCE, linger).await;
                    let finished = cut.finished();
                    if let Cut::Finished(response, _) = cut {
                        assert_eq!(response.expect("infallible").status(), StatusCode::CREATED);
                    }
                    // The client's retry lands on the other instance.
                    let retry = app_b.oneshot(request(&key)).await.expect("infallible");
                    assert_eq!(retry.status(), StatusCode::CREATED, "cut {k}");
                    let replayed = retry.headers().get("idempotent-replayed").is_some();
                    let body = axum::body::to_bytes(retry.into_body(), 1 << 20)
                        .await
                        .expect("body read");
                    assert_eq!(&body[..], b"charge 1: 10 EUR", "cut {k}");
                    assert_eq!(runs.get(), 1, "cut {k}: the handler ran once in all");
                    assert!(replayed || !finished, "cut {k}");
                    settle_idle(&a, &format!("http idempotency cut {k}")).await;
                    settle_idle(&b, &format!("http idempotency cut {k}")).await;
                    finished
                }
            })
            .await;
        }
        assert_breaker_closed(&redis, "http idempotency");
    }

    #[tokio::test]
    async fn a_rate_limited_request_on_redis_dropped_at_every_await_is_charged_once_at_most() {
        let Some(node) = RedisNode::start(
            "a_rate_limited_request_on_redis_dropped_at_every_await_is_charged_once_at_most",
        ) else {
            return;
        };
        let redis = connect(&node).await;
        let limiter = Limiter::builder(Gcra::new(5, Duration::from_secs(60)).expect("valid"))
            .with_store(redis.clone())
            .build();
        let layer = RateLimitLayer::new(Enforcer::new(limiter.clone()))
            .with_key(RateLimitKey::header(HeaderName::from_static("x-client")));
        for linger in LINGERS {
            for_every_cut(2, 20, |k| {
                let (layer, limiter) = (layer.clone(), limiter.clone());
                async move {
                    let key = format!("q{}-{k}", linger.as_millis());
                    let runs = Runs::default();
                    let app = shop(&runs).layer(layer);
                    let cut =
                        cut_lingering(app.clone().oneshot(request(&key)), k, PATIENCE, linger)
                            .await;
                    let finished = cut.finished();
                    let charged = 5 - limiter.peek_async(&key).await.expect("peeks").remaining;
                    assert!(charged <= 1, "cut {k}: charged {charged} times");
                    assert!(runs.get() <= 1, "cut {k}");
                    let next = app.oneshot(request(&key)).await.expect("infallible");
                    assert_eq!(next.status(), StatusCode::CREATED, "cut {k}");
                    let remaining = next.headers()["ratelimit-remaining"].to_str().unwrap();
                    assert_eq!(remaining, (4 - charged).to_string(), "cut {k}");
                    finished
                }
            })
            .await;
        }
        assert_breaker_closed(&redis, "http rate limit");
    }
}
