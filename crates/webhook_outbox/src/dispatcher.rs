//! The `webhook_outbox` tick: batches of fan-out until the outbox is empty,
//! the time budget is spent, or the tick is cancelled.

use std::time::{Duration, Instant};

use db::Db;
use leader::{Fence, Telemetry, Tick};
use scheduler::Panics;
use tracing::{debug, info, warn};

use crate::Error;
use crate::store::{self, Batch};

/// How a dispatcher tick is shaped.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct DispatcherConfig {
    /// Events claimed per transaction. Default 500.
    pub batch_size: usize,
    /// No batch starts after this much of the tick has passed. Default 10 s.
    pub tick_budget: Duration,
    /// The server cancels a batch's statements after this. Default 10 s.
    pub statement_timeout: Duration,
}

impl Default for DispatcherConfig {
    fn default() -> Self {
        DispatcherConfig {
            batch_size: 500,
            tick_budget: Duration::from_secs(10),
            statement_timeout: Duration::from_secs(10),
        }
    }
}

/// Why a tick stopped.
#[derive(Debug)]
pub enum TickEnd {
    /// A batch came back smaller than the batch size: nothing else is waiting.
    Drained,
    /// The budget ran out with events possibly left; the next tick goes on.
    BudgetSpent,
    /// The lease was lost or the process is shutting down.
    Cancelled,
    /// A batch panicked; the tick raises it again after its report.
    Panicked,
    /// A batch failed (logged); its transaction rolled back, so its events
    /// stay undispatched for the next tick.
    Failed(Error),
}

impl TickEnd {
    /// How the lease manager should release this tick (docs/adr/0007).
    pub fn for_release(&self) -> leader::TickEnd {
        match self {
            TickEnd::BudgetSpent => leader::TickEnd::MoreWork,
            TickEnd::Failed(e) => leader::TickEnd::Failed(e.to_string()),
            // A cancelled tick is released as lost or interrupted, whatever it says.
            _ => leader::TickEnd::Drained,
        }
    }
}

/// What one tick did.
#[derive(Debug)]
pub struct TickReport {
    /// Batches that dispatched at least one event.
    pub batches: usize,
    pub events: usize,
    pub deliveries: u64,
    pub elapsed: Duration,
    pub end: TickEnd,
}

/// Fans out outbox events. Cheap to clone.
#[derive(Debug, Clone)]
pub struct Dispatcher {
    db: Db,
    config: DispatcherConfig,
    telemetry: Telemetry,
}

const ROLE: &str = "webhook_outbox";

impl Dispatcher {
    pub fn new(db: Db, config: DispatcherConfig, telemetry: Telemetry) -> Dispatcher {
        let config = DispatcherConfig {
            batch_size: config.batch_size.max(1),
            ..config
        };
        Dispatcher {
            db,
            config,
            telemetry,
        }
    }

    pub fn config(&self) -> &DispatcherConfig {
        &self.config
    }

    /// One tick of the role: dispatch batches until the outbox is drained, the
    /// budget is spent, or `tick.cancel` fires. Each batch runs under the panic
    /// guard; a panic is raised again at the end (so the lease is released as
    /// panicked) after the report is logged.
    ///
    /// # Panics
    /// When a batch panicked, after the rest of the tick.
    ///
    /// # Cancel safety
    /// `tick.cancel` is checked between batches. A batch is one transaction:
    /// dropped mid-way (the lease manager drops a tick that outlives its
    /// cancel grace), it rolls back and its events are claimed again later.
    pub async fn run_tick(&self, tick: &Tick) -> TickReport {
        let started = Instant::now();
        let mut panics = Panics::new(ROLE);
        let (mut batches, mut events, mut deliveries) = (0, 0, 0);
        let end = loop {
            if tick.cancel.is_cancelled() {
                break TickEnd::Cancelled;
            }
            if started.elapsed() >= self.config.tick_budget {
                break TickEnd::BudgetSpent;
            }
            // A batch is short and bounded by the statement timeout: let it finish.
            let Some(outcome) = panics.step("dispatch_batch", self.batch(&tick.fence)).await else {
                break TickEnd::Panicked; // logged by the guard, raised by finish()
            };
            match outcome {
                Ok(batch) => {
                    batches += usize::from(batch.events > 0);
                    events += batch.events;
                    deliveries += batch.deliveries;
                    if batch.events < self.config.batch_size {
                        break TickEnd::Drained;
                    }
                }
                Err(e) => {
                    warn!(role = ROLE, error = %e, "webhook fan-out batch failed; its events stay undispatched");
                    break TickEnd::Failed(e);
                }
            }
        };
        let report = TickReport {
            batches,
            events,
            deliveries,
            elapsed: started.elapsed(),
            end,
        };
        if report.events > 0 {
            info!(role = ROLE, events = report.events, deliveries = report.deliveries, batches = report.batches, elapsed = ?report.elapsed, end = ?report.end, "webhook events dispatched");
        } else {
            debug!(role = ROLE, end = ?report.end, "no webhook events to dispatch");
        }
        panics.finish();
        report
    }

    /// The fenced funnel: one transaction that claims up to `limit` events,
    /// fans them out and marks them dispatched. Returns how many events it
    /// dispatched; zero when the outbox is empty or `fence` is stale.
    ///
    /// # Errors
    /// A database error; the transaction rolled back and nothing changed.
    pub async fn dispatch_batch(&self, fence: &Fence, limit: usize) -> Result<usize, Error> {
        let batch =
            store::claim_and_fan_out(&self.db, fence, limit, self.config.statement_timeout).await?;
        self.count(batch);
        Ok(batch.events)
    }

    async fn batch(&self, fence: &Fence) -> Result<Batch, Error> {
        let batch = store::claim_and_fan_out(
            &self.db,
            fence,
            self.config.batch_size,
            self.config.statement_timeout,
        )
        .await?;
        self.count(batch);
        Ok(batch)
    }

    fn count(&self, batch: Batch) {
        if batch.events > 0 {
            self.telemetry
                .counter("hardcount_webhook_events_dispatched_total", &[])
                .increment(batch.events as u64);
            debug!(
                role = ROLE,
                events = batch.events,
                deliveries = batch.deliveries,
                "webhook batch fanned out"
            );
        }
    }
}
