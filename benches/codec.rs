//! The two payload formats of the wire envelope side by side, encode and
//! decode of the same value: format version 1 (bincode 2 `standard()`,
//! read only since version 2) as the anchor, version 2 (MessagePack with
//! structs as maps and human-readable forms, rmp-serde) as ours, each
//! configured as `src/wire.rs` configures it (size limit, depth limit, read
//! to the last byte).
//!
//! Run: `cargo bench --bench codec`
//!
//! Criterion reports each measurement; the lines printed at the end give
//! ns per encode plus decode of both sides from one fixed-size timed pass
//! each, their ratio, and the payload sizes:
//! `compare <name>: ours <ns> ns, anchor <ns> ns, ratio <ours/anchor>, bytes <ours>/<anchor>`.

use std::hint::black_box;
use std::time::Instant;

use bytes::Bytes;
use criterion::Criterion;
use serde::de::DeserializeOwned;
use serde::{Deserialize, Serialize};

const MAX_DECODED: usize = 256 << 20;

type Bincode = bincode::config::Configuration<
    bincode::config::LittleEndian,
    bincode::config::Varint,
    bincode::config::Limit<MAX_DECODED>,
>;
const BINCODE: Bincode = bincode::config::standard().with_limit::<MAX_DECODED>();

fn encode_v1<T: Serialize>(value: &T) -> Vec<u8> {
    let mut out = b"tb\x01".to_vec();
    bincode::serde::encode_into_std_write(value, &mut out, BINCODE).expect("encodes");
    out
}

fn decode_v1<T: DeserializeOwned>(bytes: &[u8]) -> T {
    let (value, read) =
        bincode::serde::decode_from_slice::<T, _>(&bytes[3..], BINCODE).expect("decodes");
    assert_eq!(read, bytes.len() - 3);
    value
}

fn encode_v2<T: Serialize>(value: &T) -> Vec<u8> {
    let mut out = b"tb\x02".to_vec();
    let mut ser = rmp_serde::Serializer::new(&mut out)
        .with_struct_map()
        .with_human_readable();
    value.serialize(&mut ser).expect("encodes");
    out
}

fn decode_v2<T: DeserializeOwned>(bytes: &[u8]) -> T {
    let mut de = rmp_serde::Deserializer::from_read_ref(&bytes[3..]).with_human_readable();
    de.set_max_depth(256);
    let value = T::deserialize(&mut de).expect("decodes");
    assert!(
        serde::de::IgnoredAny::deserialize(&mut de).is_err(),
        "to the last byte"
    );
    value
}

/// A small result: a charge.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
struct Charge {
    id: u64,
    amount: i64,
    currency: String,
    captured: bool,
}

/// An HTTP response: status, a few headers, a 1 KiB body.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
struct Response {
    status: u16,
    headers: Vec<(String, String)>,
    body: Bytes,
}

/// A 1 MiB result nested 50 deep.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
struct Node {
    depth: u32,
    label: String,
    blob: Bytes,
    values: Vec<u64>,
    child: Option<Box<Node>>,
}

fn charge() -> Charge {
    Charge {
        id: 48_000_017,
        amount: 12_50,
        currency: "EUR".to_owned(),
        captured: true,
    }
}

fn response() -> Response {
    Response {
        status: 201,
        headers: vec![
            ("content-type".into(), "application/json".into()),
            ("location".into(), "/charges/ch_48000017".into()),
            (
                "x-request-id".into(),
                "0f9c2a7e-5b1d-4c3e-9a8f-1d2e3f4a5b6c".into(),
            ),
        ],
        body: Bytes::from((0..1024).map(|i| (i % 251) as u8).collect::<Vec<u8>>()),
    }
}

fn nested() -> Node {
    let mut node = None;
    for d in (0..50_u32).rev() {
        node = Some(Box::new(Node {
            depth: d,
            label: format!("level {d}"),
            blob: Bytes::from(vec![d as u8; 16 << 10]),
            values: (0..512).map(|i| u64::from(d) << 32 | i).collect(),
            child: node,
        }));
    }
    *node.expect("50 levels")
}

/// ns per encode plus decode over `n` round trips.
fn timed<T: Clone>(n: u32, value: &T, round: impl Fn(&T) -> T) -> f64 {
    let start = Instant::now();
    for _ in 0..n {
        black_box(round(black_box(value)));
    }
    start.elapsed().as_nanos() as f64 / f64::from(n)
}

fn case<T>(c: &mut Criterion, name: &str, value: &T, n: u32, lines: &mut Vec<String>)
where
    T: Serialize + DeserializeOwned + Clone + PartialEq + std::fmt::Debug,
{
    let (v1, v2) = (encode_v1(value), encode_v2(value));
    assert_eq!(&decode_v1::<T>(&v1), value);
    assert_eq!(&decode_v2::<T>(&v2), value);
    let mut group = c.benchmark_group(name);
    group.bench_function("v1_bincode_encode", |b| {
        b.iter(|| encode_v1(black_box(value)))
    });
    group.bench_function("v1_bincode_decode", |b| {
        b.iter(|| decode_v1::<T>(black_box(&v1)))
    });
    group.bench_function("v2_msgpack_encode", |b| {
        b.iter(|| encode_v2(black_box(value)))
    });
    group.bench_function("v2_msgpack_decode", |b| {
        b.iter(|| decode_v2::<T>(black_box(&v2)))
    });
    group.finish();
    let anchor = timed(n, value, |v| decode_v1::<T>(&encode_v1(v)));
    let ours = timed(n, value, |v| decode_v2::<T>(&encode_v2(v)));
    lines.push(format!(
        "compare {name}: ours {ours:.0} ns, anchor {anchor:.0} ns, ratio {:.2}, bytes {}/{}",
        ours / anchor,
        v2.len(),
        v1.len()
    ));
}

fn main() {
    let mut c = Criterion::default().configure_from_args();
    let mut lines = Vec::new();
    case(&mut c, "codec_small_struct", &charge(), 200_000, &mut lines);
    case(
        &mut c,
        "codec_http_response",
        &response(),
        200_000,
        &mut lines,
    );
    case(&mut c, "codec_nested_1mib", &nested(), 200, &mut lines);
    c.final_summary();
    for line in lines {
        println!("{line}");
    }
}
