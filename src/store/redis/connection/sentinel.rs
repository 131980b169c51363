//! A primary found through Sentinel: looked up, watched, and followed after a failover.

use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::sync::{Arc, Weak};
use std::time::Duration;

use arc_swap::ArcSwap;
use redis::aio::ConnectionManager;
use redis::sentinel::{SentinelClient, SentinelClientBuilder, SentinelServerType};
use redis::{ConnectionInfo, IntoConnectionInfo};

use super::*;
use crate::store::StoreError;

/// A primary found through Sentinel, and the means to find it again.
pub(crate) struct Follower {
    pub(crate) sentinel: tokio::sync::Mutex<SentinelClient>,
    pub(crate) primary: ArcSwap<Primary>,
    /// A lookup task runs now.
    pub(crate) looking: AtomicBool,
    /// Moved to a new primary since a command last looked: the breaker's
    /// failures were the old primary's.
    pub(crate) moved: AtomicBool,
    pub(crate) failovers: AtomicU64,
    pub(crate) connect_timeout: Duration,
}

pub(crate) struct Primary {
    /// `host:port`, as the Sentinels name it.
    pub(crate) addr: String,
    pub(crate) client: redis::Client,
    pub(crate) conn: ConnectionManager,
}

/// A Sentinel client for `master` on the Sentinels `sentinels`, the data
/// nodes reached with `security` and database `db`.
fn sentinel_client(
    sentinels: &[String],
    master: &str,
    db: i64,
    security: &Security,
) -> Result<SentinelClient, StoreError> {
    let mut addrs = Vec::with_capacity(sentinels.len());
    let mut tls = false;
    for url in sentinels {
        let info = info(url, &Security::default())?;
        tls |= is_tls(info.addr());
        addrs.push(info.addr().clone());
    }
    // A Sentinel URL's own credentials are the Sentinels' (the first
    // URL's, for all), unless the builder names others.
    let first = sentinels
        .first()
        .map(|u| u.as_str().into_connection_info())
        .transpose()
        .map_err(|e| StoreError::Config(e.to_string()))?;
    let first = first.as_ref().map(ConnectionInfo::redis_settings);
    let sentinel_user =
        (security.sentinel_username.as_deref()).or_else(|| first.and_then(|s| s.username()));
    let sentinel_password =
        (security.sentinel_password.as_deref()).or_else(|| first.and_then(|s| s.password()));
    let mut builder = SentinelClientBuilder::new(addrs, master, SentinelServerType::Master)
        .map_err(|e| StoreError::Config(format!("Sentinel settings: {e}")))?
        .set_client_to_redis_db(db);
    if let Some(user) = &security.username {
        builder = builder.set_client_to_redis_username(user);
    }
    if let Some(password) = &security.password {
        builder = builder.set_client_to_redis_password(password);
    }
    if let Some(user) = sentinel_user {
        builder = builder.set_client_to_sentinel_username(user);
    }
    if let Some(password) = sentinel_password {
        builder = builder.set_client_to_sentinel_password(password);
    }
    if tls {
        builder = builder
            .set_client_to_redis_tls_mode(redis::TlsMode::Secure)
            .set_client_to_sentinel_tls_mode(redis::TlsMode::Secure);
        #[cfg(feature = "redis-tls")]
        {
            let certificates = tls::certificates(security)?;
            builder = builder
                .set_client_to_redis_certificates(certificates.clone())
                .set_client_to_sentinel_certificates(certificates);
        }
    }
    builder
        .build()
        .map_err(|e| StoreError::Config(format!("Sentinel settings: {e}")))
}

impl Follower {
    /// Asks the Sentinels for the primary of `master` and connects to it.
    pub(crate) async fn connect(
        sentinels: &[String],
        master: &str,
        db: i64,
        security: &Security,
        connect_timeout: Duration,
    ) -> Result<Arc<Self>, StoreError> {
        let mut sentinel = sentinel_client(sentinels, master, db, security)?;
        let client = lookup(&mut sentinel, connect_timeout).await?;
        let addr = client.get_connection_info().addr().to_string();
        let conn = manage(client.clone(), connect_timeout).await?;
        let follower = Arc::new(Self {
            sentinel: tokio::sync::Mutex::new(sentinel),
            primary: ArcSwap::from_pointee(Primary { addr, client, conn }),
            looking: AtomicBool::new(false),
            moved: AtomicBool::new(false),
            failovers: AtomicU64::new(0),
            connect_timeout,
        });
        // On the connecting caller's runtime; it ends with the follower (or
        // with that runtime, leaving lookups to failed commands).
        let watched = Arc::downgrade(&follower);
        let Ok(runtime) = tokio::runtime::Handle::try_current() else {
            return Ok(follower);
        };
        runtime.spawn(async move {
            loop {
                tokio::time::sleep(WATCH_INTERVAL).await;
                let Some(follower) = watched.upgrade() else {
                    return;
                };
                if let Err(error) = follower.follow().await {
                    tracing::debug!(%error, "looking the Redis primary up through Sentinel failed");
                }
            }
        });
        Ok(follower)
    }

    /// Whether the primary moved since the last call that asked.
    pub(crate) fn take_moved(&self) -> bool {
        self.moved.load(Ordering::Relaxed) && self.moved.swap(false, Ordering::AcqRel)
    }

    /// Starts a lookup task unless one runs: it asks the Sentinels every
    /// [`LOOKUP_INTERVAL`] until they name another primary (it moves there)
    /// or the current one answers again.
    pub(crate) fn suspect(self: &Arc<Self>) {
        if self.looking.load(Ordering::Relaxed) {
            return;
        }
        let Ok(runtime) = tokio::runtime::Handle::try_current() else {
            return;
        };
        if self.looking.swap(true, Ordering::AcqRel) {
            return;
        }
        // Made before the spawn: a task dropped unpolled (its runtime ended)
        // frees the next lookup too.
        let guard = Looking(Arc::downgrade(self));
        runtime.spawn(async move {
            loop {
                let Some(follower) = guard.0.upgrade() else {
                    return;
                };
                match follower.follow().await {
                    Ok(true) => return,
                    Ok(false) if follower.primary_answers().await => return,
                    Ok(false) => {}
                    Err(error) => {
                        tracing::debug!(%error, "looking the Redis primary up through Sentinel failed");
                    }
                }
                drop(follower);
                tokio::time::sleep(LOOKUP_INTERVAL).await;
            }
        });
    }

    /// Looks the primary up; connects to it and moves there if it changed.
    /// Whether it moved.
    pub(crate) async fn follow(&self) -> Result<bool, StoreError> {
        let client = {
            let mut sentinel = self.sentinel.lock().await;
            lookup(&mut sentinel, self.connect_timeout).await?
        };
        let addr = client.get_connection_info().addr().to_string();
        let old = self.primary.load().addr.clone();
        if addr == old {
            return Ok(false);
        }
        let conn = manage(client.clone(), self.connect_timeout).await?;
        self.primary.store(Arc::new(Primary {
            addr: addr.clone(),
            client,
            conn,
        }));
        self.failovers.fetch_add(1, Ordering::Relaxed);
        self.moved.store(true, Ordering::Release);
        tracing::info!(from = %old, to = %addr, "Redis primary moved (Sentinel failover): following it");
        Ok(true)
    }

    /// Whether the current primary answers `PING` within the connect timeout.
    pub(crate) async fn primary_answers(&self) -> bool {
        let mut conn = self.primary.load().conn.clone();
        let cmd = redis::cmd("PING");
        let ping = cmd.query_async::<String>(&mut conn);
        matches!(
            tokio::time::timeout(self.connect_timeout, ping).await,
            Ok(Ok(_))
        )
    }
}

/// Frees the next lookup when a lookup task ends, however it ends.
struct Looking(Weak<Follower>);

impl Drop for Looking {
    fn drop(&mut self) {
        if let Some(follower) = self.0.upgrade() {
            follower.looking.store(false, Ordering::Release);
        }
    }
}

/// The primary's client, as the Sentinels name it now, within `timeout`.
async fn lookup(
    sentinel: &mut SentinelClient,
    timeout: Duration,
) -> Result<redis::Client, StoreError> {
    let client = tokio::time::timeout(timeout, sentinel.async_get_client())
        .await
        .map_err(|_| StoreError::Timeout { after: timeout })?
        .map_err(|e| match e.kind() {
            redis::ErrorKind::MasterNameNotFoundBySentinel => StoreError::Config(format!(
                "the Sentinels know no primary by this master name: {e}"
            )),
            _ => connect_error(e),
        })?;
    with_tcp_settings(&client)
}
