//! The [`Strategy`] contract: a pure transition over a small serializable state, and the one
//! generic implementation every built-in strategy gets from its [`Transition`].
//!
//! # Time
//!
//! The strategies read time in integer epoch **microseconds** (`now_us`, what a
//! [`Clock`](crate::clock::Clock) gives) and keep emission intervals as exact fractions of a
//! microsecond, so every quota up to 1,000,000 per second is exact, calls a few microseconds
//! apart included. What they report to callers (a [`Decision`]'s reset and retry-after, a
//! [`Forecast`], a reservation's delay) is in whole milliseconds, rounded up. Microsecond
//! timestamps stay below 2^53 (until the year 2255), so a Lua number (a double) holds every
//! value exactly and a Redis script reproduces every decision bit for bit.
//!
//! All time arithmetic saturates: `now` is clamped to [`TIME_CEILING_US`] (4·10^9 epoch
//! seconds, in 2096), after which time stands still for the strategies and the memory store.
//! A limited key then stays limited; nothing is ever granted because a sum overflowed.

use std::fmt::Debug;
use std::num::NonZeroU32;

use serde::de::DeserializeOwned;
use serde::{Deserialize, Serialize};

use super::{Decision, Forecast, RateLimitError};

/// The largest value the strategies' integer maths may reach in their configuration: 2^53,
/// the exact range of a Lua number, so that a Redis script can reproduce every decision.
pub(crate) const MAX_EXACT: u64 = 1 << 53;

/// Microseconds per millisecond.
pub(crate) const US_PER_MS: u64 = 1_000;

/// The latest instant the strategies distinguish, in epoch µs: 4·10^9 seconds (in 2096), a
/// whole second below what a `u32` of seconds holds, so stores may keep seconds in 32 bits.
/// A later `now` is treated as this one.
pub const TIME_CEILING_US: u64 = 4_000_000_000 * 1_000_000;

/// `now_us` clamped to [`TIME_CEILING_US`].
#[inline]
pub(crate) fn clamp(now_us: u64) -> u64 {
    now_us.min(TIME_CEILING_US)
}

/// Microseconds rounded up to whole milliseconds: exact below `u64::MAX - 999` (the
/// strategies' times stay below 2^54), saturating above. One add and one division by a
/// constant, where `div_ceil` also tests the remainder.
#[inline]
pub(crate) fn ms_up(us: u64) -> u64 {
    us.saturating_add(US_PER_MS - 1) / US_PER_MS
}

/// What a store must do with a key's state after a transition.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
pub enum StateUpdate<S> {
    /// Leave the stored state as it was (denials and reads never write).
    Keep,
    /// Store `state`.
    Set {
        /// The next state.
        state: S,
        /// Microseconds after `now` from which `state` is exactly like no state (the key is
        /// at rest, full again), so a store may forget it any time after that.
        ttl_us: u64,
    },
    /// Forget the key's state: it is full again.
    Remove,
}

/// The result of a pure transition: a value for the caller and an update for the store.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Applied<S, R = Decision> {
    /// What the caller gets back.
    pub result: R,
    /// What happens to the stored state.
    pub update: StateUpdate<S>,
}

/// A cost larger than a strategy can ever admit at once (its burst, capacity, quota or queue
/// slots). Waiting never helps, so it is an error, never a denial.
///
/// A [`Limiter`](super::Limiter) reports it as [`RateLimitError::InsufficientCapacity`] with
/// the key.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, thiserror::Error)]
#[error("cost {cost} exceeds the capacity {capacity}")]
pub struct InsufficientCapacity {
    /// The cost that was asked for.
    pub cost: u32,
    /// The most the strategy admits at once.
    pub capacity: u64,
}

impl InsufficientCapacity {
    /// This error for `key`.
    #[must_use]
    pub fn for_key(self, key: &str) -> RateLimitError {
        RateLimitError::InsufficientCapacity {
            key: crate::key::shown(key),
            cost: self.cost,
            capacity: self.capacity,
        }
    }
}

/// What to do with a key, as plain data: what a store receives (with the strategy's
/// parameters) and maps to one atomic step, e.g. one Redis script call.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, Serialize, Deserialize)]
#[serde(rename_all = "snake_case", tag = "op")]
pub enum RateLimitOp {
    /// Spend `cost` units ([`Limiter::check_n`](super::Limiter::check_n)).
    Check {
        /// Units to spend.
        cost: NonZeroU32,
    },
    /// The decision a cost-1 check would get, spending nothing.
    Peek,
    /// How requests of `cost` units would fare, spending nothing.
    Forecast {
        /// The cost to forecast.
        cost: NonZeroU32,
    },
    /// Reserve `cost` units of a shaper's queue (a check that also says how long to wait).
    Reserve {
        /// Units to reserve.
        cost: NonZeroU32,
    },
    /// Forget the key's state.
    Reset,
}

/// What a [`RateLimitOp`] returns, as plain data.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum RateLimitReply {
    /// The decision of a check or a peek.
    Decision(Decision),
    /// A forecast.
    Forecast(Forecast),
    /// A shaper reservation.
    Reservation(ShaperReservation),
    /// The key was reset.
    Reset,
}

/// The outcome of a shaper reservation (see [`LeakyBucket`](super::LeakyBucket)).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, Serialize, Deserialize)]
pub enum ShaperReservation {
    /// Accepted: proceed after `delay_ms`.
    Granted {
        /// Milliseconds to wait before proceeding.
        delay_ms: u64,
    },
    /// Refused because the queue is full.
    QueueFull {
        /// Milliseconds until the same reservation would be accepted.
        retry_after_ms: u64,
    },
}

/// A rate-limiting algorithm as pure functions of `(state, now_us, cost)`.
///
/// No method does I/O or reads a clock, so every decision is reproducible from its inputs,
/// and a strategy is plain data (`Serialize`) that a remote store can map to a script.
/// `None` stands for a key that has no state (never seen, expired or reset); a strategy
/// treats it as full. `now_us` is epoch microseconds, what a [`Clock`](crate::clock::Clock)
/// reads; what the strategy reports is in milliseconds, and all maths is integer (see the
/// [module docs](crate::rate_limit#time) on microseconds and saturation).
///
/// When `now_us` is earlier than a time already recorded in the state (a clock that went
/// backwards), every strategy behaves as if no time had passed: it never grants extra capacity.
///
/// Implemented by [`Gcra`](super::Gcra), [`TokenBucket`](super::TokenBucket),
/// [`FixedWindow`](super::FixedWindow), [`SlidingWindow`](super::SlidingWindow) and
/// [`LeakyBucket`](super::LeakyBucket) through one generic implementation (over a sealed
/// per-strategy transition), and by [`Tiered`](super::Tiered). Implement it directly for a
/// strategy of your own.
///
/// # Examples
///
/// ```
/// use std::num::NonZeroU32;
/// use throttlebeam::rate_limit::{Gcra, Strategy, StateUpdate};
///
/// let gcra = Gcra::new(2, std::time::Duration::from_secs(1))?;
/// let one = NonZeroU32::MIN;
/// let first = gcra.check(None, 0, one)?;
/// assert!(first.result.allowed);
/// let StateUpdate::Set { state, .. } = first.update else { unreachable!() };
/// assert_eq!(gcra.check(Some(state), 0, one)?.result.remaining, 0);
/// // Three at once can never pass a burst of two: an error, not a denial.
/// assert!(gcra.check(None, 0, NonZeroU32::new(3).unwrap()).is_err());
/// # Ok::<(), Box<dyn std::error::Error>>(())
/// ```
pub trait Strategy: Clone + Debug + Send + Sync + Serialize + 'static {
    /// The per-key state: small, `Copy`, and serializable for remote stores.
    type State: Copy + Debug + PartialEq + Send + Sync + Serialize + DeserializeOwned + 'static;

    /// A stable identifier, e.g. `"gcra"`.
    fn name(&self) -> &'static str;

    /// The ceiling reported to clients (see [`Decision::limit`]), which is also the largest
    /// cost ever admissible at once.
    fn limit(&self) -> u64;

    /// The window length in milliseconds, reported as the `w` of `RateLimit-Policy`.
    fn window_ms(&self) -> u64;

    /// Tries to spend `cost` units at `now_us`: the consuming transition.
    ///
    /// # Errors
    ///
    /// [`InsufficientCapacity`] when `cost` exceeds [`Strategy::limit`].
    fn check(
        &self,
        state: Option<Self::State>,
        now_us: u64,
        cost: NonZeroU32,
    ) -> Result<Applied<Self::State>, InsufficientCapacity>;

    /// The decision a cost-1 check would get at `now_us`, without consuming anything.
    fn peek(&self, state: Option<Self::State>, now_us: u64) -> Decision;

    /// How requests of `cost` units would fare from `now_us` on, without consuming anything.
    fn forecast(&self, state: Option<Self::State>, now_us: u64, cost: NonZeroU32) -> Forecast;

    /// Units spent by `now_us` that have not come back yet: what forgetting the key's state
    /// would hand back, since a key without state is full. 0 for a key at rest (its state is
    /// like none), [`Strategy::limit`] for one with nothing left. A bounded store forgets the
    /// keys with the fewest first, so a strategy must not report 0 for a state that still
    /// holds anything back.
    ///
    /// The default is `limit() - peek(state, now_us).remaining`.
    ///
    /// # Examples
    ///
    /// ```
    /// use std::num::NonZeroU32;
    /// use throttlebeam::rate_limit::{Gcra, StateUpdate, Strategy};
    ///
    /// let gcra = Gcra::new(10, std::time::Duration::from_secs(1))?; // one back every 100 ms
    /// let spend = gcra.check(None, 0, NonZeroU32::new(9).unwrap())?;
    /// let StateUpdate::Set { state, .. } = spend.update else { unreachable!() };
    /// assert_eq!(gcra.spent(Some(state), 0), 9);
    /// assert_eq!(gcra.spent(Some(state), 100_000), 8);
    /// assert_eq!(gcra.spent(Some(state), 900_000), 0);
    /// # Ok::<(), Box<dyn std::error::Error>>(())
    /// ```
    fn spent(&self, state: Option<Self::State>, now_us: u64) -> u64 {
        self.limit()
            .saturating_sub(self.peek(state, now_us).remaining)
    }

    /// Reserves `cost` units at `now_us`: a check that also says how long to wait before
    /// proceeding (always 0 except for a shaper, which queues).
    ///
    /// # Errors
    ///
    /// [`InsufficientCapacity`] when `cost` exceeds [`Strategy::limit`].
    fn reserve(
        &self,
        state: Option<Self::State>,
        now_us: u64,
        cost: NonZeroU32,
    ) -> Result<Applied<Self::State, ShaperReservation>, InsufficientCapacity> {
        let applied = self.check(state, now_us, cost)?;
        let d = applied.result;
        let result = if d.allowed {
            ShaperReservation::Granted { delay_ms: 0 }
        } else {
            ShaperReservation::QueueFull {
                retry_after_ms: d.retry_after_ms,
            }
        };
        Ok(Applied {
            result,
            update: applied.update,
        })
    }

    /// Runs `op` on a key's state: what a store does with a [`RateLimitOp`], through the same
    /// pure functions.
    ///
    /// # Examples
    ///
    /// ```
    /// use std::num::NonZeroU32;
    /// use throttlebeam::rate_limit::{
    ///     FixedWindow, RateLimitOp, RateLimitReply, StateUpdate, Strategy,
    /// };
    ///
    /// let window = FixedWindow::new(10, std::time::Duration::from_secs(1))?;
    /// let check = window.apply(None, 0, RateLimitOp::Check { cost: NonZeroU32::new(4).unwrap() })?;
    /// assert!(matches!(check.result, RateLimitReply::Decision(d) if d.remaining == 6));
    /// let StateUpdate::Set { state, .. } = check.update else { unreachable!() };
    /// let peek = window.apply(Some(state), 0, RateLimitOp::Peek)?;
    /// assert_eq!(peek.update, StateUpdate::Keep); // reads never write
    /// let reset = window.apply(Some(state), 0, RateLimitOp::Reset)?;
    /// assert_eq!(reset.update, StateUpdate::Remove);
    /// # Ok::<(), Box<dyn std::error::Error>>(())
    /// ```
    ///
    /// # Errors
    ///
    /// [`InsufficientCapacity`] for a check or reservation whose cost exceeds
    /// [`Strategy::limit`].
    #[inline]
    fn apply(
        &self,
        state: Option<Self::State>,
        now_us: u64,
        op: RateLimitOp,
    ) -> Result<Applied<Self::State, RateLimitReply>, InsufficientCapacity> {
        let read = |result| Applied {
            result,
            update: StateUpdate::Keep,
        };
        Ok(match op {
            RateLimitOp::Check { cost } => {
                let a = self.check(state, now_us, cost)?;
                Applied {
                    result: RateLimitReply::Decision(a.result),
                    update: a.update,
                }
            }
            RateLimitOp::Reserve { cost } => {
                let a = self.reserve(state, now_us, cost)?;
                Applied {
                    result: RateLimitReply::Reservation(a.result),
                    update: a.update,
                }
            }
            RateLimitOp::Peek => read(RateLimitReply::Decision(self.peek(state, now_us))),
            RateLimitOp::Forecast { cost } => {
                read(RateLimitReply::Forecast(self.forecast(state, now_us, cost)))
            }
            RateLimitOp::Reset => Applied {
                result: RateLimitReply::Reset,
                update: StateUpdate::Remove,
            },
        })
    }
}

/// The shape shared by the built-in strategies, in microseconds, from which the one generic
/// [`Strategy`] implementation below derives `check`, `peek`, `forecast` and `reserve`.
///
/// Every method must saturate rather than overflow; `now` is at most [`TIME_CEILING_US`].
pub trait Transition: Clone + Debug + Send + Sync + Serialize + 'static {
    /// Stored state.
    type State: Copy + Debug + PartialEq + Send + Sync + Serialize + DeserializeOwned + 'static;
    /// State brought forward to `now` (refilled, rotated).
    type View: Copy;

    /// See [`Strategy::name`].
    fn name(&self) -> &'static str;
    /// See [`Strategy::limit`].
    fn limit(&self) -> u64;
    /// See [`Strategy::window_ms`].
    fn window_ms(&self) -> u64;
    /// The state brought forward to `now`.
    fn view(&self, state: Option<Self::State>, now: u64) -> Self::View;
    /// Units spendable at `now`.
    fn available(&self, view: &Self::View, now: u64) -> u64;
    /// The earliest time `>= now` at which `units` (at most the limit) are spendable.
    fn earliest(&self, view: &Self::View, now: u64, units: u64) -> u64;
    /// Spends `units` (already known to be available): the next state and when it is full.
    fn consume(&self, view: Self::View, now: u64, units: u64) -> (Self::State, u64);
    /// How long a granted reservation waits before proceeding (a shaper's queue); 0 otherwise.
    fn delay(&self, _view: &Self::View, _now: u64) -> u64 {
        0
    }
}

impl<T: Transition> Strategy for T {
    type State = T::State;

    fn name(&self) -> &'static str {
        Transition::name(self)
    }

    fn limit(&self) -> u64 {
        Transition::limit(self)
    }

    fn window_ms(&self) -> u64 {
        Transition::window_ms(self)
    }

    #[inline(always)]
    fn check(
        &self,
        state: Option<T::State>,
        now_us: u64,
        cost: NonZeroU32,
    ) -> Result<Applied<T::State>, InsufficientCapacity> {
        step(self, state, now_us, cost).map(|(applied, _)| applied)
    }

    fn peek(&self, state: Option<T::State>, now_us: u64) -> Decision {
        let now = clamp(now_us);
        let view = self.view(state, now);
        let available = self.available(&view, now);
        if available >= 1 {
            Decision {
                allowed: true,
                limit: Transition::limit(self),
                remaining: available,
                reset_at_ms: ms_up(full_at(self, &view, now)),
                retry_after_ms: 0,
            }
        } else {
            denied(self, &view, now, available, 1)
        }
    }

    fn forecast(&self, state: Option<T::State>, now_us: u64, cost: NonZeroU32) -> Forecast {
        let now = clamp(now_us);
        let view = self.view(state, now);
        let available = self.available(&view, now);
        let limit = Transition::limit(self);
        let next = if available >= limit {
            now
        } else {
            self.earliest(&view, now, available + 1)
        };
        Forecast {
            spendable_now: available / u64::from(cost.get()),
            next_replenish_at_ms: ms_up(next),
            full_at_ms: ms_up(full_at(self, &view, now)),
        }
    }

    #[inline]
    fn spent(&self, state: Option<T::State>, now_us: u64) -> u64 {
        let now = clamp(now_us);
        let view = self.view(state, now);
        Transition::limit(self).saturating_sub(self.available(&view, now))
    }

    fn reserve(
        &self,
        state: Option<T::State>,
        now_us: u64,
        cost: NonZeroU32,
    ) -> Result<Applied<T::State, ShaperReservation>, InsufficientCapacity> {
        let (applied, delay_ms) = step(self, state, now_us, cost)?;
        let d = applied.result;
        let result = if d.allowed {
            ShaperReservation::Granted { delay_ms }
        } else {
            ShaperReservation::QueueFull {
                retry_after_ms: d.retry_after_ms,
            }
        };
        Ok(Applied {
            result,
            update: applied.update,
        })
    }
}

/// The consuming transition, with the reservation delay in ms.
#[inline(always)]
fn step<T: Transition>(
    model: &T,
    state: Option<T::State>,
    now_us: u64,
    cost: NonZeroU32,
) -> Result<(Applied<T::State>, u64), InsufficientCapacity> {
    let limit = model.limit();
    let units = u64::from(cost.get());
    if units > limit {
        return Err(InsufficientCapacity {
            cost: cost.get(),
            capacity: limit,
        });
    }
    let now = clamp(now_us);
    let view = model.view(state, now);
    let available = model.available(&view, now);
    if available < units {
        let result = denied(model, &view, now, available, units);
        return Ok((
            Applied {
                result,
                update: StateUpdate::Keep,
            },
            0,
        ));
    }
    let delay_ms = ms_up(model.delay(&view, now));
    let (state, full_at) = model.consume(view, now, units);
    let remaining = available - units;
    Ok((
        Applied {
            result: Decision {
                allowed: true,
                limit,
                remaining,
                reset_at_ms: ms_up(full_at),
                retry_after_ms: 0,
            },
            update: StateUpdate::Set {
                state,
                ttl_us: full_at.saturating_sub(now),
            },
        },
        delay_ms,
    ))
}

#[cold]
fn denied<T: Transition>(
    model: &T,
    view: &T::View,
    now: u64,
    available: u64,
    cost: u64,
) -> Decision {
    Decision {
        allowed: false,
        limit: model.limit(),
        remaining: available,
        reset_at_ms: ms_up(full_at(model, view, now)),
        // How long from now, rounded up: waiting it is always enough.
        retry_after_ms: ms_up(model.earliest(view, now, cost).saturating_sub(now)),
    }
}

fn full_at<T: Transition>(model: &T, view: &T::View, now: u64) -> u64 {
    model.earliest(view, now, model.limit())
}

/// Checks `value <= MAX_EXACT`.
pub(crate) fn exact(value: u128, what: &'static str) -> Result<u64, RateLimitError> {
    u64::try_from(value)
        .ok()
        .filter(|v| *v <= MAX_EXACT)
        .ok_or(RateLimitError::TooLarge { what })
}

/// A period or window in microseconds, within the crate's one duration range
/// (1 ms ..= 2^36 - 1 ms).
pub(crate) fn period_us(
    what: &'static str,
    period: std::time::Duration,
) -> Result<u64, RateLimitError> {
    if let Some(reason) = crate::key::duration_problem(period) {
        return Err(RateLimitError::InvalidDuration { what, reason });
    }
    // At most 2^36 ms, so it fits.
    Ok(u64::try_from(period.as_micros()).unwrap_or(u64::MAX))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn ms_up_is_div_ceil_for_every_time_the_strategies_reach() {
        let mut us = 0_u64;
        while us < 1 << 60 {
            for v in [us, us + 1, us + 999, us + 1_000, us + 1_001] {
                assert_eq!(ms_up(v), v.div_ceil(US_PER_MS), "{v} µs");
            }
            us = us * 3 + 7;
        }
        assert_eq!(ms_up(u64::MAX - 999), (u64::MAX - 999).div_ceil(US_PER_MS));
        // Above that it saturates rather than wrapping to 0.
        assert_eq!(ms_up(u64::MAX), u64::MAX / US_PER_MS);
    }
}
