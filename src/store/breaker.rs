//! A circuit breaker: closed, open for a cooldown after N consecutive
//! failures, then half open with exactly one probe in flight. Permits are
//! RAII: a command whose caller went away mid-flight is no event, so a
//! cancelled probe never leaves the breaker half open.

// Only the Redis and PostgreSQL backends use the breaker itself; its config and stats are public.
#![cfg_attr(not(any(feature = "redis", feature = "postgres")), allow(dead_code))]

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
    /// (default 10 s). A cooldown too long for the clock (`Duration::MAX`)
    /// keeps the breaker open for a century, never for no time at all.
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

/// Counters of a store's circuit breaker, as [`RedisStats`](crate::store::RedisStats)
/// reports them.
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
    /// Times the cooldown of an open breaker ended and a probe went out
    /// (open to half open).
    pub probes: u64,
    /// Times the breaker closed again after it had opened: the store
    /// answered (a probe, or a call that must be tried).
    pub recoveries: u64,
}

/// How long "for ever" is when a cooldown does not fit the clock: an open
/// breaker whose cooldown overflows stays open until this far ahead, never
/// for zero time.
const FAR_FUTURE: Duration = Duration::from_secs(100 * 365 * 24 * 60 * 60);

/// `now + cooldown`, saturated: a cooldown past what the clock can hold
/// (`Duration::MAX`, say) opens the breaker until a far instant.
fn open_until(now: Instant, cooldown: Duration) -> Instant {
    now.checked_add(cooldown)
        .or_else(|| now.checked_add(FAR_FUTURE))
        // A clock so close to its own end that a century does not fit: a year.
        .unwrap_or_else(|| now + Duration::from_secs(365 * 24 * 60 * 60))
}

#[derive(Debug)]
struct Inner {
    state: BreakerState,
    consecutive: u32,
    /// When an open breaker lets a probe through; meaningful while open.
    open_until: Instant,
    probing: bool,
}

/// A circuit breaker around a remote store.
///
/// [`Breaker::admit`] before a command gives a [`Permit`]; the permit
/// records the command's outcome ([`Permit::record`]). While open, `admit`
/// refuses at once, so a store that is down costs no timeout per call.
///
/// A permit dropped without an outcome (its caller's future was dropped
/// mid-command) is no event: the failure run neither grows nor resets, and a
/// dropped probe frees the half-open breaker for the next probe, so a
/// cancelled caller never leaves it probing for ever.
#[derive(Debug)]
pub(crate) struct Breaker {
    config: BreakerConfig,
    inner: Mutex<Inner>,
    /// Closed with no failure since the last success: admitting and
    /// recording a success change nothing then, so they take no lock.
    healthy: AtomicBool,
    opened: AtomicU64,
    refused: AtomicU64,
    failures: AtomicU64,
    probes: AtomicU64,
    recoveries: AtomicU64,
}

/// Permission to send one command, from [`Breaker::admit`] or
/// [`Breaker::admit_anyway`]. Reports its outcome with [`Permit::record`];
/// dropped without one, it is no event (see [`Breaker`]).
#[derive(Debug)]
#[must_use = "report the outcome with Permit::record"]
pub(crate) struct Permit<'a> {
    breaker: &'a Breaker,
    /// The one command deciding a half-open breaker.
    probe: bool,
    /// Recorded: nothing left to do on drop.
    done: bool,
}

impl Permit<'_> {
    /// Records the outcome of the admitted command: `ok` unless the store
    /// misbehaved (see [`StoreError::is_store_fault`](super::StoreError::is_store_fault)).
    pub(crate) fn record(mut self, ok: bool) {
        self.done = true;
        self.breaker.record(self.probe, ok);
    }

    /// Whether this permit is the half-open breaker's probe.
    pub(crate) fn is_probe(&self) -> bool {
        self.probe
    }
}

impl Drop for Permit<'_> {
    fn drop(&mut self) {
        if !self.done && self.probe {
            // No outcome: the probe decided nothing. The next admit probes.
            self.breaker.lock().probing = false;
            tracing::debug!("store circuit breaker probe dropped without an outcome");
        }
    }
}

impl Breaker {
    /// A closed breaker.
    #[must_use]
    pub(crate) fn new(config: BreakerConfig) -> Self {
        Self {
            config,
            inner: Mutex::new(Inner {
                state: BreakerState::Closed,
                consecutive: 0,
                open_until: Instant::now(),
                probing: false,
            }),
            healthy: AtomicBool::new(true),
            opened: AtomicU64::new(0),
            refused: AtomicU64::new(0),
            failures: AtomicU64::new(0),
            probes: AtomicU64::new(0),
            recoveries: AtomicU64::new(0),
        }
    }

    fn permit(&self, probe: bool) -> Permit<'_> {
        Permit {
            breaker: self,
            probe,
            done: false,
        }
    }

    /// Lets a command through, or says how long until a probe may go.
    ///
    /// # Errors
    ///
    /// The time until the next probe while the breaker is open (or while
    /// another probe is in flight).
    pub(crate) fn admit(&self) -> Result<Permit<'_>, Duration> {
        if self.healthy.load(Ordering::Acquire) {
            return Ok(self.permit(false));
        }
        let mut inner = self.lock();
        match inner.state {
            BreakerState::Closed => Ok(self.permit(false)),
            BreakerState::Open => {
                let now = Instant::now();
                if now < inner.open_until {
                    let left = inner.open_until - now;
                    drop(inner);
                    self.refused.fetch_add(1, Ordering::Relaxed);
                    return Err(left);
                }
                inner.state = BreakerState::HalfOpen;
                inner.probing = true;
                self.probes.fetch_add(1, Ordering::Relaxed);
                tracing::debug!("store circuit breaker half open: probing");
                Ok(self.permit(true))
            }
            BreakerState::HalfOpen => {
                if inner.probing {
                    drop(inner);
                    self.refused.fetch_add(1, Ordering::Relaxed);
                    Err(Duration::ZERO)
                } else {
                    inner.probing = true;
                    Ok(self.permit(true))
                }
            }
        }
    }

    /// Lets a command through whatever the state: for a command that must
    /// be tried even while the store is thought down (an owner renewing its
    /// claim or storing a result that ran). Its outcome counts as any
    /// other's: a success closes the breaker, a failure counts against it.
    pub(crate) fn admit_anyway(&self) -> Permit<'_> {
        self.permit(false)
    }

    fn record(&self, probe: bool, ok: bool) {
        if ok && !probe && self.healthy.load(Ordering::Acquire) {
            return;
        }
        let mut inner = self.lock();
        if probe {
            inner.probing = false;
        }
        if ok {
            let was = inner.state;
            inner.state = BreakerState::Closed;
            inner.consecutive = 0;
            self.healthy.store(true, Ordering::Release);
            if was != BreakerState::Closed {
                self.recoveries.fetch_add(1, Ordering::Relaxed);
                tracing::warn!("store circuit breaker closed: the store answers again");
            }
            return;
        }
        self.failures.fetch_add(1, Ordering::Relaxed);
        self.healthy.store(false, Ordering::Release);
        inner.consecutive = inner.consecutive.saturating_add(1);
        let trip = probe || inner.consecutive >= self.config.failures;
        if trip && inner.state != BreakerState::Open {
            inner.state = BreakerState::Open;
            inner.open_until = open_until(Instant::now(), self.config.cooldown);
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
    pub(crate) fn stats(&self) -> BreakerStats {
        let inner = self.lock();
        BreakerStats {
            state: inner.state,
            consecutive_failures: inner.consecutive,
            opened: self.opened.load(Ordering::Relaxed),
            refused: self.refused.load(Ordering::Relaxed),
            failures: self.failures.load(Ordering::Relaxed),
            probes: self.probes.load(Ordering::Relaxed),
            recoveries: self.recoveries.load(Ordering::Relaxed),
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
        b.admit().expect("admitted").record(false);
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
        probe.record(false);
        assert_eq!(b.stats().state, BreakerState::Open);
        assert_eq!(b.stats().opened, 2);
        tokio::time::advance(Duration::from_secs(10)).await;
        b.admit().expect("probe admitted").record(true);
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
        b.admit().expect("admitted").record(true);
        fail(&b);
        assert_eq!(b.stats().state, BreakerState::Closed);
    }

    #[tokio::test(start_paused = true)]
    async fn a_probe_dropped_without_an_outcome_frees_the_breaker_for_the_next_probe() {
        let b = Breaker::new(BreakerConfig::default().with_failures(1));
        fail(&b);
        tokio::time::advance(Duration::from_secs(10)).await;
        let probe = b.admit().expect("probe admitted");
        assert!(probe.is_probe());
        assert_eq!(
            b.admit().unwrap_err(),
            Duration::ZERO,
            "one probe at a time"
        );
        // Its caller was cancelled mid-command: no outcome.
        drop(probe);
        let s = b.stats();
        assert_eq!(s.state, BreakerState::HalfOpen);
        assert_eq!(
            (s.failures, s.opened),
            (1, 1),
            "a dropped probe is no event"
        );
        let next = b.admit().expect("the next caller probes");
        assert!(next.is_probe());
        next.record(true);
        assert_eq!(b.stats().state, BreakerState::Closed);
        // A dropped ordinary permit changes nothing either.
        fail(&b);
        tokio::time::advance(Duration::from_secs(10)).await;
        b.admit().expect("probe").record(true);
        drop(b.admit().expect("closed"));
        assert_eq!(b.stats().state, BreakerState::Closed);
        assert_eq!(b.stats().consecutive_failures, 0);
    }

    #[tokio::test(start_paused = true)]
    async fn an_overflowing_cooldown_keeps_the_breaker_open_instead_of_not_at_all() {
        let b = Breaker::new(
            BreakerConfig::default()
                .with_failures(1)
                .with_cooldown(Duration::MAX),
        );
        fail(&b);
        let left = b.admit().expect_err("open");
        assert!(left >= FAR_FUTURE - Duration::from_secs(1), "{left:?}");
        tokio::time::advance(Duration::from_secs(365 * 24 * 60 * 60)).await;
        assert!(b.admit().is_err(), "still open a year later");
        assert_eq!(b.stats().state, BreakerState::Open);
    }

    #[tokio::test(start_paused = true)]
    async fn admitted_anyway_commands_go_through_an_open_breaker_and_count() {
        let b = Breaker::new(BreakerConfig::default().with_failures(2));
        fail(&b);
        fail(&b);
        assert!(b.admit().is_err());
        let refused = b.stats().refused;
        b.admit_anyway().record(false);
        let s = b.stats();
        assert_eq!((s.state, s.failures, s.opened), (BreakerState::Open, 3, 1));
        assert_eq!(s.refused, refused, "not refused");
        // One that gets through shows the store is back: closed at once.
        b.admit_anyway().record(true);
        assert_eq!(b.stats().state, BreakerState::Closed);
        assert!(b.admit().is_ok());
        // Dropped without an outcome (cancelled): no event.
        fail(&b);
        fail(&b);
        drop(b.admit_anyway());
        assert_eq!(b.stats().state, BreakerState::Open);
    }
}
