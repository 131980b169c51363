//! Invariants of the rate-limiting maths, over random strategies and call sequences. Time is
//! in microseconds, as the strategies and clocks read it; strategies are configured in ms.

use std::num::NonZeroU32;
use std::time::Duration;

use proptest::prelude::*;
use proptest::strategy::Strategy as _;
use throttlebeam::clock::ManualClock;
use throttlebeam::rate_limit::{
    ALLOW_FULL, Decision, FixedWindow, Gcra, LeakyBucket, Limiter, RateLimitError, SlidingWindow,
    StateUpdate, Strategy, Tiered, TokenBucket, combine,
};

fn nz(n: u32) -> NonZeroU32 {
    NonZeroU32::new(n).expect("non-zero")
}

/// A call sequence: (microseconds since the previous call, at most `max_dt_ms` ms, cost).
fn calls(
    max_dt_ms: u64,
    max_cost: u32,
) -> impl proptest::strategy::Strategy<Value = Vec<(u64, u32)>> {
    prop::collection::vec((0..=max_dt_ms * 1_000, 1..=max_cost), 1..120)
}

/// Microseconds in `ms` milliseconds.
fn us(ms: u64) -> u64 {
    ms * 1_000
}

/// Runs `calls` on one key from `start` ms and returns the admitted (time in µs, cost) pairs.
/// A cost above the capacity must be an error.
fn admitted<S: Strategy>(strategy: S, start: u64, calls: &[(u64, u32)]) -> Vec<(u64, u64)> {
    let clock = ManualClock::new(start);
    let limit = strategy.limit();
    let limiter = Limiter::builder(strategy).with_clock(clock.clone()).build();
    let mut out = Vec::new();
    for &(dt, cost) in calls {
        clock.advance_us(dt);
        match limiter.check_n("k", cost) {
            Ok(d) if d.allowed => out.push((clock_now(&clock), u64::from(cost))),
            Ok(_) => {}
            Err(RateLimitError::InsufficientCapacity { .. }) => assert!(u64::from(cost) > limit),
            Err(err) => panic!("{err}"),
        }
    }
    out
}

fn clock_now(clock: &ManualClock) -> u64 {
    throttlebeam::clock::Clock::now_us(clock)
}

/// Units admitted in every span `[t_i, t_j]` (µs) stay within `bound(t_j - t_i)`.
fn assert_span_bound(
    admitted: &[(u64, u64)],
    bound: impl Fn(u64) -> u64,
) -> Result<(), TestCaseError> {
    for i in 0..admitted.len() {
        let mut units = 0;
        for &(t, cost) in &admitted[i..] {
            units += cost;
            let span = t - admitted[i].0;
            prop_assert!(
                units <= bound(span),
                "{units} units in {span} µs (bound {})",
                bound(span)
            );
        }
    }
    Ok(())
}

/// Units admitted in every aligned window (of `window` ms) stay within `limit`.
fn assert_window_bound(
    admitted: &[(u64, u64)],
    window: u64,
    limit: u64,
) -> Result<(), TestCaseError> {
    let mut per_window = std::collections::BTreeMap::new();
    for &(t, cost) in admitted {
        *per_window.entry(t / us(window)).or_insert(0) += cost;
    }
    for (w, units) in per_window {
        prop_assert!(units <= limit, "{units} units in window {w}");
    }
    Ok(())
}

/// The pure functions agree with each other at every step of `calls` (from `start` ms), and
/// waiting exactly the reported times (in whole ms) is both necessary and sufficient.
fn assert_consistent<S: Strategy>(
    strategy: &S,
    start: u64,
    calls: &[(u64, u32)],
) -> Result<(), TestCaseError> {
    let mut state = None;
    let mut now = us(start);
    for &(dt, cost) in calls {
        now += dt;
        let peek = strategy.peek(state, now);
        let one = strategy.check(state, now, NonZeroU32::MIN).unwrap().result;
        prop_assert_eq!(peek.allowed, one.allowed);
        prop_assert_eq!(peek.remaining, one.remaining + u64::from(one.allowed));
        let forecast = strategy.forecast(state, now, nz(cost));
        let outcome = match strategy.check(state, now, nz(cost)) {
            Ok(outcome) => outcome,
            Err(err) => {
                prop_assert!(u64::from(cost) > peek.limit);
                prop_assert_eq!((err.cost, err.capacity), (cost, peek.limit));
                prop_assert_eq!(forecast.spendable_now, 0);
                continue;
            }
        };
        prop_assert!(u64::from(cost) <= peek.limit);
        let d = outcome.result;
        prop_assert_eq!(forecast.spendable_now > 0, d.allowed);
        prop_assert!(d.remaining <= d.limit);
        // Not full: the next replenishment is the first instant with more capacity.
        if peek.remaining < peek.limit {
            // Reported in ms, rounded up: more at that ms, not yet a ms earlier.
            let next = us(forecast.next_replenish_at_ms);
            prop_assert!(next > now);
            prop_assert!(strategy.peek(state, next).remaining > peek.remaining);
            let before = (next - 1_000).max(now);
            prop_assert_eq!(strategy.peek(state, before).remaining, peek.remaining);
        }
        prop_assert_eq!(
            strategy.peek(state, us(forecast.full_at_ms)).remaining,
            peek.limit
        );
        if !d.allowed {
            prop_assert!(
                matches!(outcome.update, StateUpdate::Keep),
                "a denial never consumes"
            );
            // In whole ms from now, rounded up.
            let at = now + us(d.retry_after_ms);
            prop_assert!(strategy.check(state, at, nz(cost)).unwrap().result.allowed);
            if d.retry_after_ms > 0 {
                prop_assert!(
                    !strategy
                        .check(state, at - 1_000, nz(cost))
                        .unwrap()
                        .result
                        .allowed
                );
            }
        }
        if let StateUpdate::Set { state: next, .. } = outcome.update {
            state = Some(next);
        }
    }
    Ok(())
}

/// Moving the clock back (`back` µs) from the last call never shows more capacity than at
/// that call.
fn assert_backwards_grants_nothing<S: Strategy>(
    strategy: &S,
    start: u64,
    calls: &[(u64, u32)],
    back: u64,
) -> Result<(), TestCaseError> {
    let mut state = None;
    let mut now = us(start);
    for &(dt, cost) in calls {
        now += dt;
        if let Ok(outcome) = strategy.check(state, now, nz(cost))
            && let StateUpdate::Set { state: next, .. } = outcome.update
        {
            state = Some(next);
        }
        let earlier = now.saturating_sub(back);
        let at_now = strategy.peek(state, now);
        let before = strategy.peek(state, earlier);
        prop_assert!(before.remaining <= at_now.remaining);
        prop_assert!(!before.allowed || at_now.allowed);
    }
    Ok(())
}

/// `peek` and `forecast` through a limiter never change what later checks decide.
fn assert_reads_are_pure<S: Strategy>(
    strategy: S,
    calls: &[(u64, u32)],
) -> Result<(), TestCaseError> {
    let (plain_clock, read_clock) = (ManualClock::new(0), ManualClock::new(0));
    let plain = Limiter::builder(strategy.clone())
        .with_clock(plain_clock.clone())
        .build();
    let reading = Limiter::builder(strategy)
        .with_clock(read_clock.clone())
        .build();
    for &(dt, cost) in calls {
        plain_clock.advance_us(dt);
        read_clock.advance_us(dt);
        for _ in 0..cost % 3 {
            reading.peek("k").unwrap();
            let _ = reading.forecast("k", cost);
        }
        prop_assert_eq!(
            plain.check_n("k", cost).ok(),
            reading.check_n("k", cost).ok()
        );
    }
    Ok(())
}

fn gcra() -> impl proptest::strategy::Strategy<Value = Gcra> {
    gcra_with_rate().prop_map(|(g, ..)| g)
}

/// A GCRA with its limit and period (ms).
fn gcra_with_rate() -> impl proptest::strategy::Strategy<Value = (Gcra, u64, u64)> {
    (1..20u32, 1..5_000u64, 1..25u32).prop_map(|(limit, period, burst)| {
        let g = Gcra::new(limit, Duration::from_millis(period))
            .unwrap()
            .with_burst(nz(burst));
        (g, u64::from(limit), period)
    })
}

fn token_bucket() -> impl proptest::strategy::Strategy<Value = (TokenBucket, u64, u64, u64)> {
    (1..20u32, 1..20u32, 1..5_000u64).prop_map(|(capacity, refill, per)| {
        let bucket = TokenBucket::new(capacity, refill, Duration::from_millis(per)).unwrap();
        (bucket, u64::from(capacity), u64::from(refill), per)
    })
}

fn windows() -> impl proptest::strategy::Strategy<Value = (u32, u64)> {
    (1..20u32, 1..5_000u64)
}

fn leaky() -> impl proptest::strategy::Strategy<Value = (LeakyBucket, u64)> {
    leaky_with_rate().prop_map(|(l, queue, ..)| (l, queue))
}

/// A shaper with its queue (ms), rate and period (ms).
fn leaky_with_rate() -> impl proptest::strategy::Strategy<Value = (LeakyBucket, u64, u64, u64)> {
    (1..20u32, 1..5_000u64, 0..3_000u64).prop_map(|(rate, per, queue)| {
        let shaper = LeakyBucket::new(
            rate,
            Duration::from_millis(per),
            Duration::from_millis(queue),
        );
        (shaper.unwrap(), queue, u64::from(rate), per)
    })
}

/// Checks at instants near `u64::MAX` µs, where every strategy's time saturates: the units
/// admitted never exceed what one full key holds, and nothing panics (debug builds check
/// every overflow).
fn assert_saturates<S: Strategy>(strategy: S, calls: &[(u64, u32)]) -> Result<(), TestCaseError> {
    let limit = strategy.limit();
    let clock = ManualClock::new_us(u64::MAX - 10_000_000_000);
    let limiter = Limiter::builder(strategy).with_clock(clock.clone()).build();
    let mut units = 0;
    for &(dt, cost) in calls {
        clock.advance_us(dt * 100_000);
        let now = clock_now(&clock);
        if let Ok(d) = limiter.check_n_at("k", cost, now) {
            units += if d.allowed { u64::from(cost) } else { 0 };
            prop_assert!(d.remaining <= limit);
        }
        let _ = limiter.peek("k");
        let _ = limiter.forecast("k", cost);
    }
    prop_assert!(
        units <= limit,
        "{units} units admitted near u64::MAX, limit {limit}"
    );
    prop_assert_eq!(clock_now(&clock) >= u64::MAX - 10_000_000_000, true);
    Ok(())
}

fn decision() -> impl proptest::strategy::Strategy<Value = Decision> {
    (
        any::<bool>(),
        any::<u64>(),
        any::<u64>(),
        any::<u64>(),
        any::<u64>(),
    )
        .prop_map(
            |(allowed, limit, remaining, reset_at_ms, retry_after_ms)| Decision {
                allowed,
                limit,
                remaining,
                reset_at_ms,
                retry_after_ms,
            },
        )
}

proptest! {
    #[test]
    fn gcra_never_admits_more_than_burst_plus_rate((g, limit, period) in gcra_with_rate(), start in 0..10_000u64, calls in calls(400, 6)) {
        let burst = g.limit();
        assert_span_bound(&admitted(g, start, &calls), |span| burst + span * limit / us(period))?;
    }

    #[test]
    fn token_bucket_never_admits_more_than_capacity_plus_refill(
        (bucket, capacity, refill, per) in token_bucket(), start in 0..10_000u64, calls in calls(400, 6),
    ) {
        assert_span_bound(&admitted(bucket, start, &calls), |span| capacity + span * refill / us(per))?;
    }

    #[test]
    fn fixed_window_never_admits_more_than_its_quota((limit, window) in windows(), start in 0..10_000u64, calls in calls(400, 6)) {
        let w = FixedWindow::new(limit, Duration::from_millis(window)).unwrap();
        assert_window_bound(&admitted(w, start, &calls), window, u64::from(limit))?;
    }

    #[test]
    fn sliding_window_never_admits_more_than_its_quota((limit, window) in windows(), start in 0..10_000u64, calls in calls(400, 6)) {
        let w = SlidingWindow::new(limit, Duration::from_millis(window)).unwrap();
        let admitted = admitted(w, start, &calls);
        assert_window_bound(&admitted, window, u64::from(limit))?;
        // Nor more than twice the quota across any window-length span.
        assert_span_bound(&admitted, |span| if span < us(window) { 2 * u64::from(limit) } else { u64::MAX })?;
    }

    #[test]
    fn leaky_bucket_never_queues_more_than_its_cap(
        (l, queue, rate, per) in leaky_with_rate(), start in 0..10_000u64, calls in calls(400, 6),
    ) {
        // Units admitted over a span start within it plus the queue: one per interval.
        assert_span_bound(&admitted(l, start, &calls), |span| (us(queue) + span) * rate / us(per) + 1)?;
    }

    #[test]
    fn time_arithmetic_saturates_near_the_end_of_time(
        g in gcra(), (bucket, ..) in token_bucket(), (limit, window) in windows(), (l, _) in leaky(),
        calls in calls(50, 6),
    ) {
        assert_saturates(g, &calls)?;
        assert_saturates(bucket, &calls)?;
        assert_saturates(FixedWindow::new(limit, Duration::from_millis(window)).unwrap(), &calls)?;
        assert_saturates(SlidingWindow::new(limit, Duration::from_millis(window)).unwrap(), &calls)?;
        assert_saturates(l, &calls)?;
        assert_saturates(Tiered::new(g, bucket), &calls)?;
    }

    #[test]
    fn a_spent_key_stays_spent_when_time_jumps_past_the_end(g in gcra(), jump in 0..u64::MAX) {
        // Spend everything at a normal time, then jump anywhere at or beyond the ceiling: one
        // refill at most, never unbounded admissions.
        let clock = ManualClock::new(1_000);
        let limit = g.limit();
        let limiter = Limiter::builder(g).with_clock(clock.clone()).build();
        while limiter.check("k").unwrap().allowed {}
        clock.set_us(u64::MAX - (jump % 1_000_000));
        let mut admitted = 0;
        for _ in 0..(2 * limit + 2) {
            admitted += u64::from(limiter.check("k").unwrap().allowed);
        }
        prop_assert!(admitted <= limit);
    }

    #[test]
    fn decisions_peeks_and_forecasts_agree(
        g in gcra(), (bucket, ..) in token_bucket(), (limit, window) in windows(), (l, _) in leaky(),
        start in 0..10_000u64, calls in calls(400, 6),
    ) {
        assert_consistent(&g, start, &calls)?;
        assert_consistent(&bucket, start, &calls)?;
        assert_consistent(&FixedWindow::new(limit, Duration::from_millis(window)).unwrap(), start, &calls)?;
        assert_consistent(&SlidingWindow::new(limit, Duration::from_millis(window)).unwrap(), start, &calls)?;
        assert_consistent(&l, start, &calls)?;
    }

    #[test]
    fn a_clock_going_backwards_grants_nothing(
        g in gcra(), (bucket, ..) in token_bucket(), (limit, window) in windows(), (l, _) in leaky(),
        start in 0..10_000u64, calls in calls(400, 6), back in 1..5_000_000u64,
    ) {
        assert_backwards_grants_nothing(&g, start, &calls, back)?;
        assert_backwards_grants_nothing(&bucket, start, &calls, back)?;
        assert_backwards_grants_nothing(&FixedWindow::new(limit, Duration::from_millis(window)).unwrap(), start, &calls, back)?;
        assert_backwards_grants_nothing(&SlidingWindow::new(limit, Duration::from_millis(window)).unwrap(), start, &calls, back)?;
        assert_backwards_grants_nothing(&l, start, &calls, back)?;
    }

    #[test]
    fn peek_and_forecast_never_change_state(
        g in gcra(), (bucket, ..) in token_bucket(), (limit, window) in windows(), (l, _) in leaky(),
        calls in calls(400, 6),
    ) {
        assert_reads_are_pure(g, &calls)?;
        assert_reads_are_pure(bucket, &calls)?;
        assert_reads_are_pure(FixedWindow::new(limit, Duration::from_millis(window)).unwrap(), &calls)?;
        assert_reads_are_pure(SlidingWindow::new(limit, Duration::from_millis(window)).unwrap(), &calls)?;
        assert_reads_are_pure(l, &calls)?;
    }

    #[test]
    fn combine_is_commutative_associative_idempotent_with_identity(a in decision(), b in decision(), c in decision()) {
        prop_assert_eq!(combine(a, b), combine(b, a));
        prop_assert_eq!(combine(combine(a, b), c), combine(a, combine(b, c)));
        prop_assert_eq!(combine(a, a), a);
        prop_assert_eq!(combine(a, ALLOW_FULL), a);
        prop_assert_eq!(combine(ALLOW_FULL, a), a);
    }
}
