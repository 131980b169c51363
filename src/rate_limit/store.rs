//! Where per-key state lives: the [`RateLimitStore`] seam, which receives plain data (the
//! strategy's parameters and a [`RateLimitOp`]), and the in-memory
//! [`MemoryRateLimitStore`].

mod memory;

use std::future::Future;
use std::num::NonZeroU32;
use std::sync::Arc;
use std::time::Duration;

use serde::Serialize;

pub use memory::{DEFAULT_LIMITER_MAX_KEYS, MemoryRateLimitStore};

use super::strategy::{RateLimitOp, RateLimitReply, Strategy};
use super::{Decision, RateLimitError};

/// What a store calls when it goes from holding no keys to holding one (see
/// [`RateLimitStore::wake_on_first_key`]): a sweeper that went idle starts again.
pub type FirstKeyHook = Arc<dyn Fn() + Send + Sync>;

/// One operation on one key, as plain data: what a store receives.
///
/// A remote store serializes it (the strategy's parameters, tagged by
/// [`Strategy::name`], and the operation) and maps it to one script call that runs the same
/// integer maths; the memory store runs [`Strategy::apply`] on it. A
/// [`Tiered`](super::Tiered) strategy is one request too, so multi-tier all-or-nothing is one
/// store call.
///
/// # Examples
///
/// ```
/// use std::num::NonZeroU32;
/// use std::time::Duration;
/// use throttlebeam::rate_limit::{Gcra, RateLimitOp, RateLimitRequest};
///
/// let gcra = Gcra::new(10, Duration::from_secs(1))?;
/// let request = RateLimitRequest {
///     key: "user:1",
///     now_us: 1_000_000,
///     strategy: &gcra,
///     op: RateLimitOp::Check { cost: NonZeroU32::MIN },
/// };
/// assert_eq!(request.strategy_name(), "gcra");
/// # Ok::<(), throttlebeam::rate_limit::RateLimitError>(())
/// ```
#[derive(Debug, Clone, Copy, Serialize)]
pub struct RateLimitRequest<'a, S> {
    /// The store key (namespace included).
    pub key: &'a str,
    /// The limiter's time, epoch µs. A shared store may use its own clock instead.
    pub now_us: u64,
    /// The strategy's parameters.
    pub strategy: &'a S,
    /// What to do.
    pub op: RateLimitOp,
}

impl<S: Strategy> RateLimitRequest<'_, S> {
    /// The strategy's stable name, e.g. `"gcra"`: which script a remote store runs.
    #[must_use]
    pub fn strategy_name(&self) -> &'static str {
        self.strategy.name()
    }
}

/// Storage for per-key rate-limit state with one primitive, [`RateLimitStore::apply`]: run a
/// [`RateLimitRequest`] atomically with respect to every other request on the same key.
///
/// Adding an algorithm never touches a store that runs [`Strategy::apply`], and adding a
/// backend means implementing `apply`. A remote store (Redis) implements
/// [`AsyncRateLimitStore`] instead and maps each request to one script; the strategies'
/// integer maths let it reproduce every decision bit for bit.
///
/// # Examples
///
/// ```
/// use std::num::NonZeroUsize;
/// use std::time::Duration;
/// use throttlebeam::rate_limit::{FixedWindow, Limiter, MemoryRateLimitStore};
///
/// let store = MemoryRateLimitStore::new().with_max_keys(NonZeroUsize::new(10_000).unwrap());
/// let limiter = Limiter::builder(FixedWindow::new(100, Duration::from_secs(60))?)
///     .with_store(store)
///     .build();
/// assert!(limiter.check("user:1")?.allowed);
/// # Ok::<(), throttlebeam::rate_limit::RateLimitError>(())
/// ```
///
/// A store of your own sees plain data, as a remote one would send it:
///
/// ```
/// use std::sync::Mutex;
/// use std::time::Duration;
/// use throttlebeam::rate_limit::{
///     Gcra, GcraState, Limiter, MemoryRateLimitStore, RateLimitError, RateLimitReply,
///     RateLimitRequest, RateLimitStore,
/// };
///
/// #[derive(Default)]
/// struct Logged {
///     inner: MemoryRateLimitStore<GcraState>,
///     wire: Mutex<Vec<String>>,
/// }
///
/// impl RateLimitStore<Gcra> for Logged {
///     fn apply(&self, request: RateLimitRequest<'_, Gcra>) -> Result<RateLimitReply, RateLimitError> {
///         self.wire.lock().unwrap().push(serde_json::to_string(&request).unwrap());
///         self.inner.apply(request)
///     }
/// }
///
/// let limiter = Limiter::builder(Gcra::new(10, Duration::from_secs(1))?)
///     .with_store(Logged::default())
///     .with_clock(throttlebeam::clock::ManualClock::new(0))
///     .build();
/// limiter.check("user:1")?;
/// assert_eq!(
///     limiter.store().wire.lock().unwrap()[0],
///     r#"{"key":"user:1","now_us":0,"strategy":{"period_us":1000000,"per":10,"tolerance":10000000,"burst":10},"op":{"op":"check","cost":1}}"#
/// );
/// # Ok::<(), RateLimitError>(())
/// ```
pub trait RateLimitStore<S: Strategy>: Send + Sync + 'static {
    /// Runs `request` on its key atomically and stores the resulting state.
    ///
    /// # Errors
    ///
    /// [`RateLimitError::Store`] when the backend fails;
    /// [`RateLimitError::InsufficientCapacity`] for a cost the strategy can never admit.
    fn apply(&self, request: RateLimitRequest<'_, S>) -> Result<RateLimitReply, RateLimitError>;

    /// Spends `cost` units for `key` at `now_us`: what [`RateLimitStore::apply`] does with a
    /// [`RateLimitOp::Check`], returning its [`Decision`]. The default calls `apply`; the
    /// memory store answers by a shorter path to the same decision.
    ///
    /// # Errors
    ///
    /// As [`RateLimitStore::apply`], and [`RateLimitError::Store`] if `apply` replies with
    /// anything but a decision.
    #[inline]
    fn check(
        &self,
        key: &str,
        now_us: u64,
        strategy: &S,
        cost: NonZeroU32,
    ) -> Result<Decision, RateLimitError> {
        let request = RateLimitRequest {
            key,
            now_us,
            strategy,
            op: RateLimitOp::Check { cost },
        };
        match self.apply(request)? {
            RateLimitReply::Decision(d) => Ok(d),
            other => Err(wrong_reply(key, &other)),
        }
    }

    /// The number of keys held, when the store knows it (the memory store does).
    fn keys(&self) -> Option<usize> {
        None
    }

    /// Keys dropped to make room before they were at rest (0 for a store that never evicts).
    fn evictions(&self) -> u64 {
        0
    }

    /// Drops the keys at rest at `now_us` (epoch µs), if the store keeps them (the memory
    /// store does); returns how many.
    fn sweep(&self, _now_us: u64) -> usize {
        0
    }

    /// Asks the store to call `wake` each time it goes from holding no keys to holding one,
    /// so that a sweeper which went idle while the store was empty starts again (see
    /// `Limiter::sweep_on`). A store with keys to sweep calls it and returns `true`; the
    /// default has nothing to sweep and returns `false`. A later `wake` replaces the earlier.
    fn wake_on_first_key(&self, wake: FirstKeyHook) -> bool {
        let _ = wake;
        false
    }
}

/// An override as a store that keeps them for every instance gives it back (see
/// [`AsyncRateLimitStore::read_overrides`]).
#[derive(Debug, Clone, PartialEq, Eq)]
#[non_exhaustive]
pub struct StoredOverride<S> {
    /// The limiter's key (its namespace aside).
    pub key: String,
    /// The strategy that applies to it.
    pub strategy: S,
    /// How long it still applies, as the store reads it when it answers; `None` until it is
    /// removed.
    pub expires_in: Option<Duration>,
}

impl<S> StoredOverride<S> {
    /// An override of `key`, for a store of your own to return.
    pub fn new(key: impl Into<String>, strategy: S, expires_in: Option<Duration>) -> Self {
        Self {
            key: key.into(),
            strategy,
            expires_in,
        }
    }
}

/// How long a [`Limiter`](super::Limiter) waits for one call of an [`AsyncRateLimitStore`]
/// by default (see [`AsyncRateLimitStore::call_timeout`]): 1 s.
pub const DEFAULT_STORE_CALL_TIMEOUT: Duration = Duration::from_secs(1);

/// A store's reply of the wrong kind: the store is broken.
#[cold]
pub(super) fn wrong_reply(key: &str, reply: &RateLimitReply) -> RateLimitError {
    RateLimitError::store(
        key,
        format!("store replied {reply:?} to a request of another kind"),
    )
}

/// The asynchronous form of [`RateLimitStore`], for backends behind a network. Every
/// [`RateLimitStore`] is an `AsyncRateLimitStore` whose futures are ready at once.
///
/// A [`Limiter`](super::Limiter) calls it through the crate's store guard: a call slower
/// than [`call_timeout`](Self::call_timeout) is dropped and a panic while building or
/// polling it is caught; either is a [`RateLimitError::Store`], which an
/// [`Enforcer`](super::Enforcer) turns into its [`FailMode`](super::FailMode), like any
/// store failure. Nothing of a hanging or panicking store reaches the caller.
pub trait AsyncRateLimitStore<S: Strategy>: Send + Sync + 'static {
    /// Like [`RateLimitStore::apply`], awaited.
    ///
    /// # Errors
    ///
    /// As [`RateLimitStore::apply`].
    fn apply_async(
        &self,
        request: RateLimitRequest<'_, S>,
    ) -> impl Future<Output = Result<RateLimitReply, RateLimitError>> + Send;

    /// See [`RateLimitStore::keys`].
    fn keys(&self) -> Option<usize> {
        None
    }

    /// See [`RateLimitStore::evictions`].
    fn evictions(&self) -> u64 {
        0
    }

    /// See [`RateLimitStore::sweep`].
    fn sweep(&self, _now_us: u64) -> usize {
        0
    }

    /// See [`RateLimitStore::wake_on_first_key`].
    fn wake_on_first_key(&self, wake: FirstKeyHook) -> bool {
        let _ = wake;
        false
    }

    /// Checks this store answered by itself, with no round trip to the shared backend it
    /// fronts (Redis: denials answered locally while nothing can admit their key, see
    /// `RedisBuilder::with_local_answers`). Counted per store, so limiters sharing one store
    /// count together; 0 (the default) for a store that never does.
    fn local_answers(&self) -> u64 {
        0
    }

    /// The limits of `key` (a store key, the limiter's namespace included) changed on this
    /// instance: an override was set or removed. A store that answers some checks locally
    /// forgets what it answers for `key` (Redis: here and, through pub/sub, on every other
    /// instance). The default does nothing.
    fn limits_changed(&self, key: &str) {
        let _ = key;
    }

    /// Whether this store keeps per-key overrides for every limiter that shares it (Redis:
    /// every instance). A [`Limiter`](super::Limiter) then keeps its overrides there
    /// ([`write_override`](Self::write_override)) and reads them back
    /// ([`read_overrides`](Self::read_overrides)); otherwise it keeps them itself. Default
    /// `false`.
    fn shares_overrides(&self) -> bool {
        false
    }

    /// Keeps `strategy` as the override of `key` for the limiters of `namespace` (removes it
    /// when `None`), for `ttl` (until removed when `None`), and has every instance forget what
    /// it answers locally for the key. Only called when
    /// [`shares_overrides`](Self::shares_overrides); the default keeps nothing.
    ///
    /// # Errors
    ///
    /// [`RateLimitError::Store`] when the store fails (the override may or may not be kept);
    /// [`RateLimitError::TooLarge`] for a strategy the store cannot hold exactly.
    fn write_override(
        &self,
        namespace: &str,
        key: &str,
        strategy: Option<&S>,
        ttl: Option<Duration>,
    ) -> impl Future<Output = Result<(), RateLimitError>> + Send {
        let _ = (namespace, key, strategy, ttl);
        std::future::ready(Ok(()))
    }

    /// Every override kept for the limiters of `namespace` that still applies. Only called
    /// when [`shares_overrides`](Self::shares_overrides); the default has none.
    ///
    /// # Errors
    ///
    /// [`RateLimitError::Store`] when the store fails.
    fn read_overrides(
        &self,
        namespace: &str,
    ) -> impl Future<Output = Result<Vec<StoredOverride<S>>, RateLimitError>> + Send {
        let _ = namespace;
        std::future::ready(Ok(Vec::new()))
    }

    /// A number that changes whenever an override kept in this store may have changed
    /// elsewhere since it was last read: a notice of a change arrived, or notices may have
    /// been missed (the subscription that carries them was lost). A limiter reads its
    /// overrides again when it changes (besides every so often). The default, for a store
    /// that sends no notices, never changes.
    fn overrides_version(&self) -> u64 {
        0
    }

    /// The longest a [`Limiter`](super::Limiter) waits for one [`apply_async`](Self::apply_async)
    /// before giving up on it with a [`RateLimitError::Store`] (default
    /// [`DEFAULT_STORE_CALL_TIMEOUT`], 1 s). `None` for a store that bounds every call
    /// itself (Redis: its command timeout), so the limiter arms no timer of its own. A call
    /// that answers at its first poll never arms one.
    fn call_timeout(&self) -> Option<Duration> {
        Some(DEFAULT_STORE_CALL_TIMEOUT)
    }
}

impl<S: Strategy, St: RateLimitStore<S>> AsyncRateLimitStore<S> for St {
    fn apply_async(
        &self,
        request: RateLimitRequest<'_, S>,
    ) -> impl Future<Output = Result<RateLimitReply, RateLimitError>> + Send {
        std::future::ready(self.apply(request))
    }

    fn keys(&self) -> Option<usize> {
        RateLimitStore::keys(self)
    }

    fn evictions(&self) -> u64 {
        RateLimitStore::evictions(self)
    }

    fn sweep(&self, now_us: u64) -> usize {
        RateLimitStore::sweep(self, now_us)
    }

    fn wake_on_first_key(&self, wake: FirstKeyHook) -> bool {
        RateLimitStore::wake_on_first_key(self, wake)
    }
}
