//! The in-memory store: a sharded map with TTLs and a key bound whose eviction never grants
//! capacity.

use std::num::NonZeroUsize;
use std::sync::atomic::{AtomicU64, AtomicUsize, Ordering};
use std::sync::{Mutex, PoisonError, RwLock};

use dashmap::DashMap;
use dashmap::mapref::entry::Entry;

use super::{FirstKeyHook, RateLimitRequest, RateLimitStore};
use crate::key::InlineKey;
use crate::rate_limit::RateLimitError;
use crate::rate_limit::strategy::{
    RateLimitOp, RateLimitReply, StateUpdate, Strategy, TIME_CEILING_US,
};

/// Default bound on the number of keys: one million.
pub const DEFAULT_LIMITER_MAX_KEYS: usize = 1_000_000;
/// Default shard count: enough that two threads rarely meet on one shard lock.
const DEFAULT_SHARDS: usize = 64;
/// When full and nothing is at rest, evict this fraction of `max_keys` (at least one key).
const EVICT_FRACTION: usize = 64;
/// At most one warning about evicting limited keys per this many seconds.
const WARN_EVERY_SECS: u32 = 60;

/// A key's state with its bookkeeping in whole seconds, so a GCRA entry (key and slot) stays
/// at 56 bytes and a read that changes nothing writes nothing.
#[derive(Debug, Clone, Copy)]
struct Slot<S> {
    state: S,
    /// Epoch second (rounded up) from which `state` is equivalent to no state (at rest).
    /// Keeping a state up to a second longer is harmless: the strategy treats it as no state.
    expires_at: u32,
    /// Epoch second (rounded up) until which a cost-1 request is denied: the key is limited.
    limited_until: u32,
    /// Epoch second of the last request, for least-recently-used eviction.
    used_at: u32,
}

/// Microseconds per second.
const US_PER_SEC: u64 = 1_000_000;

/// The epoch second of `us`, with time standing still at the strategies' ceiling (in 2096,
/// below `u32::MAX` seconds, so a key's expiry can always lie after now).
#[inline]
fn secs(us: u64) -> u32 {
    u32::try_from(us.min(TIME_CEILING_US) / US_PER_SEC).unwrap_or(u32::MAX)
}

/// `us` as an epoch second, rounded up.
#[inline]
fn secs_up(us: u64) -> u32 {
    u32::try_from(us.div_ceil(US_PER_SEC)).unwrap_or(u32::MAX)
}

/// An in-memory [`RateLimitStore`]: a sharded hash map (one short write lock per request),
/// bounded by `max_keys` (default [`DEFAULT_LIMITER_MAX_KEYS`], one million), whose entries
/// expire when their strategy is full again. An entry holds its key inline up to 22 bytes
/// (longer keys add a heap allocation) and takes 56 bytes of table space for GCRA, so the
/// default bound is about 60–120 MB of table for GCRA keys, depending on the table's load.
///
/// Expired entries (keys at rest: their state is that of a fresh key) read as absent and are
/// dropped by [`MemoryRateLimitStore::sweep`] (see `Limiter::sweep_on` and
/// `Limiter::spawn_sweeper`), which also gives retained capacity back once most of the map is
/// gone.
///
/// **Eviction never grants capacity.** When a new key arrives and the store holds
/// `max_keys`, it drops the keys at rest first; if there are none, it evicts the least
/// recently used 1/64 of `max_keys` among keys that still have capacity left (forgetting
/// them hands back at most what they had). A key that is currently limited is evicted only
/// when every key is limited; those evictions are counted
/// ([`MemoryRateLimitStore::limited_evictions`]) and logged at warn, at most once a minute.
/// Concurrent inserts can overshoot the bound by the number of threads inserting at that
/// moment.
///
/// # Examples
///
/// ```
/// use std::num::NonZeroUsize;
/// use throttlebeam::rate_limit::{GcraState, MemoryRateLimitStore};
///
/// let store: MemoryRateLimitStore<GcraState> =
///     MemoryRateLimitStore::new().with_max_keys(NonZeroUsize::new(100).unwrap());
/// assert_eq!(store.len(), 0);
/// ```
#[derive(Debug)]
pub struct MemoryRateLimitStore<S> {
    map: DashMap<InlineKey, Slot<S>, ahash::RandomState>,
    len: AtomicUsize,
    max_keys: usize,
    evicting: Mutex<()>,
    evictions: AtomicU64,
    limited_evictions: AtomicU64,
    warned_at: AtomicU64,
    wake: Wake,
}

/// The hook called when the store stops being empty (a sweeper's kick), if any.
#[derive(Default)]
struct Wake(RwLock<Option<FirstKeyHook>>);

impl Wake {
    #[cold]
    fn call(&self) {
        let hook = self
            .0
            .read()
            .unwrap_or_else(PoisonError::into_inner)
            .clone();
        if let Some(hook) = hook {
            hook();
        }
    }

    fn set(&self, hook: FirstKeyHook) {
        *self.0.write().unwrap_or_else(PoisonError::into_inner) = Some(hook);
    }
}

impl std::fmt::Debug for Wake {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        let set = self.0.read().is_ok_and(|hook| hook.is_some());
        f.debug_tuple("Wake").field(&set).finish()
    }
}

impl<S> Default for MemoryRateLimitStore<S> {
    fn default() -> Self {
        Self::new()
    }
}

impl<S> MemoryRateLimitStore<S> {
    /// An empty store bounded to [`DEFAULT_LIMITER_MAX_KEYS`] keys.
    #[must_use]
    pub fn new() -> Self {
        Self {
            map: DashMap::with_hasher_and_shard_amount(ahash::RandomState::new(), DEFAULT_SHARDS),
            len: AtomicUsize::new(0),
            max_keys: DEFAULT_LIMITER_MAX_KEYS,
            evicting: Mutex::new(()),
            evictions: AtomicU64::new(0),
            limited_evictions: AtomicU64::new(0),
            warned_at: AtomicU64::new(u64::MAX),
            wake: Wake::default(),
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

    /// The bound on the number of keys.
    #[must_use]
    pub fn max_keys(&self) -> usize {
        self.max_keys
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

    /// Keys evicted to make room before they were at rest (limited ones included).
    #[must_use]
    pub fn evictions(&self) -> u64 {
        self.evictions.load(Ordering::Relaxed)
    }

    /// Keys evicted while they were limited, because every key was: each one could then be
    /// admitted early. Zero unless the store is too small for its traffic.
    #[must_use]
    pub fn limited_evictions(&self) -> u64 {
        self.limited_evictions.load(Ordering::Relaxed)
    }

    /// Drops every entry at rest at `now_us` (epoch µs, expired); returns how many. Gives the map's
    /// retained capacity back once it is mostly empty.
    pub fn sweep(&self, now_us: u64) -> usize {
        let now = secs(now_us);
        let mut removed = 0;
        self.map.retain(|_, slot| {
            let live = slot.expires_at > now;
            removed += usize::from(!live);
            live
        });
        self.len.fetch_sub(removed, Ordering::Relaxed);
        if removed > 0 && self.map.len().saturating_mul(4) < self.map.capacity() {
            self.map.shrink_to_fit();
        }
        removed
    }

    /// Makes room for one more key: keys at rest first, then the least recently used of those
    /// with capacity left, and limited keys only when nothing else is left.
    #[cold]
    fn make_room(&self, now_us: u64) {
        // One thread evicts; the others insert meanwhile (a bounded overshoot).
        let Ok(_guard) = self.evicting.try_lock() else {
            return;
        };
        if self.len() < self.max_keys || self.sweep(now_us) > 0 {
            return;
        }
        let now = secs(now_us);
        let batch = (self.max_keys / EVICT_FRACTION).max(1);
        let mut ages: Vec<u32> = self
            .map
            .iter()
            .filter(|e| e.limited_until <= now)
            .map(|e| e.used_at)
            .collect();
        let limited = ages.is_empty();
        if limited {
            ages = self.map.iter().map(|e| e.used_at).collect();
        }
        if ages.is_empty() {
            return;
        }
        let nth = batch.min(ages.len()) - 1;
        let (_, &mut oldest, _) = ages.select_nth_unstable(nth);
        let victim = |s: &Slot<S>| s.used_at <= oldest && (limited || s.limited_until <= now);
        let victims: Vec<InlineKey> = self
            .map
            .iter()
            .filter(|e| victim(e.value()))
            .take(batch)
            .map(|e| e.key().clone())
            .collect();
        let mut evicted = 0;
        for key in victims {
            if self.map.remove_if(&key, |_, s| victim(s)).is_some() {
                evicted += 1;
            }
        }
        self.len.fetch_sub(evicted, Ordering::Relaxed);
        self.evictions.fetch_add(evicted as u64, Ordering::Relaxed);
        if limited {
            self.limited_evictions
                .fetch_add(evicted as u64, Ordering::Relaxed);
            let last = self.warned_at.load(Ordering::Relaxed);
            if last == u64::MAX || u64::from(now) >= last + u64::from(WARN_EVERY_SECS) {
                self.warned_at.store(u64::from(now), Ordering::Relaxed);
                tracing::warn!(
                    evicted,
                    max_keys = self.max_keys,
                    "rate limit store full of limited keys: evicted some, which may admit them early; raise max_keys"
                );
            }
        }
    }
}

/// Applies `update` to a live slot at `now_us`.
#[inline]
fn write<S: Copy>(slot: &mut Slot<S>, now_us: u64, update: StateUpdate<S>) {
    let now = secs(now_us);
    if slot.used_at != now {
        slot.used_at = now;
    }
    if let StateUpdate::Set {
        state,
        ttl_us,
        limited_us,
    } = update
    {
        *slot = Slot {
            state,
            expires_at: secs_up(now_us.saturating_add(ttl_us)),
            limited_until: secs_up(now_us.saturating_add(limited_us)),
            used_at: now,
        };
    }
}

impl<S: Copy + Send + Sync + 'static> MemoryRateLimitStore<S> {
    #[cold]
    fn apply_new<St: Strategy<State = S>>(
        &self,
        request: &RateLimitRequest<'_, St>,
    ) -> Result<RateLimitReply, RateLimitError> {
        let now_us = request.now_us;
        if self.len() >= self.max_keys {
            self.make_room(now_us);
        }
        let mut first = false;
        let result = match self.map.entry(InlineKey::new(request.key)) {
            // Inserted by another thread since our lookup.
            Entry::Occupied(mut e) => run_on(e.get_mut(), request),
            Entry::Vacant(e) => {
                let applied = request
                    .strategy
                    .apply(None, now_us, request.op)
                    .map_err(|err| err.for_key(request.key))?;
                if let StateUpdate::Set {
                    state,
                    ttl_us,
                    limited_us,
                } = applied.update
                {
                    e.insert(Slot {
                        state,
                        expires_at: secs_up(now_us.saturating_add(ttl_us)),
                        limited_until: secs_up(now_us.saturating_add(limited_us)),
                        used_at: secs(now_us),
                    });
                    first = self.len.fetch_add(1, Ordering::Relaxed) == 0;
                }
                Ok(applied.result)
            }
        };
        // Outside the shard lock: the hook is someone else's code.
        if first {
            self.wake.call();
        }
        result
    }
}

/// Runs `request` on a stored slot and writes its update.
#[inline]
fn run_on<S: Copy, St: Strategy<State = S>>(
    slot: &mut Slot<S>,
    request: &RateLimitRequest<'_, St>,
) -> Result<RateLimitReply, RateLimitError> {
    let now_us = request.now_us;
    let current = (slot.expires_at > secs(now_us)).then_some(slot.state);
    let applied = request
        .strategy
        .apply(current, now_us, request.op)
        .map_err(|err| err.for_key(request.key))?;
    write(slot, now_us, applied.update);
    Ok(applied.result)
}

impl<St: Strategy> RateLimitStore<St> for MemoryRateLimitStore<St::State> {
    #[inline]
    fn apply(&self, request: RateLimitRequest<'_, St>) -> Result<RateLimitReply, RateLimitError> {
        if request.op == RateLimitOp::Reset {
            if self.map.remove(request.key.as_bytes()).is_some() {
                self.len.fetch_sub(1, Ordering::Relaxed);
            }
            return Ok(RateLimitReply::Reset);
        }
        // Looked up by bytes: building a `InlineKey` on the stack to compare against measured
        // slower (its byte-wise stores stall the wide loads that hash and compare it).
        if let Some(mut slot) = self.map.get_mut(request.key.as_bytes()) {
            return run_on(&mut slot, &request);
        }
        self.apply_new(&request)
    }

    fn keys(&self) -> Option<usize> {
        Some(self.len())
    }

    fn evictions(&self) -> u64 {
        Self::evictions(self)
    }

    fn sweep(&self, now_us: u64) -> usize {
        Self::sweep(self, now_us)
    }

    fn wake_on_first_key(&self, wake: FirstKeyHook) -> bool {
        self.wake.set(wake);
        true
    }
}

#[cfg(test)]
mod tests {
    use std::num::NonZeroU32;
    use std::time::Duration;

    use super::*;
    use crate::key::INLINE_KEY;
    use crate::rate_limit::{Decision, FixedWindow, FixedWindowState};

    fn check(
        store: &MemoryRateLimitStore<FixedWindowState>,
        w: &FixedWindow,
        key: &str,
        now_ms: u64,
    ) -> Decision {
        let request = RateLimitRequest {
            key,
            now_us: now_ms * 1_000,
            strategy: w,
            op: RateLimitOp::Check {
                cost: NonZeroU32::MIN,
            },
        };
        match store.apply(request).unwrap() {
            RateLimitReply::Decision(d) => d,
            other => panic!("{other:?}"),
        }
    }

    fn window(limit: u32, secs: u64) -> FixedWindow {
        FixedWindow::new(limit, Duration::from_secs(secs)).unwrap()
    }

    #[test]
    fn expired_entries_read_as_absent_and_are_swept() {
        let store = MemoryRateLimitStore::new();
        let w = window(3, 10);
        assert_eq!(check(&store, &w, "a", 0).remaining, 2);
        assert_eq!(check(&store, &w, "a", 9_999).remaining, 1);
        assert_eq!(check(&store, &w, "a", 10_000).remaining, 2);
        assert_eq!(store.sweep(19_999_999), 0);
        assert_eq!(store.sweep(20_000_000), 1);
        assert!(store.is_empty());
    }

    #[test]
    fn a_full_store_drops_keys_at_rest_first() {
        let store = MemoryRateLimitStore::new().with_max_keys(NonZeroUsize::new(2).unwrap());
        let (short, long) = (window(3, 5), window(3, 100));
        check(&store, &short, "short", 0);
        check(&store, &long, "long", 0);
        check(&store, &long, "new", 10_000);
        assert_eq!(store.len(), 2);
        assert_eq!(store.evictions(), 0);
        assert_eq!(check(&store, &long, "long", 10_000).remaining, 1);
    }

    #[test]
    fn a_full_store_evicts_keys_with_capacity_before_limited_ones() {
        let store = MemoryRateLimitStore::new().with_max_keys(NonZeroUsize::new(3).unwrap());
        let (one, many) = (window(1, 3_600), window(10, 3_600));
        // "spent" is the least recently used, but it is limited.
        check(&store, &one, "spent", 0);
        check(&store, &many, "b", 1_000);
        check(&store, &many, "c", 2_000);
        check(&store, &many, "d", 3_000);
        assert_eq!(store.len(), 3);
        assert_eq!(store.evictions(), 1);
        assert!(!check(&store, &one, "spent", 4_000).allowed);
        // b, the least recently used with capacity left, went instead.
        assert_eq!(check(&store, &many, "b", 5_000).remaining, 9);
        assert_eq!(store.limited_evictions(), 0);
    }

    #[test]
    fn limited_keys_go_only_when_nothing_else_is_left_and_are_counted() {
        let store = MemoryRateLimitStore::new().with_max_keys(NonZeroUsize::new(2).unwrap());
        let one = window(1, 3_600);
        check(&store, &one, "a", 0);
        check(&store, &one, "b", 1_000);
        check(&store, &one, "c", 2_000);
        assert_eq!(store.len(), 2);
        assert_eq!((store.evictions(), store.limited_evictions()), (1, 1));
    }

    #[test]
    fn a_gcra_entry_takes_56_bytes() {
        use crate::rate_limit::GcraState;
        assert_eq!(size_of::<(InlineKey, Slot<GcraState>)>(), 56);
    }

    #[test]
    fn a_sweep_gives_retained_capacity_back() {
        let store = MemoryRateLimitStore::new();
        let w = window(3, 1);
        for i in 0..20_000 {
            check(&store, &w, &format!("k{i}"), 0);
        }
        let full = store.map.capacity();
        assert!(full >= 20_000);
        assert_eq!(store.sweep(1_000_000), 20_000);
        assert!(store.map.capacity() < full / 4, "{}", store.map.capacity());
    }

    #[test]
    fn short_and_long_keys_are_told_apart() {
        let store = MemoryRateLimitStore::new();
        let w = window(3, 1);
        let long = "k".repeat(INLINE_KEY + 1);
        let exact = "k".repeat(INLINE_KEY);
        for (key, expected) in [(&long, 2), (&exact, 2), (&long, 1), (&exact, 1)] {
            assert_eq!(check(&store, &w, key, 0).remaining, expected);
        }
        assert!(matches!(InlineKey::new(&long), InlineKey::Heap(_)));
        assert!(matches!(InlineKey::new(&exact), InlineKey::Inline { .. }));
    }

    #[test]
    fn reset_forgets_a_key_and_reads_store_nothing() {
        let store = MemoryRateLimitStore::new();
        let w = window(3, 1);
        let apply = |op| {
            store
                .apply(RateLimitRequest {
                    key: "a",
                    now_us: 0,
                    strategy: &w,
                    op,
                })
                .unwrap()
        };
        apply(RateLimitOp::Peek);
        assert!(store.is_empty());
        check(&store, &w, "a", 0);
        assert_eq!(apply(RateLimitOp::Reset), RateLimitReply::Reset);
        assert!(store.is_empty());
        assert_eq!(check(&store, &w, "a", 0).remaining, 2);
    }
}
