//! Behaviour of the rate-limiting area: scenarios R1–R17 with exact numbers.

mod vectors;

use std::net::IpAddr;
use std::num::{NonZeroU32, NonZeroUsize};
use std::sync::atomic::{AtomicU64, AtomicUsize, Ordering};
use std::sync::{Arc, Mutex};
use std::time::Duration;

use http::HeaderMap;
use throttlebeam::clock::{Clock, ManualClock, TokioClock};
use throttlebeam::rate_limit::{
    ALLOW_FULL, ClientIp, Decision, EnforceOutcome, Enforcer, FailMode, FixedWindow, Gcra,
    HeaderOptions, KeyHasher, LeakyBucket, Limiter, LimiterStats, MemoryRateLimitStore, PolicyName,
    RateLimitError, RateLimitReply, RateLimitRequest, RateLimitStore, SlidingWindow, StateUpdate,
    Strategy, Tiered, TokenBucket, TrustProxy, combine,
};
use vectors::{Expect, Op, Vector};

fn nz(n: u32) -> NonZeroU32 {
    NonZeroU32::new(n).expect("non-zero")
}

fn manual<S: Strategy>(strategy: S) -> (Limiter<S>, ManualClock) {
    let clock = ManualClock::new(0);
    let limiter = Limiter::builder(strategy).with_clock(clock.clone()).build();
    (limiter, clock)
}

/// Runs a vector through the pure functions (which read µs; the vectors are in ms),
/// threading the state by hand.
fn run_pure<S: Strategy>(v: &Vector<S>) {
    let strategy = (v.strategy)();
    let mut state = None;
    for (i, step) in v.steps.iter().enumerate() {
        let at = step.at * 1_000;
        let got = match step.op {
            Op::Check(cost) => match strategy.check(state, at, nz(cost)) {
                Ok(outcome) => {
                    if let StateUpdate::Set { state: next, .. } = outcome.update {
                        state = Some(next);
                    }
                    Expect::Decision(outcome.result)
                }
                Err(err) => {
                    assert_eq!(err.cost, cost);
                    Expect::Insufficient(err.capacity)
                }
            },
            Op::Peek => Expect::Decision(strategy.peek(state, at)),
            Op::Forecast(cost) => Expect::Forecast(strategy.forecast(state, at, nz(cost))),
            Op::Reset => {
                let applied = strategy
                    .apply(state, at, throttlebeam::rate_limit::RateLimitOp::Reset)
                    .unwrap();
                assert_eq!(applied.update, StateUpdate::Remove);
                state = None;
                Expect::Reset
            }
        };
        assert_eq!(got, step.expect, "{} step {i} (pure)", v.name);
    }
}

/// Runs a vector through a `Limiter` on the memory store and a manual clock.
fn run_limiter<S: Strategy>(v: &Vector<S>) {
    let (limiter, clock) = manual((v.strategy)());
    for (i, step) in v.steps.iter().enumerate() {
        clock.set(step.at);
        let got = match step.op {
            Op::Check(cost) => match limiter.check_n("k", cost) {
                Ok(d) => Expect::Decision(d),
                Err(RateLimitError::InsufficientCapacity { key, capacity, .. }) => {
                    assert_eq!(key, "k");
                    Expect::Insufficient(capacity)
                }
                Err(err) => panic!("{} step {i}: {err}", v.name),
            },
            Op::Peek => Expect::Decision(limiter.peek("k").unwrap()),
            Op::Forecast(cost) => Expect::Forecast(limiter.forecast("k", cost).unwrap()),
            Op::Reset => {
                limiter.reset("k").unwrap();
                Expect::Reset
            }
        };
        assert_eq!(got, step.expect, "{} step {i} (limiter)", v.name);
    }
}

fn run<S: Strategy>(v: &Vector<S>) {
    run_pure(v);
    run_limiter(v);
}

#[test]
fn r1_gcra_two_per_second() {
    run(&vectors::gcra::R1);
}

#[test]
fn r2_gcra_burst_five() {
    run(&vectors::gcra::R2);
}

#[test]
fn r3_cost_above_burst_never_admitted_and_backwards_clock() {
    run(&vectors::gcra::R3);
    run(&vectors::token_bucket::COST_AND_FORECAST);
}

#[test]
fn r3_cost_n_consumes_n_units() {
    let (limiter, _clock) = manual(Gcra::new(10, Duration::from_secs(10)).unwrap());
    assert_eq!(limiter.check_n("k", 4).unwrap().remaining, 6);
    assert_eq!(limiter.check_n("k", 6).unwrap().remaining, 0);
}

#[test]
fn r3_a_cost_above_the_capacity_is_an_error_naming_key_and_capacity() {
    let (limiter, _clock) = manual(Gcra::new(10, Duration::from_secs(10)).unwrap());
    let err = limiter.check_n("user:7", 11).unwrap_err();
    assert!(matches!(
        err,
        RateLimitError::InsufficientCapacity {
            cost: 11,
            capacity: 10,
            ..
        }
    ));
    assert_eq!(
        err.to_string(),
        r#"cost 11 for key "user:7" exceeds the capacity 10: it can never be admitted"#
    );
    // Nothing was spent, and the error is counted.
    assert_eq!(limiter.peek("user:7").unwrap().remaining, 10);
    assert_eq!(limiter.stats().errors, 1);
    assert!(matches!(
        limiter.forecast("user:7", 11),
        Err(RateLimitError::InsufficientCapacity { .. })
    ));
    // Every strategy, and tiers (the smaller capacity binds).
    let minute = Duration::from_secs(60);
    let tiers = Tiered::new(
        Gcra::new(5, minute).unwrap(),
        FixedWindow::new(3, minute).unwrap(),
    );
    assert!(matches!(
        tiers.check(None, 0, nz(4)),
        Err(e) if e.capacity == 3
    ));
    let (limiter, _clock) = manual(TokenBucket::new(5, 1, minute).unwrap());
    assert!(limiter.check_n("k", 6).is_err());
    let (limiter, _clock) = manual(SlidingWindow::new(5, minute).unwrap());
    assert!(limiter.check_n("k", 6).is_err());
}

/// Units a greedy client gets in each of `seconds` simulated seconds, asking every
/// millisecond for everything the limiter can give, after draining the initial burst.
fn per_second<S: Strategy>(strategy: S, burst: u32, seconds: u64) -> Vec<u64> {
    let (limiter, clock) = manual(strategy);
    let start = 1_000_000;
    clock.set(start);
    assert!(limiter.check_n("k", burst).unwrap().allowed);
    let mut counts = vec![0; usize::try_from(seconds).unwrap()];
    for ms in 1..=seconds * 1_000 {
        clock.set(start + ms);
        let spendable = limiter.forecast("k", 1).unwrap().spendable_now;
        if spendable > 0 {
            let n = u32::try_from(spendable).unwrap();
            assert!(limiter.check_n("k", n).unwrap().allowed);
            counts[usize::try_from((ms - 1) / 1_000).unwrap()] += spendable;
        }
    }
    counts
}

#[test]
fn r3_quotas_up_to_a_million_per_second_are_exact() {
    // Before, emission intervals were whole milliseconds: 5,000 per second admitted 1,000.
    for rate in [5_000u32, 333_333, 700_000, 999_999, 1_000_000] {
        let second = Duration::from_secs(1);
        let tolerance = u64::from(rate) / 1_000;
        let gcra = per_second(Gcra::new(rate, second).unwrap(), rate, 10);
        let bucket = per_second(TokenBucket::new(rate, rate, second).unwrap(), rate, 10);
        for counts in [gcra, bucket] {
            for (s, &n) in counts.iter().enumerate() {
                assert!(
                    n.abs_diff(u64::from(rate)) <= tolerance,
                    "{rate}/s admitted {n} in second {s}: {counts:?}"
                );
            }
        }
    }
    let gcra = per_second(Gcra::new(5_000, Duration::from_secs(1)).unwrap(), 5_000, 30);
    assert!(gcra.iter().all(|&n| n.abs_diff(5_000) <= 5), "{gcra:?}");
}

#[test]
fn r3_a_quota_finer_than_a_microsecond_is_refused() {
    let second = Duration::from_secs(1);
    let err = Gcra::new(1_000_001, second).unwrap_err();
    assert!(matches!(
        err,
        RateLimitError::TooFine {
            units: 1_000_001,
            ..
        }
    ));
    assert_eq!(
        err.to_string(),
        "limit of 1000001 per 1000000 µs is finer than one per microsecond"
    );
    assert!(Gcra::new(1_000_000, second).is_ok());
    assert!(matches!(
        LeakyBucket::new(2_000, Duration::from_millis(1), second),
        Err(RateLimitError::TooFine { .. })
    ));
    assert!(matches!(
        TokenBucket::new(1, 1_000_001, second),
        Err(RateLimitError::TooFine { .. })
    ));
}

#[test]
fn r4_token_bucket() {
    run(&vectors::token_bucket::R4);
}

#[test]
fn r5_fixed_and_sliding_windows() {
    for v in &vectors::fixed_window::ALL {
        run(v);
    }
    for v in &vectors::sliding_window::ALL {
        run(v);
    }
}

#[test]
fn r6_leaky_bucket_reservations() {
    let shaper = vectors::leaky::ten_per_second_queue_150();
    let (limiter, clock) = manual(shaper);
    let mut state = None;
    for &(at, cost, expected) in vectors::leaky::R6_RESERVATIONS {
        let outcome = shaper.reserve(state, at * 1_000, nz(cost)).unwrap();
        if let StateUpdate::Set { state: next, .. } = outcome.update {
            state = Some(next);
        }
        assert_eq!(outcome.result, expected, "pure at {at}");
        clock.set(at);
        assert_eq!(
            limiter.try_reserve("k", cost).unwrap(),
            expected,
            "limiter at {at}"
        );
    }
    let no_queue = LeakyBucket::new(10, Duration::from_secs(1), Duration::ZERO).unwrap();
    let (limiter, clock) = manual(no_queue);
    for &(at, cost, expected) in vectors::leaky::R6_NO_QUEUE {
        clock.set(at);
        assert_eq!(
            limiter.try_reserve("k", cost).unwrap(),
            expected,
            "no queue at {at}"
        );
    }
    let (at, cost, capacity) = vectors::leaky::R6_TOO_LARGE;
    let (limiter, clock) = manual(shaper);
    clock.set(at);
    assert!(matches!(
        limiter.try_reserve("k", cost),
        Err(RateLimitError::InsufficientCapacity { capacity: c, .. }) if c == capacity
    ));
    assert_eq!(
        shaper
            .reserve(None, at * 1_000, nz(cost))
            .unwrap_err()
            .capacity,
        capacity
    );
    for v in &vectors::leaky::ALL {
        run(v);
    }
}

#[tokio::test(start_paused = true)]
async fn r6_waiting_form_sleeps_the_delay_or_fails_with_queue_full() {
    let limiter = Limiter::new(vectors::leaky::ten_per_second_queue_150());
    let start = tokio::time::Instant::now();
    assert_eq!(limiter.reserve("k", 1).await.unwrap(), Duration::ZERO);
    // Two more at the same instant, from other tasks: 100 ms for the first, queue full next.
    let (a, b) = tokio::join!(limiter.reserve("k", 1), async {
        tokio::task::yield_now().await;
        limiter.reserve("k", 1).await
    });
    assert_eq!(a.unwrap(), Duration::from_millis(100));
    match b {
        Err(RateLimitError::QueueFull {
            key,
            retry_after_ms,
        }) => {
            assert_eq!(key, "k");
            assert_eq!(retry_after_ms, 50);
        }
        other => panic!("expected queue full, got {other:?}"),
    }
    assert_eq!(start.elapsed(), Duration::from_millis(100));
}

#[test]
fn r7_peek_and_forecast() {
    run(&vectors::gcra::R7);
}

#[test]
fn r7_peek_never_consumes() {
    let (limiter, _clock) = manual(FixedWindow::new(2, Duration::from_secs(1)).unwrap());
    for _ in 0..10 {
        assert_eq!(limiter.peek("k").unwrap().remaining, 2);
        assert_eq!(limiter.forecast("k", 1).unwrap().spendable_now, 2);
    }
    assert!(limiter.check("k").unwrap().allowed);
    assert!(limiter.check("k").unwrap().allowed);
    assert!(!limiter.check("k").unwrap().allowed);
}

/// A clock that moves 1 ms every time it is read.
#[derive(Default)]
struct TickingClock(AtomicU64);

impl Clock for TickingClock {
    fn now_us(&self) -> u64 {
        self.0.fetch_add(1_000, Ordering::Relaxed)
    }
}

#[test]
fn r7_check_many_decides_at_one_timestamp() {
    let limiter = Limiter::builder(Gcra::new(2, Duration::from_secs(1)).unwrap())
        .with_clock(TickingClock::default())
        .build();
    let decisions = limiter.check_many(&["a", "b", "c", "a"], 1).unwrap();
    let resets: Vec<u64> = decisions.iter().map(|d| d.reset_at_ms).collect();
    // All at t=0: fresh keys fill up at 500, the second "a" at 1000.
    assert_eq!(resets, [500, 500, 500, 1_000]);
    assert!(limiter.check_many::<&str>(&[], 0).unwrap().is_empty());
    assert!(matches!(
        limiter.check_many(&["a"], 0),
        Err(RateLimitError::ZeroCost { .. })
    ));
}

fn concurrent_admissions<S: Strategy>(strategy: S) -> usize {
    let (limiter, _clock) = manual(strategy);
    let admitted = AtomicUsize::new(0);
    let barrier = std::sync::Barrier::new(8);
    std::thread::scope(|s| {
        for _ in 0..8 {
            s.spawn(|| {
                barrier.wait();
                for _ in 0..25 {
                    if limiter.check("shared").unwrap().allowed {
                        admitted.fetch_add(1, Ordering::Relaxed);
                    }
                }
            });
        }
    });
    admitted.into_inner()
}

#[test]
fn r8_two_hundred_concurrent_checks_admit_exactly_fifty() {
    let minute = Duration::from_secs(60);
    assert_eq!(concurrent_admissions(Gcra::new(50, minute).unwrap()), 50);
    assert_eq!(
        concurrent_admissions(TokenBucket::new(50, 1, minute).unwrap()),
        50
    );
    assert_eq!(
        concurrent_admissions(FixedWindow::new(50, minute).unwrap()),
        50
    );
    assert_eq!(
        concurrent_admissions(SlidingWindow::new(50, minute).unwrap()),
        50
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn r8_two_hundred_concurrent_tasks_admit_exactly_fifty() {
    let limiter = Limiter::new(Gcra::new(50, Duration::from_secs(3_600)).unwrap());
    let tasks: Vec<_> = (0..200)
        .map(|_| {
            let limiter = limiter.clone();
            tokio::spawn(async move { limiter.check("shared").unwrap().allowed })
        })
        .collect();
    let mut admitted = 0;
    for task in tasks {
        admitted += usize::from(task.await.unwrap());
    }
    assert_eq!(admitted, 50);
}

#[test]
fn r9_same_inputs_give_bit_identical_decisions() {
    let strategy = SlidingWindow::new(7, Duration::from_millis(300)).unwrap();
    let script: Vec<(u64, u32)> = (0..500u64)
        .map(|i| (i * 37 % 1_000 + i * 3, 1 + (i % 3) as u32))
        .collect();
    let replay = || {
        let (limiter, clock) = manual(strategy);
        script
            .iter()
            .map(|&(at, cost)| {
                clock.set(at);
                limiter.check_n("k", cost).unwrap()
            })
            .collect::<Vec<_>>()
    };
    assert_eq!(replay(), replay());
    // The state survives a round trip through bincode unchanged, so a remote store that keeps
    // it encoded decides the same.
    let mut state = None;
    for &(at, cost) in &script {
        let direct = strategy.check(state, at * 1_000, nz(cost)).unwrap();
        let decoded = state.map(|s| {
            let bytes = bincode::serde::encode_to_vec(s, bincode::config::standard()).unwrap();
            bincode::serde::decode_from_slice(&bytes, bincode::config::standard())
                .unwrap()
                .0
        });
        assert_eq!(
            strategy.check(decoded, at * 1_000, nz(cost)).unwrap(),
            direct
        );
        if let StateUpdate::Set { state: next, .. } = direct.update {
            state = Some(next);
        }
    }
}

#[test]
fn r10_combine_rules_and_identity() {
    let a = Decision {
        allowed: true,
        limit: 10,
        remaining: 4,
        reset_at_ms: 1_000,
        retry_after_ms: 0,
    };
    let b = Decision {
        allowed: false,
        limit: 100,
        remaining: 0,
        reset_at_ms: 60_000,
        retry_after_ms: 2_500,
    };
    assert_eq!(
        combine(a, b),
        Decision {
            allowed: false,
            limit: 10,
            remaining: 0,
            reset_at_ms: 60_000,
            retry_after_ms: 2_500,
        }
    );
    assert_eq!(combine(a, ALLOW_FULL), a);
    assert_eq!(combine(ALLOW_FULL, b), b);
}

#[test]
fn r10_tiered_limits_charge_all_tiers_or_none() {
    // A slow tier (5 per 10 s, one unit back every 2 s) and a window tier (3 per second).
    let tiers = Tiered::new(
        Gcra::new(5, Duration::from_secs(10)).unwrap(),
        FixedWindow::new(3, Duration::from_secs(1)).unwrap(),
    );
    let (limiter, clock) = manual(tiers);
    for remaining in [2, 1, 0] {
        let d = limiter.check("k").unwrap();
        assert!(d.allowed);
        assert_eq!((d.limit, d.remaining), (3, remaining));
    }
    // The window tier denies ten times: the slow tier must not be charged for them.
    for _ in 0..10 {
        let denied = limiter.check("k").unwrap();
        assert!(!denied.allowed);
        assert_eq!(denied.retry_after_ms, 1_000);
        // The slow tier fills up at 6000 ms: the later reset wins.
        assert_eq!(denied.reset_at_ms, 6_000);
    }
    clock.set(1_000);
    // Slow tier: 3 spent, 2 left (and one more at 2 s); had the denials been charged it
    // would be empty for 20 s.
    let d = limiter.check("k").unwrap();
    assert!(d.allowed);
    assert_eq!(d.remaining, 1);
    assert_eq!(d.reset_at_ms, 8_000);
}

#[test]
fn r10_tiered_denial_by_the_fast_tier_leaves_the_daily_quota() {
    let tiers = Tiered::new(
        Gcra::new(1, Duration::from_secs(1)).unwrap(),
        FixedWindow::new(3, Duration::from_secs(86_400)).unwrap(),
    );
    let (limiter, clock) = manual(tiers);
    assert!(limiter.check("k").unwrap().allowed);
    for _ in 0..5 {
        let d = limiter.check("k").unwrap();
        assert!(!d.allowed);
        assert_eq!(d.retry_after_ms, 1_000);
    }
    // Had the denials been charged, the daily quota of 3 would be gone already.
    clock.set(1_000);
    assert!(limiter.check("k").unwrap().allowed);
    clock.set(2_000);
    assert!(limiter.check("k").unwrap().allowed);
    clock.set(3_000);
    let d = limiter.check("k").unwrap();
    assert!(!d.allowed);
    assert_eq!(d.retry_after_ms, 86_397_000);
    assert_eq!(limiter.forecast("k", 1).unwrap().full_at_ms, 86_400_000);
}

fn decision(
    allowed: bool,
    limit: u64,
    remaining: u64,
    reset_at_ms: u64,
    retry_after_ms: u64,
) -> Decision {
    Decision {
        allowed,
        limit,
        remaining,
        reset_at_ms,
        retry_after_ms,
    }
}

fn header(headers: &HeaderMap, name: &str) -> Option<String> {
    headers.get(name).map(|v| v.to_str().unwrap().to_owned())
}

#[test]
fn r11_draft_headers_round_reset_up() {
    let d = decision(true, 100, 42, 10_001, 0);
    let h = HeaderOptions::new().headers(&d, 1_000);
    assert_eq!(header(&h, "ratelimit-limit").as_deref(), Some("100"));
    assert_eq!(header(&h, "ratelimit-remaining").as_deref(), Some("42"));
    assert_eq!(header(&h, "ratelimit-reset").as_deref(), Some("10"));
    assert_eq!(header(&h, "retry-after"), None);
    assert_eq!(h.len(), 3);
    // A reset in the past reads 0.
    let h = HeaderOptions::new().headers(&d, 20_000);
    assert_eq!(header(&h, "ratelimit-reset").as_deref(), Some("0"));
}

#[test]
fn r11_structured_headers() {
    let options = HeaderOptions::new()
        .with_draft(false)
        .with_structured(true)
        .with_policy(PolicyName::new("name").unwrap())
        .with_window(Duration::from_secs(60));
    let d = decision(true, 100, 50, 30_000, 0);
    let h = options.headers(&d, 0);
    assert_eq!(
        header(&h, "ratelimit").as_deref(),
        Some(r#""name";r=50;t=30"#)
    );
    assert_eq!(
        header(&h, "ratelimit-policy").as_deref(),
        Some(r#""name";q=100;w=60"#)
    );
    assert_eq!(h.len(), 2);
    // ALLOW_FULL's limits are clamped to the largest structured integer.
    let h = options.headers(&ALLOW_FULL, 0);
    assert_eq!(
        header(&h, "ratelimit-policy").as_deref(),
        Some(r#""name";q=999999999999999;w=60"#)
    );
    // Quotes and backslashes in a policy name are escaped.
    let quoted = options
        .clone()
        .with_policy(PolicyName::new(r#"a"b"#).unwrap());
    assert_eq!(
        header(&quoted.headers(&d, 0), "ratelimit").as_deref(),
        Some(r#""a\"b";r=50;t=30"#)
    );
    let escaped = options.with_policy(PolicyName::new(r#"a\"b\c"#).unwrap());
    let h = escaped.headers(&d, 0);
    assert_eq!(
        header(&h, "ratelimit").as_deref(),
        Some(r#""a\\\"b\\c";r=50;t=30"#)
    );
    assert_eq!(
        header(&h, "ratelimit-policy").as_deref(),
        Some(r#""a\\\"b\\c";q=100;w=60"#)
    );
    // Without a window, `w` is left out.
    let no_window = HeaderOptions::none()
        .with_structured(true)
        .with_policy(PolicyName::new("name").unwrap());
    assert_eq!(
        header(&no_window.headers(&d, 0), "ratelimit-policy").as_deref(),
        Some(r#""name";q=100"#)
    );
}

#[test]
fn r11_legacy_headers_use_epoch_seconds() {
    let options = HeaderOptions::none().with_legacy(true);
    let d = decision(true, 10, 3, 1_700_000_000_001, 0);
    let h = options.headers(&d, 1_699_999_999_000);
    assert_eq!(header(&h, "x-ratelimit-limit").as_deref(), Some("10"));
    assert_eq!(header(&h, "x-ratelimit-remaining").as_deref(), Some("3"));
    assert_eq!(
        header(&h, "x-ratelimit-reset").as_deref(),
        Some("1700000001")
    );
    assert_eq!(h.len(), 3);
}

#[test]
fn r11_every_denial_gets_retry_after_in_whole_seconds_at_least_one() {
    for (retry_ms, secs) in [
        (0, "1"),
        (1, "1"),
        (999, "1"),
        (1_000, "1"),
        (1_001, "2"),
        (59_500, "60"),
    ] {
        let d = decision(false, 1, 0, 0, retry_ms);
        for options in [
            HeaderOptions::new(),
            HeaderOptions::none(),
            HeaderOptions::none().with_legacy(true),
        ] {
            let h = options.headers(&d, 0);
            assert_eq!(
                header(&h, "retry-after").as_deref(),
                Some(secs),
                "{retry_ms} ms"
            );
        }
    }
}

/// A store that is down.
struct DownStore;

impl<S: Strategy> RateLimitStore<S> for DownStore {
    fn apply(&self, request: RateLimitRequest<'_, S>) -> Result<RateLimitReply, RateLimitError> {
        Err(RateLimitError::store(
            request.key,
            std::io::Error::other("connection refused"),
        ))
    }
}

fn down_enforcer(fail: FailMode, errors: &Arc<AtomicUsize>) -> Enforcer<Gcra, DownStore> {
    let limiter = Limiter::builder(Gcra::new(10, Duration::from_secs(1)).unwrap())
        .with_store(DownStore)
        .build();
    let errors = Arc::clone(errors);
    Enforcer::new(limiter)
        .with_fail_mode(fail)
        .with_headers(HeaderOptions::new().with_structured(true).with_legacy(true))
        .on_error(move |key, err| {
            assert_eq!(key, "client");
            assert!(err.is_store());
            errors.fetch_add(1, Ordering::Relaxed);
        })
}

#[test]
fn r12_store_failure_fails_open_or_closed_and_reports_once() {
    let errors = Arc::new(AtomicUsize::new(0));
    let open = down_enforcer(FailMode::Open, &errors).enforce("client");
    assert!(open.allowed);
    assert_eq!(open.outcome, EnforceOutcome::Error);
    assert!(open.headers.is_empty());
    assert_eq!(open.decision, None);
    assert_eq!(errors.load(Ordering::Relaxed), 1);

    let closed = down_enforcer(FailMode::Closed, &errors).enforce("client");
    assert!(!closed.allowed);
    assert_eq!(closed.outcome, EnforceOutcome::Error);
    assert!(closed.headers.is_empty());
    assert_eq!(errors.load(Ordering::Relaxed), 2);
}

#[test]
fn r12_bad_input_is_refused_whatever_the_fail_mode() {
    let errors = Arc::new(AtomicUsize::new(0));
    let enforcer = Enforcer::new(Limiter::new(Gcra::new(2, Duration::from_secs(1)).unwrap()))
        .with_fail_mode(FailMode::Open)
        .on_error({
            let errors = Arc::clone(&errors);
            move |_, _| {
                errors.fetch_add(1, Ordering::Relaxed);
            }
        });
    for (e, outcome) in [
        (enforcer.enforce(""), EnforceOutcome::Invalid),
        // A cost above the capacity is the server's configuration, not the client's input.
        (
            enforcer.enforce_n("k", nz(3)),
            EnforceOutcome::Misconfigured,
        ),
    ] {
        assert_eq!((e.allowed, e.outcome), (false, outcome));
        assert!(e.headers.is_empty());
    }
    assert_eq!(errors.load(Ordering::Relaxed), 0);
}

#[tokio::test]
async fn r12_async_enforcement_fails_the_same_way() {
    let errors = Arc::new(AtomicUsize::new(0));
    let result = down_enforcer(FailMode::Closed, &errors)
        .enforce_async("client", NonZeroU32::MIN)
        .await;
    assert_eq!(
        (result.allowed, result.outcome),
        (false, EnforceOutcome::Error)
    );
    assert_eq!(errors.load(Ordering::Relaxed), 1);
}

#[test]
fn enforcer_reports_limits_with_headers_and_callback() {
    let clock = ManualClock::new(0);
    let limiter = Limiter::builder(Gcra::new(2, Duration::from_secs(60)).unwrap())
        .with_clock(clock)
        .build();
    let limited = Arc::new(Mutex::new(Vec::new()));
    let seen = Arc::clone(&limited);
    let enforcer = Enforcer::new(limiter)
        .with_headers(HeaderOptions::new().with_structured(true))
        .on_limited(move |key, d| {
            seen.lock()
                .unwrap()
                .push((key.to_owned(), d.retry_after_ms))
        });
    let ok = enforcer.enforce("ip");
    assert_eq!((ok.allowed, ok.outcome), (true, EnforceOutcome::Ok));
    assert_eq!(
        header(&ok.headers, "ratelimit-remaining").as_deref(),
        Some("1")
    );
    assert_eq!(
        header(&ok.headers, "ratelimit-policy").as_deref(),
        Some(r#""default";q=2;w=60"#)
    );
    enforcer.enforce("ip");
    let denied = enforcer.enforce("ip");
    assert_eq!(
        (denied.allowed, denied.outcome),
        (false, EnforceOutcome::Limited)
    );
    assert_eq!(
        header(&denied.headers, "retry-after").as_deref(),
        Some("30")
    );
    assert_eq!(*limited.lock().unwrap(), [("ip".to_owned(), 30_000)]);
}

#[test]
fn r17_an_enforcer_decides_at_the_microsecond_and_reports_in_milliseconds() {
    let clock = ManualClock::new(1_000);
    let limiter = Limiter::builder(Gcra::per_second(nz(10_000)).with_burst(nz(1)))
        .with_clock(clock.clone())
        .build();
    let enforcer = Enforcer::new(limiter);
    for i in 0..1_000 {
        assert!(enforcer.enforce("ip").allowed, "call {i}");
        clock.advance_us(100);
    }
    // Headers still speak whole seconds from the current millisecond.
    clock.advance_us(50);
    enforcer.enforce("ip");
    let denied = enforcer.enforce("ip");
    assert!(!denied.allowed);
    assert_eq!(denied.decision.map(|d| d.retry_after_ms), Some(1));
    assert_eq!(header(&denied.headers, "retry-after").as_deref(), Some("1"));
}

fn ip(s: &str) -> IpAddr {
    s.parse().unwrap()
}

#[test]
fn r13_forwarded_headers_are_ignored_unless_trusted() {
    let untrusted = ClientIp::new();
    assert_eq!(untrusted.key(ip("10.0.0.1"), ["1.1.1.1"]), "10.0.0.1");
    let mut headers = HeaderMap::new();
    headers.insert("x-forwarded-for", "1.1.1.1, 2.2.2.2".parse().unwrap());
    assert_eq!(
        untrusted.key_from_headers(ip("10.0.0.1"), &headers),
        "10.0.0.1"
    );
}

#[test]
fn r13_trust_by_hop_count() {
    let chain = ["1.1.1.1, 2.2.2.2"];
    let peer = ip("10.0.0.1");
    assert_eq!(
        ClientIp::new().with_trusted_hops(0).key(peer, chain),
        "10.0.0.1"
    );
    assert_eq!(
        ClientIp::new().with_trusted_hops(1).key(peer, chain),
        "2.2.2.2"
    );
    assert_eq!(
        ClientIp::new().with_trusted_hops(2).key(peer, chain),
        "1.1.1.1"
    );
    // More hops than the chain: the leftmost (original) address.
    assert_eq!(
        ClientIp::new().with_trusted_hops(9).key(peer, chain),
        "1.1.1.1"
    );
    // Several header lines read as one list, in order.
    assert_eq!(
        ClientIp::new()
            .with_trusted_hops(2)
            .key(peer, ["1.1.1.1", "2.2.2.2"]),
        "1.1.1.1"
    );
}

#[test]
fn r13_trust_by_cidr_list() {
    let trusted = ClientIp::new()
        .with_trusted_proxies(["10.0.0.0/8", "192.168.1.7", "2001:db8:ffff::/48"])
        .unwrap();
    assert_eq!(
        trusted.key(ip("10.1.2.3"), ["203.0.113.9, 192.168.1.7"]),
        "203.0.113.9"
    );
    // The rightmost untrusted address wins: a client cannot spoof past it.
    assert_eq!(
        trusted.key(ip("10.1.2.3"), ["6.6.6.6, 203.0.113.9"]),
        "203.0.113.9"
    );
    // An untrusted peer is the client, whatever it forwards.
    assert_eq!(trusted.key(ip("8.8.8.8"), ["203.0.113.9"]), "8.8.8.8");
    // Everything trusted: the leftmost address.
    assert_eq!(trusted.key(ip("10.0.0.1"), ["10.0.0.2"]), "10.0.0.2");
    assert_eq!(
        trusted.key(ip("2001:db8:ffff::1"), ["198.51.100.1"]),
        "198.51.100.1"
    );
    assert_eq!(
        ClientIp::new()
            .with_trust(TrustProxy::Cidrs(Vec::new()))
            .key(ip("10.0.0.1"), ["1.1.1.1"]),
        "10.0.0.1"
    );
}

#[test]
fn r13_ipv6_is_aggregated_to_a_64_by_default() {
    let peer = ip("2001:db8:aaaa:bbbb:1:2:3:4");
    assert_eq!(
        ClientIp::new().key(peer, None::<&str>),
        "2001:db8:aaaa:bbbb::/64"
    );
    let neighbour = ip("2001:db8:aaaa:bbbb:ffff::9");
    assert_eq!(
        ClientIp::new().key(neighbour, None::<&str>),
        "2001:db8:aaaa:bbbb::/64"
    );
    let wide = ClientIp::new().with_ipv6_prefix(48).unwrap();
    assert_eq!(wide.key(peer, None::<&str>), "2001:db8:aaaa::/48");
    let exact = ClientIp::new().with_ipv6_prefix(128).unwrap();
    assert_eq!(exact.key(peer, None::<&str>), "2001:db8:aaaa:bbbb:1:2:3:4");
}

#[test]
fn r13_ipv4_mapped_ipv6_is_collapsed() {
    let mapped = ip("::ffff:203.0.113.5");
    assert_eq!(ClientIp::new().key(mapped, None::<&str>), "203.0.113.5");
    let trusted = ClientIp::new()
        .with_trusted_proxies(["10.0.0.0/8"])
        .unwrap();
    assert_eq!(
        trusted.key(ip("::ffff:10.0.0.1"), ["::ffff:198.51.100.2"]),
        "198.51.100.2"
    );
}

#[test]
fn r13_invalid_forwarded_tokens_are_dropped() {
    let hops = ClientIp::new().with_trusted_hops(1);
    assert_eq!(
        hops.key(ip("10.0.0.1"), ["1.1.1.1, junk, , 999.1.1.1"]),
        "1.1.1.1"
    );
    assert_eq!(hops.key(ip("10.0.0.1"), ["unknown"]), "10.0.0.1");
    assert_eq!(hops.key(ip("10.0.0.1"), ["1.1.1.1:8080"]), "1.1.1.1");
    assert_eq!(
        hops.key(ip("10.0.0.1"), ["[2001:db8::1]:443"]),
        "2001:db8::/64"
    );
}

#[test]
fn r13_hmac_sha256_rfc4231() {
    // RFC 4231, test case 2.
    let hasher = KeyHasher::new("Jefe").unwrap();
    assert_eq!(
        hasher.hash("what do ya want for nothing?"),
        "5bdcc146bf60754e6a042426089575c75a003f089d2739839dec58b964ec3843"
    );
    // RFC 4231, test case 1.
    let hasher = KeyHasher::new([0x0b; 20]).unwrap();
    let key = hasher.hash("Hi There");
    assert_eq!(
        key,
        "b0344c61d8db38535ca8afceaf0bf12b881dc200c9833da726e9376c2e32cff7"
    );
    assert!(
        key.bytes()
            .all(|b| b.is_ascii_digit() || (b'a'..=b'f').contains(&b))
    );
    assert!(matches!(
        KeyHasher::new(""),
        Err(RateLimitError::EmptySecret)
    ));
}

#[test]
fn r14_bad_config_is_a_typed_error() {
    let second = Duration::from_secs(1);
    assert!(matches!(
        Gcra::new(0, second),
        Err(RateLimitError::ZeroLimit)
    ));
    assert!(matches!(
        Gcra::new(1, Duration::ZERO),
        Err(RateLimitError::InvalidDuration {
            reason: "must be greater than zero",
            ..
        })
    ));
    assert!(matches!(
        Gcra::new(1, Duration::from_micros(999)),
        Err(RateLimitError::InvalidDuration {
            reason: "must be at least 1 ms",
            ..
        })
    ));
    assert!(matches!(
        Gcra::new(1, Duration::MAX),
        Err(RateLimitError::InvalidDuration { .. })
    ));
    assert!(matches!(
        TokenBucket::new(0, 1, second),
        Err(RateLimitError::ZeroCapacity)
    ));
    assert!(matches!(
        TokenBucket::new(1, 0, second),
        Err(RateLimitError::ZeroRate)
    ));
    assert!(matches!(
        TokenBucket::new(1, 1, Duration::ZERO),
        Err(RateLimitError::InvalidDuration {
            reason: "must be greater than zero",
            ..
        })
    ));
    assert!(matches!(
        FixedWindow::new(0, second),
        Err(RateLimitError::ZeroLimit)
    ));
    assert!(matches!(
        FixedWindow::new(1, Duration::ZERO),
        Err(RateLimitError::InvalidDuration {
            reason: "must be greater than zero",
            ..
        })
    ));
    assert!(matches!(
        FixedWindow::new(u32::MAX, Duration::from_secs(86_400 * 365 * 2)),
        Err(RateLimitError::TooLarge { .. })
    ));
    assert!(matches!(
        SlidingWindow::new(0, second),
        Err(RateLimitError::ZeroLimit)
    ));
    assert!(matches!(
        LeakyBucket::new(0, second, second),
        Err(RateLimitError::ZeroRate)
    ));
    assert!(matches!(
        PolicyName::new("bad\r\nname"),
        Err(RateLimitError::InvalidPolicyName { .. })
    ));
    assert!(matches!(
        ClientIp::new().with_ipv6_prefix(129),
        Err(RateLimitError::InvalidIpv6Prefix(129))
    ));
    let err = ClientIp::new()
        .with_trusted_proxies(["10.0.0.0/33"])
        .unwrap_err();
    assert_eq!(err.to_string(), "invalid trusted proxy `10.0.0.0/33`");
    assert!(matches!(
        Gcra::new(1, throttlebeam::clock::MAX_TIMER + Duration::from_millis(1)),
        Err(RateLimitError::InvalidDuration { what: "period", .. })
    ));
    assert!(SlidingWindow::new(1, Duration::from_micros(1_500)).is_ok());
    assert!(matches!(
        LeakyBucket::new(1, second, Duration::from_micros(500)),
        Err(RateLimitError::InvalidDuration {
            what: "max queue",
            ..
        })
    ));
    assert!(std::error::Error::source(&err).is_some());
}

#[test]
fn r14_zero_cost_is_a_typed_error_naming_the_key() {
    let (limiter, _clock) = manual(Gcra::new(1, Duration::from_secs(1)).unwrap());
    let err = limiter.check_n("user:7", 0).unwrap_err();
    assert!(matches!(err, RateLimitError::ZeroCost { ref key } if key == "user:7"));
    assert_eq!(
        err.to_string(),
        r#"invalid cost for key "user:7": must be at least 1"#
    );
    assert!(limiter.forecast("user:7", 0).is_err());
    let shaper = Limiter::new(vectors::leaky::ten_per_second_queue_150());
    assert!(matches!(
        shaper.try_reserve("k", 0),
        Err(RateLimitError::ZeroCost { .. })
    ));
}

#[test]
fn into_result_turns_a_denial_into_an_error() {
    let (limiter, _clock) = manual(Gcra::new(1, Duration::from_secs(1)).unwrap());
    assert!(limiter.check("k").unwrap().into_result().is_ok());
    let err = limiter.check("k").unwrap().into_result().unwrap_err();
    assert_eq!(err.decision.retry_after_ms, 1_000);
    assert_eq!(err.to_string(), "rate limited, retry after 1000 ms");
}

#[test]
fn reset_forgets_a_key() {
    let (limiter, _clock) = manual(Gcra::new(1, Duration::from_secs(1)).unwrap());
    assert!(limiter.check("k").unwrap().allowed);
    assert!(!limiter.check("k").unwrap().allowed);
    limiter.reset("k").unwrap();
    assert!(limiter.check("k").unwrap().allowed);
}

#[tokio::test]
async fn per_key_overrides_change_the_quota_of_some_keys() {
    let (limiter, _clock) = manual(Gcra::new(1, Duration::from_secs(1)).unwrap());
    limiter
        .set_override("vip", Gcra::new(3, Duration::from_secs(1)).unwrap())
        .await
        .unwrap();
    assert_eq!(limiter.check("vip").unwrap().limit, 3);
    assert_eq!(limiter.check("vip").unwrap().remaining, 1);
    assert_eq!(limiter.check("someone").unwrap().limit, 1);
    assert_eq!(limiter.peek("vip").unwrap().remaining, 1);
    assert_eq!(limiter.strategy_for("vip").limit(), 3);
    assert!(limiter.remove_override("vip").await.unwrap().is_some());
    assert_eq!(limiter.peek("vip").unwrap().limit, 1);
}

/// Issue 50 item 3: an override of this instance's own says so in its name, and wins over
/// one kept in the store (in memory, the limiter itself).
#[tokio::test]
async fn a_local_override_wins_over_a_shared_one_and_goes_alone() {
    let (limiter, _clock) = manual(Gcra::new(1, Duration::from_secs(1)).unwrap());
    let three = Gcra::new(3, Duration::from_secs(1)).unwrap();
    let five = Gcra::new(5, Duration::from_secs(1)).unwrap();
    limiter.set_override("vip", three).await.unwrap();
    limiter.set_local_override("vip", five).unwrap();
    assert_eq!(limiter.strategy_for("vip").limit(), 5);
    assert_eq!(limiter.remove_local_override("vip"), Some(five));
    assert_eq!(limiter.strategy_for("vip").limit(), 3);
    assert_eq!(limiter.remove_local_override("vip"), None);
    assert_eq!(limiter.remove_override("vip").await.unwrap(), Some(three));
    assert_eq!(limiter.strategy_for("vip").limit(), 1);
}

/// An override given a life applies for that life, then the default does (paused time).
#[tokio::test(start_paused = true)]
async fn an_override_for_a_while_expires() {
    let limiter = Limiter::new(Gcra::new(1, Duration::from_secs(1)).unwrap());
    let three = Gcra::new(3, Duration::from_secs(1)).unwrap();
    limiter
        .set_override_for("vip", three, Duration::from_secs(60))
        .await
        .unwrap();
    tokio::time::advance(Duration::from_millis(59_999)).await;
    assert_eq!(limiter.strategy_for("vip").limit(), 3);
    tokio::time::advance(Duration::from_millis(1)).await;
    assert_eq!(limiter.strategy_for("vip").limit(), 1);
    assert!(matches!(
        limiter.set_override_for("vip", three, Duration::ZERO).await,
        Err(RateLimitError::InvalidDuration { .. })
    ));
}

/// A store that records the keys it is asked for.
#[derive(Default)]
struct Recording {
    inner: MemoryRateLimitStore<throttlebeam::rate_limit::GcraState>,
    keys: Mutex<Vec<String>>,
}

impl RateLimitStore<Gcra> for Recording {
    fn apply(&self, request: RateLimitRequest<'_, Gcra>) -> Result<RateLimitReply, RateLimitError> {
        // What a remote store would send: plain data.
        let wire = serde_json::to_value(request).unwrap();
        let op = wire["op"]["op"].as_str().unwrap().to_owned();
        self.keys
            .lock()
            .unwrap()
            .push(format!("{op} {}", request.key));
        self.inner.apply(request)
    }
}

#[test]
fn the_namespace_prefixes_store_keys_and_hashed_keys_hide_identifiers() {
    let limiter = Limiter::builder(Gcra::new(5, Duration::from_secs(1)).unwrap())
        .with_store(Recording::default())
        .with_namespace("api")
        .with_clock(ManualClock::new(0))
        .build();
    let hasher = KeyHasher::new("secret").unwrap();
    let key = hasher.hash("alice@example.com");
    limiter.check(&key).unwrap();
    limiter.peek(&key).unwrap();
    limiter.reset(&key).unwrap();
    let keys = limiter.store().keys.lock().unwrap().clone();
    assert_eq!(
        keys,
        [
            format!("check api:{key}"),
            format!("peek api:{key}"),
            format!("reset api:{key}")
        ]
    );
    assert!(keys.iter().all(|k| !k.contains("alice")));
}

#[tokio::test(start_paused = true)]
async fn until_ready_waits_first_come_first_served() {
    let limiter = Limiter::new(Gcra::new(1, Duration::from_secs(1)).unwrap());
    assert!(limiter.check("k").unwrap().allowed);
    let start = tokio::time::Instant::now();
    let order = Arc::new(Mutex::new(Vec::new()));
    let waiter = |name: &'static str, delay_ms: u64| {
        let limiter = limiter.clone();
        let order = Arc::clone(&order);
        tokio::spawn(async move {
            tokio::time::sleep(Duration::from_millis(delay_ms)).await;
            limiter.until_ready("k").await.unwrap();
            order
                .lock()
                .unwrap()
                .push((name, start.elapsed().as_millis()));
        })
    };
    let a = waiter("a", 0);
    let b = waiter("b", 10);
    // c arrives when a's turn is just about due; it must not overtake a or b.
    let c = waiter("c", 999);
    for task in [a, b, c] {
        task.await.unwrap();
    }
    assert_eq!(
        *order.lock().unwrap(),
        [("a", 1_000), ("b", 2_000), ("c", 3_000)]
    );
}

#[tokio::test(start_paused = true)]
async fn until_ready_refuses_a_cost_that_can_never_pass() {
    let limiter = Limiter::new(Gcra::new(2, Duration::from_secs(1)).unwrap());
    let err = limiter.until_n_ready("k", 3).await.unwrap_err();
    assert!(matches!(
        err,
        RateLimitError::InsufficientCapacity {
            cost: 3,
            capacity: 2,
            ..
        }
    ));
    assert!(limiter.until_n_ready("k", 0).await.is_err());
    assert!(limiter.until_n_ready("k", 2).await.unwrap().allowed);
}

#[tokio::test(start_paused = true)]
async fn the_sweeper_drops_expired_keys() {
    let limiter = Limiter::builder(Gcra::new(10, Duration::from_secs(1)).unwrap())
        .with_clock(TokioClock::new())
        .build();
    for i in 0..100 {
        limiter.check(&format!("k{i}")).unwrap();
    }
    assert_eq!(limiter.store().len(), 100);
    let sweeper = limiter.spawn_sweeper(Duration::from_secs(5)).unwrap();
    tokio::time::sleep(Duration::from_secs(6)).await;
    assert!(limiter.store().is_empty());
    drop(limiter);
    tokio::time::sleep(Duration::from_secs(6)).await;
    assert!(sweeper.is_finished());
}

#[tokio::test]
async fn a_sweeper_with_a_zero_interval_is_a_typed_error() {
    let limiter = Limiter::new(Gcra::new(1, Duration::from_secs(1)).unwrap());
    for every in [Duration::ZERO, Duration::from_micros(10), Duration::MAX] {
        let err = limiter.spawn_sweeper(every).unwrap_err();
        assert!(
            matches!(
                err,
                RateLimitError::InvalidDuration {
                    what: "sweep interval",
                    ..
                }
            ),
            "{err:?}"
        );
    }
    assert_eq!(
        limiter
            .spawn_sweeper(Duration::ZERO)
            .unwrap_err()
            .to_string(),
        "invalid sweep interval: must be greater than zero"
    );
}

#[test]
fn a_sweeper_outside_a_runtime_is_a_typed_error() {
    let limiter = Limiter::new(Gcra::new(1, Duration::from_secs(1)).unwrap());
    assert!(matches!(
        limiter.spawn_sweeper(Duration::from_secs(1)),
        Err(RateLimitError::NoRuntime)
    ));
}

#[test]
fn r14_keys_follow_the_one_key_rule() {
    let (limiter, _clock) = manual(Gcra::new(5, Duration::from_secs(1)).unwrap());
    let long = "k".repeat(throttlebeam::store::MAX_KEY_LEN + 1);
    let err = limiter.check("").unwrap_err();
    assert_eq!(err.to_string(), r#"invalid key "": key is empty"#);
    let err = limiter.check_n(&long, 1).unwrap_err();
    assert!(matches!(
        &err,
        RateLimitError::InvalidKey { key, reason: "key is longer than 1024 bytes" }
            if key == &format!("{}…", "k".repeat(64))
    ));
    for result in [
        limiter.peek("").map(drop),
        limiter.forecast(&long, 1).map(drop),
        limiter.reset("").map(drop),
        limiter.check_many(&["ok", ""], 1).map(drop),
        limiter.set_local_override("", Gcra::new(1, Duration::from_secs(1)).unwrap()),
    ] {
        assert!(matches!(result, Err(RateLimitError::InvalidKey { .. })));
    }
    // Nothing was stored for bad keys; the exact maximum is fine.
    assert_eq!(limiter.store().len(), 1); // "ok" from check_many
    assert!(
        limiter
            .check(&"k".repeat(throttlebeam::store::MAX_KEY_LEN))
            .unwrap()
            .allowed
    );
    let shaper = Limiter::new(vectors::leaky::ten_per_second_queue_150());
    assert!(matches!(
        shaper.try_reserve("", 1),
        Err(RateLimitError::InvalidKey { .. })
    ));
}

#[test]
fn r15_a_spent_key_stays_denied_after_a_flood_of_fresh_keys_fills_the_store() {
    let store = MemoryRateLimitStore::new().with_max_keys(NonZeroUsize::new(1_000).unwrap());
    let clock = ManualClock::new(0);
    let limiter = Limiter::builder(Gcra::new(3, Duration::from_secs(3_600)).unwrap())
        .with_store(store)
        .with_clock(clock.clone())
        .build();
    for _ in 0..3 {
        assert!(limiter.check("abuser").unwrap().allowed);
    }
    assert!(!limiter.check("abuser").unwrap().allowed);
    // Ten times the store's size in fresh keys, each with capacity left, all used later.
    for i in 0..10_000 {
        clock.advance_ms(1);
        assert!(limiter.check(&format!("fresh{i}")).unwrap().allowed);
        assert!(limiter.store().len() <= 1_000);
    }
    let denied = limiter.check("abuser").unwrap();
    assert!(!denied.allowed, "eviction handed capacity back: {denied:?}");
    let stats = limiter.stats();
    assert!(stats.evictions >= 9_000, "{stats:?}");
    assert_eq!(limiter.store().limited_evictions(), 0);
}

#[test]
fn r16_a_flood_of_new_keys_never_hands_spent_capacity_back() {
    let store = MemoryRateLimitStore::new().with_max_keys(NonZeroUsize::new(1_000).unwrap());
    let clock = ManualClock::new(1_000_000);
    // 10 per second: one unit back every 100 ms.
    let limiter = Limiter::builder(Gcra::new(10, Duration::from_secs(1)).unwrap())
        .with_store(store)
        .with_clock(clock.clone())
        .build();
    let hot = |k: usize| format!("hot{k}");
    for k in 0..20 {
        assert_eq!(limiter.check_n(&hot(k), 10).unwrap().remaining, 0);
    }
    // One unit back each: not limited any more, yet each holds back 9.
    clock.advance_ms(100);
    for k in 0..20 {
        assert_eq!(limiter.peek(&hot(k)).unwrap().remaining, 1);
    }
    // Ten times the store's size in new keys within 50 ms, each spending 1 (every tenth 5):
    // each holds back less than a hot key.
    for i in 0..10_000 {
        clock.advance_us(5);
        let cost = if i % 10 == 0 { 5 } else { 1 };
        assert!(limiter.check_n(&format!("new{i}"), cost).unwrap().allowed);
        assert!(limiter.store().len() <= 1_000);
    }
    // Every hot key still has its one unit and no more: none was forgotten.
    for k in 0..20 {
        let once = limiter.check(&hot(k)).unwrap();
        assert!(once.allowed && once.remaining == 0, "{k}: {once:?}");
        let again = limiter.check(&hot(k)).unwrap();
        assert!(!again.allowed, "hot key {k} got capacity back: {again:?}");
    }
    let stats = limiter.stats();
    assert!(stats.evictions >= 9_000, "{stats:?}");
    assert_eq!(limiter.store().limited_evictions(), 0);
}

#[test]
fn r16_what_forgetting_hands_back_is_what_the_strategy_holds_back() {
    let one = nz(1);
    // A key at rest holds nothing back; one with every unit spent holds back its limit.
    let window = FixedWindow::new(10, Duration::from_secs(60)).unwrap();
    assert_eq!(window.spent(None, 0), 0);
    let StateUpdate::Set { state, .. } = window.check(None, 0, nz(7)).unwrap().update else {
        panic!("allowed checks write");
    };
    assert_eq!(window.spent(Some(state), 59_999_999), 7);
    assert_eq!(window.spent(Some(state), 60_000_000), 0);
    // A tiered key holds back what its most spent tier does: a daily quota spent while the
    // per-second tier is full again still counts.
    let tiers = Tiered::new(
        Gcra::per_second(nz(10)),
        FixedWindow::new(100, Duration::from_secs(86_400)).unwrap(),
    );
    let mut state = None;
    for _ in 0..9 {
        if let StateUpdate::Set { state: next, .. } = tiers.check(state, 0, one).unwrap().update {
            state = Some(next);
        }
    }
    assert_eq!(tiers.spent(state, 0), 9);
    assert_eq!(tiers.spent(state, 2_000_000), 9, "the daily tier");
    assert_eq!(tiers.spent(state, 86_400_000_000), 0);
}

/// `calls` checks of cost 1 on one key, `spacing_us` apart on a manual clock from 1 s: how
/// many were admitted.
fn spaced<S: Strategy>(strategy: S, calls: u32, spacing_us: u64) -> u32 {
    let (limiter, clock) = manual(strategy);
    clock.set(1_000);
    let mut admitted = 0;
    for _ in 0..calls {
        admitted += u32::from(limiter.check("k").unwrap().allowed);
        clock.advance_us(spacing_us);
    }
    admitted
}

#[test]
fn r17_time_is_read_in_microseconds() {
    // One every 100 µs, one at a time: a millisecond clock admits 1,000 of these.
    let gcra = Gcra::per_second(nz(10_000)).with_burst(nz(1));
    assert_eq!(spaced(gcra, 10_000, 100), 10_000);
    let bucket = TokenBucket::per_second(nz(1), nz(10_000));
    assert_eq!(spaced(bucket, 10_000, 100), 10_000);
    // Never early either: 99 µs apart, every other call waits for its 100 µs.
    assert_eq!(spaced(gcra, 10_000, 99), 5_000);
    assert_eq!(spaced(bucket, 10_000, 99), 5_000);
    // A million per second is one per microsecond.
    let fastest = Gcra::per_second(nz(1_000_000)).with_burst(nz(1));
    assert_eq!(spaced(fastest, 10_000, 1), 10_000);

    // A sliding window weighs the previous window by the microsecond: 10,000 per second,
    // asked every 100 µs, is refused once per window (at its first instant, when the previous
    // window still weighs in full), where whole milliseconds refuse the first ten.
    let sliding = SlidingWindow::new(10_000, Duration::from_secs(1)).unwrap();
    let (limiter, clock) = manual(sliding);
    let mut per_window = [0u32; 3];
    for (second, admitted) in per_window.iter_mut().enumerate() {
        for i in 0..10_000u64 {
            clock.set_us((second as u64 + 1) * 1_000_000 + i * 100);
            *admitted += u32::from(limiter.check("k").unwrap().allowed);
        }
    }
    assert_eq!(per_window, [10_000, 9_999, 9_999]);

    // Fixed windows are whole milliseconds at least; their edges fall to the microsecond.
    let fixed = FixedWindow::new(3, Duration::from_millis(1)).unwrap();
    let (limiter, clock) = manual(fixed);
    clock.set_us(1_999_999);
    assert_eq!(limiter.check_n("k", 3).unwrap().reset_at_ms, 2_000);
    assert!(!limiter.check("k").unwrap().allowed);
    clock.advance_us(1);
    assert!(limiter.check_n("k", 3).unwrap().allowed);
}

#[tokio::test(start_paused = true)]
async fn r17_the_default_clock_follows_paused_tokio_time_to_the_microsecond() {
    let limiter = Limiter::new(Gcra::per_second(nz(10_000)).with_burst(nz(1)));
    let mut admitted = 0;
    for _ in 0..10_000 {
        admitted += u32::from(limiter.check("k").unwrap().allowed);
        assert!(
            !limiter.check("k").unwrap().allowed,
            "not before its 100 µs"
        );
        tokio::time::advance(Duration::from_micros(100)).await;
    }
    assert_eq!(admitted, 10_000);
    // The waiting form too: a denial's retry-after is the wait from now, rounded up to whole
    // milliseconds (tokio's timers are no finer), never more.
    let start = tokio::time::Instant::now();
    limiter.check("k").unwrap();
    limiter.until_ready("k").await.unwrap();
    assert_eq!(start.elapsed(), Duration::from_millis(1));
}

#[test]
fn stats_count_decisions_errors_evictions_and_keys() {
    let (limiter, _clock) = manual(Gcra::new(2, Duration::from_secs(1)).unwrap());
    assert_eq!(limiter.stats(), LimiterStats::default());
    limiter.check("a").unwrap();
    limiter.check("a").unwrap();
    limiter.check("a").unwrap();
    limiter.check("b").unwrap();
    let _ = limiter.check("");
    let _ = limiter.check_n("a", 3);
    let stats = limiter.stats();
    assert_eq!(
        (
            stats.allowed,
            stats.denied,
            stats.errors,
            stats.evictions,
            stats.keys
        ),
        (3, 1, 2, 0, 2)
    );
    // Counted across threads too.
    std::thread::scope(|s| {
        for t in 0..4 {
            let limiter = &limiter;
            s.spawn(move || {
                for i in 0..100 {
                    limiter.check(&format!("t{t}-{i}")).unwrap();
                }
            });
        }
    });
    assert_eq!(limiter.stats().allowed, 403);
    let json = serde_json::to_value(limiter.stats()).unwrap();
    assert_eq!(json["allowed"], 403);
    assert_eq!(json["keys"], 402);
    assert_eq!(json["evictions"], 0);
}

#[test]
fn requests_are_plain_data_a_remote_store_can_map_to_one_script() {
    use throttlebeam::rate_limit::RateLimitOp;
    let tiers = Tiered::new(
        Gcra::new(5_000, Duration::from_secs(1)).unwrap(),
        FixedWindow::new(100, Duration::from_secs(60)).unwrap(),
    );
    let request = RateLimitRequest {
        key: "api:user:1",
        now_us: 1_000_000,
        strategy: &tiers,
        op: RateLimitOp::Check { cost: nz(2) },
    };
    assert_eq!(request.strategy_name(), "tiered");
    assert_eq!(
        serde_json::to_value(request).unwrap(),
        serde_json::json!({
            "key": "api:user:1",
            "now_us": 1_000_000,
            "strategy": {
                "first": { "period_us": 1_000_000, "per": 5_000, "tolerance": 5_000_000_000u64, "burst": 5_000 },
                "second": { "limit": 100, "window_us": 60_000_000 },
            },
            "op": { "op": "check", "cost": 2 },
        })
    );
    // Every operation, and the replies, are data too.
    for op in [
        RateLimitOp::Peek,
        RateLimitOp::Forecast { cost: nz(1) },
        RateLimitOp::Reserve { cost: nz(1) },
        RateLimitOp::Reset,
    ] {
        let back: RateLimitOp = serde_json::from_value(serde_json::to_value(op).unwrap()).unwrap();
        assert_eq!(back, op);
    }
    // The memory store answers a multi-tier check as one request.
    let store = MemoryRateLimitStore::new();
    let reply = store.apply(request).unwrap();
    assert!(matches!(reply, RateLimitReply::Decision(d) if d.allowed && d.remaining == 98));
    assert_eq!(store.len(), 1);
}

#[test]
fn a_bounded_limiter_store_stays_bounded() {
    let store = MemoryRateLimitStore::new().with_max_keys(NonZeroUsize::new(64).unwrap());
    let limiter = Limiter::builder(Gcra::new(1, Duration::from_secs(3_600)).unwrap())
        .with_store(store)
        .with_clock(ManualClock::new(0))
        .build();
    for i in 0..1_000 {
        assert!(limiter.check(&format!("k{i}")).unwrap().allowed);
        assert!(limiter.store().len() <= 64);
    }
    // Every key was limited: the ones that went were counted.
    assert_eq!(
        limiter.store().limited_evictions(),
        limiter.stats().evictions
    );
    assert!(limiter.stats().evictions >= 1_000 - 64);
}

// ---------------------------------------------------------------------------------------------
// What an override means for a key's state (issue 50 item 3): the same in memory and in Redis
// (tests/redis_rate_limit.rs compares both on random sequences of changing limits).
// ---------------------------------------------------------------------------------------------

/// One check of `cost` on `key` at `now_us` under `strategy`, in `store`.
fn spend<S: Strategy>(
    store: &MemoryRateLimitStore<S::State>,
    strategy: &S,
    key: &str,
    now_us: u64,
    cost: u32,
) -> Decision
where
    MemoryRateLimitStore<S::State>: RateLimitStore<S>,
{
    store.check(key, now_us, strategy, nz(cost)).unwrap()
}

/// A token bucket keeps its tokens under another capacity, capped at it at once (even at the
/// instant it was last written), and refills at the new rate.
#[test]
fn an_override_keeps_a_buckets_tokens_capped_at_its_capacity() {
    let store = MemoryRateLimitStore::new();
    let ten = TokenBucket::new(10, 1, Duration::from_secs(1)).unwrap();
    let five = TokenBucket::new(5, 1, Duration::from_secs(1)).unwrap();
    let twenty = TokenBucket::new(20, 1, Duration::from_secs(1)).unwrap();
    let t0 = 1_000_000_000;
    assert_eq!(spend(&store, &ten, "k", t0, 2).remaining, 8);
    // Lowered: 8 tokens held, 5 allowed, at the same microsecond.
    assert_eq!(spend(&store, &five, "k", t0, 1).remaining, 4);
    // Raised half a second later: the 4 tokens left and half a token more (one a second, up
    // to 20), less the one spent.
    let d = spend(&store, &twenty, "k", t0 + 500_000, 1);
    assert_eq!((d.limit, d.remaining), (20, 3));
    // A bucket that was full again under the limits that wrote it is at rest: full under
    // any others too.
    assert_eq!(spend(&store, &five, "j", t0, 1).remaining, 4);
    assert_eq!(spend(&store, &twenty, "j", t0 + 1_000_000, 1).remaining, 19);
}

/// A window keeps its count against another limit: a raised limit admits what it leaves room
/// for, a lowered one denies until the window ends.
#[test]
fn an_override_keeps_a_windows_count_against_its_limit() {
    let store = MemoryRateLimitStore::new();
    let two = FixedWindow::new(2, Duration::from_secs(60)).unwrap();
    let five = FixedWindow::new(5, Duration::from_secs(60)).unwrap();
    let t0 = 60_000_000;
    assert!(spend(&store, &two, "k", t0, 2).allowed);
    assert!(!spend(&store, &two, "k", t0, 1).allowed);
    assert_eq!(spend(&store, &five, "k", t0 + 1, 1).remaining, 2);
    let d = spend(&store, &two, "k", t0 + 2, 1);
    assert!(!d.allowed);
    assert_eq!(d.retry_after_ms, 60_000, "until the window ends");
}

/// A state comes to rest under the limits that wrote it: from then on it is no state, whatever
/// limits read it. Here a count spent in a 1 ms window is not carried into the 60 s window that
/// holds it, once its own window is over.
#[test]
fn a_state_at_rest_under_the_limits_that_wrote_it_is_no_state() {
    let store = MemoryRateLimitStore::new();
    let short = FixedWindow::new(1, Duration::from_millis(1)).unwrap();
    let long = FixedWindow::new(1, Duration::from_secs(60)).unwrap();
    assert!(spend(&store, &short, "k", 0, 1).allowed);
    // Within the short window the count holds in the long one too.
    assert!(!spend(&store, &long, "k", 999, 1).allowed);
    assert!(spend(&store, &long, "k", 1_000_000, 1).allowed);
}

/// A GCRA's arrival time carries over, so the time a key's spending holds is kept; its
/// sub-microsecond fraction, counted in the quota that wrote it, is read as a whole
/// microsecond by a quota whose fraction cannot hold it.
#[test]
fn an_override_keeps_a_gcras_arrival_time_to_the_microsecond() {
    let store = MemoryRateLimitStore::new();
    // 3 per second: one costs 333,333 and a third µs.
    let three = Gcra::per_second(nz(3)).with_burst(nz(1));
    let one = Gcra::per_second(nz(1)).with_burst(nz(1));
    assert!(spend(&store, &three, "k", 0, 1).allowed);
    // Arrival time 333,333 µs and a third: under one per second, 333,334 µs.
    let d = spend(&store, &one, "k", 333_333, 1);
    assert!(!d.allowed);
    assert_eq!(d.retry_after_ms, 1);
    assert!(store.check("k", 333_334, &one, nz(1)).unwrap().allowed);
}
