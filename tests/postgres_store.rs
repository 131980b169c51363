//! The PostgreSQL idempotency store on the machine's server (SCENARIOS P1):
//! the store contract that memory and Redis keep, and what is particular to
//! PostgreSQL: the migration, the envelope in the table, leases on the
//! server's clock, `LISTEN`/`NOTIFY` wake-ups and their listener's restart,
//! and expiry swept in bounded batches.
#![cfg(feature = "postgres")]

mod support;

use std::sync::Arc;
use std::time::Duration;

use support::contract::{LEASE, TTL, contract, request};
use support::postgres::{PgSchema, Proxy};
use throttlebeam::idempotency::postgres::PostgresStore;
use throttlebeam::store::StoreError;
use throttlebeam::{
    idempotency::ClaimReply, idempotency::ClaimRequest, idempotency::ClaimToken,
    idempotency::IdempotencyStore, idempotency::StoredResult,
};

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn p1_postgres_keeps_the_store_contract() {
    let Some(schema) = PgSchema::create("p1_postgres_keeps_the_store_contract").await else {
        return;
    };
    let store = schema.store().await;
    contract(Arc::new(store.clone()), "pg").await;
    let stats = store.stats();
    assert!(stats.connected && stats.statements > 0, "{stats:?}");
}

#[tokio::test]
async fn migrating_twice_changes_nothing_and_an_unmigrated_table_is_a_config_error() {
    let Some(schema) = PgSchema::create("migrating_twice_changes_nothing").await else {
        return;
    };
    let store = schema.builder().connect().await.expect("connects");
    let request = || request(ClaimToken::new(), None, LEASE);
    let e = store.claim("k", request()).await.unwrap_err();
    assert!(matches!(e, StoreError::Config(_)), "{e:?}");
    assert!(e.to_string().contains("PostgresStore::migrate"), "{e}");
    assert!(
        !e.is_store_fault(),
        "a missing table does not trip the breaker"
    );
    // Migrations racing each other and repeated: one table, every claim works.
    let (a, b) = tokio::join!(store.migrate(), store.migrate());
    a.unwrap();
    b.unwrap();
    store.migrate().await.unwrap();
    assert!(matches!(
        store.claim("k", request()).await.unwrap(),
        ClaimReply::Won { .. }
    ));
    assert!(
        store
            .migration_sql()
            .contains(&format!("\"{}\".\"idempotency\"", schema.name))
    );
    assert_eq!(store.table(), schema.table());
}

#[tokio::test]
async fn a_result_is_stored_in_the_versioned_envelope_with_its_type_tag() {
    let Some(schema) = PgSchema::create("a_result_is_stored_in_the_versioned_envelope").await
    else {
        return;
    };
    let store = schema.store().await;
    let runtime = throttlebeam::Runtime::builder()
        .with_postgres(store.clone())
        .start()
        .await
        .unwrap();
    let value = runtime
        .idempotency()
        .run("env:1", || async {
            Ok::<_, std::io::Error>(vec![7_u32, 8])
        })
        .await
        .unwrap();
    assert!(value.is_fresh());
    let admin = schema.client().await;
    let row = admin
        .query_one(
            &format!(
                "SELECT done, type_tag, value, fence, expires_at > now() + interval '23 hours' \
                   FROM {} WHERE key = $1",
                schema.table()
            ),
            &[&b"-env:1".as_slice()],
        )
        .await
        .unwrap();
    assert!(row.get::<_, bool>(0));
    assert_eq!(row.get::<_, String>(1), std::any::type_name::<Vec<u32>>());
    let bytes: Vec<u8> = row.get(2);
    assert_eq!(&bytes[..3], b"tb\x02", "the envelope: magic and version 2");
    assert!(row.get::<_, i64>(3) >= 1);
    assert!(
        row.get::<_, bool>(4),
        "the 24 h default TTL, on the server's clock"
    );
    // A value in a format version this build cannot read is refused, not misread.
    admin
        .execute(
            &format!(
                "UPDATE {} SET value = '\\x746203'::bytea WHERE key = $1",
                schema.table()
            ),
            &[&b"-env:1".as_slice()],
        )
        .await
        .unwrap();
    let refused = runtime
        .idempotency()
        .run("env:1", || async { Ok::<_, std::io::Error>(vec![0_u32]) })
        .await
        .unwrap_err();
    let throttlebeam::Error::StoreUnavailable { source, .. } = &refused else {
        panic!("{refused:?}")
    };
    assert!(source.to_string().contains("format version 3"), "{source}");
}

#[tokio::test]
async fn leases_and_ttls_run_on_the_servers_clock_and_expired_rows_are_never_replayed() {
    let Some(schema) = PgSchema::create("leases_and_ttls_run_on_the_servers_clock").await else {
        return;
    };
    let store = schema.store().await;
    let owner = ClaimToken::new();
    let lease = Duration::from_millis(400);
    let ClaimReply::Won { .. } = store
        .claim("k", ClaimRequest::new(owner, None, lease, TTL))
        .await
        .unwrap()
    else {
        panic!("won")
    };
    let admin = schema.client().await;
    let left_ms: f64 = admin
        .query_one(
            &format!(
                "SELECT extract(epoch FROM expires_at - clock_timestamp())::float8 * 1000 FROM {} \
                 WHERE key = 'k'::bytea",
                schema.table()
            ),
            &[],
        )
        .await
        .unwrap()
        .get(0);
    assert!(left_ms > 0.0 && left_ms <= 400.0, "{left_ms}");
    let ClaimReply::Busy { lease_left } = store
        .claim("k", request(ClaimToken::new(), None, LEASE))
        .await
        .unwrap()
    else {
        panic!("busy")
    };
    assert!(
        lease_left <= lease && lease_left > Duration::ZERO,
        "{lease_left:?}"
    );
    // A short TTL: replayed within it, never after, swept or not.
    let result = StoredResult::new(None, "u8", vec![1]);
    assert!(
        store
            .complete("k", owner, &result, Duration::from_millis(300))
            .await
            .unwrap()
    );
    assert_eq!(
        store
            .claim("k", request(ClaimToken::new(), None, LEASE))
            .await
            .unwrap(),
        ClaimReply::Completed(result)
    );
    tokio::time::sleep(Duration::from_millis(450)).await;
    assert!(
        matches!(
            store
                .claim("k", request(ClaimToken::new(), None, LEASE))
                .await
                .unwrap(),
            ClaimReply::Won { .. }
        ),
        "an expired result is not replayed: the key is claimed again"
    );
}

#[tokio::test]
async fn expired_rows_are_swept_in_bounded_batches() {
    let Some(schema) = PgSchema::create("expired_rows_are_swept_in_bounded_batches").await else {
        return;
    };
    let store = schema
        .builder()
        .with_sweep_batch(100)
        .connect()
        .await
        .unwrap();
    store.migrate().await.unwrap();
    let admin = schema.client().await;
    let t = schema.table();
    // 250 expired rows, 10 live ones.
    admin
        .batch_execute(&format!(
            "INSERT INTO {t} (key, done, token, fence, expires_at) \
             SELECT convert_to('old:' || i, 'UTF8'), true, '\\x00', i, clock_timestamp() - interval '1 minute' \
               FROM generate_series(1, 250) AS i; \
             INSERT INTO {t} (key, done, token, fence, expires_at) \
             SELECT convert_to('live:' || i, 'UTF8'), true, '\\x00', i, clock_timestamp() + interval '1 hour' \
               FROM generate_series(1, 10) AS i;"
        ))
        .await
        .unwrap();
    let before = store.stats().statements;
    assert_eq!(store.sweep().await.unwrap(), 250);
    assert_eq!(
        store.stats().statements - before,
        3,
        "three statements of at most 100 rows each"
    );
    assert_eq!(store.stats().swept, 250);
    let left: i64 = admin
        .query_one(&format!("SELECT count(*) FROM {t}"), &[])
        .await
        .unwrap()
        .get(0);
    assert_eq!(left, 10, "live rows stay");
    assert_eq!(store.sweep().await.unwrap(), 0);
}

#[tokio::test]
async fn the_sweeper_runs_by_itself_every_interval() {
    let Some(schema) = PgSchema::create("the_sweeper_runs_by_itself").await else {
        return;
    };
    let store = schema
        .builder()
        .with_sweep_interval(Duration::from_millis(200))
        .connect()
        .await
        .unwrap();
    store.migrate().await.unwrap();
    let owner = ClaimToken::new();
    let short = Duration::from_millis(50);
    // A claim starts the sweeper; its result's TTL ends.
    store
        .claim("expiring", ClaimRequest::new(owner, None, LEASE, short))
        .await
        .unwrap();
    let result = StoredResult::new(None, "t", b"v".to_vec());
    assert!(
        store
            .complete("expiring", owner, &result, short)
            .await
            .unwrap()
    );
    // A claim released, and one lapsed: kept as their keys' fences (a day), free all along.
    for key in ["released", "lapsed"] {
        let owner = ClaimToken::new();
        store
            .claim(key, ClaimRequest::new(owner, None, short, short))
            .await
            .unwrap();
        if key == "released" {
            assert!(store.release(key, owner).await.unwrap());
        }
    }
    let deadline = tokio::time::Instant::now() + Duration::from_secs(10);
    while store.stats().swept == 0 {
        assert!(tokio::time::Instant::now() < deadline, "never swept");
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
    // Two more sweeps at least, past both claims' leases.
    let swept_at = store.stats().statements;
    while store.stats().statements < swept_at + 2 {
        assert!(
            tokio::time::Instant::now() < deadline,
            "the sweeper stopped"
        );
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
    assert_eq!(store.stats().swept, 1, "only the expired result");
    let kept: i64 = schema
        .client()
        .await
        .query_one(
            &format!("SELECT count(*) FROM {} WHERE NOT done", schema.table()),
            &[],
        )
        .await
        .unwrap()
        .get(0);
    assert_eq!(kept, 2, "claims without a result stay as fences");
    for key in ["released", "lapsed"] {
        assert!(matches!(
            store
                .claim(
                    key,
                    ClaimRequest::new(ClaimToken::new(), None, LEASE, LEASE)
                )
                .await
                .unwrap(),
            ClaimReply::Won { .. }
        ));
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_watcher_wakes_on_the_notice_and_the_listener_comes_back_after_its_backend_is_killed() {
    let Some(schema) = PgSchema::create("a_watcher_wakes_on_the_notice").await else {
        return;
    };
    let owner_store = schema.store().await;
    // Another instance: its own pool and listener.
    let waiter_store = schema.builder().connect().await.unwrap();
    for round in 0..2_u64 {
        let key = format!("wake:{round}");
        let owner = ClaimToken::new();
        assert!(matches!(
            owner_store
                .claim(&key, request(owner, None, LEASE))
                .await
                .unwrap(),
            ClaimReply::Won { .. }
        ));
        // Listening (again, after round 0's kill) before the watch: a
        // re-subscription wakes every watcher to look again, which would
        // wake this one before the notice.
        let _started = waiter_store.watch("start-the-listener");
        let deadline = tokio::time::Instant::now() + Duration::from_secs(10);
        while !(waiter_store.is_listening() && waiter_store.stats().subscriptions > round) {
            assert!(tokio::time::Instant::now() < deadline, "never listened");
            tokio::time::sleep(Duration::from_millis(20)).await;
        }
        let changed = waiter_store.watch(&key);
        let started = tokio::time::Instant::now();
        let completer = async {
            tokio::time::sleep(Duration::from_millis(50)).await;
            let result = StoredResult::new(None, "t", b"v".to_vec());
            owner_store
                .complete(&key, owner, &result, TTL)
                .await
                .unwrap()
        };
        let (woke, stored) = tokio::join!(
            tokio::time::timeout(Duration::from_secs(5), changed),
            completer
        );
        assert!(stored);
        assert!(woke.is_ok(), "round {round}: the notice never arrived");
        assert!(started.elapsed() < Duration::from_secs(2), "round {round}");
        if round == 0 {
            // Kill every backend of both stores, the listener's included.
            assert!(schema.terminate_all().await >= 1);
            tokio::time::sleep(Duration::from_millis(100)).await;
        }
    }
    let stats = waiter_store.stats();
    assert!(
        stats.subscriptions >= 2,
        "the listener listened again: {stats:?}"
    );
    assert!(stats.notices >= 2, "{stats:?}");
}

#[tokio::test]
async fn a_lease_or_ttl_of_duration_max_holds_rather_than_erring() {
    let Some(schema) = PgSchema::create("a_lease_or_ttl_of_duration_max").await else {
        return;
    };
    let store = schema.store().await;
    let max = Duration::MAX;
    let owner = ClaimToken::new();
    let won = store.claim("forever", ClaimRequest::new(owner, None, max, max));
    assert!(matches!(won.await.unwrap(), ClaimReply::Won { .. }));
    assert!(store.renew("forever", owner, max).await.unwrap());
    let result = StoredResult::new(None, "u8", vec![1]);
    assert!(
        store
            .complete("forever", owner, &result, max)
            .await
            .unwrap()
    );
    assert_eq!(
        store
            .claim("forever", request(ClaimToken::new(), None, LEASE))
            .await
            .unwrap(),
        ClaimReply::Completed(result)
    );
}

#[tokio::test]
async fn keys_are_bytes_any_string_goes_and_scopes_never_collide() {
    let Some(schema) = PgSchema::create("keys_are_bytes").await else {
        return;
    };
    let store = schema.store().await;
    let long = "k".repeat(2100);
    for key in [
        "nul\0inside",
        "ünïcødé",
        "'; DROP TABLE x; --",
        long.as_str(),
    ] {
        let owner = ClaimToken::new();
        assert!(
            matches!(
                store.claim(key, request(owner, None, LEASE)).await.unwrap(),
                ClaimReply::Won { .. }
            ),
            "{key:?}"
        );
        let changed = store.watch(key);
        let result = StoredResult::new(None, "u8", vec![9]);
        assert!(
            store.complete(key, owner, &result, TTL).await.unwrap(),
            "{key:?}"
        );
        let _ = tokio::time::timeout(Duration::from_millis(10), changed).await;
        assert_eq!(
            store
                .claim(key, request(ClaimToken::new(), None, LEASE))
                .await
                .unwrap(),
            ClaimReply::Completed(result),
            "{key:?}"
        );
    }
}

#[tokio::test]
async fn an_unreachable_server_fails_closed_with_a_typed_error_in_bounded_time() {
    let store = PostgresStore::builder("postgres://postgres@127.0.0.1:1/test")
        .with_connect_timeout(Duration::from_millis(300))
        .with_command_timeout(Duration::from_millis(500))
        .connect()
        .await;
    let e = store.unwrap_err();
    assert!(e.is_store_fault(), "{e:?}");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_store_connecting_in_the_background_fails_closed_then_connects_and_migrates() {
    let Some(schema) = PgSchema::create("a_store_connecting_in_the_background").await else {
        return;
    };
    let port = Proxy::free_port();
    let url = support::postgres::url().replace(":5432", &format!(":{port}"));
    let store = PostgresStore::builder(&url)
        .with_table(schema.table())
        .with_application_name(&schema.name)
        .with_connect_timeout(Duration::from_millis(300))
        .with_auto_migrate(true)
        .connect_in_background()
        .unwrap();
    let claim = || store.claim("k", request(ClaimToken::new(), None, LEASE));
    let e = claim().await.unwrap_err();
    assert!(
        std::error::Error::source(&e).is_some_and(|s| s.to_string().contains("not connected yet")),
        "{e:?}"
    );
    tokio::time::sleep(Duration::from_millis(500)).await;
    assert!(claim().await.is_err(), "still unreachable");
    // The server becomes reachable: the store connects and migrates by itself.
    let _proxy = Proxy::start(port).await;
    let deadline = tokio::time::Instant::now() + Duration::from_secs(30);
    let won = loop {
        match claim().await {
            Ok(reply) => break reply,
            Err(_) if tokio::time::Instant::now() < deadline => {
                tokio::time::sleep(Duration::from_millis(50)).await;
            }
            Err(e) => panic!("never connected: {e:?}"),
        }
    };
    assert!(matches!(won, ClaimReply::Won { .. }), "{won:?}");
    assert!(store.stats().connected);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn s16_a_listener_whose_runtime_ended_is_started_again_by_the_next_watcher() {
    let Some(schema) = PgSchema::create("s16_a_listener_whose_runtime_ended").await else {
        return;
    };
    let store = schema.store().await;
    // The first watcher lives on a tokio runtime that then ends.
    let other = store.clone();
    std::thread::spawn(move || {
        let rt = tokio::runtime::Builder::new_current_thread()
            .enable_all()
            .build()
            .unwrap();
        rt.block_on(async move {
            let _changed = other.watch("first");
            let deadline = tokio::time::Instant::now() + Duration::from_secs(10);
            while !other.is_listening() {
                assert!(tokio::time::Instant::now() < deadline, "never listened");
                tokio::time::sleep(Duration::from_millis(20)).await;
            }
        });
    })
    .join()
    .unwrap();
    assert!(!store.is_listening(), "the listener ended with its runtime");
    let owner = ClaimToken::new();
    assert!(matches!(
        store
            .claim("second", request(owner, None, LEASE))
            .await
            .unwrap(),
        ClaimReply::Won { .. }
    ));
    let changed = store.watch("second");
    let deadline = tokio::time::Instant::now() + Duration::from_secs(10);
    while !store.is_listening() {
        assert!(
            tokio::time::Instant::now() < deadline,
            "never listened again"
        );
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
    let result = StoredResult::new(None, "u8", vec![2]);
    assert!(store.complete("second", owner, &result, TTL).await.unwrap());
    tokio::time::timeout(Duration::from_secs(2), changed)
        .await
        .expect("woken through the new listener");
    assert_eq!(store.stats().subscriptions, 2);
}

/// A server that takes no writes now (a standby after a failover; here, sessions that are
/// read-only) is an outage, not a refusal: `25006 read_only_sql_transaction` is
/// `StoreError::NotServing` (the server answered and did nothing), which counts against the
/// breaker and which an owner's completion tries again rather than freeing a key whose
/// function ran.
#[tokio::test]
async fn a_server_that_takes_no_writes_is_unavailable_not_a_refusal() {
    let Some(schema) = PgSchema::create("a_server_that_takes_no_writes_is_unavailable").await
    else {
        return;
    };
    schema.store().await;
    let separator = if schema.url().contains('?') { '&' } else { '?' };
    let read_only = format!(
        "{}{separator}options=-c%20default_transaction_read_only%3Don",
        schema.url()
    );
    let store = PostgresStore::builder(&read_only)
        .with_table(schema.table())
        .with_application_name(&schema.name)
        .connect()
        .await
        .expect("connects");
    let e = store
        .claim("k", request(ClaimToken::new(), None, LEASE))
        .await
        .unwrap_err();
    assert!(matches!(e, StoreError::NotServing(_)), "{e:?}");
    assert!(e.is_store_fault(), "counted against the breaker");
    assert!(!e.may_have_been_applied(), "it did nothing");
    let cause = std::error::Error::source(&e).map(ToString::to_string);
    assert!(
        cause.as_deref().is_some_and(|c| c.contains("read-only")),
        "the server's reason is kept: {cause:?}"
    );
}
