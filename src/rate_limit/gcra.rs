//! GCRA, the generic cell rate algorithm: one timestamp per key.

use std::num::NonZeroU32;
use std::time::Duration;

use serde::{Deserialize, Serialize};

use super::strategy::{self, Model, Outcome, Strategy};
use super::{Decision, Forecast, RateLimitError};

/// GCRA: `limit` requests per `period`, spaced by an emission interval of
/// `ceil(period / limit)` ms, with up to `burst` (default: `limit`) at once.
///
/// The state is the theoretical arrival time (TAT) of the next request. A request of cost `n`
/// is allowed when `max(tat, now) + n * interval <= now + burst * interval`.
///
/// # Examples
///
/// ```
/// use std::num::NonZeroU32;
/// use std::time::Duration;
/// use throttlebeam::rate_limit::{Gcra, Strategy};
///
/// // 100 per minute, at most 5 back to back.
/// let gcra = Gcra::new(100, Duration::from_secs(60))?.with_burst(NonZeroU32::new(5).unwrap());
/// assert_eq!(gcra.interval_ms(), 600);
/// assert_eq!(gcra.limit(), 5);
/// # Ok::<(), throttlebeam::rate_limit::RateLimitError>(())
/// ```
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Gcra {
    interval: u64,
    burst: u64,
    period: u64,
}

/// The state of a [`Gcra`] key: its theoretical arrival time in epoch ms.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, Serialize, Deserialize)]
pub struct GcraState {
    /// Theoretical arrival time: when the key is full again.
    pub tat: u64,
}

impl Gcra {
    /// `limit` requests per `period`, burst equal to `limit`.
    ///
    /// # Errors
    ///
    /// [`RateLimitError::ZeroLimit`] for a zero limit, [`RateLimitError::ZeroPeriod`] for a
    /// period under 1 ms, [`RateLimitError::TooLarge`] past the exact integer range.
    pub fn new(limit: u32, period: Duration) -> Result<Self, RateLimitError> {
        let limit = NonZeroU32::new(limit).ok_or(RateLimitError::ZeroLimit)?;
        let gcra = Self::from_parts(limit, strategy::period_ms(period)?);
        strategy::exact(u128::from(gcra.tolerance()), "burst * interval")?;
        Ok(gcra)
    }

    /// `limit` requests per second.
    #[must_use]
    pub fn per_second(limit: NonZeroU32) -> Self {
        Self::from_parts(limit, 1_000)
    }

    /// `limit` requests per minute.
    #[must_use]
    pub fn per_minute(limit: NonZeroU32) -> Self {
        Self::from_parts(limit, 60_000)
    }

    /// The same rate with at most `burst` requests back to back.
    ///
    /// A burst beyond the exact integer range is clamped to it.
    #[must_use]
    pub fn with_burst(self, burst: NonZeroU32) -> Self {
        let burst = u64::from(burst.get()).min(strategy::MAX_EXACT / self.interval);
        Self { burst, ..self }
    }

    /// Burst = limit. `limit * interval < period + limit`, which stays exact for any
    /// `u32` limit and any period up to 2^53 - 2^32 ms.
    fn from_parts(limit: NonZeroU32, period: u64) -> Self {
        let burst = u64::from(limit.get());
        Self {
            interval: period.div_ceil(burst),
            burst,
            period,
        }
    }

    /// The emission interval in ms: the time one unit takes to come back.
    #[must_use]
    pub fn interval_ms(&self) -> u64 {
        self.interval
    }

    fn tolerance(&self) -> u64 {
        self.burst * self.interval
    }
}

impl Model for Gcra {
    type State = GcraState;
    type View = u64;

    fn limit(&self) -> u64 {
        self.burst
    }

    #[inline]
    fn view(&self, state: Option<GcraState>, now: u64) -> u64 {
        state.map_or(now, |s| s.tat.max(now))
    }

    #[inline]
    fn available(&self, tat: &u64, now: u64) -> u64 {
        self.tolerance().saturating_sub(tat - now) / self.interval
    }

    fn earliest(&self, tat: &u64, now: u64, units: u64) -> Option<u64> {
        (units <= self.burst).then(|| {
            (tat + units * self.interval)
                .saturating_sub(self.tolerance())
                .max(now)
        })
    }

    #[inline]
    fn consume(&self, tat: u64, _now: u64, units: u64) -> (GcraState, u64) {
        let tat = tat + units * self.interval;
        (GcraState { tat }, tat)
    }
}

impl Strategy for Gcra {
    type State = GcraState;

    fn name(&self) -> &'static str {
        "gcra"
    }

    fn limit(&self) -> u64 {
        self.burst
    }

    fn window_ms(&self) -> u64 {
        self.period
    }

    #[inline]
    fn check(&self, state: Option<GcraState>, now_ms: u64, cost: NonZeroU32) -> Outcome<GcraState> {
        strategy::check(self, state, now_ms, cost)
    }

    fn peek(&self, state: Option<GcraState>, now_ms: u64) -> Decision {
        strategy::peek(self, state, now_ms)
    }

    fn forecast(&self, state: Option<GcraState>, now_ms: u64, cost: NonZeroU32) -> Forecast {
        strategy::forecast(self, state, now_ms, cost)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn interval_rounds_up_so_a_period_never_admits_more_than_its_limit() {
        let gcra = Gcra::new(3, Duration::from_secs(1)).unwrap();
        assert_eq!(gcra.interval_ms(), 334);
        assert_eq!(gcra.tolerance(), 1_002);
    }

    #[test]
    fn available_is_zero_past_the_tolerance() {
        let gcra = Gcra::new(2, Duration::from_secs(1)).unwrap();
        assert_eq!(gcra.available(&2_000, 0), 0);
        assert_eq!(gcra.available(&999, 0), 0);
        assert_eq!(gcra.available(&500, 0), 1);
        assert_eq!(gcra.available(&0, 0), 2);
    }

    #[test]
    fn earliest_is_never_before_now() {
        let gcra = Gcra::new(2, Duration::from_secs(1)).unwrap();
        assert_eq!(gcra.earliest(&70, 70, 2), Some(70));
        assert_eq!(gcra.earliest(&1_000, 0, 1), Some(500));
        assert_eq!(gcra.earliest(&0, 0, 3), None);
    }

    #[test]
    fn constants_are_in_range() {
        let big = NonZeroU32::MAX;
        assert_eq!(Gcra::per_minute(big).burst, u64::from(u32::MAX));
        assert_eq!(Gcra::per_second(big).interval_ms(), 1);
    }
}
