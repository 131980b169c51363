//! Leaky-bucket shaper: requests are queued and released at a steady rate.

use std::num::NonZeroU32;
use std::time::Duration;

use serde::{Deserialize, Serialize};

use super::strategy::{self, Model, Outcome, Strategy, Update};
use super::{Decision, Forecast, RateLimitError};

/// A shaper releasing `rate` units per `per`, one every `ceil(per / rate)` ms, that queues
/// requests for at most `max_queue`.
///
/// A reservation of `n` units starts after the units already queued; it is accepted when its
/// last unit starts within `max_queue` of now, and its caller waits the returned delay. As a
/// plain [`Strategy`] (`check`), a reservation is allowed when it would be accepted; the
/// caller is then expected to wait (see `Limiter::reserve`).
///
/// # Examples
///
/// ```
/// use std::num::NonZeroU32;
/// use std::time::Duration;
/// use throttlebeam::rate_limit::{LeakyBucket, Reservation};
///
/// let shaper = LeakyBucket::new(10, Duration::from_secs(1), Duration::from_millis(150))?;
/// let one = NonZeroU32::MIN;
/// let first = shaper.reserve(None, 0, one);
/// assert_eq!(first.result, Reservation::Granted { delay_ms: 0 });
/// # Ok::<(), throttlebeam::rate_limit::RateLimitError>(())
/// ```
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct LeakyBucket {
    interval: u64,
    max_queue: u64,
    period: u64,
}

/// The state of a [`LeakyBucket`] key: when its queue is empty, in epoch ms.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, Serialize, Deserialize)]
pub struct LeakyState {
    /// Theoretical arrival time of the next unit.
    pub tat: u64,
}

/// The outcome of a shaper reservation.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, Serialize, Deserialize)]
pub enum Reservation {
    /// Accepted: proceed after `delay_ms`.
    Granted {
        /// Milliseconds to wait before proceeding.
        delay_ms: u64,
    },
    /// Refused because the queue is full.
    QueueFull {
        /// Milliseconds until the same reservation would be accepted
        /// ([`Decision::NEVER`] if never).
        retry_after_ms: u64,
    },
}

impl LeakyBucket {
    /// Releases `rate` units per `per`, queueing for at most `max_queue` (zero: no queueing).
    ///
    /// # Errors
    ///
    /// [`RateLimitError::ZeroRate`], [`RateLimitError::ZeroPeriod`] for zero inputs,
    /// [`RateLimitError::TooLarge`] past 2^53 ms.
    pub fn new(rate: u32, per: Duration, max_queue: Duration) -> Result<Self, RateLimitError> {
        let rate = u64::from(NonZeroU32::new(rate).ok_or(RateLimitError::ZeroRate)?.get());
        let period = strategy::period_ms(per)?;
        let max_queue = strategy::exact(max_queue.as_millis(), "max queue")?;
        Ok(Self {
            interval: period.div_ceil(rate),
            max_queue,
            period,
        })
    }

    /// The release interval in ms.
    #[must_use]
    pub fn interval_ms(&self) -> u64 {
        self.interval
    }

    /// Units that can wait in the queue at once: a reservation starting now plus those that
    /// fit in `max_queue`.
    fn slots(&self) -> u64 {
        self.max_queue / self.interval + 1
    }

    /// Reserves `cost` units at `now_ms`: the pure transition behind `Limiter::try_reserve`.
    #[must_use]
    pub fn reserve(
        &self,
        state: Option<LeakyState>,
        now_ms: u64,
        cost: NonZeroU32,
    ) -> Outcome<LeakyState, Reservation> {
        let tat = self.view(state, now_ms);
        let cost = u64::from(cost.get());
        if self.available(&tat, now_ms) >= cost {
            let (state, full_at) = self.consume(tat, now_ms, cost);
            Outcome {
                result: Reservation::Granted {
                    delay_ms: tat - now_ms,
                },
                update: Update::Set {
                    state,
                    ttl_ms: full_at - now_ms,
                },
            }
        } else {
            let retry_after_ms = self
                .earliest(&tat, now_ms, cost)
                .map_or(Decision::NEVER, |t| t - now_ms);
            Outcome {
                result: Reservation::QueueFull { retry_after_ms },
                update: Update::Keep,
            }
        }
    }
}

impl Model for LeakyBucket {
    type State = LeakyState;
    type View = u64;

    fn limit(&self) -> u64 {
        self.slots()
    }

    fn view(&self, state: Option<LeakyState>, now: u64) -> u64 {
        state.map_or(now, |s| s.tat.max(now))
    }

    fn available(&self, tat: &u64, now: u64) -> u64 {
        let delay = tat - now;
        if delay > self.max_queue {
            0
        } else {
            (self.max_queue - delay) / self.interval + 1
        }
    }

    fn earliest(&self, tat: &u64, now: u64, units: u64) -> Option<u64> {
        (units <= self.slots()).then(|| {
            (tat + (units - 1) * self.interval)
                .saturating_sub(self.max_queue)
                .max(now)
        })
    }

    fn consume(&self, tat: u64, _now: u64, units: u64) -> (LeakyState, u64) {
        let tat = tat + units * self.interval;
        (LeakyState { tat }, tat)
    }
}

impl Strategy for LeakyBucket {
    type State = LeakyState;

    fn name(&self) -> &'static str {
        "leaky_bucket"
    }

    fn limit(&self) -> u64 {
        self.slots()
    }

    fn window_ms(&self) -> u64 {
        self.period
    }

    fn check(
        &self,
        state: Option<LeakyState>,
        now_ms: u64,
        cost: NonZeroU32,
    ) -> Outcome<LeakyState> {
        strategy::check(self, state, now_ms, cost)
    }

    fn peek(&self, state: Option<LeakyState>, now_ms: u64) -> Decision {
        strategy::peek(self, state, now_ms)
    }

    fn forecast(&self, state: Option<LeakyState>, now_ms: u64, cost: NonZeroU32) -> Forecast {
        strategy::forecast(self, state, now_ms, cost)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn slots_count_the_head_of_the_queue() {
        let shaper =
            LeakyBucket::new(10, Duration::from_secs(1), Duration::from_millis(150)).unwrap();
        assert_eq!(shaper.slots(), 2);
        assert_eq!(shaper.available(&200, 0), 0);
        assert_eq!(shaper.available(&100, 0), 1);
        assert_eq!(shaper.earliest(&200, 0, 1), Some(50));
        assert_eq!(shaper.earliest(&200, 0, 3), None);
    }
}
