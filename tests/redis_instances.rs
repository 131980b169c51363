//! Several runtimes in one process sharing real Redis servers, as several
//! instances behind a load balancer would: the coalescing throttle (S5).
#![cfg(feature = "redis")]

mod support;

use std::sync::{Arc, Mutex};
use std::time::Duration;

use support::redis::{RedisCluster, RedisNode};
use throttlebeam::store::Redis;
use throttlebeam::{Phase, Runtime};
use tokio::time::Instant;

/// Each "instance": its own runtime and its own connection to Redis.
async fn instance(urls: &[String], cluster: bool) -> (Runtime, Redis) {
    let runtime = Runtime::start().await.expect("runtime starts");
    let redis = if cluster {
        Redis::cluster(urls.to_vec())
    } else {
        Redis::builder(urls[0].clone())
    }
    .connect()
    .await
    .expect("connects");
    (runtime, redis)
}

type Runs = Arc<Mutex<Vec<(Phase, Instant, Instant)>>>;

async fn s5_one_leads_the_other_trails_never_overlapping(urls: Vec<String>, cluster: bool) {
    let window = Duration::from_millis(300);
    let work = Duration::from_millis(100);
    let (rt_a, redis_a) = instance(&urls, cluster).await;
    let (rt_b, redis_b) = instance(&urls, cluster).await;
    let a = rt_a
        .trailing_throttle("sync:")
        .with_window(window)
        .with_store(redis_a.clone())
        .build::<u32>()
        .expect("throttle a");
    let b = rt_b
        .trailing_throttle("sync:")
        .with_window(window)
        .with_store(redis_b.clone())
        .build::<u32>()
        .expect("throttle b");
    let runs: Runs = Arc::default();
    let job = |id: u32, runs: Runs| {
        move |phase: Phase| async move {
            let start = Instant::now();
            tokio::time::sleep(work).await;
            runs.lock().unwrap().push((phase, start, Instant::now()));
            Ok::<_, std::io::Error>(id)
        }
    };
    for key in ["room:1", "room:2", "room:3"] {
        runs.lock().unwrap().clear();
        let (va, vb) = tokio::join!(
            a.call_and_wait(key, job(1, runs.clone())),
            b.call_and_wait(key, job(2, runs.clone()))
        );
        let (va, vb) = (va.expect("a's call runs"), vb.expect("b's call runs"));
        assert_ne!(va, vb, "each instance's call ran once, on its own instance");
        let mut runs = runs.lock().unwrap().clone();
        runs.sort_by_key(|r| r.1);
        assert_eq!(runs.len(), 2, "{key}: exactly two runs: {runs:?}");
        let (first, second) = (runs[0], runs[1]);
        assert!(
            second.1 >= first.2 + window - Duration::from_millis(5),
            "{key}: the second run started {:?} after the first ended; the window is {window:?}",
            second.1 - first.2
        );
    }
    assert_eq!(redis_a.stats().breaker.failures, 0);
    assert_eq!(redis_b.stats().breaker.failures, 0);
    rt_a.shutdown(Duration::from_secs(1)).await;
    rt_b.shutdown(Duration::from_secs(1)).await;
}

#[tokio::test]
async fn s5_two_instances_on_one_node() {
    let Some(node) = RedisNode::start("s5_two_instances_on_one_node") else {
        return;
    };
    s5_one_leads_the_other_trails_never_overlapping(vec![node.url()], false).await;
}

#[tokio::test]
async fn s5_two_instances_on_a_cluster() {
    let Some(cluster) = RedisCluster::start("s5_two_instances_on_a_cluster") else {
        return;
    };
    s5_one_leads_the_other_trails_never_overlapping(cluster.urls(), true).await;
}
