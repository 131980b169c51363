//! What a coalescing throttle shares between its callers and its per-key
//! processes: the registry of key slots, the store, the mode and the gauges.

use std::any::Any;
use std::future::Future;
use std::pin::Pin;
use std::sync::Arc;
use std::sync::atomic::{AtomicBool, AtomicU8, AtomicU64, AtomicUsize, Ordering};
use std::task::{Context, Poll};
use std::time::Duration;

use sync_wrapper::SyncWrapper;
use throttlebeam_supervisors::{Counters, Generation, Registry, RunHere, SlotEntry, Sweep};
use tokio::sync::{Notify, oneshot};
use tokio::time::Instant;

use super::Phase;
use super::sleeper::SleeperShard;
use super::store::WindowStore;
use crate::cell::RunCell;
use crate::clock::{WindowClock, duration_ns};
use crate::error::Error;
use crate::error::check_key;
use crate::key::{InlineKey, shown, update_slot};
use crate::runtime::{Runtime, Service, ServiceFuture, ShutdownPolicy};
use crate::stats::{Counter, Gauge};
use crate::stripe::{Padded, STRIPES};

/// A user function, boxed so the latest one can replace an older one.
pub(super) type Job<T> = Box<dyn BoxedFn<T>>;
pub(super) type JobFuture<T> = Pin<Box<dyn Future<Output = Result<T, UserError>> + Send>>;
pub(super) type UserError = Box<dyn std::error::Error + Send + Sync + 'static>;

/// A user function as a call passes it in: boxed only when it has to wait
/// in a slot (a trailing run, or a leading run claiming its window), run
/// unboxed when it starts as its call is taken.
pub(super) trait UserFn<T>: Send + 'static {
    /// The function, boxed to wait in a slot.
    fn boxed(self) -> Job<T>;
    /// Calls the function.
    fn start(self, phase: Phase) -> impl Future<Output = Result<T, UserError>> + Send + 'static;
}

impl<T, F, Fut, E> UserFn<T> for F
where
    F: FnOnce(Phase) -> Fut + Send + 'static,
    Fut: Future<Output = Result<T, E>> + Send + 'static,
    E: Into<UserError>,
{
    fn boxed(self) -> Job<T> {
        Box::new(Boxed(self))
    }

    fn start(self, phase: Phase) -> impl Future<Output = Result<T, UserError>> + Send + 'static {
        let run = self(phase);
        async move { run.await.map_err(Into::into) }
    }
}

/// A boxed user function: called once, or overwritten in place by a newer
/// function of the same type (the same call site), so coalescing a call
/// into a pending run allocates nothing.
pub(super) trait BoxedFn<T>: Send {
    fn call(self: Box<Self>, phase: Phase) -> JobFuture<T>;
    fn as_any(&mut self) -> &mut dyn Any;
}

struct Boxed<F>(F);

impl<T, F: UserFn<T>> BoxedFn<T> for Boxed<F> {
    fn call(self: Box<Self>, phase: Phase) -> JobFuture<T> {
        Box::pin(self.0.start(phase))
    }

    fn as_any(&mut self) -> &mut dyn Any {
        self
    }
}

/// The function a coalesced call replaced, dropped once the shard lock is
/// released (dropping it may run user code).
pub(super) enum Stale<T, J> {
    /// Of the same type, overwritten in place.
    Same(J),
    /// Of another type, with its box.
    Boxed(Job<T>),
}

/// What the process tells a leading caller.
pub(super) enum Led<T> {
    /// Its own run finished with this result.
    Ran(Result<T, Error>),
    /// Another instance holds the window: the call was coalesced into the
    /// trailing run behind this cell.
    Coalesced(Arc<RunCell<T>>),
}

/// How a call was taken.
pub(super) enum Submitted<T: Send + 'static> {
    /// It leads, its run started as it was taken (no store to claim the
    /// window in): awaiting this drives the run and resolves with its
    /// result.
    Started(RunHere<Result<T, Error>>),
    /// It leads: awaiting this drives its run (a claim first) and tells
    /// the outcome.
    Lead(Leading<T>),
    /// It was coalesced; the cell is there if the caller wants to wait.
    Coalesced(Option<Arc<RunCell<T>>>),
}

/// A leading call's run, driven in the caller's task (counted as the key's
/// process) until the process tells the caller its outcome. What the
/// process still has to do then (write the window to a store, retry a lost
/// race), and everything if the caller leaves first, goes on in a process
/// of its own: dropping the caller's future never cancels the run.
pub(super) struct Leading<T> {
    pub(super) told: oneshot::Receiver<Led<T>>,
    pub(super) run: Option<RunHere<()>>,
}

impl<T> Future for Leading<T> {
    type Output = Result<Led<T>, oneshot::error::RecvError>;

    fn poll(mut self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<Self::Output> {
        let this = &mut *self;
        if let Some(run) = &mut this.run
            && Pin::new(run).poll(cx).is_ready()
        {
            this.run = None;
        }
        let told = std::task::ready!(Pin::new(&mut this.told).poll(cx));
        // Dropping an unfinished run moves its rest into a process.
        this.run = None;
        Poll::Ready(told)
    }
}

/// The next run of a key, not started yet: the calls it covers.
///
/// While the leading run claims its window, it sits here too, so a call
/// arriving before the function starts is covered by that run.
pub(super) struct Pending<T> {
    /// The latest function, wrapped to make the slot `Sync`: it is only
    /// ever reached through `&mut` or by value.
    job: SyncWrapper<Job<T>>,
    /// Who waits, boxed to keep every slot small: most runs have nobody
    /// (plain coalesced calls wait for nothing). The leading caller while
    /// this is a leading run (none for a trailing run, counted in the
    /// `pending` gauge), and one cell for every caller covered that waits.
    waiters: Option<Box<Waiters<T>>>,
}

/// Who waits for a run once it has started.
pub(super) struct Waiters<T> {
    pub(super) lead: Option<oneshot::Sender<Led<T>>>,
    pub(super) cell: Option<Arc<RunCell<T>>>,
}

impl<T> Waiters<T> {
    fn none() -> Self {
        Self {
            lead: None,
            cell: None,
        }
    }
}

impl<T: Clone> Waiters<T> {
    /// Whether anyone is still there to hear the run's outcome: the leading
    /// caller, or a caller waiting on the cell.
    pub(super) fn heard(&self) -> bool {
        self.lead.as_ref().is_some_and(|tx| !tx.is_closed())
            || self
                .cell
                .as_ref()
                .is_some_and(|cell| Arc::strong_count(cell) > 1)
    }

    pub(super) fn publish(self, result: Result<T, Error>) {
        if let Some(cell) = self.cell {
            cell.set(result.clone());
        }
        if let Some(tx) = self.lead {
            let _ = tx.send(Led::Ran(result));
        }
    }
}

impl<T: Clone> Pending<T> {
    fn new(job: Job<T>, lead: Option<oneshot::Sender<Led<T>>>) -> Self {
        Self {
            job: SyncWrapper::new(job),
            waiters: lead.map(|lead| {
                Box::new(Waiters {
                    lead: Some(lead),
                    cell: None,
                })
            }),
        }
    }

    fn waiters(&mut self) -> &mut Waiters<T> {
        self.waiters
            .get_or_insert_with(|| Box::new(Waiters::none()))
    }

    /// Makes `job` the run's function, returning the one it replaces.
    fn replace<J: UserFn<T>>(&mut self, job: J) -> Stale<T, J> {
        let current = self.job.get_mut();
        match current.as_any().downcast_mut::<Boxed<J>>() {
            Some(same) => Stale::Same(std::mem::replace(&mut same.0, job)),
            None => Stale::Boxed(std::mem::replace(current, job.boxed())),
        }
    }

    /// The cell a new waiter waits on, made on first need.
    fn cell(&mut self) -> Arc<RunCell<T>> {
        self.waiters().cell.get_or_insert_with(RunCell::new).clone()
    }

    /// Whether this is a trailing run (counted in the `pending` gauge).
    pub(super) fn is_trailing(&self) -> bool {
        self.waiters.as_ref().is_none_or(|w| w.lead.is_none())
    }

    /// A leading run that lost its window race becomes a trailing run: the
    /// leading caller is told it was coalesced. Returns whether it was
    /// leading.
    pub(super) fn demote(&mut self) -> bool {
        let Some(tx) = self.waiters.as_mut().and_then(|w| w.lead.take()) else {
            return false;
        };
        let _ = tx.send(Led::Coalesced(self.cell()));
        true
    }

    pub(super) fn start(self) -> (Job<T>, Waiters<T>) {
        let Self { job, waiters } = self;
        let job = job.into_inner();
        (job, waiters.map_or_else(Waiters::none, |w| *w))
    }

    /// Fails every caller waiting here; the function is dropped.
    pub(super) fn fail(self, error: &Error) {
        let (job, waiters) = self.start();
        drop(job);
        waiters.publish(Err(error.clone()));
    }
}

/// A key's slot in the registry: 48 bytes, the next run inline (its
/// function boxed) when one is waiting. With nothing pending and no run in
/// progress, it is a timestamp with no process.
pub(super) struct KeyState<T> {
    /// When the window ends (or the next claim retry), once a run is over.
    pub(super) until: Instant,
    /// The next run, not started yet.
    pub(super) next: Option<Pending<T>>,
    /// Which process owns the key (bumped on every start), so an exiting
    /// process never touches its successor's slot.
    pub(super) epoch: u32,
    /// A process owns the key: claiming or running.
    pub(super) busy: bool,
    /// No process: the throttle's sleeper starts one for the next run when
    /// the window ends.
    pub(super) scheduled: bool,
}

pub(super) const OPEN: u8 = 0;
pub(super) const DRAINING: u8 = 1;
pub(super) const DESTROYED: u8 = 2;

/// Live figures and counters of one throttle, plus the runtime's counters.
///
/// Figures moved on every call are striped per thread ([`Gauge`],
/// [`Counter`]): two workers bumping one shared line would bounce it
/// between their cores on every call. `live` stays one atomic: its last
/// decrement must see zero.
pub(super) struct Gauges {
    pub(super) active: Gauge,
    pub(super) pending: Gauge,
    pub(super) timers: Gauge,
    pub(super) live: Padded<AtomicUsize>,
    pub(super) idle: Notify,
    pub(super) runtime: Arc<Counters>,
    /// Calls that led (accepted calls are these plus the coalesced ones).
    pub(super) leads: Counter,
    pub(super) coalesced: Counter,
    pub(super) leading_runs: Counter,
    pub(super) trailing_runs: Counter,
    pub(super) store_errors: AtomicU64,
    pub(super) store_timeouts: AtomicU64,
    /// Runs that failed with nobody left to hear it.
    pub(super) unobserved_failures: Counter,
    /// Store calls in flight that a destroy abandons, and who waits for them.
    pub(super) in_store: AtomicUsize,
    pub(super) store_idle: Notify,
}

/// A timer counted in the throttle's and the runtime's gauges while it lives.
pub(super) struct Armed<'a>(&'a Gauges);

impl<'a> Armed<'a> {
    pub(super) fn new(gauges: &'a Gauges) -> Self {
        gauges.timers.add(1);
        gauges.runtime.timer_armed();
        Self(gauges)
    }
}

impl Drop for Armed<'_> {
    fn drop(&mut self) {
        self.0.timers.sub(1);
        self.0.runtime.timer_disarmed();
    }
}

/// Epoch milliseconds read from tokio's clock: one wall-clock reading at
/// start, then monotonic (and paused along with tokio's time in tests).
pub(super) struct EpochClock {
    base_ms: u64,
    pub(super) base: Instant,
}

impl EpochClock {
    fn new() -> Self {
        let base_ms = crate::clock::duration_ms(crate::clock::since_epoch());
        Self {
            base_ms,
            base: Instant::now(),
        }
    }

    /// `instant` in nanoseconds after the base (0 before it).
    pub(super) fn nanos(&self, instant: Instant) -> u64 {
        duration_ns(instant.saturating_duration_since(self.base))
    }

    /// The instant `nanos` after the base.
    pub(super) fn instant(&self, nanos: u64) -> Instant {
        self.base + Duration::from_nanos(nanos)
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
    /// The store other instances share, if any: `None` keeps the windows
    /// in the registry only.
    pub(super) store: Option<Box<dyn WindowStore>>,
    pub(super) store_timeout: Duration,
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
    /// The store passed in, which other throttles or instances may share.
    /// Without one the registry is the only record of a window: a store
    /// private to this throttle would hold the same windows again, and
    /// nobody else could read them.
    pub(super) store: Option<Box<dyn WindowStore>>,
    pub(super) store_timeout: Duration,
    pub(super) registry: Registry<InlineKey, KeyState<T>>,
    mode: AtomicU8,
    /// Wakes processes sleeping through a window, and abandons store calls
    /// in flight, when the mode changes.
    pub(super) wake: Notify,
    pub(super) gauges: Gauges,
    pub(super) epoch: EpochClock,
    /// Where window ends are read on the hot path: tokio's clock, through
    /// the timestamp counter unless it is paused (as the leading-edge
    /// throttle's windows). Timers and store entries stay on tokio's clock;
    /// the two differ by parts per million.
    pub(super) clock: WindowClock,
    /// Owner tokens: random per throttle, distinct per claim.
    tokens: ahash::RandomState,
    next_token: AtomicU64,
    pub(super) sleepers: Box<[SleeperShard]>,
    /// A sleeper's process ended (its runtime ended) with wake-ups left.
    pub(super) orphaned: AtomicBool,
    /// Wakes waiters when that happens, so they adopt them.
    pub(super) adopt: Notify,
}

pub(super) enum Decision<T, J> {
    /// Leads; with no store the run starts now (the slot is the claim), so
    /// its function comes straight back rather than through the slot.
    Start(Generation, u32, J),
    Lead(Generation, u32, oneshot::Receiver<Led<T>>),
    /// Coalesced into a window with no process: the sleeper starts one
    /// when the window ends.
    Schedule(Generation, u32, Instant, Option<Arc<RunCell<T>>>),
    Coalesced {
        cell: Option<Arc<RunCell<T>>>,
        stale: Option<Stale<T, J>>,
    },
    /// Not accepted; the function comes back out to be dropped unlocked.
    Refused(Error, J),
}

impl<T: Clone + Send + Sync + 'static> Shared<T> {
    pub(super) fn new(config: Config) -> Arc<Self> {
        let core = &config.runtime.core;
        let lease_every = (config.window / 2).max(Duration::from_millis(100));
        let sweeper = core.tree.sweeper().clone();
        let shared = Arc::new(Self {
            registry: Registry::with_sweeper(core.counters.clone(), core.cap, &sweeper),
            gauges: Gauges {
                active: Gauge::default(),
                pending: Gauge::default(),
                timers: Gauge::default(),
                live: Padded(AtomicUsize::new(0)),
                idle: Notify::new(),
                runtime: core.counters.clone(),
                leads: Counter::default(),
                coalesced: Counter::default(),
                leading_runs: Counter::default(),
                trailing_runs: Counter::default(),
                store_errors: AtomicU64::new(0),
                store_timeouts: AtomicU64::new(0),
                unobserved_failures: Counter::default(),
                in_store: AtomicUsize::new(0),
                store_idle: Notify::new(),
            },
            lease_every,
            lease_ttl: config.window.max(lease_every * 2),
            mode: AtomicU8::new(OPEN),
            wake: Notify::new(),
            epoch: EpochClock::new(),
            clock: WindowClock::new(core.clock),
            tokens: ahash::RandomState::new(),
            next_token: AtomicU64::new(1),
            sleepers: (0..STRIPES).map(|_| SleeperShard::default()).collect(),
            orphaned: AtomicBool::new(false),
            adopt: Notify::new(),
            runtime: config.runtime,
            name: config.name,
            prefix: config.prefix,
            window: config.window,
            store: config.store,
            store_timeout: config.store_timeout,
        });
        let service: std::sync::Weak<dyn Service> = Arc::downgrade(&shared) as _;
        shared.runtime.core.attach(service);
        let target: std::sync::Weak<dyn Sweep> = Arc::downgrade(&shared) as _;
        sweeper.register(target);
        shared
    }

    pub(super) fn mode(&self) -> u8 {
        self.mode.load(Ordering::Acquire)
    }

    /// The store to call, if the throttle has one.
    pub(super) fn shared_store(&self) -> Option<&dyn WindowStore> {
        self.store.as_deref()
    }

    /// A fresh owner token for one claim: never 0.
    pub(super) fn token(&self) -> u64 {
        let n = self.next_token.fetch_add(1, Ordering::Relaxed);
        self.tokens.hash_one(n) | 1
    }

    /// The key as the store sees it: prefix + key. Built per store command
    /// rather than kept, so an idle window costs less.
    pub(super) fn store_key(&self, key: &str) -> String {
        let mut store_key = String::with_capacity(self.prefix.len() + key.len());
        store_key.push_str(&self.prefix);
        store_key.push_str(key);
        store_key
    }

    fn refused(&self, key: &str) -> Error {
        Error::ShutDown { key: shown(key) }
    }

    /// Takes a call: leads on an idle key (starting its process), otherwise
    /// coalesces into the key's next run, starting a process only when the
    /// key has none and the run needs a timer. Never waits.
    pub(super) fn submit<J: UserFn<T>>(
        self: &Arc<Self>,
        key: &str,
        job: J,
        wants_cell: bool,
    ) -> Result<Submitted<T>, Error> {
        check_key(key)?;
        let core = &self.runtime.core;
        core.check_open(key)?;
        self.adopt_orphans();
        let mut job = job;
        let mut swept = false;
        let decision = loop {
            match self.decide(key, job, wants_cell) {
                // Full: windows that are over may be what fills it.
                Decision::Refused(Error::TooManyKeys { .. }, back)
                    if !swept && self.sweep_when_full() =>
                {
                    swept = true;
                    job = back;
                }
                decision => break decision,
            }
        };
        self.settle(key, decision)
    }

    /// Forgets windows that are over when the key cap refused a key
    /// ([`Registry::retain_when_full`], paced). Returns whether it ran.
    fn sweep_when_full(&self) -> bool {
        let now = Instant::now();
        self.registry
            .retain_when_full(|_, state| state.busy || state.scheduled || state.until > now)
    }

    /// A leading run for a slot whose `next` is empty. With a store, it
    /// waits in the slot while its window is claimed, so calls arriving
    /// meanwhile are covered by it. Without one nothing is claimed: the run
    /// starts now, as the call is taken.
    fn lead<J: UserFn<T>>(
        &self,
        next: &mut Option<Pending<T>>,
        generation: Generation,
        epoch: u32,
        job: J,
    ) -> Decision<T, J> {
        if self.store.is_none() {
            return Decision::Start(generation, epoch, job);
        }
        let (tx, rx) = oneshot::channel();
        *next = Some(Pending::new(job.boxed(), Some(tx)));
        Decision::Lead(generation, epoch, rx)
    }

    fn decide<J: UserFn<T>>(&self, key: &str, job: J, wants_cell: bool) -> Decision<T, J> {
        let gauges = &self.gauges;
        // The mode is read under the shard lock, so `destroy` (mode first,
        // then a pass over every shard) never misses a pending call.
        update_slot(&self.registry, key, |entry| match entry {
            _ if self.mode() != OPEN => Decision::Refused(self.refused(key), job),
            SlotEntry::Occupied(slot) => {
                let generation = slot.generation();
                let state = &mut slot.state;
                if let Some(next) = &mut state.next {
                    // Not started yet (leading or trailing): it covers this call.
                    return Decision::Coalesced {
                        cell: wants_cell.then(|| next.cell()),
                        stale: Some(next.replace(job)),
                    };
                }
                if !state.busy && self.clock.now() >= state.until {
                    // A window that is over: lead again in the same slot.
                    state.busy = true;
                    state.epoch = state.epoch.wrapping_add(1);
                    return self.lead(&mut state.next, generation, state.epoch, job);
                }
                let mut next = Pending::new(job.boxed(), None);
                let cell = wants_cell.then(|| next.cell());
                state.next = Some(next);
                // Counted under the lock, before anyone can take it.
                gauges.pending.add(1);
                if state.busy {
                    Decision::Coalesced { cell, stale: None }
                } else {
                    // An open window with no process: the sleeper starts one
                    // when it ends.
                    state.scheduled = true;
                    state.epoch = state.epoch.wrapping_add(1);
                    Decision::Schedule(generation, state.epoch, state.until, cell)
                }
            }
            SlotEntry::Vacant(vacant) => {
                let state = KeyState {
                    // Set when the run ends; nothing reads it while busy.
                    until: self.epoch.base,
                    next: None,
                    epoch: 0,
                    busy: true,
                    scheduled: false,
                };
                match vacant.insert(state) {
                    Ok(mut slot) => {
                        let generation = slot.generation();
                        self.lead(&mut slot.state.next, generation, 0, job)
                    }
                    Err(full) => Decision::Refused(
                        Error::TooManyKeys {
                            key: shown(key),
                            cap: full.cap,
                        },
                        job,
                    ),
                }
            }
        })
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

    /// Sleeps until `until`, or until the mode moves on from `seen` (a
    /// process retrying a lost window race keeps its own timer).
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

    /// Waits for `cell`, adopting wake-ups whose sleeper's runtime ended
    /// meanwhile: a waiter on a live runtime drives the run it waits for.
    pub(super) async fn wait_cell(self: &Arc<Self>, cell: &RunCell<T>) -> Result<T, Error> {
        loop {
            let orphaned = self.adopt.notified();
            tokio::pin!(orphaned);
            orphaned.as_mut().enable();
            self.adopt_orphans();
            tokio::select! {
                result = cell.wait() => return result,
                () = orphaned => {}
            }
        }
    }

    /// Uncounts `n` live processes; the last one out wakes a drain. While
    /// the throttle is open nobody waits, so there is nothing to wake:
    /// `drain` moves the mode on before it reads the count, and both sides
    /// are sequentially consistent, so one of them sees the other.
    pub(super) fn unlive(&self, n: usize) {
        if n > 0
            && self.gauges.live.fetch_sub(n, Ordering::SeqCst) == n
            && self.mode.load(Ordering::SeqCst) != OPEN
        {
            self.gauges.idle.notify_waiters();
        }
    }

    /// Keys with a run in progress or pending, or inside a window: what is
    /// left once windows that are over (kept until the runtime's sweep, or
    /// until the key's next call) are set aside. Visits every slot.
    pub(super) fn live_keys(&self) -> usize {
        let now = self.clock.now();
        self.registry
            .count(|s| s.busy || s.scheduled || s.next.is_some() || s.until > now)
    }

    /// Wake-ups held by the sleepers: keys whose trailing run waits for its
    /// window with no process.
    pub(super) fn wakeups(&self) -> usize {
        self.sleepers.iter().map(|s| s.lock().heap.len()).sum()
    }

    /// Fails every call not yet run, forgets idle windows, wakes every
    /// process (abandoning store calls in flight).
    pub(super) async fn destroy(&self) {
        if self.mode.swap(DESTROYED, Ordering::AcqRel) == DESTROYED {
            return;
        }
        let mut dropped = Vec::new();
        let mut trailing = 0;
        self.registry.retain(|key, state| {
            if let Some(next) = state.next.take() {
                trailing += usize::from(next.is_trailing());
                dropped.push((String::from_utf8_lossy(key.as_bytes()).into_owned(), next));
            }
            // A slot with a process is removed by that process.
            state.busy
        });
        for shard in &self.sleepers {
            drop(std::mem::take(&mut shard.lock().heap));
            shard.wake.notify_one();
        }
        self.registry.shrink_to_fit();
        self.gauges.pending.sub(trailing);
        for (key, next) in dropped {
            let error = Error::Discarded {
                key: shown(&key),
                reason: "destroyed",
            };
            next.fail(&error);
        }
        self.wake.notify_waiters();
        tracing::debug!(throttle = %self.name, "destroyed");
        // Store calls in flight were abandoned: let them unwind, so their
        // processes are gone when a shutdown's deadline is checked.
        loop {
            let idle = self.gauges.store_idle.notified();
            tokio::pin!(idle);
            idle.as_mut().enable();
            if self.gauges.in_store.load(Ordering::Acquire) == 0 {
                break;
            }
            idle.await;
        }
    }

    /// Refuses new calls, lets pending trailing runs run when their windows
    /// end, then destroys whatever is left at `deadline`.
    pub(super) async fn drain(&self, deadline: Instant) {
        let _ = self
            .mode
            .compare_exchange(OPEN, DRAINING, Ordering::SeqCst, Ordering::SeqCst);
        self.wake.notify_waiters();
        loop {
            let idle = self.gauges.idle.notified();
            tokio::pin!(idle);
            idle.as_mut().enable();
            // Wake-ups first: one that fires moves into `live` before it
            // leaves its heap.
            if self.wakeups() == 0 && self.gauges.live.load(Ordering::SeqCst) == 0 {
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

    fn stats(&self, stats: &mut crate::stats::Stats) {
        // The sleepers' wake-ups are timers the runtime does not count.
        let wakeups = self.wakeups();
        stats.timers += wakeups;
        let held = self.registry.len();
        let snapshot = self.snapshot_with(wakeups);
        // Windows that are over stay in the registry until the sweep or their key's next
        // call: counted neither in the throttle's keys nor in the runtime's (W9).
        stats.keys = stats
            .keys
            .saturating_sub(held.saturating_sub(snapshot.keys));
        stats.coalesce.add(&snapshot);
    }
}

/// The runtime's sweeper reaches the throttle's maps: windows that are over
/// and have no process are forgotten, retained capacity is given back, and
/// the store sweeps its own expired keys.
impl<T: Clone + Send + Sync + 'static> Sweep for Shared<T> {
    fn sweep(&self, now: Instant) -> usize {
        let before = self.registry.len();
        let left = self
            .registry
            .retain(|_, state| state.busy || state.scheduled || state.until > now);
        if left < before {
            self.registry.shrink_to_fit();
        }
        left + self.shared_store().map_or(0, WindowStore::sweep)
    }
}

#[cfg(all(test, target_pointer_width = "64"))]
mod tests {
    use super::KeyState;

    /// The size the slot's documentation states, and idle windows pay.
    #[test]
    fn a_slot_is_48_bytes() {
        assert_eq!(std::mem::size_of::<KeyState<u64>>(), 48);
    }
}
