//! The process-wide default runtime: the composition root that reads the environment for
//! every backend (Redis, PostgreSQL), apart from the runtime itself, which knows no primitive.

use std::num::NonZeroUsize;
use std::sync::{Arc, OnceLock};
use std::time::Duration;

use crate::error::Error;
use crate::runtime::Runtime;

impl Runtime {
    /// The process-wide default runtime, started on first use.
    ///
    /// Its supervision tree and sweeper live on a small background thread of
    /// their own, so it outlives whichever tokio runtime touched it first;
    /// per-key processes run on the caller's tokio runtime. It runs on real
    /// time: tests with paused tokio time should build their own runtime,
    /// which then follows the paused clock.
    ///
    /// No host supervises it, so it supervises itself: if its root goes
    /// down, calls fail with [`Error::RuntimeDown`] for about 100 ms, then
    /// it restarts (as [`Runtime::restart`]) and serves again.
    ///
    /// With the `redis` feature it shares through the Redis its environment
    /// names ([`RuntimeBuilder::with_redis_from_env`](crate::runtime::RuntimeBuilder::with_redis_from_env)), connecting on its own
    /// thread: the first caller never waits for Redis, and a Redis
    /// unreachable at start is connected to once it answers (until then
    /// idempotency fails closed and throttles decide per instance). With the
    /// `postgres` feature it keeps idempotency in the PostgreSQL
    /// [`POSTGRES_URL_ENV`](crate::idempotency::postgres::POSTGRES_URL_ENV) names, the
    /// same way: connecting and migrating on its own thread, failing closed
    /// until then.
    ///
    /// # Errors
    ///
    /// [`Error::Start`] if it could not start (reported to every caller).
    pub fn global() -> Result<Self, Error> {
        static GLOBAL: OnceLock<Result<Runtime, Error>> = OnceLock::new();
        GLOBAL.get_or_init(start_global).clone()
    }
}

fn start_global() -> Result<Runtime, Error> {
    let (tx, rx) = std::sync::mpsc::channel();
    let spawned = std::thread::Builder::new()
        .name("throttlebeam-runtime".to_owned())
        .spawn(move || {
            let rt = match tokio::runtime::Builder::new_current_thread()
                .enable_all()
                .build()
            {
                Ok(rt) => rt,
                Err(e) => {
                    let _ = tx.send(Err(Error::Start(Arc::new(e))));
                    return;
                }
            };
            rt.block_on(async move {
                let partitions = std::thread::available_parallelism().unwrap_or(NonZeroUsize::MIN);
                let builder = Runtime::builder()
                    .with_name("default")
                    .with_partitions(partitions);
                // Redis connects in the background, on this thread: no
                // caller waits for it, and an unreachable server is retried
                // (never a runtime that silently stopped sharing).
                #[cfg(feature = "redis")]
                let builder = builder.with_redis_from_env();
                #[cfg(feature = "postgres")]
                let builder = crate::idempotency::postgres::with_env(builder);
                let started = builder.start().await;
                let runtime = started.as_ref().ok().cloned();
                let _ = tx.send(started);
                // Nobody supervises the default runtime: it restarts itself,
                // 100 ms after its root goes down.
                if let Some(runtime) = runtime {
                    loop {
                        runtime.core.tree.wait_down().await;
                        tokio::time::sleep(Duration::from_millis(100)).await;
                        match runtime.restart().await {
                            Ok(_) => {
                                tracing::warn!("default runtime restarted after its root went down")
                            }
                            Err(error) => {
                                let error: &(dyn std::error::Error + 'static) = &error;
                                tracing::error!(error, "default runtime failed to restart");
                            }
                        }
                    }
                }
            });
        });
    if let Err(e) = spawned {
        return Err(Error::Start(Arc::new(e)));
    }
    rx.recv().unwrap_or_else(|e| Err(Error::Start(Arc::new(e))))
}
