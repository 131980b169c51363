//! The guarded exchange of one request: its body read, then a stored response replayed, or
//! the handler run once for the key and its response stored when a retry should replay it.

use std::sync::Arc;

use bytes::Bytes;
use http::request::Parts;
use http::{HeaderMap, Request, Response};
use http_body_util::LengthLimitError;
use tokio::sync::oneshot;

use super::backend::{self, Looked, StoredResponse};
use super::future::Exchange;
use super::handler::{Guarded, Handed, HandlerRun};
use super::{Config, ScopeTooLong, refuse, replay, request, too_large};
use crate::http::body::{BodyError, InBody, OutBody, RequestBody, ResponseBody};
use crate::http::problem::{ProblemType, problem};
use crate::http::stats::bump;
use crate::idempotency::{IdempotencyOptions, IdempotencyOutcome};
use crate::key::MAX_KEY_LEN;

/// A guarded request whose body is being read.
pub(super) struct Pending<S> {
    pub(super) config: Arc<Config>,
    pub(super) inner: S,
    pub(super) parts: Parts,
    pub(super) key: String,
}

/// What a guarded request becomes once its body is read.
pub(super) enum Decided<B: Send + 'static, E: Send + 'static> {
    /// Answered at once: a replay or a refusal; the run was never built.
    Answer(Response<ResponseBody<B>>),
    /// The key is this request's: the handler runs as the key's process.
    Claimed(Claimed<B, E>),
    /// The handler runs (or the request waits for the run in flight).
    Run(Exchange<B, E>),
}

/// A request whose key it claimed at once, while the handler runs as the key's process: the
/// run, which comes to the handler's response.
pub(super) struct Claimed<B: Send + 'static, E: Send + 'static> {
    pub(super) run: backend::ClaimRun<Handed<B, E>>,
    config: Arc<Config>,
}

impl<B: Send + 'static, E: Send + 'static> Claimed<B, E> {
    /// The answer once the run ended with `ran`: the handler's own response (stored or not),
    /// or the refusal of a handler that panicked.
    pub(super) fn finish(self, ran: Result<Handed<B, E>, crate::Error>) -> Handed<B, E> {
        let counters = &self.config.counters;
        match ran {
            Ok(handed) => {
                bump(&counters.fresh);
                handed
            }
            Err(err) => {
                let refusal = backend::refusal(&err, self.config.fail_fast);
                Ok(refuse(&refusal, err.key().unwrap_or_default(), counters))
            }
        }
    }
}

impl<S> Pending<S> {
    /// Fingerprints the request with its `read` body, then replays a stored response at
    /// once when there is one, or builds the run.
    pub(super) fn decide<ReqB, ResB>(
        self,
        read: Result<(Bytes, Option<HeaderMap>), BodyError>,
    ) -> Decided<ResB, S::Error>
    where
        S: Guarded<ReqB, ResB>,
        ReqB: InBody,
        ResB: OutBody,
    {
        let Self {
            config,
            inner,
            parts,
            key,
        } = self;
        let (bytes, trailers) = match read {
            Ok(read) => read,
            Err(err) if err.is::<LengthLimitError>() => {
                bump(&config.counters.too_large);
                return Decided::Answer(too_large(config.max_body));
            }
            Err(err) => {
                bump(&config.counters.invalid);
                return Decided::Answer(problem(
                    ProblemType::BodyUnreadable,
                    &format!("the request body could not be read: {err}"),
                ));
            }
        };
        let options = match config.options(&parts) {
            Ok(options) => options,
            Err(ScopeTooLong(len)) => {
                bump(&config.counters.invalid);
                return Decided::Answer(problem(
                    ProblemType::ScopeInvalid,
                    &format!(
                        "the scope named for this request is {len} bytes, over the {}-byte limit",
                        MAX_KEY_LEN - request::TENANT_PREFIX.len()
                    ),
                ));
            }
        };
        let fingerprint = request::fingerprint(&parts, &bytes);
        #[cfg(feature = "postgres")]
        if config.transactional() {
            let options = options.into_owned().with_fingerprint_digest(fingerprint);
            let request =
                Request::from_parts(parts, RequestBody::buffered_with_trailers(bytes, trailers));
            return Decided::Run(Box::pin(super::transaction::exchange(
                config,
                inner,
                request,
                Some(key),
                options,
            )));
        }
        let claim = match backend::look(&config.idempotency, &key, &options, fingerprint) {
            Ok(Some(Looked::Replay(stored))) => {
                bump(&config.counters.replays);
                return Decided::Answer(replay(&stored));
            }
            Ok(Some(Looked::Owner(claim))) => Some(claim),
            Ok(None) => None,
            Err(err) => {
                let refusal = backend::refusal(&err, config.fail_fast);
                return Decided::Answer(refuse(&refusal, &key, &config.counters));
            }
        };
        let request =
            Request::from_parts(parts, RequestBody::buffered_with_trailers(bytes, trailers));
        let Some(claim) = claim else {
            let options = options.into_owned().with_fingerprint_digest(fingerprint);
            return Decided::Run(Box::pin(exchange(config, inner, request, key, options)));
        };
        // Its borrow of `config` ends here: the run takes `config`.
        drop(options);
        // The key is ours: run the handler as its process, without the waits of a full run.
        let run_config = Arc::clone(&config);
        let handler = HandlerRun::new(run_config, inner, request);
        match backend::run_claim(&config.idempotency, &key, claim, handler) {
            Ok(run) => Decided::Claimed(Claimed { run, config }),
            Err(err) => Decided::Answer(refuse(
                &backend::refusal(&err, config.fail_fast),
                &key,
                &config.counters,
            )),
        }
    }
}

/// What the handler's run takes on the general path: the service, the request and where to
/// hand its response. Boxed, so the futures that carry it to the run stay small.
struct Handling<S, ReqB, ResB, E> {
    inner: S,
    request: Request<RequestBody<ReqB>>,
    tx: oneshot::Sender<Handed<ResB, E>>,
}

/// A guarded request that found no stored response: run the handler once for its key (or
/// wait for the run in flight and replay it).
///
/// A plain function around an `async move` block, not an `async fn`, which would keep its
/// arguments twice in its future; the request and the service travel boxed in one [`Job`],
/// so the future (itself boxed) is small and moved cheaply.
#[allow(clippy::manual_async_fn)] // an `async fn` would hold its arguments twice
fn exchange<S, ReqB, ResB>(
    config: Arc<Config>,
    inner: S,
    request: Request<RequestBody<ReqB>>,
    key: String,
    options: IdempotencyOptions,
) -> impl Future<Output = Result<Response<ResponseBody<ResB>>, S::Error>> + Send + 'static
where
    S: Guarded<ReqB, ResB>,
    ReqB: InBody,
    ResB: OutBody,
{
    let (tx, rx) = oneshot::channel::<Handed<ResB, S::Error>>();
    let job = Box::new(Handling { inner, request, tx });
    async move {
        let mut rx = rx;
        let run_config = Arc::clone(&config);
        let handler = move || {
            let Handling { inner, request, tx } = *job;
            let run = HandlerRun::new(run_config, inner, request);
            async move {
                let (stored, handed) = run.await;
                let _ = tx.send(handed);
                stored
            }
        };
        let result = backend::run(&config.idempotency, &key, options, handler).await;
        answer(&config, &key, &mut rx, result)
    }
}

/// The answer to a guarded request once its run (or the run it waited for) ended with
/// `result`: the handler's own response if it ran for this request, else the stored one
/// replayed, or the refusal.
fn answer<B, E>(
    config: &Config,
    key: &str,
    rx: &mut oneshot::Receiver<Handed<B, E>>,
    result: Result<IdempotencyOutcome<StoredResponse>, crate::Error>,
) -> Handed<B, E> {
    // The handler ran for this request: answer with its response, stored or not.
    if let Ok(handed) = rx.try_recv() {
        bump(&config.counters.fresh);
        return handed;
    }
    Ok(match result {
        Ok(
            IdempotencyOutcome::Replay(stored)
            | IdempotencyOutcome::Fresh(stored)
            | IdempotencyOutcome::Unrecorded(stored, _),
        ) => {
            bump(&config.counters.replays);
            replay(&stored)
        }
        Err(err) => refuse(
            &backend::refusal(&err, config.fail_fast),
            key,
            &config.counters,
        ),
    })
}
