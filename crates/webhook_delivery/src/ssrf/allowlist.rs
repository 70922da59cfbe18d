//! What configuration may re-open: the [`Allowlist`] of ranges (never one
//! that covers everything or the metadata service), and the [`Ports`] policy.

use std::fmt;
use std::net::{IpAddr, Ipv4Addr, Ipv6Addr};
use std::str::FromStr;

use super::ranges::is_forbidden;

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

#[cfg(test)]
mod tests {
    use super::*;

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
}
