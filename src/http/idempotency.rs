//! [`IdempotencyLayer`]: `Idempotency-Key` for HTTP services.

mod backend;
mod exchange;
mod future;
mod handler;
mod read;
mod request;
#[cfg(feature = "postgres")]
mod transaction;

use std::borrow::Cow;
use std::fmt;
use std::sync::Arc;
use std::task::{Context, Poll};

use bytes::Bytes;
use http::header::{
    CONNECTION, CONTENT_LENGTH, CONTENT_TYPE, RETRY_AFTER, SET_COOKIE, TRAILER, TRANSFER_ENCODING,
    UPGRADE,
};
use http::request::Parts;
use http::{HeaderMap, HeaderName, HeaderValue, Method, Request, Response, StatusCode};
use http_body::Body;
use http_body_util::Limited;
use tower_layer::Layer;
use tower_service::Service;

use self::backend::{Refusal, StoredResponse};
use self::exchange::{Claimed, Decided, Pending};
pub use self::future::IdempotentFuture;
use self::read::BodyRead;
#[cfg(feature = "postgres")]
pub use self::transaction::{MissingTransaction, PgTransaction, TransactionClient};
use super::body::{BodyError, RequestBody, ResponseBody};
use super::error::ConfigError;
use super::problem::{ProblemType, problem};
use super::stats::{self, HttpCounters, bump};
use crate::idempotency::{IdempotencyHandle, IdempotencyOptions};
use crate::key::{MAX_KEY_LEN, duration_problem, shown};
use crate::runtime::Runtime;

/// `idempotent-replayed`: set to `true` on every replayed response.
pub const IDEMPOTENT_REPLAYED: HeaderName = HeaderName::from_static("idempotent-replayed");

type ScopeFn = dyn Fn(&Parts) -> Option<String> + Send + Sync;
type StoreWhen = dyn Fn(StatusCode) -> bool + Send + Sync;

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
    store_when: Arc<StoreWhen>,
    /// The runtime's HTTP counters.
    counters: Arc<HttpCounters>,
    /// `options` as every request starts from (derived from `options` and `fail_fast`).
    base: IdempotencyOptions,
    /// `base` scoped to clients without credentials, built once.
    anonymous: IdempotencyOptions,
    /// The store whose transaction guarded requests run in, if any.
    #[cfg(feature = "postgres")]
    transactions: Option<transaction::Transactions>,
}

#[cfg(feature = "postgres")]
impl Config {
    /// Whether guarded requests run in a transaction of the layer's.
    fn transactional(&self) -> bool {
        self.transactions.is_some()
    }
}

/// A request's scope that the runtime cannot take: the detail of the 400.
struct ScopeTooLong(usize);

impl Config {
    /// Derives the per-request starting points from `options` and `fail_fast`.
    fn derive(mut self) -> Self {
        self.base = backend::base_options(self.options.clone(), self.fail_fast);
        self.anonymous = self.base.clone().with_scope(request::ANONYMOUS_SCOPE);
        self
    }

    /// The options of a request whose head is `parts`, scoped, without its fingerprint:
    /// borrowed when the scope is one every request of its kind shares (no credentials, or
    /// one namespace), built for a scope of the request's own.
    fn options(&self, parts: &Parts) -> Result<Cow<'_, IdempotencyOptions>, ScopeTooLong> {
        let credentials = || {
            if request::has_credentials(&parts.headers) {
                Cow::Owned(
                    self.base
                        .clone()
                        .with_scope(request::credentials_scope(&parts.headers)),
                )
            } else {
                Cow::Borrowed(&self.anonymous)
            }
        };
        Ok(match &self.scope {
            Scope::Credentials => credentials(),
            Scope::Shared => Cow::Borrowed(&self.base),
            Scope::Tenant(f) => match f(parts) {
                Some(tenant) => {
                    let scope = request::tenant_scope(&tenant);
                    if scope.len() > MAX_KEY_LEN {
                        return Err(ScopeTooLong(tenant.len()));
                    }
                    Cow::Owned(self.base.clone().with_scope(scope))
                }
                None => credentials(),
            },
        })
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
/// | first request with the key | the handler runs; its response is stored for the TTL if [the store rule](IdempotencyLayerBuilder::with_store_when) says so (table below) |
/// | a repeat (same method, path, query and body) of a stored response | the stored status, body, `Content-Type` and [kept headers](IdempotencyLayerBuilder::with_kept_headers), plus `idempotent-replayed: true`; the handler does not run |
/// | a repeat while the first is still running | waits for it (up to the wait timeout) and gets its response, replayed |
/// | the key reused with a different method, path, query or body | 422 |
/// | a repeat that waited past the wait timeout, or found the key in flight when [failing fast](IdempotencyLayerBuilder::with_fail_fast) | 409 |
/// | key empty, over 255 bytes, not text, or several `Idempotency-Key` headers | 400 |
/// | the [scope](IdempotencyLayerBuilder::with_scope) named for the request is over 1024 bytes | 400 |
/// | no key | passes through, or 400 when [keys are required](IdempotencyLayerBuilder::with_required_key) |
/// | the handler answers a status the store rule does not store (5xx, 400, 409, 429, …) or panics | nothing stored, the key is free: the retry runs again |
/// | the response has trailers, or is gRPC (`application/grpc…`) | passed through as it comes, unstored; the key is free |
/// | request body over [the buffering limit](IdempotencyLayerBuilder::with_max_body) | 413, the handler does not run |
/// | response body over [the storage limit](IdempotencyLayerBuilder::with_max_stored_response) | passed through unstored; the key is free |
/// | the store or runtime is unavailable | 503 (logged with its cause) |
///
/// Every answer the layer makes itself is an `application/problem+json` document (RFC 9457)
/// whose `type` is one of [`ProblemType`](super::ProblemType).
///
/// **What is stored** ([`IdempotencyLayer::stores_by_default`]): only what a retry should
/// get back. A retry of anything else runs the handler again, as Stripe does for requests
/// that failed validation.
///
/// | status | stored | why |
/// |---|---|---|
/// | 2xx, 3xx | yes | the outcome of the operation |
/// | 402, 404, 405, 410, 451 | yes | they describe the resource (or the payment), not the attempt: a retry would get the same |
/// | 400, 401, 403, 408, 409, 413, 415, 422, 425, 429 | no | the attempt was not processed: a corrected retry must run |
/// | every other 4xx (406, 412, 416, 428, 431, …) | no | the same, or they depend on headers the fingerprint does not cover |
/// | 1xx, 5xx | no | not an outcome: the retry runs again |
///
/// [`with_store_when`](IdempotencyLayerBuilder::with_store_when) sets another rule.
///
/// **Fingerprint.** The request body is buffered (up to [`DEFAULT_MAX_BODY`](Self::DEFAULT_MAX_BODY)
/// by default) and SHA-256 is taken over method, path, query and body; the handler then gets
/// the buffered body (and its trailers, if any). Place the layer before routing, so a replay
/// skips it.
///
/// **Scope.** One client must never receive another's stored response. Without a configured
/// scope, keys are scoped by a digest of the request's credentials (`Authorization` and
/// `Cookie` headers): the same key and body from two users run twice. A client whose cookies
/// change between retries gets a new scope, so services with session cookies that rotate
/// should scope by who the caller is, as the authentication layer in front established it:
/// [`with_scope_from_extension`](IdempotencyLayerBuilder::with_scope_from_extension). A
/// scope read from a header the client sends
/// ([`with_trusted_header_scope`](IdempotencyLayerBuilder::with_trusted_header_scope))
/// trusts that header: any client that knows a key and a body could name another tenant.
///
/// **Cancellation.** The handler runs in the key's own process: a client that hangs up does
/// not cancel it; it runs to the end and its response is stored for the retry.
///
/// Stored responses are one serializable envelope (status, kept headers, body), so the layer
/// works unchanged over any idempotency store of the runtime.
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
/// /// What the authentication layer in front inserts once it has checked the caller.
/// #[derive(Clone)]
/// struct Account(String);
///
/// let runtime = Runtime::start().await?;
/// let service = ServiceBuilder::new()
///     // Stands for the authentication layer: it checks the token and names the account.
///     .map_request(|mut req: Request<Full<Bytes>>| {
///         req.extensions_mut().insert(Account("acme".to_owned()));
///         req
///     })
///     .layer(IdempotencyLayer::builder(&runtime)
///         .with_scope_from_extension(|account: &Account| account.0.clone())
///         .build()?)
///     .service_fn(|_req| async { Ok::<_, Infallible>(Response::new(Full::new(Bytes::from("charged")))) });
///
/// let pay = || Request::post("/pay").header("idempotency-key", "k-1")
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
        self.config.fmt_fields(f, "IdempotencyLayer")
    }
}

impl Config {
    fn fmt_fields(&self, f: &mut fmt::Formatter<'_>, name: &str) -> fmt::Result {
        let scope = match self.scope {
            Scope::Credentials => "credentials",
            Scope::Shared => "shared",
            Scope::Tenant(_) => "tenant",
        };
        f.debug_struct(name)
            .field("methods", &self.methods)
            .field("required", &self.required)
            .field("scope", &scope)
            .field("max_body", &self.max_body)
            .field("max_stored", &self.max_stored)
            .field("keep", &self.keep)
            .field("options", &self.options)
            .field("fail_fast", &self.fail_fast)
            .finish_non_exhaustive()
    }
}

impl IdempotencyLayer {
    /// The default limit on a guarded request's body: 1 MiB.
    pub const DEFAULT_MAX_BODY: usize = 1024 * 1024;
    /// The default limit on a response body to store: 1 MiB.
    pub const DEFAULT_MAX_STORED_RESPONSE: usize = 1024 * 1024;

    /// Guards POST and PATCH on `runtime` with every default: keys optional, scoped by
    /// credentials, bodies up to [`DEFAULT_MAX_BODY`](Self::DEFAULT_MAX_BODY), responses
    /// stored by [the default rule](Self::stores_by_default) up to
    /// [`DEFAULT_MAX_STORED_RESPONSE`](Self::DEFAULT_MAX_STORED_RESPONSE), with the default
    /// [`IdempotencyOptions`] (TTL 24 h, lease 30 s, wait timeout 30 s). Duplicates in flight
    /// wait. [`IdempotencyLayer::builder`] sets anything else.
    pub fn new(runtime: &Runtime) -> Self {
        Self {
            config: Arc::new(IdempotencyLayerBuilder::defaults(runtime).derive()),
        }
    }

    /// A builder starting from the defaults of [`IdempotencyLayer::new`]; its
    /// [`build`](IdempotencyLayerBuilder::build) checks every setting.
    pub fn builder(runtime: &Runtime) -> IdempotencyLayerBuilder {
        IdempotencyLayerBuilder {
            config: IdempotencyLayerBuilder::defaults(runtime),
        }
    }

    /// The default store rule: 2xx, 3xx and the 4xx that describe the resource (402, 404,
    /// 405, 410, 451) are stored; 1xx, 5xx and every other 4xx are not (see the table on
    /// [`IdempotencyLayer`]).
    ///
    /// # Examples
    ///
    /// ```
    /// use http::StatusCode;
    /// use throttlebeam::http::IdempotencyLayer;
    ///
    /// assert!(IdempotencyLayer::stores_by_default(StatusCode::CREATED));
    /// assert!(IdempotencyLayer::stores_by_default(StatusCode::NOT_FOUND));
    /// assert!(!IdempotencyLayer::stores_by_default(StatusCode::UNSUPPORTED_MEDIA_TYPE));
    /// assert!(!IdempotencyLayer::stores_by_default(StatusCode::TOO_MANY_REQUESTS));
    /// assert!(!IdempotencyLayer::stores_by_default(StatusCode::BAD_GATEWAY));
    /// ```
    #[must_use]
    pub fn stores_by_default(status: StatusCode) -> bool {
        match status.as_u16() {
            200..=399 => true,
            // Payment required, not found, method not allowed, gone, unavailable for legal
            // reasons: they describe the resource, not the attempt.
            402 | 404 | 405 | 410 | 451 => true,
            _ => false,
        }
    }
}

/// The settings of an [`IdempotencyLayer`], checked by [`build`](Self::build).
///
/// # Examples
///
/// ```
/// # #[tokio::main(flavor = "current_thread")] async fn main() -> Result<(), Box<dyn std::error::Error>> {
/// use std::time::Duration;
/// use http::HeaderName;
/// use throttlebeam::http::IdempotencyLayer;
/// use throttlebeam::{IdempotencyOptions, Runtime};
///
/// let runtime = Runtime::start().await?;
/// let layer = IdempotencyLayer::builder(&runtime)
///     .with_required_key(true)
///     .with_kept_headers([HeaderName::from_static("location")])
///     .with_options(IdempotencyOptions::new().with_wait_timeout(Duration::from_secs(10)))
///     .build()?;
/// # let _ = layer;
///
/// // A bad setting is an error here, not a 500 on every request.
/// let err = IdempotencyLayer::builder(&runtime)
///     .with_options(IdempotencyOptions::new().with_wait_timeout(Duration::ZERO))
///     .build()
///     .unwrap_err();
/// assert_eq!(err.setting(), "wait timeout");
/// assert_eq!(
///     err.to_string(),
///     "invalid idempotency layer setting `wait timeout`: must be greater than zero"
/// );
/// # Ok(()) }
/// ```
#[must_use]
pub struct IdempotencyLayerBuilder {
    config: Config,
}

impl fmt::Debug for IdempotencyLayerBuilder {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        self.config.fmt_fields(f, "IdempotencyLayerBuilder")
    }
}

impl IdempotencyLayerBuilder {
    fn defaults(runtime: &Runtime) -> Config {
        Config {
            idempotency: runtime.idempotency(),
            methods: vec![Method::POST, Method::PATCH],
            required: false,
            scope: Scope::Credentials,
            max_body: IdempotencyLayer::DEFAULT_MAX_BODY,
            max_stored: IdempotencyLayer::DEFAULT_MAX_STORED_RESPONSE,
            keep: Arc::from(Vec::new()),
            options: IdempotencyOptions::new(),
            fail_fast: false,
            store_when: Arc::new(IdempotencyLayer::stores_by_default),
            counters: stats::counters_of(runtime),
            base: IdempotencyOptions::new(),
            anonymous: IdempotencyOptions::new(),
            #[cfg(feature = "postgres")]
            transactions: None,
        }
    }

    /// Runs every guarded request in a transaction of `store`'s that its handler writes in
    /// ([`PgTransaction`], from the request's extensions or, with `axum`, as an extractor):
    /// the handler's writes, the stored response and the completion of the request's key
    /// commit together under the layer's claim, or not at all. Every rule of the layer holds
    /// as without it (key and scope limits, 422 for another fingerprint, 409 with
    /// `Retry-After` while in flight, the store rule, problem+json answers); a status the
    /// store rule does not store rolls the transaction back, so the retry runs the handler
    /// again. The claim is the transaction's own (its row locked as its first statement): no
    /// renewal, never taken over while it lives, free within about a second once its
    /// connection dies. A request without a key (when keys are optional) gets a transaction
    /// too, committed by the same rule.
    ///
    /// Keys and stored responses are `store`'s: give the runtime the same store
    /// ([`RuntimeBuilder::with_postgres`](crate::runtime::RuntimeBuilder::with_postgres)) so
    /// that its other idempotent calls share them. The transactions begin at the store's
    /// [`TransactionOptions`](crate::idempotency::postgres::TransactionOptions)
    /// ([`with_transaction_options`](Self::with_transaction_options) sets others). A response
    /// whose status is stored but which cannot be (over
    /// [`with_max_stored_response`](Self::with_max_stored_response), with trailers, gRPC) is
    /// rolled back and answered 500.
    ///
    /// See [`PgTransaction`] for an example.
    #[cfg(feature = "postgres")]
    #[cfg_attr(docsrs, doc(cfg(feature = "postgres")))]
    pub fn with_postgres_transaction(
        mut self,
        store: &crate::idempotency::postgres::PostgresStore,
    ) -> Self {
        crate::idempotency::postgres::count_in(&self.config.idempotency, store);
        self.config.transactions = Some(transaction::Transactions {
            store: store.clone(),
            options: store.transaction_options(),
        });
        self
    }

    /// The isolation level and timeout of the transactions of
    /// [`with_postgres_transaction`](Self::with_postgres_transaction) (default: the store's).
    /// Without it set first, this does nothing.
    #[cfg(feature = "postgres")]
    #[cfg_attr(docsrs, doc(cfg(feature = "postgres")))]
    pub fn with_transaction_options(
        mut self,
        options: crate::idempotency::postgres::TransactionOptions,
    ) -> Self {
        if let Some(transactions) = &mut self.config.transactions {
            transactions.options = options;
        }
        self
    }

    /// Guards these methods instead of POST and PATCH.
    pub fn with_methods(mut self, methods: impl IntoIterator<Item = Method>) -> Self {
        self.config.methods = methods.into_iter().collect();
        self
    }

    /// Whether a guarded request without a key is refused with 400 (default: passed
    /// through).
    pub fn with_required_key(mut self, required: bool) -> Self {
        self.config.required = required;
        self
    }

    /// Scopes keys by the tenant `f` names for a request: the same key under two tenants
    /// runs twice. When `f` names none, the request is scoped by its credentials; a tenant
    /// whose scope would be over 1024 bytes gets a 400.
    ///
    /// Name the tenant from what the server established (an extension the authentication
    /// layer inserted, see [`with_scope_from_extension`](Self::with_scope_from_extension)),
    /// not from what the client says: a scope read from a client-sent header lets any
    /// client that knows a key and a body read another tenant's stored response.
    pub fn with_scope(
        mut self,
        f: impl Fn(&Parts) -> Option<String> + Send + Sync + 'static,
    ) -> Self {
        self.config.scope = Scope::Tenant(Arc::new(f));
        self
    }

    /// Scopes keys by what `f` reads from the request's extension of type `T`: the caller as
    /// the authentication layer in front established it (an account, a tenant, a verified
    /// token's subject). A request without a `T` is scoped by its credentials.
    pub fn with_scope_from_extension<T, F>(self, f: F) -> Self
    where
        T: Send + Sync + 'static,
        F: Fn(&T) -> String + Send + Sync + 'static,
    {
        self.with_scope(move |parts| parts.extensions.get::<T>().map(&f))
    }

    /// Scopes keys by the value of header `name` as the request carries it. This **trusts
    /// the header**: use it only behind a gateway that sets it from the authenticated caller
    /// and drops any value a client sent; otherwise any client that knows a key and a body
    /// can name another tenant and read its stored response. A request without the header
    /// (or with a value that is not text) is scoped by its credentials.
    pub fn with_trusted_header_scope(self, name: HeaderName) -> Self {
        self.with_scope(move |parts| {
            parts
                .headers
                .get(&name)
                .and_then(|v| v.to_str().ok())
                .map(str::to_owned)
        })
    }

    /// One namespace for every client: any client that sends a key gets the stored response
    /// of whoever used it first. Only for services whose responses are not private.
    pub fn with_shared_scope(mut self) -> Self {
        self.config.scope = Scope::Shared;
        self
    }

    /// The largest request body to buffer, in bytes (default
    /// [`DEFAULT_MAX_BODY`](IdempotencyLayer::DEFAULT_MAX_BODY)); a larger one gets 413 and
    /// the handler does not run.
    pub fn with_max_body(mut self, bytes: usize) -> Self {
        self.config.max_body = bytes;
        self
    }

    /// The largest response body to store, in bytes (default
    /// [`DEFAULT_MAX_STORED_RESPONSE`](IdempotencyLayer::DEFAULT_MAX_STORED_RESPONSE)). A
    /// larger response is passed through as it comes, nothing is stored and the key is free
    /// again: a retry runs the handler again.
    pub fn with_max_stored_response(mut self, bytes: usize) -> Self {
        self.config.max_stored = bytes;
        self
    }

    /// Headers to store and replay besides `Content-Type` (for example `Location`). Others
    /// are not stored: a replay must not hand out another response's cookies, so
    /// `Set-Cookie` and the connection's own headers are refused by [`build`](Self::build).
    pub fn with_kept_headers(mut self, names: impl IntoIterator<Item = HeaderName>) -> Self {
        self.config.keep = names.into_iter().collect();
        self
    }

    /// TTL, lease and wait timeout of every key (the scope and fingerprint of `options` are
    /// replaced per request).
    pub fn with_options(mut self, options: IdempotencyOptions) -> Self {
        self.config.options = options;
        self
    }

    /// Whether a duplicate that finds its key in flight gets 409 at once, with
    /// `Retry-After: 1`, instead of waiting for the first request (default: waits).
    pub fn with_fail_fast(mut self, fail_fast: bool) -> Self {
        self.config.fail_fast = fail_fast;
        self
    }

    /// Which handler statuses are stored and replayed, instead of
    /// [the default rule](IdempotencyLayer::stores_by_default). A status it refuses is
    /// passed on and not stored: the key is free and the retry runs the handler again.
    ///
    /// ```
    /// # #[tokio::main(flavor = "current_thread")] async fn main() -> Result<(), Box<dyn std::error::Error>> {
    /// use throttlebeam::Runtime;
    /// use throttlebeam::http::IdempotencyLayer;
    ///
    /// let runtime = Runtime::start().await?;
    /// // Everything but 5xx, as before 0.2.
    /// let layer = IdempotencyLayer::builder(&runtime)
    ///     .with_store_when(|status| !status.is_server_error())
    ///     .build()?;
    /// # let _ = layer;
    /// # Ok(()) }
    /// ```
    pub fn with_store_when(
        mut self,
        f: impl Fn(StatusCode) -> bool + Send + Sync + 'static,
    ) -> Self {
        self.config.store_when = Arc::new(f);
        self
    }

    /// The layer, once every setting is checked.
    ///
    /// # Errors
    ///
    /// [`ConfigError`] naming the setting: no guarded method; a TTL, lease or wait timeout
    /// that is zero, under 1 ms or over [`MAX_TIMER`](crate::clock::MAX_TIMER); a kept header that
    /// must not be replayed (`Set-Cookie`, `Connection`, `Transfer-Encoding`, …).
    pub fn build(self) -> Result<IdempotencyLayer, ConfigError> {
        let c = &self.config;
        if c.methods.is_empty() {
            return Err(ConfigError::new("methods", "must name at least one method"));
        }
        for (setting, value) in [
            ("ttl", c.options.ttl()),
            ("lease", c.options.lease()),
            ("wait timeout", c.options.wait_timeout()),
        ] {
            if let Some(reason) = duration_problem(value) {
                return Err(ConfigError::new(setting, reason));
            }
        }
        if let Some(name) = c.keep.iter().find(|name| NEVER_KEPT.contains(name)) {
            return Err(ConfigError::new(
                "kept headers",
                format!("`{name}` must not be replayed to another request"),
            ));
        }
        Ok(IdempotencyLayer {
            config: Arc::new(self.config.derive()),
        })
    }
}

/// Headers a replay must never carry: another response's cookies, and the connection's own.
const NEVER_KEPT: [HeaderName; 7] = [
    SET_COOKIE,
    CONNECTION,
    TRANSFER_ENCODING,
    UPGRADE,
    TRAILER,
    CONTENT_LENGTH,
    HeaderName::from_static("keep-alive"),
];

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
            #[cfg(feature = "postgres")]
            Ok(None) if !config.required && config.transactional() => {
                // No key, but the handler still writes in a transaction of the layer's.
                let clone = self.inner.clone();
                let inner = std::mem::replace(&mut self.inner, clone);
                let run = transaction::exchange(
                    Arc::clone(config),
                    inner,
                    req.map(RequestBody::streaming),
                    None,
                    IdempotencyOptions::new(),
                );
                return IdempotentFuture::guarded(Box::pin(run));
            }
            Ok(None) if !config.required => {
                return IdempotentFuture::passthrough(
                    self.inner.call(req.map(RequestBody::streaming)),
                );
            }
            Ok(None) => {
                bump(&config.counters.invalid);
                return IdempotentFuture::ready(problem(
                    ProblemType::KeyMissing,
                    "this request needs an Idempotency-Key header",
                ));
            }
            Err(detail) => {
                bump(&config.counters.invalid);
                return IdempotentFuture::ready(problem(ProblemType::KeyInvalid, &detail));
            }
        };
        if declared_length(&req).is_some_and(|len| len > config.max_body as u64) {
            bump(&config.counters.too_large);
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

/// Whether a response is gRPC (`application/grpc`, `application/grpc+proto`, …).
fn is_grpc(headers: &HeaderMap) -> bool {
    headers
        .get(CONTENT_TYPE)
        .is_some_and(|v| v.as_bytes().starts_with(b"application/grpc"))
}

fn replay<B>(stored: &StoredResponse) -> Response<ResponseBody<B>> {
    let (status, mut headers) = stored.head(1);
    headers.insert(IDEMPOTENT_REPLAYED, HeaderValue::from_static("true"));
    let mut response = Response::new(ResponseBody::full(stored.body.clone()));
    *response.status_mut() = status;
    *response.headers_mut() = headers;
    response
}

fn refuse<B>(refusal: &Refusal, key: &str, counters: &HttpCounters) -> Response<ResponseBody<B>> {
    let key = shown(key);
    bump(match refusal {
        Refusal::Reused => &counters.reused,
        Refusal::InFlight { .. } => &counters.in_flight,
        Refusal::Unavailable => &counters.store_failures,
        // Counted by the runtime's own stats (panics) or logged (settings).
        Refusal::Panicked | Refusal::Misconfigured => return refusal_response(refusal, &key),
    });
    refusal_response(refusal, &key)
}

fn refusal_response<B>(refusal: &Refusal, key: &str) -> Response<ResponseBody<B>> {
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

    use super::read::read_body;
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
        assert!(err.is::<http_body_util::LengthLimitError>(), "{err}");
    }
}
