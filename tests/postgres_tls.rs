//! PostgreSQL over TLS (feature `postgres-tls`), against the machine's server when it has
//! TLS on (`SHOW ssl`): `sslmode` as libpq reads it, the CA from `sslrootcert`.
#![cfg(feature = "postgres-tls")]

mod support;

use support::postgres::PgSchema;
use throttlebeam::IdempotencyOptions;
use throttlebeam::idempotency::postgres::{PostgresStore, tokio_postgres};
use throttlebeam::store::StoreError;

/// Whether the store's own connections are encrypted: a transactional run asks the server.
async fn encrypted(store: &PostgresStore) -> bool {
    let outcome = store
        .run_in_transaction(
            &format!("tls:{}", std::process::id()),
            IdempotencyOptions::new().with_ttl(std::time::Duration::from_millis(10)),
            |tx| {
                Box::pin(async move {
                    let row = tx
                        .query_one(
                            "SELECT ssl FROM pg_stat_ssl WHERE pid = pg_backend_pid()",
                            &[],
                        )
                        .await?;
                    Ok::<_, tokio_postgres::Error>(row.get::<_, bool>(0))
                })
            },
        )
        .await
        .unwrap();
    outcome.into_inner()
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn p7_sslmode_require_verify_ca_and_verify_full_as_libpq_reads_them() {
    let Some(schema) = PgSchema::create("p7_tls_modes").await else {
        return;
    };
    let admin = schema.client().await;
    let ssl: String = admin.query_one("SHOW ssl", &[]).await.unwrap().get(0);
    if ssl != "on" {
        eprintln!("skipped p7_sslmode_require_verify_ca_and_verify_full: the server has ssl off");
        return;
    }
    let cert_file: String = admin
        .query_one("SHOW ssl_cert_file", &[])
        .await
        .unwrap()
        .get(0);
    let base = schema.url().to_owned();
    let store = |url: String| {
        let table = schema.table();
        let name = schema.name.clone();
        async move {
            let store = PostgresStore::builder(&url)
                .with_table(table)
                .with_application_name(name)
                .connect()
                .await?;
            store.migrate().await?;
            Ok::<_, StoreError>(store)
        }
    };
    // require: encrypted, the certificate not checked.
    let required = store(format!("{base}?sslmode=require")).await.unwrap();
    assert!(encrypted(&required).await);
    // verify-ca: the chain checked against the server's own (self-signed) certificate.
    let ca = store(format!("{base}?sslmode=verify-ca&sslrootcert={cert_file}"))
        .await
        .unwrap();
    assert!(encrypted(&ca).await);
    // verify-full: the host name too. The certificate names `localhost`, not 127.0.0.1.
    let by_name = base.replace("127.0.0.1", "localhost");
    if by_name != base {
        let full = store(format!(
            "{by_name}?sslmode=verify-full&sslrootcert={cert_file}"
        ))
        .await
        .unwrap();
        assert!(encrypted(&full).await);
        let wrong = store(format!(
            "{base}?sslmode=verify-full&sslrootcert={cert_file}"
        ))
        .await;
        assert!(wrong.is_err(), "the certificate does not name 127.0.0.1");
    }
    // A CA given in code works as sslrootcert does.
    let pem = std::fs::read(&cert_file).unwrap();
    let in_code = PostgresStore::builder(&format!("{base}?sslmode=verify-ca"))
        .with_ca_pem(pem)
        .with_table(schema.table())
        .with_application_name(&schema.name)
        .connect()
        .await
        .unwrap();
    assert!(encrypted(&in_code).await);
    // verify-full with no CA at all cannot work: a configuration error, at once.
    let no_ca = PostgresStore::builder(&format!("{base}?sslmode=verify-full"))
        .connect()
        .await
        .unwrap_err();
    assert!(matches!(no_ca, StoreError::Config(_)), "{no_ca:?}");
    assert!(no_ca.to_string().contains("needs a CA"), "{no_ca}");
}
