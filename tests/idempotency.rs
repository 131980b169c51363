//! Idempotency behaviour (SCENARIOS I1–I10), bad input, shutdown and leaks,
//! all on paused time.

use std::future::Future;
use std::io;
use std::pin::Pin;
use std::sync::Arc;
use std::sync::atomic::{AtomicUsize, Ordering};
use std::time::Duration;

use throttlebeam::{
    Error, IdempotencyHandle, IdempotencyOptions, IdempotencyOutcome, Runtime, clock::MAX_TIMER,
    idempotency::IdempotencyReserved, idempotency::InFlight, idempotency::NotRecorded,
    store::MAX_KEY_LEN,
};
use tokio::task::JoinHandle;
use tokio::time::{Instant, sleep};

type Op<T> = Box<dyn FnOnce() -> Pin<Box<dyn Future<Output = io::Result<T>> + Send>> + Send>;

const MS: Duration = Duration::from_millis(1);
const SEC: Duration = Duration::from_secs(1);

async fn idempotency() -> (Runtime, IdempotencyHandle) {
    let runtime = Runtime::builder().start().await.unwrap();
    let idem = runtime.idempotency();
    (runtime, idem)
}

fn runs() -> Arc<AtomicUsize> {
    Arc::new(AtomicUsize::new(0))
}

fn count(runs: &AtomicUsize) -> usize {
    runs.load(Ordering::SeqCst)
}

/// Counts its run, takes `took`, then returns `value`.
fn op<T: Send + 'static>(runs: &Arc<AtomicUsize>, took: Duration, value: T) -> Op<T> {
    let runs = Arc::clone(runs);
    Box::new(move || {
        Box::pin(async move {
            runs.fetch_add(1, Ordering::SeqCst);
            sleep(took).await;
            Ok(value)
        })
    })
}

/// Counts its run, takes `took`, then fails.
fn failing(runs: &Arc<AtomicUsize>, took: Duration) -> Op<u32> {
    let runs = Arc::clone(runs);
    Box::new(move || {
        Box::pin(async move {
            runs.fetch_add(1, Ordering::SeqCst);
            sleep(took).await;
            Err(io::Error::other("card declined"))
        })
    })
}

/// Counts its run, takes `took`, then panics.
fn panicking(runs: &Arc<AtomicUsize>, took: Duration) -> Op<u32> {
    let runs = Arc::clone(runs);
    Box::new(move || {
        Box::pin(async move {
            runs.fetch_add(1, Ordering::SeqCst);
            sleep(took).await;
            panic!("gateway exploded")
        })
    })
}

fn spawn_run<T>(
    idem: &IdempotencyHandle,
    key: &'static str,
    f: Op<T>,
    options: IdempotencyOptions,
) -> JoinHandle<Result<IdempotencyOutcome<T>, Error>>
where
    T: serde::Serialize + serde::de::DeserializeOwned + Clone + Send + Sync + 'static,
{
    let idem = idem.clone();
    tokio::spawn(async move { idem.run_with(key, options, f).await })
}

fn opts() -> IdempotencyOptions {
    IdempotencyOptions::new()
}

#[tokio::test(start_paused = true)]
async fn i1_a_sequential_retry_replays_the_first_value() {
    let (_rt, idem) = idempotency().await;
    let runs = runs();

    let first = idem.run("pay:1", op(&runs, MS, 100_u32)).await;
    let second = idem.run("pay:1", op(&runs, MS, 200_u32)).await;

    assert_eq!(first.unwrap(), IdempotencyOutcome::Fresh(100));
    assert_eq!(second.unwrap(), IdempotencyOutcome::Replay(100));
    assert_eq!(count(&runs), 1);
}

#[tokio::test(start_paused = true)]
async fn i2_concurrent_duplicates_share_one_execution() {
    let (_rt, idem) = idempotency().await;
    let runs = runs();
    let start = Instant::now();

    let calls: Vec<_> = (0..5_u32)
        .map(|i| spawn_run(&idem, "pay:2", op(&runs, 100 * MS, i), opts()))
        .collect();
    let mut outcomes = Vec::new();
    for call in calls {
        outcomes.push(call.await.unwrap().unwrap());
    }

    assert_eq!(count(&runs), 1);
    assert_eq!(outcomes.iter().filter(|o| o.is_fresh()).count(), 1);
    let value = *outcomes[0].value();
    assert!(outcomes.iter().all(|o| *o.value() == value));
    assert_eq!(
        start.elapsed(),
        100 * MS,
        "duplicates get the value when it is ready"
    );
}

#[tokio::test(start_paused = true)]
async fn i3_a_duplicate_times_out_while_the_first_run_continues_and_stores() {
    let (_rt, idem) = idempotency().await;
    let runs = runs();
    let start = Instant::now();
    let first = spawn_run(&idem, "pay:3", op(&runs, 5 * SEC, 7_u32), opts());
    tokio::task::yield_now().await;

    let duplicate = idem
        .run_with("pay:3", opts().with_wait_timeout(SEC), op(&runs, MS, 8_u32))
        .await;

    let err = duplicate.unwrap_err();
    assert!(
        matches!(&err, Error::Timeout { after, .. } if *after == SEC),
        "{err:?}"
    );
    assert_eq!(err.key(), Some("pay:3"));
    assert_eq!(start.elapsed(), SEC);
    assert_eq!(count(&runs), 1, "the duplicate's function never ran");

    assert_eq!(first.await.unwrap().unwrap(), IdempotencyOutcome::Fresh(7));
    assert_eq!(start.elapsed(), 5 * SEC);
    let later = idem.run("pay:3", op(&runs, MS, 9_u32)).await;
    assert_eq!(later.unwrap(), IdempotencyOutcome::Replay(7));
    assert_eq!(count(&runs), 1);
}

#[tokio::test(start_paused = true)]
async fn i4_a_different_fingerprint_is_rejected_without_running() {
    let (_rt, idem) = idempotency().await;
    let runs = runs();
    let order = |fp: &str| opts().with_fingerprint(fp);

    // Completed key.
    let first = idem
        .run_with("pay:4", order("a"), op(&runs, MS, 1_u32))
        .await;
    assert_eq!(first.unwrap(), IdempotencyOutcome::Fresh(1));
    let other = idem
        .run_with("pay:4", order("b"), op(&runs, MS, 2_u32))
        .await;
    assert!(matches!(other, Err(Error::FingerprintMismatch { ref key }) if key == "pay:4"));
    let none = idem.run("pay:4", op(&runs, MS, 3_u32)).await;
    assert!(matches!(none, Err(Error::FingerprintMismatch { .. })));
    let same = idem
        .run_with("pay:4", order("a"), op(&runs, MS, 4_u32))
        .await;
    assert_eq!(same.unwrap(), IdempotencyOutcome::Replay(1));

    // Key in flight: rejected at once, not after waiting.
    let start = Instant::now();
    let busy = spawn_run(&idem, "pay:4b", op(&runs, 10 * SEC, 5_u32), order("a"));
    tokio::task::yield_now().await;
    let other = idem
        .run_with("pay:4b", order("b"), op(&runs, MS, 6_u32))
        .await;
    assert!(matches!(other, Err(Error::FingerprintMismatch { .. })));
    assert_eq!(start.elapsed(), Duration::ZERO);
    assert_eq!(busy.await.unwrap().unwrap(), IdempotencyOutcome::Fresh(5));

    assert_eq!(count(&runs), 2, "only the two first runs executed");
}

#[tokio::test(start_paused = true)]
async fn i4_the_same_key_in_another_scope_is_independent() {
    let (_rt, idem) = idempotency().await;
    let runs = runs();
    let tenant = |t: &str| opts().with_scope(t).with_fingerprint("same");

    let a = idem
        .run_with("pay:5", tenant("t1"), op(&runs, MS, 1_u32))
        .await;
    let b = idem
        .run_with("pay:5", tenant("t2"), op(&runs, MS, 2_u32))
        .await;
    let unscoped = idem
        .run_with(
            "pay:5",
            opts().with_fingerprint("same"),
            op(&runs, MS, 3_u32),
        )
        .await;
    let a_again = idem
        .run_with("pay:5", tenant("t1"), op(&runs, MS, 4_u32))
        .await;
    // A scope is not glued onto the key: ("t", "1pay") and ("t1", "pay") differ.
    let glued = idem
        .run_with("1pay:5", tenant("t"), op(&runs, MS, 5_u32))
        .await;

    assert_eq!(a.unwrap(), IdempotencyOutcome::Fresh(1));
    assert_eq!(b.unwrap(), IdempotencyOutcome::Fresh(2));
    assert_eq!(unscoped.unwrap(), IdempotencyOutcome::Fresh(3));
    assert_eq!(a_again.unwrap(), IdempotencyOutcome::Replay(1));
    assert_eq!(glued.unwrap(), IdempotencyOutcome::Fresh(5));
    assert_eq!(count(&runs), 4);
}

#[tokio::test(start_paused = true)]
async fn i5_an_error_or_a_panic_releases_the_key_and_a_retry_runs_again() {
    let (rt, idem) = idempotency().await;
    let runs = runs();

    let failed = idem.run("pay:6", failing(&runs, MS)).await;
    let err = failed.unwrap_err();
    assert!(
        matches!(&err, Error::Failed { key, .. } if key == "pay:6"),
        "{err:?}"
    );
    let source = std::error::Error::source(&err).map(ToString::to_string);
    assert_eq!(source.as_deref(), Some("card declined"));
    let retry = idem.run("pay:6", op(&runs, MS, 1_u32)).await;
    assert_eq!(retry.unwrap(), IdempotencyOutcome::Fresh(1));

    let panicked = idem.run("pay:7", panicking(&runs, MS)).await;
    assert!(
        matches!(&panicked, Err(Error::Panicked { message, .. }) if message == "gateway exploded"),
        "{panicked:?}"
    );
    let retry = idem.run("pay:7", op(&runs, MS, 2_u32)).await;
    assert_eq!(retry.unwrap(), IdempotencyOutcome::Fresh(2));

    // A closure that panics while building its future is caught the same way.
    let unbuilt: Op<u32> = Box::new(|| panic!("no future for you"));
    let panicked = idem.run("pay:8", unbuilt).await;
    assert!(
        matches!(&panicked, Err(Error::Panicked { message, .. }) if message == "no future for you"),
        "{panicked:?}"
    );
    let retry = idem.run("pay:8", op(&runs, MS, 3_u32)).await;
    assert_eq!(retry.unwrap(), IdempotencyOutcome::Fresh(3));

    assert_eq!(count(&runs), 5);
    assert_eq!(rt.stats().keys, 0);
    assert_eq!(rt.stats().ttl_entries, 3, "failures are never stored");
}

#[tokio::test(start_paused = true)]
async fn i5_waiting_duplicates_take_over_after_a_failure_and_a_panic() {
    let (_rt, idem) = idempotency().await;
    for (key, first) in [
        (
            "pay:8",
            failing as fn(&Arc<AtomicUsize>, Duration) -> Op<u32>,
        ),
        ("pay:9", panicking),
    ] {
        let runs = runs();
        let start = Instant::now();
        let owner = spawn_run(&idem, key, first(&runs, SEC), opts());
        tokio::task::yield_now().await;
        let b = spawn_run(&idem, key, op(&runs, 2 * SEC, 20_u32), opts());
        let c = spawn_run(&idem, key, op(&runs, 2 * SEC, 30_u32), opts());

        assert!(owner.await.unwrap().is_err());
        let (b, c) = (b.await.unwrap().unwrap(), c.await.unwrap().unwrap());

        assert_eq!(
            count(&runs),
            2,
            "{key}: the owner and exactly one duplicate ran"
        );
        assert_eq!(b.is_fresh(), c.is_replay(), "{key}: {b:?} {c:?}");
        assert_eq!(b.value(), c.value());
        assert_eq!(start.elapsed(), 3 * SEC, "{key}: took over at 1 s, ran 2 s");
    }
}

#[tokio::test(start_paused = true)]
async fn i6_the_owner_task_going_away_does_not_stop_the_operation() {
    let (_rt, idem) = idempotency().await;
    let runs = runs();
    let start = Instant::now();
    let owner = spawn_run(&idem, "pay:10", op(&runs, 5 * SEC, 1_u32), opts());
    sleep(SEC).await;
    owner.abort();
    assert!(owner.await.unwrap_err().is_cancelled());

    let duplicate = idem.run("pay:10", op(&runs, MS, 2_u32)).await;

    assert_eq!(duplicate.unwrap(), IdempotencyOutcome::Replay(1));
    assert_eq!(start.elapsed(), 5 * SEC);
    assert_eq!(count(&runs), 1);
}

#[tokio::test(start_paused = true)]
async fn i6_an_owner_slower_than_its_lease_runs_once_and_its_result_is_stored() {
    let (rt, idem) = idempotency().await;
    let runs = runs();
    let leased = || opts().with_lease(SEC);
    let start = Instant::now();
    let owner = spawn_run(
        &idem,
        "pay:11",
        op(&runs, 5 * SEC, "first".to_owned()),
        leased(),
    );

    // Well past the lease, the owner is alive: duplicates wait for it.
    sleep(2 * SEC).await;
    let waiter = spawn_run(
        &idem,
        "pay:11",
        op(&runs, SEC, "second".to_owned()),
        leased(),
    );
    let impatient = idem
        .run_with(
            "pay:11",
            leased().with_wait_timeout(SEC),
            op(&runs, SEC, "third".to_owned()),
        )
        .await;
    assert!(
        matches!(impatient, Err(Error::Timeout { ref key, after }) if key == "pay:11" && after == SEC),
        "{impatient:?}"
    );
    assert_eq!(start.elapsed(), 3 * SEC);

    assert_eq!(
        owner.await.unwrap().unwrap(),
        IdempotencyOutcome::Fresh("first".to_owned()),
        "the first caller never loses a live run"
    );
    assert_eq!(
        waiter.await.unwrap().unwrap(),
        IdempotencyOutcome::Replay("first".to_owned())
    );
    assert_eq!(start.elapsed(), 5 * SEC);
    let later = idem.run("pay:11", op(&runs, MS, "fourth".to_owned())).await;
    assert_eq!(
        later.unwrap(),
        IdempotencyOutcome::Replay("first".to_owned())
    );
    assert_eq!(count(&runs), 1, "never executed twice");
    let stats = idem.stats();
    assert_eq!(
        (stats.fresh, stats.replays, stats.takeovers, stats.timeouts),
        (1, 2, 0, 1),
        "{stats:?}"
    );
    assert_eq!((rt.stats().keys, rt.stats().processes), (0, 0));
}

#[tokio::test(start_paused = true)]
async fn i6_a_live_owner_is_never_taken_over_however_long_it_runs() {
    let (_rt, idem) = idempotency().await;
    let runs = runs();
    let hour = Duration::from_secs(3600);
    let start = Instant::now();
    let owner = spawn_run(
        &idem,
        "pay:12",
        op(&runs, hour, 1_u32),
        opts().with_lease(SEC),
    );
    // Duplicates keep arriving and waiting for the whole hour.
    let mut waiters = Vec::new();
    for _ in 0..6 {
        sleep(10 * Duration::from_secs(60)).await;
        waiters.push(spawn_run(
            &idem,
            "pay:12",
            op(&runs, MS, 2_u32),
            opts().with_wait_timeout(hour),
        ));
    }
    assert_eq!(owner.await.unwrap().unwrap(), IdempotencyOutcome::Fresh(1));
    for waiter in waiters {
        assert_eq!(
            waiter.await.unwrap().unwrap(),
            IdempotencyOutcome::Replay(1)
        );
    }
    assert_eq!(start.elapsed(), hour);
    assert_eq!(count(&runs), 1);
    assert_eq!(idem.stats().takeovers, 0);
}

#[tokio::test(start_paused = true)]
async fn i6_a_held_reservation_is_never_taken_over_and_completes() {
    let (_rt, idem) = idempotency().await;
    let runs = runs();
    let start = Instant::now();
    let IdempotencyReserved::Fresh(held) = idem
        .reserve::<u32>("job:6", opts().with_lease(SEC))
        .await
        .unwrap()
    else {
        panic!("job:6 is new");
    };
    sleep(2 * SEC).await;
    let waiter = spawn_run(&idem, "job:6", op(&runs, MS, 1_u32), opts());
    sleep(8 * SEC).await;
    assert!(
        !waiter.is_finished(),
        "still waiting for the reservation at 10 s"
    );

    held.complete(2).await.unwrap();

    assert_eq!(
        waiter.await.unwrap().unwrap(),
        IdempotencyOutcome::Replay(2)
    );
    assert_eq!(start.elapsed(), 10 * SEC);
    assert_eq!(count(&runs), 0);
    assert_eq!(idem.stats().takeovers, 0);
}

#[tokio::test(start_paused = true)]
async fn i6_an_owner_task_cancelled_mid_run_is_taken_over_by_exactly_one_duplicate() {
    let (rt, idem) = idempotency().await;
    let runs = runs();
    let start = Instant::now();
    // The owner holds a reservation while its task works; the task is cancelled.
    let owner = {
        let idem = idem.clone();
        tokio::spawn(async move {
            let reserved = idem.reserve::<u32>("job:7", opts().with_lease(SEC)).await;
            sleep(Duration::from_secs(3600)).await;
            drop(reserved);
        })
    };
    sleep(SEC).await;
    let duplicates: Vec<_> = (0..4_u32)
        .map(|i| spawn_run(&idem, "job:7", op(&runs, 100 * MS, i), opts()))
        .collect();
    sleep(SEC).await;
    assert_eq!(count(&runs), 0, "nobody takes over a live owner");
    owner.abort();

    let mut outcomes = Vec::new();
    for duplicate in duplicates {
        outcomes.push(duplicate.await.unwrap().unwrap());
    }
    assert_eq!(count(&runs), 1, "exactly one duplicate ran");
    assert_eq!(outcomes.iter().filter(|o| o.is_fresh()).count(), 1);
    let value = *outcomes[0].value();
    assert!(outcomes.iter().all(|o| *o.value() == value));
    assert_eq!(start.elapsed(), 2 * SEC + 100 * MS, "taken over at once");
    assert_eq!((rt.stats().keys, rt.stats().processes), (0, 0));
}

/// A run's own process is dropped mid-run when the tokio runtime it runs
/// on ends: its key is released, and one waiting duplicate runs instead.
#[test]
fn i6_a_run_whose_tokio_runtime_ends_mid_run_is_taken_over_by_exactly_one_duplicate() {
    let current = || {
        tokio::runtime::Builder::new_current_thread()
            .enable_all()
            .build()
            .unwrap()
    };
    let main = current();
    let (_rt, idem) = main.block_on(idempotency());
    let runs = runs();

    let other = current();
    let (started, has_started) = tokio::sync::oneshot::channel();
    let owner = {
        let idem = idem.clone();
        other.spawn(async move {
            idem.run("pay:gone", move || async move {
                let _ = started.send(());
                std::future::pending::<io::Result<u32>>().await
            })
            .await
        })
    };
    other.block_on(has_started).unwrap();

    let duplicates: Vec<_> = main.block_on(async {
        let duplicates = (0..3_u32)
            .map(|i| spawn_run(&idem, "pay:gone", op(&runs, Duration::ZERO, i), opts()))
            .collect();
        tokio::task::yield_now().await;
        duplicates
    });
    assert_eq!(count(&runs), 0);
    drop(other);

    let outcomes: Vec<_> = main.block_on(async {
        assert!(owner.await.unwrap_err().is_cancelled());
        let mut outcomes = Vec::new();
        for duplicate in duplicates {
            outcomes.push(duplicate.await.unwrap().unwrap());
        }
        outcomes
    });
    assert_eq!(count(&runs), 1, "exactly one duplicate ran");
    assert_eq!(outcomes.iter().filter(|o| o.is_fresh()).count(), 1);
    let value = *outcomes[0].value();
    assert!(outcomes.iter().all(|o| *o.value() == value));
}

#[tokio::test(start_paused = true)]
async fn i11_a_fail_fast_duplicate_gets_in_flight_at_once_with_a_retry_hint() {
    let (_rt, idem) = idempotency().await;
    let runs = runs();
    let reject = || opts().with_in_flight(InFlight::Reject);
    let start = Instant::now();
    let owner = spawn_run(&idem, "pay:17", op(&runs, 5 * SEC, 1_u32), opts());
    sleep(SEC).await;

    let rejected = idem
        .run_with("pay:17", reject(), op(&runs, MS, 2_u32))
        .await;
    assert!(
        matches!(rejected, Err(Error::InFlight { ref key, retry_after }) if key == "pay:17" && retry_after == SEC),
        "{rejected:?}"
    );
    assert_eq!(
        rejected.unwrap_err().to_string(),
        "idempotency key \"pay:17\" is in flight; retry after 1s"
    );
    let reserve = idem.reserve::<u32>("pay:17", reject()).await;
    assert!(
        matches!(reserve, Err(Error::InFlight { .. })),
        "{reserve:?}"
    );
    assert_eq!(start.elapsed(), SEC, "rejected at once");

    // The hint never points past the moment a gone holder could be taken over.
    let IdempotencyReserved::Fresh(_held) = idem
        .reserve::<u32>("job:17", opts().with_lease(300 * MS))
        .await
        .unwrap()
    else {
        panic!("job:17 is new");
    };
    sleep(50 * MS).await;
    let soon = idem.reserve::<u32>("job:17", reject()).await;
    assert!(
        matches!(soon, Err(Error::InFlight { retry_after, .. }) if retry_after == 250 * MS),
        "{soon:?}"
    );

    assert_eq!(owner.await.unwrap().unwrap(), IdempotencyOutcome::Fresh(1));
    let replay = idem
        .run_with("pay:17", reject(), op(&runs, MS, 3_u32))
        .await;
    assert_eq!(replay.unwrap(), IdempotencyOutcome::Replay(1));
    assert_eq!(count(&runs), 1);
    assert_eq!(idem.stats().in_flight_rejections, 3);
}

#[tokio::test(start_paused = true)]
async fn a_run_slower_than_its_lease_completes_and_stores() {
    let (_rt, idem) = idempotency().await;
    let runs = runs();

    let slow = idem
        .run_with("pay:13", opts().with_lease(SEC), op(&runs, 5 * SEC, 1_u32))
        .await;
    let retry = idem.run("pay:13", op(&runs, MS, 2_u32)).await;

    assert_eq!(slow.unwrap(), IdempotencyOutcome::Fresh(1));
    assert_eq!(retry.unwrap(), IdempotencyOutcome::Replay(1));
    assert_eq!(count(&runs), 1);
}
#[tokio::test(start_paused = true)]
async fn i7_results_expire_after_the_ttl_even_before_a_sweep() {
    let runtime = Runtime::builder()
        .with_sweep_interval(Duration::from_secs(3600))
        .start()
        .await
        .unwrap();
    let idem = runtime.idempotency();
    let runs = runs();
    let ttl = || opts().with_ttl(10 * SEC);

    assert!(
        idem.run_with("pay:14", ttl(), op(&runs, Duration::ZERO, 1_u32))
            .await
            .unwrap()
            .is_fresh()
    );
    sleep(10 * SEC - MS).await;
    let inside = idem
        .run_with("pay:14", ttl(), op(&runs, Duration::ZERO, 2_u32))
        .await;
    assert_eq!(inside.unwrap(), IdempotencyOutcome::Replay(1));

    sleep(MS).await;
    assert_eq!(runtime.stats().ttl_entries, 1, "expired but not swept yet");
    let after = idem
        .run_with("pay:14", ttl(), op(&runs, Duration::ZERO, 3_u32))
        .await;
    assert_eq!(after.unwrap(), IdempotencyOutcome::Fresh(3));
    assert_eq!(count(&runs), 2);
}

#[tokio::test(start_paused = true)]
async fn i7_the_sweeper_removes_expired_results() {
    let (runtime, idem) = idempotency().await;
    let runs = runs();
    for key in ["a", "b", "c"] {
        let outcome = idem
            .run_with(key, opts().with_ttl(SEC), op(&runs, Duration::ZERO, 1_u32))
            .await;
        assert!(outcome.unwrap().is_fresh());
    }
    assert_eq!(runtime.stats().ttl_entries, 3);

    sleep(Duration::from_secs(59)).await;
    assert_eq!(
        runtime.stats().ttl_entries,
        3,
        "the default sweep runs every 60 s"
    );
    sleep(2 * SEC).await;
    assert_eq!(runtime.stats().ttl_entries, 0);
    assert_eq!(
        runtime.stats().timers,
        0,
        "the sweeper sleeps once nothing is left"
    );
}

#[tokio::test(start_paused = true)]
async fn i8_a_completed_reservation_is_replayed() {
    let (rt, idem) = idempotency().await;
    let runs = runs();

    let IdempotencyReserved::Fresh(reservation) =
        idem.reserve::<u32>("job:1", opts()).await.unwrap()
    else {
        panic!("job:1 is new");
    };
    assert_eq!(reservation.key(), "job:1");
    assert_eq!(
        (rt.stats().keys, rt.stats().processes),
        (1, 0),
        "a reservation is a slot, not a process"
    );
    reservation.complete(5).await.unwrap();

    let run = idem.run("job:1", op(&runs, MS, 6_u32)).await;
    assert_eq!(run.unwrap(), IdempotencyOutcome::Replay(5));
    let reserved = idem.reserve::<u32>("job:1", opts()).await.unwrap();
    assert!(matches!(reserved, IdempotencyReserved::Replay(5)));
    assert_eq!(count(&runs), 0);
    assert_eq!(rt.stats().keys, 0);
}

#[tokio::test(start_paused = true)]
async fn i8_a_released_or_dropped_reservation_lets_the_next_run_execute() {
    let (rt, idem) = idempotency().await;
    let runs = runs();

    let IdempotencyReserved::Fresh(released) = idem.reserve::<u32>("job:2", opts()).await.unwrap()
    else {
        panic!("job:2 is new");
    };
    released.release().await;
    let after_release = idem.run("job:2", op(&runs, MS, 1_u32)).await;
    assert_eq!(after_release.unwrap(), IdempotencyOutcome::Fresh(1));

    let IdempotencyReserved::Fresh(dropped) = idem.reserve::<u32>("job:3", opts()).await.unwrap()
    else {
        panic!("job:3 is new");
    };
    drop(dropped);
    assert_eq!(rt.stats().keys, 0);
    let after_drop = idem.run("job:3", op(&runs, MS, 2_u32)).await;
    assert_eq!(after_drop.unwrap(), IdempotencyOutcome::Fresh(2));
    assert_eq!(count(&runs), 2);
}

#[tokio::test(start_paused = true)]
async fn i8_duplicates_wait_for_a_reservation() {
    let (_rt, idem) = idempotency().await;
    let runs = runs();
    let IdempotencyReserved::Fresh(held) = idem.reserve::<u32>("job:4", opts()).await.unwrap()
    else {
        panic!("job:4 is new");
    };
    let waiting_run = spawn_run(&idem, "job:4", op(&runs, MS, 1_u32), opts());
    let waiting_reserve = {
        let idem = idem.clone();
        tokio::spawn(async move { idem.reserve::<u32>("job:4", opts()).await })
    };
    sleep(SEC).await;
    assert!(!waiting_run.is_finished() && !waiting_reserve.is_finished());

    held.complete(9).await.unwrap();

    assert_eq!(
        waiting_run.await.unwrap().unwrap(),
        IdempotencyOutcome::Replay(9)
    );
    assert!(matches!(
        waiting_reserve.await.unwrap().unwrap(),
        IdempotencyReserved::Replay(9)
    ));
    assert_eq!(count(&runs), 0);

    // A waiting reservation takes over a released one.
    let IdempotencyReserved::Fresh(held) = idem.reserve::<u32>("job:5", opts()).await.unwrap()
    else {
        panic!("job:5 is new");
    };
    let next = {
        let idem = idem.clone();
        tokio::spawn(async move { idem.reserve::<u32>("job:5", opts()).await })
    };
    sleep(SEC).await;
    held.release().await;
    assert!(matches!(
        next.await.unwrap().unwrap(),
        IdempotencyReserved::Fresh(_)
    ));
}

#[tokio::test(start_paused = true)]
async fn i9_defaults() {
    let defaults = IdempotencyOptions::new();
    assert_eq!(defaults, IdempotencyOptions::default());
    assert_eq!(defaults.scope(), None);
    assert_eq!(defaults.fingerprint_digest(), None);
    assert_eq!(defaults.in_flight(), InFlight::Wait);
    assert_eq!(defaults.ttl(), Duration::from_secs(24 * 3600));
    assert_eq!(defaults.lease(), Duration::from_secs(30));
    assert_eq!(defaults.wait_timeout(), Duration::from_secs(30));

    let (_rt, idem) = idempotency().await;
    let runs = runs();
    let day = Duration::from_secs(24 * 3600);

    // TTL 24 h.
    assert!(
        idem.run("d:1", op(&runs, Duration::ZERO, 1_u32))
            .await
            .unwrap()
            .is_fresh()
    );
    sleep(day - MS).await;
    assert_eq!(
        idem.run("d:1", op(&runs, Duration::ZERO, 2_u32))
            .await
            .unwrap(),
        IdempotencyOutcome::Replay(1)
    );
    sleep(MS).await;
    assert_eq!(
        idem.run("d:1", op(&runs, Duration::ZERO, 3_u32))
            .await
            .unwrap(),
        IdempotencyOutcome::Fresh(3)
    );

    // Lease 30 s, renewed while the owner runs: a duplicate arriving at
    // 10 s waits for it (never takes over) until its 30 s wait times out.
    let start = Instant::now();
    let slow = spawn_run(
        &idem,
        "d:2",
        op(&runs, Duration::from_secs(100), 1_u32),
        opts(),
    );
    sleep(10 * SEC).await;
    let waited = idem.run("d:2", op(&runs, Duration::ZERO, 2_u32)).await;
    assert!(matches!(waited, Err(Error::Timeout { .. })), "{waited:?}");
    assert_eq!(start.elapsed(), 40 * SEC);
    assert_eq!(slow.await.unwrap().unwrap(), IdempotencyOutcome::Fresh(1));
    assert_eq!(start.elapsed(), 100 * SEC);

    // Wait timeout 30 s.
    let hour = Duration::from_secs(3600);
    let start = Instant::now();
    let _slow = spawn_run(
        &idem,
        "d:3",
        op(&runs, hour, 1_u32),
        opts().with_lease(hour),
    );
    tokio::task::yield_now().await;
    let waited = idem
        .run_with(
            "d:3",
            opts().with_lease(hour),
            op(&runs, Duration::ZERO, 2_u32),
        )
        .await;
    assert!(matches!(waited, Err(Error::Timeout { .. })));
    assert_eq!(start.elapsed(), 30 * SEC);
}

#[tokio::test(start_paused = true)]
async fn i10_dropping_the_first_callers_future_does_not_cancel_the_run() {
    let (rt, idem) = idempotency().await;
    let runs = runs();
    let start = Instant::now();

    let gave_up = tokio::time::timeout(SEC, idem.run("pay:15", op(&runs, 5 * SEC, 3_u32))).await;
    assert!(
        gave_up.is_err(),
        "the caller stopped waiting and dropped its future"
    );
    assert_eq!(
        (rt.stats().keys, rt.stats().processes),
        (1, 1),
        "still running"
    );

    sleep(4 * SEC - MS).await;
    assert_eq!(rt.stats().ttl_entries, 0, "not finished at 5 s - 1 ms");
    sleep(2 * MS).await;
    assert_eq!(start.elapsed(), 5 * SEC + MS);
    assert_eq!(
        (
            rt.stats().keys,
            rt.stats().processes,
            rt.stats().ttl_entries
        ),
        (0, 0, 1)
    );
    let replay = idem.run("pay:15", op(&runs, MS, 4_u32)).await;
    assert_eq!(replay.unwrap(), IdempotencyOutcome::Replay(3));
    assert_eq!(count(&runs), 1);
}

#[tokio::test(start_paused = true)]
async fn bad_input_is_a_typed_error_and_nothing_runs() {
    let (rt, idem) = idempotency().await;
    let runs = runs();
    let long = "k".repeat(MAX_KEY_LEN + 1);

    let cases: Vec<(&str, IdempotencyOptions, &str)> = vec![
        ("", opts(), "key"),
        (&long, opts(), "key"),
        ("k", opts().with_ttl(Duration::ZERO), "ttl"),
        ("k", opts().with_lease(Duration::ZERO), "lease"),
        (
            "k",
            opts().with_wait_timeout(Duration::ZERO),
            "wait timeout",
        ),
        ("k", opts().with_ttl(MAX_TIMER + MS), "ttl"),
        ("k", opts().with_scope(""), "scope"),
        ("k", opts().with_scope("s".repeat(MAX_KEY_LEN + 1)), "scope"),
    ];
    for (key, options, what) in cases {
        let run = idem
            .run_with(key, options.clone(), op(&runs, MS, 1_u32))
            .await;
        let reserve = idem.reserve::<u32>(key, options).await;
        for err in [run.unwrap_err(), reserve.unwrap_err()] {
            match (&err, what) {
                (Error::InvalidKey { .. }, "key") => {}
                (Error::InvalidArgument { what: w, .. }, _) if *w == what => {}
                _ => panic!("{key:.8}/{what}: unexpected {err:?}"),
            }
        }
    }
    assert_eq!(count(&runs), 0);
    assert_eq!(rt.stats().keys, 0);

    let longest = "k".repeat(MAX_KEY_LEN);
    let ok = idem
        .run_with(&longest, opts().with_ttl(MAX_TIMER), op(&runs, MS, 1_u32))
        .await;
    assert!(ok.unwrap().is_fresh());
}

#[tokio::test(start_paused = true)]
async fn a_stored_result_of_another_type_is_a_type_mismatch() {
    let (_rt, idem) = idempotency().await;
    let runs = runs();
    assert!(
        idem.run("t:1", op(&runs, MS, 1_u32))
            .await
            .unwrap()
            .is_fresh()
    );

    let other = idem.run("t:1", op(&runs, MS, String::from("x"))).await;

    assert!(
        matches!(other, Err(Error::TypeMismatch { .. })),
        "{other:?}"
    );
    assert_eq!(count(&runs), 1);
}

#[tokio::test(start_paused = true)]
async fn the_key_cap_applies_to_keys_in_flight() {
    let runtime = Runtime::builder().with_max_keys(1).start().await.unwrap();
    let idem = runtime.idempotency();
    let runs = runs();
    let IdempotencyReserved::Fresh(held) = idem.reserve::<u32>("cap:a", opts()).await.unwrap()
    else {
        panic!("cap:a is new");
    };

    let refused = idem.run("cap:b", op(&runs, MS, 1_u32)).await;
    assert!(
        matches!(refused, Err(Error::TooManyKeys { cap: 1, .. })),
        "{refused:?}"
    );
    held.release().await;
    let accepted = idem.run("cap:b", op(&runs, MS, 1_u32)).await;
    assert!(accepted.unwrap().is_fresh());
    assert_eq!(count(&runs), 1);
}

#[tokio::test(start_paused = true)]
async fn calls_after_shutdown_fail_and_waiters_are_woken() {
    let (rt, idem) = idempotency().await;
    let runs = runs();
    assert!(
        idem.run("s:1", op(&runs, MS, 1_u32))
            .await
            .unwrap()
            .is_fresh()
    );
    let start = Instant::now();
    let running = spawn_run(&idem, "s:2", op(&runs, 10 * SEC, 2_u32), opts());
    tokio::task::yield_now().await;
    let waiting = spawn_run(&idem, "s:2", op(&runs, MS, 3_u32), opts());
    tokio::task::yield_now().await;

    let report = rt.shutdown(SEC).await;
    assert_eq!(report.still_running, 1);
    assert_eq!(rt.stats().ttl_entries, 0, "results are dropped at shutdown");

    let waited = waiting.await.unwrap();
    assert!(matches!(waited, Err(Error::ShutDown { .. })), "{waited:?}");
    assert_eq!(start.elapsed(), SEC);
    let after = idem.run("s:1", op(&runs, MS, 4_u32)).await;
    assert!(matches!(after, Err(Error::ShutDown { ref key }) if key == "s:1"));
    let reserve = idem.reserve::<u32>("s:3", opts()).await;
    assert!(matches!(reserve, Err(Error::ShutDown { .. })));

    // The running function is never cancelled; its caller still gets its value, told the
    // truth: results lived in this runtime only, which is gone (I14).
    assert_eq!(
        running.await.unwrap().unwrap(),
        IdempotencyOutcome::Unrecorded(2, NotRecorded::ShutDown)
    );
    assert_eq!(rt.stats().ttl_entries, 0, "nothing stored after shutdown");
    assert_eq!(rt.stats().keys, 0);
    assert_eq!(count(&runs), 2);
}

#[tokio::test(start_paused = true)]
async fn keys_and_processes_return_to_zero_once_idle() {
    let (rt, idem) = idempotency().await;
    let runs = runs();
    let ttl = || opts().with_ttl(10 * SEC);
    let mut calls = Vec::new();
    for i in 0..300_u32 {
        let key: &'static str = Box::leak(format!("leak:{}", i % 100).into_boxed_str());
        let f = match i % 100 % 4 {
            0 => failing(&runs, 10 * MS),
            1 => panicking(&runs, 10 * MS),
            _ => op(&runs, 10 * MS, i),
        };
        calls.push(spawn_run(&idem, key, f, ttl()));
    }
    tokio::task::yield_now().await;
    for i in 0..50_u32 {
        let reserved = idem
            .reserve::<u32>(&format!("held:{i}"), ttl())
            .await
            .unwrap();
        match (i % 2, reserved) {
            (0, IdempotencyReserved::Fresh(r)) => r.complete(i).await.unwrap(),
            (_, reserved) => drop(reserved),
        }
    }
    assert!(rt.stats().keys > 0 && rt.stats().processes > 0);
    for call in calls {
        let _ = call.await.unwrap();
    }

    let stats = rt.stats();
    assert_eq!((stats.keys, stats.processes), (0, 0), "{stats:?}");
    assert_eq!(
        stats.ttl_entries,
        50 + 25,
        "succeeded keys and completed reservations"
    );
    sleep(Duration::from_secs(61)).await;
    let stats = rt.stats();
    assert_eq!(
        (stats.keys, stats.processes, stats.ttl_entries, stats.timers),
        (0, 0, 0, 0),
        "{stats:?}"
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn racing_callers_on_two_threads_run_each_key_exactly_once() {
    let (rt, idem) = idempotency().await;
    const KEYS: u32 = 1_000;
    const CALLERS: u32 = 8;
    let runs: Vec<Arc<AtomicUsize>> = (0..KEYS).map(|_| runs()).collect();
    let mut calls = Vec::new();
    // Callers of one key spawned side by side, so they meet mid-completion.
    for key in 0..KEYS {
        for caller in 0..CALLERS {
            let idem = idem.clone();
            let runs = Arc::clone(&runs[key as usize]);
            calls.push(tokio::spawn(async move {
                let f = move || async move {
                    runs.fetch_add(1, Ordering::SeqCst);
                    tokio::task::yield_now().await;
                    Ok::<_, io::Error>(key * 10 + caller)
                };
                idem.run_with(&format!("race:{key}"), opts(), f).await
            }));
        }
    }
    let mut fresh = vec![0_u32; KEYS as usize];
    let mut values = vec![None; KEYS as usize];
    for (i, call) in calls.into_iter().enumerate() {
        let key = i / CALLERS as usize;
        let outcome = call.await.unwrap().unwrap();
        fresh[key] += u32::from(outcome.is_fresh());
        let value = outcome.into_inner();
        assert_eq!(value / 10, key as u32);
        assert_eq!(
            *values[key].get_or_insert(value),
            value,
            "key {key}: one value for all"
        );
    }
    assert!(fresh.iter().all(|&n| n == 1), "{fresh:?}");
    assert!(runs.iter().all(|r| count(r) == 1));
    let stats = rt.stats();
    assert_eq!(
        (stats.keys, stats.ttl_entries),
        (0, KEYS as usize),
        "{stats:?}"
    );
}

#[tokio::test(start_paused = true)]
async fn i4_a_one_mib_fingerprint_matches_and_mismatches_like_a_short_one() {
    let (_rt, idem) = idempotency().await;
    let runs = runs();
    let body = vec![7_u8; 1 << 20];
    let mut other = body.clone();
    other[(1 << 20) - 1] = 8;

    let first = idem
        .run_with(
            "upload:1",
            opts().with_fingerprint(&body),
            op(&runs, MS, 1_u32),
        )
        .await;
    let same = idem
        .run_with(
            "upload:1",
            opts().with_fingerprint(body.clone()),
            op(&runs, MS, 2_u32),
        )
        .await;
    let changed = idem
        .run_with(
            "upload:1",
            opts().with_fingerprint(&other),
            op(&runs, MS, 3_u32),
        )
        .await;

    assert_eq!(first.unwrap(), IdempotencyOutcome::Fresh(1));
    assert_eq!(same.unwrap(), IdempotencyOutcome::Replay(1));
    assert!(
        matches!(changed, Err(Error::FingerprintMismatch { ref key }) if key == "upload:1"),
        "{changed:?}"
    );
    assert_eq!(count(&runs), 1);
    assert_eq!(
        opts().with_fingerprint(&body).fingerprint_digest(),
        opts().with_fingerprint(body.clone()).fingerprint_digest()
    );
    let stats = idem.stats();
    assert_eq!(
        (stats.fresh, stats.replays, stats.fingerprint_mismatches),
        (1, 1, 1)
    );
}

#[tokio::test(start_paused = true)]
async fn i12_past_the_cap_the_oldest_results_are_evicted_first_and_counted() {
    let runtime = Runtime::builder()
        .with_max_idempotency_results(3)
        .start()
        .await
        .unwrap();
    let idem = runtime.idempotency();
    let runs = runs();
    for (i, key) in ["r:0", "r:1", "r:2", "r:3", "r:4"].into_iter().enumerate() {
        let fresh = idem.run(key, op(&runs, MS, i)).await.unwrap();
        assert_eq!(fresh, IdempotencyOutcome::Fresh(i));
    }
    let stats = idem.stats();
    assert_eq!((stats.stored_results, stats.evictions), (3, 2), "{stats:?}");
    assert_eq!(runtime.stats().ttl_entries, 3);

    // The newest three replay; the two oldest were evicted: they run again.
    for (i, key) in [(2_usize, "r:2"), (3, "r:3"), (4, "r:4")] {
        assert_eq!(
            idem.run(key, op(&runs, MS, 99_usize)).await.unwrap(),
            IdempotencyOutcome::Replay(i)
        );
    }
    assert_eq!(
        idem.run("r:0", op(&runs, MS, 10_usize)).await.unwrap(),
        IdempotencyOutcome::Fresh(10)
    );
    assert_eq!(count(&runs), 6);
    let stats = idem.stats();
    assert_eq!(
        (stats.stored_results, stats.evictions, stats.replays),
        (3, 3, 3),
        "r:2, the oldest left, made room for r:0"
    );
    assert_eq!(
        idem.run("r:2", op(&runs, MS, 20_usize)).await.unwrap(),
        IdempotencyOutcome::Fresh(20)
    );
}

/// Issue 30 item 9: results are bounded by bytes, not only by count. Past
/// the byte budget the oldest are evicted first and counted; what is kept
/// weighs exactly its keys, encoded values and entries.
#[tokio::test(start_paused = true)]
async fn past_the_byte_budget_the_oldest_results_are_evicted_first_and_counted() {
    // "-b:0" (4 bytes) + 3,000 bytes in 3,003 encoded + 200 for the entry.
    const ONE: u64 = 4 + 3_003 + 200;
    let runtime = Runtime::builder()
        .with_max_idempotency_bytes(10_000)
        .start()
        .await
        .unwrap();
    let idem = runtime.idempotency();
    let runs = runs();
    let body = |i: u8| vec![i; 3_000];
    for i in 0..3_u8 {
        let fresh = idem.run(&format!("b:{i}"), op(&runs, MS, body(i))).await;
        assert!(fresh.unwrap().is_fresh());
    }
    let stats = idem.stats();
    assert_eq!(
        (stats.stored_results, stats.stored_bytes, stats.evictions),
        (3, 3 * ONE, 0),
        "{stats:?}"
    );
    // A fourth would weigh 12,828 bytes: the oldest goes.
    assert!(
        idem.run("b:3", op(&runs, MS, body(3)))
            .await
            .unwrap()
            .is_fresh()
    );
    let stats = idem.stats();
    assert_eq!(
        (stats.stored_results, stats.stored_bytes, stats.evictions),
        (3, 3 * ONE, 1),
        "{stats:?}"
    );
    for i in 1..4_u8 {
        let replay = idem.run(&format!("b:{i}"), op(&runs, MS, body(99))).await;
        assert_eq!(replay.unwrap(), IdempotencyOutcome::Replay(body(i)));
    }
    assert_eq!(count(&runs), 4);
    // b:0 was evicted: it runs again (and evicts b:1, now the oldest).
    let again = idem.run("b:0", op(&runs, MS, body(10))).await.unwrap();
    assert_eq!(again, IdempotencyOutcome::Fresh(body(10)));
    assert_eq!(idem.stats().evictions, 2);
    assert!(
        idem.run("b:1", op(&runs, MS, body(11)))
            .await
            .unwrap()
            .is_fresh()
    );
    assert_eq!(idem.stats().evictions, 3, "b:1 made room by evicting b:2");

    // A result heavier than the whole budget is not kept (and evicts the rest).
    let huge = idem.run("huge", op(&runs, MS, vec![0u8; 20_000])).await;
    assert!(huge.unwrap().is_fresh());
    let stats = idem.stats();
    assert_eq!(
        (stats.stored_results, stats.stored_bytes),
        (0, 0),
        "{stats:?}"
    );
    assert_eq!(stats.evictions, 3 + 3 + 1, "b:3, b:0, b:1, then itself");
    assert_eq!(runtime.stats().ttl_entries, 0);
}

#[tokio::test(start_paused = true)]
async fn the_byte_budget_has_a_documented_default_and_rejects_zero() {
    assert_eq!(
        throttlebeam::idempotency::DEFAULT_MAX_IDEMPOTENCY_BYTES,
        256 << 20
    );
    let zero = Runtime::builder()
        .with_max_idempotency_bytes(0)
        .start()
        .await;
    assert!(
        matches!(
            zero,
            Err(Error::InvalidConfig {
                what: "max idempotency bytes",
                ..
            })
        ),
        "{zero:?}"
    );
}

#[tokio::test(start_paused = true)]
async fn the_results_cap_has_a_documented_default_and_rejects_zero() {
    assert_eq!(
        throttlebeam::idempotency::DEFAULT_MAX_IDEMPOTENCY_RESULTS,
        100_000
    );
    let zero = Runtime::builder()
        .with_max_idempotency_results(0)
        .start()
        .await;
    assert!(
        matches!(
            zero,
            Err(Error::InvalidConfig {
                what: "max idempotency results",
                ..
            })
        ),
        "{zero:?}"
    );
}

#[tokio::test(start_paused = true)]
async fn stats_serialize_with_every_counter() {
    let (_rt, idem) = idempotency().await;
    let runs = runs();
    let _ = idem.run("s:1", op(&runs, MS, 1_u32)).await.unwrap();
    let json = serde_json::to_value(idem.stats()).unwrap();
    for field in [
        "fresh",
        "replays",
        "fingerprint_mismatches",
        "takeovers",
        "in_flight_rejections",
        "timeouts",
        "evictions",
        "stored_results",
        "stored_bytes",
    ] {
        assert!(json.get(field).is_some(), "{field} missing from {json}");
    }
    assert_eq!(json["fresh"], 1);
    assert_eq!(json["stored_results"], 1);
}

/// Item 8 of issue 7, idempotency part: ten million distinct keys on the
/// default settings stay within the documented bound on stored results.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
#[ignore = "slow (10 million keys): run with `cargo test --release --test idempotency -- --ignored`"]
async fn ten_million_distinct_keys_stay_within_the_default_results_cap() {
    const KEYS: u64 = 10_000_000;
    let (rt, idem) = idempotency().await;
    let callers: Vec<_> = (0..4_u64)
        .map(|caller| {
            let idem = idem.clone();
            tokio::spawn(async move {
                let mut key = String::new();
                for i in (caller..KEYS).step_by(4) {
                    key.clear();
                    key.push_str("flood:");
                    key.push_str(&i.to_string());
                    let outcome = idem
                        .run(&key, move || async move { Ok::<_, io::Error>(i) })
                        .await
                        .unwrap();
                    assert_eq!(outcome, IdempotencyOutcome::Fresh(i));
                }
            })
        })
        .collect();
    for caller in callers {
        caller.await.unwrap();
    }
    let cap = throttlebeam::idempotency::DEFAULT_MAX_IDEMPOTENCY_RESULTS;
    let stats = idem.stats();
    assert_eq!(stats.stored_results, cap, "{stats:?}");
    assert_eq!(stats.evictions, KEYS - cap as u64);
    assert_eq!(stats.fresh, KEYS);
    let runtime = rt.stats();
    assert_eq!(
        (runtime.keys, runtime.processes, runtime.ttl_entries),
        (0, 0, cap)
    );
    // Uncapped, 10 million results would hold about 2 GB; capped, the whole
    // test process stays far below that.
    if let Some(rss) = resident_bytes() {
        println!("resident after 10 million keys: {} MiB", rss >> 20);
        assert!(rss < 256 << 20, "{} MiB resident", rss >> 20);
    }
    // The newest results are the ones kept, the oldest the ones evicted. (Not the flood's
    // last key: the four callers do not finish together, so another may store more than
    // the cap's worth of results after it.)
    for i in 0..10_u64 {
        let fresh = idem
            .run(&format!("last:{i}"), move || async move {
                Ok::<_, io::Error>(i)
            })
            .await
            .unwrap();
        assert_eq!(fresh, IdempotencyOutcome::Fresh(i));
    }
    for i in 0..10_u64 {
        let replay = idem
            .run(&format!("last:{i}"), || async { Ok::<_, io::Error>(0) })
            .await
            .unwrap();
        assert_eq!(replay, IdempotencyOutcome::Replay(i), "last:{i}");
    }
    let first = idem
        .run("flood:0", || async { Ok::<_, io::Error>(u64::MAX) })
        .await
        .unwrap();
    assert_eq!(
        first,
        IdempotencyOutcome::Fresh(u64::MAX),
        "flood:0 was evicted"
    );
    assert_eq!(idem.stats().stored_results, cap);
}

/// Resident memory of this process, where `/proc` tells it.
fn resident_bytes() -> Option<usize> {
    let status = std::fs::read_to_string("/proc/self/status").ok()?;
    let kib = status
        .lines()
        .find_map(|line| line.strip_prefix("VmRSS:"))?
        .trim()
        .strip_suffix("kB")?
        .trim()
        .parse::<usize>()
        .ok()?;
    Some(kib * 1024)
}

/// Issue 30 item 11: the shared memory store saturates leases and TTLs too
/// long to add to an instant (it panicked on `Duration::MAX`): such a claim
/// holds, renews and completes as "for about thirty years".
#[tokio::test(start_paused = true)]
async fn the_memory_store_saturates_a_lease_or_ttl_of_duration_max() {
    use throttlebeam::{
        idempotency::ClaimReply, idempotency::ClaimRequest, idempotency::ClaimToken,
        idempotency::IdempotencyStore, idempotency::MemoryIdempotencyStore,
        idempotency::StoredResult,
    };
    let store = MemoryIdempotencyStore::new();
    let (owner, other) = (ClaimToken::new(), ClaimToken::new());
    let forever = Duration::MAX;
    let won = store
        .claim("k", ClaimRequest::new(owner, None, forever, forever))
        .await
        .unwrap();
    assert!(matches!(won, ClaimReply::Won { .. }), "{won:?}");
    sleep(Duration::from_secs(365 * 24 * 3600)).await;
    match store
        .claim("k", ClaimRequest::new(other, None, SEC, SEC))
        .await
        .unwrap()
    {
        ClaimReply::Busy { lease_left } => {
            assert!(lease_left > Duration::from_secs(28 * 365 * 24 * 3600));
        }
        other => panic!("{other:?}"),
    }
    assert!(store.renew("k", owner, forever).await.unwrap());
    let result = StoredResult::new(None, "u8", vec![1]);
    assert!(store.complete("k", owner, &result, forever).await.unwrap());
    sleep(Duration::from_secs(10 * 365 * 24 * 3600)).await;
    assert_eq!(
        store
            .claim("k", ClaimRequest::new(other, None, SEC, SEC))
            .await
            .unwrap(),
        ClaimReply::Completed(result)
    );
}

/// Issue 30 item 11: a shared store that reports a held key's lease as
/// `Duration::MAX` left gets a rejected duplicate a one-second retry hint,
/// not a panic adding it to the clock.
#[tokio::test(start_paused = true)]
async fn a_huge_lease_left_from_a_shared_store_caps_the_retry_hint() {
    use throttlebeam::store::StoreError;
    use throttlebeam::{
        idempotency::ClaimReply, idempotency::ClaimRequest, idempotency::ClaimToken,
        idempotency::IdempotencyStore, idempotency::IdempotencyStoreFuture,
        idempotency::StoredResult,
    };

    /// Every key is held elsewhere, for ever.
    struct HeldForever;

    impl IdempotencyStore for HeldForever {
        fn claim<'a>(
            &'a self,
            _key: &'a str,
            _request: ClaimRequest<'a>,
        ) -> IdempotencyStoreFuture<'a, ClaimReply> {
            Box::pin(async {
                Ok::<_, StoreError>(ClaimReply::Busy {
                    lease_left: Duration::MAX,
                })
            })
        }
        fn complete<'a>(
            &'a self,
            _key: &'a str,
            _token: ClaimToken,
            _result: &'a StoredResult,
            _ttl: Duration,
        ) -> IdempotencyStoreFuture<'a, bool> {
            Box::pin(async { Ok(false) })
        }
        fn release<'a>(&'a self, _: &'a str, _: ClaimToken) -> IdempotencyStoreFuture<'a, bool> {
            Box::pin(async { Ok(false) })
        }
        fn renew<'a>(
            &'a self,
            _: &'a str,
            _: ClaimToken,
            _: Duration,
        ) -> IdempotencyStoreFuture<'a, bool> {
            Box::pin(async { Ok(false) })
        }
    }

    let runtime = Runtime::builder()
        .with_idempotency_store(HeldForever)
        .start()
        .await
        .unwrap();
    let runs = runs();
    let rejected = runtime
        .idempotency()
        .run_with(
            "k",
            IdempotencyOptions::new().with_in_flight(InFlight::Reject),
            op(&runs, MS, 1u8),
        )
        .await;
    match rejected {
        Err(Error::InFlight { key, retry_after }) => {
            assert_eq!((key.as_str(), retry_after), ("k", SEC));
        }
        other => panic!("{other:?}"),
    }
    assert_eq!(count(&runs), 0);
}

/// Issue 30 item 9: a full shared memory store finds what to drop without
/// scanning (it scanned every key under its lock on every new claim, so a
/// flood at the cap was quadratic), and drops exactly what has expired.
#[tokio::test(start_paused = true)]
async fn a_full_memory_store_drops_only_what_expired_and_never_scans() {
    use throttlebeam::store::StoreError;
    use throttlebeam::{
        idempotency::ClaimReply, idempotency::ClaimRequest, idempotency::ClaimToken,
        idempotency::IdempotencyStore, idempotency::MemoryIdempotencyStore,
    };
    const CAP: usize = 50_000;
    let store = MemoryIdempotencyStore::with_max_keys(CAP);
    let claim = |key: String, lease: Duration| {
        let store = store.clone();
        async move {
            store
                .claim(&key, ClaimRequest::new(ClaimToken::new(), None, lease, SEC))
                .await
        }
    };
    // Full: odd keys held for 10 s, even keys for an hour.
    for i in 0..CAP {
        let lease = if i % 2 == 1 { 10 * SEC } else { 3600 * SEC };
        let won = claim(format!("k:{i}"), lease).await.unwrap();
        assert!(matches!(won, ClaimReply::Won { .. }));
    }
    // A flood of new keys at the cap: each refused at once, none scanning
    // the 50,000 keys held (that took minutes in a debug build).
    let started = std::time::Instant::now();
    for i in 0..CAP {
        let refused = claim(format!("new:{i}"), SEC).await.unwrap_err();
        assert!(
            matches!(refused, StoreError::Full { cap: CAP }),
            "{refused:?}"
        );
    }
    let took = started.elapsed();
    assert!(
        took < Duration::from_secs(10),
        "{CAP} refusals took {took:?}"
    );

    // Once the odd keys expire, exactly they make room, in one batch.
    sleep(10 * SEC).await;
    let started = std::time::Instant::now();
    for i in 0..CAP / 2 {
        let won = claim(format!("new:{i}"), 3600 * SEC).await.unwrap();
        assert!(matches!(won, ClaimReply::Won { .. }));
    }
    let took = started.elapsed();
    assert!(
        took < Duration::from_secs(10),
        "{} claims took {took:?}",
        CAP / 2
    );
    assert_eq!(store.len(), CAP);
    assert!(matches!(
        claim("one more".to_owned(), SEC).await,
        Err(StoreError::Full { .. })
    ));
    for i in [0, 2, 4, CAP - 2] {
        let busy = claim(format!("k:{i}"), SEC).await.unwrap();
        assert!(matches!(busy, ClaimReply::Busy { .. }), "k:{i}: {busy:?}");
    }
}

/// Issue 30 item 9: the shared memory store bounds its results by bytes:
/// past its budget the oldest completed results are evicted first and
/// counted; keys in flight are never evicted.
#[tokio::test(start_paused = true)]
async fn the_memory_store_evicts_its_oldest_results_past_its_byte_budget() {
    use throttlebeam::{
        idempotency::ClaimReply, idempotency::ClaimRequest, idempotency::ClaimToken,
        idempotency::IdempotencyStore, idempotency::MemoryIdempotencyStore,
        idempotency::StoredResult,
    };
    // "k:0" + "v" + 1,000 bytes + 200 for the entry.
    const ONE: usize = 3 + 1 + 1_000 + 200;
    assert_eq!(
        MemoryIdempotencyStore::new().max_bytes(),
        throttlebeam::idempotency::DEFAULT_MAX_IDEMPOTENCY_BYTES
    );
    let store = MemoryIdempotencyStore::new().with_max_bytes(3 * ONE);
    let hour = 3600 * SEC;
    let request = |token| ClaimRequest::new(token, None, hour, hour);
    // One key held in flight all along.
    let holder = ClaimToken::new();
    assert!(matches!(
        store.claim("held", request(holder)).await.unwrap(),
        ClaimReply::Won { .. }
    ));
    let complete = |i: u8| {
        let store = store.clone();
        async move {
            let key = format!("k:{i}");
            let owner = ClaimToken::new();
            store.claim(&key, request(owner)).await.unwrap();
            let result = StoredResult::new(None, "v", vec![i; 1_000]);
            assert!(store.complete(&key, owner, &result, hour).await.unwrap());
            sleep(MS).await;
        }
    };
    for i in 0..3 {
        complete(i).await;
    }
    assert_eq!((store.bytes(), store.evictions()), (3 * ONE, 0));
    complete(3).await;
    assert_eq!(
        (store.bytes(), store.evictions(), store.len()),
        (3 * ONE, 1, 4)
    );
    let other = ClaimToken::new();
    assert!(
        matches!(
            store.claim("k:0", request(other)).await.unwrap(),
            ClaimReply::Won { .. }
        ),
        "the oldest was evicted"
    );
    for i in 1..4_u8 {
        match store
            .claim(&format!("k:{i}"), request(other))
            .await
            .unwrap()
        {
            ClaimReply::Completed(result) => assert_eq!(result.value, vec![i; 1_000]),
            reply => panic!("k:{i}: {reply:?}"),
        }
    }
    assert!(matches!(
        store.claim("held", request(other)).await.unwrap(),
        ClaimReply::Busy { .. }
    ));
    // An expired result makes room before a live one is evicted.
    sleep(hour).await;
    assert!(store.renew("held", holder, hour).await.unwrap());
    complete(9).await;
    assert_eq!(store.evictions(), 1, "expired results were dropped instead");
    assert_eq!(store.bytes(), ONE);
}

/// S22: a run sees its claim's fence, which grows with every claim of its key (a holder that
/// failed holds a smaller one than the next), and a reservation has its own; outside a run
/// there is none.
#[tokio::test(start_paused = true)]
async fn s22_a_run_and_a_reservation_hold_a_fence_that_grows_with_every_claim() {
    use throttlebeam::idempotency::Fence;
    let (_rt, idem) = idempotency().await;
    assert_eq!(Fence::current(), None);
    let failed = idem
        .run("fenced:1", || async {
            Err::<Fence, _>(std::io::Error::other(
                Fence::current().map(|f| f.get()).unwrap_or(0).to_string(),
            ))
        })
        .await
        .unwrap_err();
    let first: u64 = std::error::Error::source(&failed)
        .unwrap()
        .to_string()
        .parse()
        .unwrap();
    assert!(first > 0, "the failed run had a fence");
    let second = idem
        .run("fenced:1", || async {
            Ok::<_, std::io::Error>(Fence::current().expect("in a run"))
        })
        .await
        .unwrap()
        .into_inner();
    assert!(second.get() > first, "{second} after {first}");
    let IdempotencyReserved::Fresh(reservation) =
        idem.reserve::<u32>("fenced:2", opts()).await.unwrap()
    else {
        panic!("fresh key");
    };
    assert!(
        reservation.fence() > second,
        "one counter for the runtime's claims"
    );
    reservation.complete(1).await.unwrap();
}
