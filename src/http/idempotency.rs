//! [`IdempotencyLayer`]: `Idempotency-Key` for HTTP services.

mod backend;
mod future;
mod request;

use std::fmt;
use std::sync::Arc;
use std::task::{Context, Poll};

use bytes::{Bytes, BytesMut};
use http::header::{CONTENT_LENGTH, RETRY_AFTER};
use http::request::Parts;
use http::{HeaderName, HeaderValue, Method, Request, Response};
use http_body::Body;
use http_body_util::{BodyExt, LengthLimitError, Limited};
use tokio::sync::oneshot;
use tower_layer::Layer;
use tower_service::Service;

use self::backend::{NotStored, Refusal, StoredResponse};
use self::future::Exchange;
pub use self::future::IdempotentFuture;
use super::body::{BodyError, RequestBody, ResponseBody};
use super::problem::{ProblemType, problem};
use crate::idempotency::{IdempotencyHandle, IdempotencyOptions, IdempotencyOutcome};
use crate::key::shown;
use crate::runtime::Runtime;

/// `idempotent-replayed`: set to `true` on every replayed response.
pub const IDEMPOTENT_REPLAYED: HeaderName = HeaderName::from_static("idempotent-replayed");

type ScopeFn = dyn Fn(&Parts) -> Option<String> + Send + Sync;

#[derive(Clone)]
enum Scope {
    /// A digest of `Authorization` and `Cookie`.
    Credentials,
    /// One namespace for every client.
    Shared,
    /// The tenant the function names (credentials when it names none).
    Tenant(Arc<ScopeFn>),
}

#[derive(Clone)]
struct Config {
    /// The runtime's idempotency, looked up once.
    idempotency: IdempotencyHandle,
    methods: Vec<Method>,
    required: bool,
    scope: Scope,
    max_body: usize,
    max_stored: usize,
    keep: Arc<[HeaderName]>,
    options: IdempotencyOptions,
    fail_fast: bool,
    /// `options` as every request starts from (derived from `options` and `fail_fast`).
    base: IdempotencyOptions,
    /// `base` scoped to clients without credentials, built once.
    anonymous: IdempotencyOptions,
}

impl Config {
    /// Derives the per-request starting points from `options` and `fail_fast`.
    fn derive(mut self) -> Self {
        self.base = backend::base_options(self.options.clone(), self.fail_fast);
        self.anonymous = self.base.clone().with_scope(request::ANONYMOUS_SCOPE);
        self
    }

    /// The options of a request whose head is `parts`, scoped, without its fingerprint.
    fn options(&self, parts: &Parts) -> IdempotencyOptions {
        let credentials = || {
            if request::has_credentials(&parts.headers) {
                self.base
                    .clone()
                    .with_scope(request::credentials_scope(&parts.headers))
            } else {
                self.anonymous.clone()
            }
        };
        match &self.scope {
            Scope::Credentials => credentials(),
            Scope::Shared => self.base.clone(),
            Scope::Tenant(f) => match f(parts) {
                Some(tenant) => self.base.clone().with_scope(request::tenant_scope(&tenant)),
                None => credentials(),
            },
        }
    }
}

/// Runs requests that carry an `Idempotency-Key` once, and answers their retries with the
/// stored response.
///
/// On a guarded method (POST and PATCH by default) a request with an `Idempotency-Key`
/// header, bare (`Idempotency-Key: 8e03978e`) or as an RFC 9651 string
/// (`Idempotency-Key: "8e03978e"`):
///
/// | situation | answer |
/// |---|---|
/// | first request with the key | the handler runs; a non-5xx response is stored for the TTL |
/// | a repeat (same method, path, query and body) | the stored status, body, `Content-Type` and [kept headers](Self::with_kept_headers), plus `idempotent-replayed: true`; the handler does not run |
/// | a repeat while the first is still running | waits for it (up to the wait timeout) and gets its response, replayed |
/// | the key reused with a different method, path, query or body | 422 |
/// | a repeat that waited past the wait timeout, or found the key in flight when [failing fast](Self::with_fail_fast) | 409 |
/// | key empty, over 255 bytes, not text, or several `Idempotency-Key` headers | 400 |
/// | no key | passes through, or 400 when [keys are required](Self::with_required_key) |
/// | the handler answers 5xx or panics | nothing stored, the key is free: the retry runs again |
/// | request body over [the buffering limit](Self::with_max_body) | 413, the handler does not run |
/// | response body over [the storage limit](Self::with_max_stored_response) | passed through unstored; the key is free |
/// | the store or runtime is unavailable | 503 |
///
/// Every answer the layer makes itself is an `application/problem+json` document (RFC 9457)
/// whose `type` is one of [`ProblemType`](super::ProblemType).
///
/// **Fingerprint.** The request body is buffered (up to [`DEFAULT_MAX_BODY`](Self::DEFAULT_MAX_BODY)
/// by default) and SHA-256 is taken over method, path, query and body; the handler then gets
/// the buffered body. Place the layer before routing, so a replay skips it.
///
/// **Scope.** One client must never receive another's stored response. Without a configured
/// scope, keys are scoped by a digest of the request's credentials (`Authorization` and
/// `Cookie` headers): the same key and body from two users run twice. A client whose cookies
/// change between retries gets a new scope, so services with session cookies that rotate
/// should name the tenant with [`with_scope`](Self::with_scope).
///
/// **Cancellation.** The handler runs in the key's own process: a client that hangs up does
/// not cancel it; it runs to the end and its response is stored for the retry.
///
/// Stored responses are one serializable envelope (status, kept headers, body), so the layer
/// works unchanged over any idempotency store of the runtime. Trailers are not stored.
///
/// # Examples
///
/// ```
/// # #[tokio::main(flavor = "current_thread")] async fn main() -> Result<(), Box<dyn std::error::Error + Send + Sync>> {
/// use std::convert::Infallible;
/// use bytes::Bytes;
/// use http::{Request, Response};
/// use http_body_util::{BodyExt, Full};
/// use throttlebeam::Runtime;
/// use throttlebeam::http::IdempotencyLayer;
/// use tower::{ServiceBuilder, ServiceExt};
///
/// let runtime = Runtime::start().await?;
/// let service = ServiceBuilder::new()
///     .layer(IdempotencyLayer::new(&runtime).with_scope(|parts| {
///         Some(parts.headers.get("x-tenant")?.to_str().ok()?.to_owned())
///     }))
///     .service_fn(|_req| async { Ok::<_, Infallible>(Response::new(Full::new(Bytes::from("charged")))) });
///
/// let pay = || Request::post("/pay").header("idempotency-key", "k-1").header("x-tenant", "acme")
///     .body(Full::new(Bytes::from("{}"))).unwrap();
/// let first = service.clone().oneshot(pay()).await?;
/// assert!(first.headers().get("idempotent-replayed").is_none());
/// let retry = service.oneshot(pay()).await?;
/// assert_eq!(retry.headers()["idempotent-replayed"], "true");
/// assert_eq!(retry.into_body().collect().await?.to_bytes(), "charged");
/// # Ok(()) }
/// ```
#[derive(Clone)]
#[must_use]
pub struct IdempotencyLayer {
    config: Arc<Config>,
}

impl fmt::Debug for IdempotencyLayer {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        let c = &self.config;
        let scope = match c.scope {
            Scope::Credentials => "credentials",
            Scope::Shared => "shared",
            Scope::Tenant(_) => "tenant",
        };
        f.debug_struct("IdempotencyLayer")
            .field("methods", &c.methods)
            .field("required", &c.required)
            .field("scope", &scope)
            .field("max_body", &c.max_body)
            .field("max_stored", &c.max_stored)
            .field("keep", &c.keep)
            .field("options", &c.options)
            .field("fail_fast", &c.fail_fast)
            .finish_non_exhaustive()
    }
}

impl IdempotencyLayer {
    /// The default limit on a guarded request's body: 1 MiB.
    pub const DEFAULT_MAX_BODY: usize = 1024 * 1024;
    /// The default limit on a response body to store: 1 MiB.
    pub const DEFAULT_MAX_STORED_RESPONSE: usize = 1024 * 1024;

    /// Guards POST and PATCH on `runtime`, keys optional, scoped by credentials, bodies up to
    /// [`DEFAULT_MAX_BODY`](Self::DEFAULT_MAX_BODY), responses stored up to
    /// [`DEFAULT_MAX_STORED_RESPONSE`](Self::DEFAULT_MAX_STORED_RESPONSE), with the default
    /// [`IdempotencyOptions`] (TTL 24 h, lease 30 s, wait timeout 30 s). Duplicates in flight
    /// wait.
    pub fn new(runtime: &Runtime) -> Self {
        Self {
            config: Arc::new(
                Config {
                    idempotency: runtime.idempotency(),
                    methods: vec![Method::POST, Method::PATCH],
                    required: false,
                    scope: Scope::Credentials,
                    max_body: Self::DEFAULT_MAX_BODY,
                    max_stored: Self::DEFAULT_MAX_STORED_RESPONSE,
                    keep: Arc::from(Vec::new()),
                    options: IdempotencyOptions::new(),
                    fail_fast: false,
                    base: IdempotencyOptions::new(),
                    anonymous: IdempotencyOptions::new(),
                }
                .derive(),
            ),
        }
    }

    fn map(self, f: impl FnOnce(&mut Config)) -> Self {
        let mut config = Arc::unwrap_or_clone(self.config);
        f(&mut config);
        Self {
            config: Arc::new(config.derive()),
        }
    }

    /// Guards these methods instead of POST and PATCH.
    pub fn with_methods(self, methods: impl IntoIterator<Item = Method>) -> Self {
        let methods = methods.into_iter().collect();
        self.map(|c| c.methods = methods)
    }

    /// Whether a guarded request without a key is refused with 400 (default: passed
    /// through).
    pub fn with_required_key(self, required: bool) -> Self {
        self.map(|c| c.required = required)
    }

    /// Scopes keys by the tenant `f` names for a request: the same key under two tenants
    /// runs twice. Read it from a header, an extension your authentication layer set, or the
    /// path. When `f` names none, the request is scoped by its credentials.
    pub fn with_scope(self, f: impl Fn(&Parts) -> Option<String> + Send + Sync + 'static) -> Self {
        self.map(|c| c.scope = Scope::Tenant(Arc::new(f)))
    }

    /// One namespace for every client: any client that sends a key gets the stored response
    /// of whoever used it first. Only for services whose responses are not private.
    pub fn with_shared_scope(self) -> Self {
        self.map(|c| c.scope = Scope::Shared)
    }

    /// The largest request body to buffer, in bytes (default
    /// [`DEFAULT_MAX_BODY`](Self::DEFAULT_MAX_BODY)); a larger one gets 413 and the handler
    /// does not run.
    pub fn with_max_body(self, bytes: usize) -> Self {
        self.map(|c| c.max_body = bytes)
    }

    /// The largest response body to store, in bytes (default
    /// [`DEFAULT_MAX_STORED_RESPONSE`](Self::DEFAULT_MAX_STORED_RESPONSE)). A larger response
    /// is passed through as it comes, nothing is stored and the key is free again: a retry
    /// runs the handler again.
    pub fn with_max_stored_response(self, bytes: usize) -> Self {
        self.map(|c| c.max_stored = bytes)
    }

    /// Headers to store and replay besides `Content-Type` (for example `Location`). Others
    /// are not stored: a replay must not hand out another response's cookies.
    pub fn with_kept_headers(self, names: impl IntoIterator<Item = HeaderName>) -> Self {
        let keep: Arc<[HeaderName]> = names.into_iter().collect();
        self.map(|c| c.keep = keep)
    }

    /// TTL, lease and wait timeout of every key (the scope and fingerprint of `options` are
    /// replaced per request). Out-of-range settings make guarded requests fail with 500.
    pub fn with_options(self, options: IdempotencyOptions) -> Self {
        self.map(|c| c.options = options)
    }

    /// Whether a duplicate that finds its key in flight gets 409 at once, with
    /// `Retry-After: 1`, instead of waiting for the first request (default: waits).
    pub fn with_fail_fast(self, fail_fast: bool) -> Self {
        self.map(|c| c.fail_fast = fail_fast)
    }
}

impl<S> Layer<S> for IdempotencyLayer {
    type Service = Idempotent<S>;

    fn layer(&self, inner: S) -> Self::Service {
        Idempotent {
            inner,
            config: Arc::clone(&self.config),
        }
    }
}

/// The service of [`IdempotencyLayer`]: runs keyed requests once and replays them.
///
/// The inner service gets a [`RequestBody`] (the buffered bytes of a guarded request) and
/// must be `Clone`; its response body must be `Unpin` to be buffered for storage (the bodies
/// of axum, hyper and `http-body-util` are).
#[derive(Clone)]
pub struct Idempotent<S> {
    inner: S,
    config: Arc<Config>,
}

impl<S: fmt::Debug> fmt::Debug for Idempotent<S> {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("Idempotent")
            .field("inner", &self.inner)
            .finish_non_exhaustive()
    }
}

impl<S, ReqB, ResB> Service<Request<ReqB>> for Idempotent<S>
where
    S: Service<Request<RequestBody<ReqB>>, Response = Response<ResB>> + Clone + Send + 'static,
    S::Future: Send + 'static,
    S::Error: Send + 'static,
    ReqB: Body<Data = Bytes> + Send + 'static,
    ReqB::Error: Into<BodyError>,
    ResB: Body<Data = Bytes> + Send + Unpin + 'static,
    ResB::Error: Into<BodyError>,
{
    type Response = Response<ResponseBody<ResB>>;
    type Error = S::Error;
    type Future = IdempotentFuture<S, ReqB, ResB>;

    fn poll_ready(&mut self, cx: &mut Context<'_>) -> Poll<Result<(), Self::Error>> {
        self.inner.poll_ready(cx)
    }

    fn call(&mut self, req: Request<ReqB>) -> Self::Future {
        let config = &self.config;
        if !config.methods.contains(req.method()) {
            return IdempotentFuture::passthrough(self.inner.call(req.map(RequestBody::streaming)));
        }
        let key = match request::key(req.headers()) {
            Ok(Some(key)) => key,
            Ok(None) if !config.required => {
                return IdempotentFuture::passthrough(
                    self.inner.call(req.map(RequestBody::streaming)),
                );
            }
            Ok(None) => {
                return IdempotentFuture::ready(problem(
                    ProblemType::KeyMissing,
                    "this request needs an Idempotency-Key header",
                ));
            }
            Err(detail) => {
                return IdempotentFuture::ready(problem(ProblemType::KeyInvalid, &detail));
            }
        };
        if declared_length(&req).is_some_and(|len| len > config.max_body as u64) {
            return IdempotentFuture::ready(too_large(config.max_body));
        }
        // The clone takes the place of the service that was polled ready, which goes with
        // this request.
        let clone = self.inner.clone();
        let inner = std::mem::replace(&mut self.inner, clone);
        let (parts, body) = req.into_parts();
        IdempotentFuture::reading(
            Limited::new(body, config.max_body),
            Pending {
                config: Arc::clone(config),
                inner,
                parts,
                key,
            },
        )
    }
}

fn declared_length<B>(req: &Request<B>) -> Option<u64> {
    req.headers()
        .get(CONTENT_LENGTH)?
        .to_str()
        .ok()?
        .parse()
        .ok()
}

fn too_large<B>(limit: usize) -> Response<ResponseBody<B>> {
    problem(
        ProblemType::BodyTooLarge,
        &format!("the request body is over the {limit}-byte limit"),
    )
}

/// What the handler's run hands back to its caller, stored or not.
type Handed<B, E> = Result<Response<ResponseBody<B>>, E>;

/// A guarded request whose body is being read.
pub(super) struct Pending<S> {
    config: Arc<Config>,
    inner: S,
    parts: Parts,
    key: String,
}

/// What a guarded request becomes once its body is read.
pub(super) enum Decided<B, E> {
    /// Answered at once: a replay or a refusal; the run was never built.
    Answer(Response<ResponseBody<B>>),
    /// The handler runs (or the request waits for the run in flight).
    Run(Exchange<B, E>),
}

impl<S> Pending<S> {
    /// Fingerprints the request with its `read` body, then replays a stored response at
    /// once when there is one, or builds the run.
    pub(super) fn decide<ReqB, ResB>(
        self,
        read: Result<Bytes, BodyError>,
    ) -> Decided<ResB, S::Error>
    where
        S: Service<Request<RequestBody<ReqB>>, Response = Response<ResB>> + Send + 'static,
        S::Future: Send + 'static,
        S::Error: Send + 'static,
        ReqB: Body<Data = Bytes> + Send + 'static,
        ReqB::Error: Into<BodyError>,
        ResB: Body<Data = Bytes> + Send + Unpin + 'static,
        ResB::Error: Into<BodyError>,
    {
        let Self {
            config,
            inner,
            parts,
            key,
        } = self;
        let bytes = match read {
            Ok(bytes) => bytes,
            Err(err) if err.is::<LengthLimitError>() => {
                return Decided::Answer(too_large(config.max_body));
            }
            Err(err) => {
                return Decided::Answer(problem(
                    ProblemType::BodyUnreadable,
                    &format!("the request body could not be read: {err}"),
                ));
            }
        };
        let options = config
            .options(&parts)
            .with_fingerprint_digest(request::fingerprint(&parts, &bytes));
        match backend::try_replay(&config.idempotency, &key, &options) {
            Ok(Some(stored)) => return Decided::Answer(replay(&stored)),
            Ok(None) => {}
            Err(err) => {
                return Decided::Answer(refuse(&backend::refusal(&err, config.fail_fast), &key));
            }
        }
        let request = Request::from_parts(parts, RequestBody::buffered(bytes));
        Decided::Run(Box::pin(exchange(config, inner, request, key, options)))
    }
}

/// A guarded request that found no stored response: run the handler once for its key (or
/// wait for the run in flight and replay it).
///
/// A plain function around an `async move` block, not an `async fn`, which would keep its
/// arguments (the whole request among them) twice in its future.
#[allow(clippy::manual_async_fn)] // an `async fn` would hold its arguments twice
fn exchange<S, ReqB, ResB>(
    config: Arc<Config>,
    mut inner: S,
    request: Request<RequestBody<ReqB>>,
    key: String,
    options: IdempotencyOptions,
) -> impl Future<Output = Result<Response<ResponseBody<ResB>>, S::Error>> + Send + 'static
where
    S: Service<Request<RequestBody<ReqB>>, Response = Response<ResB>> + Send + 'static,
    S::Future: Send + 'static,
    S::Error: Send + 'static,
    ReqB: Body<Data = Bytes> + Send + 'static,
    ReqB::Error: Into<BodyError>,
    ResB: Body<Data = Bytes> + Send + Unpin + 'static,
    ResB::Error: Into<BodyError>,
{
    async move {
        let (tx, mut rx) = oneshot::channel::<Handed<ResB, S::Error>>();
        let max_stored = config.max_stored;
        let keep = Arc::clone(&config.keep);
        let handler = move || async move {
            let response = match inner.call(request).await {
                Ok(response) => response,
                Err(err) => {
                    let _ = tx.send(Err(err));
                    return Err(NotStored);
                }
            };
            let (head, body) = response.into_parts();
            if head.status.is_server_error() {
                let _ = tx.send(Ok(Response::from_parts(
                    head,
                    ResponseBody::streaming(body),
                )));
                return Err(NotStored);
            }
            match buffer(body, max_stored).await {
                Buffered::Whole(bytes) => {
                    let stored =
                        StoredResponse::new(head.status, &head.headers, &keep, bytes.clone());
                    let _ = tx.send(Ok(Response::from_parts(head, ResponseBody::full(bytes))));
                    Ok(stored)
                }
                Buffered::Partial(body) => {
                    let _ = tx.send(Ok(Response::from_parts(head, body)));
                    Err(NotStored)
                }
            }
        };
        let result = backend::run(&config.idempotency, &key, options, handler).await;
        // The handler ran for this request: answer with its response, stored or not.
        if let Ok(handed) = rx.try_recv() {
            return handed;
        }
        Ok(match result {
            Ok(IdempotencyOutcome::Replay(stored) | IdempotencyOutcome::Fresh(stored)) => {
                replay(&stored)
            }
            Err(err) => refuse(&backend::refusal(&err, config.fail_fast), &key),
        })
    }
}

/// The data frames of a request body read so far: one frame (the usual case) is kept as it
/// came, without a copy.
#[derive(Default)]
pub(super) struct BodyRead {
    first: Bytes,
    rest: BytesMut,
}

impl BodyRead {
    pub(super) fn push(&mut self, data: Bytes) {
        if self.first.is_empty() {
            self.first = data;
        } else {
            if self.rest.is_empty() {
                self.rest.extend_from_slice(&self.first);
            }
            self.rest.extend_from_slice(&data);
        }
    }

    pub(super) fn finish(&mut self) -> Bytes {
        let first = std::mem::take(&mut self.first);
        if self.rest.is_empty() {
            first
        } else {
            std::mem::take(&mut self.rest).freeze()
        }
    }
}

/// The whole request body, up to `limit` bytes.
#[cfg(test)]
async fn read_body<B>(body: B, limit: usize) -> Result<Bytes, BodyError>
where
    B: Body<Data = Bytes>,
    B::Error: Into<BodyError>,
{
    let mut body = std::pin::pin!(Limited::new(body, limit));
    let mut read = BodyRead::default();
    while let Some(frame) = body.frame().await {
        // Trailers are not part of the fingerprint.
        if let Ok(data) = frame?.into_data() {
            read.push(data);
        }
    }
    Ok(read.finish())
}

enum Buffered<B> {
    Whole(Bytes),
    /// Over the limit, or failed: what was read, then the rest (or the error).
    Partial(ResponseBody<B>),
}

async fn buffer<B>(mut body: B, limit: usize) -> Buffered<B>
where
    B: Body<Data = Bytes> + Unpin,
    B::Error: Into<BodyError>,
{
    if body.size_hint().lower() > limit as u64 {
        return Buffered::Partial(ResponseBody::streaming(body));
    }
    let mut read = BytesMut::new();
    loop {
        match body.frame().await {
            None => return Buffered::Whole(read.freeze()),
            Some(Ok(frame)) => {
                // Trailers are not stored.
                if let Ok(data) = frame.into_data() {
                    read.extend_from_slice(&data);
                    if read.len() > limit {
                        return Buffered::Partial(ResponseBody::resume(read.freeze(), body));
                    }
                }
            }
            Some(Err(err)) => {
                return Buffered::Partial(ResponseBody::failed(read.freeze(), err.into()));
            }
        }
    }
}

fn replay<B>(stored: &StoredResponse) -> Response<ResponseBody<B>> {
    let (status, mut headers) = stored.head();
    headers.insert(IDEMPOTENT_REPLAYED, HeaderValue::from_static("true"));
    let mut response = Response::new(ResponseBody::full(stored.body.clone()));
    *response.status_mut() = status;
    *response.headers_mut() = headers;
    response
}

fn refuse<B>(refusal: &Refusal, key: &str) -> Response<ResponseBody<B>> {
    let key = shown(key);
    match refusal {
        Refusal::Reused => problem(
            ProblemType::KeyReused,
            &format!(
                "idempotency key {key:?} was used for a different method, path, query or body"
            ),
        ),
        Refusal::InFlight {
            waited,
            retry_after,
        } => {
            let detail = match waited {
                Some(after) => format!(
                    "the first request with idempotency key {key:?} is still running after {} ms",
                    after.as_millis()
                ),
                None => format!("the first request with idempotency key {key:?} is still running"),
            };
            let mut response = problem(ProblemType::KeyInFlight, &detail);
            // Whole seconds, at least 1 (RFC 9110 delay-seconds).
            let secs = retry_after.as_millis().div_ceil(1000).max(1);
            response.headers_mut().insert(
                RETRY_AFTER,
                HeaderValue::from(u64::try_from(secs).unwrap_or(u64::MAX)),
            );
            response
        }
        Refusal::Panicked => problem(
            ProblemType::HandlerPanicked,
            &format!("the handler for idempotency key {key:?} failed; nothing was stored"),
        ),
        Refusal::Unavailable => problem(
            ProblemType::IdempotencyUnavailable,
            &format!("idempotency key {key:?} cannot be checked now"),
        ),
        Refusal::Misconfigured => problem(
            ProblemType::IdempotencyMisconfigured,
            &format!("idempotency key {key:?} cannot be checked: the layer is misconfigured"),
        ),
    }
}

#[cfg(test)]
mod tests {
    use std::collections::VecDeque;
    use std::convert::Infallible;
    use std::pin::Pin;

    use http_body::Frame;
    use http_body_util::Full;

    use super::*;

    /// A body of `chunks`, one frame each, then trailers.
    struct Frames(VecDeque<Frame<Bytes>>);

    fn frames(chunks: &[&'static str]) -> Frames {
        let mut frames: VecDeque<_> = chunks
            .iter()
            .map(|c| Frame::data(Bytes::from_static(c.as_bytes())))
            .collect();
        frames.push_back(Frame::trailers(http::HeaderMap::new()));
        Frames(frames)
    }

    impl Body for Frames {
        type Data = Bytes;
        type Error = Infallible;

        fn poll_frame(
            mut self: Pin<&mut Self>,
            _: &mut Context<'_>,
        ) -> Poll<Option<Result<Frame<Bytes>, Infallible>>> {
            Poll::Ready(self.0.pop_front().map(Ok))
        }
    }

    #[tokio::test]
    async fn a_body_in_several_frames_reads_whole_and_one_frame_is_not_copied() {
        let read = read_body(frames(&["ab", "", "cd", "e"]), 16).await.unwrap();
        assert_eq!(read, "abcde");
        assert_eq!(read_body(frames(&[]), 16).await.unwrap(), "");
        let one = Bytes::from_static(b"whole");
        let read = read_body(Full::new(one.clone()), 16).await.unwrap();
        assert_eq!(read.as_ptr(), one.as_ptr());
        let err = read_body(frames(&["abc", "def"]), 5).await.unwrap_err();
        assert!(err.is::<LengthLimitError>(), "{err}");
    }
}
