//! Payments recorded exactly once: the idempotency key lives in the same
//! PostgreSQL database as the payment, and a payment, its balance update and
//! the key's stored receipt commit in one transaction. A retry replays the
//! receipt; a payment that fails (insufficient funds) commits nothing and
//! leaves the key free; two instances racing on one key charge once.
//!
//! Run: `cargo run --features postgres --example postgres`
//!
//! Uses `THROTTLEBEAM_POSTGRES_URL` if set, else
//! `postgres://postgres@127.0.0.1:5432/test`. Creates the tables
//! `example_accounts`, `example_payments` and `example_idempotency` there if
//! they do not exist; each run uses keys of its own.

use std::time::{SystemTime, UNIX_EPOCH};

use serde::{Deserialize, Serialize};
use throttlebeam::idempotency::postgres::{POSTGRES_URL_ENV, PostgresStore, tokio_postgres};
use throttlebeam::{Error, IdempotencyOptions, IdempotencyOutcome, Runtime};

/// What a payment returns, and what a retry replays.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
struct Receipt {
    payment_id: i64,
    balance_after: i64,
}

/// Why a payment was refused (the closure's own error: nothing commits).
#[derive(Debug)]
struct InsufficientFunds {
    balance: i64,
}

impl std::fmt::Display for InsufficientFunds {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(f, "insufficient funds: balance {}", self.balance)
    }
}

impl std::error::Error for InsufficientFunds {}

/// The closure's errors: the database's, or a refusal.
#[derive(Debug)]
enum PayError {
    Db(tokio_postgres::Error),
    Refused(InsufficientFunds),
}

impl std::fmt::Display for PayError {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match self {
            Self::Db(e) => write!(f, "database: {e}"),
            Self::Refused(e) => e.fmt(f),
        }
    }
}

impl std::error::Error for PayError {}

impl From<tokio_postgres::Error> for PayError {
    fn from(e: tokio_postgres::Error) -> Self {
        Self::Db(e)
    }
}

/// Charges `amount` to `account`, once per `key`.
async fn pay(
    store: &PostgresStore,
    key: &str,
    account: i64,
    amount: i64,
) -> Result<IdempotencyOutcome<Receipt>, Error> {
    // The fingerprint ties the key to this request: the same key with
    // another amount is refused, not replayed.
    let options = IdempotencyOptions::new()
        .with_scope(format!("account-{account}"))
        .with_fingerprint(format!("POST /payments amount={amount}"));
    store
        .run_in_transaction(key, options, move |tx| {
            Box::pin(async move {
                let balance: i64 = tx
                    .query_one(
                        "SELECT balance FROM example_accounts WHERE id = $1 FOR UPDATE",
                        &[&account],
                    )
                    .await?
                    .get(0);
                if balance < amount {
                    return Err(PayError::Refused(InsufficientFunds { balance }));
                }
                let payment_id: i64 = tx
                    .query_one(
                        "INSERT INTO example_payments (account, amount) VALUES ($1, $2) RETURNING id",
                        &[&account, &amount],
                    )
                    .await?
                    .get(0);
                let balance_after: i64 = tx
                    .query_one(
                        "UPDATE example_accounts SET balance = balance - $2 WHERE id = $1 \
                         RETURNING balance",
                        &[&account, &amount],
                    )
                    .await?
                    .get(0);
                Ok(Receipt {
                    payment_id,
                    balance_after,
                })
            })
        })
        .await
}

async fn payments_of(store_url: &str, account: i64) -> Result<i64, Box<dyn std::error::Error>> {
    let (client, connection) = tokio_postgres::connect(store_url, tokio_postgres::NoTls).await?;
    tokio::spawn(connection);
    let row = client
        .query_one(
            "SELECT count(*) FROM example_payments WHERE account = $1",
            &[&account],
        )
        .await?;
    Ok(row.get(0))
}

#[tokio::main]
async fn main() -> Result<(), Box<dyn std::error::Error>> {
    let url = std::env::var(POSTGRES_URL_ENV)
        .unwrap_or_else(|_| "postgres://postgres@127.0.0.1:5432/test".to_owned());
    let store = PostgresStore::builder(&url)
        .with_table("example_idempotency")
        .connect()
        .await?;
    store.migrate().await?;

    // The application's own tables, and an account of this run's own.
    let (client, connection) = tokio_postgres::connect(&url, tokio_postgres::NoTls).await?;
    tokio::spawn(connection);
    client
        .batch_execute(
            "CREATE TABLE IF NOT EXISTS example_accounts (id bigserial PRIMARY KEY, balance bigint NOT NULL);
             CREATE TABLE IF NOT EXISTS example_payments (id bigserial PRIMARY KEY, account bigint NOT NULL, amount bigint NOT NULL);",
        )
        .await?;
    let account: i64 = client
        .query_one(
            "INSERT INTO example_accounts (balance) VALUES (10000) RETURNING id",
            &[],
        )
        .await?
        .get(0);
    let run = SystemTime::now().duration_since(UNIX_EPOCH)?.as_nanos();
    println!("account {account} opened with 10000");

    // A payment, then the client's retry with the same key: one charge.
    let key = format!("pay-{run}-1");
    let first = pay(&store, &key, account, 1500).await?;
    println!("first attempt:  {first:?}");
    let retry = pay(&store, &key, account, 1500).await?;
    println!("retry:          {retry:?}");
    assert!(first.is_fresh() && retry.is_replay());
    assert_eq!(first.value(), retry.value());

    // The same key for another amount is refused.
    match pay(&store, &key, account, 2000).await {
        Err(Error::FingerprintMismatch { .. }) => println!("same key, other amount: refused"),
        other => panic!("expected a fingerprint mismatch, got {other:?}"),
    }

    // A payment the closure refuses commits nothing and leaves its key free.
    let big = format!("pay-{run}-2");
    match pay(&store, &big, account, 1_000_000).await {
        Err(Error::Failed { source, .. }) => println!("too large: {source} (nothing committed)"),
        other => panic!("expected the payment to fail, got {other:?}"),
    }

    // Two instances (two stores, two runtimes' worth of connections) race on
    // one key: one charges, the other waits for its commit and replays.
    let other = PostgresStore::builder(&url)
        .with_table("example_idempotency")
        .connect()
        .await?;
    let raced = format!("pay-{run}-3");
    let (a, b) = tokio::join!(
        pay(&store, &raced, account, 700),
        pay(&other, &raced, account, 700)
    );
    let (a, b) = (a?, b?);
    println!("raced:          {a:?} / {b:?}");
    assert_eq!(a.value(), b.value());
    assert!(a.is_fresh() != b.is_fresh(), "exactly one charged");

    // The same store also backs a runtime: a result committed by a
    // transactional run replays through it (same key, scope and fingerprint).
    let runtime = Runtime::builder()
        .with_postgres(store.clone())
        .start()
        .await?;
    let options = IdempotencyOptions::new()
        .with_scope(format!("account-{account}"))
        .with_fingerprint("POST /payments amount=1500");
    let through_runtime = runtime
        .idempotency()
        .run_with(&key, options, || async {
            Ok::<_, std::io::Error>(Receipt {
                payment_id: 0,
                balance_after: 0,
            })
        })
        .await?;
    println!("through the runtime: {through_runtime:?}");

    let charged = payments_of(&url, account).await?;
    println!("payments recorded for account {account}: {charged} (1500 and 700)");
    assert_eq!(charged, 2);
    Ok(())
}
