//! The runtime's Redis backend: given connected, or connecting in the
//! background until the server answers.
//!
//! A runtime configured with Redis never silently stops sharing: while the
//! backend is not connected yet, idempotency fails closed
//! ([`StoreError::Unavailable`], so the caller sees
//! [`Error::StoreUnavailable`](crate::Error::StoreUnavailable)) and the
//! throttles and debounce decide per instance (fail open), as during an
//! outage; a task keeps connecting, and once it succeeds every primitive
//! shares through Redis again. The task runs on a tokio runtime of a caller
//! (the one that started the runtime first); if that runtime ends before the
//! task connected, the next call that needs Redis starts it again on its own.

use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Arc, OnceLock, Weak};
use std::time::Duration;

use crate::idempotency::{
    ClaimReply, ClaimRequest, ClaimToken, IdempotencyStore, IdempotencyStoreFuture, KeyChanged,
    StoredResult,
};
use crate::store::{Redis, RedisBuilder, StoreError};

/// The first pause between two connection attempts.
const FIRST_PAUSE: Duration = Duration::from_millis(100);
/// The longest pause between two connection attempts.
const MAX_PAUSE: Duration = Duration::from_secs(2);

/// A runtime's Redis backend (a cheap handle).
#[derive(Clone)]
pub(crate) struct Backend(Arc<Inner>);

struct Inner {
    redis: OnceLock<Redis>,
    /// How to connect, for a backend not given connected.
    builder: Option<RedisBuilder>,
    /// Whether a task is connecting now.
    connecting: AtomicBool,
    /// The runtime shut down: stop connecting.
    closed: AtomicBool,
}

/// Why a call found the backend not connected yet.
#[derive(Debug, thiserror::Error)]
#[error("redis is not connected yet (unreachable at start; connecting in the background)")]
struct NotConnected;

impl Backend {
    /// A backend already connected.
    pub(crate) fn connected(redis: Redis) -> Self {
        let backend = Self::new(None);
        let _ = backend.0.redis.set(redis);
        backend
    }

    /// A backend that connects with `builder` in the background (see
    /// [`Backend::kick`]).
    pub(crate) fn connecting(builder: RedisBuilder) -> Self {
        Self::new(Some(builder))
    }

    fn new(builder: Option<RedisBuilder>) -> Self {
        Self(Arc::new(Inner {
            redis: OnceLock::new(),
            builder,
            connecting: AtomicBool::new(false),
            closed: AtomicBool::new(false),
        }))
    }

    /// The connected backend; `None` (and a connection attempt started if
    /// none runs) while not connected yet.
    #[inline]
    pub(crate) fn get(&self) -> Option<&Redis> {
        match self.0.redis.get() {
            Some(redis) => Some(redis),
            None => {
                self.kick();
                None
            }
        }
    }

    /// Starts connecting on the current tokio runtime, unless connected,
    /// shut down, outside a tokio runtime or already connecting.
    pub(crate) fn kick(&self) {
        let inner = &self.0;
        let Some(builder) = &inner.builder else {
            return;
        };
        if inner.redis.get().is_some()
            || inner.closed.load(Ordering::Acquire)
            || inner.connecting.load(Ordering::Acquire)
        {
            return;
        }
        let Ok(runtime) = tokio::runtime::Handle::try_current() else {
            return;
        };
        if inner.connecting.swap(true, Ordering::AcqRel) {
            return;
        }
        let guard = Connecting(Arc::downgrade(inner));
        runtime.spawn(connect(guard, builder.clone()));
    }

    /// The runtime shut down: no more connection attempts.
    pub(crate) fn close(&self) {
        self.0.closed.store(true, Ordering::Release);
    }
}

/// Marks the backend connecting while alive: a connecting task dropped
/// unfinished (its tokio runtime ended) lets the next call start another.
struct Connecting(Weak<Inner>);

impl Drop for Connecting {
    fn drop(&mut self) {
        if let Some(inner) = self.0.upgrade() {
            inner.connecting.store(false, Ordering::Release);
        }
    }
}

/// Connects with `builder` until it succeeds, the runtime shuts down or is
/// dropped, backing off from [`FIRST_PAUSE`] to [`MAX_PAUSE`].
async fn connect(guard: Connecting, builder: RedisBuilder) {
    let mut pause = FIRST_PAUSE;
    let mut failures = 0_u64;
    loop {
        let attempt = builder.clone().connect().await;
        let Some(inner) = guard.0.upgrade() else {
            return;
        };
        if inner.closed.load(Ordering::Acquire) {
            return;
        }
        match attempt {
            Ok(redis) => {
                let _ = inner.redis.set(redis);
                tracing::info!(
                    failures,
                    "redis connected: idempotency, throttles and debounce share through it again"
                );
                return;
            }
            Err(error) => {
                failures += 1;
                let lasting = matches!(error, StoreError::Config(_) | StoreError::Auth(_));
                let error: &(dyn std::error::Error + 'static) = &error;
                if failures == 1 && lasting {
                    tracing::error!(
                        error,
                        "redis refuses this configuration (a bad URL or certificate, refused \
                         credentials): until it changes, idempotency fails closed \
                         (StoreUnavailable) and throttles and debounce decide per instance; \
                         retrying in the background"
                    );
                } else if failures == 1 {
                    tracing::warn!(
                        error,
                        "redis is unreachable: until it connects, idempotency fails closed \
                         (StoreUnavailable) and throttles and debounce decide per instance; \
                         connecting in the background"
                    );
                } else {
                    tracing::debug!(error, failures, "redis still unreachable; retrying");
                }
            }
        }
        drop(inner);
        tokio::time::sleep(pause).await;
        pause = (pause * 2).min(MAX_PAUSE);
    }
}

/// Idempotency through a backend that may not be connected yet: fails
/// closed until it is.
pub(crate) struct BackendStore(pub(crate) Backend);

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

    fn watch(&self, key: &str) -> KeyChanged {
        match self.0.get() {
            Some(redis) => IdempotencyStore::watch(redis, key),
            None => KeyChanged::never(),
        }
    }
}
