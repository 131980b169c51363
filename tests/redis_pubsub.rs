//! Sharded pub/sub on a Redis Cluster: an idempotency waiter on one
//! instance wakes by an `SPUBLISH` notice on its key's shard channel when
//! another instance completes the key, also after the primary that owned
//! the slot failed or handed it over (`CLUSTER FAILOVER`); with no
//! subscription possible it still completes by polling. A subscriber
//! connection that goes silent without FIN or RST (a fault proxy stops
//! forwarding) is noticed within 2 s: local answers stop, and once it is
//! replaced a reset elsewhere re-admits here.
#![cfg(feature = "redis")]

mod support;

use std::time::Duration;

use support::proxy::FaultProxy;
use support::redis::{RedisCluster, RedisNode, ReplicatedCluster};
use throttlebeam::idempotency::IdempotencyReserved;
use throttlebeam::rate_limit::{FixedWindow, Limiter};
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
    warm(&a, "pubsub}warm-a").await;
    warm(&b, "pubsub}warm-b").await;
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

/// The nodes holding a subscription to `channel_part`'s shard channel,
/// primaries and replicas alike: a replica serves `SSUBSCRIBE` for its
/// primary's slots.
fn holders_of(cluster: &ReplicatedCluster, channel_part: &str) -> Vec<usize> {
    (0..cluster.nodes.len())
        .filter(|&i| {
            cluster.nodes[i]
                .cli(&["PUBSUB", "SHARDCHANNELS"])
                .is_some_and(|channels| channels.contains(channel_part))
        })
        .collect()
}

/// The slot of the shard channel of the key named by `channel_part`, which
/// the primary at `owner` holds a subscription to.
fn channel_slot(cluster: &ReplicatedCluster, owner: usize, channel_part: &str) -> u16 {
    let node = &cluster.nodes[owner];
    let channels = node
        .cli(&["PUBSUB", "SHARDCHANNELS"])
        .expect("PUBSUB SHARDCHANNELS");
    let channel = channels
        .lines()
        .map(str::trim)
        .find(|c| c.contains(channel_part))
        .expect("the owner holds the channel");
    node.cli(&["CLUSTER", "KEYSLOT", channel])
        .and_then(|slot| slot.parse().ok())
        .expect("CLUSTER KEYSLOT")
}

/// Whether the primary at `primary` counts the node at `node` among its
/// replicas (`CLUSTER REPLICAS`, its own view of the cluster).
fn counts_as_replica(cluster: &ReplicatedCluster, primary: usize, node: usize) -> bool {
    let primary = &cluster.nodes[primary];
    let port = format!(":{}@", cluster.nodes[node].port);
    primary
        .cli(&["CLUSTER", "MYID"])
        .and_then(|id| primary.cli(&["CLUSTER", "REPLICAS", &id]))
        .is_some_and(|replicas| replicas.contains(&port))
}

/// Runs `key` on `runtime` until it succeeds: each instance's data
/// connection may meet the slot's move once before its slot map is new
/// (the cluster client's own recovery), which is not what these tests are
/// about.
async fn warm(runtime: &Runtime, key: &str) {
    let deadline = Instant::now() + Duration::from_secs(60);
    while let Err(e) = runtime
        .idempotency()
        .run(key, || async { Ok::<_, std::io::Error>(()) })
        .await
    {
        assert!(Instant::now() < deadline, "{key}: {e}");
        tokio::time::sleep(Duration::from_millis(100)).await;
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn after_a_manual_failover_of_the_slot_owner_waiters_still_wake_by_notices() {
    let test = "after_a_manual_failover_of_the_slot_owner_waiters_still_wake_by_notices";
    // A long node timeout: on a loaded machine no node is failed by
    // mistake, so the only failover is the one asked for.
    let Some(cluster) = ReplicatedCluster::start(test, 5000) else {
        return;
    };
    let (_a_redis, a) = instance(cluster.urls()).await;
    let (b_redis, b) = instance(cluster.urls()).await;
    let mut owner = None;
    let first = wake_across(&a, &b, &b_redis, "pubsub}1", 0, async || {
        owner = owner_of(&cluster, "pubsub}1");
    })
    .await;
    eprintln!("before the failover: woke {first:?} after the completion");
    let owner = owner.expect("a primary holds the shard channel");
    let replica = cluster.replica_of(owner).expect("the owner has a replica");

    // A key held on A through the failover, and B waiting for it.
    let held = "pubsub}held";
    let long = IdempotencyOptions::new()
        .with_lease(Duration::from_secs(300))
        .with_wait_timeout(Duration::from_secs(300));
    let IdempotencyReserved::Fresh(reservation) = a
        .idempotency()
        .reserve::<String>(held, long.clone())
        .await
        .expect("reserves")
    else {
        panic!("{held}: fresh")
    };
    let subscribed = b_redis.stats().sharded_subscriptions;
    let waiter = tokio::spawn({
        let b = b.clone();
        async move {
            // A look at the record that meets the failover fails the wait
            // (idempotency fails closed): wait again.
            let deadline = Instant::now() + Duration::from_secs(300);
            loop {
                match b
                    .idempotency()
                    .run_with(held, long.clone(), || async {
                        Ok::<_, std::io::Error>("b".to_owned())
                    })
                    .await
                {
                    Ok(outcome) => break outcome,
                    Err(e) => {
                        assert!(Instant::now() < deadline, "{held}: {e}");
                        eprintln!("{held}: waiting again after {e}");
                        tokio::time::sleep(Duration::from_millis(100)).await;
                    }
                }
            }
        }
    });
    assert!(
        eventually(Duration::from_secs(60), || {
            b_redis.stats().sharded_subscriptions > subscribed
                && owner_of(&cluster, held) == Some(owner)
        })
        .await,
        "{held}: B's shard channel is not subscribed on the slot's owner: {:?}",
        b_redis.stats()
    );

    // The replica takes the slot over, its primary agreeing.
    let subscribed = b_redis.stats().sharded_subscriptions;
    let slot = channel_slot(&cluster, owner, held);
    assert_eq!(cluster.primary_of_slot(owner, slot), Some(owner), "{held}");
    let failover = || cluster.nodes[replica].cli(&["CLUSTER", "FAILOVER"]);
    assert_eq!(failover().as_deref(), Some("OK"), "CLUSTER FAILOVER");
    let asked = Instant::now();
    let mut asked_again = asked;
    // Seen by every node; and the new owner counts the old one among its
    // replicas, since only then does it pass the shard's messages on to it
    // (where B's listener may subscribe, see below).
    let seen_by_all = || {
        cluster.nodes[replica].is_primary()
            && (0..cluster.nodes.len()).all(|i| cluster.primary_of_slot(i, slot) == Some(replica))
            && counts_as_replica(&cluster, replica, owner)
    };
    while !seen_by_all() {
        assert!(
            asked.elapsed() < Duration::from_secs(120),
            "the promotion was not seen by every node within 120 s: slot {slot}, replica {replica}, {:?}, the old owner counted as a replica: {}",
            (0..cluster.nodes.len())
                .map(|i| (
                    cluster.nodes[i].is_primary(),
                    cluster.primary_of_slot(i, slot)
                ))
                .collect::<Vec<_>>(),
            counts_as_replica(&cluster, replica, owner)
        );
        if !cluster.nodes[replica].is_primary() && asked_again.elapsed() > Duration::from_secs(15) {
            // A manual failover gives up if the replica cannot catch up in
            // time (5 s, on a loaded machine): ask again.
            let _ = failover();
            asked_again = Instant::now();
        }
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
    eprintln!("the replica took the slot over after {:?}", asked.elapsed());
    assert!(cluster.wait_ok(Duration::from_secs(60)), "cluster not ok");

    // The old owner dropped the shard channel with the slot (`sunsubscribe`);
    // B's listener subscribed to it again within the slot's shard (a node
    // that still routes by the old slot map asks the demoted owner, which
    // serves it as the new owner's replica).
    let shard = [owner, replica];
    assert!(
        eventually(Duration::from_secs(60), || {
            b_redis.stats().sharded_subscriptions > subscribed && {
                let holders = holders_of(&cluster, held);
                !holders.is_empty() && holders.iter().all(|h| shard.contains(h))
            }
        })
        .await,
        "{held}: B's listener did not subscribe again: {:?}, held by {:?}",
        b_redis.stats(),
        holders_of(&cluster, held)
    );
    eprintln!(
        "{held}: subscribed again on {:?} (owner was {owner}, promoted {replica})",
        holders_of(&cluster, held)
    );
    assert!(
        !waiter.is_finished(),
        "{held}: B returned before A completed"
    );

    warm(&a, "pubsub}warm-a").await;
    warm(&b, "pubsub}warm-b").await;
    let notices = b_redis.stats().sharded_notices;
    reservation
        .complete("a".to_owned())
        .await
        .expect("completes");
    let outcome = tokio::time::timeout(Duration::from_secs(60), waiter)
        .await
        .expect("the waiter returns")
        .expect("the waiter ran");
    assert_eq!(outcome, IdempotencyOutcome::Replay("a".to_owned()));
    assert!(
        eventually(Duration::from_secs(30), || b_redis.stats().sharded_notices
            > notices)
        .await,
        "{held}: no sharded notice arrived: {:?}",
        b_redis.stats()
    );

    // A later waiter, on a key first waited for now, wakes by a notice too.
    let subscribed = b_redis.stats().sharded_subscriptions;
    let mut holders = Vec::new();
    let later = wake_across(&a, &b, &b_redis, "pubsub}2", subscribed, async || {
        holders = holders_of(&cluster, "pubsub}2");
    })
    .await;
    eprintln!("after the failover: woke {later:?} after the completion; subscribed on {holders:?}");
    assert!(
        !holders.is_empty() && holders.iter().all(|h| shard.contains(h)),
        "the subscription is within the slot's shard {shard:?}: {holders:?}"
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

/// The port the server sees the one pub/sub client of this server coming from
/// (`CLIENT LIST TYPE pubsub`), once there is exactly one.
fn subscriber_port(node: &RedisNode) -> Option<u16> {
    let list = node.cli(&["CLIENT", "LIST", "TYPE", "pubsub"])?;
    let ports: Vec<u16> = list
        .lines()
        .filter_map(|line| {
            let addr = line
                .split_whitespace()
                .find_map(|f| f.strip_prefix("addr="))?;
            addr.rsplit_once(':')?.1.parse().ok()
        })
        .collect();
    match ports[..] {
        [port] => Some(port),
        _ => None,
    }
}

/// Issue 50, item 2: the subscriber connection is blackholed (the proxy stops forwarding
/// it, both sockets stay open: no FIN, no RST) while the data connection keeps working.
/// The PING every second, answered within a second, notices it: local answers stop within
/// 2 s (plus scheduling), the connection is replaced, and a reset on another instance
/// re-admits the key here. Before, nothing ever noticed: local answers went on for the
/// life of the process and the reset was never heard.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_silent_subscriber_is_noticed_and_replaced_and_a_reset_elsewhere_readmits_here() {
    let test = "a_silent_subscriber_is_noticed_and_replaced";
    let Some(node) = RedisNode::start(test) else {
        return;
    };
    let proxy = FaultProxy::start(node.port);
    // Instance A reaches the server through the proxy, B directly; both with defaults.
    let a = Redis::builder(proxy.url())
        .connect()
        .await
        .expect("A connects");
    let b = Redis::builder(node.url())
        .connect()
        .await
        .expect("B connects");
    let limit = || FixedWindow::new(1, Duration::from_secs(3_600)).expect("a limit");
    let on_a = Limiter::builder(limit())
        .with_store(a.clone())
        .with_namespace("silent")
        .build();
    let on_b = Limiter::builder(limit())
        .with_store(b.clone())
        .with_namespace("silent")
        .build();

    // A's first check subscribes; once live, a denial is kept and answered locally.
    assert!(on_a.check_async("k").await.expect("decided").allowed);
    assert!(eventually(Duration::from_secs(20), || a.stats().subscriptions == 1).await);
    assert!(!on_a.check_async("k").await.expect("decided").allowed);
    let local = a.stats().local_answers;
    assert!(!on_a.check_async("k").await.expect("decided").allowed);
    assert_eq!(a.stats().local_answers, local + 1, "answered locally");

    let port = subscriber_port(&node).expect("A's one subscriber connection");
    assert!(
        proxy.blackhole_upstream_port(port),
        "it goes through the proxy"
    );
    let blackholed = Instant::now();
    // Checks every 20 ms; the first one not answered locally went to the server.
    let stopped = loop {
        let before = a.stats().local_answers;
        let decision = on_a.check_async("k").await.expect("decided");
        assert!(!decision.allowed);
        if a.stats().local_answers == before {
            break blackholed.elapsed();
        }
        assert!(
            blackholed.elapsed() < Duration::from_secs(20),
            "local answers never stopped: {:?}",
            a.stats()
        );
        tokio::time::sleep(Duration::from_millis(20)).await;
    };
    eprintln!("local answers stopped {stopped:?} after the subscriber went silent");
    assert!(
        stopped <= Duration::from_millis(2_500),
        "within PING_EVERY + PONG_WITHIN (2 s) and scheduling: {stopped:?}"
    );

    proxy.heal();
    // Replaced by a new subscription (numbered 2); a denial is kept under it.
    assert!(
        eventually(Duration::from_secs(20), || a.stats().subscriptions == 2).await,
        "{:?}",
        a.stats()
    );
    assert!(!on_a.check_async("k").await.expect("decided").allowed);
    let local = a.stats().local_answers;
    assert!(!on_a.check_async("k").await.expect("decided").allowed);
    assert_eq!(a.stats().local_answers, local + 1, "answered locally again");
    // A reset on B is heard here: the key is admitted at once, an hour before its window ends.
    on_b.reset_async("k").await.expect("reset");
    let deadline = Instant::now() + Duration::from_secs(20);
    while !on_a.check_async("k").await.expect("decided").allowed {
        assert!(
            Instant::now() < deadline,
            "the reset never reached A: {:?}",
            a.stats()
        );
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
}

/// Issue 50, item 2, sharded: the primary that holds a waiter's shard channel stops answering
/// its clients for 3 s (`CLIENT PAUSE … ALL`: the connection stays open and silent, the
/// cluster bus goes on, so the cluster sees nothing wrong). The sharded connection's `PING`
/// to that primary goes unanswered, so the connection is replaced and the channel subscribed
/// again (without the `PING`, the paused connection would simply resume and nothing would be
/// subscribed again); the waiter then still wakes by the notice.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_silent_sharded_connection_is_replaced_and_waiters_still_wake_by_notices() {
    let Some(cluster) = RedisCluster::start("a_silent_sharded_connection_is_replaced") else {
        return;
    };
    let (_a_redis, a) = instance(cluster.urls()).await;
    let (b_redis, b) = instance(cluster.urls()).await;
    let waited = wake_across(&a, &b, &b_redis, "pubsub:paused", 0, async || {
        let owner = cluster
            .nodes
            .iter()
            .find(|n| {
                n.cli(&["PUBSUB", "SHARDCHANNELS"])
                    .is_some_and(|c| c.contains("pubsub:paused"))
            })
            .expect("the slot's owner holds the subscription");
        let subscribed = b_redis.stats().sharded_subscriptions;
        assert_eq!(
            owner.cli(&["CLIENT", "PAUSE", "3000", "ALL"]).as_deref(),
            Some("OK")
        );
        let paused = Instant::now();
        assert!(
            eventually(Duration::from_secs(30), || {
                b_redis.stats().sharded_subscriptions > subscribed
            })
            .await,
            "the paused connection was never replaced: {:?}",
            b_redis.stats()
        );
        eprintln!(
            "subscribed again on a new sharded connection {:?} after the pause began",
            paused.elapsed()
        );
    })
    .await;
    eprintln!("woke {waited:?} after the completion");
    assert!(
        waited < POLL,
        "woke {waited:?} after the completion: polling, not the notice"
    );
}
