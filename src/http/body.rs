//! The bodies the layers hand on: a request body that may have been buffered, and a response
//! body that is the inner service's, a buffered or replayed one, or a problem document.

use std::pin::Pin;
use std::task::{Context, Poll};

use bytes::Bytes;
use http::HeaderMap;
use http_body::{Body, Frame, SizeHint};
use pin_project_lite::pin_project;

/// The error type of [`RequestBody`] and [`ResponseBody`]: the wrapped body's error, boxed.
pub type BodyError = Box<dyn std::error::Error + Send + Sync + 'static>;

pin_project! {
    /// The request body an inner service receives from [`IdempotencyLayer`](super::IdempotencyLayer):
    /// the buffered bytes of a guarded request (the layer read them to fingerprint it), or the
    /// original body, untouched, of any other request.
    #[derive(Debug)]
    pub struct RequestBody<B> {
        #[pin]
        kind: RequestKind<B>,
    }
}

pin_project! {
    #[project = RequestProj]
    #[derive(Debug)]
    enum RequestKind<B> {
        // Trailers are rare: boxed, so they cost a pointer.
        Buffered { data: Option<Bytes>, trailers: Option<Box<HeaderMap>> },
        Streaming { #[pin] body: B },
    }
}

impl<B> RequestBody<B> {
    /// A body of `data`, already read.
    pub fn buffered(data: Bytes) -> Self {
        Self::buffered_with_trailers(data, None)
    }

    /// A body of `data`, then `trailers`, already read.
    pub(crate) fn buffered_with_trailers(data: Bytes, trailers: Option<HeaderMap>) -> Self {
        Self {
            kind: RequestKind::Buffered {
                data: Some(data).filter(|d| !d.is_empty()),
                trailers: trailers.map(Box::new),
            },
        }
    }

    /// `body`, passed on as it comes.
    pub fn streaming(body: B) -> Self {
        Self {
            kind: RequestKind::Streaming { body },
        }
    }
}

impl<B> Body for RequestBody<B>
where
    B: Body<Data = Bytes>,
    B::Error: Into<BodyError>,
{
    type Data = Bytes;
    type Error = BodyError;

    fn poll_frame(
        self: Pin<&mut Self>,
        cx: &mut Context<'_>,
    ) -> Poll<Option<Result<Frame<Bytes>, BodyError>>> {
        match self.project().kind.project() {
            RequestProj::Buffered { data, trailers } => Poll::Ready(
                data.take()
                    .map(Frame::data)
                    .or_else(|| trailers.take().map(|t| Frame::trailers(*t)))
                    .map(Ok),
            ),
            RequestProj::Streaming { body } => body.poll_frame(cx).map_err(Into::into),
        }
    }

    fn is_end_stream(&self) -> bool {
        match &self.kind {
            RequestKind::Buffered { data, trailers } => data.is_none() && trailers.is_none(),
            RequestKind::Streaming { body } => body.is_end_stream(),
        }
    }

    fn size_hint(&self) -> SizeHint {
        match &self.kind {
            RequestKind::Buffered { data, .. } => exact(data.as_ref()),
            RequestKind::Streaming { body } => body.size_hint(),
        }
    }
}

pin_project! {
    /// The response body of the layers: the inner service's own, a buffered or replayed body,
    /// or a generated `application/problem+json` document.
    #[derive(Debug)]
    pub struct ResponseBody<B> {
        #[pin]
        kind: ResponseKind<B>,
    }
}

pin_project! {
    #[project = ResponseProj]
    #[derive(Debug)]
    enum ResponseKind<B> {
        Full { data: Option<Bytes> },
        // What was read before the layer gave up buffering, then the rest as it comes.
        Streaming { prefix: Option<Bytes>, trailers: Option<Box<HeaderMap>>, #[pin] body: B },
        // What was read before the inner body failed, then its error.
        Failed { prefix: Option<Bytes>, error: Option<BodyError> },
    }
}

impl<B> ResponseBody<B> {
    /// A body of `data`.
    pub fn full(data: Bytes) -> Self {
        Self {
            kind: ResponseKind::Full {
                data: Some(data).filter(|d| !d.is_empty()),
            },
        }
    }

    /// An empty body.
    pub fn empty() -> Self {
        Self {
            kind: ResponseKind::Full { data: None },
        }
    }

    /// The inner service's body, passed on as it comes.
    pub fn streaming(body: B) -> Self {
        Self::resume(Bytes::new(), body)
    }

    /// `prefix` (already read from `body`), then the rest of `body`.
    pub(crate) fn resume(prefix: Bytes, body: B) -> Self {
        Self::resume_with_trailers(prefix, None, body)
    }

    /// `prefix` and `trailers` (already read from `body`), then the rest of `body`.
    pub(crate) fn resume_with_trailers(
        prefix: Bytes,
        trailers: Option<HeaderMap>,
        body: B,
    ) -> Self {
        Self {
            kind: ResponseKind::Streaming {
                prefix: Some(prefix).filter(|p| !p.is_empty()),
                trailers: trailers.map(Box::new),
                body,
            },
        }
    }

    /// `prefix`, then `error`.
    #[cfg_attr(not(feature = "runtime"), allow(dead_code))]
    pub(crate) fn failed(prefix: Bytes, error: BodyError) -> Self {
        Self {
            kind: ResponseKind::Failed {
                prefix: Some(prefix).filter(|p| !p.is_empty()),
                error: Some(error),
            },
        }
    }
}

impl<B> Body for ResponseBody<B>
where
    B: Body<Data = Bytes>,
    B::Error: Into<BodyError>,
{
    type Data = Bytes;
    type Error = BodyError;

    fn poll_frame(
        self: Pin<&mut Self>,
        cx: &mut Context<'_>,
    ) -> Poll<Option<Result<Frame<Bytes>, BodyError>>> {
        match self.project().kind.project() {
            ResponseProj::Full { data } => Poll::Ready(data.take().map(|d| Ok(Frame::data(d)))),
            ResponseProj::Streaming {
                prefix,
                trailers,
                body,
            } => {
                if let Some(prefix) = prefix.take() {
                    Poll::Ready(Some(Ok(Frame::data(prefix))))
                } else if let Some(trailers) = trailers.take() {
                    Poll::Ready(Some(Ok(Frame::trailers(*trailers))))
                } else {
                    body.poll_frame(cx).map_err(Into::into)
                }
            }
            ResponseProj::Failed { prefix, error } => match prefix.take() {
                Some(prefix) => Poll::Ready(Some(Ok(Frame::data(prefix)))),
                None => Poll::Ready(error.take().map(Err)),
            },
        }
    }

    fn is_end_stream(&self) -> bool {
        match &self.kind {
            ResponseKind::Full { data } => data.is_none(),
            ResponseKind::Streaming {
                prefix,
                trailers,
                body,
            } => prefix.is_none() && trailers.is_none() && body.is_end_stream(),
            ResponseKind::Failed { prefix, error } => prefix.is_none() && error.is_none(),
        }
    }

    fn size_hint(&self) -> SizeHint {
        match &self.kind {
            ResponseKind::Full { data } => exact(data.as_ref()),
            ResponseKind::Streaming { prefix, body, .. } => {
                let extra = prefix.as_ref().map_or(0, |p| p.len() as u64);
                let inner = body.size_hint();
                let mut hint = SizeHint::new();
                hint.set_lower(inner.lower().saturating_add(extra));
                if let Some(upper) = inner.upper() {
                    hint.set_upper(upper.saturating_add(extra));
                }
                hint
            }
            ResponseKind::Failed { prefix, .. } => {
                let mut hint = SizeHint::new();
                hint.set_lower(prefix.as_ref().map_or(0, |p| p.len() as u64));
                hint
            }
        }
    }
}

fn exact(data: Option<&Bytes>) -> SizeHint {
    SizeHint::with_exact(data.map_or(0, |d| d.len() as u64))
}

/// A request body the layer can read whole.
#[cfg(feature = "runtime")]
pub(crate) trait InBody:
    Body<Data = Bytes, Error: Into<BodyError>> + Send + 'static
{
}

#[cfg(feature = "runtime")]
impl<B> InBody for B where B: Body<Data = Bytes, Error: Into<BodyError>> + Send + 'static {}

/// A response body the layer can store, or hand back streaming.
#[cfg(feature = "runtime")]
pub(crate) trait OutBody:
    Body<Data = Bytes, Error: Into<BodyError>> + Send + Unpin + 'static
{
}

#[cfg(feature = "runtime")]
impl<B> OutBody for B where B: Body<Data = Bytes, Error: Into<BodyError>> + Send + Unpin + 'static {}

#[cfg(test)]
mod tests {
    use http_body_util::{BodyExt, Full};

    use super::*;

    #[tokio::test]
    async fn a_resumed_body_yields_its_prefix_then_the_rest() {
        let body = ResponseBody::resume(Bytes::from_static(b"ab"), Full::new(Bytes::from("cd")));
        assert_eq!(body.size_hint().exact(), Some(4));
        let bytes = body.collect().await.unwrap().to_bytes();
        assert_eq!(bytes, "abcd");
    }

    #[tokio::test]
    async fn a_failed_body_yields_its_prefix_then_the_error() {
        let body = ResponseBody::<Full<Bytes>>::failed(
            Bytes::from_static(b"ab"),
            "connection reset".into(),
        );
        let mut body = std::pin::pin!(body);
        let first = body.frame().await.unwrap().unwrap();
        assert_eq!(first.into_data().unwrap(), "ab");
        let err = body.frame().await.unwrap().unwrap_err();
        assert_eq!(err.to_string(), "connection reset");
        assert!(body.frame().await.is_none());
    }

    #[tokio::test]
    async fn a_buffered_request_body_is_one_frame_with_an_exact_size() {
        let body = RequestBody::<Full<Bytes>>::buffered(Bytes::from_static(b"xyz"));
        assert_eq!(body.size_hint().exact(), Some(3));
        assert!(!body.is_end_stream());
        assert_eq!(body.collect().await.unwrap().to_bytes(), "xyz");
        let empty = RequestBody::<Full<Bytes>>::buffered(Bytes::new());
        assert!(empty.is_end_stream());
    }
}
