//! [`IdempotentFuture`]: the response future of [`Idempotent`](super::Idempotent).

use std::fmt;
use std::future::Future;
use std::pin::Pin;
use std::task::{Context, Poll, ready};

use bytes::Bytes;
use http::{Request, Response};
use http_body::Body;
use http_body_util::Limited;
use pin_project_lite::pin_project;
use tower_service::Service;

use super::{BodyRead, Claimed, Decided, Pending};
use crate::http::body::{BodyError, RequestBody, ResponseBody};

pub(super) type Exchange<B, E> =
    Pin<Box<dyn Future<Output = Result<Response<ResponseBody<B>>, E>> + Send + 'static>>;

pin_project! {
    /// The response future of [`Idempotent`](super::Idempotent): the inner service's own for
    /// a request the layer does not guard, an answer made at once (a bad key), or the
    /// guarded exchange: read the body, then replay a stored response at once, or run the
    /// handler once for the key.
    pub struct IdempotentFuture<S, ReqB, ResB>
    where
        S: Service<Request<RequestBody<ReqB>>>,
        // The run of a claimed key hands the response back across tasks.
        S::Error: Send,
        S::Error: 'static,
        ResB: Send,
        ResB: 'static,
    {
        #[pin]
        kind: Kind<S, ReqB, ResB>,
    }
}

pin_project! {
    #[project = KindProj]
    enum Kind<S, ReqB, ResB>
    where
        S: Service<Request<RequestBody<ReqB>>>,
        S::Error: Send,
        S::Error: 'static,
        ResB: Send,
        ResB: 'static,
    {
        Passthrough { #[pin] future: S::Future },
        Ready { response: Option<Response<ResponseBody<ResB>>> },
        Reading { #[pin] body: Limited<ReqB>, read: BodyRead, pending: Option<Pending<S>> },
        // The key claimed at once: the handler runs as its process.
        Claimed { claimed: Option<Claimed<ResB, S::Error>> },
        Guarded { exchange: Exchange<ResB, S::Error> },
    }
}

impl<S, ReqB, ResB> IdempotentFuture<S, ReqB, ResB>
where
    S: Service<Request<RequestBody<ReqB>>>,
    S::Error: Send + 'static,
    ResB: Send + 'static,
{
    pub(super) fn passthrough(future: S::Future) -> Self {
        Self {
            kind: Kind::Passthrough { future },
        }
    }

    pub(super) fn ready(response: Response<ResponseBody<ResB>>) -> Self {
        Self {
            kind: Kind::Ready {
                response: Some(response),
            },
        }
    }

    /// The guarded exchange, already built (a request without a key that still runs in the
    /// layer's transaction).
    #[cfg_attr(not(feature = "postgres"), allow(dead_code))]
    pub(super) fn guarded(exchange: Exchange<ResB, S::Error>) -> Self {
        Self {
            kind: Kind::Guarded { exchange },
        }
    }

    pub(super) fn reading(body: Limited<ReqB>, pending: Pending<S>) -> Self {
        Self {
            kind: Kind::Reading {
                body,
                read: BodyRead::default(),
                pending: Some(pending),
            },
        }
    }
}

impl<S, ReqB, ResB> Future for IdempotentFuture<S, ReqB, ResB>
where
    S: Service<Request<RequestBody<ReqB>>, Response = Response<ResB>> + Send + 'static,
    S::Future: Send + 'static,
    S::Error: Send + 'static,
    ReqB: Body<Data = Bytes> + Send + 'static,
    ReqB::Error: Into<BodyError>,
    ResB: Body<Data = Bytes> + Send + Unpin + 'static,
    ResB::Error: Into<BodyError>,
{
    type Output = Result<Response<ResponseBody<ResB>>, S::Error>;

    fn poll(mut self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<Self::Output> {
        loop {
            let next = match self.as_mut().project().kind.project() {
                KindProj::Passthrough { future } => {
                    return future
                        .poll(cx)
                        .map_ok(|response| response.map(ResponseBody::streaming));
                }
                KindProj::Ready { response } => {
                    return Poll::Ready(Ok(response.take().expect("polled after completion")));
                }
                KindProj::Guarded { exchange } => return exchange.as_mut().poll(cx),
                KindProj::Claimed { claimed } => {
                    let running = claimed.as_mut().expect("polled after completion");
                    let ran = ready!(Pin::new(&mut running.run).poll(cx));
                    let claimed = claimed.take().expect("polled after completion");
                    return Poll::Ready(claimed.finish(ran));
                }
                KindProj::Reading {
                    mut body,
                    read,
                    pending,
                } => {
                    let outcome = loop {
                        match ready!(body.as_mut().poll_frame(cx)) {
                            // Trailers are not part of the fingerprint.
                            Some(Ok(frame)) => match frame.into_data() {
                                Ok(data) => read.push(data),
                                Err(frame) => {
                                    if let Ok(trailers) = frame.into_trailers() {
                                        read.trailers(trailers);
                                    }
                                }
                            },
                            Some(Err(err)) => break Err(err),
                            None => break Ok(read.finish()),
                        }
                    };
                    let pending = pending.take().expect("polled after completion");
                    // An answer made at once, or a run that ends at its first poll (most do),
                    // returns from here: the future is not rewritten for it.
                    match pending.decide(outcome) {
                        Decided::Answer(response) => return Poll::Ready(Ok(response)),
                        Decided::Claimed(mut claimed) => {
                            if let Poll::Ready(ran) = Pin::new(&mut claimed.run).poll(cx) {
                                return Poll::Ready(claimed.finish(ran));
                            }
                            Kind::Claimed {
                                claimed: Some(claimed),
                            }
                        }
                        Decided::Run(exchange) => Kind::Guarded { exchange },
                    }
                }
            };
            self.as_mut().project().kind.set(next);
        }
    }
}

impl<S, ReqB, ResB> fmt::Debug for IdempotentFuture<S, ReqB, ResB>
where
    S: Service<Request<RequestBody<ReqB>>>,
    S::Error: Send + 'static,
    ResB: Send + 'static,
{
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        let kind = match &self.kind {
            Kind::Passthrough { .. } => "passthrough",
            Kind::Ready { .. } => "ready",
            Kind::Reading { .. } => "reading",
            Kind::Claimed { .. } | Kind::Guarded { .. } => "guarded",
        };
        f.debug_struct("IdempotentFuture")
            .field("kind", &kind)
            .finish()
    }
}
