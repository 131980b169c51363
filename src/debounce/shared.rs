//! Debounce across instances: one run per burst among every runtime that
//! shares a Redis backend.
//!
//! # The protocol
//!
//! A key's open burst is one record in Redis (see `debounce/redis.rs`
//! for its fields). Every call is one script on the server's clock:
//! it bumps the burst's generation, makes the calling instance the owner
//! and returns the deadline (`min(now + delay, first call + max_wait)`). The
//! owner arms a local timer for it; at the deadline one script fires the
//! burst if this instance still owns the latest generation, so exactly one
//! instance runs, the one of the burst's last call, with its latest
//! function (last call wins, as in one process). It publishes the encoded
//! outcome on the prefix's debounce channel (and keeps it readable for a
//! while); every instance hands it to its callers of that burst.
//!
//! Calls made on one instance while its previous script is in flight share
//! the next script: a burst of N local calls costs about one round trip per
//! instance per delay, not N.
//!
//! # Bounds
//!
//! Waiters elsewhere never hang. An instance that is not the owner probes
//! the burst a grace ([`GRACE`]) after its last known deadline, in one
//! script: still open and due later, it sleeps again; running, it sleeps for
//! the run's lease (the owner renews it while its function runs); finished,
//! it reads the kept outcome (a notice missed while the subscription
//! reconnected costs a grace, never a result).
//!
//! Still open half a grace past its deadline, the burst has lost its owner
//! (the instance died, or a call script timed out after the server ran it).
//! The probe then rescues it: the same script closes the burst for the
//! probing instance, which runs its own latest function for the burst and
//! publishes the outcome, so the burst still runs exactly once and every
//! waiter gets a value. Only the function differs from the rule: the
//! rescuer's, not the dead owner's. A burst whose owner died while running
//! it (its lease lapsed) is gone: its waiters get [`Error::Discarded`], as
//! do those of an instance with no function to rescue with.
//!
//! # Failure
//!
//! Fail open: a call whose script fails (Redis down, breaker open) is handed
//! to this instance's in-process debounce, so while Redis is unreachable
//! every instance debounces on its own. An owner that cannot fire, or a
//! waiter that cannot probe, runs its latest local function for its own
//! callers. Each failure is logged.
//!
//! # Costs
//!
//! Per burst: one script per instance per round trip of local calls, one
//! fire, one publish; the outcome (bincode) stays in Redis for 10 s. Every
//! instance hears every notice of the prefix on its one subscription (a
//! parse and a registry lookup each), so very busy fleets may want a prefix
//! per group of instances that share keys.
//!
//! # Limits
//!
//! Runs of successive bursts of one key may overlap across instances when a
//! run lasts longer than the delay (in one process they never do). A
//! leading-edge run covers the calls of the opening instance's first round
//! trip. With [`ShutdownPolicy::Drop`](crate::runtime::ShutdownPolicy::Drop) a burst
//! this instance owns is not run here; a waiter elsewhere rescues it after
//! the grace.

use std::any::TypeId;
use std::future::Future;
use std::pin::Pin;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, Mutex, PoisonError};
use std::time::Duration;

use serde::Serialize;
use serde::de::DeserializeOwned;
use throttlebeam_supervisors::{Generation, Registry, SlotEntry, Sweep, TimerGuard, catch_panic};
use tokio::sync::Notify;
use tokio::time::Instant;

use super::redis::{BurstListener, BurstNotice, BurstState, NoticeKind, RUN_LEASE};
use super::seam::BurstStore;
use super::{
    Burst, CLOSING_DROP, CLOSING_FLUSH, Cell, DebounceHandle, DebounceOptions, Job, OPEN, State,
    Value,
};
use crate::error::Error;
use crate::key::{InlineKey, shown, update_slot};
use crate::wire;

/// How long past a burst's deadline a waiter elsewhere waits for its
/// owner before probing; a burst still open then (half a grace overdue or
/// more) has lost its owner.
pub(super) const GRACE: Duration = Duration::from_secs(1);

/// What a shared job returns: the value for local callers and its encoding
/// for the others.
pub(super) type SharedFuture =
    Pin<Box<dyn Future<Output = Result<(Value, Vec<u8>), Error>> + Send>>;
pub(super) type SharedJob = Box<dyn FnOnce(Arc<str>) -> SharedFuture + Send>;

/// An outcome as it travels between instances: in the versioned envelope
/// ([`crate::wire`]), the value nested in the payload's format.
#[derive(serde::Serialize, serde::Deserialize)]
enum Wire {
    Value { tag: String, bytes: Vec<u8> },
    Unencodable(String),
    Failed(String),
    Panicked(String),
    Discarded(String),
}

/// `wire` sealed; a value too large for an envelope travels as the
/// error it is.
fn seal(wire: &Wire) -> Vec<u8> {
    wire::seal(wire)
        .or_else(|e| wire::seal(&Wire::Unencodable(e.to_string())))
        .unwrap_or_default()
}

/// The wire form of a value of `T`, tagged with its type.
pub(super) fn encode_value<T: Serialize>(value: &T) -> Vec<u8> {
    let wire = match wire::encode(value) {
        Ok(bytes) => Wire::Value {
            tag: std::any::type_name::<T>().to_owned(),
            bytes,
        },
        Err(e) => Wire::Unencodable(describe(&e)),
    };
    seal(&wire)
}

/// An error with its causes, as one line of text.
fn describe(error: &dyn std::error::Error) -> String {
    let mut message = error.to_string();
    let mut cause = error.source();
    while let Some(c) = cause {
        message.push_str(": ");
        message.push_str(&c.to_string());
        cause = c.source();
    }
    message
}

fn encode_error(error: &Error) -> Vec<u8> {
    let wire = match error {
        Error::Failed { source, .. } => Wire::Failed(describe(&**source)),
        Error::Panicked { message, .. } => Wire::Panicked(message.clone()),
        Error::Discarded { reason, .. } => Wire::Discarded((*reason).to_owned()),
        other => Wire::Failed(other.to_string()),
    };
    seal(&wire)
}

/// Decodes the values of one result type.
#[derive(Clone, Copy)]
pub(super) struct Codec {
    type_id: TypeId,
    tag: &'static str,
    decode: fn(&[u8]) -> Option<Value>,
}

impl Codec {
    pub(super) fn of<T: DeserializeOwned + Send + Sync + 'static>() -> Self {
        fn decode<T: DeserializeOwned + Send + Sync + 'static>(bytes: &[u8]) -> Option<Value> {
            wire::decode::<T>(bytes).ok().map(|v| Arc::new(v) as Value)
        }
        Self {
            type_id: TypeId::of::<T>(),
            tag: std::any::type_name::<T>(),
            decode: decode::<T>,
        }
    }

    /// The outcome in `bytes` for `key`'s callers: the value, or the error
    /// the run ended with. Bytes that do not decode are a
    /// [`Error::TypeMismatch`]; an envelope this build cannot read (another
    /// format version, say) is a [`Error::StoreUnavailable`] whose source is
    /// the [`WireError`](crate::store::WireError): never misread.
    fn outcome(&self, key: &str, bytes: &[u8]) -> Result<Value, Error> {
        let mismatch = || Error::TypeMismatch { key: shown(key) };
        let wire = match wire::open::<Wire>(bytes) {
            Ok(wire) => wire,
            Err(wire::WireError::Codec { .. }) => return Err(mismatch()),
            Err(unreadable) => {
                tracing::warn!(
                    key = %shown(key),
                    error = %unreadable,
                    "debounce: an outcome from another instance is unreadable by this build"
                );
                return Err(Error::StoreUnavailable {
                    key: shown(key),
                    source: Arc::new(unreadable),
                });
            }
        };
        match wire {
            Wire::Value { tag, bytes } if tag == self.tag => {
                (self.decode)(&bytes).ok_or_else(mismatch)
            }
            Wire::Value { .. } => Err(mismatch()),
            Wire::Unencodable(message) => Err(Error::failed(
                key,
                Remote(format!("the result could not be encoded: {message}")),
            )),
            Wire::Failed(message) => Err(Error::failed(key, Remote(message))),
            Wire::Panicked(message) => Err(Error::Panicked {
                key: shown(key),
                message,
            }),
            Wire::Discarded(reason) => Err(Error::Discarded {
                key: shown(key),
                reason: discard_reason(&reason),
            }),
        }
    }
}

/// The error of a function that failed on another instance, as text.
#[derive(Debug)]
struct Remote(String);

impl std::fmt::Display for Remote {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(&self.0)
    }
}

impl std::error::Error for Remote {}

const LOST: &str = "the instance owning its run was lost";

fn discard_reason(reason: &str) -> &'static str {
    [
        "cancelled",
        "dropped at shutdown",
        "its process was lost",
        "the runtime restarted",
        LOST,
    ]
    .into_iter()
    .find(|r| *r == reason)
    .unwrap_or("discarded on another instance")
}

/// A unique id for this instance (one per runtime): 64 random bits from the
/// OS-seeded hasher, mixed with the process id and the time, so two
/// processes (or two runtimes in one) never share one.
fn instance_id() -> Arc<str> {
    use std::hash::{BuildHasher, Hasher};
    static N: AtomicU64 = AtomicU64::new(0);
    let mut h = std::collections::hash_map::RandomState::new().build_hasher();
    h.write_u32(std::process::id());
    h.write_u64(N.fetch_add(1, Ordering::Relaxed));
    h.write_u128(crate::clock::since_epoch().as_nanos());
    Arc::from(format!("{:016x}", h.finish()))
}

/// A key's shared debounce state on this instance.
pub(super) struct Slot {
    key: Arc<str>,
    type_id: TypeId,
    codec: Codec,
    delay: Duration,
    options: DebounceOptions,
    /// The latest local function (a Mutex only to make the slot `Sync`).
    job: Mutex<Option<SharedJob>>,
    /// Calls not yet told to Redis, sharing one result cell.
    unsent: Option<Cell>,
    /// Calls told to Redis, by the burst that covers them.
    waiting: Vec<(Arc<str>, Cell)>,
    /// The burst and generation of this instance's latest call, while it
    /// may still be the owner.
    owner: Option<(Arc<str>, u64)>,
    /// When to fire (owner) or probe (waiter).
    due: Option<Instant>,
    /// Fire now: a flush was asked.
    flush: bool,
    wake: Arc<Notify>,
}

impl Slot {
    fn job(&mut self) -> &mut Option<SharedJob> {
        self.job.get_mut().unwrap_or_else(PoisonError::into_inner)
    }

    fn idle(&self) -> bool {
        self.unsent.is_none() && self.waiting.is_empty() && self.owner.is_none()
    }

    /// Takes the cells of `burst`, forgetting it.
    fn settle(&mut self, burst: &str) -> Vec<Cell> {
        if self.owner.as_ref().is_some_and(|(b, _)| &**b == burst) {
            self.owner = None;
            self.flush = false;
        }
        let mut cells = Vec::new();
        self.waiting.retain(|(b, cell)| {
            if &**b == burst {
                cells.push(Arc::clone(cell));
                false
            } else {
                true
            }
        });
        cells
    }
}

/// The shared debounce of one runtime.
pub(super) struct Shared {
    store: Arc<dyn BurstStore>,
    instance: Arc<str>,
    seq: AtomicU64,
    registry: Registry<InlineKey, Slot>,
}

impl Shared {
    pub(super) fn new(
        store: Arc<dyn BurstStore>,
        registry: Registry<InlineKey, Slot>,
    ) -> Arc<Self> {
        let shared = Arc::new(Self {
            store,
            instance: instance_id(),
            seq: AtomicU64::new(0),
            registry,
        });
        let listener: Arc<dyn BurstListener> = shared.clone();
        shared.store.listen_bursts(Arc::downgrade(&listener));
        shared
    }

    pub(super) fn len(&self) -> usize {
        self.registry.len()
    }

    /// Wakes every key's process (shutdown).
    pub(super) fn wake_all(&self) {
        self.registry.retain(|_, slot| {
            slot.wake.notify_one();
            true
        });
    }

    /// Forgets every key, failing its callers (runtime restart).
    pub(super) fn reset(&self) {
        for (_, mut slot) in self.registry.drain() {
            let lost = slot
                .unsent
                .take()
                .into_iter()
                .chain(slot.waiting.drain(..).map(|(_, c)| c));
            for cell in lost {
                cell.discard("the runtime restarted");
            }
            slot.wake.notify_one();
        }
    }

    /// A notice from any instance about one of our keys.
    fn apply(&self, key: &str, burst: &str, kind: &NoticeKind) {
        let mut dropped = None;
        let settled = self
            .registry
            .with_slot(key.as_bytes(), |slot| {
                let s = &mut slot.state;
                let cells = match kind {
                    NoticeKind::Flush => {
                        if s.owner.as_ref().is_some_and(|(b, _)| &**b == burst) {
                            s.flush = true;
                            s.wake.notify_one();
                        }
                        return None;
                    }
                    NoticeKind::Outcome(_) | NoticeKind::Cancelled => s.settle(burst),
                };
                if s.idle() {
                    dropped = s.job().take();
                }
                s.wake.notify_one();
                Some((cells, s.codec))
            })
            .flatten();
        drop(dropped);
        let Some((cells, codec)) = settled else {
            return;
        };
        if cells.is_empty() {
            return;
        }
        let outcome = match kind {
            NoticeKind::Outcome(bytes) => codec.outcome(key, bytes),
            _ => Err(Error::Discarded {
                key: shown(key),
                reason: "cancelled",
            }),
        };
        for cell in cells {
            cell.set(outcome.clone());
        }
    }
}

/// Keys leave the map one by one as their processes exit; a sweep gives
/// back the memory a flood of keys left behind.
impl Sweep for Shared {
    fn sweep(&self, _: Instant) -> usize {
        self.registry.release_capacity();
        // Nothing here expires: never keeps the sweeper awake.
        0
    }
}

impl BurstListener for Shared {
    fn notice(&self, notice: BurstNotice) {
        self.apply(&notice.key, &notice.burst, &notice.kind);
    }
}

impl DebounceHandle {
    /// The shared debounce of this runtime, if it has Redis.
    pub(super) fn shared(&self) -> Option<&Arc<Shared>> {
        let redis = self.runtime.core.redis()?;
        Some(self.state.shared.get_or_init(|| {
            let core = &self.runtime.core;
            let shared = Shared::new(
                Arc::new(redis.clone()),
                Registry::new(Arc::clone(&core.counters), core.cap),
            );
            let sweep: Arc<dyn Sweep> = shared.clone();
            core.tree.sweeper().register(Arc::downgrade(&sweep));
            shared
        }))
    }

    /// The shared path of [`DebounceHandle::call_shared_with`].
    pub(super) fn schedule_shared(
        &self,
        shared: &Arc<Shared>,
        key: &str,
        delay: Duration,
        options: DebounceOptions,
        job: SharedJob,
        codec: Codec,
    ) -> Result<Cell, Error> {
        let type_id = codec.type_id;
        let mut job = Some(job);
        let mut replaced = None;
        let started = update_slot(&shared.registry, key, |entry| match entry {
            SlotEntry::Occupied(slot) => {
                let s = &mut slot.state;
                if s.type_id != type_id {
                    return Err(Error::TypeMismatch { key: shown(key) });
                }
                replaced = std::mem::replace(s.job(), job.take());
                s.delay = delay;
                s.options = options;
                let cell = Arc::clone(s.unsent.get_or_insert_with(|| Burst::new(&s.key)));
                s.wake.notify_one();
                Ok((cell, None))
            }
            SlotEntry::Vacant(vacant) => {
                let owned: Arc<str> = Arc::from(key);
                let cell = Burst::new(&owned);
                let slot = Slot {
                    key: Arc::clone(&owned),
                    type_id,
                    codec,
                    delay,
                    options,
                    job: Mutex::new(job.take()),
                    unsent: Some(Arc::clone(&cell)),
                    waiting: Vec::new(),
                    owner: None,
                    due: None,
                    flush: false,
                    wake: Arc::new(Notify::new()),
                };
                let guard = vacant.insert(slot).map_err(|e| Error::TooManyKeys {
                    key: shown(key),
                    cap: e.cap,
                })?;
                Ok((cell, Some((owned, guard.generation()))))
            }
        });
        drop((job, replaced));
        let (cell, spawn) = started?;
        self.state.calls.incr();
        if let Some((key, generation)) = spawn {
            let driver = Driver {
                handle: self.clone(),
                shared: Arc::clone(shared),
                key: Arc::clone(&key),
                generation,
                done: false,
                held: Vec::new(),
            };
            // A process that cannot start is dropped unpolled: its guard
            // releases the key.
            self.runtime.core.start_process(&key, driver.run())?;
        }
        Ok(cell)
    }

    /// The shared path of [`DebounceHandle::cancel_shared`].
    pub(super) async fn cancel_everywhere(&self, shared: &Shared, key: &str) -> bool {
        let remote = match shared.store.burst_cancel(key).await {
            Ok(burst) => burst,
            Err(error) => {
                tracing::warn!(key = %shown(key), %error, "debounce: Redis unreachable; cancelling on this instance only");
                None
            }
        };
        let mut dropped = None;
        let cells = shared
            .registry
            .with_slot(key.as_bytes(), |slot| {
                let s = &mut slot.state;
                let mut cells: Vec<Cell> = s.unsent.take().into_iter().collect();
                match &remote {
                    Some(burst) => cells.extend(s.settle(burst)),
                    // Unreachable (or nothing open there): what waits here.
                    None => {
                        s.owner = None;
                        cells.extend(s.waiting.drain(..).map(|(_, c)| c));
                    }
                }
                s.flush = false;
                if s.idle() {
                    dropped = s.job().take();
                }
                s.wake.notify_one();
                cells
            })
            .unwrap_or_default();
        drop(dropped);
        let local = !cells.is_empty();
        for cell in cells {
            cell.discard("cancelled");
        }
        // Calls handed to the in-process debounce while Redis was down.
        let fallback = self.cancel(key);
        let cancelled = remote.is_some() || local || fallback;
        if cancelled {
            self.state.cancelled.incr();
        }
        cancelled
    }

    /// The shared path of [`DebounceHandle::flush_shared`].
    pub(super) async fn flush_everywhere(&self, shared: &Shared, key: &str) -> bool {
        let remote = match shared.store.burst_flush(key).await {
            Ok(flushed) => flushed,
            Err(error) => {
                tracing::warn!(key = %shown(key), %error, "debounce: Redis unreachable; flushing on this instance only");
                false
            }
        };
        let fallback = self.flush(key);
        let flushed = remote || fallback;
        if flushed {
            self.state.flushed.incr();
        }
        flushed
    }
}

enum Step {
    /// Tell Redis about the unsent calls.
    Send {
        call: String,
        cell: Cell,
        delay: Duration,
        options: DebounceOptions,
        /// A leading call's function, taken out in case it runs now.
        leading: Option<SharedJob>,
    },
    Fire {
        burst: Arc<str>,
        generation: u64,
        force: bool,
        max_wait: Option<Duration>,
    },
    /// Ask where a burst stands; `rescue` it if its owner left it overdue
    /// and this instance has a function to run for it.
    Probe {
        burst: Arc<str>,
        rescue: bool,
        max_wait: Option<Duration>,
    },
    Sleep(Option<Instant>, Arc<Notify>),
    TryExit,
    Gone,
}

/// A key's shared process: tells Redis about local calls, fires the bursts
/// this instance owns, and watches over the ones it waits for.
struct Driver {
    handle: DebounceHandle,
    shared: Arc<Shared>,
    key: Arc<str>,
    generation: Generation,
    done: bool,
    /// Cells this process holds outside the slot (a call script or a run
    /// in flight): failed if it is dropped before it settles them.
    held: Vec<Cell>,
}

impl Driver {
    fn state(&self) -> &State {
        &self.handle.state
    }

    async fn run(mut self) {
        // Subscribes if the first shared call came from outside tokio.
        self.shared.store.subscribe();
        loop {
            let now = Instant::now();
            let closing = self.state().closing.load(Ordering::Acquire);
            let mut dropped = Vec::new();
            let mut dropped_job = None;
            let step = self
                .shared
                .registry
                .with_slot(self.key.as_bytes(), |slot| {
                    if slot.generation() != self.generation {
                        return Step::Gone;
                    }
                    let s = &mut slot.state;
                    match closing {
                        OPEN => {}
                        CLOSING_DROP => {
                            dropped.extend(s.unsent.take());
                            dropped.extend(s.waiting.drain(..).map(|(_, c)| c));
                            s.owner = None;
                            dropped_job = s.job().take();
                            return Step::TryExit;
                        }
                        CLOSING_FLUSH => s.flush = true,
                        _ => {}
                    }
                    if let Some(cell) = s.unsent.take() {
                        let seq = self.shared.seq.fetch_add(1, Ordering::Relaxed);
                        return Step::Send {
                            call: format!("{}.{seq:x}", self.shared.instance),
                            cell,
                            delay: s.delay,
                            options: s.options,
                            leading: if s.options.leading() {
                                s.job().take()
                            } else {
                                None
                            },
                        };
                    }
                    let due = s.due.is_some_and(|d| now >= d);
                    if let Some((burst, generation)) = &s.owner
                        && (due || s.flush)
                    {
                        return Step::Fire {
                            burst: Arc::clone(burst),
                            generation: *generation,
                            force: s.flush,
                            max_wait: s.options.max_wait(),
                        };
                    }
                    if let Some((burst, _)) = s.waiting.first()
                        && due
                    {
                        let burst = Arc::clone(burst);
                        return Step::Probe {
                            burst,
                            rescue: s.job().is_some(),
                            max_wait: s.options.max_wait(),
                        };
                    }
                    if s.idle() {
                        return Step::TryExit;
                    }
                    Step::Sleep(s.due, Arc::clone(&s.wake))
                })
                .unwrap_or(Step::Gone);
            // Outside the shard lock: the user's function is dropped here.
            drop(dropped_job);
            for cell in dropped {
                if cell.discard("dropped at shutdown") {
                    self.state().failed.incr();
                }
            }
            match step {
                Step::Send {
                    call,
                    cell,
                    delay,
                    options,
                    leading,
                } => self.send(&call, cell, delay, options, leading).await,
                Step::Fire {
                    burst,
                    generation,
                    force,
                    max_wait,
                } => {
                    let fired = self
                        .shared
                        .store
                        .burst_fire(
                            &self.key,
                            &self.shared.instance,
                            &burst,
                            generation,
                            force,
                            max_wait,
                            None,
                        )
                        .await;
                    self.found(&burst, fired).await;
                }
                Step::Probe {
                    burst,
                    rescue,
                    max_wait,
                } => {
                    let probed = if rescue {
                        self.shared
                            .store
                            .burst_fire(
                                &self.key,
                                &self.shared.instance,
                                &burst,
                                0,
                                false,
                                max_wait,
                                Some(GRACE / 2),
                            )
                            .await
                    } else {
                        self.shared.store.burst_probe(&self.key, &burst).await
                    };
                    self.found(&burst, probed).await;
                }
                Step::Sleep(until, wake) => {
                    let _timer = TimerGuard::arm(&self.state().counters);
                    match until {
                        Some(until) => tokio::select! {
                            () = tokio::time::sleep_until(until) => {}
                            () = wake.notified() => {}
                        },
                        None => wake.notified().await,
                    }
                    self.state().wakeups.fetch_add(1, Ordering::Relaxed);
                }
                Step::TryExit => {
                    if self
                        .shared
                        .registry
                        .remove_if(self.key.as_bytes(), self.generation, Slot::idle)
                        .is_some()
                    {
                        self.done = true;
                        return;
                    }
                }
                Step::Gone => {
                    self.done = true;
                    return;
                }
            }
        }
    }

    /// Tells Redis about a batch of local calls; on failure hands them to
    /// this instance's in-process debounce.
    async fn send(
        &mut self,
        call: &str,
        cell: Cell,
        delay: Duration,
        options: DebounceOptions,
        leading: Option<SharedJob>,
    ) {
        self.held.push(Arc::clone(&cell));
        let joined = self
            .shared
            .store
            .burst_call(
                &self.key,
                &self.shared.instance,
                call,
                delay,
                options.max_wait(),
                options.leading(),
            )
            .await;
        let now = Instant::now();
        self.held.clear();
        match joined {
            Ok(joined) => {
                let burst: Arc<str> = Arc::from(joined.burst);
                let mut run_now = None;
                let mut dropped = None;
                let kept = self.shared.registry.with_slot(self.key.as_bytes(), |slot| {
                    if slot.generation() != self.generation {
                        return false;
                    }
                    let s = &mut slot.state;
                    match leading {
                        Some(job) if joined.opened => run_now = Some(job),
                        Some(job) => {
                            // Not the first call of the burst: it is the
                            // latest function unless a newer one came.
                            if s.job().is_none() {
                                *s.job() = Some(job);
                            } else {
                                dropped = Some(job);
                            }
                        }
                        None => {}
                    }
                    if run_now.is_none() {
                        s.waiting.push((Arc::clone(&burst), Arc::clone(&cell)));
                    }
                    s.owner = Some((Arc::clone(&burst), joined.generation));
                    s.due = Some(now + joined.left);
                    true
                });
                drop(dropped);
                if kept != Some(true) {
                    // The key was reset meanwhile: nobody will settle these calls.
                    cell.discard("the runtime restarted");
                    return;
                }
                if let Some(job) = run_now {
                    // The leading edge: this round trip's calls run now, here.
                    self.execute(Some(job), vec![cell], None).await;
                }
            }
            Err(error) => {
                tracing::warn!(key = %shown(&self.key), %error, "debounce: Redis unreachable; debouncing on this instance");
                // Everything waiting here goes local with the latest function.
                let (job, mut cells) = self
                    .shared
                    .registry
                    .with_slot(self.key.as_bytes(), |slot| {
                        let s = &mut slot.state;
                        s.owner = None;
                        s.flush = false;
                        let cells: Vec<Cell> = s.waiting.drain(..).map(|(_, c)| c).collect();
                        (s.job().take(), cells)
                    })
                    .unwrap_or_default();
                cells.push(cell);
                self.fall_back(job.or(leading), cells, delay, options);
            }
        }
    }

    /// Hands calls to the in-process debounce of this runtime.
    fn fall_back(
        &self,
        job: Option<SharedJob>,
        cells: Vec<Cell>,
        delay: Duration,
        options: DebounceOptions,
    ) {
        let type_id = self
            .shared
            .registry
            .read(self.key.as_bytes(), |slot| slot.state.type_id);
        let (Some(job), Some(type_id)) = (job, type_id) else {
            for cell in cells {
                cell.discard(LOST);
            }
            return;
        };
        let local: Job = Box::new(move |key: Arc<str>| {
            Box::pin(async move { job(key).await.map(|(value, _)| value) })
        });
        match self
            .handle
            .schedule(&self.key, delay, options, local, type_id)
        {
            Ok(local) => {
                tokio::spawn(async move {
                    let result = local.result.wait().await;
                    for cell in cells {
                        cell.set(result.clone());
                    }
                });
            }
            Err(e) => {
                for cell in cells {
                    cell.set(Err(e.clone()));
                }
            }
        }
    }

    /// Acts on where a burst stands (after a fire attempt or a probe).
    async fn found(
        &mut self,
        burst: &Arc<str>,
        state: Result<BurstState, crate::store::StoreError>,
    ) {
        let now = Instant::now();
        match state {
            Ok(BurstState::Fired) => {
                let (job, cells) = self
                    .shared
                    .registry
                    .with_slot(self.key.as_bytes(), |slot| {
                        let s = &mut slot.state;
                        s.flush = false;
                        let cells = s.settle(burst);
                        (s.job().take(), cells)
                    })
                    .unwrap_or_default();
                self.execute(job, cells, Some(burst)).await;
            }
            Ok(BurstState::Quiet) => {
                // Only a leading call was in it, and it has run already:
                // nobody waits on the burst itself.
                for cell in self.settle(burst) {
                    cell.discard(LOST);
                }
            }
            Ok(BurstState::Wait(left)) => self.rearm(now + left),
            Ok(BurstState::Open(left)) => {
                // Probed a grace after the deadline: a live owner fired long
                // ago, so half a grace overdue means it is gone (and this
                // instance had no function to rescue the burst with).
                let overdue = left.unsigned_abs();
                if left < 0 && Duration::from_millis(overdue) >= GRACE / 2 {
                    self.lost(burst);
                } else {
                    let left = Duration::from_millis(u64::try_from(left.max(0)).unwrap_or(0));
                    self.shared.registry.with_slot(self.key.as_bytes(), |slot| {
                        let s = &mut slot.state;
                        if s.owner.as_ref().is_some_and(|(b, _)| b == burst) {
                            s.owner = None;
                        }
                        s.flush = false;
                        s.due = Some(now + left + GRACE);
                    });
                }
            }
            Ok(BurstState::Running(left)) => {
                self.shared.registry.with_slot(self.key.as_bytes(), |slot| {
                    let s = &mut slot.state;
                    if s.owner.as_ref().is_some_and(|(b, _)| b == burst) {
                        s.owner = None;
                    }
                    s.flush = false;
                    s.due = Some(now + left + GRACE / 4);
                });
            }
            Ok(BurstState::Done(notice)) => match BurstNotice::parse(&notice) {
                Some(notice) => self.shared.apply(&self.key, burst, &notice.kind),
                None => self.lost(burst),
            },
            Ok(BurstState::Gone) => self.lost(burst),
            Err(error) => {
                tracing::warn!(key = %shown(&self.key), %error, "debounce: Redis unreachable; running here for this instance's calls");
                let (job, cells) = self
                    .shared
                    .registry
                    .with_slot(self.key.as_bytes(), |slot| {
                        let s = &mut slot.state;
                        s.owner = None;
                        s.flush = false;
                        let cells: Vec<Cell> = s.waiting.drain(..).map(|(_, c)| c).collect();
                        (s.job().take(), cells)
                    })
                    .unwrap_or_default();
                self.execute(job, cells, None).await;
            }
        }
    }

    fn rearm(&self, at: Instant) {
        self.shared.registry.with_slot(self.key.as_bytes(), |slot| {
            slot.state.due = Some(at);
        });
    }

    fn settle(&self, burst: &str) -> Vec<Cell> {
        let mut dropped = None;
        let cells = self
            .shared
            .registry
            .with_slot(self.key.as_bytes(), |slot| {
                let s = &mut slot.state;
                let cells = s.settle(burst);
                if s.idle() {
                    dropped = s.job().take();
                }
                cells
            })
            .unwrap_or_default();
        drop(dropped);
        cells
    }

    /// The burst's owner is gone without a result.
    fn lost(&self, burst: &str) {
        let cells = self.settle(burst);
        if !cells.is_empty() {
            tracing::warn!(key = %shown(&self.key), "debounce: the instance owning a burst was lost; its callers here get an error");
        }
        for cell in cells {
            if cell.discard(LOST) {
                self.state().failed.incr();
            }
        }
    }

    /// Runs the function for `cells`; publishes the outcome for the other
    /// instances when this run fired `burst`, renewing its lease meanwhile.
    async fn execute(
        &mut self,
        job: Option<SharedJob>,
        cells: Vec<Cell>,
        burst: Option<&Arc<str>>,
    ) {
        self.held.extend(cells.iter().cloned());
        self.state().runs.incr();
        let renewal = burst.map(|burst| {
            let (store, key, burst) = (Arc::clone(&self.shared.store), Arc::clone(&self.key), Arc::clone(burst));
            AbortOnDrop(tokio::spawn(async move {
                loop {
                    tokio::time::sleep(RUN_LEASE / 3).await;
                    if let Err(error) = store.burst_renew(&key, &burst).await {
                        tracing::debug!(key = %shown(&key), %error, "debounce: lease renewal failed");
                    }
                }
            }))
        });
        let result = match job {
            Some(job) => match catch_panic(job(Arc::clone(&self.key))).await {
                Ok(result) => result,
                Err(panic) => Err(Error::panicked(&self.key, &panic)),
            },
            None => Err(Error::Discarded {
                key: shown(&self.key),
                reason: LOST,
            }),
        };
        drop(renewal);
        let wire = match &result {
            Ok((_, bytes)) => bytes.clone(),
            Err(error) => encode_error(error),
        };
        let local = result.map(|(value, _)| value);
        if let Err(error) = &local {
            self.state().failed.incr();
            let error: &(dyn std::error::Error + 'static) = error;
            tracing::debug!(key = %shown(&self.key), error, "debounced function failed");
        }
        for cell in cells {
            cell.set(local.clone());
        }
        self.held.clear();
        if let Some(burst) = burst
            && let Err(error) = self
                .shared
                .store
                .burst_publish(&self.key, burst, wire)
                .await
        {
            tracing::warn!(key = %shown(&self.key), %error, "debounce: could not publish a run's outcome; waiters elsewhere fall back");
        }
    }
}

/// Stops a lease renewal when the run ends, however it ends.
struct AbortOnDrop(tokio::task::JoinHandle<()>);

impl Drop for AbortOnDrop {
    fn drop(&mut self) {
        self.0.abort();
    }
}

impl Drop for Driver {
    fn drop(&mut self) {
        for cell in std::mem::take(&mut self.held) {
            if cell.discard("its process was lost") {
                self.state().failed.incr();
            }
        }
        if self.done {
            return;
        }
        let left = self
            .shared
            .registry
            .remove_if(self.key.as_bytes(), self.generation, |_| true);
        if let Some(mut slot) = left {
            let lost = slot
                .unsent
                .take()
                .into_iter()
                .chain(slot.waiting.drain(..).map(|(_, c)| c));
            for cell in lost {
                if cell.discard("its process was lost") {
                    self.state().failed.incr();
                }
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn outcomes_travel_as_values_or_typed_errors() {
        let codec = Codec::of::<Vec<String>>();
        let value = vec!["a".to_owned(), "b".to_owned()];
        let decoded = codec.outcome("k", &encode_value(&value)).expect("a value");
        assert_eq!(decoded.downcast_ref::<Vec<String>>(), Some(&value));
        // Another type is refused, not misread.
        assert!(matches!(
            codec.outcome("k", &encode_value(&7_u32)),
            Err(Error::TypeMismatch { .. })
        ));
        // Bytes of no envelope, or of another format version, are refused
        // with a typed error naming why, never misread.
        assert!(matches!(
            codec.outcome("k", b"not bincode"),
            Err(Error::StoreUnavailable { .. })
        ));
        let mut other_version = encode_value(&value);
        assert_eq!(&other_version[..3], b"tb\x01");
        other_version[2] = 2;
        match codec.outcome("k", &other_version) {
            Err(Error::StoreUnavailable { key, source }) => {
                assert_eq!(key, "k");
                assert!(
                    matches!(
                        source.downcast_ref::<wire::WireError>(),
                        Some(wire::WireError::UnknownVersion { found: 2, .. })
                    ),
                    "{source}"
                );
            }
            other => panic!("{other:?}"),
        }
        // Truncated, or with bytes left over: the value is not misread.
        let whole = encode_value(&value);
        for cut in 3..whole.len() {
            assert!(
                matches!(
                    codec.outcome("k", &whole[..cut]),
                    Err(Error::TypeMismatch { .. })
                ),
                "{cut}"
            );
        }
        let mut padded = whole.clone();
        padded.push(0);
        assert!(matches!(
            codec.outcome("k", &padded),
            Err(Error::TypeMismatch { .. })
        ));
        let failed = Error::failed("k", std::io::Error::other("disk full"));
        match codec.outcome("k", &encode_error(&failed)) {
            Err(Error::Failed { key, source }) => {
                assert_eq!(key, "k");
                assert_eq!(source.to_string(), "disk full");
            }
            other => panic!("{other:?}"),
        }
        let panicked = Error::Panicked {
            key: "k".to_owned(),
            message: "boom".to_owned(),
        };
        assert!(matches!(
            codec.outcome("k", &encode_error(&panicked)),
            Err(Error::Panicked { message, .. }) if message == "boom"
        ));
        for reason in ["cancelled", "dropped at shutdown", LOST, "something new"] {
            let discarded = Error::Discarded {
                key: "k".to_owned(),
                reason: if reason == "something new" {
                    "x"
                } else {
                    discard_reason(reason)
                },
            };
            let Err(Error::Discarded { reason: got, .. }) =
                codec.outcome("k", &encode_error(&discarded))
            else {
                panic!("a discard");
            };
            if reason == "something new" {
                assert_eq!(got, "discarded on another instance");
            } else {
                assert_eq!(got, reason);
            }
        }
    }

    #[test]
    fn instance_ids_differ() {
        let ids: std::collections::HashSet<_> = (0..1000).map(|_| instance_id()).collect();
        assert_eq!(ids.len(), 1000);
    }
}
