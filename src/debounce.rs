//! Debounce: run once a key has been quiet for a delay.
//!
//! In one process by default ([`DebounceHandle::call`]); across every
//! instance sharing the runtime's Redis with [`DebounceHandle::across_instances`]
//! (see `debounce/shared.rs` for the protocol).

mod debounced;
mod global;
mod process;
#[cfg(feature = "redis")]
pub(crate) mod redis;
#[cfg(feature = "redis")]
mod seam;
#[cfg(feature = "redis")]
mod shared;

pub use self::debounced::Debounced;
pub use self::global::Debounce;
use self::process::Driver;
pub use crate::stats::DebounceStats;

use std::any::{Any, TypeId};
use std::future::Future;
use std::marker::PhantomData;
use std::pin::Pin;
use std::sync::Arc;
#[cfg(feature = "redis")]
use std::sync::OnceLock;
use std::sync::atomic::{AtomicU8, AtomicU64, Ordering};
use std::time::Duration;

use serde::Serialize;
use serde::de::DeserializeOwned;
use sync_wrapper::SyncWrapper;
use throttlebeam_supervisors::{
    Counters, Generation, Registry, SlotEntry, Sweep, TimerGuard, catch_panic,
};
use tokio::sync::Notify;
use tokio::time::Instant;

use crate::cell::RunCell;
use crate::error::Error;
use crate::error::{check_key, check_timer};
use crate::job::Job;
use crate::key::{InlineKey, shown, update_slot};
use crate::runtime::{Core, Runtime, Service, ServiceFuture, ShutdownPolicy};
use crate::stats::{Counter, Stats};

type Value = Arc<dyn Any + Send + Sync>;
type BoxFuture = Pin<Box<dyn Future<Output = Result<Value, Error>> + Send>>;
type BoxedJob = Box<dyn FnOnce(Arc<str>) -> BoxFuture + Send>;
type Cell = Arc<Burst>;

/// One burst of calls: the key and the result of the run covering them.
struct Burst {
    key: Arc<str>,
    result: RunCell<Value>,
}

impl Burst {
    fn new(key: &Arc<str>) -> Arc<Self> {
        Arc::new(Self {
            key: Arc::clone(key),
            result: RunCell::default(),
        })
    }

    fn set(&self, result: Result<Value, Error>) -> bool {
        self.result.set(result)
    }

    fn discard(&self, reason: &'static str) -> bool {
        self.set(Err(Error::Discarded {
            key: shown(&self.key),
            reason,
        }))
    }
}

/// Options of a debounced call beyond its delay.
///
/// # Examples
///
/// ```
/// use std::time::Duration;
/// use throttlebeam::DebounceOptions;
///
/// let options = DebounceOptions::new()
///     .with_max_wait(Duration::from_millis(500))
///     .with_leading(true);
/// assert_eq!(options.max_wait(), Some(Duration::from_millis(500)));
/// ```
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
#[must_use]
pub struct DebounceOptions {
    max_wait: Option<Duration>,
    leading: bool,
}

impl DebounceOptions {
    /// Trailing edge only, no maximum wait.
    pub fn new() -> Self {
        Self::default()
    }

    /// Runs at most `max_wait` after the first call of a burst, and then at
    /// most every `max_wait` while calls keep coming.
    pub fn with_max_wait(mut self, max_wait: Duration) -> Self {
        self.max_wait = Some(max_wait);
        self
    }

    /// Also runs on the leading edge: the first call of a burst runs now;
    /// later calls of the burst produce one trailing run.
    pub fn with_leading(mut self, leading: bool) -> Self {
        self.leading = leading;
        self
    }

    /// The maximum wait, if set.
    #[must_use]
    pub fn max_wait(&self) -> Option<Duration> {
        self.max_wait
    }

    /// Whether the leading edge runs.
    #[must_use]
    pub fn leading(&self) -> bool {
        self.leading
    }
}

/// The run a debounced call is waiting for.
struct Pending {
    /// Wrapped to make the slot `Sync`: only ever reached through `&mut` or by value.
    job: SyncWrapper<BoxedJob>,
    cell: Cell,
    /// Calls that joined this run, counted under the shard lock and added
    /// to the shared counter once the run is taken: a coalesced call costs
    /// no atomic.
    joined: u64,
}

impl Pending {
    fn new(job: BoxedJob, cell: Cell) -> Self {
        Self {
            job: SyncWrapper::new(job),
            cell,
            joined: 0,
        }
    }

    /// Swaps in a newer function, handing back the old one to be dropped
    /// outside the shard lock.
    fn replace(&mut self, job: BoxedJob) -> BoxedJob {
        self.joined += 1;
        std::mem::replace(self.job.get_mut(), job)
    }
}

/// A key's debounce state, owned by the registry.
struct Slot {
    key: Arc<str>,
    type_id: TypeId,
    /// When the burst's trailing run is due (last call + delay).
    deadline: Instant,
    /// When the burst must run at the latest (`max_wait`).
    max_deadline: Option<Instant>,
    max_wait: Option<Duration>,
    pending: Option<Pending>,
    /// The instant the process is sleeping until; earlier deadlines wake it.
    armed: Option<Instant>,
    last_run: Option<Instant>,
    flush: bool,
    wake: Arc<Notify>,
}

impl Slot {
    fn due(&self) -> Instant {
        match self.max_deadline {
            Some(max) if max < self.deadline => max,
            _ => self.deadline,
        }
    }
}

const OPEN: u8 = 0;
const CLOSING_FLUSH: u8 = 1;
const CLOSING_DROP: u8 = 2;

/// The debounce primitive of one runtime: its keys and counters.
pub(crate) struct State {
    registry: Arc<Registry<InlineKey, Slot>>,
    /// Registered (weakly) with the runtime's sweeper; kept alive here.
    _shrink: Arc<dyn Sweep>,
    counters: Arc<Counters>,
    /// Shutdown's policy, read by every process when it wakes: one store
    /// tells every key, however many there are.
    closing: AtomicU8,
    wakeups: AtomicU64,
    /// Calls covered by runs taken so far (run, cancelled, dropped): counted
    /// per run, not per call.
    calls: Counter,
    runs: Counter,
    coalesced: Counter,
    cancelled: Counter,
    flushed: Counter,
    failed: Counter,
    /// Keys debounced across instances, once a shared call was made.
    #[cfg(feature = "redis")]
    shared: OnceLock<Arc<shared::Shared>>,
}

/// Keys leave the map one by one as their processes exit; a sweep gives
/// back the memory a flood of keys left behind.
struct Shrink(Arc<Registry<InlineKey, Slot>>);

impl Sweep for Shrink {
    fn sweep(&self, _: Instant) -> usize {
        self.0.release_capacity();
        // Nothing here expires: never keeps the sweeper awake.
        0
    }
}

impl State {
    fn new(core: &Core) -> Self {
        let registry = Arc::new(Registry::new(Arc::clone(&core.counters), core.cap));
        let shrink: Arc<dyn Sweep> = Arc::new(Shrink(Arc::clone(&registry)));
        core.tree.sweeper().register(Arc::downgrade(&shrink));
        Self {
            _shrink: shrink,
            registry,
            counters: Arc::clone(&core.counters),
            closing: AtomicU8::new(OPEN),
            wakeups: AtomicU64::new(0),
            calls: Counter::default(),
            runs: Counter::default(),
            coalesced: Counter::default(),
            cancelled: Counter::default(),
            flushed: Counter::default(),
            failed: Counter::default(),
            #[cfg(feature = "redis")]
            shared: OnceLock::new(),
        }
    }

    /// Counts the calls a run covered once it is taken: its first call and
    /// the `joined` ones after it.
    fn settle(&self, joined: u64) {
        self.calls.add(1 + joined);
        if joined > 0 {
            self.coalesced.add(joined);
        }
    }
}

/// Wakes every key's process, a chunk at a time, yielding in between.
async fn wake_all(registry: Arc<Registry<InlineKey, Slot>>) {
    let mut wakes = Vec::with_capacity(registry.len());
    registry.retain(|_, slot| {
        wakes.push(Arc::clone(&slot.wake));
        true
    });
    for chunk in wakes.chunks(256) {
        for wake in chunk {
            wake.notify_one();
        }
        tokio::task::yield_now().await;
    }
}

impl Service for State {
    fn shutdown(&self, _deadline: Instant, policy: ShutdownPolicy) -> ServiceFuture<'_> {
        let closing = match policy {
            ShutdownPolicy::Flush => CLOSING_FLUSH,
            ShutdownPolicy::Drop => CLOSING_DROP,
        };
        self.closing.store(closing, Ordering::Release);
        // Constant work here: every process reads the policy when it wakes,
        // and waking them all goes on beside the shutdown, not before it.
        if !self.registry.is_empty() {
            tokio::spawn(wake_all(Arc::clone(&self.registry)));
        }
        #[cfg(feature = "redis")]
        if let Some(shared) = self.shared.get() {
            shared.wake_all();
        }
        Box::pin(std::future::ready(()))
    }

    fn reset(&self) {
        // Taken out under the shard locks, failed and dropped outside them.
        for (_, slot) in self.registry.drain() {
            if let Some(pending) = slot.pending {
                self.settle(pending.joined);
                pending.cell.discard("the runtime restarted");
                self.failed.incr();
            }
            slot.wake.notify_one();
        }
        #[cfg(feature = "redis")]
        if let Some(shared) = self.shared.get() {
            shared.reset();
        }
    }

    fn stats(&self, stats: &mut Stats) {
        let d = &mut stats.debounce;
        d.coalesced = self.coalesced.get();
        d.calls = self.calls.get();
        d.runs = self.runs.get();
        d.cancelled = self.cancelled.get();
        d.flushed = self.flushed.get();
        d.failed = self.failed.get();
        d.keys = self.registry.len();
        #[cfg(feature = "redis")]
        if let Some(shared) = self.shared.get() {
            d.keys += shared.len();
        }
        d.capacity = self.registry.capacity();
        d.timer_wakeups = self.wakeups.load(Ordering::Relaxed);
    }
}

/// Debounce on an explicit [`Runtime`]; from [`Runtime::debounce`].
///
/// A cheap handle (`Clone`). See [`Debounce`] for the behaviour.
///
/// The mode `M` says where a key's bursts are debounced: [`InProcess`] (the
/// default, from [`Runtime::debounce`]) or [`AcrossInstances`] (from
/// [`DebounceHandle::across_instances`]); the methods are the same names in
/// both modes.
pub struct DebounceHandle<M = InProcess> {
    runtime: Runtime,
    state: Arc<State>,
    _mode: PhantomData<M>,
}

/// The mode of a [`DebounceHandle`] that debounces in this process (the
/// default).
#[derive(Debug, Clone, Copy)]
pub struct InProcess;

/// The mode of a [`DebounceHandle`] that debounces across every instance
/// sharing the runtime's Redis (single node or cluster); without Redis it
/// debounces in this process.
#[derive(Debug, Clone, Copy)]
pub struct AcrossInstances;

impl<M> Clone for DebounceHandle<M> {
    fn clone(&self) -> Self {
        Self {
            runtime: self.runtime.clone(),
            state: Arc::clone(&self.state),
            _mode: PhantomData,
        }
    }
}

impl<M> std::fmt::Debug for DebounceHandle<M> {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("DebounceHandle")
            .field("keys", &self.state.registry.len())
            .finish_non_exhaustive()
    }
}

impl Runtime {
    /// The debounce primitive of this runtime.
    #[must_use]
    pub fn debounce(&self) -> DebounceHandle {
        DebounceHandle {
            runtime: self.clone(),
            state: self.core.service(State::new),
            _mode: PhantomData,
        }
    }
}

impl DebounceHandle {
    /// Schedules `f` to run once `key` has had no call for `delay`; returns as
    /// soon as it is scheduled. See [`DebounceHandle::call_with`].
    ///
    /// # Errors
    ///
    /// As [`DebounceHandle::call_with`].
    ///
    /// # Examples
    ///
    /// ```
    /// # #[tokio::main(flavor = "current_thread")] async fn main() -> Result<(), throttlebeam::Error> {
    /// use std::time::Duration;
    /// use throttlebeam::Runtime;
    ///
    /// let debounce = Runtime::start().await?.debounce();
    /// let first = debounce.call("search:7", Duration::from_millis(20), || async { Ok::<_, std::io::Error>("a") })?;
    /// let second = debounce.call("search:7", Duration::from_millis(20), || async { Ok::<_, std::io::Error>("ab") })?;
    /// // One run, with the latest function, covers both calls.
    /// assert_eq!(first.await?, "ab");
    /// assert_eq!(second.await?, "ab");
    /// # Ok(()) }
    /// ```
    pub fn call<T, J>(&self, key: &str, delay: Duration, f: J) -> Result<Debounced<T>, Error>
    where
        J: Job<T>,
        T: Clone + Send + Sync + 'static,
    {
        self.call_with(key, delay, DebounceOptions::new(), f)
    }

    /// Schedules `f` to run once `key` has had no call for `delay`, with
    /// `options` (maximum wait, leading edge).
    ///
    /// Every call resets the key's timer and replaces its function (latest
    /// function wins). The returned [`Debounced`] resolves with the outcome of
    /// the run that covers this call.
    ///
    /// # Errors
    ///
    /// [`Error::InvalidKey`]; [`Error::InvalidArgument`] for a zero or
    /// unschedulable `delay` or `max_wait`; [`Error::TypeMismatch`] when the
    /// key is pending with a function of another result type;
    /// [`Error::TooManyKeys`]; [`Error::ShutDown`]; [`Error::NoTokio`].
    /// Nothing is scheduled when an error is returned.
    pub fn call_with<T, J>(
        &self,
        key: &str,
        delay: Duration,
        options: DebounceOptions,
        f: J,
    ) -> Result<Debounced<T>, Error>
    where
        J: Job<T>,
        T: Clone + Send + Sync + 'static,
    {
        check_key(key)?;
        check_timer(key, "delay", delay)?;
        if let Some(max_wait) = options.max_wait {
            check_timer(key, "max wait", max_wait)?;
        }
        let core = &self.runtime.core;
        core.check_open(key)?;
        let job: BoxedJob = Box::new(move |key: Arc<str>| {
            Box::pin(async move {
                match f().await {
                    Ok(value) => Ok(Arc::new(value) as Value),
                    Err(e) => Err(Error::failed(&key, e)),
                }
            })
        });
        let cell = self.schedule(key, delay, options, job, TypeId::of::<T>())?;
        Ok(Debounced {
            cell,
            _type: PhantomData,
        })
    }

    /// Puts a checked call into this instance's registry: the in-process
    /// debounce, also the fallback of shared calls when Redis is down.
    fn schedule(
        &self,
        key: &str,
        delay: Duration,
        options: DebounceOptions,
        job: BoxedJob,
        type_id: TypeId,
    ) -> Result<Cell, Error> {
        let core = &self.runtime.core;
        // Every function that does not end up in the slot (replaced, or
        // refused) comes back out here, to be dropped after the shard lock.
        let mut job = Some(job);
        let mut replaced = None;
        let now = Instant::now();
        let state = &self.state;
        let started = update_slot(&state.registry, key, |entry| match entry {
            SlotEntry::Occupied(slot) => {
                let s = &mut slot.state;
                if s.type_id != type_id {
                    return Err(Error::TypeMismatch { key: shown(key) });
                }
                let Some(job) = job.take() else {
                    return Err(Error::TypeMismatch { key: shown(key) });
                };
                s.deadline = now + delay;
                s.max_wait = options.max_wait;
                let cell = match &mut s.pending {
                    Some(p) => {
                        replaced = Some(p.replace(job));
                        Arc::clone(&p.cell)
                    }
                    None => {
                        let cell = Burst::new(&s.key);
                        s.max_deadline = options.max_wait.map(|w| match s.last_run {
                            Some(last) if last + w > now => last + w,
                            _ => now + w,
                        });
                        s.pending = Some(Pending::new(job, Arc::clone(&cell)));
                        cell
                    }
                };
                if s.armed.is_none_or(|armed| s.due() < armed) {
                    s.wake.notify_one();
                }
                Ok((cell, None))
            }
            SlotEntry::Vacant(vacant) => {
                let owned: Arc<str> = Arc::from(key);
                let slot = Slot {
                    key: Arc::clone(&owned),
                    type_id,
                    deadline: now + delay,
                    max_deadline: options.max_wait.map(|w| now + w),
                    max_wait: options.max_wait,
                    pending: None,
                    armed: None,
                    last_run: options.leading.then_some(now),
                    flush: false,
                    wake: Arc::new(Notify::new()),
                };
                let mut guard = vacant.insert(slot).map_err(|e| Error::TooManyKeys {
                    key: shown(key),
                    cap: e.cap,
                })?;
                let cell = Burst::new(&owned);
                let Some(job) = job.take() else {
                    return Err(Error::TypeMismatch { key: shown(key) });
                };
                let run = Pending::new(job, Arc::clone(&cell));
                let leading = if options.leading {
                    Some(run)
                } else {
                    guard.state.pending = Some(run);
                    None
                };
                Ok((cell, Some((owned, guard.generation(), leading))))
            }
        });
        drop((job, replaced));
        let (cell, spawn) = started?;
        match spawn {
            None => {}
            Some((key, generation, leading)) => {
                let driver = Driver {
                    state: Arc::clone(state),
                    key: Arc::clone(&key),
                    generation,
                    leading,
                    running: None,
                    done: false,
                };
                // A process that cannot start is dropped unpolled: its guard
                // releases the key.
                core.start_process(&key, driver.run())?;
            }
        }
        Ok(cell)
    }

    /// Cancels the key's pending run: it never happens, its waiters get
    /// [`Error::Discarded`], and the next call starts a fresh burst. Returns
    /// whether a run was pending. A run already executing is not cancelled.
    pub fn cancel(&self, key: &str) -> bool {
        let cancelled = self
            .state
            .registry
            .with_slot(key.as_bytes(), |slot| {
                let s = &mut slot.state;
                s.max_deadline = None;
                s.flush = false;
                s.wake.notify_one();
                s.pending.take()
            })
            .flatten();
        // Outside the shard lock: the user's function is dropped here.
        match cancelled {
            Some(pending) => {
                self.state.settle(pending.joined);
                pending.cell.discard("cancelled");
                self.state.cancelled.incr();
                true
            }
            None => false,
        }
    }

    /// Runs the key's pending function now, once, instead of at its deadline.
    /// Returns whether a run was pending.
    pub fn flush(&self, key: &str) -> bool {
        let flushed = self
            .state
            .registry
            .with_slot(key.as_bytes(), |slot| {
                let s = &mut slot.state;
                if s.pending.is_some() && !s.flush {
                    s.flush = true;
                    s.wake.notify_one();
                    true
                } else {
                    s.pending.is_some()
                }
            })
            .unwrap_or(false);
        if flushed {
            self.state.flushed.incr();
        }
        flushed
    }

    /// Whether the key has a run waiting for its deadline.
    #[must_use]
    pub fn is_pending(&self, key: &str) -> bool {
        self.state
            .registry
            .with_slot(key.as_bytes(), |slot| slot.state.pending.is_some())
            .unwrap_or(false)
    }
}

impl DebounceHandle {
    /// This handle in the [`AcrossInstances`] mode: its `call`, `call_with`,
    /// `cancel` and `flush` debounce across every runtime sharing this
    /// runtime's Redis.
    ///
    /// # Examples
    ///
    /// ```
    /// # #[tokio::main(flavor = "current_thread")] async fn main() -> Result<(), throttlebeam::Error> {
    /// use throttlebeam::Runtime;
    ///
    /// let shared = Runtime::start().await?.debounce().across_instances();
    /// assert!(!shared.flush("autosave:doc_9").await?);
    /// # Ok(()) }
    /// ```
    #[must_use]
    pub fn across_instances(&self) -> DebounceHandle<AcrossInstances> {
        DebounceHandle {
            runtime: self.runtime.clone(),
            state: Arc::clone(&self.state),
            _mode: PhantomData,
        }
    }
}

impl DebounceHandle<AcrossInstances> {
    /// This handle in the [`InProcess`] mode, whose calls are tracked apart.
    #[must_use]
    pub fn in_process(&self) -> DebounceHandle {
        DebounceHandle {
            runtime: self.runtime.clone(),
            state: Arc::clone(&self.state),
            _mode: PhantomData,
        }
    }

    /// [`call_with`](Self::call_with) without options.
    ///
    /// # Errors
    ///
    /// As [`call_with`](Self::call_with).
    ///
    /// # Examples
    ///
    /// ```
    /// # #[tokio::main(flavor = "current_thread")] async fn main() -> Result<(), throttlebeam::Error> {
    /// use std::time::Duration;
    /// use throttlebeam::Runtime;
    ///
    /// // With `with_redis`, one run per burst across every runtime sharing it;
    /// // without Redis (as here), exactly `call`.
    /// let debounce = Runtime::start().await?.debounce().across_instances();
    /// let saved = debounce.call("autosave:doc_9", Duration::from_millis(20), || async {
    ///     Ok::<_, std::io::Error>(vec![1_u32, 2])
    /// })?;
    /// assert_eq!(saved.await?, [1, 2]);
    /// # Ok(()) }
    /// ```
    pub fn call<T, J>(&self, key: &str, delay: Duration, f: J) -> Result<Debounced<T>, Error>
    where
        J: Job<T>,
        T: Serialize + DeserializeOwned + Clone + Send + Sync + 'static,
    {
        self.call_with(key, delay, DebounceOptions::new(), f)
    }

    /// Debounces `key` across every runtime that shares this runtime's
    /// Redis (single node or cluster); without Redis, exactly
    /// [`DebounceHandle::call_with`].
    ///
    /// One run per burst across all instances, on the instance of the
    /// burst's last call, with that call's function (the latest wins, as in
    /// one process). The delay, `max_wait` and leading edge follow the
    /// server's clock. Every caller, on any instance, that awaits its
    /// [`Debounced`] gets the outcome of the run that covered its call:
    /// callers on other instances receive it through Redis, encoded. Hence
    /// the bounds: `T` must be `Serialize + DeserializeOwned` (MessagePack
    /// with serde, structs as maps: every serde form travels), and every
    /// instance must use the same type for a key (a value that does not
    /// decode as the caller's type is refused with [`Error::TypeMismatch`],
    /// not misread). A function's error reaches other instances as its message
    /// ([`Error::Failed`] whose source displays it).
    ///
    /// Keys of this mode and of [`InProcess`] are tracked apart on the
    /// instance: use one or the other for a key.
    ///
    /// Waiters elsewhere never hang: if the owning instance dies before
    /// firing, a waiting instance takes the burst over about a second after
    /// its deadline and runs its own latest function for it (still one run);
    /// if the owner dies while running it, its waiters get
    /// [`Error::Discarded`] once the run's lease lapses (a few seconds).
    /// While Redis is
    /// unreachable or its circuit breaker is open, calls fall back to this
    /// instance's in-process debounce (fail open), logged at warn.
    ///
    /// # Errors
    ///
    /// As [`DebounceHandle::call_with`]. Store failures are never returned:
    /// they fall back as above.
    pub fn call_with<T, J>(
        &self,
        key: &str,
        delay: Duration,
        options: DebounceOptions,
        f: J,
    ) -> Result<Debounced<T>, Error>
    where
        J: Job<T>,
        T: Serialize + DeserializeOwned + Clone + Send + Sync + 'static,
    {
        let this = self.in_process();
        #[cfg(feature = "redis")]
        if let Some(shared) = this.shared() {
            check_key(key)?;
            check_timer(key, "delay", delay)?;
            if let Some(max_wait) = options.max_wait {
                check_timer(key, "max wait", max_wait)?;
            }
            this.runtime.core.check_open(key)?;
            let job: shared::SharedJob = Box::new(move |key: Arc<str>| {
                Box::pin(async move {
                    match f().await {
                        Ok(value) => {
                            let wire = shared::encode_value(&value);
                            Ok((Arc::new(value) as Value, wire))
                        }
                        Err(e) => Err(Error::failed(&key, e)),
                    }
                })
            });
            let cell =
                this.schedule_shared(shared, key, delay, options, job, shared::Codec::of::<T>())?;
            return Ok(Debounced {
                cell,
                _type: PhantomData,
            });
        }
        this.call_with(key, delay, options, f)
    }

    /// Cancels the key's pending run on every instance sharing this
    /// runtime's Redis: it never happens, every caller awaiting it (on any
    /// instance) gets [`Error::Discarded`], and the next call starts a fresh
    /// burst. Returns whether a run was pending. Without Redis, exactly
    /// [`DebounceHandle::cancel`]; while Redis is unreachable, cancels what
    /// this instance holds (logged).
    ///
    /// # Errors
    ///
    /// [`Error::InvalidKey`].
    pub async fn cancel(&self, key: &str) -> Result<bool, Error> {
        check_key(key)?;
        let this = self.in_process();
        #[cfg(feature = "redis")]
        if let Some(shared) = this.shared() {
            return Ok(this.cancel_everywhere(shared, key).await);
        }
        Ok(this.cancel(key))
    }

    /// Runs the key's pending shared run now, once, on the instance that
    /// owns it (whichever instance asks). Returns whether a run was pending.
    /// Without Redis, exactly [`DebounceHandle::flush`]; while Redis is
    /// unreachable, flushes what this instance holds (logged).
    ///
    /// # Errors
    ///
    /// [`Error::InvalidKey`].
    pub async fn flush(&self, key: &str) -> Result<bool, Error> {
        check_key(key)?;
        let this = self.in_process();
        #[cfg(feature = "redis")]
        if let Some(shared) = this.shared() {
            return Ok(this.flush_everywhere(shared, key).await);
        }
        Ok(this.flush(key))
    }
}
