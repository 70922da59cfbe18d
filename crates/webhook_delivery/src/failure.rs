//! What `last_error` says: a category, never the detail.
//!
//! `last_error` is read by whoever reads the deliveries table (support, a tenant
//! dashboard to come), so it must not carry what only the operator may see: the
//! private addresses a name resolved to, a receiver's response body, a TLS
//! library's message. The attempt logs the detail (operator log only) and stores
//! one of these words (issue 12, point 8).

/// Why an attempt did not deliver, as stored in `last_error`.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Failure {
    /// No response within the request timeout.
    Timeout,
    /// The receiver's host refused the connection.
    Refused,
    /// Any other failure to connect (unreachable, reset).
    Connect,
    /// The TLS handshake failed (certificate, protocol).
    Tls,
    /// The name did not resolve, or resolved to nothing.
    Dns,
    /// The SSRF guard refused the target: a forbidden address, scheme or port.
    SsrfRefused,
    /// A 3xx answer (redirects are not followed).
    Http3xx,
    /// A 4xx answer other than 410.
    Http4xx,
    /// A 5xx answer.
    Http5xx,
    /// A status outside 200–599.
    HttpOther,
    /// 410 Gone: the endpoint is disabled.
    EndpointGone,
    /// A failure answer whose receiver asked that the message not be sent
    /// again (`webhook-delivery: abort-message`): dead at once.
    Aborted,
    /// The endpoint was disabled before the attempt.
    EndpointDisabled,
    /// The stored endpoint URL does not parse.
    BadUrl,
    /// The stored endpoint secret is unusable.
    BadSecret,
    /// The request failed in some other way (a broken response).
    Request,
    /// Processing the delivery panicked (a bug of this service; the panic's
    /// message is in the operator log only).
    Panicked,
}

impl Failure {
    /// The word stored in `last_error`.
    pub fn as_str(self) -> &'static str {
        match self {
            Failure::Timeout => "timeout",
            Failure::Refused => "refused",
            Failure::Connect => "connect",
            Failure::Tls => "tls",
            Failure::Dns => "dns",
            Failure::SsrfRefused => "ssrf_refused",
            Failure::Http3xx => "http_3xx",
            Failure::Http4xx => "http_4xx",
            Failure::Http5xx => "http_5xx",
            Failure::HttpOther => "http_other",
            Failure::EndpointGone => "endpoint_gone",
            Failure::Aborted => "aborted",
            Failure::EndpointDisabled => "endpoint_disabled",
            Failure::BadUrl => "bad_url",
            Failure::BadSecret => "bad_secret",
            Failure::Request => "request_failed",
            Failure::Panicked => "panicked",
        }
    }

    /// The category of a failure status `code` (not 2xx).
    pub fn of_status(code: u16) -> Failure {
        match code {
            410 => Failure::EndpointGone,
            300..=399 => Failure::Http3xx,
            400..=499 => Failure::Http4xx,
            500..=599 => Failure::Http5xx,
            _ => Failure::HttpOther,
        }
    }
}

impl std::fmt::Display for Failure {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(self.as_str())
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_status_has_one_category() {
        for (code, want) in [
            (301, "http_3xx"),
            (400, "http_4xx"),
            (410, "endpoint_gone"),
            (429, "http_4xx"),
            (500, "http_5xx"),
            (503, "http_5xx"),
            (102, "http_other"),
            (600, "http_other"),
        ] {
            assert_eq!(Failure::of_status(code).as_str(), want, "{code}");
        }
    }
}
