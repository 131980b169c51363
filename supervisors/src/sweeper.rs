//! A periodic sweeper that runs only while its targets hold entries.

use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, PoisonError, RwLock, Weak};
use std::time::Duration;

use ractor::concurrency::JoinHandle;
use ractor::{Actor, ActorProcessingErr, ActorRef, MessagingErr};
use tokio::time::Instant;

use crate::stats::Counters;

/// The shortest sweep interval; a zero interval would spin.
const MIN_INTERVAL: Duration = Duration::from_millis(1);

/// Something the sweeper cleans: removes what expired at `now` and returns
/// how many entries remain.
///
/// A panic in `sweep` fails the sweeper actor of a [`crate::Tree`], which its
/// root restarts within the tree's restart intensity.
///
/// # Examples
///
/// ```
/// use std::sync::Mutex;
/// use tokio::time::Instant;
/// use throttlebeam_supervisors::Sweep;
///
/// /// Deadlines that are dropped once passed.
/// struct Deadlines(Mutex<Vec<Instant>>);
///
/// impl Sweep for Deadlines {
///     fn sweep(&self, now: Instant) -> usize {
///         let mut deadlines = self.0.lock().unwrap();
///         deadlines.retain(|d| *d > now);
///         deadlines.len()
///     }
/// }
/// ```
pub trait Sweep: Send + Sync + 'static {
    /// Removes expired entries; returns the entries left.
    fn sweep(&self, now: Instant) -> usize;
}

/// Handle to a runtime's sweeper.
///
/// Targets register once; whoever makes a target go from empty to non-empty
/// calls [`Sweeper::kick`]. The sweeper then ticks every interval and goes
/// dormant (no timer at all) as soon as every target is empty. While it
/// ticks, its timer counts in [`Counters::timers`].
///
/// The sweeping itself is done by an actor of a [`crate::Tree`]; a handle
/// made with [`Sweeper::new`] alone only sweeps on [`Sweeper::sweep_now`].
///
/// # Examples
///
/// ```
/// # tokio::runtime::Builder::new_current_thread().enable_time().start_paused(true).build().unwrap().block_on(async {
/// use std::{sync::Arc, time::Duration};
/// use throttlebeam_supervisors::{Counters, Tree, TreeConfig, TtlTable};
///
/// let counters = Arc::new(Counters::new());
/// let config = TreeConfig::default().with_sweep_interval(Duration::from_secs(1));
/// let tree = Tree::start(config, counters.clone()).await.unwrap();
/// // The table kicks the sweeper when it stops being empty.
/// let table: Arc<TtlTable<u32, u32>> = TtlTable::with_sweeper(counters.clone(), tree.sweeper());
/// table.insert(1, 1, Duration::from_millis(500));
/// tokio::time::sleep(Duration::from_millis(1001)).await;
/// assert!(table.is_empty());
/// assert_eq!(counters.ttl_entries(), 0);
/// # tree.shutdown(tokio::time::Instant::now()).await;
/// # });
/// ```
#[derive(Clone)]
pub struct Sweeper {
    shared: Arc<SweeperShared>,
}

impl std::fmt::Debug for Sweeper {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Sweeper")
            .field("interval", &self.shared.interval)
            .field("sweeps", &self.sweeps())
            .finish_non_exhaustive()
    }
}

struct SweeperShared {
    interval: Duration,
    counters: Arc<Counters>,
    targets: RwLock<Vec<Weak<dyn Sweep>>>,
    actor: RwLock<Option<ActorRef<SweepMsg>>>,
    sweeps: AtomicU64,
}

impl Sweeper {
    /// Creates a sweeper handle ticking every `interval` (at least 1 ms); it
    /// sweeps on its own once a [`crate::Tree`] runs it.
    #[must_use]
    pub fn new(interval: Duration, counters: Arc<Counters>) -> Self {
        Self {
            shared: Arc::new(SweeperShared {
                interval: interval.max(MIN_INTERVAL),
                counters,
                targets: RwLock::new(Vec::new()),
                actor: RwLock::new(None),
                sweeps: AtomicU64::new(0),
            }),
        }
    }

    /// The sweep interval.
    #[must_use]
    pub fn interval(&self) -> Duration {
        self.shared.interval
    }

    /// Adds a target, held weakly: a dropped target is forgotten.
    ///
    /// Register a target while it is empty, or [`Sweeper::kick`] after
    /// registering one that already holds entries.
    pub fn register(&self, target: Weak<dyn Sweep>) {
        let mut targets = self
            .shared
            .targets
            .write()
            .unwrap_or_else(PoisonError::into_inner);
        targets.retain(|t| t.strong_count() > 0);
        targets.push(target);
    }

    /// Wakes the sweeper if it is dormant; cheap and idempotent.
    ///
    /// A kick while the sweeper actor is down (not started yet, or being
    /// restarted) is not lost: a starting sweeper sweeps once and keeps
    /// ticking if anything is left.
    pub fn kick(&self) {
        // Read under the lock that `attach` writes under, so a kick either
        // reaches the attached actor or precedes its first sweep.
        let actor = self
            .shared
            .actor
            .read()
            .unwrap_or_else(PoisonError::into_inner);
        if let Some(actor) = actor.as_ref() {
            let _ = actor.cast(SweepMsg::Kick);
        }
    }

    /// Sweeps every target now, on the caller's thread; returns the entries
    /// left.
    pub fn sweep_now(&self) -> usize {
        self.shared.sweep_all()
    }

    /// Completed sweeps so far.
    #[must_use]
    pub fn sweeps(&self) -> u64 {
        self.shared.sweeps.load(Ordering::Relaxed)
    }

    pub(crate) fn actor(&self) -> SweeperActor {
        SweeperActor {
            shared: Arc::clone(&self.shared),
        }
    }

    /// Routes kicks to `actor` and makes it resume: kicks sent while no actor
    /// was attached found nobody, so the new actor sweeps once on its own.
    pub(crate) fn attach(&self, actor: Option<ActorRef<SweepMsg>>) {
        let mut slot = self
            .shared
            .actor
            .write()
            .unwrap_or_else(PoisonError::into_inner);
        if let Some(actor) = &actor {
            let _ = actor.cast(SweepMsg::Resume);
        }
        *slot = actor;
    }
}

impl SweeperShared {
    fn sweep_all(&self) -> usize {
        let now = Instant::now();
        let mut dead = false;
        // Sweep outside the lock: a target may register another from `sweep`.
        let targets: Vec<Arc<dyn Sweep>> = self
            .targets
            .read()
            .unwrap_or_else(PoisonError::into_inner)
            .iter()
            .filter_map(|t| {
                let target = t.upgrade();
                dead |= target.is_none();
                target
            })
            .collect();
        if dead {
            self.targets
                .write()
                .unwrap_or_else(PoisonError::into_inner)
                .retain(|t| t.strong_count() > 0);
        }
        let left = targets.iter().map(|t| t.sweep(now)).sum();
        self.sweeps.fetch_add(1, Ordering::Relaxed);
        left
    }
}

#[derive(Debug)]
pub(crate) enum SweepMsg {
    /// A target went from empty to non-empty.
    Kick,
    /// The actor was just attached: sweep once, keep ticking if needed.
    Resume,
    /// The timer armed with this sequence number fired.
    Tick(u64),
}

pub(crate) struct SweeperActor {
    shared: Arc<SweeperShared>,
}

pub(crate) struct SweeperState {
    timer: Option<ArmedTimer>,
    next_seq: u64,
}

/// The pending tick, counted in [`Counters::timers`] until dropped. Dropping
/// it on every exit path (fire, stop, kill, panic) keeps the count exact.
struct ArmedTimer {
    seq: u64,
    handle: JoinHandle<Result<(), MessagingErr<SweepMsg>>>,
    counters: Arc<Counters>,
}

impl Drop for ArmedTimer {
    fn drop(&mut self) {
        self.handle.abort();
        self.counters.timer_disarmed();
    }
}

impl SweeperActor {
    fn arm(&self, myself: &ActorRef<SweepMsg>, state: &mut SweeperState) {
        let seq = state.next_seq;
        state.next_seq += 1;
        self.shared.counters.timer_armed();
        let handle = myself.send_after(self.shared.interval, move || SweepMsg::Tick(seq));
        state.timer = Some(ArmedTimer {
            seq,
            handle,
            counters: Arc::clone(&self.shared.counters),
        });
    }

    fn sweep_and_rearm(&self, myself: &ActorRef<SweepMsg>, state: &mut SweeperState) {
        if self.shared.sweep_all() > 0 {
            self.arm(myself, state);
        }
    }
}

#[cfg_attr(feature = "async-trait", ractor::async_trait)]
impl Actor for SweeperActor {
    type Msg = SweepMsg;
    type State = SweeperState;
    type Arguments = ();

    async fn pre_start(
        &self,
        _myself: ActorRef<SweepMsg>,
        (): (),
    ) -> Result<SweeperState, ActorProcessingErr> {
        Ok(SweeperState {
            timer: None,
            next_seq: 0,
        })
    }

    async fn handle(
        &self,
        myself: ActorRef<SweepMsg>,
        message: SweepMsg,
        state: &mut SweeperState,
    ) -> Result<(), ActorProcessingErr> {
        match message {
            SweepMsg::Kick => {
                if state.timer.is_none() {
                    self.arm(&myself, state);
                }
            }
            SweepMsg::Resume => {
                if state.timer.is_none() {
                    self.sweep_and_rearm(&myself, state);
                }
            }
            SweepMsg::Tick(seq) => {
                // Only the armed timer's tick counts; anything else is stale.
                if state.timer.as_ref().is_some_and(|t| t.seq == seq) {
                    state.timer = None;
                    self.sweep_and_rearm(&myself, state);
                }
            }
        }
        Ok(())
    }

    async fn post_stop(
        &self,
        _myself: ActorRef<SweepMsg>,
        state: &mut SweeperState,
    ) -> Result<(), ActorProcessingErr> {
        state.timer = None;
        Ok(())
    }
}

#[cfg(feature = "cluster")]
impl ractor::Message for SweepMsg {}
