//! Rate limiting: pure strategies over a store that receives plain data.
//!
//! - **Strategies** ([`Gcra`], [`TokenBucket`], [`FixedWindow`], [`SlidingWindow`],
//!   [`LeakyBucket`]) are pure functions of `(state, now_us, cost)` over a small `Copy`,
//!   serde-serializable state. Time is read in integer microseconds, so every quota up to
//!   1,000,000 per second per key is exact and a remote store can reproduce every decision
//!   bit for bit; all time arithmetic saturates. Each can `check`
//!   (consume), `peek` and `forecast` (never consume). A cost above what a strategy can ever
//!   admit is an error ([`InsufficientCapacity`]), never a denial.
//! - **Values**: a [`Decision`] (a denial is an outcome, not an error) and a [`Forecast`].
//! - **Algebra**: [`combine`] with identity [`ALLOW_FULL`]; [`Tiered`] enforces several
//!   limits atomically (all tiers are charged, or none) in one store call.
//! - **Stores**: a [`RateLimitStore`] receives a [`RateLimitRequest`]: the strategy's
//!   parameters and a [`RateLimitOp`] (check, peek, forecast, reserve, reset), all plain
//!   `Serialize` data a remote store maps to one script. [`MemoryRateLimitStore`] runs them
//!   through [`Strategy::apply`]; it is sharded, TTL-swept and bounded (one million keys by
//!   default), and when full it forgets first the keys whose forgetting hands back least
//!   ([`Strategy::spent`]): keys at rest, then those with the fewest units spent. With the `redis` feature,
//!   `store::Redis` is an [`AsyncRateLimitStore`] for every [`ScriptedStrategy`] (the
//!   built-in strategies and [`Tiered`] combinations of them): one Lua script call per
//!   operation on the server's clock, decisions bit for bit equal to the memory store's, so
//!   several instances share one limit (use the limiter's `*_async` methods).
//! - **[`Limiter`]**: strategy + store + namespace + clock, with `check`, `check_n`,
//!   `check_many`, `peek`, `forecast`, `reset`, per-key overrides (kept in a shared store for
//!   every instance, [`Limiter::set_override`], or for this one,
//!   [`Limiter::set_local_override`]), a fair `until_ready` and [`LimiterStats`].
//! - **Transport helpers** (feature `http`): [`HeaderOptions`] (draft, structured and legacy
//!   headers, `Retry-After`), an [`Enforcer`] with a [`FailMode`], [`ClientIp`] and
//!   [`KeyHasher`] keys.
//!
//! Keys follow the crate's one rule (not empty, at most [`MAX_KEY_LEN`](crate::store::MAX_KEY_LEN)
//! bytes), and durations its one range (1 ms ..= [`MAX_TIMER`](crate::clock::MAX_TIMER)).
//!
//! # Time
//!
//! Time is read in integer epoch **microseconds**: a [`Clock`](crate::clock::Clock) reads them,
//! a [`Limiter`] hands them to its store and strategy (`now_us`), and the Redis store reads the
//! server's `TIME` to the microsecond. The strategies keep emission intervals as exact
//! fractions of a microsecond, so every quota up to 1,000,000 per second is exact, calls a few
//! microseconds apart included: a GCRA of 10,000 per second with a burst of 1 admits every one
//! of 10,000 calls 100 µs apart (a finer quota is [`RateLimitError::TooFine`]). What comes
//! back is in whole **milliseconds**: a [`Decision`]'s reset time (epoch ms, rounded up) and
//! retry-after (from now, rounded up, so waiting it always suffices), a [`Forecast`], a
//! shaper's delay. Every value stays below 2^53, so a Lua number holds it exactly
//! and a Redis script reproduces each decision bit for bit. All time arithmetic saturates:
//! `now` is clamped to [`TIME_CEILING_US`] (in 2096), after which time stands still; a limited
//! key stays limited and nothing is granted by an overflow.
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
mod emission;
#[cfg(feature = "http")]
mod enforcer;
mod error;
mod fixed_window;
mod gcra;
#[cfg(feature = "http")]
mod headers;
#[cfg(feature = "http")]
mod keys;
mod leaky;
mod limiter;
#[cfg(feature = "redis")]
pub(crate) mod redis;
mod script;
mod sliding_window;
mod store;
mod strategy;
mod token_bucket;

pub use algebra::{ALLOW_FULL, Tiered, TieredState, combine};
pub use decision::{Decision, Forecast, RateLimited};
#[cfg(feature = "http")]
#[cfg_attr(docsrs, doc(cfg(feature = "http")))]
pub use enforcer::{EnforceOutcome, Enforcement, Enforcer, FailMode};
pub use error::RateLimitError;
pub use fixed_window::{FixedWindow, FixedWindowState};
pub use gcra::{Gcra, GcraState};
#[cfg(feature = "http")]
#[cfg_attr(docsrs, doc(cfg(feature = "http")))]
pub use headers::{
    HeaderOptions, MAX_HEADER_SECS, PolicyName, RATELIMIT, RATELIMIT_LIMIT, RATELIMIT_POLICY,
    RATELIMIT_REMAINING, RATELIMIT_RESET, X_RATELIMIT_LIMIT, X_RATELIMIT_REMAINING,
    X_RATELIMIT_RESET, retry_after_secs,
};
#[cfg(feature = "http")]
#[cfg_attr(docsrs, doc(cfg(feature = "http")))]
pub use keys::{ClientIp, KeyHasher, ProxyHeader, TrustProxy};
pub use leaky::{LeakyBucket, LeakyState};
pub use limiter::{DEFAULT_OVERRIDE_REFRESH, Limiter, LimiterBuilder, LimiterStats};
#[cfg(feature = "redis")]
#[cfg_attr(docsrs, doc(cfg(feature = "redis")))]
pub use redis::RuntimeStore;
pub use script::ScriptedStrategy;
#[doc(hidden)]
pub use script::TierParams;
pub use sliding_window::{SlidingWindow, SlidingWindowState};
pub use store::{
    AsyncRateLimitStore, DEFAULT_LIMITER_MAX_KEYS, DEFAULT_STORE_CALL_TIMEOUT, FirstKeyHook,
    MemoryRateLimitStore, RateLimitRequest, RateLimitStore, StoredOverride,
};
pub use strategy::{
    Applied, InsufficientCapacity, RateLimitOp, RateLimitReply, ShaperReservation, StateUpdate,
    Strategy, TIME_CEILING_US,
};
pub use token_bucket::{TokenBucket, TokenBucketState};
