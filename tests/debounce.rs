//! Debounce scenarios D1–D9 on paused tokio time.

mod support;

use std::sync::{Arc, Mutex};
use std::time::Duration;

use support::{Oops, Runs, ms, runtime, settle};
use throttlebeam::{DebounceOptions, Error, Runtime, runtime::ShutdownPolicy};
use tokio::time::{Instant, advance, sleep};

type Log = Arc<Mutex<Vec<(u64, &'static str)>>>;

fn since(start: Instant) -> u64 {
    start.elapsed().as_millis() as u64
}

#[tokio::test(start_paused = true)]
async fn d1_five_calls_run_once_after_the_last() {
    let rt = runtime().await;
    let d = rt.debounce();
    let runs = Runs::default();
    let start = Instant::now();
    let log: Log = Arc::default();
    for i in 0..5 {
        let (runs, log) = (runs.clone(), log.clone());
        let _ = d
            .call("k", ms(150), move || async move {
                runs.hit();
                log.lock().unwrap().push((since(start), "run"));
                Ok::<_, Oops>(i)
            })
            .unwrap();
        if i < 4 {
            sleep(ms(20)).await;
        }
    }
    // Last call at 80: exactly one run, at 230.
    sleep(ms(149)).await;
    assert!(
        log.lock().unwrap().is_empty(),
        "ran early: {:?}",
        log.lock().unwrap()
    );
    sleep(ms(1)).await;
    settle().await;
    assert_eq!(*log.lock().unwrap(), vec![(230, "run")]);
    sleep(ms(1000)).await;
    assert_eq!(runs.get(), 1, "ran again afterwards");
    assert!(!d.is_pending("k"));
    assert_eq!(rt.stats().keys, 0);
    assert_eq!(rt.stats().processes, 0, "{:?}", rt.stats());
    assert_eq!(rt.stats().timers, 0);
}

#[tokio::test(start_paused = true)]
async fn d2_latest_function_wins_and_every_caller_sees_it() {
    let rt = runtime().await;
    let d = rt.debounce();
    let a = d
        .call("k", ms(100), || async { Ok::<_, Oops>("first") })
        .unwrap();
    let b = d
        .call("k", ms(100), || async { Ok::<_, Oops>("second") })
        .unwrap();
    let c = d
        .call("k", ms(100), || async { Ok::<_, Oops>("third") })
        .unwrap();
    assert_eq!(a.await.unwrap(), "third");
    assert_eq!(b.await.unwrap(), "third");
    assert_eq!(c.await.unwrap(), "third");
}

#[tokio::test(start_paused = true)]
async fn d3_keys_are_independent_and_a_slow_key_does_not_delay_another() {
    let rt = runtime().await;
    let d = rt.debounce();
    let start = Instant::now();
    let slow = d
        .call("a", ms(10), move || async move {
            sleep(ms(10_000)).await;
            Ok::<_, Oops>(since(start))
        })
        .unwrap();
    let fast = d
        .call(
            "b",
            ms(50),
            move || async move { Ok::<_, Oops>(since(start)) },
        )
        .unwrap();
    assert_eq!(fast.await.unwrap(), 50);
    assert_eq!(slow.await.unwrap(), 10_010);
}

#[tokio::test(start_paused = true)]
async fn d4_max_wait_bounds_the_delay_under_constant_calls() {
    let rt = runtime().await;
    let d = rt.debounce();
    let start = Instant::now();
    let log: Log = Arc::default();
    let options = DebounceOptions::new().with_max_wait(ms(500));
    for _ in 0..=23 {
        let log = log.clone();
        let _ = d
            .call_with("k", ms(150), options, move || async move {
                log.lock().unwrap().push((since(start), "run"));
                Ok::<_, Oops>(())
            })
            .unwrap();
        sleep(ms(90)).await;
    }
    // Calls every 90 from 0 to 2070: a run at most every 500 while they keep
    // coming, then the trailing run 150 after the last call.
    sleep(ms(1000)).await;
    let times: Vec<u64> = log.lock().unwrap().iter().map(|(t, _)| *t).collect();
    assert_eq!(times, vec![500, 1000, 1500, 2000, 2220]);
}

#[tokio::test(start_paused = true)]
async fn d5_leading_runs_first_call_now_and_one_trailing_run() {
    let rt = runtime().await;
    let d = rt.debounce();
    let start = Instant::now();
    let runs = Runs::default();
    let options = DebounceOptions::new().with_leading(true);
    let mut handles = Vec::new();
    for i in 0..4u64 {
        let runs = runs.clone();
        handles.push(
            d.call_with("k", ms(100), options, move || async move {
                runs.hit();
                Ok::<_, Oops>((i, since(start)))
            })
            .unwrap(),
        );
        sleep(ms(10)).await;
    }
    let outcomes: Vec<_> = futures_join(handles).await;
    assert_eq!(outcomes[0], (0, 0), "the first call runs at once");
    for o in &outcomes[1..] {
        assert_eq!(
            *o,
            (3, 130),
            "one trailing run, latest function, at last call + delay"
        );
    }
    assert_eq!(runs.get(), 2);

    // A single call produces exactly one run.
    let single = Runs::default();
    let r = single.clone();
    let one = d
        .call_with("single", ms(100), options, move || async move {
            r.hit();
            Ok::<_, Oops>(())
        })
        .unwrap();
    one.await.unwrap();
    sleep(ms(1000)).await;
    assert_eq!(single.get(), 1);
    assert_eq!(rt.stats().keys, 0);
}

async fn futures_join<T: Clone + Send + Sync + 'static>(
    handles: Vec<throttlebeam::debounce::Debounced<T>>,
) -> Vec<T> {
    let mut out = Vec::new();
    for h in handles {
        out.push(h.await.unwrap());
    }
    out
}

#[tokio::test(start_paused = true)]
async fn d6_cancel_and_flush() {
    let rt = runtime().await;
    let d = rt.debounce();
    let runs = Runs::default();
    let r = runs.clone();
    let cancelled = d
        .call("k", ms(100), move || async move {
            r.hit();
            Ok::<_, Oops>(())
        })
        .unwrap();
    assert!(d.is_pending("k"));
    assert!(d.cancel("k"));
    assert!(!d.cancel("k"), "nothing left to cancel");
    assert!(matches!(
        cancelled.await,
        Err(Error::Discarded {
            reason: "cancelled",
            ..
        })
    ));
    sleep(ms(500)).await;
    assert_eq!(runs.get(), 0, "a cancelled run never happens");
    assert_eq!(rt.stats().keys, 0);

    // The next call starts a fresh burst.
    let start = Instant::now();
    let fresh = d
        .call(
            "k",
            ms(100),
            move || async move { Ok::<_, Oops>(since(start)) },
        )
        .unwrap();
    assert_eq!(fresh.await.unwrap(), 100);

    // Flush runs now, once.
    let r = runs.clone();
    let start = Instant::now();
    let flushed = d
        .call("k", ms(100), move || async move {
            r.hit();
            Ok::<_, Oops>(since(start))
        })
        .unwrap();
    sleep(ms(10)).await;
    assert!(d.flush("k"));
    assert_eq!(flushed.await.unwrap(), 10);
    sleep(ms(500)).await;
    assert_eq!(runs.get(), 1);
    assert!(!d.flush("k"));
}

#[tokio::test(start_paused = true)]
async fn d7_every_caller_gets_the_run_error_and_non_waiters_are_not_blocked() {
    let rt = runtime().await;
    let d = rt.debounce();
    let a = d
        .call("k", ms(50), || async { Err::<u8, _>(Oops("db down")) })
        .unwrap();
    let b = d
        .call("k", ms(50), || async { Err::<u8, _>(Oops("db down")) })
        .unwrap();
    for outcome in [a.await, b.await] {
        let err = outcome.unwrap_err();
        assert!(matches!(err, Error::Failed { ref key, .. } if key == "k"));
        let source = std::error::Error::source(&err).unwrap();
        assert_eq!(source.to_string(), "oops: db down");
    }
    let p = d
        .call("p", ms(50), || async {
            if true {
                panic!("kaboom")
            } else {
                Ok::<u8, Oops>(1)
            }
        })
        .unwrap();
    assert!(matches!(p.await, Err(Error::Panicked { message, .. }) if message == "kaboom"));
    // A caller that does not wait returns immediately: the call is synchronous.
    let before = Instant::now();
    drop(
        d.call("q", ms(10_000), || async { Ok::<_, Oops>(()) })
            .unwrap(),
    );
    assert_eq!(before.elapsed(), Duration::ZERO);
}

#[tokio::test(start_paused = true)]
async fn d8_graceful_shutdown_flushes_pending_work() {
    let rt = runtime().await;
    let d = rt.debounce();
    let runs = Runs::default();
    let mut handles = Vec::new();
    for key in ["a", "b", "c"] {
        let r = runs.clone();
        handles.push(
            d.call(key, ms(60_000), move || async move {
                r.hit();
                Ok::<_, Oops>(key)
            })
            .unwrap(),
        );
    }
    let start = Instant::now();
    let report = rt.shutdown(ms(1000)).await;
    assert_eq!(report.still_running, 0);
    assert!(
        start.elapsed() < ms(1000),
        "flushed instead of waiting for the delays"
    );
    assert_eq!(runs.get(), 3);
    for (h, key) in handles.into_iter().zip(["a", "b", "c"]) {
        assert_eq!(h.await.unwrap(), key);
    }
    assert!(matches!(
        d.call("a", ms(10), || async { Ok::<_, Oops>("late") }),
        Err(Error::ShutDown { key }) if key == "a"
    ));
    // Twice is harmless.
    assert_eq!(rt.shutdown(ms(10)).await.still_running, 0);
}

#[tokio::test(start_paused = true)]
async fn d8_shutdown_with_drop_policy_discards_pending_work() {
    let rt = Runtime::builder()
        .with_shutdown_policy(ShutdownPolicy::Drop)
        .start()
        .await
        .unwrap();
    let d = rt.debounce();
    let runs = Runs::default();
    let r = runs.clone();
    let h = d
        .call("a", ms(60_000), move || async move {
            r.hit();
            Ok::<_, Oops>(())
        })
        .unwrap();
    rt.shutdown(ms(1000)).await;
    assert!(matches!(
        h.await,
        Err(Error::Discarded {
            reason: "dropped at shutdown",
            ..
        })
    ));
    assert_eq!(runs.get(), 0);
    assert_eq!(rt.stats().keys, 0);
}

#[tokio::test(start_paused = true)]
async fn d9_bad_input_is_a_typed_error_and_schedules_nothing() {
    let rt = runtime().await;
    let d = rt.debounce();
    let ok = || async { Ok::<_, Oops>(()) };
    assert!(matches!(
        d.call("", ms(10), ok),
        Err(Error::InvalidKey { .. })
    ));
    let long = "x".repeat(1025);
    let err = d.call(&long, ms(10), ok).unwrap_err();
    assert!(matches!(err, Error::InvalidKey { .. }));
    assert!(err.to_string().contains("longer than 1024 bytes"));
    assert!(d.call(&"x".repeat(1024), ms(10), ok).is_ok());
    let err = d.call("k", Duration::ZERO, ok).unwrap_err();
    assert!(matches!(err, Error::InvalidArgument { what: "delay", .. }));
    assert!(
        err.to_string().contains("\"k\""),
        "message names the key: {err}"
    );
    assert!(matches!(
        d.call("k", Duration::MAX, ok),
        Err(Error::InvalidArgument { what: "delay", .. })
    ));
    assert!(matches!(
        d.call_with(
            "k",
            ms(10),
            DebounceOptions::new().with_max_wait(Duration::ZERO),
            ok
        ),
        Err(Error::InvalidArgument {
            what: "max wait",
            ..
        })
    ));
    settle().await;
    assert_eq!(
        rt.stats().keys,
        1,
        "only the valid 1024-byte key is tracked"
    );
    // Another result type on a pending key is refused.
    let _a = d
        .call("typed", ms(10), || async { Ok::<u8, Oops>(1) })
        .unwrap();
    assert!(matches!(
        d.call("typed", ms(10), || async {
            Ok::<String, Oops>(String::new())
        }),
        Err(Error::TypeMismatch { .. })
    ));
    advance(ms(20)).await;
}

#[tokio::test(start_paused = true)]
async fn a_burst_costs_about_one_timer_wakeup() {
    let rt = runtime().await;
    let d = rt.debounce();
    let first = d.call("k", ms(100), || async { Ok::<_, Oops>(0) }).unwrap();
    settle().await;
    for i in 1..1000 {
        let _ = d
            .call("k", ms(100), move || async move { Ok::<_, Oops>(i) })
            .unwrap();
    }
    assert_eq!(first.await.unwrap(), 999);
    let wakeups = rt.stats().debounce.timer_wakeups;
    assert!(wakeups <= 2, "wakeups: {wakeups}");
}

/// Issue 7 item 2: a key scheduled from a tokio runtime that then ends
/// (every `#[tokio::test]` does that) used to keep its slot with no process,
/// so every later call for the key hung forever.
#[test]
fn a_key_scheduled_from_an_ended_tokio_runtime_never_wedges() {
    use throttlebeam::Debounce;
    let key = "wedge:ended-runtime";
    let first = tokio::runtime::Builder::new_current_thread()
        .enable_all()
        .build()
        .unwrap();
    let lost = first.block_on(async {
        let lost = Debounce::call(key, Duration::from_secs(3600), || async {
            Ok::<_, Oops>("never")
        })
        .unwrap();
        assert!(Debounce::is_pending(key).unwrap());
        lost
    });
    // The runtime that ran the key's process ends, dropping the process.
    drop(first);
    assert!(
        !Debounce::is_pending(key).unwrap(),
        "the slot went with its process"
    );

    let second = tokio::runtime::Builder::new_current_thread()
        .enable_all()
        .build()
        .unwrap();
    second.block_on(async {
        let outcome = tokio::time::timeout(Duration::from_secs(5), lost.into_future())
            .await
            .expect("the lost run's waiter is told at once");
        assert!(
            matches!(&outcome, Err(Error::Discarded { key: k, reason }) if k == key && reason.contains("process was lost")),
            "{outcome:?}"
        );
        let again = Debounce::call(key, ms(1), || async { Ok::<_, Oops>("ran") }).unwrap();
        let ran = tokio::time::timeout(Duration::from_secs(5), again.into_future())
            .await
            .expect("a new call on the key runs, it does not hang");
        assert_eq!(ran.unwrap(), "ran");
    });
}

/// Runs `f` on a thread of its own; fails the test if it has not returned
/// within 5 s (a deadlock).
fn within_5s(f: impl FnOnce() + Send + 'static) {
    let (tx, rx) = std::sync::mpsc::channel();
    std::thread::spawn(move || {
        f();
        let _ = tx.send(());
    });
    rx.recv_timeout(Duration::from_secs(5))
        .expect("returned (a user closure dropped under a shard lock deadlocks here)");
}

/// Touches the key's shard when dropped, as a user's `Drop` may (through
/// another handle, a log sink, ...): dropped under the shard lock, it
/// deadlocks.
struct TouchesTheKeyOnDrop(throttlebeam::DebounceHandle, &'static str);

impl Drop for TouchesTheKeyOnDrop {
    fn drop(&mut self) {
        let _ = self.0.is_pending(self.1);
    }
}

/// Issue 7 item 2: replaced, cancelled and refused functions are dropped
/// after the shard lock is released.
#[test]
fn user_functions_are_never_dropped_under_the_shard_lock() {
    within_5s(|| {
        let tokio = tokio::runtime::Builder::new_current_thread()
            .enable_all()
            .start_paused(true)
            .build()
            .unwrap();
        tokio.block_on(async {
            let rt = runtime().await;
            let d = rt.debounce();
            let call = |value: u8| {
                let guard = TouchesTheKeyOnDrop(d.clone(), "k");
                d.call("k", ms(100), move || async move {
                    let _guard = guard;
                    Ok::<_, Oops>(value)
                })
            };
            let first = call(1).unwrap();
            // Replaced: the first function is dropped.
            let second = call(2).unwrap();
            // Cancelled: the second one is dropped.
            assert!(d.cancel("k"));
            assert!(matches!(first.await, Err(Error::Discarded { .. })));
            assert!(matches!(second.await, Err(Error::Discarded { .. })));
            // Refused for its type: dropped without being scheduled.
            let _pending = call(3).unwrap();
            let guard = TouchesTheKeyOnDrop(d.clone(), "k");
            let refused = d.call("k", ms(100), move || async move {
                let _guard = guard;
                Ok::<_, Oops>("other type")
            });
            assert!(matches!(refused, Err(Error::TypeMismatch { .. })));
        });
    });
}

#[tokio::test(start_paused = true)]
async fn debounce_stats_count_calls_runs_and_what_became_of_them() {
    let rt = runtime().await;
    let d = rt.debounce();
    let a1 = d.call("a", ms(100), || async { Ok::<_, Oops>(1) }).unwrap();
    let a2 = d.call("a", ms(100), || async { Ok::<_, Oops>(2) }).unwrap();
    let _b = d.call("b", ms(100), || async { Ok::<_, Oops>(3) }).unwrap();
    let c = d
        .call("c", ms(100), || async { Err::<u8, _>(Oops("c")) })
        .unwrap();
    let _e = d.call("e", ms(100), || async { Ok::<_, Oops>(5) }).unwrap();
    assert!(d.cancel("b"));
    assert!(d.flush("e"));
    assert_eq!(rt.stats().debounce.keys, 4);
    assert_eq!((a1.await.unwrap(), a2.await.unwrap()), (2, 2));
    assert!(c.await.is_err());
    let stats = rt.stats().debounce;
    assert_eq!(stats.calls, 5);
    assert_eq!(stats.coalesced, 1);
    assert_eq!(stats.cancelled, 1);
    assert_eq!(stats.flushed, 1);
    assert_eq!(stats.runs, 3);
    assert_eq!(stats.failed, 1);
    settle().await;
    advance(ms(1)).await;
    settle().await;
    assert_eq!(rt.stats().debounce.keys, 0);
}

/// Collects warn-level events for one test.
#[derive(Clone, Default)]
struct Warnings(Arc<Mutex<Vec<String>>>);

impl std::io::Write for Warnings {
    fn write(&mut self, buf: &[u8]) -> std::io::Result<usize> {
        self.0
            .lock()
            .unwrap()
            .push(String::from_utf8_lossy(buf).into_owned());
        Ok(buf.len())
    }
    fn flush(&mut self) -> std::io::Result<()> {
        Ok(())
    }
}

/// Issue 7 item 19: a failed run nobody awaited is logged at warn, not
/// only at debug (where it failed silently); an awaited one stays at debug.
#[tokio::test(start_paused = true)]
async fn a_failed_fire_and_forget_run_is_logged_at_warn() {
    let warnings = Warnings::default();
    let sink = warnings.clone();
    let subscriber = tracing_subscriber::fmt()
        .with_max_level(tracing::Level::WARN)
        .with_ansi(false)
        .with_writer(move || sink.clone())
        .finish();
    let _default = tracing::subscriber::set_default(subscriber);
    let rt = runtime().await;
    let d = rt.debounce();
    drop(
        d.call("forgotten", ms(10), || async { Err::<u8, _>(Oops("lost")) })
            .unwrap(),
    );
    let awaited = d
        .call("watched", ms(10), || async { Err::<u8, _>(Oops("seen")) })
        .unwrap();
    assert!(awaited.await.is_err());
    advance(ms(10)).await;
    settle().await;
    let lines = warnings.0.lock().unwrap().join("");
    assert!(lines.contains("WARN"), "{lines}");
    assert!(lines.contains("forgotten"), "{lines}");
    assert!(!lines.contains("watched"), "{lines}");
}
