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
//! fire, one publish; the outcome (MessagePack) stays in Redis for 10 s. Every
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
use std::sync::Arc;
use std::sync::atomic::{AtomicU64, Ordering};
use std::time::Duration;

use sync_wrapper::SyncWrapper;
use throttlebeam_supervisors::{Registry, SlotEntry, Sweep};
use tokio::sync::Notify;
use tokio::time::Instant;

use super::redis::{BurstListener, BurstNotice, NoticeKind};
use super::seam::BurstStore;
use super::{Burst, Cell, DebounceHandle, DebounceOptions, Value};
use crate::error::Error;
use crate::key::{InlineKey, shown, update_slot};

/// How long past a burst's deadline a waiter elsewhere waits for its
/// owner before probing; a burst still open then (half a grace overdue or
/// more) has lost its owner.
pub(super) const GRACE: Duration = Duration::from_secs(1);

/// What a shared job returns: the value for local callers and its encoding
/// for the others.
pub(super) type SharedFuture =
    Pin<Box<dyn Future<Output = Result<(Value, Vec<u8>), Error>> + Send>>;
pub(super) type SharedJob = Box<dyn FnOnce(Arc<str>) -> SharedFuture + Send>;

mod codec;
mod driver;

pub(super) use self::codec::{Codec, encode_value};
use self::driver::Driver;
#[cfg(test)]
mod tests;

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
    /// The latest local function, wrapped to make the slot `Sync`: only ever reached through
    /// `&mut`.
    job: SyncWrapper<Option<SharedJob>>,
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
        self.job.get_mut()
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

    /// The shared path of `call_with` of [`DebounceHandle::across_instances`].
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
                    job: SyncWrapper::new(job.take()),
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

    /// The shared path of `cancel` of [`DebounceHandle::across_instances`].
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

    /// The shared path of `flush` of [`DebounceHandle::across_instances`].
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
