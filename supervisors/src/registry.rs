//! A keyed registry of per-key slots, stamped with generations (or not, for slots that no
//! process ever removes by incarnation).
//!
//! The registry owns each key's state; a per-key process only owns time and
//! work. Every operation is synchronous and runs under one shard lock, so it
//! can never be held across an `.await`.

use std::borrow::Borrow;
use std::hash::Hash;
use std::ops::{Deref, DerefMut};
use std::sync::Arc;
use std::sync::atomic::{AtomicU64, AtomicUsize, Ordering};
use std::time::Duration;

use dashmap::DashMap;
use dashmap::mapref::entry::Entry;

use tokio::time::Instant;

use crate::stats::Counters;
use crate::sweeper::Sweeper;

/// Shards of a registry's map: at least 64, so two threads rarely meet on
/// one shard lock; more on machines with many threads.
pub(crate) fn shard_amount() -> usize {
    let threads = std::thread::available_parallelism().map_or(1, usize::from);
    (threads * 4).next_power_of_two().max(64)
}

/// Below this many slots a map is never shrunk: not worth the rehash.
pub(crate) const SHRINK_FLOOR: usize = 1024;

/// Identifies one incarnation of a key's slot.
///
/// A slot removed and created again for the same key gets a new generation,
/// so a process of the old incarnation can never remove its successor.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub struct Generation(u64);

impl Generation {
    /// The raw number, unique within one registry.
    #[must_use]
    pub fn get(self) -> u64 {
        self.0
    }
}

/// A registry whose slots carry no [`Generation`]: for states that no process removes by
/// incarnation (they are only updated in place and swept with [`Registry::retain`]). Each
/// key costs 8 bytes less, and a new key takes no number from the registry's shared
/// counter.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, Default)]
pub struct NoGeneration;

/// What a registry stamps each new slot with: a [`Generation`] (the default), or
/// [`NoGeneration`].
pub trait Stamp: Copy + private::Sealed {
    /// The stamp of a slot inserted now.
    #[doc(hidden)]
    fn next(counter: &AtomicU64) -> Self;
}

impl Stamp for Generation {
    #[inline]
    fn next(counter: &AtomicU64) -> Self {
        Self(counter.fetch_add(1, Ordering::Relaxed))
    }
}

impl Stamp for NoGeneration {
    #[inline]
    fn next(_: &AtomicU64) -> Self {
        Self
    }
}

mod private {
    pub trait Sealed {}
    impl Sealed for super::Generation {}
    impl Sealed for super::NoGeneration {}
}

/// The cap on tracked keys was reached; nothing was inserted.
#[derive(Debug, Clone, Copy, PartialEq, Eq, thiserror::Error)]
#[error("registry is full: {cap} keys tracked")]
pub struct CapacityError {
    /// The cap in force.
    pub cap: usize,
}

/// One key's slot: its stamp (a generation, by default) and the state the registry owns
/// for it.
#[derive(Debug)]
pub struct Slot<S, G = Generation> {
    stamp: G,
    /// The key's state.
    pub state: S,
}

impl<S> Slot<S> {
    /// The incarnation this slot belongs to.
    #[must_use]
    pub fn generation(&self) -> Generation {
        self.stamp
    }
}

/// A key's slot as found by [`Registry::update`].
#[derive(Debug)]
pub enum SlotEntry<'a, K, S, G = Generation> {
    /// The key is tracked.
    Occupied(&'a mut Slot<S, G>),
    /// The key is not tracked; [`VacantSlot::insert`] starts tracking it.
    Vacant(VacantSlot<'a, K, S, G>),
}

/// A key that is not tracked, its shard locked until this value drops.
///
/// Dropping it without [`VacantSlot::insert`] tracks nothing.
pub struct VacantSlot<'a, K, S, G = Generation> {
    entry: dashmap::mapref::entry::VacantEntry<'a, K, Slot<S, G>>,
    shared: &'a Shared,
}

/// A freshly inserted slot, held under its shard lock until dropped.
///
/// Read and write the slot through `Deref`/`DerefMut`. Drop it before any
/// `.await`: other keys of its shard wait while it lives.
pub struct SlotGuard<'a, K, S, G = Generation> {
    inner: dashmap::mapref::one::RefMut<'a, K, Slot<S, G>>,
    /// The slot's stamp, kept out of the map: reading it back from a
    /// freshly written entry would wait for that entry's cache line.
    stamp: G,
}

impl<K: Eq + Hash, S> SlotGuard<'_, K, S> {
    /// The generation the slot was stamped with.
    #[must_use]
    pub fn generation(&self) -> Generation {
        self.stamp
    }
}

impl<K: Eq + Hash, S, G> Deref for SlotGuard<'_, K, S, G> {
    type Target = Slot<S, G>;
    fn deref(&self) -> &Slot<S, G> {
        &self.inner
    }
}

impl<K: Eq + Hash, S, G> DerefMut for SlotGuard<'_, K, S, G> {
    fn deref_mut(&mut self) -> &mut Slot<S, G> {
        &mut self.inner
    }
}

impl<'a, K: Eq + Hash + Clone, S, G: Stamp> VacantSlot<'a, K, S, G> {
    /// Starts tracking the key with `state`, stamping a fresh generation (if the registry
    /// stamps them).
    /// Wakes the registry's sweeper, if any, when this is its first key.
    ///
    /// # Errors
    ///
    /// [`CapacityError`] when the [`Counters`] shared by this registry
    /// already count its cap of keys; nothing is inserted.
    pub fn insert(self, state: S) -> Result<SlotGuard<'a, K, S, G>, CapacityError> {
        if !self.shared.counters.key_added(self.shared.cap) {
            return Err(CapacityError {
                cap: self.shared.cap,
            });
        }
        if self.shared.len.fetch_add(1, Ordering::AcqRel) == 0
            && let Some(sweeper) = &self.shared.sweeper
        {
            sweeper.kick();
        }
        let stamp = G::next(&self.shared.next_generation);
        let inner = self.entry.insert(Slot { stamp, state });
        Ok(SlotGuard { inner, stamp })
    }

    /// The key that would be inserted.
    pub fn key(&self) -> &K {
        self.entry.key()
    }
}

#[derive(Debug)]
struct Shared {
    counters: Arc<Counters>,
    sweeper: Option<Sweeper>,
    cap: usize,
    len: AtomicUsize,
    next_generation: AtomicU64,
    full_pass: FullPass,
}

/// The pacing of [`Registry::retain_when_full`].
#[derive(Debug)]
struct FullPass {
    base: Instant,
    /// When the next pass may run, in ms after `base`.
    next_ms: AtomicU64,
    /// Passes completed so far.
    passes: AtomicU64,
    /// When the last pass ended, in ms after `base`.
    end_ms: AtomicU64,
    /// Held by the pass running: other refused callers wait for it, then
    /// try again, rather than run one of their own or give up.
    running: std::sync::Mutex<()>,
}

impl FullPass {
    fn ms(&self, at: Instant) -> u64 {
        u64::try_from(at.saturating_duration_since(self.base).as_millis()).unwrap_or(u64::MAX)
    }
}

/// Lets the next pass run `pause` after `at` (ms after the base) when
/// dropped, even if the pass panicked.
struct PassDone<'a> {
    pass: &'a FullPass,
    at: u64,
    pause: Duration,
}

impl Drop for PassDone<'_> {
    fn drop(&mut self) {
        let pause = u64::try_from(self.pause.as_millis()).unwrap_or(u64::MAX);
        self.pass
            .next_ms
            .store(self.at.saturating_add(pause), Ordering::Relaxed);
        self.pass
            .end_ms
            .store(self.pass.ms(Instant::now()), Ordering::Relaxed);
        self.pass.passes.fetch_add(1, Ordering::Release);
    }
}

/// A concurrent map from key to [`Slot`], one per runtime instance.
///
/// Never a process-global name table: two registries never see each other's
/// keys. Keys count against a cap shared through [`Counters`], so every
/// registry of one instance draws from the same budget.
///
/// Every operation is synchronous and runs under one shard lock. Closures
/// passed to it run under that lock: keep them short, and never touch the
/// same registry from inside one (that can deadlock on the shard).
///
/// # Examples
///
/// ```
/// use std::sync::Arc;
/// use throttlebeam_supervisors::{Counters, Registry, SlotEntry};
///
/// let counters = Arc::new(Counters::new());
/// let registry: Registry<String, u32> = Registry::new(counters.clone(), usize::MAX);
/// let generation = registry
///     .update("a", |slot| match slot {
///         SlotEntry::Occupied(slot) => slot.generation(),
///         SlotEntry::Vacant(vacant) => vacant.insert(1).unwrap().generation(),
///     });
/// assert_eq!(registry.len(), 1);
/// // Only the incarnation that owns the slot may remove it.
/// assert!(registry.remove_if("a", generation, |n| *n == 1).is_some());
/// assert_eq!(counters.keys(), 0);
/// ```
///
/// A registry whose slots no process removes by incarnation can do without generations:
///
/// ```
/// use std::sync::Arc;
/// use throttlebeam_supervisors::{Counters, NoGeneration, Registry, SlotEntry};
///
/// let windows: Registry<String, u64, NoGeneration> =
///     Registry::new(Arc::new(Counters::new()), usize::MAX);
/// windows.update("a", |slot| match slot {
///     SlotEntry::Occupied(slot) => slot.state = 20,
///     SlotEntry::Vacant(vacant) => drop(vacant.insert(10)),
/// });
/// assert_eq!(windows.retain(|_, until| *until > 5), 1);
/// ```
pub struct Registry<K, S, G = Generation> {
    map: DashMap<K, Slot<S, G>, ahash::RandomState>,
    shared: Shared,
}

impl<K: Eq + Hash + Clone, S, G: Stamp> Registry<K, S, G> {
    /// Creates an empty registry counting its keys in `counters`, refusing
    /// new keys once `counters` counts `cap` keys (`usize::MAX`: no cap).
    #[must_use]
    pub fn new(counters: Arc<Counters>, cap: usize) -> Self {
        Self {
            map: DashMap::with_hasher_and_shard_amount(ahash::RandomState::new(), shard_amount()),
            shared: Shared {
                counters,
                cap,
                len: AtomicUsize::new(0),
                next_generation: AtomicU64::new(1),
                sweeper: None,
                full_pass: FullPass {
                    base: Instant::now(),
                    next_ms: AtomicU64::new(0),
                    passes: AtomicU64::new(0),
                    end_ms: AtomicU64::new(0),
                    running: std::sync::Mutex::new(()),
                },
            },
        }
    }

    /// Like [`Registry::new`], and kicks `sweeper` whenever the registry goes
    /// from empty to holding a key, for registries whose slots expire.
    ///
    /// The registry does not sweep itself: wrap it in a type implementing
    /// [`crate::Sweep`] (typically with [`Registry::retain`]) and register
    /// that with the sweeper.
    #[must_use]
    pub fn with_sweeper(counters: Arc<Counters>, cap: usize, sweeper: &Sweeper) -> Self {
        let mut registry = Self::new(counters, cap);
        registry.shared.sweeper = Some(sweeper.clone());
        registry
    }

    /// Keys tracked by this registry (see the crate's consistency model).
    pub fn len(&self) -> usize {
        self.shared.len.load(Ordering::Acquire)
    }

    /// Whether no key is tracked.
    pub fn is_empty(&self) -> bool {
        self.len() == 0
    }

    /// Runs `f` on the key's slot under its shard lock, race-free: either the
    /// live slot or a vacancy that `f` alone may fill. This is
    /// lookup-or-start: of many concurrent callers for a missing key, exactly
    /// one sees it vacant.
    ///
    /// A hit costs one lookup and no allocation; the owned key is built from
    /// `key` only when the key is missing.
    ///
    /// # Examples
    ///
    /// ```
    /// use std::sync::Arc;
    /// use throttlebeam_supervisors::{Counters, Registry, SlotEntry};
    ///
    /// let registry = Registry::<String, u32>::new(Arc::new(Counters::new()), usize::MAX);
    /// let calls = || {
    ///     registry.update("k", |slot| match slot {
    ///         SlotEntry::Occupied(slot) => {
    ///             slot.state += 1;
    ///             slot.state
    ///         }
    ///         SlotEntry::Vacant(vacant) => vacant.insert(1).map_or(0, |slot| slot.state),
    ///     })
    /// };
    /// assert_eq!(calls(), 1);
    /// assert_eq!(calls(), 2);
    /// ```
    pub fn update<Q, R>(&self, key: &Q, f: impl FnOnce(SlotEntry<'_, K, S, G>) -> R) -> R
    where
        K: Borrow<Q>,
        Q: Hash + Eq + ?Sized + ToOwned,
        Q::Owned: Into<K>,
    {
        self.update_with(key, || key.to_owned().into(), f)
    }

    /// [`Registry::update`] with the key made by `make`, only if it is
    /// new: no `ToOwned` detour (a small key can be built straight into
    /// its inline form).
    ///
    /// # Examples
    ///
    /// ```
    /// use std::sync::Arc;
    /// use throttlebeam_supervisors::{Counters, Registry, SlotEntry};
    ///
    /// let registry: Registry<String, u32> = Registry::new(Arc::new(Counters::new()), usize::MAX);
    /// let calls = || {
    ///     registry.update_with("k", || String::from("k"), |slot| match slot {
    ///         SlotEntry::Occupied(slot) => {
    ///             slot.state += 1;
    ///             slot.state
    ///         }
    ///         SlotEntry::Vacant(vacant) => vacant.insert(1).map_or(0, |slot| slot.state),
    ///     })
    /// };
    /// assert_eq!((calls(), calls()), (1, 2));
    /// ```
    pub fn update_with<Q, R>(
        &self,
        key: &Q,
        make: impl FnOnce() -> K,
        f: impl FnOnce(SlotEntry<'_, K, S, G>) -> R,
    ) -> R
    where
        K: Borrow<Q>,
        Q: Hash + Eq + ?Sized,
    {
        // Found by reference first: a key already tracked (the common case
        // of a busy key) is never built.
        if let Some(mut slot) = self.map.get_mut(key) {
            return f(SlotEntry::Occupied(&mut slot));
        }
        match self.map.entry(make()) {
            Entry::Occupied(mut occupied) => f(SlotEntry::Occupied(occupied.get_mut())),
            Entry::Vacant(entry) => f(SlotEntry::Vacant(VacantSlot {
                entry,
                shared: &self.shared,
            })),
        }
    }

    /// Reads the key's live slot under a shared lock, if any. The cheapest
    /// lookup: concurrent readers of one shard do not exclude each other.
    pub fn read<Q, R>(&self, key: &Q, f: impl FnOnce(&Slot<S, G>) -> R) -> Option<R>
    where
        K: Borrow<Q>,
        Q: Hash + Eq + ?Sized,
    {
        self.map.get(key).map(|slot| f(&slot))
    }

    /// Counts the slots whose state satisfies `pred`, under shared locks
    /// (one shard at a time: callers of other shards are never held up).
    /// For figures such as "keys live now" when slots outlive their use
    /// until a sweep; it visits every slot.
    ///
    /// # Examples
    ///
    /// ```
    /// use std::sync::Arc;
    /// use throttlebeam_supervisors::{Counters, Registry, SlotEntry};
    ///
    /// let registry = Registry::<u32, u32>::new(Arc::new(Counters::new()), usize::MAX);
    /// for key in 0..4 {
    ///     registry.update(&key, |slot| {
    ///         if let SlotEntry::Vacant(vacant) = slot {
    ///             vacant.insert(key * 10).unwrap();
    ///         }
    ///     });
    /// }
    /// assert_eq!(registry.count(|state| *state >= 20), 2);
    /// assert_eq!(registry.len(), 4);
    /// ```
    pub fn count(&self, mut pred: impl FnMut(&S) -> bool) -> usize {
        self.map
            .iter()
            .filter(|slot| pred(&slot.value().state))
            .count()
    }

    /// Runs `f` on the key's live slot, if any, without creating one.
    pub fn with_slot<Q, R>(&self, key: &Q, f: impl FnOnce(&mut Slot<S, G>) -> R) -> Option<R>
    where
        K: Borrow<Q>,
        Q: Hash + Eq + ?Sized,
    {
        self.map.get_mut(key).map(|mut slot| f(&mut slot))
    }

    /// [`Registry::retain`] for a caller the key cap just refused, whose
    /// registry may be full of slots that are over but not swept yet (a
    /// task that never yields keeps the sweeper from running). Returns
    /// whether a pass ran (then try again).
    ///
    /// A pass visits every key, so it is paced by what the last one freed.
    /// One that freed at least a quarter of the keys paid for itself (each
    /// key it freed serves a caller), so the next may run as soon as the
    /// cap is hit again. One that freed less backs off for 10 ms or 20
    /// times its own duration, whichever is longer: a registry full of live
    /// keys costs refused callers at most 5 % of their time in passes. A
    /// caller refused while a pass runs waits for it; one refused in the
    /// millisecond a pass ended is told to try again without a pass of its
    /// own. One that finds room made since it was refused (by another
    /// caller's pass, or keys removed) is told to try again without a pass:
    /// a pass then would free little, and hold back the next refused
    /// caller for nothing.
    ///
    /// # Examples
    ///
    /// ```
    /// use std::sync::Arc;
    /// use throttlebeam_supervisors::{Counters, Registry, SlotEntry};
    ///
    /// let registry = Registry::<u32, bool>::new(Arc::new(Counters::new()), 2);
    /// let add = |key, live| {
    ///     registry.update(&key, |slot| match slot {
    ///         SlotEntry::Vacant(vacant) => vacant.insert(live).is_ok(),
    ///         SlotEntry::Occupied(_) => true,
    ///     })
    /// };
    /// assert!(add(1, false) && add(2, true));
    /// assert!(!add(3, true), "full");
    /// assert!(registry.retain_when_full(|_, live| *live));
    /// assert!(add(3, true), "the slot that was over made room");
    /// assert!(!add(4, true), "full of live keys");
    /// ```
    pub fn retain_when_full(&self, keep: impl FnMut(&K, &mut S) -> bool) -> bool {
        if self.has_room() {
            return true;
        }
        let pass = &self.shared.full_pass;
        let now = Instant::now();
        let at = pass.ms(now);
        if at < pass.next_ms.load(Ordering::Relaxed) {
            return false;
        }
        let seen = pass.passes.load(Ordering::Acquire);
        let _running = pass
            .running
            .lock()
            .unwrap_or_else(std::sync::PoisonError::into_inner);
        let passes = pass.passes.load(Ordering::Acquire);
        if passes != seen || (passes > 0 && pass.end_ms.load(Ordering::Relaxed) >= at) {
            // A pass ended while this caller waited for it, or since it was
            // refused (within this millisecond): try again rather than pass
            // over keys that one has just swept.
            return true;
        }
        if self.has_room() {
            return true;
        }
        if at < pass.next_ms.load(Ordering::Relaxed) {
            return false;
        }
        let mut done = PassDone {
            pass,
            at,
            pause: Duration::from_millis(10),
        };
        let before = self.len();
        let freed = before.saturating_sub(self.retain(keep));
        done.pause = if freed.saturating_mul(4) >= before && freed > 0 {
            Duration::ZERO
        } else {
            (now.elapsed() * 20).max(done.pause)
        };
        true
    }

    /// Whether the [`Counters`] shared by this registry count fewer keys
    /// than its cap.
    fn has_room(&self) -> bool {
        self.shared.counters.keys() < self.shared.cap
    }

    /// Keeps only the slots for which `keep` returns true; returns the keys
    /// left. Counts stay exact even if `keep` panics.
    ///
    /// # Examples
    ///
    /// ```
    /// use std::sync::Arc;
    /// use throttlebeam_supervisors::{Counters, Registry, SlotEntry};
    ///
    /// let counters = Arc::new(Counters::new());
    /// let registry = Registry::<u32, u32>::new(counters.clone(), usize::MAX);
    /// for key in 0..4 {
    ///     registry.update(&key, |slot| {
    ///         if let SlotEntry::Vacant(vacant) = slot {
    ///             vacant.insert(key * 10).unwrap();
    ///         }
    ///     });
    /// }
    /// assert_eq!(registry.retain(|_, state| *state >= 20), 2);
    /// assert_eq!(counters.keys(), 2);
    /// ```
    pub fn retain(&self, mut keep: impl FnMut(&K, &mut S) -> bool) -> usize {
        // Counts what was removed even if `keep` panics halfway.
        let mut removed = Forget {
            registry: self,
            n: 0,
        };
        self.map.retain(|key, slot| {
            let kept = keep(key, &mut slot.state);
            removed.n += usize::from(!kept);
            kept
        });
        let swept = removed.n > 0;
        drop(removed);
        if swept {
            self.release_capacity();
        }
        self.len()
    }

    /// Releases capacity the registry retains beyond what its slots need,
    /// as after a flood of keys that has been swept.
    pub fn shrink_to_fit(&self) {
        self.map.shrink_to_fit();
    }

    /// Gives retained capacity back once the map holds under a quarter of
    /// what it could (as governor's `shrink_to_fit`): after a flood of keys
    /// has been swept, an idle registry costs what it holds, not its peak.
    pub fn release_capacity(&self) {
        if self.map.capacity() > 4 * self.len().max(SHRINK_FLOOR) {
            self.map.shrink_to_fit();
        }
    }

    /// Slots the map can hold without growing (its memory, in slots).
    pub fn capacity(&self) -> usize {
        self.map.capacity()
    }

    /// Removes every slot, returning keys and states. A key inserted while
    /// the drain runs may stay.
    pub fn drain(&self) -> Vec<(K, S)> {
        let keys: Vec<K> = self.map.iter().map(|e| e.key().clone()).collect();
        let mut out = Vec::with_capacity(keys.len());
        for key in keys {
            if let Some((key, slot)) = self.map.remove(&key) {
                self.forget(1);
                out.push((key, slot.state));
            }
        }
        self.release_capacity();
        out
    }
}

impl<K: Eq + Hash + Clone, S> Registry<K, S> {
    /// Compare-and-remove: removes the slot only if it is still incarnation
    /// `generation` and `pred` holds, returning its state.
    ///
    /// A process exiting on idle calls this; if it fails, a caller arrived
    /// (or the slot was replaced) and the process must stay or leave
    /// without touching the slot.
    pub fn remove_if<Q>(
        &self,
        key: &Q,
        generation: Generation,
        pred: impl FnOnce(&S) -> bool,
    ) -> Option<S>
    where
        K: Borrow<Q>,
        Q: Hash + Eq + ?Sized,
    {
        // Uncount under the shard lock, as `insert` counts, so the count
        // never runs ahead of the map for one key.
        let (_, slot) = self.map.remove_if(key, |_, slot| {
            let remove = slot.stamp == generation && pred(&slot.state);
            if remove {
                self.forget(1);
            }
            remove
        })?;
        Some(slot.state)
    }
}

impl<K, S, G> Registry<K, S, G> {
    fn forget(&self, n: usize) {
        if n > 0 {
            self.shared.len.fetch_sub(n, Ordering::AcqRel);
            self.shared.counters.keys_removed(n);
        }
    }
}

impl<K, S, G> Drop for Registry<K, S, G> {
    fn drop(&mut self) {
        // Keys of a dropped registry must not keep holding the shared cap.
        let n = *self.shared.len.get_mut();
        if n > 0 {
            self.shared.counters.keys_removed(n);
        }
    }
}

/// Forgets `n` removed slots when dropped, on every exit path.
struct Forget<'a, K, S, G> {
    registry: &'a Registry<K, S, G>,
    n: usize,
}

impl<K, S, G> Drop for Forget<'_, K, S, G> {
    fn drop(&mut self) {
        self.registry.forget(self.n);
    }
}

impl<K, S, G> std::fmt::Debug for VacantSlot<'_, K, S, G> {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("VacantSlot").finish_non_exhaustive()
    }
}

impl<K: Eq + Hash, S, G: std::fmt::Debug> std::fmt::Debug for SlotGuard<'_, K, S, G> {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("SlotGuard")
            .field("stamp", &self.stamp)
            .finish_non_exhaustive()
    }
}

impl<K, S, G> std::fmt::Debug for Registry<K, S, G> {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Registry")
            .field("len", &self.shared.len.load(Ordering::Relaxed))
            .field("cap", &self.shared.cap)
            .finish_non_exhaustive()
    }
}
