//! Fixed window: a counter per aligned window.

use std::num::NonZeroU32;
use std::time::Duration;

use serde::{Deserialize, Serialize};

use super::strategy::{self, Model, Outcome, Strategy};
use super::{Decision, Forecast, RateLimitError};

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
/// let d = window.check(None, 1_250, NonZeroU32::MIN).result;
/// assert_eq!((d.remaining, d.reset_at_ms), (1, 2_000));
/// # Ok::<(), throttlebeam::rate_limit::RateLimitError>(())
/// ```
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct FixedWindow {
    limit: u64,
    window: u64,
}

/// The state of a [`FixedWindow`] key.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, Serialize, Deserialize)]
pub struct FixedWindowState {
    /// Start of the counted window, epoch ms.
    pub start: u64,
    /// Units spent in it.
    pub count: u64,
}

impl FixedWindow {
    /// `limit` units per `window`.
    ///
    /// # Errors
    ///
    /// [`RateLimitError::ZeroLimit`], [`RateLimitError::ZeroPeriod`] for zero inputs,
    /// [`RateLimitError::TooLarge`] when `limit * window` in ms exceeds 2^53.
    pub fn new(limit: u32, window: Duration) -> Result<Self, RateLimitError> {
        let limit = u64::from(
            NonZeroU32::new(limit)
                .ok_or(RateLimitError::ZeroLimit)?
                .get(),
        );
        let window = strategy::period_ms(window)?;
        strategy::exact(u128::from(limit) * u128::from(window), "limit * window")?;
        Ok(Self { limit, window })
    }
}

impl Model for FixedWindow {
    type State = FixedWindowState;
    type View = FixedWindowState;

    fn limit(&self) -> u64 {
        self.limit
    }

    fn view(&self, state: Option<FixedWindowState>, now: u64) -> FixedWindowState {
        let start = now - now % self.window;
        match state {
            // Same window, or a clock that went back into an earlier one: keep counting.
            Some(s) if s.start >= start => s,
            _ => FixedWindowState { start, count: 0 },
        }
    }

    fn available(&self, view: &FixedWindowState, _now: u64) -> u64 {
        self.limit.saturating_sub(view.count)
    }

    fn earliest(&self, view: &FixedWindowState, now: u64, units: u64) -> Option<u64> {
        (units <= self.limit).then(|| {
            if view.count + units <= self.limit {
                now
            } else {
                view.start + self.window
            }
        })
    }

    fn consume(&self, view: FixedWindowState, _now: u64, units: u64) -> (FixedWindowState, u64) {
        let next = FixedWindowState {
            count: view.count + units,
            ..view
        };
        (next, view.start + self.window)
    }
}

impl Strategy for FixedWindow {
    type State = FixedWindowState;

    fn name(&self) -> &'static str {
        "fixed_window"
    }

    fn limit(&self) -> u64 {
        self.limit
    }

    fn window_ms(&self) -> u64 {
        self.window
    }

    fn check(
        &self,
        state: Option<FixedWindowState>,
        now_ms: u64,
        cost: NonZeroU32,
    ) -> Outcome<FixedWindowState> {
        strategy::check(self, state, now_ms, cost)
    }

    fn peek(&self, state: Option<FixedWindowState>, now_ms: u64) -> Decision {
        strategy::peek(self, state, now_ms)
    }

    fn forecast(&self, state: Option<FixedWindowState>, now_ms: u64, cost: NonZeroU32) -> Forecast {
        strategy::forecast(self, state, now_ms, cost)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn windows_align_to_the_epoch_and_roll_over() {
        let w = FixedWindow::new(3, Duration::from_millis(100)).unwrap();
        let s = FixedWindowState {
            start: 100,
            count: 3,
        };
        assert_eq!(w.view(Some(s), 150), s);
        assert_eq!(
            w.view(Some(s), 250),
            FixedWindowState {
                start: 200,
                count: 0
            }
        );
        // Backwards into an earlier window: still the later, spent one.
        assert_eq!(w.view(Some(s), 50), s);
        assert_eq!(w.earliest(&s, 150, 1), Some(200));
    }
}
