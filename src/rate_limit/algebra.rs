//! The decision algebra: [`combine`], its identity [`ALLOW_FULL`], and [`Tiered`] limits
//! built on them.

use std::num::NonZeroU32;

use serde::{Deserialize, Serialize};

use super::strategy::{Applied, InsufficientCapacity, StateUpdate, Strategy};
use super::{Decision, Forecast};

/// The identity of [`combine`]: allows, with unlimited `limit` and `remaining` and nothing to
/// wait for.
pub const ALLOW_FULL: Decision = Decision {
    allowed: true,
    limit: u64::MAX,
    remaining: u64::MAX,
    reset_at_ms: 0,
    retry_after_ms: 0,
};

/// Merges two decisions about the same request: allowed only if both allow, the smaller
/// `limit` and `remaining`, the later `reset_at_ms` and the longer `retry_after_ms`.
///
/// Commutative, associative and idempotent, with [`ALLOW_FULL`] as identity, so any number
/// of decisions can be folded in any order.
///
/// # Examples
///
/// ```
/// use throttlebeam::rate_limit::{ALLOW_FULL, Decision, combine};
///
/// let per_second = Decision { allowed: true, limit: 10, remaining: 3, reset_at_ms: 1_000, retry_after_ms: 0 };
/// let per_day = Decision { allowed: false, limit: 1_000, remaining: 0, reset_at_ms: 86_400_000, retry_after_ms: 5_000 };
/// let both = combine(per_second, per_day);
/// assert!(!both.allowed);
/// assert_eq!((both.limit, both.remaining, both.retry_after_ms), (10, 0, 5_000));
/// assert_eq!(combine(per_second, ALLOW_FULL), per_second);
/// ```
#[must_use]
pub const fn combine(a: Decision, b: Decision) -> Decision {
    Decision {
        allowed: a.allowed && b.allowed,
        limit: min(a.limit, b.limit),
        remaining: min(a.remaining, b.remaining),
        reset_at_ms: max(a.reset_at_ms, b.reset_at_ms),
        retry_after_ms: max(a.retry_after_ms, b.retry_after_ms),
    }
}

const fn min(a: u64, b: u64) -> u64 {
    if a < b { a } else { b }
}

const fn max(a: u64, b: u64) -> u64 {
    if a > b { a } else { b }
}

/// Two limits enforced together, e.g. a per-second burst and a daily quota. Nest it for more
/// tiers: `Tiered::new(a, Tiered::new(b, c))`.
///
/// Both tiers live in one state under one key, and a `Tiered` is plain data like any
/// strategy, so a store applies them in a single atomic step (one store call, one script): **a request consumes from every tier or from none.** When one tier denies, the others
/// are left untouched and the decision is the [`combine`] of the denial with what the other
/// tiers would report without consuming. (Checking tiers one after the other would have spent
/// the per-second budget of requests the daily quota then refused.)
///
/// # Examples
///
/// ```
/// use std::num::NonZeroU32;
/// use std::time::Duration;
/// use throttlebeam::rate_limit::{FixedWindow, Gcra, Strategy, Tiered, StateUpdate};
///
/// let tiers = Tiered::new(
///     Gcra::per_second(NonZeroU32::new(5).unwrap()),
///     FixedWindow::new(1, Duration::from_secs(86_400))?,
/// );
/// let one = NonZeroU32::MIN;
/// let first = tiers.check(None, 0, one)?;
/// assert!(first.result.allowed);
/// let StateUpdate::Set { state, .. } = first.update else { unreachable!() };
/// let second = tiers.check(Some(state), 0, one)?;
/// assert!(!second.result.allowed);
/// assert_eq!(second.update, StateUpdate::Keep); // the per-second tier was not charged
/// # Ok::<(), Box<dyn std::error::Error>>(())
/// ```
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, Serialize)]
pub struct Tiered<A, B> {
    first: A,
    second: B,
}

/// The state of a [`Tiered`] key: each tier's state.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, Serialize, Deserialize)]
pub struct TieredState<A, B> {
    /// The first tier's state.
    pub first: Option<A>,
    /// The second tier's state.
    pub second: Option<B>,
}

impl<A: Strategy, B: Strategy> Tiered<A, B> {
    /// Enforces `first` and `second` together.
    #[must_use]
    pub fn new(first: A, second: B) -> Self {
        Self { first, second }
    }

    /// The first tier.
    #[must_use]
    pub fn first(&self) -> &A {
        &self.first
    }

    /// The second tier.
    #[must_use]
    pub fn second(&self) -> &B {
        &self.second
    }

    fn split(
        state: Option<TieredState<A::State, B::State>>,
    ) -> (Option<A::State>, Option<B::State>) {
        state.map_or((None, None), |s| (s.first, s.second))
    }
}

/// The state a tier ends with after an allowed check, and its remaining lifetime.
fn settle<S: Copy>(before: Option<S>, update: StateUpdate<S>) -> (Option<S>, u64) {
    match update {
        StateUpdate::Keep => (before, 0),
        StateUpdate::Remove => (None, 0),
        StateUpdate::Set { state, ttl_us } => (Some(state), ttl_us),
    }
}

impl<A: Strategy, B: Strategy> Strategy for Tiered<A, B> {
    type State = TieredState<A::State, B::State>;

    fn name(&self) -> &'static str {
        "tiered"
    }

    fn limit(&self) -> u64 {
        self.first.limit().min(self.second.limit())
    }

    /// The window of the tier with the smaller limit (the one clients hit first).
    fn window_ms(&self) -> u64 {
        if self.first.limit() <= self.second.limit() {
            self.first.window_ms()
        } else {
            self.second.window_ms()
        }
    }

    fn check(
        &self,
        state: Option<Self::State>,
        now_us: u64,
        cost: NonZeroU32,
    ) -> Result<Applied<Self::State>, InsufficientCapacity> {
        let capacity = self.limit();
        if u64::from(cost.get()) > capacity {
            return Err(InsufficientCapacity {
                cost: cost.get(),
                capacity,
            });
        }
        let (a, b) = Self::split(state);
        let oa = self.first.check(a, now_us, cost)?;
        let ob = self.second.check(b, now_us, cost)?;
        Ok(match (oa.result.allowed, ob.result.allowed) {
            (true, true) => {
                let (first, ttl_a) = settle(a, oa.update);
                let (second, ttl_b) = settle(b, ob.update);
                Applied {
                    result: combine(oa.result, ob.result),
                    update: StateUpdate::Set {
                        state: TieredState { first, second },
                        ttl_us: ttl_a.max(ttl_b),
                    },
                }
            }
            (allowed_a, allowed_b) => {
                // Report the tier that allowed as it stands, since it is not charged.
                let da = if allowed_a {
                    self.first.peek(a, now_us)
                } else {
                    oa.result
                };
                let db = if allowed_b {
                    self.second.peek(b, now_us)
                } else {
                    ob.result
                };
                Applied {
                    result: combine(da, db),
                    update: StateUpdate::Keep,
                }
            }
        })
    }

    fn peek(&self, state: Option<Self::State>, now_us: u64) -> Decision {
        let (a, b) = Self::split(state);
        combine(self.first.peek(a, now_us), self.second.peek(b, now_us))
    }

    /// The more of the tiers' (forgetting the key hands back both): a key that spent most of
    /// its daily quota holds that back even while its per-second tier is full.
    fn spent(&self, state: Option<Self::State>, now_us: u64) -> u64 {
        let (a, b) = Self::split(state);
        self.first
            .spent(a, now_us)
            .max(self.second.spent(b, now_us))
    }

    /// Spendable is the smaller of the tiers'; the next replenishment is that of the binding
    /// tier (the later one if both bind); full when both are full.
    fn forecast(&self, state: Option<Self::State>, now_us: u64, cost: NonZeroU32) -> Forecast {
        let (a, b) = Self::split(state);
        let fa = self.first.forecast(a, now_us, cost);
        let fb = self.second.forecast(b, now_us, cost);
        let next_replenish_at_ms = match fa.spendable_now.cmp(&fb.spendable_now) {
            std::cmp::Ordering::Less => fa.next_replenish_at_ms,
            std::cmp::Ordering::Greater => fb.next_replenish_at_ms,
            std::cmp::Ordering::Equal => fa.next_replenish_at_ms.max(fb.next_replenish_at_ms),
        };
        Forecast {
            spendable_now: fa.spendable_now.min(fb.spendable_now),
            next_replenish_at_ms,
            full_at_ms: fa.full_at_ms.max(fb.full_at_ms),
        }
    }
}
