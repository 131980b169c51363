//! Shared counters that every part of one runtime instance updates.

use std::sync::atomic::{AtomicUsize, Ordering};

/// Live counters of one runtime instance.
///
/// Registries, timers and TTL tables of one instance share one `Counters`
/// (behind an `Arc`), so a host reads one picture of the whole instance
/// ([`crate::Tree::snapshot`] adds the live processes). The key count is
/// also the budget that [`crate::Registry`] caps are checked against.
///
/// # Examples
///
/// ```
/// use std::sync::Arc;
/// use throttlebeam_supervisors::{Counters, TimerGuard};
///
/// let counters = Arc::new(Counters::new());
/// {
///     let _timer = TimerGuard::arm(&counters);
///     assert_eq!(counters.timers(), 1);
/// }
/// assert_eq!(counters.timers(), 0);
/// ```
#[derive(Debug, Default)]
pub struct Counters {
    keys: AtomicUsize,
    timers: AtomicUsize,
    ttl_entries: AtomicUsize,
}

/// A point-in-time copy of [`Counters`] plus the live process count.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
#[non_exhaustive]
pub struct Snapshot {
    /// Keys tracked in registries.
    pub keys: usize,
    /// Per-key processes alive now.
    pub processes: usize,
    /// Timers scheduled now (per-key timers and the sweeper's tick).
    pub timers: usize,
    /// Entries held in TTL tables, expired or not yet swept included.
    pub ttl_entries: usize,
}

impl Counters {
    /// Creates counters at zero.
    #[must_use]
    pub fn new() -> Self {
        Self::default()
    }

    /// Keys tracked in every registry sharing these counters.
    pub fn keys(&self) -> usize {
        self.keys.load(Ordering::Relaxed)
    }

    /// Timers scheduled now.
    pub fn timers(&self) -> usize {
        self.timers.load(Ordering::Relaxed)
    }

    /// Entries held in TTL tables.
    pub fn ttl_entries(&self) -> usize {
        self.ttl_entries.load(Ordering::Relaxed)
    }

    /// Records a timer being armed; pair it with exactly one
    /// [`Counters::timer_disarmed`], or use a [`TimerGuard`].
    pub fn timer_armed(&self) {
        self.timers.fetch_add(1, Ordering::Relaxed);
    }

    /// Records a timer firing or being dropped. Calling it more often than
    /// [`Counters::timer_armed`] corrupts the count.
    pub fn timer_disarmed(&self) {
        self.timers.fetch_sub(1, Ordering::Relaxed);
    }

    pub(crate) fn key_added(&self, cap: usize) -> bool {
        self.keys
            .fetch_update(Ordering::AcqRel, Ordering::Relaxed, |n| {
                (n < cap).then_some(n + 1)
            })
            .is_ok()
    }

    pub(crate) fn keys_removed(&self, n: usize) {
        self.keys.fetch_sub(n, Ordering::AcqRel);
    }

    pub(crate) fn ttl_added(&self) {
        self.ttl_entries.fetch_add(1, Ordering::Relaxed);
    }

    pub(crate) fn ttl_removed(&self, n: usize) {
        self.ttl_entries.fetch_sub(n, Ordering::Relaxed);
    }
}

/// A timer counted in [`Counters`] for as long as this guard lives.
///
/// Dropping it on every exit path (fire, cancel, panic) keeps the count
/// exact. See [`Counters`] for an example.
#[derive(Debug)]
pub struct TimerGuard<'a>(&'a Counters);

impl<'a> TimerGuard<'a> {
    /// Counts a timer until the guard drops.
    pub fn arm(counters: &'a Counters) -> Self {
        counters.timer_armed();
        Self(counters)
    }
}

impl Drop for TimerGuard<'_> {
    fn drop(&mut self) {
        self.0.timer_disarmed();
    }
}
