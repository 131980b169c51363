//! An axum payment service: `POST /payments` runs once per `Idempotency-Key`, and every client
//! IP gets 5 requests per 10 seconds.
//!
//! Run: `cargo run --features axum --example http`, then in another shell:
//!
//! ```sh
//! curl -si localhost:3000/payments -H 'idempotency-key: order-17' -d '{"amount":1700}'
//! curl -si localhost:3000/payments -H 'idempotency-key: order-17' -d '{"amount":1700}'  # replayed
//! curl -si localhost:3000/payments -H 'idempotency-key: order-17' -d '{"amount":9900}'  # 422
//! ```
//!
//! Set `EXAMPLE_SELF_TEST=1` to have it send those requests to itself, print the answers and
//! exit.

use std::net::SocketAddr;
use std::sync::Arc;
use std::sync::atomic::{AtomicU64, Ordering};
use std::time::Duration;

use axum::extract::State;
use axum::http::{HeaderName, StatusCode};
use axum::response::IntoResponse;
use axum::routing::post;
use axum::{Json, Router};
use serde_json::{Value, json};
use throttlebeam::http::{IdempotencyLayer, RateLimitKey, RateLimitLayer};
use throttlebeam::rate_limit::{ClientIp, Enforcer, Gcra, HeaderOptions, Limiter, ProxyHeader};
use throttlebeam::{IdempotencyOptions, Runtime};

/// The payment provider, as far as this example goes: numbers charges.
#[derive(Clone, Default)]
struct Payments {
    next_id: Arc<AtomicU64>,
}

async fn charge(State(payments): State<Payments>, Json(order): Json<Value>) -> impl IntoResponse {
    let id = payments.next_id.fetch_add(1, Ordering::SeqCst) + 1;
    println!("charging {order} as ch_{id}");
    (
        StatusCode::CREATED,
        [("location", format!("/payments/ch_{id}"))],
        Json(json!({ "id": format!("ch_{id}"), "order": order })),
    )
}

fn app(runtime: &Runtime) -> Result<Router, Box<dyn std::error::Error>> {
    let idempotency = IdempotencyLayer::builder(runtime)
        .with_required_key(true)
        .with_kept_headers([HeaderName::from_static("location")])
        .with_options(IdempotencyOptions::new().with_wait_timeout(Duration::from_secs(10)))
        .build()?;
    let limiter = Limiter::new(Gcra::new(5, Duration::from_secs(10))?);
    // Keys at rest are dropped by the runtime's sweeper, with the runtime's own maps.
    limiter.sweep_on(runtime);
    let enforcer = Enforcer::new(limiter).with_headers(HeaderOptions::new().with_structured(true));
    // Trust the local reverse proxy (if any), which appends `X-Forwarded-For`, to say who the
    // client is; every other forwarding header is ignored.
    let client = ClientIp::new()
        .with_proxy_header(ProxyHeader::XForwardedFor)
        .with_trusted_proxies(["127.0.0.1", "::1"])?;
    let rate_limit = RateLimitLayer::new(enforcer).with_key(RateLimitKey::client_ip(client));
    Ok(Router::new()
        .route("/payments", post(charge))
        .with_state(Payments::default())
        .layer(idempotency)
        .layer(rate_limit))
}

async fn self_test(addr: SocketAddr) -> Result<(), Box<dyn std::error::Error>> {
    use http_body_util::{BodyExt, Full};
    use hyper_util::client::legacy::Client;
    use hyper_util::rt::TokioExecutor;

    let client = Client::builder(TokioExecutor::new()).build_http::<Full<bytes::Bytes>>();
    for amount in [1700, 1700, 9900, 1700, 1700, 1700] {
        let request = axum::http::Request::post(format!("http://{addr}/payments"))
            .header("content-type", "application/json")
            .header("idempotency-key", "order-17")
            .body(Full::from(json!({ "amount": amount }).to_string()))?;
        let response = client.request(request).await?;
        let (parts, body) = response.into_parts();
        let body = body.collect().await?.to_bytes();
        println!("amount {amount} -> {}", parts.status);
        for name in ["idempotent-replayed", "retry-after", "ratelimit-remaining"] {
            if let Some(value) = parts.headers.get(name) {
                println!("  {name}: {}", value.to_str()?);
            }
        }
        println!("  {}", String::from_utf8_lossy(&body));
    }
    Ok(())
}

#[tokio::main]
async fn main() -> Result<(), Box<dyn std::error::Error>> {
    let runtime = Runtime::start().await?;
    let self_testing = std::env::var_os("EXAMPLE_SELF_TEST").is_some();
    let bind = if self_testing {
        "127.0.0.1:0"
    } else {
        "127.0.0.1:3000"
    };
    let listener = tokio::net::TcpListener::bind(bind).await?;
    let addr = listener.local_addr()?;
    let service = app(&runtime)?.into_make_service_with_connect_info::<SocketAddr>();
    if self_testing {
        tokio::spawn(async move { axum::serve(listener, service).await });
        return self_test(addr).await;
    }
    println!("listening on http://{addr}");
    axum::serve(listener, service).await?;
    Ok(())
}
