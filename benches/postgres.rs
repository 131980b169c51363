//! PostgreSQL benches, each side by side with its anchor, on the machine's
//! server (`THROTTLEBEAM_TEST_POSTGRES_URL`, default
//! `postgres://postgres@127.0.0.1:5432/test`), in a schema of their own
//! dropped at the end. One caller, one process; every comparison runs
//! alternating rounds after a warm-up (41 rounds of 200 replays, 7 rounds
//! of 150 writing calls), and prints the medians, the median of the rounds'
//! ratios and the load average (one round of either side varies by up to
//! 1.5x on a shared VM, and a commit's disk flush by more).
//!
//! - `postgres_idempotency_replay`: replaying a completed key through a
//!   runtime sharing the store (one statement) against a plain `SELECT` of
//!   one row by primary key, through a pool of the same kind and settings
//!   (deadpool, statements prepared once per connection). Target: <= 1.3.
//!   Printed beside it: `_store_only`, the store's claim called directly
//!   (no runtime), and `_raw_statement`, the claim's statement sent raw
//!   through the anchor's pool: what the server and the wire cost apart
//!   from the client layers.
//! - `postgres_idempotency_fresh`: claim a fresh key, run an empty
//!   function, complete it, against the same number (two) of single-row
//!   round trips that write (`INSERT`, then `UPDATE` of that row, each its
//!   own commit). Target: <= 1.5.
//! - `postgres_transaction`: a transactional run whose closure inserts one
//!   row against a hand-written transaction doing the same statements (the
//!   claim row written before the transaction with an unflushed commit,
//!   `BEGIN`, the insert, the completion `UPDATE`, `COMMIT`). Target:
//!   <= 1.3. Printed beside it: against a bare transaction holding only
//!   the insert (what idempotency costs on top of the effect alone).
//!
//! - `postgres_http_fresh` and `postgres_http_replay` (with `axum`): a POST through
//!   `IdempotencyLayer::with_postgres_transaction` whose handler inserts a payment row in the
//!   layer's transaction (the response stored and the key completed in it), against a
//!   hand-written axum handler doing the same in one transaction with its own keys table
//!   (`BEGIN`, `INSERT … ON CONFLICT DO NOTHING` of the key, the payment insert, the response
//!   row, `COMMIT`; a replay reads the stored response after the conflict). Both served by an
//!   axum `Router` in process (`oneshot`, the body read whole), on pools of the same kind and
//!   size. Target: <= 1.3 for each.
//!
//! Run: `cargo bench --features postgres --bench postgres` (all; `--features postgres,axum`
//! for the HTTP rows), or with a
//! name filter: `cargo bench --features postgres --bench postgres -- replay`.

#[path = "support/figures.rs"]
#[allow(dead_code)]
mod figures;
#[path = "../tests/support/postgres.rs"]
#[allow(dead_code, unreachable_pub)]
mod support_postgres;

use std::convert::Infallible;
use std::hint::black_box;
use std::time::Instant;

use deadpool_postgres::{Manager, ManagerConfig, Pool, RecyclingMethod, Runtime as PoolRuntime};
use figures::{median, selected};
use support_postgres::PgSchema;
use throttlebeam::idempotency::postgres::{PostgresStore, tokio_postgres};
use throttlebeam::{
    IdempotencyHandle, IdempotencyOptions, Runtime, idempotency::ClaimReply,
    idempotency::ClaimRequest, idempotency::ClaimToken, idempotency::IdempotencyStore,
};

/// Rounds of the writing comparisons (each call a commit: milliseconds).
const ROUNDS: usize = 7;
/// Rounds of the replay comparison: short and many, so that the load of a
/// busy machine falls on both sides alike.
const REPLAY_ROUNDS: usize = 41;
const REPLAYS: u64 = 200;
const WRITES: u64 = 150;

/// The load average, as `/proc/loadavg` gives it.
fn load() -> String {
    std::fs::read_to_string("/proc/loadavg")
        .map(|l| l.split_whitespace().take(3).collect::<Vec<_>>().join(" "))
        .unwrap_or_else(|_| "unknown".to_owned())
}

/// Nanoseconds per call of `n` sequential calls.
async fn per_call<F, Fut>(n: u64, mut call: F) -> f64
where
    F: FnMut(u64) -> Fut,
    Fut: Future<Output = ()>,
{
    let started = Instant::now();
    for i in 0..n {
        call(i).await;
    }
    started.elapsed().as_nanos() as f64 / n as f64
}

/// Warms both sides up, then runs `rounds` alternating rounds, and prints
/// the medians and the median ratio.
async fn compare<O, A, OF, AF>(name: &str, rounds: usize, mut ours: O, mut anchor: A)
where
    O: FnMut(usize) -> OF,
    A: FnMut(usize) -> AF,
    OF: Future<Output = f64>,
    AF: Future<Output = f64>,
{
    ours(0).await;
    anchor(0).await;
    let (mut o, mut a, mut ratios) = (Vec::new(), Vec::new(), Vec::new());
    for round in 1..=rounds {
        let x = ours(round).await;
        let y = anchor(round).await;
        o.push(x);
        a.push(y);
        ratios.push(x / y);
    }
    println!(
        "compare {name}: ours {:.0} ns, anchor {:.0} ns, ratio {:.2} (medians of {rounds} \
         alternating rounds; load average {})",
        median(&mut o),
        median(&mut a),
        median(&mut ratios),
        load()
    );
}

/// A pool of the kind and settings the store uses.
fn pool(schema: &PgSchema) -> Pool {
    let mut config: tokio_postgres::Config = schema.url().parse().expect("url");
    config.application_name(&schema.name);
    let manager = Manager::from_config(
        config,
        tokio_postgres::NoTls,
        ManagerConfig {
            recycling_method: RecyclingMethod::Fast,
        },
    );
    Pool::builder(manager)
        .max_size(16)
        .runtime(PoolRuntime::Tokio1)
        .build()
        .expect("pool")
}

async fn replay(idem: &IdempotencyHandle, store: &PostgresStore, pool: &Pool, table: &str) {
    let first = idem
        .run("bench:replay", || async { Ok::<_, Infallible>(42_u64) })
        .await
        .expect("fresh");
    assert!(first.is_fresh());
    let select = format!("SELECT value FROM {table} WHERE key = $1");
    let anchor = |_| {
        per_call(REPLAYS, |_| async {
            let conn = pool.get().await.expect("connection");
            let statement = conn.prepare_cached(&select).await.expect("prepare");
            let row = conn
                .query_one(&statement, &[&b"-bench:replay".as_slice()])
                .await
                .expect("SELECT");
            black_box(row.get::<_, Vec<u8>>(0));
        })
    };
    let through_runtime = |_| {
        per_call(REPLAYS, |_| async {
            let outcome = idem
                .run("bench:replay", || async { Ok::<_, Infallible>(0_u64) })
                .await
                .expect("replay");
            assert!(outcome.is_replay());
        })
    };
    compare(
        "postgres_idempotency_replay",
        REPLAY_ROUNDS,
        through_runtime,
        anchor,
    )
    .await;
    // Where the time goes: the store's claim called directly (no runtime),
    // and the claim's statement sent raw through the anchor's pool.
    let store_only = |_| {
        per_call(REPLAYS, |_| async {
            let request = ClaimRequest::new(
                ClaimToken::new(),
                None,
                IdempotencyOptions::DEFAULT_LEASE,
                IdempotencyOptions::DEFAULT_TTL,
            );
            let reply = store.claim("-bench:replay", request).await.expect("claim");
            assert!(matches!(reply, ClaimReply::Completed(_)));
        })
    };
    compare(
        "postgres_idempotency_replay_store_only",
        REPLAY_ROUNDS,
        store_only,
        anchor,
    )
    .await;
    let claim_fn = format!("{}_claim", table.replace('.', "\".\""));
    let raw = format!(
        "(SELECT done, fingerprint, type_tag, value, \
                 ceil(date_part('epoch', expires_at - clock_timestamp()) * 1000)::bigint AS left_ms, \
                 NULL::bigint AS fence \
            FROM {table} WHERE key = $1 AND expires_at > clock_timestamp()) \
          UNION ALL (SELECT * FROM \"{claim_fn}\"($1, $2, $3, $4, $5)) LIMIT 1"
    );
    let raw_statement = |_| {
        per_call(REPLAYS, |_| async {
            let conn = pool.get().await.expect("connection");
            let statement = conn.prepare_cached(&raw).await.expect("prepare");
            let token = [1_u8; 16];
            let row = conn
                .query_one(
                    &statement,
                    &[
                        &b"-bench:replay".as_slice(),
                        &&token[..],
                        &None::<&[u8]>,
                        &30_000_i64,
                        &true,
                    ],
                )
                .await
                .expect("claim statement");
            black_box(row.get::<_, Option<Vec<u8>>>(3));
        })
    };
    compare(
        "postgres_idempotency_replay_raw_statement",
        REPLAY_ROUNDS,
        raw_statement,
        anchor,
    )
    .await;
}

async fn fresh(idem: &IdempotencyHandle, pool: &Pool, schema: &PgSchema) {
    let anchor = format!("\"{}\".anchor", schema.name);
    schema
        .client()
        .await
        .batch_execute(&format!(
            "CREATE TABLE {anchor} (key text PRIMARY KEY, v bigint NOT NULL)"
        ))
        .await
        .expect("anchor table");
    let (insert, update) = (
        format!("INSERT INTO {anchor} (key, v) VALUES ($1, $2)"),
        format!("UPDATE {anchor} SET v = $2 WHERE key = $1"),
    );
    compare(
        "postgres_idempotency_fresh",
        ROUNDS,
        |round| {
            per_call(WRITES, move |i| async move {
                let outcome = idem
                    .run(&format!("bench:fresh:{round}:{i}"), move || async move {
                        Ok::<_, Infallible>(i)
                    })
                    .await
                    .expect("fresh");
                assert!(outcome.is_fresh());
            })
        },
        |round| {
            let (insert, update) = (&insert, &update);
            per_call(WRITES, move |i| async move {
                let conn = pool.get().await.expect("connection");
                let key = format!("anchor:{round}:{i}");
                let statement = conn.prepare_cached(insert).await.expect("prepare");
                conn.execute(&statement, &[&key, &0_i64])
                    .await
                    .expect("INSERT");
                let statement = conn.prepare_cached(update).await.expect("prepare");
                conn.execute(&statement, &[&key, &1_i64])
                    .await
                    .expect("UPDATE");
            })
        },
    )
    .await;
}

async fn transaction(store: &PostgresStore, pool: &Pool, schema: &PgSchema) {
    let admin = schema.client().await;
    let (effects, keys) = (
        format!("\"{}\".effects", schema.name),
        format!("\"{}\".keys", schema.name),
    );
    admin
        .batch_execute(&format!(
            "CREATE TABLE {effects} (key text NOT NULL, value bigint NOT NULL); \
             CREATE TABLE {keys} (key text PRIMARY KEY, done boolean NOT NULL, token bytea NOT NULL, \
                                  value bytea, expires_at timestamptz NOT NULL)"
        ))
        .await
        .expect("tables");
    let insert_effect = format!("INSERT INTO {effects} (key, value) VALUES ($1, $2)");
    // The statements a transactional run sends, written by hand.
    let claim = format!(
        "WITH c AS (SELECT set_config('synchronous_commit', 'off', true)) \
         INSERT INTO {keys} (key, done, token, expires_at) \
         SELECT $1, false, $2, clock_timestamp() + interval '30 seconds' FROM c"
    );
    let complete = format!(
        "UPDATE {keys} SET done = true, value = $3, expires_at = clock_timestamp() + interval '1 day' \
          WHERE key = $1 AND token = $2 AND NOT done"
    );
    let token = [7_u8; 16];
    let insert_effect = &insert_effect;
    let ours = |tag: &'static str| {
        move |round: usize| {
            per_call(WRITES, move |i| async move {
                let key = format!("tx:{tag}:{round}:{i}");
                let effect_key = key.clone();
                let insert = insert_effect.clone();
                let outcome = store
                    .run_in_transaction(&key, IdempotencyOptions::new(), move |tx| {
                        Box::pin(async move {
                            tx.execute(&insert, &[&effect_key, &(i as i64)]).await?;
                            Ok::<_, tokio_postgres::Error>(i)
                        })
                    })
                    .await
                    .expect("transactional run");
                assert!(outcome.is_fresh());
            })
        }
    };
    let by_hand = |round: usize| {
        let (claim, complete) = (&claim, &complete);
        per_call(WRITES, move |i| async move {
            let key = format!("hand:{round}:{i}");
            let mut conn = pool.get().await.expect("connection");
            let statement = conn.prepare_cached(claim).await.expect("prepare");
            conn.execute(&statement, &[&key, &&token[..]])
                .await
                .expect("claim");
            let tx = conn.transaction().await.expect("BEGIN");
            tx.execute(insert_effect.as_str(), &[&key, &(i as i64)])
                .await
                .expect("effect");
            let statement = tx.prepare_cached(complete).await.expect("prepare");
            let value = vec![0_u8; 12];
            tx.execute(&statement, &[&key, &&token[..], &value])
                .await
                .expect("completion");
            tx.commit().await.expect("COMMIT");
        })
    };
    compare("postgres_transaction", ROUNDS, ours("hand"), by_hand).await;
    let bare = |round: usize| {
        per_call(WRITES, move |i| async move {
            let key = format!("bare:{round}:{i}");
            let mut conn = pool.get().await.expect("connection");
            let tx = conn.transaction().await.expect("BEGIN");
            tx.execute(insert_effect.as_str(), &[&key, &(i as i64)])
                .await
                .expect("effect");
            tx.commit().await.expect("COMMIT");
        })
    };
    compare(
        "postgres_transaction_vs_bare_transaction",
        ROUNDS,
        ours("bare"),
        bare,
    )
    .await;
}

#[cfg(feature = "axum")]
mod http_bench {
    use std::sync::Arc;

    use axum::Router;
    use axum::extract::State;
    use axum::http::{HeaderMap, StatusCode};
    use axum::response::{IntoResponse, Response};
    use axum::routing::post;
    use bytes::Bytes;
    use deadpool_postgres::Pool;
    use http_body_util::BodyExt;
    use throttlebeam::Runtime;
    use throttlebeam::http::{IdempotencyLayer, PgTransaction};
    use throttlebeam::idempotency::postgres::PostgresStore;
    use tower::ServiceExt;

    use super::{REPLAY_ROUNDS, REPLAYS, ROUNDS, WRITES, compare, per_call};
    use crate::support_postgres::PgSchema;

    /// The payment's response body: what both sides answer.
    fn receipt(id: i64) -> String {
        format!(r#"{{"payment":{id},"status":"charged"}}"#)
    }

    async fn ours(State(table): State<Arc<str>>, tx: PgTransaction, body: Bytes) -> Response {
        let amount = i64::try_from(body.len()).unwrap_or(0);
        match tx
            .query_one(
                &format!("INSERT INTO {table} (amount) VALUES ($1) RETURNING id"),
                &[&amount],
            )
            .await
        {
            Ok(row) => (StatusCode::CREATED, receipt(row.get(0))).into_response(),
            Err(_) => StatusCode::INTERNAL_SERVER_ERROR.into_response(),
        }
    }

    #[derive(Clone)]
    struct Anchor {
        pool: Pool,
        payments: Arc<str>,
        keys: Arc<str>,
    }

    /// The hand-written handler: its own keys table, in one transaction.
    async fn anchor(State(a): State<Anchor>, headers: HeaderMap, body: Bytes) -> Response {
        let Some(key) = headers
            .get("idempotency-key")
            .and_then(|v| v.to_str().ok())
            .map(str::to_owned)
        else {
            return StatusCode::BAD_REQUEST.into_response();
        };
        let mut conn = a.pool.get().await.expect("connection");
        let tx = conn.transaction().await.expect("BEGIN");
        let claim = tx
            .prepare_cached(&format!(
                "INSERT INTO {} (key) VALUES ($1) ON CONFLICT DO NOTHING",
                a.keys
            ))
            .await
            .expect("prepare");
        if tx.execute(&claim, &[&key]).await.expect("claim") == 0 {
            let read = tx
                .prepare_cached(&format!(
                    "SELECT status, body FROM {} WHERE key = $1",
                    a.keys
                ))
                .await
                .expect("prepare");
            let row = tx.query_one(&read, &[&key]).await.expect("stored response");
            tx.commit().await.expect("COMMIT");
            let status: Option<i32> = row.get(0);
            let body: Option<Vec<u8>> = row.get(1);
            return match (status, body) {
                (Some(status), Some(body)) => (
                    StatusCode::from_u16(u16::try_from(status).unwrap_or(500)).unwrap(),
                    [("idempotent-replayed", "true")],
                    body,
                )
                    .into_response(),
                _ => StatusCode::CONFLICT.into_response(),
            };
        }
        let amount = i64::try_from(body.len()).unwrap_or(0);
        let insert = tx
            .prepare_cached(&format!(
                "INSERT INTO {} (amount) VALUES ($1) RETURNING id",
                a.payments
            ))
            .await
            .expect("prepare");
        let id: i64 = tx
            .query_one(&insert, &[&amount])
            .await
            .expect("payment")
            .get(0);
        let response = receipt(id);
        let store = tx
            .prepare_cached(&format!(
                "UPDATE {} SET status = $2, body = $3 WHERE key = $1",
                a.keys
            ))
            .await
            .expect("prepare");
        tx.execute(&store, &[&key, &201_i32, &response.as_bytes()])
            .await
            .expect("response row");
        tx.commit().await.expect("COMMIT");
        (StatusCode::CREATED, response).into_response()
    }

    async fn send(router: &Router, key: &str) -> (StatusCode, Bytes) {
        let request = axum::http::Request::post("/pay")
            .header("idempotency-key", key)
            .body(axum::body::Body::from("{\"amount\":1500}"))
            .expect("request");
        let response = router.clone().oneshot(request).await.expect("served");
        let status = response.status();
        let body = response
            .into_body()
            .collect()
            .await
            .expect("body")
            .to_bytes();
        (status, body)
    }

    pub(super) async fn bench(schema: &PgSchema, store: &PostgresStore, pool: &Pool) {
        let (payments, keys) = (
            format!("\"{}\".payments", schema.name),
            format!("\"{}\".http_keys", schema.name),
        );
        schema
            .client()
            .await
            .batch_execute(&format!(
                "CREATE TABLE {payments} (id bigserial PRIMARY KEY, amount bigint NOT NULL); \
                 CREATE TABLE {keys} (key text PRIMARY KEY, status integer, body bytea)"
            ))
            .await
            .expect("tables");
        let runtime = Runtime::builder()
            .with_postgres(store.clone())
            .start()
            .await
            .expect("runtime");
        let layer = IdempotencyLayer::builder(&runtime)
            .with_required_key(true)
            .with_shared_scope()
            .with_postgres_transaction(store)
            .build()
            .expect("layer");
        let ours_router = Router::new()
            .route("/pay", post(ours))
            .route_layer(layer)
            .with_state(Arc::<str>::from(payments.as_str()));
        let anchor_router = Router::new()
            .route("/pay", post(anchor))
            .with_state(Anchor {
                pool: pool.clone(),
                payments: Arc::from(payments.as_str()),
                keys: Arc::from(keys.as_str()),
            });
        let (o, a) = (&ours_router, &anchor_router);
        compare(
            "postgres_http_fresh",
            ROUNDS,
            |round| {
                per_call(WRITES, move |i| async move {
                    let (status, _) = send(o, &format!("fresh:{round}:{i}")).await;
                    assert_eq!(status, StatusCode::CREATED);
                })
            },
            |round| {
                per_call(WRITES, move |i| async move {
                    let (status, _) = send(a, &format!("fresh:{round}:{i}")).await;
                    assert_eq!(status, StatusCode::CREATED);
                })
            },
        )
        .await;
        assert_eq!(send(o, "replayed").await.0, StatusCode::CREATED);
        assert_eq!(send(a, "replayed").await.0, StatusCode::CREATED);
        compare(
            "postgres_http_replay",
            REPLAY_ROUNDS,
            |_| {
                per_call(REPLAYS, move |_| async move {
                    let (status, body) = send(o, "replayed").await;
                    assert_eq!(status, StatusCode::CREATED);
                    std::hint::black_box(body);
                })
            },
            |_| {
                per_call(REPLAYS, move |_| async move {
                    let (status, body) = send(a, "replayed").await;
                    assert_eq!(status, StatusCode::CREATED);
                    std::hint::black_box(body);
                })
            },
        )
        .await;
    }
}

fn main() {
    let rt = tokio::runtime::Builder::new_multi_thread()
        .worker_threads(2)
        .enable_all()
        .build()
        .expect("tokio runtime");
    rt.block_on(async {
        let Some(schema) = PgSchema::create("bench_postgres").await else {
            return;
        };
        println!("load average at start: {}", load());
        let store = schema.store().await;
        let runtime = Runtime::builder()
            .with_postgres(store.clone())
            .start()
            .await
            .expect("runtime");
        let idem = runtime.idempotency();
        let pool = pool(&schema);
        if selected("postgres_idempotency_replay") {
            replay(&idem, &store, &pool, &schema.table()).await;
        }
        if selected("postgres_idempotency_fresh") {
            fresh(&idem, &pool, &schema).await;
        }
        if selected("postgres_transaction") {
            transaction(&store, &pool, &schema).await;
        }
        #[cfg(feature = "axum")]
        if selected("postgres_http") {
            http_bench::bench(&schema, &store, &pool).await;
        }
        println!("load average at the end: {}", load());
    });
}
