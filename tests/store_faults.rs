//! Stores of your own that hang, fail or panic, behind every seam that takes
//! one: each call goes through the store guard (a timeout, a panic
//! boundary, cancellation safety), so a caller gets a typed error within its
//! bound, never a hang or an unwind (issue 30 item 5; SCENARIOS S7, S15).
//! An owner keeps its result through an outage shorter than its lease (S14,
//! item 1), and no failure goes unlogged (item 14).
#![cfg(all(feature = "runtime", feature = "http"))]

mod support;

use std::collections::HashMap;
use std::num::NonZeroU32;
use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::{Arc, Mutex};
use std::time::Duration;

use support::{Runs, ms};
use throttlebeam::rate_limit::{
    AsyncRateLimitStore, DEFAULT_STORE_CALL_TIMEOUT, EnforceOutcome, Enforcer, FailMode, Gcra,
    GcraState, Limiter, MemoryRateLimitStore, RateLimitError, RateLimitReply, RateLimitRequest,
    RateLimitStore,
};
use throttlebeam::store::StoreError;
use throttlebeam::{
    Error, IdempotencyOptions, IdempotencyOutcome, Runtime, coalesce::WindowClaim,
    coalesce::WindowEntry, coalesce::WindowStore, coalesce::WindowStoreFuture,
    idempotency::ClaimReply, idempotency::ClaimRequest, idempotency::ClaimToken,
    idempotency::IdempotencyReserved, idempotency::IdempotencyStore,
    idempotency::IdempotencyStoreFuture, idempotency::KeyChanged,
    idempotency::MemoryIdempotencyStore, idempotency::NotRecorded, idempotency::StoredResult,
};
use tokio::time::Instant;

/// What a faulty store does on one operation.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Fault {
    /// Answers as the memory store does.
    Pass,
    /// Never answers.
    Hang,
    /// Answers "unavailable" at once.
    Fail,
    /// Panics while building its future.
    PanicBuilding,
    /// Panics when its future is polled, after a yield.
    PanicPolling,
}

/// A [`MemoryIdempotencyStore`] whose operations misbehave on demand.
#[derive(Clone, Default)]
struct Faulty {
    inner: MemoryIdempotencyStore,
    faults: Arc<Mutex<HashMap<&'static str, Fault>>>,
    calls: Arc<Mutex<HashMap<&'static str, usize>>>,
}

impl Faulty {
    fn with(self, op: &'static str, fault: Fault) -> Self {
        self.set(op, fault);
        self
    }

    fn set(&self, op: &'static str, fault: Fault) {
        self.faults.lock().unwrap().insert(op, fault);
    }

    fn calls(&self, op: &'static str) -> usize {
        self.calls.lock().unwrap().get(op).copied().unwrap_or(0)
    }

    fn fault(&self, op: &'static str) -> Fault {
        *self.calls.lock().unwrap().entry(op).or_default() += 1;
        self.faults
            .lock()
            .unwrap()
            .get(op)
            .copied()
            .unwrap_or(Fault::Pass)
    }

    fn wrap<'a, T: Send + 'a>(
        &self,
        op: &'static str,
        call: impl FnOnce() -> IdempotencyStoreFuture<'a, T>,
    ) -> IdempotencyStoreFuture<'a, T> {
        match self.fault(op) {
            Fault::Pass => call(),
            Fault::Hang => Box::pin(std::future::pending()),
            Fault::Fail => Box::pin(std::future::ready(Err(StoreError::unavailable(
                std::io::Error::other("connection refused"),
            )))),
            Fault::PanicBuilding => panic!("{op} panicked while building its call"),
            Fault::PanicPolling => Box::pin(async move {
                tokio::task::yield_now().await;
                panic!("{op} panicked while answering")
            }),
        }
    }
}

impl IdempotencyStore for Faulty {
    fn claim<'a>(
        &'a self,
        key: &'a str,
        request: ClaimRequest<'a>,
    ) -> IdempotencyStoreFuture<'a, ClaimReply> {
        self.wrap("claim", || self.inner.claim(key, request))
    }

    fn complete<'a>(
        &'a self,
        key: &'a str,
        token: ClaimToken,
        result: &'a StoredResult,
        ttl: Duration,
    ) -> IdempotencyStoreFuture<'a, bool> {
        self.wrap("complete", || self.inner.complete(key, token, result, ttl))
    }

    fn release<'a>(&'a self, key: &'a str, token: ClaimToken) -> IdempotencyStoreFuture<'a, bool> {
        self.wrap("release", || self.inner.release(key, token))
    }

    fn renew<'a>(
        &'a self,
        key: &'a str,
        token: ClaimToken,
        lease: Duration,
    ) -> IdempotencyStoreFuture<'a, bool> {
        self.wrap("renew", || self.inner.renew(key, token, lease))
    }

    fn watch(&self, key: &str) -> KeyChanged {
        match self.fault("watch") {
            Fault::PanicBuilding => panic!("watch panicked"),
            Fault::PanicPolling => KeyChanged::new(async {
                tokio::task::yield_now().await;
                panic!("a wake-up panicked")
            }),
            Fault::Hang | Fault::Fail => KeyChanged::never(),
            Fault::Pass => self.inner.watch(key),
        }
    }
}

async fn runtime_on(store: &Faulty) -> Runtime {
    Runtime::builder()
        .with_idempotency_store(store.clone())
        .start()
        .await
        .expect("runtime starts")
}

/// The store error under an idempotency error.
fn store_error(e: &Error) -> &StoreError {
    let Error::StoreUnavailable { source, .. } = e else {
        panic!("expected StoreUnavailable, got {e:?}")
    };
    source
        .downcast_ref::<StoreError>()
        .unwrap_or_else(|| panic!("a store error under {e:?}"))
}

/// A function that counts its runs and returns `value`.
fn counted(
    runs: &Runs,
    value: u32,
) -> impl FnOnce() -> std::future::Ready<Result<u32, std::io::Error>> + Send + 'static {
    let runs = runs.clone();
    move || {
        runs.hit();
        std::future::ready(Ok(value))
    }
}

#[tokio::test(start_paused = true)]
async fn i_a_hanging_store_fails_callers_at_their_wait_timeout_not_never() {
    let store = Faulty::default().with("claim", Fault::Hang);
    let rt = runtime_on(&store).await;
    let options = IdempotencyOptions::new()
        .with_wait_timeout(Duration::from_secs(2))
        .with_lease(Duration::from_secs(30));
    let runs = Runs::default();
    let started = Instant::now();
    let outcome = rt
        .idempotency()
        .run_with("pay:1", options.clone(), counted(&runs, 1))
        .await;
    let err = outcome.expect_err("the store never answered");
    assert!(
        matches!(store_error(&err), StoreError::Timeout { after } if *after == Duration::from_secs(2)),
        "{err:?}"
    );
    assert_eq!(
        started.elapsed(),
        Duration::from_secs(2),
        "bounded by the wait timeout"
    );
    // A lease shorter than the wait bounds the claim instead.
    let started = Instant::now();
    let reserved = rt
        .idempotency()
        .reserve::<u32>("pay:2", options.with_lease(ms(700)))
        .await;
    let err = reserved.expect_err("the store never answered");
    assert!(
        matches!(store_error(&err), StoreError::Timeout { .. }),
        "{err:?}"
    );
    assert_eq!(started.elapsed(), ms(700));
    assert_eq!(runs.get(), 0, "nothing runs without the store");
    // The key is free locally: once the store answers, it runs.
    store.set("claim", Fault::Pass);
    let outcome = rt
        .idempotency()
        .run("pay:1", counted(&runs, 3))
        .await
        .unwrap();
    assert_eq!(outcome, IdempotencyOutcome::Fresh(3));
}

#[tokio::test(start_paused = true)]
async fn i_a_failing_store_is_store_unavailable_and_runs_nothing() {
    let store = Faulty::default().with("claim", Fault::Fail);
    let rt = runtime_on(&store).await;
    let runs = Runs::default();
    let err = rt
        .idempotency()
        .run("pay:1", counted(&runs, 1))
        .await
        .expect_err("the store failed");
    assert!(
        matches!(store_error(&err), StoreError::Unavailable(_)),
        "{err:?}"
    );
    assert!(err.to_string().contains("pay:1"), "{err}");
    let err = rt
        .idempotency()
        .reserve::<u32>("pay:1", IdempotencyOptions::new())
        .await
        .expect_err("the store failed");
    assert!(
        matches!(store_error(&err), StoreError::Unavailable(_)),
        "{err:?}"
    );
    assert_eq!(runs.get(), 0);
}

#[tokio::test(start_paused = true)]
async fn i_a_panicking_store_is_a_typed_error_and_never_unwinds_into_the_caller() {
    for fault in [Fault::PanicBuilding, Fault::PanicPolling] {
        let store = Faulty::default().with("claim", fault);
        let rt = runtime_on(&store).await;
        let runs = Runs::default();
        let err = rt
            .idempotency()
            .run("pay:1", counted(&runs, 1))
            .await
            .expect_err("the store panicked");
        match store_error(&err) {
            StoreError::Panicked { message } => {
                assert!(message.starts_with("claim panicked"), "{message}");
            }
            other => panic!("{fault:?}: {other:?}"),
        }
        let err = rt
            .idempotency()
            .reserve::<u32>("pay:1", IdempotencyOptions::new())
            .await
            .expect_err("the store panicked");
        assert!(
            matches!(store_error(&err), StoreError::Panicked { .. }),
            "{err:?}"
        );
        assert_eq!(runs.get(), 0, "{fault:?}");
    }
}

#[tokio::test(start_paused = true)]
async fn i_a_renewer_that_panics_or_hangs_never_reaches_the_owners_run() {
    for fault in [
        Fault::PanicBuilding,
        Fault::PanicPolling,
        Fault::Hang,
        Fault::Fail,
    ] {
        let store = Faulty::default().with("renew", fault);
        let rt = runtime_on(&store).await;
        let runs = Runs::default();
        let options = IdempotencyOptions::new().with_lease(ms(300));
        let slow = {
            let runs = runs.clone();
            move || async move {
                runs.hit();
                // Long enough for a few renewals.
                tokio::time::sleep(Duration::from_secs(1)).await;
                Ok::<_, std::io::Error>(7u32)
            }
        };
        let outcome = rt
            .idempotency()
            .run_with("job:1", options.clone(), slow)
            .await;
        assert_eq!(outcome.unwrap(), IdempotencyOutcome::Fresh(7), "{fault:?}");
        assert!(store.calls("renew") >= 3, "{fault:?}: renewals were tried");
        let replay = rt
            .idempotency()
            .run_with("job:1", options, counted(&runs, 8))
            .await
            .unwrap();
        assert_eq!(replay, IdempotencyOutcome::Replay(7), "{fault:?}");
        assert_eq!(runs.get(), 1, "{fault:?}");
    }
}

#[tokio::test(start_paused = true)]
async fn i_a_panicking_wake_up_only_costs_a_waiter_a_poll() {
    for fault in [Fault::PanicBuilding, Fault::PanicPolling] {
        let store = Faulty::default().with("watch", fault);
        let (a, b) = (runtime_on(&store).await, runtime_on(&store).await);
        let IdempotencyReserved::Fresh(reservation) = a
            .idempotency()
            .reserve::<u32>("order:1", IdempotencyOptions::new())
            .await
            .unwrap()
        else {
            panic!("fresh")
        };
        let runs = Runs::default();
        let waiter = tokio::spawn({
            let (b, runs) = (b.clone(), runs.clone());
            async move { b.idempotency().run("order:1", counted(&runs, 2)).await }
        });
        tokio::time::sleep(Duration::from_secs(1)).await;
        reservation.complete(1).await.unwrap();
        let outcome = waiter.await.expect("the waiter did not unwind");
        assert_eq!(outcome.unwrap(), IdempotencyOutcome::Replay(1), "{fault:?}");
        assert_eq!(runs.get(), 0);
        assert!(
            store.calls("watch") >= 2,
            "{fault:?}: the waiter looked again"
        );
    }
}

/// S14 with a store of your own: a completion the store fails for 2 s of a
/// 5 s lease is retried until stored; the key ran once and replays.
#[tokio::test(start_paused = true)]
async fn i_an_outage_shorter_than_the_lease_never_loses_a_result_that_ran() {
    let store = Faulty::default().with("complete", Fault::Fail);
    let (a, b) = (runtime_on(&store).await, runtime_on(&store).await);
    let options = IdempotencyOptions::new().with_lease(Duration::from_secs(5));
    let runs = Runs::default();
    let back = tokio::spawn({
        let store = store.clone();
        async move {
            tokio::time::sleep(Duration::from_secs(2)).await;
            store.set("complete", Fault::Pass);
        }
    });
    let started = Instant::now();
    let outcome = a
        .idempotency()
        .run_with("pay:1", options.clone(), counted(&runs, 1))
        .await;
    assert_eq!(outcome.unwrap(), IdempotencyOutcome::Fresh(1));
    assert!(
        started.elapsed() >= Duration::from_secs(2),
        "stored once the store was back"
    );
    assert!(store.calls("complete") > 2, "retried");
    back.await.unwrap();
    let replay = b
        .idempotency()
        .run_with("pay:1", options, counted(&runs, 2))
        .await
        .unwrap();
    assert_eq!(replay, IdempotencyOutcome::Replay(1));
    assert_eq!(runs.get(), 1);
    assert_eq!(store.calls("release"), 0);
}

/// The owner gives its result up only once its claim has certainly lapsed
/// in the store (claim + lease), and then does not release the key there:
/// the function ran, nothing may free the key before its lease says so.
#[tokio::test(start_paused = true)]
async fn i_an_owner_gives_up_storing_only_when_its_claim_has_certainly_lapsed() {
    for fault in [Fault::Fail, Fault::Hang] {
        let store = Faulty::default().with("complete", fault);
        let rt = runtime_on(&store).await;
        let lease = Duration::from_secs(1);
        let options = IdempotencyOptions::new().with_lease(lease);
        let runs = Runs::default();
        let started = Instant::now();
        let outcome = rt
            .idempotency()
            .run_with("pay:1", options.clone(), counted(&runs, 1))
            .await;
        // It ran: an outcome that hands the value back and says it was not recorded.
        assert_eq!(
            outcome.expect("the function ran"),
            IdempotencyOutcome::Unrecorded(1, NotRecorded::Unconfirmed),
            "{fault:?}"
        );
        assert_eq!(
            started.elapsed(),
            lease,
            "{fault:?}: until the claim lapsed, no longer"
        );
        assert_eq!(
            store.calls("release"),
            0,
            "{fault:?}: not released in the store"
        );
        // The documented lease-lapse case: the lapsed key runs again.
        store.set("complete", Fault::Pass);
        let again = rt
            .idempotency()
            .run_with("pay:1", options, counted(&runs, 2))
            .await
            .unwrap();
        assert_eq!(again, IdempotencyOutcome::Fresh(2), "{fault:?}");
    }
}

/// The owner of `job:1` on `a`, its function running for `runs_for` (returns 1).
fn slow_owner(
    a: &Runtime,
    runs: &Runs,
    options: &IdempotencyOptions,
    runs_for: Duration,
) -> tokio::task::JoinHandle<Result<IdempotencyOutcome<u32>, Error>> {
    let (a, runs, options) = (a.clone(), runs.clone(), options.clone());
    tokio::spawn(async move {
        let slow = move || async move {
            runs.hit();
            tokio::time::sleep(runs_for).await;
            Ok::<_, std::io::Error>(1u32)
        };
        a.idempotency().run_with("job:1", options, slow).await
    })
}

/// A renewal the store failed is tried again sooner than the next period,
/// so a store back from an outage hears from the live owner before its
/// lease lapses; a duplicate elsewhere never takes the key over.
#[tokio::test(start_paused = true)]
async fn i_a_failed_renewal_is_retried_before_the_next_period() {
    let store = Faulty::default().with("renew", Fault::Fail);
    let (a, b) = (runtime_on(&store).await, runtime_on(&store).await);
    // Renewals every second.
    let options = IdempotencyOptions::new()
        .with_lease(Duration::from_secs(3))
        .with_wait_timeout(Duration::from_secs(10));
    let runs = Runs::default();
    let owner = slow_owner(&a, &runs, &options, Duration::from_secs(4));
    tokio::time::sleep(Duration::from_millis(2_500)).await;
    // The period's two renewals (at 1 s and 2 s) and the retries between.
    assert!(
        store.calls("renew") >= 5,
        "{} renewals",
        store.calls("renew")
    );
    store.set("renew", Fault::Pass);
    tokio::time::sleep(Duration::from_millis(700)).await;
    // At 3.2 s, past the claim's first lease (3 s): only the retried
    // renewal at 2.63 s kept it.
    let outcome = b
        .idempotency()
        .run_with("job:1", options, counted(&runs, 2))
        .await
        .unwrap();
    assert_eq!(outcome, IdempotencyOutcome::Replay(1));
    assert_eq!(owner.await.unwrap().unwrap(), IdempotencyOutcome::Fresh(1));
    assert_eq!(runs.get(), 1);
}

/// An outage that begins just before the first renewal leaves the owner two thirds of a
/// lease: its retries close in on the lease's end rather than backing off to a period, so a
/// store back 1.65 s into a 2 s lease still hears from it in time (found by the fault
/// harness: `--seed 12 --only redis-kill`, a 941 ms kill from 0.64 s into a run's lease).
#[tokio::test(start_paused = true)]
async fn i_renewal_retries_close_in_on_the_end_of_the_lease() {
    let store = Faulty::default().with("renew", Fault::Fail);
    let (a, b) = (runtime_on(&store).await, runtime_on(&store).await);
    // Renewals every 667 ms; with retries backed off to a period, the tries after the first
    // renewal failed would be at 0.72, 0.82, 1.02, 1.42 and 2.08 s: past the lease.
    let options = IdempotencyOptions::new()
        .with_lease(Duration::from_secs(2))
        .with_wait_timeout(Duration::from_secs(10));
    let runs = Runs::default();
    let owner = slow_owner(&a, &runs, &options, Duration::from_secs(3));
    tokio::time::sleep(Duration::from_millis(1_650)).await;
    store.set("renew", Fault::Pass);
    tokio::time::sleep(Duration::from_millis(400)).await;
    // At 2.05 s, past the claim's first lease: a duplicate elsewhere finds it held.
    let outcome = b
        .idempotency()
        .run_with("job:1", options, counted(&runs, 2))
        .await
        .unwrap();
    assert_eq!(outcome, IdempotencyOutcome::Replay(1));
    assert_eq!(owner.await.unwrap().unwrap(), IdempotencyOutcome::Fresh(1));
    assert_eq!(runs.get(), 1, "never taken over");
}

/// Warn-level log lines, captured.
#[derive(Clone, Default)]
struct Warnings(Arc<Mutex<Vec<u8>>>);

impl std::io::Write for Warnings {
    fn write(&mut self, buf: &[u8]) -> std::io::Result<usize> {
        self.0.lock().unwrap().extend_from_slice(buf);
        Ok(buf.len())
    }
    fn flush(&mut self) -> std::io::Result<()> {
        Ok(())
    }
}

impl Warnings {
    /// Captures warnings on this thread until the guard drops.
    fn capture(&self) -> tracing::subscriber::DefaultGuard {
        let sink = self.clone();
        let subscriber = tracing_subscriber::fmt()
            .with_max_level(tracing::Level::WARN)
            .with_ansi(false)
            .with_writer(move || sink.clone())
            .finish();
        tracing::subscriber::set_default(subscriber)
    }

    fn lines(&self) -> String {
        String::from_utf8_lossy(&self.0.lock().unwrap()).into_owned()
    }
}

/// Issue 30 item 14: a store failure that makes idempotency fail closed is
/// logged at warn with its cause.
#[tokio::test(start_paused = true)]
async fn i_a_store_failure_answered_store_unavailable_is_logged_with_its_cause() {
    let warnings = Warnings::default();
    let _capture = warnings.capture();
    let store = Faulty::default().with("claim", Fault::Fail);
    let rt = runtime_on(&store).await;
    let err = rt
        .idempotency()
        .run("pay:logged", counted(&Runs::default(), 1))
        .await
        .expect_err("the store failed");
    assert!(matches!(err, Error::StoreUnavailable { .. }), "{err:?}");
    let lines = warnings.lines();
    assert!(lines.contains("WARN"), "{lines}");
    assert!(lines.contains("pay:logged"), "{lines}");
    assert!(lines.contains("connection refused"), "the cause: {lines}");
}

/// Issue 30 item 14: a run that fails after its caller left is logged at
/// warn and counted; one whose caller sees the error is not.
#[tokio::test(start_paused = true)]
async fn i_a_run_that_fails_after_its_caller_left_is_logged_and_counted() {
    let warnings = Warnings::default();
    let _capture = warnings.capture();
    let rt = support::runtime().await;
    let idem = rt.idempotency();
    let failing = |note: &'static str| {
        move || async move {
            tokio::time::sleep(Duration::from_secs(1)).await;
            Err::<u32, _>(support::Oops(note))
        }
    };
    let left =
        tokio::time::timeout(ms(100), idem.run("job:left", failing("nobody saw this"))).await;
    assert!(left.is_err(), "the caller left mid-run");
    assert_eq!(idem.stats().failures_after_caller_left, 0, "still running");
    tokio::time::sleep(Duration::from_secs(2)).await;
    assert_eq!(idem.stats().failures_after_caller_left, 1);
    let seen = idem.run("job:seen", failing("seen")).await;
    assert!(matches!(seen, Err(Error::Failed { .. })), "{seen:?}");
    // A run whose caller left and that succeeds is no failure.
    let fine = tokio::time::timeout(
        ms(100),
        idem.run("job:fine", || async {
            tokio::time::sleep(Duration::from_secs(1)).await;
            Ok::<_, std::io::Error>(1u32)
        }),
    )
    .await;
    assert!(fine.is_err());
    tokio::time::sleep(Duration::from_secs(2)).await;
    assert_eq!(idem.stats().failures_after_caller_left, 1);
    let lines = warnings.lines();
    assert!(lines.contains("failed after its caller left"), "{lines}");
    assert!(lines.contains("job:left"), "{lines}");
    assert!(lines.contains("nobody saw this"), "the cause: {lines}");
    assert!(!lines.contains("job:seen"), "{lines}");
    assert!(!lines.contains("job:fine"), "{lines}");
}

/// A GCRA store of your own that misbehaves on demand.
struct FaultyLimits {
    inner: MemoryRateLimitStore<GcraState>,
    fault: Mutex<Fault>,
    timeout: Option<Duration>,
    calls: AtomicUsize,
}

impl FaultyLimits {
    fn new(fault: Fault) -> Self {
        Self {
            inner: MemoryRateLimitStore::new(),
            fault: Mutex::new(fault),
            timeout: Some(DEFAULT_STORE_CALL_TIMEOUT),
            calls: AtomicUsize::new(0),
        }
    }
}

impl AsyncRateLimitStore<Gcra> for FaultyLimits {
    fn apply_async(
        &self,
        request: RateLimitRequest<'_, Gcra>,
    ) -> impl Future<Output = Result<RateLimitReply, RateLimitError>> + Send {
        self.calls.fetch_add(1, Ordering::SeqCst);
        let fault = *self.fault.lock().unwrap();
        let reply = (fault == Fault::Pass).then(|| self.inner.apply(request));
        let key = request.key.to_owned();
        if fault == Fault::PanicBuilding {
            panic!("apply panicked while building its call");
        }
        async move {
            match fault {
                Fault::Pass => reply.expect("applied"),
                Fault::Hang => std::future::pending().await,
                Fault::Fail => Err(RateLimitError::store(
                    &key,
                    std::io::Error::other("connection refused"),
                )),
                Fault::PanicBuilding => unreachable!(),
                Fault::PanicPolling => {
                    tokio::task::yield_now().await;
                    panic!("apply panicked while answering")
                }
            }
        }
    }

    fn call_timeout(&self) -> Option<Duration> {
        self.timeout
    }
}

fn limiter_on(store: FaultyLimits) -> Limiter<Gcra, FaultyLimits> {
    Limiter::builder(Gcra::per_second(NonZeroU32::new(10).unwrap()))
        .with_store(store)
        .with_namespace("api")
        .build()
}

/// The store error under a rate-limit error.
fn limit_store_error(e: &RateLimitError) -> &StoreError {
    let RateLimitError::Store { source, .. } = e else {
        panic!("expected a store error, got {e:?}")
    };
    source
        .downcast_ref::<StoreError>()
        .unwrap_or_else(|| panic!("a StoreError under {e:?}"))
}

#[tokio::test(start_paused = true)]
async fn r_a_hanging_async_store_times_out_and_the_fail_mode_decides() {
    let limiter = limiter_on(FaultyLimits::new(Fault::Hang));
    let started = Instant::now();
    let err = limiter.check_async("u1").await.expect_err("the store hung");
    assert_eq!(started.elapsed(), DEFAULT_STORE_CALL_TIMEOUT);
    assert!(
        matches!(limit_store_error(&err), StoreError::Timeout { after } if *after == DEFAULT_STORE_CALL_TIMEOUT),
        "{err:?}"
    );
    assert!(err.to_string().contains("api:u1"), "{err}");
    assert_eq!(limiter.stats().errors, 1);
    // Every async operation goes through the guard.
    assert!(limiter.peek_async("u1").await.unwrap_err().is_store());
    assert!(
        limiter
            .forecast_async("u1", 1)
            .await
            .unwrap_err()
            .is_store()
    );
    assert!(limiter.reset_async("u1").await.unwrap_err().is_store());
    // A store that says how long its calls may take is held to it.
    let mut quick = FaultyLimits::new(Fault::Hang);
    quick.timeout = Some(ms(40));
    let started = Instant::now();
    let err = limiter_on(quick).check_async("u1").await.unwrap_err();
    assert_eq!(started.elapsed(), ms(40));
    assert!(err.is_store());
    for (mode, allowed) in [(FailMode::Open, true), (FailMode::Closed, false)] {
        let enforcer = Enforcer::new(limiter.clone()).with_fail_mode(mode);
        let started = Instant::now();
        let e = enforcer.enforce_async("u2", NonZeroU32::MIN).await;
        assert_eq!(started.elapsed(), DEFAULT_STORE_CALL_TIMEOUT, "{mode:?}");
        assert_eq!(
            (e.allowed, e.outcome),
            (allowed, EnforceOutcome::Error),
            "{mode:?}"
        );
    }
}

#[tokio::test(start_paused = true)]
async fn r_a_failing_or_panicking_async_store_is_a_store_error_per_the_fail_mode() {
    for fault in [Fault::Fail, Fault::PanicBuilding, Fault::PanicPolling] {
        let limiter = limiter_on(FaultyLimits::new(fault));
        let err = limiter
            .check_async("u1")
            .await
            .expect_err("the store failed");
        let cause = limit_store_error_or_plain(&err);
        match fault {
            Fault::Fail => assert!(cause.is_none(), "{err:?}"),
            _ => assert!(
                matches!(cause, Some(StoreError::Panicked { message }) if message.starts_with("apply panicked")),
                "{fault:?}: {err:?}"
            ),
        }
        for (mode, allowed) in [(FailMode::Open, true), (FailMode::Closed, false)] {
            let e = Enforcer::new(limiter.clone())
                .with_fail_mode(mode)
                .enforce_async("u2", NonZeroU32::MIN)
                .await;
            assert_eq!(
                (e.allowed, e.outcome),
                (allowed, EnforceOutcome::Error),
                "{fault:?}"
            );
        }
        assert_eq!(limiter.store().calls.load(Ordering::SeqCst), 3);
    }
    // A healthy store of the same kind decides.
    let limiter = limiter_on(FaultyLimits::new(Fault::Pass));
    assert_eq!(limiter.check_async("u1").await.unwrap().remaining, 9);
}

/// The store error a guarded failure carries, or `None` for the store's own error.
fn limit_store_error_or_plain(e: &RateLimitError) -> Option<&StoreError> {
    let RateLimitError::Store { source, .. } = e else {
        panic!("expected a store error, got {e:?}")
    };
    source.downcast_ref::<StoreError>()
}

// ---------------------------------------------------------------------------------------------
// The coalescing throttle's window store, through the same guard.
// ---------------------------------------------------------------------------------------------

/// A [`MemoryWindowStore`](throttlebeam::coalesce::MemoryWindowStore) whose claims,
/// extensions and records panic while their call is being built, before
/// any future exists.
struct PanicsBuilding {
    calls: Arc<AtomicUsize>,
}

impl PanicsBuilding {
    fn panic(&self, op: &str) -> ! {
        self.calls.fetch_add(1, Ordering::SeqCst);
        panic!("window store bug in {op}")
    }
}

impl WindowStore for PanicsBuilding {
    fn claim<'a>(
        &'a self,
        _: &'a str,
        _: WindowEntry,
        _: Duration,
    ) -> WindowStoreFuture<'a, WindowClaim> {
        self.panic("claim")
    }
    fn extend<'a>(
        &'a self,
        _: &'a str,
        _: WindowEntry,
        _: Duration,
    ) -> WindowStoreFuture<'a, bool> {
        self.panic("extend")
    }
    fn record<'a>(
        &'a self,
        _: &'a str,
        _: WindowEntry,
        _: Duration,
    ) -> WindowStoreFuture<'a, bool> {
        self.panic("record")
    }
}

/// A window store call goes through the one store guard too: a store that
/// panics while building its call (not only while it is polled) is a store
/// failure, counted, and the throttle fails open; the panic never reaches
/// the run or its callers.
#[tokio::test(start_paused = true)]
async fn w_a_window_store_that_panics_building_its_calls_is_a_store_failure() {
    let runtime = Runtime::builder().start().await.expect("runtime starts");
    let calls = Arc::new(AtomicUsize::new(0));
    let throttle = runtime
        .coalesce("bug:")
        .with_window(ms(100))
        .with_store(PanicsBuilding {
            calls: Arc::clone(&calls),
        })
        .build::<u32>()
        .expect("builds");
    let runs = Runs::default();
    let work = |value: u32| {
        let runs = runs.clone();
        move |_| async move {
            // Long enough for the lease to be extended once.
            tokio::time::sleep(ms(150)).await;
            runs.hit();
            Ok::<_, std::io::Error>(value)
        }
    };
    let started = Instant::now();
    let lead = {
        let throttle = throttle.clone();
        let work = work(1);
        tokio::spawn(async move { throttle.call_and_wait("k", work).await })
    };
    support::settle().await;
    let trailing = throttle.call_and_wait("k", work(2));
    assert_eq!(trailing.await.expect("fails open, runs"), 2);
    assert_eq!(lead.await.expect("no panic").expect("fails open, runs"), 1);
    // Leading run 0..150, window until 250, trailing run 250..400.
    assert_eq!(started.elapsed(), ms(400));
    assert_eq!(runs.get(), 2);
    let stats = throttle.stats();
    // Two claims, two extensions and two records, each a failure.
    assert_eq!(calls.load(Ordering::SeqCst), 6);
    assert_eq!(
        (stats.store_errors, stats.store_timeouts),
        (6, 0),
        "{stats:?}"
    );
    assert_eq!((stats.active, stats.pending), (0, 0));
}
