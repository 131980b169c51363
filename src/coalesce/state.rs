//! What a coalescing throttle shares between its callers and its per-key
//! processes: the registry of key slots, the store, the mode and the gauges.

use std::future::Future;
use std::pin::Pin;
use std::sync::atomic::{AtomicU8, AtomicUsize, Ordering};
use std::sync::{Arc, Mutex, PoisonError};
use std::time::{Duration, SystemTime, UNIX_EPOCH};

use throttlebeam_supervisors::{Counters, Generation, Registry, SlotEntry};
use tokio::sync::{Notify, oneshot};
use tokio::time::Instant;

use super::Phase;
use super::store::{SetOptions, WindowStore};
use crate::cell::RunCell;
use crate::error::Error;
use crate::key::{InlineKey, check_key, shown};
use crate::runtime::{Runtime, Service, ServiceFuture, ShutdownPolicy};

/// A user function, boxed so the latest one can replace an older one.
pub(super) type Job<T> = Box<dyn FnOnce(Phase) -> JobFuture<T> + Send>;
pub(super) type JobFuture<T> = Pin<Box<dyn Future<Output = Result<T, UserError>> + Send>>;
pub(super) type UserError = Box<dyn std::error::Error + Send + Sync + 'static>;

/// What the process tells a leading caller.
pub(super) enum Led<T> {
    /// Its own run finished with this result.
    Ran(Result<T, Error>),
    /// Another instance holds the window: the call was coalesced into the
    /// trailing run behind this cell.
    Coalesced(Arc<RunCell<T>>),
}

/// How a call was taken.
pub(super) enum Submitted<T> {
    /// It leads: the process reports on this channel.
    Lead(oneshot::Receiver<Led<T>>),
    /// It was coalesced; the cell is there if the caller wants to wait.
    Coalesced(Option<Arc<RunCell<T>>>),
}

/// Calls coalesced into the next trailing run of a key.
pub(super) struct Pending<T> {
    /// The latest function (a `Mutex` only to make the slot `Sync`; it is
    /// reached through `&mut` or by value, never locked).
    pub(super) job: Mutex<Job<T>>,
    /// Where the covered callers wait: empty until one of them waits (plain
    /// calls need none), then one cell, plus the cells of earlier runs folded
    /// into this one after a lost window race.
    pub(super) cells: Vec<Arc<RunCell<T>>>,
}

impl<T: Clone> Pending<T> {
    pub(super) fn new(job: Job<T>, cells: Vec<Arc<RunCell<T>>>) -> Self {
        Self {
            job: Mutex::new(job),
            cells,
        }
    }

    /// The cell a new waiter waits on, made on first need.
    pub(super) fn cell(&mut self) -> Arc<RunCell<T>> {
        if let Some(cell) = self.cells.first() {
            return cell.clone();
        }
        let cell = RunCell::new();
        self.cells.push(cell.clone());
        cell
    }

    pub(super) fn into_job(self) -> (Job<T>, Vec<Arc<RunCell<T>>>) {
        let job = self
            .job
            .into_inner()
            .unwrap_or_else(PoisonError::into_inner);
        (job, self.cells)
    }

    /// Fails every caller waiting here; the function is dropped.
    pub(super) fn fail(self, error: &Error) {
        let (job, cells) = self.into_job();
        drop(job);
        for cell in cells {
            cell.set(Err(error.clone()));
        }
    }
}

/// A key's slot in the registry.
pub(super) struct KeyState<T> {
    /// A run is being claimed or executed.
    pub(super) running: bool,
    /// When not running: when the window ends (or the next claim retry).
    pub(super) until: Instant,
    /// The trailing run waiting for the window to end.
    pub(super) pending: Option<Pending<T>>,
}

pub(super) const OPEN: u8 = 0;
pub(super) const DRAINING: u8 = 1;
pub(super) const DESTROYED: u8 = 2;

/// Live figures of one throttle, plus the runtime's shared counters.
pub(super) struct Gauges {
    pub(super) active: AtomicUsize,
    pub(super) pending: AtomicUsize,
    pub(super) timers: AtomicUsize,
    pub(super) live: AtomicUsize,
    pub(super) idle: Notify,
    pub(super) runtime: Arc<Counters>,
}

/// A timer counted in the throttle's and the runtime's gauges while it lives.
pub(super) struct Armed<'a>(&'a Gauges);

impl<'a> Armed<'a> {
    pub(super) fn new(gauges: &'a Gauges) -> Self {
        gauges.timers.fetch_add(1, Ordering::Relaxed);
        gauges.runtime.timer_armed();
        Self(gauges)
    }
}

impl Drop for Armed<'_> {
    fn drop(&mut self) {
        self.0.timers.fetch_sub(1, Ordering::Relaxed);
        self.0.runtime.timer_disarmed();
    }
}

/// Epoch milliseconds read from tokio's clock: one wall-clock reading at
/// start, then monotonic (and paused along with tokio's time in tests).
pub(super) struct EpochClock {
    base_ms: u64,
    base: Instant,
}

impl EpochClock {
    fn new() -> Self {
        let base_ms = SystemTime::now()
            .duration_since(UNIX_EPOCH)
            .map_or(0, |d| u64::try_from(d.as_millis()).unwrap_or(u64::MAX));
        Self {
            base_ms,
            base: Instant::now(),
        }
    }

    pub(super) fn at(&self, instant: Instant) -> u64 {
        let since = instant.saturating_duration_since(self.base).as_millis();
        self.base_ms
            .saturating_add(u64::try_from(since).unwrap_or(u64::MAX))
    }
}

/// The configuration a throttle is built from.
pub(super) struct Config {
    pub(super) runtime: Runtime,
    pub(super) name: Box<str>,
    pub(super) prefix: Box<str>,
    pub(super) window: Duration,
    pub(super) store: Box<dyn WindowStore>,
    pub(super) owns_store: bool,
}

pub(super) struct Shared<T> {
    pub(super) runtime: Runtime,
    pub(super) name: Box<str>,
    pub(super) prefix: Box<str>,
    pub(super) window: Duration,
    /// How often a running function's lease is extended.
    pub(super) lease_every: Duration,
    /// The lease's time to live in the store.
    pub(super) lease_ttl: Duration,
    pub(super) store: Box<dyn WindowStore>,
    pub(super) owns_store: bool,
    pub(super) registry: Registry<InlineKey, KeyState<T>>,
    mode: AtomicU8,
    /// Wakes processes sleeping through a window when the mode changes.
    pub(super) wake: Notify,
    pub(super) gauges: Gauges,
    pub(super) epoch: EpochClock,
}

enum Decision<T> {
    Lead(Generation, Job<T>),
    Coalesced {
        cell: Option<Arc<RunCell<T>>>,
        stale: Option<Job<T>>,
    },
    /// Not accepted; the function comes back out to be dropped unlocked.
    Refused(Error, Job<T>),
}

impl<T: Clone + Send + Sync + 'static> Shared<T> {
    pub(super) fn new(config: Config) -> Arc<Self> {
        let core = &config.runtime.core;
        let lease_every = (config.window / 2).max(Duration::from_millis(100));
        let shared = Arc::new(Self {
            registry: Registry::new(core.counters.clone(), core.cap),
            gauges: Gauges {
                active: AtomicUsize::new(0),
                pending: AtomicUsize::new(0),
                timers: AtomicUsize::new(0),
                live: AtomicUsize::new(0),
                idle: Notify::new(),
                runtime: core.counters.clone(),
            },
            lease_every,
            lease_ttl: config.window.max(lease_every * 2),
            mode: AtomicU8::new(OPEN),
            wake: Notify::new(),
            epoch: EpochClock::new(),
            runtime: config.runtime,
            name: config.name,
            prefix: config.prefix,
            window: config.window,
            store: config.store,
            owns_store: config.owns_store,
        });
        let service: std::sync::Weak<dyn Service> = Arc::downgrade(&shared) as _;
        shared.runtime.core.attach(service);
        shared
    }

    pub(super) fn mode(&self) -> u8 {
        self.mode.load(Ordering::Acquire)
    }

    /// Store writes are skipped once a throttle that owns its store is
    /// destroyed: the store was cleared and nobody else reads it.
    pub(super) fn store_closed(&self) -> bool {
        self.owns_store && self.mode() == DESTROYED
    }

    /// The key as the store sees it: prefix + key. Built per store command
    /// rather than kept, so an idle window costs less.
    fn store_key(&self, key: &str) -> String {
        let mut store_key = String::with_capacity(self.prefix.len() + key.len());
        store_key.push_str(&self.prefix);
        store_key.push_str(key);
        store_key
    }

    fn refused(&self, key: &str) -> Error {
        Error::ShutDown { key: shown(key) }
    }

    /// Takes a call: leads on an idle key (starting its process), otherwise
    /// coalesces into the key's pending trailing run. Never waits.
    pub(super) fn submit(
        self: &Arc<Self>,
        key: &str,
        job: Job<T>,
        wants_cell: bool,
    ) -> Result<Submitted<T>, Error> {
        check_key(key)?;
        let core = &self.runtime.core;
        core.check_open(key)?;
        // The mode is read under the shard lock, so `destroy` (mode first,
        // then a pass over every shard) never misses a pending call.
        let decision = self.registry.update(key.as_bytes(), |entry| match entry {
            _ if self.mode() != OPEN => Decision::Refused(self.refused(key), job),
            SlotEntry::Occupied(slot) => match &mut slot.state.pending {
                Some(pending) => Decision::Coalesced {
                    cell: wants_cell.then(|| pending.cell()),
                    stale: Some(std::mem::replace(
                        pending
                            .job
                            .get_mut()
                            .unwrap_or_else(PoisonError::into_inner),
                        job,
                    )),
                },
                None => {
                    let mut pending = Pending::new(job, Vec::new());
                    let cell = wants_cell.then(|| pending.cell());
                    slot.state.pending = Some(pending);
                    // Counted under the lock, before anyone can take it.
                    self.gauges.pending.fetch_add(1, Ordering::Relaxed);
                    Decision::Coalesced { cell, stale: None }
                }
            },
            SlotEntry::Vacant(vacant) => {
                let state = KeyState {
                    running: true,
                    until: Instant::now(),
                    pending: None,
                };
                match vacant.insert(state) {
                    Ok(slot) => Decision::Lead(slot.generation(), job),
                    Err(full) => Decision::Refused(
                        Error::TooManyKeys {
                            key: shown(key),
                            cap: full.cap,
                        },
                        job,
                    ),
                }
            }
        });
        match decision {
            Decision::Refused(error, job) => {
                drop(job);
                Err(error)
            }
            Decision::Coalesced { cell, stale } => {
                // The replaced closure may run user code when dropped: never
                // under the shard lock.
                drop(stale);
                tracing::trace!(throttle = %self.name, key, "call coalesced");
                Ok(Submitted::Coalesced(cell))
            }
            Decision::Lead(generation, job) => {
                let (tx, rx) = oneshot::channel();
                let driver = super::process::Driver::new(self.clone(), key, generation, job, tx);
                core.start_process(key, driver.drive())?;
                Ok(Submitted::Lead(rx))
            }
        }
    }

    /// The error for callers a process leaves behind when it exits early.
    pub(super) fn exit_error(&self, key: &str) -> Error {
        if self.mode() == DESTROYED {
            Error::Discarded {
                key: shown(key),
                reason: "destroyed",
            }
        } else if self.runtime.core.is_closed() {
            Error::Discarded {
                key: shown(key),
                reason: "dropped at shutdown",
            }
        } else {
            Error::process_lost(key)
        }
    }

    /// Sleeps until `until`, or until the mode moves on from `seen`.
    pub(super) async fn nap(&self, until: Instant, seen: u8) {
        let _timer = Armed::new(&self.gauges);
        let woken = self.wake.notified();
        tokio::pin!(woken);
        woken.as_mut().enable();
        if self.mode() != seen {
            return;
        }
        tokio::select! {
            () = tokio::time::sleep_until(until) => {}
            () = woken => {}
        }
    }

    /// Claims the key's window in the store (`SET … PX lease NX`).
    ///
    /// `Ok(())` to run now, including on a store error (fail open);
    /// `Err(wait)` when another instance holds the window.
    pub(super) async fn claim(&self, key: &str) -> Result<(), Duration> {
        if self.store_closed() {
            return Ok(());
        }
        let store_key = &*self.store_key(key);
        // A claim is a lease: its value is when it lapses unless extended.
        let value = self.epoch.at(Instant::now() + self.lease_ttl).to_string();
        let options = SetOptions::px(self.lease_ttl).nx();
        match self.store.set(store_key, &value, options).await {
            Ok(true) => Ok(()),
            Ok(false) => Err(self.retry_after(store_key).await),
            Err(error) => {
                tracing::debug!(throttle = %self.name, key = store_key, %error, "window store failed; running anyway");
                Ok(())
            }
        }
    }

    /// How long to wait after losing a window race: until just past the end
    /// the store reports (a window's end, or a lease's lapse), capped at the
    /// lease TTL; the window length if unreadable.
    async fn retry_after(&self, store_key: &str) -> Duration {
        let floor = Duration::from_millis(1);
        match self.store.get(store_key).await {
            Ok(Some(value)) => match value.trim().parse::<u64>() {
                Ok(end) => {
                    let now = self.epoch.at(Instant::now());
                    // One millisecond past the end: values are truncated to
                    // milliseconds and instances' clocks differ by as much.
                    Duration::from_millis(end.saturating_sub(now).saturating_add(1))
                        .min(self.lease_ttl)
                }
                Err(_) => self.window,
            },
            // The holder's window lapsed between our SET and GET.
            Ok(None) => floor,
            Err(error) => {
                tracing::debug!(throttle = %self.name, key = store_key, %error, "window store failed reading a lost window");
                self.window
            }
        }
    }

    /// Extends a running function's lease for as long as it runs.
    pub(super) async fn hold_lease(&self, key: &str) {
        let store_key = &*self.store_key(key);
        loop {
            {
                let _timer = Armed::new(&self.gauges);
                tokio::time::sleep(self.lease_every).await;
            }
            if self.store_closed() {
                continue;
            }
            let value = self.epoch.at(Instant::now() + self.lease_ttl).to_string();
            let options = SetOptions::px(self.lease_ttl);
            if let Err(error) = self.store.set(store_key, &value, options).await {
                tracing::debug!(throttle = %self.name, key = store_key, %error, "window store failed extending a lease");
            }
        }
    }

    /// Records the window that starts now that a run finished (`SET … PX`,
    /// replacing the run's lease) and returns when it ends in memory.
    ///
    /// The store's expiry is the window in whole milliseconds (rounded up),
    /// counted from the write; the in-memory window is counted from after
    /// the write returns, so it never ends before the store key expires and
    /// this instance's next claim is not refused by its own window. On a
    /// store that may be shared (one passed in), it ends a little later
    /// still ([`Shared::courtesy`]).
    pub(super) async fn write_window(&self, key: &str) -> Instant {
        if self.store_closed() {
            return Instant::now() + self.window;
        }
        let px = self.window_px();
        let value = self.epoch.at(Instant::now() + px).to_string();
        let store_key = self.store_key(key);
        match self.store.set(&store_key, &value, SetOptions::px(px)).await {
            Ok(_) => Instant::now() + px + self.courtesy(),
            Err(error) => {
                tracing::debug!(throttle = %self.name, key = store_key, %error, "window store failed recording a window");
                Instant::now() + self.window
            }
        }
    }

    /// How long after its window ends an instance re-claims a key on a
    /// store other instances may share: an instance that lost the race waits
    /// for the same end (1 ms past it, at millisecond precision) and so
    /// claims first, instead of losing every race to a holder that always
    /// has calls pending. Zero on the throttle's own store.
    fn courtesy(&self) -> Duration {
        if self.owns_store {
            Duration::ZERO
        } else {
            Duration::from_millis(5)
        }
    }

    /// The window in whole milliseconds, rounded up.
    fn window_px(&self) -> Duration {
        let ms = Duration::from_millis(u64::try_from(self.window.as_millis()).unwrap_or(u64::MAX));
        if ms < self.window {
            ms + Duration::from_millis(1)
        } else {
            ms
        }
    }

    /// Fails every call not yet run, wakes every process, clears an owned store.
    pub(super) async fn destroy(&self) {
        if self.mode.swap(DESTROYED, Ordering::AcqRel) == DESTROYED {
            return;
        }
        let mut dropped = Vec::new();
        self.registry.retain(|key, state| {
            if let Some(pending) = state.pending.take() {
                dropped.push((
                    String::from_utf8_lossy(key.as_bytes()).into_owned(),
                    pending,
                ));
            }
            true
        });
        self.gauges
            .pending
            .fetch_sub(dropped.len(), Ordering::Relaxed);
        for (key, pending) in dropped {
            let error = Error::Discarded {
                key: shown(&key),
                reason: "destroyed",
            };
            pending.fail(&error);
        }
        self.wake.notify_waiters();
        tracing::debug!(throttle = %self.name, "destroyed");
        if self.owns_store {
            if let Err(error) = self.store.clear().await {
                tracing::debug!(throttle = %self.name, %error, "window store failed to clear");
            }
        }
    }

    /// Refuses new calls, lets pending trailing runs run when their windows
    /// end, then destroys whatever is left at `deadline`.
    pub(super) async fn drain(&self, deadline: Instant) {
        let _ = self
            .mode
            .compare_exchange(OPEN, DRAINING, Ordering::AcqRel, Ordering::Acquire);
        self.wake.notify_waiters();
        loop {
            let idle = self.gauges.idle.notified();
            tokio::pin!(idle);
            idle.as_mut().enable();
            if self.gauges.live.load(Ordering::Acquire) == 0 {
                break;
            }
            if tokio::time::timeout_at(deadline, idle).await.is_err() {
                break;
            }
        }
        self.destroy().await;
    }
}

impl<T: Clone + Send + Sync + 'static> Service for Shared<T> {
    fn shutdown(&self, deadline: Instant, policy: ShutdownPolicy) -> ServiceFuture<'_> {
        Box::pin(async move {
            if policy == ShutdownPolicy::Flush {
                self.drain(deadline).await;
            } else {
                self.destroy().await;
            }
        })
    }
}
