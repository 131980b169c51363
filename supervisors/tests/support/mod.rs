//! Helpers shared by the behaviour tests.

#![allow(dead_code, unreachable_pub)]

use std::time::Duration;

/// On a paused clock: runs every task that can make progress (actors
/// handling their mailboxes, timers due now), then moves the clock by 1 ms.
/// The clock only auto-advances once nothing else is runnable, so this is
/// deterministic, not a poll.
pub async fn settle() {
    tokio::time::sleep(Duration::from_millis(1)).await;
}
