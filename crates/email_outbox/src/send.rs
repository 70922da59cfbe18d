//! One SMTP send through the pool, turned into a [`Reply`].

use std::time::Duration;

use crate::failure::Failure;
use crate::message::{Queued, message};
use crate::pool::Pool;
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
    match tokio::time::timeout(deadline, pool.send(msg.envelope(), &body)).await {
        Err(_) => Reply::NoReply(format!("no answer within {deadline:?}")),
        Ok(Ok(response)) => Reply::Accepted {
            code: u16::from(response.code()),
            text: response.message().collect::<Vec<_>>().join(" "),
        },
        Ok(Err(Failure::Connect(why))) => Reply::NoReply(why),
        Ok(Err(Failure::Smtp(e))) => match e.status() {
            Some(code) if e.is_permanent() => Reply::Permanent {
                code: u16::from(code),
                text: e.to_string(),
            },
            Some(code) => Reply::Transient {
                code: u16::from(code),
                text: e.to_string(),
            },
            None if e.is_tls() => Reply::NoReply(format!("TLS failed: {e}")),
            None => Reply::NoReply(e.to_string()),
        },
    }
}
