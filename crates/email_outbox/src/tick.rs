//! The `email_outbox` tick: the fenced-batch driver ([`scheduler::drive`])
//! over claimed emails, sent through the pooled transport at most
//! `max_connections` at a time, results written in groups beside the sends;
//! on a tick that prunes ([`Sender::with_retention`]) the retention prune as
//! its last step.

mod batch;

use std::sync::Arc;
use std::sync::atomic::AtomicBool;
use std::time::{Duration, Instant};

use db::Db;
use leader::{Fence, Role, Telemetry, Tick, TickEnd};
use scheduler::{
    Every, FencedBatches, Panics, Prune, Pruned, Prunes, Pruning, Retention, Shape, Stop,
};
use tokio::sync::Semaphore;
use tracing::warn;

use crate::config::SenderConfig;
use crate::error::Error;
use crate::message::Queued;
use crate::pool::Pool;
use crate::smtp::Connector;
use crate::smtp::SmtpUrl;
use crate::store;
use batch::{BatchDone, Probed};

const ROLE: &str = "email_outbox";

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
    /// When a tick's end reads the backlog gauges (docs/adr/0138).
    backlog_reads: Every,
}

impl std::fmt::Debug for Sender {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Sender")
            .field("config", &self.inner.config)
            .finish_non_exhaustive()
    }
}

/// The `hardcount_emails_total` series (outcome, SMTP class) that
/// deploy/prometheus/rules.yml reads, exported at 0 by [`Sender::new`].
pub const OUTCOMES_ALERTED: [(&str, &str); 4] = [
    ("sent", "2xx"),
    ("failed", "4xx"),
    ("failed", "5xx"),
    ("failed", "none"),
];

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
        // At 0 from the start, the series the alerts take increase() of: a
        // series born at its first send had that send unseen, and a new
        // leader's sends did not hold HardcountEmailsDelayed (docs/adr/0141).
        for (outcome, class) in OUTCOMES_ALERTED {
            telemetry
                .counter(
                    "hardcount_emails_total",
                    &[("outcome", outcome), ("smtp_class", class)],
                )
                .increment(0);
        }
        Ok(Sender {
            inner: Arc::new(Inner {
                db,
                backlog_reads: Every::new(config.backlog_read_every),
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
    /// A database error; nothing was claimed. Emails an earlier statement of
    /// the walk failed at their ceiling stay failed, and are counted.
    ///
    /// An email the claim fails at its attempt ceiling (every attempt claimed,
    /// none wrote a result: each send's process died) is logged and counted
    /// as any failure, `hardcount_emails_total{outcome="failed",
    /// smtp_class="none"}` (docs/adr/0109), also when a later statement of
    /// the walk errors (docs/adr/0141).
    pub async fn claim_due(&self, fence: &Fence, limit: usize) -> Result<Vec<Queued>, Error> {
        let c = &self.inner.config;
        let mut exhausted = 0;
        let claimed = store::claim_due(
            &self.inner.db,
            fence,
            &self.inner.cursor,
            limit,
            c.claim_lease(),
            c.retry_delays.len() + 1,
            c.statement_timeout,
            &mut exhausted,
        )
        .await;
        if exhausted > 0 {
            warn!(role = %Role::EmailOutbox, emails = exhausted, "emails failed at their attempt ceiling with no result written (attempts_exhausted): the process died at each of their sends");
            self.inner
                .telemetry
                .counter(
                    "hardcount_emails_total",
                    &[("outcome", "failed"), ("smtp_class", "none")],
                )
                .increment(exhausted);
        }
        Ok(claimed?)
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
                t.backlog_read(Role::EmailOutbox, b.read_at);
            }
            Err(e) => {
                self.inner.telemetry.backlog_read_failed(Role::EmailOutbox);
                warn!(role = ROLE, error = %e, "email backlog gauges not refreshed: they keep their last values")
            }
        }
    }
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
            if self.sender.inner.backlog_reads.due() {
                self.sender.refresh_gauges().await;
            }
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

    async fn prune(
        &self,
        fence: &Fence,
        keep: Duration,
        limit: usize,
    ) -> Result<Pruned, db::Error> {
        let inner = &self.0.inner;
        store::prune_finished(
            &inner.db,
            fence,
            keep,
            limit,
            inner.config.statement_timeout,
        )
        .await
        .map(Pruned::from)
    }
}
