//! A circuit breaker: closed, open for a cooldown after N consecutive
//! failures, then half open with exactly one probe in flight.

use std::sync::Mutex;
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::time::Duration;

use serde::Serialize;
use tokio::time::Instant;

/// When the breaker opens and for how long.
///
/// # Examples
///
/// ```
/// use std::time::Duration;
/// use throttlebeam::store::BreakerConfig;
///
/// let config = BreakerConfig::default()
///     .with_failures(3)
///     .with_cooldown(Duration::from_secs(5));
/// assert_eq!(config.failures(), 3);
/// ```
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
#[must_use]
pub struct BreakerConfig {
    failures: u32,
    cooldown: Duration,
}

impl Default for BreakerConfig {
    /// 5 consecutive failures open the breaker for 10 s.
    fn default() -> Self {
        Self {
            failures: 5,
            cooldown: Duration::from_secs(10),
        }
    }
}

impl BreakerConfig {
    /// Consecutive failures that open the breaker (default 5; at least 1).
    pub fn with_failures(mut self, failures: u32) -> Self {
        self.failures = failures.max(1);
        self
    }

    /// How long the breaker stays open before one probe is let through
    /// (default 10 s).
    pub fn with_cooldown(mut self, cooldown: Duration) -> Self {
        self.cooldown = cooldown;
        self
    }

    /// Consecutive failures that open the breaker.
    #[must_use]
    pub fn failures(&self) -> u32 {
        self.failures
    }

    /// How long the breaker stays open.
    #[must_use]
    pub fn cooldown(&self) -> Duration {
        self.cooldown
    }
}

/// Where the breaker stands.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize)]
#[serde(rename_all = "snake_case")]
#[non_exhaustive]
pub enum BreakerState {
    /// Commands go through.
    Closed,
    /// Commands are refused locally until the cooldown ends.
    Open,
    /// The cooldown ended; one probe is deciding.
    HalfOpen,
}

/// Counters of a breaker, from [`Breaker::stats`].
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize)]
#[non_exhaustive]
pub struct BreakerStats {
    /// Where the breaker stands now.
    pub state: BreakerState,
    /// Failures since the last success.
    pub consecutive_failures: u32,
    /// Times the breaker opened.
    pub opened: u64,
    /// Commands refused locally while it was open.
    pub refused: u64,
    /// Store failures seen in all.
    pub failures: u64,
}

#[derive(Debug)]
struct Inner {
    state: BreakerState,
    consecutive: u32,
    open_until: Option<Instant>,
    probing: bool,
}

/// A circuit breaker around a remote store.
///
/// Call [`Breaker::admit`] before a command and [`Breaker::record`] with
/// its outcome. While open, `admit` refuses at once, so a store that is down
/// costs no timeout per call.
#[derive(Debug)]
pub struct Breaker {
    config: BreakerConfig,
    inner: Mutex<Inner>,
    /// Closed with no failure since the last success: admitting and
    /// recording a success change nothing then, so they take no lock.
    healthy: AtomicBool,
    opened: AtomicU64,
    refused: AtomicU64,
    failures: AtomicU64,
}

/// Permission to send one command, from [`Breaker::admit`].
#[derive(Debug)]
#[must_use = "report the outcome with Breaker::record"]
pub struct Permit {
    probe: bool,
}

impl Breaker {
    /// A closed breaker.
    #[must_use]
    pub fn new(config: BreakerConfig) -> Self {
        Self {
            config,
            inner: Mutex::new(Inner {
                state: BreakerState::Closed,
                consecutive: 0,
                open_until: None,
                probing: false,
            }),
            healthy: AtomicBool::new(true),
            opened: AtomicU64::new(0),
            refused: AtomicU64::new(0),
            failures: AtomicU64::new(0),
        }
    }

    /// Its configuration.
    pub fn config(&self) -> BreakerConfig {
        self.config
    }

    /// Lets a command through, or says how long until a probe may go.
    ///
    /// # Errors
    ///
    /// The time until the next probe while the breaker is open (or while
    /// another probe is in flight).
    pub fn admit(&self) -> Result<Permit, Duration> {
        if self.healthy.load(Ordering::Acquire) {
            return Ok(Permit { probe: false });
        }
        let mut inner = self.lock();
        match inner.state {
            BreakerState::Closed => Ok(Permit { probe: false }),
            BreakerState::Open => {
                let now = Instant::now();
                let until = inner.open_until.unwrap_or(now);
                if now < until {
                    drop(inner);
                    self.refused.fetch_add(1, Ordering::Relaxed);
                    return Err(until - now);
                }
                inner.state = BreakerState::HalfOpen;
                inner.probing = true;
                tracing::debug!("store circuit breaker half open: probing");
                Ok(Permit { probe: true })
            }
            BreakerState::HalfOpen => {
                if inner.probing {
                    drop(inner);
                    self.refused.fetch_add(1, Ordering::Relaxed);
                    Err(Duration::ZERO)
                } else {
                    inner.probing = true;
                    Ok(Permit { probe: true })
                }
            }
        }
    }

    /// Records the outcome of an admitted command.
    pub fn record(&self, permit: Permit, ok: bool) {
        if ok && !permit.probe && self.healthy.load(Ordering::Acquire) {
            return;
        }
        let mut inner = self.lock();
        if permit.probe {
            inner.probing = false;
        }
        if ok {
            let was = inner.state;
            inner.state = BreakerState::Closed;
            inner.consecutive = 0;
            inner.open_until = None;
            self.healthy.store(true, Ordering::Release);
            if was != BreakerState::Closed {
                tracing::warn!("store circuit breaker closed: the store answers again");
            }
            return;
        }
        self.failures.fetch_add(1, Ordering::Relaxed);
        self.healthy.store(false, Ordering::Release);
        inner.consecutive = inner.consecutive.saturating_add(1);
        let trip = permit.probe || inner.consecutive >= self.config.failures;
        if trip && inner.state != BreakerState::Open {
            inner.state = BreakerState::Open;
            inner.open_until = Instant::now().checked_add(self.config.cooldown);
            self.opened.fetch_add(1, Ordering::Relaxed);
            tracing::warn!(
                failures = inner.consecutive,
                cooldown_ms = u64::try_from(self.config.cooldown.as_millis()).unwrap_or(u64::MAX),
                "store circuit breaker opened"
            );
        }
    }

    /// Current counters.
    #[must_use]
    pub fn stats(&self) -> BreakerStats {
        let inner = self.lock();
        BreakerStats {
            state: inner.state,
            consecutive_failures: inner.consecutive,
            opened: self.opened.load(Ordering::Relaxed),
            refused: self.refused.load(Ordering::Relaxed),
            failures: self.failures.load(Ordering::Relaxed),
        }
    }

    fn lock(&self) -> std::sync::MutexGuard<'_, Inner> {
        self.inner
            .lock()
            .unwrap_or_else(std::sync::PoisonError::into_inner)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn fail(b: &Breaker) {
        let p = b.admit().expect("admitted");
        b.record(p, false);
    }

    #[tokio::test(start_paused = true)]
    async fn opens_after_n_failures_then_one_probe_decides() {
        let b = Breaker::new(
            BreakerConfig::default()
                .with_failures(3)
                .with_cooldown(Duration::from_secs(10)),
        );
        fail(&b);
        fail(&b);
        assert_eq!(b.stats().state, BreakerState::Closed);
        fail(&b);
        assert_eq!(b.stats().state, BreakerState::Open);
        assert_eq!(b.admit().unwrap_err(), Duration::from_secs(10));
        tokio::time::advance(Duration::from_secs(4)).await;
        assert_eq!(b.admit().unwrap_err(), Duration::from_secs(6));
        tokio::time::advance(Duration::from_secs(6)).await;
        let probe = b.admit().expect("probe admitted");
        assert_eq!(b.stats().state, BreakerState::HalfOpen);
        assert!(b.admit().is_err(), "only one probe at a time");
        b.record(probe, false);
        assert_eq!(b.stats().state, BreakerState::Open);
        assert_eq!(b.stats().opened, 2);
        tokio::time::advance(Duration::from_secs(10)).await;
        let probe = b.admit().expect("probe admitted");
        b.record(probe, true);
        let s = b.stats();
        assert_eq!(s.state, BreakerState::Closed);
        assert_eq!(s.consecutive_failures, 0);
        assert_eq!(s.failures, 4);
        assert_eq!(s.refused, 3);
    }

    #[tokio::test(start_paused = true)]
    async fn a_success_resets_the_run_of_failures() {
        let b = Breaker::new(BreakerConfig::default().with_failures(2));
        fail(&b);
        let p = b.admit().expect("admitted");
        b.record(p, true);
        fail(&b);
        assert_eq!(b.stats().state, BreakerState::Closed);
    }
}
