//! [`PgTransaction`]: the transaction a guarded route's handler writes in, on PostgreSQL
//! (feature `postgres`), and the exchange that opens it, runs the handler and ends it.

use std::future::Future;
use std::sync::Arc;

use http::{Request, Response};
use tokio::sync::{RwLock, RwLockReadGuard};

use super::backend::{self, StoredResponse};
use super::handler::{Guarded, HandlerRun};
use super::{Config, is_grpc, refuse, replay};
use crate::http::body::{InBody, OutBody, RequestBody, ResponseBody};
use crate::http::problem::{ProblemType, problem};
use crate::http::stats::bump;
use crate::idempotency::postgres::{
    Acquired, Begun, Conn, Ended, Open, PostgresStore, TransactionOptions, acquire, tokio_postgres,
};
use crate::idempotency::{IdempotencyKey, IdempotencyOptions};

/// The transaction of a request on a route guarded by an
/// [`IdempotencyLayer`](super::IdempotencyLayer) with
/// [`with_postgres_transaction`](super::IdempotencyLayerBuilder::with_postgres_transaction):
/// what the handler writes in it, the stored response and the completion of the request's
/// key commit together, or not at all.
///
/// The layer opens it before the handler runs (after claiming the key, whose row it locks
/// as its first statement) and ends it once the handler has answered: committed with the
/// response when [the store rule](super::IdempotencyLayerBuilder::with_store_when) stores the
/// status (2xx, 3xx, 402, 404, 410, … by default), rolled back otherwise (5xx, 400, 409, 422,
/// a panic): a retry of a rolled-back request runs the handler again. A request without a key
/// (keys optional) gets a transaction too, committed or rolled back by the same rule, with no
/// key and nothing stored.
///
/// The handler finds it in the request's extensions (`req.extensions().get::<PgTransaction>()`)
/// or, with the `axum` feature, takes it as an extractor. It is a cheap handle (`Clone`): its
/// statements go through the connection of the transaction, prepared once per connection
/// ([`execute`](Self::execute), [`query`](Self::query), …), or through
/// [`client`](Self::client) for code written against `tokio_postgres`'s
/// [`GenericClient`](tokio_postgres::GenericClient). Never `COMMIT` or `ROLLBACK` on it (use
/// `SAVEPOINT`s for a part that may fail): the layer ends it.
///
/// [`key`](Self::key) gives stable keys for the operation's effects outside the database (a
/// card network's own idempotency key): see [`IdempotencyKey::derive`].
///
/// # Examples
///
/// ```no_run
/// # #[cfg(feature = "axum")]
/// # async fn demo() -> Result<(), Box<dyn std::error::Error>> {
/// use axum::{Json, Router, http::StatusCode, routing::post};
/// use throttlebeam::Runtime;
/// use throttlebeam::http::{IdempotencyLayer, PgTransaction};
/// use throttlebeam::idempotency::postgres::PostgresStore;
///
/// #[derive(serde::Deserialize)]
/// struct Payment { account: i64, amount: i64 }
///
/// async fn pay(tx: PgTransaction, Json(p): Json<Payment>) -> Result<(StatusCode, String), StatusCode> {
///     let charge = tx.key().map(|key| key.derive("charge")); // for the card processor
///     let row = tx
///         .query_one(
///             "INSERT INTO payments (account, amount, charge) VALUES ($1, $2, $3) RETURNING id",
///             &[&p.account, &p.amount, &charge],
///         )
///         .await
///         .map_err(|_| StatusCode::INTERNAL_SERVER_ERROR)?; // rolled back, the key free
///     Ok((StatusCode::CREATED, format!("payment {}", row.get::<_, i64>(0))))
/// }
///
/// let store = PostgresStore::builder("postgres://app@127.0.0.1/shop").connect().await?;
/// store.migrate().await?;
/// let runtime = Runtime::builder().with_postgres(store.clone()).start().await?;
/// let app: Router = Router::new().route("/payments", post(pay)).route_layer(
///     IdempotencyLayer::builder(&runtime)
///         .with_required_key(true)
///         .with_postgres_transaction(&store)
///         .build()?,
/// );
/// # drop(app); Ok(()) }
/// ```
#[derive(Clone)]
pub struct PgTransaction {
    shared: Arc<Shared>,
}

struct Shared {
    /// The transaction's connection while the handler runs; taken back by the layer once it
    /// answered.
    conn: RwLock<Option<Conn>>,
    key: Option<IdempotencyKey>,
}

impl std::fmt::Debug for PgTransaction {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("PgTransaction")
            .field("key", &self.shared.key)
            .finish_non_exhaustive()
    }
}

/// The connection of a [`PgTransaction`], borrowed: derefs to deadpool's client wrapper,
/// and through it to [`tokio_postgres::Client`].
pub struct TransactionClient<'a> {
    guard: RwLockReadGuard<'a, Option<Conn>>,
}

impl std::ops::Deref for TransactionClient<'_> {
    type Target = crate::idempotency::postgres::deadpool_postgres::ClientWrapper;

    fn deref(&self) -> &Self::Target {
        self.guard
            .as_ref()
            .and_then(Conn::object_ref)
            .expect("checked when borrowed")
    }
}

impl std::fmt::Debug for TransactionClient<'_> {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("TransactionClient").finish_non_exhaustive()
    }
}

type Params<'a> = [&'a (dyn tokio_postgres::types::ToSql + Sync)];

impl PgTransaction {
    /// The request's idempotency key in its scope (`None` for a request without one): the
    /// source of stable keys for the operation's effects outside the database
    /// ([`IdempotencyKey::derive`]).
    #[must_use]
    pub fn key(&self) -> Option<&IdempotencyKey> {
        self.shared.key.as_ref()
    }

    /// The transaction's connection, for code written against `tokio_postgres`
    /// (`&*client` is a [`tokio_postgres::Client`], a
    /// [`GenericClient`](tokio_postgres::GenericClient)). Statements of several borrowers
    /// are sent in the order they are made.
    ///
    /// # Panics
    ///
    /// If the transaction has ended: the handler already answered (a task it spawned still
    /// holds the handle).
    pub async fn client(&self) -> TransactionClient<'_> {
        let guard = self.shared.conn.read().await;
        assert!(
            guard.as_ref().and_then(Conn::object_ref).is_some(),
            "the PgTransaction was used after its handler answered: the layer ended it"
        );
        TransactionClient { guard }
    }

    /// [`tokio_postgres::Client::execute`] in the transaction, the statement prepared once
    /// per connection.
    ///
    /// # Errors
    ///
    /// The database's: the statement failed (the transaction is then aborted: answer a
    /// status the store rule does not store, and it rolls back).
    ///
    /// # Panics
    ///
    /// As [`client`](Self::client).
    pub async fn execute(
        &self,
        sql: &str,
        params: &Params<'_>,
    ) -> Result<u64, tokio_postgres::Error> {
        let client = self.client().await;
        let statement = client.prepare_cached(sql).await?;
        client.execute(&statement, params).await
    }

    /// [`tokio_postgres::Client::query`] in the transaction, prepared once per connection.
    ///
    /// # Errors
    ///
    /// As [`execute`](Self::execute).
    ///
    /// # Panics
    ///
    /// As [`client`](Self::client).
    pub async fn query(
        &self,
        sql: &str,
        params: &Params<'_>,
    ) -> Result<Vec<tokio_postgres::Row>, tokio_postgres::Error> {
        let client = self.client().await;
        let statement = client.prepare_cached(sql).await?;
        client.query(&statement, params).await
    }

    /// [`tokio_postgres::Client::query_one`] in the transaction, prepared once per
    /// connection.
    ///
    /// # Errors
    ///
    /// As [`execute`](Self::execute), and when the statement returns no row or several.
    ///
    /// # Panics
    ///
    /// As [`client`](Self::client).
    pub async fn query_one(
        &self,
        sql: &str,
        params: &Params<'_>,
    ) -> Result<tokio_postgres::Row, tokio_postgres::Error> {
        let client = self.client().await;
        let statement = client.prepare_cached(sql).await?;
        client.query_one(&statement, params).await
    }

    /// [`tokio_postgres::Client::query_opt`] in the transaction, prepared once per
    /// connection.
    ///
    /// # Errors
    ///
    /// As [`execute`](Self::execute), and when the statement returns several rows.
    ///
    /// # Panics
    ///
    /// As [`client`](Self::client).
    pub async fn query_opt(
        &self,
        sql: &str,
        params: &Params<'_>,
    ) -> Result<Option<tokio_postgres::Row>, tokio_postgres::Error> {
        let client = self.client().await;
        let statement = client.prepare_cached(sql).await?;
        client.query_opt(&statement, params).await
    }

    /// [`tokio_postgres::Client::batch_execute`] in the transaction: statements without
    /// parameters, in the simple protocol.
    ///
    /// # Errors
    ///
    /// As [`execute`](Self::execute).
    ///
    /// # Panics
    ///
    /// As [`client`](Self::client).
    pub async fn batch_execute(&self, sql: &str) -> Result<(), tokio_postgres::Error> {
        self.client().await.batch_execute(sql).await
    }
}

/// Why a handler found no [`PgTransaction`]: its route is not guarded by an
/// [`IdempotencyLayer`](super::IdempotencyLayer) with
/// [`with_postgres_transaction`](super::IdempotencyLayerBuilder::with_postgres_transaction),
/// or the request's method is not one the layer guards. Answers 500 (problem+json) as an
/// axum rejection.
#[derive(Debug, Clone, Copy, thiserror::Error)]
#[error(
    "no PgTransaction for this request: guard the route with \
     IdempotencyLayer::builder(..).with_postgres_transaction(..) and a method it guards"
)]
pub struct MissingTransaction;

#[cfg(feature = "axum")]
impl axum::response::IntoResponse for MissingTransaction {
    fn into_response(self) -> axum::response::Response {
        tracing::error!("{self}");
        crate::http::problem::problem_bytes(
            ProblemType::IdempotencyMisconfigured,
            &self.to_string(),
        )
        .map(axum::body::Body::from)
    }
}

#[cfg(feature = "axum")]
impl<S: Send + Sync> axum::extract::FromRequestParts<S> for PgTransaction {
    type Rejection = MissingTransaction;

    async fn from_request_parts(
        parts: &mut http::request::Parts,
        _state: &S,
    ) -> Result<Self, Self::Rejection> {
        parts
            .extensions
            .get::<PgTransaction>()
            .cloned()
            .ok_or(MissingTransaction)
    }
}

/// What a layer with transactions keeps: the store and how its transactions begin.
#[derive(Clone)]
pub(super) struct Transactions {
    pub(super) store: PostgresStore,
    pub(super) options: TransactionOptions,
}

/// A guarded request on a route with transactions: replays its key's stored response, or
/// claims the key, opens the transaction (the claim's row locked first), runs the handler
/// with it in a task of its own, and commits the handler's writes with its stored response
/// and the key's completion, or rolls back. `key: None`: a request without a key, whose
/// transaction holds no claim and stores nothing.
#[allow(clippy::manual_async_fn)] // an `async fn` would hold its arguments twice
pub(super) fn exchange<S, ReqB, ResB>(
    config: Arc<Config>,
    inner: S,
    mut request: Request<RequestBody<ReqB>>,
    key: Option<String>,
    options: IdempotencyOptions,
) -> impl Future<Output = Result<Response<ResponseBody<ResB>>, S::Error>> + Send + 'static
where
    S: Guarded<ReqB, ResB>,
    ReqB: InBody,
    ResB: OutBody,
{
    async move {
        let transactions = config
            .transactions
            .clone()
            .expect("a layer with transactions");
        let counters = &config.counters;
        let store = &transactions.store;
        let fingerprint = options.fingerprint();
        let (open, conn, derived) = match &key {
            Some(key) => {
                let derived = IdempotencyKey::new(key, &options);
                let full = derived.scoped().to_owned();
                loop {
                    let acquired = acquire(
                        store,
                        key,
                        full.clone(),
                        fingerprint,
                        &options,
                        transactions.options,
                    )
                    .await;
                    let owner = match acquired {
                        Ok(Acquired::Replay(record)) => {
                            return Ok(match record.value::<StoredResponse>(key) {
                                Ok(stored) => {
                                    bump(&counters.replays);
                                    replay(&stored)
                                }
                                Err(err) => {
                                    refuse(&backend::refusal(&err, config.fail_fast), key, counters)
                                }
                            });
                        }
                        Ok(Acquired::Owner(owner)) => owner,
                        Err(err) => {
                            return Ok(refuse(
                                &backend::refusal(&err, config.fail_fast),
                                key,
                                counters,
                            ));
                        }
                    };
                    match owner.begin().await {
                        Ok(Begun::Open(open, conn)) => break (open, conn, Some(derived)),
                        // Taken over before its lock: nothing ran; look again.
                        Ok(Begun::Lost) => {}
                        Err(err) => {
                            return Ok(refuse(
                                &backend::refusal(&err, config.fail_fast),
                                key,
                                counters,
                            ));
                        }
                    }
                }
            }
            None => match store.begin(transactions.options, "(no key)").await {
                Ok((open, conn)) => (open, conn, None),
                Err(err) => {
                    return Ok(refuse(
                        &backend::refusal(&err, config.fail_fast),
                        "(no key)",
                        counters,
                    ));
                }
            },
        };
        let shared = Arc::new(Shared {
            conn: RwLock::new(Some(conn)),
            key: derived,
        });
        request.extensions_mut().insert(PgTransaction {
            shared: Arc::clone(&shared),
        });
        // Its own task: a client that hangs up does not cancel a payment half way.
        let run_config = Arc::clone(&config);
        let run = tokio::spawn(async move {
            let config = run_config;
            let handler = HandlerRun::new(Arc::clone(&config), inner, request);
            let caught = throttlebeam_supervisors::catch_panic(handler).await;
            let taken = shared.conn.write().await.take();
            let Some(conn) = taken else {
                unreachable!("only the layer takes the connection back");
            };
            let shown = key.as_deref().map_or_else(String::new, crate::key::shown);
            finish(
                &config,
                open,
                conn,
                key.is_some(),
                fingerprint,
                &shown,
                caught,
            )
            .await
        });
        match run.await {
            Ok(answer) => answer,
            Err(_) => Ok(problem(
                ProblemType::HandlerPanicked,
                "the handler's run was lost; nothing was committed",
            )),
        }
    }
}

/// What the handler's run came to: what to store and what it answered, or its panic.
type Caught<B, E> = Result<
    (
        Result<StoredResponse, backend::NotStored>,
        Result<Response<ResponseBody<B>>, E>,
    ),
    throttlebeam_supervisors::Panic,
>;

/// Ends the transaction once the handler answered with `caught`, and says what to answer.
async fn finish<E, B>(
    config: &Config,
    open: Open,
    conn: Conn,
    keyed: bool,
    fingerprint: Option<crate::idempotency::Fingerprint>,
    key: &str,
    caught: Caught<B, E>,
) -> Result<Response<ResponseBody<B>>, E> {
    let counters = &config.counters;
    let (stored, handed) = match caught {
        Ok(ran) => ran,
        Err(panic) => {
            open.roll_back(conn).await;
            tracing::error!(key, panic = %panic.message(), "the handler panicked; its transaction was rolled back");
            return Ok(problem(
                ProblemType::HandlerPanicked,
                &format!("the handler for idempotency key {key:?} failed; nothing was committed"),
            ));
        }
    };
    let response = match handed {
        Ok(response) => response,
        Err(err) => {
            open.roll_back(conn).await;
            return Err(err);
        }
    };
    let stores = (config.store_when)(response.status());
    let stored = match (keyed, stores, stored) {
        // Not a status the rule stores: nothing of it commits; the key is free for a retry.
        (_, false, _) => {
            open.roll_back(conn).await;
            bump(&counters.fresh);
            return Ok(response);
        }
        (false, true, _) => None,
        (true, true, Ok(stored)) => {
            match crate::idempotency::postgres::stored_result(fingerprint, &stored) {
                Ok(result) => Some(result),
                Err(err) => {
                    open.roll_back(conn).await;
                    return Ok(refuse(
                        &backend::refusal(&err, config.fail_fast),
                        key,
                        counters,
                    ));
                }
            }
        }
        // A status to store that cannot be (over the storage limit, trailers, gRPC): its
        // writes cannot commit without it, so they roll back, and the client is told.
        (true, true, Err(backend::NotStored)) => {
            open.roll_back(conn).await;
            let why = if is_grpc(response.headers()) {
                "a gRPC response"
            } else {
                "over the storage limit, or with trailers"
            };
            return Ok(problem(
                ProblemType::HandlerPanicked,
                &format!(
                    "the response for idempotency key {key:?} could not be stored ({why}); \
                     its transaction was rolled back and nothing was committed"
                ),
            ));
        }
    };
    match open.commit(conn, stored.as_ref()).await {
        Ended::Committed => {
            bump(&counters.fresh);
            Ok(response)
        }
        Ended::Elsewhere => {
            tracing::error!(
                key,
                "the handler committed or rolled back the layer's transaction itself: its \
                 response was not stored, and a retry after the claim's grace runs it again"
            );
            bump(&counters.fresh);
            Ok(response)
        }
        Ended::Failed(err) => Ok(refuse(
            &backend::refusal(&err, config.fail_fast),
            key,
            counters,
        )),
    }
}
