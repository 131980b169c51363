//! A schema and a login role of the harness's own on the machine's PostgreSQL, and the faults
//! done to the sessions of that role: terminated backends, read-only sessions, a lock held by
//! another session. Nothing here touches another user's sessions or the database's settings.

use std::time::Duration;

use tokio_postgres::{Client, NoTls};

use crate::servers::postgres_url;

/// Connects to `url` with `application_name` `app`; the connection is driven by a task.
pub(crate) async fn connect(url: &str, app: &str) -> Result<Client, String> {
    let mut config: tokio_postgres::Config = url.parse().map_err(|e| format!("{e}"))?;
    config
        .application_name(app)
        .connect_timeout(Duration::from_secs(5));
    let (client, connection) = tokio::time::timeout(Duration::from_secs(10), config.connect(NoTls))
        .await
        .map_err(|_| "connecting timed out".to_owned())?
        .map_err(|e| e.to_string())?;
    tokio::spawn(async move {
        let _ = connection.await;
    });
    Ok(client)
}

/// The schema `name` owned by the role `name`; the store's sessions log in as that role with
/// `application_name` `name`.
pub(crate) struct PgSetup {
    pub(crate) name: String,
    url: String,
    admin: Client,
}

impl PgSetup {
    pub(crate) async fn create(tag: &str) -> Result<Self, String> {
        let url = postgres_url();
        let name = format!(
            "tbf_{}_{}_{}",
            tag.replace('-', "_"),
            std::process::id(),
            crate::history::now_us() % 1_000_000
        );
        let admin = connect(&url, &format!("{name}_admin"))
            .await
            .map_err(|e| format!("PostgreSQL at {url} is unreachable: {e}"))?;
        admin
            .batch_execute(&format!(
                "CREATE ROLE \"{name}\" LOGIN; \
                 CREATE SCHEMA \"{name}\" AUTHORIZATION \"{name}\"; \
                 CREATE TABLE \"{name}\".effects (key text NOT NULL, op text NOT NULL); \
                 ALTER TABLE \"{name}\".effects OWNER TO \"{name}\";"
            ))
            .await
            .map_err(|e| format!("creating the schema failed: {e}"))?;
        Ok(Self { name, url, admin })
    }

    /// The URL the store uses: the role, through `port` (a proxy, or the server's own).
    pub(crate) fn store_url(&self, port: u16) -> String {
        let config: tokio_postgres::Config = self.url.parse().expect("a valid URL");
        let db = config.get_dbname().unwrap_or("test").to_owned();
        format!("postgres://{}@127.0.0.1:{port}/{db}", self.name)
    }

    /// The server's port.
    pub(crate) fn server_port(&self) -> u16 {
        let config: tokio_postgres::Config = self.url.parse().expect("a valid URL");
        config.get_ports().first().copied().unwrap_or(5432)
    }

    pub(crate) fn table(&self) -> String {
        format!("{}.idempotency", self.name)
    }

    pub(crate) fn effects(&self) -> String {
        format!("\"{}\".effects", self.name)
    }

    /// Terminates every session of the role (the stores' pools and listeners); how many.
    pub(crate) async fn terminate(&self) -> i64 {
        self.admin
            .query_one(
                "SELECT count(pg_terminate_backend(pid)) FROM pg_stat_activity WHERE usename = $1",
                &[&self.name],
            )
            .await
            .map_or(0, |r| r.get(0))
    }

    /// New sessions of the role start read-only (`default_transaction_read_only`) or not;
    /// the open ones are terminated so the pools reconnect with it.
    pub(crate) async fn read_only(&self, on: bool) {
        let _ = self
            .admin
            .batch_execute(&format!(
                "ALTER ROLE \"{}\" SET default_transaction_read_only = {}",
                self.name,
                if on { "on" } else { "off" }
            ))
            .await;
        self.terminate().await;
    }

    /// Another session holds an exclusive lock on the store's table for `hold`.
    pub(crate) async fn hold_lock(&self, hold: Duration) -> Result<(), String> {
        let client = connect(&self.url, &format!("{}_locker", self.name)).await?;
        client
            .batch_execute(&format!(
                "BEGIN; LOCK TABLE {} IN ACCESS EXCLUSIVE MODE",
                self.table()
            ))
            .await
            .map_err(|e| e.to_string())?;
        tokio::time::sleep(hold).await;
        client
            .batch_execute("ROLLBACK")
            .await
            .map_err(|e| e.to_string())
    }

    /// The effect rows committed: (key, op).
    pub(crate) async fn committed(&self) -> Result<Vec<(String, String)>, String> {
        let rows = self
            .admin
            .query(&format!("SELECT key, op FROM {}", self.effects()), &[])
            .await
            .map_err(|e| e.to_string())?;
        Ok(rows.iter().map(|r| (r.get(0), r.get(1))).collect())
    }

    /// Drops the schema and the role (terminating their sessions first).
    pub(crate) async fn drop_all(&self) {
        let _ = self
            .admin
            .batch_execute(&format!(
                "ALTER ROLE \"{}\" RESET default_transaction_read_only",
                self.name
            ))
            .await;
        let _ = self
            .admin
            .execute(
                "SELECT pg_terminate_backend(pid) FROM pg_stat_activity \
                 WHERE usename = $1 OR application_name = $2",
                &[&self.name, &format!("{}_locker", self.name)],
            )
            .await;
        if let Err(e) = self
            .admin
            .batch_execute(&format!(
                "SET lock_timeout = '20s'; DROP SCHEMA IF EXISTS \"{0}\" CASCADE; DROP ROLE IF EXISTS \"{0}\"",
                self.name
            ))
            .await
        {
            eprintln!("could not drop schema and role {}: {e}", self.name);
        }
    }
}
