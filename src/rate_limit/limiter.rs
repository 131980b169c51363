//! [`Limiter`]: a strategy, a store, a key namespace and a clock.

use std::borrow::Cow;
use std::num::NonZeroU32;
use std::sync::{Arc, Weak};
use std::time::Duration;

use dashmap::DashMap;

use super::store::{AsyncRateLimitStore, MemoryRateLimitStore, RateLimitRequest, RateLimitStore};
use super::strategy::{RateLimitOp, RateLimitReply, Strategy};
use super::{Decision, Forecast, RateLimitError};
use crate::clock::{Clock, QuantaClock, TokioClock};

mod asynchronous;
mod overrides;
mod shaper;
mod stats;
#[cfg(test)]
mod tests;

pub use self::overrides::DEFAULT_OVERRIDE_REFRESH;
use self::overrides::Overrides;
use self::stats::Counters;
pub use self::stats::LimiterStats;

type Gate = Arc<tokio::sync::Mutex<()>>;

/// A rate limiter: a [`Strategy`] applied to keys through a [`RateLimitStore`], timed by a
/// [`Clock`]. Cheap to clone; clones share state.
///
/// Every method reads the clock once, in microseconds (see [`Clock`]); the `*_at` forms take
/// the time instead, in epoch microseconds. Denials are
/// [`Decision`]s; errors are bad input (an empty or over-long key, a cost of zero or above
/// the strategy's capacity) or a failing store. Keys follow the crate's one key rule: not
/// empty, at most [`MAX_KEY_LEN`](crate::store::MAX_KEY_LEN) bytes.
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
pub struct Limiter<S: Strategy, St = MemoryRateLimitStore<<S as Strategy>::State>> {
    inner: Arc<Inner<S, St>>,
}

struct Inner<S, St> {
    strategy: S,
    store: St,
    namespace: Box<str>,
    clock: LimiterClock,
    overrides: Overrides<S>,
    /// FIFO gates of keys with `until_ready` callers waiting.
    queues: DashMap<Box<str>, Gate, ahash::RandomState>,
    counters: Counters,
    /// What a runtime's sweeper holds weakly to sweep the store ([`Limiter::sweep_on`]).
    #[cfg(feature = "runtime")]
    swept_by: std::sync::Mutex<Option<Arc<dyn throttlebeam_supervisors::Sweep>>>,
}

/// The store of a [`Limiter`], as a runtime's sweeper sees it.
#[cfg(feature = "runtime")]
struct StoreSweep<S, St> {
    inner: Weak<Inner<S, St>>,
}

#[cfg(feature = "runtime")]
impl<S: Strategy, St: AsyncRateLimitStore<S>> throttlebeam_supervisors::Sweep
    for StoreSweep<S, St>
{
    fn sweep(&self, _now: tokio::time::Instant) -> usize {
        let Some(inner) = self.inner.upgrade() else {
            return 0;
        };
        // A store is the user's code: its panic must not take the runtime's sweeper down.
        let left = std::panic::catch_unwind(std::panic::AssertUnwindSafe(|| {
            AsyncRateLimitStore::sweep(&inner.store, inner.clock.now_us());
            AsyncRateLimitStore::keys(&inner.store).unwrap_or(0)
        }));
        left.unwrap_or_else(|_| {
            tracing::warn!(
                strategy = inner.strategy.name(),
                "rate limit store panicked while swept; it is swept again at the next tick"
            );
            1
        })
    }
}

/// A limiter's clock: the crate's own clocks read directly (inlined into a check), any other
/// through its trait object.
enum LimiterClock {
    Tokio(TokioClock),
    Quanta(QuantaClock),
    Other(Arc<dyn Clock>),
}

impl LimiterClock {
    fn new<C: Clock>(clock: C) -> Self {
        let mut slot = Some(clock);
        let any: &mut dyn std::any::Any = &mut slot;
        if let Some(tokio) = any
            .downcast_mut::<Option<TokioClock>>()
            .and_then(Option::take)
        {
            return Self::Tokio(tokio);
        }
        if let Some(quanta) = any
            .downcast_mut::<Option<QuantaClock>>()
            .and_then(Option::take)
        {
            return Self::Quanta(quanta);
        }
        // Still there: only a match above takes it, and returns.
        slot.map_or_else(
            || Self::Tokio(TokioClock::new()),
            |clock| Self::Other(Arc::new(clock)),
        )
    }
}

impl Clock for LimiterClock {
    #[inline]
    fn now_us(&self) -> u64 {
        match self {
            Self::Tokio(clock) => clock.now_us(),
            Self::Quanta(clock) => clock.now_us(),
            Self::Other(clock) => clock.now_us(),
        }
    }
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

/// Builds a [`Limiter`]. Defaults: a [`MemoryRateLimitStore`] (bounded to one million keys),
/// no namespace, a [`TokioClock`], overrides kept in a shared store read again every
/// [`DEFAULT_OVERRIDE_REFRESH`] at least.
#[must_use]
pub struct LimiterBuilder<S: Strategy, St> {
    strategy: S,
    store: St,
    namespace: Box<str>,
    clock: LimiterClock,
    override_refresh: Duration,
}

impl<S: Strategy, St> LimiterBuilder<S, St> {
    /// Keeps state in `store`.
    pub fn with_store<St2: AsyncRateLimitStore<S>>(self, store: St2) -> LimiterBuilder<S, St2> {
        LimiterBuilder {
            strategy: self.strategy,
            store,
            namespace: self.namespace,
            clock: self.clock,
            override_refresh: self.override_refresh,
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
            clock: LimiterClock::new(clock),
            ..self
        }
    }

    /// Reads the overrides a store keeps for every instance ([`Limiter::set_override`])
    /// again at least this often while no notice says they changed (default
    /// [`DEFAULT_OVERRIDE_REFRESH`], 5 s, clamped to at least 10 ms): the most an override
    /// whose notice was lost takes to apply on this instance.
    pub fn with_override_refresh(self, every: Duration) -> Self {
        Self {
            override_refresh: every.max(Duration::from_millis(10)),
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
                overrides: Overrides::new(self.override_refresh),
                queues: DashMap::default(),
                counters: Counters::default(),
                #[cfg(feature = "runtime")]
                swept_by: std::sync::Mutex::new(None),
            }),
        }
    }
}

/// Checks a cost: at least 1, at most what the strategy can ever admit.
#[inline]
fn cost_for<S: Strategy>(strategy: &S, key: &str, cost: u32) -> Result<NonZeroU32, RateLimitError> {
    let Some(cost) = NonZeroU32::new(cost) else {
        return Err(RateLimitError::ZeroCost {
            key: crate::key::shown(key),
        });
    };
    let capacity = strategy.limit();
    if u64::from(cost.get()) > capacity {
        return Err(RateLimitError::InsufficientCapacity {
            key: crate::key::shown(key),
            cost: cost.get(),
            capacity,
        });
    }
    Ok(cost)
}

/// A store's reply of the wrong kind: the store is broken.
#[cold]
fn wrong_reply(key: &str, reply: RateLimitReply) -> RateLimitError {
    super::store::wrong_reply(key, &reply)
}

impl<S: Strategy> Limiter<S> {
    /// A limiter with an in-memory store and the tokio clock.
    #[must_use]
    pub fn new(strategy: S) -> Self {
        Self::builder(strategy).build()
    }

    /// Starts building a limiter around `strategy`.
    pub fn builder(strategy: S) -> LimiterBuilder<S, MemoryRateLimitStore<S::State>> {
        LimiterBuilder {
            strategy,
            store: MemoryRateLimitStore::new(),
            namespace: Box::default(),
            clock: LimiterClock::Tokio(TokioClock::new()),
            override_refresh: DEFAULT_OVERRIDE_REFRESH,
        }
    }
}

impl<S: Strategy, St: AsyncRateLimitStore<S>> Limiter<S, St> {
    /// Spawns a task on the current tokio runtime that drops the store's keys at rest every
    /// `every`, until the limiter is dropped. For programs without a throttlebeam runtime;
    /// with one, `Limiter::sweep_on` (feature `runtime`) hands the store to the runtime's
    /// supervised sweeper instead, which sleeps while the store is empty.
    ///
    /// # Errors
    ///
    /// [`RateLimitError::InvalidDuration`] for an interval outside 1 ms ..= 2^36 - 1 ms,
    /// [`RateLimitError::NoRuntime`] outside a tokio runtime.
    ///
    /// # Examples
    ///
    /// ```
    /// use std::num::NonZeroU32;
    /// use std::time::Duration;
    /// use throttlebeam::rate_limit::{Gcra, Limiter, RateLimitError};
    ///
    /// # #[tokio::main(flavor = "current_thread")]
    /// # async fn main() -> Result<(), RateLimitError> {
    /// let limiter = Limiter::new(Gcra::per_second(NonZeroU32::new(10).unwrap()));
    /// let sweeper = limiter.spawn_sweeper(Duration::from_secs(60))?;
    /// assert!(matches!(
    ///     limiter.spawn_sweeper(Duration::ZERO),
    ///     Err(RateLimitError::InvalidDuration { .. })
    /// ));
    /// sweeper.abort();
    /// # Ok(())
    /// # }
    /// ```
    pub fn spawn_sweeper(
        &self,
        every: Duration,
    ) -> Result<tokio::task::JoinHandle<()>, RateLimitError> {
        if let Some(reason) = crate::key::duration_problem(every) {
            return Err(RateLimitError::InvalidDuration {
                what: "sweep interval",
                reason,
            });
        }
        let handle =
            tokio::runtime::Handle::try_current().map_err(|_| RateLimitError::NoRuntime)?;
        let weak: Weak<Inner<S, St>> = Arc::downgrade(&self.inner);
        Ok(handle.spawn(async move {
            let mut ticks = tokio::time::interval(every);
            ticks.tick().await;
            loop {
                ticks.tick().await;
                let Some(inner) = weak.upgrade() else { break };
                AsyncRateLimitStore::sweep(&inner.store, inner.clock.now_us());
            }
        }))
    }

    /// Has `runtime`'s sweeper drop this limiter's keys at rest, at the runtime's sweep
    /// interval, instead of a task of the limiter's own ([`Limiter::spawn_sweeper`]): one
    /// sweeper, supervised in the runtime's tree, for the runtime's maps and the limiter's
    /// store. It sweeps while the store holds keys and sleeps (no timer) while it holds none;
    /// the store wakes it when its first key arrives. A store that keeps nothing to sweep
    /// (Redis expires its keys itself) is left alone.
    ///
    /// Lasts as long as the limiter (every clone dropped) or until the runtime shuts down; a
    /// later call moves the limiter to another runtime's sweeper. A panic in a store's
    /// `sweep` is logged and the store is swept again at the next tick.
    ///
    /// # Examples
    ///
    /// ```
    /// # #[tokio::main(flavor = "current_thread")]
    /// # async fn main() -> Result<(), Box<dyn std::error::Error>> {
    /// use std::num::NonZeroU32;
    /// use std::time::Duration;
    /// use throttlebeam::Runtime;
    /// use throttlebeam::rate_limit::{Gcra, Limiter};
    ///
    /// let runtime = Runtime::builder()
    ///     .with_sweep_interval(Duration::from_secs(30))
    ///     .start()
    ///     .await?;
    /// let limiter = Limiter::new(Gcra::per_second(NonZeroU32::new(10).unwrap()));
    /// limiter.sweep_on(&runtime);
    /// limiter.check("alice")?;
    /// assert_eq!(limiter.stats().keys, 1);
    /// # Ok(())
    /// # }
    /// ```
    #[cfg(feature = "runtime")]
    #[cfg_attr(docsrs, doc(cfg(feature = "runtime")))]
    pub fn sweep_on(&self, runtime: &crate::Runtime) {
        let sweeper = runtime.core.tree.sweeper().clone();
        let target: Arc<dyn throttlebeam_supervisors::Sweep> = Arc::new(StoreSweep {
            inner: Arc::downgrade(&self.inner),
        });
        sweeper.register(Arc::downgrade(&target));
        // Replacing an earlier target drops it: the other sweeper forgets this limiter.
        *self
            .inner
            .swept_by
            .lock()
            .unwrap_or_else(std::sync::PoisonError::into_inner) = Some(target);
        let kick = sweeper.clone();
        let wakes = AsyncRateLimitStore::wake_on_first_key(
            &self.inner.store,
            Arc::new(move || kick.kick()),
        );
        if wakes && AsyncRateLimitStore::keys(&self.inner.store).unwrap_or(0) > 0 {
            sweeper.kick();
        }
    }

    /// The limiter's counters, with the store's key count, evictions and local answers.
    #[must_use]
    pub fn stats(&self) -> LimiterStats {
        let c = &self.inner.counters;
        LimiterStats {
            allowed: c.sum(|s| &s.allowed),
            denied: c.sum(|s| &s.denied),
            errors: c.sum(|s| &s.errors),
            evictions: AsyncRateLimitStore::evictions(&self.inner.store),
            keys: AsyncRateLimitStore::keys(&self.inner.store).unwrap_or(0),
            local_answers: AsyncRateLimitStore::local_answers(&self.inner.store),
        }
    }
}

impl<S: Strategy, St> Limiter<S, St> {
    /// The default strategy.
    #[must_use]
    pub fn strategy(&self) -> &S {
        &self.inner.strategy
    }

    /// The store, e.g. to read a [`MemoryRateLimitStore`]'s size.
    #[must_use]
    pub fn store(&self) -> &St {
        &self.inner.store
    }

    /// The strategy that applies to `key` on this instance now: its override (this
    /// instance's own, else one kept in the store as last read), or the default.
    #[must_use]
    pub fn strategy_for(&self, key: &str) -> S {
        self.override_for(key)
            .unwrap_or_else(|| self.inner.strategy.clone())
    }

    /// The current time by the limiter's clock, in epoch milliseconds (rounded down): the
    /// time [`Decision`]s are reported in, e.g. for `HeaderOptions::headers` (feature
    /// `http`).
    #[must_use]
    pub fn now_ms(&self) -> u64 {
        self.inner.clock.now_ms()
    }

    /// The current time by the limiter's clock, in epoch microseconds: the time its strategy
    /// decides at, and what the `*_at` methods take.
    #[must_use]
    #[inline]
    pub fn now_us(&self) -> u64 {
        self.inner.clock.now_us()
    }

    #[inline]
    fn override_for(&self, key: &str) -> Option<S> {
        self.inner.overrides.get(key)
    }

    /// Counts an error and returns it.
    #[cold]
    #[inline(never)]
    fn failed(&self, err: RateLimitError) -> RateLimitError {
        self.inner.counters.error();
        err
    }

    #[inline]
    fn store_key<'k>(&self, key: &'k str) -> Cow<'k, str> {
        if self.inner.namespace.is_empty() {
            Cow::Borrowed(key)
        } else {
            // Pushed, not `format!`ted: the formatting machinery costs more than the copy.
            let namespace = &self.inner.namespace;
            let mut full = String::with_capacity(namespace.len() + 1 + key.len());
            full.push_str(namespace);
            full.push(':');
            full.push_str(key);
            Cow::Owned(full)
        }
    }
}

impl<S: Strategy, St: RateLimitStore<S>> Limiter<S, St> {
    /// Spends one unit for `key`.
    ///
    /// # Errors
    ///
    /// [`RateLimitError::InvalidKey`] for an empty or over-long key,
    /// [`RateLimitError::Store`] if the store fails.
    #[inline]
    pub fn check(&self, key: &str) -> Result<Decision, RateLimitError> {
        self.check_n_at(key, 1, self.now_us())
    }

    /// Spends `cost` units for `key`.
    ///
    /// # Errors
    ///
    /// [`RateLimitError::InvalidKey`] for an empty or over-long key,
    /// [`RateLimitError::ZeroCost`] for a cost of zero,
    /// [`RateLimitError::InsufficientCapacity`] for a cost above the strategy's capacity (it
    /// could never pass), [`RateLimitError::Store`] if the store fails.
    ///
    /// # Examples
    ///
    /// ```
    /// use std::time::Duration;
    /// use throttlebeam::rate_limit::{Gcra, Limiter, RateLimitError};
    ///
    /// let limiter = Limiter::new(Gcra::new(5, Duration::from_secs(1))?);
    /// assert_eq!(limiter.check_n("k", 3)?.remaining, 2);
    /// let err = limiter.check_n("k", 6).unwrap_err();
    /// assert!(matches!(err, RateLimitError::InsufficientCapacity { capacity: 5, .. }));
    /// # Ok::<(), RateLimitError>(())
    /// ```
    pub fn check_n(&self, key: &str, cost: u32) -> Result<Decision, RateLimitError> {
        self.check_n_at(key, cost, self.now_us())
    }

    /// Spends one unit for `key` at `now_us` (epoch microseconds, as [`Limiter::now_us`]).
    ///
    /// # Errors
    ///
    /// As [`Limiter::check`].
    ///
    /// # Examples
    ///
    /// ```
    /// use std::num::NonZeroU32;
    /// use throttlebeam::rate_limit::{Gcra, Limiter};
    ///
    /// // 10,000 per second, one at a time: one every 100 µs.
    /// let limiter = Limiter::new(Gcra::per_second(NonZeroU32::new(10_000).unwrap())
    ///     .with_burst(NonZeroU32::MIN));
    /// assert!(limiter.check_at("k", 1_000_000)?.allowed);
    /// assert!(!limiter.check_at("k", 1_000_099)?.allowed);
    /// assert!(limiter.check_at("k", 1_000_100)?.allowed);
    /// # Ok::<(), throttlebeam::rate_limit::RateLimitError>(())
    /// ```
    #[inline]
    pub fn check_at(&self, key: &str, now_us: u64) -> Result<Decision, RateLimitError> {
        self.check_n_at(key, 1, now_us)
    }

    /// Spends `cost` units for `key` at `now_us` (epoch microseconds, as
    /// [`Limiter::now_us`]).
    ///
    /// # Errors
    ///
    /// As [`Limiter::check_n`].
    #[inline]
    pub fn check_n_at(
        &self,
        key: &str,
        cost: u32,
        now_us: u64,
    ) -> Result<Decision, RateLimitError> {
        if let Err(err) = RateLimitError::check_key(key) {
            return Err(self.failed(err));
        }
        if self.inner.overrides.any() {
            return self.check_overridden(key, cost, now_us);
        }
        self.check_with(&self.inner.strategy, key, cost, now_us)
    }

    /// [`Limiter::check_n_at`] for a limiter with overrides: off the hot path of those without.
    #[inline(never)]
    fn check_overridden(
        &self,
        key: &str,
        cost: u32,
        now_us: u64,
    ) -> Result<Decision, RateLimitError> {
        match self.override_for(key) {
            Some(strategy) => self.check_with(&strategy, key, cost, now_us),
            None => self.check_with(&self.inner.strategy, key, cost, now_us),
        }
    }

    /// Spends `cost` units of `strategy` for a valid `key` and counts the decision.
    #[inline(always)]
    fn check_with(
        &self,
        strategy: &S,
        key: &str,
        cost: u32,
        now_us: u64,
    ) -> Result<Decision, RateLimitError> {
        let cost = match cost_for(strategy, key, cost) {
            Ok(cost) => cost,
            Err(err) => return Err(self.failed(err)),
        };
        let decided = if self.inner.namespace.is_empty() {
            self.inner.store.check(key, now_us, strategy, cost)
        } else {
            let store_key = self.store_key(key);
            self.inner.store.check(&store_key, now_us, strategy, cost)
        };
        match decided {
            Ok(d) => {
                self.inner.counters.decided(d.allowed);
                Ok(d)
            }
            Err(err) => Err(self.failed(err)),
        }
    }

    /// Runs a read-only or reset `op` for `key` now.
    fn read(
        &self,
        key: &str,
        op: impl FnOnce(&S) -> Result<RateLimitOp, RateLimitError>,
    ) -> Result<RateLimitReply, RateLimitError> {
        let result = RateLimitError::check_key(key).and_then(|()| {
            let strategy = self.strategy_for(key);
            let op = op(&strategy)?;
            let store_key = self.store_key(key);
            self.inner.store.apply(RateLimitRequest {
                key: &store_key,
                now_us: self.now_us(),
                strategy: &strategy,
                op,
            })
        });
        if result.is_err() {
            self.inner.counters.error();
        }
        result
    }

    /// Spends `cost` units for each of `keys`, all at one timestamp.
    ///
    /// # Errors
    ///
    /// The first error of any key (see [`Limiter::check_n`]); the keys before it stay spent.
    pub fn check_many<K: AsRef<str>>(
        &self,
        keys: &[K],
        cost: u32,
    ) -> Result<Vec<Decision>, RateLimitError> {
        let now_us = self.now_us();
        keys.iter()
            .map(|k| self.check_n_at(k.as_ref(), cost, now_us))
            .collect()
    }

    /// The decision a cost-1 check would get now, without spending anything.
    ///
    /// # Errors
    ///
    /// [`RateLimitError::InvalidKey`] for an empty or over-long key,
    /// [`RateLimitError::Store`] if the store fails.
    pub fn peek(&self, key: &str) -> Result<Decision, RateLimitError> {
        match self.read(key, |_| Ok(RateLimitOp::Peek))? {
            RateLimitReply::Decision(d) => Ok(d),
            other => Err(wrong_reply(key, other)),
        }
    }

    /// How requests of `cost` units would fare from now on, without spending anything.
    ///
    /// # Errors
    ///
    /// [`RateLimitError::InvalidKey`], [`RateLimitError::ZeroCost`] and
    /// [`RateLimitError::InsufficientCapacity`] as [`Limiter::check_n`],
    /// [`RateLimitError::Store`] if the store fails.
    pub fn forecast(&self, key: &str, cost: u32) -> Result<Forecast, RateLimitError> {
        let op = |s: &S| cost_for(s, key, cost).map(|cost| RateLimitOp::Forecast { cost });
        match self.read(key, op)? {
            RateLimitReply::Forecast(f) => Ok(f),
            other => Err(wrong_reply(key, other)),
        }
    }

    /// Forgets `key`'s state: it is full again.
    ///
    /// # Errors
    ///
    /// [`RateLimitError::InvalidKey`] for an empty or over-long key,
    /// [`RateLimitError::Store`] if the store fails.
    pub fn reset(&self, key: &str) -> Result<(), RateLimitError> {
        self.read(key, |_| Ok(RateLimitOp::Reset)).map(drop)
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
    /// As [`Limiter::check_n`], before any wait: a cost above the capacity is refused at once.
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
        if !self.inner.queues.contains_key(key) {
            let decision = self.check_n_at(key, cost, self.now_us())?;
            if decision.allowed {
                return Ok(decision);
            }
        }
        let ticket = Ticket::join(&self.inner.queues, key);
        let _turn = ticket.gate().lock().await;
        loop {
            let decision = self.check_n_at(key, cost, self.now_us())?;
            if decision.allowed {
                return Ok(decision);
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
