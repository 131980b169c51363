//! An axum app on a loopback port and a real HTTP client, for the middleware tests.
#![allow(dead_code, unreachable_pub)]

use std::collections::VecDeque;
use std::net::SocketAddr;
use std::pin::Pin;
use std::task::{Context, Poll};

use axum::Router;
use bytes::Bytes;
use http::{HeaderMap, Method, Request, StatusCode};
use http_body::{Body, Frame};
use http_body_util::{BodyExt, Full};
use hyper_util::client::legacy::Client;
use hyper_util::client::legacy::connect::HttpConnector;
use hyper_util::rt::TokioExecutor;

/// A server on 127.0.0.1 and a client for it.
#[derive(Clone)]
pub struct Server {
    pub addr: SocketAddr,
    client: Client<HttpConnector, Full<Bytes>>,
}

/// What came back, whole.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Reply {
    pub status: StatusCode,
    pub headers: HeaderMap,
    pub body: Bytes,
    /// The trailers, if the response had any.
    pub trailers: Option<HeaderMap>,
}

impl Reply {
    /// The body as text.
    pub fn text(&self) -> &str {
        std::str::from_utf8(&self.body).expect("utf-8 body")
    }

    /// The body as JSON.
    pub fn json(&self) -> serde_json::Value {
        serde_json::from_slice(&self.body).expect("json body")
    }

    /// A header's value as text.
    pub fn header(&self, name: &str) -> Option<&str> {
        self.headers
            .get(name)
            .map(|v| v.to_str().expect("text header"))
    }
}

/// Serves `app` (with the peer address as `ConnectInfo`) on a free loopback port.
pub async fn serve(app: Router) -> Server {
    let listener = tokio::net::TcpListener::bind("127.0.0.1:0")
        .await
        .expect("bind loopback");
    let addr = listener.local_addr().expect("local addr");
    tokio::spawn(async move {
        axum::serve(
            listener,
            app.into_make_service_with_connect_info::<SocketAddr>(),
        )
        .await
        .expect("serve");
    });
    let client = Client::builder(TokioExecutor::new())
        .pool_max_idle_per_host(128)
        .build_http();
    Server { addr, client }
}

/// Serves `app` without connect info: requests carry no peer address.
pub async fn serve_without_connect_info(app: Router) -> Server {
    let listener = tokio::net::TcpListener::bind("127.0.0.1:0")
        .await
        .expect("bind loopback");
    let addr = listener.local_addr().expect("local addr");
    tokio::spawn(async move {
        axum::serve(listener, app.into_make_service())
            .await
            .expect("serve");
    });
    let client = Client::builder(TokioExecutor::new())
        .pool_max_idle_per_host(128)
        .build_http();
    Server { addr, client }
}

impl Server {
    /// Sends `method path` with `headers` and `body`, and reads the whole reply.
    pub async fn send(
        &self,
        method: Method,
        path: &str,
        headers: &[(&str, &str)],
        body: &str,
    ) -> Reply {
        let mut request = Request::builder()
            .method(method)
            .uri(format!("http://{}{path}", self.addr));
        for (name, value) in headers {
            request = request.header(*name, *value);
        }
        let request = request
            .body(Full::new(Bytes::copy_from_slice(body.as_bytes())))
            .expect("valid request");
        let response = self.client.request(request).await.expect("request sent");
        let (parts, body) = response.into_parts();
        let collected = body.collect().await.expect("body read");
        let trailers = collected.trailers().cloned();
        Reply {
            status: parts.status,
            headers: parts.headers,
            body: collected.to_bytes(),
            trailers,
        }
    }

    /// `POST path` with an `Idempotency-Key` and `body`.
    pub async fn post(&self, path: &str, key: &str, body: &str) -> Reply {
        self.send(Method::POST, path, &[("idempotency-key", key)], body)
            .await
    }
}

/// A body of data frames, then trailers.
pub struct WithTrailers(pub VecDeque<Frame<Bytes>>);

impl WithTrailers {
    pub fn new(data: &'static str, trailers: HeaderMap) -> Self {
        Self(VecDeque::from([
            Frame::data(Bytes::from_static(data.as_bytes())),
            Frame::trailers(trailers),
        ]))
    }
}

impl Body for WithTrailers {
    type Data = Bytes;
    type Error = std::convert::Infallible;

    fn poll_frame(
        mut self: Pin<&mut Self>,
        _cx: &mut Context<'_>,
    ) -> Poll<Option<Result<Frame<Bytes>, Self::Error>>> {
        Poll::Ready(self.0.pop_front().map(Ok))
    }
}

/// A body of chunks with no declared length (sent chunked).
pub struct Chunks(pub VecDeque<Bytes>);

impl Chunks {
    pub fn new(chunks: usize, size: usize) -> Self {
        Self((0..chunks).map(|_| Bytes::from(vec![b'x'; size])).collect())
    }
}

impl Body for Chunks {
    type Data = Bytes;
    type Error = std::convert::Infallible;

    fn poll_frame(
        mut self: Pin<&mut Self>,
        _cx: &mut Context<'_>,
    ) -> Poll<Option<Result<Frame<Bytes>, Self::Error>>> {
        Poll::Ready(self.0.pop_front().map(|c| Ok(Frame::data(c))))
    }
}

/// The problem document the layers answer with.
pub fn problem(kind: &str, title: &str, status: u16, detail: &str) -> serde_json::Value {
    serde_json::json!({
        "type": format!("tag:throttlebeam,2026:{kind}"),
        "title": title,
        "status": status,
        "detail": detail,
    })
}
