//! Connections: a pool of them, each call bounded by the command timeout,
//! guarded by the circuit breaker, and cancelled (its connection discarded)
//! when its caller goes away mid-statement.

use std::sync::Arc;
use std::sync::atomic::{AtomicU64, Ordering};
use std::time::Duration;

use deadpool_postgres::{Manager, ManagerConfig, Object, Pool, RecyclingMethod, Runtime};
use tokio_postgres::types::ToSql;
use tokio_postgres::{NoTls, Row};

use crate::store::{Breaker, BreakerConfig, StoreError};

/// The parameters of one statement.
pub(super) type Params<'a> = [&'a (dyn ToSql + Sync)];

/// Whether an open breaker may refuse a call.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(super) enum Class {
    /// Refused at once while the breaker is open: the caller has a policy
    /// for an outage (idempotency fails closed) and nothing is lost.
    Refusable,
    /// Always sent, its outcome recorded: an owner renewing its claim or
    /// storing the result of a run that happened.
    MustTry,
}

/// The pool and what guards it.
pub(super) struct Connections {
    pub(super) pool: Pool,
    pub(super) config: tokio_postgres::Config,
    /// How connections outside the pool (the listener's) connect.
    pub(super) tls: super::tls::Tls,
    pub(super) timeout: Duration,
    pub(super) breaker: Breaker,
    statements: AtomicU64,
    pool_waits: AtomicU64,
    pool_timeouts: AtomicU64,
}

/// Every connection of the pool stayed busy for as long as a caller could wait.
#[derive(Debug, thiserror::Error)]
#[error(
    "all {size} connections of the postgres pool stayed busy for {waited:?} (the command \
     timeout): raise PostgresBuilder::with_pool_size or the pool's own size"
)]
pub(super) struct PoolExhausted {
    size: usize,
    waited: Duration,
}

impl Connections {
    pub(super) fn new(
        config: tokio_postgres::Config,
        tls: super::tls::Tls,
        size: usize,
        timeout: Duration,
        connect_timeout: Duration,
        breaker: BreakerConfig,
    ) -> Result<Self, StoreError> {
        let manager = Manager::from_config(
            config.clone(),
            tls.clone(),
            ManagerConfig {
                // A connection whose socket closed is dropped; a healthy one
                // costs no round trip to hand out.
                recycling_method: RecyclingMethod::Fast,
            },
        );
        let pool = Pool::builder(manager)
            .max_size(size)
            .runtime(Runtime::Tokio1)
            .create_timeout(Some(connect_timeout))
            .recycle_timeout(Some(connect_timeout))
            .build()
            .map_err(|e| StoreError::Config(format!("postgres pool: {e}")))?;
        Ok(Self::with_pool(pool, config, tls, timeout, breaker))
    }

    /// Around a pool made elsewhere (the application's own).
    pub(super) fn with_pool(
        pool: Pool,
        config: tokio_postgres::Config,
        tls: super::tls::Tls,
        timeout: Duration,
        breaker: BreakerConfig,
    ) -> Self {
        Self {
            pool,
            config,
            tls,
            timeout,
            breaker: Breaker::new(breaker),
            statements: AtomicU64::new(0),
            pool_waits: AtomicU64::new(0),
            pool_timeouts: AtomicU64::new(0),
        }
    }

    /// Statements sent so far.
    pub(super) fn statements(&self) -> u64 {
        self.statements.load(Ordering::Relaxed)
    }

    pub(super) fn count(&self) {
        self.statements.fetch_add(1, Ordering::Relaxed);
    }

    /// A connection of the pool, waiting at most the command timeout. A wait (no connection
    /// free when asked) is counted; one that ran out is a [`PoolExhausted`] error naming the
    /// pool's size.
    pub(super) async fn get(&self) -> Result<Conn, StoreError> {
        let waited = self.pool.status().available == 0;
        if waited {
            self.pool_waits.fetch_add(1, Ordering::Relaxed);
        }
        let got = crate::store::guard(self.timeout, || self.pool.get()).await;
        match got {
            Ok(Ok(object)) => Ok(Conn {
                object: Some(object),
                busy: false,
                waited,
            }),
            Ok(Err(deadpool_postgres::PoolError::Timeout(_)))
            | Err(crate::store::Fault::TimedOut(_))
                if waited =>
            {
                self.pool_timeouts.fetch_add(1, Ordering::Relaxed);
                Err(StoreError::unavailable(PoolExhausted {
                    size: self.pool.status().max_size,
                    waited: self.timeout,
                }))
            }
            Ok(Err(e)) => Err(StoreError::unavailable(e)),
            Err(fault) => Err(fault.into()),
        }
    }

    /// Times a caller found no connection free, and times it waited out the command timeout.
    pub(super) fn pool_counts(&self) -> (u64, u64) {
        (
            self.pool_waits.load(Ordering::Relaxed),
            self.pool_timeouts.load(Ordering::Relaxed),
        )
    }

    /// The pool's size and the connections in it now (open, busy or idle).
    pub(super) fn pool_size(&self) -> (usize, usize) {
        let status = self.pool.status();
        (status.max_size, status.size)
    }

    /// One statement returning one row, under the breaker and the timeout.
    pub(super) async fn query_one(
        &self,
        class: Class,
        sql: &str,
        params: &Params<'_>,
    ) -> Result<Row, StoreError> {
        self.guarded(class, async {
            let mut conn = self.get().await?;
            self.count();
            conn.query_one(sql, params).await.map_err(store_error)
        })
        .await
    }

    /// One statement returning the rows it changed, under the breaker and
    /// the timeout.
    pub(super) async fn execute(
        &self,
        class: Class,
        sql: &str,
        params: &Params<'_>,
    ) -> Result<u64, StoreError> {
        self.guarded(class, async {
            let mut conn = self.get().await?;
            self.count();
            conn.execute(sql, params).await.map_err(store_error)
        })
        .await
    }

    /// A batch of statements in the simple protocol (the migration).
    pub(super) async fn batch(&self, class: Class, sql: &str) -> Result<(), StoreError> {
        self.guarded(class, async {
            let mut conn = self.get().await?;
            self.count();
            conn.batch(sql).await.map_err(store_error)
        })
        .await
    }

    /// Runs `call` through the store guard (bounded by the command timeout,
    /// a panic caught), refused at once while the breaker is open unless it
    /// must be tried; its outcome recorded.
    pub(super) async fn guarded<T>(
        &self,
        class: Class,
        call: impl Future<Output = Result<T, StoreError>>,
    ) -> Result<T, StoreError> {
        // Dropped with this future, the permit is no event: a cancelled
        // probe never wedges the breaker.
        let permit = match class {
            Class::Refusable => self
                .breaker
                .admit()
                .map_err(|retry_in| StoreError::BreakerOpen { retry_in })?,
            Class::MustTry => self.breaker.admit_anyway(),
        };
        let result = crate::store::store_call(self.timeout, || call).await;
        permit.record(!matches!(&result, Err(e) if e.is_store_fault()));
        result
    }
}

/// A connection out of the pool. A statement dropped before it answered
/// (its caller went away, or timed out) is cancelled on the server and the
/// connection discarded: a cancel request names the backend, not the
/// statement, so the connection must not serve anyone afterwards.
pub(crate) struct Conn {
    object: Option<Object>,
    busy: bool,
    /// No connection was free when this one was asked for.
    pub(super) waited: bool,
}

impl Conn {
    /// No connection: what a run leaves behind once it took its connection.
    pub(crate) fn empty() -> Self {
        Self {
            object: None,
            busy: false,
            waited: false,
        }
    }

    fn object(&self) -> &Object {
        self.object
            .as_ref()
            .expect("a connection is held until dropped")
    }

    /// The connection, if this one still has it.
    pub(crate) fn object_ref(&self) -> Option<&Object> {
        self.object.as_ref()
    }

    /// The connection, for a transaction.
    pub(crate) fn client(&mut self) -> &mut Object {
        self.object
            .as_mut()
            .expect("a connection is held until dropped")
    }

    /// Marks a statement in flight until [`Conn::idle`]: dropped before
    /// that, the connection is cancelled and discarded.
    pub(crate) fn busy(&mut self) {
        self.busy = true;
    }

    pub(crate) fn idle(&mut self) {
        self.busy = false;
    }

    pub(super) async fn query_one(
        &mut self,
        sql: &str,
        params: &Params<'_>,
    ) -> Result<Row, tokio_postgres::Error> {
        self.busy();
        let object = self.object();
        let row = async {
            let statement = object.prepare_cached(sql).await?;
            object.query_one(&statement, params).await
        }
        .await;
        self.idle();
        row
    }

    pub(super) async fn execute(
        &mut self,
        sql: &str,
        params: &Params<'_>,
    ) -> Result<u64, tokio_postgres::Error> {
        self.busy();
        let object = self.object();
        let changed = async {
            let statement = object.prepare_cached(sql).await?;
            object.execute(&statement, params).await
        }
        .await;
        self.idle();
        changed
    }

    async fn batch(&mut self, sql: &str) -> Result<(), tokio_postgres::Error> {
        self.busy();
        let done = self.object().batch_execute(sql).await;
        self.idle();
        done
    }

    /// Takes the connection out of the pool for good (it is closed when
    /// dropped): after a failure whose state on the server is unknown.
    pub(crate) fn discard(&mut self) {
        if let Some(object) = self.object.take() {
            drop(Object::take(object));
        }
    }
}

impl Drop for Conn {
    fn drop(&mut self) {
        if !self.busy {
            return;
        }
        let Some(object) = self.object.take() else {
            return;
        };
        let cancel = object.cancel_token();
        drop(Object::take(object));
        if let Ok(runtime) = tokio::runtime::Handle::try_current() {
            runtime.spawn(async move {
                if let Err(e) = cancel.cancel_query(NoTls).await {
                    tracing::debug!(error = %e, "cancelling an abandoned postgres statement failed");
                }
            });
        }
    }
}

/// A driver error as a store error: a broken connection, a server shutting
/// down or out of resources, a serialization failure or deadlock, a server
/// that takes no writes now (a standby after a failover) are outages (they
/// count against the breaker, and an owner's completion is tried again
/// rather than refused); a missing table is a configuration error; anything
/// else the server refused is a protocol error.
pub(super) fn store_error(e: tokio_postgres::Error) -> StoreError {
    let Some(db) = e.as_db_error() else {
        return StoreError::unavailable(e);
    };
    let code = db.code().code();
    match code {
        // undefined_table, undefined_function
        "42P01" | "42883" => StoreError::Config(format!(
            "{} (run PostgresStore::migrate to create the table)",
            db.message()
        )),
        // 25006 read_only_sql_transaction: connected to a standby, or a session that writes
        // nothing. The cause is the server's own error, not the driver's ("db error").
        // A broken connection: the statement's fate is unknown.
        _ if code.starts_with("08") => StoreError::Unavailable(Arc::new(db.clone())),
        // The server answered that it cannot serve now; the statement did nothing.
        _ if code == "25006" || matches!(code.get(..2), Some("40" | "53" | "55" | "57" | "58")) => {
            StoreError::NotServing(Arc::new(db.clone()))
        }
        _ => StoreError::Protocol(format!("postgres refused a statement: {db}")),
    }
}
