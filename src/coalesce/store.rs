//! The window store: where a coalescing throttle records that a key's window
//! is taken, so that several instances sharing one store agree.
//!
//! The seam is data, not closures: four operations a remote store can map to
//! one round trip each (a `SET … NX PX` that answers the holder on a lost
//! race, and two compare-and-set writes on the owner's token), plus a read.
//! [`MemoryWindowStore`] is the in-process implementation.

use std::future::Future;
use std::pin::Pin;
use std::sync::Arc;
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::time::Duration;

use throttlebeam_supervisors::{Counters, Sweep, TtlTable};
use tokio::time::Instant;

use crate::error::Error;
use crate::key::InlineKey;

/// The error a [`WindowStore`] fails with.
pub type WindowStoreError = Box<dyn std::error::Error + Send + Sync + 'static>;

/// The future a [`WindowStore`] method returns.
pub type WindowStoreFuture<'a, T> =
    Pin<Box<dyn Future<Output = Result<T, WindowStoreError>> + Send + 'a>>;

/// Default cap on the keys a [`MemoryWindowStore`] holds.
pub const DEFAULT_WINDOW_STORE_KEYS: usize = 1_000_000;

/// What a window store holds for a key: when the window (or, while a
/// function runs, its lease) ends, and the token of the run that owns it.
///
/// Stored as text it reads `"<end_ms>:<token>"` ([`WindowEntry::encode`]),
/// so the window end stays readable by anything that parses the digits
/// before the colon; a plain `"<end_ms>"` decodes with token 0.
///
/// # Examples
///
/// ```
/// use throttlebeam::coalesce::WindowEntry;
///
/// let entry = WindowEntry::new(1_733_040_000_000, 42);
/// assert_eq!(entry.encode(), "1733040000000:42");
/// assert_eq!(WindowEntry::decode("1733040000000:42"), Some(entry));
/// assert_eq!(WindowEntry::decode("1733040000000").map(|e| e.end_ms), Some(1_733_040_000_000));
/// assert_eq!(WindowEntry::decode("soon"), None);
/// ```
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, Default)]
#[non_exhaustive]
pub struct WindowEntry {
    /// When the window or lease ends, in milliseconds since the Unix epoch.
    pub end_ms: u64,
    /// The owner's token: unique per run (random, never 0 for a run).
    pub token: u64,
}

impl WindowEntry {
    /// An entry ending at `end_ms`, owned by `token`.
    #[must_use]
    pub fn new(end_ms: u64, token: u64) -> Self {
        Self { end_ms, token }
    }

    /// The stored text: `"<end_ms>:<token>"`.
    #[must_use]
    pub fn encode(&self) -> String {
        format!("{}:{}", self.end_ms, self.token)
    }

    /// Parses [`WindowEntry::encode`]'s text, or a bare end (token 0).
    #[must_use]
    pub fn decode(value: &str) -> Option<Self> {
        let value = value.trim();
        let (end, token) = value.split_once(':').unwrap_or((value, "0"));
        Some(Self {
            end_ms: end.parse().ok()?,
            token: token.parse().ok()?,
        })
    }
}

impl std::fmt::Display for WindowEntry {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(f, "{}:{}", self.end_ms, self.token)
    }
}

/// How [`WindowStore::claim`] went.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
#[non_exhaustive]
pub enum WindowClaim {
    /// The key was free (missing or expired): it is ours now.
    Won,
    /// Another owner holds the key.
    Lost {
        /// What it holds, read in the same round trip; `None` when the
        /// value is unreadable (the throttle then retries after a window).
        holder: Option<WindowEntry>,
    },
}

/// Figures a [`WindowStore`] may report; part of [`crate::coalesce::CoalesceStats`].
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default, serde::Serialize)]
#[non_exhaustive]
pub struct WindowStoreStats {
    /// Keys held, expired ones not yet swept included.
    pub keys: usize,
    /// Live keys evicted early because the store was full.
    pub evictions: u64,
}

/// Where a coalescing throttle keeps its windows.
///
/// Keys arrive already prefixed with the throttle's namespace. Every
/// operation is one atomic step (one round trip for a remote store):
///
/// | method | contract | Redis |
/// |---|---|---|
/// | [`claim`](WindowStore::claim) | store `entry` for `ttl` only if the key is missing or expired; otherwise answer what it holds | `SET k v PX ttl NX GET` |
/// | [`extend`](WindowStore::extend) | store `entry` for `ttl` unless another token holds the key; `true` if written | compare-and-set script |
/// | [`record`](WindowStore::record) | same as `extend`, writing the window that follows a run | compare-and-set script |
///
/// Because `extend` and `record` compare the token first, a run whose lease
/// lapsed can never overwrite the window of the run that took the key over.
///
/// Fail by returning an error. The throttle fails open (the run still
/// happens and in-memory state keeps throttling per instance), never
/// retries inside a call, bounds every call by its store timeout
/// ([`CoalesceBuilder::with_store_timeout`](crate::coalesce::CoalesceBuilder::with_store_timeout))
/// and treats a panic as a failure.
///
/// # Examples
///
/// A store that is always down; the throttle keeps working:
///
/// ```
/// use std::time::Duration;
/// use throttlebeam::{coalesce::WindowClaim, coalesce::WindowEntry, coalesce::WindowStore, coalesce::WindowStoreFuture};
///
/// #[derive(Debug)]
/// struct Down;
///
/// impl WindowStore for Down {
///     fn claim<'a>(&'a self, _: &'a str, _: WindowEntry, _: Duration) -> WindowStoreFuture<'a, WindowClaim> {
///         Box::pin(async { Err("connection refused".into()) })
///     }
///     fn extend<'a>(&'a self, _: &'a str, _: WindowEntry, _: Duration) -> WindowStoreFuture<'a, bool> {
///         Box::pin(async { Err("connection refused".into()) })
///     }
///     fn record<'a>(&'a self, _: &'a str, _: WindowEntry, _: Duration) -> WindowStoreFuture<'a, bool> {
///         Box::pin(async { Err("connection refused".into()) })
///     }
/// }
/// ```
pub trait WindowStore: Send + Sync + 'static {
    /// Takes `key` for `entry.token` if it is free; see the trait docs.
    fn claim<'a>(
        &'a self,
        key: &'a str,
        entry: WindowEntry,
        ttl: Duration,
    ) -> WindowStoreFuture<'a, WindowClaim>;

    /// Extends a running function's lease, unless another token holds `key`.
    fn extend<'a>(
        &'a self,
        key: &'a str,
        entry: WindowEntry,
        ttl: Duration,
    ) -> WindowStoreFuture<'a, bool>;

    /// Records the window after a run, unless another token holds `key`.
    fn record<'a>(
        &'a self,
        key: &'a str,
        entry: WindowEntry,
        ttl: Duration,
    ) -> WindowStoreFuture<'a, bool>;

    /// Removes expired keys and returns the keys left. Called by the
    /// runtime's sweeper of every throttle using the store (and by
    /// [`Runtime::sweep_now`](crate::Runtime::sweep_now)); a store that
    /// expires keys itself (Redis) keeps the default, which does nothing.
    fn sweep(&self) -> usize {
        0
    }

    /// Figures for [`crate::coalesce::CoalesceStats`]; all zero by default.
    fn stats(&self) -> WindowStoreStats {
        WindowStoreStats::default()
    }
}

impl std::fmt::Debug for dyn WindowStore {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str("dyn WindowStore")
    }
}

impl<S: WindowStore + ?Sized> WindowStore for Arc<S> {
    fn claim<'a>(
        &'a self,
        key: &'a str,
        entry: WindowEntry,
        ttl: Duration,
    ) -> WindowStoreFuture<'a, WindowClaim> {
        (**self).claim(key, entry, ttl)
    }

    fn extend<'a>(
        &'a self,
        key: &'a str,
        entry: WindowEntry,
        ttl: Duration,
    ) -> WindowStoreFuture<'a, bool> {
        (**self).extend(key, entry, ttl)
    }

    fn record<'a>(
        &'a self,
        key: &'a str,
        entry: WindowEntry,
        ttl: Duration,
    ) -> WindowStoreFuture<'a, bool> {
        (**self).record(key, entry, ttl)
    }

    fn sweep(&self) -> usize {
        (**self).sweep()
    }

    fn stats(&self) -> WindowStoreStats {
        (**self).stats()
    }
}

struct MemoryInner {
    table: TtlTable<InlineKey, WindowEntry>,
    max_keys: usize,
    evictions: AtomicU64,
    evicting: AtomicBool,
    /// When the last eviction warning was logged, in ms after `base`
    /// (`u64::MAX`: never).
    warned_at: AtomicU64,
    base: Instant,
}

/// How often at most a full store says so at warn level.
const WARN_EVERY: Duration = Duration::from_secs(60);

/// An in-process [`WindowStore`]: the default store of a coalescing throttle.
///
/// Entries live in a TTL table (expired ones are never returned) on tokio's
/// monotonic clock, so wall-clock jumps don't affect them and paused test
/// time drives them. The runtime's sweeper removes expired entries through
/// every throttle using the store; [`MemoryWindowStore::sweep_now`] does it
/// on demand. Cheap to clone: clones share the same keys.
///
/// # Bounded
///
/// The store holds at most [`MemoryWindowStore::max_keys`] keys (default
/// [`DEFAULT_WINDOW_STORE_KEYS`], about 100 MB at worst): every window and
/// lease of every throttle using it counts, expired ones not yet swept
/// included. When a write would go over, expired keys are swept first; if
/// the store is still full, the keys that expire soonest (1/16 of the cap)
/// are evicted. An early eviction is an early expiry: the window of that
/// key is forgotten by the store, while each throttle still enforces it in
/// memory for its own instance. Evictions are counted
/// ([`WindowStoreStats::evictions`]) and logged at warn level at most once a
/// minute.
///
/// # Examples
///
/// ```
/// # #[tokio::main(flavor = "current_thread", start_paused = true)] async fn main() {
/// use std::time::Duration;
/// use throttlebeam::{coalesce::MemoryWindowStore, coalesce::WindowClaim, coalesce::WindowEntry, coalesce::WindowStore};
///
/// let store = MemoryWindowStore::new();
/// let ttl = Duration::from_millis(100);
/// let (a, b) = (WindowEntry::new(1_000, 1), WindowEntry::new(2_000, 2));
/// assert_eq!(store.claim("sync:1", a, ttl).await.unwrap(), WindowClaim::Won);
/// // Live: the claim is lost and answers the holder in the same step.
/// assert_eq!(store.claim("sync:1", b, ttl).await.unwrap(), WindowClaim::Lost { holder: Some(a) });
/// // Only the holder's token may extend or record.
/// assert!(!store.record("sync:1", b, ttl).await.unwrap());
/// tokio::time::advance(ttl).await;
/// assert_eq!(store.claim("sync:1", b, ttl).await.unwrap(), WindowClaim::Won); // expired: free
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
            .field("max_keys", &self.inner.max_keys)
            .field("evictions", &self.evictions())
            .finish()
    }
}

impl MemoryWindowStore {
    /// An empty store holding at most [`DEFAULT_WINDOW_STORE_KEYS`] keys.
    #[must_use]
    pub fn new() -> Self {
        Self::build(DEFAULT_WINDOW_STORE_KEYS)
    }

    /// An empty store holding at most `max_keys` keys.
    ///
    /// # Errors
    ///
    /// [`Error::InvalidConfig`] for a cap of zero.
    ///
    /// # Examples
    ///
    /// ```
    /// use throttlebeam::coalesce::MemoryWindowStore;
    ///
    /// assert_eq!(MemoryWindowStore::with_max_keys(10_000)?.max_keys(), 10_000);
    /// assert!(MemoryWindowStore::with_max_keys(0).is_err());
    /// # Ok::<_, throttlebeam::Error>(())
    /// ```
    pub fn with_max_keys(max_keys: usize) -> Result<Self, Error> {
        if max_keys == 0 {
            return Err(Error::InvalidConfig {
                what: "window store max keys",
                reason: "must be greater than zero",
            });
        }
        Ok(Self::build(max_keys))
    }

    fn build(max_keys: usize) -> Self {
        Self {
            inner: Arc::new(MemoryInner {
                table: TtlTable::new(Arc::new(Counters::new())),
                max_keys,
                evictions: AtomicU64::new(0),
                evicting: AtomicBool::new(false),
                warned_at: AtomicU64::new(u64::MAX),
                base: Instant::now(),
            }),
        }
    }

    /// Keys held, including expired ones not swept yet.
    #[must_use]
    pub fn len(&self) -> usize {
        self.inner.table.len()
    }

    /// Whether the store holds no key at all.
    #[must_use]
    pub fn is_empty(&self) -> bool {
        self.inner.table.is_empty()
    }

    /// The live entry of `key`, if any: what a test or a diagnostic reads back. Reading
    /// creates nothing and an expired entry reads as absent.
    ///
    /// # Examples
    ///
    /// ```
    /// use throttlebeam::coalesce::MemoryWindowStore;
    ///
    /// assert_eq!(MemoryWindowStore::new().get("k"), None);
    /// ```
    #[must_use]
    pub fn get(&self, key: &str) -> Option<WindowEntry> {
        self.inner.table.get(key.as_bytes())
    }

    /// The cap on keys held.
    #[must_use]
    pub fn max_keys(&self) -> usize {
        self.inner.max_keys
    }

    /// Live keys evicted early so far because the store was full.
    #[must_use]
    pub fn evictions(&self) -> u64 {
        self.inner.evictions.load(Ordering::Relaxed)
    }

    /// Removes expired keys now and gives back the memory they held;
    /// returns the keys left.
    pub fn sweep_now(&self) -> usize {
        self.inner.table.sweep(Instant::now())
    }

    /// Makes room before a write that would add `key`.
    fn make_room(&self, key: &str, now: Instant) {
        let inner = &*self.inner;
        if inner.table.len() < inner.max_keys
            || inner.table.read_at(key.as_bytes(), now, |_| ()).is_some()
            || inner.evicting.swap(true, Ordering::Acquire)
        {
            return;
        }
        if inner.table.sweep(now) >= inner.max_keys {
            let evicted = inner.table.evict_soonest((inner.max_keys / 16).max(1));
            let total =
                inner.evictions.fetch_add(evicted as u64, Ordering::Relaxed) + evicted as u64;
            let at = u64::try_from(now.saturating_duration_since(inner.base).as_millis())
                .unwrap_or(u64::MAX - 1);
            let last = inner.warned_at.load(Ordering::Relaxed);
            let due = last == u64::MAX || at.saturating_sub(last) >= WARN_EVERY.as_millis() as u64;
            if due
                && inner
                    .warned_at
                    .compare_exchange(last, at, Ordering::Relaxed, Ordering::Relaxed)
                    .is_ok()
            {
                tracing::warn!(
                    max_keys = inner.max_keys,
                    evicted,
                    total,
                    "window store full: evicted the windows that expire soonest"
                );
            }
        }
        inner.evicting.store(false, Ordering::Release);
    }

    fn claim_now(&self, key: &str, entry: WindowEntry, ttl: Duration) -> WindowClaim {
        let now = Instant::now();
        self.make_room(key, now);
        self.inner
            .table
            .upsert_at(InlineKey::new(key), now, |live| match live {
                Some(holder) => (
                    None,
                    WindowClaim::Lost {
                        holder: Some(*holder),
                    },
                ),
                None => (Some((entry, ttl)), WindowClaim::Won),
            })
    }

    /// Writes unless another token holds the key.
    fn cas_now(&self, key: &str, entry: WindowEntry, ttl: Duration) -> bool {
        let now = Instant::now();
        self.make_room(key, now);
        self.inner
            .table
            .upsert_at(InlineKey::new(key), now, |live| match live {
                Some(held) if held.token != entry.token => (None, false),
                _ => (Some((entry, ttl)), true),
            })
    }
}

impl WindowStore for MemoryWindowStore {
    fn claim<'a>(
        &'a self,
        key: &'a str,
        entry: WindowEntry,
        ttl: Duration,
    ) -> WindowStoreFuture<'a, WindowClaim> {
        let out = self.claim_now(key, entry, ttl);
        Box::pin(std::future::ready(Ok(out)))
    }

    fn extend<'a>(
        &'a self,
        key: &'a str,
        entry: WindowEntry,
        ttl: Duration,
    ) -> WindowStoreFuture<'a, bool> {
        let out = self.cas_now(key, entry, ttl);
        Box::pin(std::future::ready(Ok(out)))
    }

    fn record<'a>(
        &'a self,
        key: &'a str,
        entry: WindowEntry,
        ttl: Duration,
    ) -> WindowStoreFuture<'a, bool> {
        let out = self.cas_now(key, entry, ttl);
        Box::pin(std::future::ready(Ok(out)))
    }

    fn sweep(&self) -> usize {
        self.sweep_now()
    }

    fn stats(&self) -> WindowStoreStats {
        WindowStoreStats {
            keys: self.len(),
            evictions: self.evictions(),
        }
    }
}
