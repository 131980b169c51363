//! Every public future dropped at every await point (SCENARIOS S15, issue 30
//! item 15), in memory on paused tokio time, and the HTTP layers with a
//! client that hangs up: after each drop the next call on the key completes
//! with the right outcome, nothing runs twice, and the gauges return to
//! zero. The harness is `support/cancel.rs`; the Redis-backed forms are in
//! `redis_cancellation.rs`.
#![cfg(feature = "runtime")]

#[cfg(feature = "tower")]
#[path = "support/http.rs"]
mod http_server;
mod support;

use std::future::IntoFuture;
use std::sync::Arc;
use std::sync::atomic::{AtomicUsize, Ordering};
use std::time::Duration;

use laggy::Laggy;
use support::cancel::{Cut, cut_after, for_every_cut};
use support::{Oops, Runs, ms};
use throttlebeam::rate_limit::{
    Gcra, LeakyBucket, Limiter, MemoryRateLimitStore, ShaperReservation,
};
use throttlebeam::{
    DebounceOptions, Error, IdempotencyOptions, IdempotencyOutcome, Runtime, ThrottleOutcome,
    coalesce::MemoryWindowStore, idempotency::IdempotencyReserved,
    idempotency::MemoryIdempotencyStore,
};
use tokio::time::{Instant, sleep};

/// How long the harness waits for a dropped-at future to be woken, on
/// paused time: far beyond every timer here, so only a hang reaches it.
const PATIENCE: Duration = Duration::from_secs(3600);

/// How far the slow stores here are, each way.
const LAG: Duration = Duration::from_millis(5);

/// The sweep interval of the runtimes here.
const SWEEP: Duration = Duration::from_secs(1);

/// A runtime swept every [`SWEEP`].
async fn runtime_with(builder: throttlebeam::runtime::RuntimeBuilder) -> Runtime {
    builder
        .with_sweep_interval(SWEEP)
        .start()
        .await
        .expect("runtime starts")
}

async fn runtime() -> Runtime {
    runtime_with(Runtime::builder()).await
}

/// After the runtime's idle time (two sweeps), it tracks nothing: no key,
/// no process, no timer (the sweeper has gone dormant too), no trailing
/// run, coalesced call or window, no debounce key or throttle window.
async fn assert_idle(rt: &Runtime, what: &str) {
    sleep(SWEEP * 2).await;
    let s = rt.stats();
    assert_eq!(
        (s.keys, s.processes, s.timers),
        (0, 0, 0),
        "{what}: keys, processes and timers left: {s:?}"
    );
    assert_eq!(
        (s.debounce.keys, s.throttle.windows),
        (0, 0),
        "{what}: {s:?}"
    );
    let t = s.coalesce;
    assert_eq!(
        (t.active, t.pending, t.keys, t.timers),
        (0, 0, 0, 0),
        "{what}: trailing gauges left: {t:?}"
    );
}

/// A function of two awaits (`half` each) that counts its runs as it
/// ends and returns `value`.
fn slow<T: Send + 'static>(
    runs: &Runs,
    half: Duration,
    value: T,
) -> impl FnOnce() -> std::pin::Pin<Box<dyn Future<Output = Result<T, Oops>> + Send>> + Send + 'static
{
    let runs = runs.clone();
    move || {
        Box::pin(async move {
            sleep(half).await;
            sleep(half).await;
            runs.hit();
            Ok(value)
        })
    }
}

/// Stores behind a network, on tokio time: each call reaches the store
/// `lag` after it is sent and its answer comes back `lag` later, so a
/// caller dropped between the two leaves its call done with nobody told.
mod laggy {
    use std::time::Duration;

    use throttlebeam::rate_limit::{
        AsyncRateLimitStore, Gcra, LeakyBucket, MemoryRateLimitStore, RateLimitError,
        RateLimitReply, RateLimitRequest, RateLimitStore, Strategy,
    };
    use throttlebeam::{
        coalesce::WindowClaim, coalesce::WindowEntry, coalesce::WindowStore,
        coalesce::WindowStoreFuture, idempotency::ClaimReply, idempotency::ClaimRequest,
        idempotency::ClaimToken, idempotency::IdempotencyStore,
        idempotency::IdempotencyStoreFuture, idempotency::KeyChanged, idempotency::StoredResult,
    };
    use tokio::time::sleep;

    /// `inner`, `lag` away each way.
    #[derive(Debug, Clone)]
    pub(crate) struct Laggy<S> {
        pub(crate) inner: S,
        pub(crate) lag: Duration,
    }

    impl<S: IdempotencyStore> IdempotencyStore for Laggy<S> {
        fn claim<'a>(
            &'a self,
            key: &'a str,
            request: ClaimRequest<'a>,
        ) -> IdempotencyStoreFuture<'a, ClaimReply> {
            Box::pin(async move {
                sleep(self.lag).await;
                let reply = self.inner.claim(key, request).await;
                sleep(self.lag).await;
                reply
            })
        }

        fn complete<'a>(
            &'a self,
            key: &'a str,
            token: ClaimToken,
            result: &'a StoredResult,
            ttl: Duration,
        ) -> IdempotencyStoreFuture<'a, bool> {
            Box::pin(async move {
                sleep(self.lag).await;
                let reply = self.inner.complete(key, token, result, ttl).await;
                sleep(self.lag).await;
                reply
            })
        }

        fn release<'a>(
            &'a self,
            key: &'a str,
            token: ClaimToken,
        ) -> IdempotencyStoreFuture<'a, bool> {
            Box::pin(async move {
                sleep(self.lag).await;
                let reply = self.inner.release(key, token).await;
                sleep(self.lag).await;
                reply
            })
        }

        fn renew<'a>(
            &'a self,
            key: &'a str,
            token: ClaimToken,
            lease: Duration,
        ) -> IdempotencyStoreFuture<'a, bool> {
            Box::pin(async move {
                sleep(self.lag).await;
                let reply = self.inner.renew(key, token, lease).await;
                sleep(self.lag).await;
                reply
            })
        }

        fn watch(&self, key: &str) -> KeyChanged {
            self.inner.watch(key)
        }
    }

    impl<S: WindowStore> WindowStore for Laggy<S> {
        fn claim<'a>(
            &'a self,
            key: &'a str,
            entry: WindowEntry,
            ttl: Duration,
        ) -> WindowStoreFuture<'a, WindowClaim> {
            Box::pin(async move {
                sleep(self.lag).await;
                let reply = self.inner.claim(key, entry, ttl).await;
                sleep(self.lag).await;
                reply
            })
        }

        fn extend<'a>(
            &'a self,
            key: &'a str,
            entry: WindowEntry,
            ttl: Duration,
        ) -> WindowStoreFuture<'a, bool> {
            Box::pin(async move {
                sleep(self.lag).await;
                let reply = self.inner.extend(key, entry, ttl).await;
                sleep(self.lag).await;
                reply
            })
        }

        fn record<'a>(
            &'a self,
            key: &'a str,
            entry: WindowEntry,
            ttl: Duration,
        ) -> WindowStoreFuture<'a, bool> {
            Box::pin(async move {
                sleep(self.lag).await;
                let reply = self.inner.record(key, entry, ttl).await;
                sleep(self.lag).await;
                reply
            })
        }

        fn sweep(&self) -> usize {
            self.inner.sweep()
        }

        fn stats(&self) -> throttlebeam::coalesce::WindowStoreStats {
            self.inner.stats()
        }
    }

    /// One impl per strategy: a generic one would overlap the crate's own
    /// for every synchronous store.
    macro_rules! laggy_limits {
        ($($strategy:ty),*) => {$(
            impl AsyncRateLimitStore<$strategy>
                for Laggy<MemoryRateLimitStore<<$strategy as Strategy>::State>>
            {
                async fn apply_async(
                    &self,
                    request: RateLimitRequest<'_, $strategy>,
                ) -> Result<RateLimitReply, RateLimitError> {
                    sleep(self.lag).await;
                    let reply = self.inner.apply(request);
                    sleep(self.lag).await;
                    reply
                }
            }
        )*};
    }

    laggy_limits!(Gcra, LeakyBucket);
}

// ---------------------------------------------------------------------------------------------
// The harness itself.
// ---------------------------------------------------------------------------------------------

#[tokio::test(start_paused = true)]
async fn the_harness_counts_the_await_points_that_wait_and_drops_at_each() {
    struct Dropped(Arc<AtomicUsize>);
    impl Drop for Dropped {
        fn drop(&mut self) {
            self.0.fetch_add(1, Ordering::SeqCst);
        }
    }
    let drops = Arc::new(AtomicUsize::new(0));
    let reached = Arc::new(AtomicUsize::new(0));
    let polls = for_every_cut(3, 10, |k| {
        let (drops, reached) = (Arc::clone(&drops), Arc::clone(&reached));
        async move {
            let before = drops.load(Ordering::SeqCst);
            let held = Dropped(Arc::clone(&drops));
            let started = Instant::now();
            let fut = async move {
                let _held = held;
                for step in 1..=3 {
                    sleep(ms(10)).await;
                    reached.store(step, Ordering::SeqCst);
                }
                // A yield is an await point too (woken at once).
                tokio::task::yield_now().await;
                7
            };
            let cut = cut_after(fut, k, PATIENCE).await;
            assert_eq!(
                drops.load(Ordering::SeqCst),
                before + 1,
                "dropped either way"
            );
            match cut {
                Cut::Finished(v, polls) => {
                    assert_eq!((v, polls), (7, 5));
                    assert_eq!(
                        started.elapsed(),
                        ms(30),
                        "time ran to each timer, no further"
                    );
                    true
                }
                Cut::Dropped => {
                    // Cut k dropped it after k - 1 waits.
                    assert_eq!(
                        started.elapsed(),
                        ms(10) * (k.saturating_sub(1)).min(3) as u32
                    );
                    false
                }
            }
        }
    })
    .await;
    assert_eq!(polls, 5);
    assert_eq!(reached.load(Ordering::SeqCst), 3);
}

// ---------------------------------------------------------------------------------------------
// Debounce: the `Debounced` future.
// ---------------------------------------------------------------------------------------------

/// A dropped `Debounced` is fire and forget: the run still happens, once,
/// and the next call on the key starts a burst of its own.
async fn debounced_dropped_at_every_poll(options: DebounceOptions) {
    let rt = runtime().await;
    let d = rt.debounce();
    for_every_cut(2, 10, |k| {
        let (d, rt) = (d.clone(), rt.clone());
        async move {
            let key = format!("d{k}");
            let runs = Runs::default();
            let call = d
                .call_with(&key, ms(100), options, slow(&runs, ms(20), k))
                .expect("scheduled");
            let cut = cut_after(call.into_future(), k, PATIENCE).await;
            let finished = cut.finished();
            if let Cut::Finished(value, _) = cut {
                assert_eq!(value.expect("the run's value"), k);
            }
            sleep(ms(300)).await;
            assert_eq!(
                runs.get(),
                1,
                "cut {k}: the run happens once, awaited or not"
            );
            let next = d
                .call_with(&key, ms(100), options, slow(&runs, ms(20), 100 + k))
                .expect("scheduled");
            assert_eq!(next.await.expect("the next call completes"), 100 + k);
            assert_eq!(runs.get(), 2, "cut {k}");
            assert_idle(&rt, &format!("debounce cut {k}")).await;
            finished
        }
    })
    .await;
}

#[tokio::test(start_paused = true)]
async fn a_debounced_call_dropped_at_every_await_still_runs_once() {
    debounced_dropped_at_every_poll(DebounceOptions::new()).await;
}

#[tokio::test(start_paused = true)]
async fn a_leading_debounced_call_dropped_at_every_await_still_runs_once() {
    debounced_dropped_at_every_poll(
        DebounceOptions::new()
            .with_leading(true)
            .with_max_wait(ms(150)),
    )
    .await;
}

// ---------------------------------------------------------------------------------------------
// Leading throttle: `ThrottleHandle::call`.
// ---------------------------------------------------------------------------------------------

#[tokio::test(start_paused = true)]
async fn a_throttled_call_dropped_at_every_await_opens_its_window_with_its_run_or_not_at_all() {
    let rt = runtime().await;
    let t = rt.throttle();
    for_every_cut(3, 10, |k| {
        let (t, rt) = (t.clone(), rt.clone());
        async move {
            let key = format!("t{k}");
            let runs = Runs::default();
            let call = t.call(&key, ms(1000), slow(&runs, ms(50), k));
            let cut = cut_after(call, k, PATIENCE).await;
            let finished = cut.finished();
            if let Cut::Finished(outcome, _) = cut {
                assert_eq!(outcome.expect("runs"), ThrottleOutcome::Executed(k));
            }
            // Whatever was started has finished by now.
            sleep(ms(200)).await;
            let ran = runs.get();
            let next = t
                .call(&key, ms(1000), slow(&runs, ms(50), 100 + k))
                .await
                .expect("the next call completes");
            match next {
                ThrottleOutcome::Throttled { .. } => {
                    assert_eq!(ran, 1, "cut {k}: a window is open only with its run")
                }
                ThrottleOutcome::Executed(v) => {
                    assert_eq!((ran, v), (0, 100 + k), "cut {k}: no window, no run");
                }
            }
            assert_eq!(ran, usize::from(k > 0), "cut {k}: polled once, it runs");
            assert_idle(&rt, &format!("throttle cut {k}")).await;
            finished
        }
    })
    .await;
}

// ---------------------------------------------------------------------------------------------
// Coalescing throttle: `Coalesce::call` and `call_and_wait`.
// ---------------------------------------------------------------------------------------------

const WINDOW: Duration = Duration::from_millis(500);

/// A leading call dropped at every await: its run still happens once; the
/// next call is covered by a trailing run (inside the window) or leads.
async fn leading_trailing_call_dropped(wait: bool, store: Option<Duration>) {
    let rt = runtime().await;
    let mut builder = rt.coalesce("c:").with_window(WINDOW);
    if let Some(lag) = store {
        builder = builder.with_store(Laggy {
            inner: MemoryWindowStore::new(),
            lag,
        });
    }
    let tt = builder.build::<usize>().expect("builds");
    for_every_cut(3, 30, |k| {
        let (tt, rt) = (tt.clone(), rt.clone());
        async move {
            let key = format!("c{k}");
            let runs = Runs::default();
            let f = slow(&runs, ms(50), k);
            let cut = if wait {
                let call = tt.call_and_wait(&key, move |_| f());
                let cut = cut_after(call, k, PATIENCE).await;
                match cut {
                    Cut::Finished(v, polls) => Cut::Finished(v.expect("runs") == k, polls),
                    Cut::Dropped => Cut::Dropped,
                }
            } else {
                let call = tt.call(&key, move |_| f());
                let cut = cut_after(call, k, PATIENCE).await;
                match cut {
                    Cut::Finished(led, polls) => Cut::Finished(led.expect("runs"), polls),
                    Cut::Dropped => Cut::Dropped,
                }
            };
            let finished = cut.finished();
            if let Cut::Finished(right, _) = cut {
                assert!(right, "cut {k}: the leading run's outcome");
            }
            sleep(ms(200)).await;
            let ran = runs.get();
            assert_eq!(
                ran,
                usize::from(k > 0),
                "cut {k}: taken, the call runs once"
            );
            let g = slow(&runs, ms(50), 100 + k);
            let next = tt
                .call_and_wait(&key, move |_| g())
                .await
                .expect("the next call completes");
            assert_eq!(next, 100 + k);
            assert_eq!(runs.get(), ran + 1, "cut {k}: one more run, no more");
            sleep(WINDOW * 2).await;
            assert_idle(&rt, &format!("trailing cut {k}")).await;
            finished
        }
    })
    .await;
    let stats = tt.stats();
    assert_eq!(stats.active + stats.pending + stats.keys + stats.timers, 0);
    assert_eq!((stats.store_errors, stats.store_timeouts), (0, 0));
}

#[tokio::test(start_paused = true)]
async fn a_leading_coalesced_call_dropped_at_every_await_still_runs_once() {
    leading_trailing_call_dropped(false, None).await;
}

#[tokio::test(start_paused = true)]
async fn a_leading_call_and_wait_dropped_at_every_await_still_runs_once() {
    leading_trailing_call_dropped(true, None).await;
}

#[tokio::test(start_paused = true)]
async fn a_leading_call_on_a_slow_window_store_dropped_at_every_await_still_runs_once() {
    leading_trailing_call_dropped(false, Some(LAG)).await;
}

#[tokio::test(start_paused = true)]
async fn a_leading_call_and_wait_on_a_slow_window_store_dropped_at_every_await_still_runs_once() {
    leading_trailing_call_dropped(true, Some(LAG)).await;
}

#[tokio::test(start_paused = true)]
async fn a_coalesced_waiter_dropped_at_every_await_leaves_one_trailing_run() {
    let rt = runtime().await;
    let tt = rt
        .coalesce("w:")
        .with_window(WINDOW)
        .build::<usize>()
        .expect("builds");
    for_every_cut(2, 10, |k| {
        let (tt, rt) = (tt.clone(), rt.clone());
        async move {
            let key = format!("w{k}");
            let runs = Runs::default();
            let before = tt.stats();
            let lead = slow(&runs, ms(50), 0);
            let leader = {
                let (tt, key) = (tt.clone(), key.clone());
                tokio::spawn(async move { tt.call_and_wait(&key, move |_| lead()).await })
            };
            support::settle().await;
            let f = slow(&runs, ms(50), 1);
            let cut = cut_after(tt.call_and_wait(&key, move |_| f()), k, PATIENCE).await;
            let finished = cut.finished();
            if let Cut::Finished(v, _) = cut {
                assert_eq!(v.expect("the trailing run's value"), 1);
            }
            // Dropped, the call still waits in the trailing run (taken, it
            // is covered), which the next call joins with the latest
            // function; finished, the next call has a trailing run of its own.
            let g = slow(&runs, ms(50), 2);
            let third = tt.call_and_wait(&key, move |_| g()).await;
            assert_eq!(third.expect("the next call completes"), 2);
            assert_eq!(leader.await.expect("no panic").expect("leads"), 0);
            let after = tt.stats();
            let trailing = 1 + usize::from(finished);
            assert_eq!(after.leading_runs - before.leading_runs, 1, "cut {k}");
            assert_eq!(
                after.trailing_runs - before.trailing_runs,
                trailing as u64,
                "cut {k}"
            );
            assert_eq!(runs.get(), 1 + trailing, "cut {k}: nothing ran twice");
            sleep(WINDOW * 2).await;
            assert_idle(&rt, &format!("coalesced waiter cut {k}")).await;
            finished
        }
    })
    .await;
}

// ---------------------------------------------------------------------------------------------
// Idempotency: `run`, `run_with`, `reserve` and the reservation's `complete` and `release`.
// ---------------------------------------------------------------------------------------------

/// Results kept this long, so the idle check sees the table empty again.
const TTL: Duration = Duration::from_secs(5);

/// A run dropped at every await: once its key is claimed, the function
/// runs to the end and its result is replayed (I10); before, nothing ran
/// and the next run is fresh. Either way the function runs once in all.
async fn owner_dropped_at_every_poll(rt: Runtime, options: IdempotencyOptions) {
    let idem = rt.idempotency();
    let polls = for_every_cut(3, 40, |k| {
        let (idem, rt, options) = (idem.clone(), rt.clone(), options.clone());
        async move {
            let key = format!("i{k}");
            let runs = Runs::default();
            let run = idem.run_with(&key, options.clone(), slow(&runs, ms(50), k));
            let cut = cut_after(run, k, PATIENCE).await;
            let finished = cut.finished();
            if let Cut::Finished(outcome, _) = cut {
                assert_eq!(outcome.expect("runs"), IdempotencyOutcome::Fresh(k));
            }
            let next = idem
                .run_with(&key, options.clone(), slow(&runs, ms(50), 100 + k))
                .await
                .expect("the next call completes");
            match next {
                IdempotencyOutcome::Replay(v) => assert_eq!(v, k, "cut {k}"),
                // Dropped before its function started: the key was freed.
                IdempotencyOutcome::Fresh(v) => assert_eq!(v, 100 + k, "cut {k}"),
                other => panic!("cut {k}: {other:?}"),
            }
            assert_eq!(runs.get(), 1, "cut {k}: the function ran once in all");
            sleep(TTL).await;
            assert_idle(&rt, &format!("idempotency cut {k}")).await;
            assert_eq!(rt.stats().ttl_entries, 0);
            finished
        }
    })
    .await;
    // Polled once only while nothing waits: a claim, the function's two
    // sleeps and (with a short lease) its renewals.
    assert!(polls >= 3, "{polls}");
}

#[tokio::test(start_paused = true)]
async fn an_idempotent_run_dropped_at_every_await_runs_once_and_replays() {
    owner_dropped_at_every_poll(runtime().await, IdempotencyOptions::new().with_ttl(TTL)).await;
}

#[tokio::test(start_paused = true)]
async fn an_idempotent_run_with_renewals_dropped_at_every_await_runs_once_and_replays() {
    // A lease of 30 ms is renewed every 10 ms while the 100 ms function runs.
    let options = IdempotencyOptions::new()
        .with_ttl(TTL)
        .with_lease(ms(30))
        .with_scope("tenant")
        .with_fingerprint("body");
    owner_dropped_at_every_poll(runtime().await, options).await;
}

#[tokio::test(start_paused = true)]
async fn an_idempotent_run_on_a_shared_store_dropped_at_every_await_runs_once_and_replays() {
    let rt = runtime_with(Runtime::builder().with_idempotency_store(MemoryIdempotencyStore::new()))
        .await;
    owner_dropped_at_every_poll(
        rt,
        IdempotencyOptions::new().with_ttl(TTL).with_lease(ms(30)),
    )
    .await;
}

/// A shared store 5 ms away each way.
fn slow_store() -> Laggy<MemoryIdempotencyStore> {
    Laggy {
        inner: MemoryIdempotencyStore::new(),
        lag: LAG,
    }
}

#[tokio::test(start_paused = true)]
async fn an_idempotent_run_on_a_slow_shared_store_dropped_at_every_await_runs_once_and_replays() {
    // A claim that reached the store but whose caller left before the
    // answer holds the key there for its lease (30 s), longer than the next
    // caller waits (5 s): nothing but its release frees it in time.
    let rt = runtime_with(Runtime::builder().with_idempotency_store(slow_store())).await;
    let options = IdempotencyOptions::new()
        .with_ttl(TTL)
        .with_wait_timeout(Duration::from_secs(5));
    owner_dropped_at_every_poll(rt, options).await;
}

#[tokio::test(start_paused = true)]
async fn an_idempotent_run_with_renewals_on_a_slow_shared_store_dropped_at_every_await_runs_once() {
    let rt = runtime_with(Runtime::builder().with_idempotency_store(slow_store())).await;
    let options = IdempotencyOptions::new().with_ttl(TTL).with_lease(ms(60));
    owner_dropped_at_every_poll(rt, options).await;
}

/// A duplicate dropped while it waits for the owner: the owner's run is
/// replayed to the next caller, and nothing of the duplicate stays.
async fn duplicate_dropped_at_every_poll(rt: Runtime) {
    let idem = rt.idempotency();
    let options = IdempotencyOptions::new().with_ttl(TTL).with_lease(ms(40));
    for_every_cut(2, 20, |k| {
        let (idem, rt, options) = (idem.clone(), rt.clone(), options.clone());
        async move {
            let key = format!("dup{k}");
            let runs = Runs::default();
            let owner = {
                let (idem, key, options) = (idem.clone(), key.clone(), options.clone());
                let f = slow(&runs, ms(50), k);
                tokio::spawn(async move { idem.run_with(&key, options, f).await })
            };
            support::settle().await;
            let dup = idem.run_with(&key, options.clone(), slow(&runs, ms(50), 100 + k));
            let cut = cut_after(dup, k, PATIENCE).await;
            let finished = cut.finished();
            if let Cut::Finished(outcome, _) = cut {
                assert_eq!(outcome.expect("replays"), IdempotencyOutcome::Replay(k));
            }
            let next = idem
                .run_with(&key, options.clone(), slow(&runs, ms(50), 200 + k))
                .await
                .expect("the next call completes");
            assert_eq!(next, IdempotencyOutcome::Replay(k), "cut {k}");
            let owned = owner.await.expect("no panic").expect("runs");
            assert_eq!(owned, IdempotencyOutcome::Fresh(k));
            assert_eq!(runs.get(), 1, "cut {k}: the function ran once in all");
            sleep(TTL).await;
            assert_idle(&rt, &format!("duplicate cut {k}")).await;
            finished
        }
    })
    .await;
}

#[tokio::test(start_paused = true)]
async fn a_waiting_duplicate_dropped_at_every_await_leaves_the_owner_to_finish() {
    duplicate_dropped_at_every_poll(runtime().await).await;
}

#[tokio::test(start_paused = true)]
async fn a_waiting_duplicate_on_a_shared_store_dropped_at_every_await_leaves_the_owner_to_finish() {
    let rt = runtime_with(Runtime::builder().with_idempotency_store(MemoryIdempotencyStore::new()))
        .await;
    duplicate_dropped_at_every_poll(rt).await;
}

/// A duplicate on another instance, dropped at every await while it waits
/// for the owner through a slow shared store.
#[tokio::test(start_paused = true)]
async fn a_duplicate_on_another_instance_dropped_at_every_await_leaves_the_owner_to_finish() {
    let store = slow_store();
    let a = runtime_with(Runtime::builder().with_idempotency_store(store.clone())).await;
    let b = runtime_with(Runtime::builder().with_idempotency_store(store)).await;
    let (owner_side, dup_side) = (a.idempotency(), b.idempotency());
    let options = IdempotencyOptions::new().with_ttl(TTL).with_lease(ms(60));
    for_every_cut(2, 40, |k| {
        let (owner_side, dup_side, options) =
            (owner_side.clone(), dup_side.clone(), options.clone());
        let (a, b) = (a.clone(), b.clone());
        async move {
            let key = format!("x{k}");
            let runs = Runs::default();
            let owner = {
                let (idem, key, options) = (owner_side.clone(), key.clone(), options.clone());
                let f = slow(&runs, ms(100), k);
                tokio::spawn(async move { idem.run_with(&key, options, f).await })
            };
            // The owner's claim has reached the store.
            sleep(LAG * 3).await;
            let dup = dup_side.run_with(&key, options.clone(), slow(&runs, ms(50), 100 + k));
            let cut = cut_after(dup, k, PATIENCE).await;
            let finished = cut.finished();
            if let Cut::Finished(outcome, _) = cut {
                assert_eq!(outcome.expect("replays"), IdempotencyOutcome::Replay(k));
            }
            let next = dup_side
                .run_with(&key, options.clone(), slow(&runs, ms(50), 200 + k))
                .await
                .expect("the next call completes");
            assert_eq!(next, IdempotencyOutcome::Replay(k), "cut {k}");
            let owned = owner.await.expect("no panic").expect("runs");
            assert_eq!(owned, IdempotencyOutcome::Fresh(k));
            assert_eq!(runs.get(), 1, "cut {k}: the function ran once in all");
            sleep(TTL).await;
            assert_idle(&a, &format!("owner instance cut {k}")).await;
            assert_idle(&b, &format!("duplicate instance cut {k}")).await;
            finished
        }
    })
    .await;
}

/// Found by the harness: a duplicate on another instance that waits out
/// its whole wait timeout gets [`Error::Timeout`] (I3), not a store error
/// from one last claim sent with no time left to answer in.
#[tokio::test(start_paused = true)]
async fn a_duplicate_on_another_instance_that_waits_out_its_timeout_gets_a_timeout() {
    let store = slow_store();
    let a = runtime_with(Runtime::builder().with_idempotency_store(store.clone())).await;
    let b = runtime_with(Runtime::builder().with_idempotency_store(store)).await;
    let options = IdempotencyOptions::new().with_ttl(TTL);
    let runs = Runs::default();
    let owner = {
        let (idem, options) = (a.idempotency(), options.clone());
        let f = slow(&runs, Duration::from_secs(5), 1_usize);
        tokio::spawn(async move { idem.run_with("slow", options, f).await })
    };
    sleep(LAG * 3).await;
    let wait = Duration::from_secs(1);
    let started = Instant::now();
    let dup = b
        .idempotency()
        .run_with(
            "slow",
            options.with_wait_timeout(wait),
            slow(&runs, ms(1), 2),
        )
        .await;
    assert!(
        matches!(&dup, Err(Error::Timeout { key, after }) if key == "slow" && *after == wait),
        "{dup:?}"
    );
    assert_eq!(started.elapsed(), wait);
    assert_eq!(b.idempotency().stats().timeouts, 1);
    assert_eq!(
        owner.await.expect("no panic").expect("runs"),
        IdempotencyOutcome::Fresh(1)
    );
    assert_eq!(runs.get(), 1);
}

/// `reserve` dropped at every await while another reservation holds the
/// key; then the holder releases, and the next `reserve` gets the key.
async fn reserve_dropped_at_every_poll(rt: Runtime) {
    let idem = rt.idempotency();
    let options = IdempotencyOptions::new().with_ttl(TTL).with_lease(ms(60));
    for_every_cut(2, 40, |k| {
        let (idem, rt, options) = (idem.clone(), rt.clone(), options.clone());
        async move {
            let key = format!("r{k}");
            let IdempotencyReserved::Fresh(held) = idem
                .reserve::<usize>(&key, options.clone())
                .await
                .expect("reserves")
            else {
                panic!("a fresh key replayed");
            };
            let releasing = tokio::spawn(async move {
                sleep(ms(100)).await;
                held.release().await;
            });
            let cut = cut_after(idem.reserve::<usize>(&key, options.clone()), k, PATIENCE).await;
            let finished = cut.finished();
            match cut {
                // Taken over once the holder released it.
                Cut::Finished(reserved, _) => match reserved.expect("reserves") {
                    IdempotencyReserved::Fresh(mine) => mine.release().await,
                    IdempotencyReserved::Replay(v) => panic!("nothing was completed: {v}"),
                },
                Cut::Dropped => {}
            }
            releasing.await.expect("no panic");
            let IdempotencyReserved::Fresh(next) = idem
                .reserve::<usize>(&key, options.clone())
                .await
                .expect("the next call completes")
            else {
                panic!("cut {k}: nothing was completed");
            };
            next.complete(k).await.expect("completes");
            let replay = idem.reserve::<usize>(&key, options.clone()).await;
            assert!(matches!(replay, Ok(IdempotencyReserved::Replay(v)) if v == k));
            sleep(TTL).await;
            assert_idle(&rt, &format!("reserve cut {k}")).await;
            finished
        }
    })
    .await;
}

#[tokio::test(start_paused = true)]
async fn a_reserve_dropped_at_every_await_never_wedges_the_key() {
    reserve_dropped_at_every_poll(runtime().await).await;
}

#[tokio::test(start_paused = true)]
async fn a_reserve_on_a_shared_store_dropped_at_every_await_never_wedges_the_key() {
    let rt = runtime_with(Runtime::builder().with_idempotency_store(MemoryIdempotencyStore::new()))
        .await;
    reserve_dropped_at_every_poll(rt).await;
}

#[tokio::test(start_paused = true)]
async fn a_reserve_on_a_slow_shared_store_dropped_at_every_await_never_wedges_the_key() {
    let rt = runtime_with(Runtime::builder().with_idempotency_store(slow_store())).await;
    reserve_dropped_at_every_poll(rt).await;
}

/// A reservation's `complete` dropped at every await, then `release`
/// dropped unpolled: the key is either completed (replayed) or free again
/// (the next reservation completes it), never held.
async fn complete_dropped_at_every_poll(rt: Runtime, at_least: usize) {
    let idem = rt.idempotency();
    let options = IdempotencyOptions::new().with_ttl(TTL).with_lease(ms(60));
    for_every_cut(at_least, 40, |k| {
        let (idem, rt, options) = (idem.clone(), rt.clone(), options.clone());
        async move {
            let key = format!("cp{k}");
            let IdempotencyReserved::Fresh(held) = idem
                .reserve::<usize>(&key, options.clone())
                .await
                .expect("reserves")
            else {
                panic!("a fresh key replayed");
            };
            let cut = cut_after(held.complete(k), k, PATIENCE).await;
            let finished = cut.finished();
            if let Cut::Finished(done, _) = cut {
                done.expect("completes");
            }
            match idem.reserve::<usize>(&key, options.clone()).await {
                Ok(IdempotencyReserved::Replay(v)) => assert_eq!(v, k),
                Ok(IdempotencyReserved::Fresh(next)) => {
                    assert!(!finished, "cut {k}: a completed key was free again");
                    // A `release` dropped unpolled releases too.
                    drop(next.release());
                    let again = idem.reserve::<usize>(&key, options.clone()).await;
                    let Ok(IdempotencyReserved::Fresh(last)) = again else {
                        panic!("cut {k}: released, not free: {again:?}");
                    };
                    last.complete(k).await.expect("completes");
                }
                Err(e) => panic!("cut {k}: the next call failed: {e}"),
            }
            let replay = idem
                .run(&key, || async { Ok::<usize, Oops>(999) })
                .await
                .expect("replays");
            assert_eq!(replay, IdempotencyOutcome::Replay(k));
            sleep(TTL).await;
            assert_idle(&rt, &format!("complete cut {k}")).await;
            finished
        }
    })
    .await;
}

#[tokio::test(start_paused = true)]
async fn a_completion_dropped_at_every_await_leaves_the_key_completed_or_free() {
    complete_dropped_at_every_poll(runtime().await, 1).await;
}

#[tokio::test(start_paused = true)]
async fn a_completion_on_a_slow_shared_store_dropped_at_every_await_leaves_the_key_completed_or_free()
 {
    let rt = runtime_with(Runtime::builder().with_idempotency_store(slow_store())).await;
    complete_dropped_at_every_poll(rt, 2).await;
}

#[tokio::test(start_paused = true)]
async fn a_completion_on_a_shared_store_dropped_at_every_await_leaves_the_key_completed_or_free() {
    let rt = runtime_with(Runtime::builder().with_idempotency_store(MemoryIdempotencyStore::new()))
        .await;
    complete_dropped_at_every_poll(rt, 1).await;
}

// ---------------------------------------------------------------------------------------------
// The default runtime's forms: `Debounce::call`, `Throttle::call`, `Idempotency::run`,
// `run_with` and `reserve` (real time: the default runtime does not follow a paused clock).
// ---------------------------------------------------------------------------------------------

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_default_runtime_s_calls_dropped_at_every_await_run_once() {
    use support::cancel::eventually;
    use throttlebeam::{Debounce, Idempotency, Throttle};

    let patience = Duration::from_secs(10);
    let settle = Duration::from_secs(10);
    let rt = Runtime::global().expect("the default runtime starts");
    for_every_cut(2, 10, |k| async move {
        let key = format!("global-d{k}");
        let runs = Runs::default();
        let call = Debounce::call(&key, ms(20), slow(&runs, ms(5), k)).expect("scheduled");
        let cut = cut_after(call.into_future(), k, patience).await;
        eventually("the debounced run", settle, ms(5), || runs.get() == 1).await;
        cut.finished()
    })
    .await;
    for_every_cut(2, 10, |k| async move {
        let key = format!("global-t{k}");
        let runs = Runs::default();
        let call = Throttle::call(&key, Duration::from_secs(3600), slow(&runs, ms(5), k));
        let cut = cut_after(call, k, patience).await;
        eventually("the throttled run", settle, ms(5), || {
            runs.get() == usize::from(k > 0)
        })
        .await;
        let next = Throttle::call(&key, Duration::from_secs(3600), slow(&runs, ms(5), 0))
            .await
            .expect("the next call completes");
        assert_eq!(next.is_throttled(), k > 0, "cut {k}");
        assert_eq!(runs.get(), 1, "cut {k}: one run per window");
        cut.finished()
    })
    .await;
    for_every_cut(3, 10, |k| async move {
        let key = format!("global-i{k}");
        let runs = Runs::default();
        let cut = if k % 2 == 0 {
            cut_after(Idempotency::run(&key, slow(&runs, ms(5), k)), k, patience).await
        } else {
            let options = IdempotencyOptions::new().with_fingerprint("body");
            let run = Idempotency::run_with(&key, options, slow(&runs, ms(5), k));
            cut_after(run, k, patience).await
        };
        let finished = cut.finished();
        let options = if k % 2 == 0 {
            IdempotencyOptions::new()
        } else {
            IdempotencyOptions::new().with_fingerprint("body")
        };
        let next = Idempotency::reserve::<usize>(&key, options)
            .await
            .expect("the next call completes");
        match next {
            IdempotencyReserved::Replay(v) => assert_eq!(v, k, "cut {k}"),
            IdempotencyReserved::Fresh(reservation) => {
                assert_eq!(k, 0, "cut {k}: taken, the run was not lost");
                reservation.complete(k).await.expect("completes");
            }
        }
        assert!(runs.get() <= 1, "cut {k}");
        finished
    })
    .await;
    // Nothing left but the throttle's hour-long windows.
    let s = rt.stats();
    assert_eq!((s.keys, s.processes), (s.throttle.windows, 0), "{s:?}");
}

// ---------------------------------------------------------------------------------------------
// Rate limiting: `check_async`, `until_ready`, `reserve`.
// ---------------------------------------------------------------------------------------------

#[tokio::test(start_paused = true)]
async fn a_check_dropped_before_its_answer_is_never_charged() {
    let limiter = Limiter::new(Gcra::new(5, Duration::from_secs(60)).expect("valid"));
    for_every_cut(1, 5, |k| {
        let limiter = limiter.clone();
        async move {
            let key = format!("l{k}");
            let cut = cut_after(limiter.check_async(&key), k, PATIENCE).await;
            let charged = match &cut {
                Cut::Finished(d, _) => u64::from(d.as_ref().expect("decides").allowed),
                Cut::Dropped => 0,
            };
            let next = limiter.check_async(&key).await.expect("decides");
            assert_eq!(next.remaining, 5 - charged - 1, "cut {k}");
            cut.finished()
        }
    })
    .await;
}

#[tokio::test(start_paused = true)]
async fn a_check_on_a_slow_store_dropped_at_every_await_is_charged_once_at_most() {
    let limiter = Limiter::builder(Gcra::new(5, Duration::from_secs(60)).expect("valid"))
        .with_store(Laggy {
            inner: MemoryRateLimitStore::new(),
            lag: LAG,
        })
        .build();
    for_every_cut(2, 10, |k| {
        let limiter = limiter.clone();
        async move {
            let key = format!("l{k}");
            let cut = cut_after(limiter.check_async(&key), k, PATIENCE).await;
            let finished = cut.finished();
            // Whatever was sent has landed by now.
            sleep(LAG * 4).await;
            let left = limiter.peek_async(&key).await.expect("peeks").remaining;
            // Once it reached the store (its second poll), it is charged
            // once, answered or not; before, never.
            assert_eq!(left, 5 - u64::from(k >= 2), "cut {k}");
            let next = limiter.check_async(&key).await.expect("decides");
            assert_eq!(next.remaining, left - 1, "cut {k}");
            finished
        }
    })
    .await;
    assert_eq!(limiter.stats().errors, 0);
}

#[tokio::test(start_paused = true)]
async fn a_shaper_reservation_on_a_slow_store_dropped_at_every_await_is_charged_once_at_most() {
    let shaper = Limiter::builder(
        LeakyBucket::new(10, Duration::from_secs(1), Duration::from_secs(1)).expect("valid"),
    )
    .with_store(Laggy {
        inner: MemoryRateLimitStore::new(),
        lag: LAG,
    })
    .build();
    for_every_cut(3, 10, |k| {
        let shaper = shaper.clone();
        async move {
            let key = format!("s{k}");
            let start = Instant::now();
            let first = shaper.reserve_async(&key, 1).await.expect("reserves");
            assert_eq!(first, Duration::ZERO);
            let cut = cut_after(shaper.reserve_async(&key, 1), k, PATIENCE).await;
            let finished = cut.finished();
            sleep(LAG * 4).await;
            let sent = Instant::now();
            let queued = match shaper.try_reserve_async(&key, 1).await.expect("reserves") {
                ShaperReservation::Granted { delay_ms } => delay_ms,
                other => panic!("cut {k}: {other:?}"),
            };
            // Each reservation that reached the store holds a 100 ms slot
            // from the first one's: the next is due 100 ms after the last
            // held, counted from when it was sent.
            let held = 1 + u64::from(k >= 2);
            let since = u64::try_from((sent - start).as_millis()).expect("small");
            assert_eq!(queued + since, held * 100, "cut {k}");
            finished
        }
    })
    .await;
}

#[tokio::test(start_paused = true)]
async fn a_waiter_dropped_at_every_await_takes_nothing_and_holds_up_nobody() {
    // One unit every 100 ms, no burst.
    let limiter = Limiter::new(Gcra::new(1, ms(100)).expect("valid"));
    for_every_cut(2, 10, |k| {
        let limiter = limiter.clone();
        async move {
            let key = format!("u{k}");
            assert!(limiter.check(&key).expect("decides").allowed);
            let start = Instant::now();
            // A second waiter queues behind the one that is cut.
            let behind = {
                let (limiter, key) = (limiter.clone(), key.clone());
                tokio::spawn(async move {
                    tokio::task::yield_now().await;
                    limiter.until_ready(&key).await.map(|_| Instant::now())
                })
            };
            let cut = cut_after(limiter.until_ready(&key), k, PATIENCE).await;
            let finished = cut.finished();
            let served = behind.await.expect("no panic").expect("decides");
            if finished {
                // The first waiter took the unit at 100, the second the next at 200.
                assert_eq!(served - start, ms(200), "cut {k}");
            } else {
                // The dropped waiter took nothing: the second gets the unit at 100.
                assert_eq!(served - start, ms(100), "cut {k}");
            }
            assert!(!limiter.check(&key).expect("decides").allowed);
            finished
        }
    })
    .await;
}

#[tokio::test(start_paused = true)]
async fn a_shaper_reservation_dropped_at_every_await_is_charged_once_at_most() {
    // 10 per second: a slot every 100 ms, a queue of a second.
    let shaper = Limiter::new(
        LeakyBucket::new(10, Duration::from_secs(1), Duration::from_secs(1)).expect("valid"),
    );
    for_every_cut(2, 10, |k| {
        let shaper = shaper.clone();
        async move {
            let key = format!("s{k}");
            assert_eq!(
                shaper.reserve(&key, 1).await.expect("reserves"),
                Duration::ZERO
            );
            let start = Instant::now();
            let cut = cut_after(shaper.reserve(&key, 1), k, PATIENCE).await;
            let finished = cut.finished();
            if let Cut::Finished(delay, _) = cut {
                assert_eq!(delay.expect("reserves"), ms(100));
            }
            // A granted reservation keeps its slot (its delay was promised),
            // dropped or not; one never granted takes none.
            let taken = u32::from(k > 0);
            let spent = Instant::now() - start;
            let next = shaper.reserve(&key, 1).await.expect("reserves");
            assert_eq!(spent + next, ms(100) * (1 + taken), "cut {k}");
            finished
        }
    })
    .await;
}

// ---------------------------------------------------------------------------------------------
// HTTP layers: the tower `Service::call` future dropped at every await.
// ---------------------------------------------------------------------------------------------

#[cfg(feature = "tower")]
mod layers {
    use ::http::{HeaderName, Request, StatusCode};
    use axum::Router;
    use axum::routing::post;
    use throttlebeam::http::{IdempotencyLayer, RateLimitKey, RateLimitLayer};
    use throttlebeam::rate_limit::Enforcer;
    use tower::ServiceExt as _;

    use super::*;

    fn request(key: &str) -> Request<axum::body::Body> {
        Request::post("/pay")
            .header("idempotency-key", key)
            .header("x-client", key)
            .body(axum::body::Body::from("10 EUR"))
            .expect("valid request")
    }

    /// A handler of two awaits (25 ms each) that counts its runs.
    fn shop(runs: &Runs) -> Router {
        let runs = runs.clone();
        Router::new().route(
            "/pay",
            post(move |body: String| {
                let runs = runs.clone();
                async move {
                    sleep(ms(25)).await;
                    sleep(ms(25)).await;
                    let n = runs.hit();
                    (StatusCode::CREATED, format!("charge {n}: {body}"))
                }
            }),
        )
    }

    async fn body(response: ::http::Response<axum::body::Body>) -> String {
        let bytes = axum::body::to_bytes(response.into_body(), 1 << 20)
            .await
            .expect("body read");
        String::from_utf8(bytes.to_vec()).expect("utf-8")
    }

    #[tokio::test(start_paused = true)]
    async fn an_idempotent_request_dropped_at_every_await_runs_its_handler_once() {
        let rt = runtime().await;
        let polls = for_every_cut(3, 20, |k| {
            let rt = rt.clone();
            async move {
                let key = format!("h{k}");
                let runs = Runs::default();
                let layer = IdempotencyLayer::builder(&rt)
                    .with_options(IdempotencyOptions::new().with_ttl(TTL))
                    .build()
                    .expect("valid settings");
                let app = shop(&runs).layer(layer);
                let cut = cut_after(app.clone().oneshot(request(&key)), k, PATIENCE).await;
                let finished = cut.finished();
                if let Cut::Finished(response, _) = cut {
                    let response = response.expect("infallible");
                    assert_eq!(response.status(), StatusCode::CREATED);
                }
                let retry = app
                    .clone()
                    .oneshot(request(&key))
                    .await
                    .expect("infallible");
                assert_eq!(retry.status(), StatusCode::CREATED, "cut {k}");
                let replayed = retry.headers().get("idempotent-replayed").is_some();
                assert_eq!(body(retry).await, "charge 1: 10 EUR", "cut {k}");
                assert_eq!(runs.get(), 1, "cut {k}: the handler ran once in all");
                assert_eq!(replayed, k > 0, "cut {k}: taken, the request ran then");
                sleep(TTL).await;
                assert_idle(&rt, &format!("http idempotency cut {k}")).await;
                finished
            }
        })
        .await;
        assert!(polls >= 3, "{polls}");
    }

    #[tokio::test(start_paused = true)]
    async fn a_rate_limited_request_dropped_at_every_await_is_charged_once_at_most() {
        let limiter = Limiter::new(Gcra::new(5, Duration::from_secs(60)).expect("valid"));
        for (name, layer) in [
            (
                "immediate",
                RateLimitLayer::new(Enforcer::new(limiter.clone())),
            ),
            ("async", RateLimitLayer::new(Enforcer::new(limiter.clone()))),
        ] {
            let layer = layer.with_key(RateLimitKey::header(HeaderName::from_static("x-client")));
            for_every_cut(2, 20, |k| {
                let (layer, limiter) = (layer.clone(), limiter.clone());
                async move {
                    let key = format!("{name}{k}");
                    let runs = Runs::default();
                    let app = shop(&runs).layer(layer);
                    let cut = cut_after(app.clone().oneshot(request(&key)), k, PATIENCE).await;
                    let finished = cut.finished();
                    sleep(ms(100)).await;
                    let charged = 5 - limiter.peek(&key).expect("peeks").remaining;
                    assert!(charged <= 1, "{name} cut {k}: charged {charged} times");
                    assert!(runs.get() <= 1, "{name} cut {k}");
                    let next = app.oneshot(request(&key)).await.expect("infallible");
                    assert_eq!(next.status(), StatusCode::CREATED, "{name} cut {k}");
                    let remaining = next.headers()["ratelimit-remaining"].to_str().unwrap();
                    assert_eq!(remaining, (4 - charged).to_string(), "{name} cut {k}");
                    finished
                }
            })
            .await;
        }
    }

    /// A client that hangs up over real HTTP, at each stage of a request:
    /// while sending its body, right after sending it, and while the
    /// handler runs. The retry (a client of its own) gets the handler's
    /// response, which ran once in all; the rate limit charged each request
    /// once at most.
    mod over_http {
        use std::net::SocketAddr;

        use axum::extract::State;
        use tokio::net::TcpStream;
        use tokio::sync::watch;

        use super::super::http_server as server;
        use super::super::support::cancel::eventually;
        use super::*;

        /// Where a client hangs up.
        #[derive(Debug, Clone, Copy)]
        enum HangUp {
            /// Half of the declared body sent.
            MidBody,
            /// The whole request sent, no answer awaited.
            Sent,
            /// Once the handler has started.
            HandlerRunning,
        }

        const HANG_UPS: [HangUp; 3] = [HangUp::MidBody, HangUp::Sent, HangUp::HandlerRunning];

        #[derive(Clone)]
        struct Counter {
            entered: Runs,
            finished: Runs,
            open: watch::Sender<bool>,
        }

        async fn pay(State(shop): State<Counter>, body: String) -> (StatusCode, String) {
            shop.entered.hit();
            let mut open = shop.open.subscribe();
            let _ = open.wait_for(|open| *open).await;
            let n = shop.finished.hit();
            (StatusCode::CREATED, format!("charge {n}: {body}"))
        }

        /// Writes all of `bytes` (no `io-util` needed).
        async fn send(stream: &TcpStream, mut bytes: &[u8]) {
            while !bytes.is_empty() {
                stream.writable().await.expect("writable");
                match stream.try_write(bytes) {
                    Ok(n) => bytes = &bytes[n..],
                    Err(e) if e.kind() == std::io::ErrorKind::WouldBlock => {}
                    Err(e) => panic!("write failed: {e}"),
                }
            }
        }

        /// Sends `POST /pay` with `key` by hand, and hangs up at `at`.
        async fn hang_up(addr: SocketAddr, key: &str, at: HangUp, shop: &Counter) {
            let stream = TcpStream::connect(addr).await.expect("connects");
            let head = format!(
                "POST /pay HTTP/1.1\r\nhost: {addr}\r\nidempotency-key: {key}\r\n\
                 content-type: text/plain\r\ncontent-length: 6\r\n\r\n"
            );
            send(&stream, head.as_bytes()).await;
            match at {
                HangUp::MidBody => send(&stream, b"10 ").await,
                HangUp::Sent => send(&stream, b"10 EUR").await,
                HangUp::HandlerRunning => {
                    let entered = shop.entered.get();
                    send(&stream, b"10 EUR").await;
                    eventually("the handler starts", Duration::from_secs(10), ms(5), || {
                        shop.entered.get() > entered
                    })
                    .await;
                }
            }
            drop(stream);
        }

        #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
        async fn a_client_hanging_up_at_each_stage_leaves_its_key_to_run_once() {
            let rt = Runtime::builder()
                .with_sweep_interval(ms(100))
                .start()
                .await
                .expect("runtime starts");
            let shop = Counter {
                entered: Runs::default(),
                finished: Runs::default(),
                open: watch::Sender::new(false),
            };
            let layer = IdempotencyLayer::builder(&rt)
                .with_options(IdempotencyOptions::new().with_ttl(Duration::from_secs(1)))
                .build()
                .expect("valid settings");
            let app = Router::new()
                .route("/pay", post(pay))
                .with_state(shop.clone())
                .layer(layer);
            let server = server::serve(app).await;
            for at in HANG_UPS {
                let key = format!("{at:?}");
                let before = shop.finished.get();
                shop.open.send_replace(false);
                hang_up(server.addr, &key, at, &shop).await;
                shop.open.send_replace(true);
                let retry = server.post("/pay", &key, "10 EUR").await;
                assert_eq!(retry.status, StatusCode::CREATED, "{at:?}");
                let n = before + 1;
                assert_eq!(retry.text(), format!("charge {n}: 10 EUR"), "{at:?}");
                let replayed = retry.header("idempotent-replayed") == Some("true");
                match at {
                    // The handler never had the whole request.
                    HangUp::MidBody => assert!(!replayed, "{at:?}"),
                    // Whether the server took it before seeing the hang-up
                    // is a race: either way the retry has the one response.
                    HangUp::Sent => {}
                    HangUp::HandlerRunning => assert!(replayed, "{at:?}"),
                }
                assert_eq!(shop.finished.get(), n, "{at:?}: the handler ran once");
            }
            eventually("idle", Duration::from_secs(10), ms(20), || {
                let s = rt.stats();
                s.keys + s.processes + s.timers + s.ttl_entries == 0
            })
            .await;
            assert_eq!(shop.entered.get(), shop.finished.get());
        }

        #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
        async fn a_client_hanging_up_at_each_stage_is_charged_once_at_most() {
            let limiter = Limiter::new(Gcra::new(10, Duration::from_secs(60)).expect("valid"));
            let shop = Counter {
                entered: Runs::default(),
                finished: Runs::default(),
                open: watch::Sender::new(false),
            };
            for (name, layer) in [
                (
                    "immediate",
                    RateLimitLayer::new(Enforcer::new(limiter.clone())),
                ),
                ("async", RateLimitLayer::new(Enforcer::new(limiter.clone()))),
            ] {
                let layer = layer.with_key(RateLimitKey::header(HeaderName::from_static(
                    "idempotency-key",
                )));
                let app = Router::new()
                    .route("/pay", post(pay))
                    .with_state(shop.clone())
                    .layer(layer);
                let server = server::serve(app).await;
                for at in HANG_UPS {
                    let key = format!("{name}-{at:?}");
                    shop.open.send_replace(false);
                    hang_up(server.addr, &key, at, &shop).await;
                    shop.open.send_replace(true);
                    let next = server.post("/pay", &key, "10 EUR").await;
                    assert_eq!(next.status, StatusCode::CREATED, "{name} {at:?}");
                    let remaining: u64 = next
                        .header("ratelimit-remaining")
                        .expect("the limit's headers")
                        .parse()
                        .expect("a number");
                    // The hung-up request, once its head was read, and this one.
                    assert!(
                        remaining == 8 || remaining == 9,
                        "{name} {at:?}: {remaining}"
                    );
                    if matches!(at, HangUp::HandlerRunning) {
                        assert_eq!(remaining, 8, "{name} {at:?}: it reached the handler");
                    }
                }
            }
            // Every request that was not hung up on was answered by the handler
            // (hyper drops the handler of one that was: no idempotency here).
            assert!(shop.finished.get() >= 2 * HANG_UPS.len());
        }
    }
}
