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
//!
//! ```text
//! mod.rs        the refusals (SsrfError), check_url, the guarded resolver, the client builder
//! allowlist.rs  the Allowlist of re-opened ranges, the Ports policy
//! ranges.rs     is_forbidden: the forbidden ranges               (no I/O)
//! ```

mod allowlist;
mod ranges;

use reqwest::dns::{Addrs, Name, Resolve, Resolving};
use std::net::IpAddr;
use std::sync::Arc;
use url::{Host, Url};

pub use allowlist::{Allowlist, AllowlistError, Ports};
pub use ranges::is_forbidden;

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
    use std::net::Ipv4Addr;

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
