//! Rate limiting: pure strategies over a store with one atomic primitive.
//!
//! - **Strategies** ([`Gcra`], [`TokenBucket`], [`FixedWindow`], [`SlidingWindow`],
//!   [`LeakyBucket`]) are pure functions of `(state, now_ms, cost)` over a small `Copy`,
//!   serde-serializable state, in integer milliseconds, so a remote store can reproduce every
//!   decision bit for bit. Each can `check` (consume), `peek` and `forecast` (never consume).
//! - **Values**: a [`Decision`] (a denial is an outcome, not an error) and a [`Forecast`].
//! - **Algebra**: [`combine`] with identity [`ALLOW_FULL`]; [`Tiered`] enforces several
//!   limits atomically (all tiers are charged, or none).
//! - **Stores**: the [`Store`] trait has one primitive, `apply` a [`Transition`] to a key;
//!   [`MemoryStore`] is sharded, bounded and TTL-swept.
//! - **[`Limiter`]**: strategy + store + namespace + clock, with `check`, `check_n`,
//!   `check_many`, `peek`, `forecast`, `reset`, per-key overrides and a fair `until_ready`.
//! - **Transport helpers**: [`HeaderOptions`] (draft, structured and legacy headers,
//!   `Retry-After`), an [`Enforcer`] with a [`FailMode`], [`ClientIp`] and [`KeyHasher`] keys.
//!
//! # Examples
//!
//! ```
//! use std::num::NonZeroU32;
//! use throttlebeam::rate_limit::{Gcra, Limiter};
//!
//! let limiter = Limiter::new(Gcra::per_second(NonZeroU32::new(10).unwrap()));
//! let decision = limiter.check("user:42")?;
//! assert!(decision.allowed);
//! assert_eq!(decision.remaining, 9);
//! # Ok::<(), throttlebeam::rate_limit::RateLimitError>(())
//! ```

mod algebra;
mod decision;
mod enforcer;
mod error;
mod fixed_window;
mod gcra;
mod headers;
mod keys;
mod leaky;
mod limiter;
mod sliding_window;
mod store;
mod strategy;
mod token_bucket;

pub use algebra::{ALLOW_FULL, Tiered, TieredState, combine};
pub use decision::{Decision, Forecast, RateLimited};
pub use enforcer::{EnforceOutcome, Enforcement, Enforcer, FailMode};
pub use error::RateLimitError;
pub use fixed_window::{FixedWindow, FixedWindowState};
pub use gcra::{Gcra, GcraState};
pub use headers::{
    HeaderOptions, PolicyName, RATELIMIT, RATELIMIT_LIMIT, RATELIMIT_POLICY, RATELIMIT_REMAINING,
    RATELIMIT_RESET, X_RATELIMIT_LIMIT, X_RATELIMIT_REMAINING, X_RATELIMIT_RESET, retry_after_secs,
};
pub use keys::{ClientIp, KeyHasher, TrustProxy};
pub use leaky::{LeakyBucket, LeakyState, Reservation};
pub use limiter::{Limiter, LimiterBuilder};
pub use sliding_window::{SlidingWindow, SlidingWindowState};
pub use store::{AsyncStore, MemoryStore, Store, Transition};
pub use strategy::{Outcome, Strategy, Update};
pub use token_bucket::{TokenBucket, TokenBucketState};
