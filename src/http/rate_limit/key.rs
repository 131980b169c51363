//! [`RateLimitKey`]: which bucket a request is counted in.

use std::fmt;
use std::net::{IpAddr, Ipv4Addr, SocketAddr};
use std::sync::Arc;

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
/// Requests keyed by a header or a function for which no key is found (header missing, the
/// function returned `None`) share one bucket, named `unknown`: leaving the key out never
/// escapes the limit. A request keyed by client IP that has no peer address (the server was
/// not told to record it) is refused with 500 by default: see
/// [`RateLimitLayer::with_shared_bucket_without_peer`](super::RateLimitLayer::with_shared_bucket_without_peer).
///
/// # Examples
///
/// ```
/// use http::Request;
/// use throttlebeam::http::RateLimitKey;
/// use throttlebeam::rate_limit::{ClientIp, ProxyHeader};
///
/// // Behind a load balancer in 10.0.0.0/8 that appends `X-Forwarded-For`.
/// let by_ip = RateLimitKey::client_ip(
///     ClientIp::new()
///         .with_proxy_header(ProxyHeader::XForwardedFor)
///         .with_trusted_proxies(["10.0.0.0/8"])?,
/// );
/// let mut req = Request::get("/")
///     .header("x-forwarded-for", "203.0.113.7")
///     .header("forwarded", "for=198.51.100.1") // not the header the proxy writes: ignored
///     .body(())?;
/// req.extensions_mut().insert("10.0.0.5:41000".parse::<std::net::SocketAddr>()?);
/// assert_eq!(by_ip.key(&req.into_parts().0).as_deref(), Some("203.0.113.7"));
///
/// let by_api_key = RateLimitKey::header(http::HeaderName::from_static("x-api-key"));
/// let req = Request::get("/").header("x-api-key", "k-42").body(())?;
/// assert_eq!(by_api_key.key(&req.into_parts().0).as_deref(), Some("k-42"));
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
    /// peer is a trusted proxy, the one forwarding header it names
    /// ([`ClientIp::with_proxy_header`]); other forwarding headers are ignored.
    ///
    /// The peer is read from the request's `SocketAddr` extension (set it in your hyper
    /// accept loop), or, with the `axum` feature, from axum's `ConnectInfo<SocketAddr>`
    /// (serve with `into_make_service_with_connect_info::<SocketAddr>()`). Without either,
    /// the layer answers 500 (see
    /// [`RateLimitLayer::with_shared_bucket_without_peer`](super::RateLimitLayer::with_shared_bucket_without_peer)).
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

    /// The key of the request whose head is `parts`: `None` when it is keyed by client IP and
    /// has no peer address; `"unknown"` when a header or function key finds none.
    #[must_use]
    pub fn key(&self, parts: &Parts) -> Option<String> {
        match &self.0 {
            Kind::ClientIp(client_ip) => {
                client_text(client_ip, &parts.headers, &parts.extensions).map(KeyText::into_string)
            }
            Kind::Header(name) => Some(header_key(&parts.headers, name).unwrap_or_else(unknown)),
            Kind::Custom(f) => Some(f(parts).unwrap_or_else(unknown)),
        }
    }

    /// The key of `req` (`None`: keyed by client IP, no peer address), and `req`; splits the
    /// request only for a function key. An IPv4 client's key is written on the stack: no
    /// allocation per request.
    pub(super) fn key_of<B>(&self, req: Request<B>) -> (Option<KeyText>, Request<B>) {
        match &self.0 {
            Kind::ClientIp(client_ip) => {
                (client_text(client_ip, req.headers(), req.extensions()), req)
            }
            Kind::Header(name) => (
                Some(header_key(req.headers(), name).map_or(KeyText::Unknown, KeyText::Owned)),
                req,
            ),
            Kind::Custom(f) => {
                let (parts, body) = req.into_parts();
                (
                    Some(f(&parts).map_or(KeyText::Unknown, KeyText::Owned)),
                    Request::from_parts(parts, body),
                )
            }
        }
    }
}

fn unknown() -> String {
    UNKNOWN.to_owned()
}

/// A request's key, as [`RateLimitKey::key`] spells it, without allocating for the common
/// cases (an IPv4 client, no key found).
pub(super) enum KeyText {
    /// An IPv4 address in dotted decimal: at most 15 bytes.
    V4 {
        text: [u8; 15],
        len: u8,
    },
    Owned(String),
    Unknown,
}

impl KeyText {
    fn v4(addr: Ipv4Addr) -> Self {
        let mut text = [0; 15];
        let mut len = 0;
        for (i, octet) in addr.octets().into_iter().enumerate() {
            if i > 0 {
                text[len] = b'.';
                len += 1;
            }
            if octet >= 100 {
                text[len] = b'0' + octet / 100;
                len += 1;
            }
            if octet >= 10 {
                text[len] = b'0' + octet / 10 % 10;
                len += 1;
            }
            text[len] = b'0' + octet % 10;
            len += 1;
        }
        // At most 4 x 3 digits and 3 dots.
        Self::V4 {
            text,
            len: len as u8,
        }
    }

    pub(super) fn as_str(&self) -> &str {
        match self {
            // Only ASCII digits and dots are written.
            Self::V4 { text, len } => {
                std::str::from_utf8(&text[..usize::from(*len)]).unwrap_or(UNKNOWN)
            }
            Self::Owned(key) => key,
            Self::Unknown => UNKNOWN,
        }
    }

    pub(super) fn into_string(self) -> String {
        match self {
            Self::Owned(key) => key,
            other => other.as_str().to_owned(),
        }
    }
}

/// The key of the client behind the request's peer: the one derivation of
/// [`ClientIp::client_addr_from_headers`]. `None` without a peer address.
fn client_text(
    client_ip: &ClientIp,
    headers: &HeaderMap,
    extensions: &Extensions,
) -> Option<KeyText> {
    let peer = peer(extensions)?;
    Some(match client_ip.client_addr_from_headers(peer, headers) {
        IpAddr::V4(v4) => KeyText::v4(v4),
        addr @ IpAddr::V6(_) => KeyText::Owned(client_ip.key_of(addr)),
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

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn ipv4_keys_on_the_stack_read_as_the_address_does() {
        for addr in [
            Ipv4Addr::new(0, 0, 0, 0),
            Ipv4Addr::new(255, 255, 255, 255),
            Ipv4Addr::new(10, 0, 9, 100),
            Ipv4Addr::new(1, 20, 199, 7),
            Ipv4Addr::new(203, 0, 113, 42),
        ] {
            assert_eq!(KeyText::v4(addr).as_str(), addr.to_string());
        }
        for i in 0..=255u8 {
            let addr = Ipv4Addr::new(i, 255 - i, i / 3, i.wrapping_mul(7));
            assert_eq!(KeyText::v4(addr).as_str(), addr.to_string());
        }
    }
}
