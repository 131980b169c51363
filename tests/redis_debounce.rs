//! Debounce across instances (S13): several runtimes in one process sharing
//! real Redis servers, as instances behind a load balancer would. Real time:
//! the deadlines live on the server's clock, so delays stay short.
#![cfg(feature = "redis")]

mod support;

use std::sync::{Arc, Mutex};
use std::time::Duration;

use support::redis::{RedisCluster, RedisNode};
use throttlebeam::store::{BreakerConfig, Redis};
use throttlebeam::{DebounceHandle, DebounceOptions, Error, Runtime};
use tokio::time::Instant;

/// One "instance": its own connection to Redis and its own runtime.
async fn instance(urls: &[String], cluster: bool) -> Runtime {
    let redis = if cluster {
        Redis::cluster(urls.to_vec())
    } else {
        Redis::builder(urls[0].clone())
    }
    .with_command_timeout(Duration::from_millis(300))
    .with_breaker(BreakerConfig::default().with_cooldown(Duration::from_millis(300)))
    .connect()
    .await
    .expect("connects");
    Runtime::builder()
        .with_redis(redis)
        .start()
        .await
        .expect("runtime starts")
}

async fn instances(n: usize, urls: &[String], cluster: bool) -> Vec<Runtime> {
    let mut out = Vec::new();
    for _ in 0..n {
        out.push(instance(urls, cluster).await);
    }
    out
}

/// Runs: (instance, call number, when).
type Runs = Arc<Mutex<Vec<(usize, usize, Instant)>>>;

/// A call from instance `i`, number `n`, whose function records its run
/// and returns `"i:n"`.
fn call(
    debounce: &DebounceHandle,
    key: &str,
    delay: Duration,
    options: DebounceOptions,
    runs: &Runs,
    i: usize,
    n: usize,
) -> throttlebeam::debounce::Debounced<String> {
    let runs = runs.clone();
    debounce
        .across_instances()
        .call_with(key, delay, options, move || async move {
            runs.lock().unwrap().push((i, n, Instant::now()));
            Ok::<_, std::io::Error>(format!("{i}:{n}"))
        })
        .expect("scheduled")
}

async fn settle<T>(call: throttlebeam::debounce::Debounced<T>) -> Result<T, Error>
where
    T: Clone + Send + Sync + 'static,
{
    tokio::time::timeout(Duration::from_secs(5), call)
        .await
        .expect("an awaiting caller never hangs")
}

async fn shut(runtimes: Vec<Runtime>) {
    for rt in runtimes {
        rt.shutdown(Duration::from_secs(1)).await;
    }
}

/// Bursts from 4 runtimes on one key: exactly one run, on the instance of
/// the last call, with its function; every awaiting caller, on every
/// runtime, gets that run's value.
async fn one_run_per_burst_on_the_last_caller(urls: Vec<String>, cluster: bool) {
    let rts = instances(4, &urls, cluster).await;
    let debounces: Vec<_> = rts.iter().map(Runtime::debounce).collect();
    let delay = Duration::from_millis(150);
    for (round, last) in [1_usize, 3, 0].into_iter().enumerate() {
        let key = format!("doc:{round}");
        let runs: Runs = Arc::default();
        let mut pending = Vec::new();
        // Calls 20 ms apart, round robin over the instances, ending on `last`.
        let order: Vec<usize> = (0..8).map(|n| (last + 1 + n) % 4).collect();
        let mut last_call = Instant::now();
        for (n, &i) in order.iter().enumerate() {
            pending.push(call(
                &debounces[i],
                &key,
                delay,
                DebounceOptions::new(),
                &runs,
                i,
                n,
            ));
            last_call = Instant::now();
            tokio::time::sleep(Duration::from_millis(20)).await;
        }
        let expected = format!("{last}:{}", order.len() - 1);
        for outcome in futures_join(pending).await {
            assert_eq!(outcome.expect("the covering run's value"), expected);
        }
        let everyone = Instant::now();
        let runs = runs.lock().unwrap().clone();
        assert_eq!(runs.len(), 1, "{key}: exactly one run: {runs:?}");
        let (i, n, at) = runs[0];
        assert_eq!(
            (i, n),
            (last, order.len() - 1),
            "{key}: the last call's function, on its instance"
        );
        assert!(
            at + Duration::from_millis(10) >= last_call + delay,
            "{key}: ran {:?} after the last call; the delay is {delay:?}",
            at - last_call
        );
        assert!(
            at < last_call + delay + Duration::from_millis(500),
            "{key}: ran late"
        );
        eprintln!(
            "{key}: ran {:?} after the last call (delay {delay:?}); every caller on 4 instances had the value {:?} after the run",
            at - last_call,
            everyone - at
        );
    }
    // Nothing is left behind on any instance.
    tokio::time::sleep(Duration::from_millis(50)).await;
    for rt in &rts {
        assert_eq!(rt.stats().debounce.keys, 0);
    }
    shut(rts).await;
}

/// Awaits every call, concurrently.
async fn futures_join<T>(calls: Vec<throttlebeam::debounce::Debounced<T>>) -> Vec<Result<T, Error>>
where
    T: Clone + Send + Sync + 'static,
{
    let handles: Vec<_> = calls.into_iter().map(|c| tokio::spawn(settle(c))).collect();
    let mut out = Vec::new();
    for h in handles {
        out.push(h.await.expect("joins"));
    }
    out
}

#[tokio::test]
async fn bursts_from_four_runtimes_run_once_on_one_node() {
    let Some(node) = RedisNode::start("bursts_from_four_runtimes_run_once_on_one_node") else {
        return;
    };
    one_run_per_burst_on_the_last_caller(vec![node.url()], false).await;
}

#[tokio::test]
async fn bursts_from_four_runtimes_run_once_on_a_cluster() {
    let Some(cluster) = RedisCluster::start("bursts_from_four_runtimes_run_once_on_a_cluster")
    else {
        return;
    };
    one_run_per_burst_on_the_last_caller(cluster.urls(), true).await;
}

/// `max_wait` across instances: calls every 50 ms from alternating
/// instances never let the delay pass, yet a run happens at most `max_wait`
/// after the burst's first call, and again at most every `max_wait`.
async fn max_wait_holds_across_instances(urls: Vec<String>, cluster: bool) {
    let rts = instances(2, &urls, cluster).await;
    let debounces: Vec<_> = rts.iter().map(Runtime::debounce).collect();
    let delay = Duration::from_millis(150);
    let max_wait = Duration::from_millis(400);
    let options = DebounceOptions::new().with_max_wait(max_wait);
    let runs: Runs = Arc::default();
    let start = Instant::now();
    let mut n = 0;
    while start.elapsed() < Duration::from_millis(1_100) {
        let i = n % 2;
        drop(call(&debounces[i], "feed", delay, options, &runs, i, n));
        n += 1;
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
    let last_call = Instant::now();
    tokio::time::sleep(delay + Duration::from_millis(300)).await;
    let runs = runs.lock().unwrap().clone();
    let tolerance = Duration::from_millis(120);
    assert!(
        runs.len() >= 3,
        "runs while calls kept coming, then a trailing one: {runs:?}"
    );
    let mut previous = start;
    for &(_, _, at) in &runs[..runs.len() - 1] {
        assert!(
            at <= previous + max_wait + tolerance,
            "a run {:?} after the previous one (or the first call); max_wait is {max_wait:?}",
            at - previous
        );
        previous = at;
    }
    let &(i, n_last, at) = runs.last().expect("a trailing run");
    assert_eq!(
        (i, n_last),
        ((n - 1) % 2, n - 1),
        "the trailing run is the last call's, on its instance"
    );
    assert!(at > last_call, "after the calls stopped");
    shut(rts).await;
}

#[tokio::test]
async fn max_wait_holds_across_instances_on_one_node() {
    let Some(node) = RedisNode::start("max_wait_holds_across_instances_on_one_node") else {
        return;
    };
    max_wait_holds_across_instances(vec![node.url()], false).await;
}

#[tokio::test]
async fn max_wait_holds_across_instances_on_a_cluster() {
    let Some(cluster) = RedisCluster::start("max_wait_holds_across_instances_on_a_cluster") else {
        return;
    };
    max_wait_holds_across_instances(cluster.urls(), true).await;
}

/// `cancel` and `flush` from an instance that made no call.
async fn cancel_and_flush_from_another_instance(urls: Vec<String>, cluster: bool) {
    let rts = instances(3, &urls, cluster).await;
    let d: Vec<_> = rts.iter().map(Runtime::debounce).collect();
    let opts = DebounceOptions::new();

    // Cancel: nothing runs, every awaiting caller learns it.
    let delay = Duration::from_millis(200);
    let runs: Runs = Arc::default();
    let a = call(&d[0], "job:c", delay, opts, &runs, 0, 0);
    // Apart in time: the last call is the last one Redis hears.
    tokio::time::sleep(Duration::from_millis(20)).await;
    let b = call(&d[1], "job:c", delay, opts, &runs, 1, 1);
    tokio::time::sleep(Duration::from_millis(30)).await;
    assert!(
        d[2].across_instances()
            .cancel("job:c")
            .await
            .expect("valid key")
    );
    for outcome in futures_join(vec![a, b]).await {
        assert!(
            matches!(
                outcome,
                Err(Error::Discarded {
                    reason: "cancelled",
                    ..
                })
            ),
            "{outcome:?}"
        );
    }
    tokio::time::sleep(delay + Duration::from_millis(100)).await;
    assert!(
        runs.lock().unwrap().is_empty(),
        "a cancelled burst never runs"
    );
    assert!(
        !d[2]
            .across_instances()
            .cancel("job:c")
            .await
            .expect("valid key")
    );
    // The next call starts a fresh burst.
    let fresh = call(&d[0], "job:c", delay, opts, &runs, 0, 2);
    assert_eq!(settle(fresh).await.expect("runs"), "0:2");

    // Flush: a 10 s delay, flushed from the third instance, runs now on the
    // owner with its function, and both callers get the value.
    let long = Duration::from_secs(10);
    let runs: Runs = Arc::default();
    let a = call(&d[0], "job:f", long, opts, &runs, 0, 0);
    tokio::time::sleep(Duration::from_millis(20)).await;
    let b = call(&d[1], "job:f", long, opts, &runs, 1, 1);
    tokio::time::sleep(Duration::from_millis(30)).await;
    let asked = Instant::now();
    assert!(
        d[2].across_instances()
            .flush("job:f")
            .await
            .expect("valid key")
    );
    for outcome in futures_join(vec![a, b]).await {
        assert_eq!(outcome.expect("flushed"), "1:1");
    }
    assert!(
        asked.elapsed() < Duration::from_secs(1),
        "flushed now, not at the deadline"
    );
    assert_eq!(runs.lock().unwrap().len(), 1);
    assert!(
        !d[2]
            .across_instances()
            .flush("job:f")
            .await
            .expect("valid key"),
        "nothing pending"
    );
    assert!(matches!(
        d[2].across_instances().flush("").await,
        Err(Error::InvalidKey { .. })
    ));
    shut(rts).await;
}

#[tokio::test]
async fn cancel_and_flush_from_another_instance_on_one_node() {
    let Some(node) = RedisNode::start("cancel_and_flush_from_another_instance_on_one_node") else {
        return;
    };
    cancel_and_flush_from_another_instance(vec![node.url()], false).await;
}

#[tokio::test]
async fn cancel_and_flush_from_another_instance_on_a_cluster() {
    let Some(cluster) = RedisCluster::start("cancel_and_flush_from_another_instance_on_a_cluster")
    else {
        return;
    };
    cancel_and_flush_from_another_instance(cluster.urls(), true).await;
}

/// An error of the run reaches every caller; a value of another type is
/// refused, not misread.
#[tokio::test]
async fn errors_travel_and_types_are_checked() {
    let Some(node) = RedisNode::start("errors_travel_and_types_are_checked") else {
        return;
    };
    let rts = instances(2, &[node.url()], false).await;
    let (a, b) = (rts[0].debounce(), rts[1].debounce());
    let delay = Duration::from_millis(80);
    let first = a
        .across_instances()
        .call("bad", delay, || async { Ok::<_, std::io::Error>(1_u32) })
        .expect("scheduled");
    tokio::time::sleep(Duration::from_millis(20)).await;
    let last = b
        .across_instances()
        .call("bad", delay, || async {
            Err::<u32, _>(std::io::Error::other("disk full"))
        })
        .expect("scheduled");
    for outcome in [settle(first).await, settle(last).await] {
        match outcome {
            Err(Error::Failed { source, .. }) => assert_eq!(source.to_string(), "disk full"),
            other => panic!("{other:?}"),
        }
    }
    let wrong = a
        .across_instances()
        .call("typed", delay, || async { Ok::<_, std::io::Error>(7_u64) })
        .expect("scheduled");
    tokio::time::sleep(Duration::from_millis(20)).await;
    let right = b
        .across_instances()
        .call("typed", delay, || async {
            Ok::<_, std::io::Error>("text".to_owned())
        })
        .expect("scheduled");
    assert_eq!(settle(right).await.expect("its own value"), "text");
    assert!(matches!(
        settle(wrong).await,
        Err(Error::TypeMismatch { .. })
    ));
    shut(rts).await;
}

/// The owner dies before firing (a later call from an instance that never
/// answers): a waiting instance takes the burst over once it is overdue and
/// runs its own latest function for everyone still waiting; nobody hangs.
#[tokio::test]
async fn a_burst_whose_owner_died_is_rescued_by_a_waiter() {
    let Some(node) = RedisNode::start("a_burst_whose_owner_died_is_rescued_by_a_waiter") else {
        return;
    };
    let rts = instances(2, &[node.url()], false).await;
    let runs: Runs = Arc::default();
    let delay = Duration::from_millis(100);
    let opts = DebounceOptions::new();
    let a = call(&rts[0].debounce(), "orphan", delay, opts, &runs, 0, 0);
    tokio::time::sleep(Duration::from_millis(20)).await;
    let b = call(&rts[1].debounce(), "orphan", delay, opts, &runs, 1, 1);
    tokio::time::sleep(Duration::from_millis(30)).await;
    // A later call from an instance that then died: it owns the burst now.
    let record = "{throttlebeam:orphan}:d";
    node.cli(&["HINCRBY", record, "g", "1"]).expect("redis-cli");
    node.cli(&["HSET", record, "o", "ghost"])
        .expect("redis-cli");
    let started = Instant::now();
    let outcomes = futures_join(vec![a, b]).await;
    assert!(
        started.elapsed() >= Duration::from_millis(500),
        "waited for the owner first"
    );
    let runs = runs.lock().unwrap().clone();
    assert_eq!(runs.len(), 1, "exactly one rescue: {runs:?}");
    let (i, n, _) = runs[0];
    for outcome in outcomes {
        assert_eq!(outcome.expect("the rescue's value"), format!("{i}:{n}"));
    }
    shut(rts).await;
}

/// The owner dies while its function runs (its lease lapses): waiters
/// elsewhere get a typed error, never hang.
#[tokio::test]
async fn waiters_on_an_owner_that_died_mid_run_get_an_error() {
    let Some(node) = RedisNode::start("waiters_on_an_owner_that_died_mid_run_get_an_error") else {
        return;
    };
    let rts = instances(1, &[node.url()], false).await;
    let runs: Runs = Arc::default();
    let waiting = call(
        &rts[0].debounce(),
        "mid",
        Duration::from_millis(150),
        DebounceOptions::new(),
        &runs,
        0,
        0,
    );
    tokio::time::sleep(Duration::from_millis(30)).await;
    // Another instance fired the burst and died running it: the record is
    // closed and the running marker's lease lapses unrenewed.
    let record = "{throttlebeam:mid}:d";
    let burst = node.cli(&["HGET", record, "b"]).expect("redis-cli");
    assert!(!burst.is_empty(), "the burst is open");
    node.cli(&["DEL", record]).expect("redis-cli");
    let marker = format!("{{throttlebeam:mid}}:d:{burst}");
    node.cli(&["SET", &marker, "", "PX", "400"])
        .expect("redis-cli");
    let outcome = settle(waiting).await;
    assert!(
        matches!(outcome, Err(Error::Discarded { .. })),
        "{outcome:?}"
    );
    assert!(runs.lock().unwrap().is_empty(), "nothing ran here");
    shut(rts).await;
}

/// Redis killed: every instance debounces on its own (fail open), nobody
/// hangs; after the restart, bursts are shared again.
#[tokio::test]
async fn a_dead_redis_falls_back_to_per_instance_debounce() {
    let Some(mut node) = RedisNode::start("a_dead_redis_falls_back_to_per_instance_debounce")
    else {
        return;
    };
    let urls = vec![node.url()];
    let rts = instances(2, &urls, false).await;
    let d: Vec<_> = rts.iter().map(Runtime::debounce).collect();
    let delay = Duration::from_millis(100);
    let opts = DebounceOptions::new();
    // A burst in flight when Redis dies: the owner cannot fire, the waiter
    // cannot probe; each runs its own latest function.
    let runs: Runs = Arc::default();
    let a = call(&d[0], "k:mid", delay, opts, &runs, 0, 0);
    tokio::time::sleep(Duration::from_millis(20)).await;
    let b = call(&d[1], "k:mid", delay, opts, &runs, 1, 1);
    tokio::time::sleep(Duration::from_millis(30)).await;
    node.kill();
    let outcomes = futures_join(vec![a, b]).await;
    assert_eq!(outcomes[1].as_deref().expect("the owner runs"), "1:1");
    assert_eq!(outcomes[0].as_deref().expect("runs here"), "0:0");
    // New bursts while down: per instance, one run each with its latest function.
    for round in 0..3 {
        let key = format!("k:down:{round}");
        let runs: Runs = Arc::default();
        let mut pending = Vec::new();
        for n in 0..6 {
            pending.push(call(&d[n % 2], &key, delay, opts, &runs, n % 2, n));
        }
        let outcomes = futures_join(pending).await;
        for (n, outcome) in outcomes.into_iter().enumerate() {
            let expected = if n % 2 == 0 { "0:4" } else { "1:5" };
            assert_eq!(outcome.expect("fails open"), expected);
        }
        assert_eq!(runs.lock().unwrap().len(), 2, "one run per instance");
    }
    node.restart();
    // Recovery: within a few breaker cooldowns bursts are shared again.
    let deadline = Instant::now() + Duration::from_secs(10);
    let mut round = 0;
    loop {
        round += 1;
        let key = format!("k:after:{round}");
        let runs: Runs = Arc::default();
        let first = call(&d[0], &key, delay, opts, &runs, 0, 0);
        tokio::time::sleep(Duration::from_millis(20)).await;
        let last = call(&d[1], &key, delay, opts, &runs, 1, 1);
        let outcomes = futures_join(vec![first, last]).await;
        let runs = runs.lock().unwrap().clone();
        if runs.len() == 1 {
            let (i, n, _) = runs[0];
            for outcome in outcomes {
                assert_eq!(outcome.expect("shared again"), format!("{i}:{n}"));
            }
            break;
        }
        assert!(Instant::now() < deadline, "did not recover");
        tokio::time::sleep(Duration::from_millis(200)).await;
    }
    shut(rts).await;
}

/// Without Redis, `across_instances().call` is `call`.
#[tokio::test]
async fn without_redis_shared_calls_are_local() {
    let rt = Runtime::start().await.expect("starts");
    let debounce = rt.debounce();
    let runs: Runs = Arc::default();
    let delay = Duration::from_millis(30);
    let a = call(
        &debounce,
        "solo",
        delay,
        DebounceOptions::new(),
        &runs,
        0,
        0,
    );
    let b = call(
        &debounce,
        "solo",
        delay,
        DebounceOptions::new(),
        &runs,
        0,
        1,
    );
    assert!(debounce.is_pending("solo"), "in the in-process registry");
    for outcome in futures_join(vec![a, b]).await {
        assert_eq!(outcome.expect("runs"), "0:1");
    }
    let c = call(
        &debounce,
        "solo",
        delay,
        DebounceOptions::new(),
        &runs,
        0,
        2,
    );
    assert!(
        debounce
            .across_instances()
            .cancel("solo")
            .await
            .expect("valid key")
    );
    assert!(matches!(settle(c).await, Err(Error::Discarded { .. })));
    rt.shutdown(Duration::from_secs(1)).await;
}

/// The leading edge across instances: the burst's first call runs at once
/// on its instance; the later calls, from anywhere, make one trailing run
/// on the last caller's instance; a lone call runs once, not twice.
#[tokio::test]
async fn leading_edge_across_instances() {
    let Some(node) = RedisNode::start("leading_edge_across_instances") else {
        return;
    };
    let rts = instances(2, &[node.url()], false).await;
    let d: Vec<_> = rts.iter().map(Runtime::debounce).collect();
    let delay = Duration::from_millis(150);
    let opts = DebounceOptions::new().with_leading(true);
    let runs: Runs = Arc::default();
    let started = Instant::now();
    let lead = call(&d[0], "lead", delay, opts, &runs, 0, 0);
    assert_eq!(settle(lead).await.expect("leading run"), "0:0");
    assert!(started.elapsed() < delay, "the leading call runs at once");
    let a = call(&d[1], "lead", delay, opts, &runs, 1, 1);
    tokio::time::sleep(Duration::from_millis(20)).await;
    let b = call(&d[0], "lead", delay, opts, &runs, 0, 2);
    tokio::time::sleep(Duration::from_millis(20)).await;
    let c = call(&d[1], "lead", delay, opts, &runs, 1, 3);
    for outcome in futures_join(vec![a, b, c]).await {
        assert_eq!(outcome.expect("trailing run"), "1:3");
    }
    tokio::time::sleep(delay + Duration::from_millis(100)).await;
    let ran: Vec<_> = runs.lock().unwrap().iter().map(|r| (r.0, r.1)).collect();
    assert_eq!(ran, [(0, 0), (1, 3)], "one leading and one trailing run");

    // A lone call: exactly one run.
    let runs: Runs = Arc::default();
    let lone = call(&d[1], "lone", delay, opts, &runs, 1, 0);
    assert_eq!(settle(lone).await.expect("leading run"), "1:0");
    tokio::time::sleep(delay + Duration::from_millis(150)).await;
    assert_eq!(runs.lock().unwrap().len(), 1);
    shut(rts).await;
}

/// Shutdown with the default flush policy runs the bursts this instance
/// owns now, and callers elsewhere get the value.
#[tokio::test]
async fn shutdown_flushes_the_bursts_an_instance_owns() {
    let Some(node) = RedisNode::start("shutdown_flushes_the_bursts_an_instance_owns") else {
        return;
    };
    let rts = instances(2, &[node.url()], false).await;
    let d: Vec<_> = rts.iter().map(Runtime::debounce).collect();
    let long = Duration::from_secs(30);
    let runs: Runs = Arc::default();
    let elsewhere = call(&d[0], "bye", long, DebounceOptions::new(), &runs, 0, 0);
    tokio::time::sleep(Duration::from_millis(20)).await;
    let owner = call(&d[1], "bye", long, DebounceOptions::new(), &runs, 1, 1);
    tokio::time::sleep(Duration::from_millis(20)).await;
    let started = Instant::now();
    rts[1].shutdown(Duration::from_secs(2)).await;
    for outcome in futures_join(vec![elsewhere, owner]).await {
        assert_eq!(outcome.expect("flushed at shutdown"), "1:1");
    }
    assert!(started.elapsed() < Duration::from_secs(2));
    assert!(matches!(
        d[1].across_instances().call("bye", long, || async {
            Ok::<_, std::io::Error>(String::new())
        }),
        Err(Error::ShutDown { .. })
    ));
    shut(rts).await;
}

/// Calls made on one instance while its previous script is in flight share
/// the next one: a tight burst of 1,000 local calls costs a handful of
/// round trips, not 1,000, and still one run.
#[tokio::test]
async fn local_calls_share_round_trips() {
    let Some(node) = RedisNode::start("local_calls_share_round_trips") else {
        return;
    };
    let redis = Redis::builder(node.url())
        .connect()
        .await
        .expect("connects");
    let rt = Runtime::builder()
        .with_redis(redis.clone())
        .start()
        .await
        .expect("runtime starts");
    let debounce = rt.debounce();
    let runs: Runs = Arc::default();
    let before = redis.stats().commands;
    let mut pending = Vec::new();
    for n in 0..1_000 {
        pending.push(call(
            &debounce,
            "hot",
            Duration::from_millis(100),
            DebounceOptions::new(),
            &runs,
            0,
            n,
        ));
    }
    for outcome in futures_join(pending).await {
        assert_eq!(outcome.expect("one run"), "0:999");
    }
    let commands = redis.stats().commands - before;
    assert_eq!(runs.lock().unwrap().len(), 1);
    // Call scripts (at most a few), one fire, one publish.
    assert!(
        commands <= 6,
        "{commands} commands for one burst of 1,000 calls"
    );
    eprintln!("one burst of 1,000 local calls: {commands} Redis commands");
    rt.shutdown(Duration::from_secs(1)).await;
}

/// (instance, call number) of the runs or values of each key.
type ByKey = std::collections::HashMap<usize, Vec<(usize, usize)>>;

/// Many keys at once: 300 keys × 8 calls spread over 4 runtimes, all
/// concurrent. Every key runs exactly once, on one instance, with that
/// instance's latest function for the key, and all 8 callers get its value.
async fn many_keys_run_once_each(urls: Vec<String>, cluster: bool) {
    // Generous timeouts: a debug build on a loaded machine must not time out
    // (a timeout falls back per instance, which this test does not measure).
    let mut rts = Vec::new();
    for _ in 0..4 {
        let redis = if cluster {
            Redis::cluster(urls.clone())
        } else {
            Redis::builder(urls[0].clone())
        }
        .with_command_timeout(Duration::from_secs(3))
        .connect()
        .await
        .expect("connects");
        let rt = Runtime::builder().with_redis(redis).start().await;
        rts.push(rt.expect("runtime starts"));
    }
    let d: Vec<_> = rts.iter().map(Runtime::debounce).collect();
    // Every call of a key must reach Redis before its burst is due, even
    // when 2,400 calls queue up on a loaded machine.
    let delay = Duration::from_millis(500);
    let keys = 300;
    let runs: Arc<Mutex<ByKey>> = Arc::default();
    let mut pending = Vec::new();
    for n in 0..8 {
        for k in 0..keys {
            let i = (k + n) % 4;
            let runs = runs.clone();
            let call = d[i]
                .across_instances()
                .call(&format!("many:{k}"), delay, move || async move {
                    runs.lock().unwrap().entry(k).or_default().push((i, n));
                    Ok::<_, std::io::Error>((i, n))
                })
                .expect("scheduled");
            pending.push((k, call));
        }
        tokio::time::sleep(Duration::from_millis(5)).await;
    }
    let mut handles = Vec::new();
    for (k, call) in pending {
        handles.push((k, tokio::spawn(settle(call))));
    }
    let mut values = ByKey::default();
    for (k, handle) in handles {
        values
            .entry(k)
            .or_default()
            .push(handle.await.expect("joins").expect("a value"));
    }
    let runs_now = runs.lock().unwrap().clone();
    for k in 0..keys {
        let ran = runs_now.get(&k).cloned().unwrap_or_default();
        assert_eq!(ran.len(), 1, "key {k}: exactly one run: {ran:?}");
        let (i, n) = ran[0];
        let latest_here = (0..8).filter(|m| (k + m) % 4 == i).max().expect("a call");
        assert_eq!(n, latest_here, "key {k}: the instance's latest function");
        assert!(
            values[&k].iter().all(|v| *v == (i, n)),
            "key {k}: every caller gets the run's value: {:?}",
            values[&k]
        );
    }
    shut(rts).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn many_keys_run_once_each_on_one_node() {
    let Some(node) = RedisNode::start("many_keys_run_once_each_on_one_node") else {
        return;
    };
    many_keys_run_once_each(vec![node.url()], false).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn many_keys_run_once_each_on_a_cluster() {
    let Some(cluster) = RedisCluster::start("many_keys_run_once_each_on_a_cluster") else {
        return;
    };
    many_keys_run_once_each(cluster.urls(), true).await;
}
