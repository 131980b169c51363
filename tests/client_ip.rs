//! Client addresses behind proxies (`ClientIp`): only the header the operator names is read,
//! only from a trusted peer, walked from the right (scenario H11).

use std::net::IpAddr;

use http::{HeaderMap, HeaderName, HeaderValue};
use throttlebeam::rate_limit::{ClientIp, ProxyHeader};

fn ip(s: &str) -> IpAddr {
    s.parse().unwrap()
}

fn headers(pairs: &[(&str, &str)]) -> HeaderMap {
    let mut map = HeaderMap::new();
    for (name, value) in pairs {
        map.append(
            HeaderName::from_bytes(name.as_bytes()).unwrap(),
            HeaderValue::from_str(value).unwrap(),
        );
    }
    map
}

#[test]
fn only_the_named_header_is_read() {
    let behind = |header| {
        ClientIp::new()
            .with_proxy_header(header)
            .with_trusted_proxies(["10.0.0.0/8"])
            .unwrap()
    };
    let all = headers(&[
        ("x-forwarded-for", "198.51.100.1"),
        ("forwarded", "for=198.51.100.2"),
        ("x-real-ip", "198.51.100.3"),
    ]);
    let peer = ip("10.0.0.1");
    assert_eq!(
        behind(ProxyHeader::XForwardedFor).key_from_headers(peer, &all),
        "198.51.100.1"
    );
    assert_eq!(
        behind(ProxyHeader::Forwarded).key_from_headers(peer, &all),
        "198.51.100.2"
    );
    assert_eq!(
        behind(ProxyHeader::XRealIp).key_from_headers(peer, &all),
        "198.51.100.3"
    );
    // A proxy that writes `Forwarded`, and a client that sends `X-Forwarded-For` only.
    let spoof = headers(&[("x-forwarded-for", "198.51.100.1")]);
    assert_eq!(
        behind(ProxyHeader::Forwarded).key_from_headers(peer, &spoof),
        "10.0.0.1"
    );
    // Untrusted peer: nothing forwarded is read, whatever the header.
    for header in [
        ProxyHeader::XForwardedFor,
        ProxyHeader::Forwarded,
        ProxyHeader::XRealIp,
    ] {
        assert_eq!(
            behind(header).key_from_headers(ip("203.0.113.9"), &all),
            "203.0.113.9"
        );
        assert_eq!(
            ClientIp::new()
                .with_proxy_header(header)
                .key_from_headers(peer, &all),
            "10.0.0.1"
        );
    }
}

#[test]
fn forwarded_elements_are_walked_from_the_right() {
    let ip_of = |value: &str| {
        ClientIp::new()
            .with_proxy_header(ProxyHeader::Forwarded)
            .with_trusted_proxies(["10.0.0.0/8"])
            .unwrap()
            .client_addr(ip("10.0.0.1"), [value])
    };
    assert_eq!(ip_of("for=192.0.2.43"), ip("192.0.2.43"));
    assert_eq!(
        ip_of(r#"for="[2001:db8:cafe::17]:4711";proto=https, For=10.0.0.7;by=10.0.0.1"#),
        ip("2001:db8:cafe::17")
    );
    assert_eq!(ip_of(r#"for="192.0.2.43:47011""#), ip("192.0.2.43"));
    // A client's forged elements sit left of what the proxy wrote.
    assert_eq!(
        ip_of("for=6.6.6.6, for=192.0.2.43;proto=http"),
        ip("192.0.2.43")
    );
    // A trusted proxy that hides its client: keyed by that proxy, never by what the
    // client wrote further left.
    assert_eq!(ip_of("for=6.6.6.6, for=_hidden"), ip("10.0.0.1"));
    assert_eq!(
        ip_of("for=6.6.6.6, for=unknown, for=10.0.0.5"),
        ip("10.0.0.5")
    );
    // Junk is dropped; an element without `for=` names nobody.
    assert_eq!(ip_of("for=192.0.2.43, ;;=, for=[bad"), ip("192.0.2.43"));
    assert_eq!(ip_of("proto=http;by=1.2.3.4"), ip("10.0.0.1"));
}

#[test]
fn hop_counts_stop_at_a_hidden_client() {
    let hops = ClientIp::new()
        .with_proxy_header(ProxyHeader::Forwarded)
        .with_trusted_hops(2);
    let peer = ip("10.0.0.1");
    assert_eq!(
        hops.client_addr(peer, ["for=6.6.6.6, for=192.0.2.1, for=10.0.0.2"]),
        ip("192.0.2.1")
    );
    assert_eq!(
        hops.client_addr(peer, ["for=6.6.6.6, for=_x, for=10.0.0.2"]),
        ip("10.0.0.2")
    );
    assert_eq!(hops.client_addr(peer, ["for=10.0.0.2"]), ip("10.0.0.2"));
}

#[test]
fn x_real_ip_is_one_address_from_a_trusted_peer() {
    let real = ClientIp::new()
        .with_proxy_header(ProxyHeader::XRealIp)
        .with_trusted_proxies(["127.0.0.1"])
        .unwrap();
    let peer = ip("127.0.0.1");
    assert_eq!(real.client_addr(peer, ["203.0.113.4"]), ip("203.0.113.4"));
    assert_eq!(real.client_addr(peer, ["junk"]), peer);
    assert_eq!(real.client_addr(peer, ["1.1.1.1", "2.2.2.2"]), peer);
    assert_eq!(real.client_addr(peer, None::<&str>), peer);
    assert_eq!(
        real.client_addr(ip("10.9.9.9"), ["203.0.113.4"]),
        ip("10.9.9.9")
    );
}

#[test]
fn values_that_are_not_text_drop_only_their_own_entries() {
    let xff = ClientIp::new()
        .with_trusted_proxies(["10.0.0.0/8"])
        .unwrap();
    let mut map = HeaderMap::new();
    map.append(
        HeaderName::from_static("x-forwarded-for"),
        HeaderValue::from_bytes(b"\xff\xfe, 198.51.100.4").unwrap(),
    );
    assert_eq!(
        xff.client_addr_from_headers(ip("10.0.0.1"), &map),
        ip("198.51.100.4")
    );
}
