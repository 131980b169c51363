//! Idempotency through the runtime's Redis backend, which may not be
//! connected yet: fails closed until it is.

use std::time::Duration;

use super::{
    ClaimReply, ClaimRequest, ClaimToken, IdempotencyStore, IdempotencyStoreFuture, KeyChanged,
    StoredResult,
};
use crate::runtime::Backend;
use crate::store::StoreError;

/// Why a call found the backend not connected yet.
#[derive(Debug, thiserror::Error)]
#[error("redis is not connected yet (unreachable at start; connecting in the background)")]
struct NotConnected;

/// Idempotency through a backend that may not be connected yet: fails
/// closed until it is.
pub(super) struct BackendStore(pub(super) Backend);

fn not_connected<'a, T: Send + 'a>() -> IdempotencyStoreFuture<'a, T> {
    Box::pin(std::future::ready(Err(StoreError::unavailable(
        NotConnected,
    ))))
}

impl IdempotencyStore for BackendStore {
    fn claim<'a>(
        &'a self,
        key: &'a str,
        request: ClaimRequest<'a>,
    ) -> IdempotencyStoreFuture<'a, ClaimReply> {
        match self.0.get() {
            Some(redis) => redis.claim(key, request),
            None => not_connected(),
        }
    }

    fn complete<'a>(
        &'a self,
        key: &'a str,
        token: ClaimToken,
        result: &'a StoredResult,
        ttl: Duration,
    ) -> IdempotencyStoreFuture<'a, bool> {
        match self.0.get() {
            Some(redis) => redis.complete(key, token, result, ttl),
            None => not_connected(),
        }
    }

    fn release<'a>(&'a self, key: &'a str, token: ClaimToken) -> IdempotencyStoreFuture<'a, bool> {
        match self.0.get() {
            Some(redis) => redis.release(key, token),
            None => not_connected(),
        }
    }

    fn renew<'a>(
        &'a self,
        key: &'a str,
        token: ClaimToken,
        lease: Duration,
    ) -> IdempotencyStoreFuture<'a, bool> {
        match self.0.get() {
            Some(redis) => redis.renew(key, token, lease),
            None => not_connected(),
        }
    }

    fn name(&self) -> &'static str {
        "redis"
    }

    fn watch(&self, key: &str) -> KeyChanged {
        match self.0.get() {
            Some(redis) => IdempotencyStore::watch(redis, key),
            None => KeyChanged::never(),
        }
    }
}
