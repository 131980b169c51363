//! Bounded memory on default settings (issue "Foundation hardening", item 8).
//!
//! Run: `cargo bench --bench memory_bounds` (release; about two minutes).
//! `cargo bench --bench memory_bounds -- --quick` runs a tenth of the keys.
//!
//! Pushes 10 million distinct keys through the leading throttle, idempotency,
//! the rate limiter and the coalescing throttle, and 1 million pending
//! debounced keys, each on a fresh default runtime, and checks that resident
//! memory stays within the documented bound and that every call either
//! succeeded or got a typed error (the key cap), never an abort. Prints one
//! `bounds` line per primitive and exits non-zero if a bound is broken.

#[path = "support/figures.rs"]
#[allow(dead_code)]
mod figures;
use figures::selected;

use std::collections::BTreeMap;
use std::time::{Duration, Instant};

use throttlebeam::rate_limit::{Gcra, Limiter};
use throttlebeam::{Error, Runtime, runtime::DEFAULT_MAX_KEYS, runtime::ShutdownPolicy};

/// Resident set size of this process, bytes.
fn rss() -> u64 {
    let statm = std::fs::read_to_string("/proc/self/statm").unwrap_or_default();
    let pages: u64 = statm
        .split_whitespace()
        .nth(1)
        .and_then(|p| p.parse().ok())
        .unwrap_or(0);
    pages * 4096
}

/// What happened to the calls of one scenario.
#[derive(Default)]
struct Tally {
    ok: u64,
    errors: BTreeMap<&'static str, u64>,
    peak: u64,
}

impl Tally {
    fn error(&mut self, e: &Error) {
        let kind = match e {
            Error::TooManyKeys { .. } => "too_many_keys",
            _ => "other",
        };
        *self.errors.entry(kind).or_default() += 1;
    }

    fn sample(&mut self, base: u64) {
        self.peak = self.peak.max(rss().saturating_sub(base));
    }
}

fn report(name: &str, keys: u64, tally: &Tally, bound: u64, started: Instant) -> bool {
    let ok = tally.peak <= bound && !tally.errors.contains_key("other");
    println!(
        "bounds {name}: {keys} keys in {:.1} s, {} ok, errors {:?}, peak +{:.1} MiB (bound {:.1} MiB): {}",
        started.elapsed().as_secs_f64(),
        tally.ok,
        tally.errors,
        tally.peak as f64 / 1048576.0,
        bound as f64 / 1048576.0,
        if ok { "within" } else { "BROKEN" }
    );
    ok
}

const MIB: u64 = 1 << 20;

async fn leading_throttle(keys: u64) -> bool {
    let runtime = Runtime::start().await.expect("runtime");
    let throttle = runtime.throttle();
    let (base, started, mut tally) = (rss(), Instant::now(), Tally::default());
    for i in 0..keys {
        match throttle
            .call(&format!("t:{i}"), Duration::from_secs(3600), || async {
                Ok::<_, std::io::Error>(())
            })
            .await
        {
            Ok(_) => tally.ok += 1,
            Err(e) => tally.error(&e),
        }
        if i % 100_000 == 0 {
            tally.sample(base);
        }
    }
    tally.sample(base);
    // An open window costs under 256 B; the default key cap bounds them.
    let bound = DEFAULT_MAX_KEYS as u64 * 256 + 64 * MIB;
    runtime.shutdown(Duration::from_secs(5)).await;
    report("leading_throttle", keys, &tally, bound, started)
}

async fn idempotency(keys: u64) -> bool {
    let runtime = Runtime::start().await.expect("runtime");
    let idempotency = runtime.idempotency();
    let (base, started, mut tally) = (rss(), Instant::now(), Tally::default());
    for i in 0..keys {
        match idempotency
            .run(&format!("i:{i}"), move || async move {
                Ok::<_, std::io::Error>(i)
            })
            .await
        {
            Ok(_) => tally.ok += 1,
            Err(e) => tally.error(&e),
        }
        if i % 100_000 == 0 {
            tally.sample(base);
        }
    }
    tally.sample(base);
    let stats = idempotency.stats();
    assert!(stats.stored_results <= throttlebeam::idempotency::DEFAULT_MAX_IDEMPOTENCY_RESULTS);
    // Stored results are capped (about 200 B each, 1 KiB allowed here).
    let bound = throttlebeam::idempotency::DEFAULT_MAX_IDEMPOTENCY_RESULTS as u64 * 1024 + 64 * MIB;
    runtime.shutdown(Duration::from_secs(5)).await;
    report("idempotency", keys, &tally, bound, started)
}

fn rate_limiter(keys: u64) -> bool {
    let limiter = Limiter::new(Gcra::new(10, Duration::from_secs(3600)).expect("quota"));
    let (base, started, mut tally) = (rss(), Instant::now(), Tally::default());
    for i in 0..keys {
        match limiter.check(&format!("r:{i}")) {
            Ok(_) => tally.ok += 1,
            Err(_) => *tally.errors.entry("other").or_default() += 1,
        }
        if i % 100_000 == 0 {
            tally.sample(base);
        }
    }
    tally.sample(base);
    let stats = limiter.stats();
    // The memory store holds at most its cap of keys, 48 B of entry each
    // plus the map's own overhead: 256 B allowed per key here.
    let bound = throttlebeam::rate_limit::DEFAULT_LIMITER_MAX_KEYS as u64 * 256 + 64 * MIB;
    println!(
        "bounds rate_limiter: keys held {}, evictions {}",
        stats.keys, stats.evictions
    );
    report("rate_limiter", keys, &tally, bound, started)
}

async fn coalescing_throttle(keys: u64) -> bool {
    let runtime = Runtime::start().await.expect("runtime");
    let throttle = runtime
        .coalesce("c:")
        .with_window(Duration::from_secs(3600))
        .build::<u64>()
        .expect("throttle");
    let (base, started, mut tally) = (rss(), Instant::now(), Tally::default());
    for i in 0..keys {
        match throttle
            .call(&i.to_string(), move |_| async move {
                Ok::<_, std::io::Error>(i)
            })
            .await
        {
            Ok(_) => tally.ok += 1,
            Err(e) => tally.error(&e),
        }
        if i % 100_000 == 0 {
            tally.sample(base);
        }
    }
    tally.sample(base);
    // An open window with nothing pending costs under 256 B in the registry
    // (and about as much in a window store, when one is passed); capped.
    let bound = DEFAULT_MAX_KEYS as u64 * 512 + 64 * MIB;
    throttle.destroy().await;
    runtime.shutdown(Duration::from_secs(5)).await;
    report("coalescing_throttle", keys, &tally, bound, started)
}

async fn debounce(keys: u64) -> bool {
    // Default settings, except that shutdown drops the pending hour-long
    // functions instead of running a million of them.
    let runtime = Runtime::builder()
        .with_shutdown_policy(ShutdownPolicy::Drop)
        .start()
        .await
        .expect("runtime");
    let debounce = runtime.debounce();
    let (base, started, mut tally) = (rss(), Instant::now(), Tally::default());
    for i in 0..keys {
        match debounce.call(&format!("d:{i}"), Duration::from_secs(3600), || async {
            Ok::<_, std::io::Error>(())
        }) {
            Ok(_) => tally.ok += 1,
            Err(e) => tally.error(&e),
        }
        if i % 100_000 == 0 {
            tally.sample(base);
        }
    }
    tally.sample(base);
    // A pending key is a slot plus a live process with its timer: 2 KiB.
    let bound = keys.min(DEFAULT_MAX_KEYS as u64) * 2048 + 64 * MIB;
    runtime.shutdown(Duration::from_secs(5)).await;
    report("debounce_pending", keys, &tally, bound, started)
}

fn main() {
    let quick = std::env::args().any(|a| a == "--quick" || a == "--test");
    let scale = if quick { 10 } else { 1 };
    let rt = tokio::runtime::Builder::new_multi_thread()
        .worker_threads(2)
        .enable_all()
        .build()
        .expect("tokio");
    let ten_million = 10_000_000 / scale;
    let one_million = 1_000_000 / scale;
    // `cargo bench --bench memory_bounds -- coalescing` runs only the rows
    // whose name contains one of the words given.
    let mut ok = true;
    if selected("leading_throttle") {
        ok &= rt.block_on(leading_throttle(ten_million));
    }
    if selected("idempotency") {
        ok &= rt.block_on(idempotency(ten_million));
    }
    if selected("rate_limiter") {
        ok &= rate_limiter(ten_million);
    }
    if selected("coalescing_throttle") {
        ok &= rt.block_on(coalescing_throttle(ten_million));
    }
    if selected("debounce_pending") {
        ok &= rt.block_on(debounce(one_million));
    }
    if !ok {
        std::process::exit(1);
    }
}
