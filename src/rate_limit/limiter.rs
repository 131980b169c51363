//! [`Limiter`]: a strategy, a store, a key namespace and a clock.

use std::borrow::Cow;
use std::num::NonZeroU32;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Arc, Weak};
use std::time::Duration;

use dashmap::DashMap;

use super::leaky::{LeakyBucket, LeakyState, Reservation};
use super::store::{AsyncStore, MemoryStore, Store, Transition};
use super::strategy::{Outcome, Strategy};
use super::{Decision, Forecast, RateLimitError};
use crate::clock::{Clock, TokioClock};

type Gate = Arc<tokio::sync::Mutex<()>>;

/// A rate limiter: a [`Strategy`] applied to keys through a [`Store`], timed by a
/// [`Clock`]. Cheap to clone; clones share state.
///
/// Every method reads the clock once; the `*_at` forms take the time instead. Denials are
/// [`Decision`]s; errors are bad input (a cost of zero) or a failing store.
///
/// # Examples
///
/// ```
/// use std::time::Duration;
/// use throttlebeam::clock::ManualClock;
/// use throttlebeam::rate_limit::{Gcra, Limiter};
///
/// let clock = ManualClock::new(0);
/// let limiter = Limiter::builder(Gcra::new(2, Duration::from_secs(1))?)
///     .with_clock(clock.clone())
///     .build();
/// assert_eq!(limiter.check("alice")?.remaining, 1);
/// assert_eq!(limiter.check("alice")?.remaining, 0);
/// let denied = limiter.check("alice")?;
/// assert!(!denied.allowed);
/// assert_eq!(denied.retry_after_ms, 500);
/// clock.advance(Duration::from_millis(500));
/// assert!(limiter.check("alice")?.allowed);
/// # Ok::<(), throttlebeam::rate_limit::RateLimitError>(())
/// ```
pub struct Limiter<S: Strategy, St = MemoryStore<<S as Strategy>::State>> {
    inner: Arc<Inner<S, St>>,
}

struct Inner<S, St> {
    strategy: S,
    store: St,
    namespace: Box<str>,
    clock: Arc<dyn Clock>,
    overrides: DashMap<Box<str>, S, ahash::RandomState>,
    /// Skips the override lookup on the hot path while there are none.
    has_overrides: AtomicBool,
    /// FIFO gates of keys with `until_ready` callers waiting.
    queues: DashMap<Box<str>, Gate, ahash::RandomState>,
}

impl<S: Strategy, St> Clone for Limiter<S, St> {
    fn clone(&self) -> Self {
        Self {
            inner: Arc::clone(&self.inner),
        }
    }
}

impl<S: Strategy, St> std::fmt::Debug for Limiter<S, St> {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Limiter")
            .field("strategy", &self.inner.strategy.name())
            .field("namespace", &self.inner.namespace)
            .finish_non_exhaustive()
    }
}

/// Builds a [`Limiter`]. Defaults: a [`MemoryStore`], no namespace, a [`TokioClock`].
#[must_use]
pub struct LimiterBuilder<S: Strategy, St> {
    strategy: S,
    store: St,
    namespace: Box<str>,
    clock: Arc<dyn Clock>,
}

impl<S: Strategy, St> LimiterBuilder<S, St> {
    /// Keeps state in `store`.
    pub fn with_store<St2: AsyncStore<S::State>>(self, store: St2) -> LimiterBuilder<S, St2> {
        LimiterBuilder {
            strategy: self.strategy,
            store,
            namespace: self.namespace,
            clock: self.clock,
        }
    }

    /// Prefixes every store key with `namespace` and `:`, so that limiters can share a store.
    pub fn with_namespace(self, namespace: impl Into<Box<str>>) -> Self {
        Self {
            namespace: namespace.into(),
            ..self
        }
    }

    /// Reads time from `clock`.
    pub fn with_clock(self, clock: impl Clock) -> Self {
        Self {
            clock: Arc::new(clock),
            ..self
        }
    }

    /// The limiter.
    pub fn build(self) -> Limiter<S, St> {
        Limiter {
            inner: Arc::new(Inner {
                strategy: self.strategy,
                store: self.store,
                namespace: self.namespace,
                clock: self.clock,
                overrides: DashMap::default(),
                has_overrides: AtomicBool::new(false),
                queues: DashMap::default(),
            }),
        }
    }
}

/// The consuming transition.
struct Check<'a, S> {
    strategy: &'a S,
    cost: NonZeroU32,
}

impl<S: Strategy> Transition<S::State> for Check<'_, S> {
    type Output = Decision;
    #[inline]
    fn run(&self, state: Option<S::State>, now_ms: u64) -> Outcome<S::State> {
        self.strategy.check(state, now_ms, self.cost)
    }
}

/// Reads without writing.
struct Read<F>(F);

impl<S, R, F: Fn(Option<S>, u64) -> R> Transition<S> for Read<F> {
    type Output = R;
    fn run(&self, state: Option<S>, now_ms: u64) -> Outcome<S, R> {
        Outcome {
            result: (self.0)(state, now_ms),
            update: super::Update::Keep,
        }
    }
}

fn cost_of(key: &str, cost: u32) -> Result<NonZeroU32, RateLimitError> {
    NonZeroU32::new(cost).ok_or_else(|| RateLimitError::ZeroCost {
        key: key.to_owned(),
    })
}

impl<S: Strategy> Limiter<S> {
    /// A limiter with an in-memory store and the tokio clock.
    #[must_use]
    pub fn new(strategy: S) -> Self {
        Self::builder(strategy).build()
    }

    /// Starts building a limiter around `strategy`.
    pub fn builder(strategy: S) -> LimiterBuilder<S, MemoryStore<S::State>> {
        LimiterBuilder {
            strategy,
            store: MemoryStore::new(),
            namespace: Box::default(),
            clock: Arc::new(TokioClock::new()),
        }
    }

    /// Spawns a task that drops expired keys every `every`, until the limiter is dropped.
    ///
    /// # Panics
    ///
    /// Outside a tokio runtime.
    pub fn spawn_sweeper(&self, every: Duration) -> tokio::task::JoinHandle<()> {
        let weak: Weak<Inner<S, MemoryStore<S::State>>> = Arc::downgrade(&self.inner);
        tokio::spawn(async move {
            let mut ticks = tokio::time::interval(every);
            ticks.tick().await;
            loop {
                ticks.tick().await;
                let Some(inner) = weak.upgrade() else { break };
                inner.store.sweep(inner.clock.now_ms());
            }
        })
    }
}

impl<S: Strategy, St> Limiter<S, St> {
    /// The default strategy.
    #[must_use]
    pub fn strategy(&self) -> &S {
        &self.inner.strategy
    }

    /// The store, e.g. to read a [`MemoryStore`]'s size.
    #[must_use]
    pub fn store(&self) -> &St {
        &self.inner.store
    }

    /// The strategy that applies to `key`: its override, or the default.
    #[must_use]
    pub fn strategy_for(&self, key: &str) -> S {
        self.override_for(key)
            .unwrap_or_else(|| self.inner.strategy.clone())
    }

    /// The current time by the limiter's clock.
    #[must_use]
    pub fn now_ms(&self) -> u64 {
        self.inner.clock.now_ms()
    }

    /// Applies `strategy` instead of the default to `key` (e.g. a higher quota for one
    /// customer). The key keeps its state, so use a strategy of the same kind.
    pub fn set_override(&self, key: &str, strategy: S) {
        self.inner.overrides.insert(Box::from(key), strategy);
        self.inner.has_overrides.store(true, Ordering::Release);
    }

    /// Goes back to the default strategy for `key`; returns the override it had.
    pub fn remove_override(&self, key: &str) -> Option<S> {
        self.inner.overrides.remove(key).map(|(_, s)| s)
    }

    #[inline]
    fn override_for(&self, key: &str) -> Option<S> {
        if !self.inner.has_overrides.load(Ordering::Acquire) {
            return None;
        }
        self.inner.overrides.get(key).map(|s| s.clone())
    }

    #[inline]
    fn store_key<'k>(&self, key: &'k str) -> Cow<'k, str> {
        if self.inner.namespace.is_empty() {
            Cow::Borrowed(key)
        } else {
            Cow::Owned(format!("{}:{key}", self.inner.namespace))
        }
    }
}

impl<S: Strategy, St: Store<S::State>> Limiter<S, St> {
    /// Spends one unit for `key`.
    ///
    /// # Errors
    ///
    /// [`RateLimitError::Store`] if the store fails.
    #[inline]
    pub fn check(&self, key: &str) -> Result<Decision, RateLimitError> {
        self.check_n_at(key, 1, self.now_ms())
    }

    /// Spends `cost` units for `key`.
    ///
    /// # Errors
    ///
    /// [`RateLimitError::ZeroCost`] for a cost of zero, [`RateLimitError::Store`] if the
    /// store fails.
    pub fn check_n(&self, key: &str, cost: u32) -> Result<Decision, RateLimitError> {
        self.check_n_at(key, cost, self.now_ms())
    }

    /// Spends one unit for `key` at `now_ms`.
    ///
    /// # Errors
    ///
    /// [`RateLimitError::Store`] if the store fails.
    #[inline]
    pub fn check_at(&self, key: &str, now_ms: u64) -> Result<Decision, RateLimitError> {
        self.check_n_at(key, 1, now_ms)
    }

    /// Spends `cost` units for `key` at `now_ms`.
    ///
    /// # Errors
    ///
    /// [`RateLimitError::ZeroCost`] for a cost of zero, [`RateLimitError::Store`] if the
    /// store fails.
    #[inline]
    pub fn check_n_at(
        &self,
        key: &str,
        cost: u32,
        now_ms: u64,
    ) -> Result<Decision, RateLimitError> {
        let cost = cost_of(key, cost)?;
        self.decide(key, cost, now_ms)
    }

    #[inline]
    fn decide(&self, key: &str, cost: NonZeroU32, now_ms: u64) -> Result<Decision, RateLimitError> {
        let overridden = self.override_for(key);
        let strategy = overridden.as_ref().unwrap_or(&self.inner.strategy);
        let check = Check { strategy, cost };
        self.inner.store.apply(&self.store_key(key), now_ms, &check)
    }

    /// Spends `cost` units for each of `keys`, all at one timestamp.
    ///
    /// # Errors
    ///
    /// [`RateLimitError::ZeroCost`] for a cost of zero (nothing is spent), or the first
    /// [`RateLimitError::Store`] failure (earlier keys stay spent).
    pub fn check_many<K: AsRef<str>>(
        &self,
        keys: &[K],
        cost: u32,
    ) -> Result<Vec<Decision>, RateLimitError> {
        let now_ms = self.now_ms();
        let cost = match keys.first() {
            Some(first) => cost_of(first.as_ref(), cost)?,
            None => return Ok(Vec::new()),
        };
        keys.iter()
            .map(|k| self.decide(k.as_ref(), cost, now_ms))
            .collect()
    }

    /// The decision a cost-1 check would get now, without spending anything.
    ///
    /// # Errors
    ///
    /// [`RateLimitError::Store`] if the store fails.
    pub fn peek(&self, key: &str) -> Result<Decision, RateLimitError> {
        let strategy = self.strategy_for(key);
        let now_ms = self.now_ms();
        self.inner.store.apply(
            &self.store_key(key),
            now_ms,
            &Read(|s, now| strategy.peek(s, now)),
        )
    }

    /// How requests of `cost` units would fare from now on, without spending anything.
    ///
    /// # Errors
    ///
    /// [`RateLimitError::ZeroCost`] for a cost of zero, [`RateLimitError::Store`] if the
    /// store fails.
    pub fn forecast(&self, key: &str, cost: u32) -> Result<Forecast, RateLimitError> {
        let cost = cost_of(key, cost)?;
        let strategy = self.strategy_for(key);
        let now_ms = self.now_ms();
        self.inner.store.apply(
            &self.store_key(key),
            now_ms,
            &Read(|s, now| strategy.forecast(s, now, cost)),
        )
    }

    /// Forgets `key`'s state: it is full again.
    ///
    /// # Errors
    ///
    /// [`RateLimitError::Store`] if the store fails.
    pub fn reset(&self, key: &str) -> Result<(), RateLimitError> {
        self.inner.store.remove(&self.store_key(key))
    }

    /// Waits until one unit for `key` is spent; see [`Limiter::until_n_ready`].
    ///
    /// # Errors
    ///
    /// As [`Limiter::until_n_ready`].
    pub async fn until_ready(&self, key: &str) -> Result<Decision, RateLimitError> {
        self.until_n_ready(key, 1).await
    }

    /// Waits (on tokio time) until `cost` units for `key` are spent.
    ///
    /// Waiters on one key are served first come, first served: a caller that arrives while
    /// others wait queues behind them rather than taking capacity they are sleeping for.
    /// (Plain `check` calls do not queue.) Cancelling the future leaves the queue.
    ///
    /// # Errors
    ///
    /// [`RateLimitError::ZeroCost`] for a cost of zero,
    /// [`RateLimitError::InsufficientCapacity`] for a cost the strategy can never admit,
    /// [`RateLimitError::Store`] if the store fails.
    ///
    /// # Examples
    ///
    /// ```
    /// use std::num::NonZeroU32;
    /// use throttlebeam::rate_limit::{Gcra, Limiter};
    ///
    /// # #[tokio::main(flavor = "current_thread")]
    /// # async fn main() -> Result<(), throttlebeam::rate_limit::RateLimitError> {
    /// let limiter = Limiter::new(Gcra::per_second(NonZeroU32::new(100).unwrap()));
    /// let decision = limiter.until_ready("job").await?;
    /// assert!(decision.allowed);
    /// # Ok(())
    /// # }
    /// ```
    pub async fn until_n_ready(&self, key: &str, cost: u32) -> Result<Decision, RateLimitError> {
        let cost = cost_of(key, cost)?;
        if !self.inner.queues.contains_key(key) {
            let decision = self.decide(key, cost, self.now_ms())?;
            if decision.allowed {
                return Ok(decision);
            }
        }
        let ticket = Ticket::join(&self.inner.queues, key);
        let _turn = ticket.gate().lock().await;
        loop {
            let decision = self.decide(key, cost, self.now_ms())?;
            if decision.allowed {
                return Ok(decision);
            }
            if !decision.is_admissible() {
                return Err(RateLimitError::InsufficientCapacity {
                    key: key.to_owned(),
                    cost: cost.get(),
                    limit: decision.limit,
                });
            }
            tokio::time::sleep(decision.retry_after()).await;
        }
    }
}

/// A place in a key's FIFO queue; leaving removes the queue once nobody else holds it.
struct Ticket<'a> {
    queues: &'a DashMap<Box<str>, Gate, ahash::RandomState>,
    key: &'a str,
    gate: Gate,
}

impl<'a> Ticket<'a> {
    fn join(queues: &'a DashMap<Box<str>, Gate, ahash::RandomState>, key: &'a str) -> Self {
        let gate = Arc::clone(&queues.entry(Box::from(key)).or_default());
        Self { queues, key, gate }
    }

    fn gate(&self) -> &Gate {
        &self.gate
    }
}

impl Drop for Ticket<'_> {
    fn drop(&mut self) {
        // The map's handle and ours, and no other: nobody else waits. Clones are only made
        // under this shard's lock, so the count cannot grow meanwhile.
        self.queues
            .remove_if(self.key, |_, gate| Arc::strong_count(gate) == 2);
    }
}

impl<S: Strategy, St: AsyncStore<S::State>> Limiter<S, St> {
    /// [`Limiter::check_n_at`] through an asynchronous store.
    ///
    /// # Errors
    ///
    /// [`RateLimitError::Store`] if the store fails.
    pub async fn check_n_async_at(
        &self,
        key: &str,
        cost: NonZeroU32,
        now_ms: u64,
    ) -> Result<Decision, RateLimitError> {
        let strategy = self.strategy_for(key);
        let check = Check {
            strategy: &strategy,
            cost,
        };
        self.inner
            .store
            .apply_async(&self.store_key(key), now_ms, &check)
            .await
    }
}

impl<St: Store<LeakyState>> Limiter<LeakyBucket, St> {
    /// Reserves `cost` units of the shaper's queue for `key` without waiting: the delay to
    /// wait before proceeding, or a refusal with a retry-after when the queue is full.
    ///
    /// # Errors
    ///
    /// [`RateLimitError::ZeroCost`] for a cost of zero, [`RateLimitError::Store`] if the
    /// store fails.
    pub fn try_reserve(&self, key: &str, cost: u32) -> Result<Reservation, RateLimitError> {
        let cost = cost_of(key, cost)?;
        let shaper = self.strategy_for(key);
        let now_ms = self.now_ms();
        self.inner
            .store
            .apply(&self.store_key(key), now_ms, &Reserve { shaper, cost })
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
            Reservation::Granted { delay_ms } => {
                let delay = Duration::from_millis(delay_ms);
                tokio::time::sleep(delay).await;
                Ok(delay)
            }
            Reservation::QueueFull { retry_after_ms } => Err(RateLimitError::QueueFull {
                key: key.to_owned(),
                retry_after_ms,
            }),
        }
    }
}

struct Reserve {
    shaper: LeakyBucket,
    cost: NonZeroU32,
}

impl Transition<LeakyState> for Reserve {
    type Output = Reservation;
    fn run(&self, state: Option<LeakyState>, now_ms: u64) -> Outcome<LeakyState, Reservation> {
        self.shaper.reserve(state, now_ms, self.cost)
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::rate_limit::Gcra;

    #[tokio::test(start_paused = true)]
    async fn waiting_queues_are_removed_when_the_last_waiter_leaves() {
        let limiter = Limiter::new(Gcra::new(1, Duration::from_secs(1)).unwrap());
        limiter.check("k").unwrap();
        let (a, b) = tokio::join!(limiter.until_ready("k"), limiter.until_ready("k"));
        assert!(a.unwrap().allowed && b.unwrap().allowed);
        assert!(limiter.inner.queues.is_empty());
        // A cancelled waiter leaves too.
        let cancelled =
            tokio::time::timeout(Duration::from_millis(10), limiter.until_ready("k")).await;
        assert!(cancelled.is_err());
        assert!(limiter.inner.queues.is_empty());
    }
}
