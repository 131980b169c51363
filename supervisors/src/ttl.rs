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

    /// Reads and conditionally writes `key` in one step under its shard lock:
    /// `f` sees the live value as of `now` (`None` when missing or expired)
    /// and returns what to store, with its TTL from `now`, if anything, plus
    /// a result. This is set-if-absent and compare-and-set in one primitive.
    ///
    /// Keep `f` short: it holds the shard's write lock.
    ///
    /// # Examples
    ///
    /// ```
    /// # tokio::runtime::Builder::new_current_thread().enable_time().start_paused(true).build().unwrap().block_on(async {
    /// use std::{sync::Arc, time::Duration};
    /// use throttlebeam_supervisors::{Counters, TtlTable};
    /// use tokio::time::Instant;
    ///
    /// let table: TtlTable<&str, u32> = TtlTable::new(Arc::new(Counters::new()));
    /// let ttl = Duration::from_secs(1);
    /// // Set if absent: the first writer wins, the second sees its value.
    /// let nx = |v| move |live: Option<&u32>| match live {
    ///     Some(held) => (None, Err(*held)),
    ///     None => (Some((v, ttl)), Ok(())),
    /// };
    /// assert_eq!(table.upsert_at("k", Instant::now(), nx(1)), Ok(()));
    /// assert_eq!(table.upsert_at("k", Instant::now(), nx(2)), Err(1));
    /// # });
    /// ```
    pub fn upsert_at<R>(
        &self,
        key: K,
        now: Instant,
        f: impl FnOnce(Option<&V>) -> (Option<(V, Duration)>, R),
    ) -> R {
        let tick = self.tick(now);
        let (out, first) = match self.map.entry(key) {
            Entry::Occupied(mut occupied) => {
                let live = (occupied.get().expires_at > tick).then(|| &occupied.get().value);
                let (write, out) = f(live);
                if let Some((value, ttl)) = write {
                    let expires_at = self.tick(expiry(now, ttl));
                    drop(occupied.insert(TtlEntry { value, expires_at }));
                }
                (out, false)
            }
            Entry::Vacant(vacant) => {
                let (write, out) = f(None);
                let mut first = false;
                if let Some((value, ttl)) = write {
                    let expires_at = self.tick(expiry(now, ttl));
                    self.counters.ttl_added();
                    first = self.len.fetch_add(1, Ordering::AcqRel) == 0;
                    vacant.insert(TtlEntry { value, expires_at });
                }
                (out, first)
            }
        };
        if first {
            if let Some(sweeper) = &self.sweeper {
                sweeper.kick();
            }
        }
        out
    }

    /// Removes up to `n` entries, those that expire soonest first (expired
    /// ones included); returns how many were removed. For caps: evicting
    /// what would expire first is the least harmful early expiry. One pass
    /// over the table, so evict in batches.
    pub fn evict_soonest(&self, n: usize) -> usize {
        if n == 0 {
            return 0;
        }
        let mut ends: Vec<u64> = self.map.iter().map(|e| e.expires_at).collect();
        if ends.is_empty() {
            return 0;
        }
        let nth = n.min(ends.len()) - 1;
        let (_, threshold, _) = ends.select_nth_unstable(nth);
        let threshold = *threshold;
        drop(ends);
        let mut removed = 0;
        self.map.retain(|_, e| {
            let evict = removed < n && e.expires_at <= threshold;
            removed += usize::from(evict);
            !evict
        });
        self.forget(removed);
        removed
    }

    /// Releases capacity the table retains beyond what its entries need.
    pub fn shrink_to_fit(&self) {
        self.map.shrink_to_fit();
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
            // Give back what a flood left behind once it is swept.
            self.map.shrink_to_fit();
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

#[cfg(test)]
mod tests {
    use super::*;

    fn table() -> TtlTable<u32, u32> {
        TtlTable::new(Arc::new(Counters::new()))
    }

    #[tokio::test(start_paused = true)]
    async fn upsert_sees_only_live_values_and_counts_new_entries() {
        let t = table();
        let ttl = Duration::from_millis(100);
        let nx = |v: u32| {
            move |live: Option<&u32>| match live {
                Some(_) => (None, false),
                None => (Some((v, ttl)), true),
            }
        };
        assert!(t.upsert_at(1, Instant::now(), nx(10)));
        assert!(!t.upsert_at(1, Instant::now(), nx(11)));
        assert_eq!(t.get(&1), Some(10));
        assert_eq!(t.len(), 1);
        // Expired: absent for `f`, replaced without counting twice.
        tokio::time::advance(ttl).await;
        assert!(t.upsert_at(1, Instant::now(), nx(12)));
        assert_eq!(
            (t.get(&1), t.len(), t.counters.ttl_entries()),
            (Some(12), 1, 1)
        );
        // Compare-and-set: writes only when `f` says so.
        let cas = |expect: u32, v: u32| {
            move |live: Option<&u32>| {
                if live == Some(&expect) {
                    (Some((v, ttl)), true)
                } else {
                    (None, false)
                }
            }
        };
        assert!(!t.upsert_at(1, Instant::now(), cas(99, 13)));
        assert!(t.upsert_at(1, Instant::now(), cas(12, 13)));
        assert_eq!(t.get(&1), Some(13));
        // Nothing written for a missing key when `f` declines.
        assert!(!t.upsert_at(2, Instant::now(), cas(0, 1)));
        assert_eq!(t.len(), 1);
    }

    #[tokio::test(start_paused = true)]
    async fn evict_soonest_removes_the_earliest_expiries_first() {
        let t = table();
        for k in 0..10u32 {
            t.insert(k, k, Duration::from_secs(u64::from(10 - k)));
        }
        assert_eq!(t.evict_soonest(3), 3);
        assert_eq!(t.len(), 7);
        assert_eq!(t.counters.ttl_entries(), 7);
        for k in 7..10 {
            assert_eq!(t.get(&k), None, "{k} expires soonest");
        }
        for k in 0..7 {
            assert_eq!(t.get(&k), Some(k));
        }
        assert_eq!(t.evict_soonest(100), 7);
        assert!(t.is_empty());
        assert_eq!(t.evict_soonest(1), 0);
    }

    #[tokio::test(start_paused = true)]
    async fn a_sweep_gives_back_capacity() {
        let t = table();
        for k in 0..10_000u32 {
            t.insert(k, k, Duration::from_millis(10));
        }
        let grown = t.map.capacity();
        tokio::time::advance(Duration::from_millis(10)).await;
        assert_eq!(t.sweep(Instant::now()), 0);
        assert!(
            t.map.capacity() < grown / 10,
            "{} of {grown}",
            t.map.capacity()
        );
    }
}
