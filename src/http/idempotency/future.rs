//! [`IdempotentFuture`]: the response future of [`Idempotent`](super::Idempotent).

use std::fmt;
use std::future::Future;
use std::pin::Pin;
use std::task::{Context, Poll};

use http::Response;
use pin_project_lite::pin_project;

use crate::http::body::ResponseBody;

pub(super) type Exchange<B, E> =
    Pin<Box<dyn Future<Output = Result<Response<ResponseBody<B>>, E>> + Send + 'static>>;

pin_project! {
    /// The response future of [`Idempotent`](super::Idempotent): the inner service's own for
    /// a request the layer does not guard, an answer made at once (a bad key), or the
    /// guarded exchange (buffer, claim, run or replay).
    pub struct IdempotentFuture<F, B, E> {
        #[pin]
        kind: Kind<F, B, E>,
    }
}

pin_project! {
    #[project = KindProj]
    enum Kind<F, B, E> {
        Passthrough { #[pin] future: F },
        Ready { response: Option<Response<ResponseBody<B>>> },
        Guarded { exchange: Exchange<B, E> },
    }
}

impl<F, B, E> IdempotentFuture<F, B, E> {
    pub(super) fn passthrough(future: F) -> Self {
        Self {
            kind: Kind::Passthrough { future },
        }
    }

    pub(super) fn ready(response: Response<ResponseBody<B>>) -> Self {
        Self {
            kind: Kind::Ready {
                response: Some(response),
            },
        }
    }

    pub(super) fn guarded(exchange: Exchange<B, E>) -> Self {
        Self {
            kind: Kind::Guarded { exchange },
        }
    }
}

impl<F, B, E> Future for IdempotentFuture<F, B, E>
where
    F: Future<Output = Result<Response<B>, E>>,
{
    type Output = Result<Response<ResponseBody<B>>, E>;

    fn poll(self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<Self::Output> {
        match self.project().kind.project() {
            KindProj::Passthrough { future } => future
                .poll(cx)
                .map_ok(|response| response.map(ResponseBody::streaming)),
            KindProj::Ready { response } => {
                Poll::Ready(Ok(response.take().expect("polled after completion")))
            }
            KindProj::Guarded { exchange } => exchange.as_mut().poll(cx),
        }
    }
}

impl<F, B, E> fmt::Debug for IdempotentFuture<F, B, E> {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        let kind = match &self.kind {
            Kind::Passthrough { .. } => "passthrough",
            Kind::Ready { .. } => "ready",
            Kind::Guarded { .. } => "guarded",
        };
        f.debug_struct("IdempotentFuture")
            .field("kind", &kind)
            .finish()
    }
}
