//! A log line repeated by many calls, let through at most once per period with a count of
//! the ones held back: an operator reads one line per cause and interval, not one per call.

use std::sync::atomic::{AtomicU64, Ordering};
use std::time::Duration;

use tokio::time::Instant;

/// Lets a repeated log line through at most once per `period`.
#[derive(Debug)]
pub(crate) struct LogEvery {
    period: Duration,
    base: Instant,
    /// When the last line went out, in ms since `base`; `u64::MAX` before the first.
    last: AtomicU64,
    /// Lines held back since the last one went out.
    held: AtomicU64,
}

/// Once a minute.
impl Default for LogEvery {
    fn default() -> Self {
        Self::new(Duration::from_secs(60))
    }
}

impl LogEvery {
    pub(crate) fn new(period: Duration) -> Self {
        Self {
            period,
            base: Instant::now(),
            last: AtomicU64::new(u64::MAX),
            held: AtomicU64::new(0),
        }
    }

    /// `Some(held)` if a line may go out now (`held`: how many were held back since the
    /// last one), else `None` (this one is counted as held back). One caller wins a period.
    pub(crate) fn due(&self) -> Option<u64> {
        let at = u64::try_from(
            Instant::now()
                .saturating_duration_since(self.base)
                .as_millis(),
        )
        .unwrap_or(u64::MAX - 1);
        let last = self.last.load(Ordering::Relaxed);
        let period = u64::try_from(self.period.as_millis()).unwrap_or(u64::MAX);
        let due = last == u64::MAX || at.saturating_sub(last) >= period;
        if due
            && self
                .last
                .compare_exchange(last, at, Ordering::Relaxed, Ordering::Relaxed)
                .is_ok()
        {
            return Some(self.held.swap(0, Ordering::Relaxed));
        }
        self.held.fetch_add(1, Ordering::Relaxed);
        None
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[tokio::test(start_paused = true)]
    async fn one_line_per_period_carries_the_count_held_back() {
        let gate = LogEvery::new(Duration::from_secs(10));
        assert_eq!(gate.due(), Some(0));
        for _ in 0..5 {
            assert_eq!(gate.due(), None);
        }
        tokio::time::advance(Duration::from_millis(9_999)).await;
        assert_eq!(gate.due(), None);
        tokio::time::advance(Duration::from_millis(1)).await;
        assert_eq!(gate.due(), Some(6));
        assert_eq!(gate.due(), None);
    }
}
