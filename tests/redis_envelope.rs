//! The versioned wire format on a real Redis (issue 30 item 13, issue 48):
//! what one instance stores for another is in an envelope with a format
//! version (2, MessagePack, written; 1, bincode, still read, so results
//! stored before an upgrade replay after it), and a value in a version this
//! build does not read is refused with a typed error, never misread and
//! never run again.
#![cfg(feature = "redis")]

mod support;

use std::sync::Arc;
use std::sync::atomic::{AtomicUsize, Ordering};
use std::time::Duration;

use support::redis::RedisNode;
use throttlebeam::store::Redis;
use throttlebeam::{Error, IdempotencyOutcome, Runtime, store::WireError};

async fn instance(node: &RedisNode) -> Runtime {
    let redis = Redis::builder(node.url())
        .with_command_timeout(Duration::from_secs(2))
        .connect()
        .await
        .expect("connects");
    Runtime::builder()
        .with_redis(redis)
        .start()
        .await
        .expect("runtime starts")
}

/// The record of the unscoped idempotency key `key` (see the Redis claims
/// module: `{prefix:<scoped key>}:i`, the scoped form of an unscoped key
/// being `-key`).
fn record(key: &str) -> String {
    format!("{{throttlebeam:-{key}}}:i")
}

#[tokio::test]
async fn a_result_stored_in_another_format_version_is_refused_not_misread() {
    let Some(node) = RedisNode::start("a_result_stored_in_another_format_version_is_refused")
    else {
        return;
    };
    let (a, b) = (instance(&node).await, instance(&node).await);
    let runs = Arc::new(AtomicUsize::new(0));
    let run = |value: u64| {
        let runs = Arc::clone(&runs);
        move || async move {
            runs.fetch_add(1, Ordering::SeqCst);
            Ok::<_, std::io::Error>(value)
        }
    };

    // This build's own results: enveloped, version 2 (MessagePack: 7 is
    // one byte), and replayed elsewhere.
    let fresh = a.idempotency().run("mine", run(7)).await.unwrap();
    assert_eq!(fresh, IdempotencyOutcome::Fresh(7));
    let stored = node.cli(&["HGET", &record("mine"), "v"]).unwrap();
    assert_eq!(stored.as_bytes(), b"tb\x02\x07");
    let replay = b.idempotency().run("mine", run(8)).await.unwrap();
    assert_eq!(replay, IdempotencyOutcome::Replay(7));
    assert_eq!(runs.load(Ordering::SeqCst), 1);

    // A completed record a build of format version 3 wrote: its payload
    // would read back as a plausible u64 (7) if the version were ignored.
    let theirs = record("theirs");
    let written = node.cli(&[
        "HSET",
        &theirs,
        "s",
        "c",
        "t",
        "x",
        "fp",
        "",
        "v",
        "tb\u{3}\u{7}",
        "ty",
        "u64",
    ]);
    assert_eq!(written.as_deref(), Some("5"));
    for instance in [&a, &b] {
        match instance.idempotency().run("theirs", run(9)).await {
            Err(Error::StoreUnavailable { key, source }) => {
                assert_eq!(key, "theirs");
                assert!(
                    matches!(
                        source.downcast_ref::<WireError>(),
                        Some(WireError::UnknownVersion {
                            found: 3,
                            supported: 2
                        })
                    ),
                    "{source}"
                );
            }
            other => panic!("{other:?}"),
        }
    }
    assert_eq!(runs.load(Ordering::SeqCst), 1, "refused, not run again");
    // The record is left for the build that can read it.
    assert_eq!(
        node.cli(&["HGET", &theirs, "v"]).as_deref(),
        Some("tb\u{3}\u{7}")
    );

    // A record written before envelopes (bare bincode) is refused the same way.
    node.cli(&[
        "HSET",
        &record("bare"),
        "s",
        "c",
        "t",
        "x",
        "fp",
        "",
        "v",
        "\u{7}",
        "ty",
        "u64",
    ])
    .unwrap();
    match a.idempotency().run("bare", run(10)).await {
        Err(Error::StoreUnavailable { source, .. }) => {
            assert!(
                matches!(
                    source.downcast_ref::<WireError>(),
                    Some(WireError::NotEnveloped)
                ),
                "{source}"
            );
        }
        other => panic!("{other:?}"),
    }
    assert_eq!(runs.load(Ordering::SeqCst), 1);
}

/// Results an earlier release stored (version 1, bincode, tagged with the
/// Rust type name) replay after the upgrade; one of another type is still
/// refused by its tag, since bincode names no fields.
#[tokio::test]
async fn results_stored_in_version_1_before_an_upgrade_still_replay() {
    let Some(node) = RedisNode::start("results_stored_in_version_1_before_an_upgrade") else {
        return;
    };
    let rt = instance(&node).await;
    let runs = Arc::new(AtomicUsize::new(0));
    let old = |key: &str, tag: &str, value: &str| {
        let written = node.cli(&[
            "HSET",
            &record(key),
            "s",
            "c",
            "t",
            "x",
            "fp",
            "",
            "v",
            value,
            "ty",
            tag,
        ]);
        assert_eq!(written.as_deref(), Some("5"));
    };
    // bincode 2 `standard()`: 7 as one varint byte; a string as its length, then its bytes.
    old("count", "u64", "tb\u{1}\u{7}");
    old("note", std::any::type_name::<String>(), "tb\u{1}\u{4}paid");
    let counted = |value: u64| {
        let runs = Arc::clone(&runs);
        move || async move {
            runs.fetch_add(1, Ordering::SeqCst);
            Ok::<_, std::io::Error>(value)
        }
    };
    let replay = rt.idempotency().run("count", counted(9)).await.unwrap();
    assert_eq!(replay, IdempotencyOutcome::Replay(7));
    let note = rt
        .idempotency()
        .run("note", || async { Ok::<_, std::io::Error>(String::new()) })
        .await
        .unwrap();
    assert_eq!(note, IdempotencyOutcome::Replay("paid".to_owned()));
    // The u64's byte would read back as a u32 if the tag were ignored.
    let other = rt
        .idempotency()
        .run("count", || async { Ok::<_, std::io::Error>(1_u32) })
        .await;
    assert!(
        matches!(other, Err(Error::TypeMismatch { .. })),
        "{other:?}"
    );
    assert_eq!(runs.load(Ordering::SeqCst), 0);
}
