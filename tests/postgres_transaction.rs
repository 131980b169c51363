//! Transactional runs on the machine's PostgreSQL (SCENARIOS P2, P3): the
//! closure's writes, the stored result and the completion commit together;
//! nothing of a run that does not commit is visible (closure failed or
//! panicked, connection killed, process killed, pool broken), and the retry
//! commits the effect once.
#![cfg(feature = "postgres")]

mod support;

use std::io::{BufRead, BufReader};
use std::process::{Command, Stdio};
use std::sync::Arc;
use std::sync::atomic::{AtomicU32, Ordering};
use std::time::Duration;

use support::postgres::PgSchema;
use throttlebeam::idempotency::postgres::tokio_postgres::IsolationLevel;
use throttlebeam::idempotency::postgres::{
    PostgresStore, TransactionFuture, TransactionOptions, is_serialization_failure, tokio_postgres,
};
use throttlebeam::{Error, IdempotencyOptions, IdempotencyOutcome, Runtime, idempotency::InFlight};
use tokio::sync::{Semaphore, oneshot};
use tokio::time::Instant;

/// Why a test closure gave up.
#[derive(Debug)]
struct Declined;

impl std::fmt::Display for Declined {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str("declined")
    }
}

impl std::error::Error for Declined {}

/// A closure writing one effect row for `key` with `value`, counting its
/// executions, and returning `value`.
fn effect(
    effects: String,
    key: &str,
    value: i64,
    runs: &Arc<AtomicU32>,
) -> impl for<'t> FnOnce(
    &'t mut tokio_postgres::Transaction<'_>,
) -> TransactionFuture<'t, i64, tokio_postgres::Error>
+ Send
+ 'static {
    let (key, runs) = (key.to_owned(), Arc::clone(runs));
    move |tx| {
        Box::pin(async move {
            runs.fetch_add(1, Ordering::SeqCst);
            tx.execute(
                &format!("INSERT INTO {effects} (key, value) VALUES ($1, $2)"),
                &[&key, &value],
            )
            .await?;
            Ok(value)
        })
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn p2_the_effect_the_result_and_the_completion_commit_together_and_replay() {
    let Some(schema) = PgSchema::create("p2_commit_together_and_replay").await else {
        return;
    };
    schema.create_effects().await;
    let store = schema.store().await;
    let admin = schema.client().await;
    let runs = Arc::new(AtomicU32::new(0));
    let options = IdempotencyOptions::new()
        .with_scope("shop")
        .with_fingerprint("POST /pay 15");
    let first = store
        .run_in_transaction(
            "pay:1",
            options.clone(),
            effect(schema.effects(), "pay:1", 15, &runs),
        )
        .await
        .unwrap();
    assert_eq!(first, IdempotencyOutcome::Fresh(15));
    assert_eq!(schema.effects_of(&admin, "pay:1").await, 1);
    let again = store
        .run_in_transaction(
            "pay:1",
            options.clone(),
            effect(schema.effects(), "pay:1", 99, &runs),
        )
        .await
        .unwrap();
    assert_eq!(again, IdempotencyOutcome::Replay(15));
    assert_eq!(runs.load(Ordering::SeqCst), 1);
    assert_eq!(schema.effects_of(&admin, "pay:1").await, 1);
    // The same key, options and type through a runtime sharing the store: a replay.
    let runtime = Runtime::builder()
        .with_postgres(store.clone())
        .start()
        .await
        .unwrap();
    let via_runtime = runtime
        .idempotency()
        .run_with("pay:1", options.clone(), || async {
            Ok::<_, Declined>(0_i64)
        })
        .await
        .unwrap();
    assert_eq!(via_runtime, IdempotencyOutcome::Replay(15));
    // Another fingerprint, another type: refused, nothing runs.
    let other = options.clone().with_fingerprint("POST /pay 16");
    let mismatch = store
        .run_in_transaction("pay:1", other, effect(schema.effects(), "pay:1", 16, &runs))
        .await;
    assert!(
        matches!(mismatch, Err(Error::FingerprintMismatch { .. })),
        "{mismatch:?}"
    );
    let wrong_type = store
        .run_in_transaction("pay:1", options, |_tx| {
            Box::pin(async { Ok::<_, Declined>("text".to_owned()) })
        })
        .await;
    assert!(
        matches!(wrong_type, Err(Error::TypeMismatch { .. })),
        "{wrong_type:?}"
    );
    // A run through the runtime replays in a transactional run too.
    let ran = runtime
        .idempotency()
        .run("mail:1", || async { Ok::<_, Declined>(7_i64) })
        .await
        .unwrap();
    assert!(ran.is_fresh());
    let replay = store
        .run_in_transaction(
            "mail:1",
            IdempotencyOptions::new(),
            effect(schema.effects(), "mail:1", 8, &runs),
        )
        .await
        .unwrap();
    assert_eq!(replay, IdempotencyOutcome::Replay(7));
    assert_eq!(runs.load(Ordering::SeqCst), 1);
}

/// A closure that writes an effect, then fails (or panics).
fn failing(
    effects: String,
    panics: bool,
) -> impl for<'t> FnOnce(&'t mut tokio_postgres::Transaction<'_>) -> TransactionFuture<'t, i64, Declined>
+ Send
+ 'static {
    move |tx| {
        Box::pin(async move {
            tx.execute(
                &format!("INSERT INTO {effects} (key, value) VALUES ('k', 1)"),
                &[],
            )
            .await
            .expect("the effect is written");
            assert!(!panics, "the closure panics after its effect");
            Err(Declined)
        })
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn p2_a_closure_that_fails_or_panics_commits_nothing_and_the_retry_runs_once() {
    let Some(schema) = PgSchema::create("p2_closure_fails_or_panics").await else {
        return;
    };
    schema.create_effects().await;
    let store = schema.store().await;
    let admin = schema.client().await;
    let effects = schema.effects();
    let failed = store
        .run_in_transaction(
            "k",
            IdempotencyOptions::new(),
            failing(effects.clone(), false),
        )
        .await;
    assert!(matches!(failed, Err(Error::Failed { .. })), "{failed:?}");
    assert_eq!(schema.effects_of(&admin, "k").await, 0, "rolled back");
    let panicked = store
        .run_in_transaction(
            "k",
            IdempotencyOptions::new(),
            failing(effects.clone(), true),
        )
        .await;
    match &panicked {
        Err(Error::Panicked { message, .. }) => {
            assert!(message.contains("panics after its effect"), "{message}");
        }
        other => panic!("{other:?}"),
    }
    assert_eq!(schema.effects_of(&admin, "k").await, 0, "rolled back");
    // Released each time: the retry runs at once, and once.
    let runs = Arc::new(AtomicU32::new(0));
    let started = Instant::now();
    let retry = store
        .run_in_transaction(
            "k",
            IdempotencyOptions::new().with_in_flight(InFlight::Reject),
            effect(effects.clone(), "k", 3, &runs),
        )
        .await
        .unwrap();
    assert_eq!(retry, IdempotencyOutcome::Fresh(3));
    assert!(started.elapsed() < Duration::from_secs(5));
    assert_eq!(schema.effects_of(&admin, "k").await, 1);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn p2_a_duplicate_waits_for_the_commit_and_replays_and_a_fail_fast_one_is_refused() {
    let Some(schema) = PgSchema::create("p2_duplicate_waits_then_replays").await else {
        return;
    };
    schema.create_effects().await;
    let first = schema.store().await;
    // Another instance: its own pool and listener.
    let second = schema.builder().connect().await.unwrap();
    let admin = schema.client().await;
    let (started_tx, started_rx) = oneshot::channel();
    let (go_tx, go_rx) = oneshot::channel::<()>();
    let effects = schema.effects();
    let owner = tokio::spawn({
        let first = first.clone();
        async move {
            first
                .run_in_transaction("order:1", IdempotencyOptions::new(), move |tx| {
                    Box::pin(async move {
                        tx.execute(
                            &format!("INSERT INTO {effects} (key, value) VALUES ('order:1', 1)"),
                            &[],
                        )
                        .await?;
                        let _ = started_tx.send(());
                        let _ = go_rx.await;
                        Ok::<_, tokio_postgres::Error>(41_i64)
                    })
                })
                .await
        }
    });
    started_rx.await.unwrap();
    let runs = Arc::new(AtomicU32::new(0));
    let rejected = second
        .run_in_transaction(
            "order:1",
            IdempotencyOptions::new().with_in_flight(InFlight::Reject),
            effect(schema.effects(), "order:1", 2, &runs),
        )
        .await;
    match rejected {
        Err(Error::InFlight { retry_after, .. }) => {
            assert!(retry_after > Duration::ZERO && retry_after <= Duration::from_secs(1));
        }
        other => panic!("{other:?}"),
    }
    let waiter = tokio::spawn({
        let (second, effects, runs) = (second.clone(), schema.effects(), Arc::clone(&runs));
        async move {
            let outcome = second
                .run_in_transaction(
                    "order:1",
                    IdempotencyOptions::new(),
                    effect(effects, "order:1", 3, &runs),
                )
                .await;
            (outcome, Instant::now())
        }
    });
    // The owner's effect is not visible before its commit.
    tokio::time::sleep(Duration::from_millis(300)).await;
    assert_eq!(schema.effects_of(&admin, "order:1").await, 0);
    let released = Instant::now();
    go_tx.send(()).unwrap();
    assert_eq!(owner.await.unwrap().unwrap(), IdempotencyOutcome::Fresh(41));
    let (outcome, at) = waiter.await.unwrap();
    assert_eq!(outcome.unwrap(), IdempotencyOutcome::Replay(41));
    assert!(
        at - released < Duration::from_secs(2),
        "woken by the commit's notice: {:?}",
        at - released
    );
    assert_eq!(runs.load(Ordering::SeqCst), 0, "the duplicates never ran");
    assert_eq!(schema.effects_of(&admin, "order:1").await, 1);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn p2_a_run_whose_connection_is_killed_mid_closure_leaves_no_effect_and_the_retry_commits_once()
 {
    let Some(schema) = PgSchema::create("p2_connection_killed_mid_closure").await else {
        return;
    };
    schema.create_effects().await;
    let store = schema.store().await;
    let admin = schema.client().await;
    let (pid_tx, pid_rx) = oneshot::channel::<i32>();
    let (go_tx, go_rx) = oneshot::channel::<()>();
    let effects = schema.effects();
    let run = tokio::spawn({
        let store = store.clone();
        async move {
            store
                .run_in_transaction("pay:kill", IdempotencyOptions::new(), move |tx| {
                    Box::pin(async move {
                        tx.execute(
                            &format!("INSERT INTO {effects} (key, value) VALUES ('pay:kill', 1)"),
                            &[],
                        )
                        .await?;
                        let pid: i32 = tx.query_one("SELECT pg_backend_pid()", &[]).await?.get(0);
                        let _ = pid_tx.send(pid);
                        let _ = go_rx.await;
                        tx.execute(
                            &format!("INSERT INTO {effects} (key, value) VALUES ('pay:kill', 2)"),
                            &[],
                        )
                        .await?;
                        Ok::<_, tokio_postgres::Error>(1_i64)
                    })
                })
                .await
        }
    });
    let pid = pid_rx.await.unwrap();
    let killed: bool = admin
        .query_one("SELECT pg_terminate_backend($1)", &[&pid])
        .await
        .unwrap()
        .get(0);
    assert!(killed);
    go_tx.send(()).unwrap();
    let outcome = run.await.unwrap();
    assert!(
        matches!(
            outcome,
            Err(Error::Failed { .. } | Error::StoreUnavailable { .. })
        ),
        "{outcome:?}"
    );
    assert_eq!(
        schema.effects_of(&admin, "pay:kill").await,
        0,
        "nothing committed"
    );
    // The claim was released through another connection: the retry runs at once, once.
    let runs = Arc::new(AtomicU32::new(0));
    let retry = store
        .run_in_transaction(
            "pay:kill",
            IdempotencyOptions::new().with_in_flight(InFlight::Reject),
            effect(schema.effects(), "pay:kill", 5, &runs),
        )
        .await
        .unwrap();
    assert_eq!(retry, IdempotencyOutcome::Fresh(5));
    assert_eq!(schema.effects_of(&admin, "pay:kill").await, 1);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_live_runs_claim_cannot_be_taken_over_its_row_is_locked_until_it_commits() {
    let Some(schema) = PgSchema::create("a_live_runs_claim_is_locked").await else {
        return;
    };
    schema.create_effects().await;
    let store = schema.store().await;
    let admin = schema.client().await;
    let (started_tx, started_rx) = oneshot::channel();
    let (go_tx, go_rx) = oneshot::channel::<()>();
    let effects = schema.effects();
    let run = tokio::spawn({
        let store = store.clone();
        async move {
            store
                .run_in_transaction("pay:stolen", IdempotencyOptions::new(), move |tx| {
                    Box::pin(async move {
                        tx.execute(
                            &format!("INSERT INTO {effects} (key, value) VALUES ('pay:stolen', 1)"),
                            &[],
                        )
                        .await?;
                        let _ = started_tx.send(());
                        let _ = go_rx.await;
                        Ok::<_, tokio_postgres::Error>(1_i64)
                    })
                })
                .await
        }
    });
    started_rx.await.unwrap();
    // Another owner trying to take the key over (as after a lapsed lease) waits for the
    // run's row lock: with a lock timeout it gives up, and the claim stays the run's.
    let stolen = admin
        .batch_execute(&format!(
            "BEGIN; SET LOCAL lock_timeout = '200ms'; \
             UPDATE {} SET token = '\\x00000000000000000000000000000001'::bytea \
              WHERE key = '-pay:stolen'::bytea; COMMIT",
            schema.table()
        ))
        .await;
    let code = stolen.unwrap_err().code().cloned();
    assert_eq!(
        code,
        Some(tokio_postgres::error::SqlState::LOCK_NOT_AVAILABLE)
    );
    admin.batch_execute("ROLLBACK").await.unwrap();
    go_tx.send(()).unwrap();
    assert_eq!(run.await.unwrap().unwrap(), IdempotencyOutcome::Fresh(1));
    assert_eq!(schema.effects_of(&admin, "pay:stolen").await, 1);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn i10_a_caller_that_leaves_does_not_cancel_the_run_which_commits_and_replays() {
    let Some(schema) = PgSchema::create("i10_caller_leaves").await else {
        return;
    };
    schema.create_effects().await;
    let store = schema.store().await;
    let admin = schema.client().await;
    let (started_tx, started_rx) = oneshot::channel();
    let effects = schema.effects();
    let caller = tokio::spawn({
        let store = store.clone();
        async move {
            store
                .run_in_transaction("job:1", IdempotencyOptions::new(), move |tx| {
                    Box::pin(async move {
                        let _ = started_tx.send(());
                        tokio::time::sleep(Duration::from_millis(300)).await;
                        tx.execute(
                            &format!("INSERT INTO {effects} (key, value) VALUES ('job:1', 4)"),
                            &[],
                        )
                        .await?;
                        Ok::<_, tokio_postgres::Error>(4_i64)
                    })
                })
                .await
        }
    });
    started_rx.await.unwrap();
    caller.abort();
    let runs = Arc::new(AtomicU32::new(0));
    let replay = store
        .run_in_transaction(
            "job:1",
            IdempotencyOptions::new(),
            effect(schema.effects(), "job:1", 5, &runs),
        )
        .await
        .unwrap();
    assert_eq!(replay, IdempotencyOutcome::Replay(4));
    assert_eq!(runs.load(Ordering::SeqCst), 0);
    assert_eq!(schema.effects_of(&admin, "job:1").await, 1);
}

/// Set in the child process of the process-kill test: the schema its run
/// writes in.
const CHILD: &str = "THROTTLEBEAM_TEST_POSTGRES_CHILD";
/// What the child prints once its effect is written, before its commit.
const WRITTEN: &str = "effect written; blocking before the commit";

/// The child: a transactional run that writes its effect, says so, and
/// blocks before its commit until it is killed.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn child_writes_an_effect_and_blocks_before_its_commit() {
    let Ok(schema) = std::env::var(CHILD) else {
        // Run by p2_a_process_killed_between_its_effect_and_its_commit_leaves_no_effect.
        return;
    };
    let store = PostgresStore::builder(&support::postgres::url())
        .with_table(format!("{schema}.idempotency"))
        .with_application_name(&schema)
        .connect()
        .await
        .unwrap();
    let options = IdempotencyOptions::new().with_lease(Duration::from_secs(2));
    let outcome = store
        .run_in_transaction("pay:crash", options, move |tx| {
            Box::pin(async move {
                tx.execute(
                    &format!(
                        "INSERT INTO \"{schema}\".effects (key, value) VALUES ('pay:crash', 1)"
                    ),
                    &[],
                )
                .await?;
                println!("{WRITTEN}");
                std::future::pending::<()>().await;
                Ok::<_, tokio_postgres::Error>(1_i64)
            })
        })
        .await;
    panic!("the child was not killed: {outcome:?}");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn p2_a_process_killed_between_its_effect_and_its_commit_leaves_no_effect() {
    if std::env::var_os(CHILD).is_some() {
        return;
    }
    let Some(schema) = PgSchema::create("p2_process_killed_before_commit").await else {
        return;
    };
    schema.create_effects().await;
    let store = schema.store().await;
    let admin = schema.client().await;
    let mut child = Command::new(std::env::current_exe().unwrap())
        .args([
            "--exact",
            "child_writes_an_effect_and_blocks_before_its_commit",
            "--nocapture",
            "--test-threads",
            "1",
        ])
        .env(CHILD, &schema.name)
        .stdout(Stdio::piped())
        .stderr(Stdio::null())
        .spawn()
        .unwrap();
    let stdout = child.stdout.take().unwrap();
    let written = tokio::task::spawn_blocking(move || {
        BufReader::new(stdout)
            .lines()
            .map_while(Result::ok)
            .any(|line| line.contains(WRITTEN))
    });
    let written = tokio::time::timeout(Duration::from_secs(60), written).await;
    // Killed (SIGKILL) between its effect and its commit, whatever happened.
    child.kill().unwrap();
    child.wait().unwrap();
    assert!(
        matches!(written, Ok(Ok(true))),
        "the child never wrote its effect"
    );
    let claimed_at = Instant::now();
    assert_eq!(
        schema.effects_of(&admin, "pay:crash").await,
        0,
        "nothing committed"
    );
    // The child's claim lapses after its 2 s lease; the retry takes the key
    // over then, and commits once.
    let runs = Arc::new(AtomicU32::new(0));
    let retry = store
        .run_in_transaction(
            "pay:crash",
            IdempotencyOptions::new().with_wait_timeout(Duration::from_secs(20)),
            effect(schema.effects(), "pay:crash", 7, &runs),
        )
        .await
        .unwrap();
    assert_eq!(retry, IdempotencyOutcome::Fresh(7));
    assert!(claimed_at.elapsed() < Duration::from_secs(15));
    assert_eq!(runs.load(Ordering::SeqCst), 1);
    assert_eq!(schema.effects_of(&admin, "pay:crash").await, 1);
}

/// `keys` keys × `dups` duplicates over `stores`, each call retried until it
/// answers; calls `mid_flood` once a quarter of the keys committed. Returns
/// the executions of each key and the failures seen.
async fn flood(
    schema: &PgSchema,
    stores: &[PostgresStore],
    keys: usize,
    dups: usize,
    mid_flood: impl Future<Output = ()>,
) -> (Arc<Vec<AtomicU32>>, u32) {
    let runs: Arc<Vec<AtomicU32>> = Arc::new((0..keys).map(|_| AtomicU32::new(0)).collect());
    let committed = Arc::new(AtomicU32::new(0));
    let failures = Arc::new(AtomicU32::new(0));
    let gate = Arc::new(Semaphore::new(128));
    let give_up = Instant::now() + Duration::from_secs(240);
    let mut calls = tokio::task::JoinSet::new();
    for k in 0..keys {
        for d in 0..dups {
            let store = stores[(k + d) % stores.len()].clone();
            let (runs, committed, failures) = (
                Arc::clone(&runs),
                Arc::clone(&committed),
                Arc::clone(&failures),
            );
            let (gate, effects) = (Arc::clone(&gate), schema.effects());
            calls.spawn(async move {
                let _permit = gate.acquire_owned().await.unwrap();
                let key = format!("pay:{k}");
                let options = IdempotencyOptions::new()
                    .with_lease(Duration::from_secs(3))
                    .with_wait_timeout(Duration::from_secs(20));
                loop {
                    let (runs, effects, key2) = (Arc::clone(&runs), effects.clone(), key.clone());
                    let outcome = store
                        .run_in_transaction(&key, options.clone(), move |tx| {
                            Box::pin(async move {
                                runs[k].fetch_add(1, Ordering::SeqCst);
                                tx.execute(
                                    &format!("INSERT INTO {effects} (key, value) VALUES ($1, $2)"),
                                    &[&key2, &(k as i64)],
                                )
                                .await?;
                                Ok::<_, tokio_postgres::Error>(k as i64)
                            })
                        })
                        .await;
                    match outcome {
                        Ok(outcome) => {
                            assert_eq!(*outcome.value(), k as i64, "key {k}: its own value");
                            if outcome.is_fresh() {
                                committed.fetch_add(1, Ordering::SeqCst);
                            }
                            return;
                        }
                        Err(
                            Error::StoreUnavailable { .. }
                            | Error::Failed { .. }
                            | Error::Timeout { .. },
                        ) => {
                            failures.fetch_add(1, Ordering::Relaxed);
                        }
                        Err(e) => panic!("key {k}: {e:?}"),
                    }
                    assert!(Instant::now() < give_up, "key {k} never completed");
                    tokio::time::sleep(Duration::from_millis(50)).await;
                }
            });
        }
    }
    let watch = async {
        while committed.load(Ordering::SeqCst) < (keys / 4) as u32 {
            assert!(Instant::now() < give_up, "the flood did not start");
            tokio::time::sleep(Duration::from_millis(5)).await;
        }
        mid_flood.await;
    };
    let drain = async {
        while let Some(done) = calls.join_next().await {
            done.expect("no call panics");
        }
    };
    tokio::join!(watch, drain);
    assert_eq!(
        committed.load(Ordering::SeqCst) as usize,
        keys,
        "one fresh commit per key"
    );
    (runs, failures.load(Ordering::Relaxed))
}

/// Every key's effect committed exactly once.
async fn assert_one_effect_per_key(schema: &PgSchema, keys: usize) {
    let admin = schema.client().await;
    let rows = admin
        .query(
            &format!(
                "SELECT key, count(*) FROM {} GROUP BY key",
                schema.effects()
            ),
            &[],
        )
        .await
        .unwrap();
    assert_eq!(rows.len(), keys, "every key has an effect");
    let doubled: Vec<(String, i64)> = rows
        .iter()
        .map(|r| (r.get::<_, String>(0), r.get::<_, i64>(1)))
        .filter(|(_, n)| *n != 1)
        .collect();
    assert!(
        doubled.is_empty(),
        "keys whose effect committed more than once: {doubled:?}"
    );
}

async fn four_instances(schema: &PgSchema) -> Vec<PostgresStore> {
    let mut stores = Vec::new();
    for _ in 0..4 {
        stores.push(
            schema
                .builder()
                .with_pool_size(8)
                .with_command_timeout(Duration::from_secs(10))
                .connect()
                .await
                .unwrap(),
        );
    }
    stores[0].migrate().await.unwrap();
    stores
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn p3_four_instances_2000_keys_4_duplicates_commit_one_effect_per_key() {
    let Some(schema) = PgSchema::create("p3_transactional_flood").await else {
        return;
    };
    schema.create_effects().await;
    let stores = four_instances(&schema).await;
    let started = Instant::now();
    let (runs, failures) = flood(&schema, &stores, 2_000, 4, async {}).await;
    let ran_twice = (0..2_000)
        .filter(|&k| runs[k].load(Ordering::SeqCst) != 1)
        .count();
    assert_eq!(ran_twice, 0, "every closure ran once");
    assert_eq!(failures, 0);
    assert_one_effect_per_key(&schema, 2_000).await;
    println!(
        "8,000 transactional calls on 2,000 keys over 4 instances in {:?}",
        started.elapsed()
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn p3_the_pool_broken_mid_flood_commits_no_effect_twice_and_every_key_completes_on_retry() {
    let Some(schema) = PgSchema::create("p3_pool_broken_mid_flood").await else {
        return;
    };
    schema.create_effects().await;
    let stores = four_instances(&schema).await;
    let killed = Arc::new(AtomicU32::new(0));
    let break_pools = {
        let (schema, killed) = (&schema, Arc::clone(&killed));
        async move {
            // Every backend of every instance, twice: pools, listeners,
            // transactions in flight.
            for _ in 0..2 {
                let n = schema.terminate_all().await;
                killed.fetch_add(u32::try_from(n).unwrap_or(u32::MAX), Ordering::SeqCst);
                tokio::time::sleep(Duration::from_millis(100)).await;
            }
        }
    };
    let (runs, failures) = flood(&schema, &stores, 2_000, 4, break_pools).await;
    println!(
        "killed {} backends mid-flood; {failures} calls failed and were retried",
        killed.load(Ordering::SeqCst)
    );
    assert!(killed.load(Ordering::SeqCst) > 0, "the pools were broken");
    assert!((0..2_000).all(|k| runs[k].load(Ordering::SeqCst) >= 1));
    assert_one_effect_per_key(&schema, 2_000).await;
}

/// A closure that writes an effect, sleeps `hold` inside its transaction (reading before and
/// after, so that its snapshot matters), and returns `value`.
fn long(
    effects: String,
    key: &str,
    value: i64,
    hold: Duration,
    runs: &Arc<AtomicU32>,
) -> impl for<'t> FnOnce(
    &'t mut tokio_postgres::Transaction<'_>,
) -> TransactionFuture<'t, i64, tokio_postgres::Error>
+ Send
+ 'static {
    let (key, runs) = (key.to_owned(), Arc::clone(runs));
    move |tx| {
        Box::pin(async move {
            runs.fetch_add(1, Ordering::SeqCst);
            // The snapshot is taken here, after the claim's lock (reads of nothing another
            // run writes: two runs of other keys never conflict at SERIALIZABLE).
            let _: String = tx.query_one("SELECT now()::text", &[]).await?.get(0);
            tx.execute(
                &format!("INSERT INTO {effects} (key, value) VALUES ($1, $2)"),
                &[&key, &value],
            )
            .await?;
            tokio::time::sleep(hold).await;
            let _: String = tx.query_one("SELECT now()::text", &[]).await?.get(0);
            Ok(value)
        })
    }
}

/// The server's name for the isolation level of a session of `store`'s.
async fn isolation_of(store: &PostgresStore) -> String {
    let outcome = store
        .run_in_transaction(
            &format!("probe:{}", std::process::id()),
            IdempotencyOptions::new().with_ttl(Duration::from_millis(10)),
            |tx| {
                Box::pin(async move {
                    let level: String = tx
                        .query_one("SHOW transaction_isolation", &[])
                        .await?
                        .get(0);
                    Ok::<_, tokio_postgres::Error>(level)
                })
            },
        )
        .await
        .unwrap();
    outcome.into_inner()
}

/// Runs `long` on `key` from `owner` while a duplicate on `other` waits for it, and checks
/// that the run completed once, past its lease, and the duplicate replayed it.
async fn a_long_run_completes_once(
    schema: &PgSchema,
    owner: &PostgresStore,
    other: &PostgresStore,
    key: &str,
    options: IdempotencyOptions,
    transaction: TransactionOptions,
    hold: Duration,
) {
    let runs = Arc::new(AtomicU32::new(0));
    let started = Instant::now();
    let first = tokio::spawn({
        let (owner, options, run) = (
            owner.clone(),
            options.clone(),
            long(schema.effects(), key, 7, hold, &runs),
        );
        let key = key.to_owned();
        async move {
            owner
                .run_in_transaction_with(&key, options, transaction, run)
                .await
        }
    });
    // The duplicate starts once the run holds the key.
    let admin = schema.client().await;
    while admin
        .query_opt(
            &format!(
                "SELECT 1 FROM {} WHERE key = ('-' || $1::text)::bytea",
                schema.table()
            ),
            &[&key],
        )
        .await
        .unwrap()
        .is_none()
    {
        tokio::task::yield_now().await;
    }
    let duplicate = other
        .run_in_transaction_with(
            key,
            options.clone().with_wait_timeout(hold * 4),
            transaction,
            long(schema.effects(), key, 8, Duration::ZERO, &runs),
        )
        .await
        .unwrap();
    let first = first.await.unwrap().unwrap();
    assert_eq!(first, IdempotencyOutcome::Fresh(7), "{key}");
    assert_eq!(duplicate, IdempotencyOutcome::Replay(7), "{key}");
    assert!(started.elapsed() >= hold, "{key}");
    assert!(hold > options.lease(), "the run outlived its lease");
    assert_eq!(runs.load(Ordering::SeqCst), 1, "{key}: never taken over");
    assert_eq!(schema.effects_of(&admin, key).await, 1, "{key}");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn p5_repeatable_read_and_serializable_runs_longer_than_their_lease_complete_once() {
    let Some(schema) = PgSchema::create("p5_isolation_levels_short_lease").await else {
        return;
    };
    schema.create_effects().await;
    let owner = schema.store().await;
    let other = schema.builder().connect().await.unwrap();
    let lease = IdempotencyOptions::new().with_lease(Duration::from_millis(300));
    let hold = Duration::from_millis(1_500);
    // The level as an option of the run.
    for (key, level, name) in [
        ("rc", IsolationLevel::ReadCommitted, "read committed"),
        ("rr", IsolationLevel::RepeatableRead, "repeatable read"),
        ("sz", IsolationLevel::Serializable, "serializable"),
    ] {
        let transaction = TransactionOptions::new().with_isolation_level(level);
        let level_seen = owner
            .run_in_transaction_with(
                &format!("level:{key}"),
                IdempotencyOptions::new(),
                transaction,
                |tx| {
                    Box::pin(async move {
                        let level: String = tx
                            .query_one("SHOW transaction_isolation", &[])
                            .await?
                            .get(0);
                        Ok::<_, tokio_postgres::Error>(level)
                    })
                },
            )
            .await
            .unwrap();
        assert_eq!(level_seen.value(), name);
        a_long_run_completes_once(
            &schema,
            &owner,
            &other,
            key,
            lease.clone(),
            transaction,
            hold,
        )
        .await;
    }
    // The level from the session's default (`default_transaction_isolation`).
    for (key, level) in [
        ("session-rr", "repeatable%5C%20read"),
        ("session-sz", "serializable"),
    ] {
        let url = format!(
            "{}?options=-c%20default_transaction_isolation%3D{level}",
            schema.url()
        );
        let store = |url: &str| {
            PostgresStore::builder(url)
                .with_table(schema.table())
                .with_application_name(&schema.name)
                .connect()
        };
        let (owner, other) = (store(&url).await.unwrap(), store(&url).await.unwrap());
        assert_eq!(isolation_of(&owner).await, level.replace("%5C%20", " "));
        a_long_run_completes_once(
            &schema,
            &owner,
            &other,
            key,
            lease.clone(),
            TransactionOptions::new(),
            hold,
        )
        .await;
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn p5_a_serialization_failure_of_the_closures_own_statements_is_reported_and_retryable() {
    let Some(schema) = PgSchema::create("p5_serialization_failure").await else {
        return;
    };
    schema.create_effects().await;
    let store = schema.store().await;
    let admin = schema.client().await;
    admin
        .batch_execute(&format!(
            "INSERT INTO {} (key, value) VALUES ('balance', 100)",
            schema.effects()
        ))
        .await
        .unwrap();
    let (read_tx, read_rx) = oneshot::channel();
    let (go_tx, go_rx) = oneshot::channel::<()>();
    let effects = schema.effects();
    let serializable =
        TransactionOptions::new().with_isolation_level(IsolationLevel::RepeatableRead);
    let run = tokio::spawn({
        let store = store.clone();
        async move {
            store
                .run_in_transaction_with(
                    "pay:ser",
                    IdempotencyOptions::new(),
                    serializable,
                    move |tx| {
                        Box::pin(async move {
                            let balance: i64 = tx
                                .query_one(
                                    &format!("SELECT value FROM {effects} WHERE key = 'balance'"),
                                    &[],
                                )
                                .await?
                                .get(0);
                            let _ = read_tx.send(());
                            let _ = go_rx.await;
                            tx.execute(
                                &format!("UPDATE {effects} SET value = $1 WHERE key = 'balance'"),
                                &[&(balance - 10)],
                            )
                            .await?;
                            Ok::<_, tokio_postgres::Error>(balance - 10)
                        })
                    },
                )
                .await
        }
    });
    read_rx.await.unwrap();
    // A concurrent update commits after the run's snapshot: the run's own update fails.
    admin
        .batch_execute(&format!(
            "UPDATE {} SET value = 50 WHERE key = 'balance'",
            schema.effects()
        ))
        .await
        .unwrap();
    go_tx.send(()).unwrap();
    let failed = run.await.unwrap().unwrap_err();
    assert!(matches!(failed, Error::Failed { .. }), "{failed:?}");
    assert!(is_serialization_failure(&failed), "{failed:?}");
    // Released: the same call again runs, on the new balance.
    let effects = schema.effects();
    let retry = store
        .run_in_transaction_with("pay:ser", IdempotencyOptions::new(), serializable, move |tx| {
            Box::pin(async move {
                let row = tx
                    .query_one(
                        &format!(
                            "UPDATE {effects} SET value = value - 10 WHERE key = 'balance' RETURNING value"
                        ),
                        &[],
                    )
                    .await?;
                Ok::<_, tokio_postgres::Error>(row.get::<_, i64>(0))
            })
        })
        .await
        .unwrap();
    assert_eq!(retry, IdempotencyOutcome::Fresh(40));
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn p5_two_runs_longer_than_their_lease_on_a_pool_of_two_each_run_once() {
    let Some(schema) = PgSchema::create("p5_two_long_runs_pool_of_two").await else {
        return;
    };
    schema.create_effects().await;
    let owner = schema.builder().with_pool_size(2).connect().await.unwrap();
    owner.migrate().await.unwrap();
    let other = schema.builder().with_pool_size(2).connect().await.unwrap();
    let options = IdempotencyOptions::new().with_lease(Duration::from_millis(300));
    let hold = Duration::from_millis(1_500);
    let (a, b) = tokio::join!(
        a_long_run_completes_once(
            &schema,
            &owner,
            &other,
            "long:a",
            options.clone(),
            TransactionOptions::new(),
            hold
        ),
        a_long_run_completes_once(
            &schema,
            &owner,
            &other,
            "long:b",
            options.clone(),
            TransactionOptions::new(),
            hold
        ),
    );
    let ((), ()) = (a, b);
    let stats = owner.stats();
    assert_eq!(stats.transactions.takeovers, 0);
    assert_eq!(stats.transactions.committed, 2);
}

/// With every setting at its default: a 30 s lease, runs of 31 s at SERIALIZABLE (the
/// session's default) on a pool of 2, a duplicate of each waiting on another instance.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn p5_with_default_settings_two_serializable_runs_longer_than_the_lease_on_a_pool_of_two_each_run_once()
 {
    let Some(schema) = PgSchema::create("p5_defaults_long_runs").await else {
        return;
    };
    schema.create_effects().await;
    let url = format!(
        "{}?options=-c%20default_transaction_isolation%3Dserializable",
        schema.url()
    );
    let store = |url: &str| {
        PostgresStore::builder(url)
            .with_table(schema.table())
            .with_application_name(&schema.name)
            .with_pool_size(2)
            .connect()
    };
    let (owner, other) = (store(&url).await.unwrap(), store(&url).await.unwrap());
    owner.migrate().await.unwrap();
    let options = IdempotencyOptions::new();
    let hold = options.lease() + Duration::from_secs(1);
    let (a, b) = tokio::join!(
        a_long_run_completes_once(
            &schema,
            &owner,
            &other,
            "default:a",
            options.clone(),
            TransactionOptions::new(),
            hold
        ),
        a_long_run_completes_once(
            &schema,
            &owner,
            &other,
            "default:b",
            options.clone(),
            TransactionOptions::new(),
            hold
        ),
    );
    let ((), ()) = (a, b);
}

/// Set in the child process of the kill test: the schema its run writes in.
const HOLDER: &str = "THROTTLEBEAM_TEST_POSTGRES_HOLDER";

/// The child: a transactional run with default settings that writes its effect, says so,
/// and holds its transaction until it is killed.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn child_holds_a_transaction_until_killed() {
    let Ok(schema) = std::env::var(HOLDER) else {
        // Run by p6_a_killed_owner_process_lets_a_waiting_duplicate_run_within_a_second.
        return;
    };
    let store = PostgresStore::builder(&support::postgres::url())
        .with_table(format!("{schema}.idempotency"))
        .with_application_name(&schema)
        .connect()
        .await
        .unwrap();
    let outcome = store
        .run_in_transaction("pay:held", IdempotencyOptions::new(), move |tx| {
            Box::pin(async move {
                tx.execute(
                    &format!(
                        "INSERT INTO \"{schema}\".effects (key, value) VALUES ('pay:held', 1)"
                    ),
                    &[],
                )
                .await?;
                println!("{WRITTEN}");
                std::future::pending::<()>().await;
                Ok::<_, tokio_postgres::Error>(1_i64)
            })
        })
        .await;
    panic!("the child was not killed: {outcome:?}");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn p6_a_killed_owner_process_lets_a_waiting_duplicate_run_within_a_second() {
    if std::env::var_os(HOLDER).is_some() {
        return;
    }
    let Some(schema) = PgSchema::create("p6_owner_killed_takeover").await else {
        return;
    };
    schema.create_effects().await;
    let store = schema.store().await;
    let admin = schema.client().await;
    let mut child = Command::new(std::env::current_exe().unwrap())
        .args([
            "--exact",
            "child_holds_a_transaction_until_killed",
            "--nocapture",
            "--test-threads",
            "1",
        ])
        .env(HOLDER, &schema.name)
        .stdout(Stdio::piped())
        .stderr(Stdio::null())
        .spawn()
        .unwrap();
    let stdout = child.stdout.take().unwrap();
    let written = tokio::task::spawn_blocking(move || {
        BufReader::new(stdout)
            .lines()
            .map_while(Result::ok)
            .any(|line| line.contains(WRITTEN))
    });
    let written = tokio::time::timeout(Duration::from_secs(60), written).await;
    if !matches!(written, Ok(Ok(true))) {
        child.kill().unwrap();
        child.wait().unwrap();
        panic!("the child never wrote its effect");
    }
    // A duplicate waits for the child's run (default settings: a 30 s lease and wait).
    let runs = Arc::new(AtomicU32::new(0));
    let waiter = tokio::spawn({
        let (store, effects, runs) = (store.clone(), schema.effects(), Arc::clone(&runs));
        async move {
            let outcome = store
                .run_in_transaction(
                    "pay:held",
                    IdempotencyOptions::new(),
                    effect(effects, "pay:held", 2, &runs),
                )
                .await;
            (outcome, Instant::now())
        }
    });
    // The child's claim is held by its transaction alone: its grace is over.
    while admin
        .query_opt(
            &format!(
                "SELECT 1 FROM {} WHERE key = '-pay:held'::bytea AND expires_at <= clock_timestamp()",
                schema.table()
            ),
            &[],
        )
        .await
        .unwrap()
        .is_none()
    {
        tokio::task::yield_now().await;
    }
    assert!(
        !waiter.is_finished(),
        "the duplicate waits for the live run"
    );
    assert_eq!(runs.load(Ordering::SeqCst), 0);
    // kill -9 of the owner, mid-transaction.
    child.kill().unwrap();
    let killed = Instant::now();
    child.wait().unwrap();
    let (outcome, at) = waiter.await.unwrap();
    assert_eq!(outcome.unwrap(), IdempotencyOutcome::Fresh(2));
    let took = at - killed;
    println!("the duplicate ran {took:?} after the owner was killed");
    assert!(took < Duration::from_millis(1_500), "{took:?}");
    assert_eq!(runs.load(Ordering::SeqCst), 1);
    assert_eq!(
        schema.effects_of(&admin, "pay:held").await,
        1,
        "only the duplicate's"
    );
    assert_eq!(store.stats().transactions.takeovers, 1);
}
