//! Figures a runtime reports: plain data, one struct per primitive.
//!
//! Each primitive owns its counters and fills its own struct; the runtime's
//! [`Stats`] gathers them without knowing what they count. Every struct is
//! `serde::Serialize`, so a host can log or publish it as it is; with the
//! `metrics` feature, [`crate::Runtime::export_metrics`] publishes them
//! through the `metrics` facade.

use std::sync::atomic::{AtomicU64, Ordering};

use serde::Serialize;

use crate::stripe::Striped;

/// Live figures of a runtime, from [`crate::Runtime::stats`].
///
/// # Examples
///
/// ```
/// # #[tokio::main(flavor = "current_thread")] async fn main() -> Result<(), throttlebeam::Error> {
/// use std::time::Duration;
/// use throttlebeam::Runtime;
///
/// let runtime = Runtime::start().await?;
/// let throttle = runtime.throttle();
/// for _ in 0..3 {
///     let _ = throttle.call("k", Duration::from_secs(1), || async { Ok::<_, std::io::Error>(()) }).await?;
/// }
/// let stats = runtime.stats();
/// assert_eq!((stats.throttle.executed, stats.throttle.throttled), (1, 2));
/// assert_eq!(stats.throttle.windows, 1);
/// # Ok(()) }
/// ```
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default, Serialize)]
#[non_exhaustive]
pub struct Stats {
    /// Keys tracked now, over every primitive (the budget
    /// [`crate::runtime::RuntimeBuilder::with_max_keys`] caps). A throttle window that is
    /// over does not count, though its slot is kept until the sweep or the key's next call
    /// (SCENARIOS W9).
    pub keys: usize,
    /// Per-key processes alive now.
    pub processes: usize,
    /// Timers armed now for keys: debounce deadlines, trailing runs waiting for their
    /// window, leases renewed while a function runs. A window that is over holds none; the
    /// sweeper's tick is [`Stats::sweeping`].
    pub timers: usize,
    /// Whether the sweeper's tick is armed: it is while a map it sweeps holds entries (ended
    /// windows waiting to be forgotten included), and it sleeps with no timer once they are
    /// all empty.
    pub sweeping: bool,
    /// Entries held in the runtime's TTL tables (completed idempotency
    /// results), expired ones not yet swept included.
    pub ttl_entries: usize,
    /// Whether the runtime's root has failed and waits for
    /// [`crate::Runtime::restart`]; calls fail with
    /// [`crate::Error::RuntimeDown`] meanwhile.
    pub down: bool,
    /// Restarts after a failed root so far.
    pub restarts: u64,
    /// The debounce primitive.
    pub debounce: DebounceStats,
    /// The leading-edge throttle.
    pub throttle: ThrottleStats,
    /// Idempotency (counts since the runtime started; a restart keeps them).
    pub idempotency: IdempotencyStats,
    /// Every coalescing throttle of the runtime, added up.
    pub coalesce: CoalesceStats,
    /// The HTTP layers that count in this runtime (feature `http`).
    #[cfg(feature = "http")]
    #[cfg_attr(docsrs, doc(cfg(feature = "http")))]
    pub http: crate::http::HttpStats,
    /// The PostgreSQL store of the runtime ([`RuntimeBuilder::with_postgres`](crate::runtime::RuntimeBuilder::with_postgres)),
    /// or of its idempotency layer's transactions: its statements, pool and transactional
    /// runs (feature `postgres`; all zero without one).
    #[cfg(feature = "postgres")]
    #[cfg_attr(docsrs, doc(cfg(feature = "postgres")))]
    pub postgres: crate::idempotency::postgres::PostgresStats,
}

/// Counters of the debounce primitive of one runtime.
///
/// Totals count since the runtime started (a restart keeps them). Calls are
/// counted when the run covering them is taken (run, cancelled or dropped),
/// so a pending burst's calls show once it ends: a call costs no shared
/// counter on the hot path.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default, Serialize)]
#[non_exhaustive]
pub struct DebounceStats {
    /// Calls whose covering run was taken (run, cancelled or dropped).
    pub calls: u64,
    /// Runs started (leading, trailing, flushed).
    pub runs: u64,
    /// Calls folded into a run already pending for their key.
    pub coalesced: u64,
    /// Pending runs cancelled by `cancel`.
    pub cancelled: u64,
    /// Pending runs flushed by `flush`.
    pub flushed: u64,
    /// Runs whose function failed or panicked, and pending runs lost
    /// (dropped at shutdown, their process gone).
    pub failed: u64,
    /// Keys debounced now (pending or in their quiet window).
    pub keys: usize,
    /// Slots the key map holds memory for (it gives memory back after a
    /// flood once swept).
    pub capacity: usize,
    /// Timer wakeups of debounce processes so far (lazily re-armed timers
    /// make a burst of calls cost about one wakeup).
    pub timer_wakeups: u64,
}

/// Counters of the leading-edge throttle of one runtime.
///
/// Totals count since the runtime started (a restart keeps them).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default, Serialize)]
#[non_exhaustive]
pub struct ThrottleStats {
    /// Calls that opened a window and ran their function.
    pub executed: u64,
    /// Calls turned away inside a window.
    pub throttled: u64,
    /// Windows open now (one that is over does not count, though its slot is kept until the
    /// sweep or its key's next call).
    pub windows: usize,
    /// Slots the window map holds memory for (it gives memory back after a
    /// flood once swept).
    pub capacity: usize,
    /// Calls turned away because another instance holds the window in the
    /// shared store (feature `redis`).
    pub throttled_remotely: u64,
    /// Shared-store failures; each call decided per instance (fail open).
    pub store_errors: u64,
    /// Executed functions that failed or panicked after their caller had
    /// dropped its future: nobody else saw the error, so each is also
    /// logged at warn level.
    pub unobserved_failures: u64,
}

#[cfg(feature = "metrics")]
impl Stats {
    /// Publishes these figures through the `metrics` facade, labelled
    /// `runtime = name`. Totals are counters set to their absolute value
    /// (`*_total`), live figures are gauges. See
    /// [`crate::Runtime::export_metrics`] for the names.
    pub(crate) fn export(&self, name: &str) {
        use metrics::{counter, gauge};
        let label = [("runtime", name.to_owned())];
        let gauges: [(&'static str, usize); 15] = [
            ("throttlebeam_keys", self.keys),
            ("throttlebeam_processes", self.processes),
            ("throttlebeam_timers", self.timers),
            ("throttlebeam_sweeping", usize::from(self.sweeping)),
            ("throttlebeam_ttl_entries", self.ttl_entries),
            ("throttlebeam_down", usize::from(self.down)),
            ("throttlebeam_debounce_keys", self.debounce.keys),
            ("throttlebeam_debounce_capacity", self.debounce.capacity),
            ("throttlebeam_throttle_windows", self.throttle.windows),
            ("throttlebeam_throttle_capacity", self.throttle.capacity),
            (
                "throttlebeam_idempotency_stored_results",
                self.idempotency.stored_results,
            ),
            ("throttlebeam_coalesce_active", self.coalesce.active),
            ("throttlebeam_coalesce_pending", self.coalesce.pending),
            ("throttlebeam_coalesce_keys", self.coalesce.keys),
            ("throttlebeam_coalesce_store_keys", self.coalesce.store_keys),
        ];
        for (metric, value) in gauges {
            // Gauges are f64 by the facade's contract.
            #[allow(clippy::cast_precision_loss)]
            gauge!(metric, &label).set(value as f64);
        }
        #[allow(clippy::cast_precision_loss)]
        gauge!("throttlebeam_idempotency_stored_bytes", &label)
            .set(self.idempotency.stored_bytes as f64);
        let counters: [(&'static str, u64); 26] = [
            ("throttlebeam_restarts_total", self.restarts),
            ("throttlebeam_debounce_calls_total", self.debounce.calls),
            ("throttlebeam_debounce_runs_total", self.debounce.runs),
            (
                "throttlebeam_debounce_coalesced_total",
                self.debounce.coalesced,
            ),
            (
                "throttlebeam_debounce_cancelled_total",
                self.debounce.cancelled,
            ),
            ("throttlebeam_debounce_flushed_total", self.debounce.flushed),
            ("throttlebeam_debounce_failed_total", self.debounce.failed),
            (
                "throttlebeam_throttle_executed_total",
                self.throttle.executed,
            ),
            (
                "throttlebeam_throttle_throttled_total",
                self.throttle.throttled,
            ),
            (
                "throttlebeam_throttle_throttled_remotely_total",
                self.throttle.throttled_remotely,
            ),
            (
                "throttlebeam_throttle_store_errors_total",
                self.throttle.store_errors,
            ),
            (
                "throttlebeam_throttle_unobserved_failures_total",
                self.throttle.unobserved_failures,
            ),
            (
                "throttlebeam_idempotency_fresh_total",
                self.idempotency.fresh,
            ),
            (
                "throttlebeam_idempotency_replays_total",
                self.idempotency.replays,
            ),
            (
                "throttlebeam_idempotency_fingerprint_mismatches_total",
                self.idempotency.fingerprint_mismatches,
            ),
            (
                "throttlebeam_idempotency_takeovers_total",
                self.idempotency.takeovers,
            ),
            (
                "throttlebeam_idempotency_in_flight_rejections_total",
                self.idempotency.in_flight_rejections,
            ),
            (
                "throttlebeam_idempotency_timeouts_total",
                self.idempotency.timeouts,
            ),
            (
                "throttlebeam_idempotency_evictions_total",
                self.idempotency.evictions,
            ),
            ("throttlebeam_coalesce_calls_total", self.coalesce.calls),
            (
                "throttlebeam_coalesce_leading_runs_total",
                self.coalesce.leading_runs,
            ),
            (
                "throttlebeam_coalesce_trailing_runs_total",
                self.coalesce.trailing_runs,
            ),
            (
                "throttlebeam_coalesce_coalesced_total",
                self.coalesce.coalesced,
            ),
            (
                "throttlebeam_coalesce_store_errors_total",
                self.coalesce.store_errors,
            ),
            (
                "throttlebeam_coalesce_evictions_total",
                self.coalesce.evictions,
            ),
            (
                "throttlebeam_coalesce_unobserved_failures_total",
                self.coalesce.unobserved_failures,
            ),
        ];
        for (metric, value) in counters {
            counter!(metric, &label).absolute(value);
        }
        #[cfg(feature = "http")]
        {
            let http = &self.http;
            let counters: [(&'static str, u64); 9] = [
                ("throttlebeam_http_replays_total", http.replays),
                ("throttlebeam_http_fresh_total", http.fresh),
                ("throttlebeam_http_in_flight_total", http.in_flight),
                ("throttlebeam_http_reused_total", http.reused),
                ("throttlebeam_http_too_large_total", http.too_large),
                ("throttlebeam_http_invalid_total", http.invalid),
                ("throttlebeam_http_rate_limited_total", http.rate_limited),
                (
                    "throttlebeam_http_store_failures_total",
                    http.store_failures,
                ),
                ("throttlebeam_http_no_peer_total", http.no_peer),
            ];
            for (metric, value) in counters {
                counter!(metric, &label).absolute(value);
            }
        }
        #[cfg(feature = "postgres")]
        {
            let pg = &self.postgres;
            let tx = &pg.transactions;
            #[allow(clippy::cast_precision_loss)]
            gauge!("throttlebeam_postgres_pool_size", &label).set(pg.pool_size as f64);
            let counters: [(&'static str, u64); 13] = [
                ("throttlebeam_postgres_statements_total", pg.statements),
                ("throttlebeam_postgres_pool_waits_total", pg.pool_waits),
                (
                    "throttlebeam_postgres_pool_timeouts_total",
                    pg.pool_timeouts,
                ),
                ("throttlebeam_postgres_notices_total", pg.notices),
                ("throttlebeam_postgres_swept_total", pg.swept),
                ("throttlebeam_postgres_transactions_fresh_total", tx.fresh),
                (
                    "throttlebeam_postgres_transactions_replays_total",
                    tx.replays,
                ),
                (
                    "throttlebeam_postgres_transactions_fingerprint_mismatches_total",
                    tx.fingerprint_mismatches,
                ),
                (
                    "throttlebeam_postgres_transactions_in_flight_total",
                    tx.in_flight,
                ),
                (
                    "throttlebeam_postgres_transactions_takeovers_total",
                    tx.takeovers,
                ),
                (
                    "throttlebeam_postgres_transactions_committed_total",
                    tx.committed,
                ),
                (
                    "throttlebeam_postgres_transactions_rolled_back_total",
                    tx.rolled_back,
                ),
                (
                    "throttlebeam_postgres_transactions_pool_waits_total",
                    tx.pool_waits,
                ),
            ];
            for (metric, value) in counters {
                counter!(metric, &label).absolute(value);
            }
        }
    }
}

#[cfg(all(feature = "metrics", feature = "redis"))]
impl crate::store::RedisStats {
    /// Publishes these figures through the `metrics` facade, labelled
    /// `runtime = name` (see [`crate::Runtime::export_metrics`]).
    pub(crate) fn export(&self, name: &str) {
        use metrics::{counter, gauge};
        let label = [("runtime", name.to_owned())];
        let state = match self.breaker.state {
            crate::store::BreakerState::Closed => 0.0,
            crate::store::BreakerState::Open => 1.0,
            crate::store::BreakerState::HalfOpen => 2.0,
        };
        gauge!("throttlebeam_redis_breaker_state", &label).set(state);
        gauge!("throttlebeam_redis_breaker_consecutive_failures", &label)
            .set(f64::from(self.breaker.consecutive_failures));
        #[allow(clippy::cast_precision_loss)]
        gauge!("throttlebeam_redis_local_answer_keys", &label).set(self.local_answer_keys as f64);
        let counters: [(&'static str, u64); 15] = [
            ("throttlebeam_redis_commands_total", self.commands),
            ("throttlebeam_redis_failovers_total", self.failovers),
            ("throttlebeam_redis_local_answers_total", self.local_answers),
            (
                "throttlebeam_redis_fresh_key_writes_total",
                self.fresh_key_writes,
            ),
            (
                "throttlebeam_redis_fresh_key_misses_total",
                self.fresh_key_misses,
            ),
            (
                "throttlebeam_redis_script_reloads_total",
                self.script_reloads,
            ),
            ("throttlebeam_redis_reconnects_total", self.reconnects),
            ("throttlebeam_redis_subscriptions_total", self.subscriptions),
            ("throttlebeam_redis_notices_total", self.notices),
            ("throttlebeam_redis_notices_lost_total", self.notices_lost),
            (
                "throttlebeam_redis_breaker_opened_total",
                self.breaker.opened,
            ),
            (
                "throttlebeam_redis_breaker_probes_total",
                self.breaker.probes,
            ),
            (
                "throttlebeam_redis_breaker_recoveries_total",
                self.breaker.recoveries,
            ),
            (
                "throttlebeam_redis_breaker_refused_total",
                self.breaker.refused,
            ),
            (
                "throttlebeam_redis_breaker_failures_total",
                self.breaker.failures,
            ),
        ];
        for (metric, value) in counters {
            counter!(metric, &label).absolute(value);
        }
    }
}

/// A counter bumped on hot paths from many threads: each thread adds to its
/// own cache line, so counting costs no line bouncing between cores.
#[derive(Default)]
pub(crate) struct Counter(Striped<AtomicU64>);

impl Counter {
    #[inline]
    pub(crate) fn add(&self, n: u64) {
        self.0.local().fetch_add(n, Ordering::Relaxed);
    }

    #[inline]
    pub(crate) fn incr(&self) {
        self.add(1);
    }

    pub(crate) fn get(&self) -> u64 {
        self.0
            .iter()
            .map(|s| s.load(Ordering::Relaxed))
            .fold(0, u64::wrapping_add)
    }
}

/// A gauge moved up and down on hot paths from many threads, striped like
/// [`Counter`]: its value is the sum of its stripes, read as zero while a
/// racing read sees a decrement before its increment.
#[derive(Default)]
pub(crate) struct Gauge(Counter);

impl Gauge {
    #[inline]
    pub(crate) fn add(&self, n: usize) {
        self.0.add(n as u64);
    }

    #[inline]
    pub(crate) fn sub(&self, n: usize) {
        self.0.add((n as u64).wrapping_neg());
    }

    pub(crate) fn get(&self) -> usize {
        usize::try_from(self.0.get().cast_signed().max(0)).unwrap_or(usize::MAX)
    }
}

impl std::fmt::Debug for Counter {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_tuple("Counter").field(&self.get()).finish()
    }
}

/// Counters of a runtime's idempotent calls, from
/// [`IdempotencyHandle::stats`](crate::IdempotencyHandle::stats). Counts are since the runtime started;
/// `stored_results` is a level.
///
/// # Examples
///
/// ```
/// # #[tokio::main(flavor = "current_thread")] async fn main() -> Result<(), throttlebeam::Error> {
/// use throttlebeam::Runtime;
///
/// let idempotency = Runtime::start().await?.idempotency();
/// for _ in 0..2 {
///     let _ = idempotency.run("job:1", || async { Ok::<_, std::io::Error>(1) }).await?;
/// }
/// let stats = idempotency.stats();
/// assert_eq!((stats.fresh, stats.replays, stats.stored_results), (1, 1, 1));
/// # Ok(()) }
/// ```
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default, Serialize)]
#[non_exhaustive]
pub struct IdempotencyStats {
    /// Calls that claimed their key and ran their function, or got an
    /// [`IdempotencyReservation`](crate::idempotency::IdempotencyReservation).
    pub fresh: u64,
    /// Calls answered with a stored result.
    pub replays: u64,
    /// Calls refused with [`Error::FingerprintMismatch`](crate::Error::FingerprintMismatch).
    pub fingerprint_mismatches: u64,
    /// Keys taken over from a holder whose lease lapsed (a holder gone
    /// without releasing its key).
    pub takeovers: u64,
    /// Duplicates refused at once with [`Error::InFlight`](crate::Error::InFlight).
    pub in_flight_rejections: u64,
    /// Duplicates that gave up with [`Error::Timeout`](crate::Error::Timeout).
    pub timeouts: u64,
    /// Runs that ended in an error (their function failed or panicked, or
    /// their result could not be stored) after their caller had left, so
    /// that nobody received it; each is also logged at warn.
    pub failures_after_caller_left: u64,
    /// Results evicted by the cap or the byte budget before their TTL.
    pub evictions: u64,
    /// Results held now, expired ones not yet swept included.
    pub stored_results: usize,
    /// What the results held now weigh against the byte budget
    /// ([`RuntimeBuilder::with_max_idempotency_bytes`](crate::runtime::RuntimeBuilder::with_max_idempotency_bytes)).
    /// Zero with a shared store, which keeps results elsewhere.
    pub stored_bytes: u64,
}

/// Figures of one [`Coalesce`](crate::Coalesce), from [`Coalesce::stats`](crate::Coalesce::stats).
///
/// The gauges (`active`, `pending`, `timers`) are zero once the throttle is
/// idle; `keys` once its windows are over (not waiting for the runtime's
/// sweep); `store_keys` once the store has swept them; the counters only
/// grow.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default, Serialize)]
#[non_exhaustive]
pub struct CoalesceStats {
    /// Keys with a run in progress, including runs still claiming their
    /// window in the store.
    pub active: usize,
    /// Keys with coalesced calls waiting for a trailing run.
    pub pending: usize,
    /// Keys live now: running, pending, or inside a window (an open window
    /// with nothing pending is a timestamp with no process). A window that
    /// is over counts no more, even before the runtime's sweeper forgets it.
    pub keys: usize,
    /// Per-key timers scheduled now (one per key at most: a window with a
    /// trailing run pending, held by the throttle's sleeper, or a lease).
    pub timers: usize,
    /// Keys held by the window store, as it reports them
    /// ([`WindowStore::stats`](crate::coalesce::WindowStore::stats); 0 for a store that does not say, and without
    /// a store).
    pub store_keys: usize,
    /// Calls accepted.
    pub calls: u64,
    /// Leading runs started.
    pub leading_runs: u64,
    /// Trailing runs started.
    pub trailing_runs: u64,
    /// Calls coalesced into a run they did not start (`calls` minus the
    /// calls that led).
    pub coalesced: u64,
    /// Window store calls that failed or panicked (the throttle failed open).
    pub store_errors: u64,
    /// Window store calls that timed out (the throttle failed open).
    pub store_timeouts: u64,
    /// Live windows the store evicted early because it was full
    /// ([`WindowStore::stats`](crate::coalesce::WindowStore::stats)).
    pub evictions: u64,
    /// Runs that failed (error or panic) with nobody left to hear it: a
    /// leading run whose caller dropped its future (also logged at warn
    /// level), a trailing run no caller waits for (logged at error level,
    /// as every failed trailing run).
    pub unobserved_failures: u64,
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn counts_from_many_threads() {
        let counter = Counter::default();
        std::thread::scope(|s| {
            for _ in 0..4 {
                s.spawn(|| {
                    for _ in 0..1000 {
                        counter.incr();
                    }
                });
            }
        });
        assert_eq!(counter.get(), 4000);
    }

    #[test]
    fn stats_serialize_with_one_object_per_primitive() {
        let stats = Stats {
            throttle: ThrottleStats {
                executed: 2,
                ..ThrottleStats::default()
            },
            ..Stats::default()
        };
        let json = serde_json::to_value(stats).unwrap();
        assert_eq!(json["throttle"]["executed"], 2);
        assert_eq!(json["debounce"]["calls"], 0);
        assert_eq!(json["down"], false);
    }
}
