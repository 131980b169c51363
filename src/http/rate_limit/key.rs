//! [`RateLimitKey`]: which bucket a request is counted in.

use std::fmt;
use std::net::{IpAddr, SocketAddr};
use std::sync::Arc;

use http::header::FORWARDED;
use http::request::Parts;
use http::{Extensions, HeaderMap, HeaderName, Request};

use crate::rate_limit::ClientIp;

/// The key of requests the extractor finds no key for: they share one bucket, so leaving
/// the key out never escapes the limit.
pub(super) const UNKNOWN: &str = "unknown";

type KeyFn = dyn Fn(&Parts) -> Option<String> + Send + Sync;

#[derive(Clone)]
enum Kind {
    ClientIp(ClientIp),
    Header(HeaderName),
    Custom(Arc<KeyFn>),
}

/// How [`RateLimitLayer`](super::RateLimitLayer) picks the key a request is counted under.
///
/// Requests for which no key can be found (no peer address, header missing, the function
/// returned `None`) share one bucket, named `unknown`: leaving the key out never escapes the
/// limit.
///
/// # Examples
///
/// ```
/// use http::Request;
/// use throttlebeam::http::RateLimitKey;
/// use throttlebeam::rate_limit::ClientIp;
///
/// // Behind a load balancer in 10.0.0.0/8 that sets `Forwarded` or `X-Forwarded-For`.
/// let by_ip = RateLimitKey::client_ip(ClientIp::new().with_trusted_proxies(["10.0.0.0/8"])?);
/// let mut req = Request::get("/").header("forwarded", "for=203.0.113.7").body(())?;
/// req.extensions_mut().insert("10.0.0.5:41000".parse::<std::net::SocketAddr>()?);
/// assert_eq!(by_ip.key(&req.into_parts().0), "203.0.113.7");
///
/// let by_api_key = RateLimitKey::header(http::HeaderName::from_static("x-api-key"));
/// let req = Request::get("/").header("x-api-key", "k-42").body(())?;
/// assert_eq!(by_api_key.key(&req.into_parts().0), "k-42");
/// # Ok::<(), Box<dyn std::error::Error>>(())
/// ```
#[derive(Clone)]
pub struct RateLimitKey(Kind);

impl fmt::Debug for RateLimitKey {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match &self.0 {
            Kind::ClientIp(ip) => f.debug_tuple("ClientIp").field(ip).finish(),
            Kind::Header(name) => f.debug_tuple("Header").field(name).finish(),
            Kind::Custom(_) => f.write_str("Custom(..)"),
        }
    }
}

impl Default for RateLimitKey {
    fn default() -> Self {
        Self::client_ip(ClientIp::new())
    }
}

impl RateLimitKey {
    /// The client's address, as [`ClientIp`] derives it from the socket peer and, when the
    /// peer is a trusted proxy, the forwarded chain: the RFC 7239 `Forwarded` header's `for=`
    /// entries, or `X-Forwarded-For` when there is no `Forwarded` header.
    ///
    /// The peer is read from the request's `SocketAddr` extension (set it in your hyper
    /// accept loop), or, with the `axum` feature, from axum's `ConnectInfo<SocketAddr>`
    /// (serve with `into_make_service_with_connect_info::<SocketAddr>()`).
    #[must_use]
    pub fn client_ip(client_ip: ClientIp) -> Self {
        Self(Kind::ClientIp(client_ip))
    }

    /// The value of header `name` (a value that is not text counts as missing).
    #[must_use]
    pub fn header(name: HeaderName) -> Self {
        Self(Kind::Header(name))
    }

    /// Whatever `f` returns for the request (an authenticated user id from an extension,
    /// say).
    #[must_use]
    pub fn from_fn(f: impl Fn(&Parts) -> Option<String> + Send + Sync + 'static) -> Self {
        Self(Kind::Custom(Arc::new(f)))
    }

    /// The key of the request whose head is `parts`.
    #[must_use]
    pub fn key(&self, parts: &Parts) -> String {
        let found = match &self.0 {
            Kind::ClientIp(client_ip) => client_key(client_ip, &parts.headers, &parts.extensions),
            Kind::Header(name) => header_key(&parts.headers, name),
            Kind::Custom(f) => f(parts),
        };
        found.unwrap_or_else(|| UNKNOWN.to_owned())
    }

    /// The key of `req`, and `req`; splits the request only for a function key.
    pub(super) fn key_of<B>(&self, req: Request<B>) -> (String, Request<B>) {
        let (found, req) = match &self.0 {
            Kind::ClientIp(client_ip) => {
                (client_key(client_ip, req.headers(), req.extensions()), req)
            }
            Kind::Header(name) => (header_key(req.headers(), name), req),
            Kind::Custom(f) => {
                let (parts, body) = req.into_parts();
                (f(&parts), Request::from_parts(parts, body))
            }
        };
        (found.unwrap_or_else(|| UNKNOWN.to_owned()), req)
    }
}

fn client_key(
    client_ip: &ClientIp,
    headers: &HeaderMap,
    extensions: &Extensions,
) -> Option<String> {
    let peer = peer(extensions)?;
    let forwarded: Vec<String> = headers
        .get_all(FORWARDED)
        .iter()
        .flat_map(|v| v.to_str().map(forwarded_for).unwrap_or_default())
        .collect();
    Some(if forwarded.is_empty() {
        client_ip.key_from_headers(peer, headers)
    } else {
        client_ip.key(peer, forwarded)
    })
}

fn header_key(headers: &HeaderMap, name: &HeaderName) -> Option<String> {
    headers
        .get(name)
        .and_then(|v| v.to_str().ok())
        .map(str::to_owned)
}

fn peer(extensions: &Extensions) -> Option<IpAddr> {
    if let Some(addr) = extensions.get::<SocketAddr>() {
        return Some(addr.ip());
    }
    #[cfg(feature = "axum")]
    if let Some(info) = extensions.get::<axum::extract::ConnectInfo<SocketAddr>>() {
        return Some(info.0.ip());
    }
    None
}

/// The `for=` nodes of one `Forwarded` value (RFC 7239), nearest last, as addresses
/// [`ClientIp`] reads; obfuscated and `unknown` nodes are kept as `unknown` (and dropped
/// there, as junk `X-Forwarded-For` entries are).
fn forwarded_for(value: &str) -> Vec<String> {
    value
        .split(',')
        .filter_map(|element| {
            element.split(';').find_map(|pair| {
                let (name, node) = pair.split_once('=')?;
                name.trim()
                    .eq_ignore_ascii_case("for")
                    .then(|| node_addr(node))
            })
        })
        .collect()
}

/// One node: `192.0.2.43`, `"192.0.2.43:47011"`, `"[2001:db8:cafe::17]:4711"`.
fn node_addr(node: &str) -> String {
    let node = node.trim().trim_matches('"');
    let host = match node.strip_prefix('[') {
        Some(rest) => rest.split(']').next().unwrap_or(""),
        None => node
            .split(':')
            .next()
            .filter(|_| node.matches(':').count() <= 1)
            .unwrap_or(node),
    };
    host.parse::<IpAddr>()
        .map_or_else(|_| UNKNOWN.to_owned(), |ip| ip.to_string())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn forwarded_nodes_parse_per_rfc_7239() {
        assert_eq!(forwarded_for("for=192.0.2.43"), ["192.0.2.43"]);
        assert_eq!(
            forwarded_for(
                r#"for="[2001:db8:cafe::17]:4711";proto=https, For=198.51.100.17;by=203.0.113.60"#
            ),
            ["2001:db8:cafe::17", "198.51.100.17"]
        );
        assert_eq!(forwarded_for(r#"for="192.0.2.43:47011""#), ["192.0.2.43"]);
        assert_eq!(
            forwarded_for("for=unknown, for=_hidden"),
            ["unknown", "unknown"]
        );
        assert_eq!(forwarded_for("proto=http;by=1.2.3.4"), Vec::<String>::new());
        assert_eq!(forwarded_for(r#"for="[2001:db8::1]""#), ["2001:db8::1"]);
    }
}
