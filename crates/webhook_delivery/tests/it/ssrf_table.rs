//! The SSRF table's rows and the allowlist's refusals that issue 12 found open,
//! through the public API (so `scripts/mutation-check` can pin each).

use std::net::IpAddr;

use url::Url;
use webhook_delivery::ssrf::{Allowlist, Ports, SsrfError, check_url, is_forbidden};

/// IPv4-translated `::ffff:0:0/96`, 192.88.99.0/24 and 5f00::/16 passed the
/// check before. Fails if any of their arms in `ssrf::is_forbidden` goes
/// (checked against each removal).
#[test]
fn the_ranges_issue_12_found_open_are_forbidden() {
    for (ip, reason) in [
        ("::ffff:0:7f00:1", "IPv4-translated ::ffff:0:0/96"),
        ("::ffff:0:a9fe:a9fe", "IPv4-translated ::ffff:0:0/96"),
        ("192.88.99.1", "6to4 relay anycast 192.88.99/24"),
        ("5f00::1", "SRv6 SIDs 5f00::/16"),
    ] {
        let parsed: IpAddr = ip.parse().unwrap();
        assert_eq!(is_forbidden(parsed), Some(reason), "{ip}");
    }
    for ip in ["192.88.100.1", "5f01::1", "8.8.8.8"] {
        assert_eq!(is_forbidden(ip.parse().unwrap()), None, "{ip}");
    }
}

/// Any port was allowed: a webhook could probe a public host's SSH or SMTP. The
/// default policy allows 80, 443 and 1024 up. Fails if `Ports::permits` allows
/// every port (checked).
#[test]
fn a_webhook_to_a_well_known_port_other_than_80_and_443_is_refused() {
    let none = Allowlist::default();
    let check = |url: &str| check_url(&Url::parse(url).unwrap(), &none, Ports::default());
    for url in ["https://example.com/", "http://example.com:8080/"] {
        assert!(check(url).is_ok(), "{url}");
    }
    for url in ["http://example.com:22/", "https://example.com:25/"] {
        assert!(
            matches!(check(url), Err(SsrfError::ForbiddenPort { .. })),
            "{url}"
        );
    }
}

/// `HARDCOUNT_WEBHOOK_ALLOWLIST=0.0.0.0/0` was accepted silently and turned the
/// guard off. Fails if either check in the allowlist's parser goes (checked
/// against each removal).
#[test]
fn an_allowlist_covering_everything_or_the_metadata_address_is_refused() {
    for (entry, problem) in [
        ("0.0.0.0/0", "every IPv4 address"),
        ("::/0", "every IPv6 address"),
        ("169.254.0.0/16", "metadata"),
        ("::ffff:0:0/96", "metadata"),
    ] {
        let err = Allowlist::parse(entry).unwrap_err();
        assert!(err.problem.contains(problem), "{entry}: {err}");
    }
    assert!(Allowlist::parse("10.0.0.0/8,127.0.0.0/8").is_ok());
}
