//! The coalescing throttle's window in its store: claims, lease renewals and
//! window writes, each store call bounded by the store timeout and guarded
//! (see [`crate::store::guard`]), failing open.

use std::future::Future;
use std::sync::atomic::Ordering;
use std::task::Poll;
use std::time::Duration;

use tokio::time::Instant;

use super::state::{Armed, DESTROYED, Gauges, Shared};
use super::store::{WindowClaim, WindowEntry, WindowStoreFuture};
use crate::store::{Fault, guard};

/// What a store call came to once bounded and guarded.
pub(super) enum StoreOutcome<R> {
    Done(R),
    /// Failed, panicked, timed out or abandoned: fail open.
    Failed,
}

/// Counts a store call in flight while it lives.
struct InStore<'a>(&'a Gauges);

impl<'a> InStore<'a> {
    fn new(gauges: &'a Gauges) -> Self {
        gauges.in_store.fetch_add(1, Ordering::AcqRel);
        Self(gauges)
    }
}

impl Drop for InStore<'_> {
    fn drop(&mut self) {
        if self.0.in_store.fetch_sub(1, Ordering::AcqRel) == 1 {
            self.0.store_idle.notify_waiters();
        }
    }
}

impl<T: Clone + Send + Sync + 'static> Shared<T> {
    /// Runs one store call through the store guard every seam uses
    /// ([`crate::store::guard`]: bounded by the store timeout, a panic while
    /// building or polling the call caught), abandoned at once when the
    /// throttle is destroyed (a shutdown's deadline). Every failure is
    /// counted and logged at debug level (a panic at warn): the caller
    /// fails open.
    pub(super) async fn store_call<'s, R>(
        &self,
        key: &str,
        what: &'static str,
        call: impl FnOnce() -> WindowStoreFuture<'s, R>,
    ) -> StoreOutcome<R> {
        if self.mode() == DESTROYED {
            return StoreOutcome::Failed;
        }
        // Boxed: the guard's timer stays out of every process's future.
        let mut call = Box::pin(guard(self.store_timeout, call));
        // An in-memory store answers on the first poll: no timer for it.
        let first = std::future::poll_fn(|cx| Poll::Ready(call.as_mut().poll(cx))).await;
        let out = match first {
            Poll::Ready(out) => Some(out),
            Poll::Pending => self.store_wait(call).await,
        };
        let gauges = &self.gauges;
        match out {
            Some(Ok(Ok(value))) => StoreOutcome::Done(value),
            Some(Ok(Err(error))) => {
                gauges.store_errors.fetch_add(1, Ordering::Relaxed);
                tracing::debug!(throttle = %self.name, key, what, %error, "window store failed");
                StoreOutcome::Failed
            }
            Some(Err(Fault::Panicked(panic))) => {
                gauges.store_errors.fetch_add(1, Ordering::Relaxed);
                tracing::warn!(throttle = %self.name, key, what, panic, "window store panicked; treated as a store failure");
                StoreOutcome::Failed
            }
            Some(Err(Fault::TimedOut(_))) => {
                gauges.store_timeouts.fetch_add(1, Ordering::Relaxed);
                tracing::debug!(throttle = %self.name, key, what, timeout = ?self.store_timeout, "window store failed: timed out");
                StoreOutcome::Failed
            }
            None => {
                tracing::debug!(throttle = %self.name, key, what, "window store call abandoned: destroyed");
                StoreOutcome::Failed
            }
        }
    }

    /// The rest of a guarded store call that did not answer at once; `None`
    /// if the throttle was destroyed first (the call is abandoned).
    async fn store_wait<F: Future + Unpin>(&self, call: F) -> Option<F::Output> {
        let _in_store = InStore::new(&self.gauges);
        let mut call = call;
        loop {
            let stopped = self.wake.notified();
            tokio::pin!(stopped);
            stopped.as_mut().enable();
            if self.mode() == DESTROYED {
                return None;
            }
            tokio::select! {
                biased;
                out = &mut call => return Some(out),
                () = stopped => {}
            }
        }
    }

    /// Claims the key's window in the store for `token`.
    ///
    /// `Ok(())` to run now, including on a store failure (fail open);
    /// `Err(wait)` when another owner holds the window.
    pub(super) async fn claim(&self, key: &str, token: u64) -> Result<(), Duration> {
        let Some(store) = self.shared_store() else {
            // The registry's slot is the claim.
            return Ok(());
        };
        let store_key = &*self.store_key(key);
        // A claim is a lease: it lapses at its end unless extended.
        let entry = WindowEntry::new(self.epoch.at(Instant::now() + self.lease_ttl), token);
        let claim = || store.claim(store_key, entry, self.lease_ttl);
        match self.store_call(store_key, "claim", claim).await {
            StoreOutcome::Done(WindowClaim::Lost { holder }) => Err(self.retry_after(holder)),
            StoreOutcome::Done(_) | StoreOutcome::Failed => Ok(()),
        }
    }

    /// How long to wait after losing a window race: until just past the end
    /// the holder reported (a window's end, or a lease's lapse), capped at
    /// the lease TTL; the window length if unreadable.
    fn retry_after(&self, holder: Option<WindowEntry>) -> Duration {
        match holder {
            Some(entry) => {
                let now = self.epoch.at(Instant::now());
                // One millisecond past the end: values are truncated to
                // milliseconds and instances' clocks differ by as much.
                Duration::from_millis(entry.end_ms.saturating_sub(now).saturating_add(1))
                    .min(self.lease_ttl)
            }
            None => self.window,
        }
    }

    /// Extends a running function's lease for as long as it runs, and only
    /// while it still holds it.
    pub(super) async fn hold_lease(&self, key: &str, token: u64) {
        let Some(store) = self.shared_store() else {
            // Nothing to extend: the registry's slot stays busy while it runs.
            return std::future::pending().await;
        };
        let store_key = &*self.store_key(key);
        loop {
            {
                let _timer = Armed::new(&self.gauges);
                tokio::time::sleep(self.lease_every).await;
            }
            let entry = WindowEntry::new(self.epoch.at(Instant::now() + self.lease_ttl), token);
            let extend = || store.extend(store_key, entry, self.lease_ttl);
            if let StoreOutcome::Done(false) = self.store_call(store_key, "extend", extend).await {
                tracing::debug!(throttle = %self.name, key = store_key, "lease taken over by another owner; no longer extended");
                std::future::pending::<()>().await;
            }
        }
    }

    /// Records the window that starts now that a run finished (replacing the
    /// run's lease, if still ours) and returns when it ends in memory.
    ///
    /// The store's expiry is the window in whole milliseconds (rounded up),
    /// counted from the write; the in-memory window is counted from after
    /// the write returns, so it never ends before the store key expires and
    /// this instance's next claim is not refused by its own window. On a
    /// store that may be shared (one passed in), it ends a little later
    /// still ([`Shared::courtesy`]).
    pub(super) async fn write_window(&self, key: &str, token: u64) -> Instant {
        let Some(store) = self.shared_store() else {
            return self.window_end();
        };
        let px = self.window_px();
        let entry = WindowEntry::new(self.epoch.at(Instant::now() + px), token);
        let store_key = self.store_key(key);
        let record = || store.record(&store_key, entry, px);
        match self.store_call(&store_key, "record", record).await {
            StoreOutcome::Done(written) => {
                if !written {
                    tracing::debug!(throttle = %self.name, key = store_key, "window held by another owner; kept in memory only");
                }
                Instant::now() + px + self.courtesy()
            }
            StoreOutcome::Failed => Instant::now() + self.window,
        }
    }

    /// The end of a window that starts now, kept in memory only.
    pub(super) fn window_end(&self) -> Instant {
        self.clock.now() + self.window
    }

    /// How long after its window ends an instance re-claims a key on a
    /// store other instances may share: an instance that lost the race waits
    /// for the same end (1 ms past it, at millisecond precision) and so
    /// claims first, instead of losing every race to a holder that always
    /// has calls pending. Only called with a store.
    fn courtesy(&self) -> Duration {
        Duration::from_millis(5)
    }

    /// The window in whole milliseconds, rounded up.
    fn window_px(&self) -> Duration {
        let ms = Duration::from_millis(u64::try_from(self.window.as_millis()).unwrap_or(u64::MAX));
        if ms < self.window {
            ms + Duration::from_millis(1)
        } else {
            ms
        }
    }
}
