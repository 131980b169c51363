//! The shared debounce's seam to a store that several instances share: the
//! operations on one key's burst record, and who hears the notices.
//!
//! The data it speaks in ([`BurstJoined`], [`BurstState`], the notices)
//! is defined beside the Redis scripts that produce it, in `redis.rs`.

use std::future::Future;
use std::pin::Pin;
use std::sync::Weak;
use std::time::Duration;

use super::redis::{BurstJoined, BurstListener, BurstState};
use crate::store::StoreError;
use crate::store::redis::Redis;

/// A boxed store operation.
pub(crate) type BurstFuture<'a, T> =
    Pin<Box<dyn Future<Output = Result<T, StoreError>> + Send + 'a>>;

/// A store where debounce bursts are shared by every instance (Redis).
pub(crate) trait BurstStore: Send + Sync + 'static {
    /// Registers who hears this store's debounce notices (held weakly).
    fn listen_bursts(&self, listener: Weak<dyn BurstListener>);

    /// Makes sure the notices are being listened for.
    fn subscribe(&self);

    /// Joins (or opens) the burst of `key` with one call.
    fn burst_call<'a>(
        &'a self,
        key: &'a str,
        instance: &'a str,
        call: &'a str,
        delay: Duration,
        max_wait: Option<Duration>,
        leading: bool,
    ) -> BurstFuture<'a, BurstJoined>;

    /// Fires the burst if it is due and the caller owns it, or reports
    /// where it stands.
    #[allow(clippy::too_many_arguments)]
    fn burst_fire<'a>(
        &'a self,
        key: &'a str,
        instance: &'a str,
        burst: &'a str,
        generation: u64,
        force: bool,
        max_wait: Option<Duration>,
        rescue: Option<Duration>,
    ) -> BurstFuture<'a, BurstState>;

    /// Where the burst stands, changing nothing.
    fn burst_probe<'a>(&'a self, key: &'a str, burst: &'a str) -> BurstFuture<'a, BurstState>;

    /// Renews a running burst's lease.
    fn burst_renew<'a>(&'a self, key: &'a str, burst: &'a str) -> BurstFuture<'a, bool>;

    /// Stores a burst's outcome and tells every instance.
    fn burst_publish<'a>(
        &'a self,
        key: &'a str,
        burst: &'a str,
        outcome: Vec<u8>,
    ) -> BurstFuture<'a, ()>;

    /// Cancels the open burst of `key`; the burst cancelled, if any.
    fn burst_cancel<'a>(&'a self, key: &'a str) -> BurstFuture<'a, Option<String>>;

    /// Makes the open burst of `key` due now; whether there was one.
    fn burst_flush<'a>(&'a self, key: &'a str) -> BurstFuture<'a, bool>;
}

impl BurstStore for Redis {
    fn listen_bursts(&self, listener: Weak<dyn BurstListener>) {
        Redis::listen_bursts(self, listener);
    }

    fn subscribe(&self) {
        Redis::keep_listening_for_bursts(self);
    }

    fn burst_call<'a>(
        &'a self,
        key: &'a str,
        instance: &'a str,
        call: &'a str,
        delay: Duration,
        max_wait: Option<Duration>,
        leading: bool,
    ) -> BurstFuture<'a, BurstJoined> {
        Box::pin(Redis::burst_call(
            self, key, instance, call, delay, max_wait, leading,
        ))
    }

    fn burst_fire<'a>(
        &'a self,
        key: &'a str,
        instance: &'a str,
        burst: &'a str,
        generation: u64,
        force: bool,
        max_wait: Option<Duration>,
        rescue: Option<Duration>,
    ) -> BurstFuture<'a, BurstState> {
        Box::pin(Redis::burst_fire(
            self, key, instance, burst, generation, force, max_wait, rescue,
        ))
    }

    fn burst_probe<'a>(&'a self, key: &'a str, burst: &'a str) -> BurstFuture<'a, BurstState> {
        Box::pin(Redis::burst_probe(self, key, burst))
    }

    fn burst_renew<'a>(&'a self, key: &'a str, burst: &'a str) -> BurstFuture<'a, bool> {
        Box::pin(Redis::burst_renew(self, key, burst))
    }

    fn burst_publish<'a>(
        &'a self,
        key: &'a str,
        burst: &'a str,
        outcome: Vec<u8>,
    ) -> BurstFuture<'a, ()> {
        Box::pin(Redis::burst_publish(self, key, burst, outcome))
    }

    fn burst_cancel<'a>(&'a self, key: &'a str) -> BurstFuture<'a, Option<String>> {
        Box::pin(Redis::burst_cancel(self, key))
    }

    fn burst_flush<'a>(&'a self, key: &'a str) -> BurstFuture<'a, bool> {
        Box::pin(Redis::burst_flush(self, key))
    }
}
