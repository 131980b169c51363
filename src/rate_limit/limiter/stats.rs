//! A limiter's counters: striped so that concurrent checks do not share a cache line.

use std::sync::atomic::{AtomicU64, Ordering};

use serde::Serialize;

use crate::rate_limit::RateLimitError;
use crate::stripe::Striped;

/// A [`Limiter`](super::Limiter)'s counters (see [`Limiter::stats`](super::Limiter::stats)).
///
/// # Examples
///
/// ```
/// use std::num::NonZeroU32;
/// use throttlebeam::rate_limit::{Gcra, Limiter};
///
/// let limiter = Limiter::new(Gcra::per_second(NonZeroU32::MIN));
/// limiter.check("k")?;
/// limiter.check("k")?;
/// let stats = limiter.stats();
/// assert_eq!((stats.allowed, stats.denied, stats.keys), (1, 1, 1));
/// # Ok::<(), throttlebeam::rate_limit::RateLimitError>(())
/// ```
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default, Serialize)]
#[non_exhaustive]
pub struct LimiterStats {
    /// Checks allowed (each `check`, `check_n`, reservation or `check_many` key counts once).
    pub allowed: u64,
    /// Checks denied.
    pub denied: u64,
    /// Calls that returned an error: bad input or a failing store.
    pub errors: u64,
    /// Keys the store dropped to make room before they were at rest.
    pub evictions: u64,
    /// Keys the store holds (0 when the store cannot tell).
    pub keys: usize,
    /// Checks the store answered by itself, with no round trip to the shared backend (the
    /// Redis store's local answers to limited keys; counted per store, so limiters sharing
    /// one `Redis` count together). Included in `denied`.
    pub local_answers: u64,
}

/// Counters striped over cache lines, so threads deciding at once do not contend on one.
#[derive(Default)]
pub(super) struct Counters(Striped<Stripe>);

/// One stripe's counters: the three share its cache line, written by its threads only.
#[derive(Default)]
pub(super) struct Stripe {
    pub(super) allowed: AtomicU64,
    pub(super) denied: AtomicU64,
    pub(super) errors: AtomicU64,
}

impl Counters {
    #[inline]
    pub(super) fn stripe(&self) -> &Stripe {
        self.0.local()
    }

    #[inline]
    pub(super) fn count<T>(
        &self,
        result: &Result<T, RateLimitError>,
        allowed: impl Fn(&T) -> bool,
    ) {
        let stripe = self.stripe();
        let counter = match result {
            Ok(v) if allowed(v) => &stripe.allowed,
            Ok(_) => &stripe.denied,
            Err(_) => &stripe.errors,
        };
        counter.fetch_add(1, Ordering::Relaxed);
    }

    #[inline]
    pub(super) fn decided(&self, allowed: bool) {
        let stripe = self.stripe();
        let counter = if allowed {
            &stripe.allowed
        } else {
            &stripe.denied
        };
        counter.fetch_add(1, Ordering::Relaxed);
    }

    #[inline]
    pub(super) fn error(&self) {
        self.stripe().errors.fetch_add(1, Ordering::Relaxed);
    }

    pub(super) fn sum(&self, field: impl Fn(&Stripe) -> &AtomicU64) -> u64 {
        self.0
            .iter()
            .map(|s| field(s).load(Ordering::Relaxed))
            .sum()
    }
}
