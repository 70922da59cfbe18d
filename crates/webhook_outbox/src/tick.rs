//! The `webhook_outbox` tick: the fenced-batch driver ([`scheduler::drive`])
//! over the outbox's one-transaction batch (claim, fan out, stamp dispatched),
//! and on a tick that prunes ([`Dispatcher::with_retention`]) the retention
//! prune as its last step.

use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use db::Db;
use leader::{Fence, Role, Telemetry, Tick, TickEnd};
use scheduler::{
    Every, FencedBatches, Panics, Prune, Pruned, Prunes, Pruning, Retention, Shape, Stop, Wake,
};
use tracing::{debug, warn};

use crate::Error;
use crate::config::DispatcherConfig;
use crate::store::{self, Batch, PruneCursor};

/// How long a batch waits for the delivery role of this process to take
/// from a relay more than half full before it fans out anyway: whatever
/// does not fit then is inserted pending, the claim statement's to read,
/// and a delivery role that keeps the relay full is not waited on longer
/// than this per batch (docs/adr/0125).
const ROOM_WAIT: Duration = Duration::from_millis(500);

/// How often a tick that keeps claiming tries to take the handoffs whose
/// lease has ended ([`store::recover_handoffs`]), checked after each batch; a
/// batch that claims nothing always does (docs/adr/0127). Their deliveries
/// wait about this much past the lease while the outbox is busy.
const RECOVER_EVERY: Duration = Duration::from_secs(1);

/// What one tick did.
#[derive(Debug)]
pub struct TickReport {
    /// Batches that dispatched at least one event.
    pub batches: usize,
    pub events: usize,
    pub deliveries: u64,
    pub elapsed: Duration,
    /// Why the tick stopped claiming.
    pub stop: Stop,
    /// How the lease is released (docs/adr/0007).
    pub end: TickEnd,
}

/// Fans out outbox events. Cheap to clone.
#[derive(Debug, Clone)]
pub struct Dispatcher {
    db: Db,
    config: DispatcherConfig,
    telemetry: Telemetry,
    wake: Option<Wake>,
    /// The delivery role's wake in this process, poked after each fan-out.
    hand_over: Option<Wake>,
    idle_probe: Option<Duration>,
    pruning: Option<Arc<Pruning>>,
    /// Where the next claim starts among tenants (docs/adr/0048).
    cursor: db::TenantCursor,
    /// Where the event prune's next statement reads from (docs/adr/0108).
    prune_from: Arc<Mutex<PruneCursor>>,
    /// When taking expired handoffs was last tried (docs/adr/0127).
    recovered_at: Arc<Mutex<Option<Instant>>>,
    /// When a tick's end reads the backlog gauges (docs/adr/0138).
    backlog_reads: Arc<Every>,
}

impl Dispatcher {
    /// # Errors
    /// [`Error::Config`] naming a setting that cannot work.
    pub fn new(
        db: Db,
        config: DispatcherConfig,
        telemetry: Telemetry,
    ) -> Result<Dispatcher, Error> {
        config.validate()?;
        Ok(Dispatcher {
            db,
            backlog_reads: Arc::new(Every::new(config.backlog_read_every)),
            config,
            telemetry,
            wake: None,
            hand_over: None,
            idle_probe: None,
            pruning: None,
            cursor: db::TenantCursor::default(),
            prune_from: Arc::default(),
            recovered_at: Arc::default(),
        })
    }

    /// Listen for wake-ups (docs/adr/0014): while `wake` is listening, a tick
    /// that drained stays open and claims again when a producer's enqueue
    /// commits (or at `wake`'s poll interval) until its budget.
    #[must_use]
    pub fn with_wake(mut self, wake: Wake) -> Dispatcher {
        self.wake = Some(wake);
        self
    }

    /// Hand the fanned-out deliveries over (docs/adr/0070): after each batch
    /// that inserted deliveries, poke `delivery`, the `webhook_delivery`
    /// role's wake in this process, so that a tick of that role waiting out a
    /// probe's or a busy claim's pause claims them at once. Not while that
    /// wake listens: the fan-out's `pg_notify` wakes it then, in any replica.
    /// Harmless when this process does not lead that role: the poke waits for
    /// its next tick, one claim that may find nothing.
    ///
    /// While a tick of that role runs here, the fan-out also hands up to its
    /// room of deliveries to it, proving its token, through `delivery`'s
    /// [`scheduler::Relay`]: that role sends them without a claim statement
    /// (docs/adr/0087) and writes each once, with its first outcome; a
    /// `webhook_handoffs` row stands for them until then (docs/adr/0124). A
    /// batch that finds that relay more than half full waits for room, up to
    /// 500 ms (at most half the tick budget, which the tick reserves), before
    /// its statement; with room found within the wait it claims about what
    /// fits (docs/adr/0125).
    #[must_use]
    pub fn with_hand_over(mut self, delivery: Wake) -> Dispatcher {
        self.hand_over = Some(delivery);
        self
    }

    /// Probe while idle (docs/adr/0019): a tick that drained stays open until
    /// its budget and asks every `every` (`scheduler::IDLE_PROBE` in
    /// `hardcount serve`) whether an event is waiting, one index read, and
    /// claims when one is; the next tick follows at once. An event then waits
    /// about `every` for the fan-out without a listener, not the interval.
    /// With a listening wake, the wake decides instead.
    #[must_use]
    pub fn with_idle_probe(mut self, every: Duration) -> Dispatcher {
        self.idle_probe = Some(every);
        self
    }

    /// Prune (docs/adr/0040): a tick at most every `retention.every` ends
    /// with the deletion of dispatched events older than `retention.keep`
    /// whose deliveries are gone, and of the role's lease history older than
    /// `retention.lease_history`, a fenced batch per statement in a slice of
    /// the budget ([`scheduler::Pruning`]).
    #[must_use]
    pub fn with_retention(mut self, retention: Retention) -> Dispatcher {
        self.pruning = Some(Arc::new(Pruning::new(retention)));
        self
    }

    pub fn config(&self) -> &DispatcherConfig {
        &self.config
    }

    /// One tick of the role: dispatch batches until the outbox is drained, the
    /// budget is spent, a batch fails, or `tick.cancel` fires.
    ///
    /// # Panics
    /// When a batch panicked, after the rest of the tick (so the lease is
    /// released as panicked).
    ///
    /// # Cancel safety
    /// `tick.cancel` is checked between batches. A batch is one transaction:
    /// dropped mid-way (the lease manager drops a tick that outlives its
    /// cancel grace), it rolls back and its events are claimed again later.
    pub async fn run_tick(&self, tick: &Tick) -> TickReport {
        let plan = self
            .pruning
            .as_ref()
            .map(|p| p.plan(self.config.tick_budget));
        let work_until = plan.map_or_else(
            || Instant::now() + self.config.tick_budget,
            |p| p.work_until,
        );
        let driven = scheduler::drive_until(&Fanout(self), tick, work_until).await;
        if let (Some(plan), Some(pruning)) = (plan, self.pruning.as_deref())
            && let Some(mut prunes) = Prunes::of(&plan, pruning, tick, &self.telemetry)
        {
            prunes.run(&Dispatched(self)).await;
            prunes.lease_history(&self.db).await;
            prunes.finish();
        }
        TickReport {
            batches: driven.batches,
            events: driven.claimed,
            deliveries: driven.counts,
            elapsed: driven.elapsed,
            stop: driven.stop,
            end: driven.end,
        }
    }

    /// The fenced funnel: one transaction that claims up to `limit` events,
    /// fans them out and marks them dispatched. Returns how many events it
    /// dispatched; zero when the outbox is empty or `fence` is stale.
    ///
    /// # Errors
    /// A database error; the transaction rolled back and nothing changed.
    pub async fn dispatch_batch(&self, fence: &Fence, limit: usize) -> Result<usize, Error> {
        Ok(self.batch(fence, limit).await?.events)
    }

    /// How long a batch waits for room in the relay: [`ROOM_WAIT`], at most
    /// half the tick budget (a short budget still dispatches).
    fn room_wait(&self) -> Duration {
        ROOM_WAIT.min(self.config.tick_budget / 2)
    }

    /// Whether a batch that claimed should try to take expired handoffs: a
    /// second or more since the last try, or none yet.
    fn recovery_due(&self) -> bool {
        let at = *self.recovered_at.lock().unwrap_or_else(|p| p.into_inner());
        at.is_none_or(|at| at.elapsed() >= RECOVER_EVERY)
    }

    /// Take the handoffs whose lease has ended ([`store::recover_handoffs`])
    /// and poke the delivery role of this process for what was inserted.
    /// The try is recorded either way, so [`Dispatcher::recovery_due`] spaces
    /// a failing one too.
    async fn recover(&self, fence: &Fence) -> Result<(), Error> {
        *self.recovered_at.lock().unwrap_or_else(|p| p.into_inner()) = Some(Instant::now());
        let n = store::recover_handoffs(&self.db, fence, self.config.statement_timeout).await?;
        if n > 0 {
            warn!(
                role = %Role::WebhookOutbox,
                deliveries = n,
                "deliveries handed to a delivery role that did not write them before its lease ended (its process died, or its writes failed): inserted pending; they are sent again"
            );
            if let Some(delivery) = self.hand_over.as_ref()
                && !delivery.is_listening()
            {
                delivery.poke();
            }
        }
        Ok(())
    }

    async fn batch(&self, fence: &Fence, limit: usize) -> Result<Batch, Error> {
        // A relay more than half full is waited on: with room found within
        // the wait, this statement claims only about what fits and leaves
        // the rest of the outbox undispatched rather than inserting it
        // pending behind the handed rows; after a wait that ran out, it
        // fans out as before (docs/adr/0125).
        let offer = match self.hand_over.as_ref() {
            Some(w) => w.relay().offer_with_room(self.room_wait()).await,
            None => None,
        };
        let (batch, handed) = store::claim_and_fan_out(
            &self.db,
            fence,
            &self.cursor,
            limit,
            self.config.max_deliveries_per_statement,
            offer,
            self.config.statement_timeout,
        )
        .await?;
        let claimed_for_delivery = handed.rows.len();
        if let Some(delivery) = self.hand_over.as_ref() {
            if claimed_for_delivery > 0 {
                delivery.relay().hand(handed.at, handed.rows);
            }
            // A listening delivery role hears the fan-out's own pg_notify,
            // but it may hear it before the rows claimed for it are handed
            // over here, claim nothing and wait: those are poked for.
            let inserted = batch.deliveries > claimed_for_delivery as u64;
            if claimed_for_delivery > 0 || (inserted && !delivery.is_listening()) {
                delivery.poke();
            }
        }
        if batch.events == 0 {
            // A failure fails the tick, as it failed the fan-out statement
            // when the recovery was a part of it: the lease manager's
            // back-off and the tick metrics see it, and an idle probe that
            // keeps seeing the expired handoff does not retry it at once.
            self.recover(fence).await?;
        } else if self.recovery_due()
            && let Err(e) = self.recover(fence).await
        {
            // The fan-out has committed: its batch stands, and the next
            // batch that claims nothing, or a second from now, tries again.
            warn!(
                role = %Role::WebhookOutbox, error = %e,
                "could not take the handoffs whose lease has ended; tried again later"
            );
        }
        if batch.events > 0 {
            self.telemetry
                .counter("hardcount_webhook_events_dispatched_total", &[])
                .increment(batch.events as u64);
            debug!(
                role = %Role::WebhookOutbox,
                events = batch.events,
                deliveries = batch.deliveries,
                claimed_for_delivery,
                "webhook batch fanned out"
            );
        }
        Ok(batch)
    }
}

/// The role as the driver sees it. Claim, fan-out and the dispatched stamp are
/// one transaction, so the claim is the whole batch; running it only counts
/// its deliveries.
struct Fanout<'a>(&'a Dispatcher);

impl FencedBatches for Fanout<'_> {
    type Claim = Batch;
    /// Deliveries inserted.
    type Counts = u64;
    type Error = Error;

    fn role(&self) -> Role {
        Role::WebhookOutbox
    }

    fn shape(&self) -> Shape {
        Shape {
            batch_size: self.0.config.batch_size,
            budget: self.0.config.tick_budget,
            // No batch starts that could wait for the relay past the budget;
            // at most half of it is reserved, so a short budget still works.
            reserve: if self.0.hand_over.is_some() {
                self.0.room_wait()
            } else {
                Duration::ZERO
            },
        }
    }

    async fn claim(&self, fence: &Fence, limit: usize) -> Result<Batch, Error> {
        self.0.batch(fence, limit).await
    }

    fn claimed(batch: &Batch) -> usize {
        batch.events
    }

    fn wake(&self) -> Option<&Wake> {
        self.0.wake.as_ref()
    }

    fn idle_probe(&self) -> Option<Duration> {
        self.0.idle_probe
    }

    async fn probe(&self) -> Result<bool, Error> {
        Ok(store::any_undispatched(&self.0.db).await?)
    }

    /// Producers commit at any time: a tick that dispatched some is followed
    /// at once by the next, not after the interval.
    fn due_again_after_work(&self) -> bool {
        true
    }

    /// The backlog gauges, read by the leader at a tick's end at most once per
    /// `backlog_read_every` (docs/adr/0138): a fan-out
    /// that falls behind or stops making progress shows as the age of the
    /// oldest event not yet fanned out (`HardcountWebhookEventsUndispatched`),
    /// which no delivery gauge sees, since its deliveries do not exist yet.
    async fn end_tick(&self, tick: &Tick) {
        let d = self.0;
        if tick.cancel.is_cancelled() || !d.backlog_reads.due() {
            return;
        }
        match store::backlog(&d.db, d.config.statement_timeout).await {
            Ok((waiting, oldest, read_at)) => {
                d.telemetry
                    .gauge("hardcount_webhook_events_undispatched", &[])
                    .set(waiting as f64);
                d.telemetry
                    .gauge(
                        "hardcount_webhook_events_oldest_undispatched_age_seconds",
                        &[],
                    )
                    .set(oldest);
                d.telemetry.backlog_read(Role::WebhookOutbox, read_at);
            }
            Err(e) => {
                d.telemetry.backlog_read_failed(Role::WebhookOutbox);
                warn!(role = %Role::WebhookOutbox, error = %e, "could not read the webhook outbox backlog");
            }
        }
    }

    async fn run(
        &self,
        batch: Batch,
        _tick: &Tick,
        _deadline: Instant,
        _panics: &mut Panics,
        deliveries: &mut u64,
    ) -> Result<(), Error> {
        *deliveries += batch.deliveries;
        Ok(())
    }
}

/// The retention prune of dispatched events ([`store::prune_dispatched`]).
/// Each statement reads on from where the last one stopped, across ticks, and
/// a pass starts again from the oldest once a statement reads a short batch
/// (docs/adr/0108): events kept back by their deliveries are read once a pass.
struct Dispatched<'a>(&'a Dispatcher);

impl Prune for Dispatched<'_> {
    type Error = db::Error;

    fn kind(&self) -> &'static str {
        "webhook_events"
    }

    async fn prune(
        &self,
        fence: &Fence,
        keep: Duration,
        limit: usize,
    ) -> Result<Pruned, db::Error> {
        let from = *self.0.prune_from.lock().unwrap_or_else(|p| p.into_inner());
        let pruned = store::prune_dispatched(
            &self.0.db,
            fence,
            keep,
            limit,
            from,
            self.0.config.statement_timeout,
        )
        .await?;
        let next = match pruned.last {
            Some(last) if pruned.read >= limit as u64 => last,
            _ => PruneCursor::default(),
        };
        *self.0.prune_from.lock().unwrap_or_else(|p| p.into_inner()) = next;
        Ok(Pruned {
            deleted: pruned.deleted,
            read: pruned.read,
        })
    }
}
