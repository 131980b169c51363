//! Keyed debounce, throttle, rate limiting and idempotency for async Rust.

mod cell;
mod coalesce;
mod debounce;
mod error;
mod idempotency;
mod key;
mod runtime;
mod throttle;

pub use coalesce::{
    DEFAULT_WINDOW, MAX_WINDOW, MemoryStore, Phase, SetOptions, StoreError, StoreFuture,
    TrailingStats, TrailingThrottle, TrailingThrottleBuilder, WindowStore,
};
pub use debounce::{Debounce, DebounceOptions, Debounced, Debouncer};
pub use error::{BoxError, Error};
pub use key::{MAX_KEY_LEN, MAX_TIMER};
pub use runtime::{Runtime, RuntimeBuilder, ShutdownPolicy, ShutdownReport, Stats};
pub use throttle::{Throttle, Throttled, Throttler};
