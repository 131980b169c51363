//! Keyed debounce, throttle, rate limiting and idempotency for async Rust,
//! on an actor-per-key runtime modeled on Erlang/OTP.
//!
//! ```
//! # #[tokio::main(flavor = "current_thread")] async fn main() -> Result<(), throttlebeam::Error> {
//! use std::time::Duration;
//! use throttlebeam::{Debounce, Throttle, ThrottleOutcome};
//!
//! // Debounce: runs once, 50 ms after the last call for the key.
//! let saved = Debounce::call("autosave:doc-9", Duration::from_millis(50), || async {
//!     Ok::<_, std::io::Error>("saved")
//! })?;
//! assert_eq!(saved.await?, "saved");
//!
//! // Throttle: runs now, or is turned away inside the window.
//! let sent = Throttle::call("email:user-42", Duration::from_secs(60), || async {
//!     Ok::<_, std::io::Error>(())
//! })
//! .await?;
//! assert!(matches!(sent, ThrottleOutcome::Executed(())));
//! # Ok(()) }
//! ```
//!
//! | primitive | what it does |
//! |---|---|
//! | [`Debounce`] / [`DebounceHandle`] | run once a key has been quiet for a delay; latest function wins; `max_wait`, leading edge, cancel, flush |
//! | [`Throttle`] / [`ThrottleHandle`] | leading edge: run now, or [`ThrottleOutcome::Throttled`] with the time left |
//! | [`Coalesce`] | leading + trailing throttle: calls in a window coalesce into one trailing run whose value every covered caller can await |
//! | [`Idempotency`] / [`IdempotencyHandle`] | run at most once per key; duplicates in flight wait and share the result (or fail fast with a retry hint); a live run is never taken over; results replayed for a TTL, capped |
//! | [`rate_limit`] | pure strategies (GCRA, token bucket, fixed and sliding window, leaky-bucket shaper), decisions, forecasts, the decision algebra, headers, an enforcer, client-IP and HMAC keys |
//! | `http` (feature `http`) | tower layers: `RateLimitLayer`, and `IdempotencyLayer` (`Idempotency-Key`; needs `runtime` too) |
//! | [`Runtime`] | the runtime: a default one that starts itself, or explicit instances a host can supervise |
//!
//! # Cargo features
//!
//! | feature | default | what it adds |
//! |---|---|---|
//! | `runtime` | yes | the actor-per-key runtime and its primitives (ractor, rmp-serde; bincode to read results stored by 0.2) |
//! | `http` | yes | rate-limit headers, the [`Enforcer`](rate_limit::Enforcer), client-IP and HMAC keys, and the `http` module: `RateLimitLayer` (on the tower crates only: no runtime, no ractor) and, with `runtime`, `IdempotencyLayer` |
//! | `tower` | no | the same as `http` (the layers' feature before 0.2) |
//! | `axum` | no | `IntoResponse` for a rate-limit denial and axum's `ConnectInfo` as the client address (implies `http`) |
//! | `redis` | no | `store::Redis`: Redis, Redis Cluster or a primary behind Sentinel as the shared engine, so throttles, debounce (`across_instances`), idempotency and rate limits agree across instances (implies `runtime`) |
//! | `redis-tls` | no | `redis` over TLS (`rediss://`), with a private CA and client certificates (rustls on ring) |
//! | `postgres` | no | `postgres::PostgresStore`: PostgreSQL as the shared idempotency store, with transactional runs that commit the effect and its record together (implies `runtime`) |
//! | `metrics` | no | `Runtime::export_metrics` through the `metrics` facade (implies `runtime`) |
//! | `test-util` | no | tokio's `test-util`, for tests of code that uses throttlebeam |
//! | `async-trait`, `cluster` | no | forward ractor's modes (imply `runtime`) |
//!
//! Rate limiting alone ([`rate_limit`], [`clock`]) builds with `default-features = false`;
//! `default-features = false, features = ["http"]` adds its HTTP helpers and `RateLimitLayer`,
//! still without ractor, rmp-serde and bincode.
//!
//! # How it works
//!
//! Every busy key gets a short-lived process (one tokio task) under a
//! partitioned dynamic supervisor, found through a per-runtime registry. It
//! owns the key's timer and runs its functions, then exits once the key is
//! idle. Hot paths never message a process: a throttled call, a debounce
//! reset and an idempotency replay are a registry lookup and a short-locked
//! update. A key whose throttle window is open with nothing running is a
//! timestamp in the registry, swept once expired.
//!
//! # Consistency
//!
//! In memory, decisions for one key are linearizable within one runtime
//! instance. Two runtimes in one process never share keys, unless they share
//! a store: a [`MemoryIdempotencyStore`](idempotency::MemoryIdempotencyStore) or, with the `redis` or `postgres`
//! feature, Redis or PostgreSQL (see the README's "Across instances" for what
//! holds across instances and what falls back to per-instance decisions when
//! the store is unreachable, and the repository's `ARCHITECTURE.md` for the
//! details).
//!
//! # Logging
//!
//! Events go through `tracing`; nothing is logged above debug level except a
//! per-key process crashing outside user code, a debounced run that failed
//! while nobody awaited it (warn), a failed trailing run (error), and, from the
//! HTTP layers and the rate-limit enforcer: a store failure (warn, with its
//! cause and what the fail policy does about it), a setting that cannot work
//! (error, naming it), and a rate limit keyed by client IP served without peer
//! addresses (error, once per layer).
//!
//! # Observability
//!
//! [`Runtime::stats`] returns a [`Stats`] (`serde::Serialize`) with one
//! struct per primitive ([`DebounceStats`](debounce::DebounceStats), [`ThrottleStats`](throttle::ThrottleStats)), and what the
//! HTTP layers answered (`http::HttpStats`: replays, fresh runs, 409, 422, 413,
//! 400, 429, store failures); with the `metrics` feature,
//! `Runtime::export_metrics` publishes them through the `metrics` facade. ractor logs a span per actor
//! at INFO: hosts usually filter with `ractor=warn`.

#![cfg_attr(docsrs, feature(doc_cfg))]
// The crate's docs are written for the full build (as docs.rs builds them); in a build
// without some features, links to items those features add have nothing to point at.
#![cfg_attr(
    not(all(
        feature = "runtime",
        feature = "http",
        feature = "redis",
        feature = "postgres"
    )),
    allow(rustdoc::broken_intra_doc_links)
)]

#[cfg(feature = "runtime")]
mod cell;
pub mod clock;
#[cfg(feature = "runtime")]
#[cfg_attr(docsrs, doc(cfg(feature = "runtime")))]
pub mod coalesce;
#[cfg(feature = "runtime")]
#[cfg_attr(docsrs, doc(cfg(feature = "runtime")))]
pub mod debounce;
#[cfg(feature = "runtime")]
mod error;
#[cfg(feature = "runtime")]
mod global;
#[cfg(feature = "http")]
#[cfg_attr(docsrs, doc(cfg(feature = "http")))]
pub mod http;
#[cfg(feature = "runtime")]
#[cfg_attr(docsrs, doc(cfg(feature = "runtime")))]
pub mod idempotency;
#[cfg(feature = "runtime")]
mod job;
mod key;
#[cfg(feature = "runtime")]
mod log_every;
pub mod rate_limit;
#[cfg(feature = "runtime")]
#[cfg_attr(docsrs, doc(cfg(feature = "runtime")))]
pub mod runtime;
#[cfg(feature = "runtime")]
mod stats;
pub mod store;
mod stripe;
#[cfg(feature = "runtime")]
#[cfg_attr(docsrs, doc(cfg(feature = "runtime")))]
pub mod throttle;
#[cfg(feature = "runtime")]
mod wire;

#[cfg(feature = "runtime")]
#[cfg_attr(docsrs, doc(cfg(feature = "runtime")))]
pub use coalesce::Coalesce;
#[cfg(feature = "runtime")]
#[cfg_attr(docsrs, doc(cfg(feature = "runtime")))]
pub use debounce::{Debounce, DebounceHandle, DebounceOptions};
#[cfg(feature = "runtime")]
#[cfg_attr(docsrs, doc(cfg(feature = "runtime")))]
pub use error::{BoxError, Error};
#[cfg(feature = "runtime")]
#[cfg_attr(docsrs, doc(cfg(feature = "runtime")))]
pub use idempotency::{Idempotency, IdempotencyHandle, IdempotencyOptions, IdempotencyOutcome};
#[cfg(feature = "runtime")]
#[cfg_attr(docsrs, doc(cfg(feature = "runtime")))]
pub use job::Job;
#[cfg(feature = "runtime")]
#[cfg_attr(docsrs, doc(cfg(feature = "runtime")))]
pub use runtime::Runtime;
#[cfg(feature = "runtime")]
#[cfg_attr(docsrs, doc(cfg(feature = "runtime")))]
pub use stats::Stats;
#[cfg(feature = "runtime")]
#[cfg_attr(docsrs, doc(cfg(feature = "runtime")))]
pub use throttle::{Throttle, ThrottleHandle, ThrottleOutcome};

#[cfg(all(doctest, feature = "runtime", feature = "http"))]
#[doc = include_str!("../README.md")]
struct ReadmeDoctests;
