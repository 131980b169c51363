//! Keyed debounce, throttle, rate limiting and idempotency for async Rust.

mod cell;
mod debounce;
mod error;
mod idempotency;
mod key;
mod runtime;
mod throttle;

pub use error::{BoxError, Error};
pub use idempotency::{
    Deduplicator, Idempotency, IdempotencyOptions, Outcome, Reservation, Reserved,
};
pub use key::{MAX_KEY_LEN, MAX_TIMER};
pub use runtime::{Runtime, RuntimeBuilder, ShutdownPolicy, ShutdownReport, Stats};
pub use throttle::{Throttle, Throttled, Throttler};
