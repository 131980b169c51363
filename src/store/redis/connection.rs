//! Reaching Redis: the forms one URL may take (a node, a cluster, a primary
//! behind Sentinel), TLS and ACL credentials applied to every connection,
//! and a primary found through Sentinel and followed across a failover.

use std::sync::Arc;
use std::sync::atomic::Ordering;
use std::time::Duration;

use redis::aio::{ConnectionManager, ConnectionManagerConfig};
use redis::cluster::{ClusterClient, ClusterClientBuilder};
use redis::{ConnectionAddr, ConnectionInfo, IntoConnectionInfo};

pub(crate) use self::sentinel::Follower;
use super::Conn;
use crate::store::StoreError;

/// The port a Sentinel listens on when its address names none.
mod sentinel;

const SENTINEL_PORT: u16 = 26379;

/// The pause between two lookups of the primary through Sentinel while it
/// fails: the Sentinels are asked at most ten times a second, however many
/// commands fail.
const LOOKUP_INTERVAL: Duration = Duration::from_millis(100);

/// How often the primary is looked up while all is well: a failover that
/// leaves the old primary up (`SENTINEL FAILOVER`, a partition) is noticed
/// within this, not when the old primary, demoted, first refuses a write
/// (which Sentinel does up to 10 s later), so fewer writes land on it and
/// are lost.
const WATCH_INTERVAL: Duration = Duration::from_secs(1);

/// Which deployment a builder names.
#[derive(Debug, Clone, PartialEq, Eq)]
pub(super) enum Topology {
    /// One node (or a primary whose failover is not ours to follow).
    Single,
    /// A Redis Cluster, from seed nodes.
    Cluster,
    /// A primary found through Sentinels (the builder's nodes), by its
    /// master name, on database `db`.
    Sentinel {
        /// The name the Sentinels monitor the primary under.
        master: String,
        /// The database to select on the primary.
        db: i64,
    },
}

/// Credentials and certificates for every connection a backend makes.
#[derive(Clone, Default)]
pub(super) struct Security {
    /// ACL user (`AUTH user pass`); overrides the URL's.
    pub(super) username: Option<String>,
    /// Password (ACL user's, or `requirepass`); overrides the URL's.
    pub(super) password: Option<String>,
    /// ACL user on the Sentinels.
    pub(super) sentinel_username: Option<String>,
    /// Password on the Sentinels.
    pub(super) sentinel_password: Option<String>,
    /// Roots to trust instead of the system's, PEM.
    pub(super) ca_pem: Option<Vec<u8>>,
    /// Client certificate chain and private key, PEM (mutual TLS).
    pub(super) client_pem: Option<(Vec<u8>, Vec<u8>)>,
}

impl std::fmt::Debug for Security {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        let set = |v: bool| if v { "<set>" } else { "<none>" };
        f.debug_struct("Security")
            .field("username", &self.username)
            .field("password", &set(self.password.is_some()))
            .field("sentinel_username", &self.sentinel_username)
            .field("sentinel_password", &set(self.sentinel_password.is_some()))
            .field("ca_pem", &set(self.ca_pem.is_some()))
            .field("client_pem", &set(self.client_pem.is_some()))
            .finish()
    }
}

impl Security {
    fn wants_tls(&self) -> bool {
        self.ca_pem.is_some() || self.client_pem.is_some()
    }
}

/// What one URL string names: the topology, the node (or Sentinel) URLs,
/// and, for Sentinel, the data nodes' credentials (the URL's userinfo) and
/// the Sentinels' (its query).
#[derive(Debug, Clone, PartialEq, Eq)]
pub(super) struct Parsed {
    pub(super) topology: Topology,
    pub(super) nodes: Vec<String>,
    pub(super) username: Option<String>,
    pub(super) password: Option<String>,
    pub(super) sentinel_username: Option<String>,
    pub(super) sentinel_password: Option<String>,
}

/// Parses the forms [`Redis::builder`](super::Redis::builder) accepts (see
/// its docs). Errors name the URL with its password masked.
pub(super) fn parse(url: &str) -> Result<Parsed, String> {
    let url = url.trim();
    if url.is_empty() {
        return Err("the Redis URL is empty".to_owned());
    }
    let Some((scheme, rest)) = url.split_once("://") else {
        return Err(format!(
            "{:?} is not a Redis URL: it names no scheme (redis://, rediss://, \
             redis+cluster://, redis+sentinel://, or their rediss+ forms)",
            redact(url)
        ));
    };
    let single = |nodes| Parsed {
        topology: Topology::Single,
        nodes,
        username: None,
        password: None,
        sentinel_username: None,
        sentinel_password: None,
    };
    match scheme.to_ascii_lowercase().as_str() {
        "redis" | "rediss" | "valkey" | "valkeys" => {
            let nodes: Vec<String> = url
                .split(',')
                .map(str::trim)
                .filter(|n| !n.is_empty())
                .map(str::to_owned)
                .collect();
            if nodes.len() == 1 {
                return Ok(single(nodes));
            }
            // Several URLs: cluster seed nodes, each a full URL.
            if let Some(bad) = nodes.iter().find(|n| !n.contains("://")) {
                return Err(format!(
                    "{:?} lists several nodes, but {:?} is no URL: write each as \
                     redis://host:port, or use redis+cluster://host1:port,host2:port",
                    redact(url),
                    redact(bad)
                ));
            }
            Ok(Parsed {
                topology: Topology::Cluster,
                ..single(nodes)
            })
        }
        "redis+cluster" | "rediss+cluster" => {
            let base = &scheme[..scheme.len() - "+cluster".len()];
            let (userinfo, hosts, path, _) = authority(rest);
            let nodes = hosts
                .iter()
                .map(|h| format!("{base}://{userinfo}{h}{path}"))
                .collect::<Vec<_>>();
            if nodes.is_empty() {
                return Err(format!("{:?} names no node", redact(url)));
            }
            Ok(Parsed {
                topology: Topology::Cluster,
                ..single(nodes)
            })
        }
        "redis+sentinel" | "rediss+sentinel" => {
            let base = &scheme[..scheme.len() - "+sentinel".len()];
            let (userinfo, hosts, path, query) = authority(rest);
            if hosts.is_empty() {
                return Err(format!("{:?} names no Sentinel", redact(url)));
            }
            let mut parts = path.trim_matches('/').split('/').filter(|p| !p.is_empty());
            let Some(master) = parts.next() else {
                return Err(format!(
                    "{:?} names no master: write redis+sentinel://host:26379/<master name>[/<db>]",
                    redact(url)
                ));
            };
            let db = match parts.next() {
                None => 0,
                Some(db) => db.parse::<i64>().map_err(|_| {
                    format!("{:?}: the database {db:?} is not a number", redact(url))
                })?,
            };
            if parts.next().is_some() {
                return Err(format!(
                    "{:?}: the path holds more than <master name>/<db>",
                    redact(url)
                ));
            }
            // The URL's credentials are the data nodes', not the Sentinels'.
            let (username, password) = if userinfo.is_empty() {
                (None, None)
            } else {
                let info = format!("redis://{userinfo}127.0.0.1")
                    .into_connection_info()
                    .map_err(|e| format!("{:?}: {e}", redact(url)))?;
                let settings = info.redis_settings();
                (
                    settings.username().map(str::to_owned),
                    settings.password().map(str::to_owned),
                )
            };
            let nodes = hosts
                .iter()
                .map(|h| {
                    let h = if has_port(h) {
                        (*h).to_owned()
                    } else {
                        format!("{h}:{SENTINEL_PORT}")
                    };
                    format!("{base}://{h}")
                })
                .collect();
            let mut parsed = Parsed {
                topology: Topology::Sentinel {
                    master: percent_decode(master),
                    db,
                },
                nodes,
                username,
                password,
                sentinel_username: None,
                sentinel_password: None,
            };
            for pair in query.split('&').filter(|p| !p.is_empty()) {
                let (name, value) = pair.split_once('=').unwrap_or((pair, ""));
                match name {
                    "sentinel_username" => parsed.sentinel_username = Some(percent_decode(value)),
                    "sentinel_password" => parsed.sentinel_password = Some(percent_decode(value)),
                    other => {
                        return Err(format!(
                            "{:?}: unknown parameter {other:?} (known: sentinel_username, \
                             sentinel_password)",
                            redact(url)
                        ));
                    }
                }
            }
            Ok(parsed)
        }
        other => Err(format!(
            "{:?}: unknown scheme {other:?} (known: redis, rediss, redis+cluster, \
             rediss+cluster, redis+sentinel, rediss+sentinel)",
            redact(url)
        )),
    }
}

/// Splits `[userinfo@]host[,host...][/path][?query]` into the userinfo (with
/// its `@`), the hosts, the path (with its `/`) and the query.
fn authority(rest: &str) -> (&str, Vec<&str>, &str, &str) {
    let (rest, query) = rest.split_once('?').unwrap_or((rest, ""));
    let (auth, path) = match rest.find('/') {
        Some(i) => rest.split_at(i),
        None => (rest, ""),
    };
    let (userinfo, hosts) = match auth.rfind('@') {
        Some(i) => auth.split_at(i + 1),
        None => ("", auth),
    };
    let hosts = hosts
        .split(',')
        .map(str::trim)
        .filter(|h| !h.is_empty())
        .collect();
    (userinfo, hosts, path, query)
}

fn has_port(host: &str) -> bool {
    match host.rsplit_once(':') {
        Some((h, port)) => !h.ends_with('[') && !port.ends_with(']') && port.parse::<u16>().is_ok(),
        None => false,
    }
}

fn percent_decode(s: &str) -> String {
    let hex = |b: u8| char::from(b).to_digit(16);
    let bytes = s.as_bytes();
    let mut out = Vec::with_capacity(bytes.len());
    let mut i = 0;
    while i < bytes.len() {
        match (
            bytes[i],
            bytes.get(i + 1).copied().and_then(hex),
            bytes.get(i + 2).copied().and_then(hex),
        ) {
            (b'%', Some(high), Some(low)) => {
                out.push(u8::try_from(high * 16 + low).unwrap_or(b'?'));
                i += 3;
            }
            (b, _, _) => {
                out.push(b);
                i += 1;
            }
        }
    }
    String::from_utf8_lossy(&out).into_owned()
}

/// `url` with the password of its userinfo (if any) masked, for messages.
pub(super) fn redact(url: &str) -> String {
    let Some((scheme, rest)) = url.split_once("://") else {
        return url.to_owned();
    };
    let end = rest.find(['/', '?']).unwrap_or(rest.len());
    let (auth, tail) = rest.split_at(end);
    match auth.rfind('@') {
        Some(at) => {
            let (userinfo, hosts) = auth.split_at(at);
            let user = userinfo.split_once(':').map_or(userinfo, |(u, _)| u);
            let masked = if userinfo.contains(':') {
                format!("{user}:***")
            } else {
                user.to_owned()
            };
            format!("{scheme}://{masked}{hosts}{tail}")
        }
        None => url.to_owned(),
    }
}

/// A TLS URL (`rediss://`) without the `redis-tls` feature.
fn no_tls_feature(url: &str) -> StoreError {
    StoreError::Config(format!(
        "{:?} asks for TLS (rediss://): enable throttlebeam's `redis-tls` feature",
        redact(url)
    ))
}

/// How long an idle connection waits before TCP keepalive probes start.
const KEEPALIVE_IDLE: Duration = Duration::from_secs(5);

/// The pause between two keepalive probes; three unanswered close the connection.
const KEEPALIVE_INTERVAL: Duration = Duration::from_secs(1);

/// How long sent data may stay unacknowledged before the kernel closes the
/// connection (`TCP_USER_TIMEOUT`, Linux).
const USER_TIMEOUT: Duration = Duration::from_secs(10);

/// Every connection's TCP settings. A peer gone without FIN or RST (a host
/// lost, a partition, a NAT or load balancer that dropped the connection) is
/// noticed by the kernel, which closes the socket, so the connection fails and
/// is made again rather than hanging for the kernel's default of about 15
/// minutes of retransmissions: idle, within about 8 s (keepalive probes after
/// 5 s, every second, 3 unanswered); with a command unacknowledged, within
/// 10 s (`TCP_USER_TIMEOUT`). A pub/sub connection also proves it is alive
/// with `PING` (see `pubsub.rs`), which catches what TCP cannot: a peer whose
/// kernel acknowledges but whose server never answers.
pub(super) fn tcp_settings() -> redis::io::tcp::TcpSettings {
    use redis::io::tcp::socket2::TcpKeepalive;
    let keepalive = TcpKeepalive::new()
        .with_time(KEEPALIVE_IDLE)
        .with_interval(KEEPALIVE_INTERVAL);
    #[cfg(any(target_os = "linux", target_os = "android", target_os = "fuchsia"))]
    let keepalive = keepalive.with_retries(3);
    let settings = redis::io::tcp::TcpSettings::default().set_keepalive(keepalive);
    #[cfg(any(target_os = "linux", target_os = "android", target_os = "fuchsia"))]
    let settings = settings.set_user_timeout(USER_TIMEOUT);
    settings
}

/// `client` with [`tcp_settings`] (a client the Sentinels handed over).
pub(super) fn with_tcp_settings(client: &redis::Client) -> Result<redis::Client, StoreError> {
    let info = client
        .get_connection_info()
        .clone()
        .set_tcp_settings(tcp_settings());
    redis::Client::open(info).map_err(|e| StoreError::Config(e.to_string()))
}

/// `url` as connection details with the builder's credentials applied.
fn info(url: &str, security: &Security) -> Result<ConnectionInfo, StoreError> {
    // Before parsing: without its TLS support, the `redis` crate refuses a TLS URL with a
    // message that names none of our features.
    if !cfg!(feature = "redis-tls") && url.trim_start().starts_with("rediss:") {
        return Err(no_tls_feature(url));
    }
    let info = url.into_connection_info().map_err(|e| {
        StoreError::Config(format!("{:?} is not a usable Redis URL: {e}", redact(url)))
    })?;
    let mut settings = info.redis_settings().clone();
    if let Some(user) = &security.username {
        settings = settings.set_username(user);
    }
    if let Some(password) = &security.password {
        settings = settings.set_password(password);
    }
    let info = info
        .set_redis_settings(settings)
        .set_tcp_settings(tcp_settings());
    let tls = is_tls(info.addr());
    if security.wants_tls() && !tls {
        return Err(StoreError::Config(format!(
            "a CA or client certificate is set, but {:?} is no TLS URL (rediss://)",
            redact(url)
        )));
    }
    if tls && !cfg!(feature = "redis-tls") {
        return Err(no_tls_feature(url));
    }
    Ok(info)
}

fn is_tls(addr: &ConnectionAddr) -> bool {
    matches!(addr, ConnectionAddr::TcpTls { .. })
}

/// A client for one node (single node, pub/sub), TLS and credentials applied.
pub(super) fn client(url: &str, security: &Security) -> Result<redis::Client, StoreError> {
    let info = info(url, security)?;
    #[cfg(feature = "redis-tls")]
    if is_tls(info.addr()) {
        let certificates = tls::certificates(security)?;
        return redis::Client::build_with_tls(info, certificates)
            .map_err(|e| StoreError::Config(format!("TLS settings for {:?}: {e}", redact(url))));
    }
    redis::Client::open(info).map_err(|e| StoreError::Config(format!("{:?}: {e}", redact(url))))
}

/// A cluster client from seed URLs, TLS and credentials applied.
pub(super) fn cluster_client(
    nodes: &[String],
    security: &Security,
    connect_timeout: Duration,
    command_timeout: Duration,
) -> Result<ClusterClient, StoreError> {
    let infos = nodes
        .iter()
        .map(|n| info(n, security))
        .collect::<Result<Vec<_>, _>>()?;
    cluster_builder(infos, security, connect_timeout, command_timeout, false)
}

/// The cluster client sharded pub/sub uses: RESP3, so subscriptions and
/// messages arrive as push messages and redis-rs resubscribes each shard
/// channel on the node that owns its slot after a reconnect or a new slot
/// map.
pub(super) fn sharded_client(
    nodes: &[String],
    security: &Security,
    connect_timeout: Duration,
) -> Result<ClusterClient, StoreError> {
    let infos = nodes
        .iter()
        .map(|n| info(n, security))
        .collect::<Result<Vec<_>, _>>()?;
    // Subscribing answers at once; the timeout only bounds a dead node.
    cluster_builder(infos, security, connect_timeout, connect_timeout, true)
}

fn cluster_builder(
    infos: Vec<ConnectionInfo>,
    #[cfg_attr(not(feature = "redis-tls"), allow(unused_variables))] security: &Security,
    connect_timeout: Duration,
    command_timeout: Duration,
    resp3: bool,
) -> Result<ClusterClient, StoreError> {
    #[cfg_attr(not(feature = "redis-tls"), allow(unused_mut))]
    let mut builder = ClusterClientBuilder::new(infos.clone())
        .tcp_settings(tcp_settings())
        .connection_timeout(connect_timeout)
        .response_timeout(command_timeout)
        .retries(1);
    if resp3 {
        builder = builder.use_protocol(redis::ProtocolVersion::RESP3);
    }
    #[cfg(feature = "redis-tls")]
    if infos.iter().any(|i| is_tls(i.addr())) {
        builder = builder
            .tls(redis::TlsMode::Secure)
            .certs(tls::certificates(security)?);
    }
    builder
        .build()
        .map_err(|e| StoreError::Config(format!("Redis Cluster settings: {e}")))
}

/// How a backend reaches its data: a fixed connection (a node, a cluster),
/// or a primary that Sentinel names and that may change.
pub(super) enum Link {
    /// A node or a cluster; `subscribers` are the clients pub/sub may use
    /// (one per seed node).
    Fixed {
        conn: Conn,
        subscribers: Vec<redis::Client>,
        /// On a cluster, the client of the sharded pub/sub connection
        /// (idempotency completions, one shard channel per waited-on key).
        /// Boxed: the client is large and most backends have none.
        sharded: Option<Box<ClusterClient>>,
    },
    /// The primary Sentinel names, followed across failovers.
    Sentinel(Arc<Follower>),
}

impl Link {
    /// The connection a command goes out on now.
    #[inline]
    pub(super) fn conn(&self) -> Conn {
        match self {
            Self::Fixed { conn, .. } => conn.clone(),
            Self::Sentinel(follower) => Conn::Single(follower.primary.load().conn.clone()),
        }
    }

    /// A command failed on the store's side: behind Sentinel, the primary
    /// may have moved; look it up again (in the background, every
    /// [`LOOKUP_INTERVAL`] until it answers or moved).
    pub(super) fn suspect(&self) {
        if let Self::Sentinel(follower) = self {
            follower.suspect();
        }
    }

    /// Whether a new primary was followed since the last call that asked:
    /// the failures the breaker counted were the old primary's.
    #[inline]
    pub(super) fn moved(&self) -> bool {
        match self {
            Self::Fixed { .. } => false,
            Self::Sentinel(follower) => follower.take_moved(),
        }
    }

    /// The client pub/sub uses for its `attempt`-th subscription (rotating
    /// over the seed nodes), with a name for logs; behind Sentinel, the
    /// current primary's.
    pub(super) fn subscriber(&self, attempt: usize) -> (String, Option<redis::Client>) {
        match self {
            Self::Fixed { subscribers, .. } => {
                let client = subscribers.get(attempt % subscribers.len().max(1)).cloned();
                let name = client
                    .as_ref()
                    .map(|c| c.get_connection_info().addr().to_string())
                    .unwrap_or_default();
                (name, client)
            }
            Self::Sentinel(follower) => {
                let primary = follower.primary.load();
                (primary.addr.clone(), Some(primary.client.clone()))
            }
        }
    }

    /// The cluster client for sharded pub/sub; `None` off a cluster.
    pub(super) fn sharded(&self) -> Option<ClusterClient> {
        match self {
            Self::Fixed { sharded, .. } => sharded.as_deref().cloned(),
            Self::Sentinel(_) => None,
        }
    }

    /// Times a new primary was followed (Sentinel only).
    pub(super) fn failovers(&self) -> u64 {
        match self {
            Self::Fixed { .. } => 0,
            Self::Sentinel(follower) => follower.failovers.load(Ordering::Relaxed),
        }
    }
}

/// The connection manager every single-node connection uses: reconnects by
/// itself; no response timeout of its own (every command is already bounded
/// by the command timeout, and a second timer per command costs throughput).
pub(super) fn manager_config(connect_timeout: Duration) -> ConnectionManagerConfig {
    ConnectionManagerConfig::new()
        .set_connection_timeout(Some(connect_timeout))
        .set_response_timeout(None)
        .set_number_of_retries(1)
        .set_max_delay(Duration::from_millis(200))
}

/// Connects a connection manager to `client` within `timeout`.
pub(super) async fn manage(
    client: redis::Client,
    timeout: Duration,
) -> Result<ConnectionManager, StoreError> {
    let connecting = ConnectionManager::new_with_config(client, manager_config(timeout));
    tokio::time::timeout(timeout, connecting)
        .await
        .map_err(|_| StoreError::Timeout { after: timeout })?
        .map_err(connect_error)
}

/// A failed connection attempt as a typed error: refused credentials or a
/// TLS handshake that failed are [`StoreError::Auth`] (retrying will not
/// help), anything else [`StoreError::Unavailable`].
pub(super) fn connect_error(e: redis::RedisError) -> StoreError {
    if is_auth_error(&e) {
        StoreError::Auth(Arc::new(e))
    } else {
        StoreError::unavailable(e)
    }
}

/// Why connecting to the first of `clients` fails, if it fails on
/// credentials or trust ([`StoreError::Auth`]); `None` otherwise.
pub(super) async fn diagnose(clients: &[redis::Client], timeout: Duration) -> Option<StoreError> {
    let client = clients.first()?;
    match tokio::time::timeout(timeout, client.get_multiplexed_async_connection()).await {
        Ok(Err(e)) if is_auth_error(&e) => Some(StoreError::Auth(Arc::new(e))),
        _ => None,
    }
}

/// Whether `e` says the server refused the credentials (wrong password,
/// unknown user, no permission) or the TLS handshake failed on trust.
pub(super) fn is_auth_error(e: &redis::RedisError) -> bool {
    if matches!(
        e.kind(),
        redis::ErrorKind::AuthenticationFailed
            | redis::ErrorKind::Server(redis::ServerErrorKind::NoPerm)
    ) || matches!(e.code(), Some("WRONGPASS" | "NOAUTH" | "NOPERM"))
    {
        return true;
    }
    // A command a script ran that the ACL user may not (a key or channel outside its
    // patterns): Redis reports it as `ERR The user executing the script can't …`.
    if e.code() == Some("ERR")
        && e.detail()
            .is_some_and(|d| d.starts_with("The user executing the script can't"))
    {
        return true;
    }
    #[cfg(feature = "redis-tls")]
    if tls::is_handshake_failure(e) {
        return true;
    }
    false
}

#[cfg(feature = "redis-tls")]
mod tls {
    //! Certificates for redis-rs's rustls, checked here so that a bad PEM is
    //! a clear configuration error, not a handshake that fails later.

    use redis::{ClientTlsConfig, TlsCertificates};
    use rustls::pki_types::pem::PemObject;
    use rustls::pki_types::{CertificateDer, PrivateKeyDer};

    use super::{Security, StoreError};

    /// The certificates of `security`, checked; rustls's crypto provider
    /// (ring) installed for the process if none is.
    pub(super) fn certificates(security: &Security) -> Result<TlsCertificates, StoreError> {
        if rustls::crypto::CryptoProvider::get_default().is_none() {
            // Another thread may install one first: theirs stands. ring, not
            // aws-lc-rs: no C toolchain beyond `cc` to build it; rustls
            // deprecates it for lacking post-quantum key exchange, which a
            // host wanting that gets by installing aws-lc-rs's provider first.
            #[allow(deprecated)]
            let provider = rustls::crypto::ring::default_provider();
            let _ = provider.install_default();
        }
        if let Some(ca) = &security.ca_pem {
            certs(ca, "the CA")?;
        }
        let client_tls = match &security.client_pem {
            Some((cert, key)) => {
                certs(cert, "the client certificate")?;
                PrivateKeyDer::from_pem_slice(key).map_err(|e| {
                    StoreError::Config(format!(
                        "the client key is no PEM private key (PKCS#8, PKCS#1 or SEC1): {e}"
                    ))
                })?;
                Some(ClientTlsConfig {
                    client_cert: cert.clone(),
                    client_key: key.clone(),
                })
            }
            None => None,
        };
        Ok(TlsCertificates {
            client_tls,
            root_cert: security.ca_pem.clone(),
        })
    }

    fn certs(pem: &[u8], what: &str) -> Result<(), StoreError> {
        let mut found = 0_usize;
        for cert in CertificateDer::pem_slice_iter(pem) {
            cert.map_err(|e| StoreError::Config(format!("{what} PEM is unreadable: {e}")))?;
            found += 1;
        }
        if found == 0 {
            return Err(StoreError::Config(format!(
                "{what} PEM holds no certificate (no \"-----BEGIN CERTIFICATE-----\" block)"
            )));
        }
        Ok(())
    }

    /// Whether rustls failed the handshake (a certificate not trusted, or
    /// refused by the server) somewhere in `e`'s causes.
    pub(super) fn is_handshake_failure(e: &redis::RedisError) -> bool {
        is_rustls(e, 0)
    }

    fn is_rustls(e: &(dyn std::error::Error + 'static), depth: usize) -> bool {
        type Shared = std::sync::Arc<dyn std::error::Error + Send + Sync>;
        if depth > 16 {
            return false;
        }
        if e.is::<rustls::Error>() {
            return true;
        }
        // Neither an `io::Error` nor an `Arc` of an error shows what it wraps
        // through `source`: look inside.
        if let Some(io) = e.downcast_ref::<std::io::Error>()
            && let Some(inner) = io.get_ref()
            && is_rustls(inner, depth + 1)
        {
            return true;
        }
        if let Some(shared) = e.downcast_ref::<Shared>()
            && is_rustls(&**shared, depth + 1)
        {
            return true;
        }
        e.source().is_some_and(|c| is_rustls(c, depth + 1))
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn nodes(url: &str) -> (Topology, Vec<String>) {
        let p = parse(url).unwrap();
        (p.topology, p.nodes)
    }

    #[test]
    fn one_url_names_a_node_a_cluster_or_a_primary_behind_sentinel() {
        assert_eq!(
            nodes(" redis://u:p@h:1/2 "),
            (Topology::Single, vec!["redis://u:p@h:1/2".to_owned()])
        );
        assert_eq!(nodes("rediss://h").0, Topology::Single);
        assert_eq!(
            nodes("redis://a:1, redis://b:2"),
            (
                Topology::Cluster,
                vec!["redis://a:1".to_owned(), "redis://b:2".to_owned()]
            )
        );
        assert_eq!(
            nodes("rediss+cluster://u:p@a:1,b:2"),
            (
                Topology::Cluster,
                vec!["rediss://u:p@a:1".to_owned(), "rediss://u:p@b:2".to_owned()]
            )
        );
        let p = parse("redis+sentinel://u:p%40w@s1,s2:5000/my%20primary/3?sentinel_password=x%2By")
            .unwrap();
        assert_eq!(
            p.topology,
            Topology::Sentinel {
                master: "my primary".to_owned(),
                db: 3
            }
        );
        assert_eq!(
            p.nodes,
            vec!["redis://s1:26379".to_owned(), "redis://s2:5000".to_owned()]
        );
        assert_eq!(p.username.as_deref(), Some("u"));
        assert_eq!(p.password.as_deref(), Some("p@w"));
        assert_eq!(p.sentinel_password.as_deref(), Some("x+y"));
        assert_eq!(p.sentinel_username, None);
    }

    #[test]
    fn a_bad_url_is_refused_with_its_password_masked() {
        for (url, says) in [
            ("", "empty"),
            ("localhost:6379", "no scheme"),
            ("http://u:secret@h", "unknown scheme"),
            ("redis+sentinel://u:secret@s1", "names no master"),
            ("redis+sentinel://u:secret@s1/m/x", "not a number"),
            ("redis+sentinel://u:secret@s1/m?pool=3", "unknown parameter"),
            ("redis://u:secret@a:1,b:2", "is no URL"),
        ] {
            let e = parse(url).unwrap_err();
            assert!(e.contains(says), "{url}: {e}");
            assert!(!e.contains("secret"), "{url}: {e}");
        }
        assert_eq!(redact("redis://u:pw@h:1/0"), "redis://u:***@h:1/0");
        assert_eq!(redact("redis://:pw@h"), "redis://:***@h");
        assert_eq!(redact("redis://h:1"), "redis://h:1");
    }

    #[test]
    fn credentials_of_the_builder_override_the_urls() {
        let security = Security {
            username: Some("app".to_owned()),
            password: Some("s3cret".to_owned()),
            ..Security::default()
        };
        let info = info("redis://old:pw@127.0.0.1:7000/2", &security).unwrap();
        assert_eq!(info.redis_settings().username(), Some("app"));
        assert_eq!(info.redis_settings().password(), Some("s3cret"));
        assert_eq!(info.redis_settings().db(), 2);
        assert!(!format!("{security:?}").contains("s3cret"));
    }

    #[test]
    fn certificates_need_a_tls_url_and_tls_needs_its_feature() {
        let security = Security {
            ca_pem: Some(b"-----BEGIN CERTIFICATE-----".to_vec()),
            ..Security::default()
        };
        let e = info("redis://127.0.0.1:7000", &security).unwrap_err();
        assert!(e.to_string().contains("no TLS URL"), "{e}");
        let tls = info("rediss://127.0.0.1:7000", &Security::default());
        if cfg!(feature = "redis-tls") {
            assert!(tls.is_ok());
        } else {
            let e = tls.unwrap_err().to_string();
            assert!(e.contains("`redis-tls` feature"), "{e}");
        }
    }
}
