//! Tower layers for HTTP services (feature `http`): [`IdempotencyLayer`] runs requests that
//! carry an `Idempotency-Key` once and replays them, [`RateLimitLayer`] limits clients and
//! writes the limit's headers. Both work with one line in axum (`Router::layer`), hyper
//! (through `tower::ServiceBuilder`) and tonic.
//!
//! | situation | status |
//! |---|---|
//! | a repeat of a completed request (same key, method, path, query, body) | the stored status, with `idempotent-replayed: true` |
//! | key reused with a different method, path, query or body | 422 |
//! | a duplicate waited past the wait timeout, or found the key in flight when failing fast | 409 |
//! | key empty, over 255 bytes, or several `Idempotency-Key` headers; no key when required | 400 |
//! | request body over the buffering limit | 413 |
//! | the handler answered 5xx | passed on, not stored: the retry runs again |
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
//! # let _ = app;
//! # Ok(()) }
//! ```

mod body;
mod error;
mod idempotency;
mod problem;
mod rate_limit;

pub use self::body::{BodyError, RequestBody, ResponseBody};
pub use self::error::ConfigError;
pub use self::idempotency::{
    IDEMPOTENT_REPLAYED, IdempotencyLayer, IdempotencyLayerBuilder, Idempotent, IdempotentFuture,
};
pub use self::problem::{PROBLEM_JSON, ProblemType};
pub use self::rate_limit::{
    RateLimit, RateLimitDenial, RateLimitFuture, RateLimitKey, RateLimitLayer,
};
