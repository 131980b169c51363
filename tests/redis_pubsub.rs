//! Sharded pub/sub on a Redis Cluster: an idempotency waiter on one
//! instance wakes by an `SPUBLISH` notice on its key's shard channel when
//! another instance completes the key, also after the primary that owned
//! the slot failed; with no subscription possible it still completes by
//! polling.
#![cfg(feature = "redis")]

mod support;

use std::time::Duration;

use support::redis::{RedisCluster, ReplicatedCluster};
use throttlebeam::idempotency::IdempotencyReserved;
use throttlebeam::store::Redis;
use throttlebeam::{IdempotencyOptions, IdempotencyOutcome, Runtime};
use tokio::time::Instant;

/// How often the idempotency waiter polls at most (`MAX_POLL`): a wake-up
/// faster than this after the completion, with a sharded notice counted,
/// came by the notice.
const POLL: Duration = Duration::from_millis(500);

async fn instance(urls: Vec<String>) -> (Redis, Runtime) {
    let redis = Redis::cluster(urls)
        .with_command_timeout(Duration::from_secs(5))
        .connect()
        .await
        .expect("connects");
    let runtime = Runtime::builder()
        .with_redis(redis.clone())
        .start()
        .await
        .expect("runtime starts");
    (redis, runtime)
}

/// Polls `check` until it holds or `within` passes; whether it held.
async fn eventually(within: Duration, mut check: impl FnMut() -> bool) -> bool {
    let deadline = Instant::now() + within;
    while Instant::now() < deadline {
        if check() {
            return true;
        }
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
    check()
}

/// Reserves `key` on `a`, waits for it on `b` until `b` confirmed a shard
/// subscription past `subscribed_before`, completes it on `a`; returns how
/// long after the completion `b`'s waiter returned, once it replayed.
async fn wake_across(
    a: &Runtime,
    b: &Runtime,
    b_redis: &Redis,
    key: &'static str,
    subscribed_before: u64,
    then: impl AsyncFnOnce(),
) -> Duration {
    // Right after a failover the data connection may still meet `MOVED`
    // once before its slot map is new: try again, bounded.
    let deadline = Instant::now() + Duration::from_secs(30);
    let reserved = loop {
        match a
            .idempotency()
            .reserve::<String>(key, IdempotencyOptions::new())
            .await
        {
            Ok(reserved) => break reserved,
            Err(e) if Instant::now() < deadline => {
                eprintln!("{key}: reserving again after {e}");
                tokio::time::sleep(Duration::from_millis(100)).await;
            }
            Err(e) => panic!("{key}: reserving failed: {e}"),
        }
    };
    let IdempotencyReserved::Fresh(reservation) = reserved else {
        panic!("{key}: fresh")
    };
    let waiter = tokio::spawn({
        let b = b.clone();
        async move {
            let outcome = b
                .idempotency()
                .run(key, || async { Ok::<_, std::io::Error>("b".to_owned()) })
                .await
                .expect("waits");
            (outcome, Instant::now())
        }
    });
    assert!(
        eventually(Duration::from_secs(30), || {
            b_redis.stats().sharded_subscriptions > subscribed_before
        })
        .await,
        "{key}: no shard channel subscription confirmed: {:?}",
        b_redis.stats()
    );
    then().await;
    let notices = b_redis.stats().sharded_notices;
    let completed = Instant::now();
    reservation
        .complete("a".to_owned())
        .await
        .expect("completes");
    let (outcome, woke) = tokio::time::timeout(Duration::from_secs(30), waiter)
        .await
        .expect("the waiter returns")
        .expect("the waiter ran");
    assert_eq!(outcome, IdempotencyOutcome::Replay("a".to_owned()));
    assert!(
        eventually(Duration::from_secs(5), || b_redis.stats().sharded_notices
            > notices)
        .await,
        "{key}: no sharded notice arrived: {:?}",
        b_redis.stats()
    );
    woke.saturating_duration_since(completed)
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_waiter_on_another_instance_wakes_by_a_sharded_notice() {
    let Some(cluster) =
        RedisCluster::start("a_waiter_on_another_instance_wakes_by_a_sharded_notice")
    else {
        return;
    };
    let (_a_redis, a) = instance(cluster.urls()).await;
    let (b_redis, b) = instance(cluster.urls()).await;
    let waited = wake_across(&a, &b, &b_redis, "pubsub:1", 0, async || {}).await;
    eprintln!("woke {waited:?} after the completion");
    assert!(
        waited < POLL,
        "woke {waited:?} after the completion: polling, not the notice"
    );
}

/// The primary that owns `channel`'s slot: the one that holds its
/// subscription.
fn owner_of(cluster: &ReplicatedCluster, channel_part: &str) -> Option<usize> {
    cluster.primaries().into_iter().find(|&p| {
        cluster.nodes[p]
            .cli(&["PUBSUB", "SHARDCHANNELS"])
            .is_some_and(|channels| channels.contains(channel_part))
    })
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn after_the_slot_owner_fails_a_later_waiter_still_wakes_by_a_notice() {
    let test = "after_the_slot_owner_fails_a_later_waiter_still_wakes_by_a_notice";
    let Some(mut cluster) = ReplicatedCluster::start(test, 1000) else {
        return;
    };
    let (_a_redis, a) = instance(cluster.urls()).await;
    let (b_redis, b) = instance(cluster.urls()).await;
    // Both keys share one hash tag (`{prefix:pubsub}`), so one slot.
    let mut killed = None;
    let first = wake_across(&a, &b, &b_redis, "pubsub}1", 0, async || {
        killed = owner_of(&cluster, "pubsub}1");
    })
    .await;
    eprintln!("before the failover: woke {first:?} after the completion");
    let owner = killed.expect("a primary holds the shard channel");
    let replica = cluster.replica_of(owner).expect("the owner has a replica");
    cluster.nodes[owner].kill();
    let promoted = eventually(Duration::from_secs(30), || {
        cluster.nodes[replica].is_primary()
    })
    .await;
    assert!(promoted, "the replica was not promoted within 30 s");
    assert!(cluster.wait_ok(Duration::from_secs(30)), "cluster not ok");
    // Each instance's data connection meets `MOVED` once before its slot
    // map is new (the cluster client's own recovery): let both learn it.
    for (runtime, warm) in [(&a, "pubsub}warm-a"), (&b, "pubsub}warm-b")] {
        let deadline = Instant::now() + Duration::from_secs(30);
        while let Err(e) = runtime
            .idempotency()
            .run(warm, || async { Ok::<_, std::io::Error>(()) })
            .await
        {
            assert!(Instant::now() < deadline, "{warm}: {e}");
            tokio::time::sleep(Duration::from_millis(100)).await;
        }
    }
    let subscribed = b_redis.stats().sharded_subscriptions;
    let mut new_owner = None;
    let second = wake_across(&a, &b, &b_redis, "pubsub}2", subscribed, async || {
        new_owner = owner_of(&cluster, "pubsub}2");
    })
    .await;
    eprintln!("after the failover: woke {second:?} after the completion");
    assert_eq!(
        new_owner,
        Some(replica),
        "the subscription moved to the promoted replica"
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn with_no_subscription_possible_a_waiter_completes_by_polling() {
    let test = "with_no_subscription_possible_a_waiter_completes_by_polling";
    let Some(cluster) = RedisCluster::start(test) else {
        return;
    };
    // Instance B's user may run every command but use no channel: its
    // `SSUBSCRIBE` is refused, so it can only poll.
    for node in &cluster.nodes {
        node.cli(&[
            "ACL",
            "SETUSER",
            "deaf",
            "on",
            ">deafpass",
            "~*",
            "&-",
            "resetchannels",
            "+@all",
        ])
        .expect("ACL SETUSER");
    }
    let deaf: Vec<String> = cluster
        .nodes
        .iter()
        .map(|n| format!("redis://deaf:deafpass@127.0.0.1:{}", n.port))
        .collect();
    let (_a_redis, a) = instance(cluster.urls()).await;
    let (b_redis, b) = instance(deaf).await;
    let IdempotencyReserved::Fresh(reservation) = a
        .idempotency()
        .reserve::<String>("pubsub:deaf", IdempotencyOptions::new())
        .await
        .expect("reserves")
    else {
        panic!("fresh")
    };
    let before = b_redis.stats().commands;
    let waiter = tokio::spawn({
        let b = b.clone();
        async move {
            b.idempotency()
                .run("pubsub:deaf", || async {
                    Ok::<_, std::io::Error>("b".to_owned())
                })
                .await
                .expect("waits")
        }
    });
    // Complete only once B waits: its claim found the key in flight and it has
    // polled since (commands sent after the claim), so its subscription was
    // asked for (and refused) and the result can reach it only by polling.
    let deadline = tokio::time::Instant::now() + Duration::from_secs(30);
    while b_redis.stats().commands < before + 3 {
        assert!(
            tokio::time::Instant::now() < deadline,
            "B never polled: {:?}",
            b_redis.stats()
        );
        tokio::time::sleep(Duration::from_millis(10)).await;
    }
    assert!(!waiter.is_finished(), "B returned before A completed");
    reservation
        .complete("a".to_owned())
        .await
        .expect("completes");
    let outcome = tokio::time::timeout(Duration::from_secs(30), waiter)
        .await
        .expect("the waiter returns by polling")
        .expect("the waiter ran");
    assert_eq!(outcome, IdempotencyOutcome::Replay("a".to_owned()));
    let stats = b_redis.stats();
    assert_eq!(stats.sharded_subscriptions, 0, "{stats:?}");
    assert_eq!(stats.sharded_notices, 0, "{stats:?}");
}
