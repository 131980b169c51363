//! Token bucket: a capacity that refills at a steady rate.

use std::num::NonZeroU32;
use std::time::Duration;

use serde::{Deserialize, Serialize};

use super::strategy::{self, Model, Outcome, Strategy};
use super::{Decision, Forecast, RateLimitError};

/// A bucket of `capacity` tokens, refilled by `refill` tokens every `per`, starting full.
///
/// Tokens are counted in fixed point (`per_ms` sub-units per token, `refill` sub-units per
/// millisecond), so refilling is exact integer maths with no drift.
///
/// # Examples
///
/// ```
/// use std::num::NonZeroU32;
/// use throttlebeam::rate_limit::{Strategy, TokenBucket};
///
/// // 5 tokens, 10 more every second.
/// let bucket = TokenBucket::per_second(NonZeroU32::new(5).unwrap(), NonZeroU32::new(10).unwrap());
/// let first = bucket.check(None, 0, NonZeroU32::MIN);
/// assert_eq!(first.result.remaining, 4);
/// ```
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct TokenBucket {
    capacity: u64,
    /// Sub-units per token: the refill period in ms.
    per_ms: u64,
    /// Sub-units added per millisecond: tokens per period.
    refill: u64,
}

/// The state of a [`TokenBucket`] key.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, Serialize, Deserialize)]
pub struct TokenBucketState {
    /// Tokens in sub-units (`tokens * per_ms`).
    pub level: u64,
    /// Epoch ms up to which `level` has been refilled.
    pub updated_at: u64,
}

impl TokenBucket {
    /// `capacity` tokens, `refill` tokens added every `per`.
    ///
    /// # Errors
    ///
    /// [`RateLimitError::ZeroCapacity`], [`RateLimitError::ZeroRate`],
    /// [`RateLimitError::ZeroPeriod`] for zero inputs; [`RateLimitError::TooLarge`] when
    /// `capacity * per` in ms exceeds 2^53.
    pub fn new(capacity: u32, refill: u32, per: Duration) -> Result<Self, RateLimitError> {
        let capacity = u64::from(
            NonZeroU32::new(capacity)
                .ok_or(RateLimitError::ZeroCapacity)?
                .get(),
        );
        let refill = u64::from(
            NonZeroU32::new(refill)
                .ok_or(RateLimitError::ZeroRate)?
                .get(),
        );
        let per_ms = strategy::period_ms(per)?;
        strategy::exact(
            u128::from(capacity) * u128::from(per_ms),
            "capacity * period",
        )?;
        Ok(Self {
            capacity,
            per_ms,
            refill,
        })
    }

    /// `capacity` tokens, `refill` tokens added every second.
    #[must_use]
    pub fn per_second(capacity: NonZeroU32, refill: NonZeroU32) -> Self {
        // u32::MAX * 1000 < 2^53, so no range check is needed.
        Self {
            capacity: u64::from(capacity.get()),
            per_ms: 1_000,
            refill: u64::from(refill.get()),
        }
    }

    fn full_level(&self) -> u64 {
        self.capacity * self.per_ms
    }
}

impl Model for TokenBucket {
    type State = TokenBucketState;
    type View = TokenBucketState;

    fn limit(&self) -> u64 {
        self.capacity
    }

    #[inline]
    fn view(&self, state: Option<TokenBucketState>, now: u64) -> TokenBucketState {
        let full = self.full_level();
        match state {
            None => TokenBucketState {
                level: full,
                updated_at: now,
            },
            // Time went backwards (or stood still): no refill, keep the later mark.
            Some(s) if now <= s.updated_at => s,
            Some(s) => {
                let missing = full.saturating_sub(s.level);
                let elapsed = now - s.updated_at;
                // `elapsed * refill >= missing`, i.e. enough time to fill up; saturating keeps
                // the comparison right for very old states.
                let level = if elapsed.saturating_mul(self.refill) >= missing {
                    full
                } else {
                    s.level + elapsed * self.refill
                };
                TokenBucketState {
                    level,
                    updated_at: now,
                }
            }
        }
    }

    #[inline]
    fn available(&self, view: &TokenBucketState, _now: u64) -> u64 {
        view.level / self.per_ms
    }

    fn earliest(&self, view: &TokenBucketState, now: u64, units: u64) -> Option<u64> {
        (units <= self.capacity).then(|| {
            let need = units * self.per_ms;
            if view.level >= need {
                now
            } else {
                view.updated_at + (need - view.level).div_ceil(self.refill)
            }
        })
    }

    #[inline]
    fn consume(&self, view: TokenBucketState, _now: u64, units: u64) -> (TokenBucketState, u64) {
        let next = TokenBucketState {
            level: view.level - units * self.per_ms,
            updated_at: view.updated_at,
        };
        let full_at = next.updated_at + (self.full_level() - next.level).div_ceil(self.refill);
        (next, full_at)
    }
}

impl Strategy for TokenBucket {
    type State = TokenBucketState;

    fn name(&self) -> &'static str {
        "token_bucket"
    }

    fn limit(&self) -> u64 {
        self.capacity
    }

    fn window_ms(&self) -> u64 {
        // Time to refill an empty bucket.
        self.full_level().div_ceil(self.refill)
    }

    #[inline]
    fn check(
        &self,
        state: Option<TokenBucketState>,
        now_ms: u64,
        cost: NonZeroU32,
    ) -> Outcome<TokenBucketState> {
        strategy::check(self, state, now_ms, cost)
    }

    fn peek(&self, state: Option<TokenBucketState>, now_ms: u64) -> Decision {
        strategy::peek(self, state, now_ms)
    }

    fn forecast(&self, state: Option<TokenBucketState>, now_ms: u64, cost: NonZeroU32) -> Forecast {
        strategy::forecast(self, state, now_ms, cost)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn bucket() -> TokenBucket {
        TokenBucket::new(5, 10, Duration::from_secs(1)).unwrap()
    }

    #[test]
    fn refill_is_exact_and_capped() {
        let b = bucket();
        let empty = TokenBucketState {
            level: 0,
            updated_at: 0,
        };
        // 10 tokens/s: one token (1000 sub-units) every 100 ms.
        assert_eq!(b.view(Some(empty), 99).level, 990);
        assert_eq!(b.available(&b.view(Some(empty), 100), 100), 1);
        assert_eq!(b.view(Some(empty), 1_000_000).level, 5_000);
    }

    #[test]
    fn backwards_time_does_not_refill() {
        let b = bucket();
        let s = TokenBucketState {
            level: 0,
            updated_at: 500,
        };
        assert_eq!(b.view(Some(s), 100), s);
        assert_eq!(b.earliest(&s, 100, 1), Some(600));
    }
}
