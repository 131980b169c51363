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
use support::{Chunks, Reply, Server, problem, serve};
use throttlebeam::clock::ManualClock;
use throttlebeam::http::{IdempotencyLayer, RateLimitDenial, RateLimitKey, RateLimitLayer};
use throttlebeam::rate_limit::{
    ClientIp, Enforcer, FailMode, Gcra, HeaderOptions, Limiter, PolicyName, RateLimitError,
    RateLimitReply, RateLimitRequest, RateLimitStore,
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

fn app(layer: IdempotencyLayer, shop: &Shop) -> Router {
    let arrived = Arc::clone(&shop.arrived);
    Router::new()
        .route("/pay", post(pay).patch(pay).put(pay))
        .route("/flaky", post(flaky))
        .route("/big", post(big))
        .route("/boom", post(boom))
        .route("/lookup", get(lookup).post(lookup))
        .with_state(shop.clone())
        .layer(layer)
        .layer(tower::util::MapRequestLayer::new(
            move |req: Request<axum::body::Body>| {
                arrived.fetch_add(1, Ordering::SeqCst);
                req
            },
        ))
}

async fn idempotent_server(
    configure: impl FnOnce(IdempotencyLayer) -> IdempotencyLayer,
) -> (Server, Shop) {
    idempotent_server_with(Shop::new(), configure).await
}

async fn idempotent_server_with(
    shop: Shop,
    configure: impl FnOnce(IdempotencyLayer) -> IdempotencyLayer,
) -> (Server, Shop) {
    let runtime = Runtime::start().await.expect("runtime starts");
    let layer = configure(IdempotencyLayer::new(&runtime));
    (serve(app(layer, &shop)).await, shop)
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

// H6
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_same_key_under_two_tenants_runs_twice() {
    let (server, shop) = idempotent_server(|l| {
        l.with_scope(|parts| Some(parts.headers.get("x-tenant")?.to_str().ok()?.to_owned()))
    })
    .await;
    let send = |tenant: &'static str, auth: &'static str| {
        let server = server.clone();
        async move {
            server
                .send(
                    Method::POST,
                    "/pay",
                    &[
                        ("idempotency-key", "k-6"),
                        ("x-tenant", tenant),
                        ("authorization", auth),
                    ],
                    "1",
                )
                .await
        }
    };
    let acme = send("acme", "Bearer alice").await;
    let globex = send("globex", "Bearer alice").await;
    assert_eq!(acme.text(), charge(1, "1"));
    assert_eq!(globex.text(), charge(2, "1"));
    // The tenant is the scope: another user of the same tenant replays.
    let acme_again = send("acme", "Bearer bob").await;
    assert_eq!(acme_again.text(), charge(1, "1"));
    assert_eq!(acme_again.header("idempotent-replayed"), Some("true"));
    assert_eq!(shop.runs(), 2);
}

// H9
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
        .layer(IdempotencyLayer::new(&runtime).with_max_body(16))
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

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn behind_a_trusted_proxy_each_forwarded_client_has_its_own_limit() {
    let clock = ManualClock::new(0);
    let key = RateLimitKey::client_ip(ClientIp::new().with_trusted_proxies(["127.0.0.1"]).unwrap());
    let server =
        rate_limited_server(RateLimitLayer::new(Enforcer::new(gcra(&clock))).with_key(key)).await;

    for header in ["x-forwarded-for", "forwarded"] {
        let (a, b) = if header == "forwarded" {
            ("for=203.0.113.1", "for=\"[2001:db8::1]:4711\"")
        } else {
            ("198.51.100.1", "198.51.100.2")
        };
        for _ in 0..2 {
            assert_eq!(
                forwarded_for(&server, header, a).await.status,
                StatusCode::OK
            );
        }
        assert_eq!(
            forwarded_for(&server, header, a).await.status,
            StatusCode::TOO_MANY_REQUESTS
        );
        // Another client behind the same proxy is independent.
        let other = forwarded_for(&server, header, b).await;
        assert_eq!(other.status, StatusCode::OK);
        assert_eq!(other.header("ratelimit-remaining"), Some("1"));
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn behind_an_untrusted_proxy_the_socket_peer_is_the_key() {
    let clock = ManualClock::new(0);
    let key = RateLimitKey::client_ip(
        ClientIp::new()
            .with_trusted_proxies(["10.0.0.0/8"])
            .unwrap(),
    );
    let server =
        rate_limited_server(RateLimitLayer::new(Enforcer::new(gcra(&clock))).with_key(key)).await;
    assert_eq!(
        forwarded_for(&server, "x-forwarded-for", "198.51.100.1")
            .await
            .status,
        StatusCode::OK
    );
    assert_eq!(
        forwarded_for(&server, "forwarded", "for=198.51.100.2")
            .await
            .status,
        StatusCode::OK
    );
    // Forged forwarding headers do not buy a new bucket: all three are 127.0.0.1.
    let third = forwarded_for(&server, "x-forwarded-for", "198.51.100.3").await;
    assert_eq!(third.status, StatusCode::TOO_MANY_REQUESTS);
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
    let server = rate_limited_server(RateLimitLayer::new_async(closed)).await;
    assert_eq!(
        server.send(Method::GET, "/", &[], "").await.status,
        StatusCode::SERVICE_UNAVAILABLE
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_asynchronous_store_limits_the_same_way() {
    let clock = ManualClock::new(0);
    let server = rate_limited_server(RateLimitLayer::new_async(Enforcer::new(gcra(&clock)))).await;
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
async fn two_instances_share_one_response(store: impl throttlebeam::IdempotencyStore + Clone) {
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
    two_instances_share_one_response(throttlebeam::MemoryIdempotencyStore::new()).await;
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

#[cfg(feature = "postgres")]
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn two_instances_sharing_postgres_answer_a_retry_with_the_stored_response() {
    let test = "two_instances_sharing_postgres_answer_a_retry";
    let Some(schema) = support_postgres::PgSchema::create(test).await else {
        return;
    };
    two_instances_share_one_response(schema.store().await).await;
}
