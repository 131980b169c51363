//! Unit tests of the shared debounce's wire codec and instance ids.

use super::codec::{Codec, LOST, discard_reason, encode_error, encode_value};
use super::instance_id;
use crate::error::Error;
use crate::wire;

#[test]
fn outcomes_travel_as_values_or_typed_errors() {
    let codec = Codec::of::<Vec<String>>();
    let value = vec!["a".to_owned(), "b".to_owned()];
    let decoded = codec.outcome("k", &encode_value(&value)).expect("a value");
    assert_eq!(decoded.downcast_ref::<Vec<String>>(), Some(&value));
    // Another type is refused, not misread.
    assert!(matches!(
        codec.outcome("k", &encode_value(&7_u32)),
        Err(Error::TypeMismatch { .. })
    ));
    // Bytes of no envelope, or of another format version, are refused
    // with a typed error naming why, never misread.
    assert!(matches!(
        codec.outcome("k", b"not bincode"),
        Err(Error::StoreUnavailable { .. })
    ));
    let mut other_version = encode_value(&value);
    assert_eq!(&other_version[..3], b"tb\x02");
    other_version[2] = 3;
    match codec.outcome("k", &other_version) {
        Err(Error::StoreUnavailable { key, source }) => {
            assert_eq!(key, "k");
            assert!(
                matches!(
                    source.downcast_ref::<wire::WireError>(),
                    Some(wire::WireError::UnknownVersion { found: 3, .. })
                ),
                "{source}"
            );
        }
        other => panic!("{other:?}"),
    }
    // Truncated, or with bytes left over: the value is not misread.
    let whole = encode_value(&value);
    for cut in 3..whole.len() {
        assert!(
            matches!(
                codec.outcome("k", &whole[..cut]),
                Err(Error::TypeMismatch { .. })
            ),
            "{cut}"
        );
    }
    let mut padded = whole.clone();
    padded.push(0);
    assert!(matches!(
        codec.outcome("k", &padded),
        Err(Error::TypeMismatch { .. })
    ));
    let failed = Error::failed("k", std::io::Error::other("disk full"));
    match codec.outcome("k", &encode_error(&failed)) {
        Err(Error::Failed { key, source }) => {
            assert_eq!(key, "k");
            assert_eq!(source.to_string(), "disk full");
        }
        other => panic!("{other:?}"),
    }
    let panicked = Error::Panicked {
        key: "k".to_owned(),
        message: "boom".to_owned(),
    };
    assert!(matches!(
        codec.outcome("k", &encode_error(&panicked)),
        Err(Error::Panicked { message, .. }) if message == "boom"
    ));
    for reason in ["cancelled", "dropped at shutdown", LOST, "something new"] {
        let discarded = Error::Discarded {
            key: "k".to_owned(),
            reason: if reason == "something new" {
                "x"
            } else {
                discard_reason(reason)
            },
        };
        let Err(Error::Discarded { reason: got, .. }) =
            codec.outcome("k", &encode_error(&discarded))
        else {
            panic!("a discard");
        };
        if reason == "something new" {
            assert_eq!(got, "discarded on another instance");
        } else {
            assert_eq!(got, reason);
        }
    }
}

/// The outcome enum as releases that wrote version 1 defined it.
#[derive(serde::Serialize)]
#[allow(dead_code, reason = "only the first variant is written")]
enum WireV1 {
    Value { tag: String, bytes: Vec<u8> },
    Unencodable(String),
    Failed(String),
}

/// An outcome as an instance of an earlier release publishes it: version 1.
fn encode_value_v1<T: serde::Serialize>(value: &T) -> Vec<u8> {
    let config = bincode::config::standard();
    let wire = WireV1::Value {
        tag: std::any::type_name::<T>().to_owned(),
        bytes: bincode::serde::encode_to_vec(value, config).unwrap(),
    };
    let mut out = b"tb\x01".to_vec();
    out.extend(bincode::serde::encode_to_vec(&wire, config).unwrap());
    out
}

#[test]
fn outcomes_of_an_earlier_release_still_decode() {
    let codec = Codec::of::<Vec<String>>();
    let value = vec!["a".to_owned(), "é".to_owned()];
    let decoded = codec
        .outcome("k", &encode_value_v1(&value))
        .expect("a value");
    assert_eq!(decoded.downcast_ref::<Vec<String>>(), Some(&value));
    // Version 1 names no fields: another type tag is refused before decoding.
    assert!(matches!(
        codec.outcome("k", &encode_value_v1(&7_u32)),
        Err(Error::TypeMismatch { .. })
    ));
}

#[test]
fn results_that_need_a_self_describing_format_travel_between_instances() {
    #[derive(Debug, Clone, PartialEq, serde::Serialize, serde::Deserialize)]
    #[serde(tag = "type")]
    enum Event {
        Sent {
            #[serde(flatten)]
            meta: std::collections::BTreeMap<String, serde_json::Value>,
        },
        Skipped,
    }
    let value = Event::Sent {
        meta: [("to".to_owned(), serde_json::json!(["a", 1]))].into(),
    };
    let decoded = Codec::of::<Event>()
        .outcome("k", &encode_value(&value))
        .expect("a value");
    assert_eq!(decoded.downcast_ref::<Event>(), Some(&value));
    // Bytes nest as one byte string, not an array of numbers.
    // (300 bytes of UTF-8 at or over 0x80: two bytes each as numbers).
    let sealed = encode_value(&"é".repeat(150));
    assert!(sealed.len() < 400, "{}", sealed.len());
}

#[test]
fn instance_ids_differ() {
    let ids: std::collections::HashSet<_> = (0..1000).map(|_| instance_id()).collect();
    assert_eq!(ids.len(), 1000);
}
