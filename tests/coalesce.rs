//! Behaviour of the leading + trailing (coalescing) throttle: scenarios W1–W11
//! on paused tokio time, the window store contract (S1) and store failures.

use std::future::Future;
use std::pin::Pin;
use std::sync::atomic::{AtomicBool, AtomicUsize, Ordering};
use std::sync::{Arc, Mutex};
use std::time::Duration;

use throttlebeam::{
    Coalesce, Error, Runtime, coalesce::MemoryWindowStore, coalesce::Phase, coalesce::WindowClaim,
    coalesce::WindowEntry, coalesce::WindowStore, coalesce::WindowStoreFuture,
    runtime::ShutdownPolicy,
};
use tokio::task::JoinHandle;
use tokio::time::{Instant, sleep, sleep_until};
use tracing::Level;
use tracing_subscriber::layer::{Context, SubscriberExt};

// ---------------------------------------------------------------- helpers

fn ms(n: u64) -> Duration {
    Duration::from_millis(n)
}

async fn runtime() -> Runtime {
    Runtime::builder().start().await.expect("runtime starts")
}

async fn throttle<T: Clone + Send + Sync + 'static>(runtime: &Runtime, window: u64) -> Coalesce<T> {
    runtime
        .coalesce("sync:")
        .with_window(ms(window))
        .build()
        .expect("valid throttle")
}

/// Lets spawned tasks run without moving paused time.
async fn settle() {
    for _ in 0..20 {
        tokio::task::yield_now().await;
    }
}

#[derive(Debug, Clone, PartialEq, Eq)]
struct Oops(&'static str);

impl std::fmt::Display for Oops {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(f, "oops: {}", self.0)
    }
}

impl std::error::Error for Oops {}

/// One run of a function: which closure, which phase, when (ms since t0).
#[derive(Debug, Clone, PartialEq, Eq)]
struct Ran {
    tag: &'static str,
    phase: Phase,
    start: u64,
    end: Option<u64>,
}

/// Records every run against the test's start instant.
#[derive(Clone)]
struct Log {
    t0: Instant,
    runs: Arc<Mutex<Vec<Ran>>>,
    running: Arc<AtomicUsize>,
    max_running: Arc<AtomicUsize>,
}

type Fut<T> = Pin<Box<dyn Future<Output = Result<T, Oops>> + Send>>;

impl Log {
    fn new() -> Self {
        Self {
            t0: Instant::now(),
            runs: Arc::default(),
            running: Arc::default(),
            max_running: Arc::default(),
        }
    }

    fn now(&self) -> u64 {
        u64::try_from(self.t0.elapsed().as_millis()).unwrap()
    }

    /// Asserts that exactly `n` ms of paused time passed since t0.
    fn at(&self, n: u64) {
        assert_eq!(self.t0.elapsed(), ms(n), "expected to be at t={n}");
    }

    async fn until(&self, n: u64) {
        sleep_until(self.t0 + ms(n)).await;
    }

    fn runs(&self) -> Vec<Ran> {
        self.runs.lock().unwrap().clone()
    }

    /// A function tagged `tag` that takes `took` ms and returns `Ok(tag)`.
    fn work(
        &self,
        tag: &'static str,
        took: u64,
    ) -> impl FnOnce(Phase) -> Fut<&'static str> + 'static {
        self.work_with(tag, took, Ok(tag))
    }

    /// A function that takes `took` ms and returns `Err(Oops(tag))`.
    fn fail(
        &self,
        tag: &'static str,
        took: u64,
    ) -> impl FnOnce(Phase) -> Fut<&'static str> + 'static {
        self.work_with(tag, took, Err(Oops(tag)))
    }

    fn work_with(
        &self,
        tag: &'static str,
        took: u64,
        out: Result<&'static str, Oops>,
    ) -> impl FnOnce(Phase) -> Fut<&'static str> + 'static {
        let log = self.clone();
        move |phase| {
            Box::pin(async move {
                let index = {
                    let mut runs = log.runs.lock().unwrap();
                    runs.push(Ran {
                        tag,
                        phase,
                        start: log.now(),
                        end: None,
                    });
                    runs.len() - 1
                };
                let now = log.running.fetch_add(1, Ordering::SeqCst) + 1;
                log.max_running.fetch_max(now, Ordering::SeqCst);
                sleep(ms(took)).await;
                log.running.fetch_sub(1, Ordering::SeqCst);
                log.runs.lock().unwrap()[index].end = Some(log.now());
                out
            })
        }
    }
}

/// Spawns `call` (plain form) and returns its outcome with the instant it resolved.
fn spawn_call(
    t: &Coalesce<&'static str>,
    key: &'static str,
    f: impl FnOnce(Phase) -> Fut<&'static str> + Send + 'static,
) -> JoinHandle<(Result<bool, Error>, Instant)> {
    let t = t.clone();
    tokio::spawn(async move {
        let out = t.call(key, f).await;
        (out, Instant::now())
    })
}

/// Spawns `call_and_wait` and returns its outcome with the instant it resolved.
fn spawn_wait(
    t: &Coalesce<&'static str>,
    key: &'static str,
    f: impl FnOnce(Phase) -> Fut<&'static str> + Send + 'static,
) -> JoinHandle<(Result<&'static str, Error>, Instant)> {
    let t = t.clone();
    tokio::spawn(async move {
        let out = t.call_and_wait(key, f).await;
        (out, Instant::now())
    })
}

/// The gauges of a throttle: (active, pending, keys, timers).
fn gauges<T: Clone + Send + Sync + 'static>(t: &Coalesce<T>) -> (usize, usize, usize, usize) {
    let s = t.stats();
    (s.active, s.pending, s.keys, s.timers)
}

const IDLE: (usize, usize, usize, usize) = (0, 0, 0, 0);

/// The gauges once the runtime swept windows that are over.
fn swept<T: Clone + Send + Sync + 'static>(
    rt: &Runtime,
    t: &Coalesce<T>,
) -> (usize, usize, usize, usize) {
    rt.sweep_now();
    gauges(t)
}

/// Captures tracing events: level, target and message.
#[derive(Clone, Default)]
struct Captured(Arc<Mutex<Vec<(Level, String, String)>>>);

struct Message(String);

impl tracing::field::Visit for Message {
    fn record_debug(&mut self, field: &tracing::field::Field, value: &dyn std::fmt::Debug) {
        if field.name() == "message" {
            self.0 = format!("{value:?}");
        }
    }
}

impl<S: tracing::Subscriber> tracing_subscriber::Layer<S> for Captured {
    fn on_event(&self, event: &tracing::Event<'_>, _ctx: Context<'_, S>) {
        let mut message = Message(String::new());
        event.record(&mut message);
        let meta = event.metadata();
        self.0
            .lock()
            .unwrap()
            .push((*meta.level(), meta.target().to_owned(), message.0));
    }
}

impl Captured {
    /// Installs the layer for this (current-thread) test.
    fn install(&self) -> tracing::subscriber::DefaultGuard {
        tracing::subscriber::set_default(tracing_subscriber::registry().with(self.clone()))
    }

    /// Events from this crate at `level`.
    fn ours(&self, level: Level) -> Vec<String> {
        self.0
            .lock()
            .unwrap()
            .iter()
            .filter(|(l, target, _)| *l == level && target.starts_with("throttlebeam"))
            .map(|(_, _, m)| m.clone())
            .collect()
    }
}

// ---------------------------------------------------------------- W1–W4

/// W1: the full timeline of the reference, with exact instants.
#[tokio::test(start_paused = true)]
async fn w1_full_timeline() {
    let rt = runtime().await;
    let t = throttle(&rt, 1000).await;
    let log = Log::new();

    // t=0: call #1 leads and resolves `true` when its run ends at 300.
    let c1 = spawn_call(&t, "room", log.work("f1", 300));
    settle().await;
    // Running: active. Without a store there is no lease to extend: no timer.
    assert_eq!(gauges(&t), (1, 0, 1, 0));

    // t=500 and t=900: coalesced, `false` at once; their waiters wait.
    log.until(500).await;
    let (first, at) = c1.await.unwrap();
    assert!(first.unwrap());
    assert_eq!(at, log.t0 + ms(300));
    assert!(!t.call("room", log.work("f2", 300)).await.unwrap());
    log.at(500);
    let w2 = spawn_wait(&t, "room", log.work("f2b", 300));
    log.until(900).await;
    assert!(!t.call("room", log.work("f3", 300)).await.unwrap());
    log.at(900);
    let w3 = spawn_wait(&t, "room", log.work("f3b", 300));
    settle().await;
    assert_eq!(gauges(&t), (0, 1, 1, 1));

    // One trailing run starts at 1300 (the latest closure) and ends at 1600.
    let (v2, at2) = w2.await.unwrap();
    let (v3, at3) = w3.await.unwrap();
    assert_eq!((v2.unwrap(), at2), ("f3b", log.t0 + ms(1600)));
    assert_eq!((v3.unwrap(), at3), ("f3b", log.t0 + ms(1600)));

    // The window [1600, 2600) has nothing pending: a timestamp in the
    // key's slot, with no process and no timer.
    settle().await;
    assert_eq!(gauges(&t), (0, 0, 1, 0));
    assert_eq!(rt.stats().processes, 0);
    log.until(2599).await;
    assert_eq!(swept(&rt, &t), (0, 0, 1, 0), "the window is still open");
    // It passes with no calls: the key closes at 2600 (forgotten by the sweep).
    log.until(2600).await;
    assert_eq!(swept(&rt, &t), IDLE);
    assert_eq!(rt.stats().keys, 0);

    // Call #4 at 3000 leads again and completes at 3300.
    log.until(3000).await;
    let v4 = t.call_and_wait("room", log.work("f4", 300)).await.unwrap();
    assert_eq!(v4, "f4");
    log.at(3300);

    let runs = log.runs();
    let expect = |tag, phase, start, end| Ran {
        tag,
        phase,
        start,
        end: Some(end),
    };
    assert_eq!(
        runs,
        vec![
            expect("f1", Phase::Leading, 0, 300),
            expect("f3b", Phase::Trailing, 1300, 1600),
            expect("f4", Phase::Leading, 3000, 3300),
        ]
    );
}

/// W2: the trailing run uses the latest function; every waiter gets its value.
#[tokio::test(start_paused = true)]
async fn w2_latest_closure_wins() {
    let rt = runtime().await;
    let t = throttle(&rt, 200).await;
    let log = Log::new();
    assert!(t.call("k", log.work("lead", 10)).await.unwrap());
    let tags = ["a", "b", "c", "d", "e"];
    let waiters: Vec<_> = tags
        .iter()
        .map(|tag| spawn_wait(&t, "k", log.work(tag, 10)))
        .collect();
    for w in waiters {
        assert_eq!(w.await.unwrap().0.unwrap(), "e");
    }
    let ran: Vec<_> = log.runs().iter().map(|r| r.tag).collect();
    assert_eq!(ran, ["lead", "e"]);
}

/// W2 with functions of different types: each replaced function is dropped
/// once (of the same type it is overwritten in place, of another type its
/// box is swapped), and the trailing run calls the latest one.
#[tokio::test(start_paused = true)]
async fn w2_latest_function_wins_whatever_its_type_and_each_replaced_one_is_dropped_once() {
    struct Dropped(Arc<AtomicUsize>);
    impl Drop for Dropped {
        fn drop(&mut self) {
            self.0.fetch_add(1, Ordering::SeqCst);
        }
    }
    let rt = runtime().await;
    let t = throttle::<u32>(&rt, 200).await;
    assert!(
        t.call("k", |_| async { Ok::<_, std::io::Error>(0) })
            .await
            .unwrap()
    );
    let drops = Arc::new(AtomicUsize::new(0));
    // Two call sites, two closure types; the second captures a String.
    for i in 1..=6u32 {
        let guard = Dropped(drops.clone());
        let coalesced = if i % 3 == 0 {
            let tag = format!("{i}");
            t.call("k", move |_| async move {
                let _guard = guard;
                Ok::<_, std::io::Error>(tag.parse::<u32>().unwrap_or(0) * 10)
            })
            .await
        } else {
            t.call("k", move |_| async move {
                let _guard = guard;
                Ok::<_, std::io::Error>(i)
            })
            .await
        };
        assert!(!coalesced.unwrap());
    }
    // Five replaced, dropped at once; the latest (i = 6, the second type)
    // is held for the trailing run.
    assert_eq!(drops.load(Ordering::SeqCst), 5);
    let value = t
        .call_and_wait("k", |_| async { Ok::<_, std::io::Error>(99) })
        .await
        .unwrap();
    assert_eq!(value, 99, "the latest function runs");
    assert_eq!(drops.load(Ordering::SeqCst), 6);
    let s = t.stats();
    assert_eq!((s.leading_runs, s.trailing_runs, s.coalesced), (1, 1, 7));
}

/// W3: a call that arrives while a function runs is covered by the next
/// trailing run, never by the one already running.
#[tokio::test(start_paused = true)]
async fn w3_call_during_a_run_is_covered_by_the_next_run() {
    let rt = runtime().await;
    let t = throttle(&rt, 1000).await;
    let log = Log::new();
    let lead = spawn_wait(&t, "k", log.work("lead", 300));
    log.until(100).await; // the leading function is executing
    let during_lead = spawn_wait(&t, "k", log.work("t1", 300));
    log.until(1400).await; // the first trailing run is executing (1300..1600)
    assert_eq!(t.stats().active, 1);
    let during_trailing = spawn_wait(&t, "k", log.work("t2", 300));

    let (v, at) = lead.await.unwrap();
    assert_eq!((v.unwrap(), at), ("lead", log.t0 + ms(300)));
    let (v, at) = during_lead.await.unwrap();
    assert_eq!((v.unwrap(), at), ("t1", log.t0 + ms(1600)));
    let (v, at) = during_trailing.await.unwrap();
    assert_eq!((v.unwrap(), at), ("t2", log.t0 + ms(2900)));
    let starts: Vec<_> = log
        .runs()
        .iter()
        .map(|r| (r.tag, r.phase, r.start))
        .collect();
    assert_eq!(
        starts,
        [
            ("lead", Phase::Leading, 0),
            ("t1", Phase::Trailing, 1300),
            ("t2", Phase::Trailing, 2600)
        ]
    );
}

/// W3 (issue 7 item 4): a run covers every call that arrived before it
/// started executing its function, including calls that land while the
/// leading run is still claiming its window in the store: one run, and the
/// early callers get its value (the latest function, as for any run).
#[tokio::test(start_paused = true)]
async fn w3_calls_while_the_leading_run_claims_its_window_are_covered_by_it() {
    let rt = runtime().await;
    let t: Coalesce<&'static str> = rt
        .coalesce("slow:")
        .with_window(ms(1000))
        .with_store(scripted(|op| match op {
            "claim" => Act::Delay(ms(50)),
            _ => Act::Pass,
        }))
        .build()
        .unwrap();
    let log = Log::new();
    let lead = spawn_wait(&t, "k", log.work("lead", 300));
    log.until(10).await;
    assert_eq!(
        gauges(&t),
        (1, 0, 1, 0),
        "claiming: active, nothing pending"
    );
    // A burst while the claim is in flight.
    assert!(!t.call("k", log.work("plain", 300)).await.unwrap());
    let early: Vec<_> = (0..100)
        .map(|_| spawn_wait(&t, "k", log.work("early", 300)))
        .collect();
    settle().await;
    assert_eq!(
        gauges(&t).1,
        0,
        "covered by the leading run: no trailing run pending"
    );

    let (v, at) = lead.await.unwrap();
    assert_eq!((v.unwrap(), at), ("early", log.t0 + ms(350)));
    for w in early {
        let (v, at) = w.await.unwrap();
        assert_eq!((v.unwrap(), at), ("early", log.t0 + ms(350)));
    }
    log.until(5000).await;
    let runs: Vec<_> = log
        .runs()
        .iter()
        .map(|r| (r.tag, r.phase, r.start))
        .collect();
    assert_eq!(runs, [("early", Phase::Leading, 50)], "one run, not two");
    let s = t.stats();
    assert_eq!(
        (s.calls, s.leading_runs, s.trailing_runs, s.coalesced),
        (102, 1, 0, 101)
    );
}

/// Issue 7 item 9: a key whose window is open with nothing pending is a
/// timestamp in its slot, with no process and no timer; a call on it starts
/// a process only to wait for the window's end and run the trailing run; a
/// call once the window is over leads at once, before any sweep.
#[tokio::test(start_paused = true)]
async fn an_open_window_with_nothing_pending_costs_no_process() {
    let rt = runtime().await;
    let t = throttle(&rt, 1000).await;
    let log = Log::new();
    assert!(t.call("k", log.work("lead", 100)).await.unwrap());
    settle().await;
    assert_eq!(gauges(&t), (0, 0, 1, 0));
    assert_eq!((rt.stats().processes, rt.stats().keys), (0, 1));

    // A call inside the window: a process starts, with one timer until the
    // window ends at 1100.
    log.until(400).await;
    let w = spawn_wait(&t, "k", log.work("trail", 100));
    settle().await;
    assert_eq!(gauges(&t), (0, 1, 1, 1));
    assert_eq!(rt.stats().processes, 1);
    let (v, at) = w.await.unwrap();
    assert_eq!((v.unwrap(), at), ("trail", log.t0 + ms(1200)));
    settle().await;
    assert_eq!(gauges(&t), (0, 0, 1, 0));
    assert_eq!(rt.stats().processes, 0);

    // The window [1200, 2200) is over: the key counts no more, here or in the
    // runtime's keys (W9), and the next call leads at once, though the slot
    // has not been swept.
    log.until(2200).await;
    assert_eq!(gauges(&t), IDLE);
    assert_eq!(rt.stats().keys, 0, "over, though not swept yet");
    assert!(rt.stats().sweeping, "not swept yet");
    assert_eq!(
        t.call_and_wait("k", log.work("again", 100)).await.unwrap(),
        "again"
    );
    log.at(2300);
    let runs: Vec<_> = log
        .runs()
        .iter()
        .map(|r| (r.tag, r.phase, r.start))
        .collect();
    assert_eq!(
        runs,
        [
            ("lead", Phase::Leading, 0),
            ("trail", Phase::Trailing, 1100),
            ("again", Phase::Leading, 2200)
        ]
    );
}

/// Pending trailing runs wait for their windows in the throttle's one
/// sleeper: no process per waiting key; each runs when its window ends.
#[tokio::test(start_paused = true)]
async fn pending_trailing_runs_wait_without_a_process_each() {
    let rt = runtime().await;
    let t = throttle(&rt, 1000).await;
    let log = Log::new();
    let keys: Vec<&'static str> = (0..100)
        .map(|i| &*Box::leak(format!("k{i}").into_boxed_str()))
        .collect();
    for key in &keys {
        assert!(t.call(key, log.work("lead", 10)).await.unwrap());
    }
    log.at(1000);
    let waits: Vec<_> = keys
        .iter()
        .map(|key| spawn_wait(&t, key, log.work("trail", 10)))
        .collect();
    settle().await;
    // One timer per waiting key, held by one sleeper process, and counted
    // in the runtime's timers too (the sweeper's tick is not one of them).
    assert_eq!(gauges(&t), (0, 100, 100, 100));
    assert_eq!(rt.stats().processes, 1);
    assert_eq!(rt.stats().timers, 100);
    for w in waits {
        let (v, _) = w.await.unwrap();
        assert_eq!(v.unwrap(), "trail");
    }
    settle().await;
    assert_eq!(gauges(&t), (0, 0, 100, 0));
    assert_eq!(rt.stats().processes, 0);
    // Each trailing run started when its own window ended (10 ms after its
    // leading run began, plus the window).
    let runs = log.runs();
    for (lead, trail) in runs[..100].iter().zip(&runs[100..]) {
        assert_eq!(trail.start, lead.end.unwrap() + 1000, "{lead:?} {trail:?}");
    }
}

/// Callers on several worker threads schedule into per-thread sleepers:
/// every trailing run still runs once, each waiter gets its own key's value,
/// and the throttle ends idle with nothing counted.
#[test]
fn trailing_runs_scheduled_from_many_threads_all_run_once() {
    let tokio_rt = tokio::runtime::Builder::new_multi_thread()
        .worker_threads(4)
        .enable_all()
        .build()
        .unwrap();
    tokio_rt.block_on(async {
        let rt = runtime().await;
        let t = throttle::<u64>(&rt, 20).await;
        let ran = Arc::new(AtomicUsize::new(0));
        let tasks: Vec<_> = (0..8u64)
            .map(|task| {
                let (t, ran) = (t.clone(), ran.clone());
                tokio::spawn(async move {
                    let mut waits = Vec::new();
                    for i in 0..50u64 {
                        let key = format!("m{task}:{i}");
                        let n = task * 1000 + i;
                        assert!(
                            t.call(&key, move |_| async move { Ok::<_, std::io::Error>(0) })
                                .await
                                .unwrap()
                        );
                        let (t, ran) = (t.clone(), ran.clone());
                        waits.push(tokio::spawn(async move {
                            let v = t
                                .call_and_wait(&key, move |_| async move {
                                    ran.fetch_add(1, Ordering::SeqCst);
                                    Ok::<_, std::io::Error>(n)
                                })
                                .await
                                .unwrap();
                            assert_eq!(v, n);
                        }));
                    }
                    for w in waits {
                        w.await.unwrap();
                    }
                })
            })
            .collect();
        for task in tasks {
            task.await.unwrap();
        }
        assert_eq!(ran.load(Ordering::SeqCst), 400);
        let s = t.stats();
        assert_eq!(
            (
                s.leading_runs,
                s.trailing_runs,
                s.pending,
                s.active,
                s.timers
            ),
            (400, 400, 0, 0, 0)
        );
        t.shutdown(Duration::from_secs(1)).await;
        assert_eq!(rt.stats().processes, 0);
    });
}

/// W4: every window starts when a run finishes, so runs never overlap, even
/// when functions take longer than the window.
#[tokio::test(start_paused = true)]
async fn w4_runs_never_overlap() {
    let rt = runtime().await;
    let t = throttle(&rt, 500).await;
    let log = Log::new();
    let mut handles = Vec::new();
    for i in 0..100u64 {
        log.until(i * 50).await;
        let took = if i % 3 == 0 { 700 } else { 120 };
        handles.push(spawn_call(&t, "k", log.work("f", took)));
    }
    for h in handles {
        h.await.unwrap().0.unwrap();
    }
    log.until(20_000).await;
    let runs = log.runs();
    assert!(runs.len() >= 5, "runs: {runs:?}");
    assert_eq!(log.max_running.load(Ordering::SeqCst), 1);
    for pair in runs.windows(2) {
        let gap = pair[1].start - pair[0].end.unwrap();
        assert!(
            gap >= 500,
            "run started {gap} ms after the previous one ended"
        );
    }
    assert_eq!(swept(&rt, &t), IDLE);
}

// ---------------------------------------------------------------- W5–W7

/// W5: 10,000 calls on one key in one tick: exactly two runs; every
/// coalesced plain call returns false; every waiter gets the trailing value.
#[tokio::test(start_paused = true)]
async fn w5_ten_thousand_calls_in_one_tick() {
    let rt = runtime().await;
    let t = throttle(&rt, 1000).await;
    let log = Log::new();
    let lead = spawn_wait(&t, "hot", log.work("lead", 100));
    settle().await;
    let mut waiters = Vec::new();
    for i in 0..9_999 {
        if i % 2 == 0 {
            assert!(!t.call("hot", log.work("plain", 100)).await.unwrap());
        } else {
            waiters.push(spawn_wait(&t, "hot", log.work("last", 100)));
        }
    }
    log.at(0);
    // The lead runs (no store: no lease timer) and one call is pending.
    assert_eq!(gauges(&t), (1, 1, 1, 0));
    assert_eq!(lead.await.unwrap().0.unwrap(), "lead");
    assert_eq!(waiters.len(), 4_999);
    for w in waiters {
        let (v, at) = w.await.unwrap();
        assert_eq!(v.unwrap(), "last");
        assert_eq!(at, log.t0 + ms(1200));
    }
    let phases: Vec<_> = log.runs().iter().map(|r| (r.tag, r.phase)).collect();
    assert_eq!(
        phases,
        [("lead", Phase::Leading), ("last", Phase::Trailing)]
    );
}

/// W6: 10,000 distinct keys, one call each: each runs once; afterwards no
/// keys, no timers, no processes.
#[tokio::test(start_paused = true)]
async fn w6_ten_thousand_keys() {
    let rt = runtime().await;
    let t: Coalesce<usize> = throttle(&rt, 1000).await;
    let runs = Arc::new(AtomicUsize::new(0));
    let mut handles = Vec::new();
    for i in 0..10_000usize {
        let t = t.clone();
        let runs = runs.clone();
        handles.push(tokio::spawn(async move {
            t.call_and_wait(&format!("key-{i}"), move |phase| async move {
                assert_eq!(phase, Phase::Leading);
                runs.fetch_add(1, Ordering::SeqCst);
                Ok::<_, Oops>(i)
            })
            .await
        }));
    }
    for (i, h) in handles.into_iter().enumerate() {
        assert_eq!(h.await.unwrap().unwrap(), i);
    }
    assert_eq!(runs.load(Ordering::SeqCst), 10_000);
    settle().await;
    // Open windows with nothing pending: timestamps, no process, no timer.
    assert_eq!(gauges(&t), (0, 0, 10_000, 0));
    assert_eq!(rt.stats().processes, 0);
    // Every window ends at 1000; the runtime's sweep forgets them, then
    // its own timer stops.
    sleep(ms(1000)).await;
    assert_eq!(runs.load(Ordering::SeqCst), 10_000);
    assert_eq!(swept(&rt, &t), IDLE);
    sleep(ms(60_000)).await;
    let s = rt.stats();
    assert_eq!((s.keys, s.timers, s.processes), (0, 0, 0));
}

/// W7: a wait with a timeout fails with a timeout error naming the key and
/// the duration; the run is not cancelled.
#[tokio::test(start_paused = true)]
async fn w7_timeout_does_not_cancel_the_run() {
    let rt = runtime().await;
    let t = throttle(&rt, 1000).await;
    let log = Log::new();
    let err = t
        .call_and_wait_timeout("slow", ms(30), log.work("lead", 100))
        .await
        .unwrap_err();
    log.at(30);
    assert!(
        matches!(&err, Error::Timeout { key, after } if key == "slow" && *after == ms(30)),
        "{err:?}"
    );
    let message = err.to_string();
    assert!(
        message.contains("slow") && message.contains("30ms"),
        "{message}"
    );
    assert_eq!(t.stats().active, 1, "the run goes on");

    // A coalesced waiter times out too; its trailing run still happens.
    let err = t
        .call_and_wait_timeout("slow", ms(50), log.work("trail", 100))
        .await
        .unwrap_err();
    assert!(matches!(err, Error::Timeout { .. }));
    log.at(80);
    log.until(1300).await;
    let runs = log.runs();
    assert_eq!(runs.len(), 2);
    assert_eq!((runs[0].tag, runs[0].end), ("lead", Some(100)));
    assert_eq!(
        (runs[1].tag, runs[1].phase, runs[1].start),
        ("trail", Phase::Trailing, 1100)
    );
    assert_eq!(runs[1].end, Some(1200));
}

// ---------------------------------------------------------------- W8, panics, W11

/// W8: a failing leading run fails its own caller and is not logged at error.
#[tokio::test(start_paused = true)]
async fn w8_failing_leading_run_fails_its_caller() {
    let captured = Captured::default();
    let _guard = captured.install();
    let rt = runtime().await;
    let t = throttle(&rt, 100).await;
    let log = Log::new();
    let err = t.call("k", log.fail("boom", 10)).await.unwrap_err();
    match &err {
        Error::Failed { key, source } => {
            assert_eq!(key, "k");
            assert_eq!(source.to_string(), "oops: boom");
        }
        other => panic!("unexpected {other:?}"),
    }
    assert!(std::error::Error::source(&err).is_some());
    // The window still opens after a failed run.
    assert!(!t.call("k", log.work("next", 10)).await.unwrap());
    sleep(ms(500)).await;
    assert_eq!(log.runs().len(), 2);
    assert!(captured.ours(Level::ERROR).is_empty());
}

/// W8: a failing trailing run fails every waiter it covered and emits
/// exactly one error event.
#[tokio::test(start_paused = true)]
async fn w8_failing_trailing_run_fails_every_waiter_and_logs_once() {
    let captured = Captured::default();
    let _guard = captured.install();
    let rt = runtime().await;
    let t = throttle(&rt, 100).await;
    let log = Log::new();
    assert!(t.call("k", log.work("lead", 10)).await.unwrap());
    let waiters: Vec<_> = (0..5)
        .map(|_| spawn_wait(&t, "k", log.fail("bad", 10)))
        .collect();
    assert!(!t.call("k", log.fail("bad", 10)).await.unwrap());
    for w in waiters {
        let err = w.await.unwrap().0.unwrap_err();
        assert!(
            matches!(&err, Error::Failed { key, .. } if key == "k"),
            "{err:?}"
        );
    }
    assert_eq!(captured.ours(Level::ERROR), ["trailing run failed"]);
    // The key recovers: after the window a call leads again.
    sleep(ms(200)).await;
    assert_eq!(
        t.call_and_wait("k", log.work("again", 10)).await.unwrap(),
        "again"
    );
    assert_eq!(log.runs().last().unwrap().phase, Phase::Leading);
    assert_eq!(captured.ours(Level::ERROR).len(), 1);
}

/// Issue 30 item 14: a failure nobody hears is counted: a leading run whose
/// caller dropped its future (logged at warn; with a store or without), a
/// trailing run no caller waits for (logged at error, as every failed
/// trailing run). A failure someone hears is not.
#[tokio::test(start_paused = true)]
async fn failures_nobody_hears_are_logged_and_counted() {
    let captured = Captured::default();
    let _guard = captured.install();
    let rt = runtime().await;
    let plain = throttle(&rt, 100).await;
    let stored: Coalesce<&'static str> = rt
        .coalesce("stored:")
        .with_window(ms(100))
        .with_store(MemoryWindowStore::new())
        .build()
        .unwrap();
    let log = Log::new();
    let unheard = || rt.stats().coalesce.unobserved_failures;

    // Heard: a leading caller and a trailing waiter get their errors.
    assert!(plain.call("heard", log.fail("lead", 10)).await.is_err());
    let waiter = spawn_wait(&plain, "heard", log.fail("trail", 10));
    assert!(waiter.await.unwrap().0.is_err());
    assert_eq!(unheard(), 0);
    assert!(captured.ours(Level::WARN).is_empty());

    // Leading runs whose callers left after 5 ms, failing at 10 ms.
    for t in [&plain, &stored] {
        let left = tokio::time::timeout(ms(5), t.call("left", log.fail("lead", 10))).await;
        assert!(left.is_err(), "the caller left");
    }
    sleep(ms(10)).await;
    settle().await;
    assert_eq!(unheard(), 2);
    assert_eq!(
        captured.ours(Level::WARN),
        ["leading run failed after its caller left"; 2]
    );

    // A trailing run with nobody waiting: one error event, counted.
    let errors = captured.ours(Level::ERROR).len();
    assert!(!plain.call("left", log.fail("trail", 10)).await.unwrap());
    sleep(ms(200)).await;
    settle().await;
    assert_eq!(unheard(), 3);
    assert_eq!(captured.ours(Level::ERROR).len(), errors + 1);
    assert_eq!(
        plain.stats().unobserved_failures + stored.stats().unobserved_failures,
        3
    );
}

/// A panicking function: its waiters get an error, the runtime survives,
/// the key recovers after the window.
#[tokio::test(start_paused = true)]
async fn panicking_functions_fail_their_waiters_and_the_key_recovers() {
    let captured = Captured::default();
    let _guard = captured.install();
    let rt = runtime().await;
    let t: Coalesce<u32> = throttle(&rt, 100).await;
    let err = t
        .call("p", |_| async {
            panic!("lead went wrong") as Result<u32, Oops>
        })
        .await
        .unwrap_err();
    assert!(
        matches!(&err, Error::Panicked { key, message } if key == "p" && message == "lead went wrong"),
        "{err:?}"
    );
    let waiter = {
        let t = t.clone();
        tokio::spawn(async move {
            t.call_and_wait("p", |_| async {
                panic!("trail went wrong") as Result<u32, Oops>
            })
            .await
        })
    };
    let err = waiter.await.unwrap().unwrap_err();
    assert!(matches!(&err, Error::Panicked { message, .. } if message == "trail went wrong"));
    assert_eq!(captured.ours(Level::ERROR).len(), 1);
    sleep(ms(100)).await;
    settle().await;
    assert_eq!(swept(&rt, &t), IDLE);
    let value = t
        .call_and_wait("p", |phase| async move {
            assert_eq!(phase, Phase::Leading);
            Ok::<_, Oops>(7)
        })
        .await
        .unwrap();
    assert_eq!(value, 7);
    assert!(!rt.is_shut_down());
}

/// W11: nothing above debug level is emitted by a healthy timeline; debug
/// events are there for whoever asks.
#[tokio::test(start_paused = true)]
async fn w11_quiet_unless_asked() {
    let captured = Captured::default();
    let _guard = captured.install();
    let rt = runtime().await;
    let t = throttle(&rt, 100).await;
    let log = Log::new();
    assert!(t.call("k", log.work("a", 10)).await.unwrap());
    assert!(!t.call("k", log.work("b", 10)).await.unwrap());
    sleep(ms(500)).await;
    assert_eq!(log.runs().len(), 2);
    for level in [Level::ERROR, Level::WARN, Level::INFO] {
        assert!(captured.ours(level).is_empty(), "{level} events emitted");
    }
    let debug = captured.ours(Level::DEBUG);
    assert!(debug.iter().any(|m| m == "run started"), "{debug:?}");
    assert!(debug.iter().any(|m| m == "run finished"), "{debug:?}");
    assert!(!captured.ours(Level::TRACE).is_empty());
}

// ---------------------------------------------------------------- W9

/// W9: the four counters through a whole cycle, back to zero when idle.
#[tokio::test(start_paused = true)]
async fn w9_counters_return_to_zero() {
    let rt = runtime().await;
    let t = throttle(&rt, 1000).await;
    let log = Log::new();
    assert_eq!(swept(&rt, &t), IDLE);
    let lead = spawn_call(&t, "a", log.work("a", 300));
    let other = spawn_call(&t, "b", log.work("b", 300));
    settle().await;
    // Two runs in progress (no store: no lease, so no timer).
    assert_eq!(gauges(&t), (2, 0, 2, 0));
    assert!(!t.call("a", log.work("a2", 300)).await.unwrap());
    assert_eq!(gauges(&t), (2, 1, 2, 0));
    lead.await.unwrap().0.unwrap();
    other.await.unwrap().0.unwrap();
    settle().await;
    // Both in their windows: `a` has a pending call and one timer; `b` has
    // nothing pending, so no process and no timer.
    assert_eq!(gauges(&t), (0, 1, 2, 1));
    assert_eq!(rt.stats().processes, 1);
    log.until(1300).await;
    settle().await;
    // `a` runs its trailing run; `b`'s window is over (swept away).
    assert_eq!(swept(&rt, &t), (1, 0, 1, 0));
    log.until(2600).await;
    settle().await;
    assert_eq!(swept(&rt, &t), IDLE);
    sleep(ms(60_000)).await;
    let s = rt.stats();
    assert_eq!((s.keys, s.timers, s.processes), (0, 0, 0));
}

/// A long run holds its lease with one timer; the key counts as active.
#[tokio::test(start_paused = true)]
async fn a_long_run_extends_its_lease_in_the_store() {
    let rt = runtime().await;
    let store = MemoryWindowStore::new();
    let t: Coalesce<&'static str> = rt
        .coalesce("lease:")
        .with_window(ms(1000))
        .with_store(store.clone())
        .build()
        .unwrap();
    let log = Log::new();
    let run = spawn_call(&t, "k", log.work("long", 5000));
    // Claimed with a lease TTL of max(window, 2 × 500) = 1000 ms, extended
    // every 500 ms: the key stays taken all through the run.
    for at in (100..5000).step_by(400) {
        log.until(at).await;
        assert!(store.get("lease:k").is_some(), "lease lapsed at {at}");
        assert_eq!(t.stats().timers, 1);
    }
    assert!(run.await.unwrap().0.unwrap());
    // Then the window: written to end exactly when the in-memory one does.
    log.until(5999).await;
    assert!(store.get("lease:k").is_some());
    log.until(6000).await;
    assert!(store.get("lease:k").is_none());
}

/// Issue 30 item 12, issue 50, W6, W9: `keys` counts windows open now, the
/// throttle's and the runtime's alike. Once the last window is over both are
/// 0 at once, and no timer is left, without waiting for the runtime's sweep
/// (60 s); the sweep then forgets the slots, and the sweeper stops once
/// nothing is left.
#[tokio::test(start_paused = true)]
async fn keys_count_open_windows_and_the_sweeper_stops_once_nothing_is_left() {
    let rt = runtime().await;
    let t = throttle(&rt, 1000).await;
    let log = Log::new();
    let runtime_wide = || {
        let s = rt.stats();
        (s.keys, s.timers, s.sweeping)
    };
    // Runs [0, 100), [100, 200), [200, 300): windows end at 1100, 1200, 1300.
    for key in ["a", "b", "c"] {
        assert!(t.call(key, log.work(key, 100)).await.unwrap());
    }
    assert_eq!(gauges(&t), (0, 0, 3, 0));
    settle().await;
    assert_eq!(runtime_wide(), (3, 0, true));
    log.until(1099).await;
    assert_eq!((t.stats().keys, runtime_wide()), (3, (3, 0, true)));
    log.until(1100).await;
    assert_eq!(t.stats().keys, 2, "a's window is over");
    assert_eq!(runtime_wide(), (2, 0, true), "a's window is over");
    log.until(1299).await;
    assert_eq!((t.stats().keys, runtime_wide()), (1, (1, 0, true)));
    log.until(1300).await;
    assert_eq!(gauges(&t), IDLE);
    assert_eq!(rt.stats().coalesce.keys, 0);
    // Held until the sweep, which is armed meanwhile, but counted nowhere.
    assert_eq!(runtime_wide(), (0, 0, true));
    sleep(ms(60_000)).await;
    settle().await;
    assert_eq!(runtime_wide(), (0, 0, false), "swept; the sweeper stopped");
    // Nothing wakes it again until a key comes back.
    sleep(ms(600_000)).await;
    assert!(!rt.stats().sweeping);
    assert!(t.call("a", log.work("a", 100)).await.unwrap());
    settle().await;
    assert_eq!((t.stats().keys, runtime_wide()), (1, (1, 0, true)));
}

// ---------------------------------------------------------------- W10

/// W10: destroy while a function runs: it is not cancelled and its caller
/// gets the value; pending calls fail as destroyed naming the key; later
/// calls fail at once; destroying twice is harmless.
#[tokio::test(start_paused = true)]
async fn w10_destroy_during_a_running_function() {
    let rt = runtime().await;
    let t = throttle(&rt, 1000).await;
    let log = Log::new();
    let lead = spawn_wait(&t, "k", log.work("lead", 300));
    log.until(100).await;
    let pending = spawn_wait(&t, "k", log.work("never", 300));
    settle().await;
    assert_eq!(t.stats().pending, 1);

    t.destroy().await;
    assert!(t.is_destroyed());
    let (err, at) = pending.await.unwrap();
    let err = err.unwrap_err();
    assert!(
        matches!(&err, Error::Discarded { key, reason } if key == "k" && *reason == "destroyed"),
        "{err:?}"
    );
    assert_eq!(at, log.t0 + ms(100));
    assert!(err.to_string().contains("\"k\""));

    let later = t.call("k", log.work("later", 1)).await.unwrap_err();
    assert!(matches!(later, Error::ShutDown { ref key } if key == "k"));
    let later = t.call("fresh", log.work("later", 1)).await.unwrap_err();
    assert!(matches!(later, Error::ShutDown { .. }));
    log.at(100);
    t.destroy().await;

    let (v, at) = lead.await.unwrap();
    assert_eq!((v.unwrap(), at), ("lead", log.t0 + ms(300)));
    settle().await;
    assert_eq!(swept(&rt, &t), IDLE);
    assert_eq!(rt.stats().processes, 0);
    assert_eq!(log.runs().len(), 1);
}

/// W10: destroy while a trailing run is pending: it never runs, its waiters
/// fail at once, every timer goes.
#[tokio::test(start_paused = true)]
async fn w10_destroy_during_a_pending_trailing_run() {
    let rt = runtime().await;
    let t = throttle(&rt, 1000).await;
    let log = Log::new();
    assert!(t.call("k", log.work("lead", 10)).await.unwrap());
    let w = spawn_wait(&t, "k", log.work("never", 10));
    log.until(500).await;
    assert_eq!(gauges(&t), (0, 1, 1, 1));
    t.destroy().await;
    let (err, at) = w.await.unwrap();
    assert!(matches!(
        err,
        Err(Error::Discarded {
            reason: "destroyed",
            ..
        })
    ));
    assert_eq!(at, log.t0 + ms(500));
    settle().await;
    assert_eq!(swept(&rt, &t), IDLE);
    sleep(ms(60_000)).await;
    assert_eq!(rt.stats().timers, 0);
    assert_eq!(log.runs().len(), 1);
}

/// W10: a call still claiming its window when the throttle is destroyed has
/// not run: it fails as destroyed and its function never runs.
#[tokio::test(start_paused = true)]
async fn w10_destroy_while_claiming() {
    let rt = runtime().await;
    let t: Coalesce<&'static str> = rt
        .coalesce("slow:")
        .with_store(scripted(|_| Act::Delay(ms(50))))
        .build()
        .unwrap();
    let log = Log::new();
    let lead = spawn_call(&t, "k", log.work("never", 10));
    log.until(20).await;
    assert_eq!(t.stats().active, 1);
    t.destroy().await;
    let err = lead.await.unwrap().0.unwrap_err();
    assert!(
        matches!(
            err,
            Error::Discarded {
                reason: "destroyed",
                ..
            }
        ),
        "{err:?}"
    );
    settle().await;
    assert!(log.runs().is_empty());
    assert_eq!(swept(&rt, &t), IDLE);
}

/// W10: the throttle's own store is cleared; a store passed in is not.
#[tokio::test(start_paused = true)]
async fn w10_destroy_clears_only_an_owned_store() {
    let rt = runtime().await;
    let shared = MemoryWindowStore::new();
    let passed: Coalesce<u8> = rt
        .coalesce("passed:")
        .with_store(shared.clone())
        .build()
        .unwrap();
    passed
        .call("k", |_| async { Ok::<_, Oops>(1) })
        .await
        .unwrap();
    assert_eq!(shared.len(), 1);
    passed.destroy().await;
    assert_eq!(shared.len(), 1);
    assert!(shared.get("passed:k").is_some());

    // A store passed in is never cleared, whoever else holds it.
    let recorder = scripted(|_| Act::Pass);
    let cleared = recorder.cleared.clone();
    let kept: Coalesce<u8> = rt.coalesce("kept:").with_store(recorder).build().unwrap();
    kept.destroy().await;
    assert!(
        !cleared.load(Ordering::SeqCst),
        "a store passed in is never cleared"
    );

    // Without a store, windows live in the throttle's registry only (no
    // store call per run), and are gone with it.
    let owned: Coalesce<u8> = rt.coalesce("own:").build().unwrap();
    owned
        .call("k", |_| async { Ok::<_, Oops>(1) })
        .await
        .unwrap();
    let s = owned.stats();
    assert_eq!((s.store_keys, s.keys, s.leading_runs), (0, 1, 1));
    assert!(
        !owned
            .call("k", |_| async { Ok::<_, Oops>(2) })
            .await
            .unwrap(),
        "the window is held in the registry: the next call coalesces"
    );
    owned.destroy().await;
    assert_eq!(owned.stats().keys, 0);
}

/// W10, graceful: pending trailing runs still run when their windows end;
/// new calls fail; the shutdown returns once they are done.
#[tokio::test(start_paused = true)]
async fn w10_graceful_shutdown_runs_pending_trailing_runs() {
    let rt = runtime().await;
    let t = throttle(&rt, 1000).await;
    let log = Log::new();
    assert!(t.call("a", log.work("a", 100)).await.unwrap());
    assert!(t.call("b", log.work("b", 100)).await.unwrap());
    let w = spawn_wait(&t, "a", log.work("a-trail", 100));
    settle().await;
    log.at(200);
    t.shutdown(ms(5000)).await;
    // `a`'s window ended at 1100; its trailing run ended at 1200. `b` had
    // nothing pending, so it did not hold the shutdown up.
    log.at(1200);
    let (v, at) = w.await.unwrap();
    assert_eq!((v.unwrap(), at), ("a-trail", log.t0 + ms(1200)));
    assert!(matches!(
        t.call("a", log.work("x", 1)).await,
        Err(Error::ShutDown { .. })
    ));
    assert_eq!(swept(&rt, &t), IDLE);
    assert!(t.is_destroyed());
}

/// W10, graceful with a short deadline: what cannot run by then is discarded.
#[tokio::test(start_paused = true)]
async fn w10_graceful_shutdown_discards_at_the_deadline() {
    let rt = runtime().await;
    let t = throttle(&rt, 1000).await;
    let log = Log::new();
    assert!(t.call("a", log.work("a", 100)).await.unwrap());
    let w = spawn_wait(&t, "a", log.work("late", 100));
    settle().await;
    t.shutdown(ms(300)).await;
    log.at(400);
    let err = w.await.unwrap().0.unwrap_err();
    assert!(
        matches!(
            err,
            Error::Discarded {
                reason: "destroyed",
                ..
            }
        ),
        "{err:?}"
    );
    settle().await;
    assert_eq!(swept(&rt, &t), IDLE);
    assert_eq!(log.runs().len(), 1);
}

/// Runtime::shutdown drains every coalescing throttle (graceful under the
/// default flush policy).
#[tokio::test(start_paused = true)]
async fn runtime_shutdown_drains_the_throttle() {
    let rt = runtime().await;
    let t = throttle(&rt, 500).await;
    let log = Log::new();
    assert!(t.call("k", log.work("lead", 100)).await.unwrap());
    let w = spawn_wait(&t, "k", log.work("trail", 100));
    settle().await;
    let report = rt.shutdown(ms(10_000)).await;
    assert_eq!(report.still_running, 0);
    assert_eq!(w.await.unwrap().0.unwrap(), "trail");
    assert_eq!(log.runs().len(), 2);
    assert!(t.is_destroyed());
    assert!(matches!(
        t.call("k", log.work("x", 1)).await,
        Err(Error::ShutDown { .. })
    ));
}

/// Runtime::shutdown under the drop policy destroys the throttle: pending
/// trailing runs fail as destroyed, running functions still finish.
#[tokio::test(start_paused = true)]
async fn runtime_shutdown_with_the_drop_policy_destroys_the_throttle() {
    let rt = Runtime::builder()
        .with_shutdown_policy(ShutdownPolicy::Drop)
        .start()
        .await
        .unwrap();
    let t = throttle(&rt, 500).await;
    let log = Log::new();
    let lead = spawn_wait(&t, "k", log.work("lead", 100));
    settle().await;
    let w = spawn_wait(&t, "k", log.work("never", 100));
    settle().await;
    let report = rt.shutdown(ms(10_000)).await;
    assert_eq!(report.still_running, 0);
    log.at(100);
    assert_eq!(lead.await.unwrap().0.unwrap(), "lead");
    let err = w.await.unwrap().0.unwrap_err();
    assert!(
        matches!(
            err,
            Error::Discarded {
                reason: "destroyed",
                ..
            }
        ),
        "{err:?}"
    );
    assert_eq!(log.runs().len(), 1);
    assert!(t.is_destroyed());
}

// ---------------------------------------------------------------- S16, ended runtimes

/// A tokio runtime of its own, on real time: each test below ends one.
fn tokio_runtime(workers: usize) -> tokio::runtime::Runtime {
    if workers == 0 {
        tokio::runtime::Builder::new_current_thread()
    } else {
        let mut builder = tokio::runtime::Builder::new_multi_thread();
        builder.worker_threads(workers);
        builder
    }
    .enable_all()
    .build()
    .expect("a tokio runtime")
}

/// Waits (real time, bounded) until `done` holds.
async fn eventually(what: &str, done: impl Fn() -> bool) {
    let deadline = std::time::Instant::now() + Duration::from_secs(10);
    while !done() {
        assert!(
            std::time::Instant::now() < deadline,
            "timed out waiting: {what}"
        );
        sleep(ms(2)).await;
    }
}

/// Issue 30 item 3, S16: the sleeper that holds a pending trailing run lives
/// on the tokio runtime of the call that scheduled it. When that runtime
/// ends, the sleeper hands its wake-ups back: a caller already waiting on
/// another runtime drives the run, and the next call completes.
#[test]
fn a_sleeper_whose_runtime_ended_hands_its_wake_ups_back() {
    let home = tokio_runtime(1);
    let rt = home.block_on(runtime());
    let t: Coalesce<&'static str> = home.block_on(async { throttle(&rt, 200).await });

    // Runtime A: a leading run, then a call that leaves a trailing run
    // pending in the sleeper A's runtime started.
    let a = tokio_runtime(0);
    a.block_on(async {
        assert!(
            t.call("k", |_| async { Ok::<_, Oops>("lead") })
                .await
                .unwrap()
        );
        assert!(
            !t.call("k", |_| async { Ok::<_, Oops>("trail") })
                .await
                .unwrap()
        );
        settle().await;
        assert_eq!(t.stats().pending, 1);
    });
    // A caller on the home runtime waits for that trailing run.
    let waiter = {
        let t = t.clone();
        home.spawn(async move {
            t.call_and_wait("k", |_| async { Ok::<_, Oops>("waited") })
                .await
        })
    };
    home.block_on(eventually("the waiter is coalesced", || {
        t.stats().calls == 3
    }));
    // Runtime A ends with the wake-up still pending (the window is 200 ms).
    drop(a);
    let waited = home.block_on(async {
        tokio::time::timeout(Duration::from_secs(10), waiter)
            .await
            .expect("the waiter is not left hanging")
            .unwrap()
    });
    assert_eq!(waited.unwrap(), "waited");
    // The next call on the key completes too, and the key goes idle.
    let next = home.block_on(async {
        tokio::time::timeout(
            Duration::from_secs(10),
            t.call_and_wait("k", |_| async { Ok::<_, Oops>("next") }),
        )
        .await
        .expect("the next call completes")
    });
    assert_eq!(next.unwrap(), "next");
    home.block_on(eventually("the throttle goes idle", || {
        let s = t.stats();
        (s.active, s.pending, s.timers) == (0, 0, 0)
    }));
    assert_eq!(t.stats().trailing_runs, 2);
}

/// Issue 30 item 3, S16: with nobody waiting when the sleeper's runtime
/// ends, the next call from another runtime restarts the sleeper there and
/// the pending trailing run (and the call) completes.
#[test]
fn the_next_call_from_another_runtime_restarts_an_ended_sleeper() {
    let home = tokio_runtime(1);
    let rt = home.block_on(runtime());
    let t: Coalesce<&'static str> = home.block_on(async { throttle(&rt, 200).await });
    let ran = Arc::new(Mutex::new(Vec::new()));
    let a = tokio_runtime(0);
    a.block_on(async {
        assert!(
            t.call("k", |_| async { Ok::<_, Oops>("lead") })
                .await
                .unwrap()
        );
        let ran = ran.clone();
        assert!(
            !t.call("k", move |_| async move {
                ran.lock().unwrap().push("trail");
                Ok::<_, Oops>("trail")
            })
            .await
            .unwrap()
        );
    });
    drop(a);
    // Another key's call from the home runtime adopts the orphaned wake-up.
    let other = home.block_on(t.call("other", |_| async { Ok::<_, Oops>("other") }));
    assert!(other.unwrap());
    home.block_on(eventually("the trailing run ran", || {
        ran.lock().unwrap().len() == 1
    }));
    let next = home.block_on(async {
        tokio::time::timeout(
            Duration::from_secs(10),
            t.call_and_wait("k", |_| async { Ok::<_, Oops>("next") }),
        )
        .await
        .expect("the next call completes")
    });
    assert_eq!(next.unwrap(), "next");
}

// ---------------------------------------------------------------- bad input

#[tokio::test(start_paused = true)]
async fn bad_input_is_a_typed_error_and_schedules_nothing() {
    let rt = runtime().await;
    // One duration range for every setting: 1 ms ..= MAX_TIMER (2^36 - 1 ms);
    // errors name the prefix as a prefix.
    for window in [
        ms(0),
        Duration::from_micros(999),
        throttlebeam::clock::MAX_TIMER + ms(1),
        Duration::MAX,
    ] {
        let err = rt
            .coalesce("w:")
            .with_window(window)
            .build::<u8>()
            .unwrap_err();
        assert!(
            matches!(&err, Error::InvalidSetting { prefix, what: "window", .. } if prefix == "w:"),
            "{err:?}"
        );
        assert_eq!(
            err.to_string(),
            "invalid window for prefix \"w:\": must be between 1 ms and 2^36 - 1 ms"
        );
        let err = rt
            .coalesce("w:")
            .with_store_timeout(window)
            .build::<u8>()
            .unwrap_err();
        assert!(
            matches!(
                err,
                Error::InvalidSetting {
                    what: "store timeout",
                    ..
                }
            ),
            "{err:?}"
        );
    }
    // The old 2^31 - 1 ms limit is gone.
    for window in [ms(1), ms(1 << 31), throttlebeam::clock::MAX_TIMER] {
        let t = rt
            .coalesce("w:")
            .with_window(window)
            .with_store_timeout(window)
            .build::<u8>()
            .unwrap();
        assert_eq!((t.window(), t.store_timeout()), (window, window));
    }
    let err = rt.coalesce("").build::<u8>().unwrap_err();
    assert!(
        matches!(&err, Error::InvalidSetting { prefix, what: "prefix", .. } if prefix.is_empty()),
        "{err:?}"
    );
    assert_eq!(err.to_string(), "invalid prefix \"\": must not be empty");
    let long = "p".repeat(1025);
    let err = rt.coalesce(&long).build::<u8>().unwrap_err();
    assert_eq!(
        err.to_string(),
        format!(
            "invalid prefix {:?}: must be at most 1024 bytes",
            format!("{}…", &long[..64])
        )
    );
    assert!(rt.coalesce(&long[..1024]).build::<u8>().is_ok());

    let t: Coalesce<u8> = throttle(&rt, 100).await;
    let ran = Arc::new(AtomicBool::new(false));
    let job = |ran: &Arc<AtomicBool>| {
        let ran = ran.clone();
        move |_| async move {
            ran.store(true, Ordering::SeqCst);
            Ok::<_, Oops>(1)
        }
    };
    let err = t.call("", job(&ran)).await.unwrap_err();
    assert!(matches!(err, Error::InvalidKey { .. }));
    let err = t
        .call_and_wait(&"x".repeat(1025), job(&ran))
        .await
        .unwrap_err();
    assert!(matches!(err, Error::InvalidKey { .. }));
    let err = t
        .call_and_wait_timeout("k", Duration::ZERO, job(&ran))
        .await
        .unwrap_err();
    assert!(
        matches!(&err, Error::InvalidArgument { key, what: "timeout", .. } if key == "k"),
        "{err:?}"
    );
    let err = t
        .call_and_wait_timeout("k", Duration::MAX, job(&ran))
        .await
        .unwrap_err();
    assert!(matches!(
        err,
        Error::InvalidArgument {
            what: "timeout",
            ..
        }
    ));
    settle().await;
    assert!(!ran.load(Ordering::SeqCst));
    assert_eq!(swept(&rt, &t), IDLE);
}

#[tokio::test(start_paused = true)]
async fn defaults_and_names() {
    let rt = runtime().await;
    let t: Coalesce<u8> = rt.coalesce("sync:room:").build().unwrap();
    assert_eq!(t.window(), ms(1000));
    assert_eq!(t.prefix(), "sync:room:");
    assert_eq!(t.name(), "sync:room");
    let named: Coalesce<u8> = rt.coalesce("x:").with_name("rooms").build().unwrap();
    assert_eq!(named.name(), "rooms");
    assert!(format!("{named:?}").contains("rooms"));
}

#[tokio::test(start_paused = true)]
async fn the_runtime_key_cap_applies() {
    let rt = Runtime::builder().with_max_keys(2).start().await.unwrap();
    let t: Coalesce<u8> = throttle(&rt, 100).await;
    for key in ["a", "b"] {
        assert!(t.call(key, |_| async { Ok::<_, Oops>(1) }).await.unwrap());
    }
    // Coalescing into a tracked key needs no new slot.
    assert!(!t.call("a", |_| async { Ok::<_, Oops>(1) }).await.unwrap());
    let err = t
        .call("c", |_| async { Ok::<_, Oops>(1) })
        .await
        .unwrap_err();
    assert!(
        matches!(err, Error::TooManyKeys { ref key, cap: 2 } if key == "c"),
        "{err:?}"
    );
    sleep(ms(300)).await;
    assert!(t.call("c", |_| async { Ok::<_, Oops>(1) }).await.unwrap());
}

// ---------------------------------------------------------------- stores

/// S1/S2: the memory store contract: claim is set-if-absent answering the
/// holder; extend and record are compare-and-set on the owner's token; read
/// creates nothing; expiry on tokio's monotonic clock.
#[tokio::test(start_paused = true)]
async fn memory_store_contract() {
    let store = MemoryWindowStore::new();
    let (a, b) = (WindowEntry::new(1_000, 11), WindowEntry::new(2_000, 22));
    let ttl = ms(100);

    // read of a missing key creates nothing.
    assert_eq!(store.get("missing"), None);
    assert!(store.is_empty());

    // claim on a live key fails and answers its holder in the same step.
    assert_eq!(store.claim("k", a, ttl).await.unwrap(), WindowClaim::Won);
    assert_eq!(
        store.claim("k", b, ttl).await.unwrap(),
        WindowClaim::Lost { holder: Some(a) }
    );
    sleep(ms(99)).await;
    assert!(matches!(
        store.claim("k", b, ttl).await.unwrap(),
        WindowClaim::Lost { .. }
    ));
    sleep(ms(1)).await;
    assert_eq!(store.get("k"), None, "expired keys are never returned");
    assert_eq!(store.claim("k", b, ttl).await.unwrap(), WindowClaim::Won);

    // Only the holder's token extends or records; either resets the expiry.
    assert!(
        !store
            .extend("k", WindowEntry::new(9, 11), ttl)
            .await
            .unwrap()
    );
    assert!(
        !store
            .record("k", WindowEntry::new(9, 11), ttl)
            .await
            .unwrap()
    );
    assert_eq!(store.get("k"), Some(b));
    let b2 = WindowEntry::new(3_000, 22);
    assert!(store.record("k", b2, ms(500)).await.unwrap());
    sleep(ms(400)).await;
    assert_eq!(store.get("k"), Some(b2));
    // A free key may be recorded by anyone (a lapsed lease nobody took).
    assert!(store.record("free", a, ttl).await.unwrap());
}

/// S1: expired keys are swept by the runtime's sweeper through every
/// throttle using the store, and `Runtime::sweep_now` reaches the store.
#[tokio::test(start_paused = true)]
async fn the_runtime_sweeps_the_window_store() {
    let rt = Runtime::builder()
        .with_sweep_interval(ms(1000))
        .start()
        .await
        .unwrap();
    let store = MemoryWindowStore::new();
    let t: Coalesce<u8> = rt
        .coalesce("s:")
        .with_window(ms(100))
        .with_store(store.clone())
        .build()
        .unwrap();
    for key in ["a", "b", "c"] {
        assert!(t.call(key, |_| async { Ok::<_, Oops>(1) }).await.unwrap());
    }
    assert_eq!(
        (store.len(), t.stats().store_keys, t.stats().keys),
        (3, 3, 3)
    );
    // Written by hand, not through the throttle: swept all the same.
    store
        .record("s:other", WindowEntry::new(1, 1), ms(50))
        .await
        .unwrap();
    sleep(ms(200)).await;
    // Expired but not swept yet: still held (and counted).
    assert_eq!(store.len(), 4);
    assert_eq!(rt.sweep_now(), 0);
    assert_eq!((store.len(), t.stats().keys), (0, 0));
    // The periodic sweep does the same on its own.
    t.call("d", |_| async { Ok::<_, Oops>(1) }).await.unwrap();
    sleep(ms(1100)).await;
    settle().await;
    assert_eq!((store.len(), t.stats().keys, rt.stats().keys), (0, 0, 0));
}

/// A store that always fails: runs still happen (fail open) and in-memory
/// state keeps throttling; store errors are never logged above debug.
#[tokio::test(start_paused = true)]
async fn a_failing_store_never_stops_a_run() {
    let captured = Captured::default();
    let _guard = captured.install();
    let rt = runtime().await;
    let t: Coalesce<&'static str> = rt
        .coalesce("down:")
        .with_window(ms(1000))
        .with_store(scripted(|_| Act::Fail))
        .build()
        .unwrap();
    let log = Log::new();
    assert!(t.call("k", log.work("lead", 300)).await.unwrap());
    assert!(!t.call("k", log.work("skip", 300)).await.unwrap());
    let w = spawn_wait(&t, "k", log.work("trail", 300));
    let (v, at) = w.await.unwrap();
    assert_eq!((v.unwrap(), at), ("trail", log.t0 + ms(1600)));
    log.until(2600).await;
    settle().await;
    assert_eq!(swept(&rt, &t), IDLE);
    let runs: Vec<_> = log
        .runs()
        .iter()
        .map(|r| (r.tag, r.phase, r.start))
        .collect();
    assert_eq!(
        runs,
        [
            ("lead", Phase::Leading, 0),
            ("trail", Phase::Trailing, 1300)
        ]
    );
    assert!(captured.ours(Level::ERROR).is_empty());
    assert!(captured.ours(Level::WARN).is_empty());
    // Counted: claim and record of both runs failed.
    assert_eq!(t.stats().store_errors, 4);
    t.destroy().await; // clear is never called on a store passed in
}

/// Issue 7 item 10: a store whose calls never complete: every call is
/// bounded by the store timeout, the leading caller still completes (fail
/// open), and a shutdown returns by its deadline, ending store I/O then.
#[tokio::test(start_paused = true)]
async fn a_store_that_never_answers_is_timed_out_and_shutdown_keeps_its_deadline() {
    let rt = runtime().await;
    let t: Coalesce<&'static str> = rt
        .coalesce("hang:")
        .with_window(ms(1000))
        .with_store_timeout(ms(20))
        .with_store(scripted(|_| Act::Hang))
        .build()
        .unwrap();
    let log = Log::new();
    // Claim times out at 20; the run goes ahead (20..120).
    assert!(t.call("k", log.work("lead", 100)).await.unwrap());
    log.at(120);
    let w = spawn_wait(&t, "k", log.work("trail", 100));
    // Record times out at 140: the window is [140, 1140) in memory.
    let (v, at) = w.await.unwrap();
    // Trailing: claim 1140..1160 (timed out), run 1160..1260.
    assert_eq!((v.unwrap(), at), ("trail", log.t0 + ms(1260)));
    let s = t.stats();
    assert_eq!((s.store_timeouts, s.store_errors), (3, 0));
    let runs: Vec<_> = log.runs().iter().map(|r| r.start).collect();
    assert_eq!(runs, [20, 1160], "the window still holds in memory");

    // With the default timeout (1 s), a shutdown whose grace is shorter
    // still returns at its deadline, with nothing left running.
    let slow: Coalesce<&'static str> = rt
        .coalesce("hang2:")
        .with_store(scripted(|_| Act::Hang))
        .build()
        .unwrap();
    assert_eq!(
        slow.store_timeout(),
        throttlebeam::coalesce::DEFAULT_WINDOW_STORE_TIMEOUT
    );
    let lead = spawn_call(&slow, "k", log.work("never", 10));
    let waiting = spawn_wait(&slow, "k", log.work("never", 10));
    settle().await;
    let started = Instant::now();
    let report = rt.shutdown(ms(50)).await;
    assert_eq!(started.elapsed(), ms(50));
    assert_eq!(report.still_running, 0);
    for err in [lead.await.unwrap().0.err(), waiting.await.unwrap().0.err()] {
        assert!(
            matches!(
                err,
                Some(Error::Discarded {
                    reason: "destroyed",
                    ..
                })
            ),
            "{err:?}"
        );
    }
    assert_eq!(log.runs().len(), 2);
}

/// Issue 7 item 10: a store that panics is a store failure under the
/// fail-open policy: waiters get their values (never "the function
/// panicked"), and runs never come closer than the window.
#[tokio::test(start_paused = true)]
async fn a_store_that_panics_is_a_store_failure() {
    let captured = Captured::default();
    let _guard = captured.install();
    let rt = runtime().await;
    let t: Coalesce<&'static str> = rt
        .coalesce("bug:")
        .with_window(ms(500))
        .with_store(scripted(|_| Act::Panic))
        .build()
        .unwrap();
    let log = Log::new();
    let mut waits = Vec::new();
    for i in 0..40u64 {
        log.until(i * 50).await;
        waits.push(spawn_wait(&t, "k", log.work("f", 100)));
    }
    for w in waits {
        let (v, _) = w.await.unwrap();
        assert_eq!(v.unwrap(), "f");
    }
    let runs = log.runs();
    assert!(runs.len() >= 3, "{runs:?}");
    for pair in runs.windows(2) {
        let gap = pair[1].start - pair[0].end.unwrap();
        assert!(gap >= 500, "runs {gap} ms apart: {runs:?}");
    }
    assert_eq!(log.max_running.load(Ordering::SeqCst), 1);
    let s = t.stats();
    assert!(s.store_errors >= 2 * runs.len() as u64, "{s:?}");
    // Logged at warn (a store bug), never as a failed run.
    assert!(
        captured
            .ours(Level::WARN)
            .iter()
            .all(|m| m.contains("window store panicked"))
    );
    assert!(captured.ours(Level::ERROR).is_empty());
}

/// Issue 8 item 4 (seam): a run whose lease lapsed (its store calls failed
/// while it ran) never overwrites the window of the run that took the key
/// over: extend and record compare the owner's token.
#[tokio::test(start_paused = true)]
async fn a_lapsed_holder_never_overwrites_the_new_holder() {
    let store = MemoryWindowStore::new();
    let (rt_a, rt_b) = (runtime().await, runtime().await);
    // A cannot extend its lease (its link to the store is flaky then).
    let a: Coalesce<&'static str> = rt_a
        .coalesce("s:")
        .with_window(ms(1000))
        .with_store(scripted_on(store.clone(), |op| match op {
            "extend" => Act::Fail,
            _ => Act::Pass,
        }))
        .build()
        .unwrap();
    // B's lease: 2000 ms, extended every 1000 ms.
    let b: Coalesce<&'static str> = rt_b
        .coalesce("s:")
        .with_window(ms(2000))
        .with_store(store.clone())
        .build()
        .unwrap();
    let log = Log::new();
    let lead_a = spawn_call(&a, "k", log.work("a", 3000));
    // A's lease (1000 ms) lapses at 1000; B takes the key over at 1500 and
    // holds it, extending its lease at 2500 and 3500.
    log.until(1500).await;
    let lead_b = spawn_call(&b, "k", log.work("b", 3000));
    settle().await;
    let held = store.get("s:k").expect("B holds the key");
    log.until(2999).await;
    let before = store.get("s:k").unwrap();
    assert_eq!(before.token, held.token);
    // A finishes at 3000 and tries to record its window: refused.
    assert!(lead_a.await.unwrap().0.unwrap());
    log.at(3000);
    settle().await;
    let after = store.get("s:k").expect("B still holds the key");
    assert_eq!(after, before, "A's late record left B's lease alone");
    assert!(lead_b.await.unwrap().0.unwrap());
    let after_b = store.get("s:k").unwrap();
    assert_eq!(after_b.token, held.token, "B recorded its window");
}

/// Issue 7 item 8: the memory window store is capped; when full it sweeps
/// expired keys first, then evicts the keys that expire soonest, counts
/// them, and warns at most once a minute.
#[tokio::test(start_paused = true)]
async fn the_memory_window_store_is_capped() {
    let captured = Captured::default();
    let _guard = captured.install();
    assert_eq!(
        MemoryWindowStore::new().max_keys(),
        throttlebeam::coalesce::DEFAULT_WINDOW_STORE_KEYS
    );
    let store = MemoryWindowStore::with_max_keys(32).unwrap();
    let entry = |n: u64| WindowEntry::new(n, n + 1);
    // Expired keys make room without an eviction.
    for n in 0..32 {
        store
            .claim(&format!("old{n}"), entry(n), ms(10))
            .await
            .unwrap();
    }
    sleep(ms(10)).await;
    store.claim("fresh", entry(99), ms(1000)).await.unwrap();
    assert_eq!((store.len(), store.evictions()), (1, 0));
    // Live keys: the two that expire soonest (32 / 16) go first.
    for n in 0..31 {
        store
            .claim(&format!("live{n}"), entry(n), ms(2000 + n * 10))
            .await
            .unwrap();
    }
    assert_eq!(store.len(), 32);
    store.claim("one-more", entry(7), ms(5000)).await.unwrap();
    assert_eq!((store.len(), store.evictions()), (31, 2));
    assert_eq!(store.get("fresh"), None, "expired soonest");
    assert_eq!(store.get("live0"), None);
    assert!(store.get("live1").is_some());
    assert!(store.get("one-more").is_some());
    assert_eq!(captured.ours(Level::WARN).len(), 1);
    // Full again within the minute: evicted and counted, not logged again.
    store.claim("two", entry(8), ms(5000)).await.unwrap();
    store.claim("three", entry(9), ms(5000)).await.unwrap();
    assert_eq!(store.evictions(), 4);
    assert_eq!(captured.ours(Level::WARN).len(), 1);
    sleep(ms(60_000)).await;
    for n in 0..40 {
        store
            .claim(&format!("late{n}"), entry(n), ms(5000))
            .await
            .unwrap();
    }
    assert_eq!(captured.ours(Level::WARN).len(), 2);

    // Seen through a throttle's stats.
    let rt = runtime().await;
    let small = MemoryWindowStore::with_max_keys(16).unwrap();
    let t: Coalesce<u8> = rt
        .coalesce("c:")
        .with_window(ms(1000))
        .with_store(small.clone())
        .build()
        .unwrap();
    for n in 0..17 {
        t.call(&format!("k{n}"), |_| async { Ok::<_, Oops>(1) })
            .await
            .unwrap();
    }
    let s = t.stats();
    assert_eq!((s.store_keys, s.evictions), (16, 1));
    assert!(MemoryWindowStore::with_max_keys(0).is_err());
}

/// Issue 7 item 19: the counters, serializable.
#[tokio::test(start_paused = true)]
async fn stats_count_calls_runs_and_coalesced_calls() {
    let rt = runtime().await;
    let t = throttle(&rt, 100).await;
    let log = Log::new();
    assert!(t.call("a", log.work("a", 10)).await.unwrap());
    for _ in 0..3 {
        assert!(!t.call("a", log.work("a", 10)).await.unwrap());
    }
    assert!(t.call("b", log.work("b", 10)).await.unwrap());
    sleep(ms(500)).await;
    let s = t.stats();
    assert_eq!(
        (s.calls, s.leading_runs, s.trailing_runs, s.coalesced),
        (5, 2, 1, 3)
    );
    assert_eq!((s.store_errors, s.store_timeouts, s.evictions), (0, 0, 0));
    let bytes = bincode::serde::encode_to_vec(s, bincode::config::standard()).unwrap();
    assert!(!bytes.is_empty());
}

/// S5 on a shared memory store: two instances, one key. Exactly one leads;
/// the other's call runs as a trailing run after the window, and runs never
/// overlap across instances, even when a run outlasts the window (lease).
#[tokio::test(start_paused = true)]
async fn two_instances_sharing_a_store_never_overlap() {
    let rt_a = runtime().await;
    let rt_b = runtime().await;
    let store = MemoryWindowStore::new();
    let build = |rt: &Runtime| -> Coalesce<&'static str> {
        rt.coalesce("s:")
            .with_window(ms(1000))
            .with_store(store.clone())
            .build()
            .unwrap()
    };
    let (a, b) = (build(&rt_a), build(&rt_b));
    let log = Log::new();
    // A runs for 2500 ms, longer than the window: its lease keeps B out.
    let lead_a = spawn_call(&a, "k", log.work("a", 2500));
    log.until(100).await;
    // B's leading call loses the race: coalesced, `false`.
    assert!(!b.call("k", log.work("b", 100)).await.unwrap());
    let wait_b = spawn_wait(&b, "k", log.work("b2", 100));
    assert!(lead_a.await.unwrap().0.unwrap());
    let (v, _) = wait_b.await.unwrap();
    assert_eq!(v.unwrap(), "b2");
    let runs = log.runs();
    assert_eq!(runs.len(), 2, "{runs:?}");
    assert_eq!(
        (runs[0].tag, runs[0].start, runs[0].end),
        ("a", 0, Some(2500))
    );
    assert_eq!((runs[1].tag, runs[1].phase), ("b2", Phase::Trailing));
    // B ran only after A's window [2500, 3500) ended.
    assert!(runs[1].start >= 3500, "{runs:?}");
    assert_eq!(log.max_running.load(Ordering::SeqCst), 1);
}

/// A store slower than the window: the window recorded after a run always
/// replaces the run's lease, so this instance never loses a race to itself.
#[tokio::test(start_paused = true)]
async fn a_store_slower_than_the_window_never_blocks_its_own_instance() {
    let rt = runtime().await;
    let t: Coalesce<&'static str> = rt
        .coalesce("slow:")
        .with_window(ms(1))
        .with_store(scripted(|_| Act::Delay(ms(3))))
        .build()
        .unwrap();
    let log = Log::new();
    for round in 0..20 {
        let lead = spawn_wait(&t, "k", log.work("lead", 0));
        // Past the claim (3 ms): the function ran; the window is being
        // recorded.
        sleep(ms(4)).await;
        let trail = spawn_wait(&t, "k", log.work("trail", 0));
        assert_eq!(lead.await.unwrap().0.unwrap(), "lead", "round {round}");
        assert_eq!(trail.await.unwrap().0.unwrap(), "trail", "round {round}");
        sleep(ms(50)).await;
        assert_eq!(swept(&rt, &t), IDLE, "round {round}");
    }
    assert_eq!(log.runs().len(), 40);
}

/// Two instances with calls pending on one key all the time: the one that
/// lost a race claims first when the window ends, so neither starves (no
/// dropped calls) and runs still never overlap or come closer than a window.
#[tokio::test(start_paused = true)]
async fn two_busy_instances_take_turns() {
    let store = MemoryWindowStore::new();
    let (rt_a, rt_b) = (runtime().await, runtime().await);
    let build = |rt: &Runtime| -> Coalesce<&'static str> {
        rt.coalesce("s:")
            .with_window(ms(100))
            .with_store(store.clone())
            .build()
            .unwrap()
    };
    let (a, b) = (build(&rt_a), build(&rt_b));
    let log = Log::new();
    let mut waits = Vec::new();
    for i in 0..300u64 {
        let (t, tag) = if i % 2 == 0 { (&a, "a") } else { (&b, "b") };
        waits.push(spawn_wait(t, "hot", log.work(tag, 10)));
        sleep(ms(10)).await;
    }
    for w in waits {
        let (v, _) = w.await.unwrap();
        assert!(v.is_ok(), "{v:?}");
    }
    let runs = log.runs();
    assert_eq!(log.max_running.load(Ordering::SeqCst), 1);
    for pair in runs.windows(2) {
        assert!(pair[1].start - pair[0].end.unwrap() >= 100, "{pair:?}");
    }
    let by_b = runs.iter().filter(|r| r.tag == "b").count();
    let by_a = runs.len() - by_b;
    assert!(by_a >= 5 && by_b >= 5, "a ran {by_a} times, b {by_b} times");
}

/// S4: after 10 lost window races in a row, pending calls fail as dropped.
#[tokio::test(start_paused = true)]
async fn ten_lost_races_in_a_row_drop_the_pending_calls() {
    let rt = runtime().await;
    let t: Coalesce<&'static str> = rt
        .coalesce("taken:")
        .with_window(ms(100))
        .with_store(scripted(|_| Act::Taken))
        .build()
        .unwrap();
    let log = Log::new();
    assert!(!t.call("k", log.work("never", 1)).await.unwrap());
    let err = t
        .call_and_wait("k", log.work("never", 1))
        .await
        .unwrap_err();
    assert!(
        matches!(err, Error::Discarded { ref key, .. } if key == "k"),
        "{err:?}"
    );
    assert!(err.to_string().contains("lost the window race"), "{err}");
    // Unreadable window ends fall back to the window length: lost at 0,
    // 100, …, 900, the tenth loss drops the calls.
    log.at(900);
    assert!(log.runs().is_empty());
    sleep(ms(200)).await;
    settle().await;
    assert_eq!(swept(&rt, &t), IDLE);
}

// ---------------------------------------------------------------- test stores

/// What a [`Scripted`] store does before (or instead of) an operation.
#[derive(Debug, Clone, Copy)]
enum Act {
    /// Go to memory.
    Pass,
    /// Fail with an error.
    Fail,
    /// Never complete.
    Hang,
    /// Panic.
    Panic,
    /// Take this long, then go to memory.
    Delay(Duration),
    /// (claim only) another instance holds the key, with an unreadable value.
    Taken,
}

/// A memory store whose operations first do what `act` says for them.
struct Scripted<F> {
    memory: MemoryWindowStore,
    act: F,
    cleared: Arc<AtomicBool>,
}

fn scripted<F: Fn(&'static str) -> Act + Send + Sync + 'static>(act: F) -> Scripted<F> {
    scripted_on(MemoryWindowStore::new(), act)
}

fn scripted_on<F: Fn(&'static str) -> Act + Send + Sync + 'static>(
    memory: MemoryWindowStore,
    act: F,
) -> Scripted<F> {
    Scripted {
        memory,
        act,
        cleared: Arc::default(),
    }
}

impl<F: Fn(&'static str) -> Act + Send + Sync + 'static> Scripted<F> {
    async fn gate(
        &self,
        op: &'static str,
    ) -> Result<bool, throttlebeam::coalesce::WindowStoreError> {
        match (self.act)(op) {
            Act::Pass => Ok(true),
            Act::Fail => Err("connection refused".into()),
            Act::Hang => std::future::pending().await,
            Act::Panic => panic!("store bug in {op}"),
            Act::Delay(d) => {
                sleep(d).await;
                Ok(true)
            }
            Act::Taken => Ok(false),
        }
    }
}

impl<F: Fn(&'static str) -> Act + Send + Sync + 'static> WindowStore for Scripted<F> {
    fn claim<'a>(
        &'a self,
        key: &'a str,
        entry: WindowEntry,
        ttl: Duration,
    ) -> WindowStoreFuture<'a, WindowClaim> {
        Box::pin(async move {
            if !self.gate("claim").await? {
                return Ok(WindowClaim::Lost { holder: None });
            }
            self.memory.claim(key, entry, ttl).await
        })
    }
    fn extend<'a>(
        &'a self,
        key: &'a str,
        entry: WindowEntry,
        ttl: Duration,
    ) -> WindowStoreFuture<'a, bool> {
        Box::pin(async move {
            self.gate("extend").await?;
            self.memory.extend(key, entry, ttl).await
        })
    }
    fn record<'a>(
        &'a self,
        key: &'a str,
        entry: WindowEntry,
        ttl: Duration,
    ) -> WindowStoreFuture<'a, bool> {
        Box::pin(async move {
            self.gate("record").await?;
            self.memory.record(key, entry, ttl).await
        })
    }
}
