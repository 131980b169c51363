//! What the idempotency layer reads from a request: the key, the scope and the fingerprint.

use bytes::Bytes;
use http::HeaderMap;
use http::header::{AUTHORIZATION, COOKIE, HeaderName};
use http::request::Parts;
use sha2::{Digest, Sha256};

use crate::idempotency::Fingerprint;

/// `Idempotency-Key` (draft-ietf-httpapi-idempotency-key-header).
pub(super) const IDEMPOTENCY_KEY: HeaderName = HeaderName::from_static("idempotency-key");

/// The longest key accepted, in bytes.
pub(super) const MAX_HEADER_KEY_LEN: usize = 255;

/// The request's idempotency key: `None` without the header; an error (the problem detail)
/// when it is repeated, not text, empty or too long.
pub(super) fn key(headers: &HeaderMap) -> Result<Option<String>, String> {
    let mut values = headers.get_all(IDEMPOTENCY_KEY).iter();
    let Some(value) = values.next() else {
        return Ok(None);
    };
    if values.next().is_some() {
        return Err("more than one Idempotency-Key header".to_owned());
    }
    let text = value
        .to_str()
        .map_err(|_| "the Idempotency-Key header is not visible ASCII".to_owned())?
        .trim();
    let key = if text.starts_with('"') {
        // An RFC 9651 string, as the draft writes the header.
        let item: sfv::Item = sfv::Parser::new(text).parse().map_err(|_| {
            "the Idempotency-Key header is not a valid structured string".to_owned()
        })?;
        match item.bare_item.as_string() {
            Some(s) if item.params.is_empty() => s.as_str().to_owned(),
            _ => {
                return Err(
                    "the Idempotency-Key header is not a valid structured string".to_owned(),
                );
            }
        }
    } else {
        text.to_owned()
    };
    if key.is_empty() {
        return Err("the Idempotency-Key header is empty".to_owned());
    }
    if key.len() > MAX_HEADER_KEY_LEN {
        return Err(format!(
            "idempotency key {:?} is {} bytes, over the {MAX_HEADER_KEY_LEN}-byte limit",
            crate::key::shown(&key),
            key.len()
        ));
    }
    Ok(Some(key))
}

/// The scope of requests without credentials.
pub(super) const ANONYMOUS_SCOPE: &str = "http/anonymous";

/// Whether the request carries credentials (`Authorization` or `Cookie`).
pub(super) fn has_credentials(headers: &HeaderMap) -> bool {
    headers.contains_key(AUTHORIZATION) || headers.contains_key(COOKIE)
}

/// The scope of a request with no configured scope: a digest of its credentials, so one
/// client never replays another's response.
pub(super) fn credentials_scope(headers: &HeaderMap) -> String {
    let mut hasher = Sha256::new();
    let mut any = false;
    for (tag, name) in [(b'a', AUTHORIZATION), (b'c', COOKIE)] {
        for value in headers.get_all(name) {
            any = true;
            hasher.update([tag]);
            hasher.update((value.len() as u64).to_be_bytes());
            hasher.update(value.as_bytes());
        }
    }
    if !any {
        return ANONYMOUS_SCOPE.to_owned();
    }
    let mut scope = String::from("http/credentials/");
    // 128 bits tell clients apart; the scope stays short.
    push_hex(&mut scope, &hasher.finalize()[..16]);
    scope
}

/// The scope of a request whose configured scope function named `tenant`.
pub(super) fn tenant_scope(tenant: &str) -> String {
    let mut scope = String::with_capacity(TENANT_PREFIX.len() + tenant.len());
    scope.push_str(TENANT_PREFIX);
    scope.push_str(tenant);
    scope
}

/// What a tenant's scope starts with.
pub(super) const TENANT_PREFIX: &str = "http/tenant/";

/// SHA-256 over method, path, query and body, each length-prefixed: the request's
/// fingerprint as the runtime keeps it (handed over as a digest, so it is not hashed again).
pub(super) fn fingerprint(parts: &Parts, body: &Bytes) -> Fingerprint {
    let mut hasher = Sha256::new();
    let fields: [&[u8]; 4] = [
        parts.method.as_str().as_bytes(),
        parts.uri.path().as_bytes(),
        parts.uri.query().unwrap_or("").as_bytes(),
        body,
    ];
    for field in fields {
        hasher.update((field.len() as u64).to_be_bytes());
        hasher.update(field);
    }
    hasher.finalize().into()
}

const HEX: &[u8; 16] = b"0123456789abcdef";

fn push_hex(out: &mut String, bytes: &[u8]) {
    for byte in bytes {
        out.push(char::from(HEX[usize::from(byte >> 4)]));
        out.push(char::from(HEX[usize::from(byte & 0x0f)]));
    }
}

#[cfg(test)]
mod tests {
    use http::{HeaderValue, Request};

    use super::*;

    fn headers(values: &[&[u8]]) -> HeaderMap {
        let mut map = HeaderMap::new();
        for v in values {
            map.append(IDEMPOTENCY_KEY, HeaderValue::from_bytes(v).unwrap());
        }
        map
    }

    #[test]
    fn keys_are_bare_or_structured_strings() {
        assert_eq!(key(&headers(&[])), Ok(None));
        assert_eq!(key(&headers(&[b"abc-1"])), Ok(Some("abc-1".to_owned())));
        assert_eq!(key(&headers(&[b" abc "])), Ok(Some("abc".to_owned())));
        assert_eq!(
            key(&headers(&[br#""8e03-\"q\"""#])),
            Ok(Some(r#"8e03-"q""#.to_owned()))
        );
    }

    #[test]
    fn bad_keys_are_refused_with_a_reason() {
        assert_eq!(
            key(&headers(&[b"a", b"b"])).unwrap_err(),
            "more than one Idempotency-Key header"
        );
        assert_eq!(
            key(&headers(&[b""])).unwrap_err(),
            "the Idempotency-Key header is empty"
        );
        assert_eq!(
            key(&headers(&[b"\"\""])).unwrap_err(),
            "the Idempotency-Key header is empty"
        );
        assert!(key(&headers(&[b"\"open"])).is_err());
        assert!(key(&headers(&[b"\"k\";p=1"])).is_err());
        assert!(key(&headers(&["é".as_bytes()])).is_err());
        let long = "k".repeat(256);
        let err = key(&headers(&[long.as_bytes()])).unwrap_err();
        assert!(
            err.ends_with("is 256 bytes, over the 255-byte limit"),
            "{err}"
        );
        let longest = "k".repeat(255);
        assert_eq!(key(&headers(&[longest.as_bytes()])), Ok(Some(longest)));
    }

    #[test]
    fn fingerprints_tell_method_path_query_and_body_apart() {
        let fp = |method: &str, uri: &str, body: &'static str| {
            let (parts, ()) = Request::builder()
                .method(method)
                .uri(uri)
                .body(())
                .unwrap()
                .into_parts();
            fingerprint(&parts, &Bytes::from_static(body.as_bytes()))
        };
        let base = fp("POST", "/pay?x=1", "{}");
        // The digest of SHA-256 over the length-prefixed fields, as the docs describe it.
        let mut hasher = Sha256::new();
        for field in [&b"POST"[..], b"/pay", b"x=1", b"{}"] {
            hasher.update((field.len() as u64).to_be_bytes());
            hasher.update(field);
        }
        assert_eq!(base, <[u8; 32]>::from(hasher.finalize()));
        assert_eq!(base, fp("POST", "/pay?x=1", "{}"));
        for other in [
            fp("PATCH", "/pay?x=1", "{}"),
            fp("POST", "/paid?x=1", "{}"),
            fp("POST", "/pay?x=2", "{}"),
            fp("POST", "/pay", "{}"),
            fp("POST", "/pay?x=1", "{ }"),
            // Length prefixes keep field boundaries apart.
            fp("POST", "/pay?x=1{", "}"),
        ] {
            assert_ne!(base, other);
        }
    }

    #[test]
    fn credential_scopes_differ_per_user_and_are_stable() {
        let with = |name: HeaderName, value: &str| {
            let mut map = HeaderMap::new();
            map.insert(name, HeaderValue::from_str(value).unwrap());
            credentials_scope(&map)
        };
        assert_eq!(credentials_scope(&HeaderMap::new()), "http/anonymous");
        assert!(!has_credentials(&HeaderMap::new()));
        let alice = with(AUTHORIZATION, "Bearer alice");
        assert_eq!(alice, with(AUTHORIZATION, "Bearer alice"));
        assert_ne!(alice, with(AUTHORIZATION, "Bearer bob"));
        assert_ne!(alice, with(COOKIE, "Bearer alice"));
        assert!(alice.starts_with("http/credentials/"));
        assert_eq!(alice.len(), "http/credentials/".len() + 32);
    }
}
