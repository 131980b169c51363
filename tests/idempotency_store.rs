//! The idempotency store contract: the same claim / complete / release /
//! renew rules and races, checked on the in-process store, a Redis node and
//! a 3-node Redis Cluster (and, in `tests/postgres_store.rs`, on PostgreSQL).
#![cfg(feature = "runtime")]

mod support;

use std::sync::Arc;
use std::time::Duration;

use support::contract::{LEASE, TTL, contract, request};
use throttlebeam::store::StoreError;
use throttlebeam::{
    idempotency::ClaimReply, idempotency::ClaimToken, idempotency::IdempotencyStore,
    idempotency::MemoryIdempotencyStore, idempotency::StoredResult,
};
use tokio::time::advance;

const SEC: Duration = Duration::from_secs(1);

#[tokio::test]
async fn the_memory_store_keeps_the_contract() {
    contract(Arc::new(MemoryIdempotencyStore::new()), "mem").await;
}

#[tokio::test]
async fn a_full_memory_store_refuses_new_claims_with_a_typed_error() {
    let store = MemoryIdempotencyStore::with_max_keys(2);
    for k in ["a", "b"] {
        assert!(matches!(
            store
                .claim(k, request(ClaimToken::new(), None, LEASE))
                .await
                .unwrap(),
            ClaimReply::Won { .. }
        ));
    }
    let err = store
        .claim("c", request(ClaimToken::new(), None, LEASE))
        .await
        .unwrap_err();
    assert!(
        matches!(err, throttlebeam::store::StoreError::Full { cap: 2 }),
        "{err:?}"
    );
    assert!(err.to_string().contains("cap of 2"), "{err}");
}

/// The fence of a won claim.
fn fence(reply: ClaimReply) -> u64 {
    match reply {
        ClaimReply::Won { fence } => fence,
        reply => panic!("not won: {reply:?}"),
    }
}

fn result(value: Vec<u8>) -> StoredResult {
    StoredResult::new(None, "v", value)
}

#[tokio::test(start_paused = true)]
async fn a_lapsed_lease_still_holds_for_its_owner_until_another_claims() {
    let store = MemoryIdempotencyStore::new();
    let (owner, other) = (ClaimToken::new(), ClaimToken::new());
    let first = fence(store.claim("k", request(owner, None, SEC)).await.unwrap());
    advance(2 * SEC).await;
    // Lapsed, nobody took over: the owner renews it for a whole lease.
    assert!(!store.renew("k", other, SEC).await.unwrap());
    assert!(store.renew("k", owner, SEC).await.unwrap());
    assert_eq!(
        store.claim("k", request(other, None, SEC)).await.unwrap(),
        ClaimReply::Busy { lease_left: SEC }
    );
    // Lapsed again: the owner still releases it, then it is free.
    advance(2 * SEC).await;
    assert!(!store.release("k", other).await.unwrap());
    assert!(store.release("k", owner).await.unwrap());
    assert_eq!(
        store.len(),
        1,
        "kept, free, as the key's fence, until swept"
    );
    assert_eq!(store.sweep(), 0);
    // Lapsed after a new claim: the owner still completes it, and then
    // nobody else does.
    let second = fence(store.claim("k", request(owner, None, SEC)).await.unwrap());
    assert!(second > first);
    advance(2 * SEC).await;
    assert!(
        store
            .complete("k", owner, &result(vec![1]), TTL)
            .await
            .unwrap()
    );
    assert!(
        !store
            .complete("k", other, &result(vec![2]), TTL)
            .await
            .unwrap()
    );
    assert_eq!(
        store.claim("k", request(other, None, SEC)).await.unwrap(),
        ClaimReply::Completed(result(vec![1]))
    );
    // Once another claims a lapsed key, its owner is fenced off.
    let third = fence(store.claim("j", request(owner, None, SEC)).await.unwrap());
    advance(2 * SEC).await;
    let fourth = fence(store.claim("j", request(other, None, SEC)).await.unwrap());
    assert!(fourth > third && third > second);
    assert!(!store.renew("j", owner, SEC).await.unwrap());
    assert!(!store.release("j", owner).await.unwrap());
    assert!(
        !store
            .complete("j", owner, &result(vec![3]), TTL)
            .await
            .unwrap()
    );
    assert_eq!(
        store.claim("j", request(owner, None, SEC)).await.unwrap(),
        ClaimReply::Busy { lease_left: SEC }
    );
    // A completion of a key nobody ever claimed is stored too.
    assert!(
        store
            .complete("never", owner, &result(vec![4]), TTL)
            .await
            .unwrap()
    );
    assert_eq!(store.len(), 3);
}

#[tokio::test(start_paused = true)]
async fn keys_in_flight_survive_the_byte_budget() {
    // "r:0" + "v" + 1,000 bytes + 200 for the entry.
    const ONE: usize = 3 + 1 + 1_000 + 200;
    let store = MemoryIdempotencyStore::new().with_max_bytes(2 * ONE);
    let hour = 3600 * SEC;
    // Claimed before any result, so the oldest entries of all.
    let holders: Vec<ClaimToken> = (0..5).map(|_| ClaimToken::new()).collect();
    for (i, holder) in holders.iter().enumerate() {
        fence(
            store
                .claim(&format!("f:{i}"), request(*holder, None, hour))
                .await
                .unwrap(),
        );
    }
    for i in 0..10 {
        let (key, owner) = (format!("r:{i}"), ClaimToken::new());
        fence(store.claim(&key, request(owner, None, hour)).await.unwrap());
        // Renewals on the way move nothing in flight into the budget's reach.
        assert!(store.renew("f:0", holders[0], hour).await.unwrap());
        let value = result(vec![0; 1_000]);
        assert!(store.complete(&key, owner, &value, hour).await.unwrap());
        advance(SEC).await;
    }
    assert_eq!(
        (store.len(), store.bytes(), store.evictions()),
        (5 + 2, 2 * ONE, 8)
    );
    // A result heavier than the whole budget is evicted at once, with
    // every other result, and still nothing in flight.
    let owner = ClaimToken::new();
    fence(
        store
            .claim("r:x", request(owner, None, hour))
            .await
            .unwrap(),
    );
    let heavy = result(vec![0; 3 * ONE]);
    assert!(store.complete("r:x", owner, &heavy, hour).await.unwrap());
    assert_eq!((store.len(), store.bytes(), store.evictions()), (5, 0, 11));
    let other = ClaimToken::new();
    for i in 0..5 {
        let reply = store
            .claim(&format!("f:{i}"), request(other, None, hour))
            .await
            .unwrap();
        assert!(matches!(reply, ClaimReply::Busy { .. }), "f:{i}: {reply:?}");
    }
    // Their owners complete them, and the budget applies to those results.
    for (i, holder) in holders.iter().enumerate() {
        let key = format!("f:{i}");
        let value = result(vec![0; 1_000]);
        assert!(store.complete(&key, *holder, &value, hour).await.unwrap());
        advance(SEC).await;
    }
    assert_eq!(
        (store.len(), store.bytes(), store.evictions()),
        (2, 2 * ONE, 14)
    );
}

#[tokio::test(start_paused = true)]
async fn a_full_store_drops_its_expired_keys_before_refusing_a_new_one() {
    let store = MemoryIdempotencyStore::with_max_keys(3);
    let claim = |key: &'static str, lease: Duration| {
        let store = store.clone();
        async move {
            store
                .claim(key, request(ClaimToken::new(), None, lease))
                .await
        }
    };
    let a = ClaimToken::new();
    fence(store.claim("a", request(a, None, SEC)).await.unwrap());
    fence(claim("b", 10 * SEC).await.unwrap());
    // A completed result counts as a key.
    let c = ClaimToken::new();
    fence(store.claim("c", request(c, None, SEC)).await.unwrap());
    assert!(
        store
            .complete("c", c, &result(vec![1]), 10 * SEC)
            .await
            .unwrap()
    );
    let full = claim("d", LEASE).await.unwrap_err();
    assert!(matches!(full, StoreError::Full { cap: 3 }), "{full:?}");
    // "a" expired but not swept: still counted, and dropped for a new key.
    advance(SEC).await;
    assert_eq!(store.len(), 3);
    fence(claim("d", LEASE).await.unwrap());
    assert_eq!(store.len(), 3);
    assert!(!store.renew("a", a, SEC).await.unwrap(), "a was dropped");
    // Nothing else expired: full.
    let full = claim("e", LEASE).await.unwrap_err();
    assert!(matches!(full, StoreError::Full { cap: 3 }), "{full:?}");
    // An expired key is no new key: taken over at the cap, never refused.
    advance(9 * SEC).await;
    fence(claim("b", LEASE).await.unwrap());
    assert_eq!(store.len(), 3, "c expired, still counted");
    fence(claim("e", LEASE).await.unwrap());
    assert_eq!(store.len(), 3);
    assert!(matches!(
        claim("f", LEASE).await,
        Err(StoreError::Full { cap: 3 })
    ));
}

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn racing_claims_of_new_keys_never_pass_the_cap() {
    const CAP: usize = 64;
    let store = MemoryIdempotencyStore::with_max_keys(CAP);
    let tasks: Vec<_> = (0..8)
        .map(|task| {
            let store = store.clone();
            tokio::spawn(async move {
                let mut won = 0;
                for i in 0..100 {
                    let key = format!("{task}:{i}");
                    match store
                        .claim(&key, request(ClaimToken::new(), None, LEASE))
                        .await
                    {
                        Ok(ClaimReply::Won { .. }) => won += 1,
                        Err(StoreError::Full { cap: CAP }) => {}
                        reply => panic!("{key}: {reply:?}"),
                    }
                }
                won
            })
        })
        .collect();
    let mut won = 0;
    for task in tasks {
        won += task.await.unwrap();
    }
    assert_eq!((won, store.len()), (CAP, CAP));
}

#[tokio::test(start_paused = true)]
async fn a_sweep_drops_expired_keys_and_debug_shows_the_counts() {
    let store = MemoryIdempotencyStore::with_max_keys(10).with_max_bytes(10_000);
    fence(
        store
            .claim("a", request(ClaimToken::new(), None, SEC))
            .await
            .unwrap(),
    );
    let b = ClaimToken::new();
    fence(store.claim("b", request(b, None, LEASE)).await.unwrap());
    assert!(
        store
            .complete("b", b, &result(vec![0; 10]), SEC)
            .await
            .unwrap()
    );
    fence(
        store
            .claim("c", request(ClaimToken::new(), None, LEASE))
            .await
            .unwrap(),
    );
    // "b" + "v" + 10 bytes + 200.
    assert_eq!(
        format!("{store:?}"),
        "MemoryIdempotencyStore { keys: 3, bytes: 212, cap: 10, max_bytes: 10000 }"
    );
    advance(SEC).await;
    assert_eq!((store.len(), store.bytes()), (3, 212), "not swept yet");
    assert_eq!(store.sweep(), 1);
    assert_eq!((store.len(), store.bytes(), store.evictions()), (1, 0, 0));
}

#[cfg(feature = "redis")]
mod redis {
    use super::*;
    use crate::support::redis::{RedisCluster, RedisNode};
    use throttlebeam::store::Redis;

    #[tokio::test]
    async fn a_redis_node_keeps_the_contract() {
        let Some(node) = RedisNode::start("a_redis_node_keeps_the_contract") else {
            return;
        };
        let redis = Redis::builder(node.url())
            .connect()
            .await
            .expect("connects");
        contract(Arc::new(redis), "node").await;
    }

    #[tokio::test]
    async fn a_redis_cluster_keeps_the_contract() {
        let Some(cluster) = RedisCluster::start("a_redis_cluster_keeps_the_contract") else {
            return;
        };
        let redis = Redis::cluster(cluster.urls())
            .connect()
            .await
            .expect("connects");
        contract(Arc::new(redis), "cluster").await;
    }
}
