//! The machine's PostgreSQL for tests (`THROTTLEBEAM_TEST_POSTGRES_URL`,
//! default `postgres://postgres@127.0.0.1:5432/test`): each test gets a
//! schema of its own, with a unique name, dropped when the test ends (also
//! when it fails: a drop guard), and a unique `application_name` for its
//! connections, so a test can find and kill its own backends.
//!
//! Under `CI=true` a test fails if the server is unreachable; elsewhere it
//! prints one line saying it was skipped and why.

use std::sync::atomic::{AtomicU32, Ordering};
use std::time::Duration;

use throttlebeam::idempotency::postgres::tokio_postgres::{self, NoTls};
use throttlebeam::idempotency::postgres::{PostgresBuilder, PostgresStore};

/// Where the tests' server is.
pub fn url() -> String {
    std::env::var("THROTTLEBEAM_TEST_POSTGRES_URL")
        .ok()
        .filter(|u| !u.trim().is_empty())
        .unwrap_or_else(|| "postgres://postgres@127.0.0.1:5432/test".to_owned())
}

/// Whether PostgreSQL tests must run (CI) rather than skip.
pub fn required() -> bool {
    std::env::var("CI").is_ok_and(|v| v == "true" || v == "1")
}

static NEXT: AtomicU32 = AtomicU32::new(0);

/// A schema of one test's own, dropped with this value.
pub struct PgSchema {
    /// The schema's name; also its connections' `application_name`.
    pub name: String,
    url: String,
}

/// Connects with `application_name` set, the connection driven by a task.
pub async fn connect(
    url: &str,
    app: &str,
) -> Result<tokio_postgres::Client, tokio_postgres::Error> {
    let mut config: tokio_postgres::Config = url.parse()?;
    config
        .application_name(app)
        .connect_timeout(Duration::from_secs(5));
    let (client, connection) = config.connect(NoTls).await?;
    tokio::spawn(async move {
        let _ = connection.await;
    });
    Ok(client)
}

impl PgSchema {
    /// Creates the schema, or skips (see the module docs).
    pub async fn create(test: &str) -> Option<Self> {
        let url = url();
        let stem: String = test
            .chars()
            .filter(|c| c.is_ascii_alphanumeric() || *c == '_')
            .take(24)
            .collect::<String>()
            .to_ascii_lowercase();
        let name = format!(
            "tb_{stem}_{}_{}",
            std::process::id(),
            NEXT.fetch_add(1, Ordering::Relaxed)
        );
        let created = async {
            let client = connect(&url, &format!("{name}_admin")).await?;
            client
                .batch_execute(&format!("CREATE SCHEMA \"{name}\""))
                .await
        };
        match tokio::time::timeout(Duration::from_secs(10), created).await {
            Ok(Ok(())) => Some(Self { name, url }),
            Ok(Err(e)) => unavailable(test, &url, &e.to_string()),
            Err(_) => unavailable(test, &url, "connecting timed out after 10 s"),
        }
    }

    /// The test's idempotency table, `schema.idempotency`.
    pub fn table(&self) -> String {
        format!("{}.idempotency", self.name)
    }

    /// The URL of the server.
    pub fn url(&self) -> &str {
        &self.url
    }

    /// A store builder for the test's table, its connections named after
    /// the schema.
    pub fn builder(&self) -> PostgresBuilder {
        PostgresStore::builder(&self.url)
            .with_table(self.table())
            .with_application_name(&self.name)
    }

    /// A connected store with its table migrated.
    pub async fn store(&self) -> PostgresStore {
        let store = self.builder().connect().await.expect("the store connects");
        store.migrate().await.expect("the table migrates");
        store
    }

    /// A connection of the test's own, not named like the store's (killing
    /// those spares it).
    pub async fn client(&self) -> tokio_postgres::Client {
        connect(&self.url, &format!("{}_admin", self.name))
            .await
            .expect("the admin connection connects")
    }

    /// Terminates every backend of the test's stores (their pools and
    /// listeners); how many.
    pub async fn terminate_all(&self) -> i64 {
        let admin = self.client().await;
        let row = admin
            .query_one(
                "SELECT count(pg_terminate_backend(pid)) FROM pg_stat_activity \
                  WHERE application_name = $1",
                &[&self.name],
            )
            .await
            .expect("terminating answers");
        row.get(0)
    }

    /// Creates `schema.effects (key text, value bigint)`: what a test's
    /// operations write, one row per execution that committed.
    pub async fn create_effects(&self) {
        self.client()
            .await
            .batch_execute(&format!(
                "CREATE TABLE \"{}\".effects (key text NOT NULL, value bigint NOT NULL)",
                self.name
            ))
            .await
            .expect("the effects table is created");
    }

    /// The qualified name of the effects table.
    pub fn effects(&self) -> String {
        format!("\"{}\".effects", self.name)
    }

    /// Committed effects of `key`.
    pub async fn effects_of(&self, client: &tokio_postgres::Client, key: &str) -> i64 {
        client
            .query_one(
                &format!("SELECT count(*) FROM {} WHERE key = $1", self.effects()),
                &[&key],
            )
            .await
            .expect("counting effects answers")
            .get(0)
    }
}

impl Drop for PgSchema {
    fn drop(&mut self) {
        let (url, name) = (self.url.clone(), self.name.clone());
        // Drop may run on a tokio worker (or while unwinding): a thread of
        // its own with a runtime of its own.
        let dropped = std::thread::spawn(move || {
            let rt = tokio::runtime::Builder::new_current_thread()
                .enable_all()
                .build()
                .expect("a runtime for the drop");
            rt.block_on(async move {
                let admin = connect(&url, "throttlebeam_test_cleanup").await?;
                // Sessions of the test still open may hold locks on its tables.
                admin
                    .execute(
                        "SELECT pg_terminate_backend(pid) FROM pg_stat_activity \
                          WHERE application_name = $1 OR application_name = $2",
                        &[&name, &format!("{name}_admin")],
                    )
                    .await?;
                admin
                    .batch_execute(&format!(
                        "SET lock_timeout = '20s'; DROP SCHEMA IF EXISTS \"{name}\" CASCADE"
                    ))
                    .await
            })
        })
        .join();
        match dropped {
            Ok(Ok(())) => {}
            Ok(Err(e)) => eprintln!("could not drop test schema {}: {e}", self.name),
            Err(_) => eprintln!("dropping test schema {} panicked", self.name),
        }
    }
}

/// Skips (returns `None` after one line on stderr) or, under CI, panics.
fn unavailable<T>(test: &str, url: &str, why: &str) -> Option<T> {
    if required() {
        panic!("{test}: PostgreSQL is required under CI=true but {url} is unreachable: {why}");
    }
    eprintln!("skipped {test}: PostgreSQL at {url} is unreachable: {why}");
    None
}

/// A TCP forwarder to the tests' server on a port of its own: a server that
/// can be unreachable, then reachable, or cut off.
pub struct Proxy {
    pub port: u16,
    tasks: std::sync::Arc<std::sync::Mutex<Vec<tokio::task::JoinHandle<()>>>>,
}

impl Proxy {
    /// A free loopback port, nothing listening on it (yet).
    pub fn free_port() -> u16 {
        std::net::TcpListener::bind("127.0.0.1:0")
            .and_then(|l| l.local_addr())
            .map(|a| a.port())
            .expect("a free loopback port")
    }

    /// Forwards `port` to the server `url()` names (host and port read from it).
    pub async fn start(port: u16) -> Self {
        let config: tokio_postgres::Config = url().parse().expect("url");
        let target_port = config.get_ports().first().copied().unwrap_or(5432);
        let listener = tokio::net::TcpListener::bind(("127.0.0.1", port))
            .await
            .expect("the proxy's port is free");
        let tasks = std::sync::Arc::new(std::sync::Mutex::new(Vec::new()));
        let accepting = {
            let tasks = std::sync::Arc::clone(&tasks);
            tokio::spawn(async move {
                while let Ok((mut inbound, _)) = listener.accept().await {
                    let pipe = tokio::spawn(async move {
                        if let Ok(mut outbound) =
                            tokio::net::TcpStream::connect(("127.0.0.1", target_port)).await
                        {
                            let _ =
                                tokio::io::copy_bidirectional(&mut inbound, &mut outbound).await;
                        }
                    });
                    tasks.lock().unwrap().push(pipe);
                }
            })
        };
        tasks.lock().unwrap().push(accepting);
        Self { port, tasks }
    }
}

impl Drop for Proxy {
    fn drop(&mut self) {
        for task in self.tasks.lock().unwrap().drain(..) {
            task.abort();
        }
    }
}
