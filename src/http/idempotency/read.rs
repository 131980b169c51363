//! A body read into memory, frame by frame: the request's, to fingerprint it, and the
//! response's, to store it.

use bytes::{Bytes, BytesMut};
use http::HeaderMap;

/// The data frames of a request body read so far: one frame (the usual case) is kept as it
/// came, without a copy.
#[derive(Default)]
pub(super) struct BodyRead {
    first: Bytes,
    rest: BytesMut,
    /// Rare: boxed, so the future that reads the body stays small.
    trailers: Option<Box<HeaderMap>>,
}

impl BodyRead {
    /// Keeps the request's trailers for the handler (they are not fingerprinted).
    pub(super) fn trailers(&mut self, trailers: HeaderMap) {
        match &mut self.trailers {
            Some(kept) => kept.extend(trailers),
            None => self.trailers = Some(Box::new(trailers)),
        }
    }

    pub(super) fn push(&mut self, data: Bytes) {
        if self.first.is_empty() {
            self.first = data;
        } else {
            if self.rest.is_empty() {
                self.rest.reserve(self.first.len() + data.len());
                self.rest.extend_from_slice(&self.first);
            }
            self.rest.extend_from_slice(&data);
        }
    }

    /// How many bytes were read so far.
    pub(super) fn len(&self) -> usize {
        if self.rest.is_empty() {
            self.first.len()
        } else {
            self.rest.len()
        }
    }

    pub(super) fn finish(&mut self) -> (Bytes, Option<HeaderMap>) {
        let first = std::mem::take(&mut self.first);
        let bytes = if self.rest.is_empty() {
            first
        } else {
            std::mem::take(&mut self.rest).freeze()
        };
        (bytes, self.trailers.take().map(|t| *t))
    }
}

/// The whole request body, up to `limit` bytes.
#[cfg(test)]
pub(super) async fn read_body<B>(
    body: B,
    limit: usize,
) -> Result<Bytes, crate::http::body::BodyError>
where
    B: http_body::Body<Data = Bytes>,
    B::Error: Into<crate::http::body::BodyError>,
{
    use http_body_util::BodyExt;

    let mut body = std::pin::pin!(http_body_util::Limited::new(body, limit));
    let mut read = BodyRead::default();
    while let Some(frame) = body.frame().await {
        // Trailers are not part of the fingerprint.
        if let Ok(data) = frame?.into_data() {
            read.push(data);
        }
    }
    Ok(read.finish().0)
}
