//! The SSRF guard: webhook URLs come from customers, so a delivery must not become
//! a way to reach our own network (the cloud metadata service at 169.254.169.254,
//! the database, an admin port on loopback).
//!
//! Checking the URL's host name is not enough: a public name can resolve to
//! 10.0.0.1, and can resolve differently on the next lookup (DNS rebinding). So the
//! check runs on the addresses actually connected to, inside the HTTP client:
//!
//! - [`GuardedResolver`] is reqwest's resolver; it drops forbidden addresses and
//!   fails the request when none are left.
//! - reqwest does not resolve IP literals (`http://10.0.0.1/`), so [`check_url`]
//!   covers those, and the scheme. **Call it for every URL before sending.**
//! - [`client_builder`] installs the resolver and turns off redirects (a redirect
//!   to a private address would otherwise be followed without a check) and proxies
//!   (the proxy, not the target, would be resolved).
//!
//! Forbidden ranges are written out by hand in [`is_forbidden`]; an [`Allowlist`]
//! from configuration re-opens specific ranges, e.g. `127.0.0.0/8` for tests that
//! run a receiver on loopback.

use reqwest::dns::{Addrs, Name, Resolve, Resolving};
use std::fmt;
use std::net::{IpAddr, Ipv4Addr, Ipv6Addr};
use std::str::FromStr;
use std::sync::Arc;
use url::{Host, Url};

/// Why a webhook target was refused.
#[derive(Debug, thiserror::Error)]
pub enum SsrfError {
    #[error("webhook URL scheme `{0}` is not allowed; use http or https")]
    UnsupportedScheme(String),
    #[error("webhook URL has no host")]
    MissingHost,
    #[error("webhook URL port {port} is not allowed ({policy})")]
    ForbiddenPort { port: u16, policy: Ports },
    #[error(
        "refusing webhook host `{host}`: {} (not in the SSRF allowlist)",
        describe_refused(.refused)
    )]
    Forbidden {
        host: String,
        /// Every address the host had, each with the reason it was refused.
        refused: Vec<(IpAddr, &'static str)>,
    },
    #[error("webhook host `{host}` resolved to no addresses")]
    NoAddresses { host: String },
    #[error("could not resolve webhook host `{host}`: {source}")]
    Resolve {
        host: String,
        source: std::io::Error,
    },
}

fn describe_refused(refused: &[(IpAddr, &'static str)]) -> String {
    refused
        .iter()
        .map(|(addr, reason)| format!("{addr} is {reason}"))
        .collect::<Vec<_>>()
        .join(", ")
}

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

/// Ranges that configuration re-opens despite [`is_forbidden`], e.g.
/// `127.0.0.0/8,::1/128`. Addresses that are not forbidden are always allowed;
/// the empty allowlist (the default) re-opens nothing.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct Allowlist {
    ranges: Vec<Cidr>,
}

/// An allowlist entry that is neither an IP address nor a CIDR block.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
#[error("invalid SSRF allowlist entry `{entry}`: {problem}")]
pub struct AllowlistError {
    pub entry: String,
    pub problem: &'static str,
}

impl Allowlist {
    /// Parses comma-separated IP addresses and CIDR blocks. Blank entries are
    /// skipped, so `""` is the empty allowlist.
    ///
    /// # Errors
    ///
    /// [`AllowlistError`] naming the first entry that does not parse, or whose
    /// address has bits set beyond the prefix (`10.0.0.1/8`, likely a typo).
    pub fn parse(text: &str) -> Result<Self, AllowlistError> {
        let ranges = text
            .split(',')
            .map(str::trim)
            .filter(|entry| !entry.is_empty())
            .map(|entry| {
                Cidr::parse(entry).map_err(|problem| AllowlistError {
                    entry: entry.to_owned(),
                    problem,
                })
            })
            .collect::<Result<_, _>>()?;
        Ok(Self { ranges })
    }

    /// Whether configuration re-opens `ip`. An IPv4-mapped IPv6 address matches
    /// the IPv4 ranges, as it reaches the same host.
    pub fn permits(&self, ip: IpAddr) -> bool {
        let ip = match ip {
            IpAddr::V6(v6) => v6.to_ipv4_mapped().map_or(ip, IpAddr::V4),
            IpAddr::V4(_) => ip,
        };
        self.ranges.iter().any(|range| range.contains(ip))
    }

    /// `Err(reason)` when `ip` is forbidden and not re-opened.
    pub fn check(&self, ip: IpAddr) -> Result<(), &'static str> {
        match is_forbidden(ip) {
            Some(reason) if !self.permits(ip) => Err(reason),
            _ => Ok(()),
        }
    }
}

impl FromStr for Allowlist {
    type Err = AllowlistError;

    fn from_str(text: &str) -> Result<Self, Self::Err> {
        Self::parse(text)
    }
}

/// The cloud metadata service (169.254.169.254, AWS's fd00:ec2::254) and the IPv6
/// forms that reach 169.254.169.254 (mapped, compatible, NAT64, 6to4): no
/// allowlist entry may cover one.
const METADATA_ADDRESSES: [IpAddr; 6] = [
    IpAddr::V4(Ipv4Addr::new(169, 254, 169, 254)),
    IpAddr::V6(Ipv6Addr::new(0xfd00, 0xec2, 0, 0, 0, 0, 0, 0x254)),
    IpAddr::V6(Ipv6Addr::new(0, 0, 0, 0, 0, 0xffff, 0xa9fe, 0xa9fe)),
    IpAddr::V6(Ipv6Addr::new(0, 0, 0, 0, 0, 0, 0xa9fe, 0xa9fe)),
    IpAddr::V6(Ipv6Addr::new(0x64, 0xff9b, 0, 0, 0, 0, 0xa9fe, 0xa9fe)),
    IpAddr::V6(Ipv6Addr::new(0x2002, 0xa9fe, 0xa9fe, 0, 0, 0, 0, 0)),
];

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
struct Cidr {
    network: IpAddr,
    prefix: u8,
}

impl Cidr {
    fn parse(entry: &str) -> Result<Self, &'static str> {
        let (addr, prefix) = match entry.split_once('/') {
            Some((addr, prefix)) => (addr, Some(prefix)),
            None => (entry, None),
        };
        let network: IpAddr = addr.parse().map_err(|_| "not an IP address")?;
        let max = if network.is_ipv4() { 32 } else { 128 };
        let prefix = match prefix {
            None => max,
            Some(text) => text
                .parse::<u8>()
                .ok()
                .filter(|&p| p <= max)
                .ok_or("prefix length must be 0..=32 for IPv4, 0..=128 for IPv6")?,
        };
        let cidr = Self { network, prefix };
        if !cidr.contains(network) {
            return Err("address has bits set beyond the prefix length");
        }
        // An allowlist re-opens a few named ranges; one that re-opens everything or
        // the metadata service turns the guard off (issue 12), so it is refused.
        if prefix == 0 {
            return Err(if network.is_ipv4() {
                "re-opens every IPv4 address (0.0.0.0/0); name the ranges to re-open"
            } else {
                "re-opens every IPv6 address (::/0); name the ranges to re-open"
            });
        }
        if METADATA_ADDRESSES.iter().any(|&m| cidr.contains(m)) {
            return Err(
                "covers the cloud metadata address 169.254.169.254 (or an IPv6 form of it)",
            );
        }
        Ok(cidr)
    }

    /// The netmask, aligned with [`bits`] (IPv4 in the low 32 bits).
    fn mask(self) -> u128 {
        let width = if self.network.is_ipv4() { 32 } else { 128 };
        let host_bits = u32::from(width - self.prefix);
        let all = if width == 32 {
            u128::from(u32::MAX)
        } else {
            u128::MAX
        };
        all.checked_shl(host_bits).map_or(0, |m| m & all)
    }

    fn contains(self, ip: IpAddr) -> bool {
        ip.is_ipv4() == self.network.is_ipv4() && bits(ip) & self.mask() == bits(self.network)
    }
}

fn bits(ip: IpAddr) -> u128 {
    match ip {
        IpAddr::V4(v4) => u128::from(u32::from(v4)),
        IpAddr::V6(v6) => u128::from(v6),
    }
}

impl fmt::Display for Allowlist {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        for (i, range) in self.ranges.iter().enumerate() {
            if i > 0 {
                f.write_str(",")?;
            }
            write!(f, "{range}")?;
        }
        Ok(())
    }
}

impl fmt::Display for Cidr {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "{}/{}", self.network, self.prefix)
    }
}

/// The ports a webhook may be sent to. The default, [`Ports::WEB`], is 80, 443
/// and every port from 1024 up: the well-known ports below 1024 are where a
/// public host's other services listen (SSH 22, SMTP 25, DNS 53, …), which a
/// POST from us must not probe. [`Ports::ANY`] turns the policy off (set in
/// `WorkerConfig::ports`).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Ports {
    /// Every port from this one up is allowed, as are 80 and 443.
    pub lowest_unprivileged: u16,
}

impl Ports {
    /// 80, 443 and 1024–65535.
    pub const WEB: Ports = Ports {
        lowest_unprivileged: 1024,
    };
    /// Every port.
    pub const ANY: Ports = Ports {
        lowest_unprivileged: 0,
    };

    /// Whether a request may go to `port`.
    pub fn permits(self, port: u16) -> bool {
        matches!(port, 80 | 443) || port >= self.lowest_unprivileged
    }
}

impl Default for Ports {
    fn default() -> Self {
        Ports::WEB
    }
}

impl fmt::Display for Ports {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "80, 443 and {}-65535", self.lowest_unprivileged)
    }
}

/// Refuses URLs that are not http(s), have no host, go to a port `ports` does
/// not permit, or name a forbidden IP literal. Host names are left to
/// [`GuardedResolver`], which sees what they resolve to.
///
/// # Errors
///
/// [`SsrfError::UnsupportedScheme`], [`SsrfError::MissingHost`],
/// [`SsrfError::ForbiddenPort`] or [`SsrfError::Forbidden`].
pub fn check_url(url: &Url, allow: &Allowlist, ports: Ports) -> Result<(), SsrfError> {
    if !matches!(url.scheme(), "http" | "https") {
        return Err(SsrfError::UnsupportedScheme(url.scheme().to_owned()));
    }
    let port = url.port_or_known_default().ok_or(SsrfError::MissingHost)?;
    if !ports.permits(port) {
        return Err(SsrfError::ForbiddenPort {
            port,
            policy: ports,
        });
    }
    let ip = match url.host().ok_or(SsrfError::MissingHost)? {
        Host::Domain(_) => return Ok(()),
        Host::Ipv4(v4) => IpAddr::V4(v4),
        Host::Ipv6(v6) => IpAddr::V6(v6),
    };
    allow.check(ip).map_err(|reason| SsrfError::Forbidden {
        host: ip.to_string(),
        refused: vec![(ip, reason)],
    })
}

/// A reqwest resolver that looks names up with the system resolver (through
/// tokio) and hands reqwest only the addresses the [`Allowlist`] lets through.
#[derive(Debug, Clone, Default)]
pub struct GuardedResolver {
    allow: Arc<Allowlist>,
}

impl GuardedResolver {
    pub fn new(allow: Allowlist) -> Self {
        Self {
            allow: Arc::new(allow),
        }
    }

    /// Resolves `host` and keeps the permitted addresses (with port 0; reqwest sets
    /// the URL's port).
    ///
    /// # Errors
    ///
    /// [`SsrfError::Forbidden`] when every address is refused, naming each with
    /// its reason; [`SsrfError::Resolve`] or [`SsrfError::NoAddresses`] when the
    /// lookup fails.
    pub async fn resolve_host(&self, host: &str) -> Result<Vec<std::net::SocketAddr>, SsrfError> {
        let resolved =
            tokio::net::lookup_host((host, 0))
                .await
                .map_err(|source| SsrfError::Resolve {
                    host: host.to_owned(),
                    source,
                })?;
        let (mut allowed, mut refused) = (Vec::new(), Vec::new());
        for addr in resolved {
            match self.allow.check(addr.ip()) {
                Ok(()) => allowed.push(addr),
                Err(reason) => refused.push((addr.ip(), reason)),
            }
        }
        if !refused.is_empty() {
            let refused = describe_refused(&refused);
            if allowed.is_empty() {
                tracing::debug!(host, %refused, "webhook host has only forbidden addresses");
            } else {
                tracing::warn!(host, %refused, "dropping forbidden addresses of webhook host");
            }
        }
        match (allowed.is_empty(), refused.is_empty()) {
            (false, _) => Ok(allowed),
            (true, false) => Err(SsrfError::Forbidden {
                host: host.to_owned(),
                refused,
            }),
            (true, true) => Err(SsrfError::NoAddresses {
                host: host.to_owned(),
            }),
        }
    }
}

impl Resolve for GuardedResolver {
    fn resolve(&self, name: Name) -> Resolving {
        let this = self.clone();
        Box::pin(async move {
            let addrs = this.resolve_host(name.as_str()).await?;
            Ok(Box::new(addrs.into_iter()) as Addrs)
        })
    }
}

/// A reqwest client builder with the SSRF guard installed: [`GuardedResolver`],
/// no redirects (a 3xx comes back as the response), no proxies. Callers add
/// timeouts and the like, and must still run [`check_url`] on every URL.
pub fn client_builder(allow: Allowlist) -> reqwest::ClientBuilder {
    reqwest::Client::builder()
        .dns_resolver(Arc::new(GuardedResolver::new(allow)))
        .redirect(reqwest::redirect::Policy::none())
        .no_proxy()
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

    #[test]
    fn allowlist_parses_addresses_and_blocks() {
        let allow = Allowlist::parse(" 127.0.0.0/8, ::1/128,10.1.2.3 ,,fd12::/16,").unwrap();
        assert_eq!(
            allow.to_string(),
            "127.0.0.0/8,::1/128,10.1.2.3/32,fd12::/16"
        );
        assert_eq!(Allowlist::parse("").unwrap(), Allowlist::default());
    }

    /// Issue 12, point 5: `HARDCOUNT_WEBHOOK_ALLOWLIST=0.0.0.0/0` was accepted
    /// silently and turned the SSRF guard off. Each row is refused, naming the
    /// entry; fails if the prefix-0 or metadata checks in `Cidr::parse` go
    /// (checked: these rows parsed before them).
    #[test]
    fn an_allowlist_reopening_everything_or_the_metadata_address_is_refused() {
        for (bad, problem) in [
            ("0.0.0.0/0", "every IPv4 address"),
            ("::/0", "every IPv6 address"),
            ("169.254.169.254", "metadata"),
            ("169.254.0.0/16", "metadata"),
            ("128.0.0.0/1", "metadata"),
            ("::ffff:0:0/96", "metadata"),
            ("64:ff9b::/96", "metadata"),
            ("2002::/16", "metadata"),
            ("fd00::/8", "metadata"),
        ] {
            let err = Allowlist::parse(&format!("127.0.0.0/8,{bad}")).unwrap_err();
            assert_eq!(err.entry, bad);
            assert!(err.problem.contains(problem), "{bad}: {err}");
        }
        assert!(Allowlist::parse("169.254.170.0/24,fd12::/16,10.0.0.0/8").is_ok());
    }

    #[test]
    fn allowlist_errors_name_the_entry() {
        for bad in [
            "localhost",
            "10.0.0.0/33",
            "::/129",
            "10.0.0.1/8",
            "10.0.0.0/",
            "10.0.0.0/x",
            "1.2.3",
        ] {
            let err = Allowlist::parse(&format!("127.0.0.1, {bad}")).unwrap_err();
            assert_eq!(err.entry, bad);
            assert!(err.to_string().contains(&format!("`{bad}`")), "{err}");
        }
    }

    #[test]
    fn allowlist_reopens_only_its_ranges() {
        let allow = Allowlist::parse("127.0.0.0/8,fd12::/16,10.1.2.3").unwrap();
        for ip in [
            "127.0.0.1",
            "127.9.9.9",
            "::ffff:127.0.0.1",
            "fd12::1",
            "10.1.2.3",
            "8.8.8.8",
        ] {
            assert_eq!(allow.check(ip.parse().unwrap()), Ok(()), "{ip}");
        }
        for ip in ["::1", "10.1.2.4", "fc00::1", "169.254.169.254"] {
            assert!(allow.check(ip.parse().unwrap()).is_err(), "{ip}");
        }
    }

    #[test]
    fn check_url_refuses_forbidden_literals_and_other_schemes() {
        let none = Allowlist::default();
        let check = |url: &str, allow: &Allowlist| {
            check_url(&Url::parse(url).unwrap(), allow, Ports::default())
        };
        assert!(check("https://example.com/hook", &none).is_ok());
        assert!(check("http://8.8.8.8:8080/", &none).is_ok());
        assert!(check("http://[2606:4700::1111]/", &none).is_ok());
        // Host names are the resolver's job, even ones that look local.
        assert!(check("http://localhost/", &none).is_ok());
        for url in [
            "http://127.0.0.1/",
            "http://[::1]:8080/",
            "http://[::ffff:a9fe:a9fe]/",
            "http://169.254.169.254/latest/meta-data/",
            "http://2130706433/", // 127.0.0.1 in decimal, normalised by the URL parser
            "http://0x7f.1/",
            "http://0/",
        ] {
            let err = check(url, &none).unwrap_err();
            assert!(matches!(err, SsrfError::Forbidden { .. }), "{url}: {err}");
        }
        let err = check("http://10.0.0.1/", &none).unwrap_err();
        assert_eq!(
            err.to_string(),
            "refusing webhook host `10.0.0.1`: 10.0.0.1 is private (not in the SSRF allowlist)"
        );
        let loopback = Allowlist::parse("127.0.0.0/8").unwrap();
        assert!(check("http://127.0.0.1:9000/", &loopback).is_ok());
        // The port policy (issue 12, point 8): 80, 443 and 1024 up by default.
        for url in [
            "http://example.com/",
            "https://example.com/",
            "http://example.com:443/",
            "https://example.com:1024/",
            "http://example.com:65535/",
        ] {
            assert!(check(url, &none).is_ok(), "{url}");
        }
        for (url, port) in [
            ("http://example.com:22/", 22),
            ("https://example.com:25/", 25),
            ("http://example.com:1023/", 1023),
            ("http://8.8.8.8:6/", 6),
        ] {
            let err = check(url, &none).unwrap_err();
            assert!(
                matches!(err, SsrfError::ForbiddenPort { port: p, .. } if p == port),
                "{url}: {err}"
            );
        }
        let any = check_url(
            &Url::parse("http://example.com:22/").unwrap(),
            &none,
            Ports::ANY,
        );
        assert!(any.is_ok());
        assert!(matches!(
            check("ftp://example.com/", &none),
            Err(SsrfError::UnsupportedScheme(s)) if s == "ftp"
        ));
        assert!(matches!(
            check("file:///etc/passwd", &none),
            Err(SsrfError::UnsupportedScheme(_))
        ));
        assert!(matches!(
            check("unix:/run/x.sock", &none),
            Err(SsrfError::UnsupportedScheme(_))
        ));
    }

    /// Resolves through the [`Resolve`] trait, as reqwest does.
    async fn resolve(allow: &str, host: &str) -> Result<Vec<IpAddr>, SsrfError> {
        let resolver = GuardedResolver::new(Allowlist::parse(allow).unwrap());
        match resolver.resolve(host.parse().unwrap()).await {
            Ok(addrs) => Ok(addrs.map(|a| a.ip()).collect()),
            Err(err) => Err(*err.downcast::<SsrfError>().unwrap()),
        }
    }

    #[tokio::test]
    async fn resolver_refuses_localhost_unless_allowlisted() {
        let err = resolve("", "localhost").await.unwrap_err();
        assert!(matches!(err, SsrfError::Forbidden { .. }), "{err}");
        let message = err.to_string();
        assert!(
            message.contains("`localhost`") && message.contains("127.0.0.1 is loopback"),
            "{message}"
        );
        let addrs = resolve("127.0.0.0/8", "localhost").await.unwrap();
        assert!(
            addrs.contains(&IpAddr::V4(Ipv4Addr::LOCALHOST)),
            "{addrs:?}"
        );
        assert!(
            addrs.iter().all(|ip| ip.is_ipv4()),
            "::1 is not allowlisted: {addrs:?}"
        );
    }

    /// A one-shot HTTP server on loopback that answers every request with a redirect
    /// to the cloud metadata address.
    async fn redirecting_server() -> std::net::SocketAddr {
        use tokio::io::{AsyncReadExt as _, AsyncWriteExt as _};
        let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
        let addr = listener.local_addr().unwrap();
        tokio::spawn(async move {
            while let Ok((mut socket, _)) = listener.accept().await {
                let mut buf = [0; 4096];
                let _ = socket.read(&mut buf).await;
                let response = "HTTP/1.1 302 Found\r\n\
                    Location: http://169.254.169.254/latest/meta-data/\r\n\
                    Content-Length: 0\r\nConnection: close\r\n\r\n";
                let _ = socket.write_all(response.as_bytes()).await;
            }
        });
        addr
    }

    #[tokio::test]
    async fn client_connects_only_through_the_guard_and_does_not_follow_redirects() {
        let server = redirecting_server().await;
        let url = format!("http://localhost:{}/hook", server.port());

        let guarded = client_builder(Allowlist::default()).build().unwrap();
        let err = guarded.post(&url).send().await.unwrap_err();
        let mut source: Option<&dyn std::error::Error> = Some(&err);
        let mut refused = false;
        while let Some(e) = source {
            refused |= e.downcast_ref::<SsrfError>().is_some();
            source = e.source();
        }
        assert!(
            refused,
            "expected the SSRF guard in the error chain: {err:?}"
        );

        let loopback = client_builder(Allowlist::parse("127.0.0.0/8").unwrap());
        let response = loopback.build().unwrap().post(&url).send().await.unwrap();
        assert_eq!(response.status(), reqwest::StatusCode::FOUND);
    }
}
