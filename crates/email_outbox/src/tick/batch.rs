//! One claimed batch's sends: its first email alone (the probe), then the
//! rest at most `max_connections` at a time beside the writes of their
//! results in groups, and what was not sent handed back.

use std::sync::atomic::{AtomicBool, Ordering};
use std::time::{Duration, Instant};

use futures::StreamExt;
use scheduler::Panics;
use tokio_util::sync::CancellationToken;
use tracing::warn;

use super::{ROLE, Sender, Tally};
use crate::message::Queued;
use crate::store::{self, ResultRow};
use crate::verdict::{Next, Reply, next_state};

/// Results written per statement, at most.
const RESULT_GROUP: usize = 100;

/// How long a result waits for others to share its statement. Without it a
/// group held what finished during the previous write, two or three results
/// at 16 connections: a transaction each, and most of the role's Postgres
/// time spent planning them (docs/adr/0051). The claim lease covers the wait.
const RESULT_LINGER: Duration = Duration::from_millis(20);

fn lock<T>(m: &std::sync::Mutex<T>) -> std::sync::MutexGuard<'_, T> {
    m.lock().unwrap_or_else(|p| p.into_inner())
}

impl Sender {
    /// Send emails claimed earlier with [`claim_due`](Self::claim_due) and
    /// write their results, as a tick does with each batch.
    ///
    /// # Panics
    /// When a send panicked, after the rest of the batch.
    pub async fn send_claimed(&self, batch: Vec<Queued>) -> Tally {
        let cancel = CancellationToken::new();
        let down = AtomicBool::new(false);
        let done = match self.probe(batch, &cancel, &down).await {
            Probed::Done(done) => done,
            Probed::Answered(rest) => self.send_rest(rest, &cancel, &down).await,
        };
        let mut panics = Panics::new(ROLE);
        for p in done.panics {
            panics.record(p);
        }
        panics.finish();
        done.tally
    }

    /// The first send of a claimed batch, alone: if it gets no reply at all,
    /// the server is taken as unreachable, the rest are handed back
    /// unattempted and the batch is done, so a dead server costs one
    /// connection a tick, not one attempt per email. A batch's sends start
    /// within `tick_budget` of this, which is after its claim, or are handed
    /// back: so every send starts inside its claim's lease with two command
    /// timeouts of it left (`SenderConfig::claim_lease`). Without that, the
    /// unsent end of a batch outlasting its lease against a slow server could
    /// be claimed again and sent twice. Every send first takes a permit of
    /// [`Inner::sends`](super::Inner::sends), shared with the other batch in flight, and the
    /// window is checked after it, so the wait for a permit counts.
    pub(super) async fn probe(
        &self,
        batch: Vec<Queued>,
        cancel: &CancellationToken,
        down: &AtomicBool,
    ) -> Probed {
        let mut done = BatchDone {
            tally: Tally::default(),
            panics: Vec::new(),
            reachable: true,
        };
        let send_until = tokio::time::Instant::now() + self.inner.config.tick_budget;
        let mut rest = batch.into_iter();
        let Some(first) = rest.next() else {
            return Probed::Done(done);
        };
        let (q, reply, panic) = {
            let _permit = self.inner.sends.acquire().await.ok();
            if cancel.is_cancelled()
                || down.load(Ordering::Relaxed)
                || tokio::time::Instant::now() >= send_until
            {
                let unsent: Vec<Queued> = std::iter::once(first).chain(rest).collect();
                self.hand_back(&unsent, &mut done.tally).await;
                return Probed::Done(done);
            }
            self.attempt(first).await
        };
        let panic_seen = panic.as_ref().map(|_| ());
        done.panics.extend(panic);
        let first = self.result(&q, &reply);
        // A panicked send is not the server's silence (as in `send_rest`):
        // its email is retried, and the batch goes on.
        if matches!(reply, Reply::NoReply(_)) && panic_seen.is_none() {
            // The batch still sending stops too.
            down.store(true, Ordering::Relaxed);
            done.tally.unreachable += 1;
            done.reachable = false;
            warn!(role = ROLE, error = ?reply, "SMTP server unreachable; handing the batch back");
            let rest: Vec<Queued> = rest.collect();
            self.write(&mut vec![first], &mut done.tally).await;
            self.hand_back(&rest, &mut done.tally).await;
            return Probed::Done(done);
        }
        Probed::Answered(Rest {
            done,
            first,
            rest: rest.collect(),
            send_until,
        })
    }

    /// The rest of a batch whose first send was answered, at most
    /// `max_connections` at a time, and the results of all. `down` is shared
    /// by the batches in flight: a send that gets no reply stops the sends
    /// of both, and what they did not start is handed back.
    pub(super) async fn send_rest(
        &self,
        rest: Rest,
        cancel: &CancellationToken,
        down: &AtomicBool,
    ) -> BatchDone {
        let Rest {
            mut done,
            first,
            rest,
            send_until,
        } = rest;
        let limit = self.inner.config.max_connections as usize;
        let permits = &self.inner.sends;
        let unsent = std::sync::Mutex::new(Vec::new());
        let caught = std::sync::Mutex::new(Vec::new());
        let stopped = AtomicBool::new(false);
        // Sends and result writes run side by side: results queue while a group
        // is being written, and the next write takes up to RESULT_GROUP of them.
        let (results_tx, mut results_rx) = tokio::sync::mpsc::unbounded_channel();
        // The first result is written with the first group.
        let _ = results_tx.send((first, false));
        let sends = async {
            futures::stream::iter(rest)
                .for_each_concurrent(limit, |q| {
                    let (unsent, caught, stopped, results_tx) =
                        (&unsent, &caught, &stopped, &results_tx);
                    async move {
                        let _permit = permits.acquire().await.ok();
                        if cancel.is_cancelled()
                            || down.load(Ordering::Relaxed)
                            || tokio::time::Instant::now() >= send_until
                        {
                            lock(unsent).push(q);
                            return;
                        }
                        let (q, reply, panic) = self.attempt(q).await;
                        let no_reply = matches!(reply, Reply::NoReply(_)) && panic.is_none();
                        if no_reply {
                            down.store(true, Ordering::Relaxed);
                            stopped.store(true, Ordering::Relaxed);
                        }
                        if let Some(p) = panic {
                            lock(caught).push(p);
                        }
                        let _ = results_tx.send((self.result(&q, &reply), no_reply));
                    }
                })
                .await;
            drop(results_tx);
        };
        let writes = async {
            let mut written = Tally::default();
            let mut group = Vec::with_capacity(RESULT_GROUP);
            while let Some((row, no_reply)) = results_rx.recv().await {
                written.unreachable += usize::from(no_reply);
                group.push(row);
                let linger = tokio::time::Instant::now() + RESULT_LINGER;
                while group.len() < RESULT_GROUP {
                    // Ends at the linger, or when every send has finished.
                    let Ok(Some((row, no_reply))) =
                        tokio::time::timeout_at(linger, results_rx.recv()).await
                    else {
                        break;
                    };
                    written.unreachable += usize::from(no_reply);
                    group.push(row);
                }
                self.write(&mut group, &mut written).await;
            }
            written
        };
        let ((), written) = tokio::join!(sends, writes);
        done.tally.add(&written);
        done.panics
            .extend(caught.into_inner().unwrap_or_else(|p| p.into_inner()));
        let unsent = unsent.into_inner().unwrap_or_else(|p| p.into_inner());
        self.hand_back(&unsent, &mut done.tally).await;
        done.reachable = !stopped.load(Ordering::Relaxed);
        done
    }

    /// One send under the panic guard: a panic is that email's failed attempt.
    async fn attempt(&self, q: Queued) -> (Queued, Reply, Option<scheduler::Payload>) {
        let started = Instant::now();
        let step = format!("{ROLE}/send email {}", q.id);
        let deadline = self.inner.config.send_timeout * 4;
        let out = scheduler::catch(step, crate::send::send(&self.inner.pool, &q, deadline)).await;
        self.inner
            .telemetry
            .histogram("hardcount_email_send_duration_seconds", &[])
            .record(started.elapsed().as_secs_f64());
        match out {
            Ok(reply) => (q, reply, None),
            Err(payload) => (
                q,
                Reply::NoReply("the send panicked".to_owned()),
                Some(payload),
            ),
        }
    }

    fn result(&self, q: &Queued, reply: &Reply) -> ResultRow {
        // The schedule starts again at a resend, as the claim's ceiling counts.
        let attempt = u32::try_from(q.attempt - q.resent_at_attempt).unwrap_or(u32::MAX);
        let jitter = rand::random_range(-1.0..=1.0);
        let next = next_state(reply, attempt, &self.inner.config.retry_delays, jitter);
        let (code, text) = match reply {
            Reply::Accepted { code, text }
            | Reply::Transient { code, text }
            | Reply::Permanent { code, text } => (Some(*code).filter(|c| *c > 0), text.clone()),
            Reply::NoReply(why) => (None, why.clone()),
        };
        ResultRow {
            id: q.id,
            attempt: q.attempt,
            next,
            reply_code: code,
            reply_text: text,
        }
    }

    /// Write the buffered results in one statement; count what was applied.
    async fn write(&self, results: &mut Vec<ResultRow>, report: &mut Tally) {
        if results.is_empty() {
            return;
        }
        let rows = std::mem::take(results);
        let c = &self.inner.config;
        match store::record_results(&self.inner.db, &rows, c.statement_timeout).await {
            Ok(applied) => {
                for r in &rows {
                    let class = match r.reply_code {
                        Some(code) => smtp_class(code),
                        None => "none",
                    };
                    let outcome = if !applied.contains(&(r.id, r.attempt)) {
                        report.stale += 1;
                        warn!(
                            role = ROLE,
                            email = r.id,
                            attempt = r.attempt,
                            "stale send result not applied: the claim was taken over"
                        );
                        "stale"
                    } else {
                        match r.next {
                            Next::Sent => {
                                report.sent += 1;
                                "sent"
                            }
                            Next::RetryAfter(_) => {
                                report.retried += 1;
                                "retry"
                            }
                            Next::Failed => {
                                report.failed += 1;
                                // The code only: a server's text often echoes the recipient
                                // (a customer's address); it is kept in last_reply_text.
                                warn!(role = ROLE, email = r.id, code = ?r.reply_code, "email failed for good");
                                "failed"
                            }
                        }
                    };
                    self.inner
                        .telemetry
                        .counter(
                            "hardcount_emails_total",
                            &[("outcome", outcome), ("smtp_class", class)],
                        )
                        .increment(1);
                }
            }
            Err(e) => {
                report.unrecorded += rows.len();
                warn!(role = ROLE, error = %e, emails = rows.len(), "could not record send results; those emails come due again after their claim lease");
            }
        }
    }

    async fn hand_back(&self, unsent: &[Queued], report: &mut Tally) {
        if unsent.is_empty() {
            return;
        }
        let claims: Vec<(i64, i32)> = unsent.iter().map(|q| (q.id, q.attempt)).collect();
        let c = &self.inner.config;
        match store::hand_back(&self.inner.db, &claims, c.statement_timeout).await {
            Ok(n) => report.handed_back += usize::try_from(n).unwrap_or(usize::MAX),
            Err(e) => {
                warn!(role = ROLE, error = %e, "could not hand back unsent emails; they come due after their claim lease")
            }
        }
    }
}

/// `2xx`, `4xx` or `5xx`: the `smtp_class` label.
fn smtp_class(code: u16) -> &'static str {
    match code {
        200..=299 => "2xx",
        400..=499 => "4xx",
        500..=599 => "5xx",
        _ => "none",
    }
}

/// A batch after its first send.
pub(super) enum Probed {
    /// Nothing more to send: the batch was empty, cancelled, past its window,
    /// or its first send got no reply (the rest handed back).
    Done(BatchDone),
    /// The server answered; the rest is to send.
    Answered(Rest),
}

/// The rest of a batch whose first send was answered.
pub(super) struct Rest {
    /// The first send's count, panic included.
    done: BatchDone,
    /// The first send's result, written with the first group.
    first: ResultRow,
    rest: Vec<Queued>,
    /// No send of the batch starts after this.
    send_until: tokio::time::Instant,
}

/// What one batch's sends came to.
pub(super) struct BatchDone {
    pub(super) tally: Tally,
    /// Sends that panicked: raised at the tick's end, after the rest.
    pub(super) panics: Vec<scheduler::Payload>,
    /// False when a send got no reply at all: the server is taken as down.
    pub(super) reachable: bool,
}

#[cfg(test)]
mod tests {
    use super::smtp_class;
    use crate::tick::OUTCOMES_ALERTED;

    /// `HardcountEmailsFailing` sums failures by SMTP class, so each class a
    /// failure can carry is exported at 0 from the start, and a sent email's
    /// class too (docs/adr/0141). Mutation `email_class_not_zeroed` (the 5xx
    /// pair left out) fails here.
    #[test]
    fn every_class_an_outcome_can_carry_is_exported_at_zero() {
        for (outcome, codes) in [("sent", &[250_u16][..]), ("failed", &[0, 421, 550])] {
            for &code in codes {
                let class = smtp_class(code);
                assert!(
                    OUTCOMES_ALERTED.contains(&(outcome, class)),
                    "{outcome} {class}"
                );
            }
        }
    }
}
