//! Rate-limit keys: the client IP behind proxies, and HMAC-hashed identifiers.

use std::fmt;
use std::net::{IpAddr, Ipv6Addr};

use hmac::{Hmac, Mac};
use http::{HeaderMap, HeaderName, HeaderValue};
use ipnet::{IpNet, Ipv6Net};
use sha2::Sha256;

use super::RateLimitError;

/// Which proxies may speak for the client through the [`ProxyHeader`].
#[derive(Debug, Clone, PartialEq, Eq, Default)]
pub enum TrustProxy {
    /// Ignore forwarding headers: the socket peer is the client.
    #[default]
    None,
    /// Trust this many hops, counting the socket peer as the first.
    Hops(usize),
    /// Trust proxies whose address is in one of these networks.
    Cidrs(Vec<IpNet>),
}

/// The one header a trusted proxy writes the client's address in. Every other forwarding
/// header is ignored, so a client cannot pick the one that suits it.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, Default)]
#[non_exhaustive]
pub enum ProxyHeader {
    /// `X-Forwarded-For: client, proxy1, proxy2`: each proxy appends the address it received
    /// the request from (nginx's `$proxy_add_x_forwarded_for`, most load balancers). The
    /// default.
    #[default]
    XForwardedFor,
    /// RFC 7239 `Forwarded: for=client, for=proxy1`: each proxy appends an element; its
    /// `for=` node is read. An obfuscated (`for=_hidden`) or `for=unknown` node written by a
    /// trusted proxy stands for a client that cannot be told apart: such requests are keyed
    /// by that proxy's address.
    Forwarded,
    /// `X-Real-IP: client`: one address, set (not appended) by the nearest proxy (nginx's
    /// `proxy_set_header X-Real-IP $remote_addr`). Read only when the socket peer is trusted;
    /// a request with several such headers is keyed by the peer.
    XRealIp,
}

impl ProxyHeader {
    /// The header's name.
    #[must_use]
    pub fn name(self) -> HeaderName {
        match self {
            Self::XForwardedFor => X_FORWARDED_FOR,
            Self::Forwarded => http::header::FORWARDED,
            Self::XRealIp => X_REAL_IP,
        }
    }
}

const X_FORWARDED_FOR: HeaderName = HeaderName::from_static("x-forwarded-for");
const X_REAL_IP: HeaderName = HeaderName::from_static("x-real-ip");

/// Derives a rate-limit key for the client of a request: the socket peer, or, when the peer
/// is a trusted proxy, the address the trusted proxy chain wrote in the one
/// [`ProxyHeader`] the operator named. This is the only derivation of the crate: the
/// HTTP layer's [`RateLimitKey::client_ip`](crate::http::RateLimitKey::client_ip) uses it
/// too.
///
/// | configuration | the client is |
/// |---|---|
/// | [`ClientIp::new`] (no trusted proxy) | the socket peer; every forwarding header is ignored |
/// | [`with_trusted_proxies`](Self::with_trusted_proxies) (CIDR blocks or addresses) | the peer if it is not trusted; else, walking the named header's chain from the right, the first address that is not a trusted proxy |
/// | [`with_trusted_hops`](Self::with_trusted_hops)`(n)` | the address `n` places left of the peer in the chain (the leftmost, if the chain is shorter) |
///
/// The chain is read from the [`ProxyHeader`] set with
/// [`with_proxy_header`](Self::with_proxy_header) (`X-Forwarded-For` unless named), and only
/// from it: behind a proxy that writes `Forwarded`, a client-sent `X-Forwarded-For` is
/// ignored, and the other way round. Several header lines read as one list, in order.
///
/// Addresses are normalised so one client gets one key: IPv4-mapped IPv6 addresses become
/// IPv4, and IPv6 addresses are aggregated to their network (a /64 by default, the block a
/// single subscriber usually holds). Entries that are not addresses (`unknown`, junk, an
/// `X-Forwarded-For` token with a bad port) are dropped. `Forwarded` elements are parsed
/// with the [`forwarded-header-value`](https://docs.rs/forwarded-header-value) crate.
///
/// # Examples
///
/// ```
/// use std::net::IpAddr;
/// use throttlebeam::rate_limit::{ClientIp, ProxyHeader};
///
/// let peer: IpAddr = "10.0.0.2".parse().unwrap();
/// // Untrusted by default: the forwarded header is ignored.
/// assert_eq!(ClientIp::new().key(peer, ["203.0.113.7"]), "10.0.0.2");
/// // Trusting the load balancer in front of us, which appends X-Forwarded-For:
/// let ip = ClientIp::new()
///     .with_proxy_header(ProxyHeader::XForwardedFor)
///     .with_trusted_proxies(["10.0.0.0/8"])?;
/// assert_eq!(ip.key(peer, ["203.0.113.7, 10.0.0.9"]), "203.0.113.7");
/// // A proxy that writes `Forwarded`: only that header is read.
/// let ip = ClientIp::new()
///     .with_proxy_header(ProxyHeader::Forwarded)
///     .with_trusted_proxies(["10.0.0.0/8"])?;
/// let mut headers = http::HeaderMap::new();
/// headers.insert("x-forwarded-for", "198.51.100.99".parse()?);
/// headers.insert("forwarded", "for=203.0.113.7;proto=https".parse()?);
/// assert_eq!(ip.key_from_headers(peer, &headers), "203.0.113.7");
/// // IPv6 clients are keyed by their /64.
/// assert_eq!(ClientIp::new().key("2001:db8:1:2:3:4:5:6".parse().unwrap(), None::<&str>), "2001:db8:1:2::/64");
/// # Ok::<(), Box<dyn std::error::Error>>(())
/// ```
#[derive(Debug, Clone, PartialEq, Eq)]
#[must_use]
pub struct ClientIp {
    trust: TrustProxy,
    header: ProxyHeader,
    ipv6_prefix: u8,
}

impl Default for ClientIp {
    fn default() -> Self {
        Self::new()
    }
}

impl ClientIp {
    /// Trusts no proxy (the socket peer is the client); aggregates IPv6 to /64.
    pub fn new() -> Self {
        Self {
            trust: TrustProxy::None,
            header: ProxyHeader::XForwardedFor,
            ipv6_prefix: 64,
        }
    }

    /// Reads the client's address from `header`, the one the trusted proxies write
    /// (default `X-Forwarded-For`); every other forwarding header is ignored.
    pub fn with_proxy_header(self, header: ProxyHeader) -> Self {
        Self { header, ..self }
    }

    /// Uses `trust` to decide which forwarded addresses to believe.
    pub fn with_trust(self, trust: TrustProxy) -> Self {
        Self { trust, ..self }
    }

    /// Trusts `hops` proxies, the socket peer being the first: the client is the address
    /// `hops` places left of the peer in the chain (or the leftmost one, if shorter).
    pub fn with_trusted_hops(self, hops: usize) -> Self {
        self.with_trust(TrustProxy::Hops(hops))
    }

    /// Trusts proxies in these networks (`"10.0.0.0/8"`) or at these addresses
    /// (`"192.0.2.1"`): the client is the rightmost untrusted address in the chain.
    ///
    /// # Errors
    ///
    /// [`RateLimitError::InvalidTrustedProxy`] for an entry that is neither.
    pub fn with_trusted_proxies<I, T>(self, entries: I) -> Result<Self, RateLimitError>
    where
        I: IntoIterator<Item = T>,
        T: AsRef<str>,
    {
        let nets = entries
            .into_iter()
            .map(|entry| parse_net(entry.as_ref()))
            .collect::<Result<Vec<_>, _>>()?;
        Ok(self.with_trust(TrustProxy::Cidrs(nets)))
    }

    /// Aggregates IPv6 clients to networks of `prefix` bits (128 keeps whole addresses).
    ///
    /// # Errors
    ///
    /// [`RateLimitError::InvalidIpv6Prefix`] when `prefix` exceeds 128.
    pub fn with_ipv6_prefix(self, prefix: u8) -> Result<Self, RateLimitError> {
        if prefix > 128 {
            return Err(RateLimitError::InvalidIpv6Prefix(prefix));
        }
        Ok(Self {
            ipv6_prefix: prefix,
            ..self
        })
    }

    /// The header the trusted proxies write.
    #[must_use]
    pub fn proxy_header(&self) -> ProxyHeader {
        self.header
    }

    /// The client's address: the peer, or a trusted chain's forwarded address, with
    /// IPv4-mapped IPv6 collapsed to IPv4 (not yet aggregated).
    ///
    /// `forwarded` holds the values of the [`ProxyHeader`] in the order they were received.
    pub fn client_addr<I, T>(&self, peer: IpAddr, forwarded: I) -> IpAddr
    where
        I: IntoIterator<Item = T>,
        T: AsRef<str>,
    {
        if self.trust == TrustProxy::None {
            return canonical(peer);
        }
        let values: Vec<T> = forwarded.into_iter().collect();
        self.resolve(peer, values.iter().map(|v| v.as_ref().as_bytes()))
    }

    /// [`ClientIp::client_addr`] with the values of the [`ProxyHeader`] in `headers`.
    pub fn client_addr_from_headers(&self, peer: IpAddr, headers: &HeaderMap) -> IpAddr {
        if self.trust == TrustProxy::None {
            return canonical(peer);
        }
        self.resolve(
            peer,
            headers
                .get_all(self.header.name())
                .iter()
                .map(HeaderValue::as_bytes),
        )
    }

    /// The client's key: [`ClientIp::client_addr`], with IPv6 aggregated to its network
    /// (`"2001:db8:1:2::/64"`); IPv4 as the plain address.
    pub fn key<I, T>(&self, peer: IpAddr, forwarded: I) -> String
    where
        I: IntoIterator<Item = T>,
        T: AsRef<str>,
    {
        self.key_of(self.client_addr(peer, forwarded))
    }

    /// [`ClientIp::key`] with the values of the [`ProxyHeader`] in `headers` (other
    /// forwarding headers are ignored).
    pub fn key_from_headers(&self, peer: IpAddr, headers: &HeaderMap) -> String {
        self.key_of(self.client_addr_from_headers(peer, headers))
    }

    /// The key of a client whose address is `addr` (already derived).
    pub(crate) fn key_of(&self, addr: IpAddr) -> String {
        match addr {
            IpAddr::V4(v4) => v4.to_string(),
            IpAddr::V6(v6) => aggregate(v6, self.ipv6_prefix),
        }
    }

    /// The client behind `peer`, given the header's `values` in the order received.
    fn resolve<'a>(
        &self,
        peer: IpAddr,
        values: impl DoubleEndedIterator<Item = &'a [u8]>,
    ) -> IpAddr {
        let peer = canonical(peer);
        match self.header {
            ProxyHeader::XRealIp => self.real_ip(peer, values),
            ProxyHeader::XForwardedFor => self.walk(peer, nodes(values, xff_node)),
            ProxyHeader::Forwarded => self.walk(peer, nodes(values, forwarded_node)),
        }
    }

    fn trusts(&self, addr: &IpAddr) -> bool {
        match &self.trust {
            TrustProxy::None => false,
            TrustProxy::Hops(hops) => *hops > 0,
            TrustProxy::Cidrs(nets) => nets.iter().any(|net| net.contains(addr)),
        }
    }

    /// `X-Real-IP`: one value, believed when the peer is trusted.
    fn real_ip<'a>(&self, peer: IpAddr, mut values: impl Iterator<Item = &'a [u8]>) -> IpAddr {
        if !self.trusts(&peer) {
            return peer;
        }
        match (values.next(), values.next()) {
            (Some(value), None) => std::str::from_utf8(value)
                .ok()
                .and_then(parse_forwarded)
                .unwrap_or(peer),
            _ => peer,
        }
    }

    /// Walks the chain of `nodes` (nearest first, after the peer) as far as it is trusted.
    fn walk(&self, peer: IpAddr, mut nodes: impl Iterator<Item = Node>) -> IpAddr {
        // The nearest trusted address seen: what a node that names no address falls back to.
        let mut nearest = peer;
        match &self.trust {
            TrustProxy::None => peer,
            TrustProxy::Hops(hops) => {
                for _ in 0..*hops {
                    match nodes.next() {
                        None => break,
                        Some(Node::Addr(addr)) => nearest = addr,
                        // Written by a trusted hop: a client it cannot name.
                        Some(Node::Opaque) => return nearest,
                    }
                }
                nearest
            }
            TrustProxy::Cidrs(nets) => {
                if !nets.iter().any(|net| net.contains(&peer)) {
                    return peer;
                }
                for node in nodes {
                    match node {
                        Node::Addr(addr) if nets.iter().any(|net| net.contains(&addr)) => {
                            nearest = addr;
                        }
                        Node::Addr(addr) => return addr,
                        Node::Opaque => return nearest,
                    }
                }
                // Everything trusted: the leftmost address.
                nearest
            }
        }
    }
}

/// One hop of a forwarded chain.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Node {
    Addr(IpAddr),
    /// A node that is there but names no address (`Forwarded: for=_hidden`, `for=unknown`).
    Opaque,
}

/// The nodes of header `values`, nearest first (the last element of the last value first),
/// with unparseable entries dropped.
fn nodes<'a>(
    values: impl DoubleEndedIterator<Item = &'a [u8]>,
    parse: fn(&str) -> Option<Node>,
) -> impl Iterator<Item = Node> {
    values.rev().flat_map(move |value| {
        value.rsplit(|b| *b == b',').filter_map(move |element| {
            let element = std::str::from_utf8(element).ok()?.trim();
            if element.is_empty() {
                return None;
            }
            parse(element)
        })
    })
}

fn xff_node(element: &str) -> Option<Node> {
    parse_forwarded(element).map(Node::Addr)
}

/// One RFC 7239 `Forwarded` element, by `forwarded-header-value`: its `for=` node.
fn forwarded_node(element: &str) -> Option<Node> {
    use forwarded_header_value::{ForwardedStanza, Identifier};
    let stanza: ForwardedStanza = element.parse().ok()?;
    match stanza.forwarded_for? {
        Identifier::SocketAddr(addr) => Some(Node::Addr(canonical(addr.ip()))),
        Identifier::IpAddr(addr) => Some(Node::Addr(canonical(addr))),
        Identifier::String(_) | Identifier::Unknown => Some(Node::Opaque),
    }
}

fn aggregate(addr: Ipv6Addr, prefix: u8) -> String {
    if prefix == 128 {
        return addr.to_string();
    }
    // The prefix was checked to be at most 128.
    Ipv6Net::new(addr, prefix).map_or_else(|_| addr.to_string(), |net| net.trunc().to_string())
}

/// IPv4-mapped IPv6 (`::ffff:a.b.c.d`) as IPv4; anything else unchanged.
pub(crate) fn canonical(addr: IpAddr) -> IpAddr {
    match addr {
        IpAddr::V6(v6) => v6.to_ipv4_mapped().map_or(addr, IpAddr::V4),
        v4 => v4,
    }
}

/// One `X-Forwarded-For` entry: an address, optionally with a port (`1.2.3.4:80`,
/// `[2001:db8::1]:443`).
fn parse_forwarded(token: &str) -> Option<IpAddr> {
    let token = token.trim();
    token
        .parse::<IpAddr>()
        .or_else(|_| token.parse::<std::net::SocketAddr>().map(|s| s.ip()))
        .ok()
        .map(canonical)
}

fn parse_net(entry: &str) -> Result<IpNet, RateLimitError> {
    let entry = entry.trim();
    entry
        .parse::<IpNet>()
        .or_else(|err| entry.parse::<IpAddr>().map(IpNet::from).map_err(|_| err))
        .map(|net| match net {
            // A mapped network matches the collapsed IPv4 addresses it stands for.
            IpNet::V6(v6) if v6.prefix_len() >= 96 => match v6.addr().to_ipv4_mapped() {
                Some(v4) => ipnet::Ipv4Net::new(v4, v6.prefix_len() - 96).map_or(net, IpNet::V4),
                None => net,
            },
            other => other,
        })
        .map_err(|source| RateLimitError::InvalidTrustedProxy {
            entry: entry.to_owned(),
            source,
        })
}

/// Hashes identifiers with HMAC-SHA-256 so that raw IPs, emails or user ids never reach a
/// store: the same input and secret always give the same 64 lowercase hex characters.
///
/// # Examples
///
/// ```
/// use throttlebeam::rate_limit::KeyHasher;
///
/// let hasher = KeyHasher::new(b"server secret")?;
/// let key = hasher.hash("alice@example.com");
/// assert_eq!(key.len(), 64);
/// assert_eq!(key, hasher.hash("alice@example.com"));
/// # Ok::<(), throttlebeam::rate_limit::RateLimitError>(())
/// ```
#[derive(Clone)]
pub struct KeyHasher {
    mac: Hmac<Sha256>,
}

impl fmt::Debug for KeyHasher {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str("KeyHasher { .. }")
    }
}

impl KeyHasher {
    /// A hasher keyed with `secret`.
    ///
    /// # Errors
    ///
    /// [`RateLimitError::EmptySecret`] for an empty secret.
    pub fn new(secret: impl AsRef<[u8]>) -> Result<Self, RateLimitError> {
        let secret = secret.as_ref();
        if secret.is_empty() {
            return Err(RateLimitError::EmptySecret);
        }
        // HMAC accepts keys of any length; only the empty one is refused above.
        let mac =
            Hmac::<Sha256>::new_from_slice(secret).map_err(|_| RateLimitError::EmptySecret)?;
        Ok(Self { mac })
    }

    /// HMAC-SHA-256 of `raw`, as 64 lowercase hex characters.
    #[must_use]
    pub fn hash(&self, raw: &str) -> String {
        self.hash_bytes(raw.as_bytes())
    }

    /// HMAC-SHA-256 of `raw`, as 64 lowercase hex characters.
    #[must_use]
    pub fn hash_bytes(&self, raw: &[u8]) -> String {
        let mut mac = self.mac.clone();
        mac.update(raw);
        let digest = mac.finalize().into_bytes();
        let mut out = String::with_capacity(64);
        for byte in digest {
            out.push(char::from(HEX[usize::from(byte >> 4)]));
            out.push(char::from(HEX[usize::from(byte & 0x0f)]));
        }
        out
    }
}

const HEX: &[u8; 16] = b"0123456789abcdef";

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn forwarded_tokens_accept_ports_and_drop_junk() {
        assert_eq!(parse_forwarded(" 1.2.3.4:80 "), "1.2.3.4".parse().ok());
        assert_eq!(
            parse_forwarded("[2001:db8::1]:443"),
            "2001:db8::1".parse().ok()
        );
        assert_eq!(parse_forwarded("::ffff:1.2.3.4"), "1.2.3.4".parse().ok());
        assert_eq!(parse_forwarded("unknown"), None);
        assert_eq!(parse_forwarded(""), None);
    }

    #[test]
    fn trusted_entries_may_be_single_addresses() {
        assert_eq!(
            parse_net("192.0.2.1").unwrap(),
            "192.0.2.1/32".parse().unwrap()
        );
        assert_eq!(
            parse_net("::ffff:10.0.0.0/104").unwrap(),
            "10.0.0.0/8".parse().unwrap()
        );
        assert!(parse_net("nope").is_err());
    }
}
