//! Instructions per operation on the hot paths, each beside its anchor, counted by callgrind.
//!
//! Run: `cargo bench --bench icount` (needs `valgrind`; without it, one line and exit 0).
//! Filter by name: `cargo bench --bench icount -- gcra throttle`.
//!
//! Wall-time ratios on a shared machine swing from run to run; instruction counts do not: the
//! same binary executes the same instructions whatever else the machine does. For each
//! operation and each side, this binary runs itself under
//! `valgrind --tool=callgrind --toggle-collect=<measured function>` twice, with `N` and `2N`
//! operations, and prints the difference divided by `N`, so everything outside the measured
//! loop (the setup, the process's start and end) is not counted and what the loop costs once
//! cancels:
//!
//! `icount <name>: ours <instructions/op>, anchor <instructions/op>, ratio <ours/anchor>`
//!
//! Counted on the calling thread only: callgrind collects while that thread is inside the
//! measured function, and the runtimes here are current-thread tokio runtimes that do not run
//! while it is (async calls are polled once with a no-op waker: the measured paths complete
//! without waiting). Every operation goes over 10,000 keys that exist before counting starts.
//! The callgrind files of the `2N` runs are kept in `target/tmp/icount/` for
//! `callgrind_annotate --inclusive=yes <file>`.

use std::convert::Infallible;
use std::future::Future;
use std::hint::black_box;
use std::num::NonZeroU32;
use std::path::{Path, PathBuf};
use std::pin::pin;
use std::process::{Command, ExitCode, Stdio};
use std::task::{Context, Poll, Waker};
use std::time::{Duration, Instant};

use dashmap::DashMap;
use governor::{DefaultKeyedRateLimiter, Quota, RateLimiter};
use throttlebeam::rate_limit::{Gcra, Limiter, TokenBucket};

/// Keys every operation goes over.
const KEYS: usize = 10_000;
/// Operations of the shorter run; the longer one does twice as many.
const OPS: usize = 20_000;
const HOUR: Duration = Duration::from_secs(3600);
/// The child's instruction: `<operation> <side> <ops>`.
const CHILD_ENV: &str = "THROTTLEBEAM_ICOUNT";
/// Prefix of every measured function's name; the suffix is `<operation>_<side>`.
const MEASURED: &str = "icount_measured_";

/// An operation and its anchor.
struct Operation {
    name: &'static str,
    what: &'static str,
    anchor: &'static str,
}

const OPERATIONS: [Operation; 5] = [
    Operation {
        name: "gcra_check",
        what: "`Limiter::check`, GCRA, memory store, default clock",
        anchor: "governor keyed `check_key` (dashmap), same quota",
    },
    Operation {
        name: "token_bucket_check",
        what: "`Limiter::check`, token bucket, memory store, default clock",
        anchor: "governor keyed `check_key` (dashmap), same rate",
    },
    Operation {
        name: "throttle_closed",
        what: "leading throttle `call` on a closed window",
        anchor: "governor `check_key` on a limited key",
    },
    Operation {
        name: "idempotency_replay",
        what: "`IdempotencyHandle::run` on a completed key",
        anchor: "moka sync `Cache::get` with time to live",
    },
    Operation {
        name: "debounce_reset",
        what: "debounce `call` on a pending key",
        anchor: "DashMap `get_mut` writing a deadline and a value",
    },
];

fn main() -> ExitCode {
    if let Ok(job) = std::env::var(CHILD_ENV) {
        child(&job);
        return ExitCode::SUCCESS;
    }
    // `cargo bench` passes `--bench`; `cargo test --benches` would pass nothing to run.
    let words: Vec<String> = std::env::args()
        .skip(1)
        .filter(|a| !a.starts_with('-'))
        .collect();
    if Command::new("valgrind")
        .arg("--version")
        .stdout(Stdio::null())
        .stderr(Stdio::null())
        .status()
        .map_or(true, |s| !s.success())
    {
        println!(
            "icount: valgrind not found, nothing counted (install valgrind to run this bench)"
        );
        return ExitCode::SUCCESS;
    }
    let out_dir = out_dir();
    if let Err(err) = std::fs::create_dir_all(&out_dir) {
        eprintln!("icount: cannot create {}: {err}", out_dir.display());
        return ExitCode::FAILURE;
    }
    let exe = std::env::current_exe().expect("the bench's own path");
    for op in &OPERATIONS {
        if !(words.is_empty() || words.iter().any(|w| op.name.contains(w.as_str()))) {
            continue;
        }
        let count = |side: &str| -> Result<f64, String> {
            let short = callgrind(&exe, &out_dir, op.name, side, OPS)?;
            let long = callgrind(&exe, &out_dir, op.name, side, 2 * OPS)?;
            Ok((long as f64 - short as f64) / OPS as f64)
        };
        match count("ours").and_then(|ours| Ok((ours, count("anchor")?))) {
            Ok((ours, anchor)) => println!(
                "icount {}: ours {ours:.0}, anchor {anchor:.0}, ratio {:.2}",
                op.name,
                ours / anchor
            ),
            Err(err) => {
                eprintln!("icount {}: {err}", op.name);
                return ExitCode::FAILURE;
            }
        }
        println!("  ours: {}; anchor: {}", op.what, op.anchor);
    }
    println!("callgrind files: {}", out_dir.display());
    ExitCode::SUCCESS
}

/// Where the callgrind files go: cargo's temporary directory for benches, if known.
fn out_dir() -> PathBuf {
    option_env!("CARGO_TARGET_TMPDIR")
        .map_or_else(std::env::temp_dir, PathBuf::from)
        .join("icount")
}

/// Instructions counted inside `<operation>_<side>`'s measured function over `ops` operations.
fn callgrind(exe: &Path, dir: &Path, op: &str, side: &str, ops: usize) -> Result<u64, String> {
    let file = dir.join(format!("{op}.{side}.{ops}.callgrind"));
    let output = Command::new("valgrind")
        .arg("--tool=callgrind")
        .arg(format!("--callgrind-out-file={}", file.display()))
        .arg(format!("--toggle-collect=*{MEASURED}{op}_{side}*"))
        .arg(exe)
        .env(CHILD_ENV, format!("{op} {side} {ops}"))
        .stdout(Stdio::null())
        .output()
        .map_err(|e| format!("cannot run valgrind: {e}"))?;
    if !output.status.success() {
        return Err(format!(
            "the run under callgrind failed ({}): {}",
            output.status,
            String::from_utf8_lossy(&output.stderr)
        ));
    }
    let text = std::fs::read_to_string(&file)
        .map_err(|e| format!("cannot read {}: {e}", file.display()))?;
    let total = text
        .lines()
        .find_map(|l| {
            l.strip_prefix("totals:")
                .or_else(|| l.strip_prefix("summary:"))
        })
        .and_then(|v| v.split_whitespace().next()?.parse().ok())
        .ok_or_else(|| format!("no totals in {}", file.display()))?;
    if ops == OPS {
        // Only the longer run's file is kept, for callgrind_annotate.
        let _ = std::fs::remove_file(&file);
    }
    Ok(total)
}

/// Sets up `<operation> <side>` and runs its measured function `ops` times.
fn child(job: &str) {
    let mut words = job.split_whitespace();
    let (Some(op), Some(side), Some(ops)) = (words.next(), words.next(), words.next()) else {
        panic!("{CHILD_ENV}={job:?}: expected `<operation> <side> <ops>`");
    };
    let ops: usize = ops.parse().expect("a number of operations");
    let keys: Vec<String> = (0..KEYS).map(|i| format!("user:{i}")).collect();
    match (op, side) {
        ("gcra_check", "ours") => {
            let limiter = Limiter::new(Gcra::per_second(RATE));
            for key in &keys {
                limiter.check(key).expect("check");
            }
            icount_measured_gcra_check_ours(&limiter, &keys, ops);
        }
        ("token_bucket_check", "ours") => {
            let limiter = Limiter::new(TokenBucket::per_second(RATE, RATE));
            for key in &keys {
                limiter.check(key).expect("check");
            }
            icount_measured_token_bucket_check_ours(&limiter, &keys, ops);
        }
        ("gcra_check" | "token_bucket_check", "anchor") => {
            let governor: DefaultKeyedRateLimiter<String> =
                RateLimiter::keyed(Quota::per_second(RATE));
            for key in &keys {
                governor.check_key(key).expect("allowed");
            }
            if op == "gcra_check" {
                icount_measured_gcra_check_anchor(&governor, &keys, ops);
            } else {
                icount_measured_token_bucket_check_anchor(&governor, &keys, ops);
            }
        }
        ("throttle_closed", "ours") => runtime::throttle_closed(&keys, ops),
        ("throttle_closed", "anchor") => {
            let governor: DefaultKeyedRateLimiter<String> =
                RateLimiter::keyed(Quota::per_hour(NonZeroU32::MIN));
            for key in &keys {
                governor.check_key(key).expect("allowed");
            }
            icount_measured_throttle_closed_anchor(&governor, &keys, ops);
        }
        ("idempotency_replay", "ours") => runtime::idempotency_replay(&keys, ops),
        ("idempotency_replay", "anchor") => {
            let cache: moka::sync::Cache<String, u64> =
                moka::sync::Cache::builder().time_to_live(HOUR).build();
            for (i, key) in keys.iter().enumerate() {
                cache.insert(key.clone(), i as u64);
            }
            cache.run_pending_tasks();
            icount_measured_idempotency_replay_anchor(&cache, &keys, ops);
        }
        ("debounce_reset", "ours") => runtime::debounce_reset(&keys, ops),
        ("debounce_reset", "anchor") => {
            let map: DashMap<String, (Instant, u64)> = DashMap::new();
            for key in &keys {
                map.insert(key.clone(), (Instant::now() + HOUR, 0));
            }
            icount_measured_debounce_reset_anchor(&map, &keys, ops);
        }
        _ => panic!("{CHILD_ENV}={job:?}: unknown operation or side"),
    }
}

/// 50 per second: under callgrind a key's checks come far enough apart that each is allowed.
const RATE: NonZeroU32 = NonZeroU32::new(50).expect("non-zero");

/// Polls a future once with a no-op waker: the paths measured here complete without waiting,
/// so no executor sits in the count.
fn poll_once<F: Future>(f: F) -> Option<F::Output> {
    let mut f = pin!(f);
    match f.as_mut().poll(&mut Context::from_waker(Waker::noop())) {
        Poll::Ready(v) => Some(v),
        Poll::Pending => None,
    }
}

// The measured functions: one per operation and side, never inlined, so that callgrind can
// toggle collection on entering and leaving them. Each goes over the keys in order.

#[inline(never)]
fn icount_measured_gcra_check_ours(limiter: &Limiter<Gcra>, keys: &[String], ops: usize) {
    for i in 0..ops {
        black_box(limiter.check(&keys[i % KEYS]).map(|d| d.allowed).ok());
    }
}

#[inline(never)]
fn icount_measured_gcra_check_anchor(
    governor: &DefaultKeyedRateLimiter<String>,
    keys: &[String],
    ops: usize,
) {
    for i in 0..ops {
        black_box(governor.check_key(&keys[i % KEYS]).is_ok());
    }
}

#[inline(never)]
fn icount_measured_token_bucket_check_ours(
    limiter: &Limiter<TokenBucket>,
    keys: &[String],
    ops: usize,
) {
    for i in 0..ops {
        black_box(limiter.check(&keys[i % KEYS]).map(|d| d.allowed).ok());
    }
}

#[inline(never)]
fn icount_measured_token_bucket_check_anchor(
    governor: &DefaultKeyedRateLimiter<String>,
    keys: &[String],
    ops: usize,
) {
    for i in 0..ops {
        black_box(governor.check_key(&keys[i % KEYS]).is_ok());
    }
}

#[inline(never)]
fn icount_measured_throttle_closed_anchor(
    governor: &DefaultKeyedRateLimiter<String>,
    keys: &[String],
    ops: usize,
) {
    for i in 0..ops {
        black_box(governor.check_key(&keys[i % KEYS]).is_err());
    }
}

#[inline(never)]
fn icount_measured_idempotency_replay_anchor(
    cache: &moka::sync::Cache<String, u64>,
    keys: &[String],
    ops: usize,
) {
    for i in 0..ops {
        black_box(cache.get(keys[i % KEYS].as_str()));
    }
}

#[inline(never)]
fn icount_measured_debounce_reset_anchor(
    map: &DashMap<String, (Instant, u64)>,
    keys: &[String],
    ops: usize,
) {
    for i in 0..ops {
        if let Some(mut slot) = map.get_mut(keys[i % KEYS].as_str()) {
            *slot = (Instant::now() + HOUR, i as u64);
        }
    }
}

/// The operations on a throttlebeam runtime, on a current-thread tokio runtime that does not
/// run while the measured function does.
mod runtime {
    use super::*;
    use throttlebeam::{DebounceHandle, IdempotencyHandle, IdempotencyOutcome, Runtime};
    use throttlebeam::{ThrottleHandle, ThrottleOutcome};

    fn tokio() -> tokio::runtime::Runtime {
        tokio::runtime::Builder::new_current_thread()
            .enable_all()
            .build()
            .expect("tokio runtime")
    }

    /// The user function of every call: never run on the measured paths.
    async fn job() -> Result<u64, Infallible> {
        Ok(0)
    }

    async fn unit() -> Result<(), Infallible> {
        Ok(())
    }

    pub(super) fn throttle_closed(keys: &[String], ops: usize) {
        let rt = tokio();
        let runtime = rt.block_on(Runtime::start()).expect("runtime");
        let throttle = runtime.throttle();
        rt.block_on(async {
            for key in keys {
                let first = throttle.call(key, HOUR, unit).await.expect("call");
                assert!(!first.is_throttled());
            }
        });
        let _enter = rt.enter();
        let first = poll_once(throttle.call(&keys[0], HOUR, unit));
        assert!(matches!(first, Some(Ok(ThrottleOutcome::Throttled { .. }))));
        icount_measured_throttle_closed_ours(&throttle, keys, ops);
    }

    #[inline(never)]
    fn icount_measured_throttle_closed_ours(
        throttle: &ThrottleHandle,
        keys: &[String],
        ops: usize,
    ) {
        for i in 0..ops {
            black_box(poll_once(throttle.call(&keys[i % KEYS], HOUR, unit)));
        }
    }

    pub(super) fn idempotency_replay(keys: &[String], ops: usize) {
        let rt = tokio();
        let runtime = rt.block_on(Runtime::start()).expect("runtime");
        let idempotency = runtime.idempotency();
        rt.block_on(async {
            for key in keys {
                let first = idempotency.run(key, job).await.expect("run");
                assert!(first.is_fresh());
            }
        });
        let _enter = rt.enter();
        let replay = poll_once(idempotency.run(&keys[0], job));
        assert!(matches!(replay, Some(Ok(IdempotencyOutcome::Replay(0)))));
        icount_measured_idempotency_replay_ours(&idempotency, keys, ops);
    }

    #[inline(never)]
    fn icount_measured_idempotency_replay_ours(
        idempotency: &IdempotencyHandle,
        keys: &[String],
        ops: usize,
    ) {
        for i in 0..ops {
            black_box(poll_once(idempotency.run(&keys[i % KEYS], job)));
        }
    }

    pub(super) fn debounce_reset(keys: &[String], ops: usize) {
        let rt = tokio();
        let runtime = rt.block_on(Runtime::start()).expect("runtime");
        let debounce = runtime.debounce();
        let _enter = rt.enter();
        for key in keys {
            drop(debounce.call(key, HOUR, job).expect("call"));
        }
        // Every key pending with its timer armed, as after a burst's first call.
        rt.block_on(async {
            while runtime.stats().timers < keys.len() {
                tokio::task::yield_now().await;
            }
        });
        icount_measured_debounce_reset_ours(&debounce, keys, ops);
    }

    #[inline(never)]
    fn icount_measured_debounce_reset_ours(debounce: &DebounceHandle, keys: &[String], ops: usize) {
        for i in 0..ops {
            black_box(debounce.call(&keys[i % KEYS], HOUR, job).is_ok());
        }
    }
}
