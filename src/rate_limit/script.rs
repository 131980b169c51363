//! The strategies as plain integer parameters, for a store that runs them as a script.
//!
//! A remote store (Redis) cannot call [`Strategy::apply`]: it receives the strategy's
//! parameters and the [`RateLimitOp`](super::RateLimitOp) and runs the same integer maths on
//! the server. [`ScriptedStrategy`] is what it reads the parameters from: every built-in
//! strategy, and every [`Tiered`] combination of them, flattened into a list of tiers.

use super::algebra::Tiered;
use super::emission::Emission;
use super::fixed_window::FixedWindow;
use super::gcra::Gcra;
use super::leaky::LeakyBucket;
use super::sliding_window::SlidingWindow;
use super::strategy::{Strategy, Transition};
use super::token_bucket::TokenBucket;

mod sealed {
    pub trait Sealed {}
}

/// One tier of a strategy as plain integers (times in µs), exactly the fields its maths uses.
///
/// Not part of the stable API: what a script store reads from a [`ScriptedStrategy`].
#[doc(hidden)]
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
#[non_exhaustive]
pub enum TierParams {
    /// An emission interval of `period_us / per` µs with a tolerance of `tolerance / per` µs:
    /// GCRA, or (with `shaper`) the leaky-bucket shaper, whose reservations wait.
    Emission {
        /// GCRA or the shaper.
        shaper: bool,
        /// See [`Strategy::limit`].
        limit: u64,
        /// The period, µs.
        period_us: u64,
        /// Units per period.
        per: u64,
        /// In `1 / per` µs.
        tolerance: u64,
    },
    /// A token bucket of `capacity` tokens, `refill` tokens every `per_us`.
    TokenBucket {
        /// Tokens.
        capacity: u64,
        /// Sub-units per token: the refill period, µs.
        per_us: u64,
        /// Sub-units added per µs.
        refill: u64,
    },
    /// A fixed (or, with `sliding`, a sliding) window of `limit` units per `window_us`.
    Window {
        /// Sliding rather than fixed.
        sliding: bool,
        /// Units per window.
        limit: u64,
        /// The window, µs.
        window_us: u64,
    },
}

impl TierParams {
    /// How far past `now` any time this tier stores or computes can lie, in µs: what a store
    /// with a narrower number range (a Lua double) must check it can hold.
    #[must_use]
    pub fn horizon_us(&self) -> u64 {
        match *self {
            // The arrival time runs at most the tolerance ahead, plus the µs fraction and the
            // rounding of a full time.
            Self::Emission { per, tolerance, .. } => (tolerance / per).saturating_add(2),
            // Refilling from empty.
            Self::TokenBucket {
                capacity,
                per_us,
                refill,
            } => capacity.saturating_mul(per_us).div_ceil(refill),
            // The current window and the one after it.
            Self::Window { window_us, .. } => window_us.saturating_mul(2),
        }
    }
}

/// A [`Strategy`] whose parameters are plain integers a script store maps to one script call:
/// [`Gcra`], [`TokenBucket`], [`FixedWindow`], [`SlidingWindow`], [`LeakyBucket`] and any
/// [`Tiered`] of them. Sealed: a strategy of your own runs on stores that call
/// [`Strategy::apply`].
pub trait ScriptedStrategy: Strategy + sealed::Sealed {
    /// Appends this strategy's tiers, in order (one for a plain strategy).
    #[doc(hidden)]
    fn push_tiers(&self, out: &mut Vec<TierParams>);

    /// The strategy whose tiers come next in `tiers` (what [`push_tiers`](Self::push_tiers)
    /// appended), taking them; `None` if they are not tiers of this kind, or not parameters
    /// such a strategy can have (a store read back what another build or a person wrote).
    #[doc(hidden)]
    fn from_tiers(tiers: &mut std::slice::Iter<'_, TierParams>) -> Option<Self>;
}

fn emission(e: &Emission, shaper: bool, limit: u64) -> TierParams {
    TierParams::Emission {
        shaper,
        limit,
        period_us: e.period_us,
        per: e.per,
        tolerance: e.tolerance,
    }
}

impl sealed::Sealed for Gcra {}
impl ScriptedStrategy for Gcra {
    fn push_tiers(&self, out: &mut Vec<TierParams>) {
        out.push(emission(self.emission(), false, Transition::limit(self)));
    }

    fn from_tiers(tiers: &mut std::slice::Iter<'_, TierParams>) -> Option<Self> {
        match *tiers.next()? {
            TierParams::Emission {
                shaper: false,
                limit,
                period_us,
                per,
                tolerance,
            } => Self::from_parts(limit, period_us, per, tolerance),
            _ => None,
        }
    }
}

impl sealed::Sealed for LeakyBucket {}
impl ScriptedStrategy for LeakyBucket {
    fn push_tiers(&self, out: &mut Vec<TierParams>) {
        out.push(emission(self.emission(), true, Transition::limit(self)));
    }

    fn from_tiers(tiers: &mut std::slice::Iter<'_, TierParams>) -> Option<Self> {
        match *tiers.next()? {
            TierParams::Emission {
                shaper: true,
                limit,
                period_us,
                per,
                tolerance,
            } => Self::from_parts(limit, period_us, per, tolerance),
            _ => None,
        }
    }
}

impl sealed::Sealed for TokenBucket {}
impl ScriptedStrategy for TokenBucket {
    fn push_tiers(&self, out: &mut Vec<TierParams>) {
        let (capacity, per_us, refill) = self.parts();
        out.push(TierParams::TokenBucket {
            capacity,
            per_us,
            refill,
        });
    }

    fn from_tiers(tiers: &mut std::slice::Iter<'_, TierParams>) -> Option<Self> {
        match *tiers.next()? {
            TierParams::TokenBucket {
                capacity,
                per_us,
                refill,
            } => Self::from_parts(capacity, per_us, refill),
            _ => None,
        }
    }
}

impl sealed::Sealed for FixedWindow {}
impl ScriptedStrategy for FixedWindow {
    fn push_tiers(&self, out: &mut Vec<TierParams>) {
        let (limit, window_us) = self.parts();
        out.push(TierParams::Window {
            sliding: false,
            limit,
            window_us,
        });
    }

    fn from_tiers(tiers: &mut std::slice::Iter<'_, TierParams>) -> Option<Self> {
        match *tiers.next()? {
            TierParams::Window {
                sliding: false,
                limit,
                window_us,
            } => Self::from_parts(limit, window_us),
            _ => None,
        }
    }
}

impl sealed::Sealed for SlidingWindow {}
impl ScriptedStrategy for SlidingWindow {
    fn push_tiers(&self, out: &mut Vec<TierParams>) {
        let (limit, window_us) = self.parts();
        out.push(TierParams::Window {
            sliding: true,
            limit,
            window_us,
        });
    }

    fn from_tiers(tiers: &mut std::slice::Iter<'_, TierParams>) -> Option<Self> {
        match *tiers.next()? {
            TierParams::Window {
                sliding: true,
                limit,
                window_us,
            } => Self::from_parts(limit, window_us),
            _ => None,
        }
    }
}

impl<A: ScriptedStrategy, B: ScriptedStrategy> sealed::Sealed for Tiered<A, B> {}
impl<A: ScriptedStrategy, B: ScriptedStrategy> ScriptedStrategy for Tiered<A, B> {
    /// Nested tiers flatten: `Tiered(a, Tiered(b, c))` decides exactly as the three tiers
    /// `a, b, c` side by side ([`combine`](super::combine) is associative, and the forecast's
    /// binding tier is the one with the fewest spendable units, the latest on a tie).
    fn push_tiers(&self, out: &mut Vec<TierParams>) {
        self.first().push_tiers(out);
        self.second().push_tiers(out);
    }

    fn from_tiers(tiers: &mut std::slice::Iter<'_, TierParams>) -> Option<Self> {
        let first = A::from_tiers(tiers)?;
        let second = B::from_tiers(tiers)?;
        Some(Self::new(first, second))
    }
}

#[cfg(test)]
mod tests {
    use std::num::NonZeroU32;
    use std::time::Duration;

    use super::*;

    #[test]
    fn tiers_flatten_in_order() {
        let g = Gcra::new(3, Duration::from_secs(1)).unwrap();
        let w = FixedWindow::new(10, Duration::from_secs(60)).unwrap();
        let t = TokenBucket::per_second(NonZeroU32::new(5).unwrap(), NonZeroU32::MIN);
        let mut out = Vec::new();
        Tiered::new(g, Tiered::new(w, t)).push_tiers(&mut out);
        assert_eq!(
            out,
            [
                TierParams::Emission {
                    shaper: false,
                    limit: 3,
                    period_us: 1_000_000,
                    per: 3,
                    tolerance: 3_000_000
                },
                TierParams::Window {
                    sliding: false,
                    limit: 10,
                    window_us: 60_000_000
                },
                TierParams::TokenBucket {
                    capacity: 5,
                    per_us: 1_000_000,
                    refill: 1
                },
            ]
        );
        assert_eq!(out[0].horizon_us(), 1_000_002);
        assert_eq!(out[2].horizon_us(), 5_000_000);
    }

    #[test]
    fn tiers_read_back_as_the_strategy_they_came_from() {
        type Three = Tiered<Gcra, Tiered<FixedWindow, TokenBucket>>;
        let three: Three = Tiered::new(
            Gcra::new(3, Duration::from_secs(1))
                .unwrap()
                .with_burst(NonZeroU32::new(7).unwrap()),
            Tiered::new(
                FixedWindow::new(10, Duration::from_secs(60)).unwrap(),
                TokenBucket::per_second(NonZeroU32::new(5).unwrap(), NonZeroU32::MIN),
            ),
        );
        let mut tiers = Vec::new();
        three.push_tiers(&mut tiers);
        assert_eq!(Three::from_tiers(&mut tiers.iter()), Some(three));
        let shaper =
            LeakyBucket::new(10, Duration::from_secs(1), Duration::from_millis(150)).unwrap();
        let mut tiers = Vec::new();
        shaper.push_tiers(&mut tiers);
        assert_eq!(LeakyBucket::from_tiers(&mut tiers.iter()), Some(shaper));
        let window = SlidingWindow::new(2, Duration::from_secs(1)).unwrap();
        let mut tiers = Vec::new();
        window.push_tiers(&mut tiers);
        assert_eq!(SlidingWindow::from_tiers(&mut tiers.iter()), Some(window));
        // Another kind, too few tiers, or parameters no strategy has: none.
        assert_eq!(FixedWindow::from_tiers(&mut tiers.iter()), None);
        assert_eq!(Three::from_tiers(&mut tiers[..0].iter()), None);
        let bad = [TierParams::TokenBucket {
            capacity: 5,
            per_us: 1,
            refill: 2,
        }];
        assert_eq!(TokenBucket::from_tiers(&mut bad.iter()), None);
    }
}
