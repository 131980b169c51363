//! Leading-edge throttle: the first call in a window runs, the rest are
//! turned away at once.

use std::future::Future;
use std::pin::Pin;
use std::sync::{Arc, OnceLock};
use std::task::{Context, Poll};
use std::time::Duration;

use throttlebeam_supervisors::{NoGeneration, Registry, RunHere, SlotEntry, Sweep, catch_panic_fn};
use tokio::time::Instant;

#[cfg(feature = "redis")]
mod redis;
#[cfg(feature = "redis")]
mod seam;

pub use crate::stats::ThrottleStats;

#[cfg(feature = "redis")]
use self::seam::{SharedWindows, WindowOpen};
use crate::clock::{WindowClock, duration_ns};
use crate::error::Error;
use crate::error::{check_key, check_timer};
use crate::job::Job;
use crate::key::{InlineKey, shown, update_slot};
use crate::runtime::{Core, Runtime, Service};
use crate::stats::{Counter, Stats};

/// What a leading-edge throttle did with a call.
#[derive(Debug, Clone, PartialEq, Eq)]
#[must_use]
pub enum ThrottleOutcome<T> {
    /// The call opened a window and its function ran, returning this value.
    Executed(T),
    /// A window is open; the function did not run.
    Throttled {
        /// How long until the key may execute again.
        retry_after: Duration,
    },
}

impl<T> ThrottleOutcome<T> {
    /// The value, if the function ran.
    pub fn executed(self) -> Option<T> {
        match self {
            Self::Executed(v) => Some(v),
            Self::Throttled { .. } => None,
        }
    }

    /// Whether the function ran.
    #[must_use]
    pub fn is_executed(&self) -> bool {
        matches!(self, Self::Executed(_))
    }

    /// Whether the call was turned away.
    #[must_use]
    pub fn is_throttled(&self) -> bool {
        matches!(self, Self::Throttled { .. })
    }

    /// How long until the key may execute again, if the call was turned away.
    #[must_use]
    pub fn retry_after(&self) -> Option<Duration> {
        match self {
            Self::Executed(_) => None,
            Self::Throttled { retry_after } => Some(*retry_after),
        }
    }
}

/// A key's throttle window, kept in the registry: 8 bytes, no process.
#[derive(Debug)]
struct Window {
    /// When it ends, in nanoseconds on the windows' clock
    /// ([`WindowClock::now_ns`]).
    until: u64,
}

impl Window {
    /// The window ending `interval` after `now`.
    #[inline]
    fn from(now: u64, interval: Duration) -> Self {
        Self {
            until: now.saturating_add(duration_ns(interval)),
        }
    }

    /// The time left at `now`, if the window is still open.
    #[inline]
    fn left(&self, now: u64) -> Option<Duration> {
        (self.until > now).then(|| Duration::from_nanos(self.until - now))
    }
}

/// The leading-edge throttle of one runtime: its windows and counters.
pub(crate) struct State {
    windows: Arc<Windows>,
    cap: usize,
    executed: Counter,
    throttled: Counter,
    throttled_remotely: Counter,
    store_errors: Counter,
    unobserved_failures: Counter,
}

struct Windows {
    // Windows are opened, checked and swept on this one clock.
    clock: WindowClock,
    // No process removes a window by incarnation: slots without generations, 32 bytes a key.
    registry: Registry<InlineKey, Window, NoGeneration>,
}

impl Sweep for Windows {
    fn sweep(&self, _: Instant) -> usize {
        let now = self.clock.now_ns();
        self.registry.retain(|_, w| w.until > now)
    }
}

impl State {
    fn new(core: &Core) -> Self {
        let sweeper = core.tree.sweeper();
        let windows = Arc::new(Windows {
            clock: WindowClock::new(core.clock),
            registry: Registry::with_sweeper(Arc::clone(&core.counters), core.cap, sweeper),
        });
        let weak = Arc::downgrade(&windows);
        sweeper.register(weak);
        Self {
            windows,
            cap: core.cap,
            executed: Counter::default(),
            throttled: Counter::default(),
            throttled_remotely: Counter::default(),
            store_errors: Counter::default(),
            unobserved_failures: Counter::default(),
        }
    }

    /// Opens the key's window if none is open; otherwise reports the time left.
    #[inline]
    fn try_open(&self, key: &str, interval: Duration) -> Result<Option<Duration>, Error> {
        let now = self.windows.clock.now_ns();
        // Inside a window nothing changes: a shared lock is enough.
        if let Some(Some(left)) = self
            .windows
            .registry
            .read(key.as_bytes(), |slot| slot.state.left(now))
        {
            return Ok(Some(left));
        }
        self.open_or_make_room(key, now, interval)
    }

    /// [`State::open`], making room when the key cap refuses the key:
    /// windows that are over (not swept yet, if the sweeper could not run)
    /// may be what fills it, and must never count against it (W9). A caller
    /// refused again after a pass (another caller took the room it made)
    /// tries again, a few times at most.
    fn open_or_make_room(
        &self,
        key: &str,
        mut now: u64,
        interval: Duration,
    ) -> Result<Option<Duration>, Error> {
        const PASSES: usize = 3;
        let mut passes = 0;
        loop {
            match self.open(key, now, interval) {
                Err(Error::TooManyKeys { .. }) if passes < PASSES && self.make_room() => {
                    passes += 1;
                    // The call is taken once there is room.
                    now = self.windows.clock.now_ns();
                }
                decided => return decided,
            }
        }
    }

    /// A paced pass over the windows of a full key cap
    /// ([`Registry::retain_when_full`]); returns whether to try again. It
    /// forgets the windows over when the pass starts, not when its caller
    /// read the clock: a caller descheduled in between, or waiting for
    /// another caller's pass, would keep windows that ended since.
    fn make_room(&self) -> bool {
        let clock = &self.windows.clock;
        let mut now = None;
        self.windows
            .registry
            .retain_when_full(|_, w| w.until > *now.get_or_insert_with(|| clock.now_ns()))
    }

    /// [`State::try_open`] once, under the key's shard lock.
    fn open(&self, key: &str, now: u64, interval: Duration) -> Result<Option<Duration>, Error> {
        update_slot(&self.windows.registry, key, |slot| match slot {
            SlotEntry::Occupied(slot) => match slot.state.left(now) {
                Some(left) => Ok(Some(left)),
                None => {
                    slot.state = Window::from(now, interval);
                    Ok(None)
                }
            },
            SlotEntry::Vacant(vacant) => vacant
                .insert(Window::from(now, interval))
                .map(|_| None)
                .map_err(|_| Error::TooManyKeys {
                    key: shown(key),
                    cap: self.cap,
                }),
        })
    }
}

#[cfg(feature = "redis")]
impl State {
    /// Opens the window in the shared store too, after it opened here; on
    /// `Some(left)` another instance holds it: the local window is set to
    /// end with the shared one, so later calls are answered here until
    /// then. A store failure decides per instance (fail open): `None`.
    async fn open_shared(
        &self,
        store: &impl SharedWindows,
        key: &str,
        interval: Duration,
    ) -> Option<Duration> {
        match store.open_window(key, interval, 1).await {
            Ok(WindowOpen::Opened) => None,
            Ok(WindowOpen::Closed(left)) => {
                let until = Window::from(self.windows.clock.now_ns(), left);
                self.windows.registry.update(key.as_bytes(), |slot| {
                    if let SlotEntry::Occupied(slot) = slot {
                        slot.state = until;
                    }
                });
                self.throttled.incr();
                self.throttled_remotely.incr();
                Some(left)
            }
            Err(error) => {
                self.store_errors.incr();
                tracing::debug!(key = %shown(key), %error, "shared throttle window unavailable; deciding here");
                None
            }
        }
    }
}

impl Service for State {
    fn stopped(&self) {
        // Nothing reads the windows of a stopped runtime: none stays tracked.
        self.windows.registry.retain(|_, _| false);
    }

    fn reset(&self) {
        self.windows.registry.retain(|_, _| false);
    }

    fn stats(&self, stats: &mut Stats) {
        let held = self.windows.registry.len();
        let now = self.windows.clock.now_ns();
        let open = self.windows.registry.count(|w| w.until > now).min(held);
        // Windows that are over stay in the registry until the sweep or their key's next
        // call: tracked, but counted neither here nor in the runtime's keys (W9).
        stats.keys = stats.keys.saturating_sub(held - open);
        stats.throttle.executed = self.executed.get();
        stats.throttle.throttled = self.throttled.get();
        stats.throttle.windows = open;
        stats.throttle.capacity = self.windows.registry.capacity();
        stats.throttle.throttled_remotely = self.throttled_remotely.get();
        stats.throttle.store_errors = self.store_errors.get();
        stats.throttle.unobserved_failures = self.unobserved_failures.get();
    }
}

/// Leading-edge throttle on an explicit [`Runtime`]; from [`Runtime::throttle`].
///
/// A cheap handle (`Clone`). See [`Throttle`] for the behaviour.
#[derive(Clone)]
pub struct ThrottleHandle {
    runtime: Runtime,
    state: Arc<State>,
}

impl std::fmt::Debug for ThrottleHandle {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("ThrottleHandle")
            .field("windows", &self.state.windows.registry.len())
            .field("tsc_clock", &self.state.windows.clock.is_tsc())
            .finish_non_exhaustive()
    }
}

impl Runtime {
    /// The leading-edge throttle of this runtime.
    #[must_use]
    pub fn throttle(&self) -> ThrottleHandle {
        ThrottleHandle {
            runtime: self.clone(),
            state: self.core.service(State::new),
        }
    }
}

impl ThrottleHandle {
    /// Runs `f` now if `key` has no open window, opening one of `interval`
    /// from now; otherwise returns [`ThrottleOutcome::Throttled`] at once,
    /// even while the executed function is still running.
    ///
    /// The function runs in the caller's task (inside its tracing span, with
    /// no task spawned), counted as the key's process: the runtime's
    /// `processes` figure and [`Runtime::shutdown`] see it. Dropping this
    /// future does not cancel it: the rest of the run moves into a process
    /// of its own and finishes there. Its error or panic is returned to this
    /// caller, and the window stays open either way; if the caller has left
    /// by then, it is logged at warn level and counted
    /// ([`ThrottleStats::unobserved_failures`](crate::throttle::ThrottleStats::unobserved_failures)).
    ///
    /// With a shared store (a runtime on Redis), opening the window there
    /// and running the function are one unit: a caller dropped while the
    /// window is being opened still leaves the function to run once the
    /// window is open, so a window is never used up with nothing run.
    ///
    /// # Errors
    ///
    /// [`Error::InvalidKey`], [`Error::InvalidArgument`] (zero or
    /// unschedulable interval), [`Error::TooManyKeys`], [`Error::ShutDown`],
    /// [`Error::RuntimeDown`], and, when the function ran, [`Error::Failed`]
    /// or [`Error::Panicked`].
    ///
    /// # Examples
    ///
    /// ```
    /// # #[tokio::main(flavor = "current_thread")] async fn main() -> Result<(), throttlebeam::Error> {
    /// use std::time::Duration;
    /// use throttlebeam::{Runtime, ThrottleOutcome};
    ///
    /// let throttle = Runtime::start().await?.throttle();
    /// let first = throttle.call("save:9", Duration::from_secs(2), || async { Ok::<_, std::io::Error>("saved") }).await?;
    /// assert_eq!(first, ThrottleOutcome::Executed("saved"));
    /// let second = throttle.call("save:9", Duration::from_secs(2), || async { Ok::<_, std::io::Error>("saved") }).await?;
    /// assert!(second.is_throttled());
    /// # Ok(()) }
    /// ```
    pub fn call<'a, T, J>(
        &'a self,
        key: &'a str,
        interval: Duration,
        f: J,
    ) -> impl Future<Output = Result<ThrottleOutcome<T>, Error>> + Send + 'a
    where
        J: Job<T>,
        T: Send + 'static,
    {
        // A future of its own rather than an `async fn`: a throttled call's future is its
        // arguments and the run's handle, 64 bytes instead of 160, moved whole wherever it goes.
        Call::Start {
            handle: self,
            key,
            interval,
            f: Some(f),
        }
    }

    /// What a call decides when first polled: answered at once (turned away, or an error),
    /// or a run of `f` started in the caller's task.
    fn start<T, J>(&self, key: &str, interval: Duration, f: J) -> Result<Started<T>, Error>
    where
        J: Job<T>,
        T: Send + 'static,
    {
        check_key(key)?;
        check_timer(key, "interval", interval)?;
        let core = &self.runtime.core;
        core.check_open(key)?;
        let state = &self.state;
        if let Some(retry_after) = state.try_open(key, interval)? {
            state.throttled.incr();
            return Ok(Started::Answered(ThrottleOutcome::Throttled {
                retry_after,
            }));
        }
        let run = Run {
            state: Arc::clone(state),
            key: InlineKey::new(key),
            caller: tokio::task::try_id(),
        };
        // The function runs in this task, counted as the key's process: no
        // task to spawn and no hand-off on the way back. If this future is
        // dropped mid-run, the rest moves into a process of its own.
        #[cfg(feature = "redis")]
        if let Some(redis) = core.redis() {
            // Opening the shared window and running are one unit: once the
            // window may be open cluster-wide, the function runs, even if
            // this caller leaves while the window is being opened.
            let redis = redis.clone();
            let work = async move {
                if let Some(retry_after) = run
                    .state
                    .open_shared(&redis, run.key.as_str(), interval)
                    .await
                {
                    return Ok(ThrottleOutcome::Throttled { retry_after });
                }
                run.state.executed.incr();
                run.finish(catch_panic_fn(f).await)
                    .map(ThrottleOutcome::Executed)
            };
            return core.run_here(key, work).map(Started::Running);
        }
        state.executed.incr();
        let work = async move {
            run.finish(catch_panic_fn(f).await)
                .map(ThrottleOutcome::Executed)
        };
        core.run_here(key, work).map(Started::Running)
    }
}

/// How a call went on from its first poll.
enum Started<T: Send + 'static> {
    Answered(ThrottleOutcome<T>),
    Running(RunHere<Result<ThrottleOutcome<T>, Error>>),
}

pin_project_lite::pin_project! {
    /// The future of [`ThrottleHandle::call`]: lazy, as an `async fn`'s would be (nothing is
    /// decided before the first poll).
    #[project = CallProj]
    enum Call<'a, F, T>
    where
        T: Send,
        T: 'static,
    {
        Start {
            handle: &'a ThrottleHandle,
            key: &'a str,
            interval: Duration,
            f: Option<F>,
        },
        Running {
            run: RunHere<Result<ThrottleOutcome<T>, Error>>,
        },
        Done,
    }
}

impl<T, J> Future for Call<'_, J, T>
where
    J: Job<T>,
    T: Send + 'static,
{
    type Output = Result<ThrottleOutcome<T>, Error>;

    fn poll(mut self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<Self::Output> {
        let started = match self.as_mut().project() {
            CallProj::Start {
                handle,
                key,
                interval,
                f,
            } => {
                // Taken in place: an answered call writes nothing more into its future.
                let f = f.take().expect("throttle call polled after it completed");
                handle.start(key, *interval, f)
            }
            CallProj::Running { run } => {
                let out = std::task::ready!(Pin::new(run).poll(cx));
                self.set(Call::Done);
                return Poll::Ready(out);
            }
            CallProj::Done => panic!("throttle call polled after it completed"),
        };
        match started {
            Ok(Started::Answered(outcome)) => Poll::Ready(Ok(outcome)),
            Ok(Started::Running(mut run)) => match Pin::new(&mut run).poll(cx) {
                Poll::Ready(out) => Poll::Ready(out),
                Poll::Pending => {
                    self.set(Call::Running { run });
                    Poll::Pending
                }
            },
            Err(error) => Poll::Ready(Err(error)),
        }
    }
}

/// An executed call's run: what it needs to tell a failure nobody hears.
struct Run {
    state: Arc<State>,
    key: InlineKey,
    /// The caller's task. The run starts in it, and finishes elsewhere
    /// only if the caller dropped its future (the rest moved into a
    /// process of its own).
    caller: Option<tokio::task::Id>,
}

impl Run {
    /// The run's result; a failure after the caller left is logged at warn
    /// and counted, as nobody else will see it.
    fn finish<T, E>(
        self,
        caught: Result<Result<T, E>, throttlebeam_supervisors::Panic>,
    ) -> Result<T, Error>
    where
        E: Into<Box<dyn std::error::Error + Send + Sync + 'static>>,
    {
        let result = Error::from_run(self.key.as_str(), caught);
        if let Err(error) = &result
            && tokio::task::try_id() != self.caller
        {
            self.state.unobserved_failures.incr();
            // As an error value, so subscribers can walk its sources.
            let error: &(dyn std::error::Error + 'static) = error;
            tracing::warn!(key = %shown(self.key.as_str()), error, "throttled function failed after its caller left");
        }
        result
    }
}

/// Leading-edge throttle on the default runtime.
///
/// The first call for a key runs its function now and opens a window of
/// `interval` that starts when the call starts; calls inside the window are
/// turned away with [`ThrottleOutcome::Throttled`] and how long is left. Turned-away
/// calls return at once: they never wait for a slow running function. A key
/// whose window is open but whose function has finished costs a timestamp in
/// the registry, not a process; expired windows are swept.
///
/// # Examples
///
/// ```
/// # #[tokio::main(flavor = "current_thread")] async fn main() -> Result<(), throttlebeam::Error> {
/// use std::time::Duration;
/// use throttlebeam::{Throttle, ThrottleOutcome};
///
/// match Throttle::call("email:42", Duration::from_secs(60), || async {
///     Ok::<_, std::io::Error>("sent")
/// })
/// .await?
/// {
///     ThrottleOutcome::Executed(v) => assert_eq!(v, "sent"),
///     ThrottleOutcome::Throttled { retry_after } => println!("try again in {retry_after:?}"),
/// }
/// # Ok(()) }
/// ```
#[derive(Debug, Clone, Copy)]
pub struct Throttle;

impl Throttle {
    /// [`ThrottleHandle::call`] on the default runtime.
    ///
    /// # Errors
    ///
    /// As [`ThrottleHandle::call`], plus [`Error::Start`] if the default
    /// runtime could not start.
    pub async fn call<T, J>(
        key: &str,
        interval: Duration,
        f: J,
    ) -> Result<ThrottleOutcome<T>, Error>
    where
        J: Job<T>,
        T: Send + 'static,
    {
        global()?.call(key, interval, f).await
    }
}

/// The default runtime's throttle, looked up once.
fn global() -> Result<&'static ThrottleHandle, Error> {
    static GLOBAL: OnceLock<Result<ThrottleHandle, Error>> = OnceLock::new();
    GLOBAL
        .get_or_init(|| Runtime::global().map(|rt| rt.throttle()))
        .as_ref()
        .map_err(Clone::clone)
}

#[cfg(test)]
mod tests {
    use throttlebeam_supervisors::Slot;

    use super::*;

    /// W9 for a caller whose clock reading is stale by the time its pass
    /// runs (descheduled in between, on a busy machine): the pass forgets
    /// the windows over when it runs, so the key is taken, never refused.
    #[tokio::test(start_paused = true)]
    async fn a_pass_forgets_the_windows_over_when_it_runs_not_when_its_caller_read_the_clock() {
        let rt = Runtime::builder()
            .with_max_keys(3)
            .with_sweep_interval(Duration::from_secs(3600))
            .start()
            .await
            .unwrap();
        let state = rt.throttle().state;
        let window = Duration::from_millis(10);
        let stale = state.windows.clock.now_ns();
        for key in ["a", "b", "c"] {
            assert_eq!(state.try_open(key, window).unwrap(), None);
        }
        // Let the sweeper take its kick (windows open: nothing to forget)
        // and arm its next tick, an hour away.
        for _ in 0..20 {
            tokio::task::yield_now().await;
        }
        // Every window is over; the caller read its clock before they were.
        tokio::time::advance(Duration::from_millis(20)).await;
        assert_eq!(state.windows.registry.len(), 3, "the sweeper has not run");
        assert_eq!(state.open_or_make_room("d", stale, window).unwrap(), None);
        assert_eq!(state.windows.registry.len(), 1, "a, b and c were forgotten");
        // The window was opened when the key was taken, not at the stale reading.
        let left = state.try_open("d", window).unwrap();
        assert_eq!(left, Some(window));
    }

    #[test]
    fn an_open_window_is_a_32_byte_registry_entry() {
        // The key inline (24) and the window's end (8): no generation, as governor's 32.
        assert_eq!(
            std::mem::size_of::<(InlineKey, Slot<Window, NoGeneration>)>(),
            32
        );
    }
}
