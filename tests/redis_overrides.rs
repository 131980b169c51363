//! Overrides that apply everywhere (issue 50 item 3, SCENARIOS S21), on real `redis-server`
//! processes, a single node and a 3-node cluster: an override set on one instance applies on
//! another within the stated bound (the notice, then one read), and within the refresh
//! (5 s) when the notice is lost; it survives a restart of the instance that set it; given a
//! life, it expires everywhere; one of an instance's own (`set_local_override`) applies there
//! only and is kept nowhere else.
#![cfg(feature = "redis")]

mod support;

use std::sync::atomic::{AtomicU64, Ordering};
use std::time::Duration;

use support::redis::{RedisCluster, RedisNode};
use throttlebeam::rate_limit::{
    AsyncRateLimitStore, DEFAULT_OVERRIDE_REFRESH, Gcra, Limiter, Strategy, TokenBucket,
};
use throttlebeam::store::Redis;
use tokio::time::Instant;

const MINUTE: Duration = Duration::from_secs(60);

/// How long an event of another process (a notice, a subscription) may take on a busy
/// two-core machine; every wait below ends as soon as the event is seen.
const PATIENCE: Duration = Duration::from_secs(10);

/// The bound an override set elsewhere applies within, its notice heard: the notice's
/// delivery and one read of the overrides, a few ms on loopback, generous for a busy machine.
const NOTICED_WITHIN: Duration = Duration::from_secs(2);

fn unique(label: &str) -> String {
    static NEXT: AtomicU64 = AtomicU64::new(0);
    format!("{label}{}", NEXT.fetch_add(1, Ordering::Relaxed))
}

/// One instance: its own connection (its own pub/sub listener).
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

/// Checks `key` on `limiter` until a decision reports `limit` (or [`PATIENCE`] passes);
/// returns how long that took.
async fn until_limit<S: Strategy>(limiter: &Limiter<S, Redis>, key: &str, limit: u64) -> Duration
where
    Redis: AsyncRateLimitStore<S>,
{
    let start = Instant::now();
    loop {
        let d = limiter.peek_async(key).await.expect("peeks");
        if d.limit == limit {
            return start.elapsed();
        }
        assert!(
            start.elapsed() < PATIENCE,
            "{key}: limit {} after {PATIENCE:?}, not {limit}",
            d.limit
        );
        tokio::time::sleep(Duration::from_millis(5)).await;
    }
}

/// A raises one key's quota; B, which had read the (empty) overrides already, applies it
/// within [`NOTICED_WITHIN`]; removing it spreads the same way. Another key is untouched.
async fn set_on_a_applies_on_b(urls: &[String], cluster: bool) {
    let (a, b) = (instance(urls, cluster).await, instance(urls, cluster).await);
    let namespace = unique("spread");
    let gcra = Gcra::new(2, MINUTE).unwrap();
    let (on_a, on_b) = (limiter(&a, gcra, &namespace), limiter(&b, gcra, &namespace));
    assert_eq!(on_b.check_async("vip").await.unwrap().limit, 2);
    let bigger = Gcra::new(10, MINUTE).unwrap();
    on_a.set_override("vip", bigger).await.expect("set");
    // A applies it as the call returns; B once it hears of it.
    assert_eq!(on_a.check_async("vip").await.unwrap().limit, 10);
    let took = until_limit(&on_b, "vip", 10).await;
    assert!(took <= NOTICED_WITHIN, "B applied it after {took:?}");
    assert_eq!(on_b.strategy_for("vip"), bigger);
    assert_eq!(on_b.check_async("other").await.unwrap().limit, 2);
    // The key kept its state, its arrival time: 30 s ahead (one unit at 2 a minute, on B)
    // and 6 s more (one at 10 a minute, on A) leave 4 of 10 units, 3 after this check.
    assert_eq!(on_b.check_async("vip").await.unwrap().remaining, 3);
    assert_eq!(on_a.remove_override("vip").await.unwrap(), Some(bigger));
    let took = until_limit(&on_b, "vip", 2).await;
    assert!(took <= NOTICED_WITHIN, "B dropped it after {took:?}");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_override_set_on_one_instance_applies_on_another_on_a_single_node() {
    let Some(node) = RedisNode::start("an_override_applies_on_another_instance") else {
        return;
    };
    set_on_a_applies_on_b(&[node.url()], false).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_override_set_on_one_instance_applies_on_another_on_a_cluster() {
    let Some(cluster) = RedisCluster::start("an_override_applies_on_another_instance_cluster")
    else {
        return;
    };
    set_on_a_applies_on_b(&cluster.urls(), true).await;
}

/// A sets an override and goes away; the instance that replaces it applies it from its first
/// call on (that call waits for the first read of the overrides).
async fn survives_a_restart(urls: &[String], cluster: bool) {
    let namespace = unique("restart");
    let bucket = TokenBucket::new(5, 1, Duration::from_secs(1)).unwrap();
    let bigger = TokenBucket::new(50, 1, Duration::from_secs(1)).unwrap();
    {
        let a = instance(urls, cluster).await;
        limiter(&a, bucket, &namespace)
            .set_override("vip", bigger)
            .await
            .expect("set");
    }
    let again = instance(urls, cluster).await;
    let on_again = limiter(&again, bucket, &namespace);
    let first = on_again.check_async("vip").await.unwrap();
    assert_eq!((first.limit, first.remaining), (50, 49));
    assert_eq!(on_again.check_async("other").await.unwrap().limit, 5);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_override_survives_a_restart_of_the_instance_that_set_it_on_a_single_node() {
    let Some(node) = RedisNode::start("an_override_survives_a_restart") else {
        return;
    };
    survives_a_restart(&[node.url()], false).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_override_survives_a_restart_of_the_instance_that_set_it_on_a_cluster() {
    let Some(cluster) = RedisCluster::start("an_override_survives_a_restart_cluster") else {
        return;
    };
    survives_a_restart(&cluster.urls(), true).await;
}

/// An override given a life of 1.5 s applies on A and B, then on neither; the store forgets
/// it (and its hash, which lived as long as its longest override).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_override_given_a_life_expires_everywhere() {
    let Some(node) = RedisNode::start("an_override_given_a_life_expires") else {
        return;
    };
    let urls = [node.url()];
    let (a, b) = (instance(&urls, false).await, instance(&urls, false).await);
    let namespace = unique("life");
    let gcra = Gcra::new(2, MINUTE).unwrap();
    let (on_a, on_b) = (limiter(&a, gcra, &namespace), limiter(&b, gcra, &namespace));
    on_b.check_async("vip").await.unwrap();
    let hash = format!("{{throttlebeam:{namespace}}}:o");
    let life = Duration::from_millis(1_500);
    let set = Instant::now();
    on_a.set_override_for("vip", Gcra::new(10, MINUTE).unwrap(), life)
        .await
        .expect("set");
    let pttl: i64 = node.cli(&["PTTL", &hash]).unwrap().parse().unwrap();
    assert!(
        (1..=1_500).contains(&pttl),
        "the hash lives as long as the override: {pttl}"
    );
    until_limit(&on_b, "vip", 10).await;
    // Both go back to the default once it ends (each at most a round trip early), never
    // after the store forgot it.
    until_limit(&on_a, "vip", 2).await;
    until_limit(&on_b, "vip", 2).await;
    assert!(
        set.elapsed() >= life - Duration::from_millis(100),
        "went back after {:?}",
        set.elapsed()
    );
    assert_eq!(node.cli(&["EXISTS", &hash]).unwrap(), "0");
    // A permanent override keeps the hash with no expiry.
    on_a.set_override("vip", Gcra::new(10, MINUTE).unwrap())
        .await
        .expect("set");
    assert_eq!(node.cli(&["PTTL", &hash]).unwrap(), "-1");
}

/// An override of A's own applies on A only: kept nowhere, heard of nowhere.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_local_override_applies_on_its_instance_only() {
    let Some(node) = RedisNode::start("a_local_override_applies_on_its_instance_only") else {
        return;
    };
    let urls = [node.url()];
    let (a, b) = (instance(&urls, false).await, instance(&urls, false).await);
    let namespace = unique("local");
    let gcra = Gcra::new(2, MINUTE).unwrap();
    let (on_a, on_b) = (limiter(&a, gcra, &namespace), limiter(&b, gcra, &namespace));
    on_a.set_local_override("vip", Gcra::new(10, MINUTE).unwrap())
        .unwrap();
    assert_eq!(on_a.check_async("vip").await.unwrap().limit, 10);
    assert_eq!(on_b.check_async("vip").await.unwrap().limit, 2);
    let hash = format!("{{throttlebeam:{namespace}}}:o");
    assert_eq!(node.cli(&["EXISTS", &hash]).unwrap(), "0");
    // Read again on B: still nothing.
    on_b.refresh_overrides().await.unwrap();
    assert_eq!(on_b.check_async("vip").await.unwrap().limit, 2);
    // It wins over a shared one on A, and goes with A's limiter.
    on_b.set_override("vip", Gcra::new(20, MINUTE).unwrap())
        .await
        .unwrap();
    until_limit(&on_a, "vip", 10).await;
    assert_eq!(
        on_a.remove_local_override("vip").map(|g| g.limit()),
        Some(10)
    );
    until_limit(&on_a, "vip", 20).await;
}

/// An override written with no notice (as if its notice were lost: here written straight
/// into the hash) applies on B at its first call after the refresh is due: within
/// [`DEFAULT_OVERRIDE_REFRESH`] (5 s) of B's last read, plus one read.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_override_whose_notice_is_lost_applies_within_the_refresh() {
    let Some(node) = RedisNode::start("an_override_whose_notice_is_lost") else {
        return;
    };
    let urls = [node.url()];
    let (a, b) = (instance(&urls, false).await, instance(&urls, false).await);
    let namespace = unique("lost");
    let gcra = Gcra::new(2, MINUTE).unwrap();
    let (on_a, on_b) = (limiter(&a, gcra, &namespace), limiter(&b, gcra, &namespace));
    // B listens for notices (its first call subscribes), and hears A's.
    on_b.check_async("first").await.unwrap();
    let start = Instant::now();
    while b.stats().subscriptions == 0 {
        assert!(start.elapsed() < PATIENCE, "B never subscribed");
        tokio::time::sleep(Duration::from_millis(5)).await;
    }
    on_a.set_override("first", Gcra::new(10, MINUTE).unwrap())
        .await
        .unwrap();
    until_limit(&on_b, "first", 10).await;
    // B reads the overrides now; the refresh is due 5 s after this read.
    on_b.refresh_overrides().await.unwrap();
    let read = Instant::now();
    // The same override for another key, written by hand: no notice.
    let hash = format!("{{throttlebeam:{namespace}}}:o");
    let value = node.cli(&["HGET", &hash, "first"]).unwrap();
    assert_eq!(node.cli(&["HSET", &hash, "second", &value]).unwrap(), "1");
    // Not applied before the refresh is due; applied at the first call after it.
    let mut applied = None;
    while applied.is_none() {
        let d = on_b.peek_async("second").await.unwrap();
        let now = read.elapsed();
        if d.limit == 10 {
            applied = Some(now);
        } else {
            assert!(now < DEFAULT_OVERRIDE_REFRESH + PATIENCE, "never applied");
        }
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
    let applied = applied.unwrap();
    assert!(
        applied >= DEFAULT_OVERRIDE_REFRESH - Duration::from_millis(50),
        "applied after {applied:?}, before the refresh was due"
    );
    assert!(
        applied <= DEFAULT_OVERRIDE_REFRESH + NOTICED_WITHIN,
        "applied after {applied:?}"
    );
}
