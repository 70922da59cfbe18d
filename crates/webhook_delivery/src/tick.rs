//! The `webhook_delivery` tick: the fenced-batch driver ([`scheduler::drive`])
//! over this role's claim ([`claim_due`]) and batch ([`attempt_batch`]:
//! attempts run concurrently under limits, outcomes written in groups by
//! compare-and-set). Attempts a batch carried past its end
//! ([`crate::batch`]) are collected by later batches, and the rest at the
//! tick's end, before the gauges are read. A tick that prunes
//! (`WorkerConfig::retention`, docs/adr/0040) ends with the prune of
//! finished deliveries and of the role's lease history, in the slice of the
//! budget it held back.

use std::sync::Arc;
use std::sync::Mutex;
use std::sync::atomic::{AtomicUsize, Ordering::Relaxed};
use std::time::{Duration, Instant};

use leader::{Fence, Role, Tick, TickEnd};
use outbox::webhook::HandedDelivery;
use scheduler::{FencedBatches, Panics, Prune, Pruned, Prunes, Shape, Stop, Wake};
use tracing::warn;

use crate::batch::{Running, Tally, attempt_batch, collect};
use crate::delivery::Claimed;
use crate::disabling;
use crate::error::Error;
use crate::shared::Shared;
use crate::store;

/// What one tick did, per outcome.
#[derive(Debug)]
pub struct TickReport {
    pub batches: usize,
    pub claimed: usize,
    pub delivered: usize,
    pub retried: usize,
    pub dead: usize,
    pub refused: usize,
    pub stale: usize,
    pub released: usize,
    /// Handed back unsent to come due later: their endpoint's circuit breaker
    /// was open, or no turn came while their batch ran.
    pub held: usize,
    pub unrecorded: usize,
    /// Deliveries whose processing panicked (recorded as failed attempts).
    pub panicked: usize,
    pub elapsed: Duration,
    /// Why the tick stopped claiming.
    pub stop: Stop,
    /// How the lease is released (docs/adr/0007).
    pub end: TickEnd,
}

/// One tick of the role ([`crate::Worker::run_tick`] says what it does):
/// the driver over [`Deliveries`], then the attempts still carried collected,
/// the limits pruned and the breaker gauge set; a panic among the carried
/// attempts is raised after the count, as the driver raises its own.
pub(crate) async fn run_tick(
    shared: &Arc<Shared>,
    wake: Option<&Wake>,
    idle_probe: Option<Duration>,
    tick: &Tick,
) -> TickReport {
    let deliveries = Deliveries {
        shared,
        wake,
        idle_probe,
        carried: Mutex::new(Running::new()),
        waits: AtomicUsize::new(0),
        claimed_from_table: Mutex::new(None),
    };
    // While this tick runs, the fan-out of this process may claim deliveries
    // for it (docs/adr/0087).
    let token = tick.fence.token();
    deliveries.open_relay(&tick.fence, true);
    // Closed however the tick ends: dropped after the cancel grace, a lead
    // left behind had this process's fan-out wait for room before every
    // batch until it led again (docs/adr/0133).
    let _lead = Unlead(wake, token);
    // A tick that prunes holds back the prune's slice of the budget.
    let plan = shared
        .pruning
        .as_ref()
        .map(|p| p.plan(shared.config.tick_budget));
    let work_until = plan.map_or_else(
        || Instant::now() + shared.config.tick_budget,
        |p| p.work_until,
    );
    // A panic in a batch is raised after the work below, as one among the
    // carried attempts is: raised at once, it dropped the attempts still
    // carried (their results, a 2xx among them, never written) and left the
    // relay's rows to their lease (docs/adr/0133).
    let (driven, mut panics) = scheduler::drive_until_kept(&deliveries, tick, work_until).await;
    let mut t = driven.counts;
    if let Some(wake) = wake {
        wake.relay().unlead(token);
        // A cancelled tick (a shutdown, a lost lease) hands back at once what
        // the fan-out claimed for it; otherwise the next tick takes it.
        if tick.cancel.is_cancelled() {
            hand_back_handed(shared, wake, &mut t).await;
        }
    }
    // Collect the attempts carried past their batches; a panic among them
    // is raised after the count, as the driver raises its own.
    let carried = deliveries.take_carried();
    if !carried.is_empty() {
        collect(
            shared,
            carried,
            &mut Running::new(),
            None,
            None,
            &mut panics,
            &mut t,
        )
        .await;
    }
    end_of_tick(shared);
    panics.finish();
    if let (Some(plan), Some(pruning)) = (plan, shared.pruning.as_ref())
        && let Some(mut prunes) = Prunes::of(&plan, pruning, tick, &shared.telemetry)
    {
        prunes.run(&Finished(shared)).await;
        prunes.lease_history(&shared.db).await;
        prunes.finish();
    }
    TickReport {
        // Less the empty claims that only waited for carried attempts.
        batches: driven.batches - deliveries.waits.load(Relaxed),
        claimed: driven.claimed - deliveries.waits.load(Relaxed),
        delivered: t.delivered,
        retried: t.retried,
        dead: t.dead,
        refused: t.refused,
        stale: t.stale,
        released: t.released,
        held: t.held,
        unrecorded: t.unrecorded,
        panicked: t.panicked,
        elapsed: driven.elapsed,
        stop: driven.stop,
        end: driven.end,
    }
}

/// The fenced funnel: claim up to `limit` due pending deliveries for one
/// attempt each (see the crate docs; [`store::claim_due`]). Empty when
/// nothing is due or `fence` is stale. Deliveries the ceiling marks dead
/// are logged and counted, also when a later statement of the walk errors
/// (docs/adr/0141).
///
/// # Errors
/// A database error; nothing was claimed. Deliveries an earlier statement of
/// the walk marked dead at their ceiling stay dead, and are counted.
pub(crate) async fn claim_due(
    shared: &Shared,
    fence: &Fence,
    limit: usize,
) -> Result<Vec<Claimed>, Error> {
    let config = &shared.config;
    let claimed_at = Instant::now();
    let mut exhausted = 0;
    let rows = store::claim_due(
        &shared.db,
        fence,
        &shared.cursor,
        limit,
        config.claim_lease(),
        config.retry_schedule.max_attempts(),
        config.statement_timeout,
        &mut exhausted,
    )
    .await;
    if exhausted > 0 {
        // Claimed as many times as they have attempts with no outcome
        // written: each attempt's worker died (killed, out of memory). Dead
        // by the claim, counted and logged as any death.
        warn!(role = %leader::Role::WebhookDelivery, deliveries = exhausted, "deliveries dead at their attempt ceiling with no outcome written (attempts_exhausted): their workers died mid-attempt");
        shared
            .telemetry
            .counter("hardcount_webhook_deliveries_total", &[("outcome", "dead")])
            .increment(exhausted);
    }
    Ok(rows?
        .into_iter()
        .map(|row| Claimed { row, claimed_at })
        .collect())
}

/// How many batches of deliveries the fan-out may claim for this role ahead
/// of its claims (docs/adr/0087).
const HANDED_BATCHES: usize = 8;

/// While handed deliveries fill whole batches, the table is still claimed
/// from at least this often, so retries and held deliveries are not kept
/// waiting behind a long fan-out (docs/adr/0087).
const CLAIM_TABLE_EVERY: Duration = Duration::from_secs(1);

/// How many of a batch of `limit` a claim takes from the relay first: all of
/// it, or half while the claim statement is due (not run yet in this tick,
/// or last run `last` at least [`CLAIM_TABLE_EVERY`] before `now`).
fn handed_limit(last: Option<Instant>, now: Instant, limit: usize) -> usize {
    let table_due = last.is_none_or(|at| now.saturating_duration_since(at) >= CLAIM_TABLE_EVERY);
    if table_due { limit.div_ceil(2) } else { limit }
}

/// The deliveries the fan-out of this process claimed for this role
/// (docs/adr/0087), at most `limit`, each with the instant before the
/// fan-out's statement as its claim time. They are not written yet
/// (docs/adr/0124): each gets a negative id of this process, by which its
/// outcome or hand-back inserts its row.
fn take_handed(shared: &Shared, wake: Option<&Wake>, limit: usize) -> Vec<Claimed> {
    let Some(wake) = wake else {
        return Vec::new();
    };
    let mut handed = wake
        .relay()
        .take::<HandedDelivery>(limit)
        .into_iter()
        .map(|(claimed_at, d)| {
            let pair = store::Pair {
                tenant_id: d.tenant_id.clone(),
                event_id: d.event_id,
                endpoint_id: d.endpoint_id,
                handoff: d.handoff,
                handed_at: d.handed_at,
            };
            let pairs = d.handoff_pairs;
            let mut row = store::ClaimedRow::from_handed(d);
            row.id = shared.unwritten.adopt(pair, pairs, claimed_at);
            Claimed { row, claimed_at }
        })
        .collect::<Vec<_>>();
    handed.sort_by_key(|c| (c.row.event_id, c.row.endpoint_id));
    handed
}

/// Hand back unsent, due at once, every delivery the fan-out claimed for this
/// role that no tick took. Those that cannot be written come due when their
/// claim leases end.
async fn hand_back_handed(shared: &Shared, wake: &Wake, t: &mut Tally) {
    let left = take_handed(shared, Some(wake), usize::MAX);
    if !left.is_empty() {
        let held: Vec<store::HoldRow> = left
            .iter()
            .map(|c| (c.row.id, c.row.attempt, Duration::ZERO, None))
            .collect();
        t.holds(crate::outcomes::hold(shared, &held).await);
    }
}

/// The attempts carried past their batches, put back in their slot when
/// dropped.
struct PutBack<'a> {
    slot: &'a Mutex<Running>,
    running: Running,
}

impl Drop for PutBack<'_> {
    fn drop(&mut self) {
        *self.slot.lock().unwrap_or_else(|p| p.into_inner()) = std::mem::take(&mut self.running);
    }
}

/// Ends a tick's lead of the relay (`Relay::unlead`) when dropped.
struct Unlead<'a>(Option<&'a Wake>, i64);

impl Drop for Unlead<'_> {
    fn drop(&mut self) {
        if let Some(wake) = self.0 {
            wake.relay().unlead(self.1);
        }
    }
}

/// At a tick's end: forget the limits nothing holds and the handed-over
/// deliveries no attempt can still write (claimed more than two leases ago),
/// set the breaker gauge.
fn end_of_tick(shared: &Shared) {
    shared.limits.prune();
    shared
        .unwritten
        .forget_older(shared.config.claim_lease() * 2);
    shared
        .telemetry
        .gauge("hardcount_webhook_breakers_open", &[])
        .set(shared.breakers.open_count() as f64);
}

/// Read the backlog gauges on the database clock.
async fn refresh_gauges(shared: &Shared) {
    match store::backlog(&shared.db, shared.config.statement_timeout).await {
        Ok(b) => {
            let t = &shared.telemetry;
            t.gauge("hardcount_webhook_deliveries_pending", &[])
                .set(b.pending as f64);
            t.gauge("hardcount_webhook_deliveries_dead", &[])
                .set(b.dead as f64);
            t.gauge("hardcount_webhook_oldest_pending_age_seconds", &[])
                .set(b.oldest_pending_age);
            t.gauge("hardcount_webhook_oldest_due_age_seconds", &[])
                .set(b.oldest_due_age);
            t.backlog_read(Role::WebhookDelivery, b.read_at);
        }
        Err(e) => {
            shared.telemetry.backlog_read_failed(Role::WebhookDelivery);
            warn!(role = %Role::WebhookDelivery, error = %e, "could not read the webhook delivery backlog")
        }
    }
}

/// The role as the driver sees it: a claim is [`claim_due`], a batch is
/// [`attempt_batch`]; attempts carried past their batches wait in
/// `carried` for the next batch or the tick's end.
///
/// While attempts are carried, a claim that finds nothing still counts as one
/// item (`Batch::waits`), so the driver runs a batch that only collects them
/// and then claims again (after `BUSY_POLL`, or a wake-up) instead of ending
/// the tick: deliveries that come due while a tarpit's requests hang are
/// claimed then, not after them.
struct Deliveries<'a> {
    shared: &'a Arc<Shared>,
    wake: Option<&'a Wake>,
    idle_probe: Option<Duration>,
    carried: Mutex<Running>,
    /// Empty claims counted as one item, taken off the tick's report.
    waits: AtomicUsize,
    /// When this tick last ran its claim statement.
    claimed_from_table: Mutex<Option<Instant>>,
}

/// A claim: the deliveries claimed, or none while attempts are carried.
struct Batch {
    claimed: Vec<Claimed>,
    waits: bool,
}

impl Deliveries<'_> {
    /// Let the fan-out claim for this tick (`open`), or not while the table
    /// holds a backlog (docs/adr/0087).
    fn open_relay(&self, fence: &Fence, open: bool) {
        if let Some(wake) = self.wake {
            let config = &self.shared.config;
            let room = if open {
                HANDED_BATCHES * config.batch_size
            } else {
                0
            };
            // Rows wait with their payloads: at most one batch's worth at the
            // largest payload, what one claim statement may hold anyway.
            let bytes = config.batch_size * outbox::webhook::MAX_PAYLOAD_BYTES;
            wake.relay()
                .lead(fence.token(), config.claim_lease(), room, bytes);
        }
    }

    fn take_carried(&self) -> Running {
        std::mem::take(&mut *self.carried.lock().unwrap_or_else(|p| p.into_inner()))
    }
}

impl FencedBatches for Deliveries<'_> {
    type Claim = Batch;
    type Counts = Tally;
    type Error = Error;

    fn role(&self) -> Role {
        Role::WebhookDelivery
    }

    fn shape(&self) -> Shape {
        let config = &self.shared.config;
        Shape {
            batch_size: config.batch_size,
            budget: config.tick_budget,
            // No attempt starts that could end after the budget.
            reserve: config.request_timeout,
        }
    }

    /// The deliveries the fan-out handed over first, then the claim
    /// statement for the rest of `limit`, then handed ones again if the
    /// table had less. While handed deliveries fill the batch, the statement
    /// still runs every [`CLAIM_TABLE_EVERY`], for half the batch; a full
    /// claim closes the relay until one comes back short.
    async fn claim(&self, fence: &Fence, limit: usize) -> Result<Batch, Error> {
        let last = *self
            .claimed_from_table
            .lock()
            .unwrap_or_else(|p| p.into_inner());
        let mut claimed = take_handed(
            self.shared,
            self.wake,
            handed_limit(last, Instant::now(), limit),
        );
        if claimed.len() < limit {
            *self
                .claimed_from_table
                .lock()
                .unwrap_or_else(|p| p.into_inner()) = Some(Instant::now());
            let asked = limit - claimed.len();
            match claim_due(self.shared, fence, asked).await {
                Ok(more) => {
                    // A full claim means the table holds a backlog: the
                    // fan-out leaves its deliveries to this statement, in
                    // due order and by tenant, until a claim comes back
                    // short.
                    self.open_relay(fence, more.len() < asked);
                    claimed.extend(more);
                }
                // The handed deliveries are claimed already (their handoff
                // is written, docs/adr/0124): send them.
                Err(e) if !claimed.is_empty() => {
                    warn!(role = %Role::WebhookDelivery, error = %e, "the claim statement failed; sending the deliveries handed over");
                }
                Err(e) => return Err(e),
            }
            // Fill the batch from the relay when the table had less.
            if claimed.len() < limit {
                claimed.extend(take_handed(self.shared, self.wake, limit - claimed.len()));
            }
        }
        let waits = claimed.is_empty()
            && !self
                .carried
                .lock()
                .unwrap_or_else(|p| p.into_inner())
                .is_empty();
        if waits {
            self.waits.fetch_add(1, Relaxed);
        }
        Ok(Batch { claimed, waits })
    }

    fn claimed(claim: &Batch) -> usize {
        claim.claimed.len().max(usize::from(claim.waits))
    }

    fn wake(&self) -> Option<&Wake> {
        self.wake
    }

    fn idle_probe(&self) -> Option<Duration> {
        self.idle_probe
    }

    /// Deliveries handed over wait here, claimed, where the table's probe
    /// does not see them.
    async fn probe(&self) -> Result<bool, Error> {
        if self.wake.is_some_and(|w| w.relay().waiting() > 0) {
            return Ok(true);
        }
        Ok(store::any_due(&self.shared.db).await?)
    }

    /// Deliveries are fanned out at any time: a tick that delivered some is
    /// followed at once by the next, not after the interval.
    fn due_again_after_work(&self) -> bool {
        true
    }

    async fn run(
        &self,
        batch: Batch,
        tick: &Tick,
        deadline: Instant,
        panics: &mut Panics,
        tally: &mut Tally,
    ) -> Result<(), Error> {
        // Put back however the batch ends: a panic in its own code drops
        // this future, and the attempts carried from earlier batches with
        // it, which the tick collects after the driver (docs/adr/0133).
        let mut carried = PutBack {
            slot: &self.carried,
            running: self.take_carried(),
        };
        attempt_batch(
            self.shared,
            batch.claimed,
            deadline,
            &tick.cancel,
            self.wake,
            &mut carried.running,
            panics,
            tally,
        )
        .await;
        Ok(())
    }

    async fn end_tick(&self, tick: &Tick) {
        if !tick.cancel.is_cancelled() {
            if self.shared.disabling.due()
                && let Err(e) = disabling::disable_failing(self.shared, &tick.fence).await
            {
                warn!(role = %Role::WebhookDelivery, error = %e, "could not turn off the failing webhook endpoints; the next look retries");
            }
            if self.shared.backlog_reads.due() {
                refresh_gauges(self.shared).await;
            }
        }
    }
}

/// The retention prune (docs/adr/0040): delivered and dead deliveries with
/// their attempts, a fenced batch per statement ([`store::prune_finished`]).
struct Finished<'a>(&'a Shared);

impl Prune for Finished<'_> {
    type Error = db::Error;

    fn kind(&self) -> &'static str {
        "webhook_deliveries"
    }

    async fn prune(
        &self,
        fence: &Fence,
        keep: Duration,
        limit: usize,
    ) -> Result<Pruned, db::Error> {
        store::prune_finished(
            &self.0.db,
            fence,
            keep,
            limit,
            self.0.config.statement_timeout,
        )
        .await
        .map(Pruned::from)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// The claim statement's turn beside handed deliveries (docs/adr/0087):
    /// at a tick's first claim, then once [`CLAIM_TABLE_EVERY`] has passed
    /// since the last, half the batch is left to it.
    ///
    /// Mutation check: `relay_table_cadence` (the statement's turn only at
    /// the tick's first claim) fails this test.
    #[test]
    fn the_claim_statement_gets_half_a_batch_once_a_second() {
        let now = Instant::now();
        let ago = |ms| now.checked_sub(Duration::from_millis(ms)).unwrap();
        assert_eq!(handed_limit(None, now, 5), 3, "the tick's first claim");
        assert_eq!(handed_limit(Some(ago(400)), now, 5), 5);
        assert_eq!(handed_limit(Some(ago(999)), now, 5), 5);
        assert_eq!(handed_limit(Some(ago(1000)), now, 5), 3);
        assert_eq!(handed_limit(Some(ago(4000)), now, 500), 250);
    }
}
