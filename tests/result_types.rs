//! Every result type round-trips through every store as it does in memory
//! (issue 48, "Results that do not come back"): a run on one runtime is
//! `Fresh`, and a second runtime sharing the store replays an equal value,
//! for the serde forms bincode could store but never read back
//! (`serde_json::Value`, untagged and internally tagged enums, `flatten`,
//! `skip_serializing_if`) and the rest (adjacently tagged enums, 128-bit
//! integers, NaN and infinities, bytes, maps with keys that are not
//! strings, a 1 MiB result nested 50 deep). On the memory runtime, a
//! `MemoryIdempotencyStore`, a Redis node, a Redis Cluster and PostgreSQL.
//!
//! Beside them: a key recorded as "ran, result not storable" replays that
//! error from every store instead of running again; a type moved to another
//! module still replays its results; and a result type that cannot come
//! back fails a transactional run before anything is committed.

mod support;

use std::collections::{BTreeMap, HashMap};
use std::fmt::Debug;
use std::net::IpAddr;
use std::time::Duration;

use bytes::Bytes;
use serde::de::DeserializeOwned;
use serde::{Deserialize, Serialize};
use serde_json::json;
use support::{Oops, Runs};
use throttlebeam::idempotency::NotRecorded;
use throttlebeam::idempotency::{
    ClaimReply, ClaimRequest, ClaimToken, IdempotencyStore, MemoryIdempotencyStore, StoredResult,
};
use throttlebeam::store::WireError;
use throttlebeam::{Error, IdempotencyOutcome, Runtime};

// ---------------------------------------------------------------------------
// The result types.

#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(untagged)]
enum Untagged {
    Code(u16),
    Message { text: String, retry: bool },
    List(Vec<String>),
}

#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(tag = "type", rename_all = "snake_case")]
enum Internal {
    Charged {
        amount: u64,
        currency: String,
        // Written in its human-readable form: the compact one would not
        // read back inside a tagged enum.
        from: IpAddr,
    },
    Refused {
        reason: String,
    },
    Pending,
}

#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(tag = "t", content = "c")]
enum Adjacent {
    Amount(i64),
    Pair(u8, String),
    Empty,
    Named { ratio: f32 },
}

#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
struct Meta {
    created: String,
    tags: Vec<String>,
}

#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
struct Flattened {
    id: u64,
    #[serde(flatten)]
    meta: Meta,
    #[serde(flatten)]
    extra: HashMap<String, serde_json::Value>,
}

fn is_zero(n: &u64) -> bool {
    *n == 0
}

#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
struct Sparse {
    #[serde(skip_serializing_if = "Option::is_none")]
    note: Option<String>,
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    items: Vec<u32>,
    #[serde(default, skip_serializing_if = "is_zero")]
    count: u64,
}

#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
struct Wide {
    max: u128,
    min: i128,
    some: u128,
    minus_one: i128,
}

/// Floats compared bit for bit, so that NaN equals itself.
#[derive(Debug, Clone, Serialize, Deserialize)]
struct Floats(Vec<f64>);

impl PartialEq for Floats {
    fn eq(&self, other: &Self) -> bool {
        self.0.len() == other.0.len()
            && self
                .0
                .iter()
                .zip(&other.0)
                .all(|(a, b)| a.to_bits() == b.to_bits())
    }
}

#[derive(Debug, Clone, Copy, PartialEq, Eq, PartialOrd, Ord, Serialize, Deserialize)]
enum Kind {
    Card,
    Bank,
}

#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
struct Keyed {
    by_id: HashMap<u64, String>,
    by_pair: BTreeMap<(i32, bool), Vec<u8>>,
    by_kind: BTreeMap<Kind, u8>,
}

/// A 1 MiB result nested 50 deep.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
struct Node {
    depth: u32,
    label: String,
    blob: Bytes,
    json: serde_json::Value,
    child: Option<Box<Node>>,
}

fn nested(depth: u32) -> Node {
    let mut node = None;
    for d in (0..depth).rev() {
        node = Some(Box::new(Node {
            depth: d,
            label: format!("level {d}"),
            blob: Bytes::from(vec![d as u8; 20 << 10]),
            json: json!({"d": d, "list": [d, {"x": null}], "ok": d % 2 == 0}),
            child: node,
        }));
    }
    *node.expect("at least one level")
}

/// Where a type lived before it moved: same fields, another path.
mod before {
    #[derive(Debug, Clone, PartialEq, serde::Serialize, serde::Deserialize)]
    pub(crate) struct Receipt {
        pub(crate) id: u64,
        pub(crate) note: String,
    }
}

mod after {
    #[derive(Debug, Clone, PartialEq, serde::Serialize, serde::Deserialize)]
    pub(crate) struct Receipt {
        pub(crate) id: u64,
        pub(crate) note: String,
    }
}

// ---------------------------------------------------------------------------
// The checks.

/// `value` run on `a` (fresh), then replayed on `b`, equal; the function
/// runs once.
async fn same<T>(a: &Runtime, b: &Runtime, key: &str, value: T)
where
    T: Serialize + DeserializeOwned + Clone + PartialEq + Debug + Send + Sync + 'static,
{
    let runs = Runs::default();
    let run = |value: T| {
        let runs = runs.clone();
        move || async move {
            runs.hit();
            Ok::<_, Oops>(value)
        }
    };
    let fresh = a
        .idempotency()
        .run(key, run(value.clone()))
        .await
        .unwrap_or_else(|e| panic!("{key}: {e}: {:?}", std::error::Error::source(&e)));
    assert_eq!(fresh, IdempotencyOutcome::Fresh(value.clone()), "{key}");
    let replay = b
        .idempotency()
        .run(key, run(value.clone()))
        .await
        .unwrap_or_else(|e| panic!("{key}: {e}: {:?}", std::error::Error::source(&e)));
    assert_eq!(replay, IdempotencyOutcome::Replay(value), "{key}");
    assert_eq!(runs.get(), 1, "{key}");
}

/// Every type, fresh on `a` and replayed on `b`.
async fn every_type_round_trips(a: &Runtime, b: &Runtime) {
    same(
        a,
        b,
        "json",
        json!({
            "id": "ch_1", "amount": 1250, "negative": -3, "ratio": 0.25, "big": u64::MAX,
            "refunded": false, "tags": ["a", {"b": null}], "nested": {"deep": [[1], [2, 3]]}
        }),
    )
    .await;
    same(a, b, "untagged:code", Untagged::Code(404)).await;
    same(
        a,
        b,
        "untagged:message",
        Untagged::Message {
            text: "card declined".into(),
            retry: true,
        },
    )
    .await;
    same(
        a,
        b,
        "untagged:list",
        Untagged::List(vec!["x".into(), "y".into()]),
    )
    .await;
    same(
        a,
        b,
        "internal:charged",
        Internal::Charged {
            amount: 1250,
            currency: "EUR".into(),
            from: "2001:db8::7".parse().unwrap(),
        },
    )
    .await;
    same(
        a,
        b,
        "internal:refused",
        Internal::Refused {
            reason: "fraud".into(),
        },
    )
    .await;
    same(a, b, "internal:pending", Internal::Pending).await;
    same(a, b, "adjacent:amount", Adjacent::Amount(-5)).await;
    same(a, b, "adjacent:pair", Adjacent::Pair(1, "one".into())).await;
    same(a, b, "adjacent:empty", Adjacent::Empty).await;
    same(a, b, "adjacent:named", Adjacent::Named { ratio: 0.5 }).await;
    same(
        a,
        b,
        "flatten",
        Flattened {
            id: 9,
            meta: Meta {
                created: "2026-01-01".into(),
                tags: vec!["t".into()],
            },
            extra: HashMap::from([
                ("source".to_owned(), json!("api")),
                ("attempt".to_owned(), json!(2)),
            ]),
        },
    )
    .await;
    same(
        a,
        b,
        "sparse:empty",
        Sparse {
            note: None,
            items: vec![],
            count: 0,
        },
    )
    .await;
    same(
        a,
        b,
        "sparse:full",
        Sparse {
            note: Some("n".into()),
            items: vec![1, 2],
            count: 3,
        },
    )
    .await;
    same(
        a,
        b,
        "wide",
        Wide {
            max: u128::MAX,
            min: i128::MIN,
            some: (1 << 100) + 7,
            minus_one: -1,
        },
    )
    .await;
    same(a, b, "u128", u128::MAX - 1).await;
    same(
        a,
        b,
        "floats",
        Floats(vec![
            f64::NAN,
            f64::INFINITY,
            f64::NEG_INFINITY,
            -0.0,
            f64::MIN_POSITIVE,
            f64::MAX,
        ]),
    )
    .await;
    same(a, b, "nan", Floats(vec![-f64::NAN])).await;
    let body: Vec<u8> = (0..1024).map(|i| i as u8).collect();
    same(a, b, "bytes", Bytes::from(body)).await;
    same(
        a,
        b,
        "keys",
        Keyed {
            by_id: HashMap::from([(1, "one".into()), (u64::MAX, "max".into())]),
            by_pair: BTreeMap::from([((-1, true), vec![1]), ((7, false), vec![])]),
            by_kind: BTreeMap::from([(Kind::Card, 1), (Kind::Bank, 2)]),
        },
    )
    .await;
    let large = nested(50);
    let size = serde_json::to_vec(&large).map(|v| v.len()).unwrap_or(0);
    assert!(size > 1 << 20, "over 1 MiB as JSON: {size}");
    same(a, b, "large", large).await;
}

/// A type that moved to another module between two builds still replays
/// what the first build stored (a store shared by two runtimes; in one
/// process, two types).
async fn a_moved_type_replays_and_another_type_is_refused(a: &Runtime, b: &Runtime) {
    let stored = before::Receipt {
        id: 3,
        note: "paid".into(),
    };
    let fresh = a
        .idempotency()
        .run("moved", {
            let stored = stored.clone();
            || async move { Ok::<_, Oops>(stored) }
        })
        .await
        .unwrap();
    assert!(fresh.is_fresh());
    let replay = b
        .idempotency()
        .run("moved", || async {
            Ok::<_, Oops>(after::Receipt {
                id: 0,
                note: String::new(),
            })
        })
        .await
        .unwrap();
    assert_eq!(
        replay,
        IdempotencyOutcome::Replay(after::Receipt {
            id: 3,
            note: "paid".into()
        })
    );
    let other = b
        .idempotency()
        .run("moved", || async { Ok::<_, Oops>(vec![1_u64]) })
        .await
        .unwrap_err();
    assert!(matches!(other, Error::TypeMismatch { .. }), "{other:?}");
    assert_eq!(
        other.to_string(),
        "key \"moved\" holds a result of another type than the one asked for"
    );
}

/// Records, through `store`'s own claim and completion, that the unscoped
/// key `key` ran but its result could not be stored (the reserved format
/// version 255, then why).
async fn record_unstorable<S: IdempotencyStore>(store: &S, key: &str, cause: &str) {
    let full = format!("-{key}");
    let (lease, ttl) = (Duration::from_secs(30), Duration::from_secs(600));
    let owner = ClaimToken::new();
    let won = store
        .claim(&full, ClaimRequest::new(owner, None, lease, ttl))
        .await
        .unwrap();
    assert!(matches!(won, ClaimReply::Won { .. }), "{won:?}");
    let mut bytes = b"tb\xff".to_vec();
    bytes.extend_from_slice(cause.as_bytes());
    let result = StoredResult::new(None, std::any::type_name::<before::Receipt>(), bytes);
    assert!(store.complete(&full, owner, &result, ttl).await.unwrap());
}

/// Every runtime sharing the store gets [`Error::Unstorable`] for a key
/// recorded as unstorable, whatever type it asks for, and runs nothing.
async fn an_unstorable_record_replays_its_error(runtimes: [&Runtime; 2]) {
    let cause = "a value of type before::Receipt does not decode from its own encoding: \
                 missing field `note`";
    let runs = Runs::default();
    for rt in runtimes {
        for asked in 0..2 {
            let runs = runs.clone();
            let e = if asked == 0 {
                rt.idempotency()
                    .run("unstorable", move || async move {
                        runs.hit();
                        Ok::<_, Oops>(before::Receipt {
                            id: 1,
                            note: String::new(),
                        })
                    })
                    .await
                    .unwrap_err()
            } else {
                rt.idempotency()
                    .run("unstorable", move || async move {
                        runs.hit();
                        Ok::<_, Oops>(1_u8)
                    })
                    .await
                    .unwrap_err()
            };
            let Error::Unstorable { key, source } = &e else {
                panic!("{e:?}");
            };
            assert_eq!(key, "unstorable");
            assert_eq!(
                e.to_string(),
                "idempotency key \"unstorable\" ran, but its result could not be stored"
            );
            assert!(
                matches!(source.downcast_ref::<WireError>(), Some(WireError::Unstorable { cause: c }) if c == cause),
                "{source:?}"
            );
        }
    }
    assert_eq!(runs.get(), 0, "the key ran once already: never again");
}

/// A result type whose encoding does not read back (a field skipped when serialized, with no
/// default): its first run is told it was not recorded, with its value; the key is recorded
/// as run, so every later call gets [`Error::Unstorable`] and nothing runs again (I16).
async fn a_result_that_cannot_come_back_runs_once_and_says_so(a: &Runtime, b: &Runtime) {
    #[derive(Debug, Clone, PartialEq, serde::Serialize, serde::Deserialize)]
    struct Lossy {
        id: u64,
        #[serde(skip_serializing)]
        secret: String,
    }
    let runs = Runs::default();
    let lossy = |runs: &Runs| {
        let runs = runs.clone();
        move || async move {
            runs.hit();
            Ok::<_, Oops>(Lossy {
                id: 7,
                secret: "s".to_owned(),
            })
        }
    };
    let first = a.idempotency().run("lossy", lossy(&runs)).await.unwrap();
    let IdempotencyOutcome::Unrecorded(value, why) = first else {
        panic!("{first:?}");
    };
    assert_eq!(value.id, 7, "the value ran here and is handed back");
    assert_eq!(why, NotRecorded::Unstorable);
    for rt in [a, b] {
        let again = rt.idempotency().run("lossy", lossy(&runs)).await;
        let Err(e @ Error::Unstorable { .. }) = &again else {
            panic!("{again:?}");
        };
        let cause = std::error::Error::source(e).map(ToString::to_string);
        assert!(
            cause.as_deref().is_some_and(|c| c.contains("secret")),
            "the cause names what is missing: {cause:?}"
        );
    }
    assert_eq!(runs.get(), 1, "ran once, never again");
}

// ---------------------------------------------------------------------------
// The stores.

#[tokio::test]
async fn every_result_type_round_trips_on_the_memory_runtime() {
    let rt = Runtime::builder().start().await.expect("runtime starts");
    every_type_round_trips(&rt, &rt).await;
    a_result_that_cannot_come_back_runs_once_and_says_so(&rt, &rt).await;
}

#[tokio::test]
async fn every_result_type_round_trips_through_a_shared_memory_store() {
    let store = MemoryIdempotencyStore::new();
    let start = || async {
        Runtime::builder()
            .with_idempotency_store(store.clone())
            .start()
            .await
            .expect("runtime starts")
    };
    let (a, b) = (start().await, start().await);
    every_type_round_trips(&a, &b).await;
    a_moved_type_replays_and_another_type_is_refused(&a, &b).await;
    a_result_that_cannot_come_back_runs_once_and_says_so(&a, &b).await;
    record_unstorable(&store, "unstorable", "a value of type before::Receipt does not decode from its own encoding: missing field `note`").await;
    an_unstorable_record_replays_its_error([&a, &b]).await;
}

#[cfg(feature = "redis")]
mod redis {
    use super::*;
    use support::redis::{RedisCluster, RedisNode};
    use throttlebeam::store::Redis;

    /// A connection with room for a 1 MiB value in a debug build on a
    /// loaded machine.
    async fn connect(urls: &[String], cluster: bool) -> Redis {
        if cluster {
            Redis::cluster(urls.to_vec())
        } else {
            Redis::builder(urls[0].clone())
        }
        .with_command_timeout(Duration::from_secs(10))
        .connect()
        .await
        .expect("connects")
    }

    async fn instance(redis: Redis) -> Runtime {
        Runtime::builder()
            .with_redis(redis)
            .start()
            .await
            .expect("runtime starts")
    }

    async fn each(urls: &[String], cluster: bool) {
        let a = instance(connect(urls, cluster).await).await;
        let b = instance(connect(urls, cluster).await).await;
        every_type_round_trips(&a, &b).await;
        a_moved_type_replays_and_another_type_is_refused(&a, &b).await;
        a_result_that_cannot_come_back_runs_once_and_says_so(&a, &b).await;
        let store = connect(urls, cluster).await;
        record_unstorable(&store, "unstorable", "a value of type before::Receipt does not decode from its own encoding: missing field `note`").await;
        an_unstorable_record_replays_its_error([&a, &b]).await;
    }

    #[tokio::test]
    async fn every_result_type_round_trips_through_a_redis_node() {
        let Some(node) = RedisNode::start("every_result_type_round_trips_through_a_redis_node")
        else {
            return;
        };
        each(&[node.url()], false).await;
    }

    #[tokio::test]
    async fn every_result_type_round_trips_through_a_redis_cluster() {
        let Some(cluster) =
            RedisCluster::start("every_result_type_round_trips_through_a_redis_cluster")
        else {
            return;
        };
        each(&cluster.urls(), true).await;
    }
}

#[cfg(feature = "postgres")]
mod postgres {
    use super::*;
    use support::postgres::PgSchema;
    use throttlebeam::IdempotencyOptions;
    use throttlebeam::idempotency::postgres::PostgresStore;

    async fn instance(store: PostgresStore) -> Runtime {
        Runtime::builder()
            .with_postgres(store)
            .start()
            .await
            .expect("runtime starts")
    }

    #[tokio::test]
    async fn every_result_type_round_trips_through_postgres() {
        let Some(schema) = PgSchema::create("every_result_type_round_trips").await else {
            return;
        };
        let (one, two) = (schema.store().await, schema.store().await);
        let a = instance(one.clone()).await;
        let b = instance(two).await;
        every_type_round_trips(&a, &b).await;
        a_moved_type_replays_and_another_type_is_refused(&a, &b).await;
        a_result_that_cannot_come_back_runs_once_and_says_so(&a, &b).await;
        record_unstorable(&one, "unstorable", "a value of type before::Receipt does not decode from its own encoding: missing field `note`").await;
        an_unstorable_record_replays_its_error([&a, &b]).await;
    }

    /// A field skipped when serialized, with no default: it encodes, but
    /// never decodes.
    #[derive(Debug, Clone, Serialize, Deserialize)]
    struct Secret {
        id: u8,
        #[serde(skip_serializing)]
        #[allow(dead_code, reason = "skipped when serialized: what the test is about")]
        token: String,
    }

    /// A transactional run whose result could never come back fails before
    /// it commits (its effects roll back with it), naming the type and the
    /// cause; a retry is not told "another type", it fails the same way.
    #[tokio::test]
    async fn a_result_that_cannot_come_back_fails_a_transaction_before_it_commits() {
        let Some(schema) = PgSchema::create("a_result_that_cannot_come_back").await else {
            return;
        };
        let store = schema.store().await;
        let runs = Runs::default();
        for _ in 0..2 {
            let runs = runs.clone();
            let e = store
                .run_in_transaction("secret", IdempotencyOptions::new(), move |_tx| {
                    Box::pin(async move {
                        runs.hit();
                        Ok::<_, Oops>(Secret {
                            id: 1,
                            token: "t".into(),
                        })
                    })
                })
                .await
                .unwrap_err();
            let mut chain = e.to_string();
            let mut cause = std::error::Error::source(&e);
            while let Some(c) = cause {
                chain.push_str(": ");
                chain.push_str(&c.to_string());
                cause = c.source();
            }
            assert!(
                chain.contains(&format!(
                    "a value of type {} does not decode from its own encoding: missing field `token`",
                    std::any::type_name::<Secret>()
                )),
                "{chain}"
            );
            assert!(!matches!(e, Error::TypeMismatch { .. }), "{e:?}");
        }
        assert_eq!(runs.get(), 2, "nothing was committed: the retry runs");
        let admin = schema.client().await;
        let rows: i64 = admin
            .query_one(
                &format!("SELECT count(*) FROM {} WHERE done", schema.table()),
                &[],
            )
            .await
            .unwrap()
            .get(0);
        assert_eq!(rows, 0, "no result was stored");
    }
}
