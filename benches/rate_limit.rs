//! Rate-limit checks against governor's keyed limiter, same keys, same quota, same run.
//!
//! Run: `cargo bench --bench rate_limit`. After criterion's report it prints one line per
//! comparison: `compare <name>: ours <ns/op> ns, anchor <ns/op> ns, ratio <ours/anchor>`,
//! from short timed rounds alternating between the sides (medians; the ratio is the median
//! of adjacent pairs, which share the machine's load).
//!
//! Both sides read the same clock source once per check: governor's default clock is quanta,
//! so ours runs with [`QuantaClock`]. An extra line shows ours with the default
//! [`TokioClock`](throttlebeam::clock::TokioClock), which costs a `std` clock read more.

#[path = "support/figures.rs"]
#[allow(dead_code)]
mod figures;
use figures::median;

use std::hint::black_box;
use std::num::NonZeroU32;
use std::time::{Duration, Instant};

use criterion::Criterion;
use governor::{DefaultKeyedRateLimiter, Quota, RateLimiter};
use throttlebeam::clock::QuantaClock;
use throttlebeam::rate_limit::{Gcra, Limiter, Strategy, TokenBucket};

const KEYS: usize = 100_000;
const RATE: u32 = 50;

struct Fixture {
    keys: Vec<String>,
    gcra: Limiter<Gcra>,
    gcra_tokio_clock: Limiter<Gcra>,
    bucket: Limiter<TokenBucket>,
    governor: DefaultKeyedRateLimiter<String>,
}

impl Fixture {
    fn new() -> Self {
        let rate = NonZeroU32::new(RATE).expect("non-zero");
        let keys: Vec<String> = (0..KEYS).map(|i| format!("client:{i:06}")).collect();
        let fixture = Self {
            gcra: Limiter::builder(Gcra::per_second(rate))
                .with_clock(QuantaClock::new())
                .build(),
            gcra_tokio_clock: Limiter::new(Gcra::per_second(rate)),
            bucket: Limiter::builder(TokenBucket::per_second(rate, rate))
                .with_clock(QuantaClock::new())
                .build(),
            governor: RateLimiter::keyed(Quota::per_second(rate)),
            keys,
        };
        // Every key exists before timing: we measure checks, not inserts.
        for key in &fixture.keys {
            let _ = fixture.gcra.check(key);
            let _ = fixture.gcra_tokio_clock.check(key);
            let _ = fixture.bucket.check(key);
            let _ = fixture.governor.check_key(key);
        }
        fixture
    }
}

/// One side of a comparison: checks `ops` keys starting at `offset`, striding through all.
trait Side: Sync {
    fn run(&self, f: &Fixture, offset: usize, ops: u64);
}

struct Ours<S: Strategy>(fn(&Fixture) -> &Limiter<S>);
struct Governor;

impl<S: Strategy> Side for Ours<S> {
    fn run(&self, f: &Fixture, offset: usize, ops: u64) {
        let limiter = (self.0)(f);
        let mut i = offset;
        for _ in 0..ops {
            black_box(
                limiter
                    .check(&f.keys[i])
                    .map(|d| d.allowed)
                    .unwrap_or(false),
            );
            i = (i + 7) % KEYS;
        }
    }
}

impl Side for Governor {
    fn run(&self, f: &Fixture, offset: usize, ops: u64) {
        let mut i = offset;
        for _ in 0..ops {
            black_box(f.governor.check_key(&f.keys[i]).is_ok());
            i = (i + 7) % KEYS;
        }
    }
}

/// Wall time for `ops` checks spread over `threads` threads.
fn timed(side: &dyn Side, f: &Fixture, threads: usize, ops: u64) -> Duration {
    let per_thread = ops / threads as u64;
    let start = Instant::now();
    if threads == 1 {
        side.run(f, 0, ops);
    } else {
        std::thread::scope(|s| {
            for t in 0..threads {
                s.spawn(move || side.run(f, t * KEYS / threads, per_thread));
            }
        });
    }
    start.elapsed()
}

struct Comparison {
    name: &'static str,
    ours: &'static dyn Side,
    threads: usize,
}

static GCRA: Ours<Gcra> = Ours(|f| &f.gcra);
static GCRA_TOKIO_CLOCK: Ours<Gcra> = Ours(|f| &f.gcra_tokio_clock);
static BUCKET: Ours<TokenBucket> = Ours(|f| &f.bucket);
static GOVERNOR: Governor = Governor;

const COMPARISONS: [Comparison; 4] = [
    Comparison {
        name: "gcra_check_1t",
        ours: &GCRA,
        threads: 1,
    },
    Comparison {
        name: "gcra_check_2t",
        ours: &GCRA,
        threads: 2,
    },
    Comparison {
        name: "token_bucket_check",
        ours: &BUCKET,
        threads: 1,
    },
    Comparison {
        name: "gcra_check_1t_tokio_clock",
        ours: &GCRA_TOKIO_CLOCK,
        threads: 1,
    },
];

fn criterion_benches(c: &mut Criterion, f: &Fixture) {
    for cmp in &COMPARISONS {
        let mut group = c.benchmark_group(cmp.name);
        group.bench_function("ours", |b| {
            b.iter_custom(|iters| timed(cmp.ours, f, cmp.threads, iters))
        });
        group.bench_function("governor", |b| {
            b.iter_custom(|iters| timed(&GOVERNOR, f, cmp.threads, iters))
        });
        group.finish();
    }
}

/// ns/op of each side and their ratio, from short rounds that alternate between the sides,
/// so that both see the same machine load; the ratio is the median of adjacent pairs.
fn compare(cmp: &Comparison, f: &Fixture, rounds: usize, ops: u64) -> (f64, f64, f64) {
    let (mut ours, mut anchor, mut ratios) = (Vec::new(), Vec::new(), Vec::new());
    for round in 0..rounds {
        let per_op =
            |side: &dyn Side| timed(side, f, cmp.threads, ops).as_nanos() as f64 / ops as f64;
        // Alternate which side goes first.
        let (o, a) = if round % 2 == 0 {
            let o = per_op(cmp.ours);
            (o, per_op(&GOVERNOR))
        } else {
            let a = per_op(&GOVERNOR);
            (per_op(cmp.ours), a)
        };
        ours.push(o);
        anchor.push(a);
        ratios.push(o / a);
    }
    (median(&mut ours), median(&mut anchor), median(&mut ratios))
}

fn main() {
    let quick = std::env::args().any(|a| a == "--test");
    let f = Fixture::new();
    let mut c = Criterion::default()
        .warm_up_time(Duration::from_secs(1))
        .measurement_time(Duration::from_secs(3))
        .configure_from_args();
    criterion_benches(&mut c, &f);
    c.final_summary();

    // `cargo bench -- --test` only checks that the benches run: no figures then.
    if quick {
        return;
    }
    for cmp in &COMPARISONS {
        let (ours, anchor, ratio) = compare(cmp, &f, 21, 1_000_000);
        println!(
            "compare {}: ours {ours:.1} ns, anchor {anchor:.1} ns, ratio {ratio:.2}",
            cmp.name
        );
    }
}
