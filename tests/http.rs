//! The HTTP layers over real HTTP: an axum app on a loopback port and a hyper client
//! (scenarios H1-H9).

#[path = "support/http.rs"]
mod support;
#[cfg(feature = "postgres")]
#[path = "support/postgres.rs"]
#[allow(dead_code, unreachable_pub)]
mod support_postgres;
#[cfg(feature = "redis")]
#[path = "support/redis.rs"]
#[allow(dead_code, unreachable_pub)]
mod support_redis;

use std::sync::Arc;
use std::sync::atomic::{AtomicUsize, Ordering};
use std::time::Duration;

use axum::extract::State;
use axum::response::IntoResponse;
use axum::routing::{get, post};
use axum::{Json, Router};
use bytes::Bytes;
use http::{HeaderName, Method, Request, StatusCode};
use http_body_util::BodyExt;
use support::{Chunks, Reply, Server, WithTrailers, problem, serve, serve_without_connect_info};
use throttlebeam::clock::ManualClock;
use throttlebeam::http::{
    IdempotencyLayer, IdempotencyLayerBuilder, RateLimitDenial, RateLimitKey, RateLimitLayer,
};
use throttlebeam::rate_limit::{
    ClientIp, Enforcer, FailMode, Gcra, HeaderOptions, Limiter, PolicyName, ProxyHeader,
    RateLimitError, RateLimitReply, RateLimitRequest, RateLimitStore,
};
use throttlebeam::{IdempotencyOptions, Runtime};
use tokio::sync::watch;
use tower::ServiceExt;

/// The handlers' shared state: how often each ran, and a gate they wait on.
#[derive(Clone)]
struct Shop {
    runs: Arc<AtomicUsize>,
    arrived: Arc<AtomicUsize>,
    /// Requests the handler waits for before answering (0: answers at once).
    wait_for_arrivals: usize,
    open: watch::Sender<bool>,
}

impl Shop {
    fn new() -> Self {
        Self {
            runs: Arc::default(),
            arrived: Arc::default(),
            wait_for_arrivals: 0,
            open: watch::Sender::new(true),
        }
    }

    fn runs(&self) -> usize {
        self.runs.load(Ordering::SeqCst)
    }

    fn close(&self) {
        self.open.send_replace(false);
    }

    fn open(&self) {
        self.open.send_replace(true);
    }

    async fn gate(&self) {
        let mut open = self.open.subscribe();
        let all_here = async {
            while self.arrived.load(Ordering::SeqCst) < self.wait_for_arrivals {
                tokio::task::yield_now().await;
            }
        };
        let gate = async {
            all_here.await;
            let _ = open.wait_for(|open| *open).await;
        };
        tokio::time::timeout(Duration::from_secs(10), gate)
            .await
            .expect("the test opens the gate");
    }
}

async fn pay(State(shop): State<Shop>, body: String) -> impl IntoResponse {
    let n = shop.runs.fetch_add(1, Ordering::SeqCst) + 1;
    shop.gate().await;
    (
        StatusCode::CREATED,
        [
            ("location", format!("/charges/{n}")),
            ("set-cookie", "s=1".to_owned()),
        ],
        Json(serde_json::json!({ "charge": n, "body": body })),
    )
}

async fn flaky(State(shop): State<Shop>) -> impl IntoResponse {
    let n = shop.runs.fetch_add(1, Ordering::SeqCst) + 1;
    if n == 1 {
        (StatusCode::SERVICE_UNAVAILABLE, format!("down {n}"))
    } else {
        (StatusCode::OK, format!("up {n}"))
    }
}

async fn big(State(shop): State<Shop>) -> String {
    let n = shop.runs.fetch_add(1, Ordering::SeqCst) + 1;
    format!("{n}{}", "x".repeat(99))
}

async fn boom(State(shop): State<Shop>) -> String {
    if shop.runs.fetch_add(1, Ordering::SeqCst) == 0 {
        panic!("card network exploded");
    }
    "recovered".to_owned()
}

async fn lookup(State(shop): State<Shop>) -> String {
    let n = shop.runs.fetch_add(1, Ordering::SeqCst) + 1;
    format!("looked up {n}")
}

/// Who the authentication layer says the caller is.
#[derive(Clone)]
struct Account {
    tenant: &'static str,
}

/// Stands for an authentication layer: checks the bearer token and inserts the caller's
/// account (alice and bob work for acme, carol for globex).
fn authenticate(mut req: Request<axum::body::Body>) -> Request<axum::body::Body> {
    let tenant = match req.headers().get("authorization").map(|v| v.as_bytes()) {
        Some(b"Bearer alice" | b"Bearer bob") => Some("acme"),
        Some(b"Bearer carol") => Some("globex"),
        _ => None,
    };
    if let Some(tenant) = tenant {
        req.extensions_mut().insert(Account { tenant });
    }
    req
}

/// Answers the status in the path, counting runs.
async fn status(
    State(shop): State<Shop>,
    axum::extract::Path(code): axum::extract::Path<u16>,
) -> impl IntoResponse {
    let n = shop.runs.fetch_add(1, Ordering::SeqCst) + 1;
    let status = StatusCode::from_u16(code).unwrap();
    let mut response = (status, format!("run {n}")).into_response();
    if status == StatusCode::TOO_MANY_REQUESTS {
        response
            .headers_mut()
            .insert("retry-after", http::HeaderValue::from(n));
    }
    response
}

fn checksum(n: usize) -> http::HeaderMap {
    let mut trailers = http::HeaderMap::new();
    trailers.insert("x-checksum", http::HeaderValue::from(n));
    trailers
}

/// A body, then trailers.
async fn trailers(State(shop): State<Shop>) -> axum::response::Response {
    let n = shop.runs.fetch_add(1, Ordering::SeqCst) + 1;
    let mut response = axum::response::Response::new(axum::body::Body::new(WithTrailers::new(
        "body",
        checksum(n),
    )));
    response
        .headers_mut()
        .insert("trailer", http::HeaderValue::from_static("x-checksum"));
    response
}

/// What a gRPC server answers: 200, `application/grpc`, the status in trailers.
async fn grpc(State(shop): State<Shop>) -> axum::response::Response {
    let n = shop.runs.fetch_add(1, Ordering::SeqCst) + 1;
    let mut trailers = checksum(n);
    trailers.insert("grpc-status", http::HeaderValue::from_static("0"));
    let mut response = axum::response::Response::new(axum::body::Body::new(WithTrailers::new(
        "\0\0\0\0\0",
        trailers,
    )));
    let headers = response.headers_mut();
    headers.insert(
        "content-type",
        http::HeaderValue::from_static("application/grpc"),
    );
    headers.insert(
        "trailer",
        http::HeaderValue::from_static("grpc-status, x-checksum"),
    );
    response
}

fn app(layer: IdempotencyLayer, shop: &Shop) -> Router {
    let arrived = Arc::clone(&shop.arrived);
    Router::new()
        .route("/pay", post(pay).patch(pay).put(pay))
        .route("/flaky", post(flaky))
        .route("/big", post(big))
        .route("/boom", post(boom))
        .route("/lookup", get(lookup).post(lookup))
        .route("/status/{code}", post(status))
        .route("/trailers", post(trailers))
        .route("/grpc", post(grpc))
        .with_state(shop.clone())
        .layer(layer)
        .layer(tower::util::MapRequestLayer::new(authenticate))
        .layer(tower::util::MapRequestLayer::new(
            move |req: Request<axum::body::Body>| {
                arrived.fetch_add(1, Ordering::SeqCst);
                req
            },
        ))
}

async fn idempotent_server(
    configure: impl FnOnce(IdempotencyLayerBuilder) -> IdempotencyLayerBuilder,
) -> (Server, Shop) {
    idempotent_server_with(Shop::new(), configure).await
}

async fn idempotent_server_with(
    shop: Shop,
    configure: impl FnOnce(IdempotencyLayerBuilder) -> IdempotencyLayerBuilder,
) -> (Server, Shop) {
    let (server, shop, _runtime) = idempotent_runtime_server(shop, configure).await;
    (server, shop)
}

async fn idempotent_runtime_server(
    shop: Shop,
    configure: impl FnOnce(IdempotencyLayerBuilder) -> IdempotencyLayerBuilder,
) -> (Server, Shop, Runtime) {
    let runtime = Runtime::start().await.expect("runtime starts");
    let layer = configure(IdempotencyLayer::builder(&runtime))
        .build()
        .expect("valid layer");
    (serve(app(layer, &shop)).await, shop, runtime)
}

fn charge(n: usize, body: &str) -> String {
    serde_json::json!({ "charge": n, "body": body }).to_string()
}

// H1
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_repeat_gets_the_stored_status_body_and_content_type_flagged_replayed() {
    let (server, shop) =
        idempotent_server(|l| l.with_kept_headers([HeaderName::from_static("location")])).await;

    let first = server.post("/pay", "k-1", "100 EUR").await;
    assert_eq!(first.status, StatusCode::CREATED);
    assert_eq!(first.text(), charge(1, "100 EUR"));
    assert_eq!(first.header("content-type"), Some("application/json"));
    assert_eq!(first.header("location"), Some("/charges/1"));
    assert_eq!(first.header("set-cookie"), Some("s=1"));
    assert_eq!(first.header("idempotent-replayed"), None);

    // The same key bare and as an RFC 9651 string.
    for key in ["k-1", "\"k-1\""] {
        let again = server.post("/pay", key, "100 EUR").await;
        assert_eq!(again.status, StatusCode::CREATED);
        assert_eq!(again.body, first.body);
        assert_eq!(again.header("content-type"), Some("application/json"));
        assert_eq!(again.header("location"), Some("/charges/1"));
        assert_eq!(again.header("idempotent-replayed"), Some("true"));
        // Not on the allow-list: another response's cookies are never handed out.
        assert_eq!(again.header("set-cookie"), None);
    }
    assert_eq!(shop.runs(), 1);

    // PUT is not guarded by default: it runs every time.
    for n in 2..=3 {
        let put = server
            .send(Method::PUT, "/pay", &[("idempotency-key", "k-1")], "x")
            .await;
        assert_eq!(put.text(), charge(n, "x"));
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_guarded_methods_can_be_chosen() {
    let (server, shop) = idempotent_server(|l| l.with_methods([Method::PUT])).await;
    for _ in 0..2 {
        let put = server
            .send(Method::PUT, "/pay", &[("idempotency-key", "k")], "x")
            .await;
        assert_eq!(put.text(), charge(1, "x"));
    }
    let post = server.post("/pay", "k", "x").await;
    assert_eq!(post.text(), charge(2, "x"));
    assert_eq!(shop.runs(), 2);
}

// H2
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_key_reused_with_another_method_path_query_or_body_is_422() {
    let (server, shop) = idempotent_server(|l| l).await;
    assert_eq!(
        server.post("/pay?currency=eur", "k-2", "100").await.status,
        StatusCode::CREATED
    );

    let reused = problem(
        "idempotency-key-reused",
        "Idempotency key reused for a different request",
        422,
        "idempotency key \"k-2\" was used for a different method, path, query or body",
    );
    for (method, path, body) in [
        (Method::POST, "/pay?currency=eur", "200"),
        (Method::POST, "/pay?currency=usd", "100"),
        (Method::POST, "/pay", "100"),
        (Method::POST, "/lookup?currency=eur", "100"),
        (Method::PATCH, "/pay?currency=eur", "100"),
    ] {
        let reply = server
            .send(method, path, &[("idempotency-key", "k-2")], body)
            .await;
        assert_eq!(
            reply.status,
            StatusCode::UNPROCESSABLE_ENTITY,
            "{path} {body}"
        );
        assert_eq!(
            reply.header("content-type"),
            Some("application/problem+json")
        );
        assert_eq!(reply.json(), reused);
    }
    assert_eq!(shop.runs(), 1);
}

// H3, wait mode
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_duplicate_that_waits_past_the_wait_timeout_is_409() {
    let (server, shop) = idempotent_server(|l| {
        l.with_options(IdempotencyOptions::new().with_wait_timeout(Duration::from_millis(50)))
    })
    .await;
    shop.close();
    let first = tokio::spawn({
        let server = server.clone();
        async move { server.post("/pay", "k-3", "1").await }
    });
    while shop.runs() == 0 {
        tokio::task::yield_now().await;
    }

    let late = server.post("/pay", "k-3", "1").await;
    assert_eq!(late.status, StatusCode::CONFLICT);
    assert_eq!(
        late.header("content-type"),
        Some("application/problem+json")
    );
    assert_eq!(late.header("retry-after"), Some("1"));
    assert_eq!(
        late.json(),
        problem(
            "idempotency-key-in-flight",
            "A request with this idempotency key is in progress",
            409,
            "the first request with idempotency key \"k-3\" is still running after 50 ms",
        )
    );

    shop.open();
    let first = first.await.unwrap();
    assert_eq!(first.status, StatusCode::CREATED);
    assert_eq!(first.text(), charge(1, "1"));
    let replay = server.post("/pay", "k-3", "1").await;
    assert_eq!(replay.header("idempotent-replayed"), Some("true"));
    assert_eq!(shop.runs(), 1);
}

// H4
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn bad_keys_are_400_and_the_handler_does_not_run() {
    let (server, shop) = idempotent_server(|l| l).await;
    let long = "k".repeat(256);
    let long_detail = format!(
        "idempotency key \"{}…\" is 256 bytes, over the 255-byte limit",
        "k".repeat(64)
    );
    let cases: [(&[(&str, &str)], &str); 4] = [
        (
            &[("idempotency-key", "")],
            "the Idempotency-Key header is empty",
        ),
        (
            &[("idempotency-key", "\"\"")],
            "the Idempotency-Key header is empty",
        ),
        (&[("idempotency-key", &long)], &long_detail),
        (
            &[("idempotency-key", "a"), ("idempotency-key", "b")],
            "more than one Idempotency-Key header",
        ),
    ];
    for (headers, detail) in cases {
        let reply = server.send(Method::POST, "/pay", headers, "1").await;
        assert_eq!(reply.status, StatusCode::BAD_REQUEST, "{detail}");
        assert_eq!(
            reply.header("content-type"),
            Some("application/problem+json")
        );
        assert_eq!(
            reply.json(),
            problem(
                "idempotency-key-invalid",
                "Invalid Idempotency-Key header",
                400,
                detail
            )
        );
    }
    assert_eq!(shop.runs(), 0);

    let longest = "k".repeat(255);
    let reply = server.post("/pay", &longest, "1").await;
    assert_eq!(reply.status, StatusCode::CREATED);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_missing_key_passes_through_unless_keys_are_required() {
    let (server, shop) = idempotent_server(|l| l).await;
    for n in 1..=2 {
        let reply = server.send(Method::POST, "/pay", &[], "1").await;
        assert_eq!(reply.text(), charge(n, "1"));
        assert_eq!(reply.header("idempotent-replayed"), None);
    }

    let (server, shop2) = idempotent_server(|l| l.with_required_key(true)).await;
    let reply = server.send(Method::POST, "/pay", &[], "1").await;
    assert_eq!(reply.status, StatusCode::BAD_REQUEST);
    assert_eq!(
        reply.json(),
        problem(
            "idempotency-key-missing",
            "Missing Idempotency-Key header",
            400,
            "this request needs an Idempotency-Key header"
        )
    );
    assert_eq!(shop2.runs(), 0);
    // Unguarded methods need no key.
    let get = server.send(Method::GET, "/lookup", &[], "").await;
    assert_eq!(get.text(), "looked up 1");
    assert_eq!(shop.runs(), 2);
}

// H5
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_5xx_is_not_stored_and_the_retry_runs_again() {
    let (server, shop) = idempotent_server(|l| l).await;
    let first = server.post("/flaky", "k-5", "").await;
    assert_eq!(first.status, StatusCode::SERVICE_UNAVAILABLE);
    assert_eq!(first.text(), "down 1");
    let retry = server.post("/flaky", "k-5", "").await;
    assert_eq!(retry.status, StatusCode::OK);
    assert_eq!(retry.text(), "up 2");
    assert_eq!(retry.header("idempotent-replayed"), None);
    let replay = server.post("/flaky", "k-5", "").await;
    assert_eq!(replay.text(), "up 2");
    assert_eq!(replay.header("idempotent-replayed"), Some("true"));
    assert_eq!(shop.runs(), 2);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_handler_that_panics_gets_500_and_the_retry_runs_again() {
    let (server, shop) = idempotent_server(|l| l).await;
    let first = server.post("/boom", "k-p", "").await;
    assert_eq!(first.status, StatusCode::INTERNAL_SERVER_ERROR);
    assert_eq!(
        first.json(),
        problem(
            "handler-panicked",
            "Internal server error",
            500,
            "the handler for idempotency key \"k-p\" failed; nothing was stored"
        )
    );
    let retry = server.post("/boom", "k-p", "").await;
    assert_eq!(retry.status, StatusCode::OK);
    assert_eq!(retry.text(), "recovered");
    assert_eq!(shop.runs(), 2);
}

// H6, H13
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_same_key_under_two_tenants_runs_twice() {
    let (server, shop) = idempotent_server(|l| {
        l.with_scope_from_extension(|account: &Account| account.tenant.to_owned())
    })
    .await;
    let send = |claimed: &'static str, auth: &'static str| {
        let server = server.clone();
        async move {
            server
                .send(
                    Method::POST,
                    "/pay",
                    &[
                        ("idempotency-key", "k-6"),
                        // What the client says: never the scope.
                        ("x-tenant", claimed),
                        ("authorization", auth),
                    ],
                    "1",
                )
                .await
        }
    };
    let acme = send("acme", "Bearer alice").await;
    let globex = send("globex", "Bearer carol").await;
    assert_eq!(acme.text(), charge(1, "1"));
    assert_eq!(globex.text(), charge(2, "1"));
    // The tenant is the scope: another user of the same tenant replays.
    let acme_again = send("acme", "Bearer bob").await;
    assert_eq!(acme_again.text(), charge(1, "1"));
    assert_eq!(acme_again.header("idempotent-replayed"), Some("true"));
    // Claiming another tenant in a header does not reach its stored response.
    let claims_acme = send("acme", "Bearer carol").await;
    assert_eq!(claims_acme.text(), charge(2, "1"));
    assert_eq!(shop.runs(), 2);
}

// H13: a header scope is an explicit choice that trusts the header.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_trusted_header_scope_is_read_from_the_header() {
    let (server, shop) =
        idempotent_server(|l| l.with_trusted_header_scope(HeaderName::from_static("x-tenant")))
            .await;
    let send = |tenant: &'static str| {
        let server = server.clone();
        async move {
            server
                .send(
                    Method::POST,
                    "/pay",
                    &[("idempotency-key", "k-h"), ("x-tenant", tenant)],
                    "1",
                )
                .await
        }
    };
    assert_eq!(send("acme").await.text(), charge(1, "1"));
    assert_eq!(send("globex").await.text(), charge(2, "1"));
    assert_eq!(
        send("acme").await.header("idempotent-replayed"),
        Some("true")
    );
    assert_eq!(shop.runs(), 2);
}

// H13
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_scope_over_the_key_limit_is_400_and_the_handler_does_not_run() {
    let (server, shop) =
        idempotent_server(|l| l.with_trusted_header_scope(HeaderName::from_static("x-tenant")))
            .await;
    let long = "t".repeat(1013);
    let reply = server
        .send(
            Method::POST,
            "/pay",
            &[("idempotency-key", "k-long"), ("x-tenant", &long)],
            "1",
        )
        .await;
    assert_eq!(reply.status, StatusCode::BAD_REQUEST);
    assert_eq!(
        reply.json(),
        problem(
            "idempotency-scope-invalid",
            "Idempotency scope too long",
            400,
            "the scope named for this request is 1013 bytes, over the 1012-byte limit"
        )
    );
    assert_eq!(shop.runs(), 0);
    // At the limit it runs.
    let ok = server
        .send(
            Method::POST,
            "/pay",
            &[("idempotency-key", "k-long"), ("x-tenant", &long[1..])],
            "1",
        )
        .await;
    assert_eq!(ok.status, StatusCode::CREATED);
}

// H10
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn only_what_a_retry_should_get_back_is_stored() {
    let (server, shop) = idempotent_server(|l| l).await;
    let mut expected_runs = 0;
    for code in [
        400u16, 401, 403, 408, 409, 413, 415, 422, 425, 429, 406, 412, 500, 502, 503,
    ] {
        let path = format!("/status/{code}");
        let key = format!("k-{code}");
        let first = server.post(&path, &key, "x").await;
        let retry = server.post(&path, &key, "x").await;
        expected_runs += 2;
        assert_eq!(first.status.as_u16(), code);
        assert_eq!(retry.status.as_u16(), code);
        assert_eq!(retry.header("idempotent-replayed"), None, "{code}");
        assert_eq!(shop.runs(), expected_runs, "{code} was stored");
    }
    // An inner rate limiter's 429 is never replayed without its own Retry-After.
    let limited = server.post("/status/429", "k-429", "x").await;
    assert!(limited.header("retry-after").is_some());
    expected_runs += 1;
    for code in [200u16, 201, 202, 204, 301, 303, 402, 404, 405, 410, 451] {
        let path = format!("/status/{code}");
        let key = format!("k-{code}");
        let first = server.post(&path, &key, "x").await;
        let retry = server.post(&path, &key, "x").await;
        expected_runs += 1;
        assert_eq!(first.status.as_u16(), code);
        assert_eq!(retry.status.as_u16(), code);
        assert_eq!(retry.header("idempotent-replayed"), Some("true"), "{code}");
        assert_eq!(retry.body, first.body);
        assert_eq!(shop.runs(), expected_runs, "{code} was not stored");
    }
}

// H10: the rule is the operator's to choose.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_store_rule_can_be_chosen() {
    let (server, shop) =
        idempotent_server(|l| l.with_store_when(|status| !status.is_server_error())).await;
    let first = server.post("/status/415", "k-415", "x").await;
    let retry = server.post("/status/415", "k-415", "x").await;
    assert_eq!(retry.status, StatusCode::UNSUPPORTED_MEDIA_TYPE);
    assert_eq!(retry.header("idempotent-replayed"), Some("true"));
    assert_eq!(retry.body, first.body);
    assert_eq!(shop.runs(), 1);
    let (server, shop) = idempotent_server(|l| l.with_store_when(|_| false)).await;
    server.post("/status/201", "k-201", "x").await;
    let again = server.post("/status/201", "k-201", "x").await;
    assert_eq!(again.header("idempotent-replayed"), None);
    assert_eq!(shop.runs(), 2);
}

// Trailers: a response whose trailers the envelope cannot keep passes whole, unstored.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_response_with_trailers_passes_with_them_unstored() {
    let (server, shop) = idempotent_server(|l| l).await;
    for (path, n) in [
        ("/trailers", 1),
        ("/trailers", 2),
        ("/grpc", 3),
        ("/grpc", 4),
    ] {
        let reply = server
            .send(
                Method::POST,
                path,
                &[("idempotency-key", path), ("te", "trailers")],
                "x",
            )
            .await;
        assert_eq!(reply.status, StatusCode::OK, "{path}");
        assert_eq!(reply.header("idempotent-replayed"), None, "{path}");
        let trailers = reply.trailers.expect("trailers");
        assert_eq!(trailers["x-checksum"], n.to_string().as_str(), "{path}");
        assert_eq!(shop.runs(), n);
    }
}

// H6/H9/H10 configuration errors surface when the layer is built.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn bad_settings_are_refused_when_the_layer_is_built() {
    let runtime = Runtime::start().await.unwrap();
    let err = IdempotencyLayer::builder(&runtime)
        .with_options(IdempotencyOptions::new().with_wait_timeout(Duration::ZERO))
        .build()
        .unwrap_err();
    assert_eq!(
        err.to_string(),
        "invalid idempotency layer setting `wait timeout`: must be greater than zero"
    );
    let err = IdempotencyLayer::builder(&runtime)
        .with_options(IdempotencyOptions::new().with_ttl(Duration::from_micros(10)))
        .build()
        .unwrap_err();
    assert_eq!(
        (err.setting(), err.reason()),
        ("ttl", "must be at least 1 ms")
    );
    let err = IdempotencyLayer::builder(&runtime)
        .with_kept_headers([HeaderName::from_static("set-cookie")])
        .build()
        .unwrap_err();
    assert_eq!(err.setting(), "kept headers");
    let err = IdempotencyLayer::builder(&runtime)
        .with_methods([])
        .build()
        .unwrap_err();
    assert_eq!(err.setting(), "methods");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn without_a_scope_two_users_with_the_same_key_and_body_run_twice() {
    let (server, shop) = idempotent_server(|l| l).await;
    let send = |headers: &'static [(&'static str, &'static str)]| {
        let server = server.clone();
        async move { server.send(Method::POST, "/pay", headers, "1").await }
    };
    let alice = send(&[
        ("idempotency-key", "k-9"),
        ("authorization", "Bearer alice"),
    ])
    .await;
    let bob = send(&[("idempotency-key", "k-9"), ("authorization", "Bearer bob")]).await;
    let carol = send(&[("idempotency-key", "k-9"), ("cookie", "session=carol")]).await;
    let anonymous = send(&[("idempotency-key", "k-9")]).await;
    assert_eq!(alice.text(), charge(1, "1"));
    assert_eq!(bob.text(), charge(2, "1"));
    assert_eq!(carol.text(), charge(3, "1"));
    assert_eq!(anonymous.text(), charge(4, "1"));
    let alice_again = send(&[
        ("idempotency-key", "k-9"),
        ("authorization", "Bearer alice"),
    ])
    .await;
    assert_eq!(alice_again.text(), charge(1, "1"));
    assert_eq!(alice_again.header("idempotent-replayed"), Some("true"));
    assert_eq!(shop.runs(), 4);

    // Opting into one shared namespace replays across users.
    let (server, shop) = idempotent_server(|l| l.with_shared_scope()).await;
    let a = server
        .send(
            Method::POST,
            "/pay",
            &[("idempotency-key", "k"), ("authorization", "Bearer a")],
            "1",
        )
        .await;
    let b = server
        .send(
            Method::POST,
            "/pay",
            &[("idempotency-key", "k"), ("authorization", "Bearer b")],
            "1",
        )
        .await;
    assert_eq!(a.body, b.body);
    assert_eq!(b.header("idempotent-replayed"), Some("true"));
    assert_eq!(shop.runs(), 1);
}

// H7
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_body_over_the_limit_is_413_and_the_handler_does_not_run() {
    let (server, shop) = idempotent_server(|l| l.with_max_body(16)).await;
    let too_large = problem(
        "request-body-too-large",
        "Request body too large",
        413,
        "the request body is over the 16-byte limit",
    );
    let reply = server.post("/pay", "k-7", &"x".repeat(17)).await;
    assert_eq!(reply.status, StatusCode::PAYLOAD_TOO_LARGE);
    assert_eq!(
        reply.header("content-type"),
        Some("application/problem+json")
    );
    assert_eq!(reply.json(), too_large);
    assert_eq!(shop.runs(), 0);
    let fits = server.post("/pay", "k-7", &"x".repeat(16)).await;
    assert_eq!(fits.status, StatusCode::CREATED);

    // Without a declared length the limit holds while reading.
    let runtime = Runtime::start().await.unwrap();
    let service = tower::ServiceBuilder::new()
        .layer(
            IdempotencyLayer::builder(&runtime)
                .with_max_body(16)
                .build()
                .unwrap(),
        )
        .service_fn(|_req| async {
            Ok::<_, std::convert::Infallible>(http::Response::new(http_body_util::Full::new(
                Bytes::new(),
            )))
        });
    let request = Request::post("/pay")
        .header("idempotency-key", "k")
        .body(Chunks::new(3, 8))
        .unwrap();
    let response = service.oneshot(request).await.unwrap();
    assert_eq!(response.status(), StatusCode::PAYLOAD_TOO_LARGE);
    let body = response.into_body().collect().await.unwrap().to_bytes();
    assert_eq!(
        serde_json::from_slice::<serde_json::Value>(&body).unwrap(),
        too_large
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_response_over_the_storage_limit_passes_through_unstored() {
    let (server, shop) = idempotent_server(|l| l.with_max_stored_response(64)).await;
    let first = server.post("/big", "k-b", "").await;
    assert_eq!(first.status, StatusCode::OK);
    assert_eq!(first.text(), format!("1{}", "x".repeat(99)));
    let retry = server.post("/big", "k-b", "").await;
    assert_eq!(retry.text(), format!("2{}", "x".repeat(99)));
    assert_eq!(retry.header("idempotent-replayed"), None);
    assert_eq!(shop.runs(), 2);
}

async fn hundred_duplicates(server: &Server) -> Vec<Reply> {
    let tasks: Vec<_> = (0..100)
        .map(|_| {
            let server = server.clone();
            tokio::spawn(async move { server.post("/pay", "k-100", "1").await })
        })
        .collect();
    let mut replies = Vec::new();
    for task in tasks {
        replies.push(task.await.unwrap());
    }
    replies
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_hundred_concurrent_duplicates_wait_and_share_one_run() {
    let shop = Shop {
        wait_for_arrivals: 100,
        ..Shop::new()
    };
    let (server, shop) = idempotent_server_with(shop, |l| l).await;
    let replies = hundred_duplicates(&server).await;
    assert_eq!(shop.runs(), 1);
    assert_eq!(shop.arrived.load(Ordering::SeqCst), 100);
    for reply in &replies {
        assert_eq!(reply.status, StatusCode::CREATED);
        assert_eq!(reply.text(), charge(1, "1"));
    }
    let replayed = replies
        .iter()
        .filter(|r| r.header("idempotent-replayed") == Some("true"))
        .count();
    assert_eq!(replayed, 99);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_hundred_concurrent_duplicates_failing_fast_get_one_2xx_and_99_409s() {
    let (server, shop) = idempotent_server(|l| l.with_fail_fast(true)).await;
    shop.close();
    let (done_tx, mut done) = tokio::sync::mpsc::unbounded_channel();
    for _ in 0..100 {
        let (server, done_tx) = (server.clone(), done_tx.clone());
        tokio::spawn(async move {
            let _ = done_tx.send(server.post("/pay", "k-ff", "1").await);
        });
    }
    let mut replies = Vec::new();
    while replies.len() < 99 {
        replies.push(done.recv().await.unwrap());
    }
    // Every duplicate was answered while the first still runs.
    assert_eq!(shop.runs(), 1);
    shop.open();
    replies.push(done.recv().await.unwrap());

    let conflicts: Vec<_> = replies
        .iter()
        .filter(|r| r.status == StatusCode::CONFLICT)
        .collect();
    assert_eq!(conflicts.len(), 99);
    for conflict in conflicts {
        assert_eq!(conflict.header("retry-after"), Some("1"));
        assert_eq!(
            conflict.json(),
            problem(
                "idempotency-key-in-flight",
                "A request with this idempotency key is in progress",
                409,
                "the first request with idempotency key \"k-ff\" is still running",
            )
        );
    }
    let created = replies.last().unwrap();
    assert_eq!(created.status, StatusCode::CREATED);
    assert_eq!(created.text(), charge(1, "1"));
    assert_eq!(shop.runs(), 1);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_shut_down_runtime_answers_503() {
    let runtime = Runtime::start().await.unwrap();
    let shop = Shop::new();
    let server = serve(app(IdempotencyLayer::new(&runtime), &shop)).await;
    runtime.shutdown(Duration::from_millis(10)).await;
    let reply = server.post("/pay", "k-s", "1").await;
    assert_eq!(reply.status, StatusCode::SERVICE_UNAVAILABLE);
    assert_eq!(
        reply.json(),
        problem(
            "idempotency-unavailable",
            "Idempotency store unavailable",
            503,
            "idempotency key \"k-s\" cannot be checked now"
        )
    );
    assert_eq!(shop.runs(), 0);
}

// ---- rate limiting (H8) ----

async fn hello() -> &'static str {
    "hello"
}

async fn rate_limited_server(layer: RateLimitLayer) -> Server {
    serve(Router::new().route("/", get(hello)).layer(layer)).await
}

fn gcra(clock: &ManualClock) -> Limiter<Gcra> {
    Limiter::builder(Gcra::new(2, Duration::from_secs(60)).unwrap())
        .with_clock(clock.clone())
        .build()
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn n_allowed_then_429_with_retry_after_and_the_headers_on_every_response() {
    let clock = ManualClock::new(1_000_000);
    let enforcer = Enforcer::new(gcra(&clock)).with_headers(
        HeaderOptions::new()
            .with_structured(true)
            .with_policy(PolicyName::new("api").unwrap()),
    );
    let server = rate_limited_server(RateLimitLayer::new(enforcer)).await;

    for (remaining, reset) in [("1", "30"), ("0", "60")] {
        let ok = server.send(Method::GET, "/", &[], "").await;
        assert_eq!(ok.status, StatusCode::OK);
        assert_eq!(ok.text(), "hello");
        assert_eq!(ok.header("ratelimit-limit"), Some("2"));
        assert_eq!(ok.header("ratelimit-remaining"), Some(remaining));
        assert_eq!(ok.header("ratelimit-reset"), Some(reset));
        assert_eq!(
            ok.header("ratelimit"),
            Some(format!("\"api\";r={remaining};t={reset}").as_str())
        );
        assert_eq!(ok.header("ratelimit-policy"), Some("\"api\";q=2;w=60"));
        assert_eq!(ok.header("retry-after"), None);
    }

    clock.advance(Duration::from_secs(10));
    let denied = server.send(Method::GET, "/", &[], "").await;
    assert_eq!(denied.status, StatusCode::TOO_MANY_REQUESTS);
    assert_eq!(denied.header("retry-after"), Some("20"));
    assert_eq!(denied.header("ratelimit-limit"), Some("2"));
    assert_eq!(denied.header("ratelimit-remaining"), Some("0"));
    assert_eq!(denied.header("ratelimit-reset"), Some("50"));
    assert_eq!(denied.header("ratelimit"), Some("\"api\";r=0;t=50"));
    assert_eq!(
        denied.header("content-type"),
        Some("application/problem+json")
    );
    assert_eq!(
        denied.json(),
        problem(
            "rate-limited",
            "Too many requests",
            429,
            "rate limit exceeded; retry after 20 s"
        )
    );

    clock.advance(Duration::from_secs(20));
    assert_eq!(
        server.send(Method::GET, "/", &[], "").await.status,
        StatusCode::OK
    );
}

fn forwarded_for(
    server: &Server,
    header: &'static str,
    client: &'static str,
) -> impl Future<Output = Reply> {
    let server = server.clone();
    async move { server.send(Method::GET, "/", &[(header, client)], "").await }
}

/// A layer keyed by client IP, read from `header` when the peer is in `trusted`.
fn behind(clock: &ManualClock, header: ProxyHeader, trusted: &str) -> RateLimitLayer {
    let client = ClientIp::new()
        .with_proxy_header(header)
        .with_trusted_proxies([trusted])
        .unwrap();
    RateLimitLayer::new(Enforcer::new(gcra(clock))).with_key(RateLimitKey::client_ip(client))
}

/// Sends three requests, each with the headers `nth` gives it, and returns their statuses.
async fn three(server: &Server, nth: impl Fn(usize) -> Vec<(&'static str, String)>) -> Vec<u16> {
    let mut statuses = Vec::new();
    for i in 0..3 {
        let headers = nth(i);
        let headers: Vec<(&str, &str)> = headers.iter().map(|(n, v)| (*n, v.as_str())).collect();
        let reply = server.send(Method::GET, "/", &headers, "").await;
        statuses.push(reply.status.as_u16());
    }
    statuses
}

/// What a client that rotates a forged address per request would like: a fresh bucket each.
const ONE_BUCKET: [u16; 3] = [200, 200, 429];

// H11
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn behind_a_trusted_proxy_each_forwarded_client_has_its_own_limit() {
    for (header, name, a, b) in [
        (
            ProxyHeader::XForwardedFor,
            "x-forwarded-for",
            "198.51.100.1",
            "198.51.100.2",
        ),
        (
            ProxyHeader::Forwarded,
            "forwarded",
            "for=203.0.113.1",
            "for=\"[2001:db8::1]:4711\"",
        ),
        (ProxyHeader::XRealIp, "x-real-ip", "192.0.2.1", "192.0.2.2"),
    ] {
        let clock = ManualClock::new(0);
        let server = rate_limited_server(behind(&clock, header, "127.0.0.1")).await;
        for _ in 0..2 {
            assert_eq!(forwarded_for(&server, name, a).await.status, StatusCode::OK);
        }
        assert_eq!(
            forwarded_for(&server, name, a).await.status,
            StatusCode::TOO_MANY_REQUESTS
        );
        // Another client behind the same proxy is independent.
        let other = forwarded_for(&server, name, b).await;
        assert_eq!(other.status, StatusCode::OK, "{name}");
        assert_eq!(other.header("ratelimit-remaining"), Some("1"));
    }
}

// H11: from an untrusted peer, no forwarding header buys a new bucket.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_client_rotating_forwarding_headers_from_an_untrusted_peer_stays_in_one_bucket() {
    for header in [
        ProxyHeader::Forwarded,
        ProxyHeader::XForwardedFor,
        ProxyHeader::XRealIp,
    ] {
        let clock = ManualClock::new(0);
        // The proxies are in 10.0.0.0/8; the test client (127.0.0.1) is not one.
        let server = rate_limited_server(behind(&clock, header, "10.0.0.0/8")).await;
        let rotating = three(&server, |i| {
            vec![
                ("forwarded", format!("for=198.51.100.{i}")),
                ("x-forwarded-for", format!("198.51.100.{i}")),
                ("x-real-ip", format!("198.51.100.{i}")),
            ]
        })
        .await;
        assert_eq!(rotating, ONE_BUCKET, "{header:?}");
    }
}

// H11: the header the proxy does not write is the client's own, and is ignored.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn behind_a_proxy_that_writes_one_header_a_client_rotating_the_other_stays_in_one_bucket() {
    let clock = ManualClock::new(0);
    // A proxy (the test client, 127.0.0.1) that writes `Forwarded` and passes
    // `X-Forwarded-For` through as the client sent it.
    let server = rate_limited_server(behind(&clock, ProxyHeader::Forwarded, "127.0.0.1")).await;
    let rotating = three(&server, |i| {
        vec![
            ("x-forwarded-for", format!("198.51.100.{i}")),
            ("forwarded", "for=203.0.113.5;proto=http".to_owned()),
        ]
    })
    .await;
    assert_eq!(rotating, ONE_BUCKET);

    // A proxy that appends `X-Forwarded-For` and passes `Forwarded` through.
    let clock = ManualClock::new(0);
    let server = rate_limited_server(behind(&clock, ProxyHeader::XForwardedFor, "127.0.0.1")).await;
    let rotating = three(&server, |i| {
        vec![
            ("forwarded", format!("for=198.51.100.{i}")),
            ("x-forwarded-for", "203.0.113.5".to_owned()),
        ]
    })
    .await;
    assert_eq!(rotating, ONE_BUCKET);
}

// H11: what a client writes left of the proxy's entry is never read.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_client_forging_entries_left_of_the_proxys_stays_in_one_bucket() {
    let clock = ManualClock::new(0);
    let server = rate_limited_server(behind(&clock, ProxyHeader::XForwardedFor, "127.0.0.1")).await;
    let rotating = three(&server, |i| {
        // The client sent `X-Forwarded-For: 198.51.100.<i>`; the proxy appended its peer.
        vec![("x-forwarded-for", format!("198.51.100.{i}, 203.0.113.5"))]
    })
    .await;
    assert_eq!(rotating, ONE_BUCKET);

    let clock = ManualClock::new(0);
    let server = rate_limited_server(behind(&clock, ProxyHeader::Forwarded, "127.0.0.1")).await;
    let rotating = three(&server, |i| {
        // A proxy that hides its client (`for=_hidden`): keyed by the proxy, not by the
        // client's forged element.
        vec![("forwarded", format!("for=198.51.100.{i}, for=_hidden"))]
    })
    .await;
    assert_eq!(rotating, ONE_BUCKET);
}

// H11: one derivation: the layer's key is `ClientIp::key_from_headers`.
#[test]
fn the_layer_and_client_ip_derive_the_same_address() {
    let peer: std::net::SocketAddr = "10.0.0.5:41000".parse().unwrap();
    let requests = [
        vec![("x-forwarded-for", "198.51.100.1, 10.0.0.9")],
        vec![("forwarded", "for=198.51.100.2")],
        vec![("x-real-ip", "198.51.100.3")],
        vec![
            ("forwarded", "for=198.51.100.4"),
            ("x-forwarded-for", "198.51.100.5"),
            ("x-real-ip", "198.51.100.6"),
        ],
        vec![("x-forwarded-for", "2001:db8:1:2::9")],
        vec![],
    ];
    for header in [
        ProxyHeader::XForwardedFor,
        ProxyHeader::Forwarded,
        ProxyHeader::XRealIp,
    ] {
        for trusted in ["10.0.0.0/8", "192.0.2.0/24"] {
            let client = ClientIp::new()
                .with_proxy_header(header)
                .with_trusted_proxies([trusted])
                .unwrap();
            let key = RateLimitKey::client_ip(client.clone());
            for headers in &requests {
                let mut request = Request::get("/");
                for (name, value) in headers {
                    request = request.header(*name, *value);
                }
                let mut request = request.body(()).unwrap();
                request.extensions_mut().insert(peer);
                let (parts, ()) = request.into_parts();
                assert_eq!(
                    key.key(&parts),
                    Some(client.key_from_headers(peer.ip(), &parts.headers)),
                    "{header:?} {trusted} {headers:?}"
                );
            }
        }
    }
}

// H12
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn without_a_peer_address_the_client_ip_layer_answers_500_naming_the_fix() {
    let clock = ManualClock::new(0);
    let app = || Router::new().route("/", get(hello));
    let layer = RateLimitLayer::new(Enforcer::new(gcra(&clock)));
    let server = serve_without_connect_info(app().layer(layer)).await;
    for _ in 0..3 {
        let refused = server.send(Method::GET, "/", &[], "").await;
        assert_eq!(refused.status, StatusCode::INTERNAL_SERVER_ERROR);
        assert_eq!(
            refused.header("content-type"),
            Some("application/problem+json")
        );
        let doc = refused.json();
        assert_eq!(
            doc["type"],
            "tag:throttlebeam,2026:client-address-unavailable"
        );
        let detail = doc["detail"].as_str().unwrap();
        assert!(
            detail.contains("into_make_service_with_connect_info::<SocketAddr>()"),
            "{detail}"
        );
    }

    // Asked for, one bucket for every client without an address.
    let clock = ManualClock::new(0);
    let layer = RateLimitLayer::new(Enforcer::new(gcra(&clock))).with_shared_bucket_without_peer();
    let server = serve_without_connect_info(app().layer(layer)).await;
    assert_eq!(three(&server, |_| Vec::new()).await, ONE_BUCKET);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn clients_keyed_by_header_are_independent_and_keyless_requests_share_a_bucket() {
    let clock = ManualClock::new(0);
    let key = RateLimitKey::header(HeaderName::from_static("x-api-key"));
    let server =
        rate_limited_server(RateLimitLayer::new(Enforcer::new(gcra(&clock))).with_key(key)).await;
    let with_key = |k: &'static str| {
        let server = server.clone();
        async move {
            server
                .send(Method::GET, "/", &[("x-api-key", k)], "")
                .await
                .status
        }
    };
    assert_eq!(with_key("a").await, StatusCode::OK);
    assert_eq!(with_key("a").await, StatusCode::OK);
    assert_eq!(with_key("a").await, StatusCode::TOO_MANY_REQUESTS);
    assert_eq!(with_key("b").await, StatusCode::OK);
    for expected in [
        StatusCode::OK,
        StatusCode::OK,
        StatusCode::TOO_MANY_REQUESTS,
    ] {
        assert_eq!(
            server.send(Method::GET, "/", &[], "").await.status,
            expected
        );
    }
}

/// A store that is down.
struct DownStore;

impl RateLimitStore<Gcra> for DownStore {
    fn apply(&self, request: RateLimitRequest<'_, Gcra>) -> Result<RateLimitReply, RateLimitError> {
        Err(RateLimitError::store(request.key, "connection refused"))
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_store_failure_passes_when_failing_open_and_is_503_when_failing_closed() {
    let limiter = || {
        Limiter::builder(Gcra::new(2, Duration::from_secs(60)).unwrap())
            .with_store(DownStore)
            .build()
    };
    let errors = Arc::new(AtomicUsize::new(0));
    let counted = Arc::clone(&errors);
    let open = Enforcer::new(limiter())
        .with_fail_mode(FailMode::Open)
        .on_error(move |_, _| {
            counted.fetch_add(1, Ordering::SeqCst);
        });
    let server = rate_limited_server(RateLimitLayer::new(open)).await;
    let passed = server.send(Method::GET, "/", &[], "").await;
    assert_eq!(passed.status, StatusCode::OK);
    assert_eq!(passed.text(), "hello");
    assert_eq!(passed.header("ratelimit-limit"), None);
    assert_eq!(errors.load(Ordering::SeqCst), 1);

    let closed = Enforcer::new(limiter()).with_fail_mode(FailMode::Closed);
    let server = rate_limited_server(RateLimitLayer::new(closed)).await;
    let refused = server.send(Method::GET, "/", &[], "").await;
    assert_eq!(refused.status, StatusCode::SERVICE_UNAVAILABLE);
    assert_eq!(refused.header("retry-after"), None);
    assert_eq!(
        refused.json(),
        problem(
            "rate-limit-unavailable",
            "Rate limiter unavailable",
            503,
            "the rate limiter cannot decide now"
        )
    );

    // The asynchronous path applies the same policy.
    let closed = Enforcer::new(limiter()).with_fail_mode(FailMode::Closed);
    let server = rate_limited_server(RateLimitLayer::new(closed)).await;
    assert_eq!(
        server.send(Method::GET, "/", &[], "").await.status,
        StatusCode::SERVICE_UNAVAILABLE
    );
}

/// A store behind a network, as far as the layer can tell: it answers through a future that
/// is pending once.
struct Remote(throttlebeam::rate_limit::MemoryRateLimitStore<throttlebeam::rate_limit::GcraState>);

impl throttlebeam::rate_limit::AsyncRateLimitStore<Gcra> for Remote {
    fn apply_async(
        &self,
        request: RateLimitRequest<'_, Gcra>,
    ) -> impl Future<Output = Result<RateLimitReply, RateLimitError>> + Send {
        let reply = self.0.apply(request);
        async move {
            tokio::task::yield_now().await;
            reply
        }
    }
}

// One constructor: a store that answers through a future limits the same way.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_asynchronous_store_limits_the_same_way() {
    let clock = ManualClock::new(0);
    let limiter = Limiter::builder(Gcra::new(2, Duration::from_secs(60)).unwrap())
        .with_clock(clock.clone())
        .with_store(Remote(Default::default()))
        .build();
    let server = rate_limited_server(RateLimitLayer::new(Enforcer::new(limiter))).await;
    let first = server.send(Method::GET, "/", &[], "").await;
    assert_eq!(first.header("ratelimit-remaining"), Some("1"));
    assert_eq!(
        server.send(Method::GET, "/", &[], "").await.status,
        StatusCode::OK
    );
    let denied = server.send(Method::GET, "/", &[], "").await;
    assert_eq!(denied.status, StatusCode::TOO_MANY_REQUESTS);
    assert_eq!(denied.header("retry-after"), Some("30"));
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_denial_is_an_axum_response() {
    let clock = ManualClock::new(0);
    let enforcer = Arc::new(Enforcer::new(gcra(&clock)));
    let handler = move || {
        let enforcer = Arc::clone(&enforcer);
        async move {
            RateLimitDenial::check(enforcer.enforce("by-hand"))?;
            Ok::<_, RateLimitDenial>("done")
        }
    };
    let server = serve(Router::new().route("/", get(handler))).await;
    assert_eq!(server.send(Method::GET, "/", &[], "").await.text(), "done");
    assert_eq!(server.send(Method::GET, "/", &[], "").await.text(), "done");
    let denied = server.send(Method::GET, "/", &[], "").await;
    assert_eq!(denied.status, StatusCode::TOO_MANY_REQUESTS);
    assert_eq!(denied.header("retry-after"), Some("30"));
    assert_eq!(
        denied.header("content-type"),
        Some("application/problem+json")
    );
    assert_eq!(denied.json()["type"], "tag:throttlebeam,2026:rate-limited");
}

// A cost no quota can admit is the server's configuration: 500, not the client's 400.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_cost_above_the_capacity_is_500_not_400() {
    let clock = ManualClock::new(0);
    let enforcer = Arc::new(Enforcer::new(gcra(&clock)));
    let handler = move || {
        let enforcer = Arc::clone(&enforcer);
        async move {
            RateLimitDenial::check(
                enforcer.enforce_n("bulk", std::num::NonZeroU32::new(3).unwrap()),
            )?;
            Ok::<_, RateLimitDenial>("done")
        }
    };
    let server = serve(Router::new().route("/", get(handler))).await;
    let refused = server.send(Method::GET, "/", &[], "").await;
    assert_eq!(refused.status, StatusCode::INTERNAL_SERVER_ERROR);
    assert_eq!(
        refused.json(),
        problem(
            "rate-limit-misconfigured",
            "Rate limit misconfigured",
            500,
            "the rate limit configured for this request can never admit it"
        )
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_client_that_hangs_up_does_not_cancel_the_handler_and_its_retry_replays() {
    let runtime = Runtime::start().await.unwrap();
    let shop = Shop::new();
    let router = app(IdempotencyLayer::new(&runtime), &shop);
    shop.close();
    let request = || {
        Request::post("/pay")
            .header("idempotency-key", "k-hangup")
            .body(axum::body::Body::from("1"))
            .unwrap()
    };
    // The client gives up while the handler is still running.
    let gave_up =
        tokio::time::timeout(Duration::from_millis(20), router.clone().oneshot(request())).await;
    assert!(gave_up.is_err());
    assert_eq!(shop.runs(), 1);

    shop.open();
    let retry = router.oneshot(request()).await.unwrap();
    assert_eq!(retry.status(), StatusCode::CREATED);
    assert_eq!(retry.headers()["idempotent-replayed"], "true");
    let body = retry.into_body().collect().await.unwrap().to_bytes();
    assert_eq!(body, charge(1, "1"));
    assert_eq!(shop.runs(), 1);
}

/// Two instances of one service behind a load balancer, sharing `store`:
/// a request on one and its retry on the other run once, and the retry gets
/// the stored response, flagged replayed.
async fn two_instances_share_one_response(
    store: impl throttlebeam::idempotency::IdempotencyStore + Clone,
) {
    let shop = Shop::new();
    let mut servers = Vec::new();
    for _ in 0..2 {
        let runtime = Runtime::builder()
            .with_idempotency_store(store.clone())
            .start()
            .await
            .expect("runtime starts");
        servers.push(serve(app(IdempotencyLayer::new(&runtime), &shop)).await);
    }
    let first = servers[0].post("/pay", "k-shared", "5 EUR").await;
    assert_eq!(first.status, StatusCode::CREATED);
    let again = servers[1].post("/pay", "k-shared", "5 EUR").await;
    assert_eq!(again.status, StatusCode::CREATED);
    assert_eq!(again.body, first.body);
    assert_eq!(again.header("content-type"), Some("application/json"));
    assert_eq!(again.header("idempotent-replayed"), Some("true"));
    let mismatch = servers[1].post("/pay", "k-shared", "6 EUR").await;
    assert_eq!(mismatch.status, StatusCode::UNPROCESSABLE_ENTITY);
    assert_eq!(shop.runs(), 1);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn two_instances_sharing_a_store_answer_a_retry_with_the_stored_response() {
    two_instances_share_one_response(throttlebeam::idempotency::MemoryIdempotencyStore::new())
        .await;
}

#[cfg(feature = "redis")]
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn two_instances_sharing_redis_answer_a_retry_with_the_stored_response() {
    let Some(node) = support_redis::RedisNode::start(
        "two_instances_sharing_redis_answer_a_retry_with_the_stored_response",
    ) else {
        return;
    };
    let redis = throttlebeam::store::Redis::builder(node.url())
        .connect()
        .await
        .expect("connects");
    two_instances_share_one_response(redis).await;
}

// One constructor for every store: several instances share one limit through the runtime's
// Redis.
#[cfg(feature = "redis")]
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn instances_sharing_the_runtimes_redis_share_one_rate_limit() {
    let Some(node) = support_redis::RedisNode::start(
        "instances_sharing_the_runtimes_redis_share_one_rate_limit",
    ) else {
        return;
    };
    let mut servers = Vec::new();
    for _ in 0..2 {
        let redis = throttlebeam::store::Redis::builder(node.url())
            .connect()
            .await
            .expect("connects");
        let runtime = Runtime::builder()
            .with_redis(redis)
            .start()
            .await
            .expect("runtime starts");
        let redis = runtime.redis().expect("the runtime's redis");
        let limiter = Limiter::builder(Gcra::new(2, Duration::from_secs(60)).unwrap())
            .with_store(redis)
            .build();
        servers.push(rate_limited_server(RateLimitLayer::new(Enforcer::new(limiter))).await);
    }
    let statuses = [
        servers[0].send(Method::GET, "/", &[], "").await.status,
        servers[1].send(Method::GET, "/", &[], "").await.status,
        servers[0].send(Method::GET, "/", &[], "").await.status,
        servers[1].send(Method::GET, "/", &[], "").await.status,
    ];
    assert_eq!(
        statuses.map(|s| s.as_u16()),
        [200, 200, 429, 429],
        "one limit across both instances"
    );
}

#[cfg(feature = "redis")]
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn without_redis_in_the_environment_a_runtime_stays_in_memory() {
    let named = |name| std::env::var(name).is_ok_and(|v| !v.trim().is_empty());
    if named(throttlebeam::store::REDIS_URL_ENV) || named(throttlebeam::store::REDIS_CLUSTER_ENV) {
        return;
    }
    let runtime = Runtime::builder()
        .with_redis_from_env()
        .start()
        .await
        .expect("runtime starts");
    assert!(runtime.redis().is_none());
}

// Observability: what the layers answered is in the runtime's stats.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_idempotency_layer_counts_what_it_answered_in_the_runtimes_stats() {
    let (server, shop, runtime) =
        idempotent_runtime_server(Shop::new(), |l| l.with_fail_fast(true).with_max_body(16)).await;
    assert_eq!(
        server.post("/pay", "k-1", "1").await.status,
        StatusCode::CREATED
    );
    assert_eq!(
        server
            .post("/pay", "k-1", "1")
            .await
            .header("idempotent-replayed"),
        Some("true")
    );
    assert_eq!(
        server.post("/pay", "k-1", "2").await.status,
        StatusCode::UNPROCESSABLE_ENTITY
    );
    assert_eq!(
        server.post("/pay", "k-big", &"x".repeat(17)).await.status,
        StatusCode::PAYLOAD_TOO_LARGE
    );
    assert_eq!(
        server.post("/pay", "", "1").await.status,
        StatusCode::BAD_REQUEST
    );
    assert_eq!(
        server.post("/status/409", "k-409", "1").await.status,
        StatusCode::CONFLICT
    );
    shop.close();
    let first = tokio::spawn({
        let server = server.clone();
        async move { server.post("/pay", "k-2", "1").await }
    });
    while shop.runs() < 3 {
        tokio::task::yield_now().await;
    }
    assert_eq!(
        server.post("/pay", "k-2", "1").await.status,
        StatusCode::CONFLICT
    );
    shop.open();
    assert_eq!(first.await.unwrap().status, StatusCode::CREATED);
    runtime.shutdown(Duration::from_secs(1)).await;
    assert_eq!(
        server.post("/pay", "k-3", "1").await.status,
        StatusCode::SERVICE_UNAVAILABLE
    );

    let http = runtime.stats().http;
    assert_eq!(http.fresh, 3, "k-1, the handler's own 409, k-2");
    assert_eq!(http.replays, 1);
    assert_eq!(http.reused, 1);
    assert_eq!(http.too_large, 1);
    assert_eq!(http.invalid, 1);
    assert_eq!(
        http.in_flight, 1,
        "the handler's own 409 is not the layer's"
    );
    assert_eq!(http.store_failures, 1);
    assert_eq!(http.rate_limited, 0);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_rate_limit_layer_counts_its_429s_and_store_failures() {
    let clock = ManualClock::new(0);
    let layer = RateLimitLayer::new(Enforcer::new(gcra(&clock)));
    let server = rate_limited_server(layer.clone()).await;
    for _ in 0..3 {
        server.send(Method::GET, "/", &[], "").await;
    }
    assert_eq!(layer.stats().rate_limited, 1);
    assert_eq!(layer.stats().store_failures, 0);

    let runtime = Runtime::start().await.unwrap();
    let down = Limiter::builder(Gcra::new(2, Duration::from_secs(60)).unwrap())
        .with_store(DownStore)
        .build();
    let open = RateLimitLayer::new(Enforcer::new(down)).with_stats_in(&runtime);
    let server = rate_limited_server(open).await;
    assert_eq!(
        server.send(Method::GET, "/", &[], "").await.status,
        StatusCode::OK
    );
    let without_peer = serve_without_connect_info(
        Router::new()
            .route("/", get(hello))
            .layer(RateLimitLayer::new(Enforcer::new(gcra(&clock))).with_stats_in(&runtime)),
    )
    .await;
    without_peer.send(Method::GET, "/", &[], "").await;
    let http = runtime.stats().http;
    assert_eq!((http.store_failures, http.no_peer), (1, 1));
}

#[cfg(feature = "metrics")]
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_layers_counters_are_exported_through_the_metrics_facade() {
    use metrics_util::debugging::{DebugValue, DebuggingRecorder};
    let (server, _shop, runtime) = idempotent_runtime_server(Shop::new(), |l| l).await;
    server.post("/pay", "k-1", "1").await;
    server.post("/pay", "k-1", "1").await;
    let recorder = DebuggingRecorder::new();
    let snapshotter = recorder.snapshotter();
    metrics::with_local_recorder(&recorder, || runtime.export_metrics());
    let seen: std::collections::HashMap<String, DebugValue> = snapshotter
        .snapshot()
        .into_vec()
        .into_iter()
        .map(|(key, _, _, value)| (key.key().name().to_owned(), value))
        .collect();
    assert_eq!(
        seen.get("throttlebeam_http_replays_total"),
        Some(&DebugValue::Counter(1))
    );
    assert_eq!(
        seen.get("throttlebeam_http_fresh_total"),
        Some(&DebugValue::Counter(1))
    );
    assert_eq!(
        seen.get("throttlebeam_http_rate_limited_total"),
        Some(&DebugValue::Counter(0))
    );
}

#[cfg(feature = "postgres")]
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn two_instances_sharing_postgres_answer_a_retry_with_the_stored_response() {
    let test = "two_instances_sharing_postgres_answer_a_retry";
    let Some(schema) = support_postgres::PgSchema::create(test).await else {
        return;
    };
    two_instances_share_one_response(schema.store().await).await;
}
