//! One signed POST: the SSRF check, the request, a bounded read of the answer.

use std::time::{Duration, Instant, SystemTime};

use reqwest::header::{CONTENT_TYPE, RETRY_AFTER};
use url::Url;

use crate::backoff::parse_retry_after;
use crate::signature::{HEADER_ID, HEADER_SIGNATURE, HEADER_TIMESTAMP, Secret, sign};
use crate::ssrf::{Allowlist, SsrfError, check_url};

/// What one request produced.
#[derive(Debug)]
pub(crate) enum Answer {
    /// The receiver answered with a status (the body may have been cut short).
    Status {
        code: u16,
        retry_after: Option<Duration>,
        /// The start of the body, at most the configured bound.
        body: Vec<u8>,
    },
    /// The SSRF guard refused the target; no connection was made to it.
    Refused(String),
    /// No answer: a timeout, a connection failure, or a broken response.
    Failed(String),
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
    pub body: Vec<u8>,
}

/// Limits of one attempt.
pub(crate) struct Limits<'a> {
    pub allowlist: &'a Allowlist,
    /// From the start of the request until the last byte read.
    pub timeout: Duration,
    pub max_response_bytes: usize,
}

/// POST `req`, signed for this attempt's timestamp. Never takes longer than
/// `limits.timeout`: a status that arrived in time counts even if the body
/// then stalls, and reading stops after `max_response_bytes`.
pub(crate) async fn post(client: &reqwest::Client, req: Request<'_>, limits: &Limits<'_>) -> Sent {
    let started = Instant::now();
    if let Err(refused) = check_url(req.url, limits.allowlist) {
        return Sent {
            answer: Answer::Refused(refused.to_string()),
            latency: started.elapsed(),
        };
    }
    let deadline = tokio::time::Instant::from_std(started + limits.timeout);
    let timestamp = SystemTime::now()
        .duration_since(SystemTime::UNIX_EPOCH)
        .map_or(0, |d| d.as_secs());
    let timestamp = i64::try_from(timestamp).unwrap_or(i64::MAX);
    let signature = sign(req.secret, req.message_id, timestamp, &req.body);
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
                answer: Answer::Failed(format!(
                    "timed out after {:?} without a response",
                    limits.timeout
                )),
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
    let body = read_bounded(&mut response, limits.max_response_bytes, deadline).await;
    // Dropping a response that was not read to the end closes its connection.
    drop(response);
    Sent {
        answer: Answer::Status {
            code,
            retry_after,
            body,
        },
        latency,
    }
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
/// failure described without the URL (the caller logs which endpoint it was).
fn classify(e: reqwest::Error) -> Answer {
    let mut source: Option<&(dyn std::error::Error + 'static)> = Some(&e);
    while let Some(err) = source {
        if let Some(refused) = err.downcast_ref::<SsrfError>() {
            return Answer::Refused(refused.to_string());
        }
        source = err.source();
    }
    let kind = if e.is_timeout() {
        "timed out"
    } else if e.is_connect() {
        "connection failed"
    } else {
        "request failed"
    };
    Answer::Failed(format!("{kind}: {}", describe(&e.without_url())))
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
