//! RFC 9457 problem documents: the bodies of every response the layers make themselves.

use bytes::Bytes;
use http::header::CONTENT_TYPE;
use http::{HeaderValue, Response, StatusCode};
use serde::Serialize;

use super::body::ResponseBody;

/// The media type of the layers' error bodies (RFC 9457).
pub const PROBLEM_JSON: &str = "application/problem+json";

/// Every kind of response the layers make themselves, each with a stable `type` URI, a
/// status and a title.
///
/// The bodies are `application/problem+json` documents (RFC 9457) with `type`, `title`,
/// `status` and a `detail` that says what happened to this request. Match on `type`: the
/// titles and details are for people.
///
/// # Examples
///
/// ```
/// use throttlebeam::http::ProblemType;
///
/// assert_eq!(ProblemType::KeyReused.status(), 422);
/// assert_eq!(ProblemType::KeyReused.uri(), "tag:throttlebeam,2026:idempotency-key-reused");
/// ```
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
#[non_exhaustive]
pub enum ProblemType {
    /// 400: the `Idempotency-Key` header is empty, over 255 bytes, not text, or repeated.
    KeyInvalid,
    /// 400: a guarded request without an `Idempotency-Key`, when keys are required.
    KeyMissing,
    /// 422: the key was used before for a different method, path, query or body.
    KeyReused,
    /// 409: the first request with this key is still running (the duplicate waited its wait
    /// timeout, or the layer fails fast).
    KeyInFlight,
    /// 413: the request body is over the buffering limit.
    BodyTooLarge,
    /// 400: the request body could not be read.
    BodyUnreadable,
    /// 500: the handler panicked; nothing was stored and the key is free again.
    HandlerPanicked,
    /// 503: the idempotency store or runtime cannot take the request (down, shut down, full).
    IdempotencyUnavailable,
    /// 500: the layer is misconfigured (for example a scope over 1024 bytes).
    IdempotencyMisconfigured,
    /// 429: the client is over its rate limit.
    RateLimited,
    /// 503: the rate-limit store failed and the policy is to refuse.
    RateLimitUnavailable,
    /// 400: the rate-limit key taken from the request is invalid (empty, or over 1024 bytes).
    RateLimitKeyInvalid,
    /// 500: the rate limit can never admit the request (a cost above the strategy's
    /// capacity): the server's configuration.
    RateLimitMisconfigured,
    /// 400: the idempotency scope named for the request is over the key limit.
    ScopeInvalid,
    /// 500: the rate limit is keyed by client IP and the request has no peer address (the
    /// server does not record it: serve with connect info).
    ClientAddressUnavailable,
}

impl ProblemType {
    /// The `type` member: a tag URI (RFC 4151) that never changes.
    #[must_use]
    pub fn uri(self) -> &'static str {
        match self {
            Self::KeyInvalid => "tag:throttlebeam,2026:idempotency-key-invalid",
            Self::KeyMissing => "tag:throttlebeam,2026:idempotency-key-missing",
            Self::KeyReused => "tag:throttlebeam,2026:idempotency-key-reused",
            Self::KeyInFlight => "tag:throttlebeam,2026:idempotency-key-in-flight",
            Self::BodyTooLarge => "tag:throttlebeam,2026:request-body-too-large",
            Self::BodyUnreadable => "tag:throttlebeam,2026:request-body-unreadable",
            Self::HandlerPanicked => "tag:throttlebeam,2026:handler-panicked",
            Self::IdempotencyUnavailable => "tag:throttlebeam,2026:idempotency-unavailable",
            Self::IdempotencyMisconfigured => "tag:throttlebeam,2026:idempotency-misconfigured",
            Self::RateLimited => "tag:throttlebeam,2026:rate-limited",
            Self::RateLimitUnavailable => "tag:throttlebeam,2026:rate-limit-unavailable",
            Self::RateLimitKeyInvalid => "tag:throttlebeam,2026:rate-limit-key-invalid",
            Self::ClientAddressUnavailable => "tag:throttlebeam,2026:client-address-unavailable",
            Self::ScopeInvalid => "tag:throttlebeam,2026:idempotency-scope-invalid",
            Self::RateLimitMisconfigured => "tag:throttlebeam,2026:rate-limit-misconfigured",
        }
    }

    /// The response status.
    #[must_use]
    pub fn status(self) -> StatusCode {
        match self {
            Self::KeyInvalid
            | Self::KeyMissing
            | Self::BodyUnreadable
            | Self::RateLimitKeyInvalid
            | Self::ScopeInvalid => StatusCode::BAD_REQUEST,
            Self::KeyReused => StatusCode::UNPROCESSABLE_ENTITY,
            Self::KeyInFlight => StatusCode::CONFLICT,
            Self::BodyTooLarge => StatusCode::PAYLOAD_TOO_LARGE,
            Self::HandlerPanicked
            | Self::IdempotencyMisconfigured
            | Self::ClientAddressUnavailable
            | Self::RateLimitMisconfigured => StatusCode::INTERNAL_SERVER_ERROR,
            Self::IdempotencyUnavailable | Self::RateLimitUnavailable => {
                StatusCode::SERVICE_UNAVAILABLE
            }
            Self::RateLimited => StatusCode::TOO_MANY_REQUESTS,
        }
    }

    /// The `title` member: a short summary that does not change from request to request.
    #[must_use]
    pub fn title(self) -> &'static str {
        match self {
            Self::KeyInvalid => "Invalid Idempotency-Key header",
            Self::KeyMissing => "Missing Idempotency-Key header",
            Self::KeyReused => "Idempotency key reused for a different request",
            Self::KeyInFlight => "A request with this idempotency key is in progress",
            Self::BodyTooLarge => "Request body too large",
            Self::BodyUnreadable => "Request body could not be read",
            Self::HandlerPanicked => "Internal server error",
            Self::IdempotencyUnavailable => "Idempotency store unavailable",
            Self::IdempotencyMisconfigured => "Idempotency layer misconfigured",
            Self::RateLimited => "Too many requests",
            Self::RateLimitUnavailable => "Rate limiter unavailable",
            Self::RateLimitKeyInvalid => "Invalid rate-limit key",
            Self::ClientAddressUnavailable => "Client address unavailable",
            Self::ScopeInvalid => "Idempotency scope too long",
            Self::RateLimitMisconfigured => "Rate limit misconfigured",
        }
    }
}

#[derive(Serialize)]
struct Document<'a> {
    #[serde(rename = "type")]
    type_uri: &'static str,
    title: &'static str,
    status: u16,
    detail: &'a str,
}

/// The problem document of `kind` with `detail`, as a response.
#[cfg_attr(not(feature = "runtime"), allow(dead_code))]
pub(crate) fn problem<B>(kind: ProblemType, detail: &str) -> Response<ResponseBody<B>> {
    problem_bytes(kind, detail).map(ResponseBody::full)
}

/// The problem document of `kind` with `detail`, as a response of bytes.
pub(crate) fn problem_bytes(kind: ProblemType, detail: &str) -> Response<Bytes> {
    let status = kind.status();
    let document = Document {
        type_uri: kind.uri(),
        title: kind.title(),
        status: status.as_u16(),
        detail,
    };
    // A struct of strings and a number always serializes.
    let json = serde_json::to_vec(&document).unwrap_or_default();
    let mut response = Response::new(Bytes::from(json));
    *response.status_mut() = status;
    response
        .headers_mut()
        .insert(CONTENT_TYPE, HeaderValue::from_static(PROBLEM_JSON));
    response
}

#[cfg(test)]
mod tests {
    use http_body_util::{BodyExt, Full};

    use super::*;

    #[tokio::test]
    async fn a_problem_is_json_with_the_four_members() {
        let response = problem::<Full<Bytes>>(ProblemType::KeyReused, "key \"k\" \\ reused");
        assert_eq!(response.status(), 422);
        assert_eq!(response.headers()[CONTENT_TYPE], PROBLEM_JSON);
        let body = response.into_body().collect().await.unwrap().to_bytes();
        let value: serde_json::Value = serde_json::from_slice(&body).unwrap();
        assert_eq!(
            value,
            serde_json::json!({
                "type": "tag:throttlebeam,2026:idempotency-key-reused",
                "title": "Idempotency key reused for a different request",
                "status": 422,
                "detail": "key \"k\" \\ reused",
            })
        );
    }

    #[test]
    fn every_type_has_a_distinct_uri() {
        let all = [
            ProblemType::KeyInvalid,
            ProblemType::KeyMissing,
            ProblemType::KeyReused,
            ProblemType::KeyInFlight,
            ProblemType::BodyTooLarge,
            ProblemType::BodyUnreadable,
            ProblemType::HandlerPanicked,
            ProblemType::IdempotencyUnavailable,
            ProblemType::IdempotencyMisconfigured,
            ProblemType::RateLimited,
            ProblemType::RateLimitUnavailable,
            ProblemType::RateLimitKeyInvalid,
            ProblemType::ClientAddressUnavailable,
            ProblemType::ScopeInvalid,
            ProblemType::RateLimitMisconfigured,
        ];
        let uris: std::collections::HashSet<_> = all.iter().map(|k| k.uri()).collect();
        assert_eq!(uris.len(), all.len());
    }
}
