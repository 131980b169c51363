//! A periodic sweeper that runs only while its targets hold entries.

use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, RwLock, Weak};
use std::time::Duration;

use ractor::{Actor, ActorProcessingErr, ActorRef};
use tokio::time::Instant;

use crate::stats::Counters;

/// Something the sweeper cleans: removes what expired at `now` and returns
/// how many entries remain.
pub trait Sweep: Send + Sync + 'static {
    /// Removes expired entries; returns the entries left.
    fn sweep(&self, now: Instant) -> usize;
}

/// Handle to a runtime's sweeper.
///
/// Targets register once; whoever makes a target go from empty to non-empty
/// calls [`Sweeper::kick`]. The sweeper then ticks every interval and goes
/// dormant (no timer at all) as soon as every target is empty.
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
    /// Creates a sweeper handle; it sweeps once an actor runs it (see
    /// [`crate::Tree`]).
    #[must_use]
    pub fn new(interval: Duration, counters: Arc<Counters>) -> Self {
        Self {
            shared: Arc::new(SweeperShared {
                interval,
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

    /// Adds a target. The sweeper holds it weakly.
    pub fn register(&self, target: Weak<dyn Sweep>) {
        if let Ok(mut targets) = self.shared.targets.write() {
            targets.push(target);
        }
    }

    /// Wakes the sweeper if it is dormant; cheap and idempotent.
    pub fn kick(&self) {
        if let Ok(actor) = self.shared.actor.read() {
            if let Some(actor) = actor.as_ref() {
                let _ = actor.cast(SweepMsg::Kick);
            }
        }
    }

    /// Sweeps every target now; returns the entries left.
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

    pub(crate) fn attach(&self, actor: Option<ActorRef<SweepMsg>>) {
        if let Ok(mut slot) = self.shared.actor.write() {
            *slot = actor;
        }
    }
}

impl SweeperShared {
    fn sweep_all(&self) -> usize {
        let now = Instant::now();
        let targets: Vec<Arc<dyn Sweep>> = match self.targets.read() {
            Ok(targets) => targets.iter().filter_map(Weak::upgrade).collect(),
            Err(_) => Vec::new(),
        };
        let left = targets.iter().map(|t| t.sweep(now)).sum();
        self.sweeps.fetch_add(1, Ordering::Relaxed);
        left
    }
}

#[derive(Debug)]
pub(crate) enum SweepMsg {
    Kick,
    Tick,
}

pub(crate) struct SweeperActor {
    shared: Arc<SweeperShared>,
}

pub(crate) struct SweeperState {
    timer: Option<tokio::task::JoinHandle<Result<(), ractor::MessagingErr<SweepMsg>>>>,
}

impl SweeperActor {
    fn arm(&self, myself: &ActorRef<SweepMsg>, state: &mut SweeperState) {
        self.shared.counters.timer_armed();
        state.timer = Some(myself.send_after(self.shared.interval, || SweepMsg::Tick));
    }
}

impl Actor for SweeperActor {
    type Msg = SweepMsg;
    type State = SweeperState;
    type Arguments = ();

    async fn pre_start(
        &self,
        myself: ActorRef<SweepMsg>,
        (): (),
    ) -> Result<SweeperState, ActorProcessingErr> {
        // A restarted sweeper must not miss targets that filled while it was
        // down: sweep once now, which arms the timer only if entries remain.
        let _ = myself.cast(SweepMsg::Tick);
        Ok(SweeperState { timer: None })
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
            SweepMsg::Tick => {
                if state.timer.take().is_some() {
                    self.shared.counters.timer_disarmed();
                }
                if self.shared.sweep_all() > 0 {
                    self.arm(&myself, state);
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
        if let Some(timer) = state.timer.take() {
            timer.abort();
            self.shared.counters.timer_disarmed();
        }
        Ok(())
    }
}
