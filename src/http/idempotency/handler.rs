//! [`HandlerRun`]: the handler's run for a guarded request, a named future, so the key's run
//! holds it in place (an `async` block would keep the request twice: as captured, and in the
//! service's future).

use std::future::Future;
use std::pin::Pin;
use std::sync::Arc;
use std::task::{Context, Poll, ready};

use http::response::Parts;
use http::{Request, Response};
use pin_project_lite::pin_project;
use tower_service::Service;

use super::backend::{NotStored, StoredResponse};
use super::read::BodyRead;
use super::{Config, is_grpc};
use crate::http::body::{InBody, OutBody, RequestBody, ResponseBody};

/// The inner service the layer guards, with its future and error sent to the key's run: the
/// bounds the exchange's steps share, named once.
pub(super) trait Guarded<ReqB, ResB>:
    Service<
        Request<RequestBody<ReqB>>,
        Response = Response<ResB>,
        Future: Send + 'static,
        Error: Send + 'static,
    > + Send
    + 'static
{
}

impl<S, ReqB, ResB> Guarded<ReqB, ResB> for S where
    S: Service<
            Request<RequestBody<ReqB>>,
            Response = Response<ResB>,
            Future: Send + 'static,
            Error: Send + 'static,
        > + Send
        + 'static
{
}

/// What the handler's run hands back to its caller, stored or not.
pub(super) type Handed<B, E> = Result<Response<ResponseBody<B>>, E>;

/// What the handler's run comes to: what to store, if anything, and the response to hand
/// back (whole, or streaming when it is not stored).
pub(super) type HandlerOutput<B, E> = (Result<StoredResponse, NotStored>, Handed<B, E>);

pin_project! {
    /// Calls the service at its first poll (inside the run's panic boundary), then reads a
    /// response to store whole.
    pub(super) struct HandlerRun<S, ReqB, ResB>
    where
        S: Service<Request<RequestBody<ReqB>>>,
    {
        config: Arc<Config>,
        #[pin]
        step: Step<S, ReqB, ResB>,
    }
}

pin_project! {
    #[project = StepProj]
    enum Step<S, ReqB, ResB>
    where
        S: Service<Request<RequestBody<ReqB>>>,
    {
        Start { inner: S, request: Option<Request<RequestBody<ReqB>>> },
        Calling { #[pin] future: S::Future },
        // One data frame (a full body, the usual case) is kept as it came, without a copy.
        Buffering { head: Option<Parts>, body: Option<ResB>, read: BodyRead },
    }
}

impl<S, ReqB, ResB> HandlerRun<S, ReqB, ResB>
where
    S: Service<Request<RequestBody<ReqB>>>,
{
    pub(super) fn new(config: Arc<Config>, inner: S, request: Request<RequestBody<ReqB>>) -> Self {
        Self {
            config,
            step: Step::Start {
                inner,
                request: Some(request),
            },
        }
    }
}

impl<S, ReqB, ResB> Future for HandlerRun<S, ReqB, ResB>
where
    S: Guarded<ReqB, ResB>,
    ReqB: InBody,
    ResB: OutBody,
{
    type Output = HandlerOutput<ResB, S::Error>;

    fn poll(self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<Self::Output> {
        let mut this = self.project();
        loop {
            let next = match this.step.as_mut().project() {
                StepProj::Start { inner, request } => {
                    let request = request.take().expect("polled after completion");
                    Step::Calling {
                        future: inner.call(request),
                    }
                }
                StepProj::Calling { future } => {
                    let (head, body) = match ready!(future.poll(cx)) {
                        Ok(response) => response.into_parts(),
                        Err(err) => return Poll::Ready((Err(NotStored), Err(err))),
                    };
                    // gRPC answers in trailers and may stream: it passes as it comes.
                    if !(this.config.store_when)(head.status) || is_grpc(&head.headers) {
                        let streaming = Response::from_parts(head, ResponseBody::streaming(body));
                        return Poll::Ready((Err(NotStored), Ok(streaming)));
                    }
                    if body.size_hint().lower() > this.config.max_stored as u64 {
                        let streaming = Response::from_parts(head, ResponseBody::streaming(body));
                        return Poll::Ready((Err(NotStored), Ok(streaming)));
                    }
                    Step::Buffering {
                        head: Some(head),
                        body: Some(body),
                        read: BodyRead::default(),
                    }
                }
                StepProj::Buffering { head, body, read } => {
                    let limit = this.config.max_stored;
                    let tail = ready!(poll_buffer(body, read, limit, cx));
                    let head = head.take().expect("polled after completion");
                    return Poll::Ready(match tail {
                        Buffered::Whole(bytes) => {
                            let stored = StoredResponse::new(
                                head.status,
                                &head.headers,
                                &this.config.keep,
                                bytes.clone(),
                            );
                            let whole = Response::from_parts(head, ResponseBody::full(bytes));
                            (Ok(stored), Ok(whole))
                        }
                        Buffered::Partial(body) => {
                            (Err(NotStored), Ok(Response::from_parts(head, body)))
                        }
                    });
                }
            };
            this.step.set(next);
        }
    }
}

enum Buffered<B> {
    Whole(bytes::Bytes),
    /// Over the limit, or failed: what was read, then the rest (or the error).
    Partial(ResponseBody<B>),
}

/// Reads `body` (taken once it ends) into `read`, up to `limit` bytes.
fn poll_buffer<B>(
    body: &mut Option<B>,
    read: &mut BodyRead,
    limit: usize,
    cx: &mut Context<'_>,
) -> Poll<Buffered<B>>
where
    B: OutBody,
{
    let reading = body.as_mut().expect("polled after completion");
    loop {
        let frame = ready!(Pin::new(&mut *reading).poll_frame(cx));
        let frame = match frame {
            None => return Poll::Ready(Buffered::Whole(read.finish().0)),
            Some(Ok(frame)) => frame,
            Some(Err(err)) => {
                body.take();
                return Poll::Ready(Buffered::Partial(ResponseBody::failed(
                    read.finish().0,
                    err.into(),
                )));
            }
        };
        match frame.into_data() {
            Ok(data) => {
                read.push(data);
                if read.len() > limit {
                    let rest = body.take().expect("read above");
                    return Poll::Ready(Buffered::Partial(ResponseBody::resume(
                        read.finish().0,
                        rest,
                    )));
                }
            }
            // A response with trailers is not stored (the envelope has none): it passes
            // whole, trailers included.
            Err(frame) => {
                let trailers = frame.into_trailers().ok();
                let rest = body.take().expect("read above");
                return Poll::Ready(Buffered::Partial(ResponseBody::resume_with_trailers(
                    read.finish().0,
                    trailers,
                    rest,
                )));
            }
        }
    }
}
