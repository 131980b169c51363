//! A key's shared process: the driver that tells Redis about local calls,
//! fires the bursts this instance owns and watches over the others.

use std::sync::Arc;
use std::sync::atomic::Ordering;
use std::time::Duration;

use throttlebeam_supervisors::{Generation, TimerGuard, catch_panic};
use tokio::sync::Notify;
use tokio::time::Instant;

use super::codec::{LOST, encode_error};
use super::{GRACE, Shared, SharedJob, Slot};
use crate::debounce::redis::{BurstNotice, BurstState, RUN_LEASE};
use crate::debounce::{
    BoxedJob, CLOSING_DROP, CLOSING_FLUSH, Cell, DebounceHandle, DebounceOptions, OPEN, State,
};
use crate::error::Error;
use crate::key::shown;

enum Step {
    /// Tell Redis about the unsent calls.
    Send {
        call: String,
        cell: Cell,
        delay: Duration,
        options: DebounceOptions,
        /// A leading call's function, taken out in case it runs now.
        leading: Option<SharedJob>,
    },
    Fire {
        burst: Arc<str>,
        generation: u64,
        force: bool,
        max_wait: Option<Duration>,
    },
    /// Ask where a burst stands; `rescue` it if its owner left it overdue
    /// and this instance has a function to run for it.
    Probe {
        burst: Arc<str>,
        rescue: bool,
        max_wait: Option<Duration>,
    },
    Sleep(Option<Instant>, Arc<Notify>),
    TryExit,
    Gone,
}

/// A key's shared process: tells Redis about local calls, fires the bursts
/// this instance owns, and watches over the ones it waits for.
pub(super) struct Driver {
    pub(super) handle: DebounceHandle,
    pub(super) shared: Arc<Shared>,
    pub(super) key: Arc<str>,
    pub(super) generation: Generation,
    pub(super) done: bool,
    /// Cells this process holds outside the slot (a call script or a run
    /// in flight): failed if it is dropped before it settles them.
    pub(super) held: Vec<Cell>,
}

impl Driver {
    fn state(&self) -> &State {
        &self.handle.state
    }

    pub(super) async fn run(mut self) {
        // Subscribes if the first shared call came from outside tokio.
        self.shared.store.subscribe();
        loop {
            let now = Instant::now();
            let closing = self.state().closing.load(Ordering::Acquire);
            let mut dropped = Vec::new();
            let mut dropped_job = None;
            let step = self
                .shared
                .registry
                .with_slot(self.key.as_bytes(), |slot| {
                    if slot.generation() != self.generation {
                        return Step::Gone;
                    }
                    let s = &mut slot.state;
                    match closing {
                        OPEN => {}
                        CLOSING_DROP => {
                            dropped.extend(s.unsent.take());
                            dropped.extend(s.waiting.drain(..).map(|(_, c)| c));
                            s.owner = None;
                            dropped_job = s.job().take();
                            return Step::TryExit;
                        }
                        CLOSING_FLUSH => s.flush = true,
                        _ => {}
                    }
                    if let Some(cell) = s.unsent.take() {
                        let seq = self.shared.seq.fetch_add(1, Ordering::Relaxed);
                        return Step::Send {
                            call: format!("{}.{seq:x}", self.shared.instance),
                            cell,
                            delay: s.delay,
                            options: s.options,
                            leading: if s.options.leading() {
                                s.job().take()
                            } else {
                                None
                            },
                        };
                    }
                    let due = s.due.is_some_and(|d| now >= d);
                    if let Some((burst, generation)) = &s.owner
                        && (due || s.flush)
                    {
                        return Step::Fire {
                            burst: Arc::clone(burst),
                            generation: *generation,
                            force: s.flush,
                            max_wait: s.options.max_wait(),
                        };
                    }
                    if let Some((burst, _)) = s.waiting.first()
                        && due
                    {
                        let burst = Arc::clone(burst);
                        return Step::Probe {
                            burst,
                            rescue: s.job().is_some(),
                            max_wait: s.options.max_wait(),
                        };
                    }
                    if s.idle() {
                        return Step::TryExit;
                    }
                    Step::Sleep(s.due, Arc::clone(&s.wake))
                })
                .unwrap_or(Step::Gone);
            // Outside the shard lock: the user's function is dropped here.
            drop(dropped_job);
            for cell in dropped {
                if cell.discard("dropped at shutdown") {
                    self.state().failed.incr();
                }
            }
            match step {
                Step::Send {
                    call,
                    cell,
                    delay,
                    options,
                    leading,
                } => self.send(&call, cell, delay, options, leading).await,
                Step::Fire {
                    burst,
                    generation,
                    force,
                    max_wait,
                } => {
                    let fired = self
                        .shared
                        .store
                        .burst_fire(
                            &self.key,
                            &self.shared.instance,
                            &burst,
                            generation,
                            force,
                            max_wait,
                            None,
                        )
                        .await;
                    self.found(&burst, fired).await;
                }
                Step::Probe {
                    burst,
                    rescue,
                    max_wait,
                } => {
                    let probed = if rescue {
                        self.shared
                            .store
                            .burst_fire(
                                &self.key,
                                &self.shared.instance,
                                &burst,
                                0,
                                false,
                                max_wait,
                                Some(GRACE / 2),
                            )
                            .await
                    } else {
                        self.shared.store.burst_probe(&self.key, &burst).await
                    };
                    self.found(&burst, probed).await;
                }
                Step::Sleep(until, wake) => {
                    let _timer = TimerGuard::arm(&self.state().counters);
                    match until {
                        Some(until) => tokio::select! {
                            () = tokio::time::sleep_until(until) => {}
                            () = wake.notified() => {}
                        },
                        None => wake.notified().await,
                    }
                    self.state().wakeups.fetch_add(1, Ordering::Relaxed);
                }
                Step::TryExit => {
                    if self
                        .shared
                        .registry
                        .remove_if(self.key.as_bytes(), self.generation, Slot::idle)
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

    /// Tells Redis about a batch of local calls; on failure hands them to
    /// this instance's in-process debounce.
    async fn send(
        &mut self,
        call: &str,
        cell: Cell,
        delay: Duration,
        options: DebounceOptions,
        leading: Option<SharedJob>,
    ) {
        self.held.push(Arc::clone(&cell));
        let joined = self
            .shared
            .store
            .burst_call(
                &self.key,
                &self.shared.instance,
                call,
                delay,
                options.max_wait(),
                options.leading(),
            )
            .await;
        let now = Instant::now();
        self.held.clear();
        match joined {
            Ok(joined) => {
                let burst: Arc<str> = Arc::from(joined.burst);
                let mut run_now = None;
                let mut dropped = None;
                let kept = self.shared.registry.with_slot(self.key.as_bytes(), |slot| {
                    if slot.generation() != self.generation {
                        return false;
                    }
                    let s = &mut slot.state;
                    match leading {
                        Some(job) if joined.opened => run_now = Some(job),
                        Some(job) => {
                            // Not the first call of the burst: it is the
                            // latest function unless a newer one came.
                            if s.job().is_none() {
                                *s.job() = Some(job);
                            } else {
                                dropped = Some(job);
                            }
                        }
                        None => {}
                    }
                    if run_now.is_none() {
                        s.waiting.push((Arc::clone(&burst), Arc::clone(&cell)));
                    }
                    s.owner = Some((Arc::clone(&burst), joined.generation));
                    s.due = Some(now + joined.left);
                    true
                });
                drop(dropped);
                if kept != Some(true) {
                    // The key was reset meanwhile: nobody will settle these calls.
                    cell.discard("the runtime restarted");
                    return;
                }
                if let Some(job) = run_now {
                    // The leading edge: this round trip's calls run now, here.
                    self.execute(Some(job), vec![cell], None).await;
                }
            }
            Err(error) => {
                tracing::warn!(key = %shown(&self.key), %error, "debounce: Redis unreachable; debouncing on this instance");
                // Everything waiting here goes local with the latest function.
                let (job, mut cells) = self
                    .shared
                    .registry
                    .with_slot(self.key.as_bytes(), |slot| {
                        let s = &mut slot.state;
                        s.owner = None;
                        s.flush = false;
                        let cells: Vec<Cell> = s.waiting.drain(..).map(|(_, c)| c).collect();
                        (s.job().take(), cells)
                    })
                    .unwrap_or_default();
                cells.push(cell);
                self.fall_back(job.or(leading), cells, delay, options);
            }
        }
    }

    /// Hands calls to the in-process debounce of this runtime.
    fn fall_back(
        &self,
        job: Option<SharedJob>,
        cells: Vec<Cell>,
        delay: Duration,
        options: DebounceOptions,
    ) {
        let type_id = self
            .shared
            .registry
            .read(self.key.as_bytes(), |slot| slot.state.type_id);
        let (Some(job), Some(type_id)) = (job, type_id) else {
            for cell in cells {
                cell.discard(LOST);
            }
            return;
        };
        let local: BoxedJob = Box::new(move |key: Arc<str>| {
            Box::pin(async move { job(key).await.map(|(value, _)| value) })
        });
        match self
            .handle
            .schedule(&self.key, delay, options, local, type_id)
        {
            Ok(local) => {
                tokio::spawn(async move {
                    let result = local.result.wait().await;
                    for cell in cells {
                        cell.set(result.clone());
                    }
                });
            }
            Err(e) => {
                for cell in cells {
                    cell.set(Err(e.clone()));
                }
            }
        }
    }

    /// Acts on where a burst stands (after a fire attempt or a probe).
    async fn found(
        &mut self,
        burst: &Arc<str>,
        state: Result<BurstState, crate::store::StoreError>,
    ) {
        let now = Instant::now();
        match state {
            Ok(BurstState::Fired) => {
                let (job, cells) = self
                    .shared
                    .registry
                    .with_slot(self.key.as_bytes(), |slot| {
                        let s = &mut slot.state;
                        s.flush = false;
                        let cells = s.settle(burst);
                        (s.job().take(), cells)
                    })
                    .unwrap_or_default();
                self.execute(job, cells, Some(burst)).await;
            }
            Ok(BurstState::Quiet) => {
                // Only a leading call was in it, and it has run already:
                // nobody waits on the burst itself.
                for cell in self.settle(burst) {
                    cell.discard(LOST);
                }
            }
            Ok(BurstState::Wait(left)) => self.rearm(now + left),
            Ok(BurstState::Open(left)) => {
                // Probed a grace after the deadline: a live owner fired long
                // ago, so half a grace overdue means it is gone (and this
                // instance had no function to rescue the burst with).
                let overdue = left.unsigned_abs();
                if left < 0 && Duration::from_millis(overdue) >= GRACE / 2 {
                    self.lost(burst);
                } else {
                    let left = Duration::from_millis(u64::try_from(left.max(0)).unwrap_or(0));
                    self.shared.registry.with_slot(self.key.as_bytes(), |slot| {
                        let s = &mut slot.state;
                        if s.owner.as_ref().is_some_and(|(b, _)| b == burst) {
                            s.owner = None;
                        }
                        s.flush = false;
                        s.due = Some(now + left + GRACE);
                    });
                }
            }
            Ok(BurstState::Running(left)) => {
                self.shared.registry.with_slot(self.key.as_bytes(), |slot| {
                    let s = &mut slot.state;
                    if s.owner.as_ref().is_some_and(|(b, _)| b == burst) {
                        s.owner = None;
                    }
                    s.flush = false;
                    s.due = Some(now + left + GRACE / 4);
                });
            }
            Ok(BurstState::Done(notice)) => match BurstNotice::parse(&notice) {
                Some(notice) => self.shared.apply(&self.key, burst, &notice.kind),
                None => self.lost(burst),
            },
            Ok(BurstState::Gone) => self.lost(burst),
            Err(error) => {
                tracing::warn!(key = %shown(&self.key), %error, "debounce: Redis unreachable; running here for this instance's calls");
                let (job, cells) = self
                    .shared
                    .registry
                    .with_slot(self.key.as_bytes(), |slot| {
                        let s = &mut slot.state;
                        s.owner = None;
                        s.flush = false;
                        let cells: Vec<Cell> = s.waiting.drain(..).map(|(_, c)| c).collect();
                        (s.job().take(), cells)
                    })
                    .unwrap_or_default();
                self.execute(job, cells, None).await;
            }
        }
    }

    fn rearm(&self, at: Instant) {
        self.shared.registry.with_slot(self.key.as_bytes(), |slot| {
            slot.state.due = Some(at);
        });
    }

    fn settle(&self, burst: &str) -> Vec<Cell> {
        let mut dropped = None;
        let cells = self
            .shared
            .registry
            .with_slot(self.key.as_bytes(), |slot| {
                let s = &mut slot.state;
                let cells = s.settle(burst);
                if s.idle() {
                    dropped = s.job().take();
                }
                cells
            })
            .unwrap_or_default();
        drop(dropped);
        cells
    }

    /// The burst's owner is gone without a result.
    fn lost(&self, burst: &str) {
        let cells = self.settle(burst);
        if !cells.is_empty() {
            tracing::warn!(key = %shown(&self.key), "debounce: the instance owning a burst was lost; its callers here get an error");
        }
        for cell in cells {
            if cell.discard(LOST) {
                self.state().failed.incr();
            }
        }
    }

    /// Runs the function for `cells`; publishes the outcome for the other
    /// instances when this run fired `burst`, renewing its lease meanwhile.
    async fn execute(
        &mut self,
        job: Option<SharedJob>,
        cells: Vec<Cell>,
        burst: Option<&Arc<str>>,
    ) {
        self.held.extend(cells.iter().cloned());
        self.state().runs.incr();
        let renewal = burst.map(|burst| {
            let (store, key, burst) = (Arc::clone(&self.shared.store), Arc::clone(&self.key), Arc::clone(burst));
            AbortOnDrop(tokio::spawn(async move {
                loop {
                    tokio::time::sleep(RUN_LEASE / 3).await;
                    if let Err(error) = store.burst_renew(&key, &burst).await {
                        tracing::debug!(key = %shown(&key), %error, "debounce: lease renewal failed");
                    }
                }
            }))
        });
        let result = match job {
            Some(job) => match catch_panic(job(Arc::clone(&self.key))).await {
                Ok(result) => result,
                Err(panic) => Err(Error::panicked(&self.key, &panic)),
            },
            None => Err(Error::Discarded {
                key: shown(&self.key),
                reason: LOST,
            }),
        };
        drop(renewal);
        let wire = match &result {
            Ok((_, bytes)) => bytes.clone(),
            Err(error) => encode_error(error),
        };
        let local = result.map(|(value, _)| value);
        if let Err(error) = &local {
            self.state().failed.incr();
            let error: &(dyn std::error::Error + 'static) = error;
            tracing::debug!(key = %shown(&self.key), error, "debounced function failed");
        }
        for cell in cells {
            cell.set(local.clone());
        }
        self.held.clear();
        if let Some(burst) = burst
            && let Err(error) = self
                .shared
                .store
                .burst_publish(&self.key, burst, wire)
                .await
        {
            tracing::warn!(key = %shown(&self.key), %error, "debounce: could not publish a run's outcome; waiters elsewhere fall back");
        }
    }
}

/// Stops a lease renewal when the run ends, however it ends.
struct AbortOnDrop(tokio::task::JoinHandle<()>);

impl Drop for AbortOnDrop {
    fn drop(&mut self) {
        self.0.abort();
    }
}

impl Drop for Driver {
    fn drop(&mut self) {
        for cell in std::mem::take(&mut self.held) {
            if cell.discard("its process was lost") {
                self.state().failed.incr();
            }
        }
        if self.done {
            return;
        }
        let left = self
            .shared
            .registry
            .remove_if(self.key.as_bytes(), self.generation, |_| true);
        if let Some(mut slot) = left {
            let lost = slot
                .unsent
                .take()
                .into_iter()
                .chain(slot.waiting.drain(..).map(|(_, c)| c));
            for cell in lost {
                if cell.discard("its process was lost") {
                    self.state().failed.incr();
                }
            }
        }
    }
}
