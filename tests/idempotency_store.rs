//! The idempotency store contract: the same claim / complete / release /
//! renew rules and races, checked on the in-process store, a Redis node and
//! a 3-node Redis Cluster (and, in `tests/postgres_store.rs`, on PostgreSQL).
#![cfg(feature = "runtime")]

mod support;

use std::sync::Arc;

use support::contract::{LEASE, contract, request};
use throttlebeam::{
    idempotency::ClaimReply, idempotency::ClaimToken, idempotency::IdempotencyStore,
    idempotency::MemoryIdempotencyStore,
};

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
