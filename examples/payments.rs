//! A payments service on PostgreSQL: `POST /payments` with an `Idempotency-Key` charges
//! once. The handler writes the payment in the transaction the idempotency layer opened, and
//! the payment row, the stored response and the key's completion commit together; a retry
//! replays the response, a concurrent duplicate waits and replays it, a failed payment rolls
//! back and leaves the key free. The card processor is called with a key derived from the
//! request's, so a retry after a crash never charges twice there either.
//!
//! Run: `cargo run --features postgres,axum --example payments`
//!
//! Uses `THROTTLEBEAM_POSTGRES_URL` if set, else `postgres://postgres@127.0.0.1:5432/test`.
//! Creates the tables `example_pay_accounts`, `example_pay_payments` and
//! `example_pay_idempotency` there if they do not exist; each run opens an account of its
//! own. It serves on a loopback port, sends itself a few requests, and exits.

use std::time::{SystemTime, UNIX_EPOCH};

use axum::extract::State;
use axum::http::StatusCode;
use axum::routing::post;
use axum::{Json, Router};
use bytes::Bytes;
use http_body_util::{BodyExt, Full};
use hyper_util::client::legacy::Client;
use hyper_util::rt::TokioExecutor;
use serde::{Deserialize, Serialize};
use throttlebeam::Runtime;
use throttlebeam::http::{IdempotencyLayer, PgTransaction};
use throttlebeam::idempotency::postgres::{POSTGRES_URL_ENV, PostgresStore, tokio_postgres};

// ---- The service: its route table and its SQL; no idempotency glue. ----

#[derive(Deserialize)]
struct Payment {
    account: i64,
    amount: i64,
}

#[derive(Serialize, Deserialize, Debug)]
struct Receipt {
    payment: i64,
    balance: i64,
    /// The idempotency key the card processor got (the same on every retry).
    processor_key: String,
}

/// The card processor, standing in for a network call that takes its own idempotency key.
#[derive(Clone)]
struct Processor;

impl Processor {
    async fn charge(&self, idempotency_key: &str, amount: i64) -> Result<String, String> {
        Ok(format!("ch_{amount}_{}", &idempotency_key[4..12]))
    }
}

type Failure = (StatusCode, String);

fn db(e: tokio_postgres::Error) -> Failure {
    // Any 5xx rolls the transaction back and frees the key: the client's retry runs again.
    (StatusCode::INTERNAL_SERVER_ERROR, e.to_string())
}

async fn pay(
    State(processor): State<Processor>,
    tx: PgTransaction,
    Json(p): Json<Payment>,
) -> Result<(StatusCode, Json<Receipt>), Failure> {
    let balance: i64 = tx
        .query_one(
            "SELECT balance FROM example_pay_accounts WHERE id = $1 FOR UPDATE",
            &[&p.account],
        )
        .await
        .map_err(db)?
        .get(0);
    if balance < p.amount {
        // 402 describes the payment: stored and replayed like a success (nothing written).
        return Err((StatusCode::PAYMENT_REQUIRED, format!("balance {balance}")));
    }
    let processor_key = tx.key().map(|key| key.derive("charge")).unwrap_or_default();
    let charge = processor
        .charge(&processor_key, p.amount)
        .await
        .map_err(|e| (StatusCode::BAD_GATEWAY, e))?;
    let payment: i64 = tx
        .query_one(
            "INSERT INTO example_pay_payments (account, amount, charge) VALUES ($1, $2, $3) RETURNING id",
            &[&p.account, &p.amount, &charge],
        )
        .await
        .map_err(db)?
        .get(0);
    let balance: i64 = tx
        .query_one(
            "UPDATE example_pay_accounts SET balance = balance - $2 WHERE id = $1 RETURNING balance",
            &[&p.account, &p.amount],
        )
        .await
        .map_err(db)?
        .get(0);
    Ok((
        StatusCode::CREATED,
        Json(Receipt {
            payment,
            balance,
            processor_key,
        }),
    ))
}

const SQL: &str = "
    CREATE TABLE IF NOT EXISTS example_pay_accounts (id bigserial PRIMARY KEY, balance bigint NOT NULL);
    CREATE TABLE IF NOT EXISTS example_pay_payments (
        id bigserial PRIMARY KEY, account bigint NOT NULL, amount bigint NOT NULL, charge text NOT NULL);
";

async fn app(
    url: &str,
) -> Result<(Router, Runtime, PostgresStore), Box<dyn std::error::Error + Send + Sync>> {
    let store = PostgresStore::builder(url)
        .with_table("example_pay_idempotency")
        .with_auto_migrate(true)
        .connect()
        .await?;
    let runtime = Runtime::builder()
        .with_postgres(store.clone())
        .start()
        .await?;
    let layer = IdempotencyLayer::builder(&runtime)
        .with_required_key(true)
        .with_postgres_transaction(&store)
        .build()?;
    let router = Router::new()
        .route("/payments", post(pay))
        .route_layer(layer)
        .with_state(Processor);
    Ok((router, runtime, store))
}

// ---- The demonstration: serve, send a few requests, check the books. ----

#[tokio::main]
async fn main() -> Result<(), Box<dyn std::error::Error + Send + Sync>> {
    let url = std::env::var(POSTGRES_URL_ENV)
        .unwrap_or_else(|_| "postgres://postgres@127.0.0.1:5432/test".to_owned());
    let (client, connection) = tokio_postgres::connect(&url, tokio_postgres::NoTls).await?;
    tokio::spawn(connection);
    client.batch_execute(SQL).await?;
    let account: i64 = client
        .query_one(
            "INSERT INTO example_pay_accounts (balance) VALUES (10000) RETURNING id",
            &[],
        )
        .await?
        .get(0);
    println!("account {account} opened with 10000");

    let (router, runtime, _store) = app(&url).await?;
    let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await?;
    let addr = listener.local_addr()?;
    tokio::spawn(async move { axum::serve(listener, router).await });
    let http = Client::builder(TokioExecutor::new()).build_http::<Full<Bytes>>();
    let run = SystemTime::now().duration_since(UNIX_EPOCH)?.as_nanos();
    let send = |key: String, amount: i64| {
        let http = http.clone();
        async move {
            let request = http::Request::post(format!("http://{addr}/payments"))
                .header("idempotency-key", key)
                .header("content-type", "application/json")
                .body(Full::new(Bytes::from(format!(
                    r#"{{"account":{account},"amount":{amount}}}"#
                ))))?;
            let response = http.request(request).await?;
            let replayed = response.headers().contains_key("idempotent-replayed");
            let status = response.status();
            let body = response.into_body().collect().await?.to_bytes();
            Ok::<_, Box<dyn std::error::Error + Send + Sync>>((status, replayed, body))
        }
    };

    let key = format!("pay-{run}-1");
    let (status, replayed, first) = send(key.clone(), 1500).await?;
    println!(
        "first attempt: {status} {}",
        String::from_utf8_lossy(&first)
    );
    assert!(status == StatusCode::CREATED && !replayed);
    let (status, replayed, again) = send(key.clone(), 1500).await?;
    println!("retry:         {status} replayed={replayed}");
    assert!(replayed && again == first);

    let (status, _, _) = send(key, 2000).await?;
    println!("same key, another amount: {status}");
    assert_eq!(status, StatusCode::UNPROCESSABLE_ENTITY);

    // Eight concurrent duplicates: one charge, seven replays of its response.
    let raced = format!("pay-{run}-2");
    let mut calls = Vec::new();
    for _ in 0..8 {
        calls.push(tokio::spawn(send(raced.clone(), 700)));
    }
    let mut fresh = 0;
    for call in calls {
        let (status, replayed, _) = call.await??;
        assert_eq!(status, StatusCode::CREATED);
        fresh += usize::from(!replayed);
    }
    println!(
        "8 concurrent duplicates: {fresh} ran, {} replayed",
        8 - fresh
    );
    assert_eq!(fresh, 1);

    let (status, _, body) = send(format!("pay-{run}-3"), 1_000_000).await?;
    println!("too large: {status} {}", String::from_utf8_lossy(&body));
    assert_eq!(status, StatusCode::PAYMENT_REQUIRED);

    let charged: i64 = client
        .query_one(
            "SELECT count(*) FROM example_pay_payments WHERE account = $1",
            &[&account],
        )
        .await?
        .get(0);
    println!("payments recorded for account {account}: {charged} (1500 and 700)");
    assert_eq!(charged, 2);
    let stats = runtime.stats().postgres.transactions;
    println!(
        "transactions: {} committed, {} rolled back, {} replays",
        stats.committed, stats.rolled_back, stats.replays
    );
    Ok(())
}
