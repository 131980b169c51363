//! Partitioned dynamic supervision of temporary per-key processes.

use std::future::Future;
use std::pin::Pin;
use std::sync::atomic::{AtomicBool, AtomicUsize, Ordering};
use std::sync::{Arc, PoisonError, RwLock};
use std::task::{Context, Poll};

use ractor::{ActorRef, MessagingErr};
use tokio::sync::Notify;
use tokio::time::Instant;

use crate::panic::{Panic, catch_panic};

/// Why a process could not be started.
#[derive(Debug, Clone, Copy, PartialEq, Eq, thiserror::Error)]
#[non_exhaustive]
pub enum StartError {
    /// The supervisor is shutting down and accepts no new processes.
    #[error("supervisor is shut down")]
    ShutDown,
    /// The caller is not inside a tokio runtime.
    #[error("no tokio runtime: call from inside a tokio runtime")]
    NoRuntime,
}

/// Messages a partition's ractor actor receives about its children.
#[derive(Debug)]
pub(crate) enum PartitionMsg {
    /// A child process panicked outside the code that guards user functions.
    ChildPanicked(Panic),
}

#[derive(Debug, Default)]
struct Partition {
    live: AtomicUsize,
    idle: Notify,
    actor: RwLock<Option<ActorRef<PartitionMsg>>>,
}

#[derive(Debug)]
struct Inner {
    partitions: Box<[Partition]>,
    closed: AtomicBool,
}

/// A dynamic supervisor split into partitions, so starting a process never
/// funnels through one mailbox.
///
/// Children are temporary: each is one tokio task that runs until its key is
/// idle and is never restarted; the next call for the key starts a new one.
/// A child's panic is caught and reported to its partition's actor; it never
/// reaches the caller or the host.
///
/// # Examples
///
/// ```
/// # tokio::runtime::Builder::new_current_thread().enable_time().build().unwrap().block_on(async {
/// use throttlebeam_supervisors::Supervisor;
///
/// let supervisor = Supervisor::new(2);
/// let (tx, rx) = tokio::sync::oneshot::channel();
/// supervisor.start_child(7, async move { tx.send(42).unwrap() }).unwrap();
/// assert_eq!(rx.await.unwrap(), 42);
/// let deadline = tokio::time::Instant::now() + std::time::Duration::from_secs(1);
/// assert_eq!(supervisor.shutdown(deadline).await, 0);
/// # });
/// ```
#[derive(Debug, Clone)]
pub struct Supervisor {
    inner: Arc<Inner>,
}

struct ChildGuard {
    inner: Arc<Inner>,
    index: usize,
}

impl ChildGuard {
    /// Spawns `work` on `handle` as the child this guard counts: a panic is
    /// caught and reported, and the count drops when the task ends.
    fn spawn<F>(self, handle: &tokio::runtime::Handle, work: F)
    where
        F: Future<Output = ()> + Send + 'static,
    {
        handle.spawn(async move {
            let guard = self;
            if let Err(panic) = catch_panic(work).await {
                guard.report(panic);
            }
        });
    }

    /// Hands a child's panic to its partition actor, or logs it when the
    /// actor is down, so no panic goes unreported.
    fn report(&self, panic: Panic) {
        let partition = &self.inner.partitions[self.index];
        let actor = partition
            .actor
            .read()
            .unwrap_or_else(PoisonError::into_inner)
            .clone();
        let unsent = match actor {
            Some(actor) => match actor.cast(PartitionMsg::ChildPanicked(panic)) {
                Ok(()) => return,
                Err(MessagingErr::SendErr(PartitionMsg::ChildPanicked(panic))) => Some(panic),
                Err(_) => None,
            },
            None => Some(panic),
        };
        match unsent {
            Some(panic) => tracing::error!(%panic, "per-key process panicked"),
            None => tracing::error!("per-key process panicked"),
        }
    }
}

impl Drop for ChildGuard {
    fn drop(&mut self) {
        let partition = &self.inner.partitions[self.index];
        // Only `shutdown` waits for zero, and it closes before it looks: a
        // partition going idle while open wakes nobody (and takes no lock).
        // Both sides are SeqCst, so either this sees `closed`, or shutdown's
        // look at `live` comes after this decrement and sees zero.
        if partition.live.fetch_sub(1, Ordering::SeqCst) == 1
            && self.inner.closed.load(Ordering::SeqCst)
        {
            partition.idle.notify_waiters();
        }
    }
}

/// Work running in its caller's task as a supervised child; from
/// [`Supervisor::run_here`]. Dropped before it finishes, the rest of the
/// work moves into a child task of its own.
#[must_use = "the work runs when awaited; dropped, it runs in a task of its own"]
pub struct RunHere<O: Send + 'static> {
    /// The work, its count and where to move it; `None` once it finished.
    running: Option<Running<O>>,
}

struct Running<O> {
    work: Pin<Box<dyn Future<Output = O> + Send>>,
    guard: ChildGuard,
    handle: tokio::runtime::Handle,
}

impl<O: Send + 'static> std::fmt::Debug for RunHere<O> {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("RunHere")
            .field("finished", &self.running.is_none())
            .finish_non_exhaustive()
    }
}

impl<O: Send + 'static> Future for RunHere<O> {
    type Output = O;

    /// # Panics
    ///
    /// When polled again after it returned its output.
    fn poll(mut self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<O> {
        let running = self
            .running
            .as_mut()
            .expect("RunHere polled after it returned its output");
        let output = std::task::ready!(running.work.as_mut().poll(cx));
        // Uncounted once its output is in hand.
        self.running = None;
        Poll::Ready(output)
    }
}

impl<O: Send + 'static> Drop for RunHere<O> {
    fn drop(&mut self) {
        // The caller left mid-run: the rest runs on as a child (it stays
        // counted: shutdown closes to new children, not to this one).
        if let Some(Running {
            work,
            guard,
            handle,
        }) = self.running.take()
        {
            guard.spawn(&handle, async move {
                work.await;
            });
        }
    }
}

impl Supervisor {
    /// Creates a supervisor with `partitions` partitions (at least one).
    ///
    /// Without a [`crate::Tree`] no partition actor is attached, and a
    /// child's panic is only logged.
    #[must_use]
    pub fn new(partitions: usize) -> Self {
        let partitions = (0..partitions.max(1))
            .map(|_| Partition::default())
            .collect();
        Self {
            inner: Arc::new(Inner {
                partitions,
                closed: AtomicBool::new(false),
            }),
        }
    }

    /// Number of partitions.
    #[must_use]
    pub fn partitions(&self) -> usize {
        self.inner.partitions.len()
    }

    /// Starts `process` as a temporary child in the partition chosen by
    /// `route` (a hash of its key), on the current tokio runtime.
    ///
    /// The child is counted in [`Supervisor::live`] from this call until it
    /// returns, panics or is dropped. A panic is caught, reported to the
    /// partition and goes no further.
    ///
    /// # Errors
    ///
    /// [`StartError::ShutDown`] once [`Supervisor::shutdown`] began, and
    /// [`StartError::NoRuntime`] outside a tokio runtime. `process` is dropped
    /// unpolled in both cases.
    pub fn start_child<F>(&self, route: u64, process: F) -> Result<(), StartError>
    where
        F: Future<Output = ()> + Send + 'static,
    {
        let (guard, handle) = self.admit(route)?;
        guard.spawn(&handle, process);
        Ok(())
    }

    /// Counts a new child in `route`'s partition, on the current tokio
    /// runtime, unless the supervisor is shut down.
    fn admit(&self, route: u64) -> Result<(ChildGuard, tokio::runtime::Handle), StartError> {
        let handle = tokio::runtime::Handle::try_current().map_err(|_| StartError::NoRuntime)?;
        let index = (route % self.inner.partitions.len() as u64) as usize;
        // Count first, then check: shutdown closes first, then waits for zero.
        self.inner.partitions[index]
            .live
            .fetch_add(1, Ordering::SeqCst);
        let guard = ChildGuard {
            inner: Arc::clone(&self.inner),
            index,
        };
        if self.inner.closed.load(Ordering::SeqCst) {
            return Err(StartError::ShutDown);
        }
        Ok((guard, handle))
    }

    /// Runs `work` in the caller's task as a child of the partition chosen
    /// by `route`: counted in [`Supervisor::live`] (so
    /// [`Supervisor::shutdown`] waits for it) from this call until it ends.
    ///
    /// Awaiting the returned [`RunHere`] polls `work` where the caller is,
    /// with no task spawned and no message sent. If the caller drops it
    /// before `work` has finished, the rest of `work` moves into a child
    /// task of its own, still counted, so dropping the caller's future never
    /// cancels the work; its output is then discarded and a panic is caught
    /// and reported as a child's. A panic while the caller polls reaches the
    /// caller, as with any future it awaits.
    ///
    /// # Errors
    ///
    /// As [`Supervisor::start_child`]: [`StartError::ShutDown`] and
    /// [`StartError::NoRuntime`]; `work` is dropped unpolled.
    ///
    /// # Examples
    ///
    /// ```
    /// # tokio::runtime::Builder::new_current_thread().enable_time().build().unwrap().block_on(async {
    /// use throttlebeam_supervisors::Supervisor;
    ///
    /// let supervisor = Supervisor::new(2);
    /// let run = supervisor.run_here(7, async { 6 * 7 }).unwrap();
    /// assert_eq!(supervisor.live(), 1);
    /// assert_eq!(run.await, 42);
    /// assert_eq!(supervisor.live(), 0);
    /// # });
    /// ```
    pub fn run_here<F>(&self, route: u64, work: F) -> Result<RunHere<F::Output>, StartError>
    where
        F: Future + Send + 'static,
        F::Output: Send + 'static,
    {
        self.run_here_boxed(route, Box::pin(work))
    }

    /// [`Supervisor::run_here`] for work already boxed: a large future boxed where it is
    /// built is not copied again on its way in.
    ///
    /// # Errors
    ///
    /// As [`Supervisor::run_here`].
    ///
    /// # Examples
    ///
    /// ```
    /// # tokio::runtime::Builder::new_current_thread().enable_time().build().unwrap().block_on(async {
    /// use throttlebeam_supervisors::Supervisor;
    ///
    /// let supervisor = Supervisor::new(2);
    /// let run = supervisor.run_here_boxed(7, Box::pin(async { 6 * 7 })).unwrap();
    /// assert_eq!(run.await, 42);
    /// # });
    /// ```
    pub fn run_here_boxed<O>(
        &self,
        route: u64,
        work: Pin<Box<dyn Future<Output = O> + Send>>,
    ) -> Result<RunHere<O>, StartError>
    where
        O: Send + 'static,
    {
        let (guard, handle) = self.admit(route)?;
        Ok(RunHere {
            running: Some(Running {
                work,
                guard,
                handle,
            }),
        })
    }

    /// Children alive now, over all partitions.
    #[must_use]
    pub fn live(&self) -> usize {
        self.inner
            .partitions
            .iter()
            .map(|p| p.live.load(Ordering::Relaxed))
            .sum()
    }

    /// Whether [`Supervisor::shutdown`] has begun.
    #[must_use]
    pub fn is_shut_down(&self) -> bool {
        self.inner.closed.load(Ordering::SeqCst)
    }

    /// Stops accepting children and waits until every child has exited or
    /// `deadline` passes. Children are never cancelled; returns how many were
    /// still running at the deadline. Calling it again is harmless.
    ///
    /// # Panics
    ///
    /// Like any tokio timer, if children are still running and the current
    /// runtime has no time driver (build it with `enable_time`).
    pub async fn shutdown(&self, deadline: Instant) -> usize {
        self.inner.closed.store(true, Ordering::SeqCst);
        for partition in self.inner.partitions.iter() {
            loop {
                let notified = partition.idle.notified();
                tokio::pin!(notified);
                notified.as_mut().enable();
                if partition.live.load(Ordering::SeqCst) == 0 {
                    break;
                }
                if tokio::time::timeout_at(deadline, notified).await.is_err() {
                    break;
                }
            }
        }
        self.live()
    }

    pub(crate) fn attach(&self, index: usize, actor: Option<ActorRef<PartitionMsg>>) {
        if let Some(partition) = self.inner.partitions.get(index) {
            *partition
                .actor
                .write()
                .unwrap_or_else(PoisonError::into_inner) = actor;
        }
    }
}

#[cfg(feature = "cluster")]
impl ractor::Message for PartitionMsg {}
