//! Failover: a primary with a replica, and a 6-node cluster (3 primaries, 3 replicas) whose
//! primary is killed or failed over mid-flood. Durable claims (`WAIT` on claim and
//! completion), fencing counters across a promotion, and how quickly clients follow the new
//! primary (issue 33 item 3).
#![cfg(feature = "redis")]

mod support;

use std::sync::Arc;
use std::sync::atomic::{AtomicU32, Ordering};
use std::time::Duration;

use support::redis::RedisNode;
use throttlebeam::store::{Redis, StoreError};
use throttlebeam::{
    ClaimReply, ClaimRequest, ClaimToken, Error, IdempotencyOptions, IdempotencyOutcome,
    IdempotencyStore, Runtime,
};

const LEASE: Duration = Duration::from_secs(30);
const TTL: Duration = Duration::from_secs(3600);

async fn instance(redis: Redis) -> Runtime {
    Runtime::builder()
        .with_redis(redis)
        .start()
        .await
        .expect("runtime starts")
}

/// Whether `error` is a store failure whose source is a claim its replica did not take.
fn not_replicated(error: &Error) -> bool {
    matches!(
        error,
        Error::StoreUnavailable { source, .. } if matches!(
            source.downcast_ref::<StoreError>(),
            Some(StoreError::NotReplicated { wanted: 1, acknowledged: 0, .. })
        )
    )
}

/// The stored name of an unscoped idempotency key's record.
fn record_key(key: &str) -> String {
    format!("{{throttlebeam:-{key}}}:i")
}

/// Durable claims on one primary with one replica: a claim and a completion are on the
/// replica when acknowledged; with the replica away a claim is refused as `StoreUnavailable`
/// (nothing runs, the key is released) and a completion is retried until the replica is back.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn durable_claims_wait_for_the_replica_refuse_claims_without_it_and_retry_completions() {
    let test = "durable_claims_wait_for_the_replica_refuse_claims_without_it_and_retry_completions";
    let Some(primary) = RedisNode::start(test) else {
        return;
    };
    let Some(replica) = RedisNode::start_replica_of(test, &primary) else {
        return;
    };
    let wait = Duration::from_millis(300);
    let redis = Redis::builder(primary.url())
        .with_command_timeout(Duration::from_secs(2))
        .with_durable_claims(1, wait)
        .connect()
        .await
        .expect("connects");
    let rt = instance(redis.clone()).await;
    let options = IdempotencyOptions::new().with_lease(Duration::from_secs(10));
    let runs = Arc::new(AtomicU32::new(0));
    let run = |value: u32| {
        let runs = Arc::clone(&runs);
        move || async move {
            runs.fetch_add(1, Ordering::SeqCst);
            Ok::<_, std::io::Error>(value)
        }
    };

    // Acknowledged: on the replica already.
    let fresh = rt
        .idempotency()
        .run_with("pay:1", options.clone(), run(1))
        .await;
    assert_eq!(fresh.unwrap(), IdempotencyOutcome::Fresh(1));
    let state = replica.cli(&["HGET", &record_key("pay:1"), "s"]);
    assert_eq!(
        state.as_deref(),
        Some("c"),
        "the completion is on the replica"
    );

    // The replica stops answering: a claim is refused, nothing runs, the key is released.
    replica.freeze();
    let started = std::time::Instant::now();
    let refused = rt
        .idempotency()
        .run_with("pay:2", options.clone(), run(2))
        .await;
    assert!(refused.as_ref().is_err_and(not_replicated), "{refused:?}");
    assert!(
        started.elapsed() >= wait,
        "refused after waiting for the replica"
    );
    assert_eq!(
        runs.load(Ordering::SeqCst),
        1,
        "the refused claim ran nothing"
    );
    let released = async {
        while primary.cli(&["EXISTS", &record_key("pay:2")]).as_deref() != Some("0") {
            tokio::time::sleep(Duration::from_millis(20)).await;
        }
    };
    tokio::time::timeout(Duration::from_secs(10), released)
        .await
        .expect("the refused claim is released on the primary");
    replica.thaw();
    assert!(primary.wait_replicas_in_sync(1, Duration::from_secs(20)));

    // A completion made while the replica is away is retried until it is back.
    let (started_tx, started_rx) = tokio::sync::oneshot::channel();
    let go = Arc::new(tokio::sync::Notify::new());
    let call = tokio::spawn({
        let (rt, options, go, runs) = (
            rt.clone(),
            options.clone(),
            Arc::clone(&go),
            Arc::clone(&runs),
        );
        async move {
            rt.idempotency()
                .run_with("pay:3", options, move || async move {
                    runs.fetch_add(1, Ordering::SeqCst);
                    started_tx.send(()).unwrap();
                    go.notified().await;
                    Ok::<_, std::io::Error>(3u32)
                })
                .await
        }
    });
    started_rx.await.expect("the function starts");
    replica.freeze();
    go.notify_one();
    let away = Duration::from_millis(1500);
    tokio::time::sleep(away).await;
    assert!(!call.is_finished(), "the completion waits for the replica");
    replica.thaw();
    let outcome = tokio::time::timeout(Duration::from_secs(20), call)
        .await
        .expect("the completion lands once the replica is back")
        .unwrap();
    assert_eq!(outcome.unwrap(), IdempotencyOutcome::Fresh(3));
    assert_eq!(runs.load(Ordering::SeqCst), 2);
    let state = replica.cli(&["HGET", &record_key("pay:3"), "s"]);
    assert_eq!(
        state.as_deref(),
        Some("c"),
        "the completion is on the replica"
    );
    let replay = rt.idempotency().run_with("pay:3", options, run(9)).await;
    assert_eq!(replay.unwrap(), IdempotencyOutcome::Replay(3));
    assert_eq!(redis.stats().breaker.opened, 0, "no breaker fault");
}

/// Bad durable-claims settings are refused at connect, with what is wrong.
#[tokio::test]
async fn durable_claims_with_no_replica_or_no_timeout_are_refused_at_connect() {
    for (replicas, timeout, says) in [
        (0, Duration::from_millis(100), "at least one replica"),
        (1, Duration::ZERO, "greater than zero"),
    ] {
        let connected = Redis::builder("redis://127.0.0.1:1")
            .with_durable_claims(replicas, timeout)
            .connect()
            .await;
        match connected {
            Err(StoreError::Config(message)) => assert!(message.contains(says), "{message}"),
            other => panic!("{other:?}"),
        }
    }
}

/// A replica promoted without the last writes of its primary (asynchronous replication:
/// here it stopped replicating before them) still issues fences above every fence its
/// primary issued: a plain `INCR` would hand out one of them again.
#[tokio::test]
async fn fences_stay_monotonic_across_a_promotion_that_lost_the_last_increments() {
    let test = "fences_stay_monotonic_across_a_promotion_that_lost_the_last_increments";
    let Some(mut primary) = RedisNode::start(test) else {
        return;
    };
    let Some(replica) = RedisNode::start_replica_of(test, &primary) else {
        return;
    };
    let old = Redis::builder(primary.url())
        .connect()
        .await
        .expect("connects");
    let claim = async |redis: &Redis| {
        let token = ClaimToken::new();
        let request = ClaimRequest::new(token, None, LEASE, TTL);
        let ClaimReply::Won { fence } = redis.claim("k", request).await.unwrap() else {
            panic!("a free key is won")
        };
        assert!(redis.release("k", token).await.unwrap());
        fence
    };
    let first = claim(&old).await;
    assert!(primary.wait_replicas_in_sync(1, Duration::from_secs(20)));
    // The replica goes its own way: what the primary does next never reaches it.
    assert_eq!(
        replica.cli(&["REPLICAOF", "NO", "ONE"]).as_deref(),
        Some("OK")
    );
    let mut issued = vec![first];
    for _ in 0..5 {
        let fence = claim(&old).await;
        assert!(
            fence > *issued.last().unwrap(),
            "fences grow: {issued:?} then {fence}"
        );
        issued.push(fence);
    }
    primary.kill();
    let counter = replica.cli(&["GET", "{throttlebeam:k}:in"]).unwrap();
    assert_eq!(
        counter,
        first.to_string(),
        "the promoted node lacks the last fences"
    );
    let new = Redis::builder(replica.url())
        .connect()
        .await
        .expect("connects");
    let after = claim(&new).await;
    assert!(
        issued.iter().all(|&f| after > f),
        "a fence after the promotion ({after}) exceeds every fence before it ({issued:?})"
    );
}
