//! The `email_outbox` tick: the fenced-batch driver ([`scheduler::drive`])
//! over claimed emails, sent through the pooled transport at most
//! `max_connections` at a time, results written in groups beside the sends;
//! on a tick that prunes ([`Sender::with_retention`]) the retention prune as
//! its last step.

use std::sync::Arc;
use std::sync::atomic::{AtomicBool, Ordering};
use std::time::{Duration, Instant};

use db::Db;
use futures::StreamExt;
use leader::{Fence, Role, Telemetry, Tick, TickEnd};
use scheduler::{FencedBatches, Panics, Prune, Prunes, Pruning, Retention, Shape, Stop};
use tokio::sync::Semaphore;
use tokio_util::sync::CancellationToken;
use tracing::{debug, warn};

use crate::config::SenderConfig;
use crate::error::Error;
use crate::message::Queued;
use crate::pool::Pool;
use crate::smtp::Connector;
use crate::smtp::SmtpUrl;
use crate::store::{self, ResultRow};
use crate::verdict::{Next, Reply, next_state};

const ROLE: &str = "email_outbox";

/// Results written per statement, at most.
const RESULT_GROUP: usize = 100;

/// How long a result waits for others to share its statement. Without it a
/// group held what finished during the previous write, two or three results
/// at 16 connections: a transaction each, and most of the role's Postgres
/// time spent planning them (docs/adr/0051). The claim lease covers the wait.
const RESULT_LINGER: Duration = Duration::from_millis(20);

/// Batches sending at once (docs/adr/0068). While the last sends of one
/// batch finish, the next batch is claimed and its sends start, so the
/// connections do not idle at every batch's end, its claim and its first
/// send (measured: one batch of 2,000 sent 1.5 times as fast as four of 500
/// to a sink that answers at once). The sends of both together hold at most
/// `max_connections` permits of [`Inner::sends`].
const IN_FLIGHT: usize = 2;

/// What the sends of a tick (or of one [`Sender::send_claimed`]) came to.
#[derive(Debug, Default, Clone, PartialEq, Eq)]
pub struct Tally {
    pub sent: usize,
    pub retried: usize,
    pub failed: usize,
    /// Results refused by the compare-and-set: the claim was taken over.
    pub stale: usize,
    /// Claimed but not sent (server unreachable, cancelled).
    pub handed_back: usize,
    /// Results that could not be written; those emails come due after their lease.
    pub unrecorded: usize,
    /// Sends that got no SMTP reply at all (connection, TLS, timeout).
    pub unreachable: usize,
}

impl Tally {
    fn add(&mut self, other: &Tally) {
        self.sent += other.sent;
        self.retried += other.retried;
        self.failed += other.failed;
        self.stale += other.stale;
        self.handed_back += other.handed_back;
        self.unrecorded += other.unrecorded;
        self.unreachable += other.unreachable;
    }
}

/// What one tick did.
#[derive(Debug)]
pub struct TickReport {
    pub batches: usize,
    pub claimed: usize,
    pub tally: Tally,
    /// Why the tick stopped claiming.
    pub stop: Stop,
    /// How the lease is released (docs/adr/0007).
    pub end: TickEnd,
}

fn lock<T>(m: &std::sync::Mutex<T>) -> std::sync::MutexGuard<'_, T> {
    m.lock().unwrap_or_else(|p| p.into_inner())
}

/// Sends queued emails. Cheap to clone; clones share the connection pool.
#[derive(Clone)]
pub struct Sender {
    inner: Arc<Inner>,
    pruning: Option<Arc<Pruning>>,
}

struct Inner {
    db: Db,
    config: SenderConfig,
    pool: Pool,
    telemetry: Telemetry,
    /// Where the next claim starts among tenants (docs/adr/0048).
    cursor: db::TenantCursor,
    /// `max_connections` permits: a send holds one from before its checks
    /// (cancelled, server down, past its batch's send window) to its end, so
    /// the sends of the batches in flight never wait inside their deadline
    /// for a connection.
    sends: Arc<Semaphore>,
}

impl std::fmt::Debug for Sender {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Sender")
            .field("config", &self.inner.config)
            .finish_non_exhaustive()
    }
}

impl Sender {
    /// # Errors
    /// A config out of range, or a CA that is not PEM.
    pub fn new(
        db: Db,
        config: SenderConfig,
        smtp_url: &SmtpUrl,
        ca_pem: Option<&[u8]>,
        telemetry: Telemetry,
    ) -> Result<Sender, Error> {
        config.validate()?;
        let connector = Connector::new(smtp_url, ca_pem, config.send_timeout)?;
        let pool = Pool::new(connector, config.max_connections);
        let sends = Arc::new(Semaphore::new(config.max_connections.max(1) as usize));
        Ok(Sender {
            inner: Arc::new(Inner {
                db,
                config,
                pool,
                telemetry,
                cursor: db::TenantCursor::default(),
                sends,
            }),
            pruning: None,
        })
    }

    /// Prune (docs/adr/0040): a tick at most every `retention.every` ends
    /// with the deletion of sent and failed emails older than
    /// `retention.keep`, and of the role's lease history older than
    /// `retention.lease_history`, a fenced batch per statement in a slice of
    /// the budget ([`scheduler::Pruning`]).
    #[must_use]
    pub fn with_retention(mut self, retention: Retention) -> Sender {
        self.pruning = Some(Arc::new(Pruning::new(retention)));
        self
    }

    pub fn config(&self) -> &SenderConfig {
        &self.inner.config
    }

    /// One tick: batches until nothing is due ([`TickEnd::Drained`]), the
    /// budget is spent ([`TickEnd::MoreWork`]), the server is unreachable or a
    /// claim fails ([`TickEnd::Failed`]: the short cooldown, the rest handed
    /// back unattempted), or `tick.cancel` fires.
    ///
    /// # Panics
    /// When a send panicked (after the rest of the tick); that email's attempt
    /// was recorded as failed with no reply.
    ///
    /// # Cancel safety
    /// `tick.cancel` is checked before each send: unsent claims are handed
    /// back. Sends in flight finish. If the tick is dropped instead (after the
    /// cancel grace), its claims come due when their lease ends.
    pub async fn run_tick(&self, tick: &Tick) -> TickReport {
        let budget = self.inner.config.tick_budget;
        let plan = self.pruning.as_ref().map(|p| p.plan(budget));
        let work_until = plan.map_or_else(|| Instant::now() + budget, |p| p.work_until);
        let driven = scheduler::drive_until(&Sends::new(self), tick, work_until).await;
        if let (Some(plan), Some(pruning)) = (plan, self.pruning.as_deref())
            && let Some(mut prunes) = Prunes::of(&plan, pruning, tick, &self.inner.telemetry)
        {
            prunes.run(&Finished(self)).await;
            prunes.lease_history(&self.inner.db).await;
            prunes.finish();
        }
        TickReport {
            batches: driven.batches,
            claimed: driven.claimed,
            tally: driven.counts,
            stop: driven.stop,
            end: driven.end,
        }
    }

    /// The fenced funnel: claim up to `limit` due emails for one attempt each.
    ///
    /// # Errors
    /// A database error; nothing was claimed.
    pub async fn claim_due(&self, fence: &Fence, limit: usize) -> Result<Vec<Queued>, Error> {
        let c = &self.inner.config;
        Ok(store::claim_due(
            &self.inner.db,
            fence,
            &self.inner.cursor,
            limit,
            c.claim_lease(),
            c.statement_timeout,
        )
        .await?)
    }

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
    /// [`Inner::sends`], shared with the other batch in flight, and the
    /// window is checked after it, so the wait for a permit counts.
    async fn probe(
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
        done.panics.extend(panic);
        let first = self.result(&q, &reply);
        if matches!(reply, Reply::NoReply(_)) {
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
    async fn send_rest(
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
        let attempt = u32::try_from(q.attempt).unwrap_or(u32::MAX);
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
                                warn!(role = ROLE, email = r.id, code = ?r.reply_code, reply = %r.reply_text, "email failed for good");
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

    async fn refresh_gauges(&self) {
        let c = &self.inner.config;
        match store::backlog(&self.inner.db, c.statement_timeout).await {
            Ok(b) => {
                let t = &self.inner.telemetry;
                t.gauge("hardcount_emails_queued", &[]).set(b.queued as f64);
                t.gauge("hardcount_emails_failed", &[]).set(b.failed as f64);
                t.gauge("hardcount_email_oldest_queued_age_seconds", &[])
                    .set(b.oldest_queued_age);
            }
            Err(e) => debug!(role = ROLE, error = %e, "email backlog gauges not refreshed"),
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
enum Probed {
    /// Nothing more to send: the batch was empty, cancelled, past its window,
    /// or its first send got no reply (the rest handed back).
    Done(BatchDone),
    /// The server answered; the rest is to send.
    Answered(Rest),
}

/// The rest of a batch whose first send was answered.
struct Rest {
    /// The first send's count, panic included.
    done: BatchDone,
    /// The first send's result, written with the first group.
    first: ResultRow,
    rest: Vec<Queued>,
    /// No send of the batch starts after this.
    send_until: tokio::time::Instant,
}

/// What one batch's sends came to.
struct BatchDone {
    tally: Tally,
    /// Sends that panicked: raised at the tick's end, after the rest.
    panics: Vec<scheduler::Payload>,
    /// False when a send got no reply at all: the server is taken as down.
    reachable: bool,
}

/// The role as the driver sees it: each batch sends as a task of its own,
/// so the driver claims the next batch while the last sends of this one
/// finish; `run` waits for the oldest once [`IN_FLIGHT`] are sending, and
/// `finish` for the rest.
struct Sends<'a> {
    sender: &'a Sender,
    /// Set by a send that got no reply: the other batch in flight starts no
    /// more sends either.
    down: Arc<AtomicBool>,
    /// The batches still sending or writing results, oldest first.
    in_flight: scheduler::InFlight<BatchDone>,
}

impl<'a> Sends<'a> {
    fn new(sender: &'a Sender) -> Sends<'a> {
        Sends {
            sender,
            down: Arc::new(AtomicBool::new(false)),
            in_flight: scheduler::InFlight::new(IN_FLIGHT),
        }
    }

    /// Wait for finished batches (all, or those past the newest) and count
    /// them into the tick's.
    async fn collect(
        &self,
        all: bool,
        panics: &mut Panics,
        tally: &mut Tally,
    ) -> Result<(), Error> {
        let mut verdict = Ok(());
        for ((), done) in self.in_flight.wait(all).await {
            tally.add(&done.tally);
            for p in done.panics {
                panics.record(p);
            }
            if !done.reachable {
                verdict = Err(Error::Unreachable);
            }
        }
        verdict
    }
}

impl FencedBatches for Sends<'_> {
    type Claim = Vec<Queued>;
    type Counts = Tally;
    type Error = Error;

    fn role(&self) -> Role {
        Role::EmailOutbox
    }

    fn shape(&self) -> Shape {
        let c = &self.sender.inner.config;
        Shape {
            batch_size: c.batch_size,
            budget: c.tick_budget,
            // A batch is bounded by its sends (each under `send_timeout`) and runs
            // well inside the claim lease; the budget only decides whether to claim.
            reserve: std::time::Duration::ZERO,
        }
    }

    async fn claim(&self, fence: &Fence, limit: usize) -> Result<Vec<Queued>, Error> {
        self.sender.claim_due(fence, limit).await
    }

    fn claimed(batch: &Vec<Queued>) -> usize {
        batch.len()
    }

    /// The claim visits at most `TENANTS_PER_CLAIM` tenants and gives each a
    /// share of the batch (docs/adr/0048), so it comes back short while
    /// emails of other tenants wait; drained only when a claim finds nothing,
    /// or they would wait the interval, a batch of 64 tenants at a time
    /// (docs/adr/0067). A claim leases what it takes and a failed send backs
    /// off, so the loop ends.
    fn short_batch_drains(&self) -> bool {
        false
    }

    async fn run(
        &self,
        batch: Vec<Queued>,
        tick: &Tick,
        _deadline: Instant,
        panics: &mut Panics,
        tally: &mut Tally,
    ) -> Result<(), Error> {
        // The first send is awaited here, so that a tick against a dead server
        // makes one attempt: the next batch is claimed only after it answered.
        match self.sender.probe(batch, &tick.cancel, &self.down).await {
            Probed::Done(done) => {
                // Unanswered, cancelled or past its window: the batches before
                // it are waited for too, and the tick's verdict follows.
                self.in_flight
                    .push((), tokio::spawn(std::future::ready(done)));
                self.collect(true, panics, tally).await
            }
            Probed::Answered(rest) => {
                let (sender, cancel, down) =
                    (self.sender.clone(), tick.cancel.clone(), self.down.clone());
                let task =
                    tokio::spawn(async move { sender.send_rest(rest, &cancel, &down).await });
                self.in_flight.push((), task);
                self.collect(false, panics, tally).await
            }
        }
    }

    async fn finish(&self, panics: &mut Panics, tally: &mut Tally) -> Result<(), Error> {
        self.collect(true, panics, tally).await
    }

    async fn end_tick(&self, tick: &Tick) {
        if !tick.cancel.is_cancelled() {
            self.sender.inner.pool.close_idle().await;
            self.sender.refresh_gauges().await;
        }
    }
}

/// The retention prune of sent and failed emails ([`store::prune_finished`]).
struct Finished<'a>(&'a Sender);

impl Prune for Finished<'_> {
    type Error = db::Error;

    fn kind(&self) -> &'static str {
        "emails"
    }

    async fn prune(&self, fence: &Fence, keep: Duration, limit: usize) -> Result<u64, db::Error> {
        let inner = &self.0.inner;
        store::prune_finished(
            &inner.db,
            fence,
            keep,
            limit,
            inner.config.statement_timeout,
        )
        .await
    }
}
