//! Keyed debounce, throttle, rate limiting and idempotency.

pub mod clock;
pub mod rate_limit;
