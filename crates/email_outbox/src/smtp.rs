//! `SMTP_URL` and how one SMTP connection is opened from it (the pool that
//! keeps them is `pool.rs`).
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
use std::io;
use std::net::SocketAddr;
use std::pin::Pin;
use std::task::{Context, Poll};
use std::time::Duration;

use lettre::transport::smtp::authentication::{Credentials, DEFAULT_MECHANISMS};
#[allow(deprecated)]
use lettre::transport::smtp::client::AsyncNetworkStream;
use lettre::transport::smtp::client::{
    AsyncSmtpConnection, AsyncTokioStream, Certificate, TlsParameters,
};
use lettre::transport::smtp::extension::ClientId;
use tokio::io::{AsyncRead, AsyncWrite, ReadBuf};
use tokio::net::TcpStream;
use tokio_util::compat::{Compat, FuturesAsyncReadCompatExt};
use url::Url;

use crate::failure::Failure;

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
    /// Without a password lettre sends no AUTH at all, and a relay that
    /// requires it refuses each message instead.
    #[error(
        "SMTP_URL has a user without a password or a password without a user (an empty \
         password counts as none): give both, or neither"
    )]
    HalfCredentials,
    #[error(
        "HARDCOUNT_SMTP_CA_FILE is set but SMTP_URL is plain smtp:// without tls=: the CA \
         would verify nothing and mail would go in clear; use smtps:// or ?tls=required, or \
         unset the CA file"
    )]
    CaWithoutTls,
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
        if user.is_some() != password.is_some() {
            return Err(SmtpUrlError::HalfCredentials);
        }
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

    /// Whether this URL would send its credentials over a connection that may
    /// be plain: AUTH on `smtp://` without TLS, or with `tls=opportunistic`
    /// (an attacker on the path strips STARTTLS and reads the password).
    /// The binary refuses such a URL at boot unless told otherwise.
    pub fn credentials_may_travel_in_clear(&self) -> bool {
        self.has_credentials() && matches!(self.tls, TlsMode::None | TlsMode::StartTlsOpportunistic)
    }
}

fn percent_decode(s: &str) -> Option<String> {
    percent_encoding::percent_decode_str(s)
        .decode_utf8()
        .ok()
        .map(|c| c.into_owned())
}

/// How to open one SMTP connection: TCP with `TCP_NODELAY`, TLS as the URL
/// says, EHLO, and AUTH when the URL has credentials. `Debug` never shows the
/// password.
pub(crate) struct Connector {
    host: String,
    port: u16,
    security: Security,
    credentials: Option<Credentials>,
    hello: ClientId,
    timeout: Duration,
}

/// How the connection is secured.
enum Security {
    None,
    StartTls {
        params: TlsParameters,
        required: bool,
    },
    Implicit(TlsParameters),
}

impl Connector {
    /// # Errors
    /// A CA that is not PEM, or TLS parameters lettre refuses.
    pub(crate) fn new(
        url: &SmtpUrl,
        ca_pem: Option<&[u8]>,
        timeout: Duration,
    ) -> Result<Connector, SmtpUrlError> {
        if url.tls == TlsMode::None && ca_pem.is_some() {
            return Err(SmtpUrlError::CaWithoutTls);
        }
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
        let security = match url.tls {
            TlsMode::None => Security::None,
            TlsMode::StartTlsRequired => Security::StartTls {
                params: params()?,
                required: true,
            },
            TlsMode::StartTlsOpportunistic => Security::StartTls {
                params: params()?,
                required: false,
            },
            TlsMode::Implicit => Security::Implicit(params()?),
        };
        let credentials = match (&url.user, &url.password) {
            (Some(user), Some(password)) => Some(Credentials::new(user.clone(), password.clone())),
            _ => None,
        };
        Ok(Connector {
            host: url.host.clone(),
            port: url.port,
            security,
            credentials,
            hello: ClientId::default(),
            timeout,
        })
    }

    /// One SMTP command's timeout; a whole connect is bounded by it too.
    pub(crate) fn timeout(&self) -> Duration {
        self.timeout
    }

    /// Open, secure, greet and authenticate one connection.
    pub(crate) async fn connect(&self) -> Result<Conn, Failure> {
        let tcp = TcpStream::connect((self.host.as_str(), self.port))
            .await
            .map_err(|e| Failure::Connect(format!("cannot connect: {e}")))?;
        // lettre 0.11.23 leaves Nagle on: the message's final "." would wait
        // for the server's delayed ACK, about 40 ms a message (docs/adr/0016).
        tcp.set_nodelay(true)
            .map_err(|e| Failure::Connect(format!("cannot set TCP_NODELAY: {e}")))?;
        let (tcp, probe) = with_probe(tcp)
            .map_err(|e| Failure::Connect(format!("cannot keep a probe of the socket: {e}")))?;
        let stream: Box<dyn AsyncTokioStream> = match &self.security {
            Security::Implicit(params) => Box::new(implicit_tls(tcp, params.clone()).await?),
            _ => Box::new(tcp),
        };
        // A refusal before any message (the greeting, EHLO, STARTTLS, AUTH) is
        // the session's, not an email's: no reply to the message, as a
        // refused connect is. As an SMTP error, a permanent code there (a 554
        // greeting, a 535 to stale credentials) failed every queued email
        // for good, one per connection (docs/adr/0079).
        // A transient (4xx) refusal, a 421 "too many connections" among them,
        // stays the one email's retry.
        let refused = |step: &str| {
            let step = step.to_owned();
            move |e: lettre::transport::smtp::Error| {
                if e.is_transient() {
                    Failure::Smtp(e)
                } else {
                    Failure::Connect(format!("the server refused the session at {step}: {e}"))
                }
            }
        };
        let mut conn = AsyncSmtpConnection::connect_with_transport(stream, &self.hello)
            .await
            .map_err(refused("the greeting"))?;
        match &self.security {
            Security::StartTls { params, required } if *required || conn.can_starttls() => conn
                .starttls(params.clone(), &self.hello)
                .await
                .map_err(refused("STARTTLS"))?,
            _ => {}
        }
        if let Some(credentials) = &self.credentials {
            conn.auth(DEFAULT_MECHANISMS, credentials)
                .await
                .map_err(refused("AUTH"))?;
        }
        Ok(Conn { smtp: conn, probe })
    }
}

/// One open SMTP session and a second handle on its socket, which answers
/// "has the server closed this, or said something unasked?" without a round
/// trip ([`Conn::server_spoke`]). The two are dropped together, so the socket
/// closes when the session is dropped.
pub(crate) struct Conn {
    pub(crate) smtp: AsyncSmtpConnection,
    probe: std::net::TcpStream,
}

impl Conn {
    /// True when the server has closed the connection or sent bytes nobody
    /// asked for (a `421` before it closes, a TLS alert): either way the
    /// session is over. Peeks at the socket without reading from it and
    /// without waiting; an idle, healthy session has nothing to read.
    pub(crate) fn server_spoke(&self) -> bool {
        match self.probe.peek(&mut [0u8; 1]) {
            Err(e) if e.kind() == io::ErrorKind::WouldBlock => false,
            Ok(_) | Err(_) => true,
        }
    }
}

/// The stream handed back to tokio, and a duplicate of its socket for
/// [`Conn::server_spoke`] (non-blocking: the flag belongs to the socket).
fn with_probe(tcp: TcpStream) -> io::Result<(TcpStream, std::net::TcpStream)> {
    let std = tcp.into_std()?;
    let probe = std.try_clone()?;
    Ok((TcpStream::from_std(std)?, probe))
}

impl fmt::Debug for Connector {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("Connector")
            .field("host", &self.host)
            .field("port", &self.port)
            .field("auth", &self.credentials.is_some())
            .finish_non_exhaustive()
    }
}

/// Implicit TLS (`smtps://`) on a TCP stream we connected (so `TCP_NODELAY`
/// is set), made by lettre's own TLS code with the same parameters as
/// STARTTLS, and handed back to lettre as a pre-connected stream. lettre has
/// no other way to start a session on a stream that is already TLS; the
/// stream type it uses for that is public but deprecated (docs/adr/0016).
#[allow(deprecated)]
async fn implicit_tls(tcp: TcpStream, params: TlsParameters) -> Result<TlsOverTcp, Failure> {
    let mut stream = AsyncNetworkStream::use_existing_tokio1(Box::new(tcp));
    stream
        .upgrade_tls(params)
        .await
        .map_err(|e| Failure::Connect(format!("TLS failed: {e}")))?;
    Ok(TlsOverTcp(stream.compat()))
}

/// lettre's TLS stream (futures-io) seen as a tokio stream.
#[allow(deprecated)]
#[derive(Debug)]
struct TlsOverTcp(Compat<AsyncNetworkStream>);

impl AsyncRead for TlsOverTcp {
    fn poll_read(
        self: Pin<&mut Self>,
        cx: &mut Context<'_>,
        buf: &mut ReadBuf<'_>,
    ) -> Poll<io::Result<()>> {
        Pin::new(&mut self.get_mut().0).poll_read(cx, buf)
    }
}

impl AsyncWrite for TlsOverTcp {
    fn poll_write(
        self: Pin<&mut Self>,
        cx: &mut Context<'_>,
        buf: &[u8],
    ) -> Poll<io::Result<usize>> {
        Pin::new(&mut self.get_mut().0).poll_write(cx, buf)
    }

    fn poll_flush(self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<io::Result<()>> {
        Pin::new(&mut self.get_mut().0).poll_flush(cx)
    }

    fn poll_shutdown(self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<io::Result<()>> {
        Pin::new(&mut self.get_mut().0).poll_shutdown(cx)
    }
}

impl AsyncTokioStream for TlsOverTcp {
    fn peer_addr(&self) -> io::Result<SocketAddr> {
        self.0.get_ref().peer_addr()
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// Every connection sets `TCP_NODELAY` (docs/adr/0016), checked on the
    /// socket lettre's session writes to: a deterministic pin beside the
    /// timing test `one_connection_is_not_held_back_by_nagle`. Seen failing
    /// with `set_nodelay(false)` (mutation `email_nodelay`).
    #[tokio::test]
    async fn every_connection_sets_tcp_nodelay() {
        use tokio::io::{AsyncBufReadExt, AsyncWriteExt, BufReader};
        let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
        let port = listener.local_addr().unwrap().port();
        tokio::spawn(async move {
            let (s, _) = listener.accept().await.unwrap();
            let mut s = BufReader::new(s);
            s.get_mut().write_all(b"220 test ESMTP\r\n").await.unwrap();
            let mut line = String::new();
            while s.read_line(&mut line).await.unwrap_or(0) > 0 {
                s.get_mut().write_all(b"250 test\r\n").await.unwrap();
                line.clear();
            }
        });
        let url = SmtpUrl::parse(&format!("smtp://127.0.0.1:{port}")).unwrap();
        let connector = Connector::new(&url, None, Duration::from_secs(5)).unwrap();
        let conn = connector.connect().await.unwrap();
        assert!(conn.probe.nodelay().unwrap());
    }

    /// A user without a password (or the reverse) is refused: lettre sent no
    /// AUTH without both, and the relay refused every message (530) instead.
    /// A CA with a plain `smtp://` URL is refused: nothing would use it.
    /// Mutations `smtp_half_credentials`, `smtp_ca_without_tls`; seen failing.
    #[test]
    fn half_credentials_and_a_ca_without_tls_are_refused() {
        for url in [
            "smtp://mailer@127.0.0.1:25?tls=required",
            "smtps://mailer:@relay.example.com",
            "smtps://:hunter2@relay.example.com",
        ] {
            assert_eq!(
                SmtpUrl::parse(url).unwrap_err(),
                SmtpUrlError::HalfCredentials,
                "{url}"
            );
        }
        let plain = SmtpUrl::parse("smtp://127.0.0.1:25").unwrap();
        let err = Connector::new(&plain, Some(b"not pem"), Duration::from_secs(1))
            .err()
            .unwrap();
        assert_eq!(err, SmtpUrlError::CaWithoutTls);
        assert!(err.to_string().contains("HARDCOUNT_SMTP_CA_FILE"), "{err}");
    }

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

    /// Which URLs would send a password over a connection that may be plain:
    /// AUTH on bare `smtp://` or with `tls=opportunistic`, never on `smtps://`,
    /// `tls=required`, or without credentials.
    #[test]
    fn credentials_in_clear_are_told_apart() {
        for (url, clear) in [
            ("smtp://u:p@mail.example.com", true),
            ("smtp://u:p@mail.example.com?tls=opportunistic", true),
            ("smtp://u:p@mail.example.com?tls=required", false),
            ("smtps://u:p@mail.example.com", false),
            ("smtp://mail.example.com", false),
        ] {
            let u = SmtpUrl::parse(url).unwrap();
            assert_eq!(u.credentials_may_travel_in_clear(), clear, "{url}");
        }
    }
}
