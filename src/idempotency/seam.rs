//! The seam a store shared by several instances implements: the claim
//! protocol (claim, complete, release, renew), each one round trip carrying
//! the owner's [`ClaimToken`].
//!
//! A runtime given such a store (with
//! [`RuntimeBuilder::with_idempotency_store`](crate::runtime::RuntimeBuilder::with_idempotency_store),
//! or [`RuntimeBuilder::with_redis`](crate::runtime::RuntimeBuilder::with_redis), which uses the
//! Redis backend) keeps one execution per key across every instance that
//! shares it. Callers on one instance still join one local claim, so a key
//! costs one claim round trip per instance, not per caller.

use std::future::Future;
use std::pin::Pin;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, Mutex, OnceLock};
use std::task::{Context, Poll};
use std::time::Duration;

use serde::{Deserialize, Serialize};
use throttlebeam_supervisors::{Counters, Sweep, TtlTable, Update};
use tokio::sync::Notify;
use tokio::time::Instant;

use crate::store::StoreError;

/// What an [`IdempotencyStore`] call returns: a boxed future, so the trait
/// stays object safe.
pub type IdempotencyStoreFuture<'a, T> =
    Pin<Box<dyn Future<Output = Result<T, StoreError>> + Send + 'a>>;

/// The token of one claim: unique across processes, so two instances never
/// hold the same token, and a takeover always issues a new one.
///
/// The high 64 bits are random per process, the low 64 bits count the
/// claims of this process.
///
/// # Examples
///
/// ```
/// use throttlebeam::idempotency::ClaimToken;
///
/// let (a, b) = (ClaimToken::new(), ClaimToken::new());
/// assert_ne!(a, b);
/// assert_eq!(ClaimToken::from_bytes(a.to_bytes()), a);
/// assert_eq!(a.to_string().len(), 32);
/// ```
#[derive(Clone, Copy, PartialEq, Eq, Hash, PartialOrd, Ord, Serialize, Deserialize)]
pub struct ClaimToken(u128);

impl ClaimToken {
    /// A token no other claim, in this process or another, has.
    #[must_use]
    pub fn new() -> Self {
        static SEED: OnceLock<u64> = OnceLock::new();
        static NEXT: AtomicU64 = AtomicU64::new(1);
        let seed = *SEED.get_or_init(process_seed);
        let n = NEXT.fetch_add(1, Ordering::Relaxed);
        Self((u128::from(seed) << 64) | u128::from(n))
    }

    /// The token's 16 bytes, big-endian: how a store keeps it.
    #[must_use]
    pub fn to_bytes(self) -> [u8; 16] {
        self.0.to_be_bytes()
    }

    /// The token from its [`ClaimToken::to_bytes`] form.
    #[must_use]
    pub fn from_bytes(bytes: [u8; 16]) -> Self {
        Self(u128::from_be_bytes(bytes))
    }
}

impl Default for ClaimToken {
    fn default() -> Self {
        Self::new()
    }
}

impl std::fmt::Display for ClaimToken {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(f, "{:032x}", self.0)
    }
}

impl std::fmt::Debug for ClaimToken {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(f, "ClaimToken({self})")
    }
}

/// 64 random bits for this process: std's randomly keyed hasher over the
/// process id and the time, so a restarted process (same pid, later time)
/// differs too.
fn process_seed() -> u64 {
    use std::hash::{BuildHasher, Hasher};
    let mut hasher = std::collections::hash_map::RandomState::new().build_hasher();
    hasher.write_u32(std::process::id());
    hasher.write_u128(crate::clock::since_epoch().as_nanos());
    hasher.finish()
}

/// A completed result as a shared store keeps it: the fingerprint digest of
/// the request that produced it, the value's type tag and the value in a
/// versioned envelope: three header bytes, `t`, `b` and the format version,
/// then the value. Version 2, written, is MessagePack with structs as maps
/// (self-describing: every serde form reads back, `serde_json::Value`,
/// untagged and internally tagged enums, `flatten` and
/// `skip_serializing_if` too); version 1, bincode 2 `standard()`, written by
/// 0.2, is still read. A store keeps the bytes as they are.
///
/// A value this build cannot read (another format version, no envelope,
/// over 256 MiB) is refused with [`Error::StoreUnavailable`](crate::Error::StoreUnavailable),
/// whose source is a [`WireError`](crate::store::WireError): fail closed, never
/// misread. The envelope of format version 255 holds no value but why a
/// key's result could not be stored: it replays as
/// [`Error::Unstorable`](crate::Error::Unstorable), and the key does not run
/// again.
///
/// The type tag is the Rust type name of the value. In version 2 a replay
/// as another type decodes the value, and is refused with
/// [`Error::TypeMismatch`](crate::Error::TypeMismatch) only if it does not
/// read as that type, so a type moved or renamed between builds still
/// replays its results. In version 1, which names no fields, another tag is
/// refused before decoding: a type of the same shape would misread.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
#[non_exhaustive]
pub struct StoredResult {
    /// SHA-256 of the request's fingerprint, if it had one.
    pub fingerprint: Option<[u8; 32]>,
    /// The value's type name.
    pub type_tag: String,
    /// The value in its versioned envelope.
    pub value: Vec<u8>,
}

impl StoredResult {
    /// A result from its parts.
    #[must_use]
    pub fn new(fingerprint: Option<[u8; 32]>, type_tag: impl Into<String>, value: Vec<u8>) -> Self {
        Self {
            fingerprint,
            type_tag: type_tag.into(),
            value,
        }
    }
}

/// One claim request: who asks, for which request, for how long.
#[derive(Debug, Clone, Copy)]
#[non_exhaustive]
pub struct ClaimRequest<'a> {
    /// The claimant's token.
    pub token: ClaimToken,
    /// SHA-256 of the request's fingerprint, if it has one.
    pub fingerprint: Option<&'a [u8; 32]>,
    /// How long the claim holds without a renewal.
    pub lease: Duration,
    /// How long the result will be kept: a store may keep its fencing
    /// counter that long.
    pub ttl: Duration,
}

impl<'a> ClaimRequest<'a> {
    /// A request from its parts.
    #[must_use]
    pub fn new(
        token: ClaimToken,
        fingerprint: Option<&'a [u8; 32]>,
        lease: Duration,
        ttl: Duration,
    ) -> Self {
        Self {
            token,
            fingerprint,
            lease,
            ttl,
        }
    }
}

/// What a claim found.
#[derive(Debug, Clone, PartialEq, Eq)]
#[non_exhaustive]
pub enum ClaimReply {
    /// The key is now the claimant's. `fence` grows with every claim of the
    /// key, so it orders this claim after every earlier one.
    Won {
        /// The fencing counter of this claim.
        fence: u64,
    },
    /// Another owner holds the key, for `lease_left` still unless it renews.
    Busy {
        /// Time until the holder's lease lapses.
        lease_left: Duration,
    },
    /// The key completed: replay this.
    Completed(StoredResult),
    /// The key is held or completed under another fingerprint.
    Mismatch,
}

/// A wake-up for one key: resolves when the key's record may have changed
/// (completed or released), or never, for a store that cannot tell; the
/// runtime polls as well, so a missed wake-up only costs latency.
///
/// Created by [`IdempotencyStore::watch`] before the claim it follows, so a
/// change between the claim and the wait is not missed.
pub struct KeyChanged(Pin<Box<dyn Future<Output = ()> + Send>>);

impl KeyChanged {
    /// A wake-up from any future.
    pub fn new(changed: impl Future<Output = ()> + Send + 'static) -> Self {
        Self(Box::pin(changed))
    }

    /// A wake-up that never fires (the runtime's polling decides).
    #[must_use]
    pub fn never() -> Self {
        Self::new(std::future::pending())
    }
}

impl Future for KeyChanged {
    type Output = ();

    fn poll(mut self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<()> {
        self.0.as_mut().poll(cx)
    }
}

impl std::fmt::Debug for KeyChanged {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str("KeyChanged")
    }
}

/// A store of idempotency claims and results shared by several instances.
///
/// Every method is one round trip and atomic on its key. Keys arrive
/// scoped and are at most a few hundred bytes. The rules every
/// implementation keeps (the contract suite in `tests/idempotency_store.rs`
/// checks them on memory, Redis and Redis Cluster):
///
/// - `claim` wins a key that is free or whose holder's lease lapsed, and
///   returns a fencing counter larger than every earlier one of the key; a
///   held key is `Busy`, a completed one `Completed`, either under another
///   fingerprint `Mismatch`;
/// - `renew`, `complete` and `release` act only for the token that holds
///   the key and return `false` otherwise (a late call of an owner that was
///   taken over is refused); `complete` also stores over a record that
///   vanished (its result is still the only one), and answers `true` to the
///   same completion repeated by its owner (a retry of a lost reply);
/// - a completed result lives for its TTL, an in-flight claim for its lease.
///
/// The runtime calls a store through a guard, so a store that hangs, fails
/// or panics costs its callers a typed error, never a hang or an unwind: a
/// panic (while building or polling a call) is [`StoreError::Panicked`]; a
/// claim takes no longer than its caller's wait timeout or its lease, a
/// renewal no longer than a third of the lease (the next one goes out
/// instead), and a completion is retried until it is stored or the claim has
/// certainly lapsed (the last claim or renewal that may have reached the
/// store, plus the lease). A dropped call is simply dropped: a store must
/// not rely on its futures being polled to the end.
///
/// # Examples
///
/// ```
/// use std::time::Duration;
/// use throttlebeam::idempotency::{
///     ClaimReply, ClaimRequest, ClaimToken, IdempotencyStore, MemoryIdempotencyStore, StoredResult,
/// };
///
/// # #[tokio::main(flavor = "current_thread")] async fn main() -> Result<(), throttlebeam::store::StoreError> {
/// let store = MemoryIdempotencyStore::new();
/// let (lease, ttl) = (Duration::from_secs(30), Duration::from_secs(3600));
/// let owner = ClaimToken::new();
/// let ClaimReply::Won { .. } = store.claim("pay:1", ClaimRequest::new(owner, None, lease, ttl)).await? else {
///     unreachable!("a free key is won")
/// };
/// let other = ClaimToken::new();
/// assert!(matches!(
///     store.claim("pay:1", ClaimRequest::new(other, None, lease, ttl)).await?,
///     ClaimReply::Busy { .. }
/// ));
/// let result = StoredResult::new(None, "u32", vec![42]);
/// assert!(!store.complete("pay:1", other, &result, ttl).await?, "not the owner");
/// assert!(store.complete("pay:1", owner, &result, ttl).await?);
/// assert_eq!(
///     store.claim("pay:1", ClaimRequest::new(other, None, lease, ttl)).await?,
///     ClaimReply::Completed(result)
/// );
/// # Ok(()) }
/// ```
pub trait IdempotencyStore: Send + Sync + 'static {
    /// Claims `key` for `request.token`; see the trait docs.
    fn claim<'a>(
        &'a self,
        key: &'a str,
        request: ClaimRequest<'a>,
    ) -> IdempotencyStoreFuture<'a, ClaimReply>;

    /// Stores `result` for `ttl` if `token` holds `key` (or nobody does),
    /// and wakes the key's watchers. The same completion repeated by its
    /// owner after it landed answers `true` again, so an owner whose reply
    /// was lost can retry it.
    fn complete<'a>(
        &'a self,
        key: &'a str,
        token: ClaimToken,
        result: &'a StoredResult,
        ttl: Duration,
    ) -> IdempotencyStoreFuture<'a, bool>;

    /// Frees `key` if `token` holds it in flight, and wakes its watchers.
    fn release<'a>(&'a self, key: &'a str, token: ClaimToken) -> IdempotencyStoreFuture<'a, bool>;

    /// Pushes the lease of `token`'s claim on `key` out to `lease` from now.
    fn renew<'a>(
        &'a self,
        key: &'a str,
        token: ClaimToken,
        lease: Duration,
    ) -> IdempotencyStoreFuture<'a, bool>;

    /// A wake-up for the next change of `key`; [`KeyChanged::never`] by
    /// default (the runtime then polls).
    fn watch(&self, key: &str) -> KeyChanged {
        let _ = key;
        KeyChanged::never()
    }

    /// What kind of store this is, for log lines (`"redis"`, `"postgres"`, …); `"custom"`
    /// by default.
    fn name(&self) -> &'static str {
        "custom"
    }
}

/// What [`MemoryIdempotencyStore`] holds for a key.
#[derive(Debug, Clone)]
enum Held {
    InFlight {
        token: ClaimToken,
        fingerprint: Option<[u8; 32]>,
        /// The claim's fencing counter, answered again to the same claim sent twice.
        fence: u64,
    },
    /// Completed by `token`: the same `complete` repeated by it (its first
    /// reply was lost) is answered `true` again.
    Completed(StoredResult, ClaimToken),
}

impl Held {
    fn fingerprint(&self) -> Option<&[u8; 32]> {
        match self {
            Held::InFlight { fingerprint, .. } => fingerprint.as_ref(),
            Held::Completed(result, _) => result.fingerprint.as_ref(),
        }
    }

    /// Whether `token` holds the key in flight: a lapsed lease still does
    /// until someone else claims the key.
    fn held_by(&self, token: ClaimToken) -> bool {
        matches!(self, Held::InFlight { token: t, .. } if *t == token)
    }
}

/// Default cap on the keys a [`MemoryIdempotencyStore`] holds.
pub const DEFAULT_SHARED_MEMORY_KEYS: usize = 1_000_000;

/// What a completed result held by a [`MemoryIdempotencyStore`] weighs
/// against its byte budget beside its key, type tag and value.
const ENTRY_OVERHEAD: u64 = 200;

/// Evictions are logged at warn at most this often.
const WARN_EVERY: Duration = Duration::from_secs(60);

/// A key's weight against the byte budget: a completed result's bytes, and
/// nothing for a key in flight, which the budget thus never evicts.
fn weigh(key: &Arc<str>, held: &Held) -> u64 {
    match held {
        Held::InFlight { .. } => 0,
        Held::Completed(result, _) => {
            (key.len() + result.type_tag.len() + result.value.len()) as u64 + ENTRY_OVERHEAD
        }
    }
}

/// An in-process [`IdempotencyStore`]: several runtimes in one process
/// given the same store (a clone) deduplicate together.
///
/// A runtime without a shared store keeps its results in its own faster
/// table (typed values, no encoding); this store is for sharing, and for
/// testing a store of your own against the same contract. It holds at most
/// [`DEFAULT_SHARED_MEMORY_KEYS`] keys (expired ones are dropped first);
/// past the cap a claim fails with [`StoreError::Full`]. Its completed
/// results may weigh at most
/// [`DEFAULT_MAX_IDEMPOTENCY_BYTES`](crate::idempotency::DEFAULT_MAX_IDEMPOTENCY_BYTES)
/// together ([`MemoryIdempotencyStore::with_max_bytes`]): past that the
/// oldest are evicted first, an early expiry, counted
/// ([`MemoryIdempotencyStore::evictions`]) and logged at warn at most once
/// a minute. Keys in flight are never evicted.
///
/// Every call costs O(log n) amortised at most, at the cap too: the keys
/// live in a [`TtlTable`] that keeps them in expiry order and its
/// completed results in completion order, so finding what to drop never
/// scans the store.
#[derive(Clone)]
pub struct MemoryIdempotencyStore {
    inner: Arc<MemoryInner>,
}

struct MemoryInner {
    table: TtlTable<Arc<str>, Held>,
    fences: AtomicU64,
    changed: Arc<Notify>,
    cap: usize,
    /// When evictions were last logged.
    warned_at: Mutex<Option<Instant>>,
}

impl Default for MemoryIdempotencyStore {
    fn default() -> Self {
        Self::new()
    }
}

impl std::fmt::Debug for MemoryIdempotencyStore {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("MemoryIdempotencyStore")
            .field("keys", &self.len())
            .field("bytes", &self.bytes())
            .field("cap", &self.inner.cap)
            .field("max_bytes", &self.max_bytes())
            .finish()
    }
}

impl MemoryIdempotencyStore {
    /// An empty store holding at most [`DEFAULT_SHARED_MEMORY_KEYS`] keys.
    #[must_use]
    pub fn new() -> Self {
        Self::with_max_keys(DEFAULT_SHARED_MEMORY_KEYS)
    }

    /// An empty store holding at most `cap` keys (at least 1).
    #[must_use]
    pub fn with_max_keys(cap: usize) -> Self {
        let max_bytes = crate::idempotency::DEFAULT_MAX_IDEMPOTENCY_BYTES as u64;
        Self {
            inner: Arc::new(MemoryInner {
                // Not swept by a runtime: several share it. Expired keys go
                // at the cap, past the budget and in `sweep`.
                table: TtlTable::new(Arc::new(Counters::new()))
                    .with_max_weight(max_bytes, weigh)
                    .with_expiry_order(),
                fences: AtomicU64::new(0),
                changed: Arc::new(Notify::new()),
                cap: cap.max(1),
                warned_at: Mutex::new(None),
            }),
        }
    }

    /// Caps the bytes this store's completed results may weigh together
    /// (default [`DEFAULT_MAX_IDEMPOTENCY_BYTES`](crate::idempotency::DEFAULT_MAX_IDEMPOTENCY_BYTES),
    /// 256 MiB), for it and every clone of it: past the budget the oldest
    /// results are evicted first. A result weighs its key, type tag and
    /// encoded value, plus about 200 bytes for its entry.
    ///
    /// # Examples
    ///
    /// ```
    /// use std::time::Duration;
    /// use throttlebeam::{idempotency::ClaimRequest, idempotency::ClaimToken, idempotency::IdempotencyStore, idempotency::MemoryIdempotencyStore, idempotency::StoredResult};
    ///
    /// # #[tokio::main(flavor = "current_thread")] async fn main() -> Result<(), throttlebeam::store::StoreError> {
    /// let store = MemoryIdempotencyStore::new().with_max_bytes(1_000);
    /// let (lease, ttl) = (Duration::from_secs(30), Duration::from_secs(3600));
    /// for key in ["a", "b"] {
    ///     let owner = ClaimToken::new();
    ///     store.claim(key, ClaimRequest::new(owner, None, lease, ttl)).await?;
    ///     let result = StoredResult::new(None, "bytes", vec![0; 600]);
    ///     assert!(store.complete(key, owner, &result, ttl).await?);
    /// }
    /// assert_eq!((store.len(), store.evictions()), (1, 1), "a was evicted");
    /// # Ok(()) }
    /// ```
    #[must_use]
    pub fn with_max_bytes(self, max_bytes: usize) -> Self {
        self.inner.table.set_max_weight(max_bytes as u64);
        self
    }

    /// The byte budget of completed results.
    #[must_use]
    pub fn max_bytes(&self) -> usize {
        self.inner.table.max_weight().unwrap_or(u64::MAX) as usize
    }

    /// Keys held, expired ones not yet swept included.
    #[must_use]
    pub fn len(&self) -> usize {
        self.inner.table.len()
    }

    /// Whether the store holds no key.
    #[must_use]
    pub fn is_empty(&self) -> bool {
        self.len() == 0
    }

    /// What the completed results held weigh together, in bytes.
    #[must_use]
    pub fn bytes(&self) -> usize {
        self.inner.table.weight() as usize
    }

    /// Completed results evicted by the byte budget before their TTL.
    #[must_use]
    pub fn evictions(&self) -> u64 {
        self.inner.table.evictions()
    }

    /// Drops expired keys; returns how many are left.
    pub fn sweep(&self) -> usize {
        self.inner.table.sweep(Instant::now())
    }

    fn claim_now(&self, key: &str, request: ClaimRequest<'_>) -> Result<ClaimReply, StoreError> {
        let now = Instant::now();
        let claim = |held: Option<(&Held, Duration)>| match held {
            // The same claim sent again (its reply was lost): still the claimant's.
            Some((held @ Held::InFlight { token, fence, .. }, lease_left))
                if !lease_left.is_zero() && *token == request.token =>
            {
                let won = ClaimReply::Won { fence: *fence };
                (Update::Set(held.clone(), request.lease), won)
            }
            Some((held, lease_left)) if !lease_left.is_zero() => {
                let reply = if held.fingerprint() != request.fingerprint {
                    ClaimReply::Mismatch
                } else {
                    match held {
                        Held::InFlight { .. } => ClaimReply::Busy { lease_left },
                        Held::Completed(result, _) => ClaimReply::Completed(result.clone()),
                    }
                };
                (Update::Keep, reply)
            }
            // Free, or lapsed: taken over.
            _ => {
                let fence = self.inner.fences.fetch_add(1, Ordering::Relaxed) + 1;
                let held = Held::InFlight {
                    token: request.token,
                    fingerprint: request.fingerprint.copied(),
                    fence,
                };
                (Update::Set(held, request.lease), ClaimReply::Won { fence })
            }
        };
        let (table, cap) = (&self.inner.table, self.inner.cap);
        let evictions = self.evictions();
        let key: Arc<str> = Arc::from(key);
        let reply = match table.update_within_at(Arc::clone(&key), now, cap, claim) {
            Some(reply) => Ok(reply),
            // A new key at the cap: drop what expired, then try once more.
            None => {
                table.sweep(now);
                table
                    .update_within_at(key, now, cap, claim)
                    .ok_or(StoreError::Full { cap })
            }
        };
        self.evicted_since(evictions, now);
        reply
    }

    /// Logs evictions made since the count was `before` (by the write just
    /// made, mostly) at warn, at most once per [`WARN_EVERY`].
    fn evicted_since(&self, before: u64, now: Instant) {
        let n = self.evictions().saturating_sub(before);
        if n == 0 {
            return;
        }
        {
            let mut warned_at = self
                .inner
                .warned_at
                .lock()
                .unwrap_or_else(std::sync::PoisonError::into_inner);
            if warned_at.is_some_and(|at| now.saturating_duration_since(at) < WARN_EVERY) {
                return;
            }
            *warned_at = Some(now);
        }
        tracing::warn!(
            evicted = n,
            evictions = self.evictions(),
            bytes = self.bytes(),
            max_bytes = self.max_bytes(),
            "idempotency results evicted from a MemoryIdempotencyStore before their ttl: \
             its results reached their byte budget; raise it with \
             MemoryIdempotencyStore::with_max_bytes"
        );
    }
}

/// What a completion did.
enum Completion {
    Stored,
    /// The same completion by the same owner landed before.
    Repeated,
    Refused,
}

impl IdempotencyStore for MemoryIdempotencyStore {
    fn claim<'a>(
        &'a self,
        key: &'a str,
        request: ClaimRequest<'a>,
    ) -> IdempotencyStoreFuture<'a, ClaimReply> {
        Box::pin(std::future::ready(self.claim_now(key, request)))
    }

    fn complete<'a>(
        &'a self,
        key: &'a str,
        token: ClaimToken,
        result: &'a StoredResult,
        ttl: Duration,
    ) -> IdempotencyStoreFuture<'a, bool> {
        let now = Instant::now();
        let evictions = self.evictions();
        let completion = self.inner.table.update_at(Arc::from(key), now, |held| {
            let store = || Update::Set(Held::Completed(result.clone(), token), ttl);
            match held {
                Some((Held::Completed(stored, t), left))
                    if !left.is_zero() && *t == token && stored == result =>
                {
                    (Update::Keep, Completion::Repeated)
                }
                Some((held, _)) if held.held_by(token) => (store(), Completion::Stored),
                // Another claim holds the key, or held it last (its lease lapsed, or it was
                // released): this owner's claim was taken over, and the key may have run
                // again since; its late result is fenced off.
                Some(_) => (Update::Keep, Completion::Refused),
                // No record: this owner's claim lapsed and was dropped, and nobody claimed
                // the key since (a claim would have left its record), so this owner's result
                // is still the only one.
                None => (store(), Completion::Stored),
            }
        });
        // The table evicted past the budget (expired results first) as it stored.
        self.evicted_since(evictions, now);
        let stored = match completion {
            Completion::Stored => {
                self.inner.changed.notify_waiters();
                true
            }
            Completion::Repeated => true,
            Completion::Refused => false,
        };
        Box::pin(std::future::ready(Ok(stored)))
    }

    fn release<'a>(&'a self, key: &'a str, token: ClaimToken) -> IdempotencyStoreFuture<'a, bool> {
        let released =
            self.inner
                .table
                .update_at(Arc::from(key), Instant::now(), |held| match held {
                    // Free at once, but kept (lapsed, with this token) until swept or
                    // dropped at the cap: the fence against a late completion of an
                    // earlier claim of the key.
                    Some((held, _)) if held.held_by(token) => {
                        (Update::Set(held.clone(), Duration::ZERO), true)
                    }
                    _ => (Update::Keep, false),
                });
        if released {
            self.inner.changed.notify_waiters();
        }
        Box::pin(std::future::ready(Ok(released)))
    }

    fn renew<'a>(
        &'a self,
        key: &'a str,
        token: ClaimToken,
        lease: Duration,
    ) -> IdempotencyStoreFuture<'a, bool> {
        let (now, evictions) = (Instant::now(), self.evictions());
        let renewed = self
            .inner
            .table
            .update_at(Arc::from(key), now, |held| match held {
                Some((held, _)) if held.held_by(token) => (Update::Set(held.clone(), lease), true),
                _ => (Update::Keep, false),
            });
        // A budget lowered since the last write evicts at this one.
        self.evicted_since(evictions, now);
        Box::pin(std::future::ready(Ok(renewed)))
    }

    fn name(&self) -> &'static str {
        "memory"
    }

    fn watch(&self, _key: &str) -> KeyChanged {
        // One wake-up for every key: an in-process store changes cheaply,
        // and a woken watcher that finds its key unchanged waits again.
        let mut changed = Box::pin(Arc::clone(&self.inner.changed).notified_owned());
        changed.as_mut().enable();
        KeyChanged::new(changed)
    }
}
