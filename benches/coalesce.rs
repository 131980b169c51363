//! Coalescing throttle benches, each side by side with its anchor.
//!
//! - `coalesce`: a coalesced call on a key whose window is open, against the
//!   leading-only throttle's call on a key inside its window.
//! - `trailing_keys`: 100,000 keys each getting one leading and one coalesced
//!   call, end to end, against the leading-only throttle doing one executed
//!   and one throttled call per key; with peak memory per key while windows
//!   are open. Each side runs in a fresh child process so RSS figures are
//!   not skewed by memory the other side freed; the sides alternate for
//!   5 pairs of runs and the figures are their medians, as one run of
//!   either side varies by up to 2x on a shared VM.
//! - `idle_window`: memory per key whose window is open with nothing
//!   pending (one leading call each, every run finished): a timestamp in
//!   the registry and the store's entry, no process. Target: at most 256
//!   bytes, against the leading-only throttle's open window.
//!
//! Run: `cargo bench --bench coalesce`

#[path = "support/figures.rs"]
#[allow(dead_code)]
mod figures;
use figures::median;

use std::convert::Infallible;
use std::hint::black_box;
use std::process::Command;
use std::time::{Duration, Instant};

use criterion::Criterion;
use throttlebeam::{Coalesce, Runtime};

const KEYS: usize = 100_000;
const TASKS: usize = 2;
/// Longer than the call phase, so every window is still open (with its
/// trailing run pending) when the call phase ends and memory is read.
const KEY_WINDOW: Duration = Duration::from_secs(2);
/// The window of the warm-up keys: short, so the warm-up ends soon.
const WARM_WINDOW: Duration = Duration::from_millis(50);
/// Alternating runs of each side for `trailing_keys`.
const PAIRS: usize = 5;
const CHILD_ENV: &str = "THROTTLEBEAM_TRAILING_BENCH_CHILD";
const KEYS_ENV: &str = "THROTTLEBEAM_TRAILING_BENCH_KEYS";

fn tokio_runtime() -> tokio::runtime::Runtime {
    tokio::runtime::Builder::new_multi_thread()
        .worker_threads(2)
        .enable_all()
        .build()
        .expect("tokio runtime")
}

fn main() {
    if let Ok(side) = std::env::var(CHILD_ENV) {
        keys_child(&side);
        return;
    }
    // `cargo bench -- --test` only checks that the benches run: no figures then.
    let quick = std::env::args().any(|a| a == "--test");
    let rt = tokio_runtime();
    let (ours, anchor) = rt.block_on(async {
        let runtime = Runtime::builder().start().await.expect("runtime");
        (
            coalesced_call(&runtime).await,
            throttled_call(&runtime).await,
        )
    });

    let mut criterion = Criterion::default()
        .warm_up_time(Duration::from_millis(300))
        .measurement_time(Duration::from_secs(1))
        .sample_size(20)
        .configure_from_args();
    let mut group = criterion.benchmark_group("coalesce");
    group.bench_function("ours: coalesced call", |b| {
        b.iter_custom(|iters| rt.block_on(async { ours.run(iters).await }));
    });
    group.bench_function("anchor: leading-only throttled call", |b| {
        b.iter_custom(|iters| rt.block_on(async { anchor.run(iters).await }));
    });
    group.finish();
    criterion.final_summary();
    if quick {
        drop(rt);
        spawn_child("ours", 1_000);
        spawn_child("anchor", 1_000);
        spawn_child("idle", 1_000);
        return;
    }

    // Our own interleaved rounds for the comparison line: medians of 7.
    let (mut o, mut a) = (Vec::new(), Vec::new());
    for _ in 0..7 {
        let iters = 300_000;
        o.push(rt.block_on(ours.run(iters)).as_nanos() as f64 / iters as f64);
        a.push(rt.block_on(anchor.run(iters)).as_nanos() as f64 / iters as f64);
    }
    let (o, a) = (median(&mut o), median(&mut a));
    drop(rt);

    let (mut ours_runs, mut anchor_runs) = (Vec::new(), Vec::new());
    for _ in 0..PAIRS {
        ours_runs.push(spawn_child("ours", KEYS));
        anchor_runs.push(spawn_child("anchor", KEYS));
    }
    let ours_keys = KeysResult::median(&ours_runs);
    let anchor_keys = KeysResult::median(&anchor_runs);
    let idle_keys = spawn_child("idle", KEYS);
    println!();
    println!(
        "compare coalesce: ours {o:.1} ns, anchor {a:.1} ns, ratio {:.2}",
        o / a
    );
    println!(
        "compare trailing_keys: ours {:.1} ns, anchor {:.1} ns, ratio {:.2}",
        ours_keys.ns_per_key,
        anchor_keys.ns_per_key,
        ours_keys.ns_per_key / anchor_keys.ns_per_key
    );
    let ratios: Vec<String> = ours_runs
        .iter()
        .zip(&anchor_runs)
        .map(|(o, a)| format!("{:.2}", o.ns_per_key / a.ns_per_key))
        .collect();
    println!(
        "trailing_keys: medians of {PAIRS} alternating runs per side; ratio of each pair: {}",
        ratios.join(", ")
    );
    println!(
        "trailing_keys: ours {:.0} keys/s (anchor {:.0}), one leading + one coalesced call per key \
         from {TASKS} tasks; all {KEYS} keys closed {:.0} ms after the first call (minimum: call \
         phase + two {} ms windows = {:.0} ms); peak memory {:.0} bytes/key while windows are \
         open (anchor {:.0} bytes/key)",
        1e9 / ours_keys.ns_per_key,
        1e9 / anchor_keys.ns_per_key,
        ours_keys.end_to_end.as_secs_f64() * 1e3,
        KEY_WINDOW.as_millis(),
        (ours_keys.ns_per_key * KEYS as f64 / 1e6) + 2.0 * KEY_WINDOW.as_secs_f64() * 1e3,
        ours_keys.bytes_per_key,
        anchor_keys.bytes_per_key,
    );
    println!(
        "idle_window: {:.0} bytes per key whose window is open with nothing pending ({KEYS} keys, \
         no process; target 256), leading-only open window {:.0} bytes/key; once swept, \
         {:.0} bytes/key still held (coalescing run: {:.0})",
        idle_keys.bytes_per_key,
        anchor_keys.bytes_per_key,
        idle_keys.kept_per_key,
        ours_keys.kept_per_key,
    );
}

/// A key kept inside its window with a pending trailing run.
struct Coalesced {
    throttle: Coalesce<u64>,
}

impl Coalesced {
    async fn run(&self, iters: u64) -> Duration {
        let start = Instant::now();
        for i in 0..iters {
            // The closure captures a value, as real ones do: boxing it allocates.
            let ran = self
                .throttle
                .call("hot", move |_| async move { Ok::<_, Infallible>(i) })
                .await;
            black_box(ran.ok());
        }
        start.elapsed()
    }
}

async fn coalesced_call(runtime: &Runtime) -> Coalesced {
    let throttle = runtime
        .coalesce("bench:")
        .with_window(Duration::from_secs(3600))
        .build()
        .expect("throttle");
    let led = throttle
        .call("hot", |_| async { Ok::<_, Infallible>(0) })
        .await;
    assert_eq!(led.ok(), Some(true));
    Coalesced { throttle }
}

/// A key inside its leading-only window.
struct ThrottleOutcome {
    throttler: throttlebeam::ThrottleHandle,
}

impl ThrottleOutcome {
    async fn run(&self, iters: u64) -> Duration {
        let start = Instant::now();
        for i in 0..iters {
            let out = self
                .throttler
                .call("hot", Duration::from_secs(3600), move || async move {
                    Ok::<_, Infallible>(i)
                })
                .await;
            black_box(out.map(|o| o.is_throttled()).ok());
        }
        start.elapsed()
    }
}

async fn throttled_call(runtime: &Runtime) -> ThrottleOutcome {
    let throttler = runtime.throttle();
    let first = throttler
        .call("hot", Duration::from_secs(3600), || async {
            Ok::<_, Infallible>(0u64)
        })
        .await
        .expect("executes");
    assert!(!first.is_throttled());
    ThrottleOutcome { throttler }
}

// ---------------------------------------------------------------- trailing_keys

struct KeysResult {
    ns_per_key: f64,
    end_to_end: Duration,
    bytes_per_key: f64,
    /// Still held once every window is over and swept.
    kept_per_key: f64,
}

impl KeysResult {
    /// Each figure's median over `runs`.
    fn median(runs: &[Self]) -> Self {
        let of = |f: fn(&Self) -> f64| median(&mut runs.iter().map(f).collect::<Vec<_>>());
        Self {
            ns_per_key: of(|r| r.ns_per_key),
            end_to_end: Duration::from_secs_f64(of(|r| r.end_to_end.as_secs_f64())),
            bytes_per_key: of(|r| r.bytes_per_key),
            kept_per_key: of(|r| r.kept_per_key),
        }
    }
}

fn spawn_child(side: &str, keys: usize) -> KeysResult {
    let exe = std::env::current_exe().expect("bench binary");
    let out = Command::new(exe)
        .env(CHILD_ENV, side)
        .env(KEYS_ENV, keys.to_string())
        .output()
        .expect("child bench runs");
    assert!(
        out.status.success(),
        "child failed: {}",
        String::from_utf8_lossy(&out.stderr)
    );
    let text = String::from_utf8_lossy(&out.stdout);
    let line = text
        .lines()
        .find(|l| l.starts_with("RESULT"))
        .expect("child result");
    let field = |name: &str| -> f64 {
        line.split_whitespace()
            .find_map(|kv| kv.strip_prefix(name)?.strip_prefix('='))
            .and_then(|v| v.parse().ok())
            .expect("result field")
    };
    KeysResult {
        ns_per_key: field("ns_per_key"),
        end_to_end: Duration::from_secs_f64(field("end_to_end_s")),
        bytes_per_key: field("bytes_per_key"),
        kept_per_key: field("kept_per_key"),
    }
}

/// Resident set size in bytes, from /proc/self/status.
fn rss() -> f64 {
    let status = std::fs::read_to_string("/proc/self/status").unwrap_or_default();
    status
        .lines()
        .find_map(|l| l.strip_prefix("VmRSS:"))
        .and_then(|v| v.trim().trim_end_matches("kB").trim().parse::<f64>().ok())
        .map_or(0.0, |kb| kb * 1024.0)
}

fn keys_child(side: &str) {
    let n = std::env::var(KEYS_ENV)
        .ok()
        .and_then(|v| v.parse().ok())
        .unwrap_or(KEYS);
    let rt = tokio_runtime();
    let (ns_per_key, end_to_end, bytes_per_key, kept_per_key) = rt.block_on(async {
        let runtime = Runtime::builder().start().await.expect("runtime");
        let make = |prefix: &str, n: usize| {
            std::sync::Arc::new((0..n).map(|i| format!("{prefix}{i}")).collect::<Vec<_>>())
        };
        let (warm_keys, keys) = (make("warm:", 1_000), make("user:", n));
        // Warm the runtime and allocator paths on other keys first.
        let warm = match side {
            "ours" => ours_keys(&runtime, &warm_keys, "warm:", true, WARM_WINDOW).await,
            "idle" => ours_keys(&runtime, &warm_keys, "warm:", false, WARM_WINDOW).await,
            _ => anchor_keys(&runtime, &warm_keys).await,
        };
        if let Some(t) = &warm {
            closed(&runtime, t).await;
        }
        let before = rss();
        let start = Instant::now();
        let throttle = match side {
            "ours" => ours_keys(&runtime, &keys, "keys:", true, KEY_WINDOW).await,
            "idle" => ours_keys(&runtime, &keys, "keys:", false, KEY_WINDOW).await,
            _ => anchor_keys(&runtime, &keys).await,
        };
        let calls = start.elapsed();
        if side == "idle" {
            // Every run finished: the processes are gone, the windows stay.
            while runtime.stats().processes > 0 {
                tokio::time::sleep(Duration::from_millis(1)).await;
            }
        }
        let peak = rss();
        assert!(
            calls < KEY_WINDOW,
            "call phase outlasted the window: {calls:?}"
        );
        if let Some(t) = throttle {
            // Trailing runs at the end of the windows, then the windows close.
            closed(&runtime, &t).await;
        }
        let end_to_end = start.elapsed();
        let kept = rss();
        (
            calls.as_nanos() as f64 / n as f64,
            end_to_end,
            (peak - before) / n as f64,
            (kept - before) / n as f64,
        )
    });
    println!(
        "RESULT ns_per_key={ns_per_key} end_to_end_s={} bytes_per_key={bytes_per_key} \
         kept_per_key={kept_per_key}",
        end_to_end.as_secs_f64()
    );
}

/// Waits until every window of `t` is over and swept.
async fn closed(runtime: &Runtime, t: &Coalesce<u64>) {
    loop {
        let s = t.stats();
        if s.active + s.pending + s.keys == 0 {
            // Every window is over: the sweep forgets them all.
            runtime.sweep_now();
            return;
        }
        tokio::time::sleep(Duration::from_millis(1)).await;
    }
}

async fn ours_keys(
    runtime: &Runtime,
    keys: &std::sync::Arc<Vec<String>>,
    prefix: &str,
    coalesce: bool,
    window: Duration,
) -> Option<Coalesce<u64>> {
    let throttle: Coalesce<u64> = runtime
        .coalesce(prefix)
        .with_window(window)
        .build()
        .expect("throttle");
    let mut tasks = Vec::new();
    for part in 0..TASKS {
        let t = throttle.clone();
        let keys = keys.clone();
        tasks.push(tokio::spawn(async move {
            for i in (part..keys.len()).step_by(TASKS) {
                let key = &keys[i];
                let led = t
                    .call(key, move |_| async move { Ok::<_, Infallible>(1) })
                    .await;
                assert_eq!(led.ok(), Some(true));
                if !coalesce {
                    continue;
                }
                let coalesced = t
                    .call(key, move |_| async move { Ok::<_, Infallible>(2) })
                    .await;
                assert_eq!(coalesced.ok(), Some(false));
            }
        }));
    }
    for task in tasks {
        task.await.expect("task");
    }
    Some(throttle)
}

async fn anchor_keys(
    runtime: &Runtime,
    keys: &std::sync::Arc<Vec<String>>,
) -> Option<Coalesce<u64>> {
    let throttler = runtime.throttle();
    let mut tasks = Vec::new();
    for part in 0..TASKS {
        let t = throttler.clone();
        let keys = keys.clone();
        tasks.push(tokio::spawn(async move {
            for i in (part..keys.len()).step_by(TASKS) {
                let key = &keys[i];
                let first = t
                    .call(key, KEY_WINDOW * 1000, || async {
                        Ok::<_, Infallible>(1u64)
                    })
                    .await
                    .expect("executes");
                assert!(!first.is_throttled());
                let second = t
                    .call(key, KEY_WINDOW * 1000, || async {
                        Ok::<_, Infallible>(2u64)
                    })
                    .await
                    .expect("throttled");
                assert!(second.is_throttled());
            }
        }));
    }
    for task in tasks {
        task.await.expect("task");
    }
    None
}
