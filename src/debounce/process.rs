//! A debounced key's process: owns the key's timer, runs its functions,
//! and releases the key when it exits.

use std::sync::Arc;
use std::sync::atomic::Ordering;

use tokio::sync::Notify;
use tokio::time::Instant;

use super::*;

enum Step {
    Run(Pending),
    Sleep(Instant, Arc<Notify>),
    TryExit,
    Gone,
}

/// A key's process: owns the key's timer and runs its functions.
///
/// Dropping it on any path (normal exit, panic, a start that failed, its
/// tokio runtime ending) releases the key: the slot of its own generation is
/// removed, and callers still waiting get [`Error::Discarded`], so the next
/// call starts afresh instead of joining a key nobody serves.
pub(super) struct Driver {
    pub(super) state: Arc<State>,
    pub(super) key: Arc<str>,
    pub(super) generation: Generation,
    /// A leading run not started yet.
    pub(super) leading: Option<Pending>,
    /// The result cell of the run executing now.
    pub(super) running: Option<Cell>,
    /// The slot is gone (removed by the idle exit, or replaced).
    pub(super) done: bool,
}

impl Driver {
    pub(super) async fn run(mut self) {
        if let Some(run) = self.leading.take() {
            self.execute(run).await;
        }
        let state = Arc::clone(&self.state);
        loop {
            let now = Instant::now();
            let closing = state.closing.load(Ordering::Acquire);
            let mut dropped = None;
            let step = state
                .registry
                .with_slot(self.key.as_bytes(), |slot| {
                    if slot.generation() != self.generation {
                        return Step::Gone;
                    }
                    let s = &mut slot.state;
                    match closing {
                        CLOSING_DROP => {
                            dropped = s.pending.take();
                            return Step::TryExit;
                        }
                        CLOSING_FLUSH => s.flush = true,
                        _ => {}
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
                        None if closing != OPEN || now >= s.deadline => Step::TryExit,
                        None => {
                            // A leading run's quiet window: keep the key until it passes.
                            s.armed = Some(s.deadline);
                            Step::Sleep(s.deadline, Arc::clone(&s.wake))
                        }
                    }
                })
                .unwrap_or(Step::Gone);
            // Outside the shard lock: the user's function is dropped here.
            if let Some(p) = dropped {
                state.settle(p.joined);
                p.cell.discard("dropped at shutdown");
                state.failed.incr();
            }
            match step {
                Step::Run(run) => self.execute(run).await,
                Step::Sleep(until, wake) => {
                    let _timer = TimerGuard::arm(&state.counters);
                    tokio::select! {
                        () = tokio::time::sleep_until(until) => {}
                        () = wake.notified() => {}
                    }
                    state.wakeups.fetch_add(1, Ordering::Relaxed);
                }
                Step::TryExit => {
                    if state
                        .registry
                        .remove_if(self.key.as_bytes(), self.generation, |s| {
                            s.pending.is_none()
                        })
                        .is_some()
                    {
                        self.done = true;
                        return;
                    }
                }
                Step::Gone => {
                    self.done = true;
                    return;
                }
            }
        }
    }

    async fn execute(&mut self, run: Pending) {
        let Pending { job, cell, joined } = run;
        self.state.settle(joined);
        let job = job.into_inner();
        self.state.runs.incr();
        self.running = Some(Arc::clone(&cell));
        let result = match catch_panic(job(Arc::clone(&self.key))).await {
            Ok(result) => result,
            Err(panic) => Err(Error::panicked(&self.key, &panic)),
        };
        if let Err(error) = &result {
            self.state.failed.incr();
            // Nobody holds a `Debounced` for this run: nobody else will see it.
            let error: &(dyn std::error::Error + 'static) = error;
            if Arc::strong_count(&cell) <= 2 {
                tracing::warn!(key = %shown(&self.key), error, "debounced function failed and nobody awaited it");
            } else {
                tracing::debug!(key = %shown(&self.key), error, "debounced function failed");
            }
        }
        self.running = None;
        cell.set(result);
    }
}

impl Drop for Driver {
    fn drop(&mut self) {
        let left = if self.done {
            None
        } else {
            self.state
                .registry
                .remove_if(self.key.as_bytes(), self.generation, |_| true)
        };
        // Outside the shard lock: user functions are dropped here.
        let left = left.and_then(|s| s.pending).map(|p| {
            self.state.settle(p.joined);
            p.cell
        });
        let lost = [
            self.leading.take().map(|p| p.cell),
            self.running.take(),
            left,
        ];
        for cell in lost.into_iter().flatten() {
            if cell.discard("its process was lost") {
                self.state.failed.incr();
            }
        }
    }
}
