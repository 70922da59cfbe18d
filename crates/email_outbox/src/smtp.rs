//! `SMTP_URL` and the one pooled lettre transport built from it.
//!
//! | URL | connection |
//! |---|---|
//! | `smtp://host[:port]` (port 25) | plain, no TLS |
//! | `smtp://host[:port]?tls=required` (port 587) | STARTTLS, refused if the server does not offer it |
//! | `smtp://host[:port]?tls=opportunistic` | STARTTLS when offered, else plain |
//! | `smtps://host[:port]` (port 465) | implicit TLS |
//!
//! `user:password@` before the host adds SMTP AUTH (percent-encoded). A custom
//! CA (PEM) for a private relay is passed separately, never in the URL. No error
//! or `Debug` output of this module contains the password: the URL is never
//! echoed, only its scheme or the part that is wrong.

use std::fmt;
use std::time::Duration;

use lettre::transport::smtp::PoolConfig;
use lettre::transport::smtp::authentication::Credentials;
use lettre::transport::smtp::client::{Certificate, Tls, TlsParameters};
use lettre::{AsyncSmtpTransport, Tokio1Executor};
use url::Url;

/// How TLS is used on the connection.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum TlsMode {
    None,
    StartTlsRequired,
    StartTlsOpportunistic,
    Implicit,
}

/// A parsed `SMTP_URL`. `Debug` shows the user but never the password.
#[derive(Clone, PartialEq, Eq)]
pub struct SmtpUrl {
    pub host: String,
    pub port: u16,
    pub tls: TlsMode,
    user: Option<String>,
    password: Option<String>,
}

impl fmt::Debug for SmtpUrl {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("SmtpUrl")
            .field("host", &self.host)
            .field("port", &self.port)
            .field("tls", &self.tls)
            .field("user", &self.user)
            .field("password", &self.password.as_ref().map(|_| "<redacted>"))
            .finish()
    }
}

/// Why `SMTP_URL` was refused. Never contains the password.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum SmtpUrlError {
    #[error("SMTP_URL is not a URL ({0}); expected smtp://host:port or smtps://host:port")]
    NotAUrl(String),
    #[error("SMTP_URL has the unknown scheme `{0}`; expected smtp or smtps")]
    UnknownScheme(String),
    #[error("SMTP_URL has no host")]
    NoHost,
    #[error("SMTP_URL has an unknown tls value `{0}`; expected required or opportunistic")]
    UnknownTls(String),
    #[error("SMTP_URL sets tls= on smtps://, which is always implicit TLS")]
    TlsOnSmtps,
    #[error("SMTP_URL has the unknown parameter `{0}`; only tls is understood")]
    UnknownParameter(String),
    #[error("SMTP_URL's user or password is not valid percent-encoded UTF-8")]
    BadCredentials,
    #[error("the SMTP CA file is not a PEM certificate: {0}")]
    BadCa(String),
}

impl SmtpUrl {
    /// # Errors
    /// [`SmtpUrlError`], naming what is wrong without echoing the URL.
    pub fn parse(text: &str) -> Result<SmtpUrl, SmtpUrlError> {
        // url's messages name the problem ("invalid port number"), not the input.
        let url = Url::parse(text.trim()).map_err(|e| SmtpUrlError::NotAUrl(e.to_string()))?;
        let (mut tls, default_port) = match url.scheme() {
            "smtp" => (TlsMode::None, 25),
            "smtps" => (TlsMode::Implicit, 465),
            other => return Err(SmtpUrlError::UnknownScheme(other.to_owned())),
        };
        let host = url
            .host_str()
            .filter(|h| !h.is_empty())
            .ok_or(SmtpUrlError::NoHost)?
            .trim_start_matches('[')
            .trim_end_matches(']')
            .to_owned();
        let mut explicit_port = url.port();
        for (key, value) in url.query_pairs() {
            match key.as_ref() {
                "tls" if tls == TlsMode::Implicit => return Err(SmtpUrlError::TlsOnSmtps),
                "tls" => {
                    tls = match value.as_ref() {
                        "required" => TlsMode::StartTlsRequired,
                        "opportunistic" => TlsMode::StartTlsOpportunistic,
                        other => return Err(SmtpUrlError::UnknownTls(other.to_owned())),
                    };
                    if explicit_port.is_none() && tls == TlsMode::StartTlsRequired {
                        explicit_port = Some(587);
                    }
                }
                other => return Err(SmtpUrlError::UnknownParameter(other.to_owned())),
            }
        }
        let user = match url.username() {
            "" => None,
            u => Some(percent_decode(u).ok_or(SmtpUrlError::BadCredentials)?),
        };
        let password = match url.password() {
            None => None,
            Some(p) => Some(percent_decode(p).ok_or(SmtpUrlError::BadCredentials)?),
        };
        Ok(SmtpUrl {
            host,
            port: explicit_port.unwrap_or(default_port),
            tls,
            user,
            password,
        })
    }

    pub fn has_credentials(&self) -> bool {
        self.user.is_some()
    }
}

fn percent_decode(s: &str) -> Option<String> {
    percent_encoding::percent_decode_str(s)
        .decode_utf8()
        .ok()
        .map(|c| c.into_owned())
}

/// The pooled transport: at most `max_connections` connections are kept open,
/// and the sender never runs more sends than that at once, so the pool never
/// has to open a connection beyond its size.
///
/// # Errors
/// A CA that is not PEM, or TLS parameters lettre refuses.
pub fn transport(
    url: &SmtpUrl,
    ca_pem: Option<&[u8]>,
    max_connections: u32,
    timeout: Duration,
) -> Result<AsyncSmtpTransport<Tokio1Executor>, SmtpUrlError> {
    let params = || -> Result<TlsParameters, SmtpUrlError> {
        let mut b = TlsParameters::builder(url.host.clone());
        if let Some(pem) = ca_pem {
            let cert =
                Certificate::from_pem(pem).map_err(|e| SmtpUrlError::BadCa(e.to_string()))?;
            b = b.add_root_certificate(cert);
        }
        b.build_rustls()
            .map_err(|e| SmtpUrlError::BadCa(e.to_string()))
    };
    let tls = match url.tls {
        TlsMode::None => Tls::None,
        TlsMode::StartTlsRequired => Tls::Required(params()?),
        TlsMode::StartTlsOpportunistic => Tls::Opportunistic(params()?),
        TlsMode::Implicit => Tls::Wrapper(params()?),
    };
    let mut builder = AsyncSmtpTransport::<Tokio1Executor>::builder_dangerous(url.host.clone())
        .port(url.port)
        .tls(tls)
        .timeout(Some(timeout))
        .pool_config(
            PoolConfig::new()
                .max_size(max_connections.max(1))
                .idle_timeout(Duration::from_secs(30)),
        );
    if let (Some(user), Some(password)) = (&url.user, &url.password) {
        builder = builder.credentials(Credentials::new(user.clone(), password.clone()));
    }
    Ok(builder.build())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_four_forms_parse() {
        let cases = [
            ("smtp://127.0.0.1:2525", TlsMode::None, 2525),
            ("smtp://mail.example.com", TlsMode::None, 25),
            (
                "smtp://mail.example.com?tls=required",
                TlsMode::StartTlsRequired,
                587,
            ),
            (
                "smtp://mail.example.com:2587?tls=opportunistic",
                TlsMode::StartTlsOpportunistic,
                2587,
            ),
            ("smtps://mail.example.com", TlsMode::Implicit, 465),
        ];
        for (text, tls, port) in cases {
            let u = SmtpUrl::parse(text).unwrap();
            assert_eq!((u.tls, u.port), (tls, port), "{text}");
        }
    }

    #[test]
    fn bad_urls_are_named_and_never_echo_the_password() {
        let cases = [
            ("http://u:hunter2@mail.example.com", "unknown scheme `http`"),
            (
                "smtp://u:hunter2@mail.example.com?tls=maybe",
                "unknown tls value `maybe`",
            ),
            (
                "smtp://u:hunter2@mail.example.com?starttls=1",
                "unknown parameter `starttls`",
            ),
            (
                "smtps://u:hunter2@mail.example.com?tls=required",
                "always implicit TLS",
            ),
            ("smtp://u:hunter2@mail.example.com:99999", "not a URL"),
            ("hunter2", "not a URL"),
        ];
        for (text, expected) in cases {
            let err = SmtpUrl::parse(text).unwrap_err().to_string();
            assert!(err.contains(expected), "{expected:?} not in {err:?}");
            assert!(!err.contains("hunter2"), "{err}");
        }
    }

    #[test]
    fn credentials_are_decoded_and_debug_redacts_the_password() {
        let u = SmtpUrl::parse("smtp://app%40example.com:p%40ss%3Aword@mail.example.com").unwrap();
        assert!(u.has_credentials());
        assert_eq!(u.user.as_deref(), Some("app@example.com"));
        assert_eq!(u.password.as_deref(), Some("p@ss:word"));
        let debug = format!("{u:?}");
        assert!(
            !debug.contains("p@ss") && !debug.contains("p%40ss"),
            "{debug}"
        );
    }
}
