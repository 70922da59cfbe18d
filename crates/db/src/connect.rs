//! A database URL turned into connect options, TLS included (docs/adr/0030).
//!
//! Every URL the service takes goes through [`connect_options`]: the app pool,
//! migrations and the LISTEN connection. sqlx reads `sslmode` (`disable`,
//! `allow`, `prefer`, `require`, `verify-ca`, `verify-full`) and `sslrootcert`
//! (a PEM file, or the PEM text itself) from the URL; this module checks them
//! first, so a typo is refused when the process starts instead of on the first
//! connection, and an error never shows the URL's password:
//!
//! - an unknown `sslmode` is refused, naming the values it may take;
//! - an `sslrootcert` that cannot be read, or holds no PEM certificate, is
//!   refused (sqlx would skip a file without certificates and verify against
//!   the public roots alone);
//! - `sslmode=require` with an `sslrootcert` verifies the chain, as libpq does
//!   (`verify-ca`); sqlx alone would check nothing.
//!
//! Verification uses the certificates of `sslrootcert` and the public roots
//! (webpki-roots), with rustls on the aws-lc-rs provider.

use std::path::Path;

use sqlx::postgres::{PgConnectOptions, PgSslMode};
use url::Url;

use crate::{Error, redact_error, redacted_url};

/// The `sslmode` values a URL may give, as libpq spells them.
pub const SSL_MODES: [&str; 6] = [
    "disable",
    "allow",
    "prefer",
    "require",
    "verify-ca",
    "verify-full",
];

const PEM_CERTIFICATE: &str = "-----BEGIN CERTIFICATE-----";

/// The query parameters sqlx 0.9's Postgres URL parser uses (besides
/// `options[…]`); any other it logs, value and all, and ignores.
const SQLX_PARAMETERS: [&str; 18] = [
    "sslmode",
    "ssl-mode",
    "sslrootcert",
    "ssl-root-cert",
    "ssl-ca",
    "sslcert",
    "ssl-cert",
    "sslkey",
    "ssl-key",
    "statement-cache-capacity",
    "host",
    "hostaddr",
    "port",
    "dbname",
    "user",
    "password",
    "application_name",
    "options",
];

/// Check `url` as the service will use it: it parses as a Postgres URL, its
/// `sslmode` is one of [`SSL_MODES`] and its `sslrootcert` holds a certificate.
/// Nothing connects. Call it where the URL enters, to name its variable.
///
/// # Errors
/// [`Error::BadUrl`], saying what is wrong, with the URL shown redacted.
pub fn check_url(url: &str) -> Result<(), Error> {
    connect_options(url).map(drop)
}

/// The connect options `url` gives, after [`check_url`]'s checks.
pub(crate) fn connect_options(url: &str) -> Result<PgConnectOptions, Error> {
    options_or_refusal(url)
        .map_err(|reason| Error::BadUrl(format!("{}: {reason}", redacted_url(url))))
}

/// [`connect_options`], or why not (with no part of the URL in it but the
/// `sslmode` and `sslrootcert` values).
pub(crate) fn options_or_refusal(url: &str) -> Result<PgConnectOptions, String> {
    let parsed = Url::parse(url.trim()).map_err(|e| e.to_string())?;
    let mut mode = None;
    let mut root_cert = None;
    // As sqlx reads them: the last occurrence wins.
    for (key, value) in parsed.query_pairs() {
        match &*key {
            "sslmode" | "ssl-mode" => mode = Some(value.into_owned()),
            "sslrootcert" | "ssl-root-cert" | "ssl-ca" => root_cert = Some(value.into_owned()),
            // sqlx logs a parameter it does not use with its value, at warn
            // (docs/adr/0107): a secret one (libpq's `sslpassword`) is refused
            // here, by its name only, before the parse could print it.
            k if !SQLX_PARAMETERS.contains(&k)
                && !k.starts_with("options[")
                && crate::redact::is_secret_parameter(k) =>
            {
                return Err(format!(
                    "connect parameter {k} is not one the Postgres client uses, and it \
                     would log its value as ignored: remove it"
                ));
            }
            _ => {}
        }
    }
    if let Some(mode) = &mode
        && !SSL_MODES.contains(&mode.to_ascii_lowercase().as_str())
    {
        return Err(format!(
            "unknown sslmode {mode:?} (one of {})",
            SSL_MODES.join(", ")
        ));
    }
    if let Some(cert) = &root_cert {
        check_root_cert(cert)?;
    }
    let mut options: PgConnectOptions = url
        .parse()
        .map_err(|e: sqlx::Error| redact_error(&e.to_string(), url))?;
    // sqlx takes every `sslrootcert` for a path: PEM text written in the URL,
    // which the check above accepts, would be opened as a file at the first
    // connection and fail there (docs/adr/0107).
    if let Some(pem) = root_cert
        .as_ref()
        .filter(|c| c.starts_with(PEM_CERTIFICATE))
    {
        options = options.ssl_root_cert_from_pem(pem.clone().into_bytes());
    }
    if root_cert.is_some() && matches!(options.get_ssl_mode(), PgSslMode::Require) {
        // libpq: "if a root CA file exists, the behavior of sslmode=require
        // will be the same as that of verify-ca".
        return Ok(options.ssl_mode(PgSslMode::VerifyCa));
    }
    Ok(options)
}

/// An `sslrootcert` is PEM text or the path of a readable file holding PEM
/// certificates.
fn check_root_cert(cert: &str) -> Result<(), String> {
    if cert.starts_with(PEM_CERTIFICATE) {
        return Ok(());
    }
    let text = std::fs::read(Path::new(cert))
        .map_err(|e| format!("sslrootcert {cert}: cannot be read ({e})"))?;
    if !String::from_utf8_lossy(&text).contains(PEM_CERTIFICATE) {
        return Err(format!("sslrootcert {cert}: holds no PEM certificate"));
    }
    Ok(())
}

/// A connection error on `url`: a failed TLS handshake (or a server without
/// TLS when the URL requires it) becomes [`Error::Tls`], naming the URL.
pub(crate) fn connect_error(e: sqlx::Error, url: &str) -> Error {
    let detail = match &e {
        sqlx::Error::Tls(inner) => inner.to_string(),
        // rustls reports a refused certificate through the socket, as
        // InvalidData wrapping its own error: while connecting, nothing else does.
        sqlx::Error::Io(io)
            if io.kind() == std::io::ErrorKind::InvalidData && io.get_ref().is_some() =>
        {
            io.to_string()
        }
        _ => return Error::Sql(e),
    };
    Error::Tls {
        url: redacted_url(url),
        detail: redact_error(&detail, url),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// Each row: a URL, and a fragment of its refusal (`None`: accepted).
    #[test]
    fn urls_are_checked_for_their_tls_settings_without_showing_the_password() {
        let dir = std::env::temp_dir().join(format!("db-connect-test-{}", std::process::id()));
        std::fs::create_dir_all(&dir).unwrap();
        let ca = dir.join("ca.pem");
        std::fs::write(
            &ca,
            format!("{PEM_CERTIFICATE}\nMIIB\n-----END CERTIFICATE-----\n"),
        )
        .unwrap();
        let key = dir.join("server.key");
        std::fs::write(&key, "-----BEGIN PRIVATE KEY-----\n").unwrap();
        let (ca, key) = (ca.display(), key.display());
        let rows: Vec<(String, Option<&str>)> =
            vec![
            ("postgres://app:hunter2@db/x".into(), None),
            ("postgres://app:hunter2@db/x?sslmode=disable".into(), None),
            ("postgres://app:hunter2@db/x?sslmode=Verify-Full".into(), None),
            (
                format!("postgres://app:hunter2@db/x?sslmode=verify-full&sslrootcert={ca}"),
                None,
            ),
            (
                format!("postgres://app:hunter2@db/x?ssl-mode=require&ssl-ca={ca}"),
                None,
            ),
            (
                "postgres://app:hunter2@db/x?sslmode=verify_full".into(),
                Some("unknown sslmode \"verify_full\" (one of disable, allow"),
            ),
            (
                "postgres://app:hunter2@db/x?sslmode=".into(),
                Some("unknown sslmode \"\""),
            ),
            (
                "postgres://app:hunter2@db/x?sslmode=verify-full&sslrootcert=/nonexistent/ca.pem"
                    .into(),
                Some("sslrootcert /nonexistent/ca.pem: cannot be read"),
            ),
            (
                format!("postgres://app:hunter2@db/x?sslmode=verify-full&sslrootcert={key}"),
                Some("holds no PEM certificate"),
            ),
            (
                "postgres://app:hunter2@db:notaport/x".into(),
                Some("invalid port"),
            ),
            // sqlx would log this one's value as an ignored parameter (mutation
            // `unknown_secret_parameter_parsed`); a parameter it ignores that
            // is not secret is left to its warning.
            (
                "postgres://app@db/x?sslmode=require&sslpassword=hunter2".into(),
                Some("connect parameter sslpassword is not one the Postgres client uses"),
            ),
            ("postgres://app:hunter2@db/x?connect_timeout=10".into(), None),
        ];
        for (url, refusal) in rows {
            let got = check_url(&url);
            match (refusal, got) {
                (None, Ok(())) => {}
                (Some(want), Err(e)) => {
                    let text = e.to_string();
                    assert!(text.contains(want), "{url}: {text}");
                    assert!(text.starts_with("invalid database URL"), "{url}: {text}");
                    assert!(!text.contains("hunter2"), "{url}: {text}");
                }
                (want, got) => panic!("{url}: wanted {want:?}, got {got:?}"),
            }
        }
        let _ = std::fs::remove_dir_all(&dir);
    }

    #[test]
    fn require_with_a_root_certificate_verifies_the_chain_as_libpq_does() {
        let pem = format!("{PEM_CERTIFICATE}\nMIIB\n-----END CERTIFICATE-----");
        let encoded: String = url::form_urlencoded::byte_serialize(pem.as_bytes()).collect();
        let rows = [
            ("sslmode=require".to_owned(), PgSslMode::Require),
            (
                format!("sslmode=require&sslrootcert={encoded}"),
                PgSslMode::VerifyCa,
            ),
            (
                format!("sslmode=verify-full&sslrootcert={encoded}"),
                PgSslMode::VerifyFull,
            ),
            (
                format!("sslmode=prefer&sslrootcert={encoded}"),
                PgSslMode::Prefer,
            ),
        ];
        for (query, want) in rows {
            let options = connect_options(&format!("postgres://app@db/x?{query}")).unwrap();
            let got = options.get_ssl_mode();
            assert_eq!(format!("{got:?}"), format!("{want:?}"), "{query}");
        }
    }
}
