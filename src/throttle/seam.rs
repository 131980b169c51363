//! The leading throttle's seam to a store shared by several instances: one
//! operation, open a window or learn how long the open one has left.

use std::future::Future;
use std::time::Duration;

use crate::store::StoreError;

/// What [`SharedWindows::open_window`] found.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) enum WindowOpen {
    /// This call opened the window: run.
    Opened,
    /// The window is open for this long still: throttled.
    Closed(Duration),
}

/// A store where the leading throttle's windows are shared by every instance
/// (Redis, in `throttle/redis.rs`). Who opens a window is decided by the
/// store, so instances with skewed clocks agree.
pub(crate) trait SharedWindows: Send + Sync {
    /// Opens the window of `key` for `window` (written with `token`), or
    /// reports the time left on the open one.
    fn open_window(
        &self,
        key: &str,
        window: Duration,
        token: u64,
    ) -> impl Future<Output = Result<WindowOpen, StoreError>> + Send;
}
