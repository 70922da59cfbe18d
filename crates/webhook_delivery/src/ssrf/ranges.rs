//! The forbidden ranges, written out by hand: which addresses a webhook must
//! never be connected to, and why.

use std::net::{IpAddr, Ipv4Addr, Ipv6Addr};

/// The reason `ip` must not be connected to, or `None` when it is a public address.
///
/// IPv6 forms that carry an IPv4 address (IPv4-mapped, IPv4-compatible, NAT64
/// 64:ff9b::/96, 6to4) are judged by the IPv4 address inside, since that is where
/// the connection ends up.
pub fn is_forbidden(ip: IpAddr) -> Option<&'static str> {
    match ip {
        IpAddr::V4(v4) => forbidden_v4(v4),
        IpAddr::V6(v6) => forbidden_v6(v6),
    }
}

fn forbidden_v4(ip: Ipv4Addr) -> Option<&'static str> {
    let [a, b, c, _] = ip.octets();
    Some(match (a, b, c) {
        _ if ip == Ipv4Addr::UNSPECIFIED => "unspecified",
        _ if ip == Ipv4Addr::BROADCAST => "broadcast",
        (0, _, _) => "this-network 0/8",
        (10, _, _) => "private",
        (100, 64..=127, _) => "shared address space (100.64/10)",
        (127, _, _) => "loopback",
        (169, 254, _) => "link-local",
        (172, 16..=31, _) => "private",
        (192, 0, 0) => "IETF protocol assignments 192.0.0/24",
        (192, 0, 2) | (198, 51, 100) | (203, 0, 113) => "documentation",
        (192, 88, 99) => "6to4 relay anycast 192.88.99/24",
        (192, 168, _) => "private",
        (198, 18..=19, _) => "benchmarking 198.18/15",
        (224..=239, _, _) => "multicast",
        (240..=255, _, _) => "reserved 240/4",
        _ => return None,
    })
}

fn forbidden_v6(ip: Ipv6Addr) -> Option<&'static str> {
    let s = ip.segments();
    let embedded_v4 = |hi: u16, lo: u16| {
        let [a, b] = hi.to_be_bytes();
        let [c, d] = lo.to_be_bytes();
        Ipv4Addr::new(a, b, c, d)
    };
    Some(match s {
        [0, 0, 0, 0, 0, 0, 0, 0] => "unspecified ::",
        [0, 0, 0, 0, 0, 0, 0, 1] => "loopback ::1",
        // IPv4-mapped ::ffff:a.b.c.d and the deprecated IPv4-compatible ::a.b.c.d.
        [0, 0, 0, 0, 0, 0xffff | 0, hi, lo] => return forbidden_v4(embedded_v4(hi, lo)),
        // IPv4-translated ::ffff:0:a.b.c.d (SIIT): no webhook lives there, and a
        // translator would reach the IPv4 inside, so the whole /96 is refused.
        [0, 0, 0, 0, 0xffff, 0, _, _] => "IPv4-translated ::ffff:0:0/96",
        // NAT64 well-known prefix: the translator connects to the embedded IPv4.
        [0x64, 0xff9b, 0, 0, 0, 0, hi, lo] => return forbidden_v4(embedded_v4(hi, lo)),
        [0x64, 0xff9b, 1, ..] => "NAT64 local-use 64:ff9b:1::/48",
        [0x100, 0, 0, 0, ..] => "discard-only 100::/64",
        [0x2001, 0x0db8, ..] => "documentation 2001:db8::/32",
        // Teredo, benchmarking, ORCHID and other special-purpose blocks.
        [0x2001, 0..=0x01ff, ..] => "IETF protocol assignments 2001::/23",
        // 6to4 carries an IPv4 address in bits 16..48.
        [0x2002, hi, lo, ..] => return forbidden_v4(embedded_v4(hi, lo)),
        [0x3fff, 0..=0x0fff, ..] => "documentation 3fff::/20",
        [0x5f00, ..] => "SRv6 SIDs 5f00::/16",
        [0xfc00..=0xfdff, ..] => "unique local fc00::/7",
        [0xfe80..=0xfebf, ..] => "link-local fe80::/10",
        [0xfec0..=0xfeff, ..] => "site-local fec0::/10",
        [0xff00..=0xffff, ..] => "multicast ff00::/8",
        _ => return None,
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn addresses_are_judged_by_range() {
        let cases: &[(&str, Option<&str>)] = &[
            ("10.0.0.1", Some("private")),
            ("172.16.0.1", Some("private")),
            ("172.31.255.255", Some("private")),
            ("192.168.1.1", Some("private")),
            ("127.0.0.1", Some("loopback")),
            ("127.255.0.9", Some("loopback")),
            ("169.254.169.254", Some("link-local")),
            ("100.64.0.1", Some("shared address space (100.64/10)")),
            ("100.127.255.255", Some("shared address space (100.64/10)")),
            ("192.0.0.170", Some("IETF protocol assignments 192.0.0/24")),
            ("192.0.2.1", Some("documentation")),
            ("198.51.100.1", Some("documentation")),
            ("203.0.113.1", Some("documentation")),
            ("198.18.0.1", Some("benchmarking 198.18/15")),
            ("198.19.255.1", Some("benchmarking 198.18/15")),
            ("0.0.0.0", Some("unspecified")),
            ("0.1.2.3", Some("this-network 0/8")),
            ("224.0.0.1", Some("multicast")),
            ("239.255.255.250", Some("multicast")),
            ("240.0.0.1", Some("reserved 240/4")),
            ("255.255.255.255", Some("broadcast")),
            ("::1", Some("loopback ::1")),
            ("::", Some("unspecified ::")),
            ("fe80::1", Some("link-local fe80::/10")),
            ("fd00::1", Some("unique local fc00::/7")),
            ("fc00::1", Some("unique local fc00::/7")),
            ("fec0::1", Some("site-local fec0::/10")),
            ("ff02::1", Some("multicast ff00::/8")),
            ("2001:db8::1", Some("documentation 2001:db8::/32")),
            ("3fff::1", Some("documentation 3fff::/20")),
            ("100::1", Some("discard-only 100::/64")),
            ("2001::1", Some("IETF protocol assignments 2001::/23")),
            ("::ffff:127.0.0.1", Some("loopback")),
            ("::ffff:10.0.0.1", Some("private")),
            ("::ffff:169.254.169.254", Some("link-local")),
            ("::127.0.0.1", Some("loopback")),
            ("64:ff9b::10.0.0.1", Some("private")),
            ("64:ff9b::169.254.169.254", Some("link-local")),
            ("64:ff9b:1::1", Some("NAT64 local-use 64:ff9b:1::/48")),
            ("2002:7f00:1::1", Some("loopback")),
            ("2002:a9fe:a9fe::1", Some("link-local")),
            // Issue 12, point 8: these passed before. Fails if their arms go.
            ("::ffff:0:7f00:1", Some("IPv4-translated ::ffff:0:0/96")),
            ("::ffff:0:808:808", Some("IPv4-translated ::ffff:0:0/96")),
            ("192.88.99.1", Some("6to4 relay anycast 192.88.99/24")),
            ("192.88.99.255", Some("6to4 relay anycast 192.88.99/24")),
            ("5f00::1", Some("SRv6 SIDs 5f00::/16")),
            ("5f00:ffff::1", Some("SRv6 SIDs 5f00::/16")),
            ("192.88.98.255", None),
            ("192.88.100.1", None),
            ("5f01::1", None),
            // Public addresses, including near misses of the ranges above.
            ("8.8.8.8", None),
            ("1.1.1.1", None),
            ("2606:4700::1111", None),
            ("172.32.0.1", None),
            ("172.15.255.255", None),
            ("100.128.0.1", None),
            ("169.255.0.1", None),
            ("198.20.0.1", None),
            ("223.255.255.255", None),
            ("::ffff:8.8.8.8", None),
            ("64:ff9b::8.8.8.8", None),
            ("2002:808:808::1", None),
            ("2001:4860:4860::8888", None),
            ("2001:200::1", None),
            ("fe7f::1", None),
        ];
        for &(ip, expected) in cases {
            let parsed: IpAddr = ip.parse().unwrap();
            assert_eq!(is_forbidden(parsed), expected, "{ip}");
        }
    }
}
