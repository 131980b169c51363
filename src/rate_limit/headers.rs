//! Rate-limit response headers: the IETF draft triple, the structured `RateLimit` and
//! `RateLimit-Policy` fields, the legacy `X-RateLimit-*` triple, and `Retry-After`.

use std::fmt;
use std::str::FromStr;
use std::time::Duration;

use http::header::RETRY_AFTER;
use http::{HeaderMap, HeaderName, HeaderValue};

use super::{Decision, RateLimitError};

/// `RateLimit-Limit` (draft): the quota.
pub const RATELIMIT_LIMIT: HeaderName = HeaderName::from_static("ratelimit-limit");
/// `RateLimit-Remaining` (draft): units left.
pub const RATELIMIT_REMAINING: HeaderName = HeaderName::from_static("ratelimit-remaining");
/// `RateLimit-Reset` (draft): seconds until full, rounded up.
pub const RATELIMIT_RESET: HeaderName = HeaderName::from_static("ratelimit-reset");
/// `RateLimit` (structured): `"name";r=<remaining>;t=<seconds until full>`.
pub const RATELIMIT: HeaderName = HeaderName::from_static("ratelimit");
/// `RateLimit-Policy` (structured): `"name";q=<quota>;w=<window seconds>`.
pub const RATELIMIT_POLICY: HeaderName = HeaderName::from_static("ratelimit-policy");
/// `X-RateLimit-Limit` (legacy).
pub const X_RATELIMIT_LIMIT: HeaderName = HeaderName::from_static("x-ratelimit-limit");
/// `X-RateLimit-Remaining` (legacy).
pub const X_RATELIMIT_REMAINING: HeaderName = HeaderName::from_static("x-ratelimit-remaining");
/// `X-RateLimit-Reset` (legacy): epoch seconds when full, rounded up.
pub const X_RATELIMIT_RESET: HeaderName = HeaderName::from_static("x-ratelimit-reset");

/// The largest integer a structured field may carry (RFC 9651: 15 digits).
const SF_INTEGER_MAX: u64 = 999_999_999_999_999;
const POLICY_NAME_MAX_LEN: usize = 64;

/// A policy name for the structured fields, checked to be writable as an RFC 9651 string:
/// 1 to 64 printable ASCII characters (quotes and backslashes are escaped when written).
///
/// # Examples
///
/// ```
/// use throttlebeam::rate_limit::PolicyName;
///
/// assert!(PolicyName::new("api-v1").is_ok());
/// assert!(PolicyName::new("bad\nname").is_err());
/// ```
#[derive(Debug, Clone, PartialEq, Eq, Hash)]
pub struct PolicyName(Box<str>);

impl PolicyName {
    /// Validates `name`.
    ///
    /// # Errors
    ///
    /// [`RateLimitError::InvalidPolicyName`] for an empty or too long name, or one with a
    /// character outside printable ASCII.
    pub fn new(name: &str) -> Result<Self, RateLimitError> {
        let printable = name.bytes().all(|b| (0x20..=0x7e).contains(&b));
        if name.is_empty() || name.len() > POLICY_NAME_MAX_LEN || !printable {
            return Err(RateLimitError::InvalidPolicyName {
                name: name.to_owned(),
            });
        }
        Ok(Self(name.into()))
    }

    /// The name.
    #[must_use]
    pub fn as_str(&self) -> &str {
        &self.0
    }

    /// The name as an RFC 9651 sf-string: quoted, with `"` and `\` escaped.
    fn quoted(&self) -> String {
        let mut out = String::with_capacity(self.0.len() + 2);
        out.push('"');
        for c in self.0.chars() {
            if matches!(c, '"' | '\\') {
                out.push('\\');
            }
            out.push(c);
        }
        out.push('"');
        out
    }
}

impl Default for PolicyName {
    fn default() -> Self {
        Self("default".into())
    }
}

impl FromStr for PolicyName {
    type Err = RateLimitError;
    fn from_str(s: &str) -> Result<Self, Self::Err> {
        Self::new(s)
    }
}

impl fmt::Display for PolicyName {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(&self.0)
    }
}

/// Which header families to write, and what to call the policy.
///
/// Defaults: the draft triple only, policy `"default"`, no window.
///
/// # Examples
///
/// ```
/// use std::time::Duration;
/// use throttlebeam::rate_limit::{Decision, HeaderOptions, PolicyName};
///
/// let options = HeaderOptions::new()
///     .with_draft(false)
///     .with_structured(true)
///     .with_policy(PolicyName::new("api")?)
///     .with_window(Duration::from_secs(60));
/// let d = Decision { allowed: true, limit: 100, remaining: 50, reset_at_ms: 30_000, retry_after_ms: 0 };
/// let headers = options.headers(&d, 0);
/// assert_eq!(headers["ratelimit"], r#""api";r=50;t=30"#);
/// assert_eq!(headers["ratelimit-policy"], r#""api";q=100;w=60"#);
/// # Ok::<(), throttlebeam::rate_limit::RateLimitError>(())
/// ```
#[derive(Debug, Clone, PartialEq, Eq)]
#[must_use]
pub struct HeaderOptions {
    draft: bool,
    structured: bool,
    legacy: bool,
    policy: PolicyName,
    window_secs: Option<u64>,
}

impl Default for HeaderOptions {
    fn default() -> Self {
        Self::new()
    }
}

impl HeaderOptions {
    /// The draft triple only, policy `"default"`.
    pub fn new() -> Self {
        Self {
            draft: true,
            structured: false,
            legacy: false,
            policy: PolicyName::default(),
            window_secs: None,
        }
    }

    /// Writes no rate-limit headers (a denial still gets `Retry-After`).
    pub fn none() -> Self {
        Self::new().with_draft(false)
    }

    /// Whether to write `RateLimit-Limit`, `-Remaining` and `-Reset`.
    pub fn with_draft(self, on: bool) -> Self {
        Self { draft: on, ..self }
    }

    /// Whether to write the structured `RateLimit` and `RateLimit-Policy` fields.
    pub fn with_structured(self, on: bool) -> Self {
        Self {
            structured: on,
            ..self
        }
    }

    /// Whether to write `X-RateLimit-Limit`, `-Remaining` and `-Reset`.
    pub fn with_legacy(self, on: bool) -> Self {
        Self { legacy: on, ..self }
    }

    /// Names the policy in the structured fields.
    pub fn with_policy(self, policy: PolicyName) -> Self {
        Self { policy, ..self }
    }

    /// The policy window, written as the `w` of `RateLimit-Policy` (whole seconds, rounded
    /// up). Without one, `w` is left out.
    pub fn with_window(self, window: Duration) -> Self {
        Self {
            window_secs: Some(
                window
                    .as_millis()
                    .div_ceil(1_000)
                    .try_into()
                    .unwrap_or(u64::MAX),
            ),
            ..self
        }
    }

    pub(crate) fn has_window(&self) -> bool {
        self.window_secs.is_some()
    }

    /// The headers for `decision` at `now_ms`.
    pub fn headers(&self, decision: &Decision, now_ms: u64) -> HeaderMap {
        let mut headers = HeaderMap::new();
        self.write(decision, now_ms, &mut headers);
        headers
    }

    /// Writes the headers for `decision` at `now_ms` into `headers`, replacing any of the same
    /// name. A denial always gets `Retry-After` in whole seconds, at least 1.
    pub fn write(&self, decision: &Decision, now_ms: u64, headers: &mut HeaderMap) {
        let reset_secs = decision.reset_at_ms.saturating_sub(now_ms).div_ceil(1_000);
        if self.draft {
            headers.insert(RATELIMIT_LIMIT, HeaderValue::from(decision.limit));
            headers.insert(RATELIMIT_REMAINING, HeaderValue::from(decision.remaining));
            headers.insert(RATELIMIT_RESET, HeaderValue::from(reset_secs));
        }
        if self.structured {
            let name = self.policy.quoted();
            let r = decision.remaining.min(SF_INTEGER_MAX);
            let t = reset_secs.min(SF_INTEGER_MAX);
            insert_string(headers, RATELIMIT, format!("{name};r={r};t={t}"));
            let q = decision.limit.min(SF_INTEGER_MAX);
            let policy = match self.window_secs {
                Some(w) => format!("{name};q={q};w={}", w.min(SF_INTEGER_MAX)),
                None => format!("{name};q={q}"),
            };
            insert_string(headers, RATELIMIT_POLICY, policy);
        }
        if self.legacy {
            headers.insert(X_RATELIMIT_LIMIT, HeaderValue::from(decision.limit));
            headers.insert(X_RATELIMIT_REMAINING, HeaderValue::from(decision.remaining));
            headers.insert(
                X_RATELIMIT_RESET,
                HeaderValue::from(decision.reset_at_ms.div_ceil(1_000)),
            );
        }
        if !decision.allowed {
            headers.insert(RETRY_AFTER, HeaderValue::from(retry_after_secs(decision)));
        }
    }
}

/// `Retry-After` for a denial: whole seconds, rounded up, at least 1.
#[must_use]
pub fn retry_after_secs(decision: &Decision) -> u64 {
    decision.retry_after_ms.div_ceil(1_000).max(1)
}

fn insert_string(headers: &mut HeaderMap, name: HeaderName, value: String) {
    // Policy names are printable ASCII and the rest are digits, so this always succeeds.
    if let Ok(value) = HeaderValue::try_from(value) {
        headers.insert(name, value);
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn quoting_escapes_quotes_and_backslashes() {
        let name = PolicyName::new(r#"a"b\c"#).unwrap();
        assert_eq!(name.quoted(), r#""a\"b\\c""#);
    }

    #[test]
    fn policy_names_are_validated() {
        assert!(PolicyName::new("").is_err());
        assert!(PolicyName::new("é").is_err());
        assert!(PolicyName::new(&"x".repeat(65)).is_err());
        assert!(PolicyName::new(&"x".repeat(64)).is_ok());
    }
}
