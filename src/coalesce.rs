//! Leading + trailing throttle: the first call on an idle key runs now, the
//! calls that arrive while it runs or while its window is open collapse into
//! exactly one trailing run at the end of the window.
//!
//! ```text
//! window 1000 ms, the function takes 300 ms
//!
//! t=0     call #1  -> runs now (leading); its caller gets `true` at t=300
//! t=300            -> window [300, 1300)
//! t=500   call #2  -> `false` at once (coalesced)
//! t=900   call #3  -> `false` at once (coalesced)
//! t=1300           -> one trailing run, the latest function, covers #2 and #3
//! t=1600           -> its waiters get its value; window [1600, 2600)
//! t=2600           -> no calls in the window: the key closes
//! t=3000  call #4  -> leads again
//! ```
//!
//! The key's slot in a registry owns its state (the latest function, the
//! cell its waiters share, the window end); a per-key process owns its work
//! only while it has a run to claim or execute. A key whose window is open
//! is a timestamp in its slot, with no process; when a trailing run is
//! pending, a sleeper of the throttle (a heap of window ends on one timer,
//! one per stripe of threads) starts the key's process when the window
//! ends. Coalescing a call is a
//! registry update: no message, no wake-up.

mod lease;
mod process;
#[cfg(feature = "redis")]
mod redis;
mod sleeper;
mod state;
mod store;
mod wakeups;

use std::future::Future;
use std::sync::Arc;
use std::sync::atomic::Ordering;
use std::time::Duration;

use tokio::time::Instant;

use self::state::{Config, DESTROYED, Led, OPEN, Shared, Submitted};
pub use self::store::{
    DEFAULT_WINDOW_STORE_KEYS, MemoryWindowStore, WindowClaim, WindowEntry, WindowStore,
    WindowStoreError, WindowStoreFuture, WindowStoreStats,
};
use crate::error::Error;
use crate::error::{check_key, check_timer};
use crate::key::{MAX_TIMER, shown};
use crate::runtime::Runtime;
pub use crate::stats::CoalesceStats;

/// Default window of a coalescing throttle.
const DEFAULT_WINDOW: Duration = Duration::from_millis(1000);

/// Default bound on every window store call of a coalescing throttle.
pub const DEFAULT_WINDOW_STORE_TIMEOUT: Duration = Duration::from_secs(1);

/// Which edge of the window a run is for; passed to the function.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum Phase {
    /// The first call on an idle key, running now.
    Leading,
    /// The run at the end of a window, covering the calls coalesced into it.
    Trailing,
}

impl CoalesceStats {
    /// Adds `other`'s figures to these (for a runtime's total).
    pub(crate) fn add(&mut self, other: &Self) {
        self.active += other.active;
        self.pending += other.pending;
        self.keys += other.keys;
        self.timers += other.timers;
        self.store_keys += other.store_keys;
        self.calls += other.calls;
        self.leading_runs += other.leading_runs;
        self.trailing_runs += other.trailing_runs;
        self.coalesced += other.coalesced;
        self.store_errors += other.store_errors;
        self.store_timeouts += other.store_timeouts;
        self.evictions += other.evictions;
        self.unobserved_failures += other.unobserved_failures;
    }
}

/// Configures a [`Coalesce`]; from [`Runtime::coalesce`] or
/// [`CoalesceBuilder::new`] (default runtime).
#[derive(Debug)]
#[must_use]
pub struct CoalesceBuilder {
    runtime: Option<Runtime>,
    prefix: String,
    window: Duration,
    store: Option<Box<dyn WindowStore>>,
    store_timeout: Duration,
    name: Option<String>,
}

impl Runtime {
    /// A coalescing (leading + trailing) throttle on this runtime, namespaced
    /// by `prefix`: store keys are `prefix + key`.
    pub fn coalesce(&self, prefix: &str) -> CoalesceBuilder {
        CoalesceBuilder {
            runtime: Some(self.clone()),
            ..CoalesceBuilder::new(prefix)
        }
    }
}

impl CoalesceBuilder {
    /// A builder on the default runtime ([`Runtime::global`]).
    ///
    /// # Examples
    ///
    /// ```
    /// # #[tokio::main(flavor = "current_thread")] async fn main() -> Result<(), throttlebeam::Error> {
    /// use std::time::Duration;
    /// use throttlebeam::{Coalesce, coalesce::CoalesceBuilder};
    ///
    /// let reindex: Coalesce<usize> = CoalesceBuilder::new("reindex:")
    ///     .with_window(Duration::from_secs(5))
    ///     .build()?;
    /// assert!(reindex.call("catalog", |_| async { Ok::<_, std::io::Error>(120) }).await?);
    /// # Ok(()) }
    /// ```
    pub fn new(prefix: &str) -> Self {
        Self {
            runtime: None,
            prefix: prefix.to_owned(),
            window: DEFAULT_WINDOW,
            store: None,
            store_timeout: DEFAULT_WINDOW_STORE_TIMEOUT,
            name: None,
        }
    }

    /// The window that follows every run (default 1000 ms; 1 ms to
    /// [`MAX_TIMER`], 2^36 − 1 ms).
    pub fn with_window(mut self, window: Duration) -> Self {
        self.window = window;
        self
    }

    /// Also records windows in `store`, which other throttles or instances
    /// may share (a [`MemoryWindowStore`] in an `Arc`, or Redis), and claims
    /// each run's window there first. Without a store a throttle keeps its
    /// windows in its own registry only: no store call per run. A store
    /// passed in is never cleared by the throttle.
    pub fn with_store(mut self, store: impl WindowStore) -> Self {
        self.store = Some(Box::new(store));
        self
    }

    /// Bounds every window store call (default [`DEFAULT_WINDOW_STORE_TIMEOUT`],
    /// 1 s; 1 ms to [`MAX_TIMER`]). A call that takes
    /// longer is abandoned and counts as a store failure: the throttle fails
    /// open, as for an error.
    pub fn with_store_timeout(mut self, timeout: Duration) -> Self {
        self.store_timeout = timeout;
        self
    }

    /// The tag of the throttle's tracing events (default: the prefix
    /// without a trailing `:`).
    pub fn with_name(mut self, name: &str) -> Self {
        self.name = Some(name.to_owned());
        self
    }

    /// Builds the throttle for functions returning `T`.
    ///
    /// # Errors
    ///
    /// [`Error::InvalidSetting`] naming the prefix for an empty prefix or
    /// one over [`MAX_KEY_LEN`](crate::store::MAX_KEY_LEN) bytes, or for a window or
    /// store timeout outside 1 ms ..= [`MAX_TIMER`];
    /// [`Error::Start`] if the default runtime could not start.
    pub fn build<T: Clone + Send + Sync + 'static>(self) -> Result<Coalesce<T>, Error> {
        let invalid = |what, reason| Error::InvalidSetting {
            prefix: shown(&self.prefix),
            what,
            reason,
        };
        if check_key(&self.prefix).is_err() {
            return Err(invalid(
                "prefix",
                if self.prefix.is_empty() {
                    "must not be empty"
                } else {
                    "must be at most 1024 bytes"
                },
            ));
        }
        for (what, d) in [
            ("window", self.window),
            ("store timeout", self.store_timeout),
        ] {
            if d < Duration::from_millis(1) || d > MAX_TIMER {
                return Err(invalid(what, "must be between 1 ms and 2^36 - 1 ms"));
            }
        }
        let runtime = match self.runtime {
            Some(runtime) => runtime,
            None => Runtime::global()?,
        };
        let name = self.name.unwrap_or_else(|| {
            self.prefix
                .strip_suffix(':')
                .unwrap_or(&self.prefix)
                .to_owned()
        });
        let shared = Shared::new(Config {
            runtime,
            name: name.into(),
            prefix: self.prefix.into(),
            window: self.window,
            store: self.store,
            store_timeout: self.store_timeout,
        });
        Ok(Coalesce { shared })
    }
}

/// A keyed leading + trailing (coalescing) throttle for functions returning `T`.
///
/// - The first call on an idle key runs its function now ([`Phase::Leading`]).
/// - Calls while a function runs or its window is open are coalesced:
///   exactly one trailing run ([`Phase::Trailing`]) at the end of the window
///   covers them all, using the latest function passed for the key.
/// - Every run opens a window that starts when it finishes, so runs of a key
///   never overlap; a window that passes with no calls closes the key and the
///   next call leads again.
/// - A run covers a call if the call arrived before the run started
///   executing its function (a call arriving while the leading run still
///   claims its window is covered by that run); a call arriving while a
///   function runs is covered by the next trailing run. Every run uses the
///   latest function passed by the calls it covers.
/// - A key whose window is open costs a timestamp in the registry and no
///   process (with a trailing run pending, also an entry in the throttle's
///   sleeper, which starts the key's process when the window ends); windows
///   that are over are swept by the runtime's sweeper.
/// - The sleeper is a task on the tokio runtime of the call that started
///   it. If that runtime ends, its pending runs are handed back: a caller
///   waiting for one of them, or the next call on the throttle, restarts
///   the sleeper on its own runtime.
///
/// Functions run in the key's own process (a leading run's process lives in
/// its caller's task until the caller has the outcome, then moves into a
/// task of its own if work is left; without a store, a leading run starts
/// as its call is taken): dropping a caller's future or a timeout never
/// cancels them. A failed trailing run fails every waiter it
/// covered and emits one `tracing` error event; everything else is logged at
/// debug or trace level.
///
/// # Window store
///
/// Windows are also recorded in a [`WindowStore`] so instances sharing a
/// store agree on who runs a key. Each run has its own owner token:
///
/// - a run claims the key with [`WindowStore::claim`] (`SET … NX PX lease`),
///   where the lease lasts max(window, 2 × max(window / 2, 100 ms)), and
///   extends it every max(window / 2, 100 ms) while the function runs
///   ([`WindowStore::extend`], only while the key is still its own);
/// - when the run ends, [`WindowStore::record`] writes the window, again
///   only if no other owner took the key over, so a run whose lease lapsed
///   never overwrites the new holder;
/// - an instance that loses the claim learns the holder's end in the same
///   round trip and retries just after it (at most one lease later); the
///   call is coalesced meanwhile, and after 10 losses in a row its pending
///   calls fail with [`Error::Discarded`];
/// - on a store passed in (maybe shared), a holder re-claims 5 ms after its
///   window ends, so an instance waiting for that end claims first instead of
///   losing every race to a holder that always has calls pending.
///
/// A misbehaving store never stops a run (fail open): an error, a panic or
/// a call slower than the store timeout
/// ([`CoalesceBuilder::with_store_timeout`]) counts as a failure
/// ([`CoalesceStats::store_errors`], [`CoalesceStats::store_timeouts`]) and
/// in-memory state keeps throttling per instance, so runs of a key never
/// come closer than the window. Store calls still in flight are abandoned
/// when the throttle is destroyed (at a shutdown's deadline).
///
/// A cheap handle: clones share the same keys.
///
/// # Examples
///
/// ```
/// # #[tokio::main(flavor = "current_thread")] async fn main() -> Result<(), throttlebeam::Error> {
/// use std::time::Duration;
/// use throttlebeam::{coalesce::Phase, Runtime};
///
/// let runtime = Runtime::start().await?;
/// let sync = runtime
///     .coalesce("sync:")
///     .with_window(Duration::from_millis(500))
///     .build::<&'static str>()?;
///
/// // Idle key: runs now, and `true` once it has finished.
/// assert!(sync.call("room:1", |_| async { Ok::<_, std::io::Error>("v1") }).await?);
/// // Inside the window: coalesced, `false` at once.
/// assert!(!sync.call("room:1", |_| async { Ok::<_, std::io::Error>("v2") }).await?);
/// // Waiting: the value of the trailing run that covers this call.
/// let value = sync
///     .call_and_wait("room:1", |phase| async move {
///         assert_eq!(phase, Phase::Trailing);
///         Ok::<_, std::io::Error>("v3")
///     })
///     .await?;
/// assert_eq!(value, "v3");
/// runtime.shutdown(Duration::from_secs(1)).await;
/// # Ok(()) }
/// ```
pub struct Coalesce<T> {
    shared: Arc<Shared<T>>,
}

impl<T> Clone for Coalesce<T> {
    fn clone(&self) -> Self {
        Self {
            shared: Arc::clone(&self.shared),
        }
    }
}

impl<T: Clone + Send + Sync + 'static> std::fmt::Debug for Coalesce<T> {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Coalesce")
            .field("name", &self.shared.name)
            .field("prefix", &self.shared.prefix)
            .field("window", &self.shared.window)
            .field("stats", &self.stats())
            .finish_non_exhaustive()
    }
}

impl<T: Clone + Send + Sync + 'static> Coalesce<T> {
    /// Runs `f` now if `key` is idle and resolves `true` once it has
    /// finished; otherwise coalesces the call into the key's trailing run
    /// and resolves `false` at once.
    ///
    /// A coalesced call never sees the trailing run's outcome; use
    /// [`Coalesce::call_and_wait`] for that. A leading call that
    /// loses the window race to another instance sharing the store is
    /// coalesced too (`false`).
    ///
    /// # Errors
    ///
    /// [`Error::InvalidKey`], [`Error::TooManyKeys`], [`Error::ShutDown`]
    /// (destroyed or shut down), and for a leading call [`Error::Failed`] or
    /// [`Error::Panicked`] from the function, or [`Error::Discarded`] if the
    /// throttle was destroyed before it ran.
    pub async fn call<F, Fut, E>(&self, key: &str, f: F) -> Result<bool, Error>
    where
        F: FnOnce(Phase) -> Fut + Send + 'static,
        Fut: Future<Output = Result<T, E>> + Send + 'static,
        E: Into<Box<dyn std::error::Error + Send + Sync + 'static>>,
    {
        match self.shared.submit(key, f, false)? {
            Submitted::Coalesced(_) => Ok(false),
            Submitted::Started(run) => run.await.map(|_| true),
            Submitted::Lead(rx) => match rx.await {
                Ok(Led::Ran(result)) => result.map(|_| true),
                Ok(Led::Coalesced(_)) => Ok(false),
                Err(_) => Err(self.shared.exit_error(key)),
            },
        }
    }

    /// Like [`Coalesce::call`], then waits for the run that covers
    /// this call (its own leading run, or the trailing run it was coalesced
    /// into) and resolves with that run's value or error.
    ///
    /// The trailing run uses the latest function passed for the key, so the
    /// value may come from a newer closure than `f`. Don't wait on a key from
    /// inside that key's own function: the covering run cannot start until
    /// the current one ends.
    ///
    /// # Errors
    ///
    /// As [`Coalesce::call`], plus the covering run's
    /// [`Error::Failed`] or [`Error::Panicked`], and [`Error::Discarded`]
    /// when the throttle is destroyed (or loses the window race to other
    /// instances 10 times in a row) before that run starts.
    pub async fn call_and_wait<F, Fut, E>(&self, key: &str, f: F) -> Result<T, Error>
    where
        F: FnOnce(Phase) -> Fut + Send + 'static,
        Fut: Future<Output = Result<T, E>> + Send + 'static,
        E: Into<Box<dyn std::error::Error + Send + Sync + 'static>>,
    {
        let submitted = self.shared.submit(key, f, true)?;
        self.covering(key, submitted).await
    }

    /// [`Coalesce::call_and_wait`] giving up after `timeout`. The run
    /// is not cancelled: it still happens and still covers the call.
    ///
    /// # Errors
    ///
    /// As [`Coalesce::call_and_wait`], plus [`Error::Timeout`] naming
    /// the key and the timeout, and [`Error::InvalidArgument`] for a zero
    /// timeout or one too large to schedule (checked before anything runs).
    pub async fn call_and_wait_timeout<F, Fut, E>(
        &self,
        key: &str,
        timeout: Duration,
        f: F,
    ) -> Result<T, Error>
    where
        F: FnOnce(Phase) -> Fut + Send + 'static,
        Fut: Future<Output = Result<T, E>> + Send + 'static,
        E: Into<Box<dyn std::error::Error + Send + Sync + 'static>>,
    {
        check_key(key)?;
        check_timer(key, "timeout", timeout)?;
        let deadline = Instant::now() + timeout;
        let submitted = self.shared.submit(key, f, true)?;
        tokio::time::timeout_at(deadline, self.covering(key, submitted))
            .await
            .unwrap_or_else(|_| {
                Err(Error::Timeout {
                    key: shown(key),
                    after: timeout,
                })
            })
    }

    async fn covering(&self, key: &str, submitted: Submitted<T>) -> Result<T, Error> {
        let cell = match submitted {
            Submitted::Coalesced(Some(cell)) => cell,
            Submitted::Coalesced(None) => return Err(self.shared.exit_error(key)),
            Submitted::Started(run) => return run.await,
            Submitted::Lead(rx) => match rx.await {
                Ok(Led::Ran(result)) => return result,
                Ok(Led::Coalesced(cell)) => cell,
                Err(_) => return Err(self.shared.exit_error(key)),
            },
        };
        self.shared.wait_cell(&cell).await
    }

    /// Live figures and counters.
    ///
    /// # Examples
    ///
    /// ```
    /// # #[tokio::main(flavor = "current_thread")] async fn main() -> Result<(), throttlebeam::Error> {
    /// use throttlebeam::Runtime;
    ///
    /// let runtime = Runtime::start().await?;
    /// let sync = runtime.coalesce("sync:").build::<u8>()?;
    /// assert!(sync.call("a", |_| async { Ok::<_, std::io::Error>(1) }).await?);
    /// assert!(!sync.call("a", |_| async { Ok::<_, std::io::Error>(2) }).await?);
    /// let stats = sync.stats();
    /// assert_eq!((stats.calls, stats.leading_runs, stats.coalesced, stats.pending), (2, 1, 1, 1));
    /// # Ok(()) }
    /// ```
    #[must_use]
    pub fn stats(&self) -> CoalesceStats {
        self.shared.snapshot()
    }

    /// The bound on every window store call.
    #[must_use]
    pub fn store_timeout(&self) -> Duration {
        self.shared.store_timeout
    }

    /// The key namespace.
    #[must_use]
    pub fn prefix(&self) -> &str {
        &self.shared.prefix
    }

    /// The tag used in tracing events.
    #[must_use]
    pub fn name(&self) -> &str {
        &self.shared.name
    }

    /// The window that follows every run.
    #[must_use]
    pub fn window(&self) -> Duration {
        self.shared.window
    }

    /// Whether [`destroy`](Coalesce::destroy) or
    /// [`shutdown`](Coalesce::shutdown) has begun.
    #[must_use]
    pub fn is_shut_down(&self) -> bool {
        self.shared.mode() != OPEN
    }

    /// Whether the throttle is destroyed (after a shutdown's deadline too).
    #[must_use]
    pub fn is_destroyed(&self) -> bool {
        self.shared.mode() == DESTROYED
    }

    /// Stops the throttle now.
    ///
    /// Calls that have not run yet fail with [`Error::Discarded`] (reason
    /// `"destroyed"`, naming the key); functions already running are not
    /// cancelled and their waiters still get their values; every timer is
    /// cleared; later calls fail at once with [`Error::ShutDown`]. Its
    /// windows are forgotten; a store passed to
    /// [`CoalesceBuilder::with_store`] is left alone. Calling it
    /// again is harmless.
    pub async fn destroy(&self) {
        self.shared.destroy().await;
    }

    /// Stops the throttle gracefully within `grace`.
    ///
    /// Later calls fail at once with [`Error::ShutDown`]; trailing runs
    /// already pending still run when their windows end (windows are kept,
    /// so runs of a key still never come closer than the window); then, or at
    /// the deadline, the throttle is [destroyed](Coalesce::destroy):
    /// whatever is still pending fails with [`Error::Discarded`].
    /// [`Runtime::shutdown`] does this for every throttle of the runtime
    /// (or a plain destroy under [`ShutdownPolicy::Drop`](crate::runtime::ShutdownPolicy::Drop)).
    pub async fn shutdown(&self, grace: Duration) {
        let now = Instant::now();
        let deadline = now
            .checked_add(grace)
            .unwrap_or_else(|| now + crate::key::MAX_TIMER);
        self.shared.drain(deadline).await;
    }
}

impl<T: Clone + Send + Sync + 'static> Shared<T> {
    /// The figures of [`Coalesce::stats`].
    pub(crate) fn snapshot(&self) -> CoalesceStats {
        self.snapshot_with(self.wakeups())
    }

    /// [`Shared::snapshot`] with the sleepers' wake-ups already counted
    /// (counting locks every sleeper).
    pub(crate) fn snapshot_with(&self, wakeups: usize) -> CoalesceStats {
        let gauges = &self.gauges;
        let store = self
            .store
            .as_deref()
            .map(WindowStore::stats)
            .unwrap_or_default();
        let count = |c: &std::sync::atomic::AtomicU64| c.load(Ordering::Relaxed);
        CoalesceStats {
            active: gauges.active.get(),
            pending: gauges.pending.get(),
            keys: self.live_keys(),
            timers: gauges.timers.get() + wakeups,
            store_keys: store.keys,
            calls: gauges.leads.get() + gauges.coalesced.get(),
            leading_runs: gauges.leading_runs.get(),
            trailing_runs: gauges.trailing_runs.get(),
            coalesced: gauges.coalesced.get(),
            store_errors: count(&gauges.store_errors),
            store_timeouts: count(&gauges.store_timeouts),
            evictions: store.evictions,
            unobserved_failures: gauges.unobserved_failures.get(),
        }
    }
}
