//! One signed POST: the SSRF check, the request, a bounded read of the answer.

use std::time::{Duration, Instant, SystemTime};

use reqwest::header::{CONTENT_TYPE, RETRY_AFTER};
use url::Url;

use crate::backoff::parse_retry_after;
use crate::failure::Failure;
use crate::signature::{HEADER_ID, HEADER_SIGNATURE, HEADER_TIMESTAMP, Secret, sign_all};
use crate::ssrf::{Allowlist, Ports, SsrfError, check_url};

/// What one request produced.
#[derive(Debug)]
pub(crate) enum Answer {
    /// The receiver answered with a status (the body may have been cut short).
    Status {
        code: u16,
        retry_after: Option<Duration>,
        /// The receiver asked that this message not be sent again
        /// ([`ABORT_HEADER`]: [`ABORT_VALUE`]).
        abort: bool,
        /// The start of the body, at most the configured bound.
        body: Vec<u8>,
    },
    /// The SSRF guard refused the target (or its name did not resolve); no
    /// connection was made to it. `detail` is for the operator log only.
    Refused { category: Failure, detail: String },
    /// No answer: a timeout, a connection failure, or a broken response.
    /// `detail` is for the operator log only.
    Failed { category: Failure, detail: String },
}

#[derive(Debug)]
pub(crate) struct Sent {
    pub answer: Answer,
    /// Until the status line arrived, or until the failure.
    pub latency: Duration,
}

/// What to send, built once per attempt.
pub(crate) struct Request<'a> {
    pub url: &'a Url,
    pub message_id: &'a str,
    pub secret: &'a Secret,
    /// The previous secret while a rotation's overlap lasts: signed with too.
    pub previous_secret: Option<&'a Secret>,
    pub body: Vec<u8>,
}

/// Limits of one attempt.
pub(crate) struct Limits<'a> {
    pub allowlist: &'a Allowlist,
    pub ports: Ports,
    /// From the start of the request until the last byte read.
    pub timeout: Duration,
    pub max_response_bytes: usize,
}

/// POST `req`, signed for this attempt's timestamp. Never takes longer than
/// `limits.timeout`: a status that arrived in time counts even if the body
/// then stalls, and reading stops after `max_response_bytes`.
pub(crate) async fn post(client: &reqwest::Client, req: Request<'_>, limits: &Limits<'_>) -> Sent {
    let started = Instant::now();
    if let Err(refused) = check_url(req.url, limits.allowlist, limits.ports) {
        return Sent {
            answer: refusal(&refused),
            latency: started.elapsed(),
        };
    }
    let deadline = tokio::time::Instant::from_std(started + limits.timeout);
    let timestamp = SystemTime::now()
        .duration_since(SystemTime::UNIX_EPOCH)
        .map_or(0, |d| d.as_secs());
    let timestamp = i64::try_from(timestamp).unwrap_or(i64::MAX);
    let secrets: Vec<&Secret> = std::iter::once(req.secret)
        .chain(req.previous_secret)
        .collect();
    let signature = sign_all(&secrets, req.message_id, timestamp, &req.body);
    let request = client
        .post(req.url.clone())
        .header(CONTENT_TYPE, "application/json")
        .header(HEADER_ID, req.message_id)
        .header(HEADER_TIMESTAMP, timestamp.to_string())
        .header(HEADER_SIGNATURE, signature)
        .body(req.body)
        .send();
    let mut response = match tokio::time::timeout_at(deadline, request).await {
        Err(_) => {
            return Sent {
                answer: Answer::Failed {
                    category: Failure::Timeout,
                    detail: format!("timed out after {:?} without a response", limits.timeout),
                },
                latency: started.elapsed(),
            };
        }
        Ok(Err(e)) => {
            return Sent {
                answer: classify(e),
                latency: started.elapsed(),
            };
        }
        Ok(Ok(response)) => response,
    };
    let latency = started.elapsed();
    let code = response.status().as_u16();
    let retry_after = response
        .headers()
        .get(RETRY_AFTER)
        .and_then(|v| v.to_str().ok())
        .and_then(|v| parse_retry_after(v, SystemTime::now()));
    let abort = asks_abort(response.headers());
    let body = read_bounded(&mut response, limits.max_response_bytes, deadline).await;
    // Dropping a response that was not read to the end closes its connection.
    drop(response);
    Sent {
        answer: Answer::Status {
            code,
            retry_after,
            abort,
            body,
        },
        latency,
    }
}

/// The answer header by which a receiver stops the retries of one message
/// without turning its endpoint off (410 does that): `webhook-delivery:
/// abort-message` on a failure answer makes the delivery dead at once.
pub const ABORT_HEADER: &str = "webhook-delivery";
/// The value of [`ABORT_HEADER`] that stops the retries (case-insensitive).
pub const ABORT_VALUE: &str = "abort-message";

fn asks_abort(headers: &reqwest::header::HeaderMap) -> bool {
    headers
        .get_all(ABORT_HEADER)
        .iter()
        .filter_map(|v| v.to_str().ok())
        .flat_map(|v| v.split(','))
        .any(|v| v.trim().eq_ignore_ascii_case(ABORT_VALUE))
}

/// Up to `max` bytes of the body; stops early at the deadline or on an error.
async fn read_bounded(
    response: &mut reqwest::Response,
    max: usize,
    deadline: tokio::time::Instant,
) -> Vec<u8> {
    let mut body = Vec::new();
    while body.len() < max {
        match tokio::time::timeout_at(deadline, response.chunk()).await {
            Ok(Ok(Some(chunk))) => {
                let room = max - body.len();
                body.extend_from_slice(&chunk[..chunk.len().min(room)]);
            }
            Ok(Ok(None) | Err(_)) | Err(_) => break,
        }
    }
    body
}

/// A request error as a refusal (the guard inside the resolver said no) or a
/// failure described without the URL (the caller logs which endpoint it was),
/// each with its [`Failure`] category.
fn classify(e: reqwest::Error) -> Answer {
    let mut source: Option<&(dyn std::error::Error + 'static)> = Some(&e);
    let mut io_kind = None;
    while let Some(err) = source {
        if let Some(refused) = err.downcast_ref::<SsrfError>() {
            return refusal(refused);
        }
        if let Some(io) = err.downcast_ref::<std::io::Error>() {
            io_kind.get_or_insert(io.kind());
        }
        source = err.source();
    }
    let (timeout, connect) = (e.is_timeout(), e.is_connect());
    let detail = describe(&e.without_url());
    let category = if timeout {
        Failure::Timeout
    } else if io_kind == Some(std::io::ErrorKind::ConnectionRefused) {
        Failure::Refused
    } else if connect && looks_like_tls(&detail, io_kind) {
        Failure::Tls
    } else if connect {
        Failure::Connect
    } else {
        Failure::Request
    };
    let kind = match category {
        Failure::Timeout => "timed out",
        Failure::Request => "request failed",
        _ => "connection failed",
    };
    Answer::Failed {
        category,
        detail: format!("{kind}: {detail}"),
    }
}

/// rustls reports a failed handshake as an `InvalidData` I/O error under the
/// connect error; its message names the certificate or TLS.
fn looks_like_tls(detail: &str, io_kind: Option<std::io::ErrorKind>) -> bool {
    let detail = detail.to_ascii_lowercase();
    io_kind == Some(std::io::ErrorKind::InvalidData)
        || detail.contains("certificate")
        || detail.contains("tls")
}

/// The SSRF guard's refusal: a name that did not resolve is `dns`, the rest
/// (forbidden address, scheme, port) `ssrf_refused`.
fn refusal(refused: &SsrfError) -> Answer {
    let category = match refused {
        SsrfError::Resolve { .. } | SsrfError::NoAddresses { .. } => Failure::Dns,
        _ => Failure::SsrfRefused,
    };
    Answer::Refused {
        category,
        detail: refused.to_string(),
    }
}

/// An error and its causes, joined, skipping a cause its parent already says.
fn describe(e: &(dyn std::error::Error + 'static)) -> String {
    let mut parts: Vec<String> = vec![e.to_string()];
    let mut source = e.source();
    while let Some(err) = source {
        let text = err.to_string();
        if parts.last().is_none_or(|p| !p.contains(&text)) {
            parts.push(text);
        }
        source = err.source();
    }
    parts.join(": ")
}
