//! TTL expiry: expired rows are never replayed (every read checks the
//! expiry on the server's clock), and a task deletes them in bounded
//! batches, each its own short statement (`FOR UPDATE SKIP LOCKED`, so
//! instances sweeping together never wait on each other).

use std::sync::atomic::Ordering;
use std::sync::{Arc, Weak};

use super::Inner;
use super::pool::Class;
use crate::store::StoreError;

/// Batches one sweep deletes at most, so a backlog is worked off over
/// several intervals rather than in one long burst.
pub(super) const MAX_BATCHES: u32 = 100;

/// Deletes expired rows, `batch` at a time, until a batch finds fewer or
/// [`MAX_BATCHES`] ran. How many went.
pub(super) async fn sweep(inner: &Inner) -> Result<u64, StoreError> {
    let batch = i64::from(inner.sweep_batch);
    let mut swept = 0;
    for _ in 0..MAX_BATCHES {
        let deleted = inner
            .connections
            .execute(Class::Refusable, &inner.sql.sweep, &[&batch])
            .await?;
        swept += deleted;
        inner.swept.fetch_add(deleted, Ordering::Relaxed);
        if deleted < u64::from(inner.sweep_batch) {
            break;
        }
    }
    Ok(swept)
}

/// Starts the store's sweeper on the caller's tokio runtime, unless one is
/// alive.
pub(super) fn start(inner: &Arc<Inner>) {
    if inner.sweeping.load(Ordering::Acquire) {
        return;
    }
    let Ok(runtime) = tokio::runtime::Handle::try_current() else {
        return;
    };
    if inner.sweeping.swap(true, Ordering::AcqRel) {
        return;
    }
    let guard = Sweeping(Arc::downgrade(inner));
    let mut stopped = inner.stop.subscribe();
    runtime.spawn(async move {
        tokio::select! {
            () = run(&guard) => {}
            _ = stopped.changed() => {}
        }
        drop(guard);
    });
}

/// The sweeper task's hold on the store: dropped however the task ends,
/// it lets the next call start another.
struct Sweeping(Weak<Inner>);

impl Drop for Sweeping {
    fn drop(&mut self) {
        if let Some(inner) = self.0.upgrade() {
            inner.sweeping.store(false, Ordering::Release);
        }
    }
}

async fn run(guard: &Sweeping) {
    loop {
        let Some(interval) = guard.0.upgrade().map(|inner| inner.sweep_interval) else {
            return;
        };
        tokio::time::sleep(interval).await;
        let Some(inner) = guard.0.upgrade() else {
            return;
        };
        match sweep(&inner).await {
            Ok(0) => {}
            Ok(swept) => {
                tracing::debug!(swept, table = %inner.sql.table.plain(), "swept expired idempotency rows")
            }
            Err(e) => {
                tracing::debug!(error = %e, "sweeping expired idempotency rows failed; trying again next interval")
            }
        }
    }
}
