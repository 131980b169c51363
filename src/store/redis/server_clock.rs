//! This instance's estimate of the Redis server's clock, for values that
//! carry a time written by one instance and read by another (the leading
//! throttle's window end, a fresh key's first rate-limit state), so that skew
//! between instances never shifts what a reader concludes.
//!
//! # The estimate and its bound
//!
//! A measurement is [`SAMPLES`] `TIME`s in a row; each is read between two
//! readings of this host's **monotonic** clock, and the server read its clock
//! somewhere between them, so the sample with the shortest round trip is kept
//! and the server's time is taken at its midpoint: an offset from the
//! monotonic clock. A sample whose bound (below) exceeds the allowed error
//! (`RedisBuilder::with_max_clock_error`, 5 ms by default) is rejected. The
//! estimate's error is at most
//!
//! > half the kept sample's round trip + 2 µs + [`DRIFT_PPM`] (100 ppm) of the
//! > time since it,
//!
//! assuming the two clocks run within 100 ppm of each other (the 2 µs: both
//! clocks are read to the whole microsecond). An estimate whose
//! bound has grown past the allowed error is not used, nor is one measured on
//! a connection since lost (a reconnection, a Sentinel failover, a command
//! that failed on the connection); until a good sample exists, [`Estimate`]s
//! read as `None` and the callers write nothing stamped with it (they go to
//! the server's own `TIME`). It is measured again every [`RESYNC`].
//!
//! The wall clock is read only to catch a jump: every reading compares how
//! far the monotonic and wall clocks moved since the sample, and a difference
//! over [`JUMP_US`] (a wall clock stepped by chrony or by hand, a monotonic
//! clock that stood still while the host was suspended) discards the estimate
//! until the next measurement. A step of the wall clock therefore never
//! shifts the estimate; a monotonic clock that stands still for less than
//! [`JUMP_US`] adds that much to the error unseen.
//!
//! On a cluster each primary has its own estimate, measured with `TIME`
//! routed to it (and `CLUSTER MYID` in the same pipeline, so a sample is
//! credited to the node that answered it), and a key reads the estimate of
//! the primary that owns its slot in the slot map, read with `CLUSTER SLOTS`
//! every [`MAP_CHECK`]: a moved slot reads its new owner's estimate, measured
//! first.

use std::sync::Arc;
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::time::Duration;

use arc_swap::ArcSwapOption;

/// How far apart this host's monotonic clock and the server's clock are
/// assumed to drift at most, in parts per million (two clocks each within
/// 50 ppm of true time; NTP keeps them far closer).
pub(crate) const DRIFT_PPM: u64 = 100;

/// `TIME`s per measurement; the one with the shortest round trip is kept.
pub(crate) const SAMPLES: usize = 5;

/// How often every estimate is measured again.
pub(crate) const RESYNC: Duration = Duration::from_secs(10);

/// How often a cluster's slot map is read again, to notice a slot that moved
/// without a failed command (a manual failover, resharding).
pub(crate) const MAP_CHECK: Duration = Duration::from_secs(1);

/// The pause after a measurement that failed before the next is tried.
const RETRY: Duration = Duration::from_millis(250);

/// How much the monotonic and wall clocks may disagree about the time since
/// a sample (µs) before one of them is taken to have jumped.
pub(crate) const JUMP_US: u64 = 1_000;

/// The allowed error of the estimate unless the builder says otherwise.
pub(crate) const DEFAULT_MAX_ERROR: Duration = Duration::from_millis(5);

/// Slots in a Redis Cluster.
const SLOTS: usize = 16_384;

/// This host's clocks: the monotonic one the estimate runs on, and the wall
/// clock read only to notice that one of the two jumped.
#[derive(Clone, Debug)]
pub(crate) enum Clocks {
    /// The host's own (`std::time::Instant` from a base, `SystemTime`).
    Host(std::time::Instant),
    /// The host's, with steps a test makes.
    #[cfg(any(test, feature = "test-util"))]
    Stepped(SteppedClock),
}

impl Default for Clocks {
    fn default() -> Self {
        Self::Host(std::time::Instant::now())
    }
}

fn micros(d: Duration) -> u64 {
    u64::try_from(d.as_micros()).unwrap_or(u64::MAX)
}

fn host_wall_us() -> i64 {
    i64::try_from(crate::clock::since_epoch().as_micros()).unwrap_or(i64::MAX)
}

impl Clocks {
    /// Monotonic µs since this value's base.
    #[inline]
    pub(crate) fn mono_us(&self) -> u64 {
        match self {
            Self::Host(base) => micros(base.elapsed()),
            #[cfg(any(test, feature = "test-util"))]
            Self::Stepped(clock) => clock.mono_us(),
        }
    }

    /// Wall µs since the epoch.
    #[inline]
    pub(crate) fn wall_us(&self) -> i64 {
        match self {
            Self::Host(_) => host_wall_us(),
            #[cfg(any(test, feature = "test-util"))]
            Self::Stepped(clock) => clock.wall_us(),
        }
    }

    /// A (monotonic, wall) pair read as close together as the host lets:
    /// the wall clock read between two monotonic readings at most 50 µs
    /// apart (a few tries, then the closest).
    pub(crate) fn pair(&self) -> (u64, i64) {
        let mut best = (u64::MAX, 0, 0);
        for _ in 0..4 {
            let before = self.mono_us();
            let wall = self.wall_us();
            let after = self.mono_us();
            let spread = after.saturating_sub(before);
            if spread < best.0 {
                best = (spread, before + spread / 2, wall);
            }
            if spread <= 50 {
                break;
            }
        }
        (best.1, best.2)
    }
}

/// A client clock for tests (feature `test-util`): this host's monotonic and
/// wall clocks, with steps the test makes, handed to
/// [`RedisBuilder::with_client_clock`](crate::store::RedisBuilder::with_client_clock).
/// Clones share their steps.
///
/// # Examples
///
/// ```
/// use std::time::Duration;
/// use throttlebeam::store::SteppedClock;
///
/// let clock = SteppedClock::new();
/// // chrony stepped the wall clock back by 30 s.
/// clock.step_wall_back(Duration::from_secs(30));
/// // The host was suspended for 2 s: its monotonic clock stood still.
/// clock.lose_monotonic(Duration::from_secs(2));
/// ```
#[cfg(any(test, feature = "test-util"))]
#[cfg_attr(docsrs, doc(cfg(feature = "test-util")))]
#[derive(Clone, Debug)]
pub struct SteppedClock(Arc<Steps>);

#[cfg(any(test, feature = "test-util"))]
#[derive(Debug)]
struct Steps {
    base: std::time::Instant,
    /// Added to the monotonic clock (µs; negative: it lost time).
    mono_us: std::sync::atomic::AtomicI64,
    /// Added to the wall clock (µs).
    wall_us: std::sync::atomic::AtomicI64,
}

#[cfg(any(test, feature = "test-util"))]
impl Default for SteppedClock {
    fn default() -> Self {
        Self::new()
    }
}

#[cfg(any(test, feature = "test-util"))]
impl SteppedClock {
    /// This host's clocks, not stepped yet.
    #[must_use]
    pub fn new() -> Self {
        Self(Arc::new(Steps {
            base: std::time::Instant::now(),
            mono_us: std::sync::atomic::AtomicI64::new(0),
            wall_us: std::sync::atomic::AtomicI64::new(0),
        }))
    }

    /// Steps the wall clock forward by `by` (a clock corrected forward).
    pub fn step_wall_forward(&self, by: Duration) {
        self.step(&self.0.wall_us, by, 1);
    }

    /// Steps the wall clock back by `by` (a clock corrected backward).
    pub fn step_wall_back(&self, by: Duration) {
        self.step(&self.0.wall_us, by, -1);
    }

    /// The monotonic clock stood still for `by` while time went on (the
    /// host was suspended): from now on it reads `by` less than it would
    /// have.
    pub fn lose_monotonic(&self, by: Duration) {
        self.step(&self.0.mono_us, by, -1);
    }

    fn step(&self, steps: &std::sync::atomic::AtomicI64, by: Duration, sign: i64) {
        let by = i64::try_from(by.as_micros()).unwrap_or(i64::MAX);
        steps.fetch_add(sign.saturating_mul(by), Ordering::SeqCst);
    }

    fn mono_us(&self) -> u64 {
        let host = i64::try_from(self.0.base.elapsed().as_micros()).unwrap_or(i64::MAX);
        let us = host.saturating_add(self.0.mono_us.load(Ordering::SeqCst));
        u64::try_from(us.max(0)).unwrap_or(0)
    }

    fn wall_us(&self) -> i64 {
        host_wall_us().saturating_add(self.0.wall_us.load(Ordering::SeqCst))
    }
}

/// One kept sample: the server's clock as an offset from the monotonic one.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) struct Sample {
    /// Server µs since the epoch minus monotonic µs.
    offset_us: i64,
    /// Monotonic µs at the sample's midpoint.
    at_us: u64,
    /// Half the round trip (µs, rounded up): the most the server's reading
    /// can be from the midpoint.
    half_rtt_us: u64,
    /// A (monotonic, wall) pair read around the measurement, to notice a
    /// jump of either clock since.
    pair: (u64, i64),
    /// The connection's epoch (reconnections, failovers) when measured.
    epoch: u64,
}

impl Sample {
    /// A `TIME` reply `server_us` read between the monotonic readings
    /// `before_us` and `after_us`.
    pub(crate) fn new(
        before_us: u64,
        server_us: i64,
        after_us: u64,
        pair: (u64, i64),
        epoch: u64,
    ) -> Self {
        let rtt = after_us.saturating_sub(before_us);
        let at_us = before_us + rtt / 2;
        Self {
            offset_us: server_us.saturating_sub(i64::try_from(at_us).unwrap_or(i64::MAX)),
            at_us,
            half_rtt_us: rtt.div_ceil(2),
            pair,
            epoch,
        }
    }

    /// The most the estimate can be off at monotonic time `mono_us`: the server read its
    /// clock within half the round trip of the midpoint, each reading of either clock is
    /// truncated to the microsecond (under 1 µs each for the server's and for the reading
    /// now; the midpoint's is within the rounded-up half), and the clocks drift apart by at
    /// most [`DRIFT_PPM`] since.
    pub(crate) fn bound_at(&self, mono_us: u64) -> u64 {
        let age = mono_us.saturating_sub(self.at_us);
        self.half_rtt_us + 2 + age.saturating_mul(DRIFT_PPM).div_ceil(1_000_000)
    }

    /// The server's time (µs) at monotonic time `mono_us`.
    fn server_at(&self, mono_us: u64) -> u64 {
        let us = i64::try_from(mono_us)
            .unwrap_or(i64::MAX)
            .saturating_add(self.offset_us);
        u64::try_from(us.max(0)).unwrap_or(0)
    }

    /// Whether the clocks read `(mono_us, wall_us)` disagree with this
    /// sample's pair about the time since by more than [`JUMP_US`].
    fn jumped(&self, mono_us: u64, wall_us: i64) -> bool {
        let mono = i64::try_from(mono_us.wrapping_sub(self.pair.0)).unwrap_or(i64::MAX);
        let wall = wall_us.saturating_sub(self.pair.1);
        mono.abs_diff(wall) > JUMP_US
    }
}

/// What a reading of the estimate gives: the server's time and the most it
/// can be off.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) struct Reading {
    pub(crate) now_us: u64,
    pub(crate) bound_us: u64,
}

/// One server's estimate (a node, the Sentinel's primary, a cluster primary).
#[derive(Debug, Default)]
pub(crate) struct Estimate {
    sample: ArcSwapOption<Sample>,
    /// Monotonic µs of the last measurement, kept sample or not (0: never).
    measured_us: AtomicU64,
}

impl Estimate {
    /// Whether a measurement is due at `mono_us` for a connection in `epoch`:
    /// none kept, one of another epoch or past `max_error_us`, or the last
    /// measurement [`RESYNC`] ago.
    pub(crate) fn needs_measuring(&self, mono_us: u64, epoch: u64, max_error_us: u64) -> bool {
        let measured = self.measured_us.load(Ordering::Relaxed);
        match &*self.sample.load() {
            Some(sample) => {
                sample.epoch != epoch
                    || sample.bound_at(mono_us) > max_error_us
                    || mono_us.saturating_sub(measured) >= micros(RESYNC)
            }
            None => true,
        }
    }

    /// Keeps the better of `best` (a new measurement's best sample, if any
    /// passed) and the sample kept, as of monotonic time `mono_us`: the one
    /// with the smaller bound; a kept sample of another epoch never wins.
    pub(crate) fn offer(&self, best: Option<Sample>, mono_us: u64) {
        self.measured_us.store(mono_us.max(1), Ordering::Relaxed);
        let Some(best) = best else {
            return;
        };
        let kept = self.sample.load_full();
        let better = kept.is_none_or(|kept| {
            kept.epoch != best.epoch || best.bound_at(mono_us) <= kept.bound_at(mono_us)
        });
        if better {
            self.sample.store(Some(Arc::new(best)));
        }
    }

    /// Forgets the sample (a clock jumped).
    fn discard(&self, seen: &Arc<Sample>) {
        // Only the one seen: a newer measurement stays.
        let _ = self
            .sample
            .compare_and_swap(&Some(Arc::clone(seen)), None::<Arc<Sample>>);
    }

    #[cfg(test)]
    pub(crate) fn sample(&self) -> Option<Sample> {
        self.sample.load().as_deref().copied()
    }
}

/// A cluster's slot map: which primary owns each slot, and each primary's
/// estimate (carried over from one map to the next by node id).
#[derive(Debug)]
pub(crate) struct SlotMap {
    /// The index in `nodes` of each slot's owner; `u16::MAX`: no owner.
    owners: Box<[u16]>,
    pub(crate) nodes: Vec<Node>,
}

/// A cluster primary.
#[derive(Debug)]
pub(crate) struct Node {
    /// Its node id (`CLUSTER MYID`).
    pub(crate) id: String,
    /// A slot it owns, to route its `TIME`s by.
    pub(crate) slot: u16,
    pub(crate) estimate: Arc<Estimate>,
}

impl SlotMap {
    /// The map a `CLUSTER SLOTS` reply describes, with the estimates of
    /// `old`'s nodes carried over; `None` if the reply is not one.
    pub(crate) fn from_reply(reply: &redis::Value, old: Option<&Self>) -> Option<Self> {
        let redis::Value::Array(ranges) = reply else {
            return None;
        };
        let mut owners = vec![u16::MAX; SLOTS].into_boxed_slice();
        let mut nodes: Vec<Node> = Vec::new();
        for range in ranges {
            let redis::Value::Array(fields) = range else {
                return None;
            };
            let (start, end) = (int(fields.first())?, int(fields.get(1))?);
            let redis::Value::Array(primary) = fields.get(2)? else {
                return None;
            };
            let id = text(primary.get(2))?;
            let (start, end) = (usize::try_from(start).ok()?, usize::try_from(end).ok()?);
            if start > end || end >= SLOTS {
                return None;
            }
            let index = match nodes.iter().position(|n| n.id == id) {
                Some(i) => i,
                None => {
                    let estimate = old
                        .and_then(|old| old.nodes.iter().find(|n| n.id == id))
                        .map_or_else(Arc::default, |n| Arc::clone(&n.estimate));
                    nodes.push(Node {
                        id,
                        slot: u16::try_from(start).ok()?,
                        estimate,
                    });
                    nodes.len() - 1
                }
            };
            let index = u16::try_from(index).ok()?;
            owners[start..=end].fill(index);
        }
        Some(Self { owners, nodes })
    }

    /// Whether `other` gives every slot to the same node.
    pub(crate) fn same_owners(&self, other: &Self) -> bool {
        self.nodes.len() == other.nodes.len()
            && self
                .owners
                .iter()
                .zip(other.owners.iter())
                .all(|(a, b)| match (*a, *b) {
                    (u16::MAX, u16::MAX) => true,
                    (u16::MAX, _) | (_, u16::MAX) => false,
                    (a, b) => self.nodes[usize::from(a)].id == other.nodes[usize::from(b)].id,
                })
    }

    fn owner(&self, slot: u16) -> Option<&Node> {
        let index = *self.owners.get(usize::from(slot))?;
        self.nodes.get(usize::from(index))
    }
}

fn int(v: Option<&redis::Value>) -> Option<i64> {
    match v? {
        redis::Value::Int(n) => Some(*n),
        other => text(Some(other))?.parse().ok(),
    }
}

fn text(v: Option<&redis::Value>) -> Option<String> {
    match v? {
        redis::Value::BulkString(b) => Some(String::from_utf8_lossy(b).into_owned()),
        redis::Value::SimpleString(s) => Some(s.clone()),
        _ => None,
    }
}

/// The server's clock as estimated here: one estimate for a node or the
/// Sentinel's primary, one per primary on a cluster.
#[derive(Debug)]
pub(crate) struct ServerClock {
    pub(crate) clocks: Clocks,
    /// The allowed error (µs): samples and estimates past it are not used.
    pub(crate) max_error_us: u64,
    /// The estimate off a cluster.
    single: Estimate,
    /// On a cluster, the slot map (`None` until read).
    map: ArcSwapOption<SlotMap>,
    cluster: bool,
    /// Monotonic µs from which a measurement (or, on a cluster, a look at
    /// the slot map) is due.
    due_us: AtomicU64,
    /// A measurement runs now.
    syncing: AtomicBool,
    /// Monotonic µs before which no measurement is hurried: [`RETRY`] after
    /// the last one ended.
    soonest_us: AtomicU64,
    /// Whether the server takes `SET … NX … GET` (Redis 7.0 and later);
    /// cleared the first time it refuses it.
    pub(crate) set_nx_get: AtomicBool,
}

impl ServerClock {
    pub(crate) fn new(clocks: Clocks, max_error: Duration, cluster: bool) -> Self {
        Self {
            clocks,
            max_error_us: micros(max_error),
            single: Estimate::default(),
            map: ArcSwapOption::empty(),
            cluster,
            due_us: AtomicU64::new(0),
            syncing: AtomicBool::new(false),
            soonest_us: AtomicU64::new(0),
            set_nx_get: AtomicBool::new(true),
        }
    }

    pub(crate) fn is_cluster(&self) -> bool {
        self.cluster
    }

    /// The server's time now for a key of `slot` (ignored off a cluster),
    /// on a connection in `epoch`; `None` while no good sample exists.
    /// Also the monotonic time it was read at.
    #[inline]
    pub(crate) fn read(&self, slot: impl FnOnce() -> u16, epoch: u64) -> (Option<Reading>, u64) {
        if self.cluster {
            let map = self.map.load();
            let owner = map.as_deref().and_then(|map| map.owner(slot()));
            match owner {
                Some(node) => self.read_estimate(&node.estimate, epoch),
                None => {
                    self.hurry();
                    (None, self.clocks.mono_us())
                }
            }
        } else {
            self.read_estimate(&self.single, epoch)
        }
    }

    fn read_estimate(&self, estimate: &Estimate, epoch: u64) -> (Option<Reading>, u64) {
        let mono = self.clocks.mono_us();
        let guard = estimate.sample.load();
        let Some(sample) = guard.as_ref() else {
            self.hurry();
            return (None, mono);
        };
        if sample.epoch != epoch {
            self.hurry();
            return (None, mono);
        }
        if sample.jumped(mono, self.clocks.wall_us()) {
            // Read again with care: a thread paused between the two reads
            // looks like a jump.
            let (mono, wall) = self.clocks.pair();
            if sample.jumped(mono, wall) {
                tracing::debug!(
                    "this host's monotonic and wall clocks disagree since the last \
                     measurement of the Redis server's clock: measuring it again"
                );
                estimate.discard(sample);
                self.hurry();
                return (None, mono);
            }
        }
        let bound_us = sample.bound_at(mono);
        if bound_us > self.max_error_us {
            self.hurry();
            return (None, mono);
        }
        let now_us = sample.server_at(mono);
        (Some(Reading { now_us, bound_us }), mono)
    }

    /// Makes a measurement due as soon as allowed: at once, or [`RETRY`]
    /// after the last one ended (a server that fails every measurement is
    /// not asked in a loop).
    fn hurry(&self) {
        let soonest = self.soonest_us.load(Ordering::Relaxed);
        self.due_us.fetch_min(soonest, Ordering::Relaxed);
    }

    /// Whether a measurement is due at monotonic time `mono_us`; if so the
    /// caller has claimed it and must run it (see [`ServerClock::done`]).
    #[inline]
    pub(crate) fn claim_sync(&self, mono_us: u64) -> bool {
        mono_us >= self.due_us.load(Ordering::Relaxed)
            && !self.syncing.load(Ordering::Relaxed)
            && !self.syncing.swap(true, Ordering::AcqRel)
    }

    /// A claimed measurement ended (`ok`: it measured what was due): the
    /// next is due after [`RESYNC`] (on a cluster, a look at the slot map
    /// after [`MAP_CHECK`]), or after [`RETRY`] if it failed.
    pub(crate) fn done(&self, ok: bool) {
        let after = if !ok {
            RETRY
        } else if self.cluster {
            MAP_CHECK
        } else {
            RESYNC
        };
        let now = self.clocks.mono_us();
        self.soonest_us
            .store(now.saturating_add(micros(RETRY)), Ordering::Relaxed);
        self.due_us
            .store(now.saturating_add(micros(after)), Ordering::Relaxed);
        self.syncing.store(false, Ordering::Release);
    }

    /// The estimate off a cluster.
    pub(crate) fn single(&self) -> &Estimate {
        &self.single
    }

    /// The slot map, if read.
    pub(crate) fn map(&self) -> Option<Arc<SlotMap>> {
        self.map.load_full()
    }

    /// Installs a slot map read from the cluster, unless it gives every slot
    /// to the same nodes as the one in place. Whether it changed.
    pub(crate) fn install_map(&self, map: SlotMap) -> bool {
        let old = self.map.load_full();
        if old.as_deref().is_some_and(|old| old.same_owners(&map)) {
            return false;
        }
        self.map.store(Some(Arc::new(map)));
        true
    }

    /// Forgets the slot map: the next measurement reads it again first.
    pub(crate) fn forget_map(&self) {
        self.map.store(None);
    }

    /// The best of `samples` (the shortest round trip) whose bound is within
    /// the allowed error when taken, and how many were rejected.
    pub(crate) fn best(&self, samples: &[Sample]) -> (Option<Sample>, usize) {
        let accepted = samples
            .iter()
            .filter(|s| s.bound_at(s.at_us) <= self.max_error_us);
        let best = accepted.clone().min_by_key(|s| s.half_rtt_us).copied();
        (best, samples.len() - accepted.count())
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

/// The cluster slot of a key, as Redis computes it: CRC16 (XMODEM) of the
/// key's hash tag (between its first `{` and the next `}`, if not empty), or
/// of the whole key, modulo 16,384.
pub(crate) fn slot_of(key: &[u8]) -> u16 {
    let tag = key.iter().position(|&b| b == b'{').and_then(|open| {
        let rest = &key[open + 1..];
        let close = rest.iter().position(|&b| b == b'}')?;
        (close > 0).then(|| &rest[..close])
    });
    crc16(tag.unwrap_or(key)) % 16_384
}

/// The slot of `{<prefix>:<key>}…`, the stored name of a logical key (see
/// `Redis::key`), without building it: the prefix holds no brace, so the hash
/// tag is `<prefix>:` and `key` up to its first `}`.
pub(crate) fn slot_of_logical(prefix: &str, key: &str) -> u16 {
    let key = key.as_bytes();
    let key = key
        .iter()
        .position(|&b| b == b'}')
        .map_or(key, |end| &key[..end]);
    let mut crc = 0;
    for part in [prefix.as_bytes(), b":", key] {
        crc = crc16_update(crc, part);
    }
    crc % 16_384
}

const CRC16_TABLE: [u16; 256] = {
    let mut table = [0_u16; 256];
    let mut i = 0;
    while i < 256 {
        #[allow(clippy::cast_possible_truncation)]
        let mut crc = (i as u16) << 8;
        let mut bit = 0;
        while bit < 8 {
            crc = if crc & 0x8000 == 0 {
                crc << 1
            } else {
                (crc << 1) ^ 0x1021
            };
            bit += 1;
        }
        table[i] = crc;
        i += 1;
    }
    table
};

fn crc16_update(mut crc: u16, bytes: &[u8]) -> u16 {
    for &b in bytes {
        crc = (crc << 8) ^ CRC16_TABLE[usize::from(((crc >> 8) as u8) ^ b)];
    }
    crc
}

fn crc16(bytes: &[u8]) -> u16 {
    crc16_update(0, bytes)
}

#[cfg(test)]
mod tests {
    use super::*;

    const MS: u64 = 1_000;

    fn clock(max_error_ms: u64) -> (ServerClock, SteppedClock) {
        let stepped = SteppedClock::new();
        // As if the process had run a minute: samples can start before "now".
        stepped.step(&stepped.0.mono_us, Duration::from_secs(60), 1);
        stepped.step_wall_forward(Duration::from_secs(60));
        let clock = ServerClock::new(
            Clocks::Stepped(stepped.clone()),
            Duration::from_millis(max_error_ms),
            false,
        );
        (clock, stepped)
    }

    /// A sample taken now of a server `ahead_us` ahead of this host's
    /// monotonic clock, whose reply took `rtt_us`, read `late_us` after the
    /// midpoint (the request's and reply's delays differ).
    fn sample(clock: &ServerClock, ahead_us: i64, rtt_us: u64, skew_us: i64) -> Sample {
        let after = clock.clocks.mono_us();
        let before = after - rtt_us;
        let mid = before + rtt_us / 2;
        let server = i64::try_from(mid).unwrap() + ahead_us + skew_us;
        Sample::new(before, server, after, clock.clocks.pair(), 0)
    }

    #[test]
    fn the_error_bound_is_half_the_round_trip_plus_drift_since_the_sample() {
        let s = Sample::new(1_000, 5_000_000, 3_001, (2_000, 0), 0);
        assert_eq!(s.half_rtt_us, 1_001, "rounded up");
        assert_eq!(s.bound_at(2_000), 1_003);
        // 10 s later: 100 ppm is 1 ms more.
        assert_eq!(s.bound_at(2_000 + 10_000_000), 1_003 + 1_000);
        // The server read its clock anywhere in the round trip: every such
        // reading is within the bound of the estimate.
        for server_read_at in [1_000_u64, 2_000, 3_001] {
            let s = Sample::new(
                1_000,
                7_000_000 + i64::try_from(server_read_at).unwrap(),
                3_001,
                (0, 0),
                0,
            );
            let truth = 7_000_000 + 2_500;
            assert!(
                s.server_at(2_500).abs_diff(truth) <= s.bound_at(2_500),
                "{s:?}"
            );
        }
    }

    #[test]
    fn the_shortest_round_trip_within_the_allowed_error_is_kept() {
        let (clock, _) = clock(5);
        let samples = [
            sample(&clock, 3_600_000_000, 4 * MS, 0),
            sample(&clock, 3_600_000_000, 2 * MS, 0),
            sample(&clock, 3_600_000_000, 30 * MS, 0),
        ];
        let (best, rejected) = clock.best(&samples);
        assert_eq!(best.unwrap().half_rtt_us, MS);
        assert_eq!(rejected, 1, "30 ms round trip: half is over 5 ms");
        let (best, rejected) = clock.best(&samples[2..]);
        assert_eq!((best, rejected), (None, 1));
    }

    #[test]
    fn no_estimate_until_a_good_sample_then_one_within_its_bound() {
        let (clock, _) = clock(5);
        assert_eq!(clock.read(|| 0, 0).0, None, "never measured");
        let ahead = 3_600_000_000;
        // The reply took 3 ms, the server read its clock 1 ms after the midpoint.
        let s = sample(&clock, ahead, 3 * MS, 1_000);
        clock.single().offer(Some(s), clock.clocks.mono_us());
        let (reading, mono) = clock.read(|| 0, 0);
        let reading = reading.expect("a good sample");
        let truth = u64::try_from(i64::try_from(mono).unwrap() + ahead).unwrap();
        assert!(
            reading.now_us.abs_diff(truth) <= reading.bound_us,
            "{reading:?}"
        );
        assert!(reading.bound_us >= 1_500);
        // Another epoch (a reconnection since): not used.
        assert_eq!(clock.read(|| 0, 1).0, None);
    }

    #[test]
    fn an_estimate_past_the_allowed_error_by_age_is_not_used() {
        let (clock, stepped) = clock(2);
        let s = sample(&clock, 0, 2 * MS, 0);
        clock.single().offer(Some(s), clock.clocks.mono_us());
        assert!(clock.read(|| 0, 0).0.is_some());
        // 10 s later both clocks moved alike; 100 ppm of 10 s is 1 ms more
        // than the 1 ms half round trip: over 2 ms.
        let later = Duration::from_secs(10);
        stepped.step(&stepped.0.mono_us, later, 1);
        stepped.step_wall_forward(later);
        assert_eq!(clock.read(|| 0, 0).0, None);
    }

    #[test]
    fn a_clock_jump_discards_the_estimate_instead_of_shifting_it() {
        for jump in [
            |c: &SteppedClock| c.step_wall_back(Duration::from_secs(30)),
            |c: &SteppedClock| c.step_wall_forward(Duration::from_secs(59)),
            |c: &SteppedClock| c.lose_monotonic(Duration::from_millis(50)),
        ] {
            let (clock, stepped) = clock(5);
            let s = sample(&clock, 1_000_000, MS, 0);
            clock.single().offer(Some(s), clock.clocks.mono_us());
            let before = clock.read(|| 0, 0).0.expect("measured");
            assert!(clock.claim_sync(clock.clocks.mono_us()));
            clock.done(true);
            jump(&stepped);
            assert_eq!(clock.read(|| 0, 0).0, None, "discarded");
            // (Past the monotonic time lost too.)
            let soon = clock.clocks.mono_us() + micros(RETRY) + 50_000;
            assert!(clock.claim_sync(soon), "measured again as soon as allowed");
            assert!(before.bound_us < 5_000);
        }
    }

    #[test]
    fn a_new_measurement_replaces_the_sample_only_if_its_bound_is_smaller() {
        let (clock, _) = clock(5);
        let now = clock.clocks.mono_us();
        let good = sample(&clock, 0, 200, 0);
        clock.single().offer(Some(good), now);
        // Under load: a worse best sample keeps the good one.
        let worse = sample(&clock, 0, 3 * MS, 0);
        clock.single().offer(Some(worse), now);
        assert_eq!(clock.single().sample(), Some(good));
        // Another epoch always wins.
        let moved = Sample { epoch: 1, ..worse };
        clock.single().offer(Some(moved), now);
        assert_eq!(clock.single().sample(), Some(moved));
        // A measurement that kept nothing still counts as one.
        clock.single().offer(None, now);
        let max = clock.max_error_us;
        assert!(!clock.single().needs_measuring(now, 1, max));
        assert!(clock.single().needs_measuring(now, 2, max), "new epoch");
        assert!(
            clock.single().needs_measuring(now + micros(RESYNC), 1, max),
            "due"
        );
        assert!(
            clock.single().needs_measuring(now, 1, 1_000),
            "past the allowed error"
        );
    }

    #[test]
    fn one_caller_claims_a_due_measurement() {
        let (clock, _) = clock(5);
        assert!(
            clock.claim_sync(clock.clocks.mono_us()),
            "never measured: due"
        );
        assert!(!clock.claim_sync(clock.clocks.mono_us()), "claimed already");
        clock.done(true);
        assert!(
            !clock.claim_sync(clock.clocks.mono_us()),
            "not due for 10 s"
        );
        assert!(clock.takes_set_nx_get());
        assert!(clock.refuse_set_nx_get());
        assert!(!clock.refuse_set_nx_get(), "told once");
        assert!(!clock.takes_set_nx_get());
    }

    #[test]
    fn slots_are_the_ones_redis_computes() {
        use redis::cluster_routing::{Route, SlotAddr};
        for key in [
            "",
            "a",
            "{throttlebeam:user:1}:r",
            "{app:x}y}:t",
            "{}abc",
            "foo{}{bar}",
            "{user1000}.following",
            "123456789",
        ] {
            assert_eq!(
                Route::new(slot_of(key.as_bytes()), SlotAddr::Master),
                Route::with_key(key, SlotAddr::Master),
                "{key:?}"
            );
        }
        // The reference value from the Redis Cluster specification.
        assert_eq!(crc16(b"123456789"), 0x31C3);
        for (prefix, key) in [("tb", "user:7"), ("app", "x}y"), ("p", "")] {
            let stored = format!("{{{prefix}:{key}}}:t");
            assert_eq!(
                slot_of_logical(prefix, key),
                slot_of(stored.as_bytes()),
                "{stored}"
            );
        }
    }

    #[test]
    fn a_slot_map_carries_estimates_over_by_node_id() {
        use redis::Value::{Array, BulkString, Int};
        let node = |port: i64, id: &str| {
            Array(vec![
                BulkString(b"127.0.0.1".to_vec()),
                Int(port),
                BulkString(id.as_bytes().to_vec()),
            ])
        };
        let reply = |owners: [&str; 2]| {
            Array(vec![
                Array(vec![Int(0), Int(8191), node(7000, owners[0])]),
                Array(vec![Int(8192), Int(16383), node(7001, owners[1])]),
            ])
        };
        let first = SlotMap::from_reply(&reply(["a", "b"]), None).unwrap();
        assert_eq!(first.owner(8191).unwrap().id, "a");
        assert_eq!(first.owner(8192).unwrap().id, "b");
        assert_eq!(first.owner(8192).unwrap().slot, 8192);
        let b = Arc::clone(&first.owner(9000).unwrap().estimate);
        // b's slots move to c (a failover): a's estimate stays, c starts with none.
        let second = SlotMap::from_reply(&reply(["a", "c"]), Some(&first)).unwrap();
        assert!(!second.same_owners(&first));
        assert!(Arc::ptr_eq(
            &second.owner(0).unwrap().estimate,
            &first.owner(0).unwrap().estimate
        ));
        assert!(!Arc::ptr_eq(&second.owner(9000).unwrap().estimate, &b));
        let again = SlotMap::from_reply(&reply(["a", "c"]), Some(&second)).unwrap();
        assert!(again.same_owners(&second));
        assert!(SlotMap::from_reply(&Int(3), None).is_none());
    }
}
