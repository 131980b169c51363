//! Debounce: run once a key has been quiet for a delay.

use std::any::{Any, TypeId};
use std::future::{Future, IntoFuture};
use std::marker::PhantomData;
use std::pin::Pin;
use std::sync::Arc;
use std::sync::atomic::{AtomicU64, Ordering};
use std::time::Duration;

use throttlebeam_supervisors::{
    Counters, Generation, Registry, SlotEntry, TimerGuard, catch_panic,
};
use tokio::sync::Notify;
use tokio::time::Instant;

use crate::cell::RunCell;
use crate::error::Error;
use crate::key::{InlineKey, check_key, check_timer, shown};
use crate::runtime::{Core, Runtime, ShutdownPolicy};

type Value = Arc<dyn Any + Send + Sync>;
type BoxFuture = Pin<Box<dyn Future<Output = Result<Value, Error>> + Send>>;
type Job = Box<dyn FnOnce(Arc<str>) -> BoxFuture + Send>;
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
    // A Mutex only to make the slot `Sync`; it is always reached through
    // `&mut`, never locked.
    job: std::sync::Mutex<Job>,
    cell: Cell,
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
    shutdown: Option<ShutdownPolicy>,
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

pub(crate) struct State {
    registry: Arc<Registry<InlineKey, Slot>>,
    wakeups: AtomicU64,
}

impl State {
    pub(crate) fn new(counters: Arc<Counters>, cap: usize) -> Self {
        Self {
            registry: Arc::new(Registry::new(counters, cap)),
            wakeups: AtomicU64::new(0),
        }
    }

    pub(crate) fn wakeups(&self) -> u64 {
        self.wakeups.load(Ordering::Relaxed)
    }

    /// Tells every pending key's process that the runtime is shutting down.
    pub(crate) fn shutdown(&self, policy: ShutdownPolicy) {
        self.registry.retain(|_, slot| {
            slot.shutdown = Some(policy);
            slot.wake.notify_one();
            true
        });
    }
}

enum Step {
    Run(Pending),
    Sleep(Instant, Arc<Notify>),
    TryExit,
    Gone,
}

/// The per-key process: owns the key's timer and runs its functions.
async fn process(
    core: Arc<Core>,
    key: Arc<str>,
    generation: Generation,
    mut leading: Option<Pending>,
) {
    let state = &core.debounce;
    loop {
        if let Some(run) = leading.take() {
            execute(state, &key, run).await;
            continue;
        }
        let now = Instant::now();
        let step = state
            .registry
            .with_slot(key.as_bytes(), |slot| {
                if slot.generation() != generation {
                    return Step::Gone;
                }
                let s = &mut slot.state;
                match s.shutdown {
                    Some(ShutdownPolicy::Drop) => {
                        if let Some(p) = s.pending.take() {
                            p.cell.set(Err(Error::Discarded {
                                key: shown(&key),
                                reason: "dropped at shutdown",
                            }));
                        }
                        return Step::TryExit;
                    }
                    Some(ShutdownPolicy::Flush) => s.flush = true,
                    None => {}
                }
                match s.pending.take() {
                    Some(p) if s.flush || now >= s.due() => {
                        s.flush = false;
                        s.armed = None;
                        s.last_run = Some(now);
                        s.max_deadline = None;
                        Step::Run(p)
                    }
                    Some(p) => {
                        s.pending = Some(p);
                        let due = s.due();
                        s.armed = Some(due);
                        Step::Sleep(due, Arc::clone(&s.wake))
                    }
                    None if s.shutdown.is_some() || now >= s.deadline => Step::TryExit,
                    None => {
                        // A leading run's quiet window: keep the key until it passes.
                        s.armed = Some(s.deadline);
                        Step::Sleep(s.deadline, Arc::clone(&s.wake))
                    }
                }
            })
            .unwrap_or(Step::Gone);
        match step {
            Step::Run(run) => execute(state, &key, run).await,
            Step::Sleep(until, wake) => {
                let _timer = TimerGuard::arm(&core.counters);
                tokio::select! {
                    () = tokio::time::sleep_until(until) => {}
                    () = wake.notified() => {}
                }
                state.wakeups.fetch_add(1, Ordering::Relaxed);
            }
            Step::TryExit => {
                if state
                    .registry
                    .remove_if(key.as_bytes(), generation, |s| s.pending.is_none())
                    .is_some()
                {
                    return;
                }
            }
            Step::Gone => return,
        }
    }
}

async fn execute(_state: &State, key: &Arc<str>, run: Pending) {
    let Pending { job, cell } = run;
    let job = job
        .into_inner()
        .unwrap_or_else(std::sync::PoisonError::into_inner);
    let result = match catch_panic(job(Arc::clone(key))).await {
        Ok(result) => result,
        Err(panic) => Err(Error::panicked(key, &panic)),
    };
    if let Err(error) = &result {
        tracing::debug!(key = %shown(key), %error, "debounced function failed");
    }
    cell.set(result);
}

/// A scheduled debounced call; await it for the outcome of the run that
/// covers it, or drop it to fire and forget.
///
/// Awaiting gives the value of that run (which uses the latest function
/// passed for the key), or its error: [`Error::Failed`], [`Error::Panicked`],
/// or [`Error::Discarded`] if the run was cancelled or dropped at shutdown.
#[must_use = "the call is scheduled either way; await this to get the outcome"]
pub struct Debounced<T> {
    cell: Cell,
    _type: PhantomData<fn() -> T>,
}

impl<T> std::fmt::Debug for Debounced<T> {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Debounced")
            .field("key", &self.cell.key)
            .field("done", &self.cell.result.get().is_some())
            .finish()
    }
}

impl<T: Clone + Send + Sync + 'static> Debounced<T> {
    /// The outcome, if the covering run has finished.
    pub fn try_outcome(&self) -> Option<Result<T, Error>> {
        self.cell.result.get().map(|r| self.downcast(r))
    }

    fn downcast(&self, result: Result<Value, Error>) -> Result<T, Error> {
        let value = result?;
        value
            .downcast_ref::<T>()
            .cloned()
            .ok_or_else(|| Error::TypeMismatch {
                key: shown(&self.cell.key),
            })
    }
}

impl<T: Clone + Send + Sync + 'static> IntoFuture for Debounced<T> {
    type Output = Result<T, Error>;
    type IntoFuture = Pin<Box<dyn Future<Output = Result<T, Error>> + Send>>;

    fn into_future(self) -> Self::IntoFuture {
        Box::pin(async move {
            let result = self.cell.result.wait().await;
            self.downcast(result)
        })
    }
}

/// Debounce on an explicit [`Runtime`]; from [`Runtime::debouncer`].
///
/// See [`Debounce`] for the behaviour.
#[derive(Debug, Clone)]
pub struct Debouncer {
    runtime: Runtime,
}

impl Runtime {
    /// The debouncer of this runtime.
    #[must_use]
    pub fn debouncer(&self) -> Debouncer {
        Debouncer {
            runtime: self.clone(),
        }
    }
}

impl Debouncer {
    /// Schedules `f` to run once `key` has had no call for `delay`; returns as
    /// soon as it is scheduled. See [`Debouncer::call_with`].
    ///
    /// # Errors
    ///
    /// As [`Debouncer::call_with`].
    ///
    /// # Examples
    ///
    /// ```
    /// # #[tokio::main(flavor = "current_thread")] async fn main() -> Result<(), throttlebeam::Error> {
    /// use std::time::Duration;
    /// use throttlebeam::Runtime;
    ///
    /// let debounce = Runtime::start().await?.debouncer();
    /// let first = debounce.call("search:7", Duration::from_millis(20), || async { Ok::<_, std::io::Error>("a") })?;
    /// let second = debounce.call("search:7", Duration::from_millis(20), || async { Ok::<_, std::io::Error>("ab") })?;
    /// // One run, with the latest function, covers both calls.
    /// assert_eq!(first.await?, "ab");
    /// assert_eq!(second.await?, "ab");
    /// # Ok(()) }
    /// ```
    pub fn call<F, Fut, T, E>(
        &self,
        key: &str,
        delay: Duration,
        f: F,
    ) -> Result<Debounced<T>, Error>
    where
        F: FnOnce() -> Fut + Send + 'static,
        Fut: Future<Output = Result<T, E>> + Send + 'static,
        T: Clone + Send + Sync + 'static,
        E: Into<Box<dyn std::error::Error + Send + Sync + 'static>> + Send + 'static,
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
    pub fn call_with<F, Fut, T, E>(
        &self,
        key: &str,
        delay: Duration,
        options: DebounceOptions,
        f: F,
    ) -> Result<Debounced<T>, Error>
    where
        F: FnOnce() -> Fut + Send + 'static,
        Fut: Future<Output = Result<T, E>> + Send + 'static,
        T: Clone + Send + Sync + 'static,
        E: Into<Box<dyn std::error::Error + Send + Sync + 'static>> + Send + 'static,
    {
        check_key(key)?;
        check_timer(key, "delay", delay)?;
        if let Some(max_wait) = options.max_wait {
            check_timer(key, "max wait", max_wait)?;
        }
        let core = &self.runtime.core;
        core.check_open(key)?;
        let job: Job = Box::new(move |key: Arc<str>| {
            Box::pin(async move {
                match f().await {
                    Ok(value) => Ok(Arc::new(value) as Value),
                    Err(e) => Err(Error::failed(&key, e)),
                }
            })
        });
        let type_id = TypeId::of::<T>();
        let now = Instant::now();
        let state = &core.debounce;
        let started = state.registry.update(key.as_bytes(), |entry| match entry {
            SlotEntry::Occupied(slot) => {
                let s = &mut slot.state;
                if s.type_id != type_id {
                    return Err(Error::TypeMismatch { key: shown(key) });
                }
                s.deadline = now + delay;
                s.max_wait = options.max_wait;
                let cell = match &mut s.pending {
                    Some(p) => {
                        p.job = std::sync::Mutex::new(job);
                        Arc::clone(&p.cell)
                    }
                    None => {
                        let cell = Burst::new(&s.key);
                        s.max_deadline = options.max_wait.map(|w| match s.last_run {
                            Some(last) if last + w > now => last + w,
                            _ => now + w,
                        });
                        s.pending = Some(Pending {
                            job: std::sync::Mutex::new(job),
                            cell: Arc::clone(&cell),
                        });
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
                let cell = Burst::new(&owned);
                let run = Pending {
                    job: std::sync::Mutex::new(job),
                    cell: Arc::clone(&cell),
                };
                let (pending, leading) = if options.leading {
                    (None, Some(run))
                } else {
                    (Some(run), None)
                };
                let slot = Slot {
                    key: Arc::clone(&owned),
                    type_id,
                    deadline: now + delay,
                    max_deadline: options.max_wait.map(|w| now + w),
                    max_wait: options.max_wait,
                    pending,
                    armed: None,
                    last_run: leading.as_ref().map(|_| now),
                    flush: false,
                    shutdown: None,
                    wake: Arc::new(Notify::new()),
                };
                let guard = vacant.insert(slot).map_err(|e| Error::TooManyKeys {
                    key: shown(key),
                    cap: e.cap,
                })?;
                Ok((cell, Some((owned, guard.generation(), leading))))
            }
        })?;
        let (cell, spawn) = started;
        if let Some((key, generation, leading)) = spawn {
            let process = process(Arc::clone(core), Arc::clone(&key), generation, leading);
            if let Err(e) = core.start_process(&key, process) {
                state
                    .registry
                    .remove_if(key.as_bytes(), generation, |_| true);
                return Err(e);
            }
        }
        Ok(Debounced {
            cell,
            _type: PhantomData,
        })
    }

    /// Cancels the key's pending run: it never happens, its waiters get
    /// [`Error::Discarded`], and the next call starts a fresh burst. Returns
    /// whether a run was pending. A run already executing is not cancelled.
    pub fn cancel(&self, key: &str) -> bool {
        self.runtime
            .core
            .debounce
            .registry
            .with_slot(key.as_bytes(), |slot| {
                let s = &mut slot.state;
                s.max_deadline = None;
                s.flush = false;
                let pending = s.pending.take();
                s.wake.notify_one();
                pending.map(|p| {
                    p.cell.set(Err(Error::Discarded {
                        key: shown(key),
                        reason: "cancelled",
                    }))
                })
            })
            .flatten()
            .is_some()
    }

    /// Runs the key's pending function now, once, instead of at its deadline.
    /// Returns whether a run was pending.
    pub fn flush(&self, key: &str) -> bool {
        self.runtime
            .core
            .debounce
            .registry
            .with_slot(key.as_bytes(), |slot| {
                let s = &mut slot.state;
                if s.pending.is_some() {
                    s.flush = true;
                    s.wake.notify_one();
                    true
                } else {
                    false
                }
            })
            .unwrap_or(false)
    }

    /// Whether the key has a run waiting for its deadline.
    #[must_use]
    pub fn is_pending(&self, key: &str) -> bool {
        self.runtime
            .core
            .debounce
            .registry
            .with_slot(key.as_bytes(), |slot| slot.state.pending.is_some())
            .unwrap_or(false)
    }

    /// Timer wakeups of debounce processes so far (lazily re-armed timers
    /// make a burst of calls cost about one wakeup).
    #[must_use]
    pub fn timer_wakeups(&self) -> u64 {
        self.runtime.core.debounce.wakeups()
    }
}

/// Debounce on the default runtime.
///
/// Every call for a key resets its timer; the function runs once the key has
/// been quiet for the delay, and the latest function passed wins. Each key
/// has its own process, so keys never delay each other.
///
/// # Examples
///
/// ```
/// # #[tokio::main(flavor = "current_thread")] async fn main() -> Result<(), throttlebeam::Error> {
/// use std::time::Duration;
/// use throttlebeam::Debounce;
///
/// // Fire and forget: runs 50 ms after the last call for the key.
/// let _ = Debounce::call("autosave:doc_9", Duration::from_millis(50), || async {
///     Ok::<_, std::io::Error>(())
/// })?;
/// // Or await the run that covers the call.
/// let saved = Debounce::call("autosave:doc_9", Duration::from_millis(50), || async {
///     Ok::<_, std::io::Error>(())
/// })?
/// .await;
/// assert!(saved.is_ok());
/// # Ok(()) }
/// ```
#[derive(Debug, Clone, Copy)]
pub struct Debounce;

impl Debounce {
    /// [`Debouncer::call`] on the default runtime.
    ///
    /// # Errors
    ///
    /// As [`Debouncer::call_with`], plus [`Error::Start`].
    pub fn call<F, Fut, T, E>(key: &str, delay: Duration, f: F) -> Result<Debounced<T>, Error>
    where
        F: FnOnce() -> Fut + Send + 'static,
        Fut: Future<Output = Result<T, E>> + Send + 'static,
        T: Clone + Send + Sync + 'static,
        E: Into<Box<dyn std::error::Error + Send + Sync + 'static>> + Send + 'static,
    {
        Runtime::global()?.debouncer().call(key, delay, f)
    }

    /// [`Debouncer::call_with`] on the default runtime.
    ///
    /// # Errors
    ///
    /// As [`Debouncer::call_with`], plus [`Error::Start`].
    pub fn call_with<F, Fut, T, E>(
        key: &str,
        delay: Duration,
        options: DebounceOptions,
        f: F,
    ) -> Result<Debounced<T>, Error>
    where
        F: FnOnce() -> Fut + Send + 'static,
        Fut: Future<Output = Result<T, E>> + Send + 'static,
        T: Clone + Send + Sync + 'static,
        E: Into<Box<dyn std::error::Error + Send + Sync + 'static>> + Send + 'static,
    {
        Runtime::global()?
            .debouncer()
            .call_with(key, delay, options, f)
    }

    /// [`Debouncer::cancel`] on the default runtime.
    ///
    /// # Errors
    ///
    /// [`Error::Start`] if the default runtime could not start.
    pub fn cancel(key: &str) -> Result<bool, Error> {
        Ok(Runtime::global()?.debouncer().cancel(key))
    }

    /// [`Debouncer::flush`] on the default runtime.
    ///
    /// # Errors
    ///
    /// [`Error::Start`] if the default runtime could not start.
    pub fn flush(key: &str) -> Result<bool, Error> {
        Ok(Runtime::global()?.debouncer().flush(key))
    }

    /// [`Debouncer::is_pending`] on the default runtime.
    ///
    /// # Errors
    ///
    /// [`Error::Start`] if the default runtime could not start.
    pub fn is_pending(key: &str) -> Result<bool, Error> {
        Ok(Runtime::global()?.debouncer().is_pending(key))
    }
}
