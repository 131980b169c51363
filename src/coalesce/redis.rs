//! [`WindowStore`] on Redis: the coalescing throttle's windows shared by
//! every instance, each operation one script call on the server's clock.

use std::time::{Duration, SystemTime, UNIX_EPOCH};

use crate::coalesce::{WindowClaim, WindowEntry, WindowStore, WindowStoreFuture};
use crate::store::redis::{HeldWindow, Redis};

/// The holder's entry with its end on this instance's wall clock: the
/// server's time left added to our now, so clock skew between instances
/// never shifts a retry.
fn local(held: HeldWindow) -> Option<WindowEntry> {
    let now_ms = SystemTime::now()
        .duration_since(UNIX_EPOCH)
        .map_or(0, |d| u64::try_from(d.as_millis()).unwrap_or(u64::MAX));
    let left = u64::try_from(held.left.as_millis()).unwrap_or(u64::MAX);
    held.token
        .map(|token| WindowEntry::new(now_ms.saturating_add(left), token))
}

impl WindowStore for Redis {
    fn claim<'a>(
        &'a self,
        key: &'a str,
        entry: WindowEntry,
        ttl: Duration,
    ) -> WindowStoreFuture<'a, WindowClaim> {
        Box::pin(async move {
            let held = self
                .window_claim(&self.key(key, ":w"), entry.token, ttl)
                .await?;
            Ok(match held {
                None => WindowClaim::Won,
                Some(held) => WindowClaim::Lost {
                    holder: local(held),
                },
            })
        })
    }

    fn extend<'a>(
        &'a self,
        key: &'a str,
        entry: WindowEntry,
        ttl: Duration,
    ) -> WindowStoreFuture<'a, bool> {
        Box::pin(async move {
            Ok(self
                .window_cas(&self.key(key, ":w"), entry.token, ttl)
                .await?)
        })
    }

    fn record<'a>(
        &'a self,
        key: &'a str,
        entry: WindowEntry,
        ttl: Duration,
    ) -> WindowStoreFuture<'a, bool> {
        Box::pin(async move {
            Ok(self
                .window_cas(&self.key(key, ":w"), entry.token, ttl)
                .await?)
        })
    }

    fn read<'a>(&'a self, key: &'a str) -> WindowStoreFuture<'a, Option<WindowEntry>> {
        Box::pin(async move {
            Ok(self
                .window_read(&self.key(key, ":w"))
                .await?
                .and_then(local))
        })
    }

    /// A shared store keeps its keys: they expire on their own.
    fn clear(&self) -> WindowStoreFuture<'_, ()> {
        Box::pin(async { Ok(()) })
    }
}
