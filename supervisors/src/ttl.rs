//! A concurrent table whose entries expire, checked on every read.

use std::borrow::Borrow;
use std::cmp;
use std::collections::{BinaryHeap, VecDeque};
use std::hash::Hash;
use std::sync::atomic::{AtomicU64, AtomicUsize, Ordering};
use std::sync::{Arc, Mutex, MutexGuard, PoisonError};
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
/// an early expiry, and counts them ([`TtlTable::evictions`]). A table that
/// also keeps its entries in expiry order ([`TtlTable::with_expiry_order`])
/// removes what has expired before evicting anything live, and is swept
/// without a scan.
///
/// Besides plain inserts, [`TtlTable::update_at`] rewrites or removes one
/// key's entry in one step under its shard lock, seeing expired entries
/// too (compare-and-set), and [`TtlTable::update_within_at`] does so
/// without adding a key past a given count.
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
    /// With [`TtlTable::with_expiry_order`]: every write's expiry, soonest
    /// first. Locked after `order`, before any shard lock.
    expiries: Option<Mutex<BinaryHeap<Expiry<K>>>>,
}

impl<K> Bound<K> {
    /// Takes the order locks, in their one order.
    fn lock(&self) -> Orders<'_, K> {
        Orders {
            order: self.order.lock().unwrap_or_else(PoisonError::into_inner),
            expiries: self
                .expiries
                .as_ref()
                .map(|e| e.lock().unwrap_or_else(PoisonError::into_inner)),
        }
    }
}

/// The insertion order and, if kept, the expiry order, locked.
struct Orders<'a, K> {
    order: MutexGuard<'a, VecDeque<(K, u64)>>,
    expiries: Option<MutexGuard<'a, BinaryHeap<Expiry<K>>>>,
}

impl<K> Orders<'_, K> {
    /// Files write `seq` of `key`, expiring at `at`: in the expiry order if
    /// kept, and in the insertion order if it may be evicted (`queued`).
    fn file(&mut self, queued: bool, key: K, seq: u64, at: u64)
    where
        K: Clone,
    {
        match self.expiries.as_deref_mut() {
            Some(expiries) => {
                if queued {
                    self.order.push_back((key.clone(), seq));
                }
                expiries.push(Expiry { at, seq, key });
            }
            None if queued => self.order.push_back((key, seq)),
            None => {}
        }
    }
}

/// One write's slot in the expiry order; stale once its entry was
/// rewritten or removed (the entry's `seq` differs).
#[derive(Debug)]
struct Expiry<K> {
    at: u64,
    seq: u64,
    key: K,
}

impl<K> Ord for Expiry<K> {
    fn cmp(&self, other: &Self) -> cmp::Ordering {
        // Reversed: `BinaryHeap` pops its greatest, and the soonest must come first.
        (other.at, other.seq).cmp(&(self.at, self.seq))
    }
}

impl<K> PartialOrd for Expiry<K> {
    fn partial_cmp(&self, other: &Self) -> Option<cmp::Ordering> {
        Some(self.cmp(other))
    }
}

impl<K> PartialEq for Expiry<K> {
    fn eq(&self, other: &Self) -> bool {
        (self.at, self.seq) == (other.at, other.seq)
    }
}

impl<K> Eq for Expiry<K> {}

struct Budget<K, V> {
    /// Atomic so that [`TtlTable::set_max_weight`] can change it in place.
    max_weight: AtomicU64,
    weigh: fn(&K, &V) -> u64,
}

/// What [`TtlTable::update_at`] does with the entry of a key.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Update<V> {
    /// Leave it as it is (a missing key stays missing).
    Keep,
    /// Store this value for this TTL from `now`, replacing the entry.
    Set(V, Duration),
    /// Remove the entry (nothing to do for a missing key).
    Remove,
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
        let expiries = self.bound.take().and_then(|bound| bound.expiries);
        self.bound = Some(Bound {
            max_len: max_len.max(1),
            order: Mutex::new(VecDeque::new()),
            expiries,
        });
        self
    }

    /// Gives the table a weight budget: `weigh` tells what an entry weighs
    /// (its bytes, say; it must answer the same for the same entry every
    /// time), and an insert that brings the total past `max_weight` evicts
    /// the oldest inserted entries first, as the length cap does (an entry
    /// heavier than the whole budget is evicted at once). Keeps any length
    /// cap set before or after; without one the table is capped by weight
    /// only, and then an entry that weighs 0 is never evicted (evicting it
    /// would free nothing) and takes no slot in the insertion order.
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
        self.budget = Some(Budget {
            max_weight: AtomicU64::new(max_weight),
            weigh,
        });
        self
    }

    /// Keeps the entries in expiry order too: a heap beside the map, one
    /// slot per write (O(log n), under the insertion order's lock; slots of
    /// rewritten or removed entries are compacted away as the queue's are).
    /// Then a sweep removes what expired without a scan (O(log n) per entry
    /// removed), and a write past the cap or the weight budget first removes
    /// every expired entry, evicting live ones only if that is not enough.
    ///
    /// # Examples
    ///
    /// ```
    /// # tokio::runtime::Builder::new_current_thread().enable_time().start_paused(true).build().unwrap().block_on(async {
    /// use std::{sync::Arc, time::Duration};
    /// use throttlebeam_supervisors::{Counters, Sweep, TtlTable};
    ///
    /// let table: TtlTable<u32, u32> = TtlTable::new(Arc::new(Counters::new()))
    ///     .with_max_len(2)
    ///     .with_expiry_order();
    /// table.insert(1, 1, Duration::from_secs(10));
    /// table.insert(2, 2, Duration::from_secs(1));
    /// tokio::time::advance(Duration::from_secs(1)).await;
    /// // Past the cap the expired 2 goes, not the older live 1.
    /// assert_eq!(table.insert(3, 3, Duration::from_secs(10)), 0);
    /// assert_eq!((table.get(&1), table.get(&3), table.evictions()), (Some(1), Some(3), 0));
    /// # });
    /// ```
    #[must_use]
    pub fn with_expiry_order(mut self) -> Self {
        if self.bound.is_none() {
            self = self.with_max_len(usize::MAX);
        }
        if let Some(bound) = &mut self.bound {
            bound.expiries = Some(Mutex::new(BinaryHeap::new()));
        }
        self
    }

    /// Changes the weight budget set with [`TtlTable::with_max_weight`]
    /// (nothing for a table without one). Takes effect at the next write or
    /// sweep, which evicts what the new budget leaves no room for.
    pub fn set_max_weight(&self, max_weight: u64) {
        if let Some(budget) = &self.budget {
            budget.max_weight.store(max_weight, Ordering::Release);
        }
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
        self.budget
            .as_ref()
            .map(|budget| budget.max_weight.load(Ordering::Acquire))
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
        let now = self.clock.now_ns();
        let expires_at = expiry(now, ttl);
        // Only a capped table needs insertion numbers: spare the others the shared atomic.
        let seq = match self.bound {
            Some(_) => self.inserts.fetch_add(1, Ordering::Relaxed),
            None => 0,
        };
        // Weighed before it becomes visible, so a concurrent removal of it
        // never takes off weight not yet added.
        let weight = self.weigh(&key, &value);
        let entry = TtlEntry {
            value,
            expires_at,
            seq,
        };
        // With a cap, orders and map change under the order locks (taken
        // before any shard lock, never after), so the orders never miss a key.
        let mut orders = self.bound.as_ref().map(|bound| {
            let mut orders = bound.lock();
            orders.file(self.queued(bound, weight), key.clone(), seq, expires_at);
            orders
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
        let evicted = match (&self.bound, orders.as_mut()) {
            (Some(bound), Some(orders)) => self.evict(bound.max_len, orders, now),
            _ => 0,
        };
        drop(orders);
        if first && let Some(sweeper) = &self.sweeper {
            sweeper.kick();
        }
        evicted
    }

    /// Whether a write weighing `weight` takes a slot in the insertion
    /// order: only what a cap or the budget may evict does.
    fn queued(&self, bound: &Bound<K>, weight: u64) -> bool {
        bound.max_len != usize::MAX || (self.budget.is_some() && weight > 0)
    }

    /// Evicts the oldest entries until at most `max_len` remain and they
    /// weigh no more than the budget, first removing what expired by `now`
    /// if the expiry order is kept; drops slots of replaced or removed
    /// entries on the way.
    fn evict(&self, max_len: usize, orders: &mut Orders<'_, K>, now: u64) -> usize {
        let max_weight = self.max_weight().unwrap_or(u64::MAX);
        let over = || self.len() > max_len || self.weight() > max_weight;
        // Evicting a live entry while expired ones still count would be an
        // early expiry for nothing.
        if over()
            && let Some(expiries) = orders.expiries.as_deref_mut()
        {
            self.expire(expiries, now);
        }
        let order = &mut *orders.order;
        let mut evicted = 0;
        while over() {
            let Some((key, seq)) = order.pop_front() else {
                break;
            };
            if let Some((key, entry)) = self.map.remove_if(&key, |_, e| e.seq == seq) {
                self.unweigh(&key, &entry.value);
                self.forget(1);
                evicted += 1;
            }
        }
        // Replaced and swept entries leave stale slots: keep each order
        // within twice the live entries.
        if order.len() > 2 * self.len() + 64 {
            order.retain(|(key, seq)| self.map.get(key).is_some_and(|e| e.seq == *seq));
            if order.capacity() > 2 * order.len() + 64 {
                order.shrink_to_fit();
            }
        }
        if let Some(expiries) = orders.expiries.as_deref_mut() {
            if expiries.len() > 2 * self.len() + 64 {
                // Rebuilt from the map, whose writers wait on the order locks.
                *expiries = self
                    .map
                    .iter()
                    .map(|e| Expiry {
                        at: e.expires_at,
                        seq: e.seq,
                        key: e.key().clone(),
                    })
                    .collect();
            } else if expiries.capacity() > 4 * expiries.len() + 64 {
                expiries.shrink_to_fit();
            }
        }
        if evicted > 0 {
            self.evictions.fetch_add(evicted as u64, Ordering::Relaxed);
        }
        evicted
    }

    /// Removes the entries expired by `now` through the expiry order,
    /// soonest first: only what has expired (and stale slots) is looked at.
    fn expire(&self, expiries: &mut BinaryHeap<Expiry<K>>, now: u64) -> usize {
        let mut removed = 0;
        while expiries.peek().is_some_and(|next| next.at <= now) {
            let Some(Expiry { seq, key, .. }) = expiries.pop() else {
                break;
            };
            // A slot's write expires at its `at`: a matching `seq` is that write, expired.
            if let Some((key, entry)) = self.map.remove_if(&key, |_, e| e.seq == seq) {
                self.unweigh(&key, &entry.value);
                removed += 1;
            }
        }
        self.forget(removed);
        removed
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
        self.update_ticks(
            key,
            self.clock.ns_at(now),
            None::<(usize, fn() -> R)>,
            |held| {
                let live = held.and_then(|(value, left)| (!left.is_zero()).then_some(value));
                let (write, out) = f(live);
                let update = match write {
                    Some((value, ttl)) => Update::Set(value, ttl),
                    None => Update::Keep,
                };
                (update, out)
            },
        )
    }

    /// Reads and rewrites or removes `key`'s entry in one step under its
    /// shard lock: `f` sees the entry held as of `now` with the time it has
    /// left, an expired one too (with zero left) until it is removed, or
    /// `None` when there is none, and returns what to do with it plus a
    /// result. Unlike [`TtlTable::upsert_at`], this tells an expired entry
    /// from a missing one, so a compare-and-set can still match it.
    ///
    /// Keep `f` short: it holds the shard's write lock.
    ///
    /// # Examples
    ///
    /// ```
    /// # tokio::runtime::Builder::new_current_thread().enable_time().start_paused(true).build().unwrap().block_on(async {
    /// use std::{sync::Arc, time::Duration};
    /// use throttlebeam_supervisors::{Counters, TtlTable, Update};
    /// use tokio::time::Instant;
    ///
    /// let table: TtlTable<&str, u32> = TtlTable::new(Arc::new(Counters::new()));
    /// table.insert("lease", 7, Duration::from_secs(1));
    /// tokio::time::advance(Duration::from_secs(2)).await;
    /// // Lapsed, but still 7's until removed: 7 renews it.
    /// let renew = |owner| move |held: Option<(&u32, Duration)>| match held {
    ///     Some((&holder, _)) if holder == owner => (Update::Set(owner, Duration::from_secs(1)), true),
    ///     _ => (Update::Keep, false),
    /// };
    /// assert!(!table.update_at("lease", Instant::now(), renew(8)));
    /// assert!(table.update_at("lease", Instant::now(), renew(7)));
    /// assert_eq!(table.get("lease"), Some(7));
    /// // Removed only by its holder.
    /// let release = |held: Option<(&u32, Duration)>| match held {
    ///     Some((7, _)) => (Update::Remove, true),
    ///     _ => (Update::Keep, false),
    /// };
    /// assert!(table.update_at("lease", Instant::now(), release));
    /// assert!(table.is_empty());
    /// # });
    /// ```
    pub fn update_at<R>(
        &self,
        key: K,
        now: Instant,
        f: impl FnOnce(Option<(&V, Duration)>) -> (Update<V>, R),
    ) -> R {
        self.update_ticks(key, self.clock.ns_at(now), None::<(usize, fn() -> R)>, f)
    }

    /// [`TtlTable::update_at`] that adds no key past `max_len` entries: when
    /// the table holds no entry for `key` and holds `max_len` entries or
    /// more (expired ones count until removed), returns `None` without
    /// running `f`. Exact under concurrent writes. Unlike a cap set with
    /// [`TtlTable::with_max_len`], which evicts, this refuses.
    ///
    /// # Examples
    ///
    /// ```
    /// # tokio::runtime::Builder::new_current_thread().enable_time().start_paused(true).build().unwrap().block_on(async {
    /// use std::{sync::Arc, time::Duration};
    /// use throttlebeam_supervisors::{Counters, TtlTable, Update};
    /// use tokio::time::Instant;
    ///
    /// let table: TtlTable<u32, u32> = TtlTable::new(Arc::new(Counters::new()));
    /// let put = |v| move |_: Option<(&u32, Duration)>| (Update::Set(v, Duration::from_secs(1)), ());
    /// assert_eq!(table.update_within_at(1, Instant::now(), 1, put(1)), Some(()));
    /// assert_eq!(table.update_within_at(2, Instant::now(), 1, put(2)), None, "full");
    /// assert_eq!(table.update_within_at(1, Instant::now(), 1, put(3)), Some(()), "held");
    /// assert_eq!((table.get(&1), table.get(&2)), (Some(3), None));
    /// # });
    /// ```
    pub fn update_within_at<R>(
        &self,
        key: K,
        now: Instant,
        max_len: usize,
        f: impl FnOnce(Option<(&V, Duration)>) -> (Update<V>, R),
    ) -> Option<R> {
        let room = Some((max_len, || None));
        self.update_ticks(key, self.clock.ns_at(now), room, |held| {
            let (update, out) = f(held);
            (update, Some(out))
        })
    }

    /// The write path of every update: `room`, if any, is the most entries
    /// a new key may join and what to answer when it may not.
    fn update_ticks<R, F: FnOnce() -> R>(
        &self,
        key: K,
        tick: u64,
        room: Option<(usize, F)>,
        f: impl FnOnce(Option<(&V, Duration)>) -> (Update<V>, R),
    ) -> R {
        // A capped table files every write in its orders, under the order
        // locks taken before the shard lock (as `insert` does).
        let seq = match self.bound {
            Some(_) => self.inserts.fetch_add(1, Ordering::Relaxed),
            None => 0,
        };
        let mut orders = self.bound.as_ref().map(Bound::lock);
        // What to file once written: the key, its weight and its expiry.
        let mut filed = None;
        let mut first = false;
        let (out, old) = match self.map.entry(key) {
            Entry::Occupied(mut occupied) => {
                let held = occupied.get();
                let left = Duration::from_nanos(held.expires_at.saturating_sub(tick));
                let (update, out) = f(Some((&held.value, left)));
                let old = match update {
                    Update::Keep => None,
                    Update::Set(value, ttl) => {
                        let expires_at = expiry(tick, ttl);
                        let weight = self.weigh(occupied.key(), &value);
                        if self.bound.is_some() {
                            filed = Some((occupied.key().clone(), weight, expires_at));
                        }
                        let old = occupied.insert(TtlEntry {
                            value,
                            expires_at,
                            seq,
                        });
                        self.unweigh(occupied.key(), &old.value);
                        Some(old)
                    }
                    Update::Remove => {
                        let (key, old) = occupied.remove_entry();
                        self.unweigh(&key, &old.value);
                        self.forget(1);
                        Some(old)
                    }
                };
                (out, old)
            }
            Entry::Vacant(vacant) => {
                // Within a limit the new entry's place is taken before `f`
                // runs, so writes of other keys in other shards never
                // overshoot it.
                let reserved = match room {
                    Some((max_len, full)) => {
                        let took =
                            self.len
                                .fetch_update(Ordering::AcqRel, Ordering::Acquire, |n| {
                                    (n < max_len).then_some(n + 1)
                                });
                        let Ok(n) = took else {
                            return full();
                        };
                        // Kicks even if nothing is written: a concurrent
                        // insert saw this place taken and did not.
                        first = n == 0;
                        true
                    }
                    None => false,
                };
                let (update, out) = f(None);
                match update {
                    Update::Set(value, ttl) => {
                        let expires_at = expiry(tick, ttl);
                        let weight = self.weigh(vacant.key(), &value);
                        if self.bound.is_some() {
                            filed = Some((vacant.key().clone(), weight, expires_at));
                        }
                        self.counters.ttl_added();
                        if !reserved {
                            first = self.len.fetch_add(1, Ordering::AcqRel) == 0;
                        }
                        vacant.insert(TtlEntry {
                            value,
                            expires_at,
                            seq,
                        });
                    }
                    Update::Keep | Update::Remove if reserved => {
                        self.len.fetch_sub(1, Ordering::AcqRel);
                    }
                    Update::Keep | Update::Remove => {}
                }
                (out, None)
            }
        };
        // Outside the shard lock: a value may be costly to drop.
        drop(old);
        if let (Some(bound), Some(orders), Some((key, weight, expires_at))) =
            (&self.bound, orders.as_mut(), filed)
        {
            orders.file(self.queued(bound, weight), key, seq, expires_at);
            self.evict(bound.max_len, orders, tick);
        }
        drop(orders);
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
        let orders = self.bound.as_ref().map(Bound::lock);
        let mut removed = 0;
        self.map.retain(|k, e| {
            self.unweigh(k, &e.value);
            removed += 1;
            false
        });
        self.forget(removed);
        if let Some(mut orders) = orders {
            orders.order.clear();
            orders.order.shrink_to_fit();
            if let Some(expiries) = orders.expiries.as_deref_mut() {
                expiries.clear();
                expiries.shrink_to_fit();
            }
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

    /// Adds an entry's weight (with a budget) and returns it.
    fn weigh(&self, key: &K, value: &V) -> u64 {
        let Some(budget) = &self.budget else {
            return 0;
        };
        let weight = (budget.weigh)(key, value);
        self.weight.fetch_add(weight, Ordering::AcqRel);
        weight
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
        let now = self.clock.ns_at(now);
        let removed = match &self.bound {
            // The expiry order finds what expired without a scan.
            Some(bound) if bound.expiries.is_some() => {
                let mut orders = bound.lock();
                let removed = orders
                    .expiries
                    .as_deref_mut()
                    .map_or(0, |expiries| self.expire(expiries, now));
                self.evict(bound.max_len, &mut orders, now);
                removed
            }
            _ => {
                let mut removed = 0;
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
                    self.evict(bound.max_len, &mut bound.lock(), now);
                }
                removed
            }
        };
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

    fn table() -> TtlTable<u32, u32> {
        TtlTable::new(Arc::new(Counters::new()))
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

    #[tokio::test(start_paused = true)]
    async fn a_weight_only_budget_never_evicts_weightless_entries() {
        let table: TtlTable<u32, Vec<u8>> =
            TtlTable::new(Arc::new(Counters::new())).with_max_weight(100, |_, v| v.len() as u64);
        // The oldest entries of all weigh nothing, and take no queue slot.
        for k in 0..10 {
            table.insert(k, Vec::new(), 10 * SEC);
        }
        assert!(
            table
                .bound
                .as_ref()
                .unwrap()
                .order
                .lock()
                .unwrap()
                .is_empty()
        );
        table.insert(10, vec![0; 60], 10 * SEC);
        table.insert(11, vec![0; 30], 10 * SEC);
        assert_eq!(table.insert(12, vec![0; 20], 10 * SEC), 1);
        assert_eq!(table.get(&10), None, "the oldest weighed entry went");
        // Heavier than the budget: every weighed entry goes, itself last.
        assert_eq!(table.insert(13, vec![0; 101], 10 * SEC), 3);
        for k in 0..10 {
            assert_eq!(table.get(&k), Some(Vec::new()), "{k}");
        }
        assert_eq!((table.len(), table.weight(), table.evictions()), (10, 0, 4));
        // Rewritten with weight, an entry joins the order as the newest;
        // rewritten weightless, it leaves it.
        let set =
            |v: Vec<u8>| move |_: Option<(&Vec<u8>, Duration)>| (Update::Set(v, 10 * SEC), ());
        table.update_at(0, Instant::now(), set(vec![0; 50]));
        table.insert(20, vec![0; 50], 10 * SEC);
        table.update_at(0, Instant::now(), set(Vec::new()));
        assert_eq!(table.insert(21, vec![0; 60], 10 * SEC), 1);
        assert_eq!(
            (table.get(&0), table.get(&20), table.weight()),
            (Some(Vec::new()), None, 60)
        );
    }

    #[test]
    fn update_within_holds_its_limit_under_concurrent_writers() {
        let t = table();
        let won = AtomicUsize::new(0);
        std::thread::scope(|s| {
            for thread in 0..4u32 {
                let (t, won) = (&t, &won);
                s.spawn(move || {
                    for k in 0..1_000 {
                        let key = thread * 1_000 + k;
                        let put = |_: Option<(&u32, Duration)>| (Update::Set(key, 3600 * SEC), ());
                        if t.update_within_at(key, Instant::now(), 100, put).is_some() {
                            won.fetch_add(1, Ordering::Relaxed);
                        }
                    }
                });
            }
        });
        assert_eq!((won.into_inner(), t.len(), t.map.len()), (100, 100, 100));
    }

    #[tokio::test(start_paused = true)]
    async fn the_expiry_order_removes_what_expired_before_anything_live() {
        let table: TtlTable<u32, Vec<u8>> = TtlTable::new(Arc::new(Counters::new()))
            .with_max_weight(100, |_, v: &Vec<u8>| v.len() as u64)
            .with_expiry_order();
        table.insert(0, vec![0; 40], 10 * SEC);
        table.insert(1, vec![0; 30], SEC);
        table.insert(2, Vec::new(), SEC);
        table.insert(3, vec![0; 20], SEC);
        tokio::time::advance(SEC).await;
        // Past the budget every expired entry goes, weightless too, and no
        // live one, though 0 is the oldest.
        assert_eq!(table.insert(4, vec![0; 50], 10 * SEC), 0);
        assert_eq!((table.len(), table.weight(), table.evictions()), (2, 90, 0));
        assert_eq!(table.get(&0), Some(vec![0; 40]));
        // Not enough room: then the oldest live one.
        assert_eq!(table.insert(5, vec![0; 50], 10 * SEC), 1);
        assert_eq!((table.get(&0), table.evictions()), (None, 1));
        // A lowered budget evicts at the next write.
        table.set_max_weight(60);
        assert_eq!(table.max_weight(), Some(60));
        assert_eq!(table.insert(6, Vec::new(), 10 * SEC), 1);
        assert_eq!(
            (table.get(&4), table.weight(), table.evictions()),
            (None, 50, 2)
        );
        // A length cap set afterwards keeps the expiry order.
        let capped = table.with_max_len(10);
        assert!(capped.bound.as_ref().unwrap().expiries.is_some());
    }

    #[tokio::test(start_paused = true)]
    async fn a_sweep_through_the_expiry_order_removes_exactly_what_expired() {
        let t = table().with_expiry_order();
        for k in 0..100u32 {
            t.insert(k, k, if k % 2 == 0 { SEC } else { 10 * SEC });
        }
        // Renewals leave stale slots; the order stays within bounds.
        for round in 0..50 {
            for k in (1..100).step_by(2) {
                t.update_at(k, Instant::now(), |_| (Update::Set(round, 10 * SEC), ()));
            }
        }
        let bound = t.bound.as_ref().unwrap();
        let slots = bound.expiries.as_ref().unwrap().lock().unwrap().len();
        assert!(slots <= 2 * 100 + 64 + 1, "{slots} slots for 100 entries");
        assert!(bound.order.lock().unwrap().is_empty(), "nothing to evict");
        tokio::time::advance(SEC).await;
        assert_eq!(t.sweep(Instant::now()), 50);
        assert!((0..100).step_by(2).all(|k| t.map.get(&k).is_none()));
        assert!((1..100).step_by(2).all(|k| t.get(&k) == Some(49)));
        assert_eq!(t.counters.ttl_entries(), 50);
        tokio::time::advance(10 * SEC).await;
        assert_eq!(t.sweep(Instant::now()), 0);
        let expiries = bound.expiries.as_ref().unwrap().lock().unwrap();
        assert!(
            expiries.is_empty() && expiries.capacity() <= 64,
            "{}",
            expiries.capacity()
        );
    }
}
