// Run: cargo run --example rate_limit
//! An API gateway's rate limiting: a per-client limit keyed by the client IP behind a trusted
//! proxy, a tiered per-second and per-day quota for a hashed API key, response headers, and a
//! shaper pacing outbound calls.

use std::net::IpAddr;
use std::num::NonZeroU32;
use std::time::Duration;

use http::HeaderMap;
use throttlebeam::rate_limit::{
    ClientIp, EnforceOutcome, Enforcer, FixedWindow, Gcra, HeaderOptions, KeyHasher, LeakyBucket,
    Limiter, PolicyName, RateLimitError, Tiered,
};

#[tokio::main(flavor = "current_thread")]
async fn main() -> Result<(), RateLimitError> {
    // 1. Per client IP: 5 requests per second, behind a load balancer in 10.0.0.0/8.
    let client_ip = ClientIp::new().with_trusted_proxies(["10.0.0.0/8"])?;
    let enforcer = Enforcer::new(Limiter::new(Gcra::new(5, Duration::from_secs(1))?))
        .with_headers(
            HeaderOptions::new()
                .with_structured(true)
                .with_policy(PolicyName::new("per-ip")?),
        )
        .on_limited(|key, d| println!("  limited {key}, retry in {} ms", d.retry_after_ms));

    let peer: IpAddr = "10.0.0.7".parse().expect("valid address");
    let mut request_headers = HeaderMap::new();
    request_headers.insert(
        "x-forwarded-for",
        "203.0.113.50".parse().expect("valid header"),
    );
    let key = client_ip.key_from_headers(peer, &request_headers);
    println!("client key: {key}");
    for i in 1..=7 {
        let result = enforcer.enforce(&key);
        let status = match result.outcome {
            EnforceOutcome::Ok => 200,
            EnforceOutcome::Limited => 429,
            EnforceOutcome::Error => 503,
            EnforceOutcome::Invalid => 400,
            _ => 500,
        };
        println!("request {i}: {status} {:?}", result.headers);
    }
    // A cost no quota can ever admit is refused as bad input, never a 429 with an absurd
    // Retry-After.
    let too_big = enforcer.enforce_n(&key, NonZeroU32::new(6).expect("non-zero"));
    println!("a request costing 6: {:?}", too_big.outcome);

    // 2. A hashed API key with two tiers: 2 per second and 3 per day, charged together.
    let hasher = KeyHasher::new("change me: a server-side secret")?;
    let api_key = hasher.hash("sk_live_customer_42");
    let tiers = Limiter::new(Tiered::new(
        Gcra::per_second(NonZeroU32::new(2).expect("non-zero")),
        FixedWindow::new(3, Duration::from_secs(86_400))?,
    ));
    for i in 1..=4 {
        let d = tiers.check(&api_key)?;
        println!(
            "api call {i}: allowed={} remaining={} retry_after={} ms",
            d.allowed, d.remaining, d.retry_after_ms
        );
    }

    // 3. Pace outbound calls at 20 per second, queueing at most 100 ms.
    let shaper = Limiter::new(LeakyBucket::new(
        20,
        Duration::from_secs(1),
        Duration::from_millis(100),
    )?);
    for i in 1..=4 {
        match shaper.reserve("upstream", 1).await {
            Ok(waited) => println!("outbound {i}: sent after {} ms", waited.as_millis()),
            Err(err) => println!("outbound {i}: {err}"),
        }
    }
    let stats = tiers.stats();
    println!(
        "tiers: {} allowed, {} denied, {} keys",
        stats.allowed, stats.denied, stats.keys
    );
    Ok(())
}
