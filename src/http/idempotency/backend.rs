//! Every call the idempotency layer makes into the rest of the crate, and how its errors
//! become HTTP answers. Kept in one place so the runtime's API can change under it.

use std::future::Future;
use std::time::Duration;

use bytes::{Bytes, BytesMut};
use http::header::CONTENT_TYPE;
use http::{HeaderMap, HeaderName, HeaderValue, StatusCode};
use serde::{Deserialize, Serialize};

use crate::error::Error;
use crate::job::Job;
use throttlebeam_supervisors::RunHere;

use crate::idempotency::{
    Claimed, Fingerprint, IdempotencyHandle, IdempotencyOptions, IdempotencyOutcome, InFlight,
};

/// A stored response: one serializable envelope, so a shared store can keep it as it is.
///
/// The kept headers are one buffer of `name:value\n` lines (a name holds no `:`, a value
/// no line break), so storing them is one copy and a replay clones a reference, not a
/// list of strings.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub(super) struct StoredResponse {
    pub(super) status: u16,
    /// `Content-Type` and the allow-listed headers, in order.
    pub(super) headers: Bytes,
    pub(super) body: Bytes,
}

impl StoredResponse {
    pub(super) fn new(
        status: StatusCode,
        headers: &HeaderMap,
        keep: &[HeaderName],
        body: Bytes,
    ) -> Self {
        let mut lines = BytesMut::new();
        for name in
            std::iter::once(&CONTENT_TYPE).chain(keep.iter().filter(|n| **n != CONTENT_TYPE))
        {
            for value in headers.get_all(name) {
                lines.reserve(name.as_str().len() + value.len() + 2);
                lines.extend_from_slice(name.as_str().as_bytes());
                lines.extend_from_slice(b":");
                lines.extend_from_slice(value.as_bytes());
                lines.extend_from_slice(b"\n");
            }
        }
        Self {
            status: status.as_u16(),
            headers: lines.freeze(),
            body,
        }
    }

    /// The status and headers to answer a replay with, plus room for `extra` more headers
    /// (entries that no longer parse are skipped; they were valid when stored).
    pub(super) fn head(&self, extra: usize) -> (StatusCode, HeaderMap) {
        let status = StatusCode::from_u16(self.status).unwrap_or(StatusCode::OK);
        let lines = self
            .headers
            .split(|b| *b == b'\n')
            .filter(|l| !l.is_empty());
        let mut map = HeaderMap::with_capacity(extra + 1);
        for line in lines {
            let Some(colon) = line.iter().position(|b| *b == b':') else {
                continue;
            };
            let start = line.as_ptr() as usize - self.headers.as_ptr() as usize;
            let value = self.headers.slice(start + colon + 1..start + line.len());
            if let (Ok(name), Ok(value)) = (
                HeaderName::from_bytes(&line[..colon]),
                HeaderValue::from_maybe_shared(value),
            ) {
                map.append(name, value);
            }
        }
        (status, map)
    }
}

/// Whether a run ran here or replayed another's.
pub(super) type RunOutcome = IdempotencyOutcome<StoredResponse>;

/// Settings every guarded request shares: TTL, lease and wait timeout. The scope and
/// fingerprint are set per request.
pub(super) fn base_options(options: IdempotencyOptions, fail_fast: bool) -> IdempotencyOptions {
    if fail_fast {
        // A duplicate that finds the key in flight is refused at once, with a retry hint.
        options.with_in_flight(InFlight::Reject)
    } else {
        options
    }
}

/// Runs `f` once for `key` under `options`, after [`try_replay`] found no stored response.
/// (Returns the run's future itself: an `async fn` here would copy it once more.)
pub(super) fn run<'a, J>(
    idempotency: &'a IdempotencyHandle,
    key: &'a str,
    options: IdempotencyOptions,
    f: J,
) -> impl Future<Output = Result<RunOutcome, Error>> + 'a
where
    J: Job<StoredResponse, Error = NotStored>,
{
    idempotency.run_after_miss(key, options, f)
}

/// What [`look`] found at once.
pub(super) type Looked = crate::idempotency::Looked<StoredResponse>;

/// The run of a claimed key: what the handler handed back (its response, stored or not), or
/// the error of its panic.
pub(super) type ClaimRun<H> = RunHere<Result<H, Error>>;

/// The stored response of `key`, or the key claimed for this request (whose fingerprint is
/// `fingerprint`), when either can be had at once; `None` when only [`run`] can tell (the
/// key is in flight, or a shared store answers later).
pub(super) fn look(
    idempotency: &IdempotencyHandle,
    key: &str,
    options: &IdempotencyOptions,
    fingerprint: Fingerprint,
) -> Result<Option<Looked>, Error> {
    idempotency.look(key, options, Some(fingerprint))
}

/// Runs `work` for the key [`look`] claimed: the handler's run, its response stored when
/// `work` comes to one to store, and handed back to the caller either way.
pub(super) fn run_claim<H, W>(
    idempotency: &IdempotencyHandle,
    key: &str,
    claim: Claimed,
    work: W,
) -> Result<ClaimRun<H>, Error>
where
    W: Future<Output = (Result<StoredResponse, NotStored>, H)> + Send + 'static,
    H: Send + 'static,
{
    idempotency.run_claim(key, claim, work)
}

/// The handler's response was handed back but not stored (a 5xx, too large, or its body
/// failed): the key is released.
#[derive(Debug, thiserror::Error)]
#[error("response not stored")]
pub(super) struct NotStored;

/// Why a guarded request got no response of the handler's.
#[derive(Debug, Clone, PartialEq, Eq)]
pub(super) enum Refusal {
    /// The key was used for another request (422).
    Reused,
    /// The key is in flight; `waited` is how long this duplicate waited, if it did, and
    /// `retry_after` when to try again (409).
    InFlight {
        waited: Option<Duration>,
        retry_after: Duration,
    },
    /// The handler panicked (500).
    Panicked,
    /// The store or runtime cannot take it (503).
    Unavailable,
    /// A setting of the layer is out of range (500).
    Misconfigured,
}

/// The answer for an error of a run that did not hand back a handler response.
pub(super) fn refusal(err: &Error, fail_fast: bool) -> Refusal {
    match err {
        Error::FingerprintMismatch { .. } => Refusal::Reused,
        Error::Timeout { after, .. } => Refusal::InFlight {
            waited: (!fail_fast).then_some(*after),
            retry_after: Duration::from_secs(1),
        },
        Error::InFlight { retry_after, .. } => Refusal::InFlight {
            waited: None,
            retry_after: *retry_after,
        },
        Error::Panicked { .. } | Error::Failed { .. } => Refusal::Panicked,
        Error::StoreUnavailable { .. }
        | Error::ShutDown { .. }
        | Error::TooManyKeys { .. }
        | Error::NoTokio
        | Error::Start(_)
        | Error::Discarded { .. }
        | Error::LeaseLost { .. } => {
            tracing::warn!(
                error = %chain(err),
                "idempotency layer answers 503: the idempotency store or runtime cannot take the request"
            );
            Refusal::Unavailable
        }
        Error::InvalidArgument { what, reason, .. } => {
            tracing::error!(
                setting = what,
                reason,
                error = %chain(err),
                "idempotency layer answers 500: a setting is out of range"
            );
            Refusal::Misconfigured
        }
        _ => {
            tracing::error!(
                error = %chain(err),
                "idempotency layer answers 500: the runtime refused the request"
            );
            Refusal::Misconfigured
        }
    }
}

/// `err` and its sources, `: `-separated.
pub(super) fn chain(err: &(dyn std::error::Error + 'static)) -> String {
    let mut text = err.to_string();
    let mut source = err.source();
    while let Some(cause) = source {
        text.push_str(": ");
        text.push_str(&cause.to_string());
        source = cause.source();
    }
    text
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_stored_response_keeps_content_type_and_the_allow_list_only() {
        let mut headers = HeaderMap::new();
        headers.insert(CONTENT_TYPE, HeaderValue::from_static("application/json"));
        headers.append("location", HeaderValue::from_static("/charges/1"));
        headers.append("set-cookie", HeaderValue::from_static("s=1"));
        headers.append("x-a", HeaderValue::from_static("1"));
        headers.append("x-a", HeaderValue::from_static("2"));
        let keep = [
            HeaderName::from_static("location"),
            HeaderName::from_static("x-a"),
        ];
        let stored = StoredResponse::new(StatusCode::CREATED, &headers, &keep, Bytes::from("{}"));
        let (status, head) = stored.head(0);
        assert_eq!(status, StatusCode::CREATED);
        assert_eq!(head[CONTENT_TYPE], "application/json");
        assert_eq!(head["location"], "/charges/1");
        assert_eq!(head.get_all("x-a").iter().count(), 2);
        assert!(head.get("set-cookie").is_none());
    }

    #[test]
    fn the_envelope_round_trips_through_serde() {
        let stored = StoredResponse {
            status: 201,
            headers: Bytes::from("content-type:text/plain\nx-a:1\n"),
            body: Bytes::from("ok"),
        };
        let (_, head) = stored.head(0);
        assert_eq!(head["content-type"], "text/plain");
        assert_eq!(head["x-a"], "1");
        let json = serde_json::to_string(&stored).unwrap();
        assert_eq!(
            serde_json::from_str::<StoredResponse>(&json).unwrap(),
            stored
        );
    }

    #[test]
    fn an_unavailable_store_is_logged_with_its_cause() {
        let lines = std::sync::Arc::new(std::sync::Mutex::new(Vec::<u8>::new()));
        let writer = std::sync::Arc::clone(&lines);
        let subscriber = tracing_subscriber::fmt()
            .with_writer(move || Capture(std::sync::Arc::clone(&writer)))
            .with_ansi(false)
            .finish();
        let refusal = tracing::subscriber::with_default(subscriber, || {
            let down = Error::StoreUnavailable {
                key: "k".to_owned(),
                source: std::sync::Arc::new(std::io::Error::new(
                    std::io::ErrorKind::ConnectionRefused,
                    "connection refused (os error 111)",
                )),
            };
            refusal(&down, false)
        });
        assert_eq!(refusal, Refusal::Unavailable);
        let text = String::from_utf8(lines.lock().unwrap().clone()).unwrap();
        assert!(text.contains("WARN"), "{text}");
        assert!(text.contains("answers 503"), "{text}");
        assert!(text.contains("connection refused (os error 111)"), "{text}");
    }

    struct Capture(std::sync::Arc<std::sync::Mutex<Vec<u8>>>);

    impl std::io::Write for Capture {
        fn write(&mut self, buf: &[u8]) -> std::io::Result<usize> {
            self.0.lock().unwrap().extend_from_slice(buf);
            Ok(buf.len())
        }

        fn flush(&mut self) -> std::io::Result<()> {
            Ok(())
        }
    }

    #[test]
    fn errors_map_to_refusals() {
        let key = "k".to_owned();
        assert_eq!(
            refusal(&Error::FingerprintMismatch { key: key.clone() }, false),
            Refusal::Reused
        );
        let timeout = Error::Timeout {
            key: key.clone(),
            after: Duration::from_millis(50),
        };
        assert_eq!(
            refusal(&timeout, false),
            Refusal::InFlight {
                waited: Some(Duration::from_millis(50)),
                retry_after: Duration::from_secs(1),
            }
        );
        let in_flight = Error::InFlight {
            key: key.clone(),
            retry_after: Duration::from_millis(300),
        };
        assert_eq!(
            refusal(&in_flight, true),
            Refusal::InFlight {
                waited: None,
                retry_after: Duration::from_millis(300),
            }
        );
        assert_eq!(
            refusal(&Error::ShutDown { key: key.clone() }, false),
            Refusal::Unavailable
        );
        assert_eq!(
            refusal(
                &Error::InvalidArgument {
                    key,
                    what: "scope",
                    reason: "is longer than 1024 bytes"
                },
                false
            ),
            Refusal::Misconfigured
        );
    }
}
