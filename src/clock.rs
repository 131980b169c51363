//! Time sources: the [`Clock`] of rate limiting and, with the `runtime` feature, the
//! clock a [`Runtime`](crate::Runtime)'s leading-edge throttle windows read
//! ([`RuntimeClock`]). This is the one module that reads time.
//!
//! A [`Clock`] reads epoch **microseconds**: rate limiting's strategies keep time in whole
//! microseconds, so a clock of coarser grain would cap every quota at one unit per tick (a
//! millisecond clock lets a GCRA of 10,000 per second with a burst of 1 admit only 1,000).
//! The strategies never read a clock: they are pure functions of `(state, now_us, cost)`. All
//! readings saturate at `u64::MAX` rather than wrap.
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
pub use crate::key::MAX_TIMER;

/// Microseconds per millisecond.
const US_PER_MS: u64 = 1_000;

/// A source of the current time in whole microseconds since the Unix epoch.
///
/// Implementations should be monotonic. If one is not, the strategies still never grant
/// extra capacity when time goes backwards: they treat an earlier `now` as "no time passed".
///
/// # Examples
///
/// A clock of your own implements [`Clock::now_us`]; [`Clock::now_ms`] follows from it.
///
/// ```
/// use throttlebeam::clock::Clock;
///
/// struct Fixed(u64);
///
/// impl Clock for Fixed {
///     fn now_us(&self) -> u64 {
///         self.0
///     }
/// }
///
/// assert_eq!(Fixed(1_234_567).now_ms(), 1_234);
/// ```
pub trait Clock: Send + Sync + 'static {
    /// The current time in microseconds since the Unix epoch.
    fn now_us(&self) -> u64;

    /// The current time in whole milliseconds since the Unix epoch: [`Clock::now_us`]
    /// rounded down.
    #[inline]
    fn now_ms(&self) -> u64 {
        self.now_us() / US_PER_MS
    }
}

impl<C: Clock + ?Sized> Clock for Arc<C> {
    #[inline]
    fn now_us(&self) -> u64 {
        (**self).now_us()
    }

    #[inline]
    fn now_ms(&self) -> u64 {
        (**self).now_ms()
    }
}

/// The default clock: wall-clock epoch microseconds read once at creation, advanced by
/// tokio's monotonic clock.
///
/// Created while tokio's clock is paused (a test under
/// `#[tokio::test(start_paused = true)]`), it reads tokio's clock, so `tokio::time::advance`
/// moves it (to the microsecond). Otherwise it reads the same time through the CPU's timestamp
/// counter against a base taken at creation (as a [`Runtime`](crate::Runtime)'s throttle
/// windows do): less than half the cost of a `clock_gettime` on the hot path of every check,
/// and no serialised read that keeps the cache misses of consecutive checks from overlapping.
/// It never goes backwards, even if the system clock is changed after creation.
///
/// # Examples
///
/// ```
/// use throttlebeam::clock::{Clock, TokioClock};
///
/// let clock = TokioClock::new();
/// let a = clock.now_us();
/// assert!(clock.now_us() >= a);
/// ```
#[derive(Debug, Clone)]
pub struct TokioClock {
    epoch_us: u64,
    source: TokioSource,
}

#[derive(Debug, Clone)]
enum TokioSource {
    /// Tokio's clock was paused at creation: read it.
    Tokio(tokio::time::Instant),
    /// It ran freely: the timestamp counter.
    Tsc(Ticks),
}

impl TokioClock {
    /// Anchors a new clock at the current wall-clock time.
    #[must_use]
    pub fn new() -> Self {
        Self::starting_at_us(wall_clock_us())
    }

    /// Anchors a new clock that reads `epoch_ms` (milliseconds) now and advances with tokio's
    /// clock.
    #[must_use]
    pub fn starting_at(epoch_ms: u64) -> Self {
        Self::starting_at_us(epoch_ms.saturating_mul(US_PER_MS))
    }

    /// Anchors a new clock that reads `epoch_us` (microseconds) now and advances with tokio's
    /// clock.
    #[must_use]
    pub fn starting_at_us(epoch_us: u64) -> Self {
        let source = if tokio_paused() {
            TokioSource::Tokio(tokio::time::Instant::now())
        } else {
            TokioSource::Tsc(Ticks::new(quanta()))
        };
        Self { epoch_us, source }
    }
}

impl Default for TokioClock {
    fn default() -> Self {
        Self::new()
    }
}

impl Clock for TokioClock {
    #[inline]
    fn now_us(&self) -> u64 {
        let elapsed_us = match &self.source {
            TokioSource::Tsc(ticks) => ticks.elapsed_us(),
            TokioSource::Tokio(anchor) => duration_us(anchor.elapsed()),
        };
        self.epoch_us.saturating_add(elapsed_us)
    }
}

/// Nanoseconds per microsecond.
const NS_PER_US: u64 = 1_000;

/// The fixed point of [`Ticks`]' scale: microseconds per 2^56 ticks.
const TICK_SHIFT: u32 = 56;

/// Microseconds since an anchor, counted in quanta's raw ticks (the timestamp counter, or the
/// OS monotonic clock where the counter is unreliable) and scaled to microseconds by one
/// multiplication: quanta's own ticks-to-nanoseconds scale, read once by converting 2^56
/// ticks, divided by 1,000 ahead of time. It agrees with quanta's nanoseconds divided by
/// 1,000 to within a microsecond at any instant (the scale's rounding adds under 2 µs per
/// year of uptime), and it never goes backwards.
#[derive(Debug, Clone)]
struct Ticks {
    clock: quanta::Clock,
    anchor: u64,
    /// Microseconds per 2^56 ticks, rounded.
    us_per_2_56: u64,
}

impl Ticks {
    fn new(clock: quanta::Clock) -> Self {
        let ns = clock.delta_as_nanos(0, 1 << TICK_SHIFT);
        Self {
            anchor: clock.raw(),
            us_per_2_56: ns.saturating_add(NS_PER_US / 2) / NS_PER_US,
            clock,
        }
    }

    /// Microseconds since the anchor (0 if the counter reads earlier than it).
    #[inline]
    fn elapsed_us(&self) -> u64 {
        self.us(self.clock.raw().saturating_sub(self.anchor))
    }

    /// `ticks` in microseconds.
    #[inline]
    fn us(&self, ticks: u64) -> u64 {
        let us = (u128::from(ticks) * u128::from(self.us_per_2_56)) >> TICK_SHIFT;
        u64::try_from(us).unwrap_or(u64::MAX)
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

/// A fast clock for hot paths: wall-clock epoch microseconds read once at creation, advanced
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
    epoch_us: u64,
    ticks: Ticks,
}

impl QuantaClock {
    /// Anchors a new clock at the current wall-clock time.
    #[must_use]
    pub fn new() -> Self {
        Self {
            epoch_us: wall_clock_us(),
            ticks: Ticks::new(quanta::Clock::new()),
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
    fn now_us(&self) -> u64 {
        // Raw counter deltas skip quanta's `Instant` and `Duration` conversions.
        self.epoch_us.saturating_add(self.ticks.elapsed_us())
    }
}

/// A clock that moves only when told to, for deterministic tests. It keeps microseconds;
/// [`ManualClock::new`], [`ManualClock::advance_ms`] and [`ManualClock::set`] speak
/// milliseconds, their `_us` forms microseconds, and [`ManualClock::advance`] moves by a
/// [`Duration`] to the microsecond.
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
/// clock.advance(Duration::from_micros(250));
/// assert_eq!(clock.now_us(), 5_000_250);
/// clock.set(1_000); // going backwards is allowed, to test that nothing breaks
/// assert_eq!(clock.now_us(), 1_000_000);
/// ```
#[derive(Debug, Clone, Default)]
pub struct ManualClock {
    now_us: Arc<AtomicU64>,
}

impl ManualClock {
    /// A clock that reads `start_ms` milliseconds (saturating at `u64::MAX` µs).
    #[must_use]
    pub fn new(start_ms: u64) -> Self {
        Self::new_us(start_ms.saturating_mul(US_PER_MS))
    }

    /// A clock that reads `start_us` microseconds.
    #[must_use]
    pub fn new_us(start_us: u64) -> Self {
        Self {
            now_us: Arc::new(AtomicU64::new(start_us)),
        }
    }

    /// Moves the clock forward by `by` (whole microseconds), saturating at `u64::MAX` µs.
    pub fn advance(&self, by: Duration) {
        self.advance_us(duration_us(by));
    }

    /// Moves the clock forward by `ms` milliseconds, saturating at `u64::MAX` µs: it never
    /// wraps around to the past.
    pub fn advance_ms(&self, ms: u64) {
        self.advance_us(ms.saturating_mul(US_PER_MS));
    }

    /// Moves the clock forward by `us` microseconds, saturating at `u64::MAX`: it never wraps
    /// around to the past.
    pub fn advance_us(&self, us: u64) {
        // The closure always returns `Some`, so the update always succeeds.
        let _ = self
            .now_us
            .fetch_update(Ordering::Relaxed, Ordering::Relaxed, |now| {
                Some(now.saturating_add(us))
            });
    }

    /// Sets the clock to `now_ms` milliseconds, which may be in the past.
    pub fn set(&self, now_ms: u64) {
        self.set_us(now_ms.saturating_mul(US_PER_MS));
    }

    /// Sets the clock to `now_us` microseconds, which may be in the past.
    pub fn set_us(&self, now_us: u64) {
        self.now_us.store(now_us, Ordering::Relaxed);
    }
}

impl Clock for ManualClock {
    #[inline]
    fn now_us(&self) -> u64 {
        self.now_us.load(Ordering::Relaxed)
    }
}

/// The system clock in epoch µs (0 if it is set before 1970).
fn wall_clock_us() -> u64 {
    duration_us(since_epoch())
}

/// The system clock: time since the Unix epoch (zero if it is set before
/// 1970). The crate's one read of the wall clock.
pub(crate) fn since_epoch() -> Duration {
    SystemTime::now()
        .duration_since(UNIX_EPOCH)
        .unwrap_or(Duration::ZERO)
}

/// Whole milliseconds in `d`, saturating at `u64::MAX`.
#[cfg(feature = "runtime")]
pub(crate) fn duration_ms(d: Duration) -> u64 {
    u64::try_from(d.as_millis()).unwrap_or(u64::MAX)
}

/// Whole microseconds in `d`, saturating at `u64::MAX`.
#[inline]
pub(crate) fn duration_us(d: Duration) -> u64 {
    u64::try_from(d.as_micros()).unwrap_or(u64::MAX)
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
        // To the microsecond.
        tokio::time::advance(Duration::from_micros(100)).await;
        assert_eq!(clock.now_us(), 1_250_100);
    }

    #[test]
    fn a_tokio_clock_made_on_running_time_reads_the_counter() {
        let clock = TokioClock::starting_at(1_000);
        assert!(matches!(clock.source, TokioSource::Tsc(_)));
        let start = std::time::Instant::now();
        std::thread::sleep(Duration::from_millis(30));
        let moved = clock.now_us() - 1_000_000;
        let real = duration_us(start.elapsed());
        // The same time as the OS clock, to a few ms of calibration.
        assert!(
            (30_000..=real + 5_000).contains(&moved),
            "moved {moved} µs in {real} µs"
        );
    }

    #[test]
    fn ticks_scale_to_quantas_microseconds() {
        let ticks = Ticks::new(quanta());
        // From a tick to a week of them (at up to 5 GHz), and the counter's own readings.
        let mut t = 1_u64;
        while t < 3_000_000_000_000_000 {
            for ticks_now in [t, t + t / 3, t * 7 / 5] {
                let ours = ticks.us(ticks_now);
                let quantas = ticks.clock.delta_as_nanos(0, ticks_now) / NS_PER_US;
                assert!(
                    ours.abs_diff(quantas) <= 1,
                    "{ticks_now} ticks: {ours} µs, quanta {quantas} µs"
                );
            }
            t = t * 3 + 1;
        }
        let (a, b) = (ticks.elapsed_us(), ticks.elapsed_us());
        assert!(a <= b);
    }

    #[test]
    fn a_running_clock_reads_microseconds() {
        // A millisecond clock read over 3 ms gives readings that all agree below the
        // millisecond; a microsecond clock does not.
        for clock in [
            Box::new(TokioClock::new()) as Box<dyn Clock>,
            Box::new(QuantaClock::new()),
        ] {
            let start = std::time::Instant::now();
            let mut sub_ms = std::collections::BTreeSet::new();
            while start.elapsed() < Duration::from_millis(3) {
                sub_ms.insert(clock.now_us() % 1_000);
            }
            assert!(sub_ms.len() > 1, "{sub_ms:?}");
        }
    }

    #[test]
    fn durations_truncate_and_saturate() {
        #[cfg(feature = "runtime")]
        {
            assert_eq!(duration_ms(Duration::from_micros(1_999)), 1);
            assert_eq!(duration_ms(Duration::MAX), u64::MAX);
        }
        assert_eq!(duration_us(Duration::from_nanos(1_999)), 1);
        assert_eq!(duration_us(Duration::MAX), u64::MAX);
    }

    #[test]
    fn manual_clock_keeps_microseconds_and_its_millisecond_api() {
        let clock = ManualClock::new(7);
        assert_eq!((clock.now_ms(), clock.now_us()), (7, 7_000));
        clock.advance(Duration::from_nanos(1_999));
        assert_eq!(clock.now_us(), 7_001);
        clock.advance_us(999);
        assert_eq!((clock.now_ms(), clock.now_us()), (8, 8_000));
        clock.advance_ms(2);
        assert_eq!(clock.now_us(), 10_000);
        clock.set_us(123_456);
        assert_eq!(clock.now_ms(), 123);
        assert_eq!(ManualClock::new_us(5).now_us(), 5);
        // Clones share the time.
        let other = clock.clone();
        other.set(1);
        assert_eq!(clock.now_us(), 1_000);
    }

    #[test]
    fn manual_clock_saturates_instead_of_wrapping() {
        let clock = ManualClock::new_us(u64::MAX - 5);
        clock.advance_us(10);
        assert_eq!(clock.now_us(), u64::MAX);
        clock.advance(Duration::MAX);
        assert_eq!(clock.now_us(), u64::MAX);
        clock.advance_ms(u64::MAX);
        assert_eq!(clock.now_us(), u64::MAX);
        assert_eq!(ManualClock::new(u64::MAX).now_us(), u64::MAX);
    }

    #[test]
    fn quanta_clock_starts_at_the_wall_clock_and_moves_forward() {
        let wall = wall_clock_us();
        let clock = QuantaClock::new();
        let a = clock.now_us();
        assert!(a >= wall && a - wall < 1_000_000);
        std::thread::sleep(Duration::from_millis(3));
        assert!(clock.now_us() >= a + 3_000);
    }

    #[tokio::test(start_paused = true)]
    async fn tokio_clock_follows_paused_time() {
        let clock = TokioClock::starting_at(1_000);
        assert_eq!(clock.now_ms(), 1_000);
        tokio::time::advance(Duration::from_millis(250)).await;
        assert_eq!(clock.now_ms(), 1_250);
        let us = TokioClock::starting_at_us(1_000_001);
        tokio::time::advance(Duration::from_micros(3)).await;
        assert_eq!(us.now_us(), 1_000_004);
    }
}
