//! [`RateLimitLayer`]: per-client rate limiting for HTTP services, with the limit's headers
//! on every response.

mod future;
mod key;

use std::fmt;
use std::future::Future;
use std::num::NonZeroU32;
use std::pin::Pin;
use std::sync::Arc;
use std::task::{Context, Poll};

use bytes::Bytes;
use http::{Request, Response, StatusCode};
use tower_layer::Layer;
use tower_service::Service;

pub use self::future::RateLimitFuture;
pub use self::key::RateLimitKey;
use super::body::ResponseBody;
use super::problem::{ProblemType, problem_bytes};
use crate::rate_limit::{
    AsyncRateLimitStore, EnforceOutcome, Enforcement, Enforcer, RateLimitStore, Strategy,
    retry_after_secs,
};

pub(super) type PendingEnforcement = Pin<Box<dyn Future<Output = Enforcement> + Send + 'static>>;

/// An [`Enforcer`] of any strategy and store, behind one object.
trait Enforce: Send + Sync + 'static {
    /// The enforcement, when the store answers at once.
    fn enforce_now(&self, key: &str) -> Option<Enforcement>;

    /// The enforcement, from a store behind a network.
    fn enforce_later(self: Arc<Self>, key: String) -> PendingEnforcement;
}

struct Immediate<G: Strategy, St>(Enforcer<G, St>);

impl<G, St> Enforce for Immediate<G, St>
where
    G: Strategy + Send + Sync + 'static,
    St: RateLimitStore<G>,
{
    fn enforce_now(&self, key: &str) -> Option<Enforcement> {
        Some(self.0.enforce(key))
    }

    fn enforce_later(self: Arc<Self>, key: String) -> PendingEnforcement {
        Box::pin(std::future::ready(self.0.enforce(&key)))
    }
}

struct Remote<G: Strategy, St>(Enforcer<G, St>);

impl<G, St> Enforce for Remote<G, St>
where
    G: Strategy + Send + Sync + 'static,
    St: AsyncRateLimitStore<G>,
{
    fn enforce_now(&self, _key: &str) -> Option<Enforcement> {
        None
    }

    fn enforce_later(self: Arc<Self>, key: String) -> PendingEnforcement {
        Box::pin(async move { self.0.enforce_async(&key, NonZeroU32::MIN).await })
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
///
/// Requests are keyed by [`RateLimitKey`]: the client IP by default (the socket peer; see
/// [`RateLimitKey::client_ip`] for trusted proxies), a header, or a function.
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
    enforcer: Arc<dyn Enforce>,
    key: RateLimitKey,
}

impl fmt::Debug for RateLimitLayer {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("RateLimitLayer")
            .field("key", &self.key)
            .finish_non_exhaustive()
    }
}

impl RateLimitLayer {
    /// Enforces `enforcer`, whose store answers at once (the in-memory store), keyed by the
    /// client IP of the socket peer.
    pub fn new<G, St>(enforcer: Enforcer<G, St>) -> Self
    where
        G: Strategy + Send + Sync + 'static,
        St: RateLimitStore<G>,
    {
        Self {
            enforcer: Arc::new(Immediate(enforcer)),
            key: RateLimitKey::default(),
        }
    }

    /// Enforces `enforcer`, whose store is asynchronous (behind a network), keyed by the
    /// client IP of the socket peer.
    pub fn new_async<G, St>(enforcer: Enforcer<G, St>) -> Self
    where
        G: Strategy + Send + Sync + 'static,
        St: AsyncRateLimitStore<G>,
    {
        Self {
            enforcer: Arc::new(Remote(enforcer)),
            key: RateLimitKey::default(),
        }
    }

    /// Keys requests with `key`.
    pub fn with_key(self, key: RateLimitKey) -> Self {
        Self { key, ..self }
    }
}

impl<S> Layer<S> for RateLimitLayer {
    type Service = RateLimit<S>;

    fn layer(&self, inner: S) -> Self::Service {
        RateLimit {
            inner,
            enforcer: Arc::clone(&self.enforcer),
            key: self.key.clone(),
        }
    }
}

/// The service of [`RateLimitLayer`].
#[derive(Clone)]
pub struct RateLimit<S> {
    inner: S,
    enforcer: Arc<dyn Enforce>,
    key: RateLimitKey,
}

impl<S: fmt::Debug> fmt::Debug for RateLimit<S> {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("RateLimit")
            .field("inner", &self.inner)
            .field("key", &self.key)
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
        let (key, req) = self.key.key_of(req);
        match self.enforcer.enforce_now(key.as_str()) {
            Some(enforcement) => match RateLimitDenial::check(enforcement) {
                Ok(enforcement) => {
                    RateLimitFuture::calling(self.inner.call(req), enforcement.headers)
                }
                Err(denial) => RateLimitFuture::denied(denial),
            },
            None => {
                let pending = Arc::clone(&self.enforcer).enforce_later(key.into_string());
                let clone = self.inner.clone();
                let inner = std::mem::replace(&mut self.inner, clone);
                RateLimitFuture::checking(pending, inner, req)
            }
        }
    }
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

    /// 429 when over the limit, 503 when the store failed.
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
