//! The Redis backend: one value that talks to a single node or a Redis
//! Cluster, with a key prefix, timeouts and a circuit breaker.

use std::sync::Arc;
use std::sync::atomic::{AtomicU64, Ordering};
use std::time::Duration;

use redis::aio::ConnectionManager;
use redis::cluster_async::ClusterConnection;
use redis::{Cmd, FromRedisValue};
use serde::Serialize;

use self::connection::{Link, Topology};
use self::script::{LuaScript, ScriptCall};
use super::{Breaker, BreakerStats, StoreError};

mod builder;
pub use self::builder::RedisBuilder;

mod connection;
mod durable;
mod pubsub;
pub(crate) mod script;
mod server_clock;
#[cfg(any(test, feature = "test-util"))]
pub use self::server_clock::SteppedClock;

pub(crate) use self::pubsub::{Subscriber, Subscription};

/// Environment variable read by [`Redis::from_env`]: where Redis is, in any
/// form [`Redis::builder`] accepts: one node (`redis://127.0.0.1:6379/0`,
/// `rediss://user:pass@host:6380`), a cluster
/// (`redis+cluster://host1:7000,host2:7000`) or a primary behind Sentinel
/// (`redis+sentinel://host1:26379,host2:26379/mymaster`).
pub const REDIS_URL_ENV: &str = "THROTTLEBEAM_REDIS_URL";

/// Environment variable read by [`Redis::from_env`]: a comma-separated list
/// of Redis Cluster seed nodes, e.g. `redis://10.0.0.1:7000,redis://10.0.0.2:7000`.
/// Takes precedence over [`REDIS_URL_ENV`] (which can name a cluster too).
pub const REDIS_CLUSTER_ENV: &str = "THROTTLEBEAM_REDIS_CLUSTER";

/// Environment variable read by [`Redis::from_env`]: the ACL user, instead of
/// (or overriding) the URL's. See [`RedisBuilder::with_username`].
pub const REDIS_USERNAME_ENV: &str = "THROTTLEBEAM_REDIS_USERNAME";

/// Environment variable read by [`Redis::from_env`]: the password, instead
/// of (or overriding) the URL's, so that it need not be percent-encoded
/// into a URL. See [`RedisBuilder::with_password`].
pub const REDIS_PASSWORD_ENV: &str = "THROTTLEBEAM_REDIS_PASSWORD";

/// Environment variable read by [`Redis::from_env`] (feature `redis-tls`):
/// a PEM file of the certificate authorities to trust instead of the
/// system's, for a `rediss://` URL. See `RedisBuilder::with_ca_pem`.
pub const REDIS_CA_FILE_ENV: &str = "THROTTLEBEAM_REDIS_CA_FILE";

/// Environment variable read by [`Redis::from_env`] (feature `redis-tls`):
/// a PEM file of this client's certificate chain, for mutual TLS; with
/// [`REDIS_CLIENT_KEY_FILE_ENV`]. See `RedisBuilder::with_client_cert_pem`.
pub const REDIS_CLIENT_CERT_FILE_ENV: &str = "THROTTLEBEAM_REDIS_CLIENT_CERT_FILE";

/// Environment variable read by [`Redis::from_env`] (feature `redis-tls`):
/// a PEM file of the private key of [`REDIS_CLIENT_CERT_FILE_ENV`]'s
/// certificate.
pub const REDIS_CLIENT_KEY_FILE_ENV: &str = "THROTTLEBEAM_REDIS_CLIENT_KEY_FILE";

#[derive(Clone)]
enum Conn {
    Single(ConnectionManager),
    Cluster(ClusterConnection),
}

pub(crate) struct Inner {
    link: Link,
    prefix: String,
    pub(crate) command_timeout: Duration,
    breaker: Breaker,
    /// Striped: every command counts, from every worker thread.
    commands: crate::stats::Counter,
    pinned_now: AtomicU64,
    /// The server's clock as estimated here.
    pub(crate) clock: server_clock::ServerClock,
    /// The pub/sub multiplexer: its listeners and who hears which channel.
    pubsub: pubsub::PubSub,
    /// What each primitive keeps per connection, found by type.
    slices: Slices,
    /// The rate limiter's queue cap, as the builder was given it.
    pub(crate) rate_limit_queue: Option<std::num::NonZeroUsize>,
    /// The rate limiter's cap on keys answered locally, as the builder was given it.
    pub(crate) local_answers: Option<usize>,
    /// Whether a rate-limit check of a key not seen may be written with a plain `SET NX`.
    pub(crate) fresh_key_writes: bool,
    /// Durable idempotency claims, if on.
    durable: Option<durable::Durable>,
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
    /// Notices a script wrote its change for but could not publish.
    notices_lost: AtomicU64,
    /// Such losses are logged at most once per interval.
    notices_lost_log: crate::log_every::LogEvery,
}

/// State each primitive keeps per connection, one value per type: the
/// connection holds it without knowing it. A fixed number of slots, each
/// set once, so that finding a value is plain reads (no lock: every
/// rate-limit check looks its value up).
#[derive(Default)]
struct Slices {
    slots: [std::sync::OnceLock<Arc<dyn std::any::Any + Send + Sync>>; SLICES],
    /// Held while a slot is filled, so that a type gets one.
    filling: std::sync::Mutex<()>,
}

/// Slots for primitives' values: one per primitive that keeps one, and room to spare.
const SLICES: usize = 8;

impl Redis {
    /// This connection's value of type `T`, made by `make` on first use.
    ///
    /// # Panics
    ///
    /// If more than [`SLICES`] types ask for one (a fixed, internal set).
    pub(crate) fn slice<T: std::any::Any + Send + Sync>(&self, make: impl FnOnce() -> T) -> Arc<T> {
        let slices = &self.inner.slices;
        let found = || {
            slices
                .slots
                .iter()
                .map_while(std::sync::OnceLock::get)
                .find(|v| v.is::<T>())
                .and_then(|v| Arc::clone(v).downcast::<T>().ok())
        };
        if let Some(value) = found() {
            return value;
        }
        let _filling = slices
            .filling
            .lock()
            .unwrap_or_else(std::sync::PoisonError::into_inner);
        if let Some(value) = found() {
            return value;
        }
        let free = slices
            .slots
            .iter()
            .find(|slot| slot.get().is_none())
            .expect("a slot for each primitive's per-connection value");
        let value = Arc::new(make());
        let _ = free.set(value.clone());
        value
    }
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
/// # Connections
///
/// There is no pool: every connection is multiplexed (commands from every
/// task are pipelined on it, replies matched in order), so one connection
/// per node carries all the traffic of a `Redis` value and its clones.
/// Each [`RedisBuilder::connect`] makes its own connections.
///
/// | deployment | data connections | when one fails |
/// |---|---|---|
/// | one node (`redis://`, `rediss://`) | one, through redis-rs's `ConnectionManager` | it reconnects by itself (one retry per attempt, pauses up to 200 ms); the failed command is an error |
/// | cluster (`redis+cluster://`, [`Redis::cluster`]) | one per node, through redis-rs's cluster client: commands routed by slot, `MOVED`/`ASK` followed | the client refreshes its slot map and retries once within the command timeout (more retries could re-send a claim whose reply was lost in a failover) |
/// | Sentinel (`redis+sentinel://`, [`Redis::sentinel`]) | one to the primary the Sentinels name, and one to a Sentinel for lookups | the primary is looked up once a second, and every 100 ms after a command fails on the store's side (or finds the primary demoted, `READONLY`) until it answers again; when the Sentinels name another, it is connected to and used from then on (the breaker closed: its failures were the old primary's); [`RedisStats::failovers`] counts the moves |
///
/// Besides, the first call that needs notices (an idempotency waiter, a
/// debounce call, a rate-limit check with local answers on) starts one
/// pub/sub connection, which carries every broadcast channel in use, to one
/// seed node (behind Sentinel, the primary, followed across failovers),
/// moving to the next node when it fails, with polling meanwhile. It sends
/// `PING` every second and is replaced when the answer takes over a second,
/// so a connection gone silent without FIN or RST is noticed within 2 s
/// (rate limiting's local answers end then). Every connection has TCP
/// keepalive and `TCP_USER_TIMEOUT`. On a cluster, idempotency waiters instead
/// subscribe to their key's shard channel (`SSUBSCRIBE`, Redis 7) over one
/// more cluster connection, on the node that owns the key's slot,
/// resubscribed after a failover or a slot move; it `PING`s every primary
/// every second and is replaced the same way. TLS and ACL credentials
/// apply to every connection, the Sentinels' included.
///
/// | setting | default |
/// |---|---|
/// | [`with_connect_timeout`](RedisBuilder::with_connect_timeout) | 1 s per connection attempt (behind Sentinel: the lookup, then the connection) |
/// | [`with_command_timeout`](RedisBuilder::with_command_timeout) | 500 ms for each call, a client's retry included; also a cluster node's response timeout |
/// | [`with_breaker`](RedisBuilder::with_breaker) | 5 consecutive failures open it for 10 s |
/// | [`with_rate_limit_queue`](RedisBuilder::with_rate_limit_queue) | 16,384 rate-limit operations waiting for a batch (single node and Sentinel; four batch calls in flight) |
/// | [`with_max_clock_error`](RedisBuilder::with_max_clock_error) | 5 ms: the most the estimate of the server's clock may be off for fresh keys' writes to use it |
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
    pub(crate) inner: Arc<Inner>,
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
    /// Commands and script calls sent for callers, and the `CONFIG GET
    /// maxmemory-policy` at connect. The background reads that keep this
    /// instance's estimate of the server's clock (a few `TIME`s per node
    /// every 10 s while the estimate is used, and on a cluster
    /// `CLUSTER SLOTS` once a second) are not counted. A batch of
    /// rate-limit operations sent together is one script call, and one
    /// pipeline for its fresh keys' `SET`s.
    pub commands: u64,
    /// The circuit breaker.
    pub breaker: BreakerStats,
    /// Times the pub/sub listener (broadcast channels: idempotency
    /// completions, debounce notices, rate-limit resets) subscribed: 1 once
    /// it is live, more after it lost its connection, moved to another node,
    /// or restarted on another tokio runtime after its own ended. A channel
    /// first used while it is live joins that subscription.
    pub subscriptions: u64,
    /// Pub/sub notices the listener received.
    pub notices: u64,
    /// Shard channels (one per waited-on idempotency key, cluster only) the
    /// sharded listener confirmed a subscription to, on the node that owns
    /// the key's slot; again after a reconnect or a slot move.
    pub sharded_subscriptions: u64,
    /// Sharded notices (`SPUBLISH` of an idempotency completion or release,
    /// cluster only) the sharded listener received.
    pub sharded_notices: u64,
    /// Rate-limit checks answered locally, with no round trip: denials of
    /// keys nothing can admit yet (see `RedisBuilder::with_local_answers`).
    pub local_answers: u64,
    /// Keys whose denials are answered locally now (ended ones not yet
    /// dropped included), at most `RedisBuilder::with_local_answers`.
    pub local_answer_keys: usize,
    /// Rate-limit checks of fresh keys decided by a plain `SET … NX` rather than a script
    /// call (see `RedisBuilder::with_fresh_key_writes`).
    pub fresh_key_writes: u64,
    /// Such `SET`s that found their key taken (another instance's state, a value of another
    /// type), whose checks the script then decided.
    pub fresh_key_misses: u64,
    /// Script calls the server did not know the script of (`NOSCRIPT`: a
    /// restarted or failed-over node, a flushed script cache), sent again
    /// with the script's text.
    pub script_reloads: u64,
    /// Times a command succeeded after commands had failed for a lost or
    /// refused connection: the client reconnected (to a restarted server,
    /// or to the new primary after a failover).
    pub reconnects: u64,
    /// Times this backend moved to a new primary that the Sentinels named
    /// (a failover followed); 0 for a node or a cluster (a cluster client
    /// follows the slot map by itself).
    pub failovers: u64,
    /// Changes a script made whose pub/sub notice the server refused (an ACL user without
    /// channel rights, `+@all ~*` with no `&*`): the change stands, and whoever waits for it
    /// learns it by polling (idempotency waiters every 500 ms at most). Logged at warn, at
    /// most once a minute; grant the user `&*` (or `allchannels`).
    pub notices_lost: u64,
}

impl Redis {
    /// A builder from a URL, in any of these forms:
    ///
    /// | form | connects to |
    /// |---|---|
    /// | `redis://[user:pass@]host[:port][/db]` | one node (port 6379 by default) |
    /// | `rediss://[user:pass@]host[:port][/db]` | one node over TLS (feature `redis-tls`) |
    /// | `redis+cluster://[user:pass@]host:port,host:port,…` | a Redis Cluster, from these seed nodes |
    /// | `redis://host:port,redis://host:port,…` | the same (a list of node URLs) |
    /// | `redis+sentinel://[user:pass@]host[:port],…/master[/db]` | the primary that these Sentinels (port 26379 by default) monitor as `master` |
    /// | `rediss+cluster://…`, `rediss+sentinel://…` | the same over TLS, Sentinels included |
    ///
    /// The user and password are an ACL user's (or only a password, for
    /// `requirepass`), percent-encoded where they hold reserved characters;
    /// behind Sentinel they are the data nodes' (the Sentinels' own go in
    /// `?sentinel_username=…&sentinel_password=…`, or
    /// [`RedisBuilder::with_sentinel_credentials`]). A URL that is none of
    /// these fails [`connect`](RedisBuilder::connect) with
    /// [`StoreError::Config`], its password masked in the message.
    ///
    /// # Examples
    ///
    /// ```no_run
    /// # async fn demo() -> Result<(), throttlebeam::store::StoreError> {
    /// use throttlebeam::store::Redis;
    ///
    /// let primary = Redis::builder(
    ///     "redis+sentinel://app:s3cret@10.0.0.1:26379,10.0.0.2:26379,10.0.0.3:26379/mymaster",
    /// )
    /// .connect()
    /// .await?;
    /// # Ok(()) }
    /// ```
    pub fn builder(url: impl Into<String>) -> RedisBuilder {
        RedisBuilder::from_url(url.into())
    }

    /// A builder for a Redis Cluster, from one or more seed node URLs.
    pub fn cluster<I, S>(nodes: I) -> RedisBuilder
    where
        I: IntoIterator<Item = S>,
        S: Into<String>,
    {
        RedisBuilder::new(
            nodes.into_iter().map(Into::into).collect(),
            Topology::Cluster,
        )
    }

    /// A builder for the primary that `sentinels` (Sentinel URLs,
    /// `redis://host:26379`, or `rediss://` over TLS) monitor under
    /// `master`: the same as the URL
    /// `redis+sentinel://host1:26379,host2:26379/<master>`. Credentials in
    /// these URLs are the Sentinels' own (the first URL's, for all);
    /// [`with_username`](RedisBuilder::with_username) and
    /// [`with_password`](RedisBuilder::with_password) set the data nodes'.
    ///
    /// # Examples
    ///
    /// ```no_run
    /// # async fn demo() -> Result<(), throttlebeam::store::StoreError> {
    /// use throttlebeam::store::Redis;
    ///
    /// let redis = Redis::sentinel(
    ///     ["redis://10.0.0.1:26379", "redis://10.0.0.2:26379", "redis://10.0.0.3:26379"],
    ///     "mymaster",
    /// )
    /// .with_password("s3cret")
    /// .connect()
    /// .await?;
    /// # Ok(()) }
    /// ```
    pub fn sentinel<I, S>(sentinels: I, master: impl Into<String>) -> RedisBuilder
    where
        I: IntoIterator<Item = S>,
        S: Into<String>,
    {
        RedisBuilder::new(
            sentinels.into_iter().map(Into::into).collect(),
            Topology::Sentinel {
                master: master.into(),
                db: 0,
            },
        )
    }

    /// A builder from the environment; `None` when it names no Redis.
    ///
    /// Where: [`REDIS_URL_ENV`] (`THROTTLEBEAM_REDIS_URL`), one variable for
    /// every form [`Redis::builder`] accepts (a node, a cluster, a primary
    /// behind Sentinel, over TLS or not, with an ACL user or not); or
    /// [`REDIS_CLUSTER_ENV`] (comma-separated seed node URLs), which takes
    /// precedence. Then, each optional:
    ///
    /// | variable | sets |
    /// |---|---|
    /// | [`REDIS_USERNAME_ENV`] `THROTTLEBEAM_REDIS_USERNAME` | the ACL user ([`RedisBuilder::with_username`]) |
    /// | [`REDIS_PASSWORD_ENV`] `THROTTLEBEAM_REDIS_PASSWORD` | the password ([`RedisBuilder::with_password`]) |
    /// | [`REDIS_CA_FILE_ENV`] `THROTTLEBEAM_REDIS_CA_FILE` | a PEM file of CAs to trust (`with_ca_pem`, feature `redis-tls`) |
    /// | [`REDIS_CLIENT_CERT_FILE_ENV`] and [`REDIS_CLIENT_KEY_FILE_ENV`] | PEM files of a client certificate and its key (`with_client_cert_pem`) |
    ///
    /// A file that cannot be read (or certificates set without the
    /// `redis-tls` feature) fails [`connect`](RedisBuilder::connect) with
    /// [`StoreError::Config`] naming the variable.
    ///
    /// # Examples
    ///
    /// ```no_run
    /// # async fn demo() -> Result<(), throttlebeam::store::StoreError> {
    /// use throttlebeam::store::Redis;
    ///
    /// // THROTTLEBEAM_REDIS_URL=rediss+sentinel://app:s3cret@s1:26379,s2:26379/mymaster
    /// // THROTTLEBEAM_REDIS_CA_FILE=/etc/redis/ca.pem
    /// if let Some(builder) = Redis::from_env() {
    ///     let redis = builder.connect().await?;
    /// }
    /// # Ok(()) }
    /// ```
    #[must_use]
    pub fn from_env() -> Option<RedisBuilder> {
        let read = |name: &str| std::env::var(name).ok().filter(|v| !v.trim().is_empty());
        let mut builder = if let Some(nodes) = read(REDIS_CLUSTER_ENV) {
            let nodes: Vec<String> = nodes
                .split(',')
                .map(str::trim)
                .filter(|n| !n.is_empty())
                .map(str::to_owned)
                .collect();
            RedisBuilder::new(nodes, Topology::Cluster)
        } else {
            RedisBuilder::from_url(read(REDIS_URL_ENV)?.trim().to_owned())
        };
        if let Some(user) = read(REDIS_USERNAME_ENV) {
            builder.security.username = Some(user);
        }
        // Not trimmed: a password may end in a space.
        if let Some(password) = std::env::var(REDIS_PASSWORD_ENV)
            .ok()
            .filter(|p| !p.is_empty())
        {
            builder.security.password = Some(password);
        }
        let file = |name: &str| -> Result<Option<Vec<u8>>, String> {
            let Some(path) = read(name) else {
                return Ok(None);
            };
            if !cfg!(feature = "redis-tls") {
                return Err(format!(
                    "{name} is set, but TLS needs throttlebeam's `redis-tls` feature"
                ));
            }
            std::fs::read(path.trim())
                .map(Some)
                .map_err(|e| format!("{name}: cannot read {path:?}: {e}"))
        };
        let files = (|| {
            let ca = file(REDIS_CA_FILE_ENV)?;
            let cert = file(REDIS_CLIENT_CERT_FILE_ENV)?;
            let key = file(REDIS_CLIENT_KEY_FILE_ENV)?;
            let client = match (cert, key) {
                (Some(cert), Some(key)) => Some((cert, key)),
                (None, None) => None,
                _ => {
                    return Err(format!(
                        "{REDIS_CLIENT_CERT_FILE_ENV} and {REDIS_CLIENT_KEY_FILE_ENV} go together: \
                         only one is set"
                    ));
                }
            };
            Ok((ca, client))
        })();
        match files {
            Ok((ca, client)) => {
                if ca.is_some() {
                    builder.security.ca_pem = ca;
                }
                if client.is_some() {
                    builder.security.client_pem = client;
                }
            }
            Err(problem) => {
                builder.problem.get_or_insert(problem);
            }
        }
        Some(builder)
    }

    /// Whether this talks to a Redis Cluster.
    #[must_use]
    pub fn is_cluster(&self) -> bool {
        matches!(
            self.inner.link,
            Link::Fixed {
                conn: Conn::Cluster(_),
                ..
            }
        )
    }

    /// The key prefix.
    #[must_use]
    pub fn prefix(&self) -> &str {
        &self.inner.prefix
    }

    /// Counters, breaker included.
    #[must_use]
    pub fn stats(&self) -> RedisStats {
        let pubsub = self.inner.pubsub.counts();
        let (local_answers, local_answer_keys) = self.local_answer_counts();
        let (fresh_key_writes, fresh_key_misses) = self.fresh_key_counts();
        let ops = &self.inner.ops;
        RedisStats {
            commands: self.inner.commands.get(),
            breaker: self.inner.breaker.stats(),
            subscriptions: pubsub.subscriptions,
            notices: pubsub.notices,
            sharded_subscriptions: pubsub.sharded_subscriptions,
            sharded_notices: pubsub.sharded_notices,
            local_answers,
            local_answer_keys,
            fresh_key_writes,
            fresh_key_misses,
            script_reloads: ops.script_reloads.load(Ordering::Relaxed),
            reconnects: ops.reconnects.load(Ordering::Relaxed),
            failovers: self.inner.link.failovers(),
            notices_lost: ops.notices_lost.load(Ordering::Relaxed),
        }
    }

    /// The server's `maxmemory-policy` (on a cluster, the first node's answer that is not
    /// `noeviction`, if any), or `None` where it cannot be read (a managed service that
    /// refuses `CONFIG`, an ACL user without the right).
    pub(crate) async fn eviction_policy(&self) -> Option<String> {
        let cmd = redis::cmd("CONFIG")
            .arg("GET")
            .arg("maxmemory-policy")
            .clone();
        let reply: redis::Value = match self.query(&cmd).await {
            Ok(reply) => reply,
            Err(error) => {
                tracing::debug!(%error, "reading the Redis server's maxmemory-policy failed");
                return None;
            }
        };
        let mut words = Vec::new();
        flatten_strings(&reply, &mut words);
        // [name, value] per node: the value after each name.
        let mut policies = words
            .windows(2)
            .filter(|w| w[0].eq_ignore_ascii_case("maxmemory-policy"))
            .map(|w| w[1].clone());
        let first = policies.next()?;
        Some(
            policies
                .chain(std::iter::once(first.clone()))
                .find(|p| p != "noeviction")
                .unwrap_or(first),
        )
    }

    /// Warns at connect when the server may evict keys at `maxmemory`: idempotency claims in
    /// flight and stored results carry TTLs, so every policy but `noeviction` can drop
    /// them, and the key then runs again.
    pub(crate) async fn check_eviction_policy(&self) {
        if let Some(policy) = self.eviction_policy().await
            && policy != "noeviction"
        {
            tracing::warn!(
                %policy,
                "redis maxmemory-policy is not noeviction: at maxmemory the server may evict \
                 idempotency claims in flight and stored results (their keys then run again) and \
                 rate-limit states (admitting early); set maxmemory-policy noeviction"
            );
        }
    }

    /// Counts (and logs, at most once a minute) a script's answer 2: its change stands, but
    /// the server refused its notice.
    pub(crate) fn notice_sent(&self, answer: i64, key: &str) {
        if answer != 2 {
            return;
        }
        let ops = &self.inner.ops;
        let lost = ops.notices_lost.fetch_add(1, Ordering::Relaxed) + 1;
        if let Some(held_back) = ops.notices_lost_log.due() {
            tracing::warn!(
                key,
                lost,
                held_back,
                "redis refused a pub/sub notice (does the ACL user lack channel rights? grant \
                 &* or allchannels); the change stands, and waiters elsewhere learn it by \
                 polling"
            );
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
        self.guarded(Class::Refusable, |conn| send(cmd, conn)).await
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
        self.guarded_for(class, self.inner.command_timeout, call)
            .await
    }

    /// [`Redis::guarded`] bounded by `after` rather than the command timeout.
    async fn guarded_for<T, Fut>(
        &self,
        class: Class,
        after: Duration,
        call: impl FnOnce(Conn) -> Fut,
    ) -> Result<T, StoreError>
    where
        Fut: Future<Output = redis::RedisResult<T>>,
    {
        let breaker = &self.inner.breaker;
        if self.inner.link.moved() {
            // A new primary, connected: what opened the breaker was the old one.
            breaker.admit_anyway().record(true);
        }
        // Dropped with this future (its caller went away mid-command), the
        // permit is no event: a cancelled probe never wedges the breaker.
        let permit = match class {
            Class::Refusable => breaker
                .admit()
                .map_err(|retry_in| StoreError::BreakerOpen { retry_in })?,
            Class::MustTry => breaker.admit_anyway(),
        };
        if permit.is_probe()
            && let Err(e) = self.reach(after).await
        {
            permit.record(false);
            self.inner.link.suspect();
            return Err(e);
        }
        self.inner.commands.incr();
        let result = self.bounded(after, call(self.inner.link.conn())).await;
        let fault = matches!(&result, Err(e) if e.is_store_fault());
        permit.record(!fault);
        if fault {
            // Behind Sentinel the primary may have moved: look it up again.
            self.inner.link.suspect();
        }
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

    /// Whether the server can be reached, asked before a probe: a `PING`,
    /// sent again once if the first failed on the connection. After an
    /// outage the connection that saw it fails its next command whatever the
    /// server's state now (it reconnects meanwhile); that stale failure must
    /// not decide the probe, or every outage keeps the breaker open for a
    /// second cooldown. That failure may be a refusal or a reconnection
    /// attempt that timed out while the server was away (one that hung until
    /// the connect timeout: a host dropping connections, a server not
    /// accepting yet): a timeout that comes back before `after` is such a
    /// stale one. Only a server that cannot be reached fails this: any
    /// answer, an error reply included, leaves the decision to the call.
    async fn reach(&self, after: Duration) -> Result<(), StoreError> {
        let cmd = redis::cmd("PING");
        let ping = || send::<redis::Value>(&cmd, self.inner.link.conn());
        let sent = tokio::time::Instant::now();
        let answered = match self.bounded(after, ping()).await {
            Err(StoreError::Unavailable(_)) => self.bounded(after, ping()).await,
            Err(StoreError::Timeout { .. }) if sent.elapsed() < after => {
                self.bounded(after, ping()).await
            }
            answered => answered,
        };
        match answered {
            Err(e @ (StoreError::Unavailable(_) | StoreError::Timeout { .. })) => Err(e),
            _ => Ok(()),
        }
    }

    async fn bounded<T>(
        &self,
        after: Duration,
        fut: impl Future<Output = redis::RedisResult<T>>,
    ) -> Result<T, StoreError> {
        match crate::store::guard(after, || fut).await {
            Err(fault) => Err(fault.into()),
            Ok(Ok(v)) => Ok(v),
            Ok(Err(e)) if e.is_timeout() => Err(StoreError::Timeout { after }),
            Ok(Err(e)) if connection::is_auth_error(&e) => Err(StoreError::Auth(Arc::new(e))),
            // A primary demoted to replica by a failover (the store cannot serve this
            // instance until it follows the new primary), or a server that cannot serve now:
            // it answered, and did nothing.
            Ok(Err(e))
                if e.kind() == redis::ErrorKind::Server(redis::ServerErrorKind::ReadOnly)
                    || is_not_serving_now(&e) =>
            {
                Err(StoreError::NotServing(Arc::new(e)))
            }
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
///
/// A server that answers but cannot serve now (see [`is_not_serving_now`])
/// is not one.
fn is_reply_error(e: &redis::RedisError) -> bool {
    !(e.is_io_error()
        || e.is_connection_dropped()
        || e.is_connection_refusal()
        || e.is_cluster_error()
        || e.is_timeout()
        || is_not_serving_now(e))
        && e.kind() != redis::ErrorKind::Client
}

/// A server that answers but cannot serve for now: `LOADING` its data after
/// a restart, `BUSY` running another client's slow script, `MASTERDOWN`,
/// `NOREPLICAS`, `TRYAGAIN`, `CLUSTERDOWN`, `OOM` (at `maxmemory` under
/// `noeviction`: writes are refused until memory is freed). It is unavailable,
/// not refusing: the breaker counts it, and a caller with a policy for an
/// outage applies it.
fn is_not_serving_now(e: &redis::RedisError) -> bool {
    matches!(e.retry_method(), redis::RetryMethod::WaitAndRetry)
        || matches!(e.code(), Some("BUSY" | "NOREPLICAS" | "OOM"))
}

/// Every string in `value`, in order (nested arrays and maps flattened).
fn flatten_strings(value: &redis::Value, out: &mut Vec<String>) {
    match value {
        redis::Value::BulkString(b) => out.push(String::from_utf8_lossy(b).into_owned()),
        redis::Value::SimpleString(s) => out.push(s.clone()),
        redis::Value::Array(items) | redis::Value::Set(items) => {
            items.iter().for_each(|v| flatten_strings(v, out));
        }
        redis::Value::Map(pairs) => {
            for (k, v) in pairs {
                flatten_strings(k, out);
                flatten_strings(v, out);
            }
        }
        _ => {}
    }
}

/// Sends `cmd` on `conn`.
async fn send<T: FromRedisValue>(cmd: &Cmd, conn: Conn) -> redis::RedisResult<T> {
    match conn {
        Conn::Single(mut c) => cmd.query_async(&mut c).await,
        Conn::Cluster(mut c) => cmd.query_async(&mut c).await,
    }
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

impl Redis {
    /// The server's time in µs for the stored key `key` (`{prefix:…}…`): pinned by a
    /// test, or this instance's estimate of the clock of the server that holds `key` (on a
    /// cluster, its slot's primary; see `server_clock`). `None` while no good estimate
    /// exists: the caller then writes nothing stamped with it and leaves the time to the
    /// server's `TIME`.
    pub(crate) fn server_now_us(&self, key: &str) -> Option<u64> {
        if let Some(pinned) = self.pinned_us_at() {
            return Some(pinned);
        }
        self.clock_reading(|| server_clock::slot_of(key.as_bytes()))
            .map(|r| r.now_us)
    }

    /// [`Redis::server_now_us`] in ms, for the logical key `key` (stored as
    /// `{prefix:key}…`).
    pub(crate) fn server_now_ms_of(&self, key: &str) -> Option<u64> {
        if let Some(pinned) = self.pinned_ms() {
            return Some(pinned);
        }
        self.clock_reading(|| server_clock::slot_of_logical(&self.inner.prefix, key))
            .map(|r| r.now_us / 1_000)
    }

    /// The estimate of the server's clock for the stored key `key` and the most it can be
    /// off (µs), if a good one exists. For tests of the bound.
    #[cfg(any(test, feature = "test-util"))]
    #[cfg_attr(docsrs, doc(cfg(feature = "test-util")))]
    #[must_use]
    pub fn clock_estimate(&self, key: &str) -> Option<(u64, u64)> {
        self.clock_reading(|| server_clock::slot_of(key.as_bytes()))
            .map(|r| (r.now_us, r.bound_us))
    }

    /// The estimate for a key of `slot`, starting a measurement if one is due.
    #[inline]
    fn clock_reading(&self, slot: impl FnOnce() -> u16) -> Option<server_clock::Reading> {
        let epoch = self.link_epoch();
        let (reading, mono) = self.inner.clock.read(slot, epoch.unwrap_or(u64::MAX));
        self.resync_clock_when_due(mono);
        reading.filter(|_| epoch.is_some())
    }

    /// Which connection an estimate was measured on: it changes with every reconnection
    /// and every Sentinel failover followed, so an estimate of a server since replaced is
    /// never used. `None` while a command failed on the connection and none succeeded
    /// since (the server may be another one when it answers again).
    fn link_epoch(&self) -> Option<u64> {
        let ops = &self.inner.ops;
        if ops.link_lost.load(Ordering::Relaxed) {
            return None;
        }
        let reconnects = ops.reconnects.load(Ordering::Relaxed);
        Some(reconnects.wrapping_add(self.inner.link.failovers().wrapping_shl(32)))
    }

    /// Measures the server's clock (in the background) if a measurement is due at
    /// monotonic time `mono_us`: every 10 s, at once after a reconnection, a failover or a
    /// jump of this host's clocks, and on a cluster a look at the slot map every second.
    fn resync_clock_when_due(&self, mono_us: u64) {
        let clock = &self.inner.clock;
        if !clock.claim_sync(mono_us) {
            return;
        }
        let Ok(runtime) = tokio::runtime::Handle::try_current() else {
            clock.done(false);
            return;
        };
        // Made before the spawn: a task dropped unpolled frees the next measurement.
        let mut syncing = ClockSync {
            redis: self.clone(),
            ok: false,
        };
        runtime.spawn(async move {
            match syncing.redis.sync_clock().await {
                Ok(()) => syncing.succeeded(),
                Err(error) => {
                    tracing::debug!(%error, "measuring the Redis server's clock failed");
                }
            }
        });
    }

    /// Measures what is due now, in the caller's task (at connect).
    pub(super) async fn sync_clock_now(&self) {
        let clock = &self.inner.clock;
        if !clock.claim_sync(clock.clocks.mono_us()) {
            return;
        }
        let ok = match self.sync_clock().await {
            Ok(()) => true,
            Err(error) => {
                tracing::debug!(%error, "measuring the Redis server's clock failed; trying again later");
                false
            }
        };
        clock.done(ok);
    }

    /// Off a cluster, measures the server's clock if due; on one, reads the slot map and
    /// measures every primary whose estimate is due, all at once.
    async fn sync_clock(&self) -> Result<(), StoreError> {
        let clock = &self.inner.clock;
        let epoch = self.link_epoch().ok_or_else(|| {
            StoreError::unavailable(redis::RedisError::from((
                redis::ErrorKind::Io,
                "the connection failed and has not answered since",
            )))
        })?;
        if !clock.is_cluster() {
            let estimate = clock.single();
            if estimate.needs_measuring(clock.clocks.mono_us(), epoch, clock.max_error_us) {
                let best = self.measure(None, epoch).await?;
                estimate.offer(best, clock.clocks.mono_us());
            }
            return Ok(());
        }
        let reply: redis::Value = self
            .bounded(
                self.inner.command_timeout,
                send(redis::cmd("CLUSTER").arg("SLOTS"), self.inner.link.conn()),
            )
            .await?;
        let old = clock.map();
        let map = server_clock::SlotMap::from_reply(&reply, old.as_deref())
            .ok_or_else(|| StoreError::Protocol(format!("CLUSTER SLOTS answered {reply:?}")))?;
        if clock.install_map(map) {
            tracing::debug!(
                "the Redis Cluster's slot map changed: measuring new primaries' clocks"
            );
        }
        let map = clock.map().expect("installed");
        let mono = clock.clocks.mono_us();
        let due = map
            .nodes
            .iter()
            .filter(|n| n.estimate.needs_measuring(mono, epoch, clock.max_error_us));
        let measured = futures_util::future::join_all(due.map(|node| async move {
            let best = self.measure(Some(node), epoch).await?;
            node.estimate.offer(best, clock.clocks.mono_us());
            Ok::<_, StoreError>(())
        }))
        .await;
        measured.into_iter().collect()
    }

    /// [`server_clock::SAMPLES`] `TIME`s in a row, each between two readings of the
    /// monotonic clock, on a cluster routed to `node`; the best one within the allowed
    /// error. Not counted in [`RedisStats::commands`], and outside the breaker (a failed
    /// measurement only leaves the estimate unused).
    async fn measure(
        &self,
        node: Option<&server_clock::Node>,
        epoch: u64,
    ) -> Result<Option<server_clock::Sample>, StoreError> {
        let clock = &self.inner.clock;
        let pair = clock.clocks.pair();
        let mut samples = Vec::with_capacity(server_clock::SAMPLES);
        for _ in 0..server_clock::SAMPLES {
            let before = clock.clocks.mono_us();
            let server = self
                .bounded(self.inner.command_timeout, self.read_time(node))
                .await?;
            let after = clock.clocks.mono_us();
            samples.push(server_clock::Sample::new(
                before, server, after, pair, epoch,
            ));
        }
        let (best, rejected) = clock.best(&samples);
        if rejected > 0 {
            tracing::debug!(
                rejected,
                of = samples.len(),
                "TIME samples took longer than the allowed clock error allows"
            );
        }
        Ok(best)
    }

    /// One `TIME` in µs; on a cluster, sent to `node` with `CLUSTER MYID` in the same
    /// pipeline, and refused if another node answered (the slot map moved).
    async fn read_time(&self, node: Option<&server_clock::Node>) -> redis::RedisResult<i64> {
        let time = |v: redis::Value| -> redis::RedisResult<i64> {
            let (s, us): (i64, i64) = redis::from_redis_value(v)?;
            Ok(s.saturating_mul(1_000_000).saturating_add(us))
        };
        match (self.inner.link.conn(), node) {
            (Conn::Cluster(mut c), Some(node)) => {
                use redis::cluster_routing::{Route, SingleNodeRoutingInfo, SlotAddr};
                let mut pipe = redis::pipe();
                pipe.cmd("TIME").cmd("CLUSTER").arg("MYID");
                let route =
                    SingleNodeRoutingInfo::SpecificNode(Route::new(node.slot, SlotAddr::Master));
                let mut replies = c.route_pipeline(pipe, 0, 2, route).await?.into_iter();
                let (Some(server), Some(id)) = (replies.next(), replies.next()) else {
                    return Err((
                        redis::ErrorKind::Client,
                        "TIME and CLUSTER MYID: short reply",
                    )
                        .into());
                };
                let id: String = redis::from_redis_value(id)?;
                if id != node.id {
                    self.inner.clock.forget_map();
                    return Err((
                        redis::ErrorKind::Client,
                        "TIME answered by another node than the slot map says: reading the map again",
                    )
                        .into());
                }
                time(server)
            }
            (conn, _) => time(send(&redis::cmd("TIME"), conn).await?),
        }
    }
}

/// Frees the next measurement of the server's clock when one ends, however it ends.
struct ClockSync {
    redis: Redis,
    ok: bool,
}

impl ClockSync {
    fn succeeded(&mut self) {
        self.ok = true;
    }
}

impl Drop for ClockSync {
    fn drop(&mut self) {
        self.redis.inner.clock.done(self.ok);
    }
}

/// Server time in ms, or the pinned time a test passed as the last ARGV.
const NOW: &str = r"
local function now_ms(pinned)
  if pinned ~= nil and pinned ~= '' then return tonumber(pinned) end
  local t = redis.call('TIME')
  return tonumber(t[1]) * 1000 + math.floor(tonumber(t[2]) / 1000)
end
";

pub(crate) fn cached(
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

/// An integer in a script's reply (an integer, or its digits as a bulk string).
pub(crate) fn int(v: Option<&redis::Value>) -> Result<i64, StoreError> {
    match v {
        Some(redis::Value::Int(n)) => Ok(*n),
        Some(redis::Value::BulkString(b)) => std::str::from_utf8(b)
            .ok()
            .and_then(|s| s.parse().ok())
            .ok_or_else(|| StoreError::Protocol("expected an integer".to_owned())),
        other => Err(StoreError::Protocol(format!(
            "expected an integer, got {other:?}"
        ))),
    }
}

pub(crate) fn ms(d: Duration) -> u64 {
    u64::try_from(d.as_millis()).unwrap_or(u64::MAX).max(1)
}

impl Redis {
    /// The pinned time as a script argument, or empty for the server's `TIME`.
    pub(crate) fn pinned(&self) -> String {
        self.pinned_ms().map(|n| n.to_string()).unwrap_or_default()
    }

    /// The time a test pinned, in ms since the epoch.
    pub(crate) fn pinned_ms(&self) -> Option<u64> {
        self.pinned_us_at().map(|us| us / 1_000)
    }

    /// The time a test pinned, in µs since the epoch (rate limiting reads it so).
    pub(crate) fn pinned_us_at(&self) -> Option<u64> {
        match self.inner.pinned_now.load(Ordering::Relaxed) {
            0 => None,
            n => Some(n - 1),
        }
    }

    /// Pins the time scripts read (ms since the epoch, 0 included) instead
    /// of the server's `TIME`. For tests that need exact instants.
    #[cfg(any(test, feature = "test-util"))]
    #[cfg_attr(docsrs, doc(cfg(feature = "test-util")))]
    pub fn pin_time(&self, now_ms: u64) {
        self.pin_time_us(now_ms.saturating_mul(1_000));
    }

    /// [`Redis::pin_time`] to the microsecond, which rate limiting reads
    /// (other scripts read its milliseconds).
    #[cfg(any(test, feature = "test-util"))]
    #[cfg_attr(docsrs, doc(cfg(feature = "test-util")))]
    pub fn pin_time_us(&self, now_us: u64) {
        // Stored plus one, so that 0 can mean "not pinned".
        let stored = now_us.saturating_add(1);
        self.inner.pinned_now.store(stored, Ordering::Relaxed);
    }

    /// Goes back to the server's `TIME` after [`Redis::pin_time`].
    #[cfg(any(test, feature = "test-util"))]
    #[cfg_attr(docsrs, doc(cfg(feature = "test-util")))]
    pub fn unpin_time(&self) {
        self.inner.pinned_now.store(0, Ordering::Relaxed);
    }
}

#[cfg(test)]
#[path = "../../tests/support/redis.rs"]
#[allow(dead_code, unreachable_pub)]
mod harness;

/// Runs `check` against a fresh single node, then a fresh 3-node cluster.
#[cfg(test)]
pub(crate) async fn each_server(test: &str, check: impl AsyncFn(Redis)) {
    each_server_with(test, |builder| builder, check).await;
}

/// [`each_server`] on backends `configure` sets up (another command timeout, for a test
/// that checks what is decided rather than how fast; other settings).
#[cfg(test)]
pub(crate) async fn each_server_with(
    test: &str,
    configure: impl Fn(RedisBuilder) -> RedisBuilder,
    check: impl AsyncFn(Redis),
) {
    if let Some(node) = harness::RedisNode::start(test) {
        check(
            configure(Redis::builder(node.url()))
                .connect()
                .await
                .expect("connects"),
        )
        .await;
    }
    if let Some(cluster) = harness::RedisCluster::start(test) {
        check(
            configure(Redis::cluster(cluster.urls()))
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

    /// The server's `TIME` now, on a cluster from the primary of `key`'s slot.
    async fn server_time_of(redis: &Redis, key: &str) -> u64 {
        let cmd = redis::cmd("TIME");
        let value = match redis.inner.link.conn() {
            Conn::Cluster(mut c) => {
                use redis::cluster_routing::{Route, RoutingInfo, SingleNodeRoutingInfo, SlotAddr};
                let route =
                    SingleNodeRoutingInfo::SpecificNode(Route::with_key(key, SlotAddr::Master));
                c.route_command(cmd, RoutingInfo::SingleNode(route)).await
            }
            conn => send::<redis::Value>(&cmd, conn).await,
        };
        let (s, us): (u64, u64) =
            redis::from_redis_value(value.expect("TIME")).expect("two integers");
        s * 1_000_000 + us
    }

    #[tokio::test]
    async fn every_key_reads_an_estimate_of_its_own_servers_clock_within_its_bound() {
        each_server("server_clock", async |redis: Redis| {
            if let Some(map) = redis.inner.clock.map() {
                assert_eq!(map.nodes.len(), 3, "one estimate per primary");
                for node in &map.nodes {
                    assert!(
                        node.estimate.sample().is_some(),
                        "{} measured at connect",
                        node.id
                    );
                }
            }
            // Keys on every primary of a cluster.
            for key in ["{a}", "{b}", "{c}", "{d}", "{e}", "{f}", "{g}"] {
                // The server reads TIME between the two readings of the estimate, so its
                // reading lies between the first less its bound and the second plus its bound.
                let (early, early_bound) = redis.clock_estimate(key).expect("measured");
                let truth = server_time_of(&redis, key).await;
                let (late, late_bound) = redis.clock_estimate(key).expect("measured");
                assert!(
                    early.saturating_sub(early_bound) <= truth && truth <= late + late_bound,
                    "{key}: {early} ±{early_bound} .. {late} ±{late_bound}, server {truth}"
                );
                assert!(early_bound < 5_000, "within the default allowed error");
            }
            // A reconnection: the estimate is not used until measured again.
            redis.inner.ops.reconnects.fetch_add(1, Ordering::Relaxed);
            assert_eq!(redis.server_now_us("{a}"), None);
            let deadline = tokio::time::Instant::now() + Duration::from_secs(20);
            while redis.clock_estimate("{a}").is_none() {
                assert!(tokio::time::Instant::now() < deadline, "measured again");
                tokio::time::sleep(Duration::from_millis(5)).await;
            }
            // A failed command: none until one succeeds.
            redis.inner.ops.link_lost.store(true, Ordering::Release);
            assert_eq!(redis.server_now_us("{a}"), None);
            redis.ping().await.unwrap();
            assert_eq!(redis.server_now_us("{a}"), None, "a reconnection since");
        })
        .await;
    }

    /// A slot map that moved (a failover, resharding) is caught by the node id that answers
    /// each `TIME`: the map is forgotten, no key of the cluster reads an estimate until it is
    /// read and measured again, and then every key does.
    #[tokio::test]
    async fn a_time_answered_by_another_node_than_the_map_says_makes_the_map_read_again() {
        let Some(cluster) = harness::RedisCluster::start("clock_stale_map") else {
            return;
        };
        let redis = Redis::cluster(cluster.urls())
            .connect()
            .await
            .expect("connects");
        let map = redis.inner.clock.map().expect("read at connect");
        let stale = server_clock::Node {
            id: "a-node-that-left".to_owned(),
            slot: map.nodes[0].slot,
            estimate: Arc::default(),
        };
        assert!(
            redis.read_time(Some(&stale)).await.is_err(),
            "another node answered"
        );
        assert!(redis.inner.clock.map().is_none(), "the map is read again");
        assert_eq!(redis.server_now_us("{a}"), None);
        let deadline = tokio::time::Instant::now() + Duration::from_secs(20);
        while ["{a}", "{b}", "{c}", "{d}"]
            .iter()
            .any(|k| redis.clock_estimate(k).is_none())
        {
            assert!(
                tokio::time::Instant::now() < deadline,
                "read and measured again"
            );
            tokio::time::sleep(Duration::from_millis(5)).await;
        }
        assert_eq!(redis.inner.clock.map().expect("read").nodes.len(), 3);
    }

    #[tokio::test]
    async fn keys_carry_one_hash_tag_around_the_whole_logical_key() {
        let b = Redis::builder("redis://127.0.0.1:1").with_prefix("app");
        // No connection needed to name keys: build the parts by hand.
        let inner = Inner {
            link: Link::Fixed {
                conn: Conn::Single(
                    ConnectionManager::new_lazy_with_config(
                        redis::Client::open(b.nodes[0].as_str()).expect("url"),
                        connection::manager_config(Duration::from_secs(1)),
                    )
                    .expect("lazy manager"),
                ),
                subscribers: vec![],
                sharded: None,
            },
            prefix: b.prefix,
            command_timeout: b.command_timeout,
            breaker: Breaker::new(b.breaker),
            commands: crate::stats::Counter::default(),
            pinned_now: AtomicU64::new(0),
            clock: server_clock::ServerClock::new(
                server_clock::Clocks::default(),
                server_clock::DEFAULT_MAX_ERROR,
                false,
            ),
            pubsub: pubsub::PubSub::default(),
            slices: Slices::default(),
            rate_limit_queue: None,
            local_answers: None,
            fresh_key_writes: true,
            durable: None,
            ops: OpsCounters::default(),
        };
        let redis = Redis {
            inner: Arc::new(inner),
        };
        assert_eq!(redis.key("user:1", ""), "{app:user:1}");
        assert_eq!(redis.key("user:1", ":lease"), "{app:user:1}:lease");
    }
}
