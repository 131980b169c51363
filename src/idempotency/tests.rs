//! Unit tests of the idempotency ledger: the paths only its internals reach.

use std::sync::Mutex;
use std::sync::atomic::{AtomicUsize, Ordering};
use std::time::Duration;
use tokio::time::Instant;

use super::*;

#[derive(Debug, Clone, PartialEq, serde::Serialize, serde::Deserialize)]
struct Charge {
    id: u64,
    note: String,
}

fn counted(
    runs: &Arc<AtomicUsize>,
    id: u64,
) -> impl FnOnce() -> std::pin::Pin<Box<dyn Future<Output = Result<Charge, std::io::Error>> + Send>>
+ Send
+ 'static {
    let runs = Arc::clone(runs);
    move || {
        Box::pin(async move {
            runs.fetch_add(1, Ordering::SeqCst);
            tokio::time::sleep(Duration::from_millis(10)).await;
            Ok(Charge {
                id,
                note: "paid".to_owned(),
            })
        })
    }
}

#[tokio::test(start_paused = true)]
async fn a_completion_after_the_fast_path_missed_is_replayed_by_the_claim() {
    let runtime = Runtime::builder().start().await.unwrap();
    let idempotency = runtime.idempotency();
    let options = IdempotencyOptions::new();
    let runs = Arc::new(AtomicUsize::new(0));
    // The replay fast path finds nothing...
    let ledger = State::of(&runtime.core).ledger();
    let missed = fast_replay::<Charge>(&runtime.core, &ledger, "k", &options).unwrap();
    assert_eq!(missed, None);
    // ...then another caller runs the key and stores its result...
    let first = idempotency
        .run_with("k", options.clone(), counted(&runs, 1))
        .await
        .unwrap();
    assert!(first.is_fresh());
    // ...and the run that missed, claiming without looking again first, replays it.
    let late = idempotency
        .run_after_miss("k", options, counted(&runs, 2))
        .await
        .unwrap();
    assert_eq!(late, IdempotencyOutcome::Replay(first.into_inner()));
    assert_eq!(runs.load(Ordering::SeqCst), 1);
}

const SEC: Duration = Duration::from_secs(1);

#[tokio::test(start_paused = true)]
async fn a_holder_that_stops_renewing_is_taken_over_once_and_its_late_completion_is_fenced() {
    let runtime = Runtime::builder().start().await.unwrap();
    let ledger = State::of(&runtime.core).ledger();
    let options = IdempotencyOptions::new().with_lease(SEC);
    // A holder that claimed the key, then stopped renewing without
    // releasing it: what a cut-off instance of a shared store looks like.
    let Step::Owner(gone) = ledger
        .attempt::<Charge>("k", &options, Instant::now(), Instant::now())
        .await
        .unwrap()
    else {
        panic!("k is new");
    };
    let start = Instant::now();
    let runs = Arc::new(AtomicUsize::new(0));
    let duplicates: Vec<_> = (1..=3)
        .map(|id| {
            let (runtime, ledger, f) = (runtime.clone(), Arc::clone(&ledger), counted(&runs, id));
            let options = options.clone();
            tokio::spawn(async move { run_in(&runtime.core, &ledger, "k", f, options).await })
        })
        .collect();
    tokio::time::sleep(SEC + Duration::from_millis(5)).await;
    assert_eq!(
        runs.load(Ordering::SeqCst),
        1,
        "one duplicate took over at 1 s"
    );

    // The old holder wakes up while the new one runs: fenced off.
    let late = gone
        .complete(Charge {
            id: 9,
            note: "stale".to_owned(),
        })
        .await;
    assert!(
        matches!(late, Err(ref unrecorded) if unrecorded.why == NotRecorded::LeaseLost),
        "{late:?}"
    );

    let mut outcomes = Vec::new();
    for duplicate in duplicates {
        outcomes.push(duplicate.await.unwrap().unwrap());
    }
    assert_eq!(start.elapsed(), SEC + Duration::from_millis(10));
    assert_eq!(outcomes.iter().filter(|o| o.is_fresh()).count(), 1);
    assert!(
        outcomes.iter().all(|o| o.value().id != 9),
        "the stale value was not handed out"
    );
    let value = outcomes[0].value().clone();
    assert!(outcomes.iter().all(|o| *o.value() == value));
    assert_eq!(runs.load(Ordering::SeqCst), 1);
    let stats = stats_of(&ledger);
    assert_eq!(
        (stats.takeovers, stats.fresh, stats.replays),
        (1, 1, 2),
        "{stats:?}"
    );
}

#[tokio::test(start_paused = true)]
async fn a_one_mib_fingerprint_is_kept_as_its_32_byte_digest() {
    use sha2::{Digest, Sha256};

    let runtime = Runtime::builder().start().await.unwrap();
    let core = &runtime.core;
    let ledger = State::of(core).ledger();
    let body = vec![b'x'; 1 << 20];
    let options = IdempotencyOptions::new().with_fingerprint(&body);
    assert!(std::mem::size_of_val(&options) <= 128);

    let fresh = run_in(
        core,
        &ledger,
        "k",
        || async { Ok::<_, std::io::Error>(7_u64) },
        options.clone(),
    )
    .await
    .unwrap();
    assert_eq!(fresh, IdempotencyOutcome::Fresh(7));

    let record = super::full_key::with_full_key_bytes(None, "k", |full| {
        ledger.store.read(full, super::store::Record::clone)
    })
    .unwrap();
    let digest: [u8; 32] = Sha256::digest(&body).into();
    assert_eq!(record.fingerprint(), Some(&digest));
    // Digest and value in one allocation: 33 + 8 bytes, padded.
    assert!(record.footprint() <= 48, "{} bytes", record.footprint());
}

/// Collects what a `tracing` subscriber writes.
#[derive(Clone, Default)]
struct Captured(Arc<Mutex<Vec<u8>>>);

impl std::io::Write for Captured {
    fn write(&mut self, bytes: &[u8]) -> std::io::Result<usize> {
        self.0.lock().unwrap().extend_from_slice(bytes);
        Ok(bytes.len())
    }
    fn flush(&mut self) -> std::io::Result<()> {
        Ok(())
    }
}

#[tokio::test(start_paused = true)]
async fn evictions_are_logged_at_warn_at_most_once_a_minute() {
    let captured = Captured::default();
    let writer = captured.clone();
    let subscriber = tracing_subscriber::fmt()
        .with_max_level(tracing::Level::WARN)
        .with_ansi(false)
        .with_writer(move || writer.clone())
        .finish();
    let _guard = tracing::subscriber::set_default(subscriber);
    let warnings = || {
        String::from_utf8(captured.0.lock().unwrap().clone())
            .unwrap()
            .matches("idempotency results evicted")
            .count()
    };
    let idem = Runtime::builder()
        .with_max_idempotency_results(1)
        .start()
        .await
        .unwrap()
        .idempotency();
    let run = |key: String| {
        let idem = idem.clone();
        async move {
            idem.run(&key, || async { Ok::<_, std::io::Error>(1_u8) })
                .await
                .unwrap()
        }
    };

    for i in 0..10 {
        let _ = run(format!("a{i}")).await;
    }
    assert_eq!((idem.stats().evictions, warnings()), (9, 1));
    tokio::time::sleep(Duration::from_secs(59)).await;
    let _ = run("b".to_owned()).await;
    assert_eq!((idem.stats().evictions, warnings()), (10, 1));
    tokio::time::sleep(Duration::from_secs(1)).await;
    let _ = run("c".to_owned()).await;
    assert_eq!((idem.stats().evictions, warnings()), (11, 2));
}

#[tokio::test(start_paused = true)]
async fn evictions_by_the_byte_budget_are_logged_with_the_bytes() {
    let captured = Captured::default();
    let writer = captured.clone();
    let subscriber = tracing_subscriber::fmt()
        .with_max_level(tracing::Level::WARN)
        .with_ansi(false)
        .with_writer(move || writer.clone())
        .finish();
    let _guard = tracing::subscriber::set_default(subscriber);
    let idem = Runtime::builder()
        .with_max_idempotency_bytes(1_000)
        .start()
        .await
        .unwrap()
        .idempotency();
    for key in ["a", "b"] {
        let run = idem.run(key, || async { Ok::<_, std::io::Error>(vec![0u8; 600]) });
        assert!(run.await.unwrap().is_fresh());
    }
    assert_eq!(idem.stats().evictions, 1);
    let logged = String::from_utf8(captured.0.lock().unwrap().clone()).unwrap();
    assert!(logged.contains("idempotency results evicted"), "{logged}");
    assert!(logged.contains("max_bytes=1000"), "{logged}");
    assert!(logged.contains("stored_bytes=805"), "{logged}");
}

#[tokio::test(start_paused = true)]
async fn a_claim_gets_its_cell_from_its_first_waiter_and_one_made_after_shutdown_is_told_at_once() {
    let runtime = Runtime::builder().start().await.unwrap();
    let ledger = State::of(&runtime.core).ledger();
    let options = IdempotencyOptions::new();
    let (now, deadline) = (Instant::now(), Instant::now() + Duration::from_secs(1));
    let claim = |key: &'static str| {
        let ledger = Arc::clone(&ledger);
        let options = options.clone();
        async move {
            match ledger.attempt::<u32>(key, &options, now, deadline).await {
                Ok(Step::Owner(ticket)) => ticket,
                _ => panic!("a free key is claimed"),
            }
        }
    };
    let wait = |key: &'static str| {
        let ledger = Arc::clone(&ledger);
        let options = options.clone();
        async move {
            match ledger.attempt::<u32>(key, &options, now, deadline).await {
                Ok(Step::Wait { cell, .. }) => cell,
                _ => panic!("a held key is waited for"),
            }
        }
    };
    let (waited, unwaited) = (claim("a").await, claim("b").await);
    let (first, second) = (wait("a").await, wait("a").await);
    assert!(Arc::ptr_eq(&first, &second), "one cell per claim");
    assert!(first.get().is_none());
    ledger.shutdown();
    assert!(matches!(first.get(), Some(Ok(Settled::Released))));
    // "b" had no waiter when the shutdown passed: its first one is told at once.
    let late = wait("b").await;
    assert!(matches!(late.get(), Some(Ok(Settled::Released))));
    drop((waited, unwaited));
}
