//! Transactional runs: the key's claim, then one transaction on the same
//! connection holding the closure's writes, the stored result and the
//! completion, committed together.
//!
//! How the claim is held: a claim row committed before the transaction
//! begins (so duplicates see the key in flight, wait for its `NOTIFY` and
//! replay, or fail fast, without blocking in the database), leased and
//! renewed like any claim; the transaction completes it with the same
//! compare-and-set on the owner's token as every completion, as its last
//! statement, so the row lock that the completion takes is held only for the
//! commit. The commit is the only point where the run becomes visible: the
//! effect and its record land together or not at all, and a run whose claim
//! was taken over cannot commit (its completion finds another token and the
//! transaction is rolled back). The claim's own commit is not flushed to
//! disk before the transaction starts (`synchronous_commit = off` for that
//! one statement): the transaction's commit flushes it, and a crash before
//! then loses the claim together with the effect it guarded.

use std::future::Future;
use std::pin::Pin;
use std::sync::Arc;
use std::time::Duration;

use serde::Serialize;
use serde::de::DeserializeOwned;
use throttlebeam_supervisors::catch_panic;
use tokio::time::Instant;

use super::pool::{Class, Conn, store_error};
use super::{Inner, PostgresStore, claim_reply, millis, notify, protocol};
use crate::error::check_key;
use crate::error::{BoxError, Error};
use crate::idempotency::full_key::with_full_key;
use crate::idempotency::options::Fingerprint;
use crate::idempotency::store::{Record, stored_result};
use crate::key::shown;
use crate::store::StoreError;
use crate::{
    IdempotencyOptions, IdempotencyOutcome, idempotency::ClaimReply, idempotency::ClaimToken,
    idempotency::InFlight,
};

/// What a transactional run's closure returns: its future, boxed, borrowing
/// the transaction.
pub type TransactionFuture<'t, T, E> = Pin<Box<dyn Future<Output = Result<T, E>> + Send + 't>>;

/// The longest a waiting duplicate sleeps between two looks when no notice
/// arrives.
const MAX_POLL: Duration = Duration::from_millis(500);

/// The first pause before a failed renewal is tried again.
const RENEW_RETRY: Duration = Duration::from_millis(50);

/// Why a commit gave no clear answer.
#[derive(Debug, thiserror::Error)]
#[error(
    "the transaction's commit failed or its outcome is unknown; a retry replays its result if it \
     committed and runs again if it did not"
)]
struct CommitFailed(#[source] StoreError);

/// Why a step of the transaction around the closure failed.
#[derive(Debug, thiserror::Error)]
#[error("the transaction around the run failed at {step}")]
struct TransactionFailed {
    step: &'static str,
    #[source]
    source: StoreError,
}

impl PostgresStore {
    /// Runs `f` at most once per key (within `options`' scope) inside a
    /// transaction that also stores its result and completes the key: the
    /// closure's writes and the record of the run commit together, or not
    /// at all. Returns [`IdempotencyOutcome::Fresh`] with `f`'s value when
    /// this call committed it, and [`IdempotencyOutcome::Replay`] with the
    /// committed value of an earlier run otherwise.
    ///
    /// - No result and nobody holding the key: this call claims the key,
    ///   begins a transaction on the same connection, runs `f` with it, then
    ///   stores the value (in the versioned envelope, under `options`' TTL),
    ///   completes the key and commits, in that transaction.
    /// - A committed result: replayed at once; `f` does not run.
    /// - Another call holds the key (on any instance, transactional or not):
    ///   with [`InFlight::Wait`] this one waits, up to the wait timeout,
    ///   woken by the holder's commit, and replays; with [`InFlight::Reject`]
    ///   it fails at once with [`Error::InFlight`].
    ///
    /// Nothing of a run that does not commit is visible: if `f` fails or
    /// panics, the transaction is rolled back and the key released, so a
    /// retry runs `f` again, once; if the connection drops or the process
    /// dies before the commit, the server rolls the transaction back and
    /// the claim is released (or, if this process is gone, lapses after the
    /// lease), and the retry runs once. While `f` runs, the lease is renewed
    /// every third of it on another connection of the pool, so a live run is
    /// never taken over; a run that was taken over anyway (its renewals
    /// failed for a whole lease) cannot commit: it is rolled back and fails
    /// with [`Error::LeaseLost`].
    ///
    /// `f` runs in a task of its own once the key is claimed: dropping this
    /// future does not cancel it; it runs to the end and commits, and a
    /// retry replays its result. The transaction is
    /// [`tokio_postgres::Transaction`] at the database's default isolation
    /// level; `f` may use savepoints, but must not commit or roll it back
    /// itself. Keys, fingerprints and results are those of
    /// [`IdempotencyHandle::run_with`](crate::IdempotencyHandle::run_with):
    /// a result committed here replays through a runtime sharing this store,
    /// and the other way round.
    ///
    /// # Errors
    ///
    /// - [`Error::InvalidKey`], [`Error::InvalidArgument`] (bad TTL, lease,
    ///   wait timeout or scope): nothing runs.
    /// - [`Error::FingerprintMismatch`]: the key completed or is in flight
    ///   with another fingerprint; `f` does not run.
    /// - [`Error::InFlight`], [`Error::Timeout`]: another call holds the key
    ///   (with [`InFlight::Reject`]; or past the wait timeout).
    /// - [`Error::Failed`], [`Error::Panicked`]: `f` failed; nothing was
    ///   committed, the key was released.
    /// - [`Error::LeaseLost`]: another call took the key over before this
    ///   one could commit; nothing of this run was committed.
    /// - [`Error::TypeMismatch`]: the key's committed result is of another
    ///   type.
    /// - [`Error::StoreUnavailable`]: the store failed (nothing runs while
    ///   it is down), or the transaction around `f` did (nothing was
    ///   committed, the key was released), or the commit's outcome is
    ///   unknown (a retry replays the result if it committed, and runs `f`
    ///   if it did not).
    /// - [`Error::NoTokio`]: called outside a tokio runtime.
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
        check_key(key)?;
        options.check(key)?;
        if tokio::runtime::Handle::try_current().is_err() {
            return Err(Error::NoTokio);
        }
        let full = with_full_key(options.scope(), key, str::to_owned);
        let fingerprint = options.fingerprint();
        let start = Instant::now();
        let deadline = start + options.wait_timeout();
        loop {
            // Registered before the claim, so a commit right after it wakes us.
            let changed = notify::watch(&self.inner, &full);
            let token = ClaimToken::new();
            let now = Instant::now();
            let bound = deadline
                .saturating_duration_since(now)
                .min(options.lease())
                .max(Duration::from_millis(1));
            let claimed = crate::store::store_call(bound, || {
                claim_on_connection(
                    &self.inner,
                    &full,
                    token,
                    fingerprint.as_ref(),
                    options.lease(),
                )
            })
            .await
            .map_err(|e| unavailable(key, e))?;
            let lease_left = match claimed {
                (ClaimReply::Won { .. }, Some(conn)) => {
                    let run = Run {
                        inner: Arc::clone(&self.inner),
                        full,
                        key: shown(key),
                        token,
                        fingerprint,
                        ttl: options.ttl(),
                        lease: options.lease(),
                        held: true,
                    };
                    // Its own task: a caller that leaves does not cancel it.
                    return match tokio::spawn(run.run(conn, f)).await {
                        Ok(outcome) => outcome.map(IdempotencyOutcome::Fresh),
                        Err(e) if e.is_panic() => Err(Error::Panicked {
                            key: shown(key),
                            message: "the transactional run's task panicked".to_owned(),
                        }),
                        Err(_) => Err(Error::process_lost(key)),
                    };
                }
                (ClaimReply::Completed(result), _) => {
                    let record = Record::from_stored(result);
                    if record.fingerprint() != fingerprint.as_ref() {
                        return Err(Error::FingerprintMismatch { key: shown(key) });
                    }
                    return record.value(key).map(IdempotencyOutcome::Replay);
                }
                (ClaimReply::Mismatch, _) => {
                    return Err(Error::FingerprintMismatch { key: shown(key) });
                }
                (ClaimReply::Busy { lease_left }, _) => lease_left,
                (ClaimReply::Won { .. }, None) => {
                    return Err(unavailable(
                        key,
                        StoreError::Protocol("a claim won without its connection".to_owned()),
                    ));
                }
            };
            if options.in_flight() == InFlight::Reject {
                return Err(Error::InFlight {
                    key: shown(key),
                    retry_after: lease_left.clamp(Duration::from_millis(1), Duration::from_secs(1)),
                });
            }
            let now = Instant::now();
            if now >= deadline {
                return Err(Error::Timeout {
                    key: shown(key),
                    after: options.wait_timeout(),
                });
            }
            let wait = (lease_left + Duration::from_millis(1)).min(MAX_POLL);
            let _ = tokio::time::timeout_at((now + wait).min(deadline), changed).await;
        }
    }
}

/// Claims `full` on a connection of the pool, keeping the connection when
/// the claim is won (the transaction runs on it).
async fn claim_on_connection(
    inner: &Arc<Inner>,
    full: &str,
    token: ClaimToken,
    fingerprint: Option<&Fingerprint>,
    lease: Duration,
) -> Result<(ClaimReply, Option<Conn>), StoreError> {
    inner.ready()?;
    super::sweep::start(inner);
    let connections = &inner.connections;
    let token = token.to_bytes();
    let print = fingerprint.map(|f| &f[..]);
    let lease = millis(lease);
    // The run's commit flushes the claim: no need to wait for it here.
    let durable = false;
    connections
        .guarded(Class::Refusable, async {
            let mut conn = connections.get().await?;
            connections.count();
            let row = conn
                .query_one(
                    &inner.sql.claim,
                    &[&full.as_bytes(), &&token[..], &print, &lease, &durable],
                )
                .await
                .map_err(store_error)?;
            let reply = claim_reply(&row, fingerprint)?;
            let conn = matches!(reply, ClaimReply::Won { .. }).then_some(conn);
            Ok((reply, conn))
        })
        .await
}

/// The error of a store that failed `key`'s caller, logged at warn.
fn unavailable(key: &str, e: impl std::error::Error + Send + Sync + 'static) -> Error {
    let source: BoxError = Arc::new(e);
    if tracing::enabled!(tracing::Level::WARN) {
        let error = crate::idempotency::claim::with_causes(&*source);
        tracing::warn!(key = %shown(key), %error, "postgres transactional run failed; failing closed");
    }
    Error::StoreUnavailable {
        key: shown(key),
        source,
    }
}

/// A won claim and what its run needs. Dropped while it still holds the
/// key (its task was dropped: the tokio runtime ended), it releases the key
/// in the background; without a runtime to do that on, the lease lapses.
struct Run {
    inner: Arc<Inner>,
    full: String,
    key: String,
    token: ClaimToken,
    fingerprint: Option<Fingerprint>,
    ttl: Duration,
    lease: Duration,
    held: bool,
}

impl Drop for Run {
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
                tracing::debug!(error = %e, "releasing a transactional claim failed; its lease will lapse");
            }
        });
    }
}

/// How the closure's part ended.
enum Ended<T> {
    /// Stored and completed in the transaction: commit.
    Completed(T),
    /// Nothing to commit: roll back.
    Aborted(Abort),
}

/// Why a run rolls back.
enum Abort {
    /// Fail with this, and release the key.
    Failed(Error),
    /// Another owner holds the key: nothing to release.
    LeaseLost,
}

/// How the transaction ended.
enum TxEnd<T> {
    Committed(T),
    /// The commit failed or its outcome is unknown.
    CommitFailed(StoreError),
    /// Rolled back (`clean`: the rollback answered, the connection is
    /// reusable).
    RolledBack(Abort, bool),
    /// `BEGIN` failed.
    BeginFailed(StoreError),
}

impl Run {
    async fn run<F, T, E>(mut self, mut conn: Conn, f: F) -> Result<T, Error>
    where
        F: for<'t> FnOnce(&'t mut tokio_postgres::Transaction<'_>) -> TransactionFuture<'t, T, E>,
        T: Serialize,
        E: Into<Box<dyn std::error::Error + Send + Sync + 'static>>,
    {
        let claimed_at = Instant::now();
        let timeout = self.inner.connections.timeout;
        // Busy until the transaction ends: dropped before that (the task
        // dropped), the connection is cancelled and discarded, and the
        // server rolls the transaction back.
        conn.busy();
        let end = {
            let client = conn.client();
            self.inner.connections.count();
            match crate::store::guard(timeout, || client.transaction()).await {
                Ok(Ok(mut tx)) => match self.work(&mut tx, claimed_at, f).await {
                    Ended::Completed(value) => {
                        // Bounded by the lease as well: the completion's row
                        // lock keeps any takeover waiting for this commit's
                        // outcome, however long it takes.
                        let bound = timeout.max(self.lease);
                        self.inner.connections.count();
                        match crate::store::guard(bound, || tx.commit()).await {
                            Ok(Ok(())) => TxEnd::Committed(value),
                            Ok(Err(e)) => TxEnd::CommitFailed(StoreError::unavailable(e)),
                            Err(fault) => TxEnd::CommitFailed(fault.into()),
                        }
                    }
                    Ended::Aborted(abort) => {
                        self.inner.connections.count();
                        let clean = matches!(
                            crate::store::guard(timeout, || tx.rollback()).await,
                            Ok(Ok(()))
                        );
                        TxEnd::RolledBack(abort, clean)
                    }
                },
                Ok(Err(e)) => TxEnd::BeginFailed(store_error(e)),
                Err(fault) => TxEnd::BeginFailed(fault.into()),
            }
        };
        match end {
            TxEnd::Committed(value) => {
                conn.idle();
                self.held = false;
                Ok(value)
            }
            TxEnd::CommitFailed(e) => {
                conn.discard();
                // Safe whatever the commit did: a release only frees a key
                // still in flight under this token, never a completed one.
                self.release().await;
                Err(unavailable(&self.key, CommitFailed(e)))
            }
            TxEnd::RolledBack(abort, clean) => {
                if clean {
                    conn.idle();
                    drop(conn);
                } else {
                    conn.discard();
                }
                match abort {
                    Abort::LeaseLost => {
                        self.held = false;
                        Err(Error::LeaseLost {
                            key: self.key.clone(),
                        })
                    }
                    Abort::Failed(error) => {
                        self.release().await;
                        Err(error)
                    }
                }
            }
            TxEnd::BeginFailed(source) => {
                conn.discard();
                self.release().await;
                Err(unavailable(
                    &self.key,
                    TransactionFailed {
                        step: "begin",
                        source,
                    },
                ))
            }
        }
    }

    /// Runs `f` on the transaction while renewing the lease, then stores its
    /// value and completes the key in the transaction.
    async fn work<F, T, E>(
        &self,
        tx: &mut deadpool_postgres::Transaction<'_>,
        claimed_at: Instant,
        f: F,
    ) -> Ended<T>
    where
        F: for<'t> FnOnce(&'t mut tokio_postgres::Transaction<'_>) -> TransactionFuture<'t, T, E>,
        T: Serialize,
        E: Into<Box<dyn std::error::Error + Send + Sync + 'static>>,
    {
        let caught = {
            let pg: &mut tokio_postgres::Transaction<'_> = tx;
            let work = std::pin::pin!(catch_panic(async move { f(pg).await }));
            self.hold(work, claimed_at).await
        };
        let value = match Error::from_run(&self.key, caught) {
            Ok(value) => value,
            Err(error) => return Ended::Aborted(Abort::Failed(error)),
        };
        let stored = match stored_result(self.fingerprint, &value) {
            Ok(stored) => stored,
            Err(e) => return Ended::Aborted(Abort::Failed(unavailable(&self.key, e))),
        };
        let token = self.token.to_bytes();
        let fingerprint = stored.fingerprint.as_ref().map(|f| &f[..]);
        let ttl = millis(self.ttl);
        let sql = &self.inner.sql;
        self.inner.connections.count();
        let completed = crate::store::guard(self.inner.connections.timeout, || async {
            let statement = tx.prepare_cached(&sql.complete).await?;
            tx.query_one(
                &statement,
                &[
                    &self.full.as_bytes(),
                    &&token[..],
                    &fingerprint,
                    &stored.type_tag,
                    &&stored.value[..],
                    &ttl,
                    &sql.channel,
                ],
            )
            .await
        })
        .await;
        let failed = |source| {
            Ended::Aborted(Abort::Failed(unavailable(
                &self.key,
                TransactionFailed {
                    step: "completion",
                    source,
                },
            )))
        };
        match completed {
            Ok(Ok(row)) => match row.try_get::<_, bool>(0) {
                Ok(true) => Ended::Completed(value),
                Ok(false) => Ended::Aborted(Abort::LeaseLost),
                Err(e) => failed(protocol(e)),
            },
            Ok(Err(e)) => failed(store_error(e)),
            Err(fault) => failed(fault.into()),
        }
    }

    /// Runs `work`, renewing the lease every third of it until `work` ends.
    /// The renewer is built only once the work is pending.
    async fn hold<W: Future>(&self, mut work: Pin<&mut W>, claimed_at: Instant) -> W::Output {
        let mut renewing: Option<Pin<Box<dyn Future<Output = ()> + Send + '_>>> = None;
        std::future::poll_fn(|cx| {
            if let std::task::Poll::Ready(output) = work.as_mut().poll(cx) {
                return std::task::Poll::Ready(output);
            }
            let renewing = renewing.get_or_insert_with(|| Box::pin(self.keep_renewing(claimed_at)));
            let _ = renewing.as_mut().poll(cx);
            std::task::Poll::Pending
        })
        .await
    }

    /// Renews one period after the claim, then a period after each renewal;
    /// a failed renewal is tried again sooner (from 50 ms, doubling up to
    /// the period). Once the claim is no longer this run's, never ends (the
    /// completion will find out).
    async fn keep_renewing(&self, claimed_at: Instant) {
        let period = (self.lease / 3).max(Duration::from_millis(1));
        let first_retry = RENEW_RETRY.min(period);
        let (mut due, mut retry) = (claimed_at + period, first_retry);
        loop {
            tokio::time::sleep_until(due).await;
            let renewed = crate::store::store_call(period, || {
                self.inner.renew(&self.full, self.token, self.lease)
            })
            .await;
            match renewed {
                Ok(true) => {
                    due = Instant::now() + period;
                    retry = first_retry;
                }
                Ok(false) => {
                    tracing::warn!(
                        key = %self.key,
                        "transactional claim lost while its closure runs (its lease lapsed); \
                         it will be rolled back"
                    );
                    return std::future::pending().await;
                }
                Err(e) => {
                    tracing::debug!(key = %self.key, error = %e, "renewing a transactional claim failed; trying again soon");
                    due = Instant::now() + retry;
                    retry = (retry * 2).min(period);
                }
            }
        }
    }

    /// Frees the key (through the pool) so a retry runs at once; if that
    /// fails, the lease lapses.
    async fn release(&mut self) {
        self.held = false;
        let released =
            crate::store::store_call(self.lease, || self.inner.release(&self.full, self.token))
                .await;
        if let Err(e) = released {
            tracing::debug!(key = %self.key, error = %e, "releasing a transactional claim failed; its lease will lapse");
        }
    }
}
