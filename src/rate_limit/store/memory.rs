//! The in-memory store: a sharded map with TTLs and a key bound whose eviction forgets first
//! the keys that forgetting hands back least.

mod table;

use std::num::{NonZeroU32, NonZeroUsize};
use std::sync::atomic::{AtomicU64, AtomicUsize, Ordering};
use std::sync::{Mutex, PoisonError, RwLock};

use self::table::Table;
use super::{FirstKeyHook, RateLimitRequest, RateLimitStore, wrong_reply};
use crate::rate_limit::strategy::{
    InsufficientCapacity, RateLimitOp, RateLimitReply, StateUpdate, Strategy, TIME_CEILING_US,
};
use crate::rate_limit::{Decision, RateLimitError};

/// Default bound on the number of keys: one million.
pub const DEFAULT_LIMITER_MAX_KEYS: usize = 1_000_000;
/// A round of eviction forgets this fraction of `max_keys` (at least one key) besides the keys
/// at rest, so that its visit of every key is paid for by that many inserts.
const EVICT_FRACTION: usize = 64;
/// At most one warning about evicting limited keys per this many seconds.
const WARN_EVERY_SECS: u32 = 60;

/// A key's state with its rest time, so a GCRA entry (key and slot) takes 48 bytes and a
/// request that changes nothing writes nothing. What eviction needs (how much a key holds
/// back) is read from the state when it runs, not kept up to date on every request.
#[derive(Debug, Clone, Copy)]
struct Slot<S> {
    state: S,
    /// The epoch µs from which `state` is at rest under the limits that wrote it: from then
    /// on it reads as no state, whatever limits read it (an override may read it with others;
    /// the Redis store keeps the same instant in the state it stores, so both agree).
    rest_us: u64,
}

/// `now_us` as the strategies read it: time stands still at their ceiling (in 2096).
#[inline]
fn clamped(now_us: u64) -> u64 {
    now_us.min(TIME_CEILING_US)
}

/// The rest time of a state written at `now_us` that lives `ttl_us`.
#[inline]
fn rest_at(now_us: u64, ttl_us: u64) -> u64 {
    clamped(now_us).saturating_add(ttl_us)
}

/// The slot's state if it is not at rest at `now_us`.
#[inline]
fn live<S: Copy>(slot: &Slot<S>, now_us: u64) -> Option<S> {
    (slot.rest_us > clamped(now_us)).then_some(slot.state)
}

/// An in-memory [`RateLimitStore`]: a sharded hash map (one short write lock per request),
/// bounded by `max_keys` (default [`DEFAULT_LIMITER_MAX_KEYS`], one million), whose entries
/// expire when their strategy is full again. An entry holds its key inline up to 22 bytes
/// (longer keys add a heap allocation) and takes 48 bytes of table space for GCRA, so the
/// default bound is about 55–110 MB of table for GCRA keys, depending on the table's load.
///
/// Expired entries (keys at rest: their state is that of a fresh key) read as absent and are
/// dropped by [`MemoryRateLimitStore::sweep`] (see `Limiter::sweep_on` and
/// `Limiter::spawn_sweeper`), which also gives retained capacity back once most of the map is
/// gone.
///
/// **Eviction hands back as little as it can.** Forgetting a key hands back what it has spent
/// (its next request finds it full), so when a new key arrives and the store holds
/// `max_keys`, it forgets keys in the order of what that would hand back at that instant,
/// least first: keys at rest (nothing), then those with the fewest units spent and not yet
/// back ([`Strategy::spent`]), and among those the one that comes to rest first; whether a
/// key is limited at that instant does not matter, only what it holds back. So a key that spent 9 of 10 outlasts any number of keys that spent 1.
///
/// Precisely: one round of eviction reads every key once and forgets every key at rest plus
/// up to `max(1, max_keys / 64)` others, the ones that hand back least; it never forgets a key
/// while it keeps one whose forgetting would hand back fewer units at that instant. The batch
/// keeps eviction amortised (about 64 keys read per insert, no scan per insert); its cost is
/// that a round may forget a key whose units the next inserts' keys would not have needed.
/// Units are counted by the strategy of the request that makes room: keys with a per-key
/// override of another quota in the same store are measured by it too. Keys forgotten with
/// nothing left are counted ([`MemoryRateLimitStore::limited_evictions`]) and logged at warn,
/// at most once a minute: they go only when no key holds back less, i.e. the store is too
/// small for its traffic. Concurrent inserts can overshoot the bound by the number of threads
/// inserting at that moment.
///
/// # Examples
///
/// ```
/// use std::num::{NonZeroU32, NonZeroUsize};
/// use throttlebeam::rate_limit::{GcraState, MemoryRateLimitStore};
///
/// let store: MemoryRateLimitStore<GcraState> =
///     MemoryRateLimitStore::new().with_max_keys(NonZeroUsize::new(100).unwrap());
/// assert_eq!(store.len(), 0);
/// ```
#[derive(Debug)]
pub struct MemoryRateLimitStore<S> {
    map: Table<Slot<S>>,
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
            map: Table::new(),
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

    /// Keys evicted with nothing left (every unit spent), because no key held back less: each
    /// one could then be admitted early. Zero unless the store is too small for its traffic.
    #[must_use]
    pub fn limited_evictions(&self) -> u64 {
        self.limited_evictions.load(Ordering::Relaxed)
    }

    /// Drops every entry at rest at `now_us` (epoch µs, expired); returns how many. Gives the map's
    /// retained capacity back once it is mostly empty.
    pub fn sweep(&self, now_us: u64) -> usize {
        let now = clamped(now_us);
        let removed = self.map.retain(|slot| slot.rest_us > now);
        self.len.fetch_sub(removed, Ordering::Relaxed);
        if removed > 0 && self.map.len().saturating_mul(4) < self.map.capacity() {
            self.map.shrink_to_fit();
        }
        removed
    }

    /// Makes room for one more key: forgets every key at rest, and the keys whose forgetting
    /// hands back least (as `strategy` counts it at `now_us`) up to a batch.
    #[cold]
    fn make_room<St: Strategy<State = S>>(&self, strategy: &St, now_us: u64)
    where
        S: Copy,
    {
        // One thread evicts; the others insert meanwhile (a bounded overshoot).
        let Ok(_guard) = self.evicting.try_lock() else {
            return;
        };
        if self.len() < self.max_keys {
            return;
        }
        let now = clamped(now_us);
        let limit = strategy.limit();
        // What forgetting a key hands back, as one number ordered as eviction goes: 0 at
        // rest, else the units spent and then the rest time. With the units spent, for
        // counting keys forgotten with nothing left.
        let rank = |slot: &Slot<S>| -> (u128, u64) {
            if slot.rest_us <= now {
                return (0, 0);
            }
            let spent = strategy.spent(Some(slot.state), now_us);
            if spent == 0 {
                return (0, 0);
            }
            ((u128::from(spent) << 64) | u128::from(slot.rest_us), spent)
        };
        // First pass: the batch's threshold. Keys at rest are forgotten for free; the others
        // hand back capacity, so only as many as the batch still needs, least first.
        let batch = (self.max_keys / EVICT_FRACTION).max(1);
        let mut at_rest = 0;
        let mut ranks: Vec<u128> = Vec::new();
        self.map.for_each(|slot| match rank(slot) {
            (0, _) => at_rest += 1,
            (r, _) => ranks.push(r),
        });
        let need = batch.saturating_sub(at_rest).min(ranks.len());
        let (threshold, mut ties) = if need == 0 {
            (0, 0)
        } else {
            let (below, &mut threshold, _) = ranks.select_nth_unstable(need - 1);
            let under = below.iter().filter(|&&r| r < threshold).count();
            (threshold, need - under)
        };
        drop(ranks);
        // Second pass: forget them. A key written meanwhile is ranked again, so one that now
        // holds back more stays.
        let (mut rested, mut evicted, mut limited) = (0usize, 0usize, 0usize);
        self.map.retain(|slot| {
            let (r, spent) = rank(slot);
            let forget = match r {
                0 => {
                    rested += 1;
                    return false;
                }
                r if r < threshold => true,
                r if r == threshold && ties > 0 => {
                    ties -= 1;
                    true
                }
                _ => false,
            };
            if forget {
                evicted += 1;
                limited += usize::from(spent >= limit);
            }
            !forget
        });
        self.len.fetch_sub(rested + evicted, Ordering::Relaxed);
        self.evictions.fetch_add(evicted as u64, Ordering::Relaxed);
        if limited > 0 {
            self.limited_evictions
                .fetch_add(limited as u64, Ordering::Relaxed);
            let last = self.warned_at.load(Ordering::Relaxed);
            let second = now / 1_000_000;
            if last == u64::MAX || second >= last + u64::from(WARN_EVERY_SECS) {
                self.warned_at.store(second, Ordering::Relaxed);
                tracing::warn!(
                    evicted = limited,
                    max_keys = self.max_keys,
                    "rate limit store full of keys with nothing left: forgot some, which admits them early; raise max_keys"
                );
            }
        }
    }
}

/// Applies `update` to a live slot at `now_us`.
#[inline]
fn write<S: Copy>(slot: &mut Slot<S>, now_us: u64, update: StateUpdate<S>) {
    if let StateUpdate::Set { state, ttl_us } = update {
        *slot = Slot {
            state,
            rest_us: rest_at(now_us, ttl_us),
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
            self.make_room(request.strategy, now_us);
        }
        // Inserted by another thread since our lookup: run on it.
        let present = |slot: &mut Slot<S>| run_on(slot, request);
        let absent = || match request.strategy.apply(None, now_us, request.op) {
            Ok(applied) => {
                let slot = match applied.update {
                    StateUpdate::Set { state, ttl_us } => Some(Slot {
                        state,
                        rest_us: rest_at(now_us, ttl_us),
                    }),
                    _ => None,
                };
                (Ok(applied.result), slot)
            }
            Err(err) => (Err(err.for_key(request.key)), None),
        };
        let (result, inserted) = self.map.upsert(request.key, present, absent);
        let first = inserted && self.len.fetch_add(1, Ordering::Relaxed) == 0;
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
    let current = live(slot, now_us);
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
            if self.map.remove(request.key.as_bytes()) {
                self.len.fetch_sub(1, Ordering::Relaxed);
            }
            return Ok(RateLimitReply::Reset);
        }
        // Looked up by bytes: building a `InlineKey` on the stack to compare against measured
        // slower (its byte-wise stores stall the wide loads that hash and compare it).
        let key = request.key.as_bytes();
        if let Some(result) = self.map.with_mut(key, |slot| run_on(slot, &request)) {
            return result;
        }
        self.apply_new(&request)
    }

    #[inline(always)]
    fn check(
        &self,
        key: &str,
        now_us: u64,
        strategy: &St,
        cost: NonZeroU32,
    ) -> Result<Decision, RateLimitError> {
        let found = self.map.with_mut(
            key.as_bytes(),
            #[inline(always)]
            |slot| {
                let current = live(slot, now_us);
                let applied = strategy.check(current, now_us, cost)?;
                write(slot, now_us, applied.update);
                Ok(applied.result)
            },
        );
        if let Some(decided) = found {
            return decided.map_err(|err: InsufficientCapacity| err.for_key(key));
        }
        let request = RateLimitRequest {
            key,
            now_us,
            strategy,
            op: RateLimitOp::Check { cost },
        };
        match self.apply_new(&request)? {
            RateLimitReply::Decision(d) => Ok(d),
            other => Err(wrong_reply(key, &other)),
        }
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
    use crate::key::{INLINE_KEY, InlineKey};
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

    fn check_n(
        store: &MemoryRateLimitStore<FixedWindowState>,
        w: &FixedWindow,
        key: &str,
        now_ms: u64,
        cost: u32,
    ) -> Decision {
        let request = RateLimitRequest {
            key,
            now_us: now_ms * 1_000,
            strategy: w,
            op: RateLimitOp::Check {
                cost: NonZeroU32::new(cost).unwrap(),
            },
        };
        match store.apply(request).unwrap() {
            RateLimitReply::Decision(d) => d,
            other => panic!("{other:?}"),
        }
    }

    #[test]
    fn a_full_store_forgets_the_key_that_hands_back_least_limited_or_not() {
        let store = MemoryRateLimitStore::new().with_max_keys(NonZeroUsize::new(3).unwrap());
        let w = window(10, 3_600);
        // The least recently used key spent most; the limited one spent all.
        assert_eq!(check_n(&store, &w, "nine", 0, 9).remaining, 1);
        assert_eq!(check_n(&store, &w, "all", 1_000, 10).remaining, 0);
        assert_eq!(check_n(&store, &w, "two", 2_000, 2).remaining, 8);
        check_n(&store, &w, "new", 3_000, 3);
        assert_eq!(store.len(), 3);
        assert_eq!(store.evictions(), 1);
        // "two" went: forgetting it handed back 2 units, any other more.
        assert_eq!(check_n(&store, &w, "nine", 4_000, 1).remaining, 0);
        assert!(!check_n(&store, &w, "all", 4_000, 1).allowed);
        assert_eq!(store.limited_evictions(), 0);
        // Now "new" (3 spent) holds back least; "all" (10) most.
        check_n(&store, &w, "newer", 5_000, 4);
        assert!(!check_n(&store, &w, "all", 6_000, 1).allowed);
        assert!(!check_n(&store, &w, "nine", 6_000, 1).allowed);
        assert_eq!(
            check_n(&store, &w, "new", 6_000, 1).remaining,
            9,
            "forgotten"
        );
    }

    #[test]
    fn among_equal_spends_the_key_closest_to_rest_goes_first() {
        let store = MemoryRateLimitStore::new().with_max_keys(NonZeroUsize::new(2).unwrap());
        let (short, long) = (window(10, 10), window(10, 1_000));
        // Both spent 5; "short" is back to full at 10 s, "long" at 1,000 s.
        check_n(&store, &long, "long", 1_000, 5);
        check_n(&store, &short, "short", 2_000, 5);
        check_n(&store, &short, "new", 3_000, 1);
        assert_eq!(store.evictions(), 1);
        assert_eq!(check_n(&store, &long, "long", 4_000, 1).remaining, 4);
    }

    #[test]
    fn a_round_forgets_a_batch_so_eviction_is_amortised() {
        // 6,400 keys: a round forgets 100 (1/64), so the next 99 inserts find room.
        let store = MemoryRateLimitStore::new().with_max_keys(NonZeroUsize::new(6_400).unwrap());
        let w = window(10, 3_600);
        for i in 0..6_400 {
            check(&store, &w, &format!("k{i}"), 0);
        }
        assert_eq!((store.len(), store.evictions()), (6_400, 0));
        check(&store, &w, "new0", 1_000);
        assert_eq!((store.len(), store.evictions()), (6_301, 100));
        for i in 1..100 {
            check(&store, &w, &format!("new{i}"), 1_000);
        }
        assert_eq!((store.len(), store.evictions()), (6_400, 100));
        check(&store, &w, "new100", 1_000);
        assert_eq!((store.len(), store.evictions()), (6_301, 200));
        for i in 101..200 {
            check(&store, &w, &format!("new{i}"), 1_000);
        }
        assert_eq!((store.len(), store.evictions()), (6_400, 200));
        // The keys at rest go for free, however many: no capacity handed back.
        let later = 3_600_000;
        check(&store, &w, "after", later);
        assert_eq!((store.len(), store.evictions()), (1, 200));
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
    fn a_gcra_entry_takes_48_bytes() {
        use crate::rate_limit::GcraState;
        assert_eq!(size_of::<(InlineKey, Slot<GcraState>)>(), 48);
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
