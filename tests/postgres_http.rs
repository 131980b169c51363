//! The HTTP layer and the transaction as one (SCENARIOS P4, P6): a route guarded by
//! `IdempotencyLayer::with_postgres_transaction` hands its handler the transaction in which
//! its writes, the stored response and the key's completion commit together, with every
//! rule of the layer.
#![cfg(all(feature = "postgres", feature = "axum"))]

#[path = "support/http.rs"]
mod support_http;
#[path = "support/postgres.rs"]
#[allow(dead_code, unreachable_pub)]
mod support_postgres;

use std::sync::Arc;
use std::sync::atomic::{AtomicU32, Ordering};

use axum::extract::{Path, State};
use axum::http::StatusCode;
use axum::routing::{get, post as post_route};
use axum::{Json, Router};
use http::Method;
use serde::{Deserialize, Serialize};
use support_http::{Server, serve};
use support_postgres::PgSchema;
use throttlebeam::Runtime;
use throttlebeam::http::{IdempotencyLayer, PgTransaction};
use throttlebeam::idempotency::postgres::PostgresStore;
use tokio::sync::oneshot;

/// What the payments handler is told to do, per test.
#[derive(Clone)]
struct App {
    schema: String,
    runs: Arc<AtomicU32>,
    /// Held by the test to keep handlers waiting after their insert.
    gate: Arc<tokio::sync::RwLock<()>>,
    /// Where a handler says its backend's pid once its insert is done.
    pid: Arc<std::sync::Mutex<Option<oneshot::Sender<i32>>>>,
}

#[derive(Deserialize)]
struct Payment {
    account: i64,
    amount: i64,
}

#[derive(Serialize, Deserialize)]
struct Receipt {
    id: i64,
    amount: i64,
    charge: String,
}

/// The payments handler: inserts the payment in the layer's transaction, then waits at the
/// gate; 500 when told (`amount` < 0), rolled back.
async fn pay(
    State(app): State<App>,
    tx: PgTransaction,
    Json(payment): Json<Payment>,
) -> Result<(StatusCode, Json<Receipt>), (StatusCode, String)> {
    app.runs.fetch_add(1, Ordering::SeqCst);
    let db = |e: throttlebeam::idempotency::postgres::tokio_postgres::Error| {
        (StatusCode::INTERNAL_SERVER_ERROR, e.to_string())
    };
    let charge = tx.key().map(|k| k.derive("charge")).unwrap_or_default();
    let id: i64 = tx
        .query_one(
            &format!(
                "INSERT INTO \"{}\".payments (account, amount, charge) VALUES ($1, $2, $3) RETURNING id",
                app.schema
            ),
            &[&payment.account, &payment.amount, &charge],
        )
        .await
        .map_err(db)?
        .get(0);
    let sender = app.pid.lock().unwrap().take();
    if let Some(sender) = sender {
        let pid: i32 = tx
            .query_one("SELECT pg_backend_pid()", &[])
            .await
            .map_err(db)?
            .get(0);
        let _ = sender.send(pid);
    }
    drop(app.gate.read().await);
    // A statement after the wait: fails if the backend was terminated meanwhile.
    tx.query_one("SELECT 1", &[]).await.map_err(db)?;
    if payment.amount < 0 {
        return Err((StatusCode::INTERNAL_SERVER_ERROR, "refused".to_owned()));
    }
    if payment.amount == 0 {
        return Err((StatusCode::PAYMENT_REQUIRED, "nothing to pay".to_owned()));
    }
    Ok((
        StatusCode::CREATED,
        Json(Receipt {
            id,
            amount: payment.amount,
            charge,
        }),
    ))
}

async fn payment(State(app): State<App>, Path(id): Path<i64>) -> Result<String, StatusCode> {
    let _ = (app, id);
    Ok("ok".to_owned())
}

/// The schema's `payments` table.
async fn payments_table(schema: &PgSchema) {
    schema
        .client()
        .await
        .batch_execute(&format!(
            "CREATE TABLE \"{}\".payments (id bigserial PRIMARY KEY, account bigint NOT NULL, \
             amount bigint NOT NULL, charge text NOT NULL)",
            schema.name
        ))
        .await
        .unwrap();
}

async fn payments_of(schema: &PgSchema) -> i64 {
    schema
        .client()
        .await
        .query_one(
            &format!("SELECT count(*) FROM \"{}\".payments", schema.name),
            &[],
        )
        .await
        .unwrap()
        .get(0)
}

/// Stored (done) rows of the idempotency table.
async fn stored_responses(schema: &PgSchema) -> i64 {
    schema
        .client()
        .await
        .query_one(
            &format!("SELECT count(*) FROM {} WHERE done", schema.table()),
            &[],
        )
        .await
        .unwrap()
        .get(0)
}

/// The payments service: its route table, its store and the layer.
async fn service(
    schema: &PgSchema,
    layer: impl FnOnce(
        throttlebeam::http::IdempotencyLayerBuilder,
    ) -> throttlebeam::http::IdempotencyLayerBuilder,
) -> (Server, App, Runtime, PostgresStore) {
    payments_table(schema).await;
    let store = schema.store().await;
    let runtime = Runtime::builder()
        .with_postgres(store.clone())
        .start()
        .await
        .unwrap();
    let app = App {
        schema: schema.name.clone(),
        runs: Arc::default(),
        gate: Arc::default(),
        pid: Arc::default(),
    };
    let guarded = layer(IdempotencyLayer::builder(&runtime).with_postgres_transaction(&store))
        .build()
        .unwrap();
    let router = Router::new()
        .route("/payments", post_route(pay))
        .route("/payments/{id}", get(payment))
        .route_layer(guarded)
        .with_state(app.clone());
    (serve(router).await, app, runtime, store)
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn p4_a_payment_through_the_layer_commits_its_row_and_response_together_and_replays() {
    let Some(schema) = PgSchema::create("p4_payment_through_the_layer").await else {
        return;
    };
    let (server, app, runtime, _store) = service(&schema, |b| b.with_required_key(true)).await;
    let first = post(
        &server,
        "/payments",
        "pay-1",
        r#"{"account":7,"amount":1500}"#,
    )
    .await;
    assert_eq!(first.status, StatusCode::CREATED, "{}", first.text());
    assert!(first.header("idempotent-replayed").is_none());
    assert_eq!(
        (payments_of(&schema).await, stored_responses(&schema).await),
        (1, 1)
    );
    let retry = post(
        &server,
        "/payments",
        "pay-1",
        r#"{"account":7,"amount":1500}"#,
    )
    .await;
    assert_eq!(retry.status, StatusCode::CREATED);
    assert_eq!(retry.header("idempotent-replayed"), Some("true"));
    assert_eq!(retry.body, first.body);
    assert_eq!(app.runs.load(Ordering::SeqCst), 1);
    assert_eq!(payments_of(&schema).await, 1);
    // The derived key is the one the first run handed the processor, and the same for every
    // retry of the request.
    let receipt: Receipt = serde_json::from_slice(&first.body).unwrap();
    assert!(receipt.charge.starts_with("tb1-"), "{}", receipt.charge);
    // Counted in the runtime's stats.
    let stats = runtime.stats();
    assert_eq!((stats.http.fresh, stats.http.replays), (1, 1));
    let tx = stats.postgres.transactions;
    assert_eq!(
        (tx.fresh, tx.replays, tx.committed, tx.rolled_back),
        (1, 1, 1, 0)
    );
    assert!(stats.postgres.pool_size >= 2);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn p4_every_rule_of_the_layer_holds_with_its_transaction() {
    let Some(schema) = PgSchema::create("p4_every_rule_with_transactions").await else {
        return;
    };
    let (server, app, runtime, _store) =
        service(&schema, |b| b.with_max_body(64).with_fail_fast(true)).await;
    let body = r#"{"account":1,"amount":10}"#;
    // 400: a key over 255 bytes, or two keys.
    let long = "k".repeat(256);
    let bad = post(&server, "/payments", &long, body).await;
    assert_eq!(bad.status, StatusCode::BAD_REQUEST);
    assert_eq!(bad.header("content-type"), Some("application/problem+json"));
    // 413: a body over the limit; the handler does not run.
    let big = format!(r#"{{"account":1,"amount":10,"pad":"{}"}}"#, "x".repeat(100));
    assert_eq!(
        post(&server, "/payments", "big", &big).await.status,
        StatusCode::PAYLOAD_TOO_LARGE
    );
    assert_eq!(app.runs.load(Ordering::SeqCst), 0);
    // A status the store rule does not store (500): rolled back, the key free, the retry runs.
    let refused = post(&server, "/payments", "neg", r#"{"account":1,"amount":-5}"#).await;
    assert_eq!(refused.status, StatusCode::INTERNAL_SERVER_ERROR);
    assert_eq!(
        (payments_of(&schema).await, stored_responses(&schema).await),
        (0, 0)
    );
    let again = post(&server, "/payments", "neg", r#"{"account":1,"amount":-5}"#).await;
    assert_eq!(again.status, StatusCode::INTERNAL_SERVER_ERROR);
    assert_eq!(app.runs.load(Ordering::SeqCst), 2, "the retry ran again");
    assert_eq!(payments_of(&schema).await, 0);
    // 402 describes the payment: stored, and its row committed with it.
    let unpaid = post(&server, "/payments", "zero", r#"{"account":1,"amount":0}"#).await;
    assert_eq!(unpaid.status, StatusCode::PAYMENT_REQUIRED);
    let replayed = post(&server, "/payments", "zero", r#"{"account":1,"amount":0}"#).await;
    assert_eq!(replayed.header("idempotent-replayed"), Some("true"));
    assert_eq!(payments_of(&schema).await, 1);
    // 422: the key reused for another body, once committed.
    let reused = post(&server, "/payments", "zero", r#"{"account":1,"amount":1}"#).await;
    assert_eq!(reused.status, StatusCode::UNPROCESSABLE_ENTITY);
    assert_eq!(
        reused.header("content-type"),
        Some("application/problem+json")
    );
    // In flight: 409 with Retry-After (failing fast), and 422 for another body.
    let held = app.gate.write().await;
    let first = tokio::spawn({
        let server = server.clone();
        async move { post(&server, "/payments", "slow", body).await }
    });
    while payments_in_flight(&schema).await == 0 {
        tokio::task::yield_now().await;
    }
    let busy = post(&server, "/payments", "slow", body).await;
    assert_eq!(busy.status, StatusCode::CONFLICT);
    assert!(busy.header("retry-after").is_some());
    assert_eq!(
        busy.header("content-type"),
        Some("application/problem+json")
    );
    let other = post(&server, "/payments", "slow", r#"{"account":1,"amount":11}"#).await;
    assert_eq!(other.status, StatusCode::UNPROCESSABLE_ENTITY);
    drop(held);
    assert_eq!(first.await.unwrap().status, StatusCode::CREATED);
    let stats = runtime.stats();
    assert!(
        stats.http.in_flight >= 1 && stats.http.reused >= 2,
        "{:?}",
        stats.http
    );
    assert!(stats.postgres.transactions.rolled_back >= 2);
    assert!(stats.postgres.transactions.fingerprint_mismatches >= 2);
    assert!(stats.postgres.transactions.in_flight >= 1);
}

/// `POST path` with an `Idempotency-Key` and a JSON `body`.
async fn post(server: &Server, path: &str, key: &str, body: &str) -> support_http::Reply {
    server
        .send(
            Method::POST,
            path,
            &[
                ("idempotency-key", key),
                ("content-type", "application/json"),
            ],
            body,
        )
        .await
}

/// Claims of key `slow` in flight in the idempotency table.
async fn payments_in_flight(schema: &PgSchema) -> i64 {
    schema
        .client()
        .await
        .query_one(
            // Key `slow`'s: a released claim's row stays (free) as its key's fence.
            &format!(
                "SELECT count(*) FROM {} WHERE NOT done AND position('slow'::bytea IN key) > 0",
                schema.table()
            ),
            &[],
        )
        .await
        .unwrap()
        .get(0)
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn p4_with_store_when_decides_what_commits() {
    let Some(schema) = PgSchema::create("p4_store_when_commits").await else {
        return;
    };
    // 402 is not stored here: it rolls back like a 5xx.
    let (server, app, _runtime, _store) =
        service(&schema, |b| b.with_store_when(|s| s.is_success())).await;
    let unpaid = post(&server, "/payments", "zero", r#"{"account":1,"amount":0}"#).await;
    assert_eq!(unpaid.status, StatusCode::PAYMENT_REQUIRED);
    assert_eq!(
        (payments_of(&schema).await, stored_responses(&schema).await),
        (0, 0)
    );
    let again = post(&server, "/payments", "zero", r#"{"account":1,"amount":0}"#).await;
    assert!(again.header("idempotent-replayed").is_none());
    assert_eq!(app.runs.load(Ordering::SeqCst), 2);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn p4_a_request_without_a_key_writes_in_a_plain_transaction() {
    let Some(schema) = PgSchema::create("p4_keyless_plain_transaction").await else {
        return;
    };
    let (server, app, _runtime, _store) = service(&schema, |b| b).await;
    let body = r#"{"account":3,"amount":20}"#;
    let paid = server
        .send(
            Method::POST,
            "/payments",
            &[("content-type", "application/json")],
            body,
        )
        .await;
    assert_eq!(paid.status, StatusCode::CREATED, "{}", paid.text());
    let refused = server
        .send(
            Method::POST,
            "/payments",
            &[("content-type", "application/json")],
            r#"{"account":3,"amount":-1}"#,
        )
        .await;
    assert_eq!(refused.status, StatusCode::INTERNAL_SERVER_ERROR);
    assert_eq!(app.runs.load(Ordering::SeqCst), 2);
    assert_eq!(payments_of(&schema).await, 1, "the refused one rolled back");
    assert_eq!(
        stored_responses(&schema).await,
        0,
        "nothing stored without a key"
    );
    // A route the layer does not guard has no transaction: 500, problem+json.
    let unguarded = Router::new().route("/x", get(|_tx: PgTransaction| async { "never" }));
    let server = serve(unguarded).await;
    let missing = server.send(Method::GET, "/x", &[], "").await;
    assert_eq!(missing.status, StatusCode::INTERNAL_SERVER_ERROR);
    assert_eq!(
        missing.header("content-type"),
        Some("application/problem+json")
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn p6_a_terminated_backend_leaves_no_row_and_no_stored_response() {
    let Some(schema) = PgSchema::create("p6_terminated_backend_no_row").await else {
        return;
    };
    let (server, app, _runtime, _store) = service(&schema, |b| b.with_required_key(true)).await;
    let (pid_tx, pid_rx) = oneshot::channel();
    *app.pid.lock().unwrap() = Some(pid_tx);
    let held = app.gate.write().await;
    let body = r#"{"account":9,"amount":300}"#;
    let first = tokio::spawn({
        let server = server.clone();
        async move { post(&server, "/payments", "pay-killed", body).await }
    });
    let pid = pid_rx.await.unwrap();
    let admin = schema.client().await;
    let killed: bool = admin
        .query_one("SELECT pg_terminate_backend($1)", &[&pid])
        .await
        .unwrap()
        .get(0);
    assert!(killed);
    drop(held);
    let answer = first.await.unwrap();
    assert!(
        answer.status.is_server_error(),
        "{:?} {}",
        answer.status,
        answer.text()
    );
    assert_eq!(payments_of(&schema).await, 0, "no payment row");
    assert_eq!(stored_responses(&schema).await, 0, "no stored response");
    // The retry runs once and commits.
    let retry = post(&server, "/payments", "pay-killed", body).await;
    assert_eq!(retry.status, StatusCode::CREATED, "{}", retry.text());
    assert_eq!(app.runs.load(Ordering::SeqCst), 2);
    assert_eq!(
        (payments_of(&schema).await, stored_responses(&schema).await),
        (1, 1)
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn p4_concurrent_duplicates_run_the_handler_once_and_replay_its_response() {
    let Some(schema) = PgSchema::create("p4_concurrent_duplicates").await else {
        return;
    };
    let (server, app, _runtime, _store) = service(&schema, |b| b).await;
    let body = r#"{"account":5,"amount":99}"#;
    let mut calls = tokio::task::JoinSet::new();
    for _ in 0..8 {
        let server = server.clone();
        calls.spawn(async move { post(&server, "/payments", "dup", body).await });
    }
    let mut replies = Vec::new();
    while let Some(reply) = calls.join_next().await {
        replies.push(reply.unwrap());
    }
    assert!(replies.iter().all(|r| r.status == StatusCode::CREATED));
    assert!(replies.windows(2).all(|w| w[0].body == w[1].body));
    assert_eq!(
        replies
            .iter()
            .filter(|r| r.header("idempotent-replayed").is_none())
            .count(),
        1
    );
    assert_eq!(app.runs.load(Ordering::SeqCst), 1);
    assert_eq!(payments_of(&schema).await, 1);
}
