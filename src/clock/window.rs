//! The clock of leading-edge throttle windows: tokio's, read through the CPU's timestamp counter
//! unless tokio's clock is paused.
//!
//! A throttled call reads the time once, on its hottest path. Measured on a
//! 2-vCPU VM over 100,000 keys: a throttled call took 150 ns reading tokio's
//! clock (the vDSO `clock_gettime`, whose ordered TSC read also stops the
//! cache misses of consecutive calls from overlapping) and 92 ns reading the
//! timestamp counter (through `quanta`, the clock governor uses). So the
//! ratio against governor depended on which clock a runtime got: 0.93 on the
//! TSC, 1.49 on tokio's clock. Now every runtime whose tokio clock runs
//! freely reads the TSC against a base pair (a TSC reading and a tokio
//! `Instant`) taken once at start, which is tokio's clock read faster; only
//! a runtime started on a paused tokio clock (tests with `start_paused`)
//! reads tokio's clock, so `tokio::time::advance` moves its windows. Where
//! `quanta` finds no usable TSC it reads the OS monotonic clock, as governor
//! then does too. Windows are opened, checked and swept on this one clock,
//! so its drift against tokio's clock only scales window lengths by parts
//! per million. Everything that arms a timer (debounce, leases, waits) stays
//! on tokio's clock.

use tokio::time::Instant;

use super::{duration_ns, quanta, tokio_paused};

/// Which clock a [`crate::Runtime`]'s leading-edge throttle windows use.
///
/// Either way the windows are on tokio's time; the choice is how it is
/// read. A clock read sits on the hot path of every throttled call, and the
/// timestamp counter reads it fastest.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
#[non_exhaustive]
pub enum RuntimeClock {
    /// The timestamp counter against a base taken at start, unless tokio's
    /// clock is paused when the runtime starts (tests with `start_paused`):
    /// then tokio's clock itself, so `tokio::time::advance` moves windows.
    #[default]
    Auto,
    /// Always the timestamp counter (through `quanta`), even on a paused
    /// tokio clock.
    Tsc,
}

#[derive(Debug, Clone)]
pub(crate) enum WindowClock {
    Tokio {
        base: Instant,
    },
    Tsc {
        clock: quanta::Clock,
        /// The counter's raw reading at the base: a reading is scaled as a difference from
        /// it, in integers, with no `Duration` on the way.
        base: u64,
        base_tokio: Instant,
    },
}

impl WindowClock {
    pub(crate) fn new(choice: RuntimeClock) -> Self {
        let tsc = match choice {
            RuntimeClock::Tsc => true,
            RuntimeClock::Auto => !tokio_paused(),
        };
        if !tsc {
            return Self::Tokio {
                base: Instant::now(),
            };
        }
        let clock = quanta();
        let base = clock.raw();
        Self::Tsc {
            base,
            base_tokio: Instant::now(),
            clock,
        }
    }

    #[inline]
    pub(crate) fn now(&self) -> Instant {
        match self {
            Self::Tokio { .. } => Instant::now(),
            Self::Tsc { base_tokio, .. } => {
                *base_tokio + std::time::Duration::from_nanos(self.now_ns())
            }
        }
    }

    /// The time as nanoseconds since this clock was made: 8 bytes where an
    /// [`Instant`] takes 16, so a registry entry that holds one stays small
    /// (more entries per cache line and in cache). 584 years of range.
    #[inline]
    pub(crate) fn now_ns(&self) -> u64 {
        match self {
            Self::Tokio { base } => duration_ns(Instant::now().saturating_duration_since(*base)),
            Self::Tsc { clock, base, .. } => clock.delta_as_nanos(*base, clock.raw()),
        }
    }

    pub(crate) fn is_tsc(&self) -> bool {
        matches!(self, Self::Tsc { .. })
    }
}

impl throttlebeam_supervisors::TtlClock for WindowClock {
    #[inline]
    fn now_ns(&self) -> u64 {
        WindowClock::now_ns(self)
    }

    /// On the scale of [`WindowClock::now_ns`]: tokio's clock and the timestamp counter
    /// share the base pair taken at start.
    #[inline]
    fn ns_at(&self, t: Instant) -> u64 {
        let base = match self {
            Self::Tokio { base } => base,
            Self::Tsc { base_tokio, .. } => base_tokio,
        };
        duration_ns(t.saturating_duration_since(*base))
    }
}
