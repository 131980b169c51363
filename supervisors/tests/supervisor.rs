//! Supervisor: live counts, caught panics, graceful shutdown.

mod support;

use std::sync::Arc;
use std::sync::atomic::{AtomicBool, AtomicUsize, Ordering};
use std::time::Duration;

use throttlebeam_supervisors::{StartError, Supervisor};
use tokio::sync::oneshot;
use tokio::time::Instant;

const FAR: Duration = Duration::from_secs(3600);

#[tokio::test(start_paused = true)]
async fn children_are_counted_live_and_back_to_zero() {
    let supervisor = Supervisor::new(2);
    let mut releases = Vec::new();
    for route in 0..5 {
        let (release, wait) = oneshot::channel::<()>();
        releases.push(release);
        supervisor
            .start_child(route, async move {
                let _ = wait.await;
            })
            .unwrap();
    }
    assert_eq!(supervisor.live(), 5);
    support::settle().await;
    assert_eq!(supervisor.live(), 5);

    releases.drain(..2).for_each(|r| r.send(()).unwrap());
    support::settle().await;
    assert_eq!(supervisor.live(), 3);
    releases.drain(..).for_each(|r| r.send(()).unwrap());
    support::settle().await;
    assert_eq!(supervisor.live(), 0);
}

#[tokio::test(start_paused = true)]
async fn a_panicking_child_is_caught_and_others_are_unaffected() {
    let supervisor = Supervisor::new(1);
    let (release, wait) = oneshot::channel::<u32>();
    let (done, finished) = oneshot::channel::<u32>();
    supervisor
        .start_child(0, async move {
            let n = wait.await.unwrap();
            done.send(n + 1).unwrap();
        })
        .unwrap();
    supervisor
        .start_child(0, async { panic!("per-key process failed") })
        .unwrap();
    support::settle().await;
    assert_eq!(supervisor.live(), 1, "the panicked child is gone");

    // The sibling in the same partition still runs to completion.
    release.send(41).unwrap();
    assert_eq!(finished.await.unwrap(), 42);

    // And the supervisor still serves.
    let (done, finished) = oneshot::channel();
    supervisor
        .start_child(0, async move { done.send("served").unwrap() })
        .unwrap();
    assert_eq!(finished.await.unwrap(), "served");
    support::settle().await;
    assert_eq!(supervisor.live(), 0);
}

#[tokio::test(start_paused = true)]
async fn shutdown_waits_until_the_deadline_without_cancelling() {
    let supervisor = Supervisor::new(2);
    let finished = Arc::new(AtomicBool::new(false));
    let flag = finished.clone();
    supervisor
        .start_child(1, async move {
            tokio::time::sleep(Duration::from_secs(10)).await;
            flag.store(true, Ordering::SeqCst);
        })
        .unwrap();

    let start = Instant::now();
    let still_running = supervisor.shutdown(start + Duration::from_secs(3)).await;
    assert_eq!(still_running, 1);
    assert_eq!(start.elapsed(), Duration::from_secs(3));
    assert!(supervisor.is_shut_down());

    // Closed: new children are refused and dropped unpolled.
    let polled = Arc::new(AtomicBool::new(false));
    let mark = polled.clone();
    let refused = supervisor.start_child(0, async move { mark.store(true, Ordering::SeqCst) });
    assert_eq!(refused, Err(StartError::ShutDown));

    // The running child was not cancelled: it finishes on its own time.
    tokio::time::advance(Duration::from_secs(7)).await;
    support::settle().await;
    assert!(finished.load(Ordering::SeqCst));
    assert!(!polled.load(Ordering::SeqCst));
    assert_eq!(supervisor.live(), 0);

    // A second shutdown is harmless and returns at once.
    let again = Instant::now();
    assert_eq!(supervisor.shutdown(again + FAR).await, 0);
    assert_eq!(again.elapsed(), Duration::ZERO);
}

#[tokio::test(start_paused = true)]
async fn shutdown_returns_as_soon_as_the_last_child_exits() {
    let supervisor = Supervisor::new(3);
    for (route, secs) in [(0, 2), (1, 5), (2, 1), (4, 3)] {
        supervisor
            .start_child(route, async move {
                tokio::time::sleep(Duration::from_secs(secs)).await;
            })
            .unwrap();
    }
    let start = Instant::now();
    assert_eq!(supervisor.shutdown(start + FAR).await, 0);
    assert_eq!(start.elapsed(), Duration::from_secs(5));
}

#[tokio::test(start_paused = true)]
async fn shutdown_with_no_children_returns_at_once() {
    let supervisor = Supervisor::new(2);
    let start = Instant::now();
    assert_eq!(supervisor.shutdown(start + FAR).await, 0);
    assert_eq!(start.elapsed(), Duration::ZERO);
    assert_eq!(
        supervisor.start_child(0, async {}),
        Err(StartError::ShutDown)
    );
    assert_eq!(supervisor.live(), 0);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn every_accepted_child_is_waited_for() {
    let supervisor = Supervisor::new(2);
    let accepted = Arc::new(AtomicUsize::new(0));
    let ran = Arc::new(AtomicUsize::new(0));
    let starters: Vec<_> = (0..4u64)
        .map(|task| {
            let (supervisor, accepted, ran) = (supervisor.clone(), accepted.clone(), ran.clone());
            tokio::spawn(async move {
                for i in 0..2_000 {
                    let ran = ran.clone();
                    let child = async move {
                        tokio::task::yield_now().await;
                        ran.fetch_add(1, Ordering::SeqCst);
                    };
                    match supervisor.start_child(task * 10_000 + i, child) {
                        Ok(()) => accepted.fetch_add(1, Ordering::SeqCst),
                        Err(StartError::ShutDown) => break,
                        Err(other) => panic!("unexpected {other}"),
                    };
                    if i % 16 == 0 {
                        tokio::task::yield_now().await;
                    }
                }
            })
        })
        .collect();
    tokio::task::yield_now().await;
    let left = supervisor.shutdown(Instant::now() + FAR).await;
    assert_eq!(left, 0);
    // Every child accepted before the close has run to completion.
    let ran_at_shutdown = ran.load(Ordering::SeqCst);
    for starter in starters {
        starter.await.unwrap();
    }
    assert_eq!(ran_at_shutdown, accepted.load(Ordering::SeqCst));
    assert_eq!(supervisor.live(), 0);
}

#[test]
fn start_child_outside_a_runtime_is_an_error() {
    let supervisor = Supervisor::new(1);
    let polled = Arc::new(AtomicBool::new(false));
    let mark = polled.clone();
    let result = supervisor.start_child(0, async move { mark.store(true, Ordering::SeqCst) });
    assert_eq!(result, Err(StartError::NoRuntime));
    assert!(!polled.load(Ordering::SeqCst));
    assert_eq!(supervisor.live(), 0);
}

#[test]
fn partitions_are_at_least_one() {
    assert_eq!(Supervisor::new(0).partitions(), 1);
    assert_eq!(Supervisor::new(4).partitions(), 4);
}

#[tokio::test(start_paused = true)]
async fn work_run_here_is_counted_and_returns_its_output() {
    let supervisor = Supervisor::new(2);
    let (release, wait) = oneshot::channel::<u32>();
    let run = supervisor
        .run_here(3, async move { wait.await.unwrap() + 1 })
        .unwrap();
    assert_eq!(supervisor.live(), 1);
    release.send(41).unwrap();
    assert_eq!(run.await, 42);
    assert_eq!(supervisor.live(), 0);
}

#[tokio::test(start_paused = true)]
async fn work_run_here_outlives_a_caller_that_leaves_and_shutdown_waits_for_it() {
    let supervisor = Supervisor::new(1);
    let (release, wait) = oneshot::channel::<()>();
    let (done, finished) = oneshot::channel::<&str>();
    let mut run = Box::pin(
        supervisor
            .run_here(0, async move {
                wait.await.unwrap();
                done.send("finished").unwrap();
            })
            .unwrap(),
    );
    // Started in the caller's task, then the caller gives up.
    assert!(
        tokio::time::timeout(Duration::from_millis(10), &mut run)
            .await
            .is_err()
    );
    drop(run);
    assert_eq!(supervisor.live(), 1, "the rest runs on as a child");
    let deadline = Instant::now() + FAR;
    let shutdown = tokio::spawn({
        let supervisor = supervisor.clone();
        async move { supervisor.shutdown(deadline).await }
    });
    support::settle().await;
    assert!(!shutdown.is_finished(), "shutdown waits for the moved work");
    release.send(()).unwrap();
    assert_eq!(finished.await.unwrap(), "finished");
    assert_eq!(shutdown.await.unwrap(), 0);
}

#[tokio::test(start_paused = true)]
async fn a_panic_in_moved_work_is_caught() {
    let supervisor = Supervisor::new(1);
    let (release, wait) = oneshot::channel::<()>();
    let run = supervisor
        .run_here(0, async move {
            wait.await.unwrap();
            panic!("moved work failed");
        })
        .unwrap();
    drop(run);
    release.send(()).unwrap();
    support::settle().await;
    assert_eq!(supervisor.live(), 0);
}

#[tokio::test(start_paused = true)]
async fn run_here_after_shutdown_is_refused() {
    let supervisor = Supervisor::new(1);
    assert_eq!(supervisor.shutdown(Instant::now()).await, 0);
    assert_eq!(
        supervisor.run_here(0, async {}).unwrap_err(),
        StartError::ShutDown
    );
    assert_eq!(supervisor.live(), 0);
}

#[test]
fn run_here_outside_a_runtime_is_an_error() {
    let supervisor = Supervisor::new(1);
    assert_eq!(
        supervisor.run_here(0, async {}).unwrap_err(),
        StartError::NoRuntime
    );
}
