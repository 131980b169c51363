//! The coalescing throttle's sleeper, as data: keys whose next run waits for
//! their window to end sit in a heap of window ends, one per stripe of
//! threads (its process is in `wakeups.rs`).

use std::cmp::Reverse;
use std::collections::BinaryHeap;
use std::sync::{Mutex, PoisonError};

use throttlebeam_supervisors::Generation;
use tokio::sync::Notify;

use crate::key::InlineKey;

/// A key whose next run waits for its window to end, in the sleeper.
pub(super) struct Wakeup {
    /// When it is due, in nanoseconds after the epoch clock's base: half
    /// the size of an `Instant`, and a heap may hold one per key.
    pub(super) at: u64,
    pub(super) key: InlineKey,
    pub(super) generation: Generation,
    pub(super) epoch: u32,
}

// Ordered by when it is due only.
impl PartialEq for Wakeup {
    fn eq(&self, other: &Self) -> bool {
        self.at == other.at
    }
}

impl Eq for Wakeup {}

impl PartialOrd for Wakeup {
    fn partial_cmp(&self, other: &Self) -> Option<std::cmp::Ordering> {
        Some(self.cmp(other))
    }
}

impl Ord for Wakeup {
    fn cmp(&self, other: &Self) -> std::cmp::Ordering {
        self.at.cmp(&other.at)
    }
}

/// One timer for the keys of a throttle whose trailing run waits for its
/// window: a pending trailing run costs a heap entry, not a process.
#[derive(Default)]
pub(super) struct Sleeper {
    pub(super) heap: BinaryHeap<Reverse<Wakeup>>,
    /// The sleeper process is alive.
    pub(super) running: bool,
}

/// A throttle has one sleeper per stripe of threads ([`stripe`]), each
/// with its own process while it holds wake-ups: callers on different
/// workers never share its lock or its heap, which would bounce their
/// cache lines between cores on every coalesced call.
#[repr(align(128))]
#[derive(Default)]
pub(super) struct SleeperShard {
    sleeper: Mutex<Sleeper>,
    /// Wakes the shard's process for an earlier wake-up or a destroy.
    pub(super) wake: Notify,
}

impl SleeperShard {
    pub(super) fn lock(&self) -> std::sync::MutexGuard<'_, Sleeper> {
        self.sleeper.lock().unwrap_or_else(PoisonError::into_inner)
    }
}
