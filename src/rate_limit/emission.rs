//! The emission-interval core shared by [`Gcra`](super::Gcra) and the
//! [`LeakyBucket`](super::LeakyBucket) shaper: a theoretical arrival time (TAT) advanced by
//! `period / per` for every unit.
//!
//! The interval is kept as the exact fraction `period_us / per`: the TAT is a whole number of
//! microseconds plus a remainder in `1/per` µs, so a quota of 700,000 per second is neither
//! 500,000 (a 2 µs interval) nor 1,000,000 (1 µs), and no rate drifts over time. Every
//! intermediate value stays within 2^53 (checked at construction).

use serde::{Deserialize, Serialize};

use super::RateLimitError;
use super::strategy::{MAX_EXACT, exact};

/// A theoretical arrival time: `us + rem / per` microseconds.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, Default, Serialize, Deserialize)]
pub struct Tat {
    /// Whole epoch microseconds.
    pub us: u64,
    /// The fraction of a microsecond, in `1/per` µs (always `< per`).
    pub rem: u64,
}

/// An emission interval of `period_us / per` µs with a tolerance of `tolerance / per` µs.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, Serialize)]
pub(crate) struct Emission {
    /// The period, µs: one unit costs `period_us / per` µs.
    pub(crate) period_us: u64,
    /// Units per period.
    pub(crate) per: u64,
    /// How far ahead of now the TAT may run after a unit is admitted, in `1/per` µs.
    pub(crate) tolerance: u64,
    /// `period_us / per` when it is a whole number of microseconds (the usual case), else 0:
    /// lets `consume` skip a division.
    #[serde(skip)]
    pub(crate) whole_us: u64,
    /// Units admissible at once from a TAT at or before now, `tolerance / period_us`: lets
    /// `available` skip a division for a key that is full.
    #[serde(skip)]
    full: u64,
}

impl Emission {
    /// `per` units per `period_us`; `tolerance` in `1/per` µs.
    pub(crate) fn new(
        period_us: u64,
        per: u64,
        tolerance: u64,
        what: &'static str,
    ) -> Result<Self, RateLimitError> {
        if per > period_us {
            return Err(RateLimitError::TooFine {
                what,
                units: per,
                period_us,
            });
        }
        exact(u128::from(tolerance) + u128::from(period_us), what)?;
        Ok(Self::from_parts(period_us, per, tolerance))
    }

    /// Trusted parts: `per <= period_us`, `tolerance + period_us <= 2^53`.
    pub(crate) fn from_parts(period_us: u64, per: u64, tolerance: u64) -> Self {
        let whole_us = if period_us.is_multiple_of(per) {
            period_us / per
        } else {
            0
        };
        Self {
            period_us,
            per,
            tolerance,
            whole_us,
            full: tolerance / period_us,
        }
    }

    /// The largest tolerance for this interval, in `1/per` µs.
    pub(crate) fn max_tolerance(period_us: u64) -> u64 {
        MAX_EXACT - period_us
    }

    /// Units admissible at once from an empty queue.
    pub(crate) fn slots(&self) -> u64 {
        self.full
    }

    /// The TAT brought forward to `now` (never before it).
    ///
    /// A fraction at or above `per` was written with a larger `per` (another quota, an
    /// override): less than a microsecond in the units it was written in, it is read as one
    /// whole microsecond, so a key is never read as more than a microsecond off its TAT, and
    /// never earlier.
    #[inline]
    pub(crate) fn view(&self, tat: Option<Tat>, now: u64) -> Tat {
        match tat {
            Some(t) if t.rem >= self.per => self.view(
                Some(Tat {
                    us: t.us.saturating_add(1),
                    rem: 0,
                }),
                now,
            ),
            Some(t) if t.us > now || (t.us == now && t.rem > 0) => t,
            _ => Tat { us: now, rem: 0 },
        }
    }

    /// How far `tat` runs ahead of `now`, in `1/per` µs (saturating).
    #[inline]
    fn ahead(&self, tat: &Tat, now: u64) -> u64 {
        tat.us
            .saturating_sub(now)
            .saturating_mul(self.per)
            .saturating_add(tat.rem)
    }

    /// Units spendable at `now`.
    #[inline]
    pub(crate) fn available(&self, tat: &Tat, now: u64) -> u64 {
        match self.ahead(tat, now) {
            0 => self.full,
            ahead => self.tolerance.saturating_sub(ahead) / self.period_us,
        }
    }

    /// The earliest µs `>= now` at which `units` are spendable.
    pub(crate) fn earliest(&self, tat: &Tat, now: u64, units: u64) -> u64 {
        // Spendable at t when (tat - t) * per + units * period <= tolerance.
        let need = tat.rem.saturating_add(units.saturating_mul(self.period_us));
        let at = if need <= self.tolerance {
            tat.us.saturating_sub((self.tolerance - need) / self.per)
        } else {
            tat.us
                .saturating_add((need - self.tolerance).div_ceil(self.per))
        };
        at.max(now)
    }

    /// The TAT after `units` more, and the µs (rounded up) at which it is reached.
    #[inline]
    pub(crate) fn consume(&self, tat: Tat, units: u64) -> (Tat, u64) {
        if self.whole_us > 0 && tat.rem == 0 {
            let us = tat.us.saturating_add(units.saturating_mul(self.whole_us));
            return (Tat { us, rem: 0 }, us);
        }
        let total = tat.rem.saturating_add(units.saturating_mul(self.period_us));
        let next = Tat {
            us: tat.us.saturating_add(total / self.per),
            rem: total % self.per,
        };
        (next, next.us.saturating_add(u64::from(next.rem > 0)))
    }

    /// How long the TAT runs ahead of `now`, in µs rounded up.
    pub(crate) fn delay(&self, tat: &Tat, now: u64) -> u64 {
        tat.us
            .saturating_sub(now)
            .saturating_add(u64::from(tat.rem > 0))
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn fractional_intervals_do_not_drift() {
        // 3 per second: 333,333.33 µs each; three of them are exactly one second.
        let e = Emission::new(1_000_000, 3, 3_000_000, "burst").unwrap();
        let (tat, at) = e.consume(Tat { us: 0, rem: 0 }, 1);
        assert_eq!(
            (tat, at),
            (
                Tat {
                    us: 333_333,
                    rem: 1
                },
                333_334
            )
        );
        let (tat, _) = e.consume(tat, 2);
        assert_eq!(
            tat,
            Tat {
                us: 1_000_000,
                rem: 0
            }
        );
        assert_eq!(e.available(&tat, 0), 0);
        assert_eq!(e.earliest(&tat, 0, 1), 333_334);
        assert_eq!(e.available(&tat, 333_334), 1);
        assert_eq!(e.available(&tat, 333_333), 0);
    }

    #[test]
    fn a_full_key_has_every_slot_without_dividing() {
        // 3 per second, burst 5: a TAT at or before now leaves all five.
        let e = Emission::new(1_000_000, 3, 5_000_000, "burst").unwrap();
        let now = 7_000_000;
        for tat in [Tat { us: 0, rem: 0 }, Tat { us: now, rem: 0 }] {
            assert_eq!(e.available(&tat, now), 5);
        }
        assert_eq!(e.slots(), 5);
        // A third of a microsecond ahead is past the fifth slot's tolerance.
        assert_eq!(e.available(&Tat { us: now, rem: 1 }, now), 4);
    }

    #[test]
    fn an_interval_under_one_microsecond_is_too_fine() {
        assert!(Emission::new(1_000_000, 1_000_000, 1_000_000, "x").is_ok());
        assert!(matches!(
            Emission::new(1_000_000, 1_000_001, 1_000_000, "x"),
            Err(RateLimitError::TooFine { .. })
        ));
    }
}
