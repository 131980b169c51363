//! The Redis backend against real `redis-server` processes: connecting to a
//! single node and to a 3-node cluster, timeouts and the circuit breaker.
#![cfg(feature = "redis")]

mod support;

use std::time::{Duration, Instant};

use support::redis::{RedisCluster, RedisNode};
use throttlebeam::store::{BreakerConfig, BreakerState, Redis, StoreError};

#[tokio::test]
async fn connects_to_a_single_node_and_pings() {
    let Some(node) = RedisNode::start("connects_to_a_single_node_and_pings") else {
        return;
    };
    let redis = Redis::builder(node.url())
        .connect()
        .await
        .expect("connects");
    redis.ping().await.expect("ping");
    assert!(!redis.is_cluster());
    assert_eq!(redis.prefix(), "throttlebeam");
    // `CONFIG GET maxmemory-policy` (warned about unless `noeviction`), then `PING` (the
    // clock's `TIME`s at connect are not counted).
    assert_eq!(redis.stats().commands, 2);
    assert_eq!(redis.stats().breaker.state, BreakerState::Closed);
}

#[tokio::test]
async fn connects_to_a_cluster_and_pings() {
    let Some(cluster) = RedisCluster::start("connects_to_a_cluster_and_pings") else {
        return;
    };
    let redis = Redis::cluster(cluster.urls())
        .connect()
        .await
        .expect("connects");
    assert!(redis.is_cluster());
    redis.ping().await.expect("ping");
}

#[tokio::test]
async fn bad_configuration_is_a_typed_error() {
    for builder in [
        Redis::builder("not a url"),
        Redis::builder("redis://127.0.0.1:1").with_prefix(""),
        Redis::builder("redis://127.0.0.1:1").with_prefix("a{b"),
        Redis::builder("redis://127.0.0.1:1").with_command_timeout(Duration::ZERO),
        Redis::cluster(Vec::<String>::new()),
    ] {
        let err = builder.connect().await.expect_err("refused");
        assert!(matches!(err, StoreError::Config(_)), "{err:?}");
    }
}

#[tokio::test]
async fn a_dead_node_opens_the_breaker_and_recovery_is_automatic() {
    let Some(mut node) = RedisNode::start("a_dead_node_opens_the_breaker") else {
        return;
    };
    let timeout = Duration::from_millis(200);
    let redis = Redis::builder(node.url())
        .with_command_timeout(timeout)
        .with_breaker(
            BreakerConfig::default()
                .with_failures(5)
                .with_cooldown(Duration::from_millis(300)),
        )
        .connect()
        .await
        .expect("connects");
    redis.ping().await.expect("ping");

    node.kill();
    for i in 0..5 {
        let started = Instant::now();
        let err = redis.ping().await.expect_err("node is down");
        assert!(
            matches!(err, StoreError::Unavailable(_) | StoreError::Timeout { .. }),
            "call {i}: {err:?}"
        );
        // Never longer than the command timeout (plus scheduling slack).
        assert!(
            started.elapsed() < timeout + Duration::from_millis(150),
            "call {i} hung"
        );
    }
    let stats = redis.stats().breaker;
    assert_eq!(stats.state, BreakerState::Open);
    assert_eq!(stats.opened, 1);
    // While open: refused locally, at once.
    let started = Instant::now();
    let err = redis.ping().await.expect_err("breaker open");
    assert!(matches!(err, StoreError::BreakerOpen { .. }), "{err:?}");
    assert!(started.elapsed() < Duration::from_millis(20));

    node.restart();
    tokio::time::sleep(Duration::from_millis(350)).await;
    // The probe may land on a connection that is still reconnecting; a
    // bounded number of cooldowns later the store must answer again.
    let deadline = Instant::now() + Duration::from_secs(5);
    loop {
        match redis.ping().await {
            Ok(()) => break,
            Err(e) if Instant::now() < deadline => {
                let _ = e;
                tokio::time::sleep(Duration::from_millis(100)).await;
            }
            Err(e) => panic!("store did not recover: {e:?}"),
        }
    }
    assert_eq!(redis.stats().breaker.state, BreakerState::Closed);
}

/// S15: a probe whose caller is dropped while its command hangs decides
/// nothing, and the next command probes: the breaker is never left half open.
#[tokio::test]
async fn s15_a_probe_dropped_mid_command_never_leaves_the_breaker_half_open() {
    let Some(node) = RedisNode::start("s15_a_probe_dropped_mid_command") else {
        return;
    };
    let redis = Redis::builder(node.url())
        .with_command_timeout(Duration::from_millis(300))
        .with_breaker(
            BreakerConfig::default()
                .with_failures(1)
                .with_cooldown(Duration::from_millis(100)),
        )
        .connect()
        .await
        .expect("connects");
    redis.ping().await.expect("ping");
    node.freeze();
    let err = redis.ping().await.expect_err("a frozen node times out");
    assert!(matches!(err, StoreError::Timeout { .. }), "{err:?}");
    assert_eq!(redis.stats().breaker.state, BreakerState::Open);
    tokio::time::sleep(Duration::from_millis(150)).await;
    // The probe: its caller gives up while the command hangs.
    let dropped = tokio::time::timeout(Duration::from_millis(50), redis.ping()).await;
    assert!(
        dropped.is_err(),
        "the probe hung and was dropped: {dropped:?}"
    );
    let breaker = redis.stats().breaker;
    assert_eq!(breaker.state, BreakerState::HalfOpen);
    assert_eq!(breaker.failures, 1, "a dropped probe is not a failure");
    node.thaw();
    // The next command is the new probe; it finds the store back.
    redis
        .ping()
        .await
        .expect("a new probe goes through, not BreakerOpen");
    assert_eq!(redis.stats().breaker.state, BreakerState::Closed);
}

/// S15, after an outage: the connection that saw it fails its next command
/// whatever the server's state. That stale failure must not decide the
/// probe, or every outage keeps the breaker open for a second cooldown: the
/// first probe once the server is back closes the breaker.
#[tokio::test]
async fn s15_the_first_probe_after_an_outage_closes_the_breaker() {
    let Some(mut node) = RedisNode::start("s15_the_first_probe_after_an_outage") else {
        return;
    };
    let cooldown = Duration::from_millis(300);
    let redis = Redis::builder(node.url())
        .with_command_timeout(Duration::from_secs(5))
        .with_breaker(
            BreakerConfig::default()
                .with_failures(3)
                .with_cooldown(cooldown),
        )
        .connect()
        .await
        .expect("connects");
    redis.ping().await.expect("ping");
    node.kill();
    for i in 0..3 {
        let err = redis.ping().await.expect_err("node is down");
        assert!(
            matches!(err, StoreError::Unavailable(_) | StoreError::Timeout { .. }),
            "call {i}: {err:?}"
        );
    }
    assert_eq!(redis.stats().breaker.state, BreakerState::Open);
    // The connection's last attempt to reconnect fails meanwhile (at once, refused, retried
    // once within 200 ms): what it keeps is that failure.
    tokio::time::sleep(Duration::from_secs(1)).await;
    // Back and answering (the restart waits for PONG), then past the cooldown.
    node.restart();
    tokio::time::sleep(cooldown + Duration::from_millis(50)).await;
    redis
        .ping()
        .await
        .expect("the first probe after the outage answers");
    let breaker = redis.stats().breaker;
    assert_eq!(breaker.state, BreakerState::Closed, "{breaker:?}");
    assert_eq!(
        (breaker.opened, breaker.probes, breaker.recoveries),
        (1, 1, 1),
        "opened once, one probe closed it: {breaker:?}"
    );
}
