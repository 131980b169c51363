//! Every documentation example that says it shares a store across instances, run against a
//! real `redis-server` (doctests have no server): issue 49 item 6. Each builds what its
//! example builds, as written there (the server's URL aside), twice, as two instances, and
//! checks that they share one limit.
//!
//! - `RateLimitLayer::new` (src/http/rate_limit.rs) and the README's limiter built from a
//!   runtime: a runtime from the environment, which connects in the background, and a limiter
//!   built `with_runtime_store`, whose override set on one instance applies on the other. Run
//!   in a process of its own, with `THROTTLEBEAM_REDIS_URL` set.
//! - `Redis` (src/store/redis.rs): a connected `Redis` as a limiter's store.
//! - README, "Across instances": a `Redis` with a prefix, shared by a runtime and a limiter
//!   (its PostgreSQL half is tested in tests/postgres_runtime.rs).
#![cfg(all(feature = "redis", feature = "http"))]

mod support;

use std::convert::Infallible;
use std::net::SocketAddr;
use std::num::NonZeroU32;
use std::process::Command;
use std::time::Duration;

use bytes::Bytes;
use http::{Request, Response};
use http_body_util::Full;
use support::redis::RedisNode;
use throttlebeam::Runtime;
use throttlebeam::http::RateLimitLayer;
use throttlebeam::rate_limit::{Enforcer, Gcra, GcraState, Limiter};
use throttlebeam::store::{REDIS_CLUSTER_ENV, REDIS_URL_ENV, Redis};
use tower::{Service, ServiceBuilder, ServiceExt};

/// How long a background connection may take on a busy machine.
const PATIENCE: Duration = Duration::from_secs(30);

/// Set in the process that runs [`the_rate_limit_layer_example_in_its_own_process`].
const CHILD: &str = "THROTTLEBEAM_TEST_DOC_EXAMPLE_CHILD";

/// A request from `peer` through `layer`: its status and `RateLimit-Remaining`, if any.
async fn request(layer: &RateLimitLayer, peer: [u8; 4]) -> (u16, Option<String>) {
    let mut service =
        ServiceBuilder::new()
            .layer(layer.clone())
            .service_fn(|_req: Request<Full<Bytes>>| async {
                Ok::<_, Infallible>(Response::new(Full::new(Bytes::new())))
            });
    let mut req = Request::get("/").body(Full::new(Bytes::new())).unwrap();
    req.extensions_mut()
        .insert(SocketAddr::from((peer, 40_000)));
    let response = service.ready().await.unwrap().call(req).await.unwrap();
    let remaining = response
        .headers()
        .get("ratelimit-remaining")
        .map(|v| v.to_str().unwrap().to_owned());
    (response.status().as_u16(), remaining)
}

/// Sends requests from `peer` through `layer` until one is decided by the store (it carries
/// the limit's headers): the instance's background connection is up.
async fn until_connected(layer: &RateLimitLayer, peer: [u8; 4]) {
    let deadline = tokio::time::Instant::now() + PATIENCE;
    loop {
        let (status, remaining) = request(layer, peer).await;
        if remaining.is_some() {
            return;
        }
        // Not connected yet: the fail mode (open) passes the request, with no headers.
        assert_eq!(status, 200);
        assert!(
            tokio::time::Instant::now() < deadline,
            "never connected within {PATIENCE:?}"
        );
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
}

type RuntimeLimiter = Limiter<Gcra, throttlebeam::rate_limit::RuntimeStore<GcraState>>;

/// The example of `RateLimitLayer::new` (and of the README's limiter built from a runtime),
/// as written, for one instance; with its limiter.
async fn rate_limit_layer_example()
-> Result<(RateLimitLayer, RuntimeLimiter), Box<dyn std::error::Error>> {
    let runtime = Runtime::builder().with_redis_from_env().start().await?;
    let limiter = Limiter::builder(Gcra::new(100, Duration::from_secs(60))?)
        .with_runtime_store(&runtime)
        .build();
    let layer = RateLimitLayer::new(Enforcer::new(limiter.clone()));
    // The runtime lives as long as the test: its connection with it.
    std::mem::forget(runtime);
    Ok((layer, limiter))
}

/// Runs only in the process [`the_rate_limit_layer_example_shares_one_limit`] starts, with
/// `THROTTLEBEAM_REDIS_URL` set: two instances built as the example builds them share one
/// limit of 100 a minute once connected, and before that neither decides in memory.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_rate_limit_layer_example_in_its_own_process() {
    if std::env::var_os(CHILD).is_none() {
        return;
    }
    let ((a, on_a), (b, on_b)) = (
        rate_limit_layer_example().await.unwrap(),
        rate_limit_layer_example().await.unwrap(),
    );
    until_connected(&a, [10, 0, 0, 1]).await;
    until_connected(&b, [10, 0, 0, 2]).await;
    let client = [10, 0, 0, 3];
    for i in 0..100 {
        let layer = if i % 2 == 0 { &a } else { &b };
        let (status, remaining) = request(layer, client).await;
        assert_eq!(status, 200, "request {i}");
        assert_eq!(remaining, Some((99 - i).to_string()), "request {i}");
    }
    assert_eq!(request(&a, client).await.0, 429, "one limit for both");
    assert_eq!(request(&b, client).await.0, 429, "one limit for both");
    // The README's override, set on A, applies on B.
    on_a.set_override(
        "customer:7",
        Gcra::new(1_000, Duration::from_secs(60)).unwrap(),
    )
    .await
    .unwrap();
    let deadline = tokio::time::Instant::now() + PATIENCE;
    while on_b.check_async("customer:7").await.unwrap().limit != 1_000 {
        assert!(tokio::time::Instant::now() < deadline, "B never applied it");
        tokio::time::sleep(Duration::from_millis(10)).await;
    }
    println!("the rate limit layer's example shares one limit");
}

#[test]
fn the_rate_limit_layer_example_shares_one_limit() {
    if std::env::var_os(CHILD).is_some() {
        return;
    }
    let Some(node) = RedisNode::start("the_rate_limit_layer_example_shares_one_limit") else {
        return;
    };
    let test = "the_rate_limit_layer_example_in_its_own_process";
    let out = Command::new(std::env::current_exe().unwrap())
        .args(["--exact", test, "--nocapture", "--test-threads", "1"])
        .env(CHILD, "1")
        .env(REDIS_URL_ENV, node.url())
        .env_remove(REDIS_CLUSTER_ENV)
        .output()
        .unwrap();
    let (stdout, stderr) = (
        String::from_utf8_lossy(&out.stdout),
        String::from_utf8_lossy(&out.stderr),
    );
    assert!(
        out.status.success(),
        "the example's test failed:\n{stdout}\n{stderr}"
    );
    assert!(
        stdout.contains("the rate limit layer's example shares one limit"),
        "the example's test did not run:\n{stdout}\n{stderr}"
    );
}

/// The example of `Redis` (src/store/redis.rs): a limiter of 100 a second on a connected
/// `Redis`; two instances share it.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_redis_store_example_shares_one_limit() {
    let Some(node) = RedisNode::start("the_redis_store_example_shares_one_limit") else {
        return;
    };
    let mut limiters = Vec::new();
    for _ in 0..2 {
        let redis = Redis::builder(node.url()).connect().await.unwrap();
        let limiter = Limiter::builder(Gcra::per_second(NonZeroU32::new(100).unwrap()))
            .with_store(redis)
            .build();
        limiters.push(limiter);
    }
    let mut allowed = 0;
    let start = std::time::Instant::now();
    for i in 0..400 {
        if limiters[i % 2].check_async("doc").await.unwrap().allowed {
            allowed += 1;
        }
    }
    shared_burst(allowed, start.elapsed());
}

/// What 400 checks alternating between two instances of a limit of 100 a second (a burst of
/// 100, one more every 10 ms) admit in `elapsed` when the instances share it: the burst and
/// what came back meanwhile. Each instance on its own would admit twice that.
fn shared_burst(allowed: usize, elapsed: Duration) {
    let refilled = usize::try_from(elapsed.as_millis() / 10).unwrap() + 2;
    assert!(
        (100..=100 + refilled).contains(&allowed),
        "{allowed} admitted in {elapsed:?} by a limit of 100 a second shared by two instances"
    );
}

/// README, "Across instances": a `Redis` with the prefix `billing` for a runtime and a
/// limiter of 100 a second; two instances share the limit, and its keys carry the prefix.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_readmes_across_instances_example_shares_one_limit() {
    let Some(node) = RedisNode::start("the_readmes_across_instances_example") else {
        return;
    };
    let mut enforcers = Vec::new();
    for _ in 0..2 {
        let redis = Redis::builder(node.url())
            .with_prefix("billing")
            .connect()
            .await
            .unwrap();
        let runtime = Runtime::builder()
            .with_redis(redis.clone())
            .start()
            .await
            .unwrap();
        let limiter = Limiter::builder(Gcra::new(100, Duration::from_secs(1)).unwrap())
            .with_store(redis)
            .build();
        let enforcer = Enforcer::new(limiter);
        enforcers.push((runtime, enforcer));
    }
    let mut allowed = 0;
    let start = std::time::Instant::now();
    for i in 0..400 {
        let e = enforcers[i % 2]
            .1
            .enforce_async("readme", NonZeroU32::MIN)
            .await;
        allowed += usize::from(e.allowed);
    }
    shared_burst(allowed, start.elapsed());
    let keys = node.cli(&["KEYS", "{billing:readme}*"]).unwrap();
    assert!(keys.contains("{billing:readme}:r"), "{keys}");
}

/// Issue 49 item 6: a limiter built from a runtime that connects to Redis in the background
/// follows it. Before the server is up, every check fails as during an outage (never decided
/// in memory), and `Runtime::redis()`, `None`, warns that a store picked by it would stay in
/// memory; once the server is up, checks are decided there, as another instance sees.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_limiter_built_from_a_connecting_runtime_follows_its_connection() {
    let port = support::redis::free_port(false);
    let url = format!("redis://127.0.0.1:{port}");
    let events = support::Events::default();
    let _capture = events.install();
    let runtime = Runtime::builder()
        .with_redis_connecting(Redis::builder(url.clone()))
        .start()
        .await
        .unwrap();
    let gcra = Gcra::new(10, Duration::from_secs(60)).unwrap();
    let limiter = Limiter::builder(gcra).with_runtime_store(&runtime).build();
    assert!(limiter.store().is_shared());
    let err = limiter.check_async("k").await.unwrap_err();
    assert!(err.is_store(), "{err:?}");
    let mut causes = String::new();
    let mut cause = std::error::Error::source(&err);
    while let Some(c) = cause {
        causes.push_str(&format!("{c}: "));
        cause = c.source();
    }
    assert!(causes.contains("redis is not connected yet"), "{causes}");
    assert!(runtime.redis().is_none());
    assert!(runtime.redis().is_none());
    let warned = events.at(tracing::Level::WARN);
    let said = warned
        .iter()
        .filter(|m| m.contains("Runtime::redis() is None"))
        .count();
    assert_eq!(said, 1, "warned once: {warned:?}");
    let Some(node) = RedisNode::start_on("a_limiter_follows_a_connecting_runtime", port) else {
        return;
    };
    let deadline = tokio::time::Instant::now() + PATIENCE;
    let first = loop {
        match limiter.check_async("k").await {
            Ok(d) => break d,
            Err(e) => {
                assert!(e.is_store(), "{e:?}");
                assert!(tokio::time::Instant::now() < deadline, "never connected");
                tokio::time::sleep(Duration::from_millis(20)).await;
            }
        }
    };
    assert_eq!(first.remaining, 9);
    // Another instance, on the same server, sees that unit spent.
    let other = Limiter::builder(gcra)
        .with_store(Redis::builder(node.url()).connect().await.unwrap())
        .build();
    assert_eq!(other.peek_async("k").await.unwrap().remaining, 9);
}
