//! Keyed debounce, throttle, rate limiting and idempotency.
