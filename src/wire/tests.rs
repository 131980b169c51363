//! Unit tests of the envelope: both versions, the reserved one, and bytes
//! that are not what they claim.

use std::collections::{BTreeMap, HashMap};
use std::net::IpAddr;

use serde::{Deserialize, Serialize};

use super::*;

#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
struct Charge {
    id: u64,
    note: String,
    parts: Vec<u32>,
}

fn charge() -> Charge {
    Charge {
        id: 7,
        note: "paid".to_owned(),
        parts: vec![1, 2, 3],
    }
}

/// An envelope of version 1, as earlier releases wrote it.
fn sealed_v1<T: Serialize>(value: &T) -> Vec<u8> {
    let mut out = b"tb\x01".to_vec();
    out.extend(bincode::serde::encode_to_vec(value, bincode::config::standard()).unwrap());
    out
}

#[test]
fn a_value_round_trips_in_a_version_2_envelope() {
    let sealed = seal(&charge()).unwrap();
    assert_eq!(&sealed[..3], b"tb\x02");
    assert_eq!(open::<Charge>(&sealed).unwrap(), charge());
    // The payload is MessagePack with the struct as a map of its field names.
    let plain = rmp_serde::to_vec_named(&charge()).unwrap();
    assert_eq!(&sealed[3..], &plain[..]);
    assert_eq!(sealed[3], 0x83, "a map of three entries");
    assert_eq!(encode(&charge()).unwrap(), plain);
    assert_eq!(encoded_len(&charge()).unwrap(), plain.len());
}

#[test]
fn a_version_1_envelope_still_decodes() {
    let old = sealed_v1(&charge());
    let payload = unseal(&old).unwrap();
    assert_eq!(payload.format, Format::Bincode);
    assert!(!payload.format.is_self_describing());
    assert_eq!(open::<Charge>(&old).unwrap(), charge());
    assert_eq!(open::<u64>(&sealed_v1(&7_u64)).unwrap(), 7);
    // Read to the last byte, as before.
    let mut padded = old.clone();
    padded.push(0);
    let e = open::<Charge>(&padded).unwrap_err();
    assert_eq!(e.to_string(), "value could not be decoded");
    let source = std::error::Error::source(&e).unwrap().to_string();
    assert_eq!(source, "1 bytes left over after the value");
}

#[test]
fn another_version_is_refused_not_misread() {
    for found in [0, 3, 254] {
        let mut sealed = seal(&charge()).unwrap();
        sealed[2] = found;
        let e = open::<Charge>(&sealed).unwrap_err();
        assert!(
            matches!(e, WireError::UnknownVersion { found: f, supported: 2 } if f == found),
            "{e:?}"
        );
        assert_eq!(
            e.to_string(),
            format!("stored value has format version {found}; this build reads versions 1 to 2")
        );
    }
}

#[test]
fn bytes_without_an_envelope_are_refused() {
    let plain = rmp_serde::to_vec_named(&charge()).unwrap();
    for bytes in [&plain[..], b"", b"t", b"tb", b"TB\x02\x07"] {
        assert!(
            matches!(open::<Charge>(bytes), Err(WireError::NotEnveloped)),
            "{bytes:?}"
        );
    }
}

#[test]
fn truncated_or_padded_payloads_are_typed_errors() {
    for sealed in [seal(&charge()).unwrap(), sealed_v1(&charge())] {
        for cut in HEADER..sealed.len() {
            let e = open::<Charge>(&sealed[..cut]).unwrap_err();
            assert!(
                matches!(
                    e,
                    WireError::Codec {
                        what: "decoded",
                        ..
                    }
                ),
                "{cut}: {e:?}"
            );
        }
    }
    let mut padded = seal(&charge()).unwrap();
    padded.push(0xc0);
    let e = open::<Charge>(&padded).unwrap_err();
    assert_eq!(e.to_string(), "value could not be decoded");
    let source = std::error::Error::source(&e).unwrap().to_string();
    assert_eq!(source, "bytes left over after the value");
    // A partial marker left over too.
    let mut partial = seal(&charge()).unwrap();
    partial.push(0xcd);
    assert!(matches!(
        open::<Charge>(&partial),
        Err(WireError::Codec {
            what: "decoded",
            ..
        })
    ));
}

#[test]
fn an_oversize_payload_is_refused_before_decoding() {
    let sealed = seal(&vec![0u8; 100]).unwrap();
    let e = payload(&sealed, 64).unwrap_err();
    assert!(
        matches!(
            e,
            WireError::TooLarge {
                len: 103,
                limit: 64
            }
        ),
        "{e:?}"
    );
    assert_eq!(
        e.to_string(),
        "value of 103 bytes is over the limit of 64 bytes"
    );
    assert!(payload(&sealed, 103).is_ok());
}

#[test]
fn a_version_1_length_prefix_claiming_more_than_the_limit_is_refused_without_allocating() {
    // A string that claims 1 TiB in a few bytes: bincode allocates a
    // string's bytes before reading them, so without the limit decoding
    // it would abort the process.
    let mut forged = b"tb\x01".to_vec();
    forged.push(253); // varint: a u64 follows
    forged.extend_from_slice(&(1u64 << 40).to_le_bytes());
    let e = open::<String>(&forged).unwrap_err();
    assert!(
        matches!(
            e,
            WireError::Codec {
                what: "decoded",
                ..
            }
        ),
        "{e:?}"
    );
    let source = std::error::Error::source(&e).unwrap().to_string();
    assert!(source.contains("LimitExceeded"), "{source}");
}

#[test]
fn version_2_length_prefixes_past_the_end_are_refused_without_allocating() {
    // str32, bin32, array32 and map32 each claiming 4 GiB - 1 in five bytes.
    for marker in [0xdb_u8, 0xc6, 0xdd, 0xdf] {
        let mut forged = b"tb\x02".to_vec();
        forged.push(marker);
        forged.extend_from_slice(&u32::MAX.to_be_bytes());
        for bytes in [&forged[..], &[&forged[..], &[0x01, 0x02]].concat()[..]] {
            assert!(
                matches!(open::<String>(bytes), Err(WireError::Codec { .. })),
                "{marker:x}"
            );
            assert!(
                matches!(open::<Vec<u64>>(bytes), Err(WireError::Codec { .. })),
                "{marker:x}"
            );
            assert!(
                matches!(
                    open::<serde_json::Value>(bytes),
                    Err(WireError::Codec { .. })
                ),
                "{marker:x}"
            );
            assert!(
                matches!(
                    open::<HashMap<String, u8>>(bytes),
                    Err(WireError::Codec { .. })
                ),
                "{marker:x}"
            );
        }
    }
}

#[test]
fn version_2_nesting_past_the_limit_is_refused_not_a_stack_overflow() {
    // 100,000 nested one-element arrays: far past the limit, in 100 KB.
    let mut forged = b"tb\x02".to_vec();
    forged.extend(std::iter::repeat_n(0x91_u8, 100_000));
    forged.push(0xc0);
    let e = open::<serde_json::Value>(&forged).unwrap_err();
    let source = std::error::Error::source(&e).unwrap().to_string();
    assert_eq!(source, "depth limit exceeded");
    // Within the limit, on a thread with tokio's default 2 MiB stack, in a
    // debug build: the deepest hostile bytes may go decodes without
    // overflowing.
    let depth = MAX_DEPTH - 2;
    let mut deep = b"tb\x02".to_vec();
    deep.extend(std::iter::repeat_n(0x91_u8, depth));
    deep.push(0xc0);
    std::thread::Builder::new()
        .stack_size(2 << 20)
        .spawn(move || {
            let value = open::<serde_json::Value>(&deep).unwrap();
            assert!(value.is_array());
            // An untagged enum buffers what it reads first: deeper recursion.
            #[derive(Deserialize)]
            #[serde(untagged)]
            #[allow(dead_code, reason = "only decoded")]
            enum Either {
                Num(u64),
                Any(serde_json::Value),
            }
            assert!(open::<Either>(&deep).is_ok());
        })
        .unwrap()
        .join()
        .unwrap();
}

/// Bytes chosen by a deterministic generator: every prefix, every
/// single-byte change and random payloads of a sealed value decode to a
/// value or a typed error, never a panic.
#[test]
fn garbage_version_2_payloads_are_typed_errors_never_panics() {
    #[derive(Debug, PartialEq, Serialize, Deserialize)]
    #[serde(tag = "type")]
    enum Event {
        Paid {
            amount: u64,
            #[serde(flatten)]
            meta: BTreeMap<String, serde_json::Value>,
        },
        Refunded {
            #[serde(skip_serializing_if = "Option::is_none")]
            reason: Option<String>,
        },
    }
    let value = Event::Paid {
        amount: u64::MAX,
        meta: BTreeMap::from([
            (
                "k".to_owned(),
                serde_json::json!({"a": [1, -2.5, null, "x"]}),
            ),
            ("b".to_owned(), serde_json::json!(true)),
        ]),
    };
    let sealed = seal(&value).unwrap();
    assert_eq!(open::<Event>(&sealed).unwrap(), value);
    let mut seed = 0x9e37_79b9_7f4a_7c15_u64;
    let mut next = || {
        seed ^= seed << 13;
        seed ^= seed >> 7;
        seed ^= seed << 17;
        seed
    };
    let mut tried = 0;
    let mut check = |bytes: &[u8]| {
        tried += 1;
        let _ = open::<Event>(bytes);
        let _ = open::<serde_json::Value>(bytes);
        let _ = open::<Charge>(bytes);
        let _ = open::<HashMap<u32, Vec<String>>>(bytes);
    };
    for cut in 0..sealed.len() {
        check(&sealed[..cut]);
    }
    for at in HEADER..sealed.len() {
        for _ in 0..8 {
            let mut changed = sealed.clone();
            changed[at] = next() as u8;
            check(&changed);
        }
    }
    for _ in 0..2000 {
        let len = (next() % 64) as usize;
        let mut random = b"tb\x02".to_vec();
        random.extend((0..len).map(|_| next() as u8));
        check(&random);
    }
    assert!(tried > 2000);
}

#[test]
fn every_serde_form_round_trips_in_version_2() {
    #[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
    #[serde(untagged)]
    enum Untagged {
        Code(u16),
        Text { text: String },
    }
    #[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
    #[serde(tag = "type", content = "data")]
    enum Adjacent {
        A(u8),
        B { b: String },
    }
    #[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
    #[serde(tag = "kind")]
    enum Internal {
        Host { addr: IpAddr },
        Unit,
    }
    #[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
    struct Flat {
        id: u32,
        #[serde(flatten)]
        rest: HashMap<String, serde_json::Value>,
    }
    #[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
    struct Sparse {
        #[serde(skip_serializing_if = "Option::is_none")]
        a: Option<u8>,
        #[serde(default, skip_serializing_if = "Vec::is_empty")]
        b: Vec<u8>,
    }
    fn same<T>(value: T)
    where
        T: Serialize + DeserializeOwned + PartialEq + std::fmt::Debug,
    {
        let sealed = seal_checked(&value).unwrap();
        assert_eq!(open::<T>(&sealed).unwrap(), value);
    }
    same(serde_json::json!({"a": [1, 2.5, -3, null, {"b": "c"}], "u": u64::MAX}));
    same(Untagged::Code(404));
    same(Untagged::Text { text: "x".into() });
    same(Adjacent::A(1));
    same(Adjacent::B { b: "y".into() });
    // An address's compact form would not read back inside a tagged enum.
    same(Internal::Host {
        addr: "2001:db8::1".parse().unwrap(),
    });
    same(Internal::Unit);
    same(Flat {
        id: 1,
        rest: HashMap::from([("extra".to_owned(), serde_json::json!([true]))]),
    });
    same(Sparse { a: None, b: vec![] });
    same(Sparse {
        a: Some(1),
        b: vec![2],
    });
    same((u128::MAX, i128::MIN, 0_u128, -1_i128));
    same(bytes::Bytes::from_static(b"\x00\xffbody"));
    same(HashMap::from([((1_u8, 2_u16), "pair".to_owned())]));
    same(BTreeMap::from([(-1_i64, 'c'), (7, 'd')]));
    same(std::time::Duration::from_nanos(1_234_567_890));
    let floats = seal(&[f64::NAN, f64::INFINITY, f64::NEG_INFINITY, -0.0]).unwrap();
    let back = open::<[f64; 4]>(&floats).unwrap();
    assert!(back[0].is_nan());
    assert_eq!(back[1..], [f64::INFINITY, f64::NEG_INFINITY, -0.0]);
    assert!(back[3].is_sign_negative());
}

#[test]
fn a_value_its_type_cannot_read_back_is_a_round_trip_error() {
    #[derive(Debug, Serialize, Deserialize)]
    struct Secret {
        id: u8,
        #[serde(skip_serializing)]
        #[allow(dead_code, reason = "skipped when serialized: what the test is about")]
        secret: String,
    }
    let e = seal_checked(&Secret {
        id: 1,
        secret: "s".into(),
    })
    .unwrap_err();
    assert!(matches!(e, WireError::RoundTrip { .. }), "{e:?}");
    assert_eq!(
        e.to_string(),
        format!(
            "a value of type {} does not decode from its own encoding",
            std::any::type_name::<Secret>()
        )
    );
    let source = std::error::Error::source(&e).unwrap().to_string();
    assert!(source.contains("missing field `secret`"), "{source}");

    // Value-dependent: only an empty list is skipped, and there is no default.
    #[derive(Debug, Serialize, Deserialize)]
    struct Items {
        #[serde(skip_serializing_if = "Vec::is_empty")]
        items: Vec<u8>,
    }
    assert!(seal_checked(&Items { items: vec![1] }).is_ok());
    assert!(matches!(
        seal_checked(&Items { items: vec![] }),
        Err(WireError::RoundTrip { .. })
    ));

    // serde buffers a tagged enum's content in a form without 128-bit
    // integers, whatever the format.
    #[derive(Debug, Serialize, Deserialize)]
    #[serde(tag = "type")]
    enum Big {
        Amount { value: u128 },
    }
    let e = seal_checked(&Big::Amount { value: 1 }).unwrap_err();
    let source = std::error::Error::source(&e).unwrap().to_string();
    assert_eq!(source, "u128 is not supported");
}

#[test]
fn an_unstorable_envelope_carries_its_cause_and_no_value() {
    let sealed = seal_unstorable("a value of type X does not decode: missing field `s`");
    assert_eq!(&sealed[..3], b"tb\xff");
    let e = open::<u64>(&sealed).unwrap_err();
    assert!(
        matches!(&e, WireError::Unstorable { cause } if cause == "a value of type X does not decode: missing field `s`"),
        "{e:?}"
    );
    assert_eq!(
        e.to_string(),
        "a value of type X does not decode: missing field `s`"
    );
    // Cut at 4 KiB, on a character boundary.
    let long = "é".repeat(3000);
    let sealed = seal_unstorable(&long);
    assert!(sealed.len() <= HEADER + MAX_CAUSE);
    match unseal(&sealed) {
        Err(WireError::Unstorable { cause }) => {
            assert!(long.starts_with(&cause));
            assert_eq!(cause.len(), MAX_CAUSE);
        }
        other => panic!("{other:?}"),
    }
    // Hostile bytes after the reserved version: text, lossily.
    match unseal(b"tb\xff\xc0\x80") {
        Err(WireError::Unstorable { cause }) => assert_eq!(cause, "\u{fffd}\u{fffd}"),
        other => panic!("{other:?}"),
    }
}

#[test]
fn version_2_names_fields_so_another_type_fails_or_reads_by_name() {
    #[derive(Debug, PartialEq, Deserialize)]
    struct Renamed {
        note: String,
        id: u64,
    }
    let sealed = seal(&charge()).unwrap();
    // Fields are matched by name, not position; the extra field is ignored.
    assert_eq!(
        open::<Renamed>(&sealed).unwrap(),
        Renamed {
            note: "paid".into(),
            id: 7
        }
    );
    assert!(matches!(open::<u64>(&sealed), Err(WireError::Codec { .. })));
    assert!(matches!(
        open::<Vec<String>>(&seal(&7_u32).unwrap()),
        Err(WireError::Codec { .. })
    ));
}
