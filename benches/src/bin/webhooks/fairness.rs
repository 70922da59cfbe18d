//! Fairness (issue 12, point 6; docs/adr/0018): a healthy tenant's throughput
//! alone, and again beside a tenant whose 8 endpoints point at a tarpit (a
//! loopback port that accepts connections and never answers), with the same
//! settings. The issue asks that the healthy tenant keep at least 90 %.

use std::sync::Arc;
use std::sync::atomic::{AtomicUsize, Ordering::SeqCst};
use std::time::{Duration, Instant};

use anyhow::{Result, bail, ensure};
use db::Db;
use testbed::receiver::Receiver;
use testbed::{Leg, TestDb};
use tokio::io::AsyncReadExt as _;
use webhook_delivery::{WorkerConfig, create_endpoint};

use crate::args::{FairnessFlags as Flags, Shape};
use crate::loops::Loops;
use crate::progress;
use crate::report::{Figure, Report, Target};
use crate::workload::{EVENT_TYPE, bench_keyring, payload};

/// The target: the healthy tenant's throughput beside the tarpit, as a
/// share of its throughput alone.
pub const TARGET: f64 = 0.90;
const HEALTHY: &str = "tenant_healthy";
const TARPIT: &str = "tenant_tarpit";
/// The healthy tenant's endpoints: two, so its share (8) is what binds, not
/// one endpoint's 4.
const HEALTHY_ENDPOINTS: usize = 2;
/// The tarpit tenant's endpoints, all at one tarpit address.
const TARPIT_ENDPOINTS: usize = 8;
/// Events of the tarpit tenant enqueued before the healthy tenant's: claimed
/// first, more than its slots can take in the run.
const TARPIT_EVENTS: usize = 100;
const GIVE_UP: Duration = Duration::from_secs(300);

/// The worker's settings for both runs: the benchmark's shape with
/// production's fairness defaults (`WorkerConfig::default()`: 8 per tenant, 16
/// per destination, the breaker after 5 timeouts, 15 s requests).
pub fn worker(shape: &Shape) -> WorkerConfig {
    let d = WorkerConfig::default();
    WorkerConfig {
        max_in_flight_per_tenant: d.max_in_flight_per_tenant,
        max_in_flight_per_destination: d.max_in_flight_per_destination,
        breaker_timeouts: d.breaker_timeouts,
        breaker_cooloff: d.breaker_cooloff,
        request_timeout: d.request_timeout,
        ..shape.worker.clone()
    }
}

/// One run's healthy throughput.
pub struct Run {
    pub deliveries: usize,
    pub wall: Duration,
    /// Connections the tarpit held at once, at most.
    pub tarpit_most: usize,
}

impl Run {
    pub fn rate(&self) -> f64 {
        self.deliveries as f64 / self.wall.as_secs_f64()
    }
}

/// `--fairness-runs` pairs of runs, alone then beside the tarpit,
/// interleaved so that the machine's drift falls on both; every run, in order.
pub async fn phase(
    flags: &Flags,
    shape: &Shape,
    leg: Leg,
    receiver: &Receiver,
) -> Result<(Vec<Run>, Vec<Run>)> {
    ensure!(
        flags.fairness_runs > 0 && flags.fairness_events > 0,
        "fairness-runs and fairness-events must be positive"
    );
    let shape = Shape {
        worker: worker(shape),
        ..shape.clone()
    };
    let tarpit = Tarpit::start().await?;
    let (mut alone, mut beside) = (Vec::new(), Vec::new());
    for i in 1..=flags.fairness_runs {
        let a = run(flags, &shape, leg, receiver, None).await?;
        let b = run(flags, &shape, leg, receiver, Some(&tarpit)).await?;
        progress(&format!(
            "fairness: pair {i}/{}: alone {:.0}/s, beside the tarpit {:.0}/s",
            flags.fairness_runs,
            a.rate(),
            b.rate()
        ));
        alone.push(a);
        beside.push(b);
    }
    Ok((alone, beside))
}

/// The run with the median rate.
fn median(runs: &[Run]) -> &Run {
    let mut order: Vec<&Run> = runs.iter().collect();
    order.sort_by(|a, b| a.rate().total_cmp(&b.rate()));
    order[order.len() / 2]
}

/// One run on a fresh database: the tarpit tenant's backlog (if any) and then
/// the healthy tenant's enqueued, the loops started and the clock with them,
/// until every healthy delivery is `delivered`.
async fn run(
    flags: &Flags,
    shape: &Shape,
    leg: Leg,
    receiver: &Receiver,
    tarpit: Option<&Tarpit>,
) -> Result<Run> {
    let t = TestDb::new().await;
    let label = if tarpit.is_some() { "beside" } else { "alone" };
    let api = t.api();
    for i in 0..HEALTHY_ENDPOINTS {
        let url = format!("{}/fair-{label}/ep{i}", receiver.base_url());
        create_endpoint(&api, &bench_keyring(), HEALTHY, &url, &[] as &[&str]).await?;
    }
    let setup = Db::connect_lazy(&t.app_url(leg), 2)?;
    if let Some(tarpit) = tarpit {
        for i in 0..TARPIT_ENDPOINTS {
            let url = format!("{}/ep{i}", tarpit.base_url);
            create_endpoint(&api, &bench_keyring(), TARPIT, &url, &[] as &[&str]).await?;
        }
        enqueue(&setup, TARPIT, TARPIT_EVENTS).await?;
    }
    enqueue(&setup, HEALTHY, flags.fairness_events).await?;
    setup.close().await;
    let deliveries = flags.fairness_events * HEALTHY_ENDPOINTS;
    let db = Db::connect_lazy(&t.app_url(leg), 8)?;
    let mut su = t.superuser().await;
    let _ = receiver.take();
    let started = Instant::now();
    let loops = Loops::start(&db, shape, &t.app_url(Leg::Direct)).await?;
    let wall = loop {
        if started.elapsed() > GIVE_UP {
            bail!("fairness ({label}): not all delivered after {GIVE_UP:?}");
        }
        // Not done before every delivery has arrived at least once: the
        // database is asked only then, so the poll's own statements do not
        // load the run (the check of handed pairs below probes each).
        if receiver.count() < deliveries {
            tokio::time::sleep(crate::throughput::POLL).await;
            continue;
        }
        // A handoff is deleted once every pair of it is written, and one
        // statement's handoff can hold the tarpit's pairs beside the healthy
        // tenant's: the healthy tenant is done when none of its own pairs is
        // unwritten, not when the handoff goes (which waits for the tarpit's
        // request timeout).
        let left: bool = sqlx::query_scalar(
            "SELECT EXISTS (SELECT 1 FROM webhook_events WHERE dispatched_at IS NULL AND tenant_id = $1) \
                 OR EXISTS (SELECT 1 FROM webhook_deliveries WHERE status = 'pending' AND tenant_id = $1) \
                 OR EXISTS (SELECT 1 FROM webhook_handoffs h, \
                                   unnest(h.tenant_ids, h.event_ids, h.endpoint_ids) AS p(tenant_id, event_id, endpoint_id) \
                            WHERE p.tenant_id = $1 \
                              AND NOT EXISTS (SELECT 1 FROM webhook_deliveries d \
                                              WHERE d.event_id = p.event_id AND d.endpoint_id = p.endpoint_id))",
        )
        .bind(HEALTHY)
        .fetch_one(&mut su)
        .await?;
        if !left {
            break started.elapsed();
        }
        tokio::time::sleep(crate::throughput::POLL).await;
    };
    loops.stop().await?;
    let delivered: i64 = sqlx::query_scalar(
        "SELECT count(*) FROM webhook_deliveries WHERE status = 'delivered' AND tenant_id = $1",
    )
    .bind(HEALTHY)
    .fetch_one(&mut su)
    .await?;
    ensure!(
        delivered as usize == deliveries,
        "fairness ({label}): {delivered} of {deliveries} healthy deliveries delivered"
    );
    let tarpit_most = tarpit.map_or(0, |t| t.most.load(SeqCst));
    db.close().await;
    Ok(Run {
        deliveries,
        wall,
        tarpit_most,
    })
}

async fn enqueue(db: &Db, tenant: &str, events: usize) -> Result<()> {
    for chunk in (0..events).collect::<Vec<_>>().chunks(100) {
        let mut tx = db.begin().await?;
        for &i in chunk {
            webhook_outbox::enqueue(&mut tx, tenant, EVENT_TYPE, &payload(i)).await?;
        }
        tx.commit().await?;
    }
    Ok(())
}

/// A loopback port that accepts connections, reads what comes and never
/// answers; counts the connections open at once.
struct Tarpit {
    base_url: String,
    most: Arc<AtomicUsize>,
}

impl Tarpit {
    async fn start() -> Result<Tarpit> {
        let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await?;
        let base_url = format!("http://{}", listener.local_addr()?);
        let (open, most) = (Arc::new(AtomicUsize::new(0)), Arc::new(AtomicUsize::new(0)));
        let m = most.clone();
        tokio::spawn(async move {
            while let Ok((mut socket, _)) = listener.accept().await {
                let now = open.fetch_add(1, SeqCst) + 1;
                m.fetch_max(now, SeqCst);
                let open = open.clone();
                tokio::spawn(async move {
                    let mut buf = [0; 4096];
                    while matches!(socket.read(&mut buf).await, Ok(n) if n > 0) {}
                    open.fetch_sub(1, SeqCst);
                });
            }
        });
        Ok(Tarpit { base_url, most })
    }
}

/// The phase's figures: the medians, and every pair.
pub fn figures(alone: &[Run], beside: &[Run], report: &mut Report) {
    let rates = |runs: &[Run]| {
        runs.iter()
            .map(|r| format!("{:.0}", r.rate()))
            .collect::<Vec<_>>()
            .join(", ")
    };
    report.detail(
        "fairness, every run (deliveries/s)",
        format!(
            "alone {}; beside the tarpit {}",
            rates(alone),
            rates(beside)
        ),
    );
    let (alone, beside) = (median(alone), median(beside));
    let kept = beside.rate() / alone.rate();
    report.figures.push(
        Figure::new(
            "fairness: healthy tenant's throughput beside a tarpit tenant, share of alone (medians)",
            100.0 * kept,
            "%",
        )
        .target(Target::AtLeast(100.0 * TARGET)),
    );
    report.figures.push(Figure::new(
        "fairness: healthy tenant alone: deliveries/s, median",
        alone.rate(),
        "deliveries/s",
    ));
    report.figures.push(Figure::new(
        "fairness: healthy tenant beside 8 tarpit endpoints: deliveries/s, median",
        beside.rate(),
        "deliveries/s",
    ));
    report.detail(
        "fairness",
        format!(
            "{} healthy deliveries per run; median runs: alone {:.2} s, beside the tarpit {:.2} s; \
             the tarpit held at most {} connections at once ({} endpoints, {} events)",
            alone.deliveries,
            alone.wall.as_secs_f64(),
            beside.wall.as_secs_f64(),
            beside.tarpit_most,
            TARPIT_ENDPOINTS,
            TARPIT_EVENTS,
        ),
    );
    progress(&format!(
        "fairness: alone {:.0}/s, beside the tarpit {:.0}/s: {:.1} % kept (target {:.0} %)",
        alone.rate(),
        beside.rate(),
        100.0 * kept,
        100.0 * TARGET
    ));
}
