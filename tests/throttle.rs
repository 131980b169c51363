//! Leading-edge throttle scenarios T1–T5 on paused tokio time.

mod support;

use std::time::Duration;

use support::{Events, Oops, Runs, ms, runtime, settle};
use throttlebeam::{Error, ThrottleOutcome};
use tokio::time::{Instant, advance, sleep};

#[tokio::test(start_paused = true)]
async fn t1_five_immediate_calls_execute_once() {
    let rt = runtime().await;
    let t = rt.throttle();
    let runs = Runs::default();
    let mut outcomes = Vec::new();
    for i in 0..5 {
        let r = runs.clone();
        outcomes.push(
            t.call("k", ms(100), move || async move {
                r.hit();
                Ok::<_, Oops>(i)
            })
            .await
            .unwrap(),
        );
    }
    assert_eq!(outcomes[0], ThrottleOutcome::Executed(0));
    for o in &outcomes[1..] {
        assert!(o.is_throttled(), "{o:?}");
    }
    assert_eq!(runs.get(), 1, "throttled functions never run");
}

#[tokio::test(start_paused = true)]
async fn t2_window_reopens_after_the_interval() {
    let rt = runtime().await;
    let t = rt.throttle();
    let call = |v| t.call("k", ms(100), move || async move { Ok::<_, Oops>(v) });
    assert_eq!(call(0).await.unwrap(), ThrottleOutcome::Executed(0));
    sleep(ms(50)).await;
    assert_eq!(
        call(50).await.unwrap(),
        ThrottleOutcome::Throttled {
            retry_after: ms(50)
        }
    );
    sleep(ms(50)).await;
    assert_eq!(
        call(100).await.unwrap(),
        ThrottleOutcome::Executed(100),
        "now == window end executes"
    );
    sleep(ms(50)).await;
    assert!(call(150).await.unwrap().is_throttled());
}

#[tokio::test(start_paused = true)]
async fn t3_throttled_callers_do_not_wait_for_a_slow_function() {
    let rt = runtime().await;
    let t = rt.throttle();
    let t2 = t.clone();
    let slow = tokio::spawn(async move {
        t2.call("k", ms(100), || async {
            sleep(ms(5_000)).await;
            Ok::<_, Oops>("slow")
        })
        .await
    });
    tokio::task::yield_now().await;
    sleep(ms(1)).await;
    let before = Instant::now();
    let outcome = t
        .call("k", ms(100), || async { Ok::<_, Oops>("fast") })
        .await
        .unwrap();
    assert_eq!(before.elapsed(), Duration::ZERO, "returned at once");
    assert!(outcome.is_throttled());
    assert_eq!(
        slow.await.unwrap().unwrap(),
        ThrottleOutcome::Executed("slow")
    );
}

#[tokio::test(start_paused = true)]
async fn t4_window_starts_when_the_call_starts_and_retry_after_counts_down() {
    let rt = runtime().await;
    let t = rt.throttle();
    let start = Instant::now();
    // The function takes 80 of the 100 window; the window still ends at 100.
    let first = t
        .call("k", ms(100), || async {
            sleep(ms(80)).await;
            Ok::<_, Oops>(())
        })
        .await
        .unwrap();
    assert_eq!(first, ThrottleOutcome::Executed(()));
    assert_eq!(start.elapsed(), ms(80));
    let second = t
        .call("k", ms(100), || async { Ok::<_, Oops>(()) })
        .await
        .unwrap();
    assert_eq!(
        second,
        ThrottleOutcome::Throttled {
            retry_after: ms(20)
        }
    );
    sleep(ms(20)).await;
    assert!(
        !t.call("k", ms(100), || async { Ok::<_, Oops>(()) })
            .await
            .unwrap()
            .is_throttled()
    );
}

#[tokio::test(start_paused = true)]
async fn t5_errors_and_panics_reach_the_caller_and_the_window_still_opens() {
    let rt = runtime().await;
    let t = rt.throttle();
    let err = t
        .call("e", ms(100), || async { Err::<u8, _>(Oops("nope")) })
        .await
        .unwrap_err();
    assert!(matches!(&err, Error::Failed { key, .. } if key == "e"));
    assert_eq!(
        std::error::Error::source(&err).unwrap().to_string(),
        "oops: nope"
    );
    assert!(
        t.call("e", ms(100), || async { Ok::<_, Oops>(1) })
            .await
            .unwrap()
            .is_throttled()
    );

    let err = t
        .call("p", ms(100), || async {
            if true {
                panic!("bad state");
            }
            Ok::<u8, Oops>(1)
        })
        .await
        .unwrap_err();
    assert!(
        matches!(&err, Error::Panicked { key, message } if key == "p" && message == "bad state")
    );
    assert!(
        t.call("p", ms(100), || async { Ok::<_, Oops>(1) })
            .await
            .unwrap()
            .is_throttled()
    );
    assert_eq!(rt.stats().processes, 0);
}

#[tokio::test(start_paused = true)]
async fn dropping_the_caller_does_not_cancel_the_function() {
    let rt = runtime().await;
    let t = rt.throttle();
    let runs = Runs::default();
    let r = runs.clone();
    let call = t.call("k", ms(100), move || async move {
        sleep(ms(50)).await;
        r.hit();
        Ok::<_, Oops>(())
    });
    // Poll once so the call is accepted, then drop it.
    let _ = tokio::time::timeout(ms(10), call).await;
    sleep(ms(100)).await;
    assert_eq!(runs.get(), 1);
}

#[tokio::test(start_paused = true)]
async fn bad_input_is_a_typed_error() {
    let rt = runtime().await;
    let t = rt.throttle();
    let ok = || async { Ok::<_, Oops>(()) };
    assert!(matches!(
        t.call("", ms(10), ok).await,
        Err(Error::InvalidKey { .. })
    ));
    assert!(matches!(
        t.call(&"k".repeat(2000), ms(10), ok).await,
        Err(Error::InvalidKey { .. })
    ));
    assert!(matches!(
        t.call("k", Duration::ZERO, ok).await,
        Err(Error::InvalidArgument {
            what: "interval",
            ..
        })
    ));
    assert!(matches!(
        t.call("k", Duration::from_secs(u64::MAX), ok).await,
        Err(Error::InvalidArgument {
            what: "interval",
            ..
        })
    ));
    assert_eq!(rt.stats().keys, 0);
}

#[tokio::test(start_paused = true)]
async fn open_windows_are_swept_and_cost_no_process() {
    let rt = throttlebeam::Runtime::builder()
        .with_sweep_interval(ms(1000))
        .start()
        .await
        .unwrap();
    let t = rt.throttle();
    for i in 0..100 {
        let key = format!("k{i}");
        let outcome = t
            .call(&key, ms(500), || async { Ok::<_, Oops>(()) })
            .await
            .unwrap();
        assert!(!outcome.is_throttled());
    }
    // Runs happen in this task: let the sweeper's tick start.
    tokio::task::yield_now().await;
    let stats = rt.stats();
    assert_eq!(stats.keys, 100);
    assert_eq!(
        stats.processes, 0,
        "an open window with nothing running is not a process"
    );
    assert_eq!(stats.timers, 0, "an open window holds no timer");
    assert!(stats.sweeping, "the sweeper ticks");
    sleep(ms(1001)).await;
    assert_eq!(rt.stats().keys, 0);
    assert!(!rt.stats().sweeping, "the sweeper goes dormant");
}

/// Issue 50, W9: the runtime's `keys` and the throttle's `windows` count
/// windows open now. A window that is over counts nowhere from its last
/// instant on, though its slot waits for the sweep (60 s by default), and it
/// holds no timer at any point.
#[tokio::test(start_paused = true)]
async fn w9_a_window_that_is_over_counts_nowhere_before_the_sweep() {
    let rt = runtime().await;
    let t = rt.throttle();
    let t0 = Instant::now();
    let ok = || async { Ok::<_, Oops>(()) };
    assert!(t.call("a", ms(100), ok).await.unwrap().is_executed());
    advance(ms(50)).await;
    assert!(t.call("b", ms(100), ok).await.unwrap().is_executed());
    let gauges = || {
        let s = rt.stats();
        (s.keys, s.throttle.windows, s.timers)
    };
    assert_eq!(gauges(), (2, 2, 0));
    // a's window is [0, 100), b's [50, 150).
    advance(t0 + ms(99) - Instant::now()).await;
    assert_eq!(gauges(), (2, 2, 0));
    advance(ms(1)).await;
    assert_eq!(gauges(), (1, 1, 0), "a's window is over at 100");
    advance(ms(49)).await;
    assert_eq!(gauges(), (1, 1, 0));
    advance(ms(1)).await;
    assert_eq!(gauges(), (0, 0, 0), "b's window is over at 150");
    // Still held (the sweep has not run) and the sweeper still ticks for them.
    assert!(rt.stats().sweeping);
    // A key over its window opens a new one in the same slot: counted again.
    assert!(t.call("a", ms(100), ok).await.unwrap().is_executed());
    assert_eq!(gauges(), (1, 1, 0));
    sleep(ms(60_000)).await;
    settle().await;
    let s = rt.stats();
    assert_eq!(
        (s.keys, s.throttle.windows, s.timers, s.sweeping),
        (0, 0, 0, false)
    );
}

/// Under a cap of 2 keys: `a` and `b` run (100 ms windows), `c` is refused.
async fn a_and_b_then_c_refused(t: &throttlebeam::ThrottleHandle) -> Error {
    let ok = || async { Ok::<_, Oops>(()) };
    assert!(!t.call("a", ms(100), ok).await.unwrap().is_throttled());
    assert!(!t.call("b", ms(100), ok).await.unwrap().is_throttled());
    let err = t.call("c", ms(100), ok).await.unwrap_err();
    assert!(matches!(&err, Error::TooManyKeys { key, cap: 2 } if key == "c"));
    err
}

#[tokio::test(start_paused = true)]
async fn key_cap_is_enforced_with_a_clear_error() {
    let rt = throttlebeam::Runtime::builder()
        .with_max_keys(2)
        .start()
        .await
        .unwrap();
    let t = rt.throttle();
    let ok = || async { Ok::<_, Oops>(()) };
    let err = a_and_b_then_c_refused(&t).await;
    assert!(err.to_string().contains("cap 2"));
    // Existing keys keep working.
    assert!(t.call("a", ms(100), ok).await.unwrap().is_throttled());
    assert!(matches!(
        throttlebeam::Runtime::builder()
            .with_max_keys(0)
            .start()
            .await,
        Err(Error::InvalidConfig { .. })
    ));
}

/// A runtime capped at `cap` keys whose sweeper ticks once an hour.
async fn runtime_swept_hourly(cap: usize) -> throttlebeam::Runtime {
    throttlebeam::Runtime::builder()
        .with_max_keys(cap)
        .with_sweep_interval(Duration::from_secs(3600))
        .start()
        .await
        .unwrap()
}

/// A caller that never yields keeps the sweeper from running: a full key
/// cap then makes room itself from windows that are over (a paced pass),
/// rather than refusing keys that the sweeper would have freed.
#[tokio::test(start_paused = true)]
async fn a_full_key_cap_makes_room_from_windows_that_are_over_without_the_sweeper() {
    let rt = runtime_swept_hourly(2).await;
    let t = rt.throttle();
    let ok = || async { Ok::<_, Oops>(()) };
    // Both windows open: nothing to free.
    a_and_b_then_c_refused(&t).await;
    // Let the sweeper take its kick (one pass, windows open) and arm its
    // next tick, an hour away.
    for _ in 0..20 {
        tokio::task::yield_now().await;
    }
    tokio::time::advance(ms(150)).await;
    // Both windows are over: counted nowhere (W9), though they fill the cap until a
    // pass or the sweeper forgets them.
    assert_eq!(rt.stats().keys, 0, "over");
    assert!(rt.stats().sweeping, "the sweeper has not run");
    assert!(!t.call("c", ms(100), ok).await.unwrap().is_throttled());
    assert_eq!(rt.stats().keys, 1, "a and b were over and forgotten");
    assert!(t.call("c", ms(100), ok).await.unwrap().is_throttled());
}

/// Two tasks that never yield, each running fresh keys with 1 ms windows
/// back to back: the sweeper never runs, and the cap is reached over and
/// over, yet no call is refused, as the cap's keys are nearly all over by
/// then. When one caller's pass is running, the other waits for it and
/// tries again.
///
/// "Nearly all over" whatever the machine's pace: after every 1,000 keys a
/// task blocks its worker for 2 ms (still no yield), so at any instant at
/// most 1,000 of its windows are open, and the cap of 10,000 is at least
/// 80 % windows that are over when it is hit. (Without the pauses that
/// held only while 10,000 keys took over 1 ms.)
#[test]
fn tight_loops_of_fresh_keys_never_hit_a_cap_full_of_windows_that_are_over() {
    let tokio_rt = tokio::runtime::Builder::new_multi_thread()
        .worker_threads(2)
        .enable_all()
        .build()
        .unwrap();
    tokio_rt.block_on(async {
        let rt = runtime_swept_hourly(10_000).await;
        let tasks: Vec<_> = (0..2)
            .map(|task| {
                let t = rt.throttle();
                tokio::spawn(async move {
                    for i in 0..20_000 {
                        let key = format!("tight:{task}:{i}");
                        let outcome = t
                            .call(&key, ms(1), || async { Ok::<_, Oops>(()) })
                            .await
                            .unwrap_or_else(|e| panic!("{key}: {e}"));
                        assert!(!outcome.is_throttled(), "{key} is fresh");
                        if i % 1_000 == 999 {
                            // Every window opened so far is over after this.
                            std::thread::sleep(ms(2));
                        }
                    }
                })
            })
            .collect();
        for task in tasks {
            task.await.unwrap();
        }
        assert!(rt.stats().keys <= 10_000);
    });
}

#[tokio::test]
async fn windows_on_the_timestamp_counter_behave_the_same() {
    let rt = throttlebeam::Runtime::builder()
        .with_clock(throttlebeam::runtime::RuntimeClock::Tsc)
        .start()
        .await
        .unwrap();
    let t = rt.throttle();
    let ok = || async { Ok::<_, Oops>(1) };
    assert_eq!(
        t.call("k", ms(60_000), ok).await.unwrap(),
        ThrottleOutcome::Executed(1)
    );
    match t.call("k", ms(60_000), ok).await.unwrap() {
        ThrottleOutcome::Throttled { retry_after } => {
            assert!(
                retry_after <= ms(60_000) && retry_after > ms(59_000),
                "{retry_after:?}"
            );
        }
        other => panic!("expected throttled, got {other:?}"),
    }
    // A one-millisecond window really closes.
    assert!(!t.call("short", ms(1), ok).await.unwrap().is_throttled());
    let start = std::time::Instant::now();
    loop {
        if !t.call("short", ms(1), ok).await.unwrap().is_throttled() {
            break;
        }
        assert!(
            start.elapsed() < std::time::Duration::from_secs(5),
            "window never closed"
        );
        tokio::task::yield_now().await;
    }
}

/// Issue 7 item 15: memory comes back. After a flood of keys is swept,
/// neither the windows nor the debounce keys keep their peak capacity, and
/// both show in stats.
#[tokio::test(start_paused = true)]
async fn a_swept_flood_gives_its_memory_back_and_shows_in_stats() {
    let rt = runtime().await;
    let t = rt.throttle();
    let d = rt.debounce();
    let mut runs = Vec::new();
    for i in 0..20_000 {
        let key = format!("flood:{i}");
        assert!(
            t.call(&key, ms(10), || async { Ok::<_, Oops>(()) })
                .await
                .unwrap()
                .is_executed()
        );
        runs.push(d.call(&key, ms(1), || async { Ok::<_, Oops>(()) }).unwrap());
    }
    let peak = rt.stats();
    assert_eq!(
        (peak.throttle.windows, peak.debounce.keys),
        (20_000, 20_000)
    );
    assert!(peak.throttle.capacity >= 20_000 && peak.debounce.capacity >= 20_000);
    advance(ms(10)).await;
    for run in runs {
        run.await.unwrap();
    }
    support::settle().await;
    assert_eq!(rt.sweep_now(), 0);
    let swept = rt.stats();
    assert_eq!(
        (swept.throttle.windows, swept.debounce.keys, swept.keys),
        (0, 0, 0)
    );
    assert!(
        swept.throttle.capacity < peak.throttle.capacity / 4,
        "windows kept {} of {} slots",
        swept.throttle.capacity,
        peak.throttle.capacity
    );
    assert!(
        swept.debounce.capacity < peak.debounce.capacity / 4,
        "debounce kept {} of {} slots",
        swept.debounce.capacity,
        peak.debounce.capacity
    );
}

#[tokio::test(start_paused = true)]
async fn throttle_stats_count_executed_and_throttled_calls() {
    let rt = runtime().await;
    let t = rt.throttle();
    for _ in 0..5 {
        let _ = t
            .call("a", ms(100), || async { Ok::<_, Oops>(()) })
            .await
            .unwrap();
    }
    let _ = t
        .call("b", ms(100), || async { Err::<(), _>(Oops("b")) })
        .await;
    let stats = rt.stats().throttle;
    assert_eq!((stats.executed, stats.throttled, stats.windows), (2, 4, 2));
    let json = serde_json::to_value(rt.stats()).unwrap();
    assert_eq!(json["throttle"]["throttled"], 4);
}

/// Issue 7 item 2: a leading call whose per-key process is lost (its tokio
/// runtime ended mid-run) gets a typed `Discarded`, not a panic report, and
/// the key is usable again.
#[test]
fn a_run_whose_caller_and_runtime_end_mid_run_leaves_the_key_throttled_not_wedged() {
    use std::future::Future;
    use std::pin::Pin;

    let main = tokio::runtime::Builder::new_multi_thread()
        .worker_threads(1)
        .enable_all()
        .build()
        .unwrap();
    let rt = main.block_on(runtime());
    let key = "lost:leading";
    let throttle = rt.throttle();
    let stats = rt.clone();
    std::thread::spawn(move || {
        let doomed = tokio::runtime::Builder::new_current_thread()
            .enable_all()
            .build()
            .unwrap();
        let (started_tx, started_rx) = tokio::sync::oneshot::channel::<()>();
        let mut call: Pin<Box<dyn Future<Output = _> + Send>> = Box::pin(async move {
            throttle
                .call(key, Duration::from_secs(3600), move || async move {
                    let _ = started_tx.send(());
                    std::future::pending::<()>().await;
                    Ok::<_, Oops>("never")
                })
                .await
        });
        doomed.block_on(async {
            tokio::select! {
                _ = &mut call => panic!("the function never ends"),
                _ = started_rx => {}
            }
        });
        assert_eq!(
            stats.stats().processes,
            1,
            "the run counts as the key's process"
        );
        // The runtime the run started on ends, then its caller leaves: the
        // rest of the run has nowhere to go and is dropped with it.
        drop(doomed);
        drop(call);
    })
    .join()
    .unwrap();
    main.block_on(async {
        assert_eq!(rt.stats().processes, 0, "nothing is left counted");
        // The window was opened by the lost call: the key is throttled, not wedged.
        let again = rt
            .throttle()
            .call(key, Duration::from_secs(3600), || async {
                Ok::<_, Oops>("ran")
            })
            .await
            .unwrap();
        assert!(
            matches!(again, ThrottleOutcome::Throttled { .. }),
            "{again:?}"
        );
    });
}

/// Issue 30 item 14: a function that fails after its caller dropped its
/// future is logged at warn and counted; a caller who waits gets the error
/// and nothing is counted.
#[tokio::test(start_paused = true)]
async fn a_failure_after_the_caller_left_is_logged_at_warn_and_counted() {
    let events = Events::default();
    let _events = events.install();
    let rt = runtime().await;
    let t = rt.throttle();
    let seen = t
        .call("seen", ms(100), || async {
            sleep(ms(50)).await;
            Err::<(), _>(Oops("seen"))
        })
        .await;
    assert!(matches!(seen, Err(Error::Failed { .. })), "{seen:?}");
    assert_eq!(rt.stats().throttle.unobserved_failures, 0);
    assert!(events.at(tracing::Level::WARN).is_empty());

    // This caller gives up after 10 ms; the run fails at 50 ms and panics
    // at 60 ms, in processes of their own.
    let left = tokio::time::timeout(
        ms(10),
        t.call("left", ms(100), || async {
            sleep(ms(50)).await;
            Err::<(), _>(Oops("unseen"))
        }),
    )
    .await;
    assert!(left.is_err(), "the caller left");
    let panicked = tokio::time::timeout(
        ms(10),
        t.call("panicked", ms(100), || async {
            sleep(ms(50)).await;
            panic!("unseen");
            #[allow(unreachable_code)]
            Ok::<(), Oops>(())
        }),
    )
    .await;
    assert!(panicked.is_err(), "the caller left");
    assert_eq!(rt.stats().processes, 2, "the runs go on");
    assert_eq!(rt.stats().throttle.unobserved_failures, 0);
    sleep(ms(50)).await;
    settle().await;
    assert_eq!(rt.stats().processes, 0);
    assert_eq!(rt.stats().throttle.unobserved_failures, 2);
    assert_eq!(
        events.at(tracing::Level::WARN),
        ["throttled function failed after its caller left"; 2]
    );
}
