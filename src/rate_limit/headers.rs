//! Rate-limit response headers: the IETF draft triple, the structured `RateLimit` and
//! `RateLimit-Policy` fields, the legacy `X-RateLimit-*` triple, and `Retry-After`.

use std::fmt;
use std::str::FromStr;
use std::time::Duration;

use http::header::RETRY_AFTER;
use http::{HeaderMap, HeaderName, HeaderValue};
use sfv::FieldType as _;

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

/// The largest number of seconds any header carries: [`MAX_TIMER`](crate::clock::MAX_TIMER) in whole
/// seconds (about 2.2 years). A longer reset or retry-after (a token bucket that refills very
/// slowly) is written as this, so no header ever carries an absurd value.
pub const MAX_HEADER_SECS: u64 = crate::clock::MAX_TIMER.as_secs();

const POLICY_NAME_MAX_LEN: usize = 64;
const DEFAULT_POLICY_NAME: &sfv::StringRef = sfv::StringRef::constant("default");
const KEY_REMAINING: &sfv::KeyRef = sfv::KeyRef::constant("r");
const KEY_RESET: &sfv::KeyRef = sfv::KeyRef::constant("t");
const KEY_QUOTA: &sfv::KeyRef = sfv::KeyRef::constant("q");
const KEY_WINDOW: &sfv::KeyRef = sfv::KeyRef::constant("w");

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
#[derive(Clone, PartialEq, Eq, Hash)]
pub struct PolicyName(sfv::String);

impl PolicyName {
    /// Validates `name`.
    ///
    /// # Errors
    ///
    /// [`RateLimitError::InvalidPolicyName`] for an empty or too long name, or one with a
    /// character outside printable ASCII.
    pub fn new(name: &str) -> Result<Self, RateLimitError> {
        match sfv::StringRef::from_str(name) {
            Ok(valid) if !name.is_empty() && name.len() <= POLICY_NAME_MAX_LEN => {
                Ok(Self(valid.to_owned()))
            }
            _ => Err(RateLimitError::InvalidPolicyName {
                name: name.to_owned(),
            }),
        }
    }

    /// The name.
    #[must_use]
    pub fn as_str(&self) -> &str {
        self.0.as_str()
    }

    /// One structured-field list member: this name as an sf-string, with `params`.
    fn member<const N: usize>(&self, params: [(&sfv::KeyRef, u64); N]) -> sfv::List {
        let params = params
            .into_iter()
            .map(|(key, value)| (key.to_owned(), sf_integer(value).into()))
            .collect();
        vec![sfv::Item::with_params(self.0.clone(), params).into()]
    }
}

// Written by hand to print `PolicyName("api")`, as the derive did before the name became an
// `sfv::String`.
impl fmt::Debug for PolicyName {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_tuple("PolicyName").field(&self.as_str()).finish()
    }
}

impl Default for PolicyName {
    fn default() -> Self {
        Self(DEFAULT_POLICY_NAME.to_owned())
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
        f.write_str(self.as_str())
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
    /// name. A denial always gets `Retry-After` in whole seconds, at least 1. Every delay is
    /// capped at [`MAX_HEADER_SECS`], and the legacy reset at that many seconds after `now_ms`.
    pub fn write(&self, decision: &Decision, now_ms: u64, headers: &mut HeaderMap) {
        let reset_secs = secs_up(decision.reset_at_ms.saturating_sub(now_ms));
        if self.draft {
            headers.insert(RATELIMIT_LIMIT, HeaderValue::from(decision.limit));
            headers.insert(RATELIMIT_REMAINING, HeaderValue::from(decision.remaining));
            headers.insert(RATELIMIT_RESET, HeaderValue::from(reset_secs));
        }
        if self.structured {
            let remaining = decision.remaining;
            let rate_limit = self
                .policy
                .member([(KEY_REMAINING, remaining), (KEY_RESET, reset_secs)]);
            insert_list(headers, RATELIMIT, &rate_limit);
            let q = decision.limit;
            let policy = match self.window_secs {
                Some(w) => self.policy.member([(KEY_QUOTA, q), (KEY_WINDOW, w)]),
                None => self.policy.member([(KEY_QUOTA, q)]),
            };
            insert_list(headers, RATELIMIT_POLICY, &policy);
        }
        if self.legacy {
            headers.insert(X_RATELIMIT_LIMIT, HeaderValue::from(decision.limit));
            headers.insert(X_RATELIMIT_REMAINING, HeaderValue::from(decision.remaining));
            headers.insert(
                X_RATELIMIT_RESET,
                HeaderValue::from(
                    decision
                        .reset_at_ms
                        .div_ceil(1_000)
                        .min(now_ms.div_ceil(1_000).saturating_add(MAX_HEADER_SECS)),
                ),
            );
        }
        if !decision.allowed {
            headers.insert(RETRY_AFTER, HeaderValue::from(retry_after_secs(decision)));
        }
    }
}

/// `Retry-After` for a denial: whole seconds, rounded up, at least 1 and at most
/// [`MAX_HEADER_SECS`].
#[must_use]
pub fn retry_after_secs(decision: &Decision) -> u64 {
    secs_up(decision.retry_after_ms).max(1)
}

/// Milliseconds as whole seconds, rounded up, capped at [`MAX_HEADER_SECS`].
fn secs_up(ms: u64) -> u64 {
    ms.div_ceil(1_000).min(MAX_HEADER_SECS)
}

/// `value` as a structured-field integer, clamped to the largest one (RFC 9651: 15 digits).
fn sf_integer(value: u64) -> sfv::Integer {
    sfv::Integer::try_from(value).unwrap_or(sfv::Integer::MAX)
}

fn insert_list(headers: &mut HeaderMap, name: HeaderName, list: &sfv::List) {
    // A non-empty list of a printable-ASCII string and integers serializes to a valid header
    // value, so both steps always succeed.
    if let Some(Ok(value)) = list.serialize().map(HeaderValue::try_from) {
        headers.insert(name, value);
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn structured(name: &str, remaining: u64) -> HeaderMap {
        let d = Decision {
            allowed: true,
            limit: 100,
            remaining,
            reset_at_ms: 30_000,
            retry_after_ms: 0,
        };
        HeaderOptions::none()
            .with_structured(true)
            .with_policy(PolicyName::new(name).unwrap())
            .with_window(Duration::from_secs(60))
            .headers(&d, 0)
    }

    #[test]
    fn quoting_escapes_quotes_and_backslashes() {
        let h = structured(r#"a"b\c"#, 50);
        assert_eq!(h[RATELIMIT], r#""a\"b\\c";r=50;t=30"#);
        assert_eq!(h[RATELIMIT_POLICY], r#""a\"b\\c";q=100;w=60"#);
    }

    #[test]
    fn structured_fields_parse_back_to_the_same_list() {
        let name = r#" ~"\x"#;
        let h = structured(name, u64::MAX);
        for (field, expected) in [
            (RATELIMIT, [("r", 999_999_999_999_999), ("t", 30)]),
            (RATELIMIT_POLICY, [("q", 100), ("w", 60)]),
        ] {
            let list: sfv::List = sfv::Parser::new(h[field].as_bytes())
                .parse()
                .expect("valid structured field");
            let [sfv::ListEntry::Item(item)] = list.as_slice() else {
                panic!("one item expected: {list:?}");
            };
            assert_eq!(
                item.bare_item.as_string().map(sfv::StringRef::as_str),
                Some(name)
            );
            let params: Vec<_> = item
                .params
                .iter()
                .map(|(k, v)| (k.as_str(), v.as_integer().map(i64::from)))
                .collect();
            let expected: Vec<_> = expected.iter().map(|&(k, v)| (k, Some(v))).collect();
            assert_eq!(params, expected);
        }
    }

    #[test]
    fn no_header_carries_an_absurd_delay() {
        let d = Decision {
            allowed: false,
            limit: 1,
            remaining: 0,
            reset_at_ms: u64::MAX,
            retry_after_ms: u64::MAX,
        };
        assert_eq!(retry_after_secs(&d), MAX_HEADER_SECS);
        let h = HeaderOptions::new()
            .with_structured(true)
            .with_legacy(true)
            .headers(&d, 1_000);
        let secs = |name: &str| h[name].to_str().unwrap().parse::<u64>().unwrap();
        assert_eq!(secs("retry-after"), MAX_HEADER_SECS);
        assert_eq!(secs("ratelimit-reset"), MAX_HEADER_SECS);
        assert_eq!(secs("x-ratelimit-reset"), 1 + MAX_HEADER_SECS);
        assert_eq!(
            h[RATELIMIT],
            format!(r#""default";r=0;t={MAX_HEADER_SECS}"#).as_str()
        );
    }

    #[test]
    fn policy_names_are_validated() {
        assert!(PolicyName::new("").is_err());
        assert!(PolicyName::new("é").is_err());
        assert!(PolicyName::new("\x1f").is_err());
        assert!(PolicyName::new("\x7f").is_err());
        assert!(PolicyName::new("a\tb").is_err());
        assert!(PolicyName::new(&"x".repeat(65)).is_err());
        assert!(PolicyName::new(&"x".repeat(64)).is_ok());
        assert!(PolicyName::new(" ~").is_ok());
        assert!(matches!(
            PolicyName::new("bad\r\nname"),
            Err(RateLimitError::InvalidPolicyName { name }) if name == "bad\r\nname"
        ));
    }

    #[test]
    fn policy_name_accessors() {
        let name = PolicyName::new(r#"a"b"#).unwrap();
        assert_eq!(name.as_str(), r#"a"b"#);
        assert_eq!(name.to_string(), r#"a"b"#);
        assert_eq!(format!("{name:?}"), r#"PolicyName("a\"b")"#);
        assert_eq!(PolicyName::default().as_str(), "default");
        assert_eq!("api".parse::<PolicyName>().unwrap().as_str(), "api");
    }
}
