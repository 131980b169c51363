//! The window store: where a coalescing throttle records that a key's window
//! is taken, so that several instances sharing one store agree.
//!
//! The contract is four Redis-style commands (`GET`, `SET … PX [NX]`, `DEL`,
//! and a `clear` of what the store owns). [`MemoryWindowStore`] is the in-process
//! implementation; a Redis store implements the same trait.

use std::future::Future;
use std::pin::Pin;
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::sync::{Arc, Weak};
use std::time::Duration;

use dashmap::DashMap;
use dashmap::mapref::entry::Entry;
use tokio::time::Instant;

use crate::error::Error;
use crate::key::MAX_TIMER;

/// The error a [`WindowStore`] fails with.
pub type WindowStoreError = Box<dyn std::error::Error + Send + Sync + 'static>;

/// The future a [`WindowStore`] method returns.
pub type WindowStoreFuture<'a, T> =
    Pin<Box<dyn Future<Output = Result<T, WindowStoreError>> + Send + 'a>>;

/// Options of [`WindowStore::set`]: the expiry (Redis `PX`) and whether to
/// write only if the key is missing or expired (Redis `NX`).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
#[non_exhaustive]
pub struct SetOptions {
    /// Time to live of the written value.
    pub px: Duration,
    /// Write only if the key is missing or expired.
    pub nx: bool,
}

impl SetOptions {
    /// Overwrite unconditionally with a time to live of `px` (`SET key value PX ms`).
    #[must_use]
    pub fn px(px: Duration) -> Self {
        Self { px, nx: false }
    }

    /// Write only if the key is missing or expired (`SET key value PX ms NX`).
    #[must_use]
    pub fn nx(self) -> Self {
        Self { nx: true, ..self }
    }

    /// The expiry in whole milliseconds, at least 1, as Redis `PX` takes it.
    #[must_use]
    pub fn px_millis(&self) -> u64 {
        u64::try_from(self.px.as_millis())
            .unwrap_or(u64::MAX)
            .max(1)
    }
}

/// Where a coalescing throttle keeps its windows.
///
/// Keys arrive already prefixed with the throttle's namespace. The throttle
/// stores when a key's window ends, or while a function runs when its lease
/// lapses (milliseconds since the Unix epoch, as a decimal string), and reads
/// it back after losing a window race.
///
/// | method | contract |
/// |---|---|
/// | [`get`](WindowStore::get) | the stored value, or `None` when missing or expired; never creates anything |
/// | [`set`](WindowStore::set) | store the value for [`SetOptions::px`]; with [`SetOptions::nx`], atomically and only if the key is missing or expired, returning whether this call wrote it; without it, always overwrite and return `true` |
/// | [`del`](WindowStore::del) | remove the key (the throttle never calls it) |
/// | [`clear`](WindowStore::clear) | remove every key the store owns; a shared store may make it a no-op. The throttle calls it only on a store it created itself |
///
/// Fail by returning an error: the throttle fails open (the run still
/// happens and in-memory state keeps throttling per instance) and never
/// retries inside a call. There is no timeout around store calls, so give a
/// networked client its own.
///
/// # Examples
///
/// A store that is always down; the throttle keeps working:
///
/// ```
/// use throttlebeam::{SetOptions, WindowStoreFuture, WindowStore};
///
/// #[derive(Debug)]
/// struct Down;
///
/// impl WindowStore for Down {
///     fn get<'a>(&'a self, _key: &'a str) -> WindowStoreFuture<'a, Option<String>> {
///         Box::pin(async { Err("connection refused".into()) })
///     }
///     fn set<'a>(&'a self, _key: &'a str, _value: &'a str, _options: SetOptions) -> WindowStoreFuture<'a, bool> {
///         Box::pin(async { Err("connection refused".into()) })
///     }
///     fn del<'a>(&'a self, _key: &'a str) -> WindowStoreFuture<'a, ()> {
///         Box::pin(async { Err("connection refused".into()) })
///     }
///     fn clear(&self) -> WindowStoreFuture<'_, ()> {
///         Box::pin(async { Ok(()) })
///     }
/// }
/// ```
pub trait WindowStore: Send + Sync + 'static {
    /// The live value of `key`, if any.
    fn get<'a>(&'a self, key: &'a str) -> WindowStoreFuture<'a, Option<String>>;

    /// Writes `value` under `key` with the given expiry; see the trait docs.
    fn set<'a>(
        &'a self,
        key: &'a str,
        value: &'a str,
        options: SetOptions,
    ) -> WindowStoreFuture<'a, bool>;

    /// Removes `key`.
    fn del<'a>(&'a self, key: &'a str) -> WindowStoreFuture<'a, ()>;

    /// Removes every key this store owns.
    fn clear(&self) -> WindowStoreFuture<'_, ()>;
}

#[derive(Debug)]
struct Stored {
    value: Box<str>,
    expires_at: Instant,
}

struct MemoryInner {
    map: DashMap<Box<str>, Stored, ahash::RandomState>,
    sweep_interval: Duration,
    sweeping: AtomicBool,
    sweeps: AtomicU64,
}

/// An in-process [`WindowStore`]: the default store of a coalescing throttle.
///
/// Expiry is measured on tokio's monotonic clock, so wall-clock jumps don't
/// affect it (and paused test time drives it). Expired keys are never
/// returned; a lazy sweeper removes them every sweep interval (default 60 s)
/// and runs only while the store holds keys. [`WindowStore::clear`] empties
/// the store, which keeps working afterwards. Cheap to clone: clones share
/// the same keys.
///
/// # Examples
///
/// ```
/// # #[tokio::main(flavor = "current_thread", start_paused = true)] async fn main() {
/// use std::time::Duration;
/// use throttlebeam::{MemoryWindowStore, SetOptions, WindowStore};
///
/// let store = MemoryWindowStore::new();
/// let ttl = SetOptions::px(Duration::from_millis(100)).nx();
/// assert!(store.set("sync:1", "1", ttl).await.unwrap());
/// assert!(!store.set("sync:1", "2", ttl).await.unwrap()); // live: NX fails
/// tokio::time::advance(Duration::from_millis(100)).await;
/// assert!(store.set("sync:1", "3", ttl).await.unwrap()); // expired: NX wins
/// assert_eq!(store.get("sync:1").await.unwrap().as_deref(), Some("3"));
/// # }
/// ```
#[derive(Clone)]
pub struct MemoryWindowStore {
    inner: Arc<MemoryInner>,
}

impl Default for MemoryWindowStore {
    fn default() -> Self {
        Self::new()
    }
}

impl std::fmt::Debug for MemoryWindowStore {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("MemoryWindowStore")
            .field("len", &self.len())
            .field("sweep_interval", &self.inner.sweep_interval)
            .field("sweeping", &self.is_sweeping())
            .finish()
    }
}

impl MemoryWindowStore {
    /// An empty store sweeping every 60 s while it holds keys.
    #[must_use]
    pub fn new() -> Self {
        Self::build(Duration::from_secs(60))
    }

    /// An empty store sweeping every `interval` while it holds keys.
    ///
    /// # Errors
    ///
    /// [`Error::InvalidConfig`] for a zero interval or one too large to
    /// schedule.
    pub fn with_sweep_interval(interval: Duration) -> Result<Self, Error> {
        if interval.is_zero() || interval > MAX_TIMER {
            return Err(Error::InvalidConfig {
                what: "sweep interval",
                reason: "must be between 1 ns and 2^36 - 1 ms",
            });
        }
        Ok(Self::build(interval))
    }

    fn build(sweep_interval: Duration) -> Self {
        Self {
            inner: Arc::new(MemoryInner {
                map: DashMap::with_hasher(ahash::RandomState::new()),
                sweep_interval,
                sweeping: AtomicBool::new(false),
                sweeps: AtomicU64::new(0),
            }),
        }
    }

    /// Keys held, including expired ones the sweeper has not removed yet.
    #[must_use]
    pub fn len(&self) -> usize {
        self.inner.map.len()
    }

    /// Whether the store holds no key at all.
    #[must_use]
    pub fn is_empty(&self) -> bool {
        self.inner.map.is_empty()
    }

    /// Whether the sweeper is running (it runs only while keys exist).
    #[must_use]
    pub fn is_sweeping(&self) -> bool {
        self.inner.sweeping.load(Ordering::Acquire)
    }

    /// Sweeps done so far.
    #[must_use]
    pub fn sweeps(&self) -> u64 {
        self.inner.sweeps.load(Ordering::Relaxed)
    }

    /// Removes expired keys now; returns the keys left.
    pub fn sweep_now(&self) -> usize {
        self.inner.sweep(Instant::now())
    }

    fn get_now(&self, key: &str) -> Option<String> {
        let now = Instant::now();
        {
            let entry = self.inner.map.get(key)?;
            if entry.expires_at > now {
                return Some(entry.value.to_string());
            }
        }
        self.inner.map.remove_if(key, |_, e| e.expires_at <= now);
        None
    }

    fn set_now(&self, key: &str, value: &str, options: SetOptions) -> bool {
        let now = Instant::now();
        let expires_at = now.checked_add(options.px).unwrap_or(now + MAX_TIMER);
        let fresh = || Stored {
            value: value.into(),
            expires_at,
        };
        if let Some(mut live) = self.inner.map.get_mut(key) {
            if options.nx && live.expires_at > now {
                return false;
            }
            *live = fresh();
            return true;
        }
        match self.inner.map.entry(key.into()) {
            Entry::Occupied(mut occupied) => {
                if options.nx && occupied.get().expires_at > now {
                    return false;
                }
                occupied.insert(fresh());
            }
            Entry::Vacant(vacant) => {
                vacant.insert(fresh());
            }
        }
        self.ensure_sweeper();
        true
    }

    /// Starts the sweeper if it is not running; it stops once the store is empty.
    fn ensure_sweeper(&self) {
        let inner = &self.inner;
        if inner.sweeping.load(Ordering::Acquire) || inner.sweeping.swap(true, Ordering::AcqRel) {
            return;
        }
        let Ok(handle) = tokio::runtime::Handle::try_current() else {
            // No runtime to sweep on: reads still never return expired keys.
            inner.sweeping.store(false, Ordering::Release);
            return;
        };
        let weak = Arc::downgrade(inner);
        let interval = inner.sweep_interval;
        handle.spawn(sweep_loop(weak, interval));
    }
}

async fn sweep_loop(weak: Weak<MemoryInner>, interval: Duration) {
    loop {
        tokio::time::sleep(interval).await;
        let Some(inner) = weak.upgrade() else { return };
        if inner.sweep(Instant::now()) > 0 {
            continue;
        }
        inner.sweeping.store(false, Ordering::Release);
        // A key written between the sweep and the store above saw the flag
        // still set and started nothing: take the job back.
        if inner.map.is_empty() || inner.sweeping.swap(true, Ordering::AcqRel) {
            return;
        }
    }
}

impl MemoryInner {
    fn sweep(&self, now: Instant) -> usize {
        self.map.retain(|_, e| e.expires_at > now);
        self.sweeps.fetch_add(1, Ordering::Relaxed);
        self.map.len()
    }
}

impl WindowStore for MemoryWindowStore {
    fn get<'a>(&'a self, key: &'a str) -> WindowStoreFuture<'a, Option<String>> {
        Box::pin(async move { Ok(self.get_now(key)) })
    }

    fn set<'a>(
        &'a self,
        key: &'a str,
        value: &'a str,
        options: SetOptions,
    ) -> WindowStoreFuture<'a, bool> {
        Box::pin(async move { Ok(self.set_now(key, value, options)) })
    }

    fn del<'a>(&'a self, key: &'a str) -> WindowStoreFuture<'a, ()> {
        Box::pin(async move {
            self.inner.map.remove(key);
            Ok(())
        })
    }

    fn clear(&self) -> WindowStoreFuture<'_, ()> {
        Box::pin(async move {
            self.inner.map.clear();
            Ok(())
        })
    }
}
