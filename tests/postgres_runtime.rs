//! Runtimes sharing PostgreSQL, as instances behind a load balancer would
//! (SCENARIOS I, S8, S12, P3): one execution per key across instances,
//! duplicates waiting for another instance's run (woken by its `NOTIFY`)
//! or failing fast, takeover of a dead owner's key after its lease, and the
//! default runtime configured from the environment.
#![cfg(feature = "postgres")]

mod support;

use std::process::Command;
use std::sync::Arc;
use std::sync::atomic::{AtomicU32, Ordering};
use std::time::Duration;

use support::postgres::{PgSchema, Proxy};
use support::{Oops, Runs};
use throttlebeam::idempotency::postgres::{
    POSTGRES_URL_ENV, PostgresBuilder, PostgresStore, tokio_postgres,
};
use throttlebeam::store::BreakerConfig;
use throttlebeam::{
    Error, Idempotency, IdempotencyOptions, IdempotencyOutcome, Runtime,
    idempotency::IdempotencyReserved, idempotency::InFlight, idempotency::NotRecorded,
};
use tokio::sync::Semaphore;
use tokio::time::Instant;

/// One "instance": its own pool, listener and runtime.
async fn instance(schema: &PgSchema) -> (Runtime, PostgresStore) {
    let breaker = BreakerConfig::default().with_cooldown(Duration::from_millis(200));
    instance_with(schema.builder().with_breaker(breaker)).await
}

/// An instance from `builder` (pool of 8, 10 s command timeout).
async fn instance_with(builder: PostgresBuilder) -> (Runtime, PostgresStore) {
    let store = builder
        .with_pool_size(8)
        .with_command_timeout(Duration::from_secs(10))
        .connect()
        .await
        .expect("connects");
    store.migrate().await.expect("migrates");
    let runtime = Runtime::builder()
        .with_postgres(store.clone())
        .start()
        .await
        .expect("runtime starts");
    (runtime, store)
}

fn counted(
    runs: &Runs,
    value: u64,
) -> impl FnOnce() -> std::future::Ready<Result<u64, Oops>> + Send + use<> {
    let runs = runs.clone();
    move || {
        runs.hit();
        std::future::ready(Ok(value))
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn s12_duplicates_on_one_instance_share_one_claim_and_a_replay_is_one_statement() {
    let Some(schema) = PgSchema::create("s12_duplicates_share_one_claim").await else {
        return;
    };
    let (rt, store) = instance(&schema).await;
    let runs = Runs::default();
    let before = store.stats().statements;
    let calls: Vec<_> = (0..8)
        .map(|_| {
            let (rt, runs) = (rt.clone(), runs.clone());
            tokio::spawn(async move {
                rt.idempotency()
                    .run("job:1", move || async move {
                        runs.hit();
                        tokio::time::sleep(Duration::from_millis(20)).await;
                        Ok::<_, Oops>(5_u64)
                    })
                    .await
                    .unwrap()
            })
        })
        .collect();
    let mut fresh = 0;
    for call in calls {
        let outcome = call.await.unwrap();
        assert_eq!(*outcome.value(), 5);
        fresh += usize::from(outcome.is_fresh());
    }
    assert_eq!(
        (fresh, runs.get()),
        (1, 1),
        "I2: one run, the others replay"
    );
    assert_eq!(
        store.stats().statements - before,
        2,
        "one claim and one completion"
    );
    let before = store.stats().statements;
    let replay = rt
        .idempotency()
        .run("job:1", counted(&runs, 6))
        .await
        .unwrap();
    assert_eq!(replay, IdempotencyOutcome::Replay(5), "I1");
    assert_eq!(
        store.stats().statements - before,
        1,
        "a replay is one statement"
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn i3_i4_i5_i11_timeouts_fingerprints_failures_and_fail_fast_across_instances() {
    let Some(schema) = PgSchema::create("i3_i4_i5_i11_across_instances").await else {
        return;
    };
    let (a, _) = instance(&schema).await;
    let (b, _) = instance(&schema).await;
    let runs = Runs::default();
    // I3: a duplicate elsewhere waits its wait timeout; the first run goes on
    // and stores its result.
    let first = tokio::spawn({
        let (a, runs) = (a.clone(), runs.clone());
        async move {
            a.idempotency()
                .run("slow:1", move || async move {
                    runs.hit();
                    tokio::time::sleep(Duration::from_millis(800)).await;
                    Ok::<_, Oops>(1_u64)
                })
                .await
        }
    });
    tokio::time::sleep(Duration::from_millis(200)).await;
    let short = IdempotencyOptions::new().with_wait_timeout(Duration::from_millis(200));
    let waited = b
        .idempotency()
        .run_with("slow:1", short, counted(&runs, 2))
        .await;
    assert!(matches!(waited, Err(Error::Timeout { .. })), "{waited:?}");
    // I11: fail fast, with a retry hint.
    let reject = IdempotencyOptions::new().with_in_flight(InFlight::Reject);
    match b
        .idempotency()
        .run_with("slow:1", reject, counted(&runs, 3))
        .await
    {
        Err(Error::InFlight { retry_after, .. }) => {
            assert!(retry_after > Duration::ZERO && retry_after <= Duration::from_secs(1));
        }
        other => panic!("{other:?}"),
    }
    assert_eq!(first.await.unwrap().unwrap(), IdempotencyOutcome::Fresh(1));
    let replay = b
        .idempotency()
        .run("slow:1", counted(&runs, 4))
        .await
        .unwrap();
    assert_eq!(replay, IdempotencyOutcome::Replay(1));
    assert_eq!(runs.get(), 1);

    // I4: another fingerprint is refused; another scope is another key.
    let fp = |f: &str| IdempotencyOptions::new().with_fingerprint(f);
    let paid = a
        .idempotency()
        .run_with("pay:1", fp("10 EUR"), counted(&runs, 10))
        .await;
    assert_eq!(paid.unwrap(), IdempotencyOutcome::Fresh(10));
    let other = b
        .idempotency()
        .run_with("pay:1", fp("11 EUR"), counted(&runs, 11))
        .await;
    assert!(
        matches!(other, Err(Error::FingerprintMismatch { .. })),
        "{other:?}"
    );
    let scoped = b
        .idempotency()
        .run_with(
            "pay:1",
            fp("11 EUR").with_scope("tenant-2"),
            counted(&runs, 12),
        )
        .await;
    assert_eq!(scoped.unwrap(), IdempotencyOutcome::Fresh(12));
    assert_eq!(runs.get(), 3);

    // I5: a failure releases the key: a duplicate waiting elsewhere takes over.
    let failing = tokio::spawn({
        let a = a.clone();
        async move {
            a.idempotency()
                .run("flaky:1", || async {
                    tokio::time::sleep(Duration::from_millis(300)).await;
                    Err::<u64, _>(Oops("card declined"))
                })
                .await
        }
    });
    tokio::time::sleep(Duration::from_millis(100)).await;
    let started = Instant::now();
    let taken = b
        .idempotency()
        .run("flaky:1", counted(&runs, 20))
        .await
        .unwrap();
    assert_eq!(taken, IdempotencyOutcome::Fresh(20));
    assert!(
        started.elapsed() < Duration::from_secs(2),
        "woken by the release's notice"
    );
    assert!(matches!(failing.await.unwrap(), Err(Error::Failed { .. })));
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn i6_s8_an_owner_instance_that_dies_is_taken_over_once_after_its_lease_and_its_late_completion_is_refused()
 {
    let Some(schema) = PgSchema::create("i6_s8_owner_instance_dies").await else {
        return;
    };
    let lease = Duration::from_millis(800);
    let options = IdempotencyOptions::new()
        .with_lease(lease)
        .with_wait_timeout(Duration::from_secs(10));
    // The owner lives on a tokio runtime of its own, which dies mid-run:
    // its renewals stop, as when a process crashes.
    let (tx, rx) = tokio::sync::oneshot::channel();
    let owner_schema_table = schema.table();
    let owner_name = schema.name.clone();
    let opts = options.clone();
    let owner_thread = std::thread::spawn(move || {
        let tokio_rt = tokio::runtime::Builder::new_multi_thread()
            .worker_threads(1)
            .enable_all()
            .build()
            .unwrap();
        tokio_rt.block_on(async move {
            let store = PostgresStore::builder(&support::postgres::url())
                .with_table(owner_schema_table)
                .with_application_name(owner_name)
                .connect()
                .await
                .unwrap();
            store.migrate().await.unwrap();
            let rt = Runtime::builder()
                .with_postgres(store)
                .start()
                .await
                .unwrap();
            let reserved = rt
                .idempotency()
                .reserve::<u64>("charge:1", opts)
                .await
                .expect("the owner reserves");
            let IdempotencyReserved::Fresh(reservation) = reserved else {
                panic!("a fresh key is reserved")
            };
            tx.send((reservation, Instant::now())).unwrap();
            std::mem::forget(rt);
        });
        tokio_rt.shutdown_background();
    });
    let (reservation, claimed_at) = rx.await.unwrap();
    owner_thread.join().unwrap();
    let mut runtimes = Vec::new();
    for _ in 0..3 {
        runtimes.push(instance(&schema).await.0);
    }
    let runs = Arc::new(AtomicU32::new(0));
    let mut calls = Vec::new();
    for i in 0..9 {
        let rt = runtimes[i % 3].clone();
        let (runs, options) = (Arc::clone(&runs), options.clone());
        calls.push(tokio::spawn(async move {
            let outcome = rt
                .idempotency()
                .run_with("charge:1", options, move || async move {
                    runs.fetch_add(1, Ordering::SeqCst);
                    Ok::<_, Oops>(77_u64)
                })
                .await
                .expect("a duplicate gets the value");
            (outcome, Instant::now())
        }));
    }
    let mut fresh = 0;
    for call in calls {
        let (outcome, at) = call.await.unwrap();
        assert_eq!(*outcome.value(), 77);
        assert!(
            at >= claimed_at + lease - Duration::from_millis(50),
            "no takeover before the lease (on the server's clock)"
        );
        fresh += usize::from(outcome.is_fresh());
    }
    assert_eq!(fresh, 1, "exactly one takeover");
    assert_eq!(runs.load(Ordering::SeqCst), 1);
    let late = reservation.complete(1).await;
    assert!(
        matches!(
            late,
            Err(Error::NotRecorded {
                reason: NotRecorded::LeaseLost,
                ..
            })
        ),
        "{late:?}"
    );
    let replay = runtimes[0]
        .idempotency()
        .run_with("charge:1", options, || async { Ok::<_, Oops>(0_u64) })
        .await
        .unwrap();
    assert_eq!(replay, IdempotencyOutcome::Replay(77));
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn i7_i8_reservations_and_ttls_across_instances() {
    let Some(schema) = PgSchema::create("i7_i8_reservations_and_ttls").await else {
        return;
    };
    let (a, _) = instance(&schema).await;
    let (b, _) = instance(&schema).await;
    let runs = Runs::default();
    // I8: reserve and complete on one instance, replay on the other.
    let IdempotencyReserved::Fresh(reservation) = a
        .idempotency()
        .reserve::<u64>("order:1", IdempotencyOptions::new())
        .await
        .unwrap()
    else {
        panic!("fresh")
    };
    let waiter = tokio::spawn({
        let b = b.clone();
        let runs = runs.clone();
        async move { b.idempotency().run("order:1", counted(&runs, 2)).await }
    });
    tokio::time::sleep(Duration::from_millis(200)).await;
    reservation.complete(1).await.unwrap();
    assert_eq!(
        waiter.await.unwrap().unwrap(),
        IdempotencyOutcome::Replay(1)
    );
    // A released reservation, and a dropped one, let the next run execute.
    for drop_it in [false, true] {
        let key = format!("order:release:{drop_it}");
        let IdempotencyReserved::Fresh(reservation) = a
            .idempotency()
            .reserve::<u64>(&key, IdempotencyOptions::new())
            .await
            .unwrap()
        else {
            panic!("fresh")
        };
        if drop_it {
            drop(reservation);
        } else {
            reservation.release().await;
        }
        let next = b
            .idempotency()
            .run_with(
                &key,
                IdempotencyOptions::new().with_wait_timeout(Duration::from_secs(5)),
                counted(&runs, 3),
            )
            .await;
        assert_eq!(next.unwrap(), IdempotencyOutcome::Fresh(3), "{key}");
    }
    // I7: past its TTL (on the server's clock) the key runs again.
    let ttl = IdempotencyOptions::new().with_ttl(Duration::from_millis(300));
    let first = a
        .idempotency()
        .run_with("ttl:1", ttl.clone(), counted(&runs, 5))
        .await;
    assert_eq!(first.unwrap(), IdempotencyOutcome::Fresh(5));
    let within = b
        .idempotency()
        .run_with("ttl:1", ttl.clone(), counted(&runs, 6))
        .await;
    assert_eq!(within.unwrap(), IdempotencyOutcome::Replay(5));
    tokio::time::sleep(Duration::from_millis(400)).await;
    let after = b
        .idempotency()
        .run_with("ttl:1", ttl, counted(&runs, 7))
        .await;
    assert_eq!(after.unwrap(), IdempotencyOutcome::Fresh(7));
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn s7_with_postgres_unreachable_idempotency_fails_closed_and_runs_nothing() {
    let store = PostgresStore::builder("postgres://postgres@127.0.0.1:1/test")
        .with_connect_timeout(Duration::from_millis(200))
        .with_command_timeout(Duration::from_millis(500))
        .connect_in_background()
        .unwrap();
    let rt = Runtime::builder()
        .with_postgres(store)
        .start()
        .await
        .unwrap();
    let runs = Runs::default();
    for _ in 0..4 {
        let started = Instant::now();
        let outcome = rt.idempotency().run("pay:down", counted(&runs, 1)).await;
        assert!(
            matches!(outcome, Err(Error::StoreUnavailable { .. })),
            "{outcome:?}"
        );
        assert!(started.elapsed() < Duration::from_secs(2));
    }
    assert_eq!(runs.get(), 0, "nothing runs without the store");
}

/// Writes one row into the effects table per execution: what "one committed
/// effect per key" counts.
async fn effects_client(schema: &PgSchema) -> Arc<tokio_postgres::Client> {
    Arc::new(schema.client().await)
}

/// 4 runtimes × `keys` keys × 4 duplicates; each execution inserts its
/// effect (autocommit, through a connection of the test's own). Calls that
/// fail with the store are retried until they answer. `mid_flood` runs once
/// a quarter of the keys ran.
async fn flood(
    schema: &PgSchema,
    keys: usize,
    builder: impl Fn() -> PostgresBuilder,
    lease: Duration,
    mid_flood: impl Future<Output = ()>,
) -> (Arc<Vec<AtomicU32>>, u32) {
    let mut runtimes = Vec::new();
    let mut effects = Vec::new();
    for _ in 0..4 {
        runtimes.push(instance_with(builder()).await.0);
        effects.push(effects_client(schema).await);
    }
    let runs: Arc<Vec<AtomicU32>> = Arc::new((0..keys).map(|_| AtomicU32::new(0)).collect());
    let failures = Arc::new(AtomicU32::new(0));
    let gate = Arc::new(Semaphore::new(128));
    let give_up = Instant::now() + Duration::from_secs(240);
    let table = schema.effects();
    let mut calls = tokio::task::JoinSet::new();
    for k in 0..keys {
        for d in 0..4 {
            let rt = runtimes[(k + d) % 4].clone();
            let client = Arc::clone(&effects[(k + d) % 4]);
            let (runs, failures, gate) =
                (Arc::clone(&runs), Arc::clone(&failures), Arc::clone(&gate));
            let insert = format!("INSERT INTO {table} (key, value) VALUES ($1, $2)");
            calls.spawn(async move {
                let _permit = gate.acquire_owned().await.unwrap();
                let options = IdempotencyOptions::new()
                    .with_lease(lease)
                    .with_wait_timeout(Duration::from_secs(20));
                let key = format!("pay:{k}");
                loop {
                    let (runs, client, insert, key2) = (
                        Arc::clone(&runs),
                        Arc::clone(&client),
                        insert.clone(),
                        key.clone(),
                    );
                    let outcome = rt
                        .idempotency()
                        .run_with(&key, options.clone(), move || async move {
                            runs[k].fetch_add(1, Ordering::SeqCst);
                            client.execute(&insert, &[&key2, &(k as i64)]).await?;
                            Ok::<_, tokio_postgres::Error>(k as u64)
                        })
                        .await;
                    match outcome {
                        Ok(outcome) => {
                            assert_eq!(*outcome.value(), k as u64, "key {k}: its own value");
                            return;
                        }
                        Err(Error::StoreUnavailable { .. } | Error::Timeout { .. }) => {
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
        let ran = || runs.iter().filter(|r| r.load(Ordering::SeqCst) > 0).count();
        while ran() < keys / 4 {
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
    (runs, failures.load(Ordering::Relaxed))
}

async fn assert_once_each(schema: &PgSchema, runs: &[AtomicU32]) {
    let twice: Vec<(usize, u32)> = runs
        .iter()
        .enumerate()
        .map(|(k, r)| (k, r.load(Ordering::SeqCst)))
        .filter(|(_, n)| *n != 1)
        .collect();
    assert!(
        twice.is_empty(),
        "keys not run exactly once (key, runs): {twice:?}"
    );
    let admin = schema.client().await;
    let counts = admin
        .query_one(
            &format!(
                "SELECT count(DISTINCT key), count(*) FROM {}",
                schema.effects()
            ),
            &[],
        )
        .await
        .unwrap();
    let (keys, rows): (i64, i64) = (counts.get(0), counts.get(1));
    assert_eq!(
        (keys, rows),
        (runs.len() as i64, runs.len() as i64),
        "one committed effect per key"
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn p3_four_runtimes_2000_keys_4_duplicates_run_and_commit_each_key_once() {
    let Some(schema) = PgSchema::create("p3_runtime_flood").await else {
        return;
    };
    schema.create_effects().await;
    let started = Instant::now();
    let breaker = BreakerConfig::default().with_cooldown(Duration::from_millis(200));
    let builder = || schema.builder().with_breaker(breaker);
    let (runs, failures) = flood(&schema, 2_000, builder, Duration::from_secs(3), async {}).await;
    assert_eq!(failures, 0);
    assert_once_each(&schema, &runs).await;
    println!(
        "8,000 calls on 2,000 keys over 4 runtimes in {:?}",
        started.elapsed()
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn s14_every_backend_killed_mid_flood_runs_no_key_twice_and_every_key_completes_on_retry() {
    let Some(schema) = PgSchema::create("s14_backends_killed_mid_flood").await else {
        return;
    };
    schema.create_effects().await;
    let killed = Arc::new(AtomicU32::new(0));
    let break_pools = {
        let (schema, killed) = (&schema, Arc::clone(&killed));
        async move {
            for _ in 0..2 {
                let n = schema.terminate_all().await;
                killed.fetch_add(u32::try_from(n).unwrap_or(u32::MAX), Ordering::SeqCst);
                tokio::time::sleep(Duration::from_millis(100)).await;
            }
        }
    };
    let breaker = BreakerConfig::default().with_cooldown(Duration::from_millis(200));
    let builder = || schema.builder().with_breaker(breaker);
    let lease = Duration::from_secs(3);
    let (runs, failures) = flood(&schema, 2_000, builder, lease, break_pools).await;
    println!(
        "killed {} backends mid-flood; {failures} calls failed and were retried",
        killed.load(Ordering::SeqCst)
    );
    assert!(killed.load(Ordering::SeqCst) > 0);
    assert_once_each(&schema, &runs).await;
}

/// S14 on PostgreSQL: with the default breaker (5 failures open it for
/// 10 s) and a 5 s lease, the server unreachable for 2 s in the middle of a
/// flood from four instances (every connection cut, new ones refused, as
/// when a server restarts; here through a forwarder the test cuts, the
/// machine's server stays up) makes no key run twice: owners whose
/// function ran keep renewing and retrying their completion through the
/// open breaker until stored.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn s14_the_server_unreachable_for_two_seconds_mid_flood_runs_no_key_twice_with_the_default_breaker()
 {
    let Some(schema) = PgSchema::create("s14_server_unreachable_mid_flood").await else {
        return;
    };
    schema.create_effects().await;
    let port = Proxy::free_port();
    let proxy = std::sync::Mutex::new(Some(Proxy::start(port).await));
    let url = support::postgres::url().replace(":5432", &format!(":{port}"));
    let builder = || {
        PostgresStore::builder(&url)
            .with_table(schema.table())
            .with_application_name(&schema.name)
            .with_connect_timeout(Duration::from_millis(500))
    };
    let outage = async {
        drop(proxy.lock().unwrap().take());
        tokio::time::sleep(Duration::from_secs(2)).await;
        *proxy.lock().unwrap() = Some(Proxy::start(port).await);
    };
    let (runs, failures) = flood(&schema, 2_000, builder, Duration::from_secs(5), outage).await;
    println!("{failures} calls saw the outage and were retried");
    assert!(failures > 0, "the outage was seen");
    assert_once_each(&schema, &runs).await;
}

/// Set in the process that runs the default runtime's test: the schema its
/// PostgreSQL URL puts first on the `search_path`.
const CHILD: &str = "THROTTLEBEAM_TEST_POSTGRES_DEFAULT_RUNTIME";

/// The default runtime is process-global and reads its environment once:
/// its test runs in a process of its own (this test binary again, running
/// [`default_runtime_in_a_process_of_its_own`] only) with
/// `THROTTLEBEAM_POSTGRES_URL` naming the test's schema.
#[tokio::test]
async fn the_default_runtime_shares_through_the_postgres_its_environment_names() {
    if std::env::var_os(CHILD).is_some() {
        return;
    }
    let Some(schema) = PgSchema::create("the_default_runtime_shares_through_postgres").await else {
        return;
    };
    let test = "default_runtime_in_a_process_of_its_own";
    let url = format!(
        "{}?application_name={}&options=-c%20search_path%3D{}",
        support::postgres::url(),
        schema.name,
        schema.name
    );
    let out = tokio::task::spawn_blocking(move || {
        Command::new(std::env::current_exe().unwrap())
            .args(["--exact", test, "--nocapture", "--test-threads", "1"])
            .env(CHILD, "1")
            .env(POSTGRES_URL_ENV, url)
            .output()
            .unwrap()
    })
    .await
    .unwrap();
    let (stdout, stderr) = (
        String::from_utf8_lossy(&out.stdout),
        String::from_utf8_lossy(&out.stderr),
    );
    assert!(
        out.status.success(),
        "the default runtime's test failed:\n{stdout}\n{stderr}"
    );
    assert!(
        stdout.contains("the default runtime shares through PostgreSQL"),
        "the default runtime's test did not run:\n{stdout}\n{stderr}"
    );
    // It migrated the table into the schema its URL named, and stored there.
    let admin = schema.client().await;
    let stored: i64 = admin
        .query_one(
            &format!(
                "SELECT count(*) FROM \"{}\".throttlebeam_idempotency WHERE done",
                schema.name
            ),
            &[],
        )
        .await
        .unwrap()
        .get(0);
    assert_eq!(stored, 1);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn default_runtime_in_a_process_of_its_own() {
    if std::env::var_os(CHILD).is_none() {
        // Run by the_default_runtime_shares_through_the_postgres_its_environment_names.
        return;
    }
    let started = std::time::Instant::now();
    let _ = Runtime::global().expect("the default runtime starts");
    let took = started.elapsed();
    assert!(
        took < Duration::from_millis(900),
        "Runtime::global() took {took:?}: it waited"
    );
    let runs = Runs::default();
    // Connecting and migrating happen in the background: until then calls
    // fail closed; then they share through PostgreSQL.
    let deadline = Instant::now() + Duration::from_secs(30);
    let fresh = loop {
        match Idempotency::run("env:1", counted(&runs, 1)).await {
            Ok(outcome) => break outcome,
            Err(Error::StoreUnavailable { .. }) if Instant::now() < deadline => {
                tokio::time::sleep(Duration::from_millis(50)).await;
            }
            Err(e) => panic!("{e:?}"),
        }
    };
    assert_eq!(fresh, IdempotencyOutcome::Fresh(1));
    let url = std::env::var(POSTGRES_URL_ENV).unwrap();
    let other = PostgresStore::builder(&url).connect().await.unwrap();
    let rt = Runtime::builder()
        .with_postgres(other)
        .start()
        .await
        .unwrap();
    let replay = rt
        .idempotency()
        .run("env:1", counted(&runs, 2))
        .await
        .unwrap();
    assert_eq!(replay, IdempotencyOutcome::Replay(1));
    assert_eq!(runs.get(), 1);
    println!("the default runtime shares through PostgreSQL");
}
