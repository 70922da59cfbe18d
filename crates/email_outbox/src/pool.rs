//! The SMTP connection pool: at most `max_connections` connections open at
//! once (docs/adr/0016), each with `TCP_NODELAY`, reused while healthy.
//!
//! A send holds one permit of a semaphore sized `max_connections` from before
//! it takes a connection until after it has put it back (or closed it). It
//! reuses an idle connection when there is one and the server has neither
//! closed it nor spoken on it (a peek at the socket, no round trip; after a
//! `NOOP` too when it sat idle longer than [`PROBE_AFTER`]), and opens a
//! new one only when none is idle, so the connections open — idle plus in
//! use — never exceed the permits. A connection lettre marks broken (any
//! error mid-transaction) is closed, never reused; dropping one (a send
//! cancelled or timed out) closes its socket at once.

use std::future::Future;
use std::sync::Mutex;
use std::time::{Duration, Instant};

use lettre::address::Envelope;
use lettre::transport::smtp::response::{Response, Severity};
use tokio::sync::Semaphore;

use crate::failure::Failure;
use crate::smtp::{Conn, Connector};

/// An idle connection older than this is closed instead of reused.
const IDLE_TIMEOUT: Duration = Duration::from_secs(30);

/// An idle connection older than this is asked `NOOP` before it is reused.
/// A younger one is reused on the peek alone: a server that closed it, or
/// said `421` on it, has left bytes or an end of stream on the socket. What
/// the peek cannot see (a peer gone without a word, a link cut) takes longer
/// than this to happen to a connection that was answering a moment ago.
const PROBE_AFTER: Duration = Duration::from_secs(2);

pub(crate) struct Pool {
    connector: Connector,
    permits: Semaphore,
    idle: Mutex<Vec<Idle>>,
}

struct Idle {
    conn: Conn,
    since: Instant,
}

impl Pool {
    pub(crate) fn new(connector: Connector, max_connections: u32) -> Pool {
        Pool {
            connector,
            permits: Semaphore::new(max_connections.max(1) as usize),
            idle: Mutex::new(Vec::new()),
        }
    }

    /// Send one message (the row `email`'s) on a pooled connection. A
    /// connection whose answer to the message was not a completion (2xx) is
    /// out of step with its server and is not used again.
    pub(crate) async fn send(
        &self,
        email: i64,
        envelope: &Envelope,
        body: &[u8],
    ) -> Result<Response, Failure> {
        // The semaphore is never closed.
        let _permit = self.permits.acquire().await.ok();
        let mut conn = self.checkout().await?;
        // The row's id only: recipients and bodies stay out of logs, which is
        // also why lettre is built without its `tracing` feature (it logs
        // every line it writes, AUTH's credentials among them).
        tracing::trace!(email, "sending on a pooled connection");
        let result = conn.smtp.send(envelope, body).await;
        let out_of_step = result.as_ref().is_ok_and(|r| !completed(r));
        if !conn.smtp.has_broken() && !out_of_step {
            self.lock().push(Idle {
                conn,
                since: Instant::now(),
            });
        }
        result.map_err(Failure::Smtp)
    }

    /// An idle connection the server still holds open, or a new one.
    async fn checkout(&self) -> Result<Conn, Failure> {
        let timeout = self.connector.timeout();
        loop {
            let idle = self.lock().pop();
            let Some(Idle { mut conn, since }) = idle else {
                return within(timeout, self.connector.connect()).await;
            };
            let idle = since.elapsed();
            if idle < IDLE_TIMEOUT
                && !conn.server_spoke()
                && (idle < PROBE_AFTER
                    || tokio::time::timeout(timeout, conn.smtp.test_connected())
                        .await
                        .unwrap_or(false))
            {
                return Ok(conn);
            }
            // Dropped: its socket closes now, before a new one is opened.
        }
    }

    /// Close connections idle for longer than the idle timeout, with a `QUIT`
    /// each (bounded by one command timeout in all). Their permits are held
    /// meanwhile, so the bound stays exact; when sends hold them, next time.
    pub(crate) async fn close_idle(&self) {
        let expired = |i: &Idle| i.since.elapsed() >= IDLE_TIMEOUT;
        let n = self.lock().iter().filter(|i| expired(i)).count();
        let Some(_permits) = u32::try_from(n)
            .ok()
            .filter(|n| *n > 0)
            .and_then(|n| self.permits.try_acquire_many(n).ok())
        else {
            return;
        };
        let stale: Vec<Idle> = self.lock().extract_if(.., |i| expired(i)).take(n).collect();
        let quits = stale.into_iter().map(|mut i| async move {
            let _ = i.conn.smtp.quit().await;
        });
        let _ =
            tokio::time::timeout(self.connector.timeout(), futures::future::join_all(quits)).await;
    }

    fn lock(&self) -> std::sync::MutexGuard<'_, Vec<Idle>> {
        self.idle.lock().unwrap_or_else(|p| p.into_inner())
    }
}

/// A 2xx answer: the only one that says the server took the message (RFC 5321
/// 4.2.5). lettre counts a 3xx to the message's end as success too.
pub(crate) fn completed(response: &Response) -> bool {
    response.code().severity == Severity::PositiveCompletion
}

async fn within<T>(
    timeout: Duration,
    f: impl Future<Output = Result<T, Failure>>,
) -> Result<T, Failure> {
    tokio::time::timeout(timeout, f)
        .await
        .unwrap_or_else(|_| Err(Failure::Connect(format!("no answer within {timeout:?}"))))
}
