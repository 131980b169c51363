//! Time sources: the [`Clock`] of rate limiting and, with the `runtime` feature, the
//! clock a [`Runtime`](crate::Runtime)'s leading-edge throttle windows read
//! ([`RuntimeClock`]). This is the one module that reads time.
//!
//! Rate limiting's strategies never read a clock: they are pure functions of `(state, now_ms, cost)`. All
//! readings are epoch milliseconds and saturate at `u64::MAX` rather than wrap.
//! A [`Limiter`](crate::rate_limit::Limiter) reads its [`Clock`] once per call and hands the
//! timestamp down, so a batch such as `check_many` is decided at one instant.

use std::sync::Arc;
use std::sync::atomic::{AtomicU64, Ordering};
use std::time::{Duration, SystemTime, UNIX_EPOCH};

#[cfg(feature = "runtime")]
mod window;
#[cfg(feature = "runtime")]
pub use self::window::RuntimeClock;
#[cfg(feature = "runtime")]
pub(crate) use self::window::WindowClock;

/// A source of the current time in whole milliseconds since the Unix epoch.
///
/// Implementations should be monotonic. If one is not, the strategies still never grant
/// extra capacity when time goes backwards: they treat an earlier `now` as "no time passed".
pub trait Clock: Send + Sync + 'static {
    /// The current time in milliseconds since the Unix epoch.
    fn now_ms(&self) -> u64;
}

impl<C: Clock + ?Sized> Clock for Arc<C> {
    fn now_ms(&self) -> u64 {
        (**self).now_ms()
    }
}

/// The default clock: wall-clock epoch milliseconds read once at creation, advanced by
/// tokio's monotonic clock.
///
/// Created while tokio's clock is paused (a test under
/// `#[tokio::test(start_paused = true)]`), it reads tokio's clock, so `tokio::time::advance`
/// moves it. Otherwise it reads the same time through the CPU's timestamp counter against a
/// base taken at creation (as a [`Runtime`](crate::Runtime)'s throttle windows do): less than half
/// the cost of a `clock_gettime` on the hot path of every check, and no serialised read that
/// keeps the cache misses of consecutive checks from overlapping. It never goes backwards, even
/// if the system clock is changed after creation.
///
/// # Examples
///
/// ```
/// use throttlebeam::clock::{Clock, TokioClock};
///
/// let clock = TokioClock::new();
/// let a = clock.now_ms();
/// assert!(clock.now_ms() >= a);
/// ```
#[derive(Debug, Clone)]
pub struct TokioClock {
    epoch_ms: u64,
    source: TokioSource,
}

#[derive(Debug, Clone)]
enum TokioSource {
    /// Tokio's clock was paused at creation: read it.
    Tokio(tokio::time::Instant),
    /// It ran freely: the timestamp counter since `anchor`.
    Tsc { clock: quanta::Clock, anchor: u64 },
}

impl TokioClock {
    /// Anchors a new clock at the current wall-clock time.
    #[must_use]
    pub fn new() -> Self {
        Self::starting_at(wall_clock_ms())
    }

    /// Anchors a new clock that reads `epoch_ms` now and advances with tokio's clock.
    #[must_use]
    pub fn starting_at(epoch_ms: u64) -> Self {
        let source = if tokio_paused() {
            TokioSource::Tokio(tokio::time::Instant::now())
        } else {
            let clock = quanta();
            TokioSource::Tsc {
                anchor: clock.raw(),
                clock,
            }
        };
        Self { epoch_ms, source }
    }
}

impl Default for TokioClock {
    fn default() -> Self {
        Self::new()
    }
}

impl Clock for TokioClock {
    #[inline]
    fn now_ms(&self) -> u64 {
        let elapsed_ms = match &self.source {
            TokioSource::Tsc { clock, anchor } => {
                clock.delta_as_nanos(*anchor, clock.raw()) / 1_000_000
            }
            TokioSource::Tokio(anchor) => duration_ms(anchor.elapsed()),
        };
        self.epoch_ms.saturating_add(elapsed_ms)
    }
}

/// One calibrated timestamp-counter clock per process (calibration takes a while).
pub(crate) fn quanta() -> quanta::Clock {
    static CLOCK: std::sync::OnceLock<quanta::Clock> = std::sync::OnceLock::new();
    CLOCK.get_or_init(quanta::Clock::new).clone()
}

/// Whether tokio's clock is paused now: it stands still while real time moves (checked over
/// 20 µs). Outside a runtime it runs.
pub(crate) fn tokio_paused() -> bool {
    let before = tokio::time::Instant::now();
    let spin = std::time::Instant::now();
    while spin.elapsed() < Duration::from_micros(20) {
        std::hint::spin_loop();
    }
    tokio::time::Instant::now() == before
}

/// A fast clock for hot paths: wall-clock epoch milliseconds read once at creation, advanced
/// by the CPU's timestamp counter through [`quanta`] (the clock governor uses), falling back
/// to the OS monotonic clock where the counter is unreliable.
///
/// Reading it costs roughly half of `std::time::Instant::now()`. Unlike [`TokioClock`] it does
/// not follow tokio's paused time, so tests should use [`TokioClock`] or [`ManualClock`].
///
/// # Examples
///
/// ```
/// use throttlebeam::clock::QuantaClock;
/// use throttlebeam::rate_limit::{Gcra, Limiter};
///
/// let limiter = Limiter::builder(Gcra::per_second(std::num::NonZeroU32::new(100).unwrap()))
///     .with_clock(QuantaClock::new())
///     .build();
/// assert!(limiter.check("k")?.allowed);
/// # Ok::<(), throttlebeam::rate_limit::RateLimitError>(())
/// ```
#[derive(Debug, Clone)]
pub struct QuantaClock {
    epoch_ms: u64,
    anchor: u64,
    clock: quanta::Clock,
}

impl QuantaClock {
    /// Anchors a new clock at the current wall-clock time.
    #[must_use]
    pub fn new() -> Self {
        let clock = quanta::Clock::new();
        Self {
            epoch_ms: wall_clock_ms(),
            anchor: clock.raw(),
            clock,
        }
    }
}

impl Default for QuantaClock {
    fn default() -> Self {
        Self::new()
    }
}

impl Clock for QuantaClock {
    #[inline]
    fn now_ms(&self) -> u64 {
        // Raw counter deltas skip quanta's `Instant` and `Duration` conversions.
        let elapsed_ns = self.clock.delta_as_nanos(self.anchor, self.clock.raw());
        self.epoch_ms.saturating_add(elapsed_ns / 1_000_000)
    }
}

/// A clock that moves only when told to, for deterministic tests.
///
/// Clones share the same time, so a test can keep one handle and give another to a limiter.
///
/// # Examples
///
/// ```
/// use std::time::Duration;
/// use throttlebeam::clock::{Clock, ManualClock};
///
/// let clock = ManualClock::new(0);
/// clock.advance(Duration::from_secs(5));
/// assert_eq!(clock.now_ms(), 5_000);
/// clock.set(1_000); // going backwards is allowed, to test that nothing breaks
/// assert_eq!(clock.now_ms(), 1_000);
/// ```
#[derive(Debug, Clone, Default)]
pub struct ManualClock {
    now: Arc<AtomicU64>,
}

impl ManualClock {
    /// A clock that reads `start_ms`.
    #[must_use]
    pub fn new(start_ms: u64) -> Self {
        Self {
            now: Arc::new(AtomicU64::new(start_ms)),
        }
    }

    /// Moves the clock forward by `by` (whole milliseconds), saturating at `u64::MAX`.
    pub fn advance(&self, by: Duration) {
        self.advance_ms(duration_ms(by));
    }

    /// Moves the clock forward by `ms` milliseconds, saturating at `u64::MAX`: it never wraps
    /// around to the past.
    pub fn advance_ms(&self, ms: u64) {
        // The closure always returns `Some`, so the update always succeeds.
        let _ = self
            .now
            .fetch_update(Ordering::Relaxed, Ordering::Relaxed, |now| {
                Some(now.saturating_add(ms))
            });
    }

    /// Sets the clock to `now_ms`, which may be in the past.
    pub fn set(&self, now_ms: u64) {
        self.now.store(now_ms, Ordering::Relaxed);
    }
}

impl Clock for ManualClock {
    fn now_ms(&self) -> u64 {
        self.now.load(Ordering::Relaxed)
    }
}

/// The system clock in epoch ms (0 if it is set before 1970).
fn wall_clock_ms() -> u64 {
    SystemTime::now()
        .duration_since(UNIX_EPOCH)
        .map_or(0, duration_ms)
}

/// Whole milliseconds in `d`, saturating at `u64::MAX`.
pub(crate) fn duration_ms(d: Duration) -> u64 {
    u64::try_from(d.as_millis()).unwrap_or(u64::MAX)
}

/// Nanoseconds in `d`, saturating at `u64::MAX` (584 years).
#[cfg(feature = "runtime")]
#[inline]
pub(crate) fn duration_ns(d: Duration) -> u64 {
    u64::try_from(d.as_nanos()).unwrap_or(u64::MAX)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[tokio::test(start_paused = true)]
    async fn a_tokio_clock_made_on_paused_time_follows_advance() {
        let clock = TokioClock::starting_at(1_000);
        assert!(matches!(clock.source, TokioSource::Tokio(_)));
        std::thread::sleep(Duration::from_millis(5));
        assert_eq!(clock.now_ms(), 1_000, "paused: real time does not move it");
        tokio::time::advance(Duration::from_millis(250)).await;
        assert_eq!(clock.now_ms(), 1_250);
    }

    #[test]
    fn a_tokio_clock_made_on_running_time_reads_the_counter() {
        let clock = TokioClock::starting_at(1_000);
        assert!(matches!(clock.source, TokioSource::Tsc { .. }));
        let start = std::time::Instant::now();
        std::thread::sleep(Duration::from_millis(30));
        let moved = clock.now_ms() - 1_000;
        let real = duration_ms(start.elapsed());
        // The same time as the OS clock, to a few ms of calibration.
        assert!(
            (30..=real + 5).contains(&moved),
            "moved {moved} ms in {real} ms"
        );
    }

    #[test]
    fn duration_ms_truncates_and_saturates() {
        assert_eq!(duration_ms(Duration::from_micros(1_999)), 1);
        assert_eq!(duration_ms(Duration::MAX), u64::MAX);
    }

    #[test]
    fn manual_clock_saturates_instead_of_wrapping() {
        let clock = ManualClock::new(u64::MAX - 5);
        clock.advance_ms(10);
        assert_eq!(clock.now_ms(), u64::MAX);
        clock.advance(Duration::MAX);
        assert_eq!(clock.now_ms(), u64::MAX);
    }

    #[test]
    fn quanta_clock_starts_at_the_wall_clock_and_moves_forward() {
        let wall = wall_clock_ms();
        let clock = QuantaClock::new();
        let a = clock.now_ms();
        assert!(a >= wall && a - wall < 1_000);
        std::thread::sleep(Duration::from_millis(3));
        assert!(clock.now_ms() >= a + 3);
    }

    #[tokio::test(start_paused = true)]
    async fn tokio_clock_follows_paused_time() {
        let clock = TokioClock::starting_at(1_000);
        assert_eq!(clock.now_ms(), 1_000);
        tokio::time::advance(Duration::from_millis(250)).await;
        assert_eq!(clock.now_ms(), 1_250);
    }
}
