//! What an SMTP answer means for the email: sent, tried again later, or failed
//! for good (docs/adr/0009). A pure function, tested as a table.

use std::time::Duration;

/// How one send ended, as the sender saw it.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Reply {
    /// The server took the message (2xx after DATA).
    Accepted { code: u16, text: String },
    /// A 4xx reply: the server asks us to try again later.
    Transient { code: u16, text: String },
    /// A 5xx reply: the server refuses this message for good.
    Permanent { code: u16, text: String },
    /// No SMTP reply: the connection, TLS or a timeout failed, or the send
    /// panicked. The server may never have seen the message.
    NoReply(String),
}

/// The state a send leaves its email in.
#[derive(Debug, Clone, Copy, PartialEq)]
pub enum Next {
    Sent,
    /// Still queued, due again after this wait.
    RetryAfter(Duration),
    Failed,
}

/// The next state of an email after its `attempt`-th send (1-based) ended
/// with `reply`. `delays[i]` is the wait after the `i + 1`-th failed attempt,
/// so an email gets `delays.len() + 1` attempts; `jitter` in `-1.0..=1.0`
/// spreads each wait by up to ±20 %.
pub fn next_state(reply: &Reply, attempt: u32, delays: &[Duration], jitter: f64) -> Next {
    match reply {
        Reply::Accepted { .. } => Next::Sent,
        Reply::Permanent { .. } => Next::Failed,
        Reply::Transient { .. } | Reply::NoReply(_) => {
            let index = usize::try_from(attempt.saturating_sub(1)).unwrap_or(usize::MAX);
            match delays.get(index) {
                Some(delay) => Next::RetryAfter(delay.mul_f64(1.0 + 0.2 * jitter.clamp(-1.0, 1.0))),
                None => Next::Failed,
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn replies_map_to_states() {
        let s = Duration::from_secs;
        let delays = [s(60), s(300)];
        let reply = |code: u16| match code {
            200..=299 => Reply::Accepted {
                code,
                text: "ok".into(),
            },
            400..=499 => Reply::Transient {
                code,
                text: "later".into(),
            },
            _ => Reply::Permanent {
                code,
                text: "no".into(),
            },
        };
        let no_reply = Reply::NoReply("connection refused".into());
        let table = [
            (reply(250), 1, 0.0, Next::Sent),
            (reply(250), 3, 0.0, Next::Sent),
            (reply(451), 1, 0.0, Next::RetryAfter(s(60))),
            (reply(451), 2, 0.0, Next::RetryAfter(s(300))),
            (reply(451), 3, 0.0, Next::Failed),
            (reply(421), 1, 1.0, Next::RetryAfter(s(72))),
            (reply(421), 1, -1.0, Next::RetryAfter(s(48))),
            (reply(550), 1, 0.0, Next::Failed),
            (reply(554), 2, 0.0, Next::Failed),
            (no_reply.clone(), 1, 0.0, Next::RetryAfter(s(60))),
            (no_reply.clone(), 3, 0.0, Next::Failed),
            (no_reply, 1, 9.0, Next::RetryAfter(s(72))),
        ];
        for (reply, attempt, jitter, expected) in table {
            assert_eq!(
                next_state(&reply, attempt, &delays, jitter),
                expected,
                "{reply:?} on attempt {attempt}"
            );
        }
    }
}
