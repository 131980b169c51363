//! Tower layers for HTTP services (feature `http`): [`IdempotencyLayer`] (also needs the
//! `runtime` feature) runs requests that carry an `Idempotency-Key` once and replays them,
//! [`RateLimitLayer`] (the tower crates only, no runtime) limits clients and writes the
//! limit's headers. Both are tower layers: one line in axum (`Router::layer`, or
//! `route_layer` on one route) and in hyper (through `tower::ServiceBuilder`).
//!
//! | situation | status |
//! |---|---|
//! | a repeat of a stored response (same key, method, path, query, body) | the stored status, with `idempotent-replayed: true` |
//! | key reused with a different method, path, query or body | 422 |
//! | a duplicate waited past the wait timeout, or found the key in flight when failing fast | 409 |
//! | key empty, over 255 bytes, or several `Idempotency-Key` headers; no key when required | 400 |
//! | request body over the buffering limit | 413 |
//! | the handler answered 5xx, or a 4xx saying the attempt was not processed (400, 409, 415, 422, 429, …) | passed on, not stored: the retry runs again (see [`IdempotencyLayer::stores_by_default`]) |
//! | the response has trailers, or is gRPC | passed on with its trailers, not stored |
//! | rate limit keyed by client IP, no peer address | 500 naming the fix, unless [`RateLimitLayer::with_shared_bucket_without_peer`] |
//! | idempotency store or runtime unavailable | 503 |
//! | over the rate limit | 429 with `Retry-After` |
//! | rate-limit store failed | passes (fail open) or 503 (fail closed) |
//!
//! Every answer a layer makes itself is an `application/problem+json` document (RFC 9457)
//! with a stable `type` ([`ProblemType`]).
//!
//! # Examples
//!
//! ```
//! # #[tokio::main(flavor = "current_thread")] async fn main() -> Result<(), Box<dyn std::error::Error>> {
//! use std::net::SocketAddr;
//! use std::time::Duration;
//! use axum::{Router, routing::post};
//! use throttlebeam::Runtime;
//! use throttlebeam::http::{IdempotencyLayer, RateLimitLayer};
//! use throttlebeam::rate_limit::{Enforcer, Gcra, Limiter};
//!
//! let runtime = Runtime::start().await?;
//! let limiter = Limiter::new(Gcra::new(10, Duration::from_secs(1))?);
//! let app: Router = Router::new()
//!     .route("/payments", post(|body: String| async move { format!("charged {body}") }))
//!     .layer(IdempotencyLayer::new(&runtime))
//!     .layer(RateLimitLayer::new(Enforcer::new(limiter)));
//!
//! // The rate limit keys by client IP: serve with the peer address.
//! let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await?;
//! let server = axum::serve(listener, app.into_make_service_with_connect_info::<SocketAddr>());
//! # drop(server);
//! # Ok(()) }
//! ```

mod body;
#[cfg(feature = "runtime")]
mod error;
#[cfg(feature = "runtime")]
mod idempotency;
mod problem;
mod rate_limit;
mod stats;

pub use self::body::{BodyError, RequestBody, ResponseBody};
#[cfg(feature = "runtime")]
#[cfg_attr(docsrs, doc(cfg(feature = "runtime")))]
pub use self::error::ConfigError;
#[cfg(feature = "runtime")]
#[cfg_attr(docsrs, doc(cfg(feature = "runtime")))]
pub use self::idempotency::{
    IDEMPOTENT_REPLAYED, IdempotencyLayer, IdempotencyLayerBuilder, Idempotent, IdempotentFuture,
};
#[cfg(all(feature = "runtime", feature = "postgres"))]
#[cfg_attr(docsrs, doc(cfg(feature = "postgres")))]
pub use self::idempotency::{MissingTransaction, PgTransaction, TransactionClient};
pub use self::problem::{PROBLEM_JSON, ProblemType};
pub use self::rate_limit::{
    RateLimit, RateLimitDenial, RateLimitFuture, RateLimitKey, RateLimitLayer,
};
pub use self::stats::HttpStats;
