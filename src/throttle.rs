//! Leading-edge throttle: the first call in a window runs, the rest are
//! turned away at once.

use std::future::Future;
use std::sync::Arc;
use std::time::Duration;

use throttlebeam_supervisors::{Counters, Registry, SlotEntry, Sweep, Sweeper, catch_panic};
use tokio::sync::oneshot;
use tokio::time::Instant;

use crate::error::Error;
use crate::key::{InlineKey, check_key, check_timer, shown};
use crate::runtime::{Clock, Runtime};

/// What a leading-edge throttle did with a call.
#[derive(Debug, Clone, PartialEq, Eq)]
#[must_use]
pub enum Throttled<T> {
    /// The call opened a window and its function ran, returning this value.
    Executed(T),
    /// A window is open; the function did not run.
    Throttled {
        /// How long until the key may execute again.
        retry_after: Duration,
    },
}

impl<T> Throttled<T> {
    /// The value, if the function ran.
    pub fn executed(self) -> Option<T> {
        match self {
            Self::Executed(v) => Some(v),
            Self::Throttled { .. } => None,
        }
    }

    /// Whether the call was turned away.
    #[must_use]
    pub fn is_throttled(&self) -> bool {
        matches!(self, Self::Throttled { .. })
    }
}

/// A key's throttle window, kept in the registry: 16 bytes, no process.
#[derive(Debug)]
struct Window {
    until: Instant,
}

pub(crate) struct State {
    windows: Arc<Windows>,
}

struct Windows {
    // Windows are opened, checked and swept on this one clock.
    clock: Clock,
    registry: Registry<InlineKey, Window>,
}

impl Sweep for Windows {
    fn sweep(&self, _: Instant) -> usize {
        let now = self.clock.now();
        self.registry.retain(|_, w| w.until > now)
    }
}

impl State {
    pub(crate) fn new(
        counters: Arc<Counters>,
        cap: usize,
        sweeper: &Sweeper,
        clock: Clock,
    ) -> Self {
        Self {
            windows: Arc::new(Windows {
                clock,
                registry: Registry::with_sweeper(counters, cap, sweeper),
            }),
        }
    }

    pub(crate) fn uses_tsc(&self) -> bool {
        self.windows.clock.is_tsc()
    }

    pub(crate) fn register(&self, sweeper: &Sweeper) {
        let weak = Arc::downgrade(&self.windows);
        sweeper.register(weak);
    }

    /// Opens the key's window if none is open; otherwise reports the time left.
    fn try_open(
        &self,
        key: &str,
        interval: Duration,
        cap: usize,
    ) -> Result<Option<Duration>, Error> {
        let now = self.windows.clock.now();
        // Inside a window nothing changes: a shared lock is enough.
        if let Some(Some(left)) = self.windows.registry.read(key.as_bytes(), |slot| {
            (slot.state.until > now).then(|| slot.state.until - now)
        }) {
            return Ok(Some(left));
        }
        self.windows
            .registry
            .update(key.as_bytes(), |slot| match slot {
                SlotEntry::Occupied(slot) => {
                    if slot.state.until > now {
                        Ok(Some(slot.state.until - now))
                    } else {
                        slot.state.until = now + interval;
                        Ok(None)
                    }
                }
                SlotEntry::Vacant(vacant) => vacant
                    .insert(Window {
                        until: now + interval,
                    })
                    .map(|_| None)
                    .map_err(|_| Error::TooManyKeys {
                        key: shown(key),
                        cap,
                    }),
            })
    }
}

/// Leading-edge throttle on an explicit [`Runtime`]; from [`Runtime::throttler`].
///
/// See [`Throttle`] for the behaviour.
#[derive(Debug, Clone)]
pub struct Throttler {
    runtime: Runtime,
}

impl Runtime {
    /// The leading-edge throttle of this runtime.
    #[must_use]
    pub fn throttler(&self) -> Throttler {
        Throttler {
            runtime: self.clone(),
        }
    }
}

impl Throttler {
    /// Runs `f` now if `key` has no open window, opening one of `interval`
    /// from now; otherwise returns [`Throttled::Throttled`] at once, even while
    /// the executed function is still running.
    ///
    /// The function runs in the key's own process: dropping this future does
    /// not cancel it. Its error or panic is returned to this caller, and the
    /// window stays open either way.
    ///
    /// # Errors
    ///
    /// [`Error::InvalidKey`], [`Error::InvalidArgument`] (zero or
    /// unschedulable interval), [`Error::TooManyKeys`], [`Error::ShutDown`],
    /// and, when the function ran, [`Error::Failed`] or [`Error::Panicked`].
    ///
    /// # Examples
    ///
    /// ```
    /// # #[tokio::main(flavor = "current_thread")] async fn main() -> Result<(), throttlebeam::Error> {
    /// use std::time::Duration;
    /// use throttlebeam::{Runtime, Throttled};
    ///
    /// let throttle = Runtime::start().await?.throttler();
    /// let first = throttle.call("save:9", Duration::from_secs(2), || async { Ok::<_, std::io::Error>("saved") }).await?;
    /// assert_eq!(first, Throttled::Executed("saved"));
    /// let second = throttle.call("save:9", Duration::from_secs(2), || async { Ok::<_, std::io::Error>("saved") }).await?;
    /// assert!(second.is_throttled());
    /// # Ok(()) }
    /// ```
    pub async fn call<F, Fut, T, E>(
        &self,
        key: &str,
        interval: Duration,
        f: F,
    ) -> Result<Throttled<T>, Error>
    where
        F: FnOnce() -> Fut + Send + 'static,
        Fut: Future<Output = Result<T, E>> + Send + 'static,
        T: Send + 'static,
        E: Into<Box<dyn std::error::Error + Send + Sync + 'static>> + Send + 'static,
    {
        check_key(key)?;
        check_timer(key, "interval", interval)?;
        let core = &self.runtime.core;
        core.check_open(key)?;
        let state = &core.throttle;
        if let Some(retry_after) = state.try_open(key, interval, core.cap)? {
            return Ok(Throttled::Throttled { retry_after });
        }
        let (tx, rx) = oneshot::channel();
        let owned_key: Box<str> = key.into();
        core.start_process(key, async move {
            let caught = catch_panic(async move { f().await }).await;
            let _ = tx.send(Error::from_run(&owned_key, caught));
        })?;
        match rx.await {
            Ok(outcome) => outcome.map(Throttled::Executed),
            Err(_) => Err(Error::process_lost(key)),
        }
    }
}

/// Leading-edge throttle on the default runtime.
///
/// The first call for a key runs its function now and opens a window of
/// `interval` that starts when the call starts; calls inside the window are
/// turned away with [`Throttled::Throttled`] and how long is left. Turned-away
/// calls return at once: they never wait for a slow running function. A key
/// whose window is open but whose function has finished costs a timestamp in
/// the registry, not a process; expired windows are swept.
///
/// # Examples
///
/// ```
/// # #[tokio::main(flavor = "current_thread")] async fn main() -> Result<(), throttlebeam::Error> {
/// use std::time::Duration;
/// use throttlebeam::{Throttle, Throttled};
///
/// match Throttle::call("email:42", Duration::from_secs(60), || async {
///     Ok::<_, std::io::Error>("sent")
/// })
/// .await?
/// {
///     Throttled::Executed(v) => assert_eq!(v, "sent"),
///     Throttled::Throttled { retry_after } => println!("try again in {retry_after:?}"),
/// }
/// # Ok(()) }
/// ```
#[derive(Debug, Clone, Copy)]
pub struct Throttle;

impl Throttle {
    /// [`Throttler::call`] on the default runtime.
    ///
    /// # Errors
    ///
    /// As [`Throttler::call`], plus [`Error::Start`] if the default runtime
    /// could not start.
    pub async fn call<F, Fut, T, E>(
        key: &str,
        interval: Duration,
        f: F,
    ) -> Result<Throttled<T>, Error>
    where
        F: FnOnce() -> Fut + Send + 'static,
        Fut: Future<Output = Result<T, E>> + Send + 'static,
        T: Send + 'static,
        E: Into<Box<dyn std::error::Error + Send + Sync + 'static>> + Send + 'static,
    {
        Runtime::global()?.throttler().call(key, interval, f).await
    }
}
