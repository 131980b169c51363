//! The estimate of the Redis server's clock (issue 50, item 1): its bound (half the best
//! sample's round trip plus 100 ppm of the time since) holds through a proxy that delays the
//! server's replies, samples too slow for the allowed error are rejected and leave fresh keys
//! to the script's `TIME`, and a client clock stepped in the estimate's clock seam (a wall
//! clock corrected, a monotonic clock that stood still while the host was suspended) never
//! shifts it.
#![cfg(all(feature = "redis", feature = "test-util"))]

mod support;

use std::time::Duration;

use support::proxy::FaultProxy;
use support::redis::RedisNode;
use throttlebeam::rate_limit::{FixedWindow, Limiter};
use throttlebeam::store::{Redis, SteppedClock};

const KEY: &str = "{throttlebeam:clock}:r";

/// The server's `TIME` in µs, read on `direct` (not through the proxy).
async fn server_time(direct: &mut redis::aio::MultiplexedConnection) -> u64 {
    let (s, us): (u64, u64) = redis::cmd("TIME").query_async(direct).await.expect("TIME");
    s * 1_000_000 + us
}

async fn direct(node: &RedisNode) -> redis::aio::MultiplexedConnection {
    redis::Client::open(node.url())
        .expect("url")
        .get_multiplexed_async_connection()
        .await
        .expect("connects")
}

/// Reads the estimate, the server's `TIME`, and the estimate again: the server read its
/// clock between the two readings, so if the bound is true its reading lies between the
/// first less its bound and the second plus its bound. Returns how far behind the server the
/// first reading was and its bound (µs).
async fn check_bound(redis: &Redis, direct: &mut redis::aio::MultiplexedConnection) -> (i64, u64) {
    let (early, early_bound) = redis.clock_estimate(KEY).expect("a good estimate");
    let truth = server_time(direct).await;
    let (late, late_bound) = redis.clock_estimate(KEY).expect("a good estimate");
    assert!(
        early.saturating_sub(early_bound) <= truth && truth <= late + late_bound,
        "the server read {truth}, outside {early} - {early_bound} .. {late} + {late_bound}"
    );
    let behind = i64::try_from(truth).unwrap() - i64::try_from(early).unwrap();
    (behind, early_bound)
}

/// Waits (at most 20 s) until `redis` has a good estimate again; each look starts a
/// measurement if one is due.
async fn measured_again(redis: &Redis) {
    let deadline = tokio::time::Instant::now() + Duration::from_secs(20);
    while redis.clock_estimate(KEY).is_none() {
        assert!(
            tokio::time::Instant::now() < deadline,
            "measured again within 20 s"
        );
        tokio::time::sleep(Duration::from_millis(5)).await;
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn through_a_proxy_that_delays_replies_the_estimate_stays_within_its_bound() {
    let Some(node) = RedisNode::start("clock_bound_through_a_delaying_proxy") else {
        return;
    };
    let mut direct = direct(&node).await;
    let proxy = FaultProxy::start(node.port);
    // Replies 8 ms late, requests on time: the server reads its clock about 4 ms before the
    // round trip's midpoint, the error the midpoint assumption makes.
    proxy.delay_replies(Duration::from_millis(8));
    let redis = Redis::builder(proxy.url())
        .with_command_timeout(Duration::from_secs(5))
        .with_max_clock_error(Duration::from_millis(20))
        .connect()
        .await
        .expect("connects");
    let (behind, bound) = check_bound(&redis, &mut direct).await;
    assert!(
        behind >= 3_000,
        "the delay shows: the estimate runs {behind} µs behind the server"
    );
    assert!(
        (4_000..20_000).contains(&bound),
        "half the round trip or more: {bound} µs"
    );
    eprintln!("8 ms reply delay: estimate {behind} µs behind the server, bound {bound} µs");

    // Delays that vary: the shortest round trip of the five is kept.
    proxy.delay_replies_in_turn(&[
        Duration::from_millis(40),
        Duration::from_millis(40),
        Duration::from_millis(1),
        Duration::from_millis(40),
        Duration::from_millis(40),
    ]);
    let redis = Redis::builder(proxy.url())
        .with_command_timeout(Duration::from_secs(5))
        .with_max_clock_error(Duration::from_millis(30))
        .connect()
        .await
        .expect("connects");
    let (behind, bound) = check_bound(&redis, &mut direct).await;
    assert!(
        bound < 5_000,
        "the 1 ms sample is kept, not a 40 ms one: {bound} µs"
    );
    eprintln!("1 ms among 40 ms delays: estimate {behind} µs behind the server, bound {bound} µs");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn samples_slower_than_the_allowed_error_leave_fresh_keys_to_the_scripts_time() {
    let Some(node) = RedisNode::start("clock_samples_rejected") else {
        return;
    };
    let proxy = FaultProxy::start(node.port);
    proxy.delay_replies(Duration::from_millis(30));
    let redis = Redis::builder(proxy.url())
        .with_command_timeout(Duration::from_secs(5))
        .connect()
        .await
        .expect("connects");
    assert_eq!(
        redis.clock_estimate(KEY),
        None,
        "every sample's half round trip is over the 5 ms allowed"
    );
    let limiter = Limiter::builder(FixedWindow::new(1, Duration::from_secs(3_600)).unwrap())
        .with_store(redis.clone())
        .build();
    for key in ["a", "b", "c"] {
        let first = limiter.check_async(key).await.expect("decided");
        assert!(first.allowed, "{key}");
        let second = limiter.check_async(key).await.expect("decided");
        assert!(!second.allowed, "{key}: one an hour");
    }
    let stats = redis.stats();
    assert_eq!(
        stats.fresh_key_writes, 0,
        "every check on the server's TIME: {stats:?}"
    );

    // The link is quick again: measured again, and fresh keys are written.
    proxy.delay_replies(Duration::ZERO);
    measured_again(&redis).await;
    assert!(limiter.check_async("d").await.expect("decided").allowed);
    assert_eq!(redis.stats().fresh_key_writes, 1);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_stepped_client_clock_never_shifts_the_estimate() {
    let Some(node) = RedisNode::start("clock_stepped_client") else {
        return;
    };
    let mut direct = direct(&node).await;
    let clock = SteppedClock::new();
    let redis = Redis::builder(node.url())
        .with_client_clock(clock.clone())
        .connect()
        .await
        .expect("connects");
    check_bound(&redis, &mut direct).await;
    let steps: [(&str, &dyn Fn()); 3] = [
        ("wall clock stepped back 30 s", &|| {
            clock.step_wall_back(Duration::from_secs(30))
        }),
        ("wall clock stepped forward 59 s", &|| {
            clock.step_wall_forward(Duration::from_secs(59));
        }),
        // Without the check against the wall clock, the estimate would run 200 ms behind.
        ("monotonic clock stood still 200 ms", &|| {
            clock.lose_monotonic(Duration::from_millis(200));
        }),
    ];
    for (what, step) in steps {
        step();
        assert_eq!(redis.clock_estimate(KEY), None, "{what}: discarded at once");
        measured_again(&redis).await;
        let (behind, bound) = check_bound(&redis, &mut direct).await;
        eprintln!("{what}: then {behind} µs behind, bound {bound} µs");
    }
}

/// Without a good estimate, a leading throttle window carries no end: the instance that
/// loses reads the time left with `PTTL`, so instances still agree, on the server's clock.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn without_an_estimate_a_leading_window_carries_no_end_and_losers_ask_its_ttl() {
    let Some(node) = RedisNode::start("clock_leading_window_without_estimate") else {
        return;
    };
    let proxy = FaultProxy::start(node.port);
    proxy.delay_replies(Duration::from_millis(30));
    let mut runtimes = Vec::new();
    for _ in 0..2 {
        let redis = Redis::builder(proxy.url())
            .with_command_timeout(Duration::from_secs(5))
            .connect()
            .await
            .expect("connects");
        assert_eq!(redis.clock_estimate(KEY), None);
        runtimes.push(
            throttlebeam::Runtime::builder()
                .with_redis(redis)
                .start()
                .await
                .expect("runtime"),
        );
    }
    let window = Duration::from_secs(30);
    let ran = runtimes[0]
        .throttle()
        .call("mail:1", window, || async { Ok::<_, std::io::Error>(1) })
        .await
        .expect("runs");
    assert_eq!(ran.executed(), Some(1));
    let turned = runtimes[1]
        .throttle()
        .call("mail:1", window, || async { Ok::<_, std::io::Error>(2) })
        .await
        .expect("throttled");
    let left = turned.retry_after().expect("throttled across instances");
    assert!(left > Duration::from_secs(29) && left <= window, "{left:?}");
    let stored: String = redis::cmd("GET")
        .arg("{throttlebeam:mail:1}:t")
        .query_async(&mut direct(&node).await)
        .await
        .expect("GET");
    assert!(!stored.contains(':'), "no end in {stored:?}");
}
