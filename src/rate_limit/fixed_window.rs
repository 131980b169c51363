//! Fixed window: a counter per aligned window.

use std::num::NonZeroU32;
use std::time::Duration;

use serde::{Deserialize, Serialize};

use super::RateLimitError;
use super::strategy::{self, Transition};

/// At most `limit` units per window of `window` ms, windows aligned to the Unix epoch.
///
/// # Examples
///
/// ```
/// use std::num::NonZeroU32;
/// use std::time::Duration;
/// use throttlebeam::rate_limit::{FixedWindow, Strategy};
///
/// let window = FixedWindow::new(2, Duration::from_secs(1))?;
/// // At 1.25 s (times are epoch µs), in the window [1 s, 2 s).
/// let d = window.check(None, 1_250_000, NonZeroU32::MIN)?.result;
/// assert_eq!((d.remaining, d.reset_at_ms), (1, 2_000));
/// # Ok::<(), Box<dyn std::error::Error>>(())
/// ```
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, Serialize)]
pub struct FixedWindow {
    limit: u64,
    window_us: u64,
}

/// The state of a [`FixedWindow`] key.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, Serialize, Deserialize)]
pub struct FixedWindowState {
    /// Start of the counted window, epoch µs.
    pub start_us: u64,
    /// Units spent in it.
    pub count: u64,
}

impl FixedWindow {
    /// `limit` units per `window`.
    ///
    /// # Errors
    ///
    /// [`RateLimitError::ZeroLimit`] for a zero limit, [`RateLimitError::InvalidDuration`] for
    /// a window outside 1 ms ..= 2^36 - 1 ms, [`RateLimitError::TooLarge`] when
    /// `limit * window` in µs exceeds 2^53.
    pub fn new(limit: u32, window: Duration) -> Result<Self, RateLimitError> {
        let limit = u64::from(
            NonZeroU32::new(limit)
                .ok_or(RateLimitError::ZeroLimit)?
                .get(),
        );
        let window_us = strategy::period_us("window", window)?;
        strategy::exact(u128::from(limit) * u128::from(window_us), "limit * window")?;
        Ok(Self { limit, window_us })
    }
}

impl FixedWindow {
    /// `(limit, window_us)`.
    pub(crate) fn parts(&self) -> (u64, u64) {
        (self.limit, self.window_us)
    }

    /// The window of [`FixedWindow::parts`] `(limit, window_us)`, if those are parameters a
    /// `FixedWindow` can have.
    pub(crate) fn from_parts(limit: u64, window_us: u64) -> Option<Self> {
        let valid = limit >= 1
            && u32::try_from(limit).is_ok()
            && window_us >= 1
            && limit.checked_mul(window_us)? <= strategy::MAX_EXACT;
        valid.then_some(Self { limit, window_us })
    }
}

impl Transition for FixedWindow {
    type State = FixedWindowState;
    type View = FixedWindowState;

    fn name(&self) -> &'static str {
        "fixed_window"
    }

    fn limit(&self) -> u64 {
        self.limit
    }

    fn window_ms(&self) -> u64 {
        self.window_us / strategy::US_PER_MS
    }

    fn view(&self, state: Option<FixedWindowState>, now: u64) -> FixedWindowState {
        let start_us = now - now % self.window_us;
        match state {
            // Same window, or a clock that went back into an earlier one: keep counting.
            Some(s) if s.start_us >= start_us => s,
            _ => FixedWindowState { start_us, count: 0 },
        }
    }

    fn available(&self, view: &FixedWindowState, _now: u64) -> u64 {
        self.limit.saturating_sub(view.count)
    }

    fn earliest(&self, view: &FixedWindowState, now: u64, units: u64) -> u64 {
        if view.count.saturating_add(units) <= self.limit {
            now
        } else {
            view.start_us.saturating_add(self.window_us).max(now)
        }
    }

    fn consume(&self, view: FixedWindowState, _now: u64, units: u64) -> (FixedWindowState, u64) {
        let next = FixedWindowState {
            count: view.count + units,
            ..view
        };
        (next, view.start_us.saturating_add(self.window_us))
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn windows_align_to_the_epoch_and_roll_over() {
        let w = FixedWindow::new(3, Duration::from_millis(100)).unwrap();
        let s = FixedWindowState {
            start_us: 100_000,
            count: 3,
        };
        assert_eq!(w.view(Some(s), 150_000), s);
        assert_eq!(
            w.view(Some(s), 250_000),
            FixedWindowState {
                start_us: 200_000,
                count: 0
            }
        );
        // Backwards into an earlier window: still the later, spent one.
        assert_eq!(w.view(Some(s), 50_000), s);
        assert_eq!(w.earliest(&s, 150_000, 1), 200_000);
    }
}
