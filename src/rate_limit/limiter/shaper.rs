//! Leaky-bucket reservations: the limiter as a traffic shaper.

use std::time::Duration;

use crate::rate_limit::RateLimitError;
use crate::rate_limit::leaky::LeakyBucket;
use crate::rate_limit::store::{AsyncRateLimitStore, RateLimitStore};
use crate::rate_limit::strategy::{RateLimitOp, RateLimitReply, ShaperReservation};

use super::{Limiter, cost_for, wrong_reply};

impl<St: AsyncRateLimitStore<LeakyBucket>> Limiter<LeakyBucket, St> {
    /// [`Limiter::try_reserve`] through an asynchronous store.
    ///
    /// # Errors
    ///
    /// As [`Limiter::try_reserve`].
    pub async fn try_reserve_async(
        &self,
        key: &str,
        cost: u32,
    ) -> Result<ShaperReservation, RateLimitError> {
        let op = |s: &LeakyBucket| cost_for(s, key, cost).map(|cost| RateLimitOp::Reserve { cost });
        let result = match self.read_async(key, op).await? {
            RateLimitReply::Reservation(r) => Ok(r),
            other => Err(wrong_reply(key, other)),
        };
        self.inner
            .counters
            .count(&result, |r| matches!(r, ShaperReservation::Granted { .. }));
        result
    }

    /// [`Limiter::reserve`] through an asynchronous store: reserves `cost` units for `key` and
    /// sleeps the delay (on tokio time); returns it.
    ///
    /// # Errors
    ///
    /// As [`Limiter::reserve`].
    pub async fn reserve_async(&self, key: &str, cost: u32) -> Result<Duration, RateLimitError> {
        match self.try_reserve_async(key, cost).await? {
            ShaperReservation::Granted { delay_ms } => {
                let delay = Duration::from_millis(delay_ms);
                tokio::time::sleep(delay).await;
                Ok(delay)
            }
            ShaperReservation::QueueFull { retry_after_ms } => Err(RateLimitError::QueueFull {
                key: crate::key::shown(key),
                retry_after_ms,
            }),
        }
    }
}

impl<St: RateLimitStore<LeakyBucket>> Limiter<LeakyBucket, St> {
    /// Reserves `cost` units of the shaper's queue for `key` without waiting: the delay to
    /// wait before proceeding, or a refusal with a retry-after when the queue is full.
    ///
    /// # Errors
    ///
    /// As [`Limiter::check_n`] (a cost above the queue's slots can never be reserved).
    pub fn try_reserve(&self, key: &str, cost: u32) -> Result<ShaperReservation, RateLimitError> {
        let op = |s: &LeakyBucket| cost_for(s, key, cost).map(|cost| RateLimitOp::Reserve { cost });
        let result = match self.read(key, op) {
            Ok(RateLimitReply::Reservation(r)) => Ok(r),
            Ok(other) => Err(wrong_reply(key, other)),
            Err(err) => return Err(err),
        };
        self.inner
            .counters
            .count(&result, |r| matches!(r, ShaperReservation::Granted { .. }));
        result
    }

    /// Reserves `cost` units for `key` and sleeps the delay (on tokio time); returns it.
    ///
    /// # Errors
    ///
    /// [`RateLimitError::QueueFull`] with the retry-after when the queue is full, and the
    /// errors of [`Limiter::try_reserve`].
    ///
    /// # Examples
    ///
    /// ```
    /// use std::time::Duration;
    /// use throttlebeam::rate_limit::{LeakyBucket, Limiter};
    ///
    /// # #[tokio::main(flavor = "current_thread", start_paused = true)]
    /// # async fn main() -> Result<(), throttlebeam::rate_limit::RateLimitError> {
    /// let shaper = Limiter::new(LeakyBucket::new(10, Duration::from_secs(1), Duration::from_secs(1))?);
    /// assert_eq!(shaper.reserve("out", 1).await?, Duration::ZERO);
    /// assert_eq!(shaper.reserve("out", 1).await?, Duration::from_millis(100)); // and slept it
    /// # Ok(())
    /// # }
    /// ```
    pub async fn reserve(&self, key: &str, cost: u32) -> Result<Duration, RateLimitError> {
        match self.try_reserve(key, cost)? {
            ShaperReservation::Granted { delay_ms } => {
                let delay = Duration::from_millis(delay_ms);
                tokio::time::sleep(delay).await;
                Ok(delay)
            }
            ShaperReservation::QueueFull { retry_after_ms } => Err(RateLimitError::QueueFull {
                key: crate::key::shown(key),
                retry_after_ms,
            }),
        }
    }
}
