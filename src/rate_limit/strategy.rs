//! The [`Strategy`] contract: a pure transition over a small serializable state.

use std::fmt::Debug;
use std::num::NonZeroU32;

use serde::Serialize;
use serde::de::DeserializeOwned;

use super::{Decision, Forecast};

/// The largest value the strategies' integer maths may reach: 2^53, the exact range of a
/// Lua number, so that a Redis script can reproduce every decision bit for bit.
pub(crate) const MAX_EXACT: u64 = 1 << 53;

/// What a store must do with a key's state after a transition.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Update<S> {
    /// Leave the stored state as it was (denials and reads never write).
    Keep,
    /// Store `state`. From `ttl_ms` after now on, the strategy must treat `state` exactly like
    /// no state (it is full again), so a store may forget it any time after that.
    Set {
        /// The next state.
        state: S,
        /// Milliseconds after `now` at which `state` is equivalent to no state.
        ttl_ms: u64,
    },
}

/// The result of a pure transition: a value for the caller and an update for the store.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Outcome<S, R = Decision> {
    /// What the caller gets back.
    pub result: R,
    /// What happens to the stored state.
    pub update: Update<S>,
}

/// A rate-limiting algorithm as pure functions of `(state, now_ms, cost)`.
///
/// No method does I/O or reads a clock, so every decision is reproducible from its inputs.
/// `None` stands for a key that has no state (never seen, expired or reset); a strategy
/// treats it as full. Times are epoch milliseconds and all maths is integer.
///
/// When `now_ms` is earlier than a time already recorded in the state (a clock that went
/// backwards), every strategy behaves as if no time had passed: it never grants extra capacity.
///
/// # Examples
///
/// ```
/// use std::num::NonZeroU32;
/// use throttlebeam::rate_limit::{Gcra, Strategy, Update};
///
/// let gcra = Gcra::new(2, std::time::Duration::from_secs(1))?;
/// let one = NonZeroU32::MIN;
/// let first = gcra.check(None, 0, one);
/// assert!(first.result.allowed);
/// let Update::Set { state, .. } = first.update else { unreachable!() };
/// assert_eq!(gcra.check(Some(state), 0, one).result.remaining, 0);
/// # Ok::<(), throttlebeam::rate_limit::RateLimitError>(())
/// ```
pub trait Strategy: Clone + Send + Sync + 'static {
    /// The per-key state: small, `Copy`, and serializable for remote stores.
    type State: Copy + Debug + PartialEq + Send + Sync + Serialize + DeserializeOwned + 'static;

    /// A stable identifier, e.g. `"gcra"`.
    fn name(&self) -> &'static str;

    /// The ceiling reported to clients (see [`Decision::limit`]).
    fn limit(&self) -> u64;

    /// The window length in milliseconds, reported as the `w` of `RateLimit-Policy`.
    fn window_ms(&self) -> u64;

    /// Tries to spend `cost` units at `now_ms`: the consuming transition.
    fn check(
        &self,
        state: Option<Self::State>,
        now_ms: u64,
        cost: NonZeroU32,
    ) -> Outcome<Self::State>;

    /// The decision a cost-1 check would get at `now_ms`, without consuming anything.
    fn peek(&self, state: Option<Self::State>, now_ms: u64) -> Decision;

    /// How requests of `cost` units would fare from `now_ms` on, without consuming anything.
    fn forecast(&self, state: Option<Self::State>, now_ms: u64, cost: NonZeroU32) -> Forecast;
}

/// The shape shared by the built-in strategies, from which `check`, `peek` and `forecast`
/// follow once (see [`check`], [`peek`], [`forecast`]).
pub(crate) trait Model {
    /// Stored state.
    type State: Copy;
    /// State brought forward to `now` (refilled, rotated).
    type View: Copy;

    fn limit(&self) -> u64;
    fn view(&self, state: Option<Self::State>, now: u64) -> Self::View;
    /// Units spendable at `now`.
    fn available(&self, view: &Self::View, now: u64) -> u64;
    /// The earliest time `>= now` at which `units` are spendable; `None` when never.
    fn earliest(&self, view: &Self::View, now: u64, units: u64) -> Option<u64>;
    /// Spends `units` (already known to be available): the next state and when it is full.
    fn consume(&self, view: Self::View, now: u64, units: u64) -> (Self::State, u64);
}

#[inline]
pub(crate) fn check<M: Model>(
    model: &M,
    state: Option<M::State>,
    now: u64,
    cost: NonZeroU32,
) -> Outcome<M::State> {
    let view = model.view(state, now);
    let available = model.available(&view, now);
    let cost = u64::from(cost.get());
    if available >= cost {
        let (state, full_at) = model.consume(view, now, cost);
        let ttl_ms = full_at.saturating_sub(now);
        Outcome {
            result: Decision {
                allowed: true,
                limit: model.limit(),
                remaining: available - cost,
                reset_at_ms: full_at,
                retry_after_ms: 0,
            },
            update: Update::Set { state, ttl_ms },
        }
    } else {
        Outcome {
            result: denied(model, &view, now, available, cost),
            update: Update::Keep,
        }
    }
}

#[cold]
fn denied<M: Model>(model: &M, view: &M::View, now: u64, available: u64, cost: u64) -> Decision {
    Decision {
        allowed: false,
        limit: model.limit(),
        remaining: available,
        reset_at_ms: full_at(model, view, now),
        retry_after_ms: model
            .earliest(view, now, cost)
            .map_or(Decision::NEVER, |t| t - now),
    }
}

fn full_at<M: Model>(model: &M, view: &M::View, now: u64) -> u64 {
    model.earliest(view, now, model.limit()).unwrap_or(now)
}

pub(crate) fn peek<M: Model>(model: &M, state: Option<M::State>, now: u64) -> Decision {
    let view = model.view(state, now);
    let available = model.available(&view, now);
    if available >= 1 {
        Decision {
            allowed: true,
            limit: model.limit(),
            remaining: available,
            reset_at_ms: full_at(model, &view, now),
            retry_after_ms: 0,
        }
    } else {
        denied(model, &view, now, available, 1)
    }
}

pub(crate) fn forecast<M: Model>(
    model: &M,
    state: Option<M::State>,
    now: u64,
    cost: NonZeroU32,
) -> Forecast {
    let view = model.view(state, now);
    let available = model.available(&view, now);
    let next_replenish_at_ms = if available >= model.limit() {
        now
    } else {
        model.earliest(&view, now, available + 1).unwrap_or(now)
    };
    Forecast {
        spendable_now: available / u64::from(cost.get()),
        next_replenish_at_ms,
        full_at_ms: full_at(model, &view, now),
    }
}

/// Checks `value <= MAX_EXACT`.
pub(crate) fn exact(value: u128, what: &'static str) -> Result<u64, super::RateLimitError> {
    u64::try_from(value)
        .ok()
        .filter(|v| *v <= MAX_EXACT)
        .ok_or(super::RateLimitError::TooLarge { what })
}

/// A `Duration` as whole milliseconds, rejecting anything shorter than 1 ms.
pub(crate) fn period_ms(period: std::time::Duration) -> Result<u64, super::RateLimitError> {
    match period.as_millis() {
        0 => Err(super::RateLimitError::ZeroPeriod),
        ms => exact(ms, "period"),
    }
}
