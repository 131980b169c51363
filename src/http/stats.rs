//! [`HttpStats`]: what the layers answered, counted.

use std::sync::atomic::{AtomicU64, Ordering};

use serde::Serialize;

/// Counters of the HTTP layers: what they answered themselves, and how often the handler
/// ran or was replayed. Totals since the counters were made.
///
/// The idempotency layers of a runtime count into that runtime's [`Stats`](crate::Stats)
/// (`runtime.stats().http`, exported with the `metrics` feature as
/// `throttlebeam_http_*_total`); a [`RateLimitLayer`](super::RateLimitLayer) counts into
/// its own ([`RateLimitLayer::stats`](super::RateLimitLayer::stats)), or into a runtime's
/// with [`RateLimitLayer::with_stats_in`](super::RateLimitLayer::with_stats_in).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default, Serialize)]
#[non_exhaustive]
pub struct HttpStats {
    /// Guarded requests answered with a stored response (`idempotent-replayed: true`).
    pub replays: u64,
    /// Guarded requests whose handler ran (first requests, and retries of responses that
    /// were not stored).
    pub fresh: u64,
    /// 409: a duplicate found its key in flight (waited past the wait timeout, or failing
    /// fast).
    pub in_flight: u64,
    /// 422: a key reused for a different request.
    pub reused: u64,
    /// 413: a request body over the buffering limit.
    pub too_large: u64,
    /// 400: a bad `Idempotency-Key`, a missing required one, a scope over the limit, or a
    /// bad rate-limit key.
    pub invalid: u64,
    /// 429: over the rate limit.
    pub rate_limited: u64,
    /// Store failures: 503s of an unreachable idempotency store or runtime, and rate-limit
    /// store failures (passed when failing open, 503 when failing closed).
    pub store_failures: u64,
    /// 500: a rate limit keyed by client IP found no peer address.
    pub no_peer: u64,
}

/// What the layers bump.
#[derive(Debug, Default)]
pub(crate) struct HttpCounters {
    pub(crate) replays: AtomicU64,
    pub(crate) fresh: AtomicU64,
    pub(crate) in_flight: AtomicU64,
    pub(crate) reused: AtomicU64,
    pub(crate) too_large: AtomicU64,
    pub(crate) invalid: AtomicU64,
    pub(crate) rate_limited: AtomicU64,
    pub(crate) store_failures: AtomicU64,
    pub(crate) no_peer: AtomicU64,
}

/// Adds one to `counter`.
pub(crate) fn bump(counter: &AtomicU64) {
    counter.fetch_add(1, Ordering::Relaxed);
}

impl HttpCounters {
    pub(crate) fn snapshot(&self) -> HttpStats {
        let read = |c: &AtomicU64| c.load(Ordering::Relaxed);
        HttpStats {
            replays: read(&self.replays),
            fresh: read(&self.fresh),
            in_flight: read(&self.in_flight),
            reused: read(&self.reused),
            too_large: read(&self.too_large),
            invalid: read(&self.invalid),
            rate_limited: read(&self.rate_limited),
            store_failures: read(&self.store_failures),
            no_peer: read(&self.no_peer),
        }
    }
}

/// The runtime's HTTP counters, reported in its stats.
#[cfg(feature = "runtime")]
pub(crate) struct HttpService {
    pub(crate) counters: std::sync::Arc<HttpCounters>,
}

#[cfg(feature = "runtime")]
impl crate::runtime::Service for HttpService {
    fn stats(&self, stats: &mut crate::Stats) {
        stats.http = self.counters.snapshot();
    }
}

/// The HTTP counters of `runtime`, made on first use.
#[cfg(feature = "runtime")]
pub(crate) fn counters_of(runtime: &crate::Runtime) -> std::sync::Arc<HttpCounters> {
    let service = runtime.core.service(|_| HttpService {
        counters: std::sync::Arc::default(),
    });
    std::sync::Arc::clone(&service.counters)
}
