//! URLs and errors fit to print: every credential a URL carries is replaced by
//! `***`.
//!
//! A URL carries a credential in two places: the password of its userinfo
//! (`postgres://app:hunter2@db/x`) and query parameters (libpq and sqlx read
//! `?password=hunter2`; providers use `?api_key=`, `?token=`). The URL is parsed
//! (the `url` crate, as sqlx and lettre parse it), never pattern-matched, so an
//! `@` or `:` inside a parameter (`?application_name=a@b`) cannot shift what is
//! hidden. This is the one redactor: database URLs (`db`), SMTP and endpoint URLs
//! (through `webhook_delivery::redacted_url` and `hardcount`) all call it.

use url::Url;
use url::form_urlencoded;

/// What a redacted credential reads as.
pub const REDACTED: &str = "***";

/// What is printed in place of a URL that does not parse: its text may be a
/// credential in any position, so none of it is shown.
pub const UNPARSEABLE: &str = "<a URL that does not parse; not shown>";

/// Whether a query parameter named `name` carries a credential: `password`, or
/// any name holding `pass`, `secret`, `key` or `token` (case-insensitive;
/// `sslpassword`, `api_key`, `access_token`, `client_secret`, `sslkey`).
pub fn is_secret_parameter(name: &str) -> bool {
    let name = name.to_ascii_lowercase();
    ["pass", "secret", "key", "token"]
        .iter()
        .any(|word| name.contains(word))
}

/// `url` with the password of its userinfo and the value of every secret query
/// parameter ([`is_secret_parameter`]) replaced by `***`, for logs and errors.
/// The user name, host, path and other parameters are kept as written. A URL that
/// does not parse is not shown at all ([`UNPARSEABLE`]).
pub fn redacted_url(url: &str) -> String {
    match Url::parse(url.trim()) {
        Ok(parsed) => redacted(&parsed),
        Err(_) => UNPARSEABLE.to_owned(),
    }
}

/// [`redacted_url`] for a URL already parsed.
pub fn redacted(url: &Url) -> String {
    let mut shown = url.clone();
    if shown.password().is_some() {
        // Fails only for a URL that cannot hold a password, which then has none.
        let _ = shown.set_password(Some(REDACTED));
    }
    if let Some(query) = url.query() {
        let pairs: Vec<String> = query
            .split('&')
            .map(|pair| {
                let raw_name = pair.split_once('=').map_or(pair, |(n, _)| n);
                if is_secret_parameter(&decoded(raw_name)) {
                    format!("{raw_name}={REDACTED}")
                } else {
                    pair.to_owned()
                }
            })
            .collect();
        shown.set_query(Some(&pairs.join("&")));
    }
    shown.to_string()
}

/// `text` (an error that may quote `url` or its parts) with every credential of
/// `url` replaced by `***`: the userinfo password and each secret parameter's
/// value, both as written and decoded. A URL that does not parse has no parts
/// to find: `text` is returned as is (sqlx's and url's parse errors do not quote
/// the input).
pub fn redact_error(text: &str, url: &str) -> String {
    let Ok(parsed) = Url::parse(url.trim()) else {
        return text.to_owned();
    };
    let mut secrets: Vec<String> = Vec::new();
    if let Some(p) = parsed.password() {
        secrets.push(p.to_owned());
        secrets.push(decoded_userinfo(p));
    }
    if let Some(query) = parsed.query() {
        for pair in query.split('&') {
            if let Some((name, value)) = pair.split_once('=')
                && is_secret_parameter(&decoded(name))
            {
                secrets.push(value.to_owned());
                secrets.push(decoded(value));
            }
        }
    }
    secrets.retain(|s| !s.is_empty());
    // Longest first, so a secret that contains another is replaced whole.
    secrets.sort_by_key(|s| std::cmp::Reverse(s.len()));
    let mut out = text.to_owned();
    for s in &secrets {
        out = out.replace(s.as_str(), REDACTED);
    }
    out
}

/// A query component decoded as application/x-www-form-urlencoded.
fn decoded(raw: &str) -> String {
    form_urlencoded::parse(raw.as_bytes())
        .next()
        .map(|(name, _)| name.into_owned())
        .unwrap_or_default()
}

/// A userinfo component percent-decoded (`+` is literal there).
fn decoded_userinfo(raw: &str) -> String {
    percent_encoding::percent_decode_str(raw)
        .decode_utf8_lossy()
        .into_owned()
}

#[cfg(test)]
mod tests {
    use super::*;

    /// Each row: a URL, what is printed, and a secret that must not appear. Removing
    /// the query pass (the issue-12 leak: `?password=hunter2` printed by `hardcount
    /// migrate`) fails the query rows; pattern-matching on `@` fails the `a@b` rows.
    #[test]
    fn redacted_url_hides_every_credential_and_keeps_the_rest() {
        let rows = [
            (
                "postgres://app:s3cret@db:6432/x",
                "postgres://app:***@db:6432/x",
                "s3cret",
            ),
            ("postgres://app@db/x", "postgres://app@db/x", "-"),
            (
                "postgres://app:p%40ss%2Fw0rd@db:6432/x",
                "postgres://app:***@db:6432/x",
                "w0rd",
            ),
            (
                "postgres://app@127.0.0.1:1/db?password=hunter2",
                "postgres://app@127.0.0.1:1/db?password=***",
                "hunter2",
            ),
            (
                "postgres://app@db/x?application_name=a@b&password=hunter2",
                "postgres://app@db/x?application_name=a@b&password=***",
                "hunter2",
            ),
            (
                "postgres://app:hunter2@db/x?application_name=a@b",
                "postgres://app:***@db/x?application_name=a@b",
                "hunter2",
            ),
            (
                "postgres://app:pw1@db/x?sslmode=require&sslpassword=pw2&application_name=x:y@z",
                "postgres://app:***@db/x?sslmode=require&sslpassword=***&application_name=x:y@z",
                "pw2",
            ),
            (
                "https://api.example.com/v1?API_Key=k1&access_token=t1&client_secret=s1&page=2",
                "https://api.example.com/v1?API_Key=***&access_token=***&client_secret=***&page=2",
                "k1",
            ),
            (
                "smtps://mailer:m41l@smtp.example.com:465?tls=required",
                "smtps://mailer:***@smtp.example.com:465?tls=required",
                "m41l",
            ),
            ("postgres://u:hunter2@h:notaport/x", UNPARSEABLE, "hunter2"),
        ];
        for (url, want, secret) in rows {
            let got = redacted_url(url);
            assert_eq!(got, want, "{url}");
            assert!(!got.contains(secret), "{url} -> {got}");
        }
    }

    #[test]
    fn redact_error_hides_the_credentials_of_the_url_in_any_text() {
        let url = "postgres://app:p%40ss@db/x?application_name=a@b&password=hunter%202";
        let text =
            "password authentication failed (p@ss / p%40ss / hunter 2 / hunter%202), app a@b";
        assert_eq!(
            redact_error(text, url),
            "password authentication failed (*** / *** / *** / ***), app a@b"
        );
        assert_eq!(redact_error("no url", "not a url"), "no url");
    }

    #[test]
    fn secret_parameters_are_named_by_what_they_hold() {
        for name in [
            "password",
            "sslpassword",
            "api_key",
            "Token",
            "client_secret",
            "sslkey",
        ] {
            assert!(is_secret_parameter(name), "{name}");
        }
        for name in ["application_name", "sslmode", "host", "tls", "dbname"] {
            assert!(!is_secret_parameter(name), "{name}");
        }
    }
}
