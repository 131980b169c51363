//! Sliding window: the current window's count plus the previous one's, weighted by overlap.

use std::num::NonZeroU32;
use std::time::Duration;

use serde::{Deserialize, Serialize};

use super::strategy::{self, Model, Outcome, Strategy};
use super::{Decision, Forecast, RateLimitError};

/// At most `limit` units in any window of `window` ms, estimated as
/// `previous * (window - elapsed) / window + current`.
///
/// The estimate is kept multiplied by `window`, so it is exact in integers.
///
/// # Examples
///
/// ```
/// use std::num::NonZeroU32;
/// use std::time::Duration;
/// use throttlebeam::rate_limit::{SlidingWindow, SlidingWindowState, Strategy};
///
/// let w = SlidingWindow::new(10, Duration::from_secs(1))?;
/// // 10 spent last window; a quarter into this one, 3/4 of them still count.
/// let state = SlidingWindowState { start: 1_000, previous: 10, current: 0 };
/// assert_eq!(w.peek(Some(state), 1_250).remaining, 2);
/// # Ok::<(), throttlebeam::rate_limit::RateLimitError>(())
/// ```
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct SlidingWindow {
    limit: u64,
    window: u64,
}

/// The state of a [`SlidingWindow`] key.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, Serialize, Deserialize)]
pub struct SlidingWindowState {
    /// Start of the window `current` counts, epoch ms (the previous one ends there).
    pub start: u64,
    /// Units spent in the previous window.
    pub previous: u64,
    /// Units spent in the current window.
    pub current: u64,
}

impl SlidingWindow {
    /// `limit` units per sliding `window`.
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

    /// The weighted count times `window` at `now`.
    fn estimate(&self, v: &SlidingWindowState, now: u64) -> u64 {
        // A start after now (clock went back) counts as no time elapsed: the full weight.
        let elapsed = now.saturating_sub(v.start).min(self.window);
        v.previous * (self.window - elapsed) + v.current * self.window
    }
}

impl Model for SlidingWindow {
    type State = SlidingWindowState;
    type View = SlidingWindowState;

    fn limit(&self) -> u64 {
        self.limit
    }

    fn view(&self, state: Option<SlidingWindowState>, now: u64) -> SlidingWindowState {
        let start = now - now % self.window;
        match state {
            Some(s) if s.start >= start => s,
            Some(s) if s.start + self.window == start => SlidingWindowState {
                start,
                previous: s.current,
                current: 0,
            },
            _ => SlidingWindowState {
                start,
                previous: 0,
                current: 0,
            },
        }
    }

    fn available(&self, view: &SlidingWindowState, now: u64) -> u64 {
        (self.limit * self.window).saturating_sub(self.estimate(view, now)) / self.window
    }

    fn earliest(&self, v: &SlidingWindowState, now: u64, units: u64) -> Option<u64> {
        let w = self.window;
        let budget = self.limit.checked_sub(units)? * w;
        let current = v.current * w;
        let at = if current <= budget {
            // Fits in this window once the previous window's weight has shrunk enough.
            match (budget - current).checked_div(v.previous) {
                None => now,
                Some(slack) => v.start + w - slack.min(w),
            }
        } else {
            // Only once this window's count has become the (shrinking) previous one.
            v.start + 2 * w - (budget / v.current).min(w)
        };
        Some(at.max(now))
    }

    fn consume(
        &self,
        view: SlidingWindowState,
        _now: u64,
        units: u64,
    ) -> (SlidingWindowState, u64) {
        let next = SlidingWindowState {
            current: view.current + units,
            ..view
        };
        // With a non-zero current count, the key is empty once the next window has passed.
        (next, view.start + 2 * self.window)
    }
}

impl Strategy for SlidingWindow {
    type State = SlidingWindowState;

    fn name(&self) -> &'static str {
        "sliding_window"
    }

    fn limit(&self) -> u64 {
        self.limit
    }

    fn window_ms(&self) -> u64 {
        self.window
    }

    fn check(
        &self,
        state: Option<SlidingWindowState>,
        now_ms: u64,
        cost: NonZeroU32,
    ) -> Outcome<SlidingWindowState> {
        strategy::check(self, state, now_ms, cost)
    }

    fn peek(&self, state: Option<SlidingWindowState>, now_ms: u64) -> Decision {
        strategy::peek(self, state, now_ms)
    }

    fn forecast(
        &self,
        state: Option<SlidingWindowState>,
        now_ms: u64,
        cost: NonZeroU32,
    ) -> Forecast {
        strategy::forecast(self, state, now_ms, cost)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn w() -> SlidingWindow {
        SlidingWindow::new(10, Duration::from_millis(1_000)).unwrap()
    }

    #[test]
    fn estimate_weights_the_previous_window() {
        let s = SlidingWindowState {
            start: 1_000,
            previous: 10,
            current: 2,
        };
        assert_eq!(w().estimate(&s, 1_000), 12_000);
        assert_eq!(w().estimate(&s, 1_500), 7_000);
        assert_eq!(w().available(&s, 1_500), 3);
        // Clock behind the window start: full weight, never more capacity.
        assert_eq!(w().estimate(&s, 900), 12_000);
    }

    #[test]
    fn earliest_waits_for_the_previous_weight_to_shrink() {
        let s = SlidingWindowState {
            start: 1_000,
            previous: 10,
            current: 2,
        };
        // One unit needs previous * (1000 - e) <= (10 - 1 - 2) * 1000, so e >= 300.
        assert_eq!(w().earliest(&s, 1_000, 1), Some(1_300));
        // Ten units need the whole current count to age out too: 2 * (1000 - e') <= 0.
        assert_eq!(w().earliest(&s, 1_000, 10), Some(3_000));
        assert_eq!(w().earliest(&s, 1_000, 11), None);
    }

    #[test]
    fn rotation_moves_current_to_previous() {
        let s = SlidingWindowState {
            start: 0,
            previous: 4,
            current: 3,
        };
        assert_eq!(
            w().view(Some(s), 1_200),
            SlidingWindowState {
                start: 1_000,
                previous: 3,
                current: 0
            }
        );
        assert_eq!(w().view(Some(s), 2_000).previous, 0);
    }
}
