//! The per-key process: owns a key's work while it has a run to claim or
//! execute.
//!
//! One per busy key under the runtime's partitioned supervisor: a leading
//! run's process is driven in its caller's task until the caller has its
//! outcome (then what is left moves into a tokio task of its own); a
//! trailing run's process is a tokio task the sleeper starts. It claims the
//! window in the store, takes the key's next run
//! from the slot (from that instant on, new calls go to the following run),
//! runs it (holding a lease), publishes the result and records the window.
//! Then it exits, leaving the window in the slot as a timestamp: if a
//! trailing run is pending, the throttle's sleeper starts the key's next
//! process when the window ends (a process retrying a lost window race
//! keeps its own timer, to count its losses). A window that is over with
//! nothing pending closes the key with a generation-gated
//! compare-and-remove, so a call that races the exit is never lost.

use std::future::Future;
use std::pin::Pin;
use std::sync::Arc;
use std::sync::atomic::Ordering;
use std::task::Poll;

use throttlebeam_supervisors::{Generation, catch_panic};
use tokio::time::Instant;

use super::Phase;
use super::sleeper::Wakeup;
use super::state::{
    DESTROYED, DRAINING, Decision, Job, Leading, Shared, Stale, Submitted, UserFn, Waiters,
};
use crate::error::Error;
use crate::key::{InlineKey, shown};

/// Lost window races in a row after which pending calls are dropped.
const MAX_LOST_RACES: u32 = 10;

enum Step {
    /// Retrying a lost window race: this process keeps count and waits.
    Sleep(Instant),
    /// A run is pending inside the window: the sleeper takes over.
    Schedule(Instant),
    Claim,
    /// Window open, nothing pending: leave it as a timestamp.
    Release,
    Close,
}

/// A key's process. Dropping it on any path (normal exit, panic, a start
/// that failed, a runtime torn down) releases the key: the slot of its own
/// incarnation is removed and callers still waiting get an error.
pub(super) struct Driver<T: Clone + Send + Sync + 'static> {
    shared: Arc<Shared<T>>,
    /// Inline for the keys most users have: no allocation per run.
    key: InlineKey,
    generation: Generation,
    epoch: u32,
    active: bool,
    /// The callers of the run in progress, until they are told.
    waiters: Option<Waiters<T>>,
    lost_races: u32,
    /// The slot was handed back (idle window) or removed (closed).
    released: bool,
    /// The end of the window a finished run recorded, written into the
    /// slot by the next look at it (`next_run`): the slot is busy until
    /// then, and nothing reads the end of a busy slot.
    window_until: Option<Instant>,
}

impl<T: Clone + Send + Sync + 'static> Driver<T> {
    /// A process for `key`'s slot incarnation `epoch`; counted live (and
    /// active if it claims at once) from here, before it is spawned.
    pub(super) fn new(
        shared: Arc<Shared<T>>,
        key: &str,
        generation: Generation,
        epoch: u32,
        active: bool,
    ) -> Self {
        shared.gauges.live.fetch_add(1, Ordering::AcqRel);
        if active {
            shared.gauges.active.add(1);
        }
        Self {
            shared,
            key: InlineKey::new(key),
            generation,
            epoch,
            active,
            waiters: None,
            lost_races: 0,
            released: false,
            window_until: None,
        }
    }

    /// Runs a leading run that started as its call was taken (no store:
    /// nothing to claim, nothing in the slot to take) and resolves with its
    /// result, once its window is in the slot. Driven by the caller.
    pub(super) async fn lead<J: UserFn<T>>(
        mut self,
        job: J,
        caller: Option<tokio::task::Id>,
    ) -> Result<T, Error> {
        let phase = Phase::Leading;
        self.shared.gauges.leading_runs.incr();
        tracing::debug!(throttle = %self.shared.name, key = %self.key.as_str(), ?phase, "run started");
        // No lease to hold: the slot stays busy while it runs.
        let result = Error::from_run(self.key.as_str(), catch_panic(job.start(phase)).await);
        // Driven by its caller until the caller leaves: then the rest runs
        // in a task of its own.
        self.finished(&result, phase, tokio::task::try_id() == caller);
        // No store: the window is a timestamp in the slot, written now.
        self.window_until = Some(self.shared.window_end());
        self.set_active(false);
        if !matches!(self.next_step(), Next::Done) {
            // Not done with the key (it cannot be, with a window just
            // opened and no race to lose, but the slot has the last word):
            // the rest goes on in a process of its own, so this caller has
            // its result now.
            let shared = self.shared.clone();
            let key = self.key.clone();
            let _ = shared
                .runtime
                .core
                .start_process(key.as_str(), self.drive(false));
        }
        result
    }

    /// Claims and runs at once (`claim_first`), or first waits for the
    /// window of a key whose last run already ended.
    pub(super) async fn drive(mut self, claim_first: bool) {
        if !claim_first && !self.next_run().await {
            return;
        }
        loop {
            self.set_active(true);
            let token = self.shared.token();
            let claim = self.shared.claim(self.key.as_str(), token).await;
            if self.shared.mode() == DESTROYED {
                // Destroyed before the function started: `destroy` failed
                // the run's callers; dropping releases the slot.
                return;
            }
            match claim {
                Ok(()) => {
                    self.lost_races = 0;
                    self.execute(token).await;
                }
                Err(wait) => self.lose(wait),
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
                gauge.add(1);
            } else {
                gauge.sub(1);
            }
        }
    }

    /// Starts the key's next run (taking it from the slot: calls from now on
    /// are covered by the run after it), runs it, publishes the result,
    /// then records the window that starts at its end.
    async fn execute(&mut self, token: u64) {
        let epoch = self.epoch;
        let taken = self
            .shared
            .registry
            .with_slot(self.key.as_bytes(), |slot| {
                if slot.state.epoch == epoch {
                    slot.state.next.take()
                } else {
                    None
                }
            })
            .flatten();
        let Some(next) = taken else { return };
        let gauges = &self.shared.gauges;
        let phase = if next.is_trailing() {
            gauges.pending.sub(1);
            gauges.trailing_runs.incr();
            Phase::Trailing
        } else {
            gauges.leading_runs.incr();
            Phase::Leading
        };
        let (job, waiters) = next.start();
        self.waiters = Some(waiters);
        tracing::debug!(throttle = %self.shared.name, key = %self.key.as_str(), ?phase, "run started");
        let result = run_job(&self.shared, self.key.as_str(), token, job, phase).await;
        let heard = self.waiters.as_ref().is_some_and(Waiters::heard);
        self.finished(&result, phase, heard);
        if let Some(waiters) = self.waiters.take() {
            waiters.publish(result);
        }
        // Calls arriving until the window is recorded coalesce all the same
        // (the key is busy).
        self.window_until = Some(self.shared.write_window(self.key.as_str(), token).await);
        self.set_active(false);
    }

    /// Logs a run's end: a failed trailing run at error level (nobody may
    /// be waiting for it), a failed leading run whose caller left (`heard`
    /// false) at warn, anything else at debug. A failure nobody heard is
    /// counted.
    fn finished(&self, result: &Result<T, Error>, phase: Phase, heard: bool) {
        if result.is_err() && !heard {
            self.shared.gauges.unobserved_failures.incr();
        }
        match (result, phase) {
            (Err(error), Phase::Trailing) => {
                // As an error value, so subscribers can walk its sources.
                let error: &(dyn std::error::Error + 'static) = error;
                tracing::error!(throttle = %self.shared.name, key = %self.key.as_str(), error, "trailing run failed");
            }
            (Err(error), Phase::Leading) if !heard => {
                let error: &(dyn std::error::Error + 'static) = error;
                tracing::warn!(throttle = %self.shared.name, key = %self.key.as_str(), error, "leading run failed after its caller left");
            }
            _ => {
                tracing::debug!(throttle = %self.shared.name, key = %self.key.as_str(), ?phase, ok = result.is_ok(), "run finished");
            }
        }
    }

    /// Another owner holds the window: the run stays in the slot (a leading
    /// run becomes the trailing one) and is claimed again after `wait`, or
    /// is dropped after too many losses in a row.
    fn lose(&mut self, wait: std::time::Duration) {
        self.lost_races += 1;
        let until = Instant::now() + wait;
        let epoch = self.epoch;
        tracing::debug!(throttle = %self.shared.name, key = %self.key.as_str(), lost = self.lost_races, ?wait, "window race lost");
        let give_up = self.lost_races >= MAX_LOST_RACES;
        if give_up {
            self.lost_races = 0;
        }
        let gauges = &self.shared.gauges;
        let dropped = self
            .shared
            .registry
            .with_slot(self.key.as_bytes(), |slot| {
                let state = &mut slot.state;
                if state.epoch != epoch {
                    return None;
                }
                state.until = until;
                if give_up {
                    let next = state.next.take()?;
                    if next.is_trailing() {
                        gauges.pending.sub(1);
                    }
                    return Some(next);
                }
                if let Some(next) = state.next.as_mut()
                    && next.demote()
                {
                    // Counted under the lock, before anyone can take it.
                    gauges.pending.add(1);
                }
                None
            })
            .flatten();
        self.set_active(false);
        if let Some(next) = dropped {
            next.fail(&Error::Discarded {
                key: shown(self.key.as_str()),
                reason: "lost the window race 10 times in a row",
            });
        }
    }

    /// Sleeps through the window while a run is pending, then claims it
    /// (`true`); otherwise hands the key back as a timestamp or closes it
    /// (`false`).
    async fn next_run(&mut self) -> bool {
        loop {
            match self.next_step() {
                Next::Claim => return true,
                Next::Done => return false,
                Next::Sleep(until, mode) => self.shared.nap(until, mode).await,
            }
        }
    }

    /// One look at the slot for [`Driver::next_run`], without waiting: the
    /// key's next run is to be claimed now, or later (a lost race retried
    /// by this process), or the process is done.
    fn next_step(&mut self) -> Next {
        let epoch = self.epoch;
        let retrying = self.lost_races > 0;
        loop {
            let mode = self.shared.mode();
            if mode == DESTROYED {
                return Next::Done;
            }
            let window_until = self.window_until.take();
            // A window just recorded is open (windows are never zero).
            let now = if window_until.is_some() {
                self.shared.epoch.base
            } else {
                Instant::now()
            };
            let step = self.shared.registry.with_slot(self.key.as_bytes(), |slot| {
                let state = &mut slot.state;
                if state.epoch != epoch {
                    return None;
                }
                if let Some(until) = window_until {
                    state.until = until;
                }
                let open = now < state.until;
                match (&state.next, open) {
                    (Some(_), true) if retrying => Some(Step::Sleep(state.until)),
                    (Some(_), true) => {
                        state.busy = false;
                        state.scheduled = true;
                        Some(Step::Schedule(state.until))
                    }
                    (Some(_), false) => Some(Step::Claim),
                    // While draining, a window with nothing pending protects
                    // nothing: close it.
                    (None, true) if mode != DRAINING => {
                        state.busy = false;
                        Some(Step::Release)
                    }
                    (None, _) => Some(Step::Close),
                }
            });
            match step.flatten() {
                None => {
                    // The slot is not ours any more.
                    self.released = true;
                    return Next::Done;
                }
                Some(Step::Sleep(until)) => return Next::Sleep(until, mode),
                Some(Step::Schedule(until)) => {
                    self.released = true;
                    self.shared
                        .schedule(self.key.as_str(), self.generation, epoch, until);
                    return Next::Done;
                }
                Some(Step::Claim) => return Next::Claim,
                Some(Step::Release) => {
                    self.released = true;
                    tracing::trace!(throttle = %self.shared.name, key = %self.key.as_str(), "window open; process released");
                    return Next::Done;
                }
                Some(Step::Close) => {
                    let closed =
                        self.shared
                            .registry
                            .remove_if(self.key.as_bytes(), self.generation, |s| {
                                s.epoch == epoch && s.next.is_none()
                            });
                    if closed.is_some() {
                        self.released = true;
                        tracing::debug!(throttle = %self.shared.name, key = %self.key.as_str(), "window closed");
                        return Next::Done;
                    }
                    // A call arrived since: go round and take it.
                }
            }
        }
    }
}

/// What a process does after a look at its slot.
enum Next {
    Claim,
    /// Retrying a lost race: wait until then (or until the mode moves on
    /// from the one seen), then look again.
    Sleep(Instant, u8),
    Done,
}

/// Polls the function to the end (never cancelled), extending its lease in
/// the store meanwhile; a panic becomes an error.
///
/// The lease future is boxed only when the function does not finish on its
/// first poll, so instant functions don't pay for it.
async fn run_job<T: Clone + Send + Sync + 'static>(
    shared: &Shared<T>,
    key: &str,
    token: u64,
    job: Job<T>,
    phase: Phase,
) -> Result<T, Error> {
    let mut run = catch_panic(job.call(phase));
    let first = std::future::poll_fn(|cx| Poll::Ready(Pin::new(&mut run).poll(cx))).await;
    let caught = match first {
        Poll::Ready(out) => out,
        Poll::Pending => {
            let mut lease = Box::pin(shared.hold_lease(key, token));
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
        self.set_active(false);
        // Borrowed, not cloned: a clone and its drop are two contended
        // writes on the refcount per run.
        let shared = &self.shared;
        let epoch = self.epoch;
        let left = if self.released {
            None
        } else {
            shared
                .registry
                .remove_if(self.key.as_bytes(), self.generation, |s| s.epoch == epoch)
        };
        let next = left.and_then(|s| s.next);
        if self.waiters.is_some() || next.is_some() {
            let error = shared.exit_error(self.key.as_str());
            if let Some(waiters) = self.waiters.take() {
                waiters.publish(Err(error.clone()));
            }
            if let Some(next) = next {
                if next.is_trailing() {
                    shared.gauges.pending.sub(1);
                }
                next.fail(&error);
            }
        }
        shared.unlive(1);
    }
}

/// Where the throttle's state hands a key to its process: a decision
/// that leads, or a wake-up that is due, starts a [`Driver`].
impl<T: Clone + Send + Sync + 'static> Shared<T> {
    pub(super) fn settle<J: UserFn<T>>(
        self: &Arc<Self>,
        key: &str,
        decision: Decision<T, J>,
    ) -> Result<Submitted<T>, Error> {
        let core = &self.runtime.core;
        match decision {
            Decision::Refused(error, job) => {
                drop(job);
                Err(error)
            }
            Decision::Coalesced { cell, stale } => {
                // The replaced closure may run user code when dropped: never
                // under the shard lock.
                match stale {
                    Some(Stale::Same(f)) => drop(f),
                    Some(Stale::Boxed(job)) => drop(job),
                    None => {}
                }
                self.gauges.coalesced.incr();
                tracing::trace!(throttle = %self.name, key, "call coalesced");
                Ok(Submitted::Coalesced(cell))
            }
            Decision::Schedule(generation, epoch, at, cell) => {
                self.gauges.coalesced.incr();
                tracing::trace!(throttle = %self.name, key, "call coalesced");
                self.schedule(key, generation, epoch, at);
                Ok(Submitted::Coalesced(cell))
            }
            Decision::Start(generation, epoch, job) => {
                self.gauges.leads.incr();
                let driver = Driver::new(self.clone(), key, generation, epoch, true);
                // The caller's task: the run finishes elsewhere only if the
                // caller left.
                let caller = tokio::task::try_id();
                Ok(Submitted::Started(
                    core.run_here(key, driver.lead(job, caller))?,
                ))
            }
            Decision::Lead(generation, epoch, rx) => {
                self.gauges.leads.incr();
                let driver = Driver::new(self.clone(), key, generation, epoch, true);
                let run = core.run_here(key, driver.drive(true))?;
                Ok(Submitted::Lead(Leading {
                    told: rx,
                    run: Some(run),
                }))
            }
        }
    }

    /// Starts the process of a scheduled key, if its slot is still the one
    /// that was scheduled.
    pub(super) fn fire(self: &Arc<Self>, wakeup: Wakeup) {
        let Wakeup {
            key,
            generation,
            epoch,
            ..
        } = wakeup;
        let started = self
            .registry
            .with_slot(key.as_bytes(), |slot| {
                let same = slot.generation() == generation;
                let state = &mut slot.state;
                let ours = same && state.epoch == epoch && state.scheduled;
                if ours {
                    state.scheduled = false;
                    state.busy = true;
                }
                ours
            })
            .unwrap_or(false);
        if started {
            let key = key.as_str();
            let driver = Driver::new(self.clone(), key, generation, epoch, false);
            // On failure the driver is dropped: it releases the slot and
            // fails the callers.
            let _ = self.runtime.core.start_process(key, driver.drive(false));
        }
    }
}
