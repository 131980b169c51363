//! [`RuntimeStore`]: the store a runtime shares through, for limiters built from the runtime,
//! so that a runtime still connecting to Redis in the background never leaves them in memory.

use std::future::Future;
use std::time::Duration;

use crate::rate_limit::{
    AsyncRateLimitStore, FirstKeyHook, FixedWindow, Gcra, LeakyBucket, LimiterBuilder,
    MemoryRateLimitStore, RateLimitError, RateLimitReply, RateLimitRequest, RateLimitStore,
    ScriptedStrategy, SlidingWindow, StoredOverride, Strategy, Tiered, TokenBucket,
};
use crate::runtime::{Backend, Runtime};
use crate::store::{Redis, StoreError};

/// What a check gets while the runtime's Redis has not connected yet.
#[derive(Debug, thiserror::Error)]
#[error("redis is not connected yet (unreachable at start; connecting in the background)")]
struct NotConnected;

/// The store of a [`Runtime`]'s rate limits: its Redis when the runtime is configured with
/// one (`with_redis`, `with_redis_connecting`, or `with_redis_from_env` with a URL in the
/// environment), connected or still connecting; memory when it has none. Built by
/// [`LimiterBuilder::with_runtime_store`] (or [`RuntimeStore::of`]).
///
/// It follows the runtime's connection: while a connection made in the background is not up,
/// every call fails as during an outage, with [`RateLimitError::Store`] whose source says
/// Redis is not connected yet (an `Enforcer` applies its `FailMode`); from the moment it is
/// up, every call goes to Redis. Never does a limiter built from a runtime configured with
/// Redis decide in memory, per instance.
///
/// # Examples
///
/// ```
/// # #[tokio::main(flavor = "current_thread")]
/// # async fn main() -> Result<(), Box<dyn std::error::Error>> {
/// use std::time::Duration;
/// use throttlebeam::Runtime;
/// use throttlebeam::rate_limit::{Gcra, Limiter};
///
/// // With `.with_redis_from_env()` and a URL in the environment, every instance shares it.
/// let runtime = Runtime::start().await?;
/// let limiter = Limiter::builder(Gcra::new(100, Duration::from_secs(60))?)
///     .with_runtime_store(&runtime)
///     .build();
/// assert!(!limiter.store().is_shared(), "no Redis configured: in memory");
/// assert_eq!(limiter.check_async("k").await?.remaining, 99);
/// # Ok(()) }
/// ```
pub struct RuntimeStore<T> {
    /// The runtime's Redis, connected or connecting; `None`: memory.
    redis: Option<Backend>,
    memory: MemoryRateLimitStore<T>,
}

impl<T> std::fmt::Debug for RuntimeStore<T> {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("RuntimeStore")
            .field("shared", &self.is_shared())
            .field("connected", &self.connected().is_some())
            .finish_non_exhaustive()
    }
}

impl<T> RuntimeStore<T> {
    /// The store `runtime` shares through (see [`RuntimeStore`]).
    #[must_use]
    pub fn of(runtime: &Runtime) -> Self {
        Self {
            redis: runtime.core.backend().cloned(),
            memory: MemoryRateLimitStore::new(),
        }
    }

    /// Whether the runtime is configured with Redis: limits are shared once it is connected.
    #[must_use]
    pub fn is_shared(&self) -> bool {
        self.redis.is_some()
    }

    /// The runtime's Redis, once connected (starting a connection attempt if none runs).
    fn connected(&self) -> Option<&Redis> {
        self.redis.as_ref().and_then(Backend::get)
    }

    /// The Redis to call: connected, or the error a call gets until it is.
    fn redis_for(&self, key: &str) -> Result<&Redis, RateLimitError> {
        self.connected()
            .ok_or_else(|| RateLimitError::store(key, StoreError::unavailable(NotConnected)))
    }
}

impl<S: Strategy, St> LimiterBuilder<S, St> {
    /// Keeps state where `runtime` shares it: in its Redis when it is configured with one,
    /// following its connection (see [`RuntimeStore`]), in memory otherwise. The way to build
    /// a limiter from a runtime that connects to Redis in the background
    /// (`with_redis_connecting`, `with_redis_from_env`): `Runtime::redis()` is `None` until the
    /// connection is up, and a limiter built on that `None` would stay in memory for good.
    pub fn with_runtime_store(self, runtime: &Runtime) -> LimiterBuilder<S, RuntimeStore<S::State>>
    where
        RuntimeStore<S::State>: AsyncRateLimitStore<S>,
    {
        self.with_store(RuntimeStore::of(runtime))
    }
}

/// Every call goes to the Redis store, once connected; in memory without one. One impl per
/// strategy type, as for [`Redis`] (see there).
macro_rules! runtime_store_body {
    ($strategy:ty) => {
        fn apply_async(
            &self,
            request: RateLimitRequest<'_, $strategy>,
        ) -> impl Future<Output = Result<RateLimitReply, RateLimitError>> + Send {
            async move {
                if self.redis.is_none() {
                    return RateLimitStore::apply(&self.memory, request);
                }
                let redis = self.redis_for(request.key)?;
                AsyncRateLimitStore::apply_async(redis, request).await
            }
        }

        /// `None`: Redis bounds every call by its command timeout, and memory answers at once.
        fn call_timeout(&self) -> Option<Duration> {
            None
        }

        fn keys(&self) -> Option<usize> {
            self.redis.is_none().then(|| self.memory.len())
        }

        fn evictions(&self) -> u64 {
            if self.redis.is_none() {
                self.memory.evictions()
            } else {
                0
            }
        }

        fn sweep(&self, now_us: u64) -> usize {
            if self.redis.is_none() {
                self.memory.sweep(now_us)
            } else {
                0
            }
        }

        fn wake_on_first_key(&self, wake: FirstKeyHook) -> bool {
            self.redis.is_none()
                && RateLimitStore::<$strategy>::wake_on_first_key(&self.memory, wake)
        }

        fn local_answers(&self) -> u64 {
            self.connected()
                .map_or(0, AsyncRateLimitStore::<$strategy>::local_answers)
        }

        fn limits_changed(&self, key: &str) {
            if let Some(redis) = self.connected() {
                AsyncRateLimitStore::<$strategy>::limits_changed(redis, key);
            }
        }

        fn shares_overrides(&self) -> bool {
            self.redis.is_some()
        }

        fn write_override(
            &self,
            namespace: &str,
            key: &str,
            strategy: Option<&$strategy>,
            ttl: Option<Duration>,
        ) -> impl Future<Output = Result<(), RateLimitError>> + Send {
            async move {
                let redis = self.redis_for(key)?;
                AsyncRateLimitStore::write_override(redis, namespace, key, strategy, ttl).await
            }
        }

        fn read_overrides(
            &self,
            namespace: &str,
        ) -> impl Future<Output = Result<Vec<StoredOverride<$strategy>>, RateLimitError>> + Send {
            async move {
                let redis = self.redis_for(namespace)?;
                AsyncRateLimitStore::<$strategy>::read_overrides(redis, namespace).await
            }
        }

        fn overrides_version(&self) -> u64 {
            self.connected()
                .map_or(0, AsyncRateLimitStore::<$strategy>::overrides_version)
        }
    };
}

macro_rules! runtime_store {
    ($($strategy:ty),+ $(,)?) => {$(
        /// Redis once connected, memory without it (see [`RuntimeStore`]).
        impl AsyncRateLimitStore<$strategy> for RuntimeStore<<$strategy as Strategy>::State> {
            runtime_store_body!($strategy);
        }
    )+};
}

runtime_store!(Gcra, TokenBucket, FixedWindow, SlidingWindow, LeakyBucket);

/// Every tier charged or none (see [`RuntimeStore`]).
impl<A: ScriptedStrategy, B: ScriptedStrategy> AsyncRateLimitStore<Tiered<A, B>>
    for RuntimeStore<<Tiered<A, B> as Strategy>::State>
{
    runtime_store_body!(Tiered<A, B>);
}
