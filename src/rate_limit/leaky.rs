//! Leaky-bucket shaper: requests are queued and released at a steady rate.

use std::num::NonZeroU32;
use std::time::Duration;

use serde::{Deserialize, Serialize};

use super::RateLimitError;
use super::emission::{Emission, Tat};
use super::strategy::{self, Transition};

/// A shaper releasing `rate` units per `per`, one every `per / rate`, that queues requests
/// for at most `max_queue`.
///
/// A reservation of `n` units starts after the units already queued; it is accepted when its
/// last unit starts within `max_queue` of now, and its caller waits the returned delay
/// ([`Strategy::reserve`](super::Strategy::reserve), `Limiter::reserve`). As a plain check, a
/// reservation is allowed when it would be accepted; the caller is then expected to wait.
///
/// # Examples
///
/// ```
/// use std::num::NonZeroU32;
/// use std::time::Duration;
/// use throttlebeam::rate_limit::{LeakyBucket, ShaperReservation, Strategy};
///
/// let shaper = LeakyBucket::new(10, Duration::from_secs(1), Duration::from_millis(150))?;
/// let one = NonZeroU32::MIN;
/// let first = shaper.reserve(None, 0, one)?;
/// assert_eq!(first.result, ShaperReservation::Granted { delay_ms: 0 });
/// # Ok::<(), Box<dyn std::error::Error>>(())
/// ```
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, Serialize)]
pub struct LeakyBucket {
    #[serde(flatten)]
    emission: Emission,
}

/// The state of a [`LeakyBucket`] key: when its queue is empty.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, Serialize, Deserialize)]
pub struct LeakyState {
    /// Theoretical arrival time of the next unit, whole epoch microseconds.
    pub tat_us: u64,
    /// The fraction of a microsecond of the arrival time, in `1 / rate` µs.
    pub rem: u64,
}

impl LeakyBucket {
    /// Releases `rate` units per `per`, queueing for at most `max_queue` (zero: no queueing).
    ///
    /// # Errors
    ///
    /// [`RateLimitError::ZeroRate`] for a zero rate, [`RateLimitError::InvalidDuration`] for
    /// a period outside 1 ms ..= 2^36 - 1 ms or a queue longer than that,
    /// [`RateLimitError::TooFine`] for more than one unit per microsecond.
    pub fn new(rate: u32, per: Duration, max_queue: Duration) -> Result<Self, RateLimitError> {
        let rate = u64::from(NonZeroU32::new(rate).ok_or(RateLimitError::ZeroRate)?.get());
        let period_us = strategy::period_us("period", per)?;
        let queue_us = if max_queue.is_zero() {
            0
        } else {
            strategy::period_us("max queue", max_queue)?
        };
        let tolerance = u128::from(queue_us) * u128::from(rate) + u128::from(period_us);
        let tolerance = strategy::exact(tolerance, "max queue * rate")?;
        Ok(Self {
            emission: Emission::new(period_us, rate, tolerance, "rate")?,
        })
    }

    /// The release interval (rounded to whole nanoseconds; the shaper keeps it exact).
    #[must_use]
    pub fn interval(&self) -> Duration {
        let ns = u128::from(self.emission.period_us) * 1_000 / u128::from(self.emission.per);
        Duration::from_nanos(u64::try_from(ns).unwrap_or(u64::MAX))
    }
}

impl LeakyBucket {
    pub(crate) fn emission(&self) -> &Emission {
        &self.emission
    }

    /// The shaper whose tier reads `(limit, period_us, per, tolerance)` (see
    /// `ScriptedStrategy`), if those are parameters a `LeakyBucket` can have.
    pub(crate) fn from_parts(limit: u64, period_us: u64, per: u64, tolerance: u64) -> Option<Self> {
        let valid = per >= 1
            && per <= period_us
            && tolerance >= period_us
            && tolerance / period_us == limit
            && tolerance.checked_add(period_us)? <= strategy::MAX_EXACT;
        valid.then(|| Self {
            emission: Emission::from_parts(period_us, per, tolerance),
        })
    }
}

impl Transition for LeakyBucket {
    type State = LeakyState;
    type View = Tat;

    fn name(&self) -> &'static str {
        "leaky_bucket"
    }

    /// Units that can wait in the queue at once: a reservation starting now plus those that
    /// fit in `max_queue`.
    fn limit(&self) -> u64 {
        self.emission.slots()
    }

    fn window_ms(&self) -> u64 {
        self.emission.period_us / strategy::US_PER_MS
    }

    fn view(&self, state: Option<LeakyState>, now: u64) -> Tat {
        self.emission.view(
            state.map(|s| Tat {
                us: s.tat_us,
                rem: s.rem,
            }),
            now,
        )
    }

    fn available(&self, tat: &Tat, now: u64) -> u64 {
        self.emission.available(tat, now)
    }

    fn earliest(&self, tat: &Tat, now: u64, units: u64) -> u64 {
        self.emission.earliest(tat, now, units)
    }

    fn consume(&self, tat: Tat, _now: u64, units: u64) -> (LeakyState, u64) {
        let (tat, full_at) = self.emission.consume(tat, units);
        (
            LeakyState {
                tat_us: tat.us,
                rem: tat.rem,
            },
            full_at,
        )
    }

    fn delay(&self, tat: &Tat, now: u64) -> u64 {
        self.emission.delay(tat, now)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn slots_count_the_head_of_the_queue() {
        let shaper =
            LeakyBucket::new(10, Duration::from_secs(1), Duration::from_millis(150)).unwrap();
        let at = |us| Tat { us, rem: 0 };
        assert_eq!(shaper.limit(), 2);
        assert_eq!(shaper.available(&at(200_000), 0), 0);
        assert_eq!(shaper.available(&at(100_000), 0), 1);
        assert_eq!(shaper.earliest(&at(200_000), 0, 1), 50_000);
    }
}
