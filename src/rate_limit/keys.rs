//! Rate-limit keys: the client IP behind proxies, and HMAC-hashed identifiers.

use std::fmt;
use std::net::{IpAddr, Ipv6Addr};

use hmac::{Hmac, Mac};
use http::HeaderMap;
use ipnet::{IpNet, Ipv6Net};
use sha2::Sha256;

use super::RateLimitError;

/// Which proxies may speak for the client through `X-Forwarded-For`.
#[derive(Debug, Clone, PartialEq, Eq, Default)]
pub enum TrustProxy {
    /// Ignore `X-Forwarded-For`: the socket peer is the client.
    #[default]
    None,
    /// Trust this many hops, counting the socket peer as the first.
    Hops(usize),
    /// Trust proxies whose address is in one of these networks.
    Cidrs(Vec<IpNet>),
}

/// Derives a rate-limit key for the client of a request: the socket peer, or the address a
/// trusted proxy chain forwarded.
///
/// Addresses are normalised so one client gets one key: IPv4-mapped IPv6 addresses become
/// IPv4, and IPv6 addresses are aggregated to their network (a /64 by default, the block a
/// single subscriber usually holds). Unparseable `X-Forwarded-For` entries are dropped.
///
/// # Examples
///
/// ```
/// use std::net::IpAddr;
/// use throttlebeam::rate_limit::ClientIp;
///
/// let peer: IpAddr = "10.0.0.2".parse().unwrap();
/// // Untrusted by default: the forwarded header is ignored.
/// assert_eq!(ClientIp::new().key(peer, ["203.0.113.7"]), "10.0.0.2");
/// // Trusting the load balancer in front of us:
/// let ip = ClientIp::new().with_trusted_proxies(["10.0.0.0/8"])?;
/// assert_eq!(ip.key(peer, ["203.0.113.7, 10.0.0.9"]), "203.0.113.7");
/// // IPv6 clients are keyed by their /64.
/// assert_eq!(ClientIp::new().key("2001:db8:1:2:3:4:5:6".parse().unwrap(), None::<&str>), "2001:db8:1:2::/64");
/// # Ok::<(), throttlebeam::rate_limit::RateLimitError>(())
/// ```
#[derive(Debug, Clone, PartialEq, Eq)]
#[must_use]
pub struct ClientIp {
    trust: TrustProxy,
    ipv6_prefix: u8,
}

impl Default for ClientIp {
    fn default() -> Self {
        Self::new()
    }
}

impl ClientIp {
    /// Trusts no proxy; aggregates IPv6 to /64.
    pub fn new() -> Self {
        Self {
            trust: TrustProxy::None,
            ipv6_prefix: 64,
        }
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

    /// The client's address: the peer, or a trusted chain's forwarded address, with IPv4-mapped
    /// IPv6 collapsed to IPv4 (not yet aggregated).
    ///
    /// `forwarded` holds the `X-Forwarded-For` values in the order they were received.
    pub fn client_addr<I, T>(&self, peer: IpAddr, forwarded: I) -> IpAddr
    where
        I: IntoIterator<Item = T>,
        T: AsRef<str>,
    {
        let peer = canonical(peer);
        if self.trust == TrustProxy::None {
            return peer;
        }
        // Nearest first: the peer, then the forwarded entries from right to left.
        let mut chain: Vec<IpAddr> = Vec::new();
        for value in forwarded {
            chain.extend(value.as_ref().split(',').filter_map(parse_forwarded));
        }
        chain.push(peer);
        chain.reverse();
        match &self.trust {
            TrustProxy::None => peer,
            TrustProxy::Hops(hops) => chain[(*hops).min(chain.len() - 1)],
            TrustProxy::Cidrs(nets) => chain
                .iter()
                .copied()
                .find(|addr| !nets.iter().any(|net| net.contains(addr)))
                .unwrap_or(chain[chain.len() - 1]),
        }
    }

    /// The client's key: [`ClientIp::client_addr`], with IPv6 aggregated to its network
    /// (`"2001:db8:1:2::/64"`); IPv4 as the plain address.
    pub fn key<I, T>(&self, peer: IpAddr, forwarded: I) -> String
    where
        I: IntoIterator<Item = T>,
        T: AsRef<str>,
    {
        match self.client_addr(peer, forwarded) {
            IpAddr::V4(v4) => v4.to_string(),
            IpAddr::V6(v6) => aggregate(v6, self.ipv6_prefix),
        }
    }

    /// [`ClientIp::key`] with the `X-Forwarded-For` values of `headers` (values that are
    /// not text are dropped).
    pub fn key_from_headers(&self, peer: IpAddr, headers: &HeaderMap) -> String {
        let forwarded = headers
            .get_all("x-forwarded-for")
            .iter()
            .filter_map(|v| v.to_str().ok());
        self.key(peer, forwarded)
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
fn canonical(addr: IpAddr) -> IpAddr {
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
