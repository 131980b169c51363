//! Transactional runs: a claim held by the run's own transaction, in which the run's writes,
//! the stored result and the completion commit together.
//!
//! How the claim is held. The claim is the same statement as every claim of the table
//! (`Inner::claim`'s), sent on the connection the run will use, with a short lease (the
//! *grace*, [`CLAIM_GRACE`] at most) and an unflushed commit: from then on duplicates on every
//! instance see the key in flight (and its fingerprint), wait for its `NOTIFY` and replay, or
//! fail fast, without blocking in the database. The transaction then begins on that
//! connection, at the run's isolation level, and its first statement locks the claim's row
//! (`SELECT … FOR UPDATE`, if the row is still this token's), so that its snapshot follows the
//! claim. From there the row lock is the claim: nothing renews it, and nothing beside the
//! transaction touches it. A claim whose lease ended is taken over only if no transaction holds
//! its row (`FOR UPDATE SKIP LOCKED` in the claim function), so a live run is never taken over,
//! however long it lasts and however full the pool; once the owner's connection dies
//! (a crashed process, a terminated backend, the server's timeouts) its lock goes with it and
//! the next look of a waiting duplicate (at most half a second later, sooner when woken) takes
//! the key over. The grace only covers the moment between the claim's commit and the lock; a
//! run that did not lock its row in time (paused past the grace, and taken over meanwhile)
//! finds the row another's, rolls back before running anything and looks again.
//!
//! The completion is the same compare-and-set on the owner's token as every completion, in the
//! transaction (and on the transaction that locked the row: a closure that committed or rolled
//! back on its own is told so), and the commit is the only point where the run becomes visible.
//! An orphaned transaction (its client gone without the server noticing) holds its key until
//! the server ends it: the transaction's `statement_timeout` and
//! `idle_in_transaction_session_timeout` are [`TransactionOptions::with_timeout`] (60 s by
//! default), so at most twice that.

use std::future::Future;
use std::pin::Pin;
use std::sync::Arc;
use std::time::Duration;

use serde::Serialize;
use serde::de::DeserializeOwned;
use throttlebeam_supervisors::catch_panic;
use tokio::time::Instant;
use tokio_postgres::error::SqlState;
use tokio_postgres::{IsolationLevel, Statement};

use super::pool::{Class, Conn, store_error};
use super::{Inner, PostgresStore, millis, notify, protocol};
use crate::error::check_key;
use crate::error::{BoxError, Error};
use crate::idempotency::claim::Tally;
use crate::idempotency::full_key::with_full_key;
use crate::idempotency::options::Fingerprint;
use crate::idempotency::store::{Record, checked_stored_result};
use crate::idempotency::{NotRecorded, StoredResult};
use crate::key::shown;
use crate::store::StoreError;
use crate::{
    IdempotencyOptions, IdempotencyOutcome, idempotency::ClaimToken, idempotency::InFlight,
};

/// What a transactional run's closure returns: its future, boxed, borrowing
/// the transaction.
pub type TransactionFuture<'t, T, E> = Pin<Box<dyn Future<Output = Result<T, E>> + Send + 't>>;

/// The longest a waiting duplicate sleeps between two looks when no notice
/// arrives.
const MAX_POLL: Duration = Duration::from_millis(500);

/// The lease a transactional claim is committed with: enough for the claim's commit and the
/// transaction's first statement, which locks the row (after that the lock holds it).
pub(crate) const CLAIM_GRACE: Duration = Duration::from_secs(1);

/// The default [`TransactionOptions::with_timeout`].
const DEFAULT_TIMEOUT: Duration = Duration::from_secs(60);

/// How a transactional run's transaction is opened: its isolation level and its timeouts.
///
/// # Examples
///
/// ```
/// use std::time::Duration;
/// use throttlebeam::idempotency::postgres::{TransactionOptions, tokio_postgres::IsolationLevel};
///
/// let options = TransactionOptions::new()
///     .with_isolation_level(IsolationLevel::Serializable)
///     .with_timeout(Duration::from_secs(30));
/// assert!(matches!(options.isolation_level(), Some(IsolationLevel::Serializable)));
/// ```
#[derive(Debug, Clone, Copy)]
#[must_use]
pub struct TransactionOptions {
    isolation: Option<IsolationLevel>,
    timeout: Duration,
}

impl Default for TransactionOptions {
    fn default() -> Self {
        Self::new()
    }
}

impl TransactionOptions {
    /// The session's default isolation level (`default_transaction_isolation`, READ
    /// COMMITTED unless the database or role says otherwise) and a 60 s timeout.
    pub fn new() -> Self {
        Self {
            isolation: None,
            timeout: DEFAULT_TIMEOUT,
        }
    }

    /// The transaction's isolation level, set as it begins (`BEGIN ISOLATION LEVEL …`). The
    /// closure cannot set it itself: `SET TRANSACTION ISOLATION LEVEL` must come before any
    /// other statement, and the run's first statement locks its claim.
    pub fn with_isolation_level(mut self, level: IsolationLevel) -> Self {
        self.isolation = Some(level);
        self
    }

    /// The isolation level asked for, if any (`None`: the session's default).
    #[must_use]
    pub fn isolation_level(&self) -> Option<IsolationLevel> {
        self.isolation
    }

    /// How long the transaction may run one statement (`statement_timeout`) or sit idle
    /// between two (`idle_in_transaction_session_timeout`) before the server ends it (default
    /// 60 s; at least 1 ms). This bounds how long a transaction whose client is gone (cut off
    /// without the server noticing) holds its key: twice this at most. The closure may set
    /// either itself (`SET LOCAL statement_timeout = …`) for its own statements.
    pub fn with_timeout(mut self, timeout: Duration) -> Self {
        self.timeout = timeout.max(Duration::from_millis(1));
        self
    }

    /// The timeout.
    #[must_use]
    pub fn timeout(&self) -> Duration {
        self.timeout
    }

    /// `BEGIN` with the isolation level.
    pub(crate) fn begin(&self) -> &'static str {
        match self.isolation {
            None => "BEGIN",
            Some(IsolationLevel::Serializable) => "BEGIN ISOLATION LEVEL SERIALIZABLE",
            Some(IsolationLevel::RepeatableRead) => "BEGIN ISOLATION LEVEL REPEATABLE READ",
            Some(IsolationLevel::ReadUncommitted) => "BEGIN ISOLATION LEVEL READ UNCOMMITTED",
            Some(_) => "BEGIN ISOLATION LEVEL READ COMMITTED",
        }
    }
}

/// Whether `error` is a serialization failure or a deadlock (SQLSTATE `40001` or `40P01`) of
/// a transactional run's own statements: the run was rolled back and its key released, so the
/// same call again (same key) runs it again, at once. The usual answer at REPEATABLE READ and
/// SERIALIZABLE is to retry a few times.
///
/// # Examples
///
/// ```no_run
/// # async fn demo(store: throttlebeam::idempotency::postgres::PostgresStore) -> Result<(), throttlebeam::Error> {
/// use throttlebeam::IdempotencyOptions;
/// use throttlebeam::idempotency::postgres::{is_serialization_failure, tokio_postgres};
///
/// let mut tries = 0;
/// let outcome = loop {
///     let run = store
///         .run_in_transaction("transfer-77", IdempotencyOptions::new(), |tx| {
///             Box::pin(async move {
///                 tx.execute("UPDATE accounts SET balance = balance - 5 WHERE id = 1", &[]).await?;
///                 Ok::<_, tokio_postgres::Error>(5_i64)
///             })
///         })
///         .await;
///     match run {
///         Err(e) if is_serialization_failure(&e) && tries < 3 => tries += 1,
///         other => break other?,
///     }
/// };
/// # drop(outcome); Ok(()) }
/// ```
#[must_use]
pub fn is_serialization_failure(error: &Error) -> bool {
    let mut cause: Option<&(dyn std::error::Error + 'static)> = Some(error);
    while let Some(e) = cause {
        if let Some(pg) = e.downcast_ref::<tokio_postgres::Error>()
            && pg.code().is_some_and(|code| {
                *code == SqlState::T_R_SERIALIZATION_FAILURE
                    || *code == SqlState::T_R_DEADLOCK_DETECTED
            })
        {
            return true;
        }
        if let Some(db) = e.downcast_ref::<tokio_postgres::error::DbError>()
            && (*db.code() == SqlState::T_R_SERIALIZATION_FAILURE
                || *db.code() == SqlState::T_R_DEADLOCK_DETECTED)
        {
            return true;
        }
        cause = e.source();
    }
    false
}

/// Why a commit gave no clear answer.
#[derive(Debug, thiserror::Error)]
#[error(
    "the transaction's commit failed or its outcome is unknown; a retry replays its result if it \
     committed and runs again if it did not"
)]
pub(crate) struct CommitFailed(#[source] pub(crate) StoreError);

/// Why a step of the transaction around the closure failed.
#[derive(Debug, thiserror::Error)]
#[error("the transaction around the run failed at {step}")]
pub(crate) struct TransactionFailed {
    pub(crate) step: &'static str,
    #[source]
    pub(crate) source: StoreError,
}

/// What one look at a key found, for a transactional run.
pub(crate) enum Look {
    /// Won on this connection, which the run keeps: where the claim's row is (its `ctid`,
    /// as text), and whether the claim took an expired row over.
    Won(Conn, String, bool),
    /// A committed result.
    Replay(StoredResult),
    /// Held or completed under another fingerprint.
    Mismatch,
    /// Held, for about this long.
    Busy(Duration),
}

impl Inner {
    /// Claims `full` for a transactional run on a connection of the pool with `lease` (the
    /// grace), keeping the connection when the claim is won.
    async fn claim_for_run(
        self: &Arc<Self>,
        full: &str,
        token: ClaimToken,
        fingerprint: Option<&Fingerprint>,
        lease: Duration,
    ) -> Result<Look, StoreError> {
        self.ready()?;
        super::sweep::start(self);
        let connections = &self.connections;
        let token = token.to_bytes();
        let print = fingerprint.map(|f| &f[..]);
        let lease = millis(lease);
        // The run's commit flushes the claim: no need to wait for it here.
        let durable = false;
        connections
            .guarded(Class::Refusable, async {
                let mut conn = connections.get().await?;
                connections.count();
                let row = match conn
                    .query_one(
                        &self.sql.claim,
                        &[&full.as_bytes(), &&token[..], &print, &lease, &durable],
                    )
                    .await
                {
                    Ok(row) => row,
                    Err(e) if super::is_contention(&e) => return Ok(Look::Busy(Duration::ZERO)),
                    Err(e) => return Err(store_error(e)),
                };
                Ok(match super::claim_reply(&row, fingerprint)? {
                    crate::idempotency::ClaimReply::Won { .. } => {
                        // A won claim's left_ms says where its row is, and whether it took an
                        // expired row over (see the claim function).
                        let at = row
                            .try_get::<_, Option<i64>>(4)
                            .map_err(protocol)?
                            .filter(|at| *at >= 0)
                            .ok_or_else(|| {
                                StoreError::Protocol(
                                    "a claim won without its row's place: run PostgresStore::migrate \
                                     to update the claim function"
                                        .to_owned(),
                                )
                            })?;
                        let ctid = at / 2;
                        let place = format!("({},{})", ctid >> 16, ctid & 0xffff);
                        Look::Won(conn, place, at % 2 == 1)
                    }
                    crate::idempotency::ClaimReply::Completed(result) => Look::Replay(result),
                    crate::idempotency::ClaimReply::Mismatch => Look::Mismatch,
                    crate::idempotency::ClaimReply::Busy { lease_left } => Look::Busy(lease_left),
                })
            })
            .await
    }
}

/// A claim won for a transactional run: its connection (not in a transaction yet) and what
/// its run needs. Dropped while it still holds the key, it releases the key in the background;
/// without a runtime to do that on, its grace lapses (or its transaction's lock goes with its
/// connection).
pub(crate) struct Owner {
    pub(crate) inner: Arc<Inner>,
    pub(crate) conn: Conn,
    pub(crate) full: String,
    /// The caller's key, shortened for messages.
    pub(crate) key: String,
    pub(crate) token: ClaimToken,
    pub(crate) fingerprint: Option<Fingerprint>,
    pub(crate) ttl: Duration,
    pub(crate) transaction: TransactionOptions,
    /// Where the claim's row is (its `ctid`, as text).
    place: String,
    /// The transaction that locked the claim (`txid_current()`), once it did.
    pub(crate) txid: Option<i64>,
    held: bool,
}

impl Drop for Owner {
    fn drop(&mut self) {
        if !self.held {
            return;
        }
        let Ok(runtime) = tokio::runtime::Handle::try_current() else {
            return;
        };
        let (inner, full, token) = (Arc::clone(&self.inner), self.full.clone(), self.token);
        runtime.spawn(async move {
            if let Err(e) = inner.release(&full, token).await {
                tracing::debug!(error = %e, "releasing a transactional claim failed; its grace will lapse");
            }
        });
    }
}

/// What [`acquire`] ended with.
// Moved once, from the wait loop to its caller: not worth a box.
#[allow(clippy::large_enum_variant)]
pub(crate) enum Acquired {
    Replay(Record),
    Owner(Owner),
}

/// Looks at `key` (scoped: `full`) until its committed result replays, this caller holds it
/// (a claim won on a connection the run keeps), or the wait ends: the claim, wait and wake-up
/// loop of a transactional run, on the table's one claim statement and its `NOTIFY`s.
pub(crate) async fn acquire(
    store: &PostgresStore,
    key: &str,
    full: String,
    fingerprint: Option<Fingerprint>,
    options: &IdempotencyOptions,
    transaction: TransactionOptions,
) -> Result<Acquired, Error> {
    let inner = &store.inner;
    let counters = &inner.runs;
    let start = Instant::now();
    let deadline = start + options.wait_timeout();
    let grace = options.lease().min(CLAIM_GRACE);
    loop {
        // Registered before the claim, so a commit right after it wakes us.
        let changed = notify::watch(inner, &full);
        let token = ClaimToken::new();
        let bound = deadline
            .saturating_duration_since(Instant::now())
            .min(options.lease())
            .max(Duration::from_millis(1));
        let looked = crate::store::store_call(bound, || {
            inner.claim_for_run(&full, token, fingerprint.as_ref(), grace)
        })
        .await
        .map_err(|e| unavailable(key, e))?;
        let lease_left = match looked {
            Look::Won(conn, place, took_over) => {
                if conn.waited {
                    Tally::bump(&counters.pool_waits);
                }
                if took_over {
                    Tally::bump(&counters.takeovers);
                }
                return Ok(Acquired::Owner(Owner {
                    inner: Arc::clone(inner),
                    conn,
                    full,
                    key: shown(key),
                    token,
                    fingerprint,
                    ttl: options.ttl(),
                    transaction,
                    place,
                    txid: None,
                    held: true,
                }));
            }
            Look::Replay(result) => {
                let record = Record::from_stored(result);
                if record.fingerprint() != fingerprint.as_ref() {
                    Tally::bump(&counters.fingerprint_mismatches);
                    return Err(Error::FingerprintMismatch { key: shown(key) });
                }
                Tally::bump(&counters.replays);
                return Ok(Acquired::Replay(record));
            }
            Look::Mismatch => {
                Tally::bump(&counters.fingerprint_mismatches);
                return Err(Error::FingerprintMismatch { key: shown(key) });
            }
            Look::Busy(lease_left) => lease_left,
        };
        if options.in_flight() == InFlight::Reject {
            Tally::bump(&counters.in_flight);
            return Err(Error::InFlight {
                key: shown(key),
                retry_after: lease_left.clamp(Duration::from_millis(1), Duration::from_secs(1)),
            });
        }
        let now = Instant::now();
        if now >= deadline {
            Tally::bump(&counters.in_flight);
            return Err(Error::Timeout {
                key: shown(key),
                after: options.wait_timeout(),
            });
        }
        let wait = (lease_left + Duration::from_millis(1)).min(MAX_POLL);
        let _ = tokio::time::timeout_at((now + wait).min(deadline), changed).await;
    }
}

/// How locking the claim's row went.
pub(crate) enum Locked {
    /// Locked by this transaction.
    Yes,
    /// The row is no longer this token's (it was taken over before the lock: the claim's
    /// grace ran out first): nothing ran; look again.
    Lost,
}

impl Owner {
    /// The run's first statement, in its transaction: locks the claim's row and sets the
    /// transaction's timeouts.
    pub(crate) async fn lock<C>(
        &mut self,
        client: &C,
        statement: &Statement,
    ) -> Result<Locked, tokio_postgres::Error>
    where
        C: tokio_postgres::GenericClient + Sync,
    {
        let token = self.token.to_bytes();
        let timeout = format!("{}ms", millis(self.transaction.timeout));
        self.inner.connections.count();
        let (key, token) = (self.full.as_bytes(), &token[..]);
        let params: [&(dyn tokio_postgres::types::ToSql + Sync); 4] =
            [&key, &token, &timeout, &self.place];
        let row = client.query_opt(statement, &params).await?;
        Ok(match row {
            Some(row) => {
                self.txid = Some(row.try_get(0)?);
                Tally::bump(&self.inner.runs.fresh);
                Locked::Yes
            }
            None => {
                // Not ours: nothing to release.
                self.held = false;
                Locked::Lost
            }
        })
    }

    /// Stores `stored` and completes the key in the transaction that locked it: whether it
    /// did (`false`: the transaction is not the one that locked the claim, so the closure
    /// committed or rolled it back itself).
    pub(crate) async fn complete<C>(
        &self,
        client: &C,
        statement: &Statement,
        stored: &StoredResult,
    ) -> Result<bool, StoreError>
    where
        C: tokio_postgres::GenericClient + Sync,
    {
        let token = self.token.to_bytes();
        let fingerprint = stored.fingerprint.as_ref().map(|f| &f[..]);
        let ttl = millis(self.ttl);
        let txid = self.txid.unwrap_or(-1);
        self.inner.connections.count();
        let (key, value) = (self.full.as_bytes(), &stored.value[..]);
        let token = &token[..];
        let params: [&(dyn tokio_postgres::types::ToSql + Sync); 9] = [
            &key,
            &token,
            &fingerprint,
            &stored.type_tag,
            &value,
            &ttl,
            &self.inner.sql.channel,
            &txid,
            &self.place,
        ];
        let completed = crate::store::guard(self.inner.connections.timeout, || {
            client.query_one(statement, &params)
        })
        .await;
        match completed {
            Ok(Ok(row)) => Ok(row.try_get::<_, i64>(0).map_err(protocol)? == 1),
            Ok(Err(e)) => Err(store_error(e)),
            Err(fault) => Err(fault.into()),
        }
    }

    /// The key's claim ended with the transaction's commit: nothing to release.
    pub(crate) fn committed(&mut self) {
        self.held = false;
        Tally::bump(&self.inner.runs.committed);
    }

    /// Frees the key (through the pool) so a retry runs at once; if that fails, its grace
    /// lapses. Counts a rollback.
    pub(crate) async fn release(&mut self) {
        Tally::bump(&self.inner.runs.rolled_back);
        if !std::mem::replace(&mut self.held, false) {
            return;
        }
        let released = crate::store::store_call(self.inner.connections.timeout, || {
            self.inner.release(&self.full, self.token)
        })
        .await;
        if let Err(e) = released {
            tracing::debug!(key = %self.key, error = %e, "releasing a transactional claim failed; its grace will lapse");
        }
    }

    /// The key is left as it is (a closure that ended the transaction itself): its grace
    /// lapses, and the next caller takes it over.
    pub(crate) fn abandon(&mut self) {
        self.held = false;
    }
}

/// The error of a store that failed `key`'s caller, logged at warn.
pub(crate) fn unavailable(key: &str, e: impl std::error::Error + Send + Sync + 'static) -> Error {
    let source: BoxError = Arc::new(e);
    if tracing::enabled!(tracing::Level::WARN) {
        let error = crate::error::with_causes(&*source);
        tracing::warn!(key = %shown(key), %error, "postgres transactional run failed; failing closed");
    }
    Error::StoreUnavailable {
        key: shown(key),
        source,
    }
}

impl PostgresStore {
    /// [`run_in_transaction_with`](Self::run_in_transaction_with) with the store's
    /// [`TransactionOptions`] (by default: the session's isolation level, a 60 s timeout).
    ///
    /// # Errors
    ///
    /// As [`run_in_transaction_with`](Self::run_in_transaction_with).
    ///
    /// # Examples
    ///
    /// A payment recorded in the same database as its idempotency key: the
    /// charge row, the balance update and the key's result are one commit.
    ///
    /// ```no_run
    /// # async fn demo() -> Result<(), Box<dyn std::error::Error>> {
    /// use throttlebeam::IdempotencyOptions;
    /// use throttlebeam::idempotency::postgres::{PostgresStore, tokio_postgres};
    ///
    /// let store = PostgresStore::builder("postgres://app@127.0.0.1/shop").connect().await?;
    /// store.migrate().await?;
    /// let key = "key-sent-by-the-client";
    /// let options = IdempotencyOptions::new().with_fingerprint("POST /payments amount=1500");
    /// let charged = store
    ///     .run_in_transaction(key, options, |tx| {
    ///         Box::pin(async move {
    ///             let row = tx
    ///                 .query_one(
    ///                     "INSERT INTO payments (account, amount) VALUES ($1, $2) RETURNING id",
    ///                     &[&7_i64, &1500_i64],
    ///                 )
    ///                 .await?;
    ///             tx.execute(
    ///                 "UPDATE accounts SET balance = balance - $2 WHERE id = $1",
    ///                 &[&7_i64, &1500_i64],
    ///             )
    ///             .await?;
    ///             Ok::<i64, tokio_postgres::Error>(row.get(0))
    ///         })
    ///     })
    ///     .await?;
    /// println!("payment {} ({})", charged.value(), if charged.is_fresh() { "new" } else { "replayed" });
    /// # Ok(()) }
    /// ```
    pub async fn run_in_transaction<F, T, E>(
        &self,
        key: &str,
        options: IdempotencyOptions,
        f: F,
    ) -> Result<IdempotencyOutcome<T>, Error>
    where
        F: for<'t> FnOnce(&'t mut tokio_postgres::Transaction<'_>) -> TransactionFuture<'t, T, E>
            + Send
            + 'static,
        T: Serialize + DeserializeOwned + Clone + Send + 'static,
        E: Into<Box<dyn std::error::Error + Send + Sync + 'static>> + Send + 'static,
    {
        let transaction = self.inner.transaction;
        self.run_in_transaction_with(key, options, transaction, f)
            .await
    }

    /// Runs `f` at most once per key (within `options`' scope) inside a transaction that
    /// also stores its result and completes the key: the closure's writes and the record of
    /// the run commit together, or not at all. Returns [`IdempotencyOutcome::Fresh`] with `f`'s
    /// value when this call committed it, and [`IdempotencyOutcome::Replay`] with the
    /// committed value of an earlier run otherwise.
    ///
    /// - No result and nobody holding the key: this call claims the key on a connection of
    ///   the pool, begins a transaction on it (at `transaction`'s isolation level), locks the
    ///   claim's row as the transaction's first statement, runs `f` with the transaction,
    ///   then stores the value (in the versioned envelope, under `options`' TTL), completes
    ///   the key and commits, in that transaction.
    /// - A committed result: replayed at once; `f` does not run.
    /// - Another call holds the key (on any instance, transactional or not): with
    ///   [`InFlight::Wait`] this one waits, up to the wait timeout, woken by the holder's
    ///   commit, and replays; with [`InFlight::Reject`] it fails at once with
    ///   [`Error::InFlight`].
    ///
    /// The run's transaction holds its key (see [the module](super#transactional-runs)): no
    /// renewal, no second connection, never taken over while the transaction lives, however
    /// long it takes; free within about a second once its connection dies. Nothing of a run
    /// that does not commit is visible: if `f` fails or panics, the transaction is rolled back
    /// and the key released, so a retry runs `f` again, once; if the connection drops or the
    /// process dies before the commit, the server rolls the transaction back and the next
    /// caller runs, once.
    ///
    /// `f` runs in a task of its own once the key is claimed: dropping this future does not
    /// cancel it; it runs to the end and commits, and a retry replays its result. `f` may use
    /// savepoints, but must not commit or roll the transaction back itself (a run whose
    /// transaction ended early is told so: [`IdempotencyOutcome::Unrecorded`]). Keys,
    /// fingerprints and results are those of
    /// [`IdempotencyHandle::run_with`](crate::IdempotencyHandle::run_with): a result committed
    /// here replays through a runtime sharing this store, and the other way round.
    ///
    /// # Errors
    ///
    /// - [`Error::InvalidKey`], [`Error::InvalidArgument`] (bad TTL, lease, wait timeout or
    ///   scope): nothing runs.
    /// - [`Error::FingerprintMismatch`]: the key completed or is in flight with another
    ///   fingerprint; `f` does not run.
    /// - [`Error::InFlight`], [`Error::Timeout`]: another call holds the key (with
    ///   [`InFlight::Reject`]; or past the wait timeout).
    /// - [`Error::Failed`], [`Error::Panicked`]: `f` failed; nothing was committed, the key
    ///   was released. A serialization failure or deadlock of `f`'s own statements is a
    ///   `Failed` whose source is the driver's error ([`is_serialization_failure`] tells):
    ///   retry the call.
    /// - [`Error::TypeMismatch`]: the key's committed result is of another type.
    /// - [`Error::StoreUnavailable`]: the store failed (nothing runs while it is down), or the
    ///   transaction around `f` did (nothing was committed, the key was released), or the
    ///   commit's outcome is unknown (a retry replays the result if it committed, and runs `f`
    ///   if it did not).
    /// - [`Error::NoTokio`]: called outside a tokio runtime.
    pub async fn run_in_transaction_with<F, T, E>(
        &self,
        key: &str,
        options: IdempotencyOptions,
        transaction: TransactionOptions,
        f: F,
    ) -> Result<IdempotencyOutcome<T>, Error>
    where
        F: for<'t> FnOnce(&'t mut tokio_postgres::Transaction<'_>) -> TransactionFuture<'t, T, E>
            + Send
            + 'static,
        T: Serialize + DeserializeOwned + Clone + Send + 'static,
        E: Into<Box<dyn std::error::Error + Send + Sync + 'static>> + Send + 'static,
    {
        check_key(key)?;
        options.check(key)?;
        if tokio::runtime::Handle::try_current().is_err() {
            return Err(Error::NoTokio);
        }
        let full = with_full_key(options.scope(), key, str::to_owned);
        let fingerprint = options.fingerprint();
        let mut f = Some(f);
        loop {
            let owner =
                match acquire(self, key, full.clone(), fingerprint, &options, transaction).await? {
                    Acquired::Replay(record) => {
                        return record.value(key).map(IdempotencyOutcome::Replay);
                    }
                    Acquired::Owner(owner) => owner,
                };
            let Some(run) = f.take() else {
                unreachable!("the closure is taken only by a run that locked its claim");
            };
            // Its own task: a caller that leaves does not cancel it.
            let ran = match tokio::spawn(run_closure(owner, run)).await {
                Ok(ran) => ran,
                Err(e) if e.is_panic() => {
                    return Err(Error::Panicked {
                        key: shown(key),
                        message: "the transactional run's task panicked".to_owned(),
                    });
                }
                Err(_) => return Err(Error::process_lost(key)),
            };
            match ran {
                Ran::Ended(outcome) => return outcome,
                // Taken over before the lock: nothing ran; the closure comes back.
                Ran::Lost(run) => f = Some(run),
            }
        }
    }
}

/// How a closure's run ended.
enum Ran<F, T> {
    Ended(Result<IdempotencyOutcome<T>, Error>),
    /// The claim was lost before the lock: the closure did not run.
    Lost(F),
}

/// How the transaction ended.
enum TxEnd<T> {
    Committed(T),
    /// The closure ended the transaction itself: ran, not recorded.
    EndedByClosure(T),
    /// The commit failed or its outcome is unknown.
    CommitFailed(StoreError),
    /// Rolled back (`clean`: the rollback answered, the connection is reusable).
    RolledBack(Error, bool),
    /// `BEGIN` or the lock failed.
    BeginFailed(StoreError),
    /// The claim was lost before the lock (rolled back, `clean` as above).
    Lost(bool),
}

/// Runs `f` in the transaction of `owner`'s claim: begin, lock, `f`, store, complete, commit.
async fn run_closure<F, T, E>(mut owner: Owner, f: F) -> Ran<F, T>
where
    F: for<'t> FnOnce(&'t mut tokio_postgres::Transaction<'_>) -> TransactionFuture<'t, T, E>,
    T: Serialize + DeserializeOwned + 'static,
    E: Into<Box<dyn std::error::Error + Send + Sync + 'static>>,
{
    let inner = Arc::clone(&owner.inner);
    let timeout = inner.connections.timeout;
    let mut conn = std::mem::replace(&mut owner.conn, Conn::empty());
    // Busy until the transaction ends: dropped before that (the task dropped), the
    // connection is cancelled and discarded, and the server rolls the transaction back.
    conn.busy();
    let mut f = Some(f);
    let end = {
        let client = conn.client();
        inner.connections.count();
        let mut builder = client.build_transaction();
        if let Some(level) = owner.transaction.isolation {
            builder = builder.isolation_level(level);
        }
        match crate::store::guard(timeout, || builder.start()).await {
            Ok(Ok(mut tx)) => {
                let locked = async {
                    let statement = tx.prepare_cached(&inner.sql.lock).await?;
                    owner.lock(&*tx, &statement).await
                };
                match crate::store::guard(timeout, || locked).await {
                    Ok(Ok(Locked::Yes)) => {
                        let run = f.take().expect("runs once");
                        match work(&owner, &mut tx, run).await {
                            Ok(stored_value) => match stored_value {
                                (true, value) => {
                                    inner.connections.count();
                                    match crate::store::guard(timeout, || tx.commit()).await {
                                        Ok(Ok(())) => TxEnd::Committed(value),
                                        Ok(Err(e)) => {
                                            TxEnd::CommitFailed(StoreError::unavailable(e))
                                        }
                                        Err(fault) => TxEnd::CommitFailed(fault.into()),
                                    }
                                }
                                (false, value) => {
                                    let _ = crate::store::guard(timeout, || tx.rollback()).await;
                                    TxEnd::EndedByClosure(value)
                                }
                            },
                            Err(error) => {
                                inner.connections.count();
                                let clean = matches!(
                                    crate::store::guard(timeout, || tx.rollback()).await,
                                    Ok(Ok(()))
                                );
                                TxEnd::RolledBack(error, clean)
                            }
                        }
                    }
                    Ok(Ok(Locked::Lost)) => {
                        let clean = matches!(
                            crate::store::guard(timeout, || tx.rollback()).await,
                            Ok(Ok(()))
                        );
                        TxEnd::Lost(clean)
                    }
                    Ok(Err(e)) if lost_at_lock(&e) => {
                        let _ = crate::store::guard(timeout, || tx.rollback()).await;
                        TxEnd::Lost(false)
                    }
                    Ok(Err(e)) => TxEnd::BeginFailed(store_error(e)),
                    Err(fault) => TxEnd::BeginFailed(fault.into()),
                }
            }
            Ok(Err(e)) => TxEnd::BeginFailed(store_error(e)),
            Err(fault) => TxEnd::BeginFailed(fault.into()),
        }
    };
    let key = owner.key.clone();
    // The connection goes back (or away) first: a release needs one of the pool's.
    let clean = match &end {
        TxEnd::Committed(_) => true,
        TxEnd::RolledBack(_, clean) | TxEnd::Lost(clean) => *clean,
        _ => false,
    };
    if clean {
        conn.idle();
    } else {
        conn.discard();
    }
    drop(conn);
    let outcome = match end {
        TxEnd::Committed(value) => {
            owner.committed();
            Ok(IdempotencyOutcome::Fresh(value))
        }
        TxEnd::EndedByClosure(value) => {
            owner.abandon();
            tracing::warn!(
                key = %key,
                "a transactional run's closure committed or rolled back the run's transaction \
                 itself: its result was not recorded, and the key is free once its grace ends"
            );
            Ok(IdempotencyOutcome::Unrecorded(
                value,
                NotRecorded::LeaseLost,
            ))
        }
        TxEnd::CommitFailed(e) => {
            // Safe whatever the commit did: a release only frees a key still in flight under
            // this token, never a completed one.
            owner.release().await;
            Err(unavailable(&key, CommitFailed(e)))
        }
        TxEnd::RolledBack(error, _) => {
            owner.release().await;
            Err(error)
        }
        TxEnd::BeginFailed(source) => {
            owner.release().await;
            Err(unavailable(
                &key,
                TransactionFailed {
                    step: "begin",
                    source,
                },
            ))
        }
        TxEnd::Lost(_) => {
            drop(owner);
            return Ran::Lost(f.take().expect("not run"));
        }
    };
    Ran::Ended(outcome)
}

/// Whether the lock statement failed because the claim's row changed under it (taken over
/// at REPEATABLE READ or SERIALIZABLE): lost, not a store failure.
pub(crate) fn lost_at_lock(e: &tokio_postgres::Error) -> bool {
    e.code().is_some_and(|code| {
        *code == SqlState::T_R_SERIALIZATION_FAILURE || *code == SqlState::LOCK_NOT_AVAILABLE
    })
}

/// Runs `f` on the transaction, then stores its value and completes the key in it: the value,
/// and whether the completion landed (`false`: the transaction is no longer the one that
/// locked the claim).
async fn work<F, T, E>(
    owner: &Owner,
    tx: &mut deadpool_postgres::Transaction<'_>,
    f: F,
) -> Result<(bool, T), Error>
where
    F: for<'t> FnOnce(&'t mut tokio_postgres::Transaction<'_>) -> TransactionFuture<'t, T, E>,
    T: Serialize + DeserializeOwned + 'static,
    E: Into<Box<dyn std::error::Error + Send + Sync + 'static>>,
{
    let caught = {
        let pg: &mut tokio_postgres::Transaction<'_> = tx;
        catch_panic(async move { f(pg).await }).await
    };
    let value = Error::from_run(&owner.key, caught)?;
    let stored =
        checked_stored_result(owner.fingerprint, &value).map_err(|e| unavailable(&owner.key, e))?;
    let statement = tx
        .prepare_cached(&owner.inner.sql.complete_locked)
        .await
        .map_err(|e| {
            unavailable(
                &owner.key,
                TransactionFailed {
                    step: "completion",
                    source: store_error(e),
                },
            )
        })?;
    match owner.complete(&**tx, &statement, &stored).await {
        Ok(done) => Ok((done, value)),
        Err(source) => Err(unavailable(
            &owner.key,
            TransactionFailed {
                step: "completion",
                source,
            },
        )),
    }
}
