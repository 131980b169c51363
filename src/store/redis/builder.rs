//! [`RedisBuilder`]: where Redis is, how it is reached (TLS, ACL user, Sentinel, cluster),
//! its timeouts, breaker and options, and `connect`.

use std::sync::Arc;
use std::sync::atomic::AtomicU64;
use std::time::Duration;

use super::connection::{self, Link, Security, Topology};
use super::{Conn, Inner, OpsCounters, Redis, Slices, durable, pubsub, server_clock};
use crate::store::{Breaker, BreakerConfig, StoreError};

pub(super) const DEFAULT_PREFIX: &str = "throttlebeam";

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
#[derive(Clone)]
#[must_use]
pub struct RedisBuilder {
    pub(super) nodes: Vec<String>,
    pub(super) topology: Topology,
    /// Boxed: most builders carry none, and builders move by value.
    pub(super) security: Box<Security>,
    /// What was wrong with the URL or the environment, reported by `connect`.
    pub(super) problem: Option<String>,
    pub(super) prefix: String,
    pub(super) connect_timeout: Duration,
    pub(super) command_timeout: Duration,
    pub(super) breaker: BreakerConfig,
    /// See `RedisBuilder::with_rate_limit_queue` (`None`: the rate limiter's default).
    pub(crate) rate_limit_queue: Option<std::num::NonZeroUsize>,
    /// See `RedisBuilder::with_durable_claims`.
    pub(super) durable_claims: Option<durable::Durability>,
    /// See `RedisBuilder::with_local_answers` (`None`: the rate limiter's default).
    pub(crate) local_answers: Option<usize>,
    /// See `RedisBuilder::with_fresh_key_writes`.
    pub(crate) fresh_key_writes: bool,
    /// See [`RedisBuilder::with_max_clock_error`].
    pub(super) max_clock_error: Duration,
    /// See `RedisBuilder::with_client_clock`.
    pub(super) clocks: server_clock::Clocks,
}

impl std::fmt::Debug for RedisBuilder {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        let nodes: Vec<String> = self.nodes.iter().map(|n| connection::redact(n)).collect();
        f.debug_struct("RedisBuilder")
            .field("nodes", &nodes)
            .field("topology", &self.topology)
            .field("security", &self.security)
            .field("problem", &self.problem)
            .field("prefix", &self.prefix)
            .field("connect_timeout", &self.connect_timeout)
            .field("command_timeout", &self.command_timeout)
            .field("breaker", &self.breaker)
            .field("rate_limit_queue", &self.rate_limit_queue)
            .field("local_answers", &self.local_answers)
            .field("fresh_key_writes", &self.fresh_key_writes)
            .field("max_clock_error", &self.max_clock_error)
            .finish_non_exhaustive()
    }
}

impl RedisBuilder {
    pub(super) fn from_url(url: String) -> Self {
        match connection::parse(&url) {
            Ok(parsed) => {
                let mut builder = Self::new(parsed.nodes, parsed.topology);
                let security = &mut builder.security;
                security.username = parsed.username;
                security.password = parsed.password;
                security.sentinel_username = parsed.sentinel_username;
                security.sentinel_password = parsed.sentinel_password;
                builder
            }
            Err(problem) => {
                let mut builder = Self::new(vec![url], Topology::Single);
                builder.problem = Some(problem);
                builder
            }
        }
    }

    pub(super) fn new(nodes: Vec<String>, topology: Topology) -> Self {
        Self {
            nodes,
            topology,
            security: Box::default(),
            problem: None,
            prefix: DEFAULT_PREFIX.to_owned(),
            connect_timeout: Duration::from_secs(1),
            command_timeout: Duration::from_millis(500),
            breaker: BreakerConfig::default(),
            rate_limit_queue: None,
            durable_claims: None,
            local_answers: None,
            fresh_key_writes: true,
            max_clock_error: server_clock::DEFAULT_MAX_ERROR,
            clocks: server_clock::Clocks::default(),
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

    /// The most this instance's estimate of the server's clock may be off for it to be
    /// used (default 5 ms).
    ///
    /// Two writes are stamped with that estimate rather than the server's `TIME`, to save
    /// a script call: a fresh key's first rate-limit check (see
    /// [`with_fresh_key_writes`](Self::with_fresh_key_writes)) and a leading throttle
    /// window's end. The estimate is measured with `TIME` (the best of 5 in a row, every
    /// 10 s, and at once after a reconnection, a failover or a jump of this host's clocks;
    /// on a cluster, per primary) on this host's monotonic clock, and its error is at most
    /// half the best sample's round trip plus 100 ppm of the time since. While that bound
    /// is over `max_error` (a slow or loaded link, no sample yet), those writes go to the
    /// server's `TIME` like every other decision: the bound is a guarantee, not a typical
    /// figure.
    ///
    /// # Examples
    ///
    /// ```no_run
    /// # async fn demo() -> Result<(), throttlebeam::store::StoreError> {
    /// use std::time::Duration;
    /// use throttlebeam::store::Redis;
    ///
    /// // Across regions: a 20 ms round trip still stamps fresh keys, within 12 ms.
    /// let redis = Redis::builder("redis://10.0.0.5:6379")
    ///     .with_max_clock_error(Duration::from_millis(12))
    ///     .connect()
    ///     .await?;
    /// # drop(redis);
    /// # Ok(()) }
    /// ```
    pub fn with_max_clock_error(mut self, max_error: Duration) -> Self {
        self.max_clock_error = max_error;
        self
    }

    /// Reads this host's clocks through `clock` (feature `test-util`), whose steps a test
    /// makes: a wall clock stepped, a monotonic clock that stood still.
    #[cfg(any(test, feature = "test-util"))]
    #[cfg_attr(docsrs, doc(cfg(feature = "test-util")))]
    pub fn with_client_clock(mut self, clock: super::SteppedClock) -> Self {
        self.clocks = server_clock::Clocks::Stepped(clock);
        self
    }

    /// The ACL user every connection authenticates as (`AUTH user pass`),
    /// overriding the URL's. Behind Sentinel, the data nodes' user (see
    /// [`with_sentinel_credentials`](Self::with_sentinel_credentials)).
    ///
    /// Refused credentials fail [`connect`](Self::connect) with
    /// [`StoreError::Auth`].
    ///
    /// # Examples
    ///
    /// ```no_run
    /// # async fn demo() -> Result<(), throttlebeam::store::StoreError> {
    /// use throttlebeam::store::Redis;
    ///
    /// // The same as redis://app:s3cret@10.0.0.5:6379
    /// let redis = Redis::builder("redis://10.0.0.5:6379")
    ///     .with_username("app")
    ///     .with_password("s3cret")
    ///     .connect()
    ///     .await?;
    /// # Ok(()) }
    /// ```
    pub fn with_username(mut self, username: impl Into<String>) -> Self {
        self.security.username = Some(username.into());
        self
    }

    /// The password every connection authenticates with (the ACL user's,
    /// or the `default` user's `requirepass`), overriding the URL's.
    pub fn with_password(mut self, password: impl Into<String>) -> Self {
        self.security.password = Some(password.into());
        self
    }

    /// The user and password for the Sentinels themselves, when they
    /// require one (`requirepass` in `sentinel.conf`): the URL's credentials
    /// are the data nodes'. In a URL: `?sentinel_username=…&sentinel_password=…`.
    pub fn with_sentinel_credentials(
        mut self,
        username: Option<String>,
        password: impl Into<String>,
    ) -> Self {
        self.security.sentinel_username = username;
        self.security.sentinel_password = Some(password.into());
        self
    }

    /// Trusts the certificate authorities in `pem` (one or more
    /// `-----BEGIN CERTIFICATE-----` blocks) instead of the system's roots,
    /// for a `rediss://` URL: a managed Redis with its own CA, or a server
    /// with a self-made one. The server's certificate must also name the
    /// host of the URL (or its IP address).
    ///
    /// A PEM that holds no certificate fails [`connect`](Self::connect) with
    /// [`StoreError::Config`]; a server whose certificate this CA did not sign
    /// fails it with [`StoreError::Auth`].
    ///
    /// # Examples
    ///
    /// ```no_run
    /// # async fn demo() -> Result<(), Box<dyn std::error::Error>> {
    /// use throttlebeam::store::Redis;
    ///
    /// let redis = Redis::builder("rediss://app:s3cret@redis.internal:6380")
    ///     .with_ca_pem(std::fs::read("/etc/redis/ca.pem")?)
    ///     .with_client_cert_pem(
    ///         std::fs::read("/etc/redis/client.pem")?,
    ///         std::fs::read("/etc/redis/client.key")?,
    ///     )
    ///     .connect()
    ///     .await?;
    /// # Ok(()) }
    /// ```
    #[cfg(feature = "redis-tls")]
    #[cfg_attr(docsrs, doc(cfg(feature = "redis-tls")))]
    pub fn with_ca_pem(mut self, pem: impl Into<Vec<u8>>) -> Self {
        self.security.ca_pem = Some(pem.into());
        self
    }

    /// Presents this client certificate chain (PEM) and its private key
    /// (PEM: PKCS#8, PKCS#1 or SEC1) to the server: mutual TLS, for a server
    /// started with `tls-auth-clients yes`.
    ///
    /// A PEM that holds no certificate or no key fails
    /// [`connect`](Self::connect) with [`StoreError::Config`].
    #[cfg(feature = "redis-tls")]
    #[cfg_attr(docsrs, doc(cfg(feature = "redis-tls")))]
    pub fn with_client_cert_pem(
        mut self,
        cert_pem: impl Into<Vec<u8>>,
        key_pem: impl Into<Vec<u8>>,
    ) -> Self {
        self.security.client_pem = Some((cert_pem.into(), key_pem.into()));
        self
    }

    pub(super) fn validate(&self) -> Result<(), StoreError> {
        if let Some(problem) = &self.problem {
            return Err(StoreError::Config(problem.clone()));
        }
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
        self.validate_durable_claims()
    }

    /// Connects. A single node is reached through a reconnecting connection
    /// manager; a cluster through a cluster client that follows the slot map;
    /// a primary behind Sentinel through a connection manager to the primary
    /// the Sentinels name, moved to the new primary when they name another
    /// (see [`Redis`]'s "Connections").
    ///
    /// # Errors
    ///
    /// [`StoreError::Config`] for a bad URL, PEM or setting (the message
    /// says which, with any password masked), [`StoreError::Auth`] if the
    /// server refused the credentials or the TLS handshake failed on trust
    /// (a wrong CA, a client certificate refused), [`StoreError::Unavailable`]
    /// or [`StoreError::Timeout`] if no node answered in time.
    pub async fn connect(self) -> Result<Redis, StoreError> {
        self.validate()?;
        let link = match &self.topology {
            Topology::Cluster => {
                let client = connection::cluster_client(
                    &self.nodes,
                    &self.security,
                    self.connect_timeout,
                    self.command_timeout,
                )?;
                let subscribers = self
                    .nodes
                    .iter()
                    .map(|n| connection::client(n, &self.security))
                    .collect::<Result<Vec<_>, _>>()?;
                let connecting = client.get_async_connection();
                let conn = match tokio::time::timeout(self.connect_timeout, connecting)
                    .await
                    .map_err(|_| StoreError::Timeout {
                        after: self.connect_timeout,
                    })? {
                    Ok(conn) => conn,
                    Err(e) => {
                        // The cluster client folds its nodes' errors into
                        // one message: ask a seed node directly why.
                        let diagnosed =
                            connection::diagnose(&subscribers, self.connect_timeout).await;
                        return Err(diagnosed.unwrap_or_else(|| connection::connect_error(e)));
                    }
                };
                Link::Fixed {
                    conn: Conn::Cluster(conn),
                    subscribers,
                    sharded: Some(Box::new(connection::sharded_client(
                        &self.nodes,
                        &self.security,
                        self.connect_timeout,
                    )?)),
                }
            }
            Topology::Single => {
                let client = connection::client(&self.nodes[0], &self.security)?;
                let conn = connection::manage(client.clone(), self.connect_timeout).await?;
                Link::Fixed {
                    conn: Conn::Single(conn),
                    subscribers: vec![client],
                    sharded: None,
                }
            }
            Topology::Sentinel { master, db } => Link::Sentinel(
                connection::Follower::connect(
                    &self.nodes,
                    master,
                    *db,
                    &self.security,
                    self.connect_timeout,
                )
                .await?,
            ),
        };
        let durable = self.durable_connection().await?;
        let redis = Redis {
            inner: Arc::new(Inner {
                link,
                prefix: self.prefix,
                command_timeout: self.command_timeout,
                breaker: Breaker::new(self.breaker),
                commands: crate::stats::Counter::default(),
                pinned_now: AtomicU64::new(0),
                clock: server_clock::ServerClock::new(
                    self.clocks,
                    self.max_clock_error,
                    self.topology == Topology::Cluster,
                ),
                pubsub: pubsub::PubSub::default(),
                slices: Slices::default(),
                rate_limit_queue: self.rate_limit_queue,
                local_answers: self.local_answers,
                fresh_key_writes: self.fresh_key_writes,
                durable,
                ops: OpsCounters::default(),
            }),
        };
        // Learn the server's clock now; if it does not answer, the first
        // write that would use it tries again (and goes to the server's TIME).
        redis.sync_clock_now().await;
        redis.check_eviction_policy().await;
        Ok(redis)
    }
}
