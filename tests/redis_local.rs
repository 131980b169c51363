//! Limited keys answered locally (issue 33, item 1), on real `redis-server` processes: a
//! denial is answered on the instance that got it with no round trip until shortly before it
//! can end, with the server's figures; a reset or an override on any instance makes every
//! instance ask the server again at once; a lost subscription leaves no stale answer; memory
//! is bounded. Every strategy, and a tiered limit, on a single node; a cluster too.
#![cfg(feature = "redis")]

mod support;

use std::sync::atomic::{AtomicU64, Ordering};
use std::time::Duration;

use support::redis::{RedisCluster, RedisNode};
use throttlebeam::rate_limit::{
    AsyncRateLimitStore, Decision, FixedWindow, Gcra, LeakyBucket, Limiter, ShaperReservation,
    SlidingWindow, Strategy, Tiered, TokenBucket,
};
use throttlebeam::store::Redis;
use tokio::time::Instant;

const MINUTE: Duration = Duration::from_secs(60);

/// How long an event of another process (a subscription, a notice) may take on a busy
/// machine; every wait below ends as soon as the event is seen.
const PATIENCE: Duration = Duration::from_secs(10);

fn unique(label: &str) -> String {
    static NEXT: AtomicU64 = AtomicU64::new(0);
    format!("{label}{}", NEXT.fetch_add(1, Ordering::Relaxed))
}

/// One instance: its own connection (its own pub/sub listener and local answers).
async fn instance(urls: &[String], cluster: bool) -> Redis {
    let builder = if cluster {
        Redis::cluster(urls.to_vec())
    } else {
        Redis::builder(urls[0].clone())
    };
    builder.connect().await.expect("connects")
}

fn limiter<S: Strategy>(redis: &Redis, strategy: S, namespace: &str) -> Limiter<S, Redis>
where
    Redis: AsyncRateLimitStore<S>,
{
    Limiter::builder(strategy)
        .with_store(redis.clone())
        .with_namespace(namespace.to_owned())
        .build()
}

/// Waits (bounded) until `done` holds: an event of another process, not an ordering of tasks.
async fn eventually(what: &str, mut done: impl AsyncFnMut() -> bool) {
    let deadline = Instant::now() + PATIENCE;
    while !done().await {
        assert!(Instant::now() < deadline, "{what}: not within {PATIENCE:?}");
        tokio::time::sleep(Duration::from_millis(5)).await;
    }
}

/// Checks `key` until it is denied; returns the denial (from the server).
async fn exhaust<S: Strategy>(limiter: &Limiter<S, Redis>, key: &str, cost: u32) -> Decision
where
    Redis: AsyncRateLimitStore<S>,
{
    for _ in 0..100 {
        let d = limiter.check_n_async(key, cost).await.expect("decides");
        if !d.allowed {
            return d;
        }
    }
    panic!("{key} was never denied");
}

/// Denies `key` until the instance answers it locally (its subscription is live once it has
/// kept a denial); returns the first local answer.
async fn until_local<S: Strategy>(limiter: &Limiter<S, Redis>, key: &str, cost: u32) -> Decision
where
    Redis: AsyncRateLimitStore<S>,
{
    let redis = limiter.store().clone();
    let mut answer = None;
    eventually("a local answer", async || {
        let before = redis.stats().local_answers;
        let d = limiter.check_n_async(key, cost).await.expect("decides");
        assert!(!d.allowed, "{key}: {d:?}");
        answer = Some(d);
        redis.stats().local_answers > before
    })
    .await;
    answer.expect("answered")
}

/// Script calls the server ran (`EVALSHA` and `EVAL`), from `INFO commandstats`.
fn server_script_calls(node: &RedisNode) -> u64 {
    let info = node.cli(&["INFO", "commandstats"]).expect("INFO");
    ["cmdstat_evalsha:calls=", "cmdstat_eval:calls="]
        .iter()
        .filter_map(|prefix| {
            info.lines()
                .find_map(|l| l.strip_prefix(prefix))
                .and_then(|rest| rest.split(',').next())
                .map(|n| n.parse::<u64>().expect("a count"))
        })
        .sum()
}

/// One strategy on one node: denied on A (from the server), then answered locally on A with
/// no round trip (neither A's command counter nor the server's script calls move), with the
/// server's figures and a retry-after counting down; B, another instance, asks the server.
async fn answered_locally<S: Strategy>(node: &RedisNode, strategy: S, label: &str)
where
    Redis: AsyncRateLimitStore<S>,
{
    let urls = [node.url()];
    let (a, b) = (instance(&urls, false).await, instance(&urls, false).await);
    let namespace = unique(label);
    let (on_a, on_b) = (
        limiter(&a, strategy.clone(), &namespace),
        limiter(&b, strategy, &namespace),
    );
    let denied = exhaust(&on_a, "k", 1).await;
    assert!(denied.retry_after_ms > 1_000, "{label}: {denied:?}");
    let first = until_local(&on_a, "k", 1).await;
    let (sent, answered) = (a.stats().commands, a.stats().local_answers);
    let on_server = server_script_calls(node);
    let mut last = first;
    for _ in 0..500 {
        let d = on_a.check_async("k").await.expect("decides");
        assert!(!d.allowed);
        assert_eq!(
            (d.limit, d.remaining, d.reset_at_ms),
            (denied.limit, denied.remaining, denied.reset_at_ms),
            "{label}: the server's figures"
        );
        assert!(
            (1..=last.retry_after_ms).contains(&d.retry_after_ms),
            "{label}: {d:?} after {last:?}"
        );
        last = d;
    }
    assert_eq!(a.stats().commands, sent, "{label}: no round trip");
    assert_eq!(a.stats().local_answers, answered + 500, "{label}");
    assert_eq!(
        server_script_calls(node),
        on_server,
        "{label}: nothing reached the server"
    );
    assert_eq!(on_a.stats().local_answers, answered + 500);
    assert!(on_a.stats().denied >= 501);
    // Another instance knows nothing of it: it asks the server, which agrees. Its limiter's
    // first call reads the overrides kept in the store (one round trip); never having seen
    // the key, it then tries it as a fresh key (a `SET NX`, which finds it taken), then the
    // script decides.
    let (sent_b, missed_b) = (b.stats().commands, b.stats().fresh_key_misses);
    assert!(!on_b.check_async("k").await.expect("decides").allowed);
    assert_eq!(b.stats().commands, sent_b + 3, "{label}");
    assert_eq!(b.stats().fresh_key_misses, missed_b + 1, "{label}");
    // Another key of A's is not answered locally.
    assert!(on_a.check_async("other").await.expect("decides").allowed);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn every_strategy_answers_a_limited_key_locally_with_no_round_trip() {
    let Some(node) = RedisNode::start("every_strategy_answers_a_limited_key_locally") else {
        return;
    };
    answered_locally(&node, Gcra::new(2, MINUTE).unwrap(), "gcra").await;
    answered_locally(&node, TokenBucket::new(2, 1, MINUTE).unwrap(), "bucket").await;
    answered_locally(&node, FixedWindow::new(2, MINUTE).unwrap(), "fixed").await;
    answered_locally(&node, SlidingWindow::new(2, MINUTE).unwrap(), "sliding").await;
    answered_locally(
        &node,
        LeakyBucket::new(1, MINUTE, Duration::from_secs(30)).unwrap(),
        "shaper",
    )
    .await;
    let tiered = Tiered::new(
        Gcra::new(100, MINUTE).unwrap(),
        FixedWindow::new(2, MINUTE).unwrap(),
    );
    answered_locally(&node, tiered, "tiered").await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_shapers_refused_reservations_are_answered_locally() {
    let Some(node) = RedisNode::start("a_shapers_refused_reservations_are_answered_locally") else {
        return;
    };
    let redis = instance(&[node.url()], false).await;
    let shaper = limiter(
        &redis,
        LeakyBucket::new(1, MINUTE, Duration::from_secs(30)).unwrap(),
        &unique("reserve"),
    );
    assert!(matches!(
        shaper.try_reserve_async("k", 1).await.unwrap(),
        ShaperReservation::Granted { .. }
    ));
    let mut refused = 0;
    eventually("a local answer", async || {
        let before = redis.stats().local_answers;
        match shaper.try_reserve_async("k", 1).await.unwrap() {
            ShaperReservation::QueueFull { retry_after_ms } => {
                assert!(retry_after_ms > 1_000);
                refused += 1;
            }
            other => panic!("{other:?}"),
        }
        redis.stats().local_answers > before
    })
    .await;
    let sent = redis.stats().commands;
    for _ in 0..100 {
        assert!(matches!(
            shaper.try_reserve_async("k", 1).await.unwrap(),
            ShaperReservation::QueueFull { .. }
        ));
    }
    assert_eq!(redis.stats().commands, sent);
    assert!(refused >= 1);
}

/// A reset on A re-admits the key on B as soon as B hears of it (one pub/sub notice), far
/// before the denial's end; B's next denials are its own again.
async fn reset_readmits_everywhere(urls: &[String], cluster: bool) {
    let (a, b) = (instance(urls, cluster).await, instance(urls, cluster).await);
    let namespace = unique("reset");
    let window = FixedWindow::new(2, MINUTE).unwrap();
    let (on_a, on_b) = (
        limiter(&a, window, &namespace),
        limiter(&b, window, &namespace),
    );
    exhaust(&on_b, "k", 1).await;
    until_local(&on_b, "k", 1).await;
    let notices = b.stats().notices;
    let started = Instant::now();
    on_a.reset_async("k").await.expect("reset");
    eventually("B hears of the reset", async || b.stats().notices > notices).await;
    let sent = b.stats().commands;
    let d = on_b.check_async("k").await.expect("decides");
    assert!(d.allowed, "{d:?}");
    assert_eq!(d.remaining, 1);
    assert_eq!(b.stats().commands, sent + 1, "asked the server");
    assert!(
        started.elapsed() < Duration::from_secs(30),
        "long before its end"
    );
    assert_eq!(b.stats().local_answer_keys, 0);
    // A's own reset forgets A's local answer at once, with no notice needed.
    exhaust(&on_a, "k2", 1).await;
    until_local(&on_a, "k2", 1).await;
    on_a.reset_async("k2").await.expect("reset");
    assert!(on_a.check_async("k2").await.expect("decides").allowed);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_reset_on_one_instance_readmits_on_another_at_once() {
    if let Some(node) = RedisNode::start("a_reset_readmits_on_a_single_node") {
        reset_readmits_everywhere(&[node.url()], false).await;
    }
    if let Some(cluster) = RedisCluster::start("a_reset_readmits_on_a_cluster") {
        reset_readmits_everywhere(&cluster.urls(), true).await;
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_override_on_one_instance_makes_every_instance_ask_the_server() {
    let Some(node) = RedisNode::start("an_override_makes_every_instance_ask") else {
        return;
    };
    let urls = [node.url()];
    let (a, b) = (instance(&urls, false).await, instance(&urls, false).await);
    let namespace = unique("override");
    let gcra = Gcra::new(2, MINUTE).unwrap();
    let (on_a, on_b) = (limiter(&a, gcra, &namespace), limiter(&b, gcra, &namespace));
    exhaust(&on_b, "vip", 1).await;
    until_local(&on_b, "vip", 1).await;
    exhaust(&on_a, "vip", 1).await;
    until_local(&on_a, "vip", 1).await;
    let notices = b.stats().notices;
    // A raises the key's limit: its own next check goes to the server, with the new limit.
    // (A longer burst window: the key's spent minute fits in it.)
    let bigger = Gcra::new(10, 10 * MINUTE).unwrap();
    on_a.set_override("vip", bigger).await.unwrap();
    let answered = a.stats().local_answers;
    assert!(on_a.check_async("vip").await.expect("decides").allowed);
    assert_eq!(a.stats().local_answers, answered, "decided by the server");
    // B hears of it: it reads the overrides again (one round trip) and asks the server,
    // with the new limit, which admits the key (its arrival time 120 s ahead of a 600 s
    // burst window).
    eventually("B hears of the override", async || {
        b.stats().notices > notices
    })
    .await;
    let sent = b.stats().commands;
    let d = on_b.check_async("vip").await.expect("decides");
    assert!(d.allowed && d.limit == 10, "{d:?}");
    assert_eq!(b.stats().commands, sent + 2);
    // Removing it is announced too.
    let notices = b.stats().notices;
    assert_eq!(on_a.remove_override("vip").await.unwrap(), Some(bigger));
    eventually("B hears of the removal", async || {
        b.stats().notices > notices
    })
    .await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_lost_subscription_leaves_no_stale_local_answer() {
    let Some(node) = RedisNode::start("a_lost_subscription_leaves_no_stale_answer") else {
        return;
    };
    let urls = [node.url()];
    let (a, b) = (instance(&urls, false).await, instance(&urls, false).await);
    let namespace = unique("lost");
    let window = SlidingWindow::new(2, MINUTE).unwrap();
    let (on_a, on_b) = (
        limiter(&a, window, &namespace),
        limiter(&b, window, &namespace),
    );
    exhaust(&on_b, "k", 1).await;
    until_local(&on_b, "k", 1).await;
    let subscriptions = b.stats().subscriptions;
    // The server drops every subscriber; the reset's notice reaches nobody.
    node.cli(&["CLIENT", "KILL", "TYPE", "pubsub"])
        .expect("CLIENT KILL");
    on_a.reset_async("k").await.expect("reset");
    eventually("B subscribes again", async || {
        b.stats().subscriptions > subscriptions
    })
    .await;
    // B's answer was kept under the lost subscription: it asks the server (and, since
    // notices may have been missed meanwhile, reads the overrides again first).
    let sent = b.stats().commands;
    assert!(on_b.check_async("k").await.expect("decides").allowed);
    assert_eq!(b.stats().commands, sent + 2);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_larger_cost_is_answered_locally_and_a_smaller_one_asks_the_server() {
    let Some(node) = RedisNode::start("check_n_answered_locally") else {
        return;
    };
    let redis = instance(&[node.url()], false).await;
    let window = limiter(
        &redis,
        FixedWindow::new(3, MINUTE).unwrap(),
        &unique("cost"),
    );
    assert_eq!(window.check_n_async("k", 2).await.unwrap().remaining, 1);
    let denied = exhaust(&window, "k", 2).await;
    assert_eq!(denied.remaining, 1);
    until_local(&window, "k", 2).await;
    let sent = redis.stats().commands;
    // No request of 2 or more can pass before the window ends.
    assert!(!window.check_n_async("k", 3).await.unwrap().allowed);
    assert!(!window.check_n_async("k", 2).await.unwrap().allowed);
    assert_eq!(redis.stats().commands, sent);
    // One unit still can: the server admits it.
    let d = window.check_async("k").await.unwrap();
    assert!(d.allowed && d.remaining == 0, "{d:?}");
    assert_eq!(redis.stats().commands, sent + 1);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn local_answers_are_bounded_and_can_be_turned_off() {
    let Some(node) = RedisNode::start("local_answers_are_bounded") else {
        return;
    };
    let few = Redis::builder(node.url())
        .with_local_answers(3)
        .connect()
        .await
        .expect("connects");
    let gcra = Gcra::new(1, MINUTE).unwrap();
    let limited = limiter(&few, gcra, &unique("few"));
    exhaust(&limited, "a", 1).await;
    until_local(&limited, "a", 1).await;
    for key in ["b", "c", "d", "e"] {
        exhaust(&limited, key, 1).await;
        exhaust(&limited, key, 1).await;
    }
    // Three keys kept; the others' denials come from the server.
    assert_eq!(few.stats().local_answer_keys, 3, "{:?}", few.stats());
    let sent = few.stats().commands;
    assert!(!limited.check_async("e").await.unwrap().allowed);
    assert_eq!(few.stats().commands, sent + 1);

    let off = Redis::builder(node.url())
        .with_local_answers(0)
        .connect()
        .await
        .expect("connects");
    let limited = limiter(&off, gcra, &unique("off"));
    exhaust(&limited, "k", 1).await;
    let sent = off.stats().commands;
    for _ in 0..20 {
        assert!(!limited.check_async("k").await.unwrap().allowed);
    }
    assert_eq!(off.stats().commands, sent + 20);
    assert_eq!(off.stats().local_answers, 0);
}

/// Issue 50 item 5, on a real server: four instances (each its own connection, limiter and
/// local answers) hammer one key of a GCRA of 50 per second, one at a time (an emission
/// interval of 20 ms), eight callers each, for 1.5 s. No denial, from the server or answered
/// locally while other callers' denials are being kept, says to wait more than the server
/// can: 20 ms.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn no_local_answer_says_later_than_the_server_across_four_instances() {
    let Some(node) = RedisNode::start("no_local_answer_says_later_than_the_server") else {
        return;
    };
    let urls = [node.url()];
    let namespace = unique("later");
    let gcra = Gcra::per_second(std::num::NonZeroU32::new(50).unwrap())
        .with_burst(std::num::NonZeroU32::MIN);
    let mut instances = Vec::new();
    for _ in 0..4 {
        let redis = instance(&urls, false).await;
        instances.push((redis.clone(), limiter(&redis, gcra, &namespace)));
    }
    let until = Instant::now() + Duration::from_millis(1_500);
    let mut callers = Vec::new();
    for (_, limiter) in &instances {
        for _ in 0..8 {
            let limiter = limiter.clone();
            callers.push(tokio::spawn(async move {
                let mut worst = 0;
                while Instant::now() < until {
                    let d = limiter.check_async("k").await.expect("decides");
                    if !d.allowed {
                        worst = worst.max(d.retry_after_ms);
                    }
                    tokio::task::yield_now().await;
                }
                worst
            }));
        }
    }
    let mut worst = 0;
    for caller in callers {
        worst = worst.max(caller.await.expect("caller"));
    }
    let local: u64 = instances.iter().map(|(r, _)| r.stats().local_answers).sum();
    assert!(local > 0, "no local answer was given");
    assert!(
        worst <= 20,
        "a denial said to wait {worst} ms where the emission interval is 20 ms"
    );
}
