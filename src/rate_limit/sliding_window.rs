//! Sliding window: the current window's count plus the previous one's, weighted by overlap.

use std::num::NonZeroU32;
use std::time::Duration;

use serde::{Deserialize, Serialize};

use super::RateLimitError;
use super::strategy::{self, Transition};

/// At most `limit` units in any window of `window` ms, estimated as
/// `previous * (window - elapsed) / window + current`.
///
/// The estimate is kept multiplied by `window` (in µs), so it is exact in integers.
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
/// let state = SlidingWindowState { start_us: 1_000_000, previous: 10, current: 0 };
/// assert_eq!(w.peek(Some(state), 1_250_000).remaining, 2);
/// # Ok::<(), throttlebeam::rate_limit::RateLimitError>(())
/// ```
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, Serialize)]
pub struct SlidingWindow {
    limit: u64,
    window_us: u64,
}

/// The state of a [`SlidingWindow`] key.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, Serialize, Deserialize)]
pub struct SlidingWindowState {
    /// Start of the window `current` counts, epoch µs (the previous one ends there).
    pub start_us: u64,
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

    /// The weighted count times `window` at `now`.
    fn estimate(&self, v: &SlidingWindowState, now: u64) -> u64 {
        let w = self.window_us;
        // A start after now (clock went back) counts as no time elapsed: the full weight.
        let elapsed = now.saturating_sub(v.start_us).min(w);
        v.previous
            .saturating_mul(w - elapsed)
            .saturating_add(v.current.saturating_mul(w))
    }
}

impl SlidingWindow {
    /// `(limit, window_us)`.
    pub(crate) fn parts(&self) -> (u64, u64) {
        (self.limit, self.window_us)
    }

    /// The window of [`SlidingWindow::parts`] `(limit, window_us)`, if those are parameters a
    /// `SlidingWindow` can have.
    pub(crate) fn from_parts(limit: u64, window_us: u64) -> Option<Self> {
        let valid = limit >= 1
            && u32::try_from(limit).is_ok()
            && window_us >= 1
            && limit.checked_mul(window_us)? <= strategy::MAX_EXACT;
        valid.then_some(Self { limit, window_us })
    }
}

impl Transition for SlidingWindow {
    type State = SlidingWindowState;
    type View = SlidingWindowState;

    fn name(&self) -> &'static str {
        "sliding_window"
    }

    fn limit(&self) -> u64 {
        self.limit
    }

    fn window_ms(&self) -> u64 {
        self.window_us / strategy::US_PER_MS
    }

    fn view(&self, state: Option<SlidingWindowState>, now: u64) -> SlidingWindowState {
        let start_us = now - now % self.window_us;
        match state {
            Some(s) if s.start_us >= start_us => s,
            Some(s) if s.start_us.saturating_add(self.window_us) == start_us => {
                SlidingWindowState {
                    start_us,
                    previous: s.current,
                    current: 0,
                }
            }
            _ => SlidingWindowState {
                start_us,
                previous: 0,
                current: 0,
            },
        }
    }

    fn available(&self, view: &SlidingWindowState, now: u64) -> u64 {
        (self.limit * self.window_us).saturating_sub(self.estimate(view, now)) / self.window_us
    }

    fn earliest(&self, v: &SlidingWindowState, now: u64, units: u64) -> u64 {
        let w = self.window_us;
        let budget = self.limit.saturating_sub(units) * w;
        let current = v.current.saturating_mul(w);
        let at = if current <= budget {
            // Fits in this window once the previous window's weight has shrunk enough.
            match (budget - current).checked_div(v.previous) {
                None => now,
                Some(slack) => v.start_us.saturating_add(w - slack.min(w)),
            }
        } else {
            // Only once this window's count has become the (shrinking) previous one.
            v.start_us
                .saturating_add(2 * w)
                .saturating_sub((budget / v.current).min(w))
        };
        at.max(now)
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
        (next, view.start_us.saturating_add(2 * self.window_us))
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn w() -> SlidingWindow {
        SlidingWindow::new(10, Duration::from_millis(1_000)).unwrap()
    }

    const S: SlidingWindowState = SlidingWindowState {
        start_us: 1_000_000,
        previous: 10,
        current: 2,
    };

    #[test]
    fn estimate_weights_the_previous_window() {
        assert_eq!(w().estimate(&S, 1_000_000), 12_000_000);
        assert_eq!(w().estimate(&S, 1_500_000), 7_000_000);
        assert_eq!(w().available(&S, 1_500_000), 3);
        // Clock behind the window start: full weight, never more capacity.
        assert_eq!(w().estimate(&S, 900_000), 12_000_000);
    }

    #[test]
    fn earliest_waits_for_the_previous_weight_to_shrink() {
        // One unit needs previous * (1000 - e) <= (10 - 1 - 2) * 1000 ms, so e >= 300 ms.
        assert_eq!(w().earliest(&S, 1_000_000, 1), 1_300_000);
        // Ten units need the whole current count to age out too: 2 * (1000 - e') <= 0.
        assert_eq!(w().earliest(&S, 1_000_000, 10), 3_000_000);
    }

    #[test]
    fn rotation_moves_current_to_previous() {
        let s = SlidingWindowState {
            start_us: 0,
            previous: 4,
            current: 3,
        };
        assert_eq!(
            w().view(Some(s), 1_200_000),
            SlidingWindowState {
                start_us: 1_000_000,
                previous: 3,
                current: 0
            }
        );
        assert_eq!(w().view(Some(s), 2_000_000).previous, 0);
    }
}
