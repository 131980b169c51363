//! A concurrent table whose entries expire, checked on every read.

use std::borrow::Borrow;
use std::collections::VecDeque;
use std::hash::Hash;
use std::sync::atomic::{AtomicU64, AtomicUsize, Ordering};
use std::sync::{Arc, Mutex, PoisonError};
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
    /// Insertion number: tells this entry's slot in a capped table's
    /// order queue from the slots of entries it replaced.
    seq: u64,
}

/// A map whose entries live for a TTL.
///
/// Expiry is checked on every read, so an expired entry is never returned,
/// even before the sweeper removes it. Register the table with a [`Sweeper`]
/// (see [`TtlTable::with_sweeper`]) to have expired entries removed
/// periodically; the sweeper runs only while the table holds entries.
///
/// A table may be capped ([`TtlTable::with_max_len`]) and given a weight
/// budget ([`TtlTable::with_max_weight`], bytes, say): an insert past
/// either evicts the oldest inserted entries first, which has the effect of
/// an early expiry, and counts them ([`TtlTable::evictions`]).
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
pub struct TtlTable<K, V, C = TokioClock> {
    map: DashMap<K, TtlEntry<V>, ahash::RandomState>,
    len: AtomicUsize,
    counters: Arc<Counters>,
    sweeper: Option<Sweeper>,
    /// Every expiry is in nanoseconds on this clock.
    clock: C,
    /// The cap, with the keys in insertion order (and their insertion
    /// number, which tells a live entry from a replaced or removed one).
    bound: Option<Bound<K>>,
    /// The weight budget, if any: how to weigh an entry, and the most the
    /// entries may weigh together.
    budget: Option<Budget<K, V>>,
    /// What the entries weigh together (0 without a budget).
    weight: AtomicU64,
    evictions: AtomicU64,
    inserts: AtomicU64,
}

#[derive(Debug)]
struct Bound<K> {
    max_len: usize,
    order: Mutex<VecDeque<(K, u64)>>,
}

struct Budget<K, V> {
    max_weight: u64,
    weigh: fn(&K, &V) -> u64,
}

impl<K: Eq + Hash + Clone + Send + Sync + 'static, V: Clone + Send + Sync + 'static>
    TtlTable<K, V>
{
    /// Creates an empty table without a sweeper, on tokio's clock.
    #[must_use]
    pub fn new(counters: Arc<Counters>) -> Self {
        Self::with_clock(counters, TokioClock::new())
    }

    /// Creates an empty table registered with `sweeper`.
    #[must_use]
    pub fn with_sweeper(counters: Arc<Counters>, sweeper: &Sweeper) -> Arc<Self> {
        Self::new(counters).swept_by(sweeper)
    }
}

impl<K, V, C> TtlTable<K, V, C>
where
    K: Eq + Hash + Clone + Send + Sync + 'static,
    V: Clone + Send + Sync + 'static,
    C: TtlClock,
{
    /// Creates an empty table without a sweeper whose entries expire on `clock`: a clock
    /// faster to read than tokio's makes every read cheaper.
    #[must_use]
    pub fn with_clock(counters: Arc<Counters>, clock: C) -> Self {
        Self {
            map: DashMap::with_hasher_and_shard_amount(
                ahash::RandomState::new(),
                crate::registry::shard_amount(),
            ),
            len: AtomicUsize::new(0),
            counters,
            clock,
            sweeper: None,
            bound: None,
            budget: None,
            weight: AtomicU64::new(0),
            evictions: AtomicU64::new(0),
            inserts: AtomicU64::new(0),
        }
    }

    /// Caps the table at `max_len` entries (at least one): an insert past
    /// the cap evicts the oldest inserted entries first. Each entry then
    /// also costs a slot in an insertion-order queue.
    ///
    /// # Examples
    ///
    /// ```
    /// # tokio::runtime::Builder::new_current_thread().enable_time().start_paused(true).build().unwrap().block_on(async {
    /// use std::{sync::Arc, time::Duration};
    /// use throttlebeam_supervisors::{Counters, TtlTable};
    ///
    /// let table: TtlTable<u32, u32> = TtlTable::new(Arc::new(Counters::new())).with_max_len(2);
    /// for k in 0..3 {
    ///     table.insert(k, k, Duration::from_secs(10));
    /// }
    /// assert_eq!((table.get(&0), table.get(&1), table.get(&2)), (None, Some(1), Some(2)));
    /// assert_eq!(table.evictions(), 1);
    /// # });
    /// ```
    #[must_use]
    pub fn with_max_len(mut self, max_len: usize) -> Self {
        self.bound = Some(Bound {
            max_len: max_len.max(1),
            order: Mutex::new(VecDeque::new()),
        });
        self
    }

    /// Gives the table a weight budget: `weigh` tells what an entry weighs
    /// (its bytes, say; it must answer the same for the same entry every
    /// time), and an insert that brings the total past `max_weight` evicts
    /// the oldest inserted entries first, as the length cap does (an entry
    /// heavier than the whole budget is evicted at once). Keeps any length
    /// cap set before or after; without one the table is capped by weight
    /// only.
    ///
    /// # Examples
    ///
    /// ```
    /// # tokio::runtime::Builder::new_current_thread().enable_time().start_paused(true).build().unwrap().block_on(async {
    /// use std::{sync::Arc, time::Duration};
    /// use throttlebeam_supervisors::{Counters, TtlTable};
    ///
    /// let table: TtlTable<u32, Vec<u8>> = TtlTable::new(Arc::new(Counters::new()))
    ///     .with_max_weight(100, |_, v| v.len() as u64);
    /// table.insert(1, vec![0; 60], Duration::from_secs(10));
    /// table.insert(2, vec![0; 30], Duration::from_secs(10));
    /// assert_eq!(table.weight(), 90);
    /// assert_eq!(table.insert(3, vec![0; 20], Duration::from_secs(10)), 1, "1 evicted");
    /// assert_eq!((table.get(&1), table.weight(), table.evictions()), (None, 50, 1));
    /// # });
    /// ```
    #[must_use]
    pub fn with_max_weight(mut self, max_weight: u64, weigh: fn(&K, &V) -> u64) -> Self {
        if self.bound.is_none() {
            self = self.with_max_len(usize::MAX);
        }
        self.budget = Some(Budget { max_weight, weigh });
        self
    }

    /// Registers this table with `sweeper`.
    #[must_use]
    pub fn swept_by(mut self, sweeper: &Sweeper) -> Arc<Self> {
        self.sweeper = Some(sweeper.clone());
        let table = Arc::new(self);
        let weak = Arc::downgrade(&table);
        sweeper.register(weak);
        table
    }

    /// The table's clock now, in nanoseconds after its base: the scale of every expiry, and
    /// a reading as cheap as the clock (a timestamp counter, say).
    pub fn now_ns(&self) -> u64 {
        self.clock.now_ns()
    }

    /// The cap set with [`TtlTable::with_max_len`], if any.
    pub fn max_len(&self) -> Option<usize> {
        self.bound.as_ref().map(|bound| bound.max_len)
    }

    /// The weight budget set with [`TtlTable::with_max_weight`], if any.
    pub fn max_weight(&self) -> Option<u64> {
        self.budget.as_ref().map(|budget| budget.max_weight)
    }

    /// What the entries held weigh together, expired ones not yet swept
    /// included (0 without a weight budget).
    pub fn weight(&self) -> u64 {
        self.weight.load(Ordering::Acquire)
    }

    /// Entries evicted by the cap or the weight budget since the table was created.
    pub fn evictions(&self) -> u64 {
        self.evictions.load(Ordering::Relaxed)
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

    /// [`TtlTable::read_at`] now, read on the table's clock.
    #[inline]
    pub fn read<Q, R>(&self, key: &Q, f: impl FnOnce(&V) -> R) -> Option<R>
    where
        K: Borrow<Q>,
        Q: Hash + Eq + ?Sized,
    {
        self.read_ticks(key, self.clock.now_ns(), f)
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
        self.read_ticks(key, self.clock.ns_at(now), f)
    }

    #[inline]
    fn read_ticks<Q, R>(&self, key: &Q, now: u64, f: impl FnOnce(&V) -> R) -> Option<R>
    where
        K: Borrow<Q>,
        Q: Hash + Eq + ?Sized,
    {
        {
            let entry = self.map.get(key)?;
            if entry.expires_at > now {
                return Some(f(&entry.value));
            }
        }
        self.remove_expired(key, now);
        None
    }

    /// Removes `key` if it expired by `now` (out of line: reads of live keys never get here).
    #[inline(never)]
    fn remove_expired<Q>(&self, key: &Q, now: u64)
    where
        K: Borrow<Q>,
        Q: Hash + Eq + ?Sized,
    {
        if let Some((key, entry)) = self.map.remove_if(key, |_, e| e.expires_at <= now) {
            self.unweigh(&key, &entry.value);
            self.forget(1);
        }
    }

    /// Stores `value` for `ttl`, replacing any entry for `key` (a replaced
    /// entry still counts once). A `ttl` too large to represent means about
    /// thirty years. Returns how many entries the cap evicted (0 without a
    /// cap).
    pub fn insert(&self, key: K, value: V, ttl: Duration) -> usize {
        let expires_at = expiry(self.clock.now_ns(), ttl);
        // Only a capped table needs insertion numbers: spare the others the shared atomic.
        let seq = match self.bound {
            Some(_) => self.inserts.fetch_add(1, Ordering::Relaxed),
            None => 0,
        };
        // Weighed before it becomes visible, so a concurrent removal of it
        // never takes off weight not yet added.
        self.weigh(&key, &value);
        let entry = TtlEntry {
            value,
            expires_at,
            seq,
        };
        // With a cap, order and map change under the order lock (taken
        // before any shard lock, never after), so the queue never misses a key.
        let mut order = self.bound.as_ref().map(|bound| {
            let mut order = bound.order.lock().unwrap_or_else(PoisonError::into_inner);
            order.push_back((key.clone(), seq));
            order
        });
        // Count a new entry before it becomes visible, under its shard lock,
        // so a concurrent remove never decrements below zero.
        let (replaced, first) = match self.map.entry(key) {
            Entry::Occupied(mut occupied) => {
                let replaced = occupied.insert(entry);
                self.unweigh(occupied.key(), &replaced.value);
                (Some(replaced), false)
            }
            Entry::Vacant(vacant) => {
                self.counters.ttl_added();
                let first = self.len.fetch_add(1, Ordering::AcqRel) == 0;
                vacant.insert(entry);
                (None, first)
            }
        };
        drop(replaced);
        let evicted = match (&self.bound, order.as_deref_mut()) {
            (Some(bound), Some(order)) => self.evict(bound.max_len, order),
            _ => 0,
        };
        drop(order);
        if first && let Some(sweeper) = &self.sweeper {
            sweeper.kick();
        }
        evicted
    }

    /// Evicts the oldest entries until at most `max_len` remain and they
    /// weigh no more than the budget; drops queue slots of replaced or
    /// removed entries on the way.
    fn evict(&self, max_len: usize, order: &mut VecDeque<(K, u64)>) -> usize {
        let max_weight = self.max_weight().unwrap_or(u64::MAX);
        let mut evicted = 0;
        while self.len() > max_len || self.weight() > max_weight {
            let Some((key, seq)) = order.pop_front() else {
                break;
            };
            if let Some((key, entry)) = self.map.remove_if(&key, |_, e| e.seq == seq) {
                self.unweigh(&key, &entry.value);
                self.forget(1);
                evicted += 1;
            }
        }
        // Replaced and swept entries leave stale slots: keep the queue
        // within twice the live entries.
        if order.len() > 2 * self.len() + 64 {
            order.retain(|(key, seq)| self.map.get(key).is_some_and(|e| e.seq == *seq));
            if order.capacity() > 2 * order.len() + 64 {
                order.shrink_to_fit();
            }
        }
        if evicted > 0 {
            self.evictions.fetch_add(evicted as u64, Ordering::Relaxed);
        }
        evicted
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
        let tick = self.clock.ns_at(now);
        // A capped table records every write in its order queue, under the
        // order lock taken before the shard lock (as `insert` does).
        let seq = match self.bound {
            Some(_) => self.inserts.fetch_add(1, Ordering::Relaxed),
            None => 0,
        };
        let mut order = self.bound.as_ref().map(|bound| {
            (
                bound.order.lock().unwrap_or_else(PoisonError::into_inner),
                key.clone(),
            )
        });
        let (out, first, written) = match self.map.entry(key) {
            Entry::Occupied(mut occupied) => {
                let live = (occupied.get().expires_at > tick).then(|| &occupied.get().value);
                let (write, out) = f(live);
                let written = write.is_some();
                if let Some((value, ttl)) = write {
                    let expires_at = expiry(tick, ttl);
                    self.weigh(occupied.key(), &value);
                    let replaced = occupied.insert(TtlEntry {
                        value,
                        expires_at,
                        seq,
                    });
                    self.unweigh(occupied.key(), &replaced.value);
                }
                (out, false, written)
            }
            Entry::Vacant(vacant) => {
                let (write, out) = f(None);
                let mut first = false;
                let written = write.is_some();
                if let Some((value, ttl)) = write {
                    let expires_at = expiry(tick, ttl);
                    self.weigh(vacant.key(), &value);
                    self.counters.ttl_added();
                    first = self.len.fetch_add(1, Ordering::AcqRel) == 0;
                    vacant.insert(TtlEntry {
                        value,
                        expires_at,
                        seq,
                    });
                }
                (out, first, written)
            }
        };
        if let (Some(bound), Some((order, key))) = (&self.bound, order.as_mut())
            && written
        {
            order.push_back((key.clone(), seq));
            self.evict(bound.max_len, order);
        }
        drop(order);
        if first && let Some(sweeper) = &self.sweeper {
            sweeper.kick();
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
        self.map.retain(|k, e| {
            let evict = removed < n && e.expires_at <= threshold;
            if evict {
                self.unweigh(k, &e.value);
            }
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
        let (key, entry) = self.map.remove(key)?;
        self.unweigh(&key, &entry.value);
        self.forget(1);
        (entry.expires_at > self.clock.now_ns()).then_some(entry.value)
    }

    /// Removes every entry.
    pub fn clear(&self) {
        let order = self
            .bound
            .as_ref()
            .map(|bound| bound.order.lock().unwrap_or_else(PoisonError::into_inner));
        let mut removed = 0;
        self.map.retain(|k, e| {
            self.unweigh(k, &e.value);
            removed += 1;
            false
        });
        self.forget(removed);
        if let Some(mut order) = order {
            order.clear();
            order.shrink_to_fit();
        }
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

    /// Adds an entry's weight (with a budget).
    fn weigh(&self, key: &K, value: &V) {
        if let Some(budget) = &self.budget {
            self.weight
                .fetch_add((budget.weigh)(key, value), Ordering::AcqRel);
        }
    }

    /// Takes a removed entry's weight off (with a budget).
    fn unweigh(&self, key: &K, value: &V) {
        if let Some(budget) = &self.budget {
            self.weight
                .fetch_sub((budget.weigh)(key, value), Ordering::AcqRel);
        }
    }
}

impl<K, V, C> Drop for TtlTable<K, V, C> {
    fn drop(&mut self) {
        // Entries of a dropped table must not stay counted.
        let n = *self.len.get_mut();
        if n > 0 {
            self.counters.ttl_removed(n);
        }
    }
}

/// Where a [`TtlTable`] reads the time: nanoseconds after a base of its own, now and at a
/// tokio [`Instant`] (what sweeps and callers with an explicit `now` pass), on one scale.
pub trait TtlClock: Send + Sync + 'static {
    /// Nanoseconds after the base, now.
    fn now_ns(&self) -> u64;
    /// `t` as nanoseconds after the base (0 before it).
    fn ns_at(&self, t: Instant) -> u64;
}

/// tokio's clock (paused and advanced in tests), read against the instant it was made: the
/// default clock of a [`TtlTable`].
#[derive(Debug, Clone, Copy)]
pub struct TokioClock {
    base: Instant,
}

impl TokioClock {
    /// A clock whose base is now.
    #[must_use]
    pub fn new() -> Self {
        Self {
            base: Instant::now(),
        }
    }
}

impl Default for TokioClock {
    fn default() -> Self {
        Self::new()
    }
}

impl TtlClock for TokioClock {
    #[inline]
    fn now_ns(&self) -> u64 {
        self.ns_at(Instant::now())
    }

    #[inline]
    fn ns_at(&self, t: Instant) -> u64 {
        u64::try_from(t.saturating_duration_since(self.base).as_nanos()).unwrap_or(u64::MAX)
    }
}

/// `now + ttl` in nanoseconds, a TTL too large to represent capped at about thirty years.
fn expiry(now: u64, ttl: Duration) -> u64 {
    const FAR: u64 = 30 * 365 * 24 * 60 * 60 * 1_000_000_000;
    let ttl = u64::try_from(ttl.as_nanos()).unwrap_or(FAR).min(FAR);
    now.saturating_add(ttl)
}

impl<K, V, C> Sweep for TtlTable<K, V, C>
where
    K: Eq + Hash + Clone + Send + Sync + 'static,
    V: Clone + Send + Sync + 'static,
    C: TtlClock,
{
    fn sweep(&self, now: Instant) -> usize {
        let mut removed = 0;
        let now = self.clock.ns_at(now);
        self.map.retain(|k, e| {
            let keep = e.expires_at > now;
            if !keep {
                self.unweigh(k, &e.value);
            }
            removed += usize::from(!keep);
            keep
        });
        self.forget(removed);
        if let Some(bound) = &self.bound {
            let mut order = bound.order.lock().unwrap_or_else(PoisonError::into_inner);
            self.evict(bound.max_len, &mut order);
        }
        if removed > 0 {
            // Give back what a flood left behind once it is swept.
            self.release_capacity();
        }
        self.len()
    }
}

impl<K, V, C> std::fmt::Debug for TtlTable<K, V, C> {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("TtlTable")
            .field("len", &self.len.load(Ordering::Relaxed))
            .finish_non_exhaustive()
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    const SEC: Duration = Duration::from_secs(1);

    fn capped(max_len: usize) -> (Arc<Counters>, TtlTable<u32, u32>) {
        let counters = Arc::new(Counters::new());
        (
            Arc::clone(&counters),
            TtlTable::new(Arc::clone(&counters)).with_max_len(max_len),
        )
    }

    #[tokio::test(start_paused = true)]
    async fn past_the_cap_the_oldest_inserted_go_first_and_are_counted() {
        let (counters, table) = capped(3);
        for k in 0..3 {
            assert_eq!(table.insert(k, k * 10, 10 * SEC), 0);
        }
        // Replacing key 0 makes it the newest.
        assert_eq!(table.insert(0, 1, 10 * SEC), 0);
        assert_eq!(table.insert(3, 30, 10 * SEC), 1, "key 1 evicted");
        assert_eq!(table.insert(4, 40, 10 * SEC), 1, "key 2 evicted");
        assert_eq!(table.get(&1), None);
        assert_eq!(table.get(&2), None);
        assert_eq!(
            (table.get(&0), table.get(&3), table.get(&4)),
            (Some(1), Some(30), Some(40))
        );
        assert_eq!((table.len(), table.evictions()), (3, 2));
        assert_eq!(counters.ttl_entries(), 3);
    }

    #[tokio::test(start_paused = true)]
    async fn past_the_weight_budget_the_oldest_go_first_and_weight_is_exact() {
        let table: TtlTable<u32, Vec<u8>> = TtlTable::new(Arc::new(Counters::new()))
            .with_max_len(100)
            .with_max_weight(100, |k, v| u64::from(*k % 2) + v.len() as u64);
        assert_eq!(
            (table.max_len(), table.max_weight()),
            (Some(100), Some(100))
        );
        table.insert(0, vec![0; 40], 10 * SEC);
        table.insert(2, vec![0; 40], 20 * SEC);
        assert_eq!(table.weight(), 80);
        // Replacing an entry swaps its weight.
        table.insert(0, vec![0; 10], 10 * SEC);
        assert_eq!(table.weight(), 50);
        // Past the budget the oldest (key 2: key 0 was replaced after it) go first.
        assert_eq!(table.insert(4, vec![0; 60], 30 * SEC), 1);
        assert_eq!(table.get(&2), None);
        assert_eq!((table.weight(), table.evictions()), (70, 1));
        // Odd keys weigh one more: the weigher sees the key.
        table.insert(5, vec![0; 19], 30 * SEC);
        assert_eq!(table.weight(), 90);
        // Every way out takes the entry's weight off.
        assert!(table.remove(&5).is_some());
        assert_eq!(table.weight(), 70);
        tokio::time::advance(10 * SEC).await;
        assert_eq!(table.get(&0), None, "expired on read");
        assert_eq!(table.weight(), 60);
        table.insert(6, vec![0; 30], SEC);
        tokio::time::advance(SEC).await;
        assert_eq!(table.sweep(Instant::now()), 1);
        assert_eq!(table.weight(), 60);
        let nx = |live: Option<&Vec<u8>>| (live.is_none().then(|| (vec![0; 5], SEC)), ());
        table.upsert_at(8, Instant::now(), nx);
        assert_eq!(table.weight(), 65);
        // An entry heavier than the whole budget evicts everything, itself last.
        assert_eq!(table.insert(10, vec![0; 101], SEC), 3);
        assert_eq!((table.len(), table.weight(), table.evictions()), (0, 0, 4));
        table.insert(12, vec![0; 7], SEC);
        table.clear();
        assert_eq!(table.weight(), 0);
    }

    #[tokio::test(start_paused = true)]
    async fn the_order_queue_stays_within_bounds_under_churn() {
        let (_, table) = capped(1_000);
        for round in 0..50 {
            for k in 0..100 {
                table.insert(k, round, 10 * SEC);
            }
        }
        assert_eq!((table.len(), table.evictions()), (100, 0));
        let queued = table.bound.as_ref().unwrap().order.lock().unwrap().len();
        assert!(queued <= 2 * 100 + 64 + 1, "{queued} slots for 100 entries");
        tokio::time::advance(10 * SEC).await;
        assert_eq!(table.sweep(Instant::now()), 0);
        let bound = table.bound.as_ref().unwrap().order.lock().unwrap();
        assert!(
            bound.is_empty() && bound.capacity() <= 64,
            "{}",
            bound.capacity()
        );
    }

    #[tokio::test(start_paused = true)]
    async fn an_uncapped_table_never_evicts() {
        let table: TtlTable<u32, u32> = TtlTable::new(Arc::new(Counters::new()));
        for k in 0..10_000 {
            assert_eq!(table.insert(k, k, SEC), 0);
        }
        assert_eq!(
            (table.len(), table.evictions(), table.max_len()),
            (10_000, 0, None)
        );
    }

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
