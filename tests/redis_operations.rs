//! Operations on real `redis-server` processes (issue 33, item 6): after a mixed workload of
//! every primitive (shared debounce with cancel and flush, the leading throttle, the
//! coalescing throttle, idempotency with replays, failures and reservations, every
//! rate-limit strategy with resets and overrides) no key the library wrote lives without a
//! TTL; and `Redis::stats()` with the `metrics` export report round trips, local answers, the
//! breaker's state and transitions, script reloads and reconnections.
#![cfg(feature = "redis")]

mod support;

use std::time::Duration;

use support::redis::{RedisCluster, RedisNode};
use throttlebeam::rate_limit::{
    AsyncRateLimitStore, FixedWindow, Gcra, LeakyBucket, Limiter, SlidingWindow, Strategy, Tiered,
    TokenBucket,
};
use throttlebeam::store::{BreakerConfig, BreakerState, Redis};
use throttlebeam::{IdempotencyOptions, Runtime, coalesce::Phase};

const MINUTE: Duration = Duration::from_secs(60);

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

/// Checks, peeks, forecasts, a reset and an override of one strategy, some keys limited.
async fn rate_limits<S: Strategy>(redis: &Redis, strategy: S, bigger: S, name: &str)
where
    Redis: AsyncRateLimitStore<S>,
{
    let limiter = Limiter::builder(strategy)
        .with_store(redis.clone())
        .with_namespace(format!("ttl-{name}"))
        .build();
    for n in 0..5 {
        for _ in 0..4 {
            limiter
                .check_async(&format!("k{n}"))
                .await
                .expect("decides");
        }
        limiter.peek_async(&format!("p{n}")).await.expect("peeks");
        limiter
            .forecast_async(&format!("k{n}"), 1)
            .await
            .expect("forecasts");
    }
    limiter.reset_async("k0").await.expect("resets");
    limiter.check_async("k0").await.expect("decides");
    limiter.set_override("k1", bigger).await.expect("override");
    limiter.check_async("k1").await.expect("decides");
    limiter.remove_override("k1").await.expect("removed");
}

async fn mixed_workload(runtime: &Runtime, redis: &Redis) {
    // The leading throttle.
    let throttle = runtime.throttle();
    for n in 0..10 {
        for _ in 0..2 {
            let _ = throttle
                .call(&format!("mail:{n}"), MINUTE, || async {
                    Ok::<_, std::io::Error>(())
                })
                .await
                .expect("throttle decides");
        }
    }
    // The coalescing throttle: a leading and a trailing run per key.
    let coalesce = runtime
        .coalesce("sync:")
        .with_window(Duration::from_millis(100))
        .with_store(redis.clone())
        .build::<u32>()
        .expect("coalescing throttle");
    for n in 0..5 {
        let key = format!("room:{n}");
        let (first, second) = tokio::join!(
            coalesce.call_and_wait(&key, |_: Phase| async { Ok::<_, std::io::Error>(1) }),
            coalesce.call_and_wait(&key, |_: Phase| async { Ok::<_, std::io::Error>(2) }),
        );
        first.expect("runs");
        second.expect("runs");
    }
    // And windows still open when the keys are scanned.
    let slow = runtime
        .coalesce("slow:")
        .with_window(MINUTE)
        .with_store(redis.clone())
        .build::<u32>()
        .expect("coalescing throttle");
    for n in 0..3 {
        let ran = slow
            .call(&format!("room:{n}"), |_: Phase| async {
                Ok::<_, std::io::Error>(1)
            })
            .await;
        assert!(ran.expect("runs"), "the leading run");
    }
    // Shared debounce: bursts that run, one cancelled, one flushed.
    let debounce = runtime.debounce();
    let delay = Duration::from_millis(50);
    for n in 0..5 {
        let key = format!("feed:{n}");
        let calls: Vec<_> = (0..3)
            .map(|i| {
                debounce
                    .across_instances()
                    .call(
                        &key,
                        delay,
                        move || async move { Ok::<_, std::io::Error>(i) },
                    )
                    .expect("scheduled")
            })
            .collect();
        for call in calls {
            tokio::time::timeout(Duration::from_secs(10), call)
                .await
                .expect("settles")
                .expect("runs");
        }
    }
    // Cancelled and flushed bursts (whether the other instance's view had the burst yet or
    // not: what they leave behind is what is checked).
    let long = Duration::from_secs(1);
    let cancelled = debounce
        .across_instances()
        .call("feed:cancel", long, || async { Ok::<_, std::io::Error>(0) })
        .expect("scheduled");
    debounce
        .across_instances()
        .cancel("feed:cancel")
        .await
        .expect("valid key");
    let flushed = debounce
        .across_instances()
        .call("feed:flush", long, || async { Ok::<_, std::io::Error>(0) })
        .expect("scheduled");
    debounce
        .across_instances()
        .flush("feed:flush")
        .await
        .expect("valid key");
    for call in [cancelled, flushed] {
        // Run, or cancelled: settled either way.
        let _ = tokio::time::timeout(Duration::from_secs(10), call)
            .await
            .expect("settles");
    }
    // Idempotency: fresh runs, replays, a failure (released), a short result TTL.
    let idempotency = runtime.idempotency();
    for n in 0..10 {
        for _ in 0..2 {
            let _ = idempotency
                .run(&format!("pay:{n}"), move || async move {
                    Ok::<_, std::io::Error>(n)
                })
                .await
                .expect("runs or replays");
        }
    }
    let failed = idempotency
        .run("pay:failed", || async {
            Err::<u32, _>(std::io::Error::other("declined"))
        })
        .await;
    assert!(failed.is_err());
    let options = IdempotencyOptions::new().with_ttl(Duration::from_secs(5));
    let _ = idempotency
        .run_with("pay:short", options, || async {
            Ok::<_, std::io::Error>(1)
        })
        .await
        .expect("runs");
    // Every rate-limit strategy, with resets and overrides.
    let per = |n| Gcra::new(n, MINUTE).expect("gcra");
    rate_limits(redis, per(2), per(20), "gcra").await;
    let bucket = |n| TokenBucket::new(n, 1, MINUTE).expect("bucket");
    rate_limits(redis, bucket(2), bucket(20), "bucket").await;
    let fixed = |n| FixedWindow::new(n, MINUTE).expect("fixed");
    rate_limits(redis, fixed(2), fixed(20), "fixed").await;
    let sliding = |n| SlidingWindow::new(n, MINUTE).expect("sliding");
    rate_limits(redis, sliding(2), sliding(20), "sliding").await;
    let shaper = |n| LeakyBucket::new(n, MINUTE, Duration::from_secs(30)).expect("shaper");
    rate_limits(redis, shaper(2), shaper(20), "shaper").await;
    let tiered = |n| Tiered::new(per(n * 10), fixed(n));
    rate_limits(redis, tiered(2), tiered(20), "tiered").await;
    let shaped = Limiter::builder(shaper(2))
        .with_store(redis.clone())
        .with_namespace("ttl-reserve")
        .build();
    for _ in 0..4 {
        shaped.try_reserve_async("k", 1).await.expect("reserves");
    }
}

/// Every key on `url` with its time to live in ms (-1: none).
async fn keys_and_ttls(url: &str) -> Vec<(String, i64)> {
    let client = redis::Client::open(url).expect("url");
    let mut conn = client
        .get_multiplexed_async_connection()
        .await
        .expect("connects");
    let mut keys = Vec::new();
    let mut cursor = 0u64;
    loop {
        let (next, batch): (u64, Vec<String>) = redis::cmd("SCAN")
            .arg(cursor)
            .arg("COUNT")
            .arg(1000)
            .query_async(&mut conn)
            .await
            .expect("SCAN");
        keys.extend(batch);
        if next == 0 {
            break;
        }
        cursor = next;
    }
    let mut out = Vec::with_capacity(keys.len());
    for key in keys {
        let ttl: i64 = redis::cmd("PTTL")
            .arg(&key)
            .query_async(&mut conn)
            .await
            .expect("PTTL");
        // -2: it expired between the scan and now.
        if ttl != -2 {
            out.push((key, ttl));
        }
    }
    out
}

async fn every_key_has_a_ttl(urls: &[String], cluster: bool) {
    let (runtime, redis) = instance(urls, cluster).await;
    mixed_workload(&runtime, &redis).await;
    let (mut seen, mut suffixes) = (0, std::collections::BTreeSet::new());
    for url in urls {
        let keys = keys_and_ttls(url).await;
        seen += keys.len();
        for (key, _) in &keys {
            if let Some((_, suffix)) = key.rsplit_once('}') {
                suffixes.insert(suffix.split(':').take(2).collect::<Vec<_>>().join(":"));
            }
        }
        let forever: Vec<&(String, i64)> = keys.iter().filter(|(_, ttl)| *ttl < 0).collect();
        assert!(
            forever.is_empty(),
            "keys without a TTL on {url}: {forever:?}"
        );
    }
    // The workload wrote keys of every primitive (most still live): leading windows,
    // coalescing windows, debounce bursts and outcomes, idempotency records and fences,
    // rate-limit states.
    assert!(seen >= 50, "only {seen} keys");
    for suffix in [":t", ":w", ":d", ":i", ":in", ":r"] {
        assert!(
            suffixes.contains(suffix),
            "no {suffix} key among {suffixes:?}"
        );
    }
    assert_eq!(redis.stats().breaker.failures, 0);
    runtime.shutdown(Duration::from_secs(1)).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn every_key_written_by_a_mixed_workload_has_a_ttl() {
    if let Some(node) = RedisNode::start("every_key_has_a_ttl_on_a_single_node") {
        every_key_has_a_ttl(&[node.url()], false).await;
    }
    if let Some(cluster) = RedisCluster::start("every_key_has_a_ttl_on_a_cluster") {
        every_key_has_a_ttl(&cluster.urls(), true).await;
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn stats_show_round_trips_reloads_reconnects_and_breaker_transitions() {
    let Some(mut node) = RedisNode::start("stats_show_operations") else {
        return;
    };
    let redis = Redis::builder(node.url())
        .with_breaker(
            BreakerConfig::default()
                .with_failures(2)
                .with_cooldown(Duration::from_millis(200)),
        )
        .connect()
        .await
        .expect("connects");
    let limiter = Limiter::builder(Gcra::new(100, MINUTE).expect("gcra"))
        .with_store(redis.clone())
        .build();
    // A limiter's first call reads the overrides kept in the store: read them first.
    limiter.refresh_overrides().await.expect("reads overrides");
    let start = redis.stats();
    limiter.check_async("k").await.expect("decides");
    let after = redis.stats();
    assert_eq!(after.commands, start.commands + 1, "one round trip");
    // A flushed script cache: the next call reloads its script, once.
    node.cli(&["SCRIPT", "FLUSH"]).expect("SCRIPT FLUSH");
    limiter.check_async("k").await.expect("decides");
    limiter.check_async("k").await.expect("decides");
    assert_eq!(redis.stats().script_reloads, after.script_reloads + 1);
    // The server goes away: failures open the breaker, which then refuses.
    node.kill();
    for _ in 0..3 {
        assert!(limiter.check_async("k").await.is_err());
    }
    let down = redis.stats();
    assert_eq!(down.breaker.state, BreakerState::Open);
    assert_eq!(down.breaker.opened, 1);
    assert!(down.breaker.refused >= 1, "{down:?}");
    // It comes back (empty: the script is reloaded): a probe after the cooldown closes the
    // breaker, and the client has reconnected.
    node.restart();
    let deadline = tokio::time::Instant::now() + Duration::from_secs(10);
    while limiter.check_async("k").await.is_err() {
        assert!(
            tokio::time::Instant::now() < deadline,
            "{:?}",
            redis.stats()
        );
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
    let up = redis.stats();
    assert_eq!(up.breaker.state, BreakerState::Closed);
    assert!(up.breaker.probes >= 1, "{up:?}");
    assert_eq!(up.breaker.recoveries, 1, "{up:?}");
    assert!(up.reconnects >= 1, "{up:?}");
    assert!(up.script_reloads >= after.script_reloads + 2, "{up:?}");
}

#[cfg(feature = "metrics")]
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_metrics_export_carries_the_redis_figures() {
    use metrics_util::debugging::{DebugValue, DebuggingRecorder};

    let Some(node) = RedisNode::start("the_metrics_export_carries_redis") else {
        return;
    };
    let (runtime, redis) = instance(&[node.url()], false).await;
    let limiter = Limiter::builder(Gcra::new(1, MINUTE).expect("gcra"))
        .with_store(redis.clone())
        .build();
    limiter.check_async("k").await.expect("decides");
    // Denied until the subscription is live, then answered locally.
    let deadline = tokio::time::Instant::now() + Duration::from_secs(10);
    while redis.stats().local_answers == 0 {
        assert!(!limiter.check_async("k").await.expect("decides").allowed);
        assert!(tokio::time::Instant::now() < deadline);
        tokio::time::sleep(Duration::from_millis(5)).await;
    }
    let recorder = DebuggingRecorder::new();
    let snapshotter = recorder.snapshotter();
    metrics::with_local_recorder(&recorder, || runtime.export_metrics());
    let stats = redis.stats();
    let mut seen = std::collections::HashMap::new();
    for (key, _, _, value) in snapshotter.snapshot().into_vec() {
        seen.insert(key.key().name().to_owned(), value);
    }
    let counter = |name: &str| match seen.get(name) {
        Some(DebugValue::Counter(n)) => *n,
        other => panic!("{name}: {other:?}"),
    };
    assert_eq!(counter("throttlebeam_redis_commands_total"), stats.commands);
    assert_eq!(
        counter("throttlebeam_redis_local_answers_total"),
        stats.local_answers
    );
    assert!(counter("throttlebeam_redis_local_answers_total") >= 1);
    // A new server knew no script: the first call of each was sent again with its text.
    assert_eq!(
        counter("throttlebeam_redis_script_reloads_total"),
        stats.script_reloads
    );
    assert!(stats.script_reloads >= 1);
    for name in [
        "throttlebeam_redis_reconnects_total",
        "throttlebeam_redis_failovers_total",
        "throttlebeam_redis_breaker_opened_total",
        "throttlebeam_redis_breaker_probes_total",
        "throttlebeam_redis_breaker_recoveries_total",
    ] {
        assert_eq!(counter(name), 0, "{name}");
    }
    assert!(matches!(
        seen.get("throttlebeam_redis_breaker_state"),
        Some(DebugValue::Gauge(g)) if g.into_inner() == 0.0
    ));
    assert!(matches!(
        seen.get("throttlebeam_redis_local_answer_keys"),
        Some(DebugValue::Gauge(g)) if g.into_inner() == 1.0
    ));
    runtime.shutdown(Duration::from_secs(1)).await;
}
