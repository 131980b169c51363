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
//! | [`TrailingThrottle`] | leading + trailing throttle: calls in a window coalesce into one trailing run whose value every covered caller can await |
//! | [`Idempotency`] / [`Deduplicator`] | run at most once per key; duplicates in flight wait and share the result; results replayed for a TTL |
//! | [`rate_limit`] | pure strategies (GCRA, token bucket, fixed and sliding window, leaky-bucket shaper), decisions, forecasts, the decision algebra, headers, an enforcer, client-IP and HMAC keys |
//! | [`Runtime`] | the runtime: a default one that starts itself, or explicit instances a host can supervise |
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
//! instance. Two runtimes in one process never share keys.
//!
//! # Logging
//!
//! Events go through `tracing`; nothing is logged above debug level except a
//! per-key process crashing outside user code, a debounced run that failed
//! while nobody awaited it (warn), and a failed trailing run (error).
//!
//! # Observability
//!
//! [`Runtime::stats`] returns a [`Stats`] (`serde::Serialize`) with one
//! struct per primitive ([`DebounceStats`], [`ThrottleStats`]); with the
//! `metrics` feature, `Runtime::export_metrics` publishes them through the
//! `metrics` facade. ractor logs a span per actor
//! at INFO: hosts usually filter with `ractor=warn`.

mod cell;
pub mod clock;
mod coalesce;
mod debounce;
mod error;
mod idempotency;
mod key;
pub mod rate_limit;
mod runtime;
mod stats;
mod throttle;

pub use coalesce::{
    MemoryWindowStore, Phase, SetOptions, TrailingStats, TrailingThrottle, TrailingThrottleBuilder,
    WindowStore, WindowStoreError, WindowStoreFuture,
};
pub use debounce::{Debounce, DebounceHandle, DebounceOptions, Debounced};
pub use error::{BoxError, Error};
pub use idempotency::{
    Deduplicator, Idempotency, IdempotencyOptions, Outcome, Reservation, Reserved,
};
pub use key::{MAX_KEY_LEN, MAX_TIMER};
pub use runtime::{Runtime, RuntimeBuilder, RuntimeClock, ShutdownPolicy, ShutdownReport};
pub use stats::{DebounceStats, Stats, ThrottleStats};
pub use throttle::{Throttle, ThrottleHandle, ThrottleOutcome};

#[cfg(doctest)]
#[doc = include_str!("../README.md")]
struct ReadmeDoctests;
