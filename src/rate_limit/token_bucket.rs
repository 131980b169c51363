//! Token bucket: a capacity that refills at a steady rate.

use std::num::NonZeroU32;
use std::time::Duration;

use serde::{Deserialize, Serialize};

use super::RateLimitError;
use super::strategy::{self, Transition};

/// A bucket of `capacity` tokens, refilled by `refill` tokens every `per`, starting full.
///
/// Tokens are counted in fixed point (`per` in µs sub-units per token, `refill` sub-units
/// per microsecond), so refilling is exact integer maths with no drift, up to one token per
/// microsecond.
///
/// # Examples
///
/// ```
/// use std::num::NonZeroU32;
/// use throttlebeam::rate_limit::{Strategy, TokenBucket};
///
/// // 5 tokens, 10 more every second.
/// let bucket = TokenBucket::per_second(NonZeroU32::new(5).unwrap(), NonZeroU32::new(10).unwrap());
/// let first = bucket.check(None, 0, NonZeroU32::MIN)?;
/// assert_eq!(first.result.remaining, 4);
/// # Ok::<(), Box<dyn std::error::Error>>(())
/// ```
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, Serialize)]
pub struct TokenBucket {
    capacity: u64,
    /// Sub-units per token: the refill period in µs.
    per_us: u64,
    /// Sub-units added per microsecond: tokens per period.
    refill: u64,
}

/// The state of a [`TokenBucket`] key.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, Serialize, Deserialize)]
pub struct TokenBucketState {
    /// Tokens in sub-units (`tokens * per_us`).
    pub level: u64,
    /// Epoch microseconds up to which `level` has been refilled.
    pub updated_at_us: u64,
}

impl TokenBucket {
    /// `capacity` tokens, `refill` tokens added every `per`.
    ///
    /// # Errors
    ///
    /// [`RateLimitError::ZeroCapacity`], [`RateLimitError::ZeroRate`] for zero inputs,
    /// [`RateLimitError::InvalidDuration`] for a period outside 1 ms ..= 2^36 - 1 ms,
    /// [`RateLimitError::TooFine`] for more than one token per microsecond,
    /// [`RateLimitError::TooLarge`] when `capacity * per` in µs exceeds 2^53.
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
        let per_us = strategy::period_us("period", per)?;
        if refill > per_us {
            return Err(RateLimitError::TooFine {
                what: "refill",
                units: refill,
                period_us: per_us,
            });
        }
        strategy::exact(
            u128::from(capacity) * u128::from(per_us),
            "capacity * period",
        )?;
        Ok(Self {
            capacity,
            per_us,
            refill,
        })
    }

    /// `capacity` tokens, `refill` tokens added every second (a refill over 1,000,000 is
    /// clamped to it: one token per microsecond).
    #[must_use]
    pub fn per_second(capacity: NonZeroU32, refill: NonZeroU32) -> Self {
        // u32::MAX * 10^6 < 2^53, so no range check is needed.
        Self {
            capacity: u64::from(capacity.get()),
            per_us: 1_000_000,
            refill: u64::from(refill.get()).min(1_000_000),
        }
    }

    fn full_level(&self) -> u64 {
        self.capacity * self.per_us
    }
}

impl TokenBucket {
    /// `(capacity, per_us, refill)`.
    pub(crate) fn parts(&self) -> (u64, u64, u64) {
        (self.capacity, self.per_us, self.refill)
    }

    /// The bucket of [`TokenBucket::parts`] `(capacity, per_us, refill)`, if those are
    /// parameters a `TokenBucket` can have.
    pub(crate) fn from_parts(capacity: u64, per_us: u64, refill: u64) -> Option<Self> {
        let valid = capacity >= 1
            && refill >= 1
            && refill <= per_us
            && capacity.checked_mul(per_us)? <= strategy::MAX_EXACT;
        valid.then_some(Self {
            capacity,
            per_us,
            refill,
        })
    }
}

impl Transition for TokenBucket {
    type State = TokenBucketState;
    type View = TokenBucketState;

    fn name(&self) -> &'static str {
        "token_bucket"
    }

    fn limit(&self) -> u64 {
        self.capacity
    }

    fn window_ms(&self) -> u64 {
        // Time to refill an empty bucket.
        strategy::ms_up(self.full_level().div_ceil(self.refill))
    }

    #[inline]
    fn view(&self, state: Option<TokenBucketState>, now: u64) -> TokenBucketState {
        let full = self.full_level();
        match state {
            None => TokenBucketState {
                level: full,
                updated_at_us: now,
            },
            // Time went backwards (or stood still): no refill, keep the later mark. Capped at
            // the capacity: a state written with a larger one (an override) holds no more.
            Some(s) if now <= s.updated_at_us => TokenBucketState {
                level: s.level.min(full),
                ..s
            },
            Some(s) => {
                let missing = full.saturating_sub(s.level);
                let elapsed = now - s.updated_at_us;
                // `elapsed * refill >= missing`, i.e. enough time to fill up; saturating keeps
                // the comparison right for very old states.
                let level = if elapsed.saturating_mul(self.refill) >= missing {
                    full
                } else {
                    s.level + elapsed * self.refill
                };
                TokenBucketState {
                    level,
                    updated_at_us: now,
                }
            }
        }
    }

    #[inline]
    fn available(&self, view: &TokenBucketState, _now: u64) -> u64 {
        view.level / self.per_us
    }

    fn earliest(&self, view: &TokenBucketState, now: u64, units: u64) -> u64 {
        let need = units.saturating_mul(self.per_us);
        if view.level >= need {
            now
        } else {
            view.updated_at_us
                .saturating_add((need - view.level).div_ceil(self.refill))
                .max(now)
        }
    }

    #[inline]
    fn consume(&self, view: TokenBucketState, _now: u64, units: u64) -> (TokenBucketState, u64) {
        let next = TokenBucketState {
            level: view.level - units * self.per_us,
            updated_at_us: view.updated_at_us,
        };
        let full_at = next
            .updated_at_us
            .saturating_add((self.full_level() - next.level).div_ceil(self.refill));
        (next, full_at)
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
            updated_at_us: 0,
        };
        // 10 tokens/s: one token (10^6 sub-units) every 100 ms.
        assert_eq!(b.view(Some(empty), 99_999).level, 999_990);
        assert_eq!(b.available(&b.view(Some(empty), 100_000), 100_000), 1);
        assert_eq!(b.view(Some(empty), 1_000_000_000).level, 5_000_000);
    }

    #[test]
    fn backwards_time_does_not_refill() {
        let b = bucket();
        let s = TokenBucketState {
            level: 0,
            updated_at_us: 500_000,
        };
        assert_eq!(b.view(Some(s), 100_000), s);
        assert_eq!(b.earliest(&s, 100_000, 1), 600_000);
    }
}
