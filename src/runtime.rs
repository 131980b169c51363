//! The runtime: registries, supervision tree, sweeper, shutdown and stats.

use std::future::Future;
use std::num::NonZeroUsize;
use std::sync::Arc;
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::time::Duration;

use ractor::ActorCell;
use throttlebeam_supervisors::{Counters, RunHere, StartError, Tree, TreeConfig};
use tokio::time::Instant;

use crate::error::Error;
use crate::key::shown;
use crate::stats::Stats;

#[cfg(feature = "redis")]
mod redis;
mod service;
mod settings;

#[cfg(feature = "redis")]
pub(crate) use self::redis::Backend;
use self::service::Services;
pub(crate) use self::service::{Service, ServiceFuture};
pub(crate) use self::settings::{Setting, Settings};
pub use crate::clock::RuntimeClock;

/// What [`Runtime::shutdown`] does with debounced calls still waiting for
/// their delay.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
#[non_exhaustive]
pub enum ShutdownPolicy {
    /// Run every pending debounced function now (the default: nothing
    /// accepted is lost).
    #[default]
    Flush,
    /// Discard pending debounced functions; their waiters get
    /// [`Error::Discarded`].
    Drop,
}

/// The default cap on keys a runtime tracks at once
/// ([`RuntimeBuilder::with_max_keys`]).
pub const DEFAULT_MAX_KEYS: usize = 1_000_000;

/// Configures and starts a [`Runtime`].
///
/// # Examples
///
/// ```
/// # #[tokio::main(flavor = "current_thread")] async fn main() -> Result<(), throttlebeam::Error> {
/// use std::time::Duration;
/// use throttlebeam::{Runtime, runtime::ShutdownPolicy};
///
/// let runtime = Runtime::builder()
///     .with_sweep_interval(Duration::from_secs(10))
///     .with_max_keys(100_000)
///     .with_shutdown_policy(ShutdownPolicy::Flush)
///     .start()
///     .await?;
/// runtime.shutdown(Duration::from_secs(5)).await;
/// # Ok(()) }
/// ```
#[derive(Debug, Clone)]
#[must_use]
pub struct RuntimeBuilder {
    sweep_interval: Duration,
    max_keys: Option<usize>,
    policy: ShutdownPolicy,
    partitions: Option<usize>,
    clock: RuntimeClock,
    name: Arc<str>,
    /// The primitives' own settings, which the runtime carries for them.
    pub(crate) settings: Settings,
    #[cfg(feature = "redis")]
    redis: Option<RedisChoice>,
}

/// The Redis backend a builder was given.
#[cfg(feature = "redis")]
#[derive(Debug, Clone)]
enum RedisChoice {
    /// Connected already.
    Connected(crate::store::Redis),
    /// To connect in the background.
    Connecting(Box<crate::store::RedisBuilder>),
}

impl Default for RuntimeBuilder {
    fn default() -> Self {
        Self {
            name: Arc::from("throttlebeam"),
            sweep_interval: Duration::from_secs(60),
            max_keys: None,
            policy: ShutdownPolicy::Flush,
            partitions: None,
            clock: RuntimeClock::Auto,
            settings: Settings::default(),
            #[cfg(feature = "redis")]
            redis: None,
        }
    }
}

impl RuntimeBuilder {
    /// How often expired idempotency results and throttle windows are swept
    /// (default 60 s). The sweeper runs only while there is something to sweep.
    pub fn with_sweep_interval(mut self, interval: Duration) -> Self {
        self.sweep_interval = interval;
        self
    }

    /// Caps the keys tracked at once by this runtime's debounce, leading
    /// throttle and idempotency keys in flight (default
    /// [`DEFAULT_MAX_KEYS`]): a call that would track one more fails with
    /// [`Error::TooManyKeys`], so a flood of distinct keys ends in a typed
    /// error, never in running out of memory. An open leading-throttle
    /// window costs about 75 bytes, a key with a live process (a pending
    /// debounce, a running function) under 2 KiB, so the default bounds
    /// them at about 75 MB and 2 GB. Completed idempotency results have
    /// their own cap ([`with_max_idempotency_results`](Self::with_max_idempotency_results)),
    /// and each coalescing throttle its own registry and window store caps.
    pub fn with_max_keys(mut self, max_keys: usize) -> Self {
        self.max_keys = Some(max_keys);
        self
    }

    /// Shares this runtime's throttle windows and idempotency keys with every
    /// other runtime connected to the same Redis (single node or cluster).
    ///
    /// The leading throttle opens its windows there, so one call runs per
    /// window across all instances. A key known closed until T is answered
    /// locally until T, with no round trip; while Redis is unreachable (or
    /// its circuit breaker is open) the throttle decides per instance (fail
    /// open). Idempotency claims and results live there too (unless
    /// [`with_idempotency_store`](Self::with_idempotency_store) names another
    /// store): one execution per key across all instances; while Redis is
    /// unreachable idempotent calls fail with
    /// [`Error::StoreUnavailable`] (fail closed). Debounced calls made with
    /// [`DebounceHandle::across_instances`](crate::DebounceHandle::across_instances)
    /// run once per burst across all instances, falling back to this
    /// instance's own debounce while Redis is unreachable.
    ///
    /// The default runtime picks Redis up from the environment
    /// ([`with_redis_from_env`](Self::with_redis_from_env)).
    #[cfg(feature = "redis")]
    #[cfg_attr(docsrs, doc(cfg(feature = "redis")))]
    pub fn with_redis(mut self, redis: crate::store::Redis) -> Self {
        self.redis = Some(RedisChoice::Connected(redis));
        self
    }

    /// Shares through Redis as [`with_redis`](Self::with_redis) does, but
    /// connects in the background: [`start`](Self::start) neither waits for
    /// Redis nor fails when it is unreachable, and the runtime never
    /// silently stops sharing. Until the connection succeeds, idempotent
    /// calls fail with [`Error::StoreUnavailable`] (fail closed) and
    /// throttles and debounce decide per instance (fail open), exactly as
    /// during an outage; connecting is retried (backing off up to every 2 s,
    /// the first failure logged at warn), and once it succeeds every
    /// primitive shares through Redis. After that, outages are the
    /// backend's business as with [`with_redis`](Self::with_redis).
    ///
    /// The attempts run on the tokio runtime that starts the runtime; if it
    /// ends first, the next call needing Redis starts them again on its own.
    ///
    /// # Examples
    ///
    /// ```
    /// # #[tokio::main(flavor = "current_thread")] async fn main() -> Result<(), throttlebeam::Error> {
    /// use std::time::Duration;
    /// use throttlebeam::{Error, Runtime};
    /// use throttlebeam::store::Redis;
    ///
    /// // Nothing listens there: the runtime starts anyway.
    /// let runtime = Runtime::builder()
    ///     .with_redis_connecting(Redis::builder("redis://127.0.0.1:1"))
    ///     .start()
    ///     .await?;
    /// let (throttle, idempotency) = (runtime.throttle(), runtime.idempotency());
    /// let ran = throttle.call("k", Duration::from_secs(1), || async { Ok::<_, std::io::Error>(()) });
    /// assert!(ran.await?.is_executed(), "throttles decide per instance");
    /// let once = idempotency.run("pay:1", || async { Ok::<_, std::io::Error>(1) });
    /// assert!(matches!(once.await, Err(Error::StoreUnavailable { .. })), "idempotency fails closed");
    /// # Ok(()) }
    /// ```
    #[cfg(feature = "redis")]
    #[cfg_attr(docsrs, doc(cfg(feature = "redis")))]
    pub fn with_redis_connecting(mut self, redis: crate::store::RedisBuilder) -> Self {
        self.redis = Some(RedisChoice::Connecting(Box::new(redis)));
        self
    }

    /// [`with_redis_connecting`](Self::with_redis_connecting) with the Redis
    /// the environment names ([`Redis::from_env`](crate::store::Redis::from_env):
    /// [`REDIS_URL_ENV`](crate::store::REDIS_URL_ENV), one variable for a
    /// node, a cluster or a primary behind Sentinel, over TLS or not, with an
    /// ACL user or not, or [`REDIS_CLUSTER_ENV`](crate::store::REDIS_CLUSTER_ENV);
    /// certificates and credentials from their own variables); the builder
    /// unchanged when neither URL variable is set. What the default runtime
    /// ([`Runtime::global`]) does.
    ///
    /// A configuration the environment gets wrong (a URL that does not
    /// parse, a certificate file that cannot be read) is retried like an
    /// unreachable server, each failure logged: idempotency fails closed
    /// meanwhile.
    #[cfg(feature = "redis")]
    #[cfg_attr(docsrs, doc(cfg(feature = "redis")))]
    pub fn with_redis_from_env(self) -> Self {
        match crate::store::Redis::from_env() {
            Some(redis) => self.with_redis_connecting(redis),
            None => self,
        }
    }

    /// What shutdown does with pending debounced work (default flush).
    pub fn with_shutdown_policy(mut self, policy: ShutdownPolicy) -> Self {
        self.policy = policy;
        self
    }

    /// The clock of throttle windows (default [`RuntimeClock::Auto`]: the
    /// CPU's timestamp counter, or tokio's clock when it is paused at start).
    pub fn with_clock(mut self, clock: RuntimeClock) -> Self {
        self.clock = clock;
        self
    }

    /// The runtime's name, for telling runtimes apart in exported metrics
    /// and logs (default `"throttlebeam"`).
    pub fn with_name(mut self, name: &str) -> Self {
        self.name = Arc::from(name);
        self
    }

    /// Supervisor partitions (default: tokio worker threads).
    pub fn with_partitions(mut self, partitions: NonZeroUsize) -> Self {
        self.partitions = Some(partitions.get());
        self
    }

    /// Starts a standalone runtime.
    ///
    /// # Errors
    ///
    /// [`Error::InvalidConfig`] for a zero sweep interval, a zero key cap or
    /// a zero idempotency results cap or byte budget,
    /// [`Error::Start`] if the supervision tree fails to start.
    pub async fn start(self) -> Result<Runtime, Error> {
        self.spawn(None).await
    }

    /// Starts the runtime linked under a host's ractor supervisor.
    ///
    /// The host receives the runtime's own failure as a supervision event
    /// ([`ractor::SupervisionEvent::ActorFailed`] for [`Runtime::root_actor`]);
    /// a failure inside one key never reaches it.
    ///
    /// # Errors
    ///
    /// As [`RuntimeBuilder::start`].
    pub async fn start_linked(self, host: ActorCell) -> Result<Runtime, Error> {
        self.spawn(Some(host)).await
    }

    async fn spawn(self, host: Option<ActorCell>) -> Result<Runtime, Error> {
        if self.sweep_interval.is_zero() || self.sweep_interval > crate::key::MAX_TIMER {
            return Err(Error::InvalidConfig {
                what: "sweep interval",
                reason: "must be between 1 ns and 2^36 - 1 ms",
            });
        }
        self.settings.check()?;
        if self.max_keys == Some(0) {
            return Err(Error::InvalidConfig {
                what: "max keys",
                reason: "must be greater than zero",
            });
        }
        if tokio::runtime::Handle::try_current().is_err() {
            return Err(Error::NoTokio);
        }
        let mut config = TreeConfig::default().with_sweep_interval(self.sweep_interval);
        if let Some(partitions) = self.partitions {
            config = config.with_partitions(partitions);
        }
        #[cfg(feature = "redis")]
        let redis = self.redis.map(|choice| match choice {
            RedisChoice::Connected(redis) => Backend::connected(redis),
            RedisChoice::Connecting(builder) => Backend::connecting(*builder),
        });
        let counters = Arc::new(Counters::new());
        // The tree counts in counters of its own: what it counts there is the sweeper's tick,
        // reported apart from the primitives' timers (`Stats::sweeping`).
        let tree = match host {
            Some(host) => Tree::start_linked(config, Arc::new(Counters::new()), host).await,
            None => Tree::start(config, Arc::new(Counters::new())).await,
        }
        .map_err(|e| Error::Start(Arc::new(e)))?;
        let core = Arc::new(Core {
            router: ahash::RandomState::new(),
            tree,
            counters,
            cap: self.max_keys.unwrap_or(DEFAULT_MAX_KEYS),
            policy: self.policy,
            clock: self.clock,
            name: self.name,
            settings: self.settings,
            #[cfg(feature = "redis")]
            redis,
            #[cfg(feature = "redis")]
            warned_not_connected: AtomicBool::new(false),
            closed: AtomicBool::new(false),
            restarts: AtomicU64::new(0),
            services: Services::default(),
        });
        // A backend to connect starts connecting now, on this tokio runtime.
        #[cfg(feature = "redis")]
        if let Some(redis) = &core.redis {
            redis.kick();
        }
        Ok(Runtime { core })
    }
}

/// The runtime proper, shared by every handle. It knows no primitive: each
/// one keeps its state in a [`Service`] created on first use
/// ([`Core::service`]) or attached per instance ([`Core::attach`]).
pub(crate) struct Core {
    /// Hashes keys to supervisor partitions.
    router: ahash::RandomState,
    pub(crate) tree: Tree,
    pub(crate) counters: Arc<Counters>,
    pub(crate) cap: usize,
    pub(crate) policy: ShutdownPolicy,
    /// The clock choice for services that keep windows on it.
    pub(crate) clock: RuntimeClock,
    /// The name metrics and logs know the runtime by.
    name: Arc<str>,
    /// The primitives' own settings (see [`Settings`]).
    pub(crate) settings: Settings,
    /// The shared store every primitive of this runtime agrees through
    /// (see [`Core::redis`]).
    #[cfg(feature = "redis")]
    redis: Option<Backend>,
    /// Whether [`Runtime::redis`] warned that the background connection is not up.
    #[cfg(feature = "redis")]
    warned_not_connected: AtomicBool,
    closed: AtomicBool,
    restarts: AtomicU64,
    services: Services,
}

impl Core {
    #[inline]
    pub(crate) fn is_closed(&self) -> bool {
        self.closed.load(Ordering::Acquire)
    }

    /// Fails with [`Error::ShutDown`] once shutdown began, and with
    /// [`Error::RuntimeDown`] while the root is down awaiting a restart.
    #[inline]
    pub(crate) fn check_open(&self, key: &str) -> Result<(), Error> {
        if self.is_closed() {
            return Err(Error::ShutDown { key: shown(key) });
        }
        if self.tree.is_known_down() {
            return Err(Error::RuntimeDown { key: shown(key) });
        }
        Ok(())
    }

    /// The Redis backend every primitive of this runtime agrees through,
    /// once connected: `None` without one, and while a backend given to
    /// connect in the background has not connected yet (then primitives
    /// decide as during an outage).
    #[cfg(feature = "redis")]
    #[inline]
    pub(crate) fn redis(&self) -> Option<&crate::store::Redis> {
        self.redis.as_ref().and_then(Backend::get)
    }

    /// The Redis backend, connected or not.
    #[cfg(feature = "redis")]
    pub(crate) fn backend(&self) -> Option<&Backend> {
        self.redis.as_ref()
    }

    /// This runtime's instance of service `S`, created by `make` on first use.
    pub(crate) fn service<S: Service>(&self, make: impl FnOnce(&Core) -> S) -> Arc<S> {
        self.services.get_or_insert(|| make(self))
    }

    /// Attaches a service with a life of its own (one per instance of a
    /// primitive, such as a trailing throttle): told about shutdown,
    /// restarts and stats while it lives, forgotten once dropped.
    pub(crate) fn attach(&self, service: std::sync::Weak<dyn Service>) {
        self.services.attach(service);
    }

    /// Runs `work` in the caller's task as a supervised child of `key`'s
    /// partition; dropped before it ends, the rest moves into a process of
    /// its own (see [`throttlebeam_supervisors::Supervisor::run_here`]).
    pub(crate) fn run_here<F>(&self, key: &str, work: F) -> Result<RunHere<F::Output>, Error>
    where
        F: Future + Send + 'static,
        F::Output: Send + 'static,
    {
        self.run_here_boxed(key, Box::pin(work))
    }

    /// [`Core::run_here`] for work boxed where it is built (a large run's future is then not
    /// copied again on its way in).
    pub(crate) fn run_here_boxed<O: Send + 'static>(
        &self,
        key: &str,
        work: std::pin::Pin<Box<dyn Future<Output = O> + Send>>,
    ) -> Result<RunHere<O>, Error> {
        self.tree
            .supervisor()
            .run_here_boxed(self.router.hash_one(key), work)
            .map_err(|e| start_error(key, e))
    }

    /// Starts a per-key process under the partitioned supervisor; the key
    /// picks the partition.
    pub(crate) fn start_process<F>(&self, key: &str, process: F) -> Result<(), Error>
    where
        F: Future<Output = ()> + Send + 'static,
    {
        self.tree
            .supervisor()
            .start_child(self.router.hash_one(key), process)
            .map_err(|e| start_error(key, e))
    }
}

/// Why `key`'s process could not start, as the caller's error.
fn start_error(key: &str, error: StartError) -> Error {
    match error {
        StartError::NoRuntime => Error::NoTokio,
        _ => Error::ShutDown { key: shown(key) },
    }
}

/// What [`Runtime::shutdown`] left behind.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
#[non_exhaustive]
pub struct ShutdownReport {
    /// Per-key processes still running at the deadline. They are never
    /// cancelled; their callers still get their results.
    pub still_running: usize,
}

/// An actor-per-key runtime: the home of debounce timers, throttle windows and
/// idempotency leases.
///
/// `Runtime` is a cheap handle (`Clone`). Most programs use the default
/// runtime through [`crate::Debounce`], [`crate::Throttle`] and
/// [`crate::Idempotency`]; tests and hosts that want no globals build their
/// own with [`Runtime::builder`] and use [`Runtime::debounce`],
/// [`Runtime::throttle`] and [`Runtime::idempotency`].
///
/// # Examples
///
/// ```
/// # #[tokio::main(flavor = "current_thread")] async fn main() -> Result<(), throttlebeam::Error> {
/// use std::time::Duration;
/// use throttlebeam::Runtime;
///
/// let runtime = Runtime::start().await?;
/// let outcome = runtime
///     .throttle()
///     .call("report:7", Duration::from_secs(1), || async { Ok::<_, std::io::Error>(42) })
///     .await?;
/// assert_eq!(outcome.executed(), Some(42));
/// runtime.shutdown(Duration::from_secs(1)).await;
/// # Ok(()) }
/// ```
#[derive(Clone)]
pub struct Runtime {
    pub(crate) core: Arc<Core>,
}

impl std::fmt::Debug for Runtime {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Runtime")
            .field("name", &self.core.name)
            .field("stats", &self.stats())
            .field("closed", &self.core.is_closed())
            .finish_non_exhaustive()
    }
}

impl Runtime {
    /// A builder with the defaults.
    pub fn builder() -> RuntimeBuilder {
        RuntimeBuilder::default()
    }

    /// Starts a runtime with the defaults.
    ///
    /// # Errors
    ///
    /// As [`RuntimeBuilder::start`].
    pub async fn start() -> Result<Self, Error> {
        Self::builder().start().await
    }

    /// Live figures: the runtime's own and each primitive's.
    #[must_use]
    pub fn stats(&self) -> Stats {
        let tree = self.core.tree.snapshot();
        let counters = &self.core.counters;
        let mut stats = Stats {
            keys: counters.keys(),
            processes: tree.processes,
            timers: counters.timers(),
            sweeping: tree.timers > 0,
            ttl_entries: counters.ttl_entries(),
            down: self.core.tree.is_down(),
            restarts: self.core.restarts.load(Ordering::Relaxed),
            ..Stats::default()
        };
        // Each primitive adds its figures, and takes out of `keys` the windows it still holds
        // that are over (kept until the sweep, or the key's next call).
        for service in self.core.services.all() {
            service.stats(&mut stats);
        }
        stats
    }

    /// The Redis this runtime shares through ([`RuntimeBuilder::with_redis`],
    /// [`RuntimeBuilder::with_redis_from_env`]), if any and connected: a cheap clone of the
    /// connection. `None` while a connection made in the background
    /// ([`RuntimeBuilder::with_redis_connecting`], `with_redis_from_env`) is not up yet, so
    /// a rate limiter built from it must not pick its store by this: build it with
    /// `LimiterBuilder::with_runtime_store(&runtime)`, which follows the connection (and
    /// keeps state in memory only for a runtime with no Redis at all). Called while such a
    /// connection is not up, it logs a warning saying so, once per runtime.
    #[cfg(feature = "redis")]
    #[cfg_attr(docsrs, doc(cfg(feature = "redis")))]
    #[must_use]
    pub fn redis(&self) -> Option<crate::store::Redis> {
        let redis = self.core.redis().cloned();
        if redis.is_none()
            && self.core.backend().is_some()
            && !self.core.warned_not_connected.swap(true, Ordering::Relaxed)
        {
            tracing::warn!(
                runtime = %self.core.name,
                "Runtime::redis() is None: the runtime still connects to Redis in the \
                 background. A rate limiter or layer that picks its store by it keeps its \
                 state in memory, per instance, for good; build it with \
                 LimiterBuilder::with_runtime_store(&runtime), which follows the connection"
            );
        }
        redis
    }

    /// The cap on tracked keys ([`RuntimeBuilder::with_max_keys`]).
    #[must_use]
    pub fn max_keys(&self) -> usize {
        self.core.cap
    }

    /// The root actor of the runtime's supervision tree, as a host's
    /// supervisor sees it in supervision events.
    #[must_use]
    pub fn root_actor(&self) -> ActorCell {
        self.core.tree.root()
    }

    /// Whether [`Runtime::shutdown`] has begun.
    #[must_use]
    pub fn is_shut_down(&self) -> bool {
        self.core.is_closed()
    }

    /// Whether the runtime's root actor has failed (or was killed) and the
    /// runtime waits for [`Runtime::restart`]. Meanwhile every call fails at
    /// once with [`Error::RuntimeDown`] and nothing is swept.
    #[must_use]
    pub fn is_down(&self) -> bool {
        self.core.tree.is_down()
    }

    /// Restarts a runtime whose root actor failed, OTP-style: a fresh root
    /// with its sweeper and supervisor partitions, linked under the same
    /// host supervisor as before (if any). Every handle to this runtime
    /// (clones of it, [`crate::DebounceHandle`], [`crate::ThrottleHandle`],
    /// trailing throttles, ...) works again afterwards.
    ///
    /// State the old root's processes held is gone, as after an expiry:
    /// pending debounced runs are discarded (their waiters get
    /// [`Error::Discarded`]) and throttle windows are forgotten. Functions
    /// still running finish; their callers get their results. Idempotency
    /// loses nothing: keys in flight stay held by their runs (a retry waits
    /// for the run and replays its result, never runs it again) and stored
    /// results are still replayed.
    ///
    /// Returns whether a restart happened: `false` while the root is alive,
    /// and for a runtime that was shut down (it stays shut down). Meant to
    /// be called from the host's supervision handler on the root's
    /// `ActorFailed` or `ActorTerminated` event.
    ///
    /// # Errors
    ///
    /// [`Error::Start`] when the new root fails to start (for example the
    /// host is stopping); the runtime stays down and may be restarted again.
    ///
    /// # Examples
    ///
    /// ```
    /// # #[tokio::main(flavor = "current_thread")] async fn main() -> Result<(), throttlebeam::Error> {
    /// use std::time::Duration;
    /// use throttlebeam::{Error, Runtime};
    ///
    /// let runtime = Runtime::start().await?;
    /// let throttle = runtime.throttle();
    /// runtime.root_actor().kill(); // what a failing root looks like
    /// while !runtime.is_down() {
    ///     tokio::task::yield_now().await;
    /// }
    /// let call = throttle.call("k", Duration::from_secs(1), || async { Ok::<_, std::io::Error>(()) });
    /// assert!(matches!(call.await, Err(Error::RuntimeDown { .. })));
    ///
    /// assert!(runtime.restart().await?);
    /// let call = throttle.call("k", Duration::from_secs(1), || async { Ok::<_, std::io::Error>(()) });
    /// assert!(call.await?.is_executed());
    /// # Ok(()) }
    /// ```
    pub async fn restart(&self) -> Result<bool, Error> {
        if !self.core.tree.is_down() {
            return Ok(false);
        }
        // Forget state first: while down no call is accepted, so nothing
        // new can land between the reset and the restart.
        for service in self.core.services.all() {
            service.reset();
        }
        let restarted = self
            .core
            .tree
            .restart()
            .await
            .map_err(|e| Error::Start(Arc::new(e)))?;
        if restarted {
            self.core.restarts.fetch_add(1, Ordering::Relaxed);
        }
        Ok(restarted)
    }

    /// Publishes [`Runtime::stats`] through the [`metrics`](https://docs.rs/metrics)
    /// facade, to whatever recorder the host installed (Prometheus,
    /// StatsD, ...). Call it periodically or before each scrape: it reads
    /// the counters the hot paths keep anyway, so a runtime pays nothing for
    /// metrics between exports. Every metric carries the label
    /// `runtime` = [`RuntimeBuilder::with_name`] (default `"throttlebeam"`).
    ///
    /// | metric | kind | what |
    /// |---|---|---|
    /// | `throttlebeam_keys` | gauge | keys tracked, every primitive |
    /// | `throttlebeam_processes` | gauge | per-key processes alive |
    /// | `throttlebeam_timers` | gauge | timers armed for keys (the sweeper's tick apart) |
    /// | `throttlebeam_sweeping` | gauge | 1 while the sweeper's tick is armed |
    /// | `throttlebeam_ttl_entries` | gauge | entries in TTL tables |
    /// | `throttlebeam_down` | gauge | 1 while the root is down |
    /// | `throttlebeam_restarts_total` | counter | restarts after a failed root |
    /// | `throttlebeam_debounce_keys`, `throttlebeam_debounce_capacity` | gauge | [`crate::debounce::DebounceStats`] |
    /// | `throttlebeam_debounce_{calls,runs,coalesced,cancelled,flushed,failed}_total` | counter | [`crate::debounce::DebounceStats`] |
    /// | `throttlebeam_throttle_windows`, `throttlebeam_throttle_capacity` | gauge | [`crate::throttle::ThrottleStats`] |
    /// | `throttlebeam_throttle_{executed,throttled,throttled_remotely,store_errors}_total` | counter | [`crate::throttle::ThrottleStats`] |
    /// | `throttlebeam_idempotency_stored_results`, `throttlebeam_idempotency_stored_bytes` | gauge | [`crate::idempotency::IdempotencyStats`] |
    /// | `throttlebeam_idempotency_{fresh,replays,fingerprint_mismatches,takeovers,in_flight_rejections,timeouts,evictions}_total` | counter | [`crate::idempotency::IdempotencyStats`] |
    /// | `throttlebeam_coalesce_{active,pending,keys,store_keys}` | gauge | [`crate::coalesce::CoalesceStats`], every coalescing throttle added up |
    /// | `throttlebeam_coalesce_{calls,leading_runs,trailing_runs,coalesced,store_errors,evictions}_total` | counter | [`crate::coalesce::CoalesceStats`] |
    /// | `throttlebeam_http_{replays,fresh,in_flight,reused,too_large,invalid,rate_limited,store_failures,no_peer}_total` | counter | `http::HttpStats` (feature `http`): the HTTP layers counting in this runtime |
    /// | `throttlebeam_redis_breaker_state` | gauge | the Redis backend's breaker (feature `redis`): 0 closed, 1 open, 2 half open |
    /// | `throttlebeam_redis_breaker_consecutive_failures`, `throttlebeam_redis_local_answer_keys` | gauge | `store::RedisStats` |
    /// | `throttlebeam_redis_{commands,local_answers,fresh_key_writes,fresh_key_misses,script_reloads,reconnects,failovers,subscriptions,notices,notices_lost}_total` | counter | `store::RedisStats`: round trips, rate-limit checks answered locally, fresh keys' checks written with a plain `SET NX` and tries that found the key taken, `NOSCRIPT` reloads, reconnections (restarts, failovers followed), primaries Sentinel named and followed, pub/sub, notices the server refused to publish |
    /// | `throttlebeam_redis_breaker_{opened,probes,recoveries,refused,failures}_total` | counter | `store::BreakerStats`: the breaker's transitions and what it refused |
    ///
    /// # Examples
    ///
    /// ```
    /// # #[tokio::main(flavor = "current_thread")] async fn main() -> Result<(), throttlebeam::Error> {
    /// use throttlebeam::Runtime;
    ///
    /// let runtime = Runtime::builder().with_name("api").start().await?;
    /// // With a recorder installed (metrics-exporter-prometheus, ...):
    /// runtime.export_metrics();
    /// # Ok(()) }
    /// ```
    #[cfg(feature = "metrics")]
    pub fn export_metrics(&self) {
        self.stats().export(&self.core.name);
        #[cfg(feature = "redis")]
        if let Some(redis) = self.core.redis() {
            redis.stats().export(&self.core.name);
        }
    }

    /// Sweeps every expiring map of the runtime now (throttle windows,
    /// idempotency results, whatever a primitive registered with the
    /// runtime's sweeper), instead of waiting for the next periodic sweep,
    /// and gives back memory a flood left behind. Returns the entries left.
    pub fn sweep_now(&self) -> usize {
        self.core.tree.sweeper().sweep_now()
    }

    /// Shuts down gracefully within `grace`.
    ///
    /// Stops accepting calls ([`Error::ShutDown`]), runs or discards pending
    /// debounced work according to the [`ShutdownPolicy`], lets coalescing
    /// throttles drain, waits for running functions until the deadline
    /// (never cancelling them), then stops the supervision tree and drops
    /// what the primitives still track (throttle windows, stored results).
    /// Returns by the deadline whatever is pending: the work it does per key
    /// is constant and runs beside it, not before it. Calling it again is
    /// harmless.
    pub async fn shutdown(&self, grace: Duration) -> ShutdownReport {
        let deadline = Instant::now()
            .checked_add(grace)
            .unwrap_or_else(|| Instant::now() + crate::key::MAX_TIMER);
        self.core.closed.store(true, Ordering::Release);
        let services = self.core.services.all();
        for service in &services {
            service.shutdown(deadline, self.core.policy).await;
        }
        let still_running = self.core.tree.shutdown(deadline).await;
        for service in &services {
            service.stopped();
        }
        #[cfg(feature = "redis")]
        if let Some(redis) = &self.core.redis {
            redis.close();
        }
        ShutdownReport { still_running }
    }
}
