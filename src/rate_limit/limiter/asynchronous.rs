//! The limiter's operations through an asynchronous store.

use crate::rate_limit::store::{AsyncRateLimitStore, RateLimitRequest};
use crate::rate_limit::strategy::{RateLimitOp, RateLimitReply, Strategy};
use crate::rate_limit::{Decision, Forecast, RateLimitError};

use super::{Limiter, cost_for, wrong_reply};

/// The same operations through an [`AsyncRateLimitStore`], such as the Redis store (feature
/// `redis`) that several instances share. They work on every store: a synchronous one is
/// an asynchronous one whose futures are ready at once.
///
/// # Examples
///
/// ```
/// use std::time::Duration;
/// use throttlebeam::rate_limit::{Gcra, Limiter};
///
/// # #[tokio::main(flavor = "current_thread")]
/// # async fn main() -> Result<(), throttlebeam::rate_limit::RateLimitError> {
/// // With Redis: `Limiter::builder(strategy).with_store(redis).build()`.
/// let limiter = Limiter::new(Gcra::new(2, Duration::from_secs(1))?);
/// assert_eq!(limiter.check_async("k").await?.remaining, 1);
/// assert_eq!(limiter.peek_async("k").await?.remaining, 1);
/// assert_eq!(limiter.forecast_async("k", 1).await?.spendable_now, 1);
/// limiter.reset_async("k").await?;
/// assert_eq!(limiter.check_n_async("k", 2).await?.remaining, 0);
/// # Ok(())
/// # }
/// ```
impl<S: Strategy, St: AsyncRateLimitStore<S>> Limiter<S, St> {
    /// [`Limiter::check`] through an asynchronous store.
    ///
    /// # Errors
    ///
    /// As [`Limiter::check`].
    pub async fn check_async(&self, key: &str) -> Result<Decision, RateLimitError> {
        self.check_n_async_at(key, 1, self.now_us()).await
    }

    /// [`Limiter::check_n`] through an asynchronous store.
    ///
    /// # Errors
    ///
    /// As [`Limiter::check_n`].
    pub async fn check_n_async(&self, key: &str, cost: u32) -> Result<Decision, RateLimitError> {
        self.check_n_async_at(key, cost, self.now_us()).await
    }

    /// [`Limiter::peek`] through an asynchronous store.
    ///
    /// # Errors
    ///
    /// As [`Limiter::peek`].
    pub async fn peek_async(&self, key: &str) -> Result<Decision, RateLimitError> {
        match self.read_async(key, |_| Ok(RateLimitOp::Peek)).await? {
            RateLimitReply::Decision(d) => Ok(d),
            other => Err(self.failed(wrong_reply(key, other))),
        }
    }

    /// [`Limiter::forecast`] through an asynchronous store.
    ///
    /// # Errors
    ///
    /// As [`Limiter::forecast`].
    pub async fn forecast_async(&self, key: &str, cost: u32) -> Result<Forecast, RateLimitError> {
        let op = |s: &S| cost_for(s, key, cost).map(|cost| RateLimitOp::Forecast { cost });
        match self.read_async(key, op).await? {
            RateLimitReply::Forecast(f) => Ok(f),
            other => Err(self.failed(wrong_reply(key, other))),
        }
    }

    /// [`Limiter::reset`] through an asynchronous store.
    ///
    /// # Errors
    ///
    /// As [`Limiter::reset`].
    pub async fn reset_async(&self, key: &str) -> Result<(), RateLimitError> {
        self.read_async(key, |_| Ok(RateLimitOp::Reset))
            .await
            .map(drop)
    }

    /// Runs a read-only, reset or reservation `op` for `key` now.
    pub(super) async fn read_async(
        &self,
        key: &str,
        op: impl FnOnce(&S) -> Result<RateLimitOp, RateLimitError>,
    ) -> Result<RateLimitReply, RateLimitError> {
        let result = async {
            RateLimitError::check_key(key)?;
            self.sync_overrides().await;
            let strategy = self.strategy_for(key);
            let op = op(&strategy)?;
            let store_key = self.store_key(key);
            let request = RateLimitRequest {
                key: &store_key,
                now_us: self.now_us(),
                strategy: &strategy,
                op,
            };
            self.apply_guarded(request).await
        }
        .await;
        result.map_err(|err| self.failed(err))
    }

    /// [`Limiter::check_n_at`] through an asynchronous store (`now_us` in epoch
    /// microseconds; a store on a shared server may decide on the server's clock instead).
    ///
    /// # Errors
    ///
    /// As [`Limiter::check_n`].
    pub async fn check_n_async_at(
        &self,
        key: &str,
        cost: u32,
        now_us: u64,
    ) -> Result<Decision, RateLimitError> {
        let result = self.decide_async(key, cost, now_us).await;
        self.inner.counters.count(&result, |d| d.allowed);
        result
    }

    async fn decide_async(
        &self,
        key: &str,
        cost: u32,
        now_us: u64,
    ) -> Result<Decision, RateLimitError> {
        RateLimitError::check_key(key)?;
        self.sync_overrides().await;
        let strategy = self.strategy_for(key);
        let cost = cost_for(&strategy, key, cost)?;
        let store_key = self.store_key(key);
        let request = RateLimitRequest {
            key: &store_key,
            now_us,
            strategy: &strategy,
            op: RateLimitOp::Check { cost },
        };
        match self.apply_guarded(request).await? {
            RateLimitReply::Decision(d) => Ok(d),
            other => Err(wrong_reply(key, other)),
        }
    }

    /// One call of the store through the store guard: bounded by the store's
    /// [`call_timeout`](AsyncRateLimitStore::call_timeout), a panic caught; either is a
    /// [`RateLimitError::Store`], never a hang or an unwind in the caller.
    async fn apply_guarded(
        &self,
        request: RateLimitRequest<'_, S>,
    ) -> Result<RateLimitReply, RateLimitError> {
        let store = &self.inner.store;
        let key = request.key;
        self.guarded(key, || store.apply_async(request)).await
    }

    /// One call of the store (`call` makes it) through the store guard, as
    /// [`Limiter::apply_guarded`]; a fault is a [`RateLimitError::Store`] naming `key`.
    pub(super) async fn guarded<T, F>(
        &self,
        key: &str,
        call: impl FnOnce() -> F,
    ) -> Result<T, RateLimitError>
    where
        F: std::future::Future<Output = Result<T, RateLimitError>>,
    {
        match crate::store::guard(self.inner.store.call_timeout(), call).await {
            Ok(reply) => reply,
            Err(fault) => {
                if matches!(fault, crate::store::Fault::Panicked(_)) {
                    tracing::warn!(key, %fault, "rate limit store panicked; a store failure");
                }
                Err(RateLimitError::store(
                    key,
                    crate::store::StoreError::from(fault),
                ))
            }
        }
    }
}
