//! The Redis backend: one value that talks to a single node or a Redis
//! Cluster, with a key prefix, timeouts and a circuit breaker.

use std::sync::Arc;
use std::sync::atomic::{AtomicU64, Ordering};
use std::time::Duration;

use redis::aio::{ConnectionManager, ConnectionManagerConfig};
use redis::cluster::ClusterClientBuilder;
use redis::cluster_async::ClusterConnection;
use redis::{Cmd, FromRedisValue};
use serde::Serialize;

use self::script::{LuaScript, ScriptCall};
use super::{Breaker, BreakerConfig, BreakerStats, StoreError};

mod claims;
mod debounce;
mod notify;
mod rate_limit;
mod script;
mod server_clock;
mod window;

pub(crate) use self::debounce::{BurstListener, BurstNotice, BurstState, NoticeKind, RUN_LEASE};

/// Environment variable read by [`Redis::from_env`]: the URL of a single
/// Redis node, e.g. `redis://127.0.0.1:6379/0`.
pub const REDIS_URL_ENV: &str = "THROTTLEBEAM_REDIS_URL";

/// Environment variable read by [`Redis::from_env`]: a comma-separated list
/// of Redis Cluster seed nodes, e.g. `redis://10.0.0.1:7000,redis://10.0.0.2:7000`.
/// Takes precedence over [`REDIS_URL_ENV`].
pub const REDIS_CLUSTER_ENV: &str = "THROTTLEBEAM_REDIS_CLUSTER";

const DEFAULT_PREFIX: &str = "throttlebeam";

/// Configures a [`Redis`] backend.
///
/// # Examples
///
/// ```no_run
/// # async fn demo() -> Result<(), throttlebeam::store::StoreError> {
/// use std::time::Duration;
/// use throttlebeam::store::Redis;
///
/// let redis = Redis::builder("redis://127.0.0.1:6379")
///     .with_prefix("billing")
///     .with_command_timeout(Duration::from_millis(250))
///     .connect()
///     .await?;
/// redis.ping().await?;
/// # Ok(()) }
/// ```
#[derive(Debug, Clone)]
#[must_use]
pub struct RedisBuilder {
    nodes: Vec<String>,
    cluster: bool,
    prefix: String,
    connect_timeout: Duration,
    command_timeout: Duration,
    breaker: BreakerConfig,
    /// See `RedisBuilder::with_rate_limit_queue`.
    rate_limit_queue: std::num::NonZeroUsize,
    /// See `RedisBuilder::with_local_answers`.
    local_answers: usize,
}

impl RedisBuilder {
    fn new(nodes: Vec<String>, cluster: bool) -> Self {
        Self {
            nodes,
            cluster,
            prefix: DEFAULT_PREFIX.to_owned(),
            connect_timeout: Duration::from_secs(1),
            command_timeout: Duration::from_millis(500),
            breaker: BreakerConfig::default(),
            rate_limit_queue: rate_limit::DEFAULT_QUEUE,
            local_answers: rate_limit::DEFAULT_LOCAL_ANSWERS,
        }
    }

    /// The namespace of every key (default `throttlebeam`). A logical key
    /// `k` is stored as `{prefix:k}`, the hash tag around the whole key, so
    /// every key of one operation lands in one cluster slot.
    pub fn with_prefix(mut self, prefix: impl Into<String>) -> Self {
        self.prefix = prefix.into();
        self
    }

    /// How long connecting may take (default 1 s).
    pub fn with_connect_timeout(mut self, timeout: Duration) -> Self {
        self.connect_timeout = timeout;
        self
    }

    /// How long one command or script call may take (default 500 ms). No
    /// call waits longer: past it the call fails with
    /// [`StoreError::Timeout`] and counts against the breaker.
    pub fn with_command_timeout(mut self, timeout: Duration) -> Self {
        self.command_timeout = timeout;
        self
    }

    /// The circuit breaker (default: 5 consecutive failures open it for 10 s).
    /// A caller that goes away mid-command is no event for it (a cancelled
    /// probe frees the breaker for the next one).
    pub fn with_breaker(mut self, breaker: BreakerConfig) -> Self {
        self.breaker = breaker;
        self
    }

    fn validate(&self) -> Result<(), StoreError> {
        if self.nodes.is_empty() {
            return Err(StoreError::Config("no Redis node given".to_owned()));
        }
        if self.prefix.is_empty() {
            return Err(StoreError::Config("the key prefix is empty".to_owned()));
        }
        if self.prefix.contains(['{', '}']) {
            return Err(StoreError::Config(format!(
                "the key prefix {:?} contains a brace, which would break its hash tag",
                self.prefix
            )));
        }
        if self.connect_timeout.is_zero() || self.command_timeout.is_zero() {
            return Err(StoreError::Config(
                "connect and command timeouts must be greater than zero".to_owned(),
            ));
        }
        Ok(())
    }

    /// Connects. A single node is reached through a reconnecting connection
    /// manager; a cluster through a cluster client that follows the slot map.
    ///
    /// # Errors
    ///
    /// [`StoreError::Config`] for a bad URL or setting,
    /// [`StoreError::Unavailable`] or [`StoreError::Timeout`] if no node
    /// answered in time.
    pub async fn connect(self) -> Result<Redis, StoreError> {
        self.validate()?;
        let conn = if self.cluster {
            let client = ClusterClientBuilder::new(self.nodes.clone())
                .connection_timeout(self.connect_timeout)
                .response_timeout(self.command_timeout)
                .retries(1)
                .build()
                .map_err(|e| StoreError::Config(e.to_string()))?;
            let connecting = client.get_async_connection();
            let conn = tokio::time::timeout(self.connect_timeout, connecting)
                .await
                .map_err(|_| StoreError::Timeout {
                    after: self.connect_timeout,
                })?
                .map_err(StoreError::unavailable)?;
            Conn::Cluster(conn)
        } else {
            let client = redis::Client::open(self.nodes[0].as_str())
                .map_err(|e| StoreError::Config(e.to_string()))?;
            // No response timeout of its own: every command is already
            // bounded by `command_timeout` (see `Redis::bounded`), and a
            // second timer per command costs throughput.
            let config = ConnectionManagerConfig::new()
                .set_connection_timeout(Some(self.connect_timeout))
                .set_response_timeout(None)
                .set_number_of_retries(1)
                .set_max_delay(Duration::from_millis(200));
            let connecting = ConnectionManager::new_with_config(client, config);
            let conn = tokio::time::timeout(self.connect_timeout, connecting)
                .await
                .map_err(|_| StoreError::Timeout {
                    after: self.connect_timeout,
                })?
                .map_err(StoreError::unavailable)?;
            Conn::Single(conn)
        };
        let redis = Redis {
            inner: Arc::new(Inner {
                conn,
                prefix: self.prefix,
                command_timeout: self.command_timeout,
                breaker: Breaker::new(self.breaker),
                commands: crate::stats::Counter::default(),
                pinned_now: AtomicU64::new(0),
                clock: server_clock::ServerClock::default(),
                nodes: self.nodes,
                waiters: notify::Waiters::default(),
                bursts: debounce::BurstListeners::default(),
                batches: rate_limit::Batcher::new(self.rate_limit_queue, self.local_answers),
                ops: OpsCounters::default(),
            }),
        };
        // Learn the server's clock now; if it does not answer, the first
        // window opened tries again.
        if let Err(error) = redis.sync_clock().await {
            tracing::debug!(%error, "reading the Redis server's TIME failed; trying again later");
        }
        Ok(redis)
    }
}

#[derive(Clone)]
enum Conn {
    Single(ConnectionManager),
    Cluster(ClusterConnection),
}

struct Inner {
    conn: Conn,
    prefix: String,
    command_timeout: Duration,
    breaker: Breaker,
    /// Striped: every command counts, from every worker thread.
    commands: crate::stats::Counter,
    pinned_now: AtomicU64,
    /// The server's clock as estimated here.
    clock: server_clock::ServerClock,
    nodes: Vec<String>,
    waiters: notify::Waiters,
    /// Who hears debounce notices.
    bursts: debounce::BurstListeners,
    /// Rate-limit operations waiting to go out together (single node), and
    /// the denials answered locally.
    batches: rate_limit::Batcher,
    /// Operational counters beside `commands` (see [`RedisStats`]).
    ops: OpsCounters,
}

/// Counters of what happened to the connection and the scripts.
#[derive(Default)]
struct OpsCounters {
    /// Script calls sent again as `EVAL` after `NOSCRIPT`.
    script_reloads: AtomicU64,
    /// A call failed for a lost or refused connection since the last success.
    link_lost: std::sync::atomic::AtomicBool,
    /// Successes that came after such failures: the client reconnected.
    reconnects: AtomicU64,
}

/// A Redis (or Redis Cluster) backend shared by several instances.
///
/// A cheap handle (`Clone`). Every decision made through it is one command
/// or one script call (`EVALSHA`; when the server does not know the script
/// yet, the same call goes again as `EVAL` with the script's text, which
/// leaves it in the server's cache); every call is bounded by the command
/// timeout and guarded by a circuit breaker. While the breaker is open,
/// calls are refused locally, except an idempotency owner's lease renewals
/// and completions: a function that ran must not lose its result to an
/// outage shorter than its lease, so those always go out, as probes (one
/// that succeeds closes the breaker).
///
/// # Rate limiting
///
/// `Redis` is an [`AsyncRateLimitStore`](crate::rate_limit::AsyncRateLimitStore)
/// for every [`ScriptedStrategy`](crate::rate_limit::ScriptedStrategy): GCRA,
/// token bucket, fixed and sliding window, the leaky-bucket shaper, and
/// [`Tiered`](crate::rate_limit::Tiered) combinations of them (all tiers
/// charged or none). Each operation is one call of one Lua script that runs
/// the strategies' integer maths (microseconds, every value below 2^53) on the
/// server's `TIME`, so decisions are bit for bit those of the memory store and
/// every instance shares one limit. A key's state lives at
/// `{prefix:key}:r` and expires once it is at rest (equal to a fresh key). A
/// failure (timeout, connection, breaker open) is
/// [`RateLimitError::Store`](crate::rate_limit::RateLimitError::Store), which
/// an `Enforcer` (feature `http`) turns into its `FailMode`.
///
/// A key the server denied until T is answered on this instance with no
/// round trip until shortly before T (nothing another instance does can admit
/// it sooner); a reset or an override on any instance is announced through
/// pub/sub and ends those answers everywhere, and none are given while the
/// subscription is down. See [`RedisBuilder::with_local_answers`]; they are
/// counted in [`RedisStats::local_answers`].
///
/// The store is implemented for each strategy type, not for every
/// `S: ScriptedStrategy`: such an impl would overlap (E0119) the blanket
/// `impl<S, St: RateLimitStore<S>> AsyncRateLimitStore<S> for St`, since
/// another crate may implement `RateLimitStore<ItsOwnStrategy>` for `Redis`.
/// Generic code therefore bounds on `Redis: AsyncRateLimitStore<S>`.
///
/// ```no_run
/// # async fn demo() -> Result<(), Box<dyn std::error::Error>> {
/// use std::num::NonZeroU32;
/// use throttlebeam::rate_limit::{Gcra, Limiter};
/// use throttlebeam::store::Redis;
///
/// let redis = Redis::builder("redis://127.0.0.1:6379").connect().await?;
/// let limiter = Limiter::builder(Gcra::per_second(NonZeroU32::new(100).unwrap()))
///     .with_store(redis)
///     .with_namespace("api")
///     .build();
/// let decision = limiter.check_async("user:42").await?;
/// println!("{} left", decision.remaining);
/// # Ok(()) }
/// ```
#[derive(Clone)]
pub struct Redis {
    inner: Arc<Inner>,
}

impl std::fmt::Debug for Redis {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Redis")
            .field("cluster", &self.is_cluster())
            .field("prefix", &self.inner.prefix)
            .field("stats", &self.stats())
            .finish_non_exhaustive()
    }
}

/// Counters of a [`Redis`] backend.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize)]
#[non_exhaustive]
pub struct RedisStats {
    /// Commands and script calls sent, including the `TIME` reads that keep
    /// this instance's estimate of the server's clock (one at connect, then
    /// at most one a minute while leading windows are opened). A batch of
    /// rate-limit operations sent together is one script call.
    pub commands: u64,
    /// The circuit breaker.
    pub breaker: BreakerStats,
    /// Times the pub/sub listener (completion and debounce notices)
    /// subscribed: 1 once it is live, more after it lost its connection,
    /// moved to another node, or restarted on another tokio runtime after
    /// its own ended.
    pub subscriptions: u64,
    /// Pub/sub notices the listener received.
    pub notices: u64,
    /// Rate-limit checks answered locally, with no round trip: denials of
    /// keys nothing can admit yet (see `RedisBuilder::with_local_answers`).
    pub local_answers: u64,
    /// Keys whose denials are answered locally now (ended ones not yet
    /// dropped included), at most `RedisBuilder::with_local_answers`.
    pub local_answer_keys: usize,
    /// Script calls the server did not know the script of (`NOSCRIPT`: a
    /// restarted or failed-over node, a flushed script cache), sent again
    /// with the script's text.
    pub script_reloads: u64,
    /// Times a command succeeded after commands had failed for a lost or
    /// refused connection: the client reconnected (to a restarted server,
    /// or to the new primary after a failover).
    pub reconnects: u64,
}

impl Redis {
    /// A builder for one node, from a `redis://` (or `rediss://`) URL.
    pub fn builder(url: impl Into<String>) -> RedisBuilder {
        RedisBuilder::new(vec![url.into()], false)
    }

    /// A builder for a Redis Cluster, from one or more seed node URLs.
    pub fn cluster<I, S>(nodes: I) -> RedisBuilder
    where
        I: IntoIterator<Item = S>,
        S: Into<String>,
    {
        RedisBuilder::new(nodes.into_iter().map(Into::into).collect(), true)
    }

    /// A builder from the environment: [`REDIS_CLUSTER_ENV`] (comma-separated
    /// seed nodes) if set, else [`REDIS_URL_ENV`]; `None` when neither is
    /// set or both are empty.
    #[must_use]
    pub fn from_env() -> Option<RedisBuilder> {
        let read = |name: &str| std::env::var(name).ok().filter(|v| !v.trim().is_empty());
        if let Some(nodes) = read(REDIS_CLUSTER_ENV) {
            let nodes: Vec<String> = nodes
                .split(',')
                .map(str::trim)
                .filter(|n| !n.is_empty())
                .map(str::to_owned)
                .collect();
            return Some(RedisBuilder::new(nodes, true));
        }
        read(REDIS_URL_ENV).map(|url| RedisBuilder::new(vec![url.trim().to_owned()], false))
    }

    /// Whether this talks to a Redis Cluster.
    #[must_use]
    pub fn is_cluster(&self) -> bool {
        matches!(self.inner.conn, Conn::Cluster(_))
    }

    /// The key prefix.
    #[must_use]
    pub fn prefix(&self) -> &str {
        &self.inner.prefix
    }

    /// Counters, breaker included.
    #[must_use]
    pub fn stats(&self) -> RedisStats {
        let (subscriptions, notices) = self.inner.waiters.counts();
        let local = &self.inner.batches.local;
        let ops = &self.inner.ops;
        RedisStats {
            commands: self.inner.commands.get(),
            breaker: self.inner.breaker.stats(),
            subscriptions,
            notices,
            local_answers: local.answered(),
            local_answer_keys: local.len(),
            script_reloads: ops.script_reloads.load(Ordering::Relaxed),
            reconnects: ops.reconnects.load(Ordering::Relaxed),
        }
    }

    /// Sends `PING`.
    ///
    /// # Errors
    ///
    /// As every command: timeout, breaker open, unavailable.
    pub async fn ping(&self) -> Result<(), StoreError> {
        let reply: String = self.query(&redis::cmd("PING")).await?;
        if reply == "PONG" {
            Ok(())
        } else {
            Err(StoreError::Protocol(format!("PING answered {reply:?}")))
        }
    }

    /// The stored name of a logical key: `{prefix:key}` followed by
    /// `suffix`, so every key of one operation shares one hash tag. Each
    /// primitive has its own suffix (`:t` leading throttle, `:w` coalescing
    /// window, `:r` rate limit, `:i`/`:in` idempotency record and fence,
    /// `:d`/`:d:<burst>` debounce burst and outcome), so
    /// one logical key used by two primitives never collides.
    pub(crate) fn key(&self, logical: &str, suffix: &str) -> String {
        let mut k =
            String::with_capacity(self.inner.prefix.len() + logical.len() + suffix.len() + 3);
        k.push('{');
        k.push_str(&self.inner.prefix);
        k.push(':');
        k.push_str(logical);
        k.push('}');
        k.push_str(suffix);
        k
    }

    /// Sends one command, under the timeout and the breaker.
    pub(crate) async fn query<T: FromRedisValue>(&self, cmd: &Cmd) -> Result<T, StoreError> {
        self.guarded(Class::Refusable, |conn| async move {
            match conn {
                Conn::Single(mut c) => cmd.query_async(&mut c).await,
                Conn::Cluster(mut c) => cmd.query_async(&mut c).await,
            }
        })
        .await
    }

    /// Sends a pipeline (one round trip; in a cluster its keys share a
    /// slot), under the timeout and the breaker.
    pub(crate) async fn query_pipe<T: FromRedisValue>(
        &self,
        pipe: &redis::Pipeline,
    ) -> Result<T, StoreError> {
        self.guarded(Class::Refusable, |conn| async move {
            match conn {
                Conn::Single(mut c) => pipe.query_async(&mut c).await,
                Conn::Cluster(mut c) => pipe.query_async(&mut c).await,
            }
        })
        .await
    }

    /// Calls a script (`EVALSHA`; on `NOSCRIPT`, the same call as `EVAL`, see
    /// [`script`]), under the timeout and the breaker.
    pub(crate) async fn invoke<T: FromRedisValue>(
        &self,
        call: &ScriptCall<'_>,
    ) -> Result<T, StoreError> {
        self.invoke_as(Class::Refusable, call).await
    }

    /// [`Redis::invoke`] for a call that must be tried even while the
    /// breaker is open (see [`Class::MustTry`]): an owner renewing its claim
    /// or storing the result of a run.
    pub(crate) async fn invoke_must_try<T: FromRedisValue>(
        &self,
        call: &ScriptCall<'_>,
    ) -> Result<T, StoreError> {
        self.invoke_as(Class::MustTry, call).await
    }

    async fn invoke_as<T: FromRedisValue>(
        &self,
        class: Class,
        call: &ScriptCall<'_>,
    ) -> Result<T, StoreError> {
        self.guarded(class, |conn| async move {
            let reloads = &self.inner.ops.script_reloads;
            match conn {
                Conn::Single(mut c) => evaluate(call, &mut c, reloads).await,
                Conn::Cluster(mut c) => evaluate(call, &mut c, reloads).await,
            }
        })
        .await
    }

    /// Runs one call on the connection through the store guard (bounded by
    /// the command timeout, a panic caught), refused at once while the
    /// breaker is open unless it must be tried; its outcome recorded.
    async fn guarded<T, Fut>(
        &self,
        class: Class,
        call: impl FnOnce(Conn) -> Fut,
    ) -> Result<T, StoreError>
    where
        Fut: Future<Output = redis::RedisResult<T>>,
    {
        let breaker = &self.inner.breaker;
        // Dropped with this future (its caller went away mid-command), the
        // permit is no event: a cancelled probe never wedges the breaker.
        let permit = match class {
            Class::Refusable => breaker
                .admit()
                .map_err(|retry_in| StoreError::BreakerOpen { retry_in })?,
            Class::MustTry => breaker.admit_anyway(),
        };
        self.inner.commands.incr();
        let result = self.bounded(call(self.inner.conn.clone())).await;
        permit.record(!matches!(&result, Err(e) if e.is_store_fault()));
        let ops = &self.inner.ops;
        match &result {
            Ok(_) => {
                if ops.link_lost.load(Ordering::Relaxed)
                    && ops.link_lost.swap(false, Ordering::AcqRel)
                {
                    ops.reconnects.fetch_add(1, Ordering::Relaxed);
                }
            }
            Err(StoreError::Unavailable(_)) => ops.link_lost.store(true, Ordering::Release),
            Err(_) => {}
        }
        result
    }

    async fn bounded<T>(
        &self,
        fut: impl Future<Output = redis::RedisResult<T>>,
    ) -> Result<T, StoreError> {
        let after = self.inner.command_timeout;
        match crate::store::guard(after, || fut).await {
            Err(fault) => Err(fault.into()),
            Ok(Ok(v)) => Ok(v),
            Ok(Err(e)) if e.is_timeout() => Err(StoreError::Timeout { after }),
            Ok(Err(e)) if is_reply_error(&e) => Err(StoreError::Protocol(e.to_string())),
            Ok(Err(e)) => Err(StoreError::unavailable(e)),
        }
    }
}

/// Whether an open breaker may refuse a call.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Class {
    /// Refused at once while the breaker is open: the caller has a policy
    /// for an outage (fail open, fail closed) and nothing is lost.
    Refusable,
    /// Always sent, its outcome still recorded (a success closes the
    /// breaker): work already done would be lost if it were refused. An
    /// owner's renewals and completions are such probes.
    MustTry,
}

/// A reply the server made on purpose (a script error, a type error): the
/// store is up, so it does not count against the breaker.
fn is_reply_error(e: &redis::RedisError) -> bool {
    !(e.is_io_error()
        || e.is_connection_dropped()
        || e.is_connection_refusal()
        || e.is_cluster_error()
        || e.is_timeout())
        && e.kind() != redis::ErrorKind::Client
}

/// `call` as `EVALSHA`, then as `EVAL` if the server does not know its script.
async fn evaluate<T, C>(
    call: &ScriptCall<'_>,
    conn: &mut C,
    reloads: &AtomicU64,
) -> redis::RedisResult<T>
where
    T: FromRedisValue,
    C: redis::aio::ConnectionLike + Send,
{
    match call.evalsha().query_async(conn).await {
        Err(e) if script::is_no_script(&e) => {
            reloads.fetch_add(1, Ordering::Relaxed);
            call.eval().query_async(conn).await
        }
        done => done,
    }
}

/// What [`Redis::open_window`] found.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) enum WindowOpen {
    /// This call opened the window: run.
    Opened,
    /// The window is open for this long still: throttled.
    Closed(Duration),
}

impl Redis {
    /// Opens the leading-throttle window of `key` for `window`, or learns
    /// how long the open one has left, in one round trip of one plain
    /// command: `SET key "<end_ms>:<token>" NX PX window GET`. Who opens is
    /// decided by the server's expiry, so instances with skewed clocks
    /// agree; the value carries the window's end on the server's clock (as
    /// estimated here, see [`Redis::sync_clock`]), so a loser reads the time
    /// left from the holder's reply without a second command.
    ///
    /// A server older than Redis 7.0 refuses `NX` with `GET`: from then on
    /// this sends `SET NX PX` and `PTTL` pipelined (still one round trip).
    /// A value that carries no end (written by an older version of this
    /// crate) costs one `PTTL` more.
    pub(crate) async fn open_window(
        &self,
        key: &str,
        window: Duration,
        token: u64,
    ) -> Result<WindowOpen, StoreError> {
        let px = ms(window);
        let key = self.key(key, ":t");
        let now = self.server_now_ms();
        let value = window_value(now.saturating_add(px), token);
        if self.inner.clock.takes_set_nx_get() {
            // Sized up front: the command's buffers never grow (no reallocation per decision).
            let mut cmd = redis::Cmd::with_capacity(7, key.len() + value.len() + 32);
            cmd.arg("SET")
                .arg(&key)
                .arg(&value)
                .arg("NX")
                .arg("PX")
                .arg(px)
                .arg("GET");
            match self.query::<Option<String>>(&cmd).await {
                Ok(None) => return Ok(WindowOpen::Opened),
                Ok(Some(held)) => {
                    return match window_end(&held) {
                        Some(end) => Ok(WindowOpen::Closed(Duration::from_millis(
                            end.saturating_sub(now).clamp(1, px),
                        ))),
                        None => self.time_left(&key).await,
                    };
                }
                Err(StoreError::Protocol(reply)) if reply.contains("syntax") => {
                    if self.inner.clock.refuse_set_nx_get() {
                        tracing::info!(
                            %reply,
                            "Redis refuses SET with NX and GET (before 7.0): \
                             leading windows use SET NX PX and PTTL pipelined"
                        );
                    }
                }
                Err(error) => return Err(error),
            }
        }
        let mut pipe = redis::pipe();
        pipe.cmd("SET")
            .arg(&key)
            .arg(&value)
            .arg("NX")
            .arg("PX")
            .arg(px)
            .cmd("PTTL")
            .arg(&key);
        let (opened, left): (Option<String>, i64) = self.query_pipe(&pipe).await?;
        Ok(if opened.is_some() {
            WindowOpen::Opened
        } else {
            closed_for(left)
        })
    }

    /// The time left on a window key, asked with `PTTL`.
    async fn time_left(&self, key: &str) -> Result<WindowOpen, StoreError> {
        let left: i64 = self.query(redis::cmd("PTTL").arg(key)).await?;
        Ok(closed_for(left))
    }

    /// The server's time in ms: pinned by a test, or this instance's
    /// estimate, which is measured again (in the background) once a minute.
    fn server_now_ms(&self) -> u64 {
        if let Some(pinned) = self.pinned_ms() {
            return pinned;
        }
        if self.inner.clock.claim_resync()
            && let Ok(runtime) = tokio::runtime::Handle::try_current()
        {
            let redis = self.clone();
            runtime.spawn(async move {
                if let Err(error) = redis.sync_clock().await {
                    tracing::debug!(%error, "reading the Redis server's TIME failed");
                }
            });
        }
        self.inner.clock.now_ms()
    }

    /// Measures the offset between the server's clock and this host's with
    /// one `TIME`, assuming the server read it halfway through the round
    /// trip.
    async fn sync_clock(&self) -> Result<(), StoreError> {
        let before = server_clock::wall_us();
        let (s, us): (i64, i64) = self.query(&redis::cmd("TIME")).await?;
        let after = server_clock::wall_us();
        let server = s.saturating_mul(1_000_000).saturating_add(us);
        self.inner.clock.record(before, server, after);
        Ok(())
    }
}

/// A leading window's value: `"<end_ms>:<token>"`.
fn window_value(end_ms: u64, token: u64) -> String {
    let (mut end, mut owner) = (itoa::Buffer::new(), itoa::Buffer::new());
    let (end, owner) = (end.format(end_ms), owner.format(token));
    let mut value = String::with_capacity(end.len() + 1 + owner.len());
    value.push_str(end);
    value.push(':');
    value.push_str(owner);
    value
}

/// The end (ms on the server's clock) a leading window's value carries:
/// `"<end_ms>:<token>"`.
fn window_end(value: &str) -> Option<u64> {
    value.split_once(':')?.0.parse().ok()
}

/// A `PTTL` reply as a closed window; below 1 ms (the key expired between
/// the commands) it is over in 1 ms.
fn closed_for(left_ms: i64) -> WindowOpen {
    WindowOpen::Closed(Duration::from_millis(left_ms.max(1).unsigned_abs()))
}

/// Server time in ms, or the pinned time a test passed as the last ARGV.
const NOW: &str = r"
local function now_ms(pinned)
  if pinned ~= nil and pinned ~= '' then return tonumber(pinned) end
  local t = redis.call('TIME')
  return tonumber(t[1]) * 1000 + math.floor(tonumber(t[2]) / 1000)
end
";

/// Coalescing-throttle window claim: `SET NX PX` of `"<end_ms>:<token>"`
/// (end on the server's clock); on a lost race, what the holder stores and
/// its time left, in the same round trip.
const WINDOW_CLAIM: &str = r"
local now = now_ms(ARGV[3])
local value = string.format('%.0f', now + tonumber(ARGV[2])) .. ':' .. ARGV[1]
if redis.call('SET', KEYS[1], value, 'NX', 'PX', ARGV[2]) then return {1, 0, ''} end
local held = redis.call('GET', KEYS[1])
local left = redis.call('PTTL', KEYS[1])
return {0, left, held or ''}
";

/// Compare-and-set on the owner's token: write `"<end_ms>:<token>"` for
/// `ttl` unless another token holds the key.
const WINDOW_CAS: &str = r"
local held = redis.call('GET', KEYS[1])
if held then
  local token = string.match(held, ':(%d+)$') or '0'
  if token ~= ARGV[1] then return 0 end
end
local now = now_ms(ARGV[3])
local value = string.format('%.0f', now + tonumber(ARGV[2])) .. ':' .. ARGV[1]
redis.call('SET', KEYS[1], value, 'PX', ARGV[2])
return 1
";

/// The live value of a window and its time left.
const WINDOW_READ: &str = r"
local held = redis.call('GET', KEYS[1])
if not held then return {0, 0, ''} end
return {1, redis.call('PTTL', KEYS[1]), held}
";

/// What a window key holds, from the Redis side.
#[derive(Debug, Clone, PartialEq, Eq)]
pub(crate) struct HeldWindow {
    /// Time left on the key, by the server's clock.
    pub(crate) left: Duration,
    /// The owner's token, when the value is readable.
    pub(crate) token: Option<u64>,
    /// The stored text.
    pub(crate) raw: String,
}

impl HeldWindow {
    fn parse(left: i64, raw: String) -> Self {
        let token = raw.rsplit_once(':').and_then(|(_, t)| t.parse().ok());
        Self {
            left: Duration::from_millis(left.max(0).unsigned_abs()),
            token,
            raw,
        }
    }
}

fn cached(
    cell: &'static std::sync::OnceLock<LuaScript>,
    body: &str,
    with_now: bool,
) -> &'static LuaScript {
    cell.get_or_init(|| {
        if with_now {
            LuaScript::new(format!("{NOW}{body}"))
        } else {
            LuaScript::new(body.to_owned())
        }
    })
}

fn ms(d: Duration) -> u64 {
    u64::try_from(d.as_millis()).unwrap_or(u64::MAX).max(1)
}

impl Redis {
    /// The pinned time as a script argument, or empty for the server's `TIME`.
    fn pinned(&self) -> String {
        self.pinned_ms().map(|n| n.to_string()).unwrap_or_default()
    }

    /// The time a test pinned, in ms since the epoch.
    fn pinned_ms(&self) -> Option<u64> {
        self.pinned_us_at().map(|us| us / 1_000)
    }

    /// The time a test pinned, in µs since the epoch (rate limiting reads it so).
    fn pinned_us_at(&self) -> Option<u64> {
        match self.inner.pinned_now.load(Ordering::Relaxed) {
            0 => None,
            n => Some(n - 1),
        }
    }

    /// Pins the time scripts read (ms since the epoch, 0 included) instead
    /// of the server's `TIME`. For tests that need exact instants.
    #[doc(hidden)]
    pub fn pin_time(&self, now_ms: u64) {
        self.pin_time_us(now_ms.saturating_mul(1_000));
    }

    /// [`Redis::pin_time`] to the microsecond, which rate limiting reads
    /// (other scripts read its milliseconds).
    #[doc(hidden)]
    pub fn pin_time_us(&self, now_us: u64) {
        // Stored plus one, so that 0 can mean "not pinned".
        let stored = now_us.saturating_add(1);
        self.inner.pinned_now.store(stored, Ordering::Relaxed);
    }

    /// Goes back to the server's `TIME` after [`Redis::pin_time`].
    #[doc(hidden)]
    pub fn unpin_time(&self) {
        self.inner.pinned_now.store(0, Ordering::Relaxed);
    }

    /// Takes a coalescing-throttle window for `token` if it is free.
    /// `Ok(None)`: won; `Ok(Some(held))`: lost to `held`.
    pub(crate) async fn window_claim(
        &self,
        key: &str,
        token: u64,
        ttl: Duration,
    ) -> Result<Option<HeldWindow>, StoreError> {
        static SCRIPT: std::sync::OnceLock<LuaScript> = std::sync::OnceLock::new();
        let mut call = cached(&SCRIPT, WINDOW_CLAIM, true).prepare_invoke();
        call.key(key).arg(token).arg(ms(ttl)).arg(self.pinned());
        let (won, left, raw): (i64, i64, String) = self.invoke(&call).await?;
        Ok((won != 1).then(|| HeldWindow::parse(left, raw)))
    }

    /// Extends or records the window of `key` for `token`, unless another
    /// token holds it. `true` if written.
    pub(crate) async fn window_cas(
        &self,
        key: &str,
        token: u64,
        ttl: Duration,
    ) -> Result<bool, StoreError> {
        static SCRIPT: std::sync::OnceLock<LuaScript> = std::sync::OnceLock::new();
        let mut call = cached(&SCRIPT, WINDOW_CAS, true).prepare_invoke();
        call.key(key).arg(token).arg(ms(ttl)).arg(self.pinned());
        let written: i64 = self.invoke(&call).await?;
        Ok(written == 1)
    }

    /// What the window key holds, if it is live.
    pub(crate) async fn window_read(&self, key: &str) -> Result<Option<HeldWindow>, StoreError> {
        static SCRIPT: std::sync::OnceLock<LuaScript> = std::sync::OnceLock::new();
        let mut call = cached(&SCRIPT, WINDOW_READ, false).prepare_invoke();
        call.key(key);
        let (found, left, raw): (i64, i64, String) = self.invoke(&call).await?;
        Ok((found == 1).then(|| HeldWindow::parse(left, raw)))
    }
}

#[cfg(test)]
#[path = "../../tests/support/redis.rs"]
#[allow(dead_code, unreachable_pub)]
mod harness;

/// Runs `check` against a fresh single node, then a fresh 3-node cluster.
#[cfg(test)]
async fn each_server(test: &str, check: impl AsyncFn(Redis)) {
    each_server_bounded(test, None, check).await;
}

/// [`each_server`] with another command timeout than the default (`None`), for tests that
/// check what is decided, not how fast: a burst on a cluster just created, on a loaded
/// machine, can take longer than the default.
#[cfg(test)]
async fn each_server_bounded(
    test: &str,
    command_timeout: Option<Duration>,
    check: impl AsyncFn(Redis),
) {
    let bounded = |builder: RedisBuilder| match command_timeout {
        Some(after) => builder.with_command_timeout(after),
        None => builder,
    };
    if let Some(node) = harness::RedisNode::start(test) {
        check(
            bounded(Redis::builder(node.url()))
                .connect()
                .await
                .expect("connects"),
        )
        .await;
    }
    if let Some(cluster) = harness::RedisCluster::start(test) {
        check(
            bounded(Redis::cluster(cluster.urls()))
                .connect()
                .await
                .expect("connects"),
        )
        .await;
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_window_value_carries_its_end_then_its_token() {
        assert_eq!(window_value(1_700_000_000_123, 42), "1700000000123:42");
        assert_eq!(window_value(0, 0), "0:0");
        let widest = window_value(u64::MAX, u64::MAX);
        assert_eq!(widest, format!("{}:{}", u64::MAX, u64::MAX));
        assert_eq!(window_end(&widest), Some(u64::MAX));
        assert_eq!(window_end("17:3"), Some(17));
        assert_eq!(window_end("legacy"), None);
    }

    #[tokio::test]
    async fn leading_window_opens_once_then_reports_its_time_left() {
        each_server("leading_window_opens_once", async |redis: Redis| {
            for key in ["a", "b", "c", "d"] {
                let w = Duration::from_secs(10);
                assert_eq!(
                    redis.open_window(key, w, 1).await.unwrap(),
                    WindowOpen::Opened
                );
                match redis.open_window(key, w, 2).await.unwrap() {
                    WindowOpen::Closed(left) => assert!(left > Duration::from_secs(9) && left <= w),
                    other => panic!("{other:?}"),
                }
            }
        })
        .await;
    }

    #[tokio::test]
    async fn a_lost_leading_window_reads_the_holders_end_from_one_command() {
        each_server("leading_window_end", async |redis: Redis| {
            let w = Duration::from_secs(10);
            let closed = |s: u64| WindowOpen::Closed(Duration::from_secs(s));
            redis.pin_time(1_000_000);
            assert_eq!(
                redis.open_window("e", w, 1).await.unwrap(),
                WindowOpen::Opened
            );
            // Another instance, 4 s later on the server's clock.
            redis.pin_time(1_004_000);
            let sent = redis.stats().commands;
            assert_eq!(redis.open_window("e", w, 2).await.unwrap(), closed(6));
            assert_eq!(redis.stats().commands - sent, 1, "one command");
            // A caller with a shorter window asks again after its own.
            let short = Duration::from_secs(2);
            assert_eq!(redis.open_window("e", short, 2).await.unwrap(), closed(2));
            redis.unpin_time();

            // A value carrying no end (an older version's token): one PTTL more.
            let legacy = redis.key("legacy", ":t");
            let () = redis
                .query(redis::cmd("SET").arg(&legacy).arg(1).arg("PX").arg(5000))
                .await
                .unwrap();
            let sent = redis.stats().commands;
            match redis.open_window("legacy", w, 3).await.unwrap() {
                WindowOpen::Closed(left) => {
                    assert!(left > Duration::from_secs(4) && left <= Duration::from_secs(5));
                }
                other => panic!("{other:?}"),
            }
            assert_eq!(redis.stats().commands - sent, 2);

            // A server that refuses NX with GET (before 7.0): the pipeline.
            redis.inner.clock.refuse_set_nx_get();
            assert_eq!(
                redis.open_window("old", w, 1).await.unwrap(),
                WindowOpen::Opened
            );
            match redis.open_window("old", w, 2).await.unwrap() {
                WindowOpen::Closed(left) => assert!(left > Duration::from_secs(9) && left <= w),
                other => panic!("{other:?}"),
            }
            // What the pipeline wrote carries its end: a reader that uses
            // `GET` finds it.
            redis.inner.clock.set_nx_get.store(true, Ordering::Relaxed);
            match redis.open_window("old", w, 3).await.unwrap() {
                WindowOpen::Closed(left) => assert!(left > Duration::from_secs(8) && left <= w),
                other => panic!("{other:?}"),
            }
        })
        .await;
    }

    #[tokio::test]
    async fn the_server_clock_estimate_is_measured_at_connect_and_corrected_by_a_resync() {
        each_server("server_clock", async |redis: Redis| {
            let server_ms = async || {
                let (s, us): (u64, u64) = redis.query(&redis::cmd("TIME")).await.unwrap();
                s * 1000 + us / 1000
            };
            let off = |a: u64, b: u64| a.abs_diff(b);
            let truth = server_ms().await;
            assert!(
                off(redis.server_now_ms(), truth) < 1000,
                "measured at connect"
            );
            // Off by an hour (a stepped clock), then measured again.
            redis.inner.clock.record(0, 3_600_000_000, 0);
            assert!(off(redis.server_now_ms(), server_ms().await) > 3_000_000);
            redis.sync_clock().await.unwrap();
            assert!(off(redis.server_now_ms(), server_ms().await) < 1000);
        })
        .await;
    }

    #[tokio::test]
    async fn window_claim_and_compare_and_set_on_the_token() {
        each_server("window_claim_and_cas", async |redis: Redis| {
            let lease = Duration::from_secs(30);
            for k in ["w1", "w2", "w3"] {
                redis.pin_time(1_000_000);
                let key = redis.key(k, "");
                assert_eq!(redis.window_claim(&key, 7, lease).await.unwrap(), None);
                let held = redis
                    .window_claim(&key, 8, lease)
                    .await
                    .unwrap()
                    .expect("lost");
                assert_eq!(held.token, Some(7));
                assert_eq!(held.raw, "1030000:7");
                assert!(held.left > Duration::from_secs(29));
                // Another token can neither extend nor record.
                assert!(!redis.window_cas(&key, 8, lease).await.unwrap());
                // The owner can; the stored end follows the (pinned) server time.
                redis.pin_time(2_000_000);
                assert!(
                    redis
                        .window_cas(&key, 7, Duration::from_secs(5))
                        .await
                        .unwrap()
                );
                let held = redis.window_read(&key).await.unwrap().expect("live");
                assert_eq!(held.raw, "2005000:7");
                assert!(held.left <= Duration::from_secs(5));
                assert_eq!(
                    redis.window_read(&redis.key("missing", "")).await.unwrap(),
                    None
                );
            }
        })
        .await;
    }

    #[tokio::test]
    async fn keys_carry_one_hash_tag_around_the_whole_logical_key() {
        let b = Redis::builder("redis://127.0.0.1:1").with_prefix("app");
        // No connection needed to name keys: build the parts by hand.
        let inner = Inner {
            conn: Conn::Single(
                ConnectionManager::new_lazy_with_config(
                    redis::Client::open(b.nodes[0].as_str()).expect("url"),
                    ConnectionManagerConfig::new(),
                )
                .expect("lazy manager"),
            ),
            prefix: b.prefix,
            command_timeout: b.command_timeout,
            breaker: Breaker::new(b.breaker),
            commands: crate::stats::Counter::default(),
            pinned_now: AtomicU64::new(0),
            clock: server_clock::ServerClock::default(),
            nodes: vec![],
            waiters: notify::Waiters::default(),
            bursts: debounce::BurstListeners::default(),
            batches: rate_limit::Batcher::default(),
            ops: OpsCounters::default(),
        };
        let redis = Redis {
            inner: Arc::new(inner),
        };
        assert_eq!(redis.key("user:1", ""), "{app:user:1}");
        assert_eq!(redis.key("user:1", ":lease"), "{app:user:1}:lease");
    }
}
