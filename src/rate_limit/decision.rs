//! The plain values a limiter returns: [`Decision`] and [`Forecast`].

use std::time::Duration;

use serde::{Deserialize, Serialize};

/// The result of one rate-limit check. All fields are integers, so any store that runs the
/// same maths reproduces it bit for bit.
///
/// A denial is an outcome, not an error. Use [`Decision::into_result`] to turn it into one.
///
/// # Examples
///
/// ```
/// use throttlebeam::rate_limit::Decision;
///
/// let d = Decision { allowed: false, limit: 10, remaining: 0, reset_at_ms: 5_000, retry_after_ms: 250 };
/// assert_eq!(d.retry_after().as_millis(), 250);
/// assert!(d.into_result().is_err());
/// ```
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, Serialize, Deserialize)]
pub struct Decision {
    /// Whether the request may proceed.
    pub allowed: bool,
    /// The ceiling reported to clients: the burst (GCRA), capacity (token bucket), quota
    /// (windows) or queue slots (shaper).
    pub limit: u64,
    /// Whole units that can still be spent before the next denial.
    pub remaining: u64,
    /// Epoch milliseconds at which the limiter is fully replenished.
    pub reset_at_ms: u64,
    /// Milliseconds to wait from now before the same request would be allowed, rounded up
    /// (waiting it always suffices): 0 when allowed. (A cost
    /// the limiter can never admit is an error,
    /// [`RateLimitError::InsufficientCapacity`](super::RateLimitError::InsufficientCapacity),
    /// never a denial.)
    pub retry_after_ms: u64,
}

impl Decision {
    /// `retry_after_ms` as a [`Duration`].
    #[must_use]
    pub fn retry_after(&self) -> Duration {
        Duration::from_millis(self.retry_after_ms)
    }

    /// `Ok(self)` when allowed, otherwise a [`RateLimited`] error carrying the decision.
    ///
    /// # Errors
    ///
    /// Returns [`RateLimited`] when `allowed` is false.
    pub fn into_result(self) -> Result<Self, RateLimited> {
        if self.allowed {
            Ok(self)
        } else {
            Err(RateLimited { decision: self })
        }
    }
}

/// A denial turned into an error, for callers who prefer `?` (see [`Decision::into_result`]).
#[derive(Debug, Clone, Copy, PartialEq, Eq, thiserror::Error)]
#[error("rate limited, retry after {} ms", decision.retry_after_ms)]
pub struct RateLimited {
    /// The denying decision.
    pub decision: Decision,
}

/// A non-consuming projection of a key's capacity.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, Serialize, Deserialize)]
pub struct Forecast {
    /// How many requests of the forecast cost are admissible right now, back to back.
    pub spendable_now: u64,
    /// Epoch milliseconds when capacity next grows by at least one unit (now when full).
    pub next_replenish_at_ms: u64,
    /// Epoch milliseconds when the limiter is full again (now when full).
    pub full_at_ms: u64,
}
