//! A concurrent table whose entries expire, checked on every read.

use std::borrow::Borrow;
use std::hash::Hash;
use std::sync::Arc;
use std::sync::atomic::{AtomicUsize, Ordering};
use std::time::Duration;

use dashmap::DashMap;
use dashmap::mapref::entry::Entry;
use tokio::time::Instant;

use crate::stats::Counters;
use crate::sweeper::{Sweep, Sweeper};

#[derive(Debug)]
struct TtlEntry<V> {
    value: V,
    /// Nanoseconds after the table's base instant: 8 bytes instead of 16
    /// keeps small entries within one cache line.
    expires_at: u64,
}

/// A map whose entries live for a TTL.
///
/// Expiry is checked on every read, so an expired entry is never returned,
/// even before the sweeper removes it. Register the table with a [`Sweeper`]
/// (see [`TtlTable::with_sweeper`]) to have expired entries removed
/// periodically; the sweeper runs only while the table holds entries.
///
/// # Examples
///
/// ```
/// # tokio::runtime::Builder::new_current_thread().enable_time().start_paused(true).build().unwrap().block_on(async {
/// use std::{sync::Arc, time::Duration};
/// use throttlebeam_supervisors::{Counters, TtlTable};
///
/// let table: TtlTable<String, u32> = TtlTable::new(Arc::new(Counters::new()));
/// table.insert("k".to_owned(), 1, Duration::from_secs(10));
/// assert_eq!(table.get("k"), Some(1));
/// tokio::time::advance(Duration::from_secs(10)).await;
/// assert_eq!(table.get("k"), None);
/// # });
/// ```
pub struct TtlTable<K, V> {
    map: DashMap<K, TtlEntry<V>, ahash::RandomState>,
    len: AtomicUsize,
    counters: Arc<Counters>,
    sweeper: Option<Sweeper>,
    base: Instant,
}

impl<K: Eq + Hash + Send + Sync + 'static, V: Clone + Send + Sync + 'static> TtlTable<K, V> {
    /// Creates an empty table without a sweeper.
    #[must_use]
    pub fn new(counters: Arc<Counters>) -> Self {
        Self {
            map: DashMap::with_hasher_and_shard_amount(
                ahash::RandomState::new(),
                crate::registry::shard_amount(),
            ),
            len: AtomicUsize::new(0),
            counters,
            base: Instant::now(),
            sweeper: None,
        }
    }

    /// Creates an empty table registered with `sweeper`.
    #[must_use]
    pub fn with_sweeper(counters: Arc<Counters>, sweeper: &Sweeper) -> Arc<Self> {
        let mut table = Self::new(counters);
        table.sweeper = Some(sweeper.clone());
        let table = Arc::new(table);
        let weak = Arc::downgrade(&table);
        sweeper.register(weak);
        table
    }

    /// Entries held, including expired ones not yet swept.
    pub fn len(&self) -> usize {
        self.len.load(Ordering::Acquire)
    }

    /// Whether the table holds nothing.
    pub fn is_empty(&self) -> bool {
        self.len() == 0
    }

    /// The live value for `key`; an expired entry is removed and not returned.
    pub fn get<Q>(&self, key: &Q) -> Option<V>
    where
        K: Borrow<Q>,
        Q: Hash + Eq + ?Sized,
    {
        self.get_at(key, Instant::now())
    }

    /// [`TtlTable::get`] as of `now`.
    pub fn get_at<Q>(&self, key: &Q, now: Instant) -> Option<V>
    where
        K: Borrow<Q>,
        Q: Hash + Eq + ?Sized,
    {
        self.read_at(key, now, V::clone)
    }

    /// Runs `f` on the live value for `key` as of `now`, under a shared lock
    /// and without cloning it; an expired entry is removed and `f` not run.
    ///
    /// Keep `f` short: it holds the shard's read lock.
    pub fn read_at<Q, R>(&self, key: &Q, now: Instant, f: impl FnOnce(&V) -> R) -> Option<R>
    where
        K: Borrow<Q>,
        Q: Hash + Eq + ?Sized,
    {
        {
            let entry = self.map.get(key)?;
            if entry.expires_at > self.tick(now) {
                return Some(f(&entry.value));
            }
        }
        if self
            .map
            .remove_if(key, |_, e| e.expires_at <= self.tick(now))
            .is_some()
        {
            self.forget(1);
        }
        None
    }

    /// Stores `value` for `ttl`, replacing any entry for `key` (a replaced
    /// entry still counts once). A `ttl` too large to represent means about
    /// thirty years.
    pub fn insert(&self, key: K, value: V, ttl: Duration) {
        let expires_at = self.tick(expiry(Instant::now(), ttl));
        let entry = TtlEntry { value, expires_at };
        // Count a new entry before it becomes visible, under its shard lock,
        // so a concurrent remove never decrements below zero.
        let (replaced, first) = match self.map.entry(key) {
            Entry::Occupied(mut occupied) => (Some(occupied.insert(entry)), false),
            Entry::Vacant(vacant) => {
                self.counters.ttl_added();
                let first = self.len.fetch_add(1, Ordering::AcqRel) == 0;
                vacant.insert(entry);
                (None, first)
            }
        };
        drop(replaced);
        if first {
            if let Some(sweeper) = &self.sweeper {
                sweeper.kick();
            }
        }
    }

    /// Removes `key`, returning its value if it was live.
    pub fn remove<Q>(&self, key: &Q) -> Option<V>
    where
        K: Borrow<Q>,
        Q: Hash + Eq + ?Sized,
    {
        let (_, entry) = self.map.remove(key)?;
        self.forget(1);
        (entry.expires_at > self.tick(Instant::now())).then_some(entry.value)
    }

    /// Removes every entry.
    pub fn clear(&self) {
        let mut removed = 0;
        self.map.retain(|_, _| {
            removed += 1;
            false
        });
        self.forget(removed);
        self.release_capacity();
    }

    /// Gives retained capacity back once the table holds under a quarter of
    /// what it could (as governor's `shrink_to_fit`); sweeps call it.
    pub fn release_capacity(&self) {
        let len = self.len().max(crate::registry::SHRINK_FLOOR);
        if self.map.capacity() > 4 * len {
            self.map.shrink_to_fit();
        }
    }

    /// Entries the table can hold without growing (its memory, in entries).
    pub fn capacity(&self) -> usize {
        self.map.capacity()
    }

    fn forget(&self, n: usize) {
        if n > 0 {
            self.len.fetch_sub(n, Ordering::AcqRel);
            self.counters.ttl_removed(n);
        }
    }
}

impl<K, V> Drop for TtlTable<K, V> {
    fn drop(&mut self) {
        // Entries of a dropped table must not stay counted.
        let n = *self.len.get_mut();
        if n > 0 {
            self.counters.ttl_removed(n);
        }
    }
}

impl<K, V> TtlTable<K, V> {
    /// `t` as nanoseconds after the table's base (0 before it).
    #[inline]
    fn tick(&self, t: Instant) -> u64 {
        u64::try_from(t.saturating_duration_since(self.base).as_nanos()).unwrap_or(u64::MAX)
    }
}

/// `now + ttl`, capped instead of overflowing on huge TTLs.
fn expiry(now: Instant, ttl: Duration) -> Instant {
    const FAR: Duration = Duration::from_secs(30 * 365 * 24 * 60 * 60);
    now.checked_add(ttl)
        .or_else(|| now.checked_add(FAR))
        .unwrap_or(now)
}

impl<K, V> Sweep for TtlTable<K, V>
where
    K: Eq + Hash + Send + Sync + 'static,
    V: Clone + Send + Sync + 'static,
{
    fn sweep(&self, now: Instant) -> usize {
        let mut removed = 0;
        let now = self.tick(now);
        self.map.retain(|_, e| {
            let keep = e.expires_at > now;
            removed += usize::from(!keep);
            keep
        });
        self.forget(removed);
        if removed > 0 {
            self.release_capacity();
        }
        self.len()
    }
}

impl<K, V> std::fmt::Debug for TtlTable<K, V> {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("TtlTable")
            .field("len", &self.len.load(Ordering::Relaxed))
            .finish_non_exhaustive()
    }
}
