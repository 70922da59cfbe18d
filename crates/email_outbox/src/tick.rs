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
        Ok(Sender {
            inner: Arc::new(Inner {
                db,
                config,
                pool,
                telemetry,
                cursor: db::TenantCursor::default(),
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
        let driven = scheduler::drive_until(&Sends(self), tick, work_until).await;
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
        let mut panics = Panics::new(ROLE);
        let mut tally = Tally::default();
        self.send_batch(batch, &CancellationToken::new(), &mut panics, &mut tally)
            .await;
        panics.finish();
        tally
    }

    /// Send one claimed batch and write its results. The first email goes
    /// alone: if it gets no reply at all, the server is taken as unreachable,
    /// the rest are handed back unattempted and this returns false, so a dead
    /// server costs one connection a tick, not one attempt per email. A send
    /// not started within `tick_budget` of the batch's start is handed back,
    /// so every send starts inside its claim's lease with two command
    /// timeouts of it left (`SenderConfig::claim_lease`).
    async fn send_batch(
        &self,
        batch: Vec<Queued>,
        cancel: &CancellationToken,
        panics: &mut Panics,
        report: &mut Tally,
    ) -> bool {
        let mut rest = batch.into_iter();
        let Some(first) = rest.next() else {
            return true;
        };
        let (q, reply, panic) = self.attempt(first).await;
        if let Some(p) = panic {
            panics.record(p);
        }
        let unreachable = matches!(reply, Reply::NoReply(_));
        let mut results = vec![self.result(&q, &reply)];
        if unreachable {
            report.unreachable += 1;
            warn!(role = ROLE, error = ?reply, "SMTP server unreachable; handing the batch back");
            let rest: Vec<Queued> = rest.collect();
            self.write(&mut results, report).await;
            self.hand_back(&rest, report).await;
            return false;
        }
        let down = AtomicBool::new(false);
        let limit = self.inner.config.max_connections as usize;
        // The claim lease is the tick budget plus two command timeouts and a
        // margin (`SenderConfig::claim_lease`): a send starts only within the
        // budget from this batch's claim, and what is left is handed back.
        // Without it the unsent end of a batch outlasting its lease against a
        // slow server could be claimed again and sent twice. Measured from
        // the batch's start, which is after the claim.
        let send_until = tokio::time::Instant::now() + self.inner.config.tick_budget;
        let unsent = std::sync::Mutex::new(Vec::new());
        let caught = std::sync::Mutex::new(Vec::new());
        // Sends and result writes run side by side: results queue while a group
        // is being written, and the next write takes up to RESULT_GROUP of them.
        let (results_tx, mut results_rx) = tokio::sync::mpsc::unbounded_channel();
        // The first result is written with the first group.
        for row in results {
            let _ = results_tx.send((row, false));
        }
        let sends = async {
            futures::stream::iter(rest)
                .for_each_concurrent(limit, |q| {
                    let (down, unsent, caught, results_tx) = (&down, &unsent, &caught, &results_tx);
                    async move {
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
        report.add(&written);
        for p in caught.into_inner().unwrap_or_else(|p| p.into_inner()) {
            panics.record(p);
        }
        let unsent = unsent.into_inner().unwrap_or_else(|p| p.into_inner());
        self.hand_back(&unsent, report).await;
        !down.load(Ordering::Relaxed)
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

/// The role as the driver sees it.
struct Sends<'a>(&'a Sender);

impl FencedBatches for Sends<'_> {
    type Claim = Vec<Queued>;
    type Counts = Tally;
    type Error = Error;

    fn role(&self) -> Role {
        Role::EmailOutbox
    }

    fn shape(&self) -> Shape {
        let c = &self.0.inner.config;
        Shape {
            batch_size: c.batch_size,
            budget: c.tick_budget,
            // A batch is bounded by its sends (each under `send_timeout`) and runs
            // well inside the claim lease; the budget only decides whether to claim.
            reserve: std::time::Duration::ZERO,
        }
    }

    async fn claim(&self, fence: &Fence, limit: usize) -> Result<Vec<Queued>, Error> {
        self.0.claim_due(fence, limit).await
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
        if self.0.send_batch(batch, &tick.cancel, panics, tally).await {
            Ok(())
        } else {
            Err(Error::Unreachable)
        }
    }

    async fn end_tick(&self, tick: &Tick) {
        if !tick.cancel.is_cancelled() {
            self.0.inner.pool.close_idle().await;
            self.0.refresh_gauges().await;
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
