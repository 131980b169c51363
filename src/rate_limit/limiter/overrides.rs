//! A limiter's per-key overrides: its own ([`Limiter::set_local_override`]) and those its store
//! keeps for every instance ([`Limiter::set_override`]), read back here so that a check costs
//! no lookup in the store.
//!
//! A store that shares overrides (Redis) is read again when it says they may have changed
//! (a notice arrived, or notices may have been missed: [`AsyncRateLimitStore::overrides_version`])
//! and at least every [`DEFAULT_OVERRIDE_REFRESH`]; the first asynchronous call of a limiter
//! waits for the first read, so an instance that starts (or restarts) never decides with
//! limits it has not read. A read that fails is tried again no sooner than [`RETRY`], and
//! meanwhile calls go on with what was read last.

use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::time::Duration;

use dashmap::DashMap;
use tokio::time::Instant;

use super::Limiter;
use crate::rate_limit::store::AsyncRateLimitStore;
use crate::rate_limit::strategy::Strategy;
use crate::rate_limit::{RateLimitError, StoredOverride};

/// How often a limiter reads the overrides its store keeps for every instance, at most, while
/// nothing says they changed (see [`LimiterBuilder::with_override_refresh`](super::LimiterBuilder::with_override_refresh)):
/// 5 s. The bound within which an override whose notice was lost applies everywhere.
pub const DEFAULT_OVERRIDE_REFRESH: Duration = Duration::from_secs(5);

/// The least time between two reads of the overrides after one failed.
const RETRY: Duration = Duration::from_millis(250);

/// The least time between two warnings that reading the overrides failed.
const WARN_EVERY: Duration = Duration::from_secs(60);

/// An override read from the store, until it expires.
struct Shared<S> {
    strategy: S,
    until: Option<Instant>,
}

/// The overrides of one limiter.
pub(super) struct Overrides<S> {
    /// This instance's own: they win over shared ones.
    local: DashMap<Box<str>, S, ahash::RandomState>,
    /// Those kept for every instance, as last read (or, for a store that keeps none, kept
    /// here).
    shared: DashMap<Box<str>, Shared<S>, ahash::RandomState>,
    /// Whether either map may hold anything: checks skip both while it is false.
    any: AtomicBool,
    /// One read of the store at a time; the first one is waited for.
    gate: tokio::sync::Mutex<()>,
    /// Whether a read of the store has succeeded.
    loaded: AtomicBool,
    /// The store's `overrides_version` when the last successful read was sent.
    version: AtomicU64,
    /// When the next read is due, in ns after `base`.
    due: AtomicU64,
    /// After a failed read, the least time the next one waits for, in ns after `base`.
    retry_at: AtomicU64,
    base: Instant,
    refresh: Duration,
    /// Writes of this instance so far: a read sent before one is not applied (it may predate
    /// the write), and the next call reads again.
    writes: AtomicU64,
    /// When a failed read was last logged at warn (ns after `base`, `u64::MAX` never), and
    /// failures since.
    warned_at: AtomicU64,
    failures: AtomicU64,
}

impl<S: Strategy> Overrides<S> {
    pub(super) fn new(refresh: Duration) -> Self {
        Self {
            local: DashMap::default(),
            shared: DashMap::default(),
            any: AtomicBool::new(false),
            gate: tokio::sync::Mutex::new(()),
            loaded: AtomicBool::new(false),
            version: AtomicU64::new(0),
            due: AtomicU64::new(0),
            retry_at: AtomicU64::new(0),
            base: Instant::now(),
            refresh,
            writes: AtomicU64::new(0),
            warned_at: AtomicU64::new(u64::MAX),
            failures: AtomicU64::new(0),
        }
    }

    /// Whether any override may apply: checks look none up while there is none.
    #[inline]
    pub(super) fn any(&self) -> bool {
        self.any.load(Ordering::Acquire)
    }

    /// The override of `key`: this instance's own, else a shared one that has not expired.
    pub(super) fn get(&self, key: &str) -> Option<S> {
        if !self.any() {
            return None;
        }
        if let Some(local) = self.local.get(key) {
            return Some(local.clone());
        }
        let found = self.shared.get(key)?;
        if let Some(until) = found.until
            && Instant::now() >= until
        {
            drop(found);
            self.shared.remove_if(key, |_, o| o.until == Some(until));
            return None;
        }
        Some(found.strategy.clone())
    }

    pub(super) fn set_local(&self, key: &str, strategy: S) {
        self.local.insert(Box::from(key), strategy);
        self.any.store(true, Ordering::Release);
    }

    pub(super) fn remove_local(&self, key: &str) -> Option<S> {
        self.local.remove(key).map(|(_, s)| s)
    }

    /// Keeps what this instance just wrote (to the store, or here for a store that keeps
    /// none), and has a read of the store in flight not applied.
    pub(super) fn wrote(&self, key: &str, strategy: Option<S>, ttl: Option<Duration>) -> Option<S> {
        self.writes.fetch_add(1, Ordering::SeqCst);
        match strategy {
            Some(strategy) => {
                let until = ttl.map(|ttl| Instant::now() + ttl);
                self.any.store(true, Ordering::Release);
                self.shared
                    .insert(Box::from(key), Shared { strategy, until })
                    .map(|old| old.strategy)
            }
            None => self.shared.remove(key).map(|(_, old)| old.strategy),
        }
    }

    fn instant(&self, ns: &AtomicU64) -> Instant {
        self.base + Duration::from_nanos(ns.load(Ordering::Acquire))
    }

    fn set_instant(&self, ns: &AtomicU64, at: Instant) {
        let after =
            u64::try_from(at.saturating_duration_since(self.base).as_nanos()).unwrap_or(u64::MAX);
        ns.store(after, Ordering::Release);
    }

    /// Whether nothing is to be read now: what was read last still stands (the store says
    /// nothing changed and the refresh is not due), or a failed read is too recent to try
    /// again.
    #[inline]
    fn settled(&self, version: u64, now: Instant) -> bool {
        (self.loaded.load(Ordering::Acquire)
            && version == self.version.load(Ordering::Acquire)
            && now < self.instant(&self.due))
            || now < self.instant(&self.retry_at)
    }

    /// Logs a failed read at warn, at most once per [`WARN_EVERY`] with the count held back
    /// (a store down fails every read until it is back; its checks fail too, and say so).
    #[cold]
    fn failed(&self, namespace: &str, error: &RateLimitError, now: Instant) {
        let failures = self.failures.fetch_add(1, Ordering::Relaxed) + 1;
        let last = self.warned_at.load(Ordering::Relaxed);
        let due = last == u64::MAX || now >= self.base + Duration::from_nanos(last) + WARN_EVERY;
        if !due {
            tracing::debug!(namespace, %error, "reading the overrides kept in the store failed");
            return;
        }
        self.set_instant(&self.warned_at, now);
        self.failures.store(0, Ordering::Relaxed);
        tracing::warn!(
            namespace,
            %error,
            failures,
            "reading the overrides kept in the store failed; deciding with those read last, \
             trying again in {RETRY:?} (logged at most once a minute, with the failures since)"
        );
    }

    /// Replaces the shared overrides with `read`, sent at `sent`.
    fn apply(&self, read: Vec<StoredOverride<S>>, sent: Instant) {
        let mut keys = std::collections::HashSet::with_capacity(read.len());
        for o in read {
            let until = o.expires_in.map(|left| sent + left);
            keys.insert(Box::<str>::from(o.key.as_str()));
            self.shared.insert(
                Box::from(o.key),
                Shared {
                    strategy: o.strategy,
                    until,
                },
            );
        }
        // Each key goes from its old override to its new one, never through none.
        self.shared.retain(|key, _| keys.contains(key));
        if !keys.is_empty() {
            self.any.store(true, Ordering::Release);
        }
    }
}

impl<S: Strategy, St: AsyncRateLimitStore<S>> Limiter<S, St> {
    /// Brings the overrides of a store that keeps them for every instance up to date before an
    /// asynchronous call (see the module's documentation). Nothing for any other store.
    #[inline]
    pub(super) async fn sync_overrides(&self) {
        let store = &self.inner.store;
        if !store.shares_overrides() {
            return;
        }
        let overrides = &self.inner.overrides;
        if overrides.settled(store.overrides_version(), Instant::now()) {
            return;
        }
        self.read_overrides(false).await;
    }

    /// Reads the shared overrides (one caller at a time; the others go on with what was read
    /// last, but wait for the first read). With `now`, reads them even if they seem fresh.
    #[inline(never)]
    async fn read_overrides(&self, now: bool) -> Option<RateLimitError> {
        let store = &self.inner.store;
        let overrides = &self.inner.overrides;
        let _gate = if overrides.loaded.load(Ordering::Acquire) && !now {
            match overrides.gate.try_lock() {
                Ok(gate) => gate,
                Err(_) => return None,
            }
        } else {
            overrides.gate.lock().await
        };
        // Read by another caller meanwhile, or a failed read too recent to try again.
        let version = store.overrides_version();
        let at = Instant::now();
        if !now && overrides.settled(version, at) {
            return None;
        }
        let writes = overrides.writes.load(Ordering::SeqCst);
        let namespace = &self.inner.namespace;
        let read = self
            .guarded(namespace, || store.read_overrides(namespace))
            .await;
        let done = Instant::now();
        match read {
            Ok(read) if overrides.writes.load(Ordering::SeqCst) == writes => {
                overrides.apply(read, at);
                overrides.version.store(version, Ordering::Release);
                overrides.set_instant(&overrides.due, done + overrides.refresh);
                overrides.set_instant(&overrides.retry_at, overrides.base);
                overrides.loaded.store(true, Ordering::Release);
                None
            }
            // A write of this instance came meanwhile: the read may predate it. The next
            // call reads again.
            Ok(_) => None,
            Err(error) => {
                overrides.failed(&self.inner.namespace, &error, done);
                overrides.set_instant(&overrides.retry_at, done + RETRY);
                Some(error)
            }
        }
    }

    /// Applies `strategy` instead of the default to `key` on every instance that shares this
    /// limiter's store (e.g. a higher quota for one customer), until it is removed.
    ///
    /// A store that keeps overrides for every instance (Redis) keeps it there: it survives a
    /// restart of this instance, and applies on every other instance (with this limiter's
    /// namespace) at its first call after the store's notice of it arrives, or at the latest
    /// [`DEFAULT_OVERRIDE_REFRESH`] (5 s) later if the notice is lost. Until then they decide
    /// with the limits they knew. Any other store (memory) keeps it in this limiter, which is
    /// all that shares it. This instance applies it once the call returns. An override of
    /// this instance's own ([`Limiter::set_local_override`]) wins over it.
    ///
    /// The key keeps its state, read with the new limits: a bucket keeps its tokens (at
    /// most the new capacity), a window its count (against the new limit), a GCRA its
    /// arrival time; a state at rest under the limits that wrote it is none, whatever limits
    /// read it. The memory and Redis stores agree on this to the microsecond.
    ///
    /// # Errors
    ///
    /// [`RateLimitError::InvalidKey`] for an empty or over-long key;
    /// [`RateLimitError::Store`] when the store fails (the override may or may not be kept
    /// there); [`RateLimitError::TooLarge`] for a strategy the store cannot hold exactly.
    ///
    /// # Examples
    ///
    /// ```
    /// use std::time::Duration;
    /// use throttlebeam::rate_limit::{Gcra, Limiter};
    ///
    /// # #[tokio::main(flavor = "current_thread")]
    /// # async fn main() -> Result<(), throttlebeam::rate_limit::RateLimitError> {
    /// // With Redis: `Limiter::builder(..).with_store(redis)`, and every instance applies it.
    /// let limiter = Limiter::new(Gcra::new(10, Duration::from_secs(60))?);
    /// limiter.set_override("customer:7", Gcra::new(100, Duration::from_secs(60))?).await?;
    /// assert_eq!(limiter.check_async("customer:7").await?.limit, 100);
    /// assert_eq!(limiter.remove_override("customer:7").await?.map(|g| g.interval()),
    ///     Some(Duration::from_millis(600)));
    /// # Ok(())
    /// # }
    /// ```
    pub async fn set_override(&self, key: &str, strategy: S) -> Result<(), RateLimitError> {
        self.write_override(key, Some(strategy), None)
            .await
            .map(drop)
    }

    /// [`Limiter::set_override`] for `ttl`: afterwards `key` goes back to the default
    /// strategy on every instance (measured on the store's clock: each instance stops
    /// applying it at most one round trip before the store forgets it).
    ///
    /// # Errors
    ///
    /// As [`Limiter::set_override`], and [`RateLimitError::InvalidDuration`] for a `ttl`
    /// outside 1 ms ..= 2^36 - 1 ms.
    pub async fn set_override_for(
        &self,
        key: &str,
        strategy: S,
        ttl: Duration,
    ) -> Result<(), RateLimitError> {
        if let Some(reason) = crate::key::duration_problem(ttl) {
            return Err(self.failed(RateLimitError::InvalidDuration {
                what: "override ttl",
                reason,
            }));
        }
        self.write_override(key, Some(strategy), Some(ttl))
            .await
            .map(drop)
    }

    /// Goes back to the default strategy for `key` on every instance (as
    /// [`Limiter::set_override`] spreads); returns the override this instance applied.
    ///
    /// # Errors
    ///
    /// [`RateLimitError::InvalidKey`] for an empty or over-long key;
    /// [`RateLimitError::Store`] when the store fails (the override may or may not be gone
    /// there).
    pub async fn remove_override(&self, key: &str) -> Result<Option<S>, RateLimitError> {
        self.write_override(key, None, None).await
    }

    async fn write_override(
        &self,
        key: &str,
        strategy: Option<S>,
        ttl: Option<Duration>,
    ) -> Result<Option<S>, RateLimitError> {
        if let Err(err) = RateLimitError::check_key(key) {
            return Err(self.failed(err));
        }
        let store = &self.inner.store;
        if store.shares_overrides() {
            let namespace = &self.inner.namespace;
            let written = self
                .guarded(key, || {
                    store.write_override(namespace, key, strategy.as_ref(), ttl)
                })
                .await;
            written.map_err(|err| self.failed(err))?;
        } else {
            AsyncRateLimitStore::limits_changed(store, &self.store_key(key));
        }
        Ok(self.inner.overrides.wrote(key, strategy, ttl))
    }

    /// Reads the overrides the store keeps for every instance now, rather than when a notice
    /// or the refresh calls for it (nothing for a store that keeps none).
    ///
    /// # Errors
    ///
    /// [`RateLimitError::Store`] when the store fails; the limiter goes on with the
    /// overrides it read last.
    pub async fn refresh_overrides(&self) -> Result<(), RateLimitError> {
        if !self.inner.store.shares_overrides() {
            return Ok(());
        }
        self.read_overrides(true).await.map_or(Ok(()), Err)
    }

    /// Applies `strategy` instead of the default to `key` on this instance only, whatever the
    /// store: not kept in it, not seen by other instances, gone with this limiter. It wins
    /// over an override kept in the store. The key keeps its state (see
    /// [`Limiter::set_override`]). A store that answers some denials locally forgets those of
    /// `key` (the Redis store: on every instance).
    ///
    /// # Errors
    ///
    /// [`RateLimitError::InvalidKey`] for an empty or over-long key.
    pub fn set_local_override(&self, key: &str, strategy: S) -> Result<(), RateLimitError> {
        RateLimitError::check_key(key)?;
        self.inner.overrides.set_local(key, strategy);
        AsyncRateLimitStore::limits_changed(&self.inner.store, &self.store_key(key));
        Ok(())
    }

    /// Removes this instance's own override of `key` (see
    /// [`Limiter::set_local_override`]); returns it. Local answers of `key` are forgotten as
    /// there.
    pub fn remove_local_override(&self, key: &str) -> Option<S> {
        let removed = self.inner.overrides.remove_local(key);
        if removed.is_some() {
            AsyncRateLimitStore::limits_changed(&self.inner.store, &self.store_key(key));
        }
        removed
    }
}
