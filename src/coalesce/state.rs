//! What a coalescing throttle shares between its callers and its per-key
//! processes: the registry of key slots, the store, the mode and the gauges.

use std::any::Any;
use std::cmp::Reverse;
use std::collections::BinaryHeap;
use std::future::Future;
use std::pin::Pin;
use std::sync::atomic::{AtomicBool, AtomicU8, AtomicU64, AtomicUsize, Ordering};
use std::sync::{Arc, Mutex, PoisonError};
use std::task::{Context, Poll};
use std::time::Duration;

use sync_wrapper::SyncWrapper;
use throttlebeam_supervisors::{Counters, Generation, Registry, RunHere, SlotEntry, Sweep};
use tokio::sync::{Notify, oneshot};
use tokio::time::Instant;

use super::Phase;
use super::store::{WindowClaim, WindowEntry, WindowStore, WindowStoreFuture};
use crate::cell::RunCell;
use crate::clock::{WindowClock, duration_ns};
use crate::error::Error;
use crate::error::check_key;
use crate::key::{InlineKey, shown, update_slot};
use crate::runtime::{Runtime, Service, ServiceFuture, ShutdownPolicy};
use crate::stats::{Counter, Gauge, STRIPES, stripe};
use crate::store::{Fault, guard};

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

/// A key whose next run waits for its window to end, in the sleeper.
pub(super) struct Wakeup {
    /// When it is due, in nanoseconds after the epoch clock's base: half
    /// the size of an `Instant`, and a heap may hold one per key.
    at: u64,
    pub(super) key: InlineKey,
    pub(super) generation: Generation,
    pub(super) epoch: u32,
}

// Ordered by when it is due only.
impl PartialEq for Wakeup {
    fn eq(&self, other: &Self) -> bool {
        self.at == other.at
    }
}

impl Eq for Wakeup {}

impl PartialOrd for Wakeup {
    fn partial_cmp(&self, other: &Self) -> Option<std::cmp::Ordering> {
        Some(self.cmp(other))
    }
}

impl Ord for Wakeup {
    fn cmp(&self, other: &Self) -> std::cmp::Ordering {
        self.at.cmp(&other.at)
    }
}

/// One timer for the keys of a throttle whose trailing run waits for its
/// window: a pending trailing run costs a heap entry, not a process.
#[derive(Default)]
struct Sleeper {
    heap: BinaryHeap<Reverse<Wakeup>>,
    /// The sleeper process is alive.
    running: bool,
}

/// A throttle has one sleeper per stripe of threads ([`stripe`]), each
/// with its own process while it holds wake-ups: callers on different
/// workers never share its lock or its heap, which would bounce their
/// cache lines between cores on every coalesced call.
#[repr(align(128))]
#[derive(Default)]
struct SleeperShard {
    sleeper: Mutex<Sleeper>,
    /// Wakes the shard's process for an earlier wake-up or a destroy.
    wake: Notify,
}

impl SleeperShard {
    fn lock(&self) -> std::sync::MutexGuard<'_, Sleeper> {
        self.sleeper.lock().unwrap_or_else(PoisonError::into_inner)
    }
}

/// Holds a sleeper shard's `running` mark for its process. A process that
/// ends without handing the shard back itself (its tokio runtime ended, or
/// it never started) is dropped with wake-ups still in the heap: the guard
/// clears the mark and flags them as orphaned, so the next call or waiter
/// on a live runtime starts a sleeper there ([`Shared::adopt_orphans`]).
struct SleeperGuard<T: Clone + Send + Sync + 'static> {
    shared: Arc<Shared<T>>,
    index: usize,
    /// The process emptied its heap and cleared the mark itself.
    done: bool,
}

impl<T: Clone + Send + Sync + 'static> Drop for SleeperGuard<T> {
    fn drop(&mut self) {
        if self.done {
            return;
        }
        let shared = &self.shared;
        let left = {
            let mut sleeper = shared.sleepers[self.index].lock();
            sleeper.running = false;
            sleeper.heap.len()
        };
        if left > 0 {
            // Flagged after the shard is handed back, so an adopter that
            // sees the flag sees the shard free.
            shared.orphaned.store(true, Ordering::Release);
            shared.adopt.notify_waiters();
            tracing::debug!(throttle = %shared.name, shard = self.index, left, "sleeper ended with wake-ups pending; handed back");
        }
    }
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
    in_store: AtomicUsize,
    store_idle: Notify,
}

/// A counter on a cache line of its own: the gauges are written from every
/// worker, and a shared line would make each write evict its neighbours.
#[repr(align(64))]
pub(super) struct Padded<A>(A);

impl<A> std::ops::Deref for Padded<A> {
    type Target = A;
    fn deref(&self) -> &A {
        &self.0
    }
}

/// Counts a store call in flight while it lives.
struct InStore<'a>(&'a Gauges);

impl<'a> InStore<'a> {
    fn new(gauges: &'a Gauges) -> Self {
        gauges.in_store.fetch_add(1, Ordering::AcqRel);
        Self(gauges)
    }
}

impl Drop for InStore<'_> {
    fn drop(&mut self) {
        if self.0.in_store.fetch_sub(1, Ordering::AcqRel) == 1 {
            self.0.store_idle.notify_waiters();
        }
    }
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
    fn instant(&self, nanos: u64) -> Instant {
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
    clock: WindowClock,
    /// Owner tokens: random per throttle, distinct per claim.
    tokens: ahash::RandomState,
    next_token: AtomicU64,
    sleepers: Box<[SleeperShard]>,
    /// A sleeper's process ended (its runtime ended) with wake-ups left.
    orphaned: AtomicBool,
    /// Wakes waiters when that happens, so they adopt them.
    adopt: Notify,
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

/// What a store call came to once bounded and guarded.
pub(super) enum StoreOutcome<R> {
    Done(R),
    /// Failed, panicked, timed out or abandoned: fail open.
    Failed,
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
    fn shared_store(&self) -> Option<&dyn WindowStore> {
        self.store.as_deref()
    }

    /// A fresh owner token for one claim: never 0.
    pub(super) fn token(&self) -> u64 {
        let n = self.next_token.fetch_add(1, Ordering::Relaxed);
        self.tokens.hash_one(n) | 1
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

    /// Hands a key whose next run waits for `at` to the sleeper of this
    /// thread's stripe (its slot is marked scheduled): one heap entry,
    /// counted as a timer until it fires.
    pub(super) fn schedule(
        self: &Arc<Self>,
        key: &str,
        generation: Generation,
        epoch: u32,
        at: Instant,
    ) {
        let index = stripe() % self.sleepers.len();
        let shard = &self.sleepers[index];
        let at = self.epoch.nanos(at);
        let (start, earlier) = {
            let mut sleeper = shard.lock();
            let earlier = sleeper.heap.peek().is_some_and(|top| at < top.0.at);
            sleeper.heap.push(Reverse(Wakeup {
                at,
                key: InlineKey::new(key),
                generation,
                epoch,
            }));
            let start = !sleeper.running;
            sleeper.running = true;
            (start, earlier)
        };
        if start {
            self.start_sleeper(index);
        } else if earlier {
            shard.wake.notify_one();
        }
    }

    /// Starts the process of sleeper shard `index` on the caller's tokio
    /// runtime; its shard was just marked running.
    fn start_sleeper(self: &Arc<Self>, index: usize) {
        let guard = SleeperGuard {
            shared: Arc::clone(self),
            index,
            done: false,
        };
        if self
            .runtime
            .core
            .start_process(&self.prefix, Self::sleep_loop(guard))
            .is_err()
        {
            // (The unpolled guard handed the shard back as it was dropped.)
            // No runtime to sleep on: fire now; the processes fail their
            // callers as they cannot start either.
            let shard = &self.sleepers[index];
            let due = {
                let mut sleeper = shard.lock();
                if sleeper.running {
                    // Another caller started a sleeper meanwhile.
                    return;
                }
                let due = std::mem::take(&mut sleeper.heap).into_vec();
                self.gauges.live.fetch_add(due.len(), Ordering::SeqCst);
                due
            };
            self.fire_all(due.into_iter().map(|Reverse(wakeup)| wakeup));
        }
    }

    /// Restarts, on the caller's tokio runtime, the sleepers whose own
    /// runtime ended while they held wake-ups. Costs one load while there
    /// are none; outside a tokio runtime it leaves them to the next caller.
    pub(super) fn adopt_orphans(self: &Arc<Self>) {
        if !self.orphaned.load(Ordering::Acquire)
            || tokio::runtime::Handle::try_current().is_err()
            || !self.orphaned.swap(false, Ordering::AcqRel)
        {
            return;
        }
        for (index, shard) in self.sleepers.iter().enumerate() {
            let start = {
                let mut sleeper = shard.lock();
                let start = !sleeper.running && !sleeper.heap.is_empty();
                sleeper.running |= start;
                start
            };
            if start {
                tracing::debug!(throttle = %self.name, shard = index, "sleeper restarted on this runtime");
                self.start_sleeper(index);
            }
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

    /// The process of the guard's sleeper shard: starts each scheduled key's
    /// process when its window ends; exits when nothing is scheduled.
    ///
    /// Due wake-ups leave the heap counted as live work (under the shard's
    /// lock, so a drain never sees them in neither place) until their
    /// processes have started.
    async fn sleep_loop(mut guard: SleeperGuard<T>) {
        let this = Arc::clone(&guard.shared);
        let index = guard.index;
        let shard = &this.sleepers[index];
        loop {
            let woken = shard.wake.notified();
            tokio::pin!(woken);
            woken.as_mut().enable();
            let now = this.epoch.nanos(Instant::now());
            let (due, next) = {
                let mut sleeper = shard.lock();
                let mut due = Vec::new();
                while sleeper.heap.peek().is_some_and(|top| top.0.at <= now) {
                    if let Some(Reverse(wakeup)) = sleeper.heap.pop() {
                        due.push(wakeup);
                    }
                }
                if !due.is_empty() {
                    this.gauges.live.fetch_add(due.len(), Ordering::SeqCst);
                }
                let next = sleeper.heap.peek().map(|top| top.0.at);
                if next.is_none() {
                    sleeper.running = false;
                    guard.done = true;
                }
                (due, next)
            };
            this.fire_all(due.into_iter());
            let Some(at) = next else { return };
            tokio::select! {
                () = tokio::time::sleep_until(this.epoch.instant(at)) => {}
                () = woken => {}
            }
        }
    }

    /// Fires wake-ups taken from a heap, which counted them as live work
    /// under its lock; uncounts them once their processes have started.
    fn fire_all(self: &Arc<Self>, due: impl ExactSizeIterator<Item = Wakeup>) {
        let n = due.len();
        for wakeup in due {
            self.fire(wakeup);
        }
        self.unlive(n);
    }

    /// Runs one store call through the store guard every seam uses
    /// ([`crate::store::guard`]: bounded by the store timeout, a panic while
    /// building or polling the call caught), abandoned at once when the
    /// throttle is destroyed (a shutdown's deadline). Every failure is
    /// counted and logged at debug level (a panic at warn): the caller
    /// fails open.
    pub(super) async fn store_call<'s, R>(
        &self,
        key: &str,
        what: &'static str,
        call: impl FnOnce() -> WindowStoreFuture<'s, R>,
    ) -> StoreOutcome<R> {
        if self.mode() == DESTROYED {
            return StoreOutcome::Failed;
        }
        // Boxed: the guard's timer stays out of every process's future.
        let mut call = Box::pin(guard(self.store_timeout, call));
        // An in-memory store answers on the first poll: no timer for it.
        let first = std::future::poll_fn(|cx| Poll::Ready(call.as_mut().poll(cx))).await;
        let out = match first {
            Poll::Ready(out) => Some(out),
            Poll::Pending => self.store_wait(call).await,
        };
        let gauges = &self.gauges;
        match out {
            Some(Ok(Ok(value))) => StoreOutcome::Done(value),
            Some(Ok(Err(error))) => {
                gauges.store_errors.fetch_add(1, Ordering::Relaxed);
                tracing::debug!(throttle = %self.name, key, what, %error, "window store failed");
                StoreOutcome::Failed
            }
            Some(Err(Fault::Panicked(panic))) => {
                gauges.store_errors.fetch_add(1, Ordering::Relaxed);
                tracing::warn!(throttle = %self.name, key, what, panic, "window store panicked; treated as a store failure");
                StoreOutcome::Failed
            }
            Some(Err(Fault::TimedOut(_))) => {
                gauges.store_timeouts.fetch_add(1, Ordering::Relaxed);
                tracing::debug!(throttle = %self.name, key, what, timeout = ?self.store_timeout, "window store failed: timed out");
                StoreOutcome::Failed
            }
            None => {
                tracing::debug!(throttle = %self.name, key, what, "window store call abandoned: destroyed");
                StoreOutcome::Failed
            }
        }
    }

    /// The rest of a guarded store call that did not answer at once; `None`
    /// if the throttle was destroyed first (the call is abandoned).
    async fn store_wait<F: Future + Unpin>(&self, call: F) -> Option<F::Output> {
        let _in_store = InStore::new(&self.gauges);
        let mut call = call;
        loop {
            let stopped = self.wake.notified();
            tokio::pin!(stopped);
            stopped.as_mut().enable();
            if self.mode() == DESTROYED {
                return None;
            }
            tokio::select! {
                biased;
                out = &mut call => return Some(out),
                () = stopped => {}
            }
        }
    }

    /// Claims the key's window in the store for `token`.
    ///
    /// `Ok(())` to run now, including on a store failure (fail open);
    /// `Err(wait)` when another owner holds the window.
    pub(super) async fn claim(&self, key: &str, token: u64) -> Result<(), Duration> {
        let Some(store) = self.shared_store() else {
            // The registry's slot is the claim.
            return Ok(());
        };
        let store_key = &*self.store_key(key);
        // A claim is a lease: it lapses at its end unless extended.
        let entry = WindowEntry::new(self.epoch.at(Instant::now() + self.lease_ttl), token);
        let claim = || store.claim(store_key, entry, self.lease_ttl);
        match self.store_call(store_key, "claim", claim).await {
            StoreOutcome::Done(WindowClaim::Lost { holder }) => Err(self.retry_after(holder)),
            StoreOutcome::Done(_) | StoreOutcome::Failed => Ok(()),
        }
    }

    /// How long to wait after losing a window race: until just past the end
    /// the holder reported (a window's end, or a lease's lapse), capped at
    /// the lease TTL; the window length if unreadable.
    fn retry_after(&self, holder: Option<WindowEntry>) -> Duration {
        match holder {
            Some(entry) => {
                let now = self.epoch.at(Instant::now());
                // One millisecond past the end: values are truncated to
                // milliseconds and instances' clocks differ by as much.
                Duration::from_millis(entry.end_ms.saturating_sub(now).saturating_add(1))
                    .min(self.lease_ttl)
            }
            None => self.window,
        }
    }

    /// Extends a running function's lease for as long as it runs, and only
    /// while it still holds it.
    pub(super) async fn hold_lease(&self, key: &str, token: u64) {
        let Some(store) = self.shared_store() else {
            // Nothing to extend: the registry's slot stays busy while it runs.
            return std::future::pending().await;
        };
        let store_key = &*self.store_key(key);
        loop {
            {
                let _timer = Armed::new(&self.gauges);
                tokio::time::sleep(self.lease_every).await;
            }
            let entry = WindowEntry::new(self.epoch.at(Instant::now() + self.lease_ttl), token);
            let extend = || store.extend(store_key, entry, self.lease_ttl);
            if let StoreOutcome::Done(false) = self.store_call(store_key, "extend", extend).await {
                tracing::debug!(throttle = %self.name, key = store_key, "lease taken over by another owner; no longer extended");
                std::future::pending::<()>().await;
            }
        }
    }

    /// Records the window that starts now that a run finished (replacing the
    /// run's lease, if still ours) and returns when it ends in memory.
    ///
    /// The store's expiry is the window in whole milliseconds (rounded up),
    /// counted from the write; the in-memory window is counted from after
    /// the write returns, so it never ends before the store key expires and
    /// this instance's next claim is not refused by its own window. On a
    /// store that may be shared (one passed in), it ends a little later
    /// still ([`Shared::courtesy`]).
    pub(super) async fn write_window(&self, key: &str, token: u64) -> Instant {
        let Some(store) = self.shared_store() else {
            return self.window_end();
        };
        let px = self.window_px();
        let entry = WindowEntry::new(self.epoch.at(Instant::now() + px), token);
        let store_key = self.store_key(key);
        let record = || store.record(&store_key, entry, px);
        match self.store_call(&store_key, "record", record).await {
            StoreOutcome::Done(written) => {
                if !written {
                    tracing::debug!(throttle = %self.name, key = store_key, "window held by another owner; kept in memory only");
                }
                Instant::now() + px + self.courtesy()
            }
            StoreOutcome::Failed => Instant::now() + self.window,
        }
    }

    /// The end of a window that starts now, kept in memory only.
    pub(super) fn window_end(&self) -> Instant {
        self.clock.now() + self.window
    }

    /// How long after its window ends an instance re-claims a key on a
    /// store other instances may share: an instance that lost the race waits
    /// for the same end (1 ms past it, at millisecond precision) and so
    /// claims first, instead of losing every race to a holder that always
    /// has calls pending. Only called with a store.
    fn courtesy(&self) -> Duration {
        Duration::from_millis(5)
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
        stats.trailing.add(&self.snapshot_with(wakeups));
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
