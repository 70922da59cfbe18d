//! What an attempt's answer means for its delivery: a pure function of the
//! answer, the attempt number and the retry schedule. No SQL, no I/O.
//!
//! ```text
//!  answer                          attempt < max_attempts     attempt = max_attempts
//!  2xx                             delivered                  delivered
//!  410 Gone                        endpoint gone (dead, endpoint disabled)
//!  other failure + abort header    dead (the endpoint stays on)
//!  other status (Retry-After?)     retry after max(schedule, Retry-After)   dead
//!  no answer / refused by SSRF     retry after the schedule's delay         dead
//!  endpoint disabled (not sent)    dead
//! ```

use std::time::Duration;

use rand::Rng;

use crate::backoff::RetrySchedule;

/// What an attempt heard, as far as its verdict goes.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) enum Heard {
    /// The receiver answered with a status, and maybe `Retry-After`.
    Status {
        code: u16,
        retry_after: Option<Duration>,
        /// The receiver asked that this message not be sent again
        /// (`webhook-delivery: abort-message`).
        abort: bool,
    },
    /// No status: a timeout, a connection failure, a broken response, or an
    /// endpoint whose URL or secret is unusable.
    NoAnswer,
    /// The SSRF guard refused the target; no connection was made.
    Refused,
    /// The endpoint is disabled; nothing was sent.
    EndpointDisabled,
}

/// The state a delivery moves to after an attempt.
#[derive(Debug, Clone, Copy, PartialEq)]
pub(crate) enum Verdict {
    Delivered,
    /// Still pending, due again after this wait.
    RetryAfter(Duration),
    Dead,
    /// 410 Gone: dead, and its endpoint is disabled with it.
    EndpointGone,
}

/// The verdict on attempt number `attempt` (1 for the first) that heard `heard`.
/// A failure is retried after the schedule's jittered delay (postponed, never
/// brought forward, by `Retry-After`) until the schedule is exhausted.
pub(crate) fn verdict(
    heard: Heard,
    attempt: u32,
    schedule: &RetrySchedule,
    jitter: &mut impl Rng,
) -> Verdict {
    let retry_after = match heard {
        Heard::Status { code, .. } if (200..300).contains(&code) => return Verdict::Delivered,
        Heard::Status { code: 410, .. } => return Verdict::EndpointGone,
        Heard::Status { abort: true, .. } => return Verdict::Dead,
        Heard::EndpointDisabled => return Verdict::Dead,
        Heard::Status { retry_after, .. } => retry_after,
        Heard::NoAnswer | Heard::Refused => None,
    };
    match schedule.next_delay_with_retry_after(attempt, retry_after, jitter) {
        Some(wait) => Verdict::RetryAfter(wait),
        None => Verdict::Dead,
    }
}

/// The most of a failed answer's body kept in its attempt history, in
/// characters (`webhook_delivery_attempts_snippet_bounded`).
pub(crate) const MAX_SNIPPET_CHARS: usize = 1024;

/// The start of a failed answer's body for its attempt history: at most
/// [`MAX_SNIPPET_CHARS`] characters, invalid UTF-8 and NUL (which Postgres
/// text cannot hold) replaced by U+FFFD, so writing it cannot fail the
/// outcome.
pub(crate) fn response_snippet(body: &[u8]) -> String {
    String::from_utf8_lossy(body)
        .chars()
        .take(MAX_SNIPPET_CHARS)
        .map(|c| {
            if c == '\0' {
                char::REPLACEMENT_CHARACTER
            } else {
                c
            }
        })
        .collect()
}

/// The operator log's line for a failure status: the code and the start of the
/// body (`last_error` holds only the category, [`crate::failure::Failure`]).
pub(crate) fn status_error(code: u16, body: &[u8]) -> String {
    const SHOWN: usize = 256;
    let text = String::from_utf8_lossy(&body[..body.len().min(SHOWN)]);
    let text = text.trim();
    if text.is_empty() {
        format!("HTTP {code}")
    } else {
        format!("HTTP {code}: {text}")
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_snippet_is_bounded_and_always_storable() {
        let long = "é".repeat(MAX_SNIPPET_CHARS + 10);
        assert_eq!(
            response_snippet(long.as_bytes()).chars().count(),
            MAX_SNIPPET_CHARS
        );
        assert_eq!(response_snippet(b"a\0b\xff"), "a\u{fffd}b\u{fffd}");
        assert_eq!(response_snippet(b""), "");
    }

    /// What a case expects: a state, or a retry within jitter bounds (seconds).
    #[derive(Debug)]
    enum Expect {
        Delivered,
        Dead,
        EndpointGone,
        RetryWithin(f64, f64),
    }

    #[test]
    fn each_answer_and_attempt_gets_its_verdict() {
        // Three attempts: retries 10 s and 1 min (±20 %) after the first two.
        let schedule = RetrySchedule::parse("10s,1m").unwrap();
        let status = |code| Heard::Status {
            code,
            retry_after: None,
            abort: false,
        };
        let asked = |code, secs| Heard::Status {
            code,
            retry_after: Some(Duration::from_secs(secs)),
            abort: false,
        };
        let aborted = |code| Heard::Status {
            code,
            retry_after: Some(Duration::from_secs(60)),
            abort: true,
        };
        use Expect::*;
        let cases = [
            (status(200), 1, Delivered),
            (status(204), 3, Delivered),
            (status(299), 2, Delivered),
            (status(410), 1, EndpointGone),
            (status(410), 3, EndpointGone),
            (status(500), 1, RetryWithin(8.0, 12.0)),
            (status(404), 2, RetryWithin(48.0, 72.0)),
            (status(301), 1, RetryWithin(8.0, 12.0)),
            (status(500), 3, Dead),
            (Heard::NoAnswer, 1, RetryWithin(8.0, 12.0)),
            (Heard::NoAnswer, 3, Dead),
            (Heard::Refused, 2, RetryWithin(48.0, 72.0)),
            (Heard::Refused, 3, Dead),
            (Heard::EndpointDisabled, 1, Dead),
            // The abort header ends the retries of a failure on any attempt,
            // leaves a 410 a 410, and does not undo a delivery.
            (aborted(500), 1, Dead),
            (aborted(429), 2, Dead),
            (aborted(410), 1, EndpointGone),
            (aborted(200), 1, Delivered),
            // Retry-After postpones an attempt ...
            (asked(429, 600), 1, RetryWithin(600.0, 600.0)),
            (asked(503, 86_400 * 3), 1, RetryWithin(86_400.0, 86_400.0)),
            // ... never brings one forward ...
            (asked(503, 1), 2, RetryWithin(48.0, 72.0)),
            // ... and never revives an exhausted schedule.
            (asked(429, 5), 3, Dead),
        ];
        let mut rng = rand::rng();
        for (heard, attempt, expect) in cases {
            let got = verdict(heard, attempt, &schedule, &mut rng);
            let ok = match (&expect, got) {
                (Delivered, Verdict::Delivered)
                | (Dead, Verdict::Dead)
                | (EndpointGone, Verdict::EndpointGone) => true,
                (RetryWithin(lo, hi), Verdict::RetryAfter(wait)) => {
                    (*lo..=*hi).contains(&wait.as_secs_f64())
                }
                _ => false,
            };
            assert!(
                ok,
                "{heard:?} on attempt {attempt}: expected {expect:?}, got {got:?}"
            );
        }
    }

    #[test]
    fn a_failure_status_keeps_the_start_of_the_body() {
        assert_eq!(status_error(500, b""), "HTTP 500");
        assert_eq!(
            status_error(503, b"  down for maintenance\n"),
            "HTTP 503: down for maintenance"
        );
        let long = vec![b'x'; 10_000];
        assert_eq!(status_error(500, &long).len(), "HTTP 500: ".len() + 256);
    }
}
