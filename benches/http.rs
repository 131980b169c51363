//! The HTTP layers in process (`tower::ServiceExt::oneshot` on a trivial handler), each beside
//! its anchor.
//!
//! Run: `cargo bench --features http,axum --bench http`. After criterion's report it prints
//! one line per comparison: `compare <name>: ours <ns/op> ns, anchor <ns/op> ns, ratio
//! <ours/anchor>`, from short timed rounds alternating between the sides (medians; the ratio
//! is the median of adjacent pairs, which share the machine's load).
//!
//! - `http_rate_limit`: `RateLimitLayer` (GCRA, in-memory store, draft headers) against
//!   tower_governor's `GovernorLayer` (with its headers), same quota, same 10 000 client IPs.
//!   `http_rate_limit_no_headers`: both without headers.
//! - `http_idempotency_replay`: a replayed 1 KiB response through `IdempotencyLayer` against
//!   calling the handler itself.
//! - `http_idempotency_fresh`: a first request (new key) with a 1 KiB body through the layer
//!   against calling the handler itself.
//! - `http_idempotency_replay_least_layer`, `http_idempotency_fresh_least_layer`: the same
//!   requests against [`LeastLayer`], the least idempotency layer (the fingerprint, a DashMap
//!   of claims and one of results capped at 100,000, the handler): the floor of each row with
//!   its table, timed in the same rounds.
//!
//! The handler reads its 1 KiB request body and answers 1 KiB: the least a real endpoint does.
//!
//! After them, the floor of each idempotency row from the same run: what the layer cannot
//! skip (SHA-256 of the body for the fingerprint, plus building the request for a replay, or
//! the handler itself for a first request) as ns and as a ratio to that row's anchor.
//!
//! Profile mode, for callgrind: `HTTP_BENCH_PROFILE=fresh|replay|rate_limit` (and
//! `HTTP_BENCH_ITERS`, default 20 000) skips criterion and runs that many requests of one
//! path through our layer in `profile_round`, so `--toggle-collect='*profile_round*'`
//! counts only them (the fixture's setup is left out). `HTTP_BENCH_PROFILE=bare` runs the
//! bare handler the same way, the anchor to subtract. `HTTP_BENCH_FULL=1` with `fresh` first
//! fills the result table to its cap, so the counted requests also evict (the steady state of
//! the timed rounds). `HTTP_BENCH_PROFILE=least` counts [`LeastTable`]'s first requests at its
//! cap, `least_layer` and `least_layer_replay` [`LeastLayer`]'s first requests and replays.
//! The command is in benches/README.md.

#[path = "support/figures.rs"]
#[allow(dead_code)]
mod figures;
use figures::{median, selected};

use std::collections::VecDeque;
use std::convert::Infallible;
use std::hash::{BuildHasherDefault, Hasher};
use std::hint::black_box;
use std::net::SocketAddr;
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use axum::body::Body;
use axum::extract::ConnectInfo;
use bytes::Bytes;
use criterion::Criterion;
use dashmap::DashMap;
use http::{HeaderName, HeaderValue, Request, Response};
use http_body_util::BodyExt;
use throttlebeam::clock::QuantaClock;
use throttlebeam::http::{IdempotencyLayer, RateLimitLayer};
use throttlebeam::rate_limit::{Enforcer, Gcra, HeaderOptions, Limiter};
use throttlebeam::{IdempotencyOptions, Runtime};
use tokio::runtime::Runtime as Tokio;
use tower::util::BoxCloneService;
use tower::{Layer, ServiceExt, service_fn};
use tower_governor::GovernorLayer;
use tower_governor::governor::GovernorConfigBuilder;

const CLIENTS: usize = 10_000;
const KIB: usize = 1024;
/// The results an idempotency table keeps: the runtime's default cap.
const RESULTS: usize = throttlebeam::idempotency::DEFAULT_MAX_IDEMPOTENCY_RESULTS;

type Svc = BoxCloneService<Request<Body>, Response<Body>, Infallible>;

/// The trivial handler: reads the request body, answers 1 KiB.
fn handler<B>() -> impl tower::Service<
    Request<B>,
    Response = Response<Body>,
    Error = Infallible,
    Future = impl Future<Output = Result<Response<Body>, Infallible>> + Send,
> + Clone
+ Send
+ Sync
+ 'static
where
    B: http_body::Body<Data = Bytes> + Send + 'static,
{
    let answer = Bytes::from(vec![b'a'; KIB]);
    service_fn(move |req: Request<B>| {
        let answer = answer.clone();
        async move {
            let read = req.into_body().collect().await.map(|c| c.to_bytes().len());
            black_box(read.ok());
            Ok::<_, Infallible>(Response::new(Body::from(answer)))
        }
    })
}

fn boxed<S>(svc: S) -> Svc
where
    S: tower::Service<Request<Body>, Error = Infallible> + Clone + Send + 'static,
    S::Response: axum::response::IntoResponse,
    S::Future: Send + 'static,
{
    BoxCloneService::new(svc.map_response(axum::response::IntoResponse::into_response))
}

/// How each side builds its `i`th request.
#[derive(Clone, Copy)]
enum Requests {
    /// GET from client `i % CLIENTS`.
    Clients,
    /// POST with 1 KiB under one key.
    SameKey,
    /// POST with 1 KiB under key `i` of this round.
    NewKey(u64),
}

struct Fixture {
    tokio: Tokio,
    peers: Vec<SocketAddr>,
    payload: Bytes,
    bare: Svc,
    ours_rate_limit: Svc,
    ours_rate_limit_no_headers: Svc,
    governor: Svc,
    governor_no_headers: Svc,
    idempotent: Svc,
    least: Svc,
}

impl Fixture {
    fn request(&self, requests: Requests, i: u64) -> Request<Body> {
        match requests {
            Requests::Clients => {
                let peer = self.peers[i as usize % CLIENTS];
                let mut req = Request::get("/").body(Body::empty()).expect("request");
                req.extensions_mut().insert(peer);
                req.extensions_mut().insert(ConnectInfo(peer));
                req
            }
            Requests::SameKey => Request::post("/pay")
                .header("idempotency-key", "replayed")
                .body(Body::from(self.payload.clone()))
                .expect("request"),
            Requests::NewKey(round) => Request::post("/pay")
                .header("idempotency-key", format!("fresh-{round}-{i}"))
                .body(Body::from(self.payload.clone()))
                .expect("request"),
        }
    }

    fn timed(&self, svc: &Svc, requests: Requests, ops: u64) -> Duration {
        self.tokio.block_on(async {
            let start = Instant::now();
            for i in 0..ops {
                let response = svc.clone().oneshot(self.request(requests, i)).await;
                black_box(response.map(|r| r.status()).ok());
            }
            start.elapsed()
        })
    }
}

fn fixture() -> Fixture {
    let tokio = tokio::runtime::Builder::new_current_thread()
        .enable_all()
        .build()
        .expect("tokio");
    let runtime = tokio.block_on(async {
        Runtime::builder()
            .with_sweep_interval(Duration::from_secs(1))
            .start()
            .await
            .expect("runtime")
    });
    let peers = (0..CLIENTS)
        .map(|i| SocketAddr::from(([10, 0, (i / 256) as u8, (i % 256) as u8], 40_000)))
        .collect();
    // Generous quotas: every request is allowed, so both sides take the same path.
    let limiter = || {
        Limiter::builder(Gcra::new(1_000_000, Duration::from_secs(1)).expect("quota"))
            .with_clock(QuantaClock::new())
            .build()
    };
    let governor = |headers: bool| {
        let mut builder = GovernorConfigBuilder::default();
        builder.per_nanosecond(1_000).burst_size(1_000_000);
        if headers {
            let config = builder.use_headers().finish().expect("config");
            boxed(GovernorLayer::new(config).layer(handler()))
        } else {
            let config = builder.finish().expect("config");
            boxed(GovernorLayer::new(config).layer(handler()))
        }
    };
    let idempotent = IdempotencyLayer::builder(&runtime)
        .with_options(IdempotencyOptions::new().with_ttl(Duration::from_secs(1)))
        .build()
        .expect("layer");
    let fixture = Fixture {
        peers,
        payload: Bytes::from(vec![b'p'; KIB]),
        bare: boxed(handler()),
        ours_rate_limit: boxed(RateLimitLayer::new(Enforcer::new(limiter())).layer(handler())),
        ours_rate_limit_no_headers: boxed(
            RateLimitLayer::new(Enforcer::new(limiter()).with_headers(HeaderOptions::none()))
                .layer(handler()),
        ),
        governor: governor(true),
        governor_no_headers: governor(false),
        idempotent: boxed(idempotent.layer(handler())),
        least: boxed(LeastLayer {
            inner: handler(),
            table: Arc::new(LeastTable::full(&Bytes::from(vec![b'a'; KIB]))),
        }),
        tokio,
    };
    // Every client and the replayed key exist before timing.
    for svc in [
        &fixture.ours_rate_limit,
        &fixture.ours_rate_limit_no_headers,
        &fixture.governor,
        &fixture.governor_no_headers,
    ] {
        fixture.timed(svc, Requests::Clients, CLIENTS as u64);
    }
    fixture.timed(&fixture.idempotent, Requests::SameKey, 1);
    fixture.timed(&fixture.least, Requests::SameKey, 1);
    fixture
}

/// FxHash (rustc's): a fast hasher for [`LeastTable`], as the layer's own maps hash with
/// aHash (std's SipHash would weigh on the floor).
#[derive(Default)]
struct Fx(u64);

impl Hasher for Fx {
    fn write(&mut self, bytes: &[u8]) {
        let mut chunks = bytes.chunks_exact(8);
        for chunk in &mut chunks {
            let word = u64::from_le_bytes(chunk.try_into().expect("8 bytes"));
            self.0 = (self.0.rotate_left(5) ^ word).wrapping_mul(0x51_7c_c1_b7_27_22_0a_95);
        }
        for byte in chunks.remainder() {
            self.0 =
                (self.0.rotate_left(5) ^ u64::from(*byte)).wrapping_mul(0x51_7c_c1_b7_27_22_0a_95);
        }
    }

    fn finish(&self) -> u64 {
        self.0
    }
}

type FxMap<V> = DashMap<Arc<str>, V, BuildHasherDefault<Fx>>;

/// The least work of any idempotency layer that keeps results in memory, for a first
/// request besides the handler and the hash: look its key up in the results (a miss), claim
/// the key in a concurrent map, store the result (fingerprint, expiry, body) in a concurrent
/// map capped at 100,000 results, evicting the oldest from a queue of keys in insertion
/// order, and free the claim. One allocation (the key, shared by the three).
struct LeastTable {
    claims: FxMap<u64>,
    results: FxMap<([u8; 32], u64, Bytes)>,
    order: Mutex<VecDeque<Arc<str>>>,
    base: Instant,
}

impl LeastTable {
    /// A table already at its cap, as the timed rounds find the layer's.
    fn full(body: &Bytes) -> Self {
        let table = Self {
            claims: DashMap::default(),
            results: DashMap::default(),
            order: Mutex::new(VecDeque::new()),
            base: Instant::now(),
        };
        for i in 0..RESULTS {
            table.first_request(&format!("14:http/anonymousfill-{i}"), body);
        }
        table
    }

    /// The stored body of `key`, if any.
    fn lookup(&self, key: &str) -> Option<Bytes> {
        self.results.get(key).map(|stored| stored.2.clone())
    }

    /// Claims `key` (free: a first request).
    fn claim(&self, key: &str) -> Arc<str> {
        let key: Arc<str> = Arc::from(key);
        self.claims.insert(Arc::clone(&key), 1);
        key
    }

    /// Stores `body` for `key`, evicting the oldest result past the cap, and frees the claim.
    fn complete(&self, key: Arc<str>, fingerprint: [u8; 32], body: Bytes) {
        let expires = self.base.elapsed().as_nanos() as u64 + 1_000_000_000;
        self.results
            .insert(Arc::clone(&key), (fingerprint, expires, body));
        {
            let mut order = self.order.lock().expect("order");
            order.push_back(Arc::clone(&key));
            while order.len() > RESULTS {
                if let Some(oldest) = order.pop_front() {
                    self.results.remove(&oldest);
                }
            }
        }
        self.claims.remove(&key);
    }

    #[inline(never)]
    fn first_request(&self, key: &str, body: &Bytes) -> bool {
        if self.lookup(key).is_some() {
            return false;
        }
        let key = self.claim(key);
        self.complete(key, [7; 32], body.clone());
        true
    }
}

/// [`LeastTable`] around the handler, as the least idempotency layer: reads the body,
/// fingerprints it (SHA-256 over method, path, query and body), looks the key up and replays
/// the stored body with `idempotent-replayed: true`, or claims the key, calls the handler,
/// reads its response, stores it and frees the claim. No scope, fingerprint check, lease,
/// waits, cancellation safety, statuses or kept headers: the floor of each idempotency row,
/// timed in the same rounds as ours.
#[derive(Clone)]
struct LeastLayer<S> {
    inner: S,
    table: Arc<LeastTable>,
}

impl<S> tower::Service<Request<Body>> for LeastLayer<S>
where
    S: tower::Service<Request<Body>, Response = Response<Body>, Error = Infallible>
        + Clone
        + Send
        + 'static,
    S::Future: Send,
{
    type Response = Response<Body>;
    type Error = Infallible;
    type Future =
        std::pin::Pin<Box<dyn Future<Output = Result<Response<Body>, Infallible>> + Send>>;

    fn poll_ready(
        &mut self,
        _: &mut std::task::Context<'_>,
    ) -> std::task::Poll<Result<(), Infallible>> {
        std::task::Poll::Ready(Ok(()))
    }

    fn call(&mut self, req: Request<Body>) -> Self::Future {
        let (table, mut inner) = (Arc::clone(&self.table), self.inner.clone());
        Box::pin(async move {
            let (parts, body) = req.into_parts();
            let key = parts
                .headers
                .get("idempotency-key")
                .and_then(|k| k.to_str().ok())
                .unwrap_or_default();
            let key = format!("14:http/anonymous{key}");
            let bytes = body
                .collect()
                .await
                .map(|c| c.to_bytes())
                .unwrap_or_default();
            let mut hasher = <sha2::Sha256 as sha2::Digest>::new();
            for field in [
                parts.method.as_str().as_bytes(),
                parts.uri.path().as_bytes(),
                parts.uri.query().unwrap_or("").as_bytes(),
                &bytes,
            ] {
                sha2::Digest::update(&mut hasher, (field.len() as u64).to_be_bytes());
                sha2::Digest::update(&mut hasher, field);
            }
            let fingerprint: [u8; 32] = sha2::Digest::finalize(hasher).into();
            if let Some(stored) = table.lookup(&key) {
                let mut replayed = Response::new(Body::from(stored));
                replayed.headers_mut().insert(
                    HeaderName::from_static("idempotent-replayed"),
                    HeaderValue::from_static("true"),
                );
                return Ok(replayed);
            }
            let key = table.claim(&key);
            let response = inner
                .call(Request::from_parts(parts, Body::from(bytes)))
                .await?;
            let (head, body) = response.into_parts();
            let stored = body
                .collect()
                .await
                .map(|c| c.to_bytes())
                .unwrap_or_default();
            table.complete(key, fingerprint, stored.clone());
            Ok(Response::from_parts(head, Body::from(stored)))
        })
    }
}

struct Comparison {
    name: &'static str,
    ours: fn(&Fixture) -> &Svc,
    anchor: fn(&Fixture) -> &Svc,
    requests: Requests,
    ops: u64,
}

const COMPARISONS: [Comparison; 6] = [
    Comparison {
        name: "http_rate_limit",
        ours: |f| &f.ours_rate_limit,
        anchor: |f| &f.governor,
        requests: Requests::Clients,
        ops: 50_000,
    },
    Comparison {
        name: "http_rate_limit_no_headers",
        ours: |f| &f.ours_rate_limit_no_headers,
        anchor: |f| &f.governor_no_headers,
        requests: Requests::Clients,
        ops: 50_000,
    },
    Comparison {
        name: "http_idempotency_replay",
        ours: |f| &f.idempotent,
        anchor: |f| &f.bare,
        requests: Requests::SameKey,
        ops: 20_000,
    },
    Comparison {
        name: "http_idempotency_fresh",
        ours: |f| &f.idempotent,
        anchor: |f| &f.bare,
        requests: Requests::NewKey(0),
        ops: 5_000,
    },
    // The floor of each idempotency row with its table: the least idempotency layer.
    Comparison {
        name: "http_idempotency_replay_least_layer",
        ours: |f| &f.idempotent,
        anchor: |f| &f.least,
        requests: Requests::SameKey,
        ops: 20_000,
    },
    Comparison {
        name: "http_idempotency_fresh_least_layer",
        ours: |f| &f.idempotent,
        anchor: |f| &f.least,
        requests: Requests::NewKey(1_000),
        ops: 5_000,
    },
];

fn criterion_benches(c: &mut Criterion, f: &Fixture) {
    // Every batch of either side gets keys of its own: a first request is always one.
    let round = std::cell::Cell::new(1_000_000);
    let requests = |cmp: &Comparison| match cmp.requests {
        Requests::NewKey(_) => {
            round.set(round.get() + 1);
            Requests::NewKey(round.get())
        }
        other => other,
    };
    for cmp in &COMPARISONS {
        let mut group = c.benchmark_group(cmp.name);
        group.bench_function("ours", |b| {
            b.iter_custom(|iters| f.timed((cmp.ours)(f), requests(cmp), iters))
        });
        group.bench_function("anchor", |b| {
            b.iter_custom(|iters| f.timed((cmp.anchor)(f), requests(cmp), iters))
        });
        group.finish();
    }
}

fn compare(cmp: &Comparison, f: &Fixture, rounds: u64) -> (f64, f64, f64) {
    let (mut ours, mut anchor, mut ratios) = (Vec::new(), Vec::new(), Vec::new());
    for round in 0..rounds {
        // New keys of this comparison's own, apart from every other's.
        let requests = match cmp.requests {
            Requests::NewKey(base) => Requests::NewKey(base + round),
            other => other,
        };
        let per_op = |svc: &Svc| f.timed(svc, requests, cmp.ops).as_nanos() as f64 / cmp.ops as f64;
        let (o, a) = if round % 2 == 0 {
            let o = per_op((cmp.ours)(f));
            (o, per_op((cmp.anchor)(f)))
        } else {
            let a = per_op((cmp.anchor)(f));
            (per_op((cmp.ours)(f)), a)
        };
        ours.push(o);
        anchor.push(a);
        ratios.push(o / a);
    }
    (median(&mut ours), median(&mut anchor), median(&mut ratios))
}

/// Runs `ops` requests of `requests` through `svc`, for callgrind to count on its own.
#[inline(never)]
fn profile_round(f: &Fixture, svc: &Svc, requests: Requests, ops: u64) -> Duration {
    f.timed(svc, requests, ops)
}

/// Runs `ops` first requests through `table`, for callgrind to count on its own.
#[inline(never)]
fn profile_round_least(table: &LeastTable, body: &Bytes, keys: &[String]) -> Duration {
    let start = Instant::now();
    for key in keys {
        black_box(table.first_request(key, body));
    }
    start.elapsed()
}

/// Profile mode: one path, `HTTP_BENCH_ITERS` times, without criterion.
fn profile(f: &Fixture, path: &str) {
    let ops = std::env::var("HTTP_BENCH_ITERS")
        .ok()
        .and_then(|n| n.parse().ok())
        .unwrap_or(20_000);
    if path == "least" {
        let table = LeastTable::full(&f.payload);
        let keys: Vec<String> = (0..ops)
            .map(|i| format!("14:http/anonymousfresh-0-{i}"))
            .collect();
        let took = profile_round_least(&table, &f.payload, &keys);
        println!(
            "profile least: {ops} first requests, {:.1} ns each",
            took.as_nanos() as f64 / ops as f64
        );
        return;
    }
    let (svc, requests) = match path {
        "fresh" => (&f.idempotent, Requests::NewKey(0)),
        "least_layer" => (&f.least, Requests::NewKey(0)),
        "least_layer_replay" => (&f.least, Requests::SameKey),
        "replay" => (&f.idempotent, Requests::SameKey),
        "rate_limit" => (&f.ours_rate_limit, Requests::Clients),
        "rate_limit_no_headers" => (&f.ours_rate_limit_no_headers, Requests::Clients),
        "governor" => (&f.governor, Requests::Clients),
        "bare" => (&f.bare, Requests::SameKey),
        other => panic!(
            "HTTP_BENCH_PROFILE={other:?}: expected fresh, replay, rate_limit, \
             rate_limit_no_headers, governor, bare, least, least_layer or least_layer_replay"
        ),
    };
    // `HTTP_BENCH_FULL=1`: first fill the result table to its cap (the runtime's default
    // count of stored results), as the timed fresh rounds find it after criterion's: every
    // fresh request then also evicts the oldest result.
    if path == "fresh" && std::env::var_os("HTTP_BENCH_FULL").is_some_and(|v| v == "1") {
        let full = throttlebeam::idempotency::DEFAULT_MAX_IDEMPOTENCY_RESULTS as u64;
        f.timed(svc, Requests::NewKey(u64::MAX), full);
    }
    let took = profile_round(f, svc, requests, ops);
    println!(
        "profile {path}: {ops} requests, {:.1} ns each",
        took.as_nanos() as f64 / ops as f64
    );
}

fn main() {
    if let Ok(path) = std::env::var("HTTP_BENCH_PROFILE") {
        profile(&fixture(), &path);
        return;
    }
    let quick = std::env::args().any(|a| a == "--test");
    let f = fixture();
    let mut c = Criterion::default()
        .warm_up_time(Duration::from_millis(500))
        .measurement_time(Duration::from_secs(2))
        .configure_from_args();
    criterion_benches(&mut c, &f);
    c.final_summary();

    // `cargo bench -- --test` only checks that the benches run: no figures then.
    if quick {
        return;
    }
    // `cargo bench --bench http -- http_idempotency` compares only the matching names.
    let mut anchors = Vec::new();
    for cmp in &COMPARISONS {
        if !selected(cmp.name) {
            continue;
        }
        let (ours, anchor, ratio) = compare(cmp, &f, 21);
        println!(
            "compare {}: ours {ours:.1} ns, anchor {anchor:.1} ns, ratio {ratio:.2}",
            cmp.name
        );
        anchors.push((cmp.name, ours, anchor));
    }
    // What no idempotency layer can skip, from the same run: the fingerprint (SHA-256 over
    // the 1 KiB body), and building the request the bench hands in (both sides pay that).
    let per_op = |op: &dyn Fn(u64)| {
        let mut samples: Vec<f64> = (0..21)
            .map(|_| {
                let start = Instant::now();
                for i in 0..20_000 {
                    op(i);
                }
                start.elapsed().as_nanos() as f64 / 20_000.0
            })
            .collect();
        median(&mut samples)
    };
    let sha = per_op(&|_| {
        black_box(<sha2::Sha256 as sha2::Digest>::digest(black_box(
            &f.payload[..],
        )));
    });
    let build = per_op(&|i| {
        black_box(f.request(Requests::SameKey, i));
    });
    println!("sha256 of 1 KiB: {sha:.1} ns; building a request: {build:.1} ns");
    for (name, ours, anchor) in anchors {
        // A replay builds the request and hashes its body; a first request also runs the
        // handler, which is the whole anchor.
        let floor = match name {
            "http_idempotency_replay" => build + sha,
            "http_idempotency_fresh" => anchor + sha,
            _ => continue,
        };
        println!(
            "floor {name}: at least {floor:.1} ns (ratio {:.2}) before any work of the layer's \
             own; ours / floor {:.2}",
            floor / anchor,
            ours / floor
        );
    }
}
