//! The two role loops of one replica, wired as `hardcount serve` wires them, and
//! the sums of what their ticks reported.
//!
//! The only place the benchmark calls the roles' tick code (`run_tick` and its
//! report): keep it that way, so a change to those crates touches this file alone.

use std::sync::Arc;
use std::sync::atomic::{AtomicU64, Ordering::Relaxed};
use std::time::{Duration, Instant};

use anyhow::{Context, Result};
use db::Db;
use leader::{Manager, Role, Telemetry, Timing};
use scheduler::{IDLE_PROBE, RoleSpec, Wake, listen, run_role, work};
use tokio_util::sync::CancellationToken;
use webhook_delivery::Worker;
use webhook_outbox::Dispatcher;

use crate::args::Shape;

/// How long [`Loops::start`] waits for the delivery role's tick to lead
/// before it starts the fan-out anyway.
const LEAD_WAIT: Duration = Duration::from_secs(5);

/// What the role loops' ticks reported, summed.
#[derive(Default)]
pub struct Ticks {
    pub outbox_ticks: AtomicU64,
    pub outbox_events: AtomicU64,
    pub delivery_ticks: AtomicU64,
    pub delivery_batches: AtomicU64,
    pub claimed: AtomicU64,
    pub delivered: AtomicU64,
    /// Retried, dead, refused, stale, handed back, unrecorded or panicked.
    pub not_delivered: AtomicU64,
}

impl Ticks {
    fn add_outbox(&self, r: &webhook_outbox::TickReport) {
        self.outbox_ticks.fetch_add(1, Relaxed);
        self.outbox_events.fetch_add(r.events as u64, Relaxed);
    }

    fn add_delivery(&self, r: &webhook_delivery::TickReport) {
        self.delivery_ticks.fetch_add(1, Relaxed);
        self.delivery_batches.fetch_add(r.batches as u64, Relaxed);
        self.claimed.fetch_add(r.claimed as u64, Relaxed);
        self.delivered.fetch_add(r.delivered as u64, Relaxed);
        let other =
            r.retried + r.dead + r.refused + r.stale + r.released + r.unrecorded + r.panicked;
        self.not_delivered.fetch_add(other as u64, Relaxed);
    }
}

pub struct Loops {
    shutdown: CancellationToken,
    handles: Vec<tokio::task::JoinHandle<()>>,
    ticks: Arc<Ticks>,
}

impl Loops {
    /// Both roles on one replica: one `leader::Manager` with the design's
    /// timing (`Timing::ADR`, docs/design.md §2.4),
    /// one `scheduler::run_role` loop per role, on `db`; with `shape.listen`,
    /// woken through a listener on `listen_url` (as `HARDCOUNT_LISTEN_URL`).
    pub async fn start(db: &Db, shape: &Shape, listen_url: &str) -> Result<Loops> {
        let telemetry = Telemetry::noop();
        let manager = Manager::with_holder_id(
            db.clone(),
            Timing::ADR,
            telemetry.clone(),
            format!("bench-webhooks-{}", std::process::id()),
        );
        // As `hardcount serve`: an idle tick probes (docs/adr/0019).
        let mut dispatcher =
            Dispatcher::new(db.clone(), shape.dispatcher.clone(), telemetry.clone())?
                .with_idle_probe(IDLE_PROBE);
        let mut worker =
            Worker::new(db.clone(), shape.worker.clone(), telemetry)?.with_idle_probe(IDLE_PROBE);
        let shutdown = CancellationToken::new();
        let mut handles = Vec::new();
        // As `hardcount serve`: the delivery role's wake exists listener or
        // not, and the outbox pokes it after each fan-out (docs/adr/0070).
        let wakes = [Role::WebhookOutbox, Role::WebhookDelivery]
            .map(|role| Wake::new(role, shape.interval));
        dispatcher = dispatcher.with_hand_over(wakes[1].clone());
        worker = worker.with_wake(wakes[1].clone());
        if shape.listen {
            dispatcher = dispatcher.with_wake(wakes[0].clone());
            handles.push(tokio::spawn(listen(
                listen_url.to_owned(),
                wakes.to_vec(),
                Timing::ADR.max_poll,
                shutdown.clone(),
            )));
        }
        let ticks = Arc::new(Ticks::default());
        let (t1, t2) = (ticks.clone(), ticks.clone());
        let specs = [
            RoleSpec {
                role: Role::WebhookOutbox,
                interval: shape.interval,
                work: work(move |tick| {
                    let (dispatcher, t) = (dispatcher.clone(), t1.clone());
                    async move {
                        let r = dispatcher.run_tick(&tick).await;
                        t.add_outbox(&r);
                        r.end
                    }
                }),
            },
            RoleSpec {
                role: Role::WebhookDelivery,
                interval: shape.interval,
                work: work(move |tick| {
                    let (worker, t) = (worker.clone(), t2.clone());
                    async move {
                        let r = worker.run_tick(&tick).await;
                        t.add_delivery(&r);
                        r.end
                    }
                }),
            },
        ];
        // The delivery role first, as in a service that already runs: a
        // burst then finds its tick leading, and the fan-out hands over to
        // it from its first statement (docs/adr/0125). The wait is inside
        // the runs' clocks.
        let [outbox, delivery] = specs;
        handles.push(tokio::spawn(run_role(
            manager.clone(),
            delivery,
            shutdown.clone(),
        )));
        let leads = Instant::now() + LEAD_WAIT;
        while wakes[1].relay().offer().is_none() && Instant::now() < leads {
            tokio::time::sleep(Duration::from_millis(1)).await;
        }
        handles.push(tokio::spawn(run_role(manager, outbox, shutdown.clone())));
        Ok(Loops {
            shutdown,
            handles,
            ticks,
        })
    }

    /// Cancel both loops (and the listener) and wait for them; the ticks' sums.
    pub async fn stop(self) -> Result<Arc<Ticks>> {
        self.shutdown.cancel();
        for h in self.handles {
            h.await.context("a role loop panicked")?;
        }
        Ok(self.ticks)
    }
}
