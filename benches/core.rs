//! Core benchmarks, each side by side with its anchor in the same run.
//!
//! Run: `cargo bench --bench core`
//!
//! Criterion reports every pair; the lines printed at the end give ns/op of
//! both sides from one fixed-size timed pass each, and their ratio:
//! `compare <name>: ours <ns/op> ns, anchor <ns/op> ns, ratio <ours/anchor>`.

use std::convert::Infallible;
use std::future::Future;
use std::hint::black_box;
use std::num::NonZeroU32;
use std::pin::pin;
use std::sync::atomic::{AtomicU64, Ordering};
use std::task::{Context, Poll, Waker};
use std::time::{Duration, Instant};

use criterion::Criterion;
use dashmap::DashMap;
use governor::{Quota, RateLimiter};
use ractor::{Actor, ActorProcessingErr, ActorRef, RpcReplyPort};
use throttlebeam::{IdempotencyOutcome, Runtime, ThrottleOutcome, runtime::RuntimeClock};

const KEYS: usize = 100_000;
const HOUR: Duration = Duration::from_secs(3600);

/// Polls a future once with a no-op waker: the hot paths measured here
/// complete without waiting, so no executor sits in the measurement.
fn poll_once<F: Future>(f: F) -> Option<F::Output> {
    let mut f = pin!(f);
    match f.as_mut().poll(&mut Context::from_waker(Waker::noop())) {
        Poll::Ready(v) => Some(v),
        Poll::Pending => None,
    }
}

/// Runs `total` operations split over `threads` threads; returns wall time.
fn parallel(threads: usize, total: u64, op: &(dyn Fn(u64) + Sync)) -> Duration {
    let per = total / threads as u64;
    let start = Instant::now();
    std::thread::scope(|s| {
        for t in 0..threads as u64 {
            s.spawn(move || {
                for i in 0..per {
                    op(t * per + i);
                }
            });
        }
    });
    start.elapsed()
}

/// ns/op of ours and of the anchor, passes alternating so both see the same
/// machine load: the best of `rounds` passes of `total` operations each.
fn paired(
    rounds: usize,
    total: u64,
    mut ours: impl FnMut(u64) -> Duration,
    mut anchor: impl FnMut(u64) -> Duration,
) -> (f64, f64) {
    let ns = |d: Duration| d.as_nanos() as f64 / total as f64;
    (0..rounds).fold((f64::INFINITY, f64::INFINITY), |(o, a), _| {
        let a = a.min(ns(anchor(total)));
        (o.min(ns(ours(total))), a)
    })
}

/// ns/op of the best of three passes of `total` operations.
fn ns_per_op(total: u64, mut pass: impl FnMut(u64) -> Duration) -> f64 {
    (0..3)
        .map(|_| pass(total).as_nanos() as f64 / total as f64)
        .fold(f64::INFINITY, f64::min)
}

struct Line {
    name: &'static str,
    ours: f64,
    anchor: f64,
    extra: String,
}

fn keys() -> Vec<String> {
    (0..KEYS).map(|i| format!("user:{i}")).collect()
}

fn tokio_rt() -> tokio::runtime::Runtime {
    tokio::runtime::Builder::new_multi_thread()
        .worker_threads(2)
        .enable_all()
        .build()
        .expect("tokio runtime")
}

fn throttle_reject(c: &mut Criterion, lines: &mut Vec<Line>) {
    let rt = tokio_rt();
    let runtime = rt.block_on(Runtime::start()).expect("runtime");
    let throttle = runtime.throttle();
    let keys = keys();
    rt.block_on(async {
        for key in &keys {
            let first = throttle
                .call(key, HOUR, || async { Ok::<_, Infallible>(()) })
                .await
                .expect("call");
            assert!(!first.is_throttled());
        }
    });
    let governor = RateLimiter::dashmap(Quota::per_hour(NonZeroU32::MIN));
    for key in &keys {
        assert!(governor.check_key(key).is_ok());
    }
    let ours = |i: u64| {
        let key = &keys[i as usize % KEYS];
        let outcome = poll_once(throttle.call(key, HOUR, || async { Ok::<_, Infallible>(()) }));
        debug_assert!(matches!(
            outcome,
            Some(Ok(ThrottleOutcome::Throttled { .. }))
        ));
        black_box(outcome);
    };
    let anchor = |i: u64| {
        let key = &keys[i as usize % KEYS];
        black_box(governor.check_key(key).is_err());
    };
    let mut g = c.benchmark_group("throttle_reject");
    g.bench_function("ours_2_threads", |b| {
        b.iter_custom(|n| parallel(2, n.max(2), &ours))
    });
    g.bench_function("governor_check_key_2_threads", |b| {
        b.iter_custom(|n| parallel(2, n.max(2), &anchor))
    });
    g.finish();
    let (ours_ns, anchor_ns) = paired(
        7,
        2_000_000,
        |n| parallel(2, n, &ours),
        |n| parallel(2, n, &anchor),
    );
    lines.push(Line {
        name: "throttle_reject",
        ours: ours_ns,
        anchor: anchor_ns,
        extra: String::new(),
    });

    // The same windows on a second runtime (this row had `RuntimeClock::Tokio`, removed: it
    // was the same clock as the default `Auto`).
    let on_tokio = rt
        .block_on(Runtime::builder().with_clock(RuntimeClock::Auto).start())
        .expect("runtime");
    let tokio_throttle = on_tokio.throttle();
    rt.block_on(async {
        for key in &keys {
            let first = tokio_throttle
                .call(key, HOUR, || async { Ok::<_, Infallible>(()) })
                .await
                .expect("call");
            assert!(!first.is_throttled());
        }
    });
    let ours_tokio = |i: u64| {
        let key = &keys[i as usize % KEYS];
        black_box(poll_once(
            tokio_throttle.call(key, HOUR, || async { Ok::<_, Infallible>(()) }),
        ));
    };
    // What one clock read costs on this machine, on the bench's threads.
    let read = |f: &(dyn Fn() + Sync)| ns_per_op(4_000_000, |n| parallel(2, n, &|_| f()));
    let quanta = quanta::Clock::new();
    let clocks = format!(
        "; one read, 2 threads: tokio {:.1} ns, std {:.1} ns, quanta {:.1} ns",
        read(&|| {
            black_box(tokio::time::Instant::now());
        }),
        read(&|| {
            black_box(Instant::now());
        }),
        read(&|| {
            black_box(quanta.now());
        }),
    );
    let (ours_tokio_ns, anchor_ns) = paired(
        7,
        2_000_000,
        |n| parallel(2, n, &ours_tokio),
        |n| parallel(2, n, &anchor),
    );
    lines.push(Line {
        name: "throttle_reject_tokio_clock",
        ours: ours_tokio_ns,
        anchor: anchor_ns,
        extra: format!(" (windows on tokio's clock instead of the TSC{clocks})"),
    });
}

fn debounce_burst(c: &mut Criterion, lines: &mut Vec<Line>) {
    let rt = tokio_rt();
    let _enter = rt.enter();
    let runtime = rt.block_on(Runtime::start()).expect("runtime");
    let debounce = runtime.debounce();
    let first = debounce
        .call("burst", HOUR, || async { Ok::<u64, Infallible>(0) })
        .expect("call");
    drop(first);
    let map: DashMap<String, (Instant, u64)> = DashMap::new();
    map.insert("burst".to_owned(), (Instant::now(), 0));
    let ours = |i: u64| {
        let call = debounce.call(
            "burst",
            HOUR,
            move || async move { Ok::<u64, Infallible>(i) },
        );
        black_box(call.is_ok());
    };
    let anchor = |i: u64| {
        if let Some(mut slot) = map.get_mut("burst") {
            *slot = (Instant::now() + HOUR, i);
        }
    };
    let mut g = c.benchmark_group("debounce_burst");
    g.bench_function("ours", |b| b.iter_custom(|n| parallel(1, n, &ours)));
    g.bench_function("dashmap_get_mut", |b| {
        b.iter_custom(|n| parallel(1, n, &anchor))
    });
    g.finish();
    let wakeups_during_bench = runtime.stats().debounce.timer_wakeups;

    // Wakeups per burst, on real time: 50 bursts of 1,000 calls, 2 ms delay.
    let before = runtime.stats().debounce.timer_wakeups;
    rt.block_on(async {
        for burst in 0..50 {
            let key = format!("wake:{burst}");
            let mut last = None;
            for i in 0..1000u64 {
                last = Some(
                    debounce
                        .call(&key, Duration::from_millis(2), move || async move {
                            Ok::<u64, Infallible>(i)
                        })
                        .expect("call"),
                );
            }
            assert_eq!(last.expect("calls").await.expect("run"), 999);
        }
    });
    let per_burst = (runtime.stats().debounce.timer_wakeups - before) as f64 / 50.0;
    let (ours_ns, anchor_ns) = paired(
        7,
        2_000_000,
        |n| parallel(1, n, &ours),
        |n| parallel(1, n, &anchor),
    );
    lines.push(Line {
        name: "debounce_burst",
        ours: ours_ns,
        anchor: anchor_ns,
        extra: format!(
            " (timer wakeups per 1,000-call burst: {per_burst:.2}; during the bench: {wakeups_during_bench})"
        ),
    });
}

fn idempotency_replay(c: &mut Criterion, lines: &mut Vec<Line>) {
    let rt = tokio_rt();
    let runtime = rt.block_on(Runtime::start()).expect("runtime");
    let idem = runtime.idempotency();
    let keys = keys();
    rt.block_on(async {
        for (i, key) in keys.iter().enumerate() {
            let first = idem
                .run(key, move || async move { Ok::<_, Infallible>(i as u64) })
                .await
                .expect("run");
            assert!(first.is_fresh());
        }
    });
    // What a user would pick instead: a TTL cache, on the same keys.
    let cache: moka::sync::Cache<String, u64> =
        moka::sync::Cache::builder().time_to_live(HOUR).build();
    for (i, key) in keys.iter().enumerate() {
        cache.insert(key.clone(), i as u64);
    }
    cache.run_pending_tasks();
    let ours = |i: u64| {
        let key = &keys[i as usize % KEYS];
        let outcome = poll_once(idem.run(key, || async { Ok::<u64, Infallible>(u64::MAX) }));
        debug_assert!(matches!(outcome, Some(Ok(IdempotencyOutcome::Replay(_)))));
        black_box(outcome);
    };
    let anchor = |i: u64| {
        let key = &keys[i as usize % KEYS];
        black_box(cache.get(key.as_str()));
    };
    // The floor: a bare map read and an Arc clone, no clock, no expiry.
    let map: DashMap<String, std::sync::Arc<u64>> = DashMap::new();
    for (i, key) in keys.iter().enumerate() {
        map.insert(key.clone(), std::sync::Arc::new(i as u64));
    }
    let floor = |i: u64| {
        let key = &keys[i as usize % KEYS];
        black_box(map.get(key.as_str()).map(|v| std::sync::Arc::clone(&v)));
    };
    let mut g = c.benchmark_group("idempotency_replay");
    g.bench_function("ours", |b| b.iter_custom(|n| parallel(1, n, &ours)));
    g.bench_function("moka_sync_cache_get_ttl", |b| {
        b.iter_custom(|n| parallel(1, n, &anchor))
    });
    g.bench_function("dashmap_get_arc_clone", |b| {
        b.iter_custom(|n| parallel(1, n, &floor))
    });
    g.finish();
    let ours_ns = ns_per_op(2_000_000, |n| parallel(1, n, &ours));
    lines.push(Line {
        name: "idempotency_replay",
        ours: ours_ns,
        anchor: ns_per_op(2_000_000, |n| parallel(1, n, &anchor)),
        extra: " (anchor: moka::sync::Cache::get with time_to_live, 100,000 keys)".to_owned(),
    });
    lines.push(Line {
        name: "idempotency_replay_floor",
        ours: ours_ns,
        anchor: ns_per_op(2_000_000, |n| parallel(1, n, &floor)),
        extra: " (anchor: DashMap get + Arc clone, no clock, no expiry)".to_owned(),
    });
}

struct Echo;

/// The anchor actor's one message: reply with a number.
struct Ping(RpcReplyPort<u64>);

#[cfg(feature = "cluster")]
impl ractor::Message for Ping {}

#[cfg_attr(feature = "async-trait", ractor::async_trait)]
impl Actor for Echo {
    type Msg = Ping;
    type State = ();
    type Arguments = ();

    async fn pre_start(&self, _: ActorRef<Self::Msg>, (): ()) -> Result<(), ActorProcessingErr> {
        Ok(())
    }

    async fn handle(
        &self,
        _: ActorRef<Self::Msg>,
        Ping(reply): Ping,
        (): &mut (),
    ) -> Result<(), ActorProcessingErr> {
        let _ = reply.send(1);
        Ok(())
    }
}

fn fresh_key(c: &mut Criterion, lines: &mut Vec<Line>) {
    let rt = tokio_rt();
    let runtime = rt
        .block_on(
            Runtime::builder()
                .with_sweep_interval(Duration::from_millis(100))
                .start(),
        )
        .expect("runtime");
    let throttle = runtime.throttle();
    static NEXT: AtomicU64 = AtomicU64::new(0);
    // Two tasks, each running its share of calls back to back.
    let ours = |n: u64| -> Duration {
        rt.block_on(async {
            let start = Instant::now();
            let tasks: Vec<_> = (0..2)
                .map(|_| {
                    let throttle = throttle.clone();
                    tokio::spawn(async move {
                        for _ in 0..n / 2 {
                            let key = format!("fresh:{}", NEXT.fetch_add(1, Ordering::Relaxed));
                            let outcome = throttle
                                .call(&key, Duration::from_millis(1), || async {
                                    Ok::<_, Infallible>(1u8)
                                })
                                .await
                                .expect("call");
                            let _ = black_box(outcome);
                        }
                    })
                })
                .collect();
            for t in tasks {
                t.await.expect("task");
            }
            start.elapsed()
        })
    };
    let anchor = |n: u64| -> Duration {
        rt.block_on(async {
            let start = Instant::now();
            let tasks: Vec<_> = (0..2)
                .map(|_| {
                    tokio::spawn(async move {
                        for _ in 0..n / 2 {
                            let (actor, join) = Actor::spawn(None, Echo, ()).await.expect("spawn");
                            let reply = actor.call(Ping, None).await.expect("call");
                            black_box(reply);
                            actor.stop(None);
                            join.await.expect("exit");
                        }
                    })
                })
                .collect();
            for t in tasks {
                t.await.expect("task");
            }
            start.elapsed()
        })
    };
    let mut g = c.benchmark_group("fresh_key");
    g.bench_function("ours_2_tasks", |b| b.iter_custom(|n| ours(n.max(2))));
    g.bench_function("ractor_spawn_call_exit_2_tasks", |b| {
        b.iter_custom(|n| anchor(n.max(2)))
    });
    g.finish();
    let ours_ns = ns_per_op(400_000, ours);
    let stats = runtime.stats();
    lines.push(Line {
        name: "fresh_key",
        ours: ours_ns,
        anchor: ns_per_op(200_000, anchor),
        extra: format!(
            " ({:.0} keys/s; live processes after: {})",
            1e9 / ours_ns,
            stats.processes
        ),
    });
}

fn rss_bytes() -> usize {
    let statm = std::fs::read_to_string("/proc/self/statm").unwrap_or_default();
    let pages: usize = statm
        .split_whitespace()
        .nth(1)
        .and_then(|p| p.parse().ok())
        .unwrap_or(0);
    pages * 4096
}

/// Bytes per live busy key (a pending debounce: slot, process, timer) and per
/// open leading-only window (a registry slot, no process), by RSS growth.
fn memory() -> String {
    const N: usize = 100_000;
    let rt = tokio_rt();
    let _enter = rt.enter();
    let runtime = rt.block_on(Runtime::start()).expect("runtime");
    let keys: Vec<String> = (0..N).map(|i| format!("mem:{i:08}")).collect();
    let debounce = runtime.debounce();
    let throttle = runtime.throttle();

    let before = rss_bytes();
    for key in &keys {
        drop(
            debounce
                .call(key, HOUR, || async { Ok::<u8, Infallible>(0) })
                .expect("call"),
        );
    }
    // Let every process start and arm its timer.
    rt.block_on(async {
        while runtime.stats().timers < N {
            tokio::task::yield_now().await;
        }
    });
    let busy = (rss_bytes() - before) as f64 / N as f64;
    let stats = runtime.stats();

    let before = rss_bytes();
    rt.block_on(async {
        for key in &keys {
            let outcome = throttle
                .call(key, HOUR, || async { Ok::<_, Infallible>(()) })
                .await
                .expect("call");
            assert!(!outcome.is_throttled());
        }
    });
    let window = (rss_bytes() - before) as f64 / N as f64;
    format!(
        "memory: {busy:.0} bytes per live busy key ({} processes, {} timers), {window:.0} bytes per open leading-only window (target 2048 and 256)",
        stats.processes, stats.timers
    )
}

fn main() {
    // `CORE_BENCH=throttle_reject,fresh_key` runs only those (quick checks).
    // Memory first, in a fresh process, so RSS growth is not hidden by freed pages.
    let only = std::env::var("CORE_BENCH").ok();
    let wanted = |name: &str| {
        only.as_deref()
            .is_none_or(|o| o.split(',').any(|n| n == name))
    };
    let memory = if wanted("memory") {
        memory()
    } else {
        String::new()
    };
    let mut c = Criterion::default()
        .warm_up_time(Duration::from_millis(500))
        .measurement_time(Duration::from_secs(2))
        .sample_size(10)
        .configure_from_args();
    let mut lines = Vec::new();
    // `CORE_BENCH=throttle_reject,fresh_key` runs only those (quick checks).
    let only = std::env::var("CORE_BENCH").ok();
    let wanted = |name: &str| {
        only.as_deref()
            .is_none_or(|o| o.split(',').any(|n| n == name))
    };
    if wanted("throttle_reject") {
        throttle_reject(&mut c, &mut lines);
    }
    if wanted("idempotency_replay") {
        idempotency_replay(&mut c, &mut lines);
    }
    if wanted("debounce_burst") {
        debounce_burst(&mut c, &mut lines);
    }
    if wanted("fresh_key") {
        fresh_key(&mut c, &mut lines);
    }
    c.final_summary();
    println!();
    for l in &lines {
        println!(
            "compare {}: ours {:.1} ns, anchor {:.1} ns, ratio {:.2}{}",
            l.name,
            l.ours,
            l.anchor,
            l.ours / l.anchor,
            l.extra
        );
    }
    println!("{memory}");
}
