//! Run: cargo run --example quickstart
//!
//! The five primitives on the default in-memory runtime, with no set-up: a
//! debounced autosave, a throttled email, a coalescing (leading + trailing)
//! throttle, an idempotent payment, and a rate limit with a denial and its
//! HTTP headers. It prints what each primitive did.

use std::sync::Arc;
use std::sync::atomic::{AtomicU32, Ordering};
use std::time::Duration;

use throttlebeam::rate_limit::{Gcra, HeaderOptions, Limiter};
use throttlebeam::{
    Debounce, Idempotency, IdempotencyOptions, IdempotencyOutcome, Runtime, Throttle,
    ThrottleOutcome, coalesce::Phase,
};

#[derive(Debug)]
struct AppError(&'static str);

impl std::fmt::Display for AppError {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(self.0)
    }
}

impl std::error::Error for AppError {}

#[tokio::main]
async fn main() -> Result<(), Box<dyn std::error::Error>> {
    // Debounce: five keystrokes 20 ms apart, one save 100 ms after the last.
    let saves = Arc::new(AtomicU32::new(0));
    let mut last = None;
    for text in ["h", "he", "hel", "hell", "hello"] {
        let saves = Arc::clone(&saves);
        last = Some(Debounce::call(
            "autosave:doc-1",
            Duration::from_millis(100),
            move || async move {
                saves.fetch_add(1, Ordering::SeqCst);
                Ok::<_, AppError>(text.to_owned())
            },
        )?);
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
    if let Some(saved) = last {
        let saved = saved.await?;
        println!(
            "debounce: 5 calls -> {} save(s), saved {saved:?}",
            saves.load(Ordering::SeqCst)
        );
    }

    // Throttle: the first call runs, the rest of the window is turned away.
    for attempt in 1..=3 {
        match Throttle::call(
            "email:user-42",
            Duration::from_secs(60),
            move || async move { Ok::<_, AppError>(format!("email sent on attempt {attempt}")) },
        )
        .await?
        {
            ThrottleOutcome::Executed(what) => println!("throttle: {what}"),
            ThrottleOutcome::Throttled { retry_after } => {
                println!(
                    "throttle: attempt {attempt} throttled, retry in {:.0}s",
                    retry_after.as_secs_f64().ceil()
                );
            }
        }
    }

    // Idempotency: a client retries a payment with the same key; it is charged once.
    let charges = Arc::new(AtomicU32::new(0));
    for attempt in 1..=2 {
        let charges = Arc::clone(&charges);
        let options = IdempotencyOptions::new()
            .with_scope("tenant-7")
            .with_fingerprint("order-1001:4999");
        let outcome = Idempotency::run_with("pay:order-1001", options, move || async move {
            let n = charges.fetch_add(1, Ordering::SeqCst) + 1;
            Ok::<_, AppError>(format!("charge #{n} of 49.99"))
        })
        .await?;
        match outcome {
            IdempotencyOutcome::Fresh(receipt) => {
                println!("idempotency: attempt {attempt} ran: {receipt}")
            }
            IdempotencyOutcome::Replay(receipt) => {
                println!("idempotency: attempt {attempt} replayed: {receipt}")
            }
            // It ran, but a retry may not find it (never in memory while the runtime is up).
            IdempotencyOutcome::Unrecorded(receipt, why) => {
                println!("idempotency: attempt {attempt} ran, not recorded ({why}): {receipt}")
            }
        }
    }
    println!(
        "idempotency: charged {} time(s)",
        charges.load(Ordering::SeqCst)
    );

    // Coalescing throttle: the first call runs now; calls inside the window
    // coalesce into one trailing run whose value every waiter gets.
    let sync = Runtime::global()?
        .coalesce("sync:")
        .with_window(Duration::from_millis(200))
        .build::<String>()?;
    let leading = sync
        .call_and_wait("room-1", |phase| async move {
            Ok::<_, AppError>(format!("{phase:?} sync"))
        })
        .await?;
    println!("coalescing throttle: first call -> {leading}");
    let waiters: Vec<_> = (1..=3)
        .map(|n| {
            let sync = sync.clone();
            tokio::spawn(async move {
                sync.call_and_wait("room-1", move |phase| async move {
                    assert_eq!(phase, Phase::Trailing);
                    Ok::<_, AppError>(format!("trailing sync of call {n}"))
                })
                .await
            })
        })
        .collect();
    for (n, waiter) in waiters.into_iter().enumerate() {
        let value = waiter.await.expect("task ran")?;
        println!("coalescing throttle: call {} got {value:?}", n + 1);
    }
    println!(
        "coalescing throttle: 4 calls -> {} run(s)",
        sync.stats().leading_runs + sync.stats().trailing_runs
    );

    // Rate limiting: 2 requests per second per client; the third is denied
    // with a Retry-After and the standard headers.
    let limiter = Limiter::new(Gcra::new(2, Duration::from_secs(1))?);
    let headers = HeaderOptions::new();
    for request in 1..=3 {
        let decision = limiter.check("client:203.0.113.9")?;
        let verdict = if decision.allowed {
            "allowed"
        } else {
            "denied"
        };
        println!(
            "rate limit: request {request} {verdict}, remaining {}",
            decision.remaining
        );
        if !decision.allowed {
            for (name, value) in headers.headers(&decision, limiter.now_ms()).iter() {
                println!("rate limit:   {name}: {}", value.to_str().unwrap_or("?"));
            }
        }
    }
    Ok(())
}
