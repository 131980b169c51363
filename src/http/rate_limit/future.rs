//! [`RateLimitFuture`]: the response future of [`RateLimit`](super::RateLimit).

use std::fmt;
use std::future::Future;
use std::pin::Pin;
use std::task::{Context, Poll, ready};

use bytes::Bytes;
use http::{HeaderMap, HeaderName, Request, Response};
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
        Refused { response: Option<Response<Bytes>> },
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

    pub(super) fn refused(response: Response<Bytes>) -> Self {
        Self {
            state: State::Refused {
                response: Some(response),
            },
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
                    add_limit_headers(response.headers_mut(), std::mem::take(headers));
                    return Poll::Ready(Ok(response.map(ResponseBody::streaming)));
                }
                StateProj::Refused { response } => {
                    let response = response.take().expect("polled after completion");
                    return Poll::Ready(Ok(response.map(ResponseBody::full)));
                }
                StateProj::Denied { denial } => {
                    let denial = denial.take().expect("polled after completion");
                    return Poll::Ready(Ok(denial.into_response().map(ResponseBody::full)));
                }
            }
        }
    }
}

/// Adds the limit's headers to the handler's `response` headers; they replace any the handler
/// set under the same names. The limit's map becomes the response's (no copy), and the
/// handler's other headers, usually none or few, move into it.
fn add_limit_headers(response: &mut HeaderMap, limit: HeaderMap) {
    if limit.is_empty() {
        return;
    }
    let own = std::mem::replace(response, limit);
    let mut kept: Option<HeaderName> = None;
    for (name, value) in own {
        match name {
            Some(name) => {
                kept = (!response.contains_key(&name)).then_some(name);
                if let Some(name) = &kept {
                    response.append(name.clone(), value);
                }
            }
            None => {
                if let Some(name) = &kept {
                    response.append(name, value);
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
            State::Refused { .. } => "refused",
        };
        f.debug_struct("RateLimitFuture")
            .field("state", &state)
            .finish()
    }
}

#[cfg(test)]
mod tests {
    use http::HeaderValue;

    use super::*;

    #[test]
    fn the_limit_headers_replace_the_handlers_and_keep_the_rest() {
        let mut response = HeaderMap::new();
        response.append("ratelimit-limit", HeaderValue::from_static("999"));
        response.append("ratelimit-limit", HeaderValue::from_static("998"));
        response.append("set-cookie", HeaderValue::from_static("a=1"));
        response.append("set-cookie", HeaderValue::from_static("b=2"));
        response.append("content-type", HeaderValue::from_static("text/plain"));
        let mut limit = HeaderMap::new();
        limit.insert("ratelimit-limit", HeaderValue::from_static("10"));
        limit.insert("ratelimit-remaining", HeaderValue::from_static("9"));
        add_limit_headers(&mut response, limit);
        let all = |name: &str| -> Vec<&str> {
            response
                .get_all(name)
                .iter()
                .map(|v| v.to_str().unwrap())
                .collect()
        };
        assert_eq!(all("ratelimit-limit"), ["10"]);
        assert_eq!(all("ratelimit-remaining"), ["9"]);
        assert_eq!(all("set-cookie"), ["a=1", "b=2"]);
        assert_eq!(all("content-type"), ["text/plain"]);
        assert_eq!(response.len(), 5);

        let mut untouched = HeaderMap::new();
        untouched.insert("content-type", HeaderValue::from_static("text/plain"));
        add_limit_headers(&mut untouched, HeaderMap::new());
        assert_eq!(untouched.len(), 1);
    }
}
