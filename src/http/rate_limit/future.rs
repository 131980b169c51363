//! [`RateLimitFuture`]: the response future of [`RateLimit`](super::RateLimit).

use std::fmt;
use std::future::Future;
use std::pin::Pin;
use std::task::{Context, Poll, ready};

use http::{HeaderMap, Request, Response};
use pin_project_lite::pin_project;
use tower_service::Service;

use super::{PendingEnforcement, RateLimitDenial};
use crate::http::body::ResponseBody;

pin_project! {
    /// The response future of [`RateLimit`](super::RateLimit): waits for the store (when it
    /// is remote), then the inner service, and adds the rate-limit headers; or answers a
    /// denial.
    pub struct RateLimitFuture<S, B>
    where
        S: Service<Request<B>>,
    {
        #[pin]
        state: State<S, B>,
    }
}

pin_project! {
    #[project = StateProj]
    enum State<S, B>
    where
        S: Service<Request<B>>,
    {
        Checking { pending: PendingEnforcement, inner: Option<S>, request: Option<Request<B>> },
        Calling { #[pin] future: S::Future, headers: HeaderMap },
        Denied { denial: Option<RateLimitDenial> },
    }
}

impl<S: Service<Request<B>>, B> RateLimitFuture<S, B> {
    pub(super) fn checking(pending: PendingEnforcement, inner: S, request: Request<B>) -> Self {
        Self {
            state: State::Checking {
                pending,
                inner: Some(inner),
                request: Some(request),
            },
        }
    }

    pub(super) fn calling(future: S::Future, headers: HeaderMap) -> Self {
        Self {
            state: State::Calling { future, headers },
        }
    }

    pub(super) fn denied(denial: RateLimitDenial) -> Self {
        Self {
            state: State::Denied {
                denial: Some(denial),
            },
        }
    }
}

impl<S, B, ResB> Future for RateLimitFuture<S, B>
where
    S: Service<Request<B>, Response = Response<ResB>>,
{
    type Output = Result<Response<ResponseBody<ResB>>, S::Error>;

    fn poll(mut self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<Self::Output> {
        loop {
            match self.as_mut().project().state.project() {
                StateProj::Checking {
                    pending,
                    inner,
                    request,
                } => {
                    let enforcement = ready!(pending.as_mut().poll(cx));
                    let next = match RateLimitDenial::check(enforcement) {
                        Ok(enforcement) => {
                            let (Some(mut inner), Some(request)) = (inner.take(), request.take())
                            else {
                                panic!("polled after completion");
                            };
                            State::Calling {
                                future: inner.call(request),
                                headers: enforcement.headers,
                            }
                        }
                        Err(denial) => State::Denied {
                            denial: Some(denial),
                        },
                    };
                    self.as_mut().project().state.set(next);
                }
                StateProj::Calling { future, headers } => {
                    let mut response = ready!(future.poll(cx))?;
                    // The limit's headers replace any the handler set under the same names.
                    let mut last = None;
                    for (name, value) in std::mem::take(headers) {
                        match name {
                            Some(name) => {
                                response.headers_mut().insert(name.clone(), value);
                                last = Some(name);
                            }
                            None => {
                                if let Some(name) = &last {
                                    response.headers_mut().append(name, value);
                                }
                            }
                        }
                    }
                    return Poll::Ready(Ok(response.map(ResponseBody::streaming)));
                }
                StateProj::Denied { denial } => {
                    let denial = denial.take().expect("polled after completion");
                    return Poll::Ready(Ok(denial.into_response().map(ResponseBody::full)));
                }
            }
        }
    }
}

impl<S: Service<Request<B>>, B> fmt::Debug for RateLimitFuture<S, B> {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        let state = match &self.state {
            State::Checking { .. } => "checking",
            State::Calling { .. } => "calling",
            State::Denied { .. } => "denied",
        };
        f.debug_struct("RateLimitFuture")
            .field("state", &state)
            .finish()
    }
}
