//! A key's first check as one plain `SET … NX`: the state a key with no state holds after the
//! check, computed here, written only if the key is still empty.
//!
//! A check on a key with no state is always allowed (a cost above the capacity never gets
//! here), and what it leaves is a function of the time alone: the window that holds `now`,
//! a theoretical arrival time one cost after it, a bucket less one cost. So the check needs
//! no script: this instance computes that state with the script's own maths (see
//! `rate_limit.lua`, `run` without a state) at its estimate of the server's clock, and sends
//! it as `SET key state PX ttl NX`, which costs the server a little over half what a check
//! costs it in the batch script (2.9 µs against 5.1 µs on the project's machine). If the key
//! holds anything (a state another instance wrote, a value of another type), the `SET` leaves
//! it alone and the check goes to the script, which decides on the server's
//! `TIME` as every other check does.
//!
//! Which keys are worth trying is guessed (see [`Guess`]): keys this instance saw holding a
//! state go straight to the script until that state ends, and while most tries find the key
//! taken, only one check in [`PROBE_EVERY`] tries.

use std::sync::Arc;
use std::sync::atomic::{AtomicU32, AtomicU64, Ordering};
use std::time::Duration;

use throttlebeam_supervisors::{Counters, TtlTable};

use super::operation::{Args, Fresh};
use crate::rate_limit::{Decision, RateLimitReply};
use crate::store::StoreError;
use crate::store::redis::RedisBuilder;

impl RedisBuilder {
    /// Whether a rate-limit check of a key this instance has not seen holding a state is
    /// first sent as a plain `SET key state PX ttl NX` rather than a script call (default
    /// `true`).
    ///
    /// A check of a key with no state is always allowed, and the state it leaves depends only
    /// on the time. This instance computes it with the script's own maths at its estimate of
    /// the server's clock (see `RedisBuilder::with_max_clock_error`: off by at most half a
    /// `TIME` round trip plus 100 ppm of its age, or not used) and writes it only if the key is
    /// still empty; a key that holds anything goes on to the script, which decides on the
    /// server's `TIME` as for every other check. Such a `SET` costs the server a little over half what a check costs
    /// it in a script, and the client less too, so fresh keys (one check per client, per IP,
    /// per window) go about 1.5 times as fast.
    ///
    /// The difference it makes to decisions is that estimate's error, once per key: a fixed or
    /// sliding window's first check within that error (well under a millisecond on a local
    /// network) of a window's edge may count in the window on the other side, and a GCRA or
    /// token bucket's first check starts its key that much early or late. Turn it off when
    /// every check must be on the server's own clock.
    ///
    /// # Examples
    ///
    /// ```no_run
    /// # async fn demo() -> Result<(), throttlebeam::store::StoreError> {
    /// use throttlebeam::store::Redis;
    ///
    /// let redis = Redis::builder("redis://127.0.0.1:6379")
    ///     .with_fresh_key_writes(false)
    ///     .connect()
    ///     .await?;
    /// # drop(redis);
    /// # Ok(()) }
    /// ```
    pub fn with_fresh_key_writes(mut self, enabled: bool) -> Self {
        self.fresh_key_writes = enabled;
        self
    }
}

/// One tier's state after a check of `units` at `now` on no state, as `rate_limit.lua`'s `run`
/// computes it: the fields, units spendable before the check, when the tier is full again
/// (µs). `None` when the tier cannot take the check, or its parameters would divide by zero
/// (the script then decides).
fn tier(kind: u8, n: &[u64], now: u64, units: u64) -> Option<([u64; 3], u64, u64)> {
    let (lim, a, b, c) = (n[0], n[1], n[2], n[3]);
    let (fields, avail, full_at) = match kind {
        b'g' | b'l' => {
            // v1 = now, v2 = 0: the room is the whole tolerance.
            let avail = c.checked_div(a)?;
            let total = units.checked_mul(a)?;
            let v1 = now.checked_add(total.checked_div(b)?)?;
            let v2 = total % b;
            ([v1, v2, 0], avail, v1 + u64::from(v2 > 0))
        }
        b't' => {
            // A full bucket of `a` tokens of `b` sub-units, refilling `c` sub-units a µs.
            let full = a.checked_mul(b)?;
            let spent = units.checked_mul(b)?;
            let left = full.checked_sub(spent)?;
            let refill = spent.checked_add(c.checked_sub(1)?)? / c;
            ([left, now, 0], a, now.checked_add(refill)?)
        }
        b'f' | b's' => {
            let start = now - now.checked_rem(a)?;
            let sliding = kind == b's';
            let fields = if sliding {
                [start, 0, units]
            } else {
                [start, units, 0]
            };
            let ends = if sliding { 2 * a } else { a };
            (fields, lim, start.checked_add(ends)?)
        }
        _ => return None,
    };
    (avail >= units).then_some((fields, avail, full_at))
}

/// The write and reply of a check (`args`, op `c`) on a key with no state at `now_us` (the
/// server's time, µs), or `None` if the script must decide it.
pub(super) fn check(args: &Args, now_us: u64) -> Option<Fresh> {
    if args.op != "c" || args.numbers.len() != 4 * args.kinds.len() {
        return None;
    }
    let now = crate::rate_limit::strategy::clamp(now_us);
    let units = u64::from(args.cost);
    let kinds = args.kinds.as_bytes();
    let mut value = Vec::with_capacity(kinds.len() * 25 + 8);
    value.extend_from_slice(kinds);
    let (mut limit, mut remaining, mut full_at) = (u64::MAX, u64::MAX, 0);
    for (t, &kind) in kinds.iter().enumerate() {
        let n = &args.numbers[4 * t..4 * t + 4];
        let (fields, avail, full) = tier(kind, n, now, units)?;
        let count = if kind == b's' { 3 } else { 2 };
        for field in &fields[..count] {
            // Exact: every value stays below 2^53 (the store checks each tier's horizon).
            #[allow(clippy::cast_precision_loss)]
            value.extend_from_slice(&(*field as f64).to_le_bytes());
        }
        limit = limit.min(n[0]);
        remaining = remaining.min(avail - units);
        full_at = full_at.max(full);
    }
    // Its rest time: when the state is at rest under these limits (see `rate_limit.lua`).
    #[allow(clippy::cast_precision_loss)]
    value.extend_from_slice(&(full_at as f64).to_le_bytes());
    let ms_up = |us: u64| us.div_ceil(1_000);
    Some(Fresh {
        value,
        px: ms_up(full_at - now).saturating_add(args.slack),
        reply: RateLimitReply::Decision(Decision {
            allowed: true,
            limit,
            remaining,
            reset_at_ms: ms_up(full_at),
            retry_after_ms: 0,
        }),
    })
}

/// How many keys seen holding a state this instance remembers, to send their checks straight
/// to the script.
pub(super) const KNOWN_KEYS: usize = 10_000;

/// How long a key seen holding a state is remembered at least, however soon its state ends: a
/// busy key's state keeps moving on, and a key remembered too long only costs what every
/// check cost before (a script call).
pub(super) const KNOWN_AT_LEAST: Duration = Duration::from_secs(5);

/// `SET key state PX ttl NX` for `fresh`.
pub(super) fn set(key: &str, fresh: &Fresh) -> redis::Cmd {
    let mut cmd = redis::Cmd::with_capacity(6, 3 + key.len() + fresh.value.len() + 24);
    cmd.arg("SET")
        .arg(key)
        .arg(fresh.value.as_slice())
        .arg("PX")
        .arg(fresh.px)
        .arg("NX");
    cmd
}

/// While most tries find their key taken, one check in this many tries.
pub(super) const PROBE_EVERY: u32 = 64;

/// Misses past which only probes try (each miss adds 2, each hit takes 1 away: more than one
/// try in three missing climbs there).
const PAUSE_AT: u32 = 64;

/// How far past [`PAUSE_AT`] misses count: a burst of first checks of one key (all but one
/// miss) pauses tries, and a handful of probes that write (a few hundred checks) resume them.
const PAUSE_MARGIN: u32 = 4;

/// Which checks to send as a plain `SET NX` first: those of keys this instance has not seen
/// holding a state, while such tries mostly find their key empty.
pub(super) struct Guess {
    /// Keys seen holding a state (a script's decision on them), each until that state ends.
    known: TtlTable<String, ()>,
    /// Recent misses, weighed against hits (see [`PAUSE_AT`]).
    score: AtomicU32,
    /// Checks passed over while paused, to probe one in [`PROBE_EVERY`].
    skipped: AtomicU32,
    /// Checks written with a plain `SET`, and tries that found the key taken.
    written: AtomicU64,
    missed: AtomicU64,
}

impl Guess {
    pub(super) fn new() -> Self {
        Self {
            known: TtlTable::new(Arc::new(Counters::new())).with_max_len(KNOWN_KEYS),
            score: AtomicU32::new(0),
            skipped: AtomicU32::new(0),
            written: AtomicU64::new(0),
            missed: AtomicU64::new(0),
        }
    }

    /// Whether a check of `key` (as stored) should try a plain `SET NX` first.
    pub(super) fn worth_trying(&self, key: &str) -> bool {
        if self.score.load(Ordering::Relaxed) >= PAUSE_AT
            && !self
                .skipped
                .fetch_add(1, Ordering::Relaxed)
                .is_multiple_of(PROBE_EVERY)
        {
            return false;
        }
        // Fresh keys alone leave the table empty: no lookup then.
        self.known.is_empty() || self.known.get(key).is_none()
    }

    /// What the reply to a fresh check's `SET NX` means: its decision if the key was written,
    /// `None` if it was taken (the script decides).
    pub(super) fn outcome(
        &self,
        fresh: &Fresh,
        written: &redis::Value,
    ) -> Result<Option<RateLimitReply>, StoreError> {
        match written {
            redis::Value::Nil => {
                self.miss();
                Ok(None)
            }
            ok if matches!(ok, redis::Value::Okay)
                || matches!(ok, redis::Value::SimpleString(s) if s == "OK") =>
            {
                self.hit();
                Ok(Some(fresh.reply))
            }
            other => Err(StoreError::Protocol(format!(
                "a rate limit key's SET NX replied {other:?}"
            ))),
        }
    }

    /// Checks written with a plain `SET`, and tries that found their key taken, so far.
    pub(super) fn counts(&self) -> (u64, u64) {
        (
            self.written.load(Ordering::Relaxed),
            self.missed.load(Ordering::Relaxed),
        )
    }

    /// A try wrote its key.
    fn hit(&self) {
        self.written.fetch_add(1, Ordering::Relaxed);
        if self.score.load(Ordering::Relaxed) > 0 {
            let _ = self
                .score
                .fetch_update(Ordering::Relaxed, Ordering::Relaxed, |s| {
                    Some(s.saturating_sub(1))
                });
        }
    }

    /// A try found its key taken.
    fn miss(&self) {
        self.missed.fetch_add(1, Ordering::Relaxed);
        let _ = self
            .score
            .fetch_update(Ordering::Relaxed, Ordering::Relaxed, |s| {
                Some((s + 2).min(PAUSE_AT + PAUSE_MARGIN))
            });
    }

    /// The script decided a check of `key`: it holds a state for `life` at least.
    pub(super) fn seen(&self, key: &str, life: Duration) {
        if !life.is_zero() {
            self.known.insert(key.to_owned(), (), life);
        }
    }

    /// `key` was reset: it holds no state.
    pub(super) fn forget(&self, key: &str) {
        self.known.remove(key);
    }
}
