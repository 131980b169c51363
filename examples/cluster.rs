//! Two instances sharing one Redis: a leading throttle, a coalescing
//! throttle, an idempotent payment and a rate limit that agree across them,
//! and what happens when Redis goes away.
//!
//! Run: `cargo run --features redis --example cluster`
//!
//! Uses `THROTTLEBEAM_REDIS_URL` if set; otherwise starts its own
//! `redis-server` on a free loopback port (and stops it at the end).

use std::convert::Infallible;
use std::net::TcpListener;
use std::num::NonZeroU32;
use std::process::{Child, Command, Stdio};
use std::time::Duration;

use throttlebeam::rate_limit::{Enforcer, FailMode, Gcra, Limiter};
use throttlebeam::store::{BreakerConfig, REDIS_URL_ENV, Redis};
use throttlebeam::{Runtime, ThrottleOutcome, coalesce::Phase};

/// A `redis-server` this example started, killed when dropped.
struct OwnServer {
    port: u16,
    child: Option<Child>,
}

impl OwnServer {
    fn start(port: u16) -> Result<Self, Box<dyn std::error::Error>> {
        let child = Command::new("redis-server")
            .args(["--port", &port.to_string(), "--bind", "127.0.0.1"])
            .args(["--save", "", "--appendonly", "no"])
            .stdout(Stdio::null())
            .stderr(Stdio::null())
            .spawn()
            .map_err(|e| format!("cannot start redis-server ({e}); set {REDIS_URL_ENV}"))?;
        let server = Self {
            port,
            child: Some(child),
        };
        for _ in 0..200 {
            if std::net::TcpStream::connect(("127.0.0.1", port)).is_ok() {
                return Ok(server);
            }
            std::thread::sleep(Duration::from_millis(10));
        }
        Err("redis-server did not start listening".into())
    }

    fn kill(&mut self) {
        if let Some(mut child) = self.child.take() {
            let _ = child.kill();
            let _ = child.wait();
        }
    }
}

impl Drop for OwnServer {
    fn drop(&mut self) {
        self.kill();
    }
}

/// One instance: its own connection and its own runtime.
async fn instance(url: &str) -> Result<(Runtime, Redis), Box<dyn std::error::Error>> {
    let redis = Redis::builder(url)
        .with_prefix("example")
        .with_command_timeout(Duration::from_millis(200))
        .with_breaker(
            BreakerConfig::default()
                .with_failures(3)
                .with_cooldown(Duration::from_secs(1)),
        )
        .connect()
        .await?;
    let runtime = Runtime::builder().with_redis(redis.clone()).start().await?;
    Ok((runtime, redis))
}

fn shown<T: std::fmt::Debug>(outcome: &ThrottleOutcome<T>) -> String {
    match outcome {
        ThrottleOutcome::Executed(v) => format!("executed ({v:?})"),
        ThrottleOutcome::Throttled { retry_after } => {
            format!("throttled, retry in {retry_after:?}")
        }
        #[allow(unreachable_patterns)]
        _ => "other".to_owned(),
    }
}

#[tokio::main]
async fn main() -> Result<(), Box<dyn std::error::Error>> {
    let mut own = None;
    let url = match std::env::var(REDIS_URL_ENV) {
        Ok(url) if !url.trim().is_empty() => url,
        _ => {
            let port = TcpListener::bind("127.0.0.1:0")?.local_addr()?.port();
            own = Some(OwnServer::start(port)?);
            println!("started redis-server on 127.0.0.1:{port}");
            format!("redis://127.0.0.1:{port}")
        }
    };
    let run = std::process::id();
    let (a, redis_a) = instance(&url).await?;
    let (b, redis_b) = instance(&url).await?;

    // 1. Leading throttle: whichever instance comes first leads; the other is throttled.
    println!("\n== leading throttle across instances ==");
    let key = format!("report:{run}");
    let window = Duration::from_secs(5);
    let first = a
        .throttle()
        .call(&key, window, || async { Ok::<_, Infallible>("a") })
        .await?;
    let second = b
        .throttle()
        .call(&key, window, || async { Ok::<_, Infallible>("b") })
        .await?;
    println!("instance a: {}", shown(&first));
    println!("instance b: {}", shown(&second));

    // 2. Coalescing throttle: both call at once; one leads, the other's call
    //    becomes the trailing run, one window later, never overlapping.
    println!("\n== coalescing throttle across instances ==");
    let window = Duration::from_millis(500);
    let ta = a
        .coalesce("sync:")
        .with_window(window)
        .with_store(redis_a.clone())
        .build::<String>()?;
    let tb = b
        .coalesce("sync:")
        .with_window(window)
        .with_store(redis_b.clone())
        .build::<String>()?;
    let started = tokio::time::Instant::now();
    let job = |who: &'static str| {
        move |phase: Phase| async move {
            let at = started.elapsed();
            println!("  instance {who} runs as {phase:?} at {at:?}");
            tokio::time::sleep(Duration::from_millis(100)).await;
            Ok::<_, Infallible>(format!("{who} ({phase:?})"))
        }
    };
    let key = format!("room:{run}");
    let (ra, rb) = tokio::join!(
        ta.call_and_wait(&key, job("a")),
        tb.call_and_wait(&key, job("b"))
    );
    println!("instance a got {:?}", ra?);
    println!("instance b got {:?}", rb?);

    // 3. Idempotency: the same payment reaches both instances (a client
    //    retried through the load balancer); it is charged once, and the
    //    other instance replays the stored receipt.
    println!("\n== one payment, two instances ==");
    let payment = format!("payment:{run}");
    let charge = |who: &'static str| {
        move || async move {
            println!("  instance {who} charges the card");
            tokio::time::sleep(Duration::from_millis(100)).await;
            Ok::<_, Infallible>(format!("receipt from {who}"))
        }
    };
    let (ia, ib) = (a.idempotency(), b.idempotency());
    let (pa, pb) = tokio::join!(ia.run(&payment, charge("a")), ib.run(&payment, charge("b")));
    let (pa, pb) = (pa?, pb?);
    println!(
        "instance a: {} {:?}",
        if pa.is_fresh() { "ran" } else { "replayed" },
        pa.value()
    );
    println!(
        "instance b: {} {:?}",
        if pb.is_fresh() { "ran" } else { "replayed" },
        pb.value()
    );

    // 4. A rate limit of 5 per minute per user, shared: the two instances
    //    draw on one budget.
    println!("\n== one rate limit, two instances ==");
    let limit = |redis: &Redis| -> Result<Limiter<Gcra, Redis>, Box<dyn std::error::Error>> {
        Ok(Limiter::builder(Gcra::new(5, Duration::from_secs(60))?)
            .with_store(redis.clone())
            .with_namespace(format!("api:{run}"))
            .build())
    };
    let (la, lb) = (limit(&redis_a)?, limit(&redis_b)?);
    for i in 0..4 {
        let da = la.check_async("user:42").await?;
        let db = lb.check_async("user:42").await?;
        println!(
            "request {i}: a {} ({} left), b {} ({} left)",
            if da.allowed { "allowed" } else { "limited" },
            da.remaining,
            if db.allowed { "allowed" } else { "limited" },
            db.remaining
        );
    }

    // 5. Redis goes away: throttles fall back to per-instance decisions and
    //    the breaker opens; idempotency fails closed; when Redis is back,
    //    they share again.
    let Some(server) = own.as_mut() else {
        println!("\n(skipping the outage demo: the server was given by {REDIS_URL_ENV})");
        return Ok(());
    };
    println!("\n== Redis goes away ==");
    server.kill();
    let window = Duration::from_secs(5);
    for i in 0..5 {
        // A fresh key per call, so each one tries Redis (a key known closed
        // is answered locally without trying).
        let key = format!("outage:{run}:{i}");
        let oa = a
            .throttle()
            .call(&key, window, move || async move { Ok::<_, Infallible>(i) })
            .await?;
        let ob = b
            .throttle()
            .call(&key, window, move || async move { Ok::<_, Infallible>(i) })
            .await?;
        println!("call {i}: a {}, b {}", shown(&oa), shown(&ob));
    }
    println!(
        "instance a breaker: {:?} (opened {} time(s)); both executed: each instance decided alone",
        redis_a.stats().breaker.state,
        redis_a.stats().breaker.opened
    );
    let key = format!("payment:{run}:outage");
    let refused = a
        .idempotency()
        .run(&key, || async {
            Ok::<_, Infallible>("never charged".to_owned())
        })
        .await;
    match refused {
        Err(e) => println!("a payment during the outage: refused, nothing charged ({e})"),
        Ok(outcome) => println!("a payment during the outage ran: {outcome:?}"),
    }
    let open = Enforcer::new(limit(&redis_a)?).with_fail_mode(FailMode::Open);
    let closed = Enforcer::new(limit(&redis_a)?).with_fail_mode(FailMode::Closed);
    let (o, c) = (
        open.enforce_async("user:7", NonZeroU32::MIN).await,
        closed.enforce_async("user:7", NonZeroU32::MIN).await,
    );
    println!(
        "a rate-limited request during the outage: fail open lets it through ({}, {:?}), \
         fail closed refuses it ({}, {:?})",
        o.allowed, o.outcome, c.allowed, c.outcome
    );

    println!("\n== Redis is back ==");
    let port = server.port;
    drop(own.take());
    let _restarted = OwnServer::start(port)?;
    tokio::time::sleep(Duration::from_millis(1_200)).await; // the breaker's cooldown
    let mut recovered = false;
    for attempt in 0..20 {
        let key = format!("recovered:{run}:{attempt}");
        let oa = a
            .throttle()
            .call(&key, window, || async { Ok::<_, Infallible>("a") })
            .await?;
        let ob = b
            .throttle()
            .call(&key, window, || async { Ok::<_, Infallible>("b") })
            .await?;
        if matches!(oa, ThrottleOutcome::Executed(_))
            && matches!(ob, ThrottleOutcome::Throttled { .. })
            && redis_a.ping().await.is_ok()
        {
            println!("attempt {attempt}: a {}, b {}", shown(&oa), shown(&ob));
            recovered = true;
            break;
        }
        tokio::time::sleep(Duration::from_millis(200)).await;
    }
    println!(
        "recovered: {recovered}; instance a breaker: {:?}",
        redis_a.stats().breaker.state
    );
    a.shutdown(Duration::from_secs(1)).await;
    b.shutdown(Duration::from_secs(1)).await;
    Ok(())
}
