//! PostgreSQL as the idempotency store (feature `postgres`): claims and
//! results in one table shared by every instance, and transactional runs
//! that commit an operation's effect and its record together.
//!
//! # Two ways to use it
//!
//! **As the shared store of a runtime.** [`PostgresStore`] implements
//! [`IdempotencyStore`] with the contract of the memory and Redis stores:
//! [`Runtime`](crate::Runtime)s built
//! [`with_postgres`](crate::runtime::RuntimeBuilder::with_postgres) run each key once
//! across every instance, through [`IdempotencyHandle::run`](crate::IdempotencyHandle::run),
//! [`reserve`](crate::IdempotencyHandle::reserve) and the HTTP layer, exactly
//! as with Redis. The operation's effect happens wherever the function puts
//! it; the store keeps who holds the key and the result.
//!
//! ```no_run
//! # async fn demo() -> Result<(), Box<dyn std::error::Error>> {
//! use throttlebeam::Runtime;
//! use throttlebeam::idempotency::postgres::PostgresStore;
//!
//! let store = PostgresStore::builder("postgres://app@db.internal/app").connect().await?;
//! store.migrate().await?; // idempotent: creates the table once
//! let runtime = Runtime::builder().with_postgres(store).start().await?;
//! let sent = runtime
//!     .idempotency()
//!     .run("mail:42", || async { Ok::<_, std::io::Error>("queued".to_owned()) })
//!     .await?;
//! println!("{}", sent.into_inner());
//! # Ok(()) }
//! ```
//!
//! **Transactionally** ([`PostgresStore::run_in_transaction`]), when the
//! effect itself lives in the same database: the closure gets a transaction,
//! and its writes, the stored result and the completion of the key commit
//! together, or not at all. A retry replays a result whose effect is
//! committed, and runs again when nothing was (the process died, the closure
//! failed or panicked, the connection dropped before the commit): the effect
//! happens exactly once, with no window between the effect and its record.
//!
//! ```no_run
//! # async fn demo(store: throttlebeam::idempotency::postgres::PostgresStore) -> Result<(), throttlebeam::Error> {
//! use throttlebeam::IdempotencyOptions;
//!
//! #[derive(Clone, serde::Serialize, serde::Deserialize)]
//! struct Receipt {
//!     charge_id: i64,
//!     balance: i64,
//! }
//!
//! let options = IdempotencyOptions::new()
//!     .with_scope("customer-7")
//!     .with_fingerprint("POST /charges amount=1500");
//! let receipt = store
//!     .run_in_transaction("charge-key-from-client", options, |tx| {
//!         Box::pin(async move {
//!             let charge = tx
//!                 .query_one(
//!                     "INSERT INTO charges (customer, amount) VALUES (7, 1500) RETURNING id",
//!                     &[],
//!                 )
//!                 .await?;
//!             let account = tx
//!                 .query_one(
//!                     "UPDATE accounts SET balance = balance - 1500 WHERE id = 7 RETURNING balance",
//!                     &[],
//!                 )
//!                 .await?;
//!             Ok::<_, tokio_postgres::Error>(Receipt {
//!                 charge_id: charge.get(0),
//!                 balance: account.get(0),
//!             })
//!         })
//!     })
//!     .await?;
//! // `Fresh` the first time; every retry with the key gets `Replay` of the
//! // same receipt, and the card is charged once.
//! println!("charge {}", receipt.into_inner().charge_id);
//! # Ok(()) }
//! # use throttlebeam::idempotency::postgres::tokio_postgres;
//! ```
//!
//! **Behind an HTTP route**: an [`IdempotencyLayer`](crate::http::IdempotencyLayer) built
//! [`with_postgres_transaction`](crate::http::IdempotencyLayerBuilder::with_postgres_transaction)
//! hands its handler the transaction ([`PgTransaction`](crate::http::PgTransaction)), and the
//! handler's writes, the stored response and the key's completion commit together under the
//! layer's claim (features `http`, or `axum` for the extractor).
//!
//! # Transactional runs
//!
//! A transactional run's claim is held by its own transaction, not renewed beside it:
//!
//! - the claim is the table's one claim statement (the runtime's too), sent on the connection
//!   the run will use, with a one-second *grace* as its lease (shorter if the run's lease is)
//!   and an unflushed commit: duplicates on every instance see the key in flight with its
//!   fingerprint (422 for another body, 409 or a wait for the same) without blocking;
//! - the transaction begins on that connection at the run's isolation level
//!   ([`TransactionOptions::with_isolation_level`]; by default the session's
//!   `default_transaction_isolation`), and its first statement locks the claim's row
//!   (`SELECT … FOR UPDATE`), so its snapshot follows the claim. The closure cannot set the
//!   level itself (`SET TRANSACTION ISOLATION LEVEL` must come first): that is what the option
//!   is for;
//! - from then on the row lock is the claim. Nothing renews it and no second connection is
//!   needed: a live run is never taken over, however long it lasts and however full the pool
//!   (a claim whose lease ended is taken over only if no transaction holds its row:
//!   `FOR UPDATE SKIP LOCKED`, with a 200 ms `lock_timeout` answered as busy). Once the owner's
//!   connection dies (a killed process, `pg_terminate_backend`) the lock goes with it, and a
//!   waiting duplicate's next look, at most half a second later, takes the key over;
//! - inside the transaction the row is reached by its `ctid` alone, never through an index,
//!   so at SERIALIZABLE no predicate lock of the table's index makes concurrent runs of other
//!   keys conflict; runs succeed at READ COMMITTED, REPEATABLE READ and SERIALIZABLE. A
//!   serialization failure of the closure's own statements is [`Error::Failed`](crate::Error::Failed)
//!   with the driver's error as its source ([`is_serialization_failure`]): the key was
//!   released, and calling again runs it again;
//! - the completion (in the transaction, compare-and-set on the token and on the transaction
//!   that locked the row) and the commit make the run visible, effect and record together.
//!
//! An orphaned transaction (its client cut off without the server noticing) holds its key
//! until the server ends it: every run sets `statement_timeout` and
//! `idle_in_transaction_session_timeout` to [`TransactionOptions::with_timeout`] (60 s by
//! default), so at most twice that (120 s by default). Keep a closure's waits between two
//! statements (a card network's answer) under that timeout.
//!
//! # The table
//!
//! [`PostgresStore::migrate`] creates it (once; running it again changes
//! nothing, and instances running it together take turns on an advisory
//! lock). For the default table name (`throttlebeam_idempotency`, in the
//! connection's `search_path`; see [`PostgresBuilder::with_table`]) it runs
//! this SQL, which a migration tool of your own may run instead
//! ([`PostgresStore::migration_sql`] gives it for any table name):
//!
//! ```sql
#![doc = include_str!("postgres/schema.sql")]
//! ```
//!
//! It is quiet (`client_min_messages = warning`: no "already exists" notices on every start).
//! [`PostgresStore::undo_migration_sql`] gives the SQL that drops it all again.
//!
//! A row is a key in flight until its lease ends, or a completed result until
//! its TTL ends; either way an expired row is free. Results are stored in the
//! same versioned envelope as in Redis (`tb`, a format version, then
//! MessagePack; bincode 2 in version 1, still read), with their Rust type
//! name, so another build reads them or refuses them
//! ([`Error::StoreUnavailable`](crate::Error::StoreUnavailable) with a
//! [`WireError`](crate::store::WireError)), never misreads them.
//!
//! # One statement per operation
//!
//! | operation | statement |
//! |---|---|
//! | claim | a `SELECT` of the live row; only when the key is free or expired, the `<table>_claim` function (`INSERT … ON CONFLICT DO UPDATE … WHERE expired`), in the same statement |
//! | complete | `INSERT … ON CONFLICT DO UPDATE … WHERE` the owner's token, and `NOTIFY` |
//! | release | `UPDATE … SET expires_at = now … WHERE` the owner's token and still in flight (the row stays, free, as the key's fence), and `NOTIFY` |
//! | renew | `UPDATE … SET expires_at … WHERE` the owner's token |
//!
//! A replay or a duplicate finding the key busy reads one row and writes
//! nothing. Leases and TTLs run on the server's clock (`clock_timestamp()`),
//! so instances whose clocks disagree still agree on when a lease ends. Every
//! claim takes the next value of the `<table>_fence` sequence: a claim's
//! fencing counter is larger than every earlier claim's of its key. Tokens
//! are [`ClaimToken`]s, unique across processes; complete, release and
//! renew compare them, so an owner that was taken over is refused. A
//! released claim's row stays (free, holding the releasing claim's token), and
//! so does a lapsed one's, for a day after its lease ended: an owner paused
//! past its lease whose key was taken over and released since finds another
//! token and is refused, rather than storing a result for a key that ran again.
//!
//! # Wake-ups
//!
//! Completions and releases `NOTIFY` a channel named after the table, with
//! the SHA-256 of the key. Each store keeps one connection of its own
//! `LISTEN`ing (outside the pool; restarted when lost, and on the tokio
//! runtime of the next waiter if its own ended), and wakes the duplicates
//! waiting on this instance at once. While it is down they poll, at least
//! twice a second, so a lost notice only costs latency.
//!
//! # Expiry
//!
//! Expired rows are never replayed: every read compares the expiry with the
//! server's clock. A task deletes them (a claim's row without a result a day
//! after its lease ended, see above) every
//! [`PostgresBuilder::with_sweep_interval`] (default 60 s) in batches of
//! [`PostgresBuilder::with_sweep_batch`] rows (default 1,000), each batch a
//! statement of its own that skips rows another statement holds, at most
//! 100 batches per sweep; [`PostgresStore::sweep`] runs one at once.
//!
//! # Connections and failures
//!
//! Statements go through a pool of [`PostgresBuilder::with_pool_size`]
//! connections (default 16), each bounded by the command timeout and
//! guarded by a circuit breaker, as with Redis: while the store fails,
//! idempotent calls fail closed with
//! [`Error::StoreUnavailable`](crate::Error::StoreUnavailable) and run
//! nothing, except an owner's renewals and completions, which always go out
//! (a run that happened must not lose its result to a short outage). A
//! statement whose caller goes away before it answered is cancelled on the
//! server and its connection discarded.
//!
//! Connections are plain TCP unless the URL asks for TLS (feature `postgres-tls`, rustls on
//! ring): `sslmode=require` (encrypted; the certificate checked only against a CA if one is
//! given), `verify-ca` (its chain against the CA), `verify-full` (its chain and host name),
//! the CA from `sslrootcert=<file>` or [`PostgresBuilder::with_ca_pem`]. Without the feature
//! no TLS stack is compiled, and a URL asking for TLS is a configuration error.
//!
//! The pool is the store's own ([`PostgresBuilder::with_pool_size`], 16 by default) or the
//! application's ([`PostgresBuilder::with_pool`]). A transactional run holds one connection
//! for its whole transaction; past the pool's size, a call waits for a connection at most the
//! command timeout (5 s by default) and then fails with
//! [`Error::StoreUnavailable`](crate::Error::StoreUnavailable) naming the pool (an HTTP 503),
//! having run nothing; [`PostgresStats::pool_waits`] and [`PostgresStats::pool_timeouts`]
//! count both.
//!
//! The default runtime ([`Runtime::global`](crate::Runtime::global)) uses
//! the database [`POSTGRES_URL_ENV`] names, connecting and migrating in the
//! background: no caller waits for it, and until it answers idempotent calls
//! fail closed.

mod notify;
#[cfg(feature = "http")]
mod open;
mod pool;
mod sql;
mod sweep;
mod tls;
mod transaction;

use std::sync::Arc;
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::time::Duration;

use serde::Serialize;

#[cfg(feature = "http")]
pub(crate) use self::open::{Begun, Ended, Open};
#[cfg(feature = "http")]
pub(crate) use self::pool::Conn;
use self::pool::{Class, Connections};
use self::sql::{Sql, TableName};
#[cfg(feature = "http")]
pub(crate) use self::transaction::{
    Acquired, CommitFailed, Locked, Owner, TransactionFailed, acquire, lost_at_lock, unavailable,
};
pub use self::transaction::{TransactionFuture, TransactionOptions, is_serialization_failure};
use crate::store::{BreakerConfig, BreakerStats, StoreError};
use crate::{
    idempotency::ClaimReply, idempotency::ClaimRequest, idempotency::ClaimToken,
    idempotency::IdempotencyStore, idempotency::IdempotencyStoreFuture, idempotency::KeyChanged,
    idempotency::StoredResult,
};

/// The PostgreSQL driver this module speaks, re-exported so that the types
/// a transactional run's closure sees ([`Transaction`](tokio_postgres::Transaction),
/// [`Error`](tokio_postgres::Error), [`ToSql`](tokio_postgres::types::ToSql))
/// are the ones of the version in use.
pub use tokio_postgres;

/// The connection pool this module uses, re-exported so that a pool made by the application
/// ([`PostgresBuilder::with_pool`]) is of the version in use.
pub use deadpool_postgres;

/// The environment variable the default runtime reads its PostgreSQL from:
/// a URL (`postgres://user@host:5432/db`) or key-value string
/// (`host=… user=… dbname=…`), as [`tokio_postgres::Config`] parses them.
pub const POSTGRES_URL_ENV: &str = "THROTTLEBEAM_POSTGRES_URL";

/// The default lowest pool size: a transactional run holds one connection
/// while its lease is renewed on another.
const MIN_POOL: usize = 2;

/// A lease or TTL beyond this (about a thousand years) holds for that long:
/// a timestamp must stay within PostgreSQL's range.
const MAX_MILLIS: u128 = 1_000 * 365 * 24 * 60 * 60 * 1_000;

/// How [`PostgresStore`] connects: URL, table, pool, timeouts.
///
/// # Examples
///
/// ```
/// use std::time::Duration;
/// use throttlebeam::idempotency::postgres::PostgresStore;
///
/// let builder = PostgresStore::builder("postgres://app@127.0.0.1:5432/app")
///     .with_table("billing.idempotency_keys")
///     .with_pool_size(32)
///     .with_command_timeout(Duration::from_secs(2));
/// # drop(builder);
/// ```
#[derive(Clone)]
#[must_use]
pub struct PostgresBuilder {
    config: Result<tokio_postgres::Config, String>,
    table: String,
    pool_size: usize,
    command_timeout: Duration,
    connect_timeout: Duration,
    breaker: BreakerConfig,
    application_name: Option<String>,
    sweep_interval: Duration,
    sweep_batch: u32,
    auto_migrate: bool,
    transaction: TransactionOptions,
    /// A pool made elsewhere, used instead of opening one.
    pool: Option<deadpool_postgres::Pool>,
    /// What the URL asked of TLS.
    tls: tls::Asked,
    /// A CA (PEM) to check the server's certificate against.
    ca_pem: Option<Vec<u8>>,
}

impl std::fmt::Debug for PostgresBuilder {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        // The config's own Debug leaves the password out.
        f.debug_struct("PostgresBuilder")
            .field("config", &self.config)
            .field("table", &self.table)
            .field("pool_size", &self.pool_size)
            .field("command_timeout", &self.command_timeout)
            .field("connect_timeout", &self.connect_timeout)
            .field("auto_migrate", &self.auto_migrate)
            .finish_non_exhaustive()
    }
}

impl PostgresBuilder {
    fn new(url: &str) -> Self {
        let (url, tls) = tls::split(url);
        Self {
            tls,
            ca_pem: None,
            config: url
                .parse::<tokio_postgres::Config>()
                .map_err(|e| format!("invalid postgres url: {e}")),
            table: sql::DEFAULT_TABLE.to_owned(),
            pool_size: 16,
            command_timeout: Duration::from_secs(5),
            connect_timeout: Duration::from_secs(5),
            breaker: BreakerConfig::default(),
            application_name: None,
            sweep_interval: Duration::from_secs(60),
            sweep_batch: 1_000,
            auto_migrate: false,
            transaction: TransactionOptions::new(),
            pool: None,
        }
    }

    /// Sends the store's statements and transactional runs through `pool`, a pool the
    /// application made (and shares with its own queries), instead of opening one: the
    /// store's statements and the application's take turns on its connections, and
    /// [`with_pool_size`](Self::with_pool_size) is ignored (the pool's own size holds). The
    /// URL still names the database, for the one connection the store opens outside the pool
    /// (its `LISTEN` for wake-ups), so it must name the pool's database.
    ///
    /// A transactional run holds one connection of the pool for its whole transaction, and
    /// the store's statements wait for a connection at most the command timeout: size the
    /// pool for the application's queries plus the runs in flight.
    ///
    /// # Examples
    ///
    /// ```no_run
    /// # async fn demo() -> Result<(), Box<dyn std::error::Error>> {
    /// use throttlebeam::idempotency::postgres::{PostgresStore, deadpool_postgres, tokio_postgres};
    ///
    /// let url = "postgres://app@127.0.0.1/shop";
    /// let manager = deadpool_postgres::Manager::new(url.parse()?, tokio_postgres::NoTls);
    /// let pool = deadpool_postgres::Pool::builder(manager).max_size(32).build()?;
    /// // The application queries `pool`; the store shares it.
    /// let store = PostgresStore::builder(url).with_pool(pool.clone()).connect().await?;
    /// # drop(store); Ok(()) }
    /// ```
    pub fn with_pool(mut self, pool: deadpool_postgres::Pool) -> Self {
        self.pool = Some(pool);
        self
    }

    /// The CA (PEM, one or more certificates) that the server's certificate must chain to,
    /// as `sslrootcert=<file>` in the URL gives it (feature `postgres-tls`). With it,
    /// `sslmode=require` (and `prefer`) check the chain as `verify-ca` does; `verify-full`
    /// checks the host name too. Without the feature, a CA is a configuration error.
    ///
    /// # Examples
    ///
    /// ```no_run
    /// # async fn demo(ca_pem: Vec<u8>) -> Result<(), throttlebeam::store::StoreError> {
    /// use throttlebeam::idempotency::postgres::PostgresStore;
    ///
    /// let store = PostgresStore::builder("postgres://app@db.internal/shop?sslmode=verify-full")
    ///     .with_ca_pem(ca_pem)
    ///     .connect()
    ///     .await?;
    /// # drop(store); Ok(()) }
    /// ```
    pub fn with_ca_pem(mut self, pem: impl Into<Vec<u8>>) -> Self {
        self.ca_pem = Some(pem.into());
        self
    }

    /// The isolation level and timeout of this store's transactional runs (default: the
    /// session's isolation level, 60 s), see [`TransactionOptions`].
    pub fn with_transaction_options(mut self, options: TransactionOptions) -> Self {
        self.transaction = options;
        self
    }

    /// The table (default `throttlebeam_idempotency`), optionally
    /// schema-qualified (`billing.idempotency_keys`; the schema must exist).
    /// Lowercase letters, digits and underscores; the table name at most 48
    /// bytes (the sequence, index and function are named after it).
    pub fn with_table(mut self, table: impl Into<String>) -> Self {
        self.table = table.into();
        self
    }

    /// Connections in the pool (default 16, at least 2): at most this many
    /// statements and transactional runs at once; others wait (within the
    /// command timeout) for a connection.
    pub fn with_pool_size(mut self, size: usize) -> Self {
        self.pool_size = size;
        self
    }

    /// How long one statement may take, waiting for a connection included
    /// (default 5 s); past it the statement is cancelled and the call fails
    /// with [`StoreError::Timeout`], which counts against the breaker.
    pub fn with_command_timeout(mut self, timeout: Duration) -> Self {
        self.command_timeout = timeout;
        self
    }

    /// How long opening a connection may take (default 5 s).
    pub fn with_connect_timeout(mut self, timeout: Duration) -> Self {
        self.connect_timeout = timeout;
        self
    }

    /// The circuit breaker (default: 5 consecutive failures open it for
    /// 10 s).
    pub fn with_breaker(mut self, breaker: BreakerConfig) -> Self {
        self.breaker = breaker;
        self
    }

    /// The `application_name` of the store's connections, as
    /// `pg_stat_activity` shows it (default: the URL's, else
    /// `throttlebeam`).
    pub fn with_application_name(mut self, name: impl Into<String>) -> Self {
        self.application_name = Some(name.into());
        self
    }

    /// How often expired rows are deleted (default 60 s).
    pub fn with_sweep_interval(mut self, interval: Duration) -> Self {
        self.sweep_interval = interval;
        self
    }

    /// Rows one sweeping statement deletes at most (default 1,000).
    pub fn with_sweep_batch(mut self, rows: u32) -> Self {
        self.sweep_batch = rows;
        self
    }

    /// Runs [`PostgresStore::migrate`] as part of connecting (default off:
    /// the table is created by a deliberate call or a migration tool).
    pub fn with_auto_migrate(mut self, migrate: bool) -> Self {
        self.auto_migrate = migrate;
        self
    }

    /// Checks the settings and makes the store, connecting nothing yet.
    fn build(self, ready: bool) -> Result<Arc<Inner>, StoreError> {
        let mut config = self.config.map_err(StoreError::Config)?;
        let table = TableName::parse(&self.table)?;
        if self.pool.is_none() && self.pool_size < MIN_POOL {
            return Err(StoreError::Config(format!(
                "postgres pool size {} is below the minimum of {MIN_POOL}",
                self.pool_size
            )));
        }
        for (what, d) in [
            ("command timeout", self.command_timeout),
            ("connect timeout", self.connect_timeout),
            ("sweep interval", self.sweep_interval),
        ] {
            if d.is_zero() || d > crate::clock::MAX_TIMER {
                return Err(StoreError::Config(format!(
                    "postgres {what} {d:?} is out of range (1 ns to 2^36 - 1 ms)"
                )));
            }
        }
        if self.sweep_batch == 0 {
            return Err(StoreError::Config(
                "postgres sweep batch must be at least 1 row".to_owned(),
            ));
        }
        if let Some(name) = self.application_name {
            config.application_name(name);
        } else if config.get_application_name().is_none() {
            config.application_name("throttlebeam");
        }
        config.connect_timeout(self.connect_timeout);
        let tls = tls::connector(&mut config, &self.tls, self.ca_pem.as_deref())?;
        let connections = match self.pool {
            Some(pool) => {
                Connections::with_pool(pool, config, tls, self.command_timeout, self.breaker)
            }
            None => Connections::new(
                config,
                tls,
                self.pool_size,
                self.command_timeout,
                self.connect_timeout,
                self.breaker,
            )?,
        };
        Ok(Arc::new(Inner {
            sql: Sql::new(table),
            connections,
            waiters: notify::Waiters::default(),
            stop: tokio::sync::watch::Sender::new(()),
            sweeping: AtomicBool::new(false),
            sweep_interval: self.sweep_interval,
            sweep_batch: self.sweep_batch,
            swept: AtomicU64::new(0),
            ready: AtomicBool::new(ready),
            connecting: AtomicBool::new(false),
            auto_migrate: self.auto_migrate,
            transaction: self.transaction,
            runs: RunCounters::default(),
        }))
    }

    /// Makes the store and checks that the server answers (one round trip,
    /// plus the migration with [`with_auto_migrate`](Self::with_auto_migrate)).
    ///
    /// # Errors
    ///
    /// [`StoreError::Config`] for an invalid URL, table name, pool size,
    /// timeout or sweep setting; [`StoreError::Unavailable`] or
    /// [`StoreError::Timeout`] if the server does not answer.
    pub async fn connect(self) -> Result<PostgresStore, StoreError> {
        let inner = self.build(true)?;
        inner.check().await?;
        Ok(PostgresStore { inner })
    }

    /// Makes the store without waiting for the server: it connects (and,
    /// with [`with_auto_migrate`](Self::with_auto_migrate), migrates) in the
    /// background, on the current tokio runtime if there is one, else on
    /// that of its first call. Until that succeeds, every call fails closed
    /// with [`StoreError::Unavailable`] ("postgres is not connected yet");
    /// attempts back off from 100 ms to 2 s, the first failure logged at
    /// warn. What the default runtime does with [`POSTGRES_URL_ENV`].
    ///
    /// # Errors
    ///
    /// [`StoreError::Config`] for an invalid URL, table name, pool size,
    /// timeout or sweep setting (nothing to retry).
    pub fn connect_in_background(self) -> Result<PostgresStore, StoreError> {
        let inner = self.build(false)?;
        inner.kick();
        Ok(PostgresStore { inner })
    }
}

/// The store's shared state.
pub(crate) struct Inner {
    sql: Sql,
    connections: Connections,
    waiters: notify::Waiters,
    /// Dropped with the store: its listener and sweeper stop.
    stop: tokio::sync::watch::Sender<()>,
    sweeping: AtomicBool,
    sweep_interval: Duration,
    sweep_batch: u32,
    swept: AtomicU64,
    /// The server answered (and the table was migrated, if asked).
    ready: AtomicBool,
    /// A background connection attempt runs.
    connecting: AtomicBool,
    auto_migrate: bool,
    /// The default options of transactional runs.
    transaction: TransactionOptions,
    /// What transactional runs came to.
    runs: RunCounters,
}

/// Counters of transactional runs (store-wide, whoever runs them).
#[derive(Debug, Default)]
pub(crate) struct RunCounters {
    pub(crate) fresh: AtomicU64,
    pub(crate) replays: AtomicU64,
    pub(crate) fingerprint_mismatches: AtomicU64,
    pub(crate) in_flight: AtomicU64,
    pub(crate) takeovers: AtomicU64,
    pub(crate) committed: AtomicU64,
    pub(crate) rolled_back: AtomicU64,
    pub(crate) pool_waits: AtomicU64,
}

/// Reports `store`'s figures in the stats of the runtime of `idempotency`
/// (`runtime.stats().postgres`), unless that runtime reports a store already.
pub(crate) fn count_in(idempotency: &crate::IdempotencyHandle, store: &PostgresStore) {
    report_in(&idempotency.runtime().core, store);
}

/// Reports `store`'s figures in the stats of `core`'s runtime, unless it reports one already.
pub(crate) fn report_in(core: &crate::runtime::Core, store: &PostgresStore) {
    let _ = core.service(|_| StatsService(store.clone()));
}

/// A store's figures in a runtime's stats.
struct StatsService(PostgresStore);

impl crate::runtime::Service for StatsService {
    fn stats(&self, stats: &mut crate::Stats) {
        stats.postgres = self.0.stats();
    }
}

/// `value`'s stored form for a request with `fingerprint`, checked to read back (see
/// `checked_stored_result`).
#[cfg(feature = "http")]
pub(crate) fn stored_result<T>(
    fingerprint: Option<crate::idempotency::Fingerprint>,
    value: &T,
) -> Result<StoredResult, crate::Error>
where
    T: Serialize + serde::de::DeserializeOwned + 'static,
{
    crate::idempotency::store::checked_stored_result(fingerprint, value)
        .map_err(|e| unavailable("(response)", e))
}

/// Whether a claim failed only because its key is contended this instant: a lock it would
/// have waited for past the claim's `lock_timeout`, or a serialization failure or deadlock of
/// the claim's own statement (a database whose default isolation is SERIALIZABLE). The claim
/// answers busy; the store did not fail.
fn is_contention(e: &tokio_postgres::Error) -> bool {
    use tokio_postgres::error::SqlState;
    e.code().is_some_and(|code| {
        *code == SqlState::LOCK_NOT_AVAILABLE
            || *code == SqlState::T_R_SERIALIZATION_FAILURE
            || *code == SqlState::T_R_DEADLOCK_DETECTED
    })
}

/// Why a call found a store connecting in the background not connected
/// yet.
#[derive(Debug, thiserror::Error)]
#[error("postgres is not connected yet (unreachable at start; connecting in the background)")]
struct NotConnected;

impl Inner {
    /// One round trip, and the migration if asked: what connecting means.
    async fn check(&self) -> Result<(), StoreError> {
        if self.auto_migrate {
            self.connections
                .batch(Class::MustTry, &self.sql.migrate)
                .await
        } else {
            self.connections.batch(Class::MustTry, "SELECT 1").await
        }
    }

    /// Fails closed while the store connects in the background (and starts
    /// connecting if nobody is).
    #[inline]
    fn ready(self: &Arc<Self>) -> Result<(), StoreError> {
        if self.ready.load(Ordering::Acquire) {
            return Ok(());
        }
        self.kick();
        Err(StoreError::unavailable(NotConnected))
    }

    /// Starts connecting on the current tokio runtime, unless connected,
    /// outside a tokio runtime or already connecting.
    fn kick(self: &Arc<Self>) {
        if self.ready.load(Ordering::Acquire) || self.connecting.load(Ordering::Acquire) {
            return;
        }
        let Ok(runtime) = tokio::runtime::Handle::try_current() else {
            return;
        };
        if self.connecting.swap(true, Ordering::AcqRel) {
            return;
        }
        let guard = Connecting(Arc::downgrade(self));
        let mut stopped = self.stop.subscribe();
        runtime.spawn(async move {
            tokio::select! {
                () = connect(&guard) => {}
                _ = stopped.changed() => {}
            }
            drop(guard);
        });
    }

    async fn claim(
        self: &Arc<Self>,
        key: &str,
        request: ClaimRequest<'_>,
    ) -> Result<ClaimReply, StoreError> {
        self.ready()?;
        sweep::start(self);
        let token = request.token.to_bytes();
        let fingerprint = request.fingerprint.map(|f| &f[..]);
        let lease = millis(request.lease);
        let durable = true;
        let connections = &self.connections;
        let sql = &self.sql.claim;
        connections
            .guarded(Class::Refusable, async {
                let mut conn = connections.get().await?;
                connections.count();
                match conn
                    .query_one(
                        sql,
                        &[&key.as_bytes(), &&token[..], &fingerprint, &lease, &durable],
                    )
                    .await
                {
                    Ok(row) => claim_reply(&row, request.fingerprint),
                    // Contended this instant (a lock, a serialization failure): look again soon.
                    Err(e) if is_contention(&e) => Ok(ClaimReply::Busy {
                        lease_left: Duration::from_millis(50),
                    }),
                    Err(e) => Err(pool::store_error(e)),
                }
            })
            .await
    }

    async fn complete(
        self: &Arc<Self>,
        key: &str,
        token: ClaimToken,
        result: &StoredResult,
        ttl: Duration,
    ) -> Result<bool, StoreError> {
        self.ready()?;
        let token = token.to_bytes();
        let fingerprint = result.fingerprint.as_ref().map(|f| &f[..]);
        let ttl = millis(ttl);
        // The owner's run happened: never refused by an open breaker.
        let row = self
            .connections
            .query_one(
                Class::MustTry,
                &self.sql.complete,
                &[
                    &key.as_bytes(),
                    &&token[..],
                    &fingerprint,
                    &result.type_tag,
                    &&result.value[..],
                    &ttl,
                    &self.sql.channel,
                ],
            )
            .await?;
        row.try_get::<_, bool>(0).map_err(protocol)
    }

    async fn release(self: &Arc<Self>, key: &str, token: ClaimToken) -> Result<bool, StoreError> {
        self.ready()?;
        let token = token.to_bytes();
        let row = self
            .connections
            .query_one(
                Class::Refusable,
                &self.sql.release,
                &[&key.as_bytes(), &&token[..], &self.sql.channel],
            )
            .await?;
        Ok(row.try_get::<_, i64>(0).map_err(protocol)? > 0)
    }

    async fn renew(
        self: &Arc<Self>,
        key: &str,
        token: ClaimToken,
        lease: Duration,
    ) -> Result<bool, StoreError> {
        self.ready()?;
        let token = token.to_bytes();
        let lease = millis(lease);
        // A live owner showing it is alive: never refused by an open breaker.
        let renewed = self
            .connections
            .execute(
                Class::MustTry,
                &self.sql.renew,
                &[&key.as_bytes(), &&token[..], &lease],
            )
            .await?;
        Ok(renewed == 1)
    }
}

/// Marks the store connecting while alive: a connecting task dropped
/// unfinished (its tokio runtime ended) lets the next call start another.
struct Connecting(std::sync::Weak<Inner>);

impl Drop for Connecting {
    fn drop(&mut self) {
        if let Some(inner) = self.0.upgrade() {
            inner.connecting.store(false, Ordering::Release);
        }
    }
}

/// Checks the server until it answers or the store is dropped, backing off
/// from 100 ms to 2 s.
async fn connect(guard: &Connecting) {
    let mut pause = Duration::from_millis(100);
    let mut failures = 0_u64;
    loop {
        let Some(inner) = guard.0.upgrade() else {
            return;
        };
        match inner.check().await {
            Ok(()) => {
                inner.ready.store(true, Ordering::Release);
                tracing::info!(
                    failures,
                    table = %inner.sql.table.plain(),
                    "postgres connected: idempotency shares through it"
                );
                return;
            }
            Err(error) => {
                failures += 1;
                let error: &(dyn std::error::Error + 'static) = &error;
                if failures == 1 {
                    tracing::warn!(
                        error,
                        "postgres is unreachable: until it connects, idempotency fails closed \
                         (StoreUnavailable); connecting in the background"
                    );
                } else {
                    tracing::debug!(error, failures, "postgres still unreachable; retrying");
                }
            }
        }
        drop(inner);
        tokio::time::sleep(pause).await;
        pause = (pause * 2).min(Duration::from_secs(2));
    }
}

/// A lease or TTL in whole milliseconds, rounded up (a lease of 0.4 ms
/// holds for 1 ms, not 0) and capped at about a thousand years.
fn millis(d: Duration) -> i64 {
    let ms = d.as_nanos().div_ceil(1_000_000).min(MAX_MILLIS);
    i64::try_from(ms).unwrap_or(i64::MAX)
}

fn protocol(e: tokio_postgres::Error) -> StoreError {
    StoreError::Protocol(format!("unexpected postgres reply: {e}"))
}

/// What a claim's row says, for a claimant with `fingerprint`.
fn claim_reply(
    row: &tokio_postgres::Row,
    fingerprint: Option<&[u8; 32]>,
) -> Result<ClaimReply, StoreError> {
    let fence: Option<i64> = row.try_get(5).map_err(protocol)?;
    if let Some(fence) = fence {
        return Ok(ClaimReply::Won {
            fence: fence.max(0).unsigned_abs(),
        });
    }
    let done: Option<bool> = row.try_get(0).map_err(protocol)?;
    let left: Option<i64> = row.try_get(4).map_err(protocol)?;
    let left = left.unwrap_or(0);
    let Some(done) = done.filter(|_| left > 0) else {
        // Lost a race to a claim, release or expiry that landed meanwhile:
        // look again at once.
        return Ok(ClaimReply::Busy {
            lease_left: Duration::ZERO,
        });
    };
    let held: Option<Vec<u8>> = row.try_get(1).map_err(protocol)?;
    if held.as_deref() != fingerprint.map(|f| &f[..]) {
        return Ok(ClaimReply::Mismatch);
    }
    if !done {
        return Ok(ClaimReply::Busy {
            lease_left: Duration::from_millis(left.unsigned_abs()),
        });
    }
    let type_tag: Option<String> = row.try_get(2).map_err(protocol)?;
    let value: Option<Vec<u8>> = row.try_get(3).map_err(protocol)?;
    Ok(ClaimReply::Completed(StoredResult::new(
        fingerprint.copied(),
        type_tag.unwrap_or_default(),
        value.unwrap_or_default(),
    )))
}

/// Idempotency claims and results in one PostgreSQL table shared by every
/// instance; see [the module](self) for the table, the statements and the
/// guarantees.
///
/// A cheap handle (`Clone`). Made by [`PostgresStore::builder`] (or
/// [`PostgresStore::from_env`]) and [`PostgresBuilder::connect`]; given to
/// a runtime with
/// [`RuntimeBuilder::with_postgres`](crate::runtime::RuntimeBuilder::with_postgres);
/// used directly for [`run_in_transaction`](PostgresStore::run_in_transaction).
#[derive(Clone)]
pub struct PostgresStore {
    inner: Arc<Inner>,
}

impl std::fmt::Debug for PostgresStore {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("PostgresStore")
            .field("table", &self.inner.sql.table.plain())
            .field("stats", &self.stats())
            .finish_non_exhaustive()
    }
}

/// Counters of a [`PostgresStore`].
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize)]
#[non_exhaustive]
pub struct PostgresStats {
    /// Statements sent through the pool (claims, completions, releases,
    /// renewals, sweeps, transactional runs' own statements; not the
    /// statements of a transactional run's closure).
    pub statements: u64,
    /// The circuit breaker.
    pub breaker: BreakerStats,
    /// Times the change listener issued `LISTEN`: 1 once it is live, more
    /// after it lost its connection or restarted.
    pub subscriptions: u64,
    /// Change notices the listener received.
    pub notices: u64,
    /// Expired rows the sweeper deleted.
    pub swept: u64,
    /// Whether the server has answered (a store connecting in the
    /// background is not connected until it does).
    pub connected: bool,
    /// Connections the pool may open ([`PostgresBuilder::with_pool_size`], or the size of a
    /// pool given with [`PostgresBuilder::with_pool`]).
    pub pool_size: usize,
    /// Times a statement or a transactional run found no connection free and waited for one
    /// (at most the command timeout).
    pub pool_waits: u64,
    /// Times that wait ran out: the caller failed with [`Error::StoreUnavailable`](crate::Error::StoreUnavailable)
    /// (an HTTP 503), nothing ran.
    pub pool_timeouts: u64,
    /// Transactional runs (through [`PostgresStore::run_in_transaction`] or the HTTP layer's
    /// transactions).
    pub transactions: TransactionStats,
}

impl Default for PostgresStats {
    /// All zero: no store.
    fn default() -> Self {
        Self {
            statements: 0,
            breaker: crate::store::Breaker::new(BreakerConfig::default()).stats(),
            subscriptions: 0,
            notices: 0,
            swept: 0,
            connected: false,
            pool_size: 0,
            pool_waits: 0,
            pool_timeouts: 0,
            transactions: TransactionStats::default(),
        }
    }
}

/// Counters of a [`PostgresStore`]'s transactional runs.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default, Serialize)]
#[non_exhaustive]
pub struct TransactionStats {
    /// Runs that claimed their key and began their transaction.
    pub fresh: u64,
    /// Calls answered with a committed result.
    pub replays: u64,
    /// Calls refused for another fingerprint.
    pub fingerprint_mismatches: u64,
    /// Calls that found their key in flight and were refused at once or waited past their
    /// wait timeout.
    pub in_flight: u64,
    /// Claims that took over a key whose holder was gone (its lease over and its row locked
    /// by no transaction).
    pub takeovers: u64,
    /// Runs whose transaction committed with their result.
    pub committed: u64,
    /// Runs rolled back: the closure or handler failed, panicked or answered a status that is
    /// not stored, or the transaction around it failed.
    pub rolled_back: u64,
    /// Runs that waited for a connection to claim their key on.
    pub pool_waits: u64,
}

impl PostgresStore {
    /// A builder from a URL (`postgres://user:password@host:5432/db`, with
    /// `?application_name=…&options=…` if needed) or a key-value string
    /// (`host=… user=… dbname=…`). The URL is checked when connecting.
    pub fn builder(url: &str) -> PostgresBuilder {
        PostgresBuilder::new(url)
    }

    /// A builder for the database [`POSTGRES_URL_ENV`] names, migrating as
    /// it connects ([`PostgresBuilder::with_auto_migrate`]); `None` when the
    /// variable is unset or empty.
    #[must_use]
    pub fn from_env() -> Option<PostgresBuilder> {
        let url = std::env::var(POSTGRES_URL_ENV).ok()?;
        let url = url.trim();
        (!url.is_empty()).then(|| PostgresBuilder::new(url).with_auto_migrate(true))
    }

    /// Creates the table, its index, its fencing sequence and its claim
    /// function if they do not exist, in one transaction, under an advisory
    /// lock (instances migrating together take turns). Running it again
    /// changes nothing; it replaces the claim function with this build's.
    ///
    /// # Errors
    ///
    /// As every call: unavailable, timed out, or refused (no privilege to
    /// create the table, a schema that does not exist) as
    /// [`StoreError::Protocol`].
    ///
    /// # Examples
    ///
    /// ```no_run
    /// # async fn demo() -> Result<(), throttlebeam::store::StoreError> {
    /// use throttlebeam::idempotency::postgres::PostgresStore;
    ///
    /// let store = PostgresStore::builder("postgres://app@127.0.0.1/app").connect().await?;
    /// store.migrate().await?;
    /// store.migrate().await?; // nothing to do the second time
    /// # Ok(()) }
    /// ```
    pub async fn migrate(&self) -> Result<(), StoreError> {
        self.inner
            .connections
            .batch(Class::MustTry, &self.inner.sql.migrate)
            .await
    }

    /// The SQL [`PostgresStore::migrate`] runs for this store's table, for a
    /// migration tool of your own.
    #[must_use]
    pub fn migration_sql(&self) -> &str {
        &self.inner.sql.migrate
    }

    /// The SQL that undoes [`PostgresStore::migrate`] for this store's table: drops the
    /// claim function, the table (every key and result in it) and the fencing sequence. For
    /// the default table it is:
    ///
    /// ```sql
    #[doc = include_str!("postgres/undo.sql")]
    /// ```
    #[must_use]
    pub fn undo_migration_sql(&self) -> &str {
        &self.inner.sql.undo
    }

    /// The options transactional runs begin with unless told otherwise
    /// ([`PostgresBuilder::with_transaction_options`]).
    pub fn transaction_options(&self) -> TransactionOptions {
        self.inner.transaction
    }

    /// The table, as configured (`table` or `schema.table`).
    #[must_use]
    pub fn table(&self) -> String {
        self.inner.sql.table.plain()
    }

    /// Counters, breaker included.
    #[must_use]
    pub fn stats(&self) -> PostgresStats {
        let (subscriptions, notices) = self.inner.waiters.counts();
        let (pool_waits, pool_timeouts) = self.inner.connections.pool_counts();
        let runs = &self.inner.runs;
        let read = |c: &AtomicU64| c.load(Ordering::Relaxed);
        PostgresStats {
            pool_size: self.inner.connections.pool_size().0,
            pool_waits,
            pool_timeouts,
            transactions: TransactionStats {
                fresh: read(&runs.fresh),
                replays: read(&runs.replays),
                fingerprint_mismatches: read(&runs.fingerprint_mismatches),
                in_flight: read(&runs.in_flight),
                takeovers: read(&runs.takeovers),
                committed: read(&runs.committed),
                rolled_back: read(&runs.rolled_back),
                pool_waits: read(&runs.pool_waits),
            },
            statements: self.inner.connections.statements(),
            breaker: self.inner.connections.breaker.stats(),
            subscriptions,
            notices,
            swept: self.inner.swept.load(Ordering::Relaxed),
            connected: self.inner.ready.load(Ordering::Acquire),
        }
    }

    /// Whether the change listener's `LISTEN` is in force now.
    #[must_use]
    pub fn is_listening(&self) -> bool {
        self.inner.waiters.is_subscribed()
    }

    /// Deletes expired rows now, in batches (see [the module](self#expiry));
    /// returns how many went.
    ///
    /// # Errors
    ///
    /// As every call: unavailable, timed out, breaker open.
    pub async fn sweep(&self) -> Result<u64, StoreError> {
        self.inner.ready()?;
        sweep::sweep(&self.inner).await
    }
}

/// Idempotency across instances: claims and results in PostgreSQL, one
/// statement each, changes announced with `NOTIFY`.
impl IdempotencyStore for PostgresStore {
    fn claim<'a>(
        &'a self,
        key: &'a str,
        request: ClaimRequest<'a>,
    ) -> IdempotencyStoreFuture<'a, ClaimReply> {
        Box::pin(self.inner.claim(key, request))
    }

    fn complete<'a>(
        &'a self,
        key: &'a str,
        token: ClaimToken,
        result: &'a StoredResult,
        ttl: Duration,
    ) -> IdempotencyStoreFuture<'a, bool> {
        Box::pin(self.inner.complete(key, token, result, ttl))
    }

    fn release<'a>(&'a self, key: &'a str, token: ClaimToken) -> IdempotencyStoreFuture<'a, bool> {
        Box::pin(self.inner.release(key, token))
    }

    fn renew<'a>(
        &'a self,
        key: &'a str,
        token: ClaimToken,
        lease: Duration,
    ) -> IdempotencyStoreFuture<'a, bool> {
        Box::pin(self.inner.renew(key, token, lease))
    }

    fn watch(&self, key: &str) -> KeyChanged {
        notify::watch(&self.inner, key)
    }

    fn name(&self) -> &'static str {
        "postgres"
    }
}

/// A store whose configuration was refused: every call fails with that
/// error, so a runtime told to share through PostgreSQL never silently
/// runs per instance.
struct Misconfigured(StoreError);

impl IdempotencyStore for Misconfigured {
    fn claim<'a>(
        &'a self,
        _: &'a str,
        _: ClaimRequest<'a>,
    ) -> IdempotencyStoreFuture<'a, ClaimReply> {
        Box::pin(std::future::ready(Err(self.0.clone())))
    }

    fn complete<'a>(
        &'a self,
        _: &'a str,
        _: ClaimToken,
        _: &'a StoredResult,
        _: Duration,
    ) -> IdempotencyStoreFuture<'a, bool> {
        Box::pin(std::future::ready(Err(self.0.clone())))
    }

    fn release<'a>(&'a self, _: &'a str, _: ClaimToken) -> IdempotencyStoreFuture<'a, bool> {
        Box::pin(std::future::ready(Err(self.0.clone())))
    }

    fn renew<'a>(
        &'a self,
        _: &'a str,
        _: ClaimToken,
        _: Duration,
    ) -> IdempotencyStoreFuture<'a, bool> {
        Box::pin(std::future::ready(Err(self.0.clone())))
    }
}

/// `builder` sharing idempotency through the PostgreSQL of
/// [`POSTGRES_URL_ENV`], connecting in the background; unchanged when the
/// variable is unset. A URL or setting that cannot work is logged at error
/// and makes every idempotent call fail closed with it.
pub(crate) fn with_env(builder: crate::runtime::RuntimeBuilder) -> crate::runtime::RuntimeBuilder {
    let Some(postgres) = PostgresStore::from_env() else {
        return builder;
    };
    match postgres.connect_in_background() {
        Ok(store) => builder.with_postgres(store),
        Err(error) => {
            let shown: &(dyn std::error::Error + 'static) = &error;
            tracing::error!(
                error = shown,
                "{POSTGRES_URL_ENV} cannot be used: idempotency fails closed until it is fixed"
            );
            builder.with_idempotency_store(Misconfigured(error))
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn leases_round_up_to_whole_milliseconds_and_saturate() {
        assert_eq!(millis(Duration::from_micros(400)), 1);
        assert_eq!(millis(Duration::from_millis(1500)), 1500);
        assert_eq!(millis(Duration::ZERO), 0);
        assert_eq!(
            millis(Duration::MAX),
            i64::try_from(MAX_MILLIS).unwrap(),
            "a thousand years, within PostgreSQL's timestamps"
        );
    }

    #[tokio::test]
    async fn bad_settings_are_typed_errors_that_name_the_bound() {
        let cases: [(PostgresBuilder, &str); 6] = [
            (
                PostgresStore::builder("postgres://x@127.0.0.1:1/db").with_pool_size(1),
                "below the minimum of 2",
            ),
            (
                PostgresStore::builder("postgres://x@127.0.0.1:1/db").with_table("Bad"),
                "lowercase letters",
            ),
            (
                PostgresStore::builder("postgres://x@127.0.0.1:1/db")
                    .with_command_timeout(Duration::ZERO),
                "command timeout",
            ),
            (
                PostgresStore::builder("postgres://x@127.0.0.1:1/db").with_sweep_batch(0),
                "at least 1 row",
            ),
            (
                PostgresStore::builder("postgres://x@127.0.0.1:1/db")
                    .with_sweep_interval(Duration::ZERO),
                "sweep interval",
            ),
            (
                PostgresStore::builder("mysql://nope"),
                "invalid postgres url",
            ),
        ];
        for (builder, needle) in cases {
            let e = builder.clone().connect_in_background().unwrap_err();
            assert!(matches!(e, StoreError::Config(_)), "{e:?}");
            assert!(e.to_string().contains(needle), "{e}");
            let e = builder.connect().await.unwrap_err();
            assert!(e.to_string().contains(needle), "{e}");
        }
    }

    #[tokio::test]
    async fn a_store_connecting_in_the_background_fails_closed_until_connected() {
        let store = PostgresStore::builder("postgres://x@127.0.0.1:1/db")
            .with_connect_timeout(Duration::from_millis(200))
            .connect_in_background()
            .unwrap();
        let request = ClaimRequest::new(
            ClaimToken::new(),
            None,
            Duration::from_secs(1),
            Duration::from_secs(1),
        );
        let e = store.claim("k", request).await.unwrap_err();
        assert!(e.to_string().contains("store unavailable"), "{e}");
        let source = std::error::Error::source(&e).unwrap().to_string();
        assert!(source.contains("postgres is not connected yet"), "{source}");
        assert!(!store.stats().connected);
    }
}
