//! This instance's estimate of the Redis server's clock, for values that
//! carry a time written by one instance and read by another (the leading
//! throttle's window end), so that skew between instances never shifts what
//! a reader concludes. Measured with `TIME` at connect and again at most
//! once a minute; accurate to half a round trip plus a minute's drift.

use std::sync::atomic::{AtomicBool, AtomicI64, AtomicU64, Ordering};

/// Seconds between two measurements.
const RESYNC_S: u64 = 60;

#[derive(Debug)]
pub(crate) struct ServerClock {
    /// Server time minus this host's wall time, in µs.
    offset_us: AtomicI64,
    /// This host's wall time (s) of the last measurement or of a claim to
    /// make one; 0: never measured.
    synced_s: AtomicU64,
    /// Whether the server takes `SET … NX … GET` (Redis 7.0 and later);
    /// cleared the first time it refuses it.
    pub(crate) set_nx_get: AtomicBool,
}

impl Default for ServerClock {
    fn default() -> Self {
        Self {
            offset_us: AtomicI64::new(0),
            synced_s: AtomicU64::new(0),
            set_nx_get: AtomicBool::new(true),
        }
    }
}

/// This host's wall time in µs since the epoch (0 before it).
pub(crate) fn wall_us() -> i64 {
    i64::try_from(crate::clock::since_epoch().as_micros()).unwrap_or(i64::MAX)
}

impl ServerClock {
    /// The server's time when this host's wall clock reads `wall_us`.
    pub(crate) fn at(&self, wall_us: i64) -> u64 {
        let us = wall_us.saturating_add(self.offset_us.load(Ordering::Relaxed));
        u64::try_from(us.max(0)).unwrap_or(0)
    }

    /// Whether a measurement is due at this host's wall time `wall_us`; if
    /// so the caller has claimed it, and no other caller gets `true` for the
    /// next minute.
    pub(crate) fn claim_resync(&self, wall_us: i64) -> bool {
        let now_s = u64::try_from(wall_us / 1_000_000).unwrap_or(0);
        let last = self.synced_s.load(Ordering::Relaxed);
        // abs_diff: a wall clock stepped backwards still gets a measurement.
        now_s.abs_diff(last) >= RESYNC_S
            && self
                .synced_s
                .compare_exchange(last, now_s, Ordering::Relaxed, Ordering::Relaxed)
                .is_ok()
    }

    /// Records a `TIME` reply (`server_us`) read between `before_us` and
    /// `after_us` of this host's wall time: the server read its clock
    /// about halfway.
    pub(crate) fn record(&self, before_us: i64, server_us: i64, after_us: i64) {
        let midpoint = before_us + (after_us - before_us) / 2;
        self.offset_us
            .store(server_us.saturating_sub(midpoint), Ordering::Relaxed);
        let after_s = u64::try_from(after_us / 1_000_000).unwrap_or(0);
        self.synced_s.store(after_s.max(1), Ordering::Relaxed);
    }

    pub(crate) fn takes_set_nx_get(&self) -> bool {
        self.set_nx_get.load(Ordering::Relaxed)
    }

    /// The server refused `SET … NX … GET`; returns whether this call is
    /// the one that found out (to log it once).
    pub(crate) fn refuse_set_nx_get(&self) -> bool {
        self.set_nx_get.swap(false, Ordering::Relaxed)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_offset_is_the_server_time_at_the_midpoint_of_the_round_trip() {
        let clock = ServerClock::default();
        let now = wall_us();
        // The server is an hour ahead; the reply took 2 ms.
        let hour = 3_600_000_000;
        clock.record(now - 2_000, now - 1_000 + hour, now);
        let estimate = i64::try_from(clock.at(wall_us()) / 1000).unwrap() * 1000;
        assert!((estimate - (wall_us() + hour)).abs() < 50_000, "{estimate}");
        // Just measured: none due.
        assert!(!clock.claim_resync(wall_us()));
    }

    #[test]
    fn a_measurement_is_claimed_by_one_caller_per_minute() {
        let clock = ServerClock::default();
        assert!(clock.claim_resync(wall_us()), "never measured: due");
        assert!(!clock.claim_resync(wall_us()), "claimed already");
        assert!(clock.takes_set_nx_get());
        assert!(clock.refuse_set_nx_get());
        assert!(!clock.refuse_set_nx_get(), "told once");
        assert!(!clock.takes_set_nx_get());
    }
}
