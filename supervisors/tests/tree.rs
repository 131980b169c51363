//! Tree: startup, embedding under a host supervisor, restarts, shutdown.

mod support;

use std::sync::Arc;
use std::sync::atomic::{AtomicUsize, Ordering};
use std::time::Duration;

use ractor::{Actor, ActorId, ActorProcessingErr, ActorRef, ActorStatus, SupervisionEvent};
use throttlebeam_supervisors::{Counters, Snapshot, StartError, Sweep, Tree, TreeConfig, TtlTable};
use tokio::sync::mpsc;
use tokio::time::Instant;

const INTERVAL: Duration = Duration::from_secs(10);

/// What the host saw of its children.
#[derive(Debug, Clone, PartialEq, Eq)]
enum Seen {
    Started(ActorId),
    Failed(ActorId, String),
    Terminated(ActorId, Option<String>),
}

/// A host application's supervisor: records every supervision event.
struct Host;

#[cfg_attr(feature = "async-trait", ractor::async_trait)]
impl Actor for Host {
    type Msg = ();
    type State = mpsc::UnboundedSender<Seen>;
    type Arguments = mpsc::UnboundedSender<Seen>;

    async fn pre_start(
        &self,
        _myself: ActorRef<()>,
        events: Self::Arguments,
    ) -> Result<Self::State, ActorProcessingErr> {
        Ok(events)
    }

    async fn handle_supervisor_evt(
        &self,
        _myself: ActorRef<()>,
        event: SupervisionEvent,
        events: &mut Self::State,
    ) -> Result<(), ActorProcessingErr> {
        let seen = match event {
            SupervisionEvent::ActorStarted(cell) => Seen::Started(cell.get_id()),
            SupervisionEvent::ActorFailed(cell, err) => {
                Seen::Failed(cell.get_id(), err.to_string())
            }
            SupervisionEvent::ActorTerminated(cell, _, reason) => {
                Seen::Terminated(cell.get_id(), reason)
            }
            _ => return Ok(()),
        };
        let _ = events.send(seen);
        Ok(())
    }
}

struct Hosted {
    host: ActorRef<()>,
    events: mpsc::UnboundedReceiver<Seen>,
    tree: Tree,
}

impl Hosted {
    async fn start(config: TreeConfig) -> Self {
        let (tx, events) = mpsc::unbounded_channel();
        let (host, _) = Actor::spawn(None, Host, tx).await.unwrap();
        let tree = Tree::start_linked(config, Arc::new(Counters::new()), host.get_cell())
            .await
            .unwrap();
        let mut hosted = Self { host, events, tree };
        support::settle().await;
        assert_eq!(hosted.seen(), vec![Seen::Started(hosted.root_id())]);
        hosted
    }

    fn root_id(&self) -> ActorId {
        self.tree.root().get_id()
    }

    /// Events received so far, without waiting.
    fn seen(&mut self) -> Vec<Seen> {
        std::iter::from_fn(|| self.events.try_recv().ok()).collect()
    }

    async fn stop(self) {
        self.tree.shutdown(Instant::now()).await;
        self.host.stop_and_wait(None, None).await.unwrap();
    }
}

/// A sweep target that panics on the calls listed, and otherwise reports
/// `left` entries.
struct Faulty {
    calls: AtomicUsize,
    panic_on: fn(usize) -> bool,
    left: usize,
}

impl Faulty {
    fn new(panic_on: fn(usize) -> bool, left: usize) -> Arc<Self> {
        Arc::new(Self {
            calls: AtomicUsize::new(0),
            panic_on,
            left,
        })
    }

    fn calls(&self) -> usize {
        self.calls.load(Ordering::SeqCst)
    }
}

impl Sweep for Faulty {
    fn sweep(&self, _now: Instant) -> usize {
        let call = self.calls.fetch_add(1, Ordering::SeqCst) + 1;
        assert!(!(self.panic_on)(call), "sweep target failed on call {call}");
        self.left
    }
}

/// Registers `target` and wakes the sweeper: it ticks one interval from now.
async fn arm(tree: &Tree, target: &Arc<Faulty>) {
    let weak = Arc::downgrade(target);
    tree.sweeper().register(weak);
    tree.sweeper().kick();
    support::settle().await;
    assert_eq!(tree.counters().timers(), 1);
}

fn config() -> TreeConfig {
    TreeConfig::default()
        .with_sweep_interval(INTERVAL)
        .with_partitions(3)
        .with_restart_intensity(3, Duration::from_secs(5))
}

#[tokio::test(start_paused = true)]
async fn starts_partitions_and_sweeper_idle() {
    let counters = Arc::new(Counters::new());
    let tree = Tree::start(config(), counters.clone()).await.unwrap();
    support::settle().await;
    assert_eq!(tree.supervisor().partitions(), 3);
    assert_eq!(tree.sweeper().interval(), INTERVAL);
    assert_eq!(tree.root().get_status(), ActorStatus::Running);
    assert!(Arc::ptr_eq(tree.counters(), &counters));
    assert_eq!(tree.snapshot(), Snapshot::default());
    // Root's children: the sweeper and one actor per partition.
    assert_eq!(tree.root().get_children().len(), 4);

    let table: Arc<TtlTable<u8, u8>> = TtlTable::with_sweeper(counters.clone(), tree.sweeper());
    table.insert(1, 1, Duration::from_secs(60));
    let (release, wait) = tokio::sync::oneshot::channel::<()>();
    tree.supervisor()
        .start_child(9, async move {
            let _ = wait.await;
        })
        .unwrap();
    support::settle().await;
    let snapshot = tree.snapshot();
    assert_eq!(
        (
            snapshot.processes,
            snapshot.timers,
            snapshot.ttl_entries,
            snapshot.keys
        ),
        (1, 1, 1, 0)
    );
    release.send(()).unwrap();
    tree.shutdown(Instant::now() + INTERVAL).await;
    assert_eq!(tree.snapshot().processes, 0);
}

#[tokio::test(start_paused = true)]
async fn partitions_default_to_worker_threads_and_never_zero() {
    assert_eq!(TreeConfig::default().partitions, 1);
    assert_eq!(TreeConfig::default().with_partitions(0).partitions, 1);
    let mut config = TreeConfig::default();
    config.partitions = 0;
    let tree = Tree::start(config, Arc::new(Counters::new()))
        .await
        .unwrap();
    assert_eq!(tree.supervisor().partitions(), 1);
    tree.shutdown(Instant::now()).await;
}

#[tokio::test(start_paused = true)]
async fn a_per_key_panic_never_reaches_the_host() {
    let mut hosted = Hosted::start(config()).await;
    for route in 0..6 {
        hosted
            .tree
            .supervisor()
            .start_child(route, async { panic!("user code failed") })
            .unwrap();
    }
    support::settle().await;
    assert_eq!(hosted.tree.supervisor().live(), 0);
    assert_eq!(hosted.seen(), vec![]);
    assert_eq!(hosted.tree.root().get_status(), ActorStatus::Running);
    assert_eq!(
        hosted.tree.root().get_children().len(),
        4,
        "no partition died"
    );
    hosted.stop().await;
}

#[tokio::test(start_paused = true)]
async fn a_failing_sweeper_is_restarted_within_the_intensity() {
    let mut hosted = Hosted::start(config()).await;
    let counters = hosted.tree.counters().clone();
    // Fails three times in a row (the tick, then each restart's first
    // sweep), then recovers: three restarts, within the intensity of three.
    let target = Faulty::new(|call| call <= 3, 0);
    arm(&hosted.tree, &target).await;

    tokio::time::advance(INTERVAL).await;
    support::settle().await;
    assert_eq!(target.calls(), 4);
    assert_eq!(hosted.seen(), vec![], "restarts stay inside the tree");
    assert_eq!(hosted.tree.root().get_status(), ActorStatus::Running);
    assert_eq!(counters.timers(), 0, "the recovered sweeper went dormant");

    // The restarted sweeper is the one kicks reach now.
    let table: Arc<TtlTable<u8, u8>> =
        TtlTable::with_sweeper(counters.clone(), hosted.tree.sweeper());
    table.insert(1, 1, Duration::from_secs(1));
    support::settle().await;
    assert_eq!(counters.timers(), 1);
    tokio::time::advance(INTERVAL).await;
    support::settle().await;
    assert_eq!((counters.ttl_entries(), counters.timers()), (0, 0));

    hosted.stop().await;
}

/// Fails its first sweep, after filling `table` (whose kick goes to the
/// dying sweeper and is lost with it).
struct FailsWhileFilling {
    table: Arc<TtlTable<u8, u8>>,
    calls: AtomicUsize,
}

impl Sweep for FailsWhileFilling {
    fn sweep(&self, _now: Instant) -> usize {
        if self.calls.fetch_add(1, Ordering::SeqCst) == 0 {
            self.table.insert(1, 1, Duration::from_secs(1));
            panic!("sweep target failed");
        }
        0
    }
}

#[tokio::test(start_paused = true)]
async fn kicks_lost_while_the_sweeper_restarts_are_recovered() {
    let tree = Tree::start(config(), Arc::new(Counters::new()))
        .await
        .unwrap();
    support::settle().await;
    let counters = tree.counters().clone();
    let table: Arc<TtlTable<u8, u8>> = TtlTable::with_sweeper(counters.clone(), tree.sweeper());
    let target = Arc::new(FailsWhileFilling {
        table: table.clone(),
        calls: AtomicUsize::new(0),
    });
    let weak = Arc::downgrade(&target);
    tree.sweeper().register(weak);
    tree.sweeper().kick();
    support::settle().await;

    tokio::time::advance(INTERVAL).await;
    support::settle().await;
    assert_eq!(
        target.calls.load(Ordering::SeqCst),
        2,
        "failed, restarted, swept"
    );
    assert_eq!(counters.ttl_entries(), 1);
    assert_eq!(counters.timers(), 1, "the restarted sweeper saw the entry");

    tokio::time::advance(INTERVAL).await;
    support::settle().await;
    assert_eq!((counters.ttl_entries(), counters.timers()), (0, 0));
    tree.shutdown(Instant::now()).await;
}

#[tokio::test(start_paused = true)]
async fn past_the_intensity_the_root_fails_to_the_host() {
    let mut hosted = Hosted::start(config()).await;
    let root = hosted.root_id();
    let target = Faulty::new(|_| true, 0);
    arm(&hosted.tree, &target).await;
    tokio::time::advance(INTERVAL).await;
    support::settle().await;

    // The tick and three restarts failed; the fourth failure fails the root.
    assert_eq!(target.calls(), 4);
    match hosted.seen().as_slice() {
        [Seen::Failed(id, why)] => {
            assert_eq!(*id, root);
            assert!(why.contains("restart intensity"), "{why}");
        }
        other => panic!("expected the root's failure, saw {other:?}"),
    }
    assert_eq!(hosted.tree.root().get_status(), ActorStatus::Stopped);
    assert_eq!(hosted.tree.counters().timers(), 0);
    // Shutting down a failed tree is harmless.
    assert_eq!(hosted.tree.shutdown(Instant::now()).await, 0);
    assert_eq!(
        hosted.tree.supervisor().start_child(0, async {}),
        Err(StartError::ShutDown)
    );
    hosted.stop().await;
}

#[tokio::test(start_paused = true)]
async fn restarts_older_than_the_window_are_forgiven() {
    let config = config().with_restart_intensity(1, Duration::from_secs(5));
    let mut hosted = Hosted::start(config).await;
    // Fails on every tick, recovers on each restart's first sweep and keeps
    // ticking: one restart per interval, never two within the window.
    let target = Faulty::new(|call| call % 2 == 1, 1);
    arm(&hosted.tree, &target).await;
    for round in 1..=4 {
        tokio::time::advance(INTERVAL).await;
        support::settle().await;
        assert_eq!(target.calls(), round * 2);
    }
    assert_eq!(hosted.seen(), vec![]);
    assert_eq!(hosted.tree.root().get_status(), ActorStatus::Running);
    assert_eq!(hosted.tree.counters().timers(), 1);
    hosted.stop().await;
}

#[tokio::test(start_paused = true)]
async fn shutdown_stops_the_root_and_the_host_sees_it() {
    let mut hosted = Hosted::start(config()).await;
    let root = hosted.root_id();
    let (release, wait) = tokio::sync::oneshot::channel::<()>();
    hosted
        .tree
        .supervisor()
        .start_child(0, async move {
            let _ = wait.await;
        })
        .unwrap();

    let start = Instant::now();
    let left = hosted.tree.shutdown(start + Duration::from_secs(2)).await;
    assert_eq!(left, 1, "the per-key process outlived the deadline");
    assert_eq!(start.elapsed(), Duration::from_secs(2));
    support::settle().await;
    assert_eq!(
        hosted.seen(),
        vec![Seen::Terminated(root, Some("shutdown".to_owned()))]
    );
    assert_eq!(hosted.tree.root().get_status(), ActorStatus::Stopped);

    // Never cancelled: the process still runs and finishes on its own.
    assert_eq!(hosted.tree.supervisor().live(), 1);
    release.send(()).unwrap();
    support::settle().await;
    assert_eq!(hosted.tree.snapshot(), Snapshot::default());

    // A second shutdown is harmless.
    assert_eq!(hosted.tree.shutdown(Instant::now()).await, 0);
    assert_eq!(hosted.seen(), vec![]);
    hosted.stop().await;
}

#[tokio::test(start_paused = true)]
async fn a_failed_root_is_down_until_restarted_and_then_sweeps_again() {
    let mut hosted = Hosted::start(config()).await;
    let old_root = hosted.root_id();
    let target = Faulty::new(|call| call <= 4, 1);
    arm(&hosted.tree, &target).await;
    tokio::time::advance(INTERVAL).await;
    support::settle().await;
    assert!(matches!(hosted.seen().as_slice(), [Seen::Failed(..)]));
    assert!(hosted.tree.is_known_down(), "known before anyone asks");
    assert!(hosted.tree.is_down());
    assert_eq!(
        hosted.tree.counters().timers(),
        0,
        "nothing sweeps while down"
    );

    assert!(hosted.tree.restart().await.unwrap());
    support::settle().await;
    assert!(!hosted.tree.is_down() && !hosted.tree.is_known_down());
    let new_root = hosted.root_id();
    assert_ne!(new_root, old_root);
    assert_eq!(hosted.seen(), vec![Seen::Started(new_root)]);
    // The kept sweeper resumed on the kept target: it sweeps and ticks again.
    assert_eq!(target.calls(), 5);
    assert_eq!(hosted.tree.counters().timers(), 1);
    tokio::time::advance(INTERVAL).await;
    support::settle().await;
    assert_eq!(target.calls(), 6);
    // Restarting a live tree does nothing.
    assert!(!hosted.tree.restart().await.unwrap());
    hosted.stop().await;
}

#[tokio::test(start_paused = true)]
async fn a_killed_root_is_down_and_a_shut_down_tree_is_not_restarted() {
    let tree = Tree::start(config(), Arc::new(Counters::new()))
        .await
        .unwrap();
    assert!(!tree.is_down());
    tree.root().kill();
    support::settle().await;
    assert!(tree.is_known_down(), "the root's watcher noticed the kill");
    assert!(tree.is_down());
    assert!(tree.restart().await.unwrap());
    assert!(!tree.is_down());
    tree.shutdown(Instant::now()).await;
    assert!(!tree.is_down(), "a shut-down tree is closed, not down");
    assert!(!tree.restart().await.unwrap());
}
