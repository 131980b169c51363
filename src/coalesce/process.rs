//! The per-key process: owns a key's time and work from its leading call
//! until a window passes with no calls.
//!
//! One tokio task per busy key, started under the runtime's partitioned
//! supervisor. It claims the window in the store, runs the function (holding
//! a lease while it runs), publishes the result, then sleeps through the
//! window on one timer. When the window ends it either takes the pending
//! trailing run from the key's slot or closes the key with a
//! generation-gated compare-and-remove, so a call that races the exit is
//! never lost.

use std::future::Future;
use std::pin::Pin;
use std::sync::Arc;
use std::sync::atomic::Ordering;
use std::task::Poll;

use throttlebeam_supervisors::{Generation, catch_panic};
use tokio::sync::oneshot;
use tokio::time::Instant;

use super::Phase;
use super::state::{DESTROYED, DRAINING, Job, KeyState, Led, Pending, Shared};
use crate::cell::RunCell;
use crate::error::Error;
use crate::key::shown;

/// Lost window races in a row after which pending calls are dropped.
const MAX_LOST_RACES: u32 = 10;

/// Who waits for the current run.
enum Waiters<T> {
    /// The leading caller.
    Lead(oneshot::Sender<Led<T>>),
    /// Callers coalesced into a trailing run (none if nobody waits).
    Cells(Vec<Arc<RunCell<T>>>),
}

impl<T: Clone> Waiters<T> {
    fn publish(self, result: Result<T, Error>) {
        match self {
            Self::Lead(tx) => {
                let _ = tx.send(Led::Ran(result));
            }
            Self::Cells(cells) => {
                for cell in cells {
                    cell.set(result.clone());
                }
            }
        }
    }
}

enum Step<T> {
    Sleep(Instant),
    Run(Pending<T>),
    Close,
}

/// A key's process. Dropping it on any path (normal exit, panic, a start
/// that failed, a runtime torn down) releases the key: the slot of its own
/// generation is removed and callers still waiting get an error.
pub(super) struct Driver<T: Clone + Send + Sync + 'static> {
    shared: Arc<Shared<T>>,
    key: Box<str>,
    generation: Generation,
    active: bool,
    phase: Phase,
    job: Option<Job<T>>,
    waiters: Option<Waiters<T>>,
    lost_races: u32,
    /// The slot was removed by the idle exit.
    closed: bool,
}

impl<T: Clone + Send + Sync + 'static> Driver<T> {
    /// A process for the leading call on `key`; counted live and active
    /// from here, before it is spawned.
    pub(super) fn new(
        shared: Arc<Shared<T>>,
        key: &str,
        generation: Generation,
        job: Job<T>,
        tx: oneshot::Sender<Led<T>>,
    ) -> Self {
        shared.gauges.live.fetch_add(1, Ordering::AcqRel);
        shared.gauges.active.fetch_add(1, Ordering::Relaxed);
        Self {
            shared,
            key: key.into(),
            generation,
            active: true,
            phase: Phase::Leading,
            job: Some(job),
            waiters: Some(Waiters::Lead(tx)),
            lost_races: 0,
            closed: false,
        }
    }

    pub(super) async fn drive(mut self) {
        loop {
            let claim = self.shared.claim(&self.key).await;
            if self.shared.mode() == DESTROYED {
                // Destroyed before the function started: the call never runs.
                let error = self.shared.exit_error(&self.key);
                self.finish_without_run(Err(error));
            } else {
                match claim {
                    Ok(()) => {
                        self.lost_races = 0;
                        self.execute().await;
                    }
                    Err(wait) => self.lose(wait),
                }
            }
            if !self.next_run().await {
                return;
            }
        }
    }

    fn set_active(&mut self, active: bool) {
        if self.active != active {
            self.active = active;
            let gauge = &self.shared.gauges.active;
            if active {
                gauge.fetch_add(1, Ordering::Relaxed);
            } else {
                gauge.fetch_sub(1, Ordering::Relaxed);
            }
        }
    }

    /// Runs the function, opens the window at its end, publishes the result.
    async fn execute(&mut self) {
        let Some(job) = self.job.take() else { return };
        let phase = self.phase;
        tracing::debug!(throttle = %self.shared.name, key = %self.key, ?phase, "run started");
        let result = run_job(&self.shared, &self.key, job, phase).await;
        match (&result, phase) {
            (Err(error), Phase::Trailing) => {
                // As an error value, so subscribers can walk its sources.
                let error: &(dyn std::error::Error + 'static) = error;
                tracing::error!(throttle = %self.shared.name, key = %self.key, error, "trailing run failed");
            }
            _ => {
                tracing::debug!(throttle = %self.shared.name, key = %self.key, ?phase, ok = result.is_ok(), "run finished");
            }
        }
        if let Some(waiters) = self.waiters.take() {
            waiters.publish(result);
        }
        // Calls arriving until the window is recorded coalesce all the same
        // (the key still reads as running).
        let until = self.shared.write_window(&self.key).await;
        self.shared.registry.with_slot(self.key.as_bytes(), |slot| {
            slot.state.running = false;
            slot.state.until = until;
        });
        self.set_active(false);
    }

    /// Ends the current run without running it: `result` goes to its callers
    /// and the key sits in a window that is already over.
    fn finish_without_run(&mut self, result: Result<T, Error>) {
        drop(self.job.take());
        let now = Instant::now();
        self.shared.registry.with_slot(self.key.as_bytes(), |slot| {
            slot.state.running = false;
            slot.state.until = now;
        });
        self.set_active(false);
        if let Some(waiters) = self.waiters.take() {
            waiters.publish(result);
        }
    }

    /// Another instance holds the window: fold this run into the pending one
    /// and retry after `wait`, or give up after too many losses in a row.
    fn lose(&mut self, wait: std::time::Duration) {
        self.lost_races += 1;
        let until = Instant::now() + wait;
        tracing::debug!(throttle = %self.shared.name, key = %self.key, lost = self.lost_races, ?wait, "window race lost");
        if self.lost_races >= MAX_LOST_RACES {
            self.lost_races = 0;
            let error = Error::Discarded {
                key: shown(&self.key),
                reason: "lost the window race 10 times in a row",
            };
            let dropped = self
                .shared
                .registry
                .with_slot(self.key.as_bytes(), |slot| {
                    slot.state.running = false;
                    slot.state.until = until;
                    slot.state.pending.take()
                })
                .flatten();
            self.set_active(false);
            if let Some(pending) = dropped {
                self.shared.gauges.pending.fetch_sub(1, Ordering::Relaxed);
                pending.fail(&error);
            }
            drop(self.job.take());
            if let Some(waiters) = self.waiters.take() {
                waiters.publish(Err(error));
            }
            return;
        }
        let mut job = self.job.take();
        let mut waiters = self.waiters.take();
        let gauges = &self.shared.gauges;
        let mut coalesced_lead = None;
        self.shared.registry.with_slot(self.key.as_bytes(), |slot| {
            let state: &mut KeyState<T> = &mut slot.state;
            state.running = false;
            state.until = until;
            match (state.pending.as_mut(), waiters.take()) {
                // The pending function is newer than ours: it wins, our
                // callers ride along.
                (Some(pending), Some(Waiters::Lead(tx))) => {
                    coalesced_lead = Some((tx, pending.cell()));
                }
                (Some(pending), Some(Waiters::Cells(cells))) => {
                    pending.cells.extend(cells);
                }
                (None, Some(w)) => match job.take() {
                    Some(j) => {
                        let pending = match w {
                            Waiters::Lead(tx) => {
                                let mut pending = Pending::new(j, Vec::new());
                                coalesced_lead = Some((tx, pending.cell()));
                                pending
                            }
                            Waiters::Cells(cells) => Pending::new(j, cells),
                        };
                        state.pending = Some(pending);
                        // Counted under the lock, before anyone can take it.
                        gauges.pending.fetch_add(1, Ordering::Relaxed);
                    }
                    None => waiters = Some(w),
                },
                (_, None) => {}
            }
        });
        self.set_active(false);
        if let Some((tx, cell)) = coalesced_lead {
            let _ = tx.send(Led::Coalesced(cell));
        }
        // Only when the slot was gone, which a live process never sees.
        if let Some(waiters) = waiters {
            waiters.publish(Err(self.shared.exit_error(&self.key)));
        }
        drop(job);
    }

    /// Sleeps through the window, then takes the pending trailing run
    /// (`true`) or closes the key (`false`).
    async fn next_run(&mut self) -> bool {
        loop {
            let mode = self.shared.mode();
            if mode == DESTROYED {
                return false;
            }
            let now = Instant::now();
            let step = self.shared.registry.with_slot(self.key.as_bytes(), |slot| {
                let state = &mut slot.state;
                // While draining, a window with nothing pending protects nothing.
                let idle_drain = mode == DRAINING && state.pending.is_none();
                if now < state.until && !idle_drain {
                    return Step::Sleep(state.until);
                }
                match state.pending.take() {
                    Some(pending) => {
                        state.running = true;
                        Step::Run(pending)
                    }
                    None => Step::Close,
                }
            });
            match step {
                None => return false,
                Some(Step::Sleep(until)) => self.shared.nap(until, mode).await,
                Some(Step::Close) => {
                    let closed =
                        self.shared
                            .registry
                            .remove_if(self.key.as_bytes(), self.generation, |s| {
                                s.pending.is_none()
                            });
                    if closed.is_some() {
                        self.closed = true;
                        tracing::debug!(throttle = %self.shared.name, key = %self.key, "window closed");
                        return false;
                    }
                    // A call arrived since: go round and take it.
                }
                Some(Step::Run(pending)) => {
                    self.shared.gauges.pending.fetch_sub(1, Ordering::Relaxed);
                    self.set_active(true);
                    let (job, cells) = pending.into_job();
                    self.phase = Phase::Trailing;
                    self.job = Some(job);
                    self.waiters = Some(Waiters::Cells(cells));
                    return true;
                }
            }
        }
    }
}

/// Polls the function to the end (never cancelled), extending its lease in
/// the store meanwhile; a panic becomes an error.
///
/// The lease future is boxed only when the function does not finish on its
/// first poll, so instant functions and idle windows don't pay for it.
async fn run_job<T: Clone + Send + Sync + 'static>(
    shared: &Shared<T>,
    key: &str,
    job: Job<T>,
    phase: Phase,
) -> Result<T, Error> {
    let mut run = catch_panic(job(phase));
    let first = std::future::poll_fn(|cx| Poll::Ready(Pin::new(&mut run).poll(cx))).await;
    let caught = match first {
        Poll::Ready(out) => out,
        Poll::Pending => {
            let mut lease = Box::pin(shared.hold_lease(key));
            let mut leasing = true;
            loop {
                tokio::select! {
                    biased;
                    out = &mut run => break out,
                    () = &mut lease, if leasing => leasing = false,
                }
            }
        }
    };
    Error::from_run(key, caught)
}

impl<T: Clone + Send + Sync + 'static> Drop for Driver<T> {
    fn drop(&mut self) {
        let shared = Arc::clone(&self.shared);
        self.set_active(false);
        drop(self.job.take());
        let left = if self.closed {
            None
        } else {
            shared
                .registry
                .remove_if(self.key.as_bytes(), self.generation, |_| true)
        };
        if self.waiters.is_some() || left.as_ref().is_some_and(|s| s.pending.is_some()) {
            let error = shared.exit_error(&self.key);
            if let Some(waiters) = self.waiters.take() {
                waiters.publish(Err(error.clone()));
            }
            if let Some(pending) = left.and_then(|s| s.pending) {
                shared.gauges.pending.fetch_sub(1, Ordering::Relaxed);
                pending.fail(&error);
            }
        }
        if shared.gauges.live.fetch_sub(1, Ordering::AcqRel) == 1 {
            shared.gauges.idle.notify_waiters();
        }
    }
}
