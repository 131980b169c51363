//! The cancellation harness (SCENARIOS S15, issue 30 item 15): drives a
//! future for at most `k` polls, then drops it, for every `k` until the
//! future finishes on its own.
//!
//! A poll is counted only where the future really waited: after a pending
//! poll the harness polls again only once the future's waker fired (on
//! paused tokio time the clock runs forward to the future's next timer by
//! itself, deterministically). So cut `k` drops the future at its `k`-th
//! await point that suspended, and `k = 0` drops it unpolled.
//!
//! Each test builds one case per cut (`for_every_cut`), usually on a fresh
//! key of one runtime, and checks the invariants after the drop: the next
//! call on the key completes with the right outcome, nothing ran twice, the
//! gauges return to zero and the breaker is closed.

use std::future::Future;
use std::pin::pin;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Arc, Mutex};
use std::task::{Context, Poll, Wake, Waker};
use std::time::Duration;

/// What became of a future cut after `k` polls.
#[derive(Debug)]
pub enum Cut<T> {
    /// It finished within its polls: its output and the polls it took.
    Finished(T, usize),
    /// It was still pending after its `k`-th poll (or never polled, for
    /// `k = 0`) and was dropped.
    Dropped,
}

impl<T> Cut<T> {
    /// Whether the future finished on its own.
    pub fn finished(&self) -> bool {
        matches!(self, Cut::Finished(..))
    }

    /// The output of a future that finished; panics on a dropped one.
    pub fn output(self) -> T {
        match self {
            Cut::Finished(output, _) => output,
            Cut::Dropped => panic!("the future was dropped, it has no output"),
        }
    }
}

/// The waker the cut future is polled with: it records that the future
/// asked to be polled again and wakes the harness's own task.
#[derive(Default)]
struct Flag {
    woken: AtomicBool,
    harness: Mutex<Option<Waker>>,
}

impl Wake for Flag {
    fn wake(self: Arc<Self>) {
        self.wake_by_ref();
    }

    fn wake_by_ref(self: &Arc<Self>) {
        self.woken.store(true, Ordering::SeqCst);
        if let Some(waker) = self.harness.lock().unwrap().take() {
            waker.wake();
        }
    }
}

/// Polls `fut` at most `k` times and drops it if it is still pending.
///
/// After each pending poll, waits (up to `patience`, on tokio time: paused
/// or real) for the future's waker before polling again; a future nobody
/// wakes within `patience` is a hang, and the test fails naming the poll.
pub async fn cut_after<F: Future>(fut: F, k: usize, patience: Duration) -> Cut<F::Output> {
    cut_lingering(fut, k, patience, Duration::ZERO).await
}

/// [`cut_after`], but the future is dropped only `linger` after its `k`-th
/// poll: meanwhile other tasks run, so a request it sent reaches its server
/// and its answer may come back, unread (the future is not polled again).
/// On a real server that is how a call is done there with nobody told.
pub async fn cut_lingering<F: Future>(
    fut: F,
    k: usize,
    patience: Duration,
    linger: Duration,
) -> Cut<F::Output> {
    let mut fut = pin!(fut);
    if let Some((output, polls)) = poll_at_most(fut.as_mut(), k, patience).await {
        return Cut::Finished(output, polls);
    }
    if k > 0 && !linger.is_zero() {
        tokio::time::sleep(linger).await;
    }
    Cut::Dropped
}

/// Polls `fut` up to `k` times, each after a wake-up; its output and the
/// polls it took, if it finished.
async fn poll_at_most<F: Future>(
    mut fut: std::pin::Pin<&mut F>,
    k: usize,
    patience: Duration,
) -> Option<(F::Output, usize)> {
    let flag = Arc::new(Flag::default());
    let waker = Waker::from(Arc::clone(&flag));
    for poll in 1..=k {
        flag.woken.store(false, Ordering::SeqCst);
        if let Poll::Ready(output) = fut.as_mut().poll(&mut Context::from_waker(&waker)) {
            return Some((output, poll));
        }
        if poll == k {
            break;
        }
        let woken = std::future::poll_fn(|cx| {
            *flag.harness.lock().unwrap() = Some(cx.waker().clone());
            if flag.woken.load(Ordering::SeqCst) {
                Poll::Ready(())
            } else {
                Poll::Pending
            }
        });
        if tokio::time::timeout(patience, woken).await.is_err() {
            panic!("the future was never woken after its poll {poll} (waited {patience:?})");
        }
    }
    None
}

/// Runs `case(k)` for `k = 0, 1, 2, …` until a case's future finishes
/// within its `k` polls (the case returns whether it did), and returns that
/// `k`: the polls the operation takes when nobody drops it.
///
/// Fails if the operation needs more than `max` polls, or fewer than
/// `at_least` (a future that never waits would test nothing here).
pub async fn for_every_cut<C>(
    at_least: usize,
    max: usize,
    mut case: impl FnMut(usize) -> C,
) -> usize
where
    C: Future<Output = bool>,
{
    for k in 0..=max {
        if case(k).await {
            assert!(
                k >= at_least,
                "the operation finished within {k} polls: expected it to wait at least {at_least} times"
            );
            return k;
        }
    }
    panic!("the operation was still pending after {max} polls");
}

/// Waits (on tokio time, paused or real) until `done` holds, checking every
/// `every`, for at most `within`; fails naming `what` otherwise.
pub async fn eventually(
    what: &str,
    within: Duration,
    every: Duration,
    mut done: impl FnMut() -> bool,
) {
    let deadline = tokio::time::Instant::now() + within;
    while !done() {
        assert!(
            tokio::time::Instant::now() < deadline,
            "{what}: not within {within:?}"
        );
        tokio::time::sleep(every).await;
    }
}
