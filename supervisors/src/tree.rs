//! The supervision tree: a ractor root with partition actors and a sweeper.

use std::collections::VecDeque;
use std::sync::Arc;
use std::sync::atomic::{AtomicBool, Ordering};
use std::time::Duration;

use arc_swap::ArcSwap;
use ractor::{Actor, ActorCell, ActorProcessingErr, ActorRef, ActorStatus, SupervisionEvent};
use tokio::time::Instant;

use crate::stats::{Counters, Snapshot};
use crate::supervisor::{PartitionMsg, Supervisor};
use crate::sweeper::Sweeper;

/// How a [`Tree`] is built.
///
/// # Examples
///
/// ```
/// use std::time::Duration;
/// use throttlebeam_supervisors::TreeConfig;
///
/// let config = TreeConfig::default()
///     .with_partitions(4)
///     .with_sweep_interval(Duration::from_secs(30))
///     .with_restart_intensity(5, Duration::from_secs(10));
/// assert_eq!(config.partitions, 4);
/// ```
#[derive(Debug, Clone)]
#[non_exhaustive]
pub struct TreeConfig {
    /// Partitions of the per-key supervisor (default: worker threads of the
    /// current tokio runtime, 1 outside one; 0 means 1).
    pub partitions: usize,
    /// Sweep interval of the TTL sweeper (default 60 s, at least 1 ms).
    pub sweep_interval: Duration,
    /// Restarts of infrastructure children tolerated within
    /// `restart_window` before the root itself fails (default 3).
    pub max_restarts: usize,
    /// The window for `max_restarts` (default 5 s).
    pub restart_window: Duration,
}

impl Default for TreeConfig {
    fn default() -> Self {
        let partitions = tokio::runtime::Handle::try_current()
            .map(|h| h.metrics().num_workers())
            .unwrap_or(1);
        Self {
            partitions,
            sweep_interval: Duration::from_secs(60),
            max_restarts: 3,
            restart_window: Duration::from_secs(5),
        }
    }
}

impl TreeConfig {
    /// Sets the sweep interval (at least 1 ms).
    #[must_use]
    pub fn with_sweep_interval(mut self, interval: Duration) -> Self {
        self.sweep_interval = interval;
        self
    }

    /// Sets the number of supervisor partitions (at least one).
    #[must_use]
    pub fn with_partitions(mut self, partitions: usize) -> Self {
        self.partitions = partitions.max(1);
        self
    }

    /// Sets the restart intensity of infrastructure children: a failure
    /// that would make more than `max_restarts` restarts within `window`
    /// fails the root instead.
    #[must_use]
    pub fn with_restart_intensity(mut self, max_restarts: usize, window: Duration) -> Self {
        self.max_restarts = max_restarts;
        self.restart_window = window;
        self
    }
}

/// The tree could not start: one of its actors failed to spawn, or the
/// host supervisor is shutting down.
#[derive(Debug, thiserror::Error)]
#[error("supervision tree failed to start")]
pub struct StartTreeError(#[source] ractor::SpawnErr);

/// A running supervision tree: root actor, one actor per supervisor
/// partition, and the sweeper, all linked under the root.
///
/// Infrastructure children (partitions, sweeper) are restarted by the root
/// within a restart intensity; past it the root fails, and a host that
/// started the tree with [`Tree::start_linked`] receives that failure as a
/// supervision event. Per-key processes are not ractor actors: they are
/// temporary tasks of the [`Supervisor`], so their crashes never reach the
/// root or the host.
///
/// Cloning a `Tree` clones handles to the same running tree.
///
/// # Examples
///
/// ```
/// # tokio::runtime::Builder::new_current_thread().enable_all().build().unwrap().block_on(async {
/// use std::{sync::Arc, time::Duration};
/// use throttlebeam_supervisors::{Counters, Tree, TreeConfig};
/// use tokio::time::Instant;
///
/// let tree = Tree::start(TreeConfig::default(), Arc::new(Counters::new())).await?;
/// tree.supervisor().start_child(1, async { /* a key's work */ })?;
/// let still_running = tree.shutdown(Instant::now() + Duration::from_secs(5)).await;
/// assert_eq!(still_running, 0);
/// # Ok::<(), Box<dyn std::error::Error>>(())
/// # }).unwrap();
/// ```
#[derive(Debug, Clone)]
pub struct Tree {
    inner: Arc<TreeInner>,
    supervisor: Supervisor,
    sweeper: Sweeper,
    counters: Arc<Counters>,
}

#[derive(Debug)]
struct TreeInner {
    /// The current root; replaced by [`Tree::restart`].
    root: ArcSwap<ActorRef<RootMsg>>,
    /// Set once the current root is known to be down: at once when it fails
    /// its restart intensity or is stopped, moments later when it is killed
    /// (by its watcher), or by whoever sees it down first.
    down: Arc<Down>,
    host: Option<ActorCell>,
    config: TreeConfig,
    /// Serializes restarts.
    restarting: tokio::sync::Mutex<()>,
}

impl Tree {
    /// Starts an unlinked tree on the current tokio runtime (which needs its
    /// time driver), counting in `counters`.
    ///
    /// # Errors
    ///
    /// [`StartTreeError`] when an actor fails to start.
    pub async fn start(
        config: TreeConfig,
        counters: Arc<Counters>,
    ) -> Result<Self, StartTreeError> {
        Self::spawn(config, counters, None).await
    }

    /// Starts the tree linked under a host's supervisor actor.
    ///
    /// The host then receives supervision events for [`Tree::root`] only:
    /// `ActorStarted`, `ActorFailed` when the restart intensity is exceeded,
    /// and `ActorTerminated` after [`Tree::shutdown`]. Per-key failures and
    /// infrastructure restarts stay inside the tree.
    ///
    /// # Errors
    ///
    /// [`StartTreeError`] when an actor fails to start or `host` is shutting
    /// down.
    ///
    /// # Examples
    ///
    /// ```
    /// # tokio::runtime::Builder::new_current_thread().enable_all().build().unwrap().block_on(async {
    /// use std::sync::Arc;
    /// use ractor::{Actor, ActorProcessingErr, ActorRef, SupervisionEvent};
    /// use throttlebeam_supervisors::{Counters, Tree, TreeConfig};
    ///
    /// /// The host application's own supervisor.
    /// struct Host;
    ///
    /// #[cfg_attr(feature = "async-trait", ractor::async_trait)]
    /// impl Actor for Host {
    ///     type Msg = ();
    ///     type State = ();
    ///     type Arguments = ();
    ///
    ///     async fn pre_start(&self, _: ActorRef<()>, (): ()) -> Result<(), ActorProcessingErr> {
    ///         Ok(())
    ///     }
    ///
    ///     async fn handle_supervisor_evt(
    ///         &self,
    ///         _: ActorRef<()>,
    ///         event: SupervisionEvent,
    ///         _: &mut (),
    ///     ) -> Result<(), ActorProcessingErr> {
    ///         if let SupervisionEvent::ActorFailed(_, why) = event {
    ///             eprintln!("throttling runtime failed: {why}");
    ///         }
    ///         Ok(())
    ///     }
    /// }
    ///
    /// let (host, _) = Actor::spawn(None, Host, ()).await?;
    /// let tree =
    ///     Tree::start_linked(TreeConfig::default(), Arc::new(Counters::new()), host.get_cell())
    ///         .await?;
    /// assert_eq!(host.get_children().len(), 1);
    /// tree.shutdown(tokio::time::Instant::now()).await;
    /// host.stop_and_wait(None, None).await?;
    /// # Ok::<(), Box<dyn std::error::Error>>(())
    /// # }).unwrap();
    /// ```
    pub async fn start_linked(
        config: TreeConfig,
        counters: Arc<Counters>,
        host: ActorCell,
    ) -> Result<Self, StartTreeError> {
        Self::spawn(config, counters, Some(host)).await
    }

    async fn spawn(
        config: TreeConfig,
        counters: Arc<Counters>,
        host: Option<ActorCell>,
    ) -> Result<Self, StartTreeError> {
        let supervisor = Supervisor::new(config.partitions);
        let sweeper = Sweeper::new(config.sweep_interval, Arc::clone(&counters));
        let down = Arc::new(Down::default());
        let (root, join) = spawn_root(&supervisor, &sweeper, &config, host.clone(), &down).await?;
        let tree = Self {
            inner: Arc::new(TreeInner {
                root: ArcSwap::from_pointee(root),
                down,
                host,
                config,
                restarting: tokio::sync::Mutex::new(()),
            }),
            supervisor,
            sweeper,
            counters,
        };
        tree.watch(join);
        Ok(tree)
    }

    /// Marks the tree down when the current root's task ends, however it
    /// ended (a kill runs none of the root's own code), unless the tree was
    /// shut down or has restarted since.
    fn watch(&self, join: ractor::concurrency::JoinHandle<()>) {
        let id = self.inner.root.load().get_id();
        let inner = Arc::downgrade(&self.inner);
        let supervisor = self.supervisor.clone();
        tokio::spawn(async move {
            let _ = join.await;
            if let Some(inner) = inner.upgrade()
                && !supervisor.is_shut_down()
                && inner.root.load().get_id() == id
            {
                inner.down.set();
            }
        });
    }

    /// Waits until the root is known to be down (see
    /// [`Tree::is_known_down`]); for a tree with no host supervisor, whose
    /// owner restarts it itself. Meant for one waiter at a time.
    pub async fn wait_down(&self) {
        loop {
            if self.is_known_down() {
                return;
            }
            self.inner.down.notify.notified().await;
        }
    }

    /// The hot-path form of [`Tree::is_down`]: one relaxed load, no lookup.
    /// True once the tree knows its root is down: at once for a root that
    /// failed its restart intensity or was stopped from outside, moments
    /// later for one that was killed (or at once if [`Tree::is_down`] saw it
    /// first).
    #[inline]
    #[must_use]
    pub fn is_known_down(&self) -> bool {
        self.inner.down.flag.load(Ordering::Relaxed)
    }

    /// Whether the root has stopped without [`Tree::shutdown`]: it failed
    /// (restart intensity exceeded) or was killed. Nothing is swept and no
    /// infrastructure is supervised until [`Tree::restart`].
    ///
    /// Exact, but reads the current root: hot paths use
    /// [`Tree::is_known_down`].
    #[must_use]
    pub fn is_down(&self) -> bool {
        if self.supervisor.is_shut_down() {
            return false;
        }
        if self.inner.down.flag.load(Ordering::Acquire) {
            return true;
        }
        let down = self.inner.root.load().get_status() >= ActorStatus::Stopping;
        if down {
            self.inner.down.set();
        }
        down
    }

    /// Starts a fresh root (and its partition actors and sweeper) after the
    /// old one failed, linked under the same host supervisor, if any. The
    /// [`Supervisor`], [`Sweeper`] and their registered targets are kept, so
    /// every handle to this tree works again. Returns whether a restart
    /// happened: `false` while the root is alive, or once the tree was shut
    /// down.
    ///
    /// Safe to call from the host's `handle_supervisor_evt`.
    ///
    /// # Errors
    ///
    /// [`StartTreeError`] when the new root fails to start or the host is
    /// shutting down; the tree stays down and may be restarted again.
    ///
    /// # Examples
    ///
    /// ```
    /// # tokio::runtime::Builder::new_current_thread().enable_all().build().unwrap().block_on(async {
    /// use std::sync::Arc;
    /// use throttlebeam_supervisors::{Counters, Tree, TreeConfig};
    ///
    /// let tree = Tree::start(TreeConfig::default(), Arc::new(Counters::new())).await?;
    /// tree.root().kill();
    /// while !tree.is_down() {
    ///     tokio::task::yield_now().await;
    /// }
    /// assert!(tree.restart().await?);
    /// assert!(!tree.is_down());
    /// tree.shutdown(tokio::time::Instant::now()).await;
    /// # Ok::<(), Box<dyn std::error::Error>>(())
    /// # }).unwrap();
    /// ```
    pub async fn restart(&self) -> Result<bool, StartTreeError> {
        let _one_at_a_time = self.inner.restarting.lock().await;
        if !self.is_down() {
            return Ok(false);
        }
        // Wait for the old root to be gone, so its post-stop detaching can
        // never undo the new root's attaching.
        let old = self.inner.root.load_full();
        while old.get_status() != ActorStatus::Stopped {
            tokio::task::yield_now().await;
        }
        let (root, join) = spawn_root(
            &self.supervisor,
            &self.sweeper,
            &self.inner.config,
            self.inner.host.clone(),
            &self.inner.down,
        )
        .await?;
        self.inner.root.store(Arc::new(root));
        self.inner.down.flag.store(false, Ordering::Release);
        self.watch(join);
        tracing::info!("supervision tree restarted");
        Ok(true)
    }

    /// The per-key supervisor.
    #[must_use]
    pub fn supervisor(&self) -> &Supervisor {
        &self.supervisor
    }

    /// The sweeper.
    #[must_use]
    pub fn sweeper(&self) -> &Sweeper {
        &self.sweeper
    }

    /// The counters this tree was started with.
    #[must_use]
    pub fn counters(&self) -> &Arc<Counters> {
        &self.counters
    }

    /// A snapshot of the counters plus the supervisor's live processes.
    #[must_use]
    pub fn snapshot(&self) -> Snapshot {
        Snapshot {
            keys: self.counters.keys(),
            processes: self.supervisor.live(),
            timers: self.counters.timers(),
            ttl_entries: self.counters.ttl_entries(),
        }
    }

    /// The root actor's cell, as a host's supervisor sees it in supervision
    /// events.
    #[must_use]
    pub fn root(&self) -> ActorCell {
        self.inner.root.load().get_cell()
    }

    /// Shuts down: stops accepting per-key processes, waits for them until
    /// `deadline`, then stops the root and its children, waiting for that at
    /// most 5 ms past `deadline` (the stop goes on past it). Returns the
    /// number of per-key processes still running at the deadline (never
    /// cancelled).
    /// Calling it twice, or after the root failed, is harmless.
    ///
    /// # Panics
    ///
    /// As [`Supervisor::shutdown`]: without a tokio time driver while
    /// processes are still running.
    pub async fn shutdown(&self, deadline: Instant) -> usize {
        let left = self.supervisor.shutdown(deadline).await;
        let root = self.inner.root.load_full();
        // The stop is sent at the first poll; waiting for it runs at most a
        // few ms past the deadline (the root's task may queue behind many
        // woken keys), and the stop goes on without us after that.
        let stop = root.stop_and_wait(Some("shutdown".to_owned()), None);
        let until = deadline.max(Instant::now()) + STOP_ALLOWANCE;
        let _ = tokio::time::timeout_at(until, stop).await;
        left
    }
}

/// Whether the current root is known to be down, and who to tell.
#[derive(Debug, Default)]
struct Down {
    flag: AtomicBool,
    /// Holds a permit once the root went down, for [`Tree::wait_down`].
    notify: tokio::sync::Notify,
}

impl Down {
    fn set(&self) {
        if !self.flag.swap(true, Ordering::AcqRel) {
            self.notify.notify_one();
        }
    }
}

/// How long past its deadline a shutdown waits for the root to stop.
const STOP_ALLOWANCE: Duration = Duration::from_millis(5);

async fn spawn_root(
    supervisor: &Supervisor,
    sweeper: &Sweeper,
    config: &TreeConfig,
    host: Option<ActorCell>,
    down: &Arc<Down>,
) -> Result<(ActorRef<RootMsg>, ractor::concurrency::JoinHandle<()>), StartTreeError> {
    let root = Root {
        supervisor: supervisor.clone(),
        sweeper: sweeper.clone(),
        config: config.clone(),
        down: Arc::clone(down),
    };
    match host {
        Some(host) => Actor::spawn_linked(None, root, (), host).await,
        None => Actor::spawn(None, root, ()).await,
    }
    .map_err(StartTreeError)
}

#[derive(Debug)]
pub(crate) enum RootMsg {}

struct Root {
    supervisor: Supervisor,
    sweeper: Sweeper,
    config: TreeConfig,
    /// The tree's "known down" flag.
    down: Arc<Down>,
}

#[derive(Clone, Copy, PartialEq, Eq)]
enum Role {
    Sweeper,
    Partition(usize),
}

struct RootState {
    children: Vec<(ractor::ActorId, Role)>,
    restarts: VecDeque<Instant>,
}

impl Root {
    fn detach_all(&self) {
        self.sweeper.attach(None);
        for index in 0..self.supervisor.partitions() {
            self.supervisor.attach(index, None);
        }
    }

    async fn start_child(
        &self,
        myself: &ActorRef<RootMsg>,
        role: Role,
    ) -> Result<ractor::ActorId, ActorProcessingErr> {
        let cell = myself.get_cell();
        let id = match role {
            Role::Sweeper => {
                let (actor, _) = Actor::spawn_linked(None, self.sweeper.actor(), (), cell).await?;
                let id = actor.get_id();
                self.sweeper.attach(Some(actor));
                id
            }
            Role::Partition(index) => {
                let (actor, _) =
                    Actor::spawn_linked(None, PartitionActor { index }, (), cell).await?;
                let id = actor.get_id();
                self.supervisor.attach(index, Some(actor));
                id
            }
        };
        Ok(id)
    }
}

#[cfg_attr(feature = "async-trait", ractor::async_trait)]
impl Actor for Root {
    type Msg = RootMsg;
    type State = RootState;
    type Arguments = ();

    async fn pre_start(
        &self,
        myself: ActorRef<RootMsg>,
        (): (),
    ) -> Result<RootState, ActorProcessingErr> {
        let mut children = Vec::new();
        let id = self.start_child(&myself, Role::Sweeper).await?;
        children.push((id, Role::Sweeper));
        for index in 0..self.supervisor.partitions() {
            let role = Role::Partition(index);
            let id = self.start_child(&myself, role).await?;
            children.push((id, role));
        }
        Ok(RootState {
            children,
            restarts: VecDeque::new(),
        })
    }

    async fn handle(
        &self,
        _myself: ActorRef<RootMsg>,
        message: RootMsg,
        _state: &mut RootState,
    ) -> Result<(), ActorProcessingErr> {
        match message {}
    }

    async fn handle_supervisor_evt(
        &self,
        myself: ActorRef<RootMsg>,
        event: SupervisionEvent,
        state: &mut RootState,
    ) -> Result<(), ActorProcessingErr> {
        let (cell, why) = match event {
            SupervisionEvent::ActorFailed(cell, err) => (cell, err.to_string()),
            SupervisionEvent::ActorTerminated(cell, _, reason) => {
                (cell, reason.unwrap_or_else(|| "terminated".to_owned()))
            }
            _ => return Ok(()),
        };
        let Some(pos) = state
            .children
            .iter()
            .position(|(id, _)| *id == cell.get_id())
        else {
            return Ok(());
        };
        let (_, role) = state.children.remove(pos);
        match role {
            Role::Sweeper => self.sweeper.attach(None),
            Role::Partition(index) => self.supervisor.attach(index, None),
        }
        let now = Instant::now();
        while state
            .restarts
            .front()
            .is_some_and(|t| now.duration_since(*t) > self.config.restart_window)
        {
            state.restarts.pop_front();
        }
        if state.restarts.len() >= self.config.max_restarts {
            // A failing actor gets no post_stop: detach here, so handles stop
            // sending to actors that ractor is about to kill.
            self.detach_all();
            // Before the host hears of it: calls fail fast from now on.
            self.down.set();
            return Err(format!("restart intensity exceeded; last child exit: {why}").into());
        }
        state.restarts.push_back(now);
        tracing::warn!(reason = %why, "restarting infrastructure child");
        let id = self.start_child(&myself, role).await?;
        state.children.push((id, role));
        Ok(())
    }

    async fn post_stop(
        &self,
        myself: ActorRef<RootMsg>,
        _state: &mut RootState,
    ) -> Result<(), ActorProcessingErr> {
        // Stopped by someone other than `Tree::shutdown`: down, not closed.
        if !self.supervisor.is_shut_down() {
            self.down.set();
        }
        self.detach_all();
        myself.stop_children_and_wait(None, None).await;
        Ok(())
    }
}

struct PartitionActor {
    index: usize,
}

#[cfg_attr(feature = "async-trait", ractor::async_trait)]
impl Actor for PartitionActor {
    type Msg = PartitionMsg;
    type State = u64;
    type Arguments = ();

    async fn pre_start(
        &self,
        _myself: ActorRef<PartitionMsg>,
        (): (),
    ) -> Result<u64, ActorProcessingErr> {
        Ok(0)
    }

    async fn handle(
        &self,
        _myself: ActorRef<PartitionMsg>,
        message: PartitionMsg,
        panics: &mut u64,
    ) -> Result<(), ActorProcessingErr> {
        match message {
            PartitionMsg::ChildPanicked(panic) => {
                *panics += 1;
                tracing::error!(partition = self.index, %panic, "per-key process panicked");
            }
        }
        Ok(())
    }
}

#[cfg(feature = "cluster")]
impl ractor::Message for RootMsg {}
