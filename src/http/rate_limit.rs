//! [`RateLimitLayer`]: per-client rate limiting for HTTP services, with the limit's headers
//! on every response.

mod future;
mod key;

use std::any::Any;
use std::fmt;
use std::future::Future;
use std::num::NonZeroU32;
use std::pin::Pin;
use std::sync::Arc;
use std::sync::atomic::{AtomicBool, Ordering};
use std::task::{Context, Poll};

use bytes::Bytes;
use http::{Request, Response, StatusCode};
use tower_layer::Layer;
use tower_service::Service;

pub use self::future::RateLimitFuture;
use self::key::KeyText;
pub use self::key::RateLimitKey;
use super::body::ResponseBody;
use super::problem::{ProblemType, problem_bytes};
use super::stats::{HttpCounters, HttpStats, bump};
use crate::rate_limit::{
    AsyncRateLimitStore, EnforceOutcome, Enforcement, Enforcer, MemoryRateLimitStore, Strategy,
    retry_after_secs,
};

pub(super) type PendingEnforcement = Pin<Box<dyn Future<Output = Enforcement> + Send + 'static>>;

/// An [`Enforcer`] of any strategy and store, behind one object.
trait Enforce: Send + Sync + 'static {
    /// The enforcement, when the store answers at once.
    fn enforce_now(&self, key: &str) -> Option<Enforcement>;

    /// The enforcement, from a store behind a network, counted in `counters`.
    fn enforce_later(
        self: Arc<Self>,
        key: String,
        counters: Arc<HttpCounters>,
    ) -> PendingEnforcement;
}

/// An [`Enforcer`] over any store.
struct Layered<G: Strategy, St>(Enforcer<G, St>);

impl<G, St> Enforce for Layered<G, St>
where
    G: Strategy + Send + Sync + 'static,
    St: AsyncRateLimitStore<G>,
{
    fn enforce_now(&self, key: &str) -> Option<Enforcement> {
        // The memory store answers in the call: no future to build or box. (The type test is
        // a constant once monomorphized.)
        let any: &dyn Any = &self.0;
        any.downcast_ref::<Enforcer<G, MemoryRateLimitStore<G::State>>>()
            .map(|memory| memory.enforce(key))
    }

    fn enforce_later(
        self: Arc<Self>,
        key: String,
        counters: Arc<HttpCounters>,
    ) -> PendingEnforcement {
        Box::pin(async move {
            let enforcement = self.0.enforce_async(&key, NonZeroU32::MIN).await;
            count(&counters, &enforcement);
            enforcement
        })
    }
}

/// Limits requests per client with any [`Enforcer`] (any strategy, any store), and writes
/// the enforcer's rate-limit headers on every response, allowed or denied.
///
/// | situation | answer |
/// |---|---|
/// | allowed | the inner service's response, plus the configured headers (draft `RateLimit-*` by default) |
/// | over the limit | 429 with `Retry-After` (whole seconds), the headers, and an `application/problem+json` body |
/// | store failed, [`FailMode::Open`](crate::rate_limit::FailMode::Open) | passes, without rate-limit headers (nothing is known) |
/// | store failed, [`FailMode::Closed`](crate::rate_limit::FailMode::Closed) | 503, `application/problem+json` |
/// | keyed by client IP and the request has no peer address | 500 naming the fix (logged once at error), or one shared bucket with [`with_shared_bucket_without_peer`](Self::with_shared_bucket_without_peer) |
///
/// Requests are keyed by [`RateLimitKey`]: the client IP by default (the socket peer; see
/// [`RateLimitKey::client_ip`] for trusted proxies), a header, or a function. The client
/// IP needs the peer address: with axum, serve with
/// `into_make_service_with_connect_info::<SocketAddr>()`; with hyper, insert the peer's
/// `SocketAddr` into each request's extensions.
///
/// # Examples
///
/// ```
/// # #[tokio::main(flavor = "current_thread")] async fn main() -> Result<(), Box<dyn std::error::Error>> {
/// use std::convert::Infallible;
/// use std::time::Duration;
/// use bytes::Bytes;
/// use http::{Request, Response};
/// use http_body_util::Full;
/// use throttlebeam::http::{RateLimitKey, RateLimitLayer};
/// use throttlebeam::rate_limit::{Enforcer, Gcra, Limiter};
/// use tower::{ServiceBuilder, ServiceExt};
///
/// let limiter = Limiter::new(Gcra::new(1, Duration::from_secs(60))?);
/// let service = ServiceBuilder::new()
///     .layer(RateLimitLayer::new(Enforcer::new(limiter))
///         .with_key(RateLimitKey::header(http::HeaderName::from_static("x-api-key"))))
///     .service_fn(|_req: Request<Full<Bytes>>| async { Ok::<_, Infallible>(Response::new(Full::new(Bytes::new()))) });
///
/// let call = || Request::get("/").header("x-api-key", "k-1").body(Full::new(Bytes::new())).unwrap();
/// let allowed = service.clone().oneshot(call()).await?;
/// assert_eq!(allowed.headers()["ratelimit-remaining"], "0");
/// let denied = service.oneshot(call()).await?;
/// assert_eq!(denied.status(), 429);
/// assert_eq!(denied.headers()["retry-after"], "60");
/// # Ok(()) }
/// ```
#[derive(Clone)]
#[must_use]
pub struct RateLimitLayer {
    config: Arc<Config>,
}

#[derive(Clone)]
struct Config {
    enforcer: Arc<dyn Enforce>,
    key: RateLimitKey,
    /// Whether requests without a peer address share one bucket (instead of a 500).
    shared_without_peer: bool,
    /// Whether the missing peer address was logged (once per layer).
    warned: Arc<AtomicBool>,
    counters: Arc<HttpCounters>,
}

/// Counts what `enforcement` says of the request.
fn count(counters: &HttpCounters, enforcement: &Enforcement) {
    match enforcement.outcome {
        EnforceOutcome::Ok => {}
        EnforceOutcome::Limited => bump(&counters.rate_limited),
        EnforceOutcome::Invalid => bump(&counters.invalid),
        // Counted whether the request passed (failing open) or not.
        EnforceOutcome::Error => bump(&counters.store_failures),
        _ => {}
    }
}

impl fmt::Debug for RateLimitLayer {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("RateLimitLayer")
            .field("key", &self.config.key)
            .field("shared_without_peer", &self.config.shared_without_peer)
            .finish_non_exhaustive()
    }
}

impl RateLimitLayer {
    /// Enforces `enforcer`, over any store: in memory, behind a network (`store::Redis`,
    /// feature `redis`) or your own, keyed by the client IP of the socket peer.
    ///
    /// The in-memory store is asked in the request's own call, with no future built; any
    /// other store is awaited before the inner service is called.
    ///
    /// # Examples
    ///
    /// One limit shared by every instance through the runtime's Redis when the environment
    /// names one (`THROTTLEBEAM_REDIS_URL`), each instance's own in memory otherwise. The
    /// runtime connects in the background: until Redis answers, requests get the enforcer's
    /// fail mode (open by default: passed, without rate-limit headers), never a limit kept
    /// in memory. (`runtime.redis()` is `None` until then: a store picked by it would stay in
    /// memory for good.)
    ///
    /// ```no_run
    /// # #[cfg(feature = "redis")]
    /// # async fn demo() -> Result<(), Box<dyn std::error::Error>> {
    /// use std::time::Duration;
    /// use throttlebeam::Runtime;
    /// use throttlebeam::http::RateLimitLayer;
    /// use throttlebeam::rate_limit::{Enforcer, Gcra, Limiter};
    ///
    /// let runtime = Runtime::builder().with_redis_from_env().start().await?;
    /// let limiter = Limiter::builder(Gcra::new(100, Duration::from_secs(60))?)
    ///     .with_runtime_store(&runtime)
    ///     .build();
    /// let layer = RateLimitLayer::new(Enforcer::new(limiter));
    /// # let _ = layer;
    /// # Ok(()) }
    /// ```
    pub fn new<G, St>(enforcer: Enforcer<G, St>) -> Self
    where
        G: Strategy + Send + Sync + 'static,
        St: AsyncRateLimitStore<G>,
    {
        Self::with_enforcer(Arc::new(Layered(enforcer)))
    }

    /// [`RateLimitLayer::new`], which now takes any store.
    #[deprecated(since = "0.2.0", note = "`RateLimitLayer::new` takes any store")]
    pub fn new_async<G, St>(enforcer: Enforcer<G, St>) -> Self
    where
        G: Strategy + Send + Sync + 'static,
        St: AsyncRateLimitStore<G>,
    {
        Self::new(enforcer)
    }

    fn with_enforcer(enforcer: Arc<dyn Enforce>) -> Self {
        Self {
            config: Arc::new(Config {
                enforcer,
                key: RateLimitKey::default(),
                shared_without_peer: false,
                warned: Arc::default(),
                counters: Arc::default(),
            }),
        }
    }

    fn map(self, f: impl FnOnce(&mut Config)) -> Self {
        let mut config = Arc::unwrap_or_clone(self.config);
        f(&mut config);
        Self {
            config: Arc::new(config),
        }
    }

    /// Keys requests with `key`.
    pub fn with_key(self, key: RateLimitKey) -> Self {
        self.map(|c| c.key = key)
    }

    /// Counts requests that have no peer address in one bucket shared by all of them,
    /// instead of refusing them with 500. Only for a service that cannot learn its peers
    /// and accepts that one busy client then limits every other: by default such requests
    /// get a 500 `application/problem+json` that names the fix (serve with
    /// `into_make_service_with_connect_info::<SocketAddr>()`), logged once at error.
    pub fn with_shared_bucket_without_peer(self) -> Self {
        self.map(|c| c.shared_without_peer = true)
    }

    /// Counts into `runtime`'s stats (`runtime.stats().http`, and its `metrics` export)
    /// instead of this layer's own.
    #[cfg(feature = "runtime")]
    #[cfg_attr(docsrs, doc(cfg(feature = "runtime")))]
    pub fn with_stats_in(self, runtime: &crate::Runtime) -> Self {
        let counters = super::stats::counters_of(runtime);
        self.map(|c| c.counters = counters)
    }

    /// What this layer answered so far: 429s, store failures, bad keys and missing peer
    /// addresses (the runtime's figures, with [`with_stats_in`](Self::with_stats_in)).
    #[must_use]
    pub fn stats(&self) -> HttpStats {
        self.config.counters.snapshot()
    }
}

impl<S> Layer<S> for RateLimitLayer {
    type Service = RateLimit<S>;

    fn layer(&self, inner: S) -> Self::Service {
        RateLimit {
            inner,
            config: Arc::clone(&self.config),
        }
    }
}

/// The service of [`RateLimitLayer`].
#[derive(Clone)]
pub struct RateLimit<S> {
    inner: S,
    config: Arc<Config>,
}

impl<S: fmt::Debug> fmt::Debug for RateLimit<S> {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("RateLimit")
            .field("inner", &self.inner)
            .field("key", &self.config.key)
            .finish_non_exhaustive()
    }
}

impl<S, ReqB, ResB> Service<Request<ReqB>> for RateLimit<S>
where
    S: Service<Request<ReqB>, Response = Response<ResB>> + Clone + Send + 'static,
    ReqB: Send + 'static,
{
    type Response = Response<ResponseBody<ResB>>;
    type Error = S::Error;
    type Future = RateLimitFuture<S, ReqB>;

    fn poll_ready(&mut self, cx: &mut Context<'_>) -> Poll<Result<(), Self::Error>> {
        self.inner.poll_ready(cx)
    }

    fn call(&mut self, req: Request<ReqB>) -> Self::Future {
        let config = &*self.config;
        let (key, req) = config.key.key_of(req);
        let key = match key {
            Some(key) => key,
            None if config.shared_without_peer => KeyText::Unknown,
            None => {
                bump(&config.counters.no_peer);
                return RateLimitFuture::refused(no_peer(config));
            }
        };
        match config.enforcer.enforce_now(key.as_str()) {
            Some(enforcement) => match RateLimitDenial::check({
                count(&config.counters, &enforcement);
                enforcement
            }) {
                Ok(enforcement) => {
                    RateLimitFuture::calling(self.inner.call(req), enforcement.headers)
                }
                Err(denial) => RateLimitFuture::denied(denial),
            },
            None => {
                let pending = Arc::clone(&config.enforcer)
                    .enforce_later(key.into_string(), Arc::clone(&config.counters));
                let clone = self.inner.clone();
                let inner = std::mem::replace(&mut self.inner, clone);
                RateLimitFuture::checking(pending, inner, req)
            }
        }
    }
}

/// The answer to a request keyed by client IP that has no peer address, logged once per
/// layer.
fn no_peer(config: &Config) -> Response<Bytes> {
    if !config.warned.swap(true, Ordering::Relaxed) {
        tracing::error!(
            "rate limit: a request has no peer address, so its client IP is unknown; serve \
             with `into_make_service_with_connect_info::<SocketAddr>()` (axum) or insert the \
             peer's `SocketAddr` into each request's extensions (hyper), or call \
             `RateLimitLayer::with_shared_bucket_without_peer`; answering 500 until then \
             (logged once)"
        );
    }
    problem_bytes(
        ProblemType::ClientAddressUnavailable,
        "the client address is unavailable: the server must be served with \
         `into_make_service_with_connect_info::<SocketAddr>()` (axum) or record the peer's \
         `SocketAddr` in each request's extensions (hyper)",
    )
}

/// A request the rate limit turned away: over the limit (429), or the store failed and the
/// policy is to refuse (503). Usable directly as a response: [`RateLimitDenial::into_response`],
/// or, with the `axum` feature, as an `axum::response::IntoResponse` (return it from a
/// handler that enforces by hand).
///
/// # Examples
///
/// ```
/// use std::time::Duration;
/// use throttlebeam::http::RateLimitDenial;
/// use throttlebeam::rate_limit::{Enforcer, Gcra, Limiter};
///
/// let enforcer = Enforcer::new(Limiter::new(Gcra::new(1, Duration::from_secs(10))?));
/// assert!(RateLimitDenial::check(enforcer.enforce("alice")).is_ok());
/// let denial = RateLimitDenial::check(enforcer.enforce("alice")).unwrap_err();
/// let response = denial.into_response();
/// assert_eq!(response.status(), 429);
/// assert_eq!(response.headers()["retry-after"], "10");
/// assert_eq!(response.headers()["content-type"], "application/problem+json");
/// # Ok::<(), throttlebeam::rate_limit::RateLimitError>(())
/// ```
#[derive(Debug, Clone)]
pub struct RateLimitDenial {
    enforcement: Enforcement,
}

impl RateLimitDenial {
    /// `Ok(enforcement)` when the request may proceed, the denial otherwise: a handler that
    /// enforces by hand writes `RateLimitDenial::check(enforcer.enforce(key))?`.
    ///
    /// # Errors
    ///
    /// The denial, when `enforcement` does not allow the request.
    #[allow(clippy::result_large_err)]
    pub fn check(enforcement: Enforcement) -> Result<Enforcement, Self> {
        if enforcement.allowed {
            Ok(enforcement)
        } else {
            Err(Self { enforcement })
        }
    }

    /// 429 when over the limit, 503 when the store failed, 400 for a bad key, 500 when the
    /// limit can never admit the request (the server's configuration).
    #[must_use]
    pub fn status(&self) -> StatusCode {
        self.kind().status()
    }

    /// The enforcement that denied the request.
    #[must_use]
    pub fn enforcement(&self) -> &Enforcement {
        &self.enforcement
    }

    fn kind(&self) -> ProblemType {
        match self.enforcement.outcome {
            EnforceOutcome::Error => ProblemType::RateLimitUnavailable,
            EnforceOutcome::Invalid => ProblemType::RateLimitKeyInvalid,
            EnforceOutcome::Misconfigured => ProblemType::RateLimitMisconfigured,
            _ => ProblemType::RateLimited,
        }
    }

    /// The response: the status, the rate-limit headers (with `Retry-After` when limited),
    /// and an `application/problem+json` body.
    #[must_use]
    pub fn into_response(self) -> Response<Bytes> {
        let kind = self.kind();
        let detail = match (kind, self.enforcement.decision) {
            (ProblemType::RateLimited, Some(decision)) => format!(
                "rate limit exceeded; retry after {} s",
                retry_after_secs(&decision)
            ),
            (ProblemType::RateLimitKeyInvalid, _) => {
                "the rate-limit key taken from this request is empty or over 1024 bytes".to_owned()
            }
            (ProblemType::RateLimited, None) => "rate limit exceeded".to_owned(),
            (ProblemType::RateLimitMisconfigured, _) => {
                "the rate limit configured for this request can never admit it".to_owned()
            }
            _ => "the rate limiter cannot decide now".to_owned(),
        };
        let mut response = problem_bytes(kind, &detail);
        response.headers_mut().extend(self.enforcement.headers);
        response
    }
}

impl std::fmt::Display for RateLimitDenial {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match (self.kind(), self.enforcement.decision) {
            (ProblemType::RateLimited, Some(d)) => {
                write!(f, "rate limited, retry after {} ms", d.retry_after_ms)
            }
            _ => f.write_str("rate limiter unavailable, request refused"),
        }
    }
}

impl std::error::Error for RateLimitDenial {}

#[cfg(feature = "axum")]
impl axum::response::IntoResponse for RateLimitDenial {
    fn into_response(self) -> axum::response::Response {
        RateLimitDenial::into_response(self).map(axum::body::Body::from)
    }
}

#[cfg(test)]
mod tests {
    use std::convert::Infallible;
    use std::io::Write;
    use std::sync::Mutex;
    use std::time::Duration;

    use http_body_util::Full;
    use tower::{ServiceExt, service_fn};

    use super::*;
    use crate::rate_limit::{Gcra, Limiter};

    /// Log lines written while a test runs.
    #[derive(Clone, Default)]
    struct Lines(Arc<Mutex<Vec<u8>>>);

    impl Write for Lines {
        fn write(&mut self, buf: &[u8]) -> std::io::Result<usize> {
            self.0.lock().unwrap().extend_from_slice(buf);
            Ok(buf.len())
        }

        fn flush(&mut self) -> std::io::Result<()> {
            Ok(())
        }
    }

    #[tokio::test]
    async fn a_missing_peer_address_is_logged_once_at_error() {
        let lines = Lines::default();
        let writer = lines.clone();
        let subscriber = tracing_subscriber::fmt()
            .with_writer(move || writer.clone())
            .with_ansi(false)
            .finish();
        let _guard = tracing::subscriber::set_default(subscriber);

        let limiter = Limiter::new(Gcra::new(10, Duration::from_secs(1)).unwrap());
        let service = RateLimitLayer::new(Enforcer::new(limiter)).layer(service_fn(
            |_req: Request<Full<Bytes>>| async {
                Ok::<_, Infallible>(Response::new(Full::new(Bytes::new())))
            },
        ));
        for _ in 0..3 {
            let response = service
                .clone()
                .oneshot(Request::new(Full::new(Bytes::new())))
                .await
                .unwrap();
            assert_eq!(response.status(), StatusCode::INTERNAL_SERVER_ERROR);
        }
        let text = String::from_utf8(lines.0.lock().unwrap().clone()).unwrap();
        assert_eq!(text.matches("has no peer address").count(), 1, "{text}");
        assert!(text.contains("ERROR"), "{text}");
    }
}
