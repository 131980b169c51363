//! GCRA, the generic cell rate algorithm: one timestamp per key.

use std::num::NonZeroU32;
use std::time::Duration;

use serde::{Deserialize, Serialize};

use super::RateLimitError;
use super::emission::{Emission, Tat};
use super::strategy::{self, Transition};

/// GCRA: `limit` requests per `period`, spaced by an emission interval of `period / limit`,
/// with up to `burst` (default: `limit`) at once.
///
/// The state is the theoretical arrival time (TAT) of the next request. A request of cost `n`
/// is allowed when `max(tat, now) + n * interval <= now + burst * interval`. The interval is
/// kept as an exact fraction of a microsecond, so every quota up to 1,000,000 per second is
/// exact; a finer one is refused with [`RateLimitError::TooFine`].
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
/// assert_eq!(gcra.interval(), Duration::from_millis(600));
/// assert_eq!(gcra.limit(), 5);
/// # Ok::<(), throttlebeam::rate_limit::RateLimitError>(())
/// ```
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, Serialize)]
pub struct Gcra {
    #[serde(flatten)]
    emission: Emission,
    burst: u64,
}

/// The state of a [`Gcra`] key: its theoretical arrival time.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, Serialize, Deserialize)]
pub struct GcraState {
    /// Theoretical arrival time, whole epoch microseconds: when the key is full again.
    pub tat_us: u64,
    /// The fraction of a microsecond of the arrival time, in `1 / limit` µs.
    pub rem: u64,
}

impl Gcra {
    /// `limit` requests per `period`, burst equal to `limit`.
    ///
    /// # Errors
    ///
    /// [`RateLimitError::ZeroLimit`] for a zero limit, [`RateLimitError::InvalidDuration`] for
    /// a period outside 1 ms ..= 2^36 - 1 ms, [`RateLimitError::TooFine`] for more than one
    /// request per microsecond, [`RateLimitError::TooLarge`] past the exact integer range.
    pub fn new(limit: u32, period: Duration) -> Result<Self, RateLimitError> {
        let limit = NonZeroU32::new(limit).ok_or(RateLimitError::ZeroLimit)?;
        let period_us = strategy::period_us("period", period)?;
        let per = u64::from(limit.get());
        let tolerance = u128::from(per) * u128::from(period_us);
        let tolerance = strategy::exact(tolerance, "limit * period")?;
        Ok(Self {
            emission: Emission::new(period_us, per, tolerance, "limit")?,
            burst: per,
        })
    }

    /// `limit` requests per second (a limit over 1,000,000, one per microsecond, is clamped
    /// to it).
    #[must_use]
    pub fn per_second(limit: NonZeroU32) -> Self {
        Self::clamped(limit, 1_000_000)
    }

    /// `limit` requests per minute (a limit over 60,000,000 is clamped to it).
    #[must_use]
    pub fn per_minute(limit: NonZeroU32) -> Self {
        Self::clamped(limit, 60_000_000)
    }

    fn clamped(limit: NonZeroU32, period_us: u64) -> Self {
        let per = u64::from(limit.get()).min(period_us);
        let emission = Emission::from_parts(period_us, per, per * period_us);
        Self {
            emission,
            burst: per,
        }
    }

    /// The same rate with at most `burst` requests back to back.
    ///
    /// A burst beyond the exact integer range (`burst * period` over 2^53 µs) is clamped to it.
    #[must_use]
    pub fn with_burst(self, burst: NonZeroU32) -> Self {
        let period_us = self.emission.period_us;
        let burst = u64::from(burst.get()).min(Emission::max_tolerance(period_us) / period_us);
        Self {
            emission: Emission::from_parts(period_us, self.emission.per, burst * period_us),
            burst,
        }
    }

    /// The emission interval: the time one unit takes to come back (rounded to whole
    /// nanoseconds; the limiter keeps it exact).
    #[must_use]
    pub fn interval(&self) -> Duration {
        let ns = u128::from(self.emission.period_us) * 1_000 / u128::from(self.emission.per);
        Duration::from_nanos(u64::try_from(ns).unwrap_or(u64::MAX))
    }
}

impl Gcra {
    pub(crate) fn emission(&self) -> &Emission {
        &self.emission
    }

    /// The GCRA whose tier reads `(limit, period_us, per, tolerance)` (see
    /// `ScriptedStrategy`), if those are parameters a `Gcra` can have.
    pub(crate) fn from_parts(limit: u64, period_us: u64, per: u64, tolerance: u64) -> Option<Self> {
        let valid = per >= 1
            && per <= period_us
            && limit >= 1
            && limit.checked_mul(period_us) == Some(tolerance)
            && tolerance.checked_add(period_us)? <= strategy::MAX_EXACT;
        valid.then(|| Self {
            emission: Emission::from_parts(period_us, per, tolerance),
            burst: limit,
        })
    }
}

impl From<GcraState> for Tat {
    fn from(s: GcraState) -> Self {
        Self {
            us: s.tat_us,
            rem: s.rem,
        }
    }
}

impl From<Tat> for GcraState {
    fn from(t: Tat) -> Self {
        Self {
            tat_us: t.us,
            rem: t.rem,
        }
    }
}

impl Transition for Gcra {
    type State = GcraState;
    type View = Tat;

    fn name(&self) -> &'static str {
        "gcra"
    }

    fn limit(&self) -> u64 {
        self.burst
    }

    fn window_ms(&self) -> u64 {
        self.emission.period_us / strategy::US_PER_MS
    }

    #[inline]
    fn view(&self, state: Option<GcraState>, now: u64) -> Tat {
        self.emission.view(state.map(Tat::from), now)
    }

    #[inline]
    fn available(&self, tat: &Tat, now: u64) -> u64 {
        self.emission.available(tat, now)
    }

    fn earliest(&self, tat: &Tat, now: u64, units: u64) -> u64 {
        self.emission.earliest(tat, now, units)
    }

    #[inline]
    fn consume(&self, tat: Tat, _now: u64, units: u64) -> (GcraState, u64) {
        let (tat, full_at) = self.emission.consume(tat, units);
        (tat.into(), full_at)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn interval_is_an_exact_fraction() {
        let gcra = Gcra::new(3, Duration::from_secs(1)).unwrap();
        assert_eq!(gcra.interval(), Duration::from_nanos(333_333_333));
        assert_eq!(gcra.emission.tolerance, 3_000_000);
    }

    #[test]
    fn available_is_zero_past_the_tolerance() {
        let gcra = Gcra::new(2, Duration::from_secs(1)).unwrap();
        let at = |us| Tat { us, rem: 0 };
        assert_eq!(gcra.available(&at(2_000_000), 0), 0);
        assert_eq!(gcra.available(&at(999_999), 0), 0);
        assert_eq!(gcra.available(&at(500_000), 0), 1);
        assert_eq!(gcra.available(&at(0), 0), 2);
    }

    #[test]
    fn earliest_is_never_before_now() {
        let gcra = Gcra::new(2, Duration::from_secs(1)).unwrap();
        let at = |us| Tat { us, rem: 0 };
        assert_eq!(gcra.earliest(&at(70), 70, 2), 70);
        assert_eq!(gcra.earliest(&at(1_000_000), 0, 1), 500_000);
    }

    #[test]
    fn constants_are_in_range() {
        let big = NonZeroU32::MAX;
        assert_eq!(Gcra::per_minute(big).burst, 60_000_000);
        assert_eq!(Gcra::per_second(big).interval(), Duration::from_micros(1));
        let wide = Gcra::per_second(NonZeroU32::MIN).with_burst(big);
        assert!(wide.emission.tolerance <= strategy::MAX_EXACT);
    }
}
