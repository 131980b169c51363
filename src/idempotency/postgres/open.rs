//! A transaction opened for a handler (the HTTP layer's transactions): begun on a connection
//! of the store's, around the claim it locked (or no claim, for a request without a key), and
//! ended by the layer: committed with the handler's stored response and the key's
//! completion, or rolled back.

use std::sync::Arc;

use super::pool::{Conn, store_error};
use super::{
    Inner, Locked, Owner, PostgresStore, TransactionFailed, TransactionOptions, unavailable,
};
use crate::error::Error;
use crate::idempotency::StoredResult;
use crate::store::StoreError;

/// A transaction begun for a handler; its connection travels apart (the handler uses it).
pub(crate) struct Open {
    inner: Arc<Inner>,
    /// The claim the transaction holds, if the request had a key.
    owner: Option<Owner>,
    key: String,
}

/// What beginning came to.
// Moved once, from the begin to its caller: not worth a box.
#[allow(clippy::large_enum_variant)]
pub(crate) enum Begun {
    /// The transaction is open (with the claim's row locked, if any): the connection is in it.
    Open(Open, Conn),
    /// The claim was taken over before its lock (its grace ran out first): nothing ran.
    Lost,
}

/// How ending the transaction went.
pub(crate) enum Ended {
    /// Committed (with the key's completion, if it has one).
    Committed,
    /// The handler committed or rolled the transaction back itself: nothing recorded, the
    /// claim left to lapse.
    Elsewhere,
    /// Not committed (the commit's outcome may be unknown): the key was released.
    Failed(Error),
}

impl Owner {
    /// Begins the run's transaction on the claim's connection and locks the claim's row, in
    /// one round trip (`BEGIN …` and the lock pipelined).
    pub(crate) async fn begin(mut self) -> Result<Begun, Error> {
        let inner = Arc::clone(&self.inner);
        let key = self.key.clone();
        let mut conn = std::mem::replace(&mut self.conn, Conn::empty());
        conn.busy();
        let timeout = inner.connections.timeout;
        let begin = self.transaction.begin();
        let locked = {
            let client = conn.client();
            let work = async {
                let statement = client.prepare_cached(&inner.sql.lock).await?;
                inner.connections.count();
                let (begun, locked) = tokio::join!(
                    client.batch_execute(begin),
                    self.lock(&***client, &statement)
                );
                begun?;
                locked
            };
            crate::store::guard(timeout, || work).await
        };
        match locked {
            Ok(Ok(Locked::Yes)) => Ok(Begun::Open(
                Open {
                    inner,
                    owner: Some(self),
                    key,
                },
                conn,
            )),
            Ok(Ok(Locked::Lost)) => {
                end(&mut conn, "ROLLBACK", timeout).await;
                Ok(Begun::Lost)
            }
            Ok(Err(e)) if super::lost_at_lock(&e) => {
                end(&mut conn, "ROLLBACK", timeout).await;
                self.abandon();
                Ok(Begun::Lost)
            }
            Ok(Err(e)) => {
                conn.discard();
                self.release().await;
                Err(unavailable(&key, failed("begin", store_error(e))))
            }
            Err(fault) => {
                conn.discard();
                self.release().await;
                Err(unavailable(&key, failed("begin", fault.into())))
            }
        }
    }
}

impl PostgresStore {
    /// Begins a transaction with no claim (a request without a key) on a connection of the
    /// pool.
    pub(crate) async fn begin(
        &self,
        transaction: TransactionOptions,
        key: &str,
    ) -> Result<(Open, Conn), Error> {
        let inner = &self.inner;
        inner.ready().map_err(|e| unavailable(key, e))?;
        let timeout = inner.connections.timeout;
        let mut conn = inner
            .connections
            .get()
            .await
            .map_err(|e| unavailable(key, e))?;
        conn.busy();
        let settings = format!(
            "{}; SET LOCAL statement_timeout = '{ms}ms'; \
             SET LOCAL idle_in_transaction_session_timeout = '{ms}ms'",
            transaction.begin(),
            ms = super::millis(transaction.timeout())
        );
        inner.connections.count();
        let begun = {
            let client = conn.client();
            crate::store::guard(timeout, || client.batch_execute(&settings)).await
        };
        match begun {
            Ok(Ok(())) => Ok((
                Open {
                    inner: Arc::clone(inner),
                    owner: None,
                    key: crate::key::shown(key),
                },
                conn,
            )),
            Ok(Err(e)) => {
                conn.discard();
                Err(unavailable(key, failed("begin", store_error(e))))
            }
            Err(fault) => {
                conn.discard();
                Err(unavailable(key, failed("begin", fault.into())))
            }
        }
    }
}

impl Open {
    /// Commits: with `stored` as the key's result and its completion, when the request has a
    /// key.
    pub(crate) async fn commit(mut self, mut conn: Conn, stored: Option<&StoredResult>) -> Ended {
        let inner = Arc::clone(&self.inner);
        let timeout = inner.connections.timeout;
        inner.connections.count();
        // The completion and the COMMIT go out together (one round trip): a completion that
        // failed aborted the transaction, whose COMMIT then rolls back; one that stored
        // nothing (the handler ended the transaction itself) leaves nothing to commit.
        let (completed, committed) = {
            let client = conn.client();
            match (self.owner.as_ref(), stored) {
                (Some(owner), Some(stored)) => {
                    // Prepared first (once per connection): the completion must be sent
                    // before the COMMIT, at its first poll.
                    match client.prepare_cached(&inner.sql.complete_locked).await {
                        Ok(statement) => {
                            let completion = owner.complete(&***client, &statement, stored);
                            let commit =
                                crate::store::guard(timeout, || client.batch_execute("COMMIT"));
                            let (completed, committed) = tokio::join!(completion, commit);
                            (Some(completed), committed)
                        }
                        Err(e) => (
                            Some(Err(store_error(e))),
                            crate::store::guard(timeout, || client.batch_execute("ROLLBACK")).await,
                        ),
                    }
                }
                _ => (
                    None,
                    crate::store::guard(timeout, || client.batch_execute("COMMIT")).await,
                ),
            }
        };
        match completed {
            Some(Ok(false)) => {
                conn.discard();
                if let Some(owner) = self.owner.as_mut() {
                    owner.abandon();
                }
                return Ended::Elsewhere;
            }
            Some(Err(source)) => {
                if matches!(committed, Ok(Ok(()))) {
                    conn.idle();
                } else {
                    conn.discard();
                }
                drop(conn);
                self.release().await;
                return Ended::Failed(unavailable(&self.key, failed("completion", source)));
            }
            Some(Ok(true)) | None => {}
        }
        match committed {
            Ok(Ok(())) => {
                conn.idle();
                drop(conn);
                if let Some(owner) = self.owner.as_mut() {
                    owner.committed();
                }
                Ended::Committed
            }
            Ok(Err(e)) => {
                conn.discard();
                drop(conn);
                self.release().await;
                Ended::Failed(unavailable(
                    &self.key,
                    super::CommitFailed(StoreError::unavailable(e)),
                ))
            }
            Err(fault) => {
                conn.discard();
                drop(conn);
                self.release().await;
                Ended::Failed(unavailable(&self.key, super::CommitFailed(fault.into())))
            }
        }
    }

    /// Rolls back and frees the key (if any), so a retry runs again.
    pub(crate) async fn roll_back(mut self, mut conn: Conn) {
        let timeout = self.inner.connections.timeout;
        end(&mut conn, "ROLLBACK", timeout).await;
        drop(conn);
        self.release().await;
    }

    async fn release(&mut self) {
        match self.owner.as_mut() {
            Some(owner) => owner.release().await,
            None => {
                self.inner
                    .runs
                    .rolled_back
                    .fetch_add(1, std::sync::atomic::Ordering::Relaxed);
            }
        }
    }
}

/// Ends the transaction on `conn` with `sql` (`ROLLBACK`): the connection goes back to the
/// pool if that answered, else away.
async fn end(conn: &mut Conn, sql: &str, timeout: std::time::Duration) {
    let ended = {
        let client = conn.client();
        crate::store::guard(timeout, || client.batch_execute(sql)).await
    };
    if matches!(ended, Ok(Ok(()))) {
        conn.idle();
    } else {
        conn.discard();
    }
}

fn failed(step: &'static str, source: StoreError) -> TransactionFailed {
    TransactionFailed { step, source }
}
