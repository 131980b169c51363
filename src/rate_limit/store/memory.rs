//! The in-memory store: a sharded map with TTLs and a key bound.

use std::num::NonZeroUsize;
use std::sync::Mutex;
use std::sync::atomic::{AtomicUsize, Ordering};

use dashmap::DashMap;
use dashmap::mapref::entry::Entry;

use super::{Store, Transition};
use crate::key::InlineKey;
use crate::rate_limit::RateLimitError;
use crate::rate_limit::strategy::Update;

/// Default bound on the number of keys.
const DEFAULT_MAX_KEYS: usize = 1_000_000;
/// Default shard count: enough that two threads rarely meet on one shard lock.
const DEFAULT_SHARDS: usize = 64;
/// When full and nothing has expired, evict this fraction of `max_keys` (at least one key).
const EVICT_FRACTION: usize = 64;

/// A key's state with its bookkeeping in whole seconds, so a GCRA entry (key and slot) stays
/// at 40 bytes and a read that changes nothing writes nothing.
#[derive(Debug, Clone, Copy)]
struct Slot<S> {
    state: S,
    /// Epoch second (rounded up) from which `state` is equivalent to no state. Keeping a state
    /// up to a second longer is harmless: the strategy treats it as no state.
    expires_at: u32,
    /// Epoch second of the last `apply`, for least-recently-used eviction.
    used_at: u32,
}

/// The epoch second of `ms`, saturating in 2106.
#[inline]
fn secs(ms: u64) -> u32 {
    u32::try_from(ms / 1_000).unwrap_or(u32::MAX)
}

/// `ms` as an epoch second, rounded up.
#[inline]
fn secs_up(ms: u64) -> u32 {
    u32::try_from(ms.div_ceil(1_000)).unwrap_or(u32::MAX)
}

/// An in-memory [`Store`]: a sharded hash map (one short write lock per `apply`), bounded by
/// `max_keys`, whose entries expire when their strategy is full again.
///
/// Expired entries read as absent and are dropped by [`MemoryStore::sweep`] (see
/// `Limiter::spawn_sweeper`). When a new key arrives and the store holds `max_keys`, it first
/// drops every expired entry; if none had expired, it evicts the least recently used
/// 1/64 of `max_keys`. Concurrent inserts can overshoot the bound by the number of threads
/// inserting at that moment.
///
/// # Examples
///
/// ```
/// use std::num::NonZeroUsize;
/// use throttlebeam::rate_limit::{GcraState, MemoryStore};
///
/// let store: MemoryStore<GcraState> = MemoryStore::new().with_max_keys(NonZeroUsize::new(100).unwrap());
/// assert_eq!(store.len(), 0);
/// ```
#[derive(Debug)]
pub struct MemoryStore<S> {
    map: DashMap<InlineKey, Slot<S>, ahash::RandomState>,
    len: AtomicUsize,
    max_keys: usize,
    evicting: Mutex<()>,
}

impl<S> Default for MemoryStore<S> {
    fn default() -> Self {
        Self::new()
    }
}

impl<S> MemoryStore<S> {
    /// An empty store bounded to one million keys.
    #[must_use]
    pub fn new() -> Self {
        Self::with_shards(DEFAULT_SHARDS)
    }

    fn with_shards(shards: usize) -> Self {
        Self {
            map: DashMap::with_hasher_and_shard_amount(ahash::RandomState::new(), shards),
            len: AtomicUsize::new(0),
            max_keys: DEFAULT_MAX_KEYS,
            evicting: Mutex::new(()),
        }
    }

    /// Bounds the store to `max_keys` keys.
    #[must_use]
    pub fn with_max_keys(self, max_keys: NonZeroUsize) -> Self {
        Self {
            max_keys: max_keys.get(),
            ..self
        }
    }

    /// The number of stored keys, expired ones included until swept.
    #[must_use]
    pub fn len(&self) -> usize {
        self.len.load(Ordering::Relaxed)
    }

    /// Whether no key is stored.
    #[must_use]
    pub fn is_empty(&self) -> bool {
        self.len() == 0
    }

    /// Drops every entry expired at `now_ms`; returns how many.
    pub fn sweep(&self, now_ms: u64) -> usize {
        let now = secs(now_ms);
        let mut removed = 0;
        self.map.retain(|_, slot| {
            let live = slot.expires_at > now;
            removed += usize::from(!live);
            live
        });
        self.len.fetch_sub(removed, Ordering::Relaxed);
        removed
    }

    /// Makes room for one more key: expired entries first, else the least recently used.
    #[cold]
    fn make_room(&self, now_ms: u64) {
        // One thread evicts; the others insert meanwhile (a bounded overshoot).
        let Ok(_guard) = self.evicting.try_lock() else {
            return;
        };
        if self.len() < self.max_keys || self.sweep(now_ms) > 0 {
            return;
        }
        let batch = (self.max_keys / EVICT_FRACTION).max(1);
        let mut ages: Vec<u32> = self.map.iter().map(|e| e.used_at).collect();
        if ages.is_empty() {
            return;
        }
        let nth = batch.min(ages.len()) - 1;
        let (_, &mut oldest, _) = ages.select_nth_unstable(nth);
        let victims: Vec<InlineKey> = self
            .map
            .iter()
            .filter(|e| e.used_at <= oldest)
            .take(batch)
            .map(|e| e.key().clone())
            .collect();
        for key in victims {
            if self
                .map
                .remove_if(&key, |_, s| s.used_at <= oldest)
                .is_some()
            {
                self.len.fetch_sub(1, Ordering::Relaxed);
            }
        }
    }
}

/// Runs `transition` on a live slot and writes its update.
#[inline]
fn run_on<S: Copy, T: Transition<S>>(slot: &mut Slot<S>, now_ms: u64, transition: &T) -> T::Output {
    let now = secs(now_ms);
    let current = (slot.expires_at > now).then_some(slot.state);
    let outcome = transition.run(current, now_ms);
    if slot.used_at != now {
        slot.used_at = now;
    }
    if let Update::Set { state, ttl_ms } = outcome.update {
        slot.state = state;
        slot.expires_at = secs_up(now_ms.saturating_add(ttl_ms));
    }
    outcome.result
}

impl<S: Copy + Send + Sync + 'static> MemoryStore<S> {
    #[cold]
    fn apply_new<T: Transition<S>>(&self, key: &str, now_ms: u64, transition: &T) -> T::Output {
        if self.len() >= self.max_keys {
            self.make_room(now_ms);
        }
        match self.map.entry(InlineKey::new(key)) {
            // Inserted by another thread since our lookup.
            Entry::Occupied(mut e) => run_on(e.get_mut(), now_ms, transition),
            Entry::Vacant(e) => {
                let outcome = transition.run(None, now_ms);
                if let Update::Set { state, ttl_ms } = outcome.update {
                    e.insert(Slot {
                        state,
                        expires_at: secs_up(now_ms.saturating_add(ttl_ms)),
                        used_at: secs(now_ms),
                    });
                    self.len.fetch_add(1, Ordering::Relaxed);
                }
                outcome.result
            }
        }
    }
}

impl<S: Copy + Send + Sync + 'static> Store<S> for MemoryStore<S> {
    #[inline]
    fn apply<T: Transition<S>>(
        &self,
        key: &str,
        now_ms: u64,
        transition: &T,
    ) -> Result<T::Output, RateLimitError> {
        // Looked up by bytes: building a `InlineKey` on the stack to compare against measured
        // slower (its byte-wise stores stall the wide loads that hash and compare it).
        let found = self.map.get_mut(key.as_bytes());
        if let Some(mut slot) = found {
            return Ok(run_on(&mut slot, now_ms, transition));
        }
        Ok(self.apply_new(key, now_ms, transition))
    }

    fn remove(&self, key: &str) -> Result<(), RateLimitError> {
        if self.map.remove(key.as_bytes()).is_some() {
            self.len.fetch_sub(1, Ordering::Relaxed);
        }
        Ok(())
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::key::INLINE_KEY;
    use crate::rate_limit::strategy::Outcome;

    /// Adds one to a counter that lives `ttl` ms.
    struct Bump(u64);

    impl Transition<u64> for Bump {
        type Output = u64;
        fn run(&self, state: Option<u64>, _now_ms: u64) -> Outcome<u64, u64> {
            let next = state.unwrap_or(0) + 1;
            Outcome {
                result: next,
                update: Update::Set {
                    state: next,
                    ttl_ms: self.0,
                },
            }
        }
    }

    #[test]
    fn expired_entries_read_as_absent_and_are_swept() {
        let store = MemoryStore::new();
        // Expiry is kept in whole seconds, rounded up: 19_999 ms lives until 20 s.
        assert_eq!(store.apply("a", 0, &Bump(10_000)).unwrap(), 1);
        assert_eq!(store.apply("a", 9_999, &Bump(10_000)).unwrap(), 2);
        assert_eq!(store.apply("a", 19_999, &Bump(10_000)).unwrap(), 3);
        assert_eq!(store.apply("a", 30_000, &Bump(10_500)).unwrap(), 1);
        assert_eq!(store.sweep(40_999), 0);
        assert_eq!(store.sweep(41_000), 1);
        assert!(store.is_empty());
    }

    #[test]
    fn a_full_store_drops_expired_keys_first() {
        let store = MemoryStore::new().with_max_keys(NonZeroUsize::new(2).unwrap());
        store.apply("short", 0, &Bump(5_000)).unwrap();
        store.apply("long", 0, &Bump(100_000)).unwrap();
        store.apply("new", 10_000, &Bump(100_000)).unwrap();
        assert_eq!(store.len(), 2);
        assert_eq!(store.apply("long", 10_000, &Bump(100_000)).unwrap(), 2);
        assert_eq!(store.apply("short", 10_000, &Bump(100_000)).unwrap(), 1);
    }

    #[test]
    fn a_full_store_evicts_the_least_recently_used() {
        let store = MemoryStore::new().with_max_keys(NonZeroUsize::new(3).unwrap());
        // Recency is kept in whole seconds.
        let hour = Bump(3_600_000);
        store.apply("a", 0, &hour).unwrap();
        store.apply("b", 1_000, &hour).unwrap();
        store.apply("c", 2_000, &hour).unwrap();
        store.apply("a", 3_000, &hour).unwrap(); // a is now the most recent
        store.apply("d", 4_000, &hour).unwrap();
        assert_eq!(store.len(), 3);
        // b was the least recently used: it starts over.
        assert_eq!(store.apply("b", 5_000, &hour).unwrap(), 1);
        assert_eq!(store.apply("d", 6_000, &hour).unwrap(), 2);
    }

    #[test]
    fn short_and_long_keys_are_told_apart() {
        let store = MemoryStore::new();
        let long = "k".repeat(INLINE_KEY + 1);
        let exact = "k".repeat(INLINE_KEY);
        for (key, expected) in [(&long, 1), (&exact, 1), (&long, 2), (&exact, 2)] {
            assert_eq!(store.apply(key, 0, &Bump(1_000)).unwrap(), expected);
        }
        assert!(matches!(InlineKey::new(&long), InlineKey::Heap(_)));
        assert!(matches!(InlineKey::new(&exact), InlineKey::Inline { .. }));
        assert_eq!(InlineKey::new(""), InlineKey::new(""));
    }

    #[test]
    fn remove_forgets_a_key() {
        let store = MemoryStore::new();
        store.apply("a", 0, &Bump(1_000)).unwrap();
        store.remove("a").unwrap();
        store.remove("a").unwrap();
        assert!(store.is_empty());
        assert_eq!(store.apply("a", 0, &Bump(1_000)).unwrap(), 1);
    }
}
