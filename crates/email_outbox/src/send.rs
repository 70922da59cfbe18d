//! One SMTP send through the pool, turned into a [`Reply`].

use std::time::Duration;

use crate::failure::Failure;
use crate::message::{Queued, message};
use crate::pool::{Pool, completed};
use crate::verdict::Reply;

/// Send `q` once. Never panics on the server's behalf: every failure becomes
/// a [`Reply`]. A row that no longer builds a message (edited by hand) is a
/// permanent failure (code 0) with the reason.
pub(crate) async fn send(pool: &Pool, q: &Queued, deadline: Duration) -> Reply {
    let msg = match message(q) {
        Ok(m) => m,
        Err(e) => {
            return Reply::Permanent {
                code: 0,
                text: format!("not sendable: {e}"),
            };
        }
    };
    let body = msg.formatted();
    let text =
        |r: &lettre::transport::smtp::response::Response| r.message().collect::<Vec<_>>().join(" ");
    match tokio::time::timeout(deadline, pool.send(q.id, msg.envelope(), &body)).await {
        Err(_) => Reply::NoReply(format!("no answer within {deadline:?}")),
        Ok(Ok(response)) if completed(&response) => Reply::Accepted {
            code: u16::from(response.code()),
            text: text(&response),
        },
        // A 3xx to the message's end: the server did not say it took the
        // message, so it is sent again (the pool drops that connection).
        Ok(Ok(response)) => Reply::Transient {
            code: u16::from(response.code()),
            text: format!("not a completion to the message's end: {}", text(&response)),
        },
        Ok(Err(Failure::Connect(why))) => Reply::NoReply(why),
        Ok(Err(Failure::Smtp(e))) => match e.status() {
            // "Authentication required" (RFC 4954) or "must issue STARTTLS
            // first" (RFC 3207), to MAIL FROM: the session is refused, not
            // this message, as a 535 to AUTH is (docs/adr/0079, 0133). As this
            // email's permanent failure it failed every queued email in one
            // tick. The server's text stays out: it is the session's.
            Some(code) if u16::from(code) == 530 => Reply::NoReply(
                "the server refused the session before any message (530: authentication or \
                 TLS required)"
                    .to_owned(),
            ),
            Some(code) if e.is_permanent() => Reply::Permanent {
                code: u16::from(code),
                text: e.to_string(),
            },
            Some(code) => Reply::Transient {
                code: u16::from(code),
                text: e.to_string(),
            },
            None if e.is_tls() => Reply::NoReply(format!("TLS failed: {e}")),
            // lettre refused to send this message on this server before a
            // command went out: an address that needs SMTPUTF8 where the
            // server does not offer it. This email's permanent failure (it
            // can be resent), not a server that is down: as "no reply" it
            // stopped every email's batch and failed the tick each time it
            // came due.
            None if e.is_client() => Reply::Permanent {
                code: 0,
                text: format!("not sendable on this server: {e}"),
            },
            None => Reply::NoReply(e.to_string()),
        },
    }
}
