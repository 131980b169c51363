//! The sleeper's process: schedules a key's next run in the heap of window
//! ends and starts the key's process when it is due.

use std::cmp::Reverse;
use std::sync::Arc;
use std::sync::atomic::Ordering;

use throttlebeam_supervisors::Generation;
use tokio::time::Instant;

use super::sleeper::Wakeup;
use super::state::Shared;
use crate::key::InlineKey;
use crate::stripe::stripe;

/// Holds a sleeper shard's `running` mark for its process. A process that
/// ends without handing the shard back itself (its tokio runtime ended, or
/// it never started) is dropped with wake-ups still in the heap: the guard
/// clears the mark and flags them as orphaned, so the next call or waiter
/// on a live runtime starts a sleeper there ([`Shared::adopt_orphans`]).
struct SleeperGuard<T: Clone + Send + Sync + 'static> {
    shared: Arc<Shared<T>>,
    index: usize,
    /// The process emptied its heap and cleared the mark itself.
    done: bool,
}

impl<T: Clone + Send + Sync + 'static> Drop for SleeperGuard<T> {
    fn drop(&mut self) {
        if self.done {
            return;
        }
        let shared = &self.shared;
        let left = {
            let mut sleeper = shared.sleepers[self.index].lock();
            sleeper.running = false;
            sleeper.heap.len()
        };
        if left > 0 {
            // Flagged after the shard is handed back, so an adopter that
            // sees the flag sees the shard free.
            shared.orphaned.store(true, Ordering::Release);
            shared.adopt.notify_waiters();
            tracing::debug!(throttle = %shared.name, shard = self.index, left, "sleeper ended with wake-ups pending; handed back");
        }
    }
}

impl<T: Clone + Send + Sync + 'static> Shared<T> {
    /// Hands a key whose next run waits for `at` to the sleeper of this
    /// thread's stripe (its slot is marked scheduled): one heap entry,
    /// counted as a timer until it fires.
    pub(super) fn schedule(
        self: &Arc<Self>,
        key: &str,
        generation: Generation,
        epoch: u32,
        at: Instant,
    ) {
        let index = stripe() % self.sleepers.len();
        let shard = &self.sleepers[index];
        let at = self.epoch.nanos(at);
        let (start, earlier) = {
            let mut sleeper = shard.lock();
            let earlier = sleeper.heap.peek().is_some_and(|top| at < top.0.at);
            sleeper.heap.push(Reverse(Wakeup {
                at,
                key: InlineKey::new(key),
                generation,
                epoch,
            }));
            let start = !sleeper.running;
            sleeper.running = true;
            (start, earlier)
        };
        if start {
            self.start_sleeper(index);
        } else if earlier {
            shard.wake.notify_one();
        }
    }

    /// Starts the process of sleeper shard `index` on the caller's tokio
    /// runtime; its shard was just marked running.
    fn start_sleeper(self: &Arc<Self>, index: usize) {
        let guard = SleeperGuard {
            shared: Arc::clone(self),
            index,
            done: false,
        };
        if self
            .runtime
            .core
            .start_process(&self.prefix, Self::sleep_loop(guard))
            .is_err()
        {
            // (The unpolled guard handed the shard back as it was dropped.)
            // No runtime to sleep on: fire now; the processes fail their
            // callers as they cannot start either.
            let shard = &self.sleepers[index];
            let due = {
                let mut sleeper = shard.lock();
                if sleeper.running {
                    // Another caller started a sleeper meanwhile.
                    return;
                }
                let due = std::mem::take(&mut sleeper.heap).into_vec();
                self.gauges.live.fetch_add(due.len(), Ordering::SeqCst);
                due
            };
            self.fire_all(due.into_iter().map(|Reverse(wakeup)| wakeup));
        }
    }

    /// Restarts, on the caller's tokio runtime, the sleepers whose own
    /// runtime ended while they held wake-ups. Costs one load while there
    /// are none; outside a tokio runtime it leaves them to the next caller.
    pub(super) fn adopt_orphans(self: &Arc<Self>) {
        if !self.orphaned.load(Ordering::Acquire)
            || tokio::runtime::Handle::try_current().is_err()
            || !self.orphaned.swap(false, Ordering::AcqRel)
        {
            return;
        }
        for (index, shard) in self.sleepers.iter().enumerate() {
            let start = {
                let mut sleeper = shard.lock();
                let start = !sleeper.running && !sleeper.heap.is_empty();
                sleeper.running |= start;
                start
            };
            if start {
                tracing::debug!(throttle = %self.name, shard = index, "sleeper restarted on this runtime");
                self.start_sleeper(index);
            }
        }
    }

    /// The process of the guard's sleeper shard: starts each scheduled key's
    /// process when its window ends; exits when nothing is scheduled.
    ///
    /// Due wake-ups leave the heap counted as live work (under the shard's
    /// lock, so a drain never sees them in neither place) until their
    /// processes have started.
    async fn sleep_loop(mut guard: SleeperGuard<T>) {
        let this = Arc::clone(&guard.shared);
        let index = guard.index;
        let shard = &this.sleepers[index];
        loop {
            let woken = shard.wake.notified();
            tokio::pin!(woken);
            woken.as_mut().enable();
            let now = this.epoch.nanos(Instant::now());
            let (due, next) = {
                let mut sleeper = shard.lock();
                let mut due = Vec::new();
                while sleeper.heap.peek().is_some_and(|top| top.0.at <= now) {
                    if let Some(Reverse(wakeup)) = sleeper.heap.pop() {
                        due.push(wakeup);
                    }
                }
                if !due.is_empty() {
                    this.gauges.live.fetch_add(due.len(), Ordering::SeqCst);
                }
                let next = sleeper.heap.peek().map(|top| top.0.at);
                if next.is_none() {
                    sleeper.running = false;
                    guard.done = true;
                }
                (due, next)
            };
            this.fire_all(due.into_iter());
            let Some(at) = next else { return };
            tokio::select! {
                () = tokio::time::sleep_until(this.epoch.instant(at)) => {}
                () = woken => {}
            }
        }
    }

    /// Fires wake-ups taken from a heap, which counted them as live work
    /// under its lock; uncounts them once their processes have started.
    fn fire_all(self: &Arc<Self>, due: impl ExactSizeIterator<Item = Wakeup>) {
        let n = due.len();
        for wakeup in due {
            self.fire(wakeup);
        }
        self.unlive(n);
    }
}
