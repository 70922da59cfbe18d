//! Latency: a producer commits events at a steady rate while the loops run;
//! each delivery's latency is its arrival at the receiver minus its event's
//! commit, both on this process's monotonic clock.

use std::collections::HashMap;
use std::sync::atomic::{AtomicU64, Ordering::Relaxed};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use anyhow::{Result, ensure};
use benches::{CpuSnapshot, CpuUse};
use db::{Db, Row as _, sql};
use testbed::receiver::Receiver;
use testbed::{Leg, TestDb};
use tokio::task::JoinSet;

use crate::args::{Args, Shape};
use crate::bouncer::{self, Bouncer, PoolSampler};
use crate::loops::Loops;
use crate::progress;
use crate::report::{Figure, Report, Target, cpu_figures};
use crate::workload::{Arrivals, EVENT_TYPE, TENANT, endpoints, payload};

/// The target for the p99 at the benchmark's intervals.
pub const P99_TARGET_MS: f64 = 2000.0;
/// The loops run this long before the producer starts: first leases, first connections.
const WARM_UP: Duration = Duration::from_secs(2);
/// After the producer stops, the phase waits at most this long for the last deliveries.
const DRAIN: Duration = Duration::from_secs(60);

pub struct Latency {
    /// Arrival minus commit, one per delivery that arrived, sorted.
    pub samples: Vec<Duration>,
    pub expected: usize,
    committed: usize,
    produce_secs: f64,
    /// Producer transactions (BEGIN, enqueue, read message_id, COMMIT), timed whole.
    commit_times: Vec<Duration>,
    producer_errors: u64,
    /// Percentiles on the database clock: delivered_at - the event's created_at.
    db_p50_ms: f64,
    db_p99_ms: f64,
    /// Where the time went, on the database clock (each stamp is its
    /// transaction's start): (stage, p50 ms, p99 ms).
    stages: Vec<(&'static str, f64, f64)>,
    cpu: CpuUse,
    wall: f64,
    bouncer: Option<Bouncer>,
    verified: usize,
    requests: usize,
}

/// What the producer recorded per committed event.
#[derive(Default)]
struct Commits {
    /// message_id -> the instant its transaction's COMMIT returned.
    at: Mutex<HashMap<String, Instant>>,
    durations: Mutex<Vec<Duration>>,
    errors: AtomicU64,
}

async fn produce_one(db: Db, commits: Arc<Commits>, i: usize) -> Result<()> {
    let started = Instant::now();
    let mut tx = db.begin().await?;
    let id = webhook_outbox::enqueue(&mut tx, TENANT, EVENT_TYPE, &payload(i)).await?;
    let row = tx
        .fetch_one(sql("SELECT message_id FROM webhook_events WHERE id = $1").bind(id))
        .await?;
    let message_id: String = row.try_get("message_id").map_err(db::Error::from)?;
    tx.commit().await?;
    let at = Instant::now();
    commits.at.lock().unwrap().insert(message_id, at);
    commits.durations.lock().unwrap().push(at - started);
    Ok(())
}

/// The stages of a delivery's wait, each between two stamps taken at the start
/// of their transactions (`now()`): the producer's (`created_at`), the
/// fan-out's (`dispatched_at`), the claim's (`last_attempt_at`; single
/// attempts only in these phases), the outcome's (`delivered_at`).
const STAGES: [&str; 3] = ["event to fan-out", "fan-out to claim", "claim to outcome"];

/// One phase on a fresh database, endpoints on the receiver under `/{label}/`.
pub async fn phase(
    args: &Args,
    shape: &Shape,
    leg: Leg,
    receiver: &Receiver,
    label: &str,
) -> Result<Latency> {
    let t = TestDb::new().await;
    let url = t.app_url(leg);
    let db = Db::connect_lazy(&url, args.pool)?;
    let producer = Db::connect_lazy(&url, args.producer_pool)?;
    let endpoints = endpoints(
        &t.api(),
        &receiver.base_url(),
        label,
        args.latency_endpoints,
    )
    .await?;
    let mut su = t.superuser().await;
    let _ = receiver.take();

    let loops = Loops::start(&db, shape, &t.app_url(Leg::Direct)).await?;
    tokio::time::sleep(WARM_UP).await;

    let bouncer0 = bouncer::snapshot(leg, t.name()).await;
    let sampler = PoolSampler::start(leg, t.name());
    let cpu0 = CpuSnapshot::take();
    let started = Instant::now();
    let commits = Arc::new(Commits::default());
    let mut tasks = JoinSet::new();
    let mut every = tokio::time::interval(Duration::from_secs(1) / args.rate);
    every.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Burst);
    let total = args.rate as usize * args.latency_secs as usize;
    let mut reported = Instant::now();
    for i in 0..total {
        every.tick().await;
        let (p, c) = (producer.clone(), commits.clone());
        tasks.spawn(async move {
            if let Err(e) = produce_one(p, c.clone(), i).await
                && c.errors.fetch_add(1, Relaxed) == 0
            {
                eprintln!("producer transaction failed: {e:#}");
            }
        });
        while tasks.try_join_next().is_some() {}
        if reported.elapsed() >= Duration::from_secs(5) {
            reported = Instant::now();
            progress(&format!(
                "  {:>4.1} s: {} events committed, {} requests arrived",
                started.elapsed().as_secs_f64(),
                commits.at.lock().unwrap().len(),
                receiver.count()
            ));
        }
    }
    while tasks.join_next().await.is_some() {}
    let produce_secs = started.elapsed().as_secs_f64();
    let committed = commits.at.lock().unwrap().len();
    let expected = committed * args.latency_endpoints;
    progress(&format!(
        "  producer done: {committed} events in {produce_secs:.1} s; waiting for {expected} deliveries"
    ));
    let drain_until = Instant::now() + DRAIN;
    loop {
        let delivered: i64 = sqlx::query_scalar(
            "SELECT count(*) FROM webhook_deliveries WHERE status = 'delivered'",
        )
        .fetch_one(&mut su)
        .await?;
        if delivered as usize >= expected || Instant::now() > drain_until {
            break;
        }
        tokio::time::sleep(Duration::from_millis(100)).await;
    }
    let wall = started.elapsed().as_secs_f64();
    let cpu = CpuSnapshot::take().since(&cpu0);
    let sampled = sampler.stop().await;
    let bouncer = Bouncer::delta(bouncer0, bouncer::snapshot(leg, t.name()).await, sampled);
    loops.stop().await?;

    // The cross-check and the stages, in one pass over the delivered rows.
    let row = sqlx::query(
        "SELECT percentile_disc(0.5) WITHIN GROUP (ORDER BY x) AS x50, percentile_disc(0.99) WITHIN GROUP (ORDER BY x) AS x99, \
                percentile_disc(0.5) WITHIN GROUP (ORDER BY a) AS a50, percentile_disc(0.99) WITHIN GROUP (ORDER BY a) AS a99, \
                percentile_disc(0.5) WITHIN GROUP (ORDER BY b) AS b50, percentile_disc(0.99) WITHIN GROUP (ORDER BY b) AS b99, \
                percentile_disc(0.5) WITHIN GROUP (ORDER BY c) AS c50, percentile_disc(0.99) WITHIN GROUP (ORDER BY c) AS c99 \
         FROM (SELECT extract(epoch FROM d.delivered_at - e.created_at)::float8 * 1000 AS x, \
                      extract(epoch FROM e.dispatched_at - e.created_at)::float8 * 1000 AS a, \
                      extract(epoch FROM d.last_attempt_at - e.dispatched_at)::float8 * 1000 AS b, \
                      extract(epoch FROM d.delivered_at - d.last_attempt_at)::float8 * 1000 AS c \
               FROM webhook_deliveries d JOIN webhook_events e ON e.id = d.event_id \
               WHERE d.status = 'delivered') s",
    )
    .fetch_one(&mut su)
    .await?;
    let ms = |column: &str| -> Result<f64> {
        Ok(row.try_get::<Option<f64>, _>(column)?.unwrap_or(f64::NAN))
    };
    let (db_p50_ms, db_p99_ms) = (ms("x50")?, ms("x99")?);
    let stages = vec![
        (STAGES[0], ms("a50")?, ms("a99")?),
        (STAGES[1], ms("b50")?, ms("b99")?),
        (STAGES[2], ms("c50")?, ms("c99")?),
    ];
    let got = Arrivals::of(&receiver.take(), &endpoints)?;
    let at = std::mem::take(&mut *commits.at.lock().unwrap());
    let mut samples = Vec::with_capacity(expected);
    for ((id, _path), arrived) in &got.first {
        if let Some(committed) = at.get(id) {
            samples.push(arrived.saturating_duration_since(*committed));
        }
    }
    samples.sort();
    let mut commit_times = std::mem::take(&mut *commits.durations.lock().unwrap());
    commit_times.sort();
    drop(su);
    db.close().await;
    producer.close().await;
    ensure!(
        samples.len() == expected,
        "only {} of {expected} deliveries reached the receiver",
        samples.len()
    );
    Ok(Latency {
        samples,
        expected,
        committed,
        produce_secs,
        commit_times,
        producer_errors: commits.errors.load(Relaxed),
        db_p50_ms,
        db_p99_ms,
        stages,
        cpu,
        wall,
        bouncer,
        verified: got.verified,
        requests: got.requests,
    })
}

/// The phase at the benchmark's intervals: percentiles, producer, CPU, PgBouncer.
pub fn figures(l: &Latency, report: &mut Report) {
    let p = |q| benches::percentile_ms(&l.samples, q);
    let figures = &mut report.figures;
    figures.push(Figure::new(
        "latency: enqueue-to-delivered p50",
        p(50.0),
        "ms",
    ));
    figures.push(
        Figure::new("latency: enqueue-to-delivered p99", p(99.0), "ms")
            .target(Target::AtMost(P99_TARGET_MS)),
    );
    figures.push(Figure::new(
        "latency: enqueue-to-delivered max",
        p(100.0),
        "ms",
    ));
    figures.push(Figure::new(
        "latency: producer rate achieved",
        l.committed as f64 / l.produce_secs,
        "events/s",
    ));
    figures.push(Figure::new(
        "latency: producer transaction p99 (BEGIN, enqueue, read message_id, COMMIT)",
        benches::percentile_ms(&l.commit_times, 99.0),
        "ms",
    ));
    figures.push(Figure::new(
        "latency, database clock: delivered_at - event created_at, p50",
        l.db_p50_ms,
        "ms",
    ));
    figures.push(Figure::new(
        "latency, database clock: delivered_at - event created_at, p99",
        l.db_p99_ms,
        "ms",
    ));
    cpu_figures("latency", &l.cpu, l.wall, figures);
    if let Some(b) = &l.bouncer {
        b.figures("latency", l.expected.max(1), figures);
    }
    report.detail(
        "latency: events committed",
        format!(
            "{} in {:.1} s ({} producer errors)",
            l.committed, l.produce_secs, l.producer_errors
        ),
    );
    report.detail(
        "latency: deliveries",
        format!(
            "{} expected, {} arrived ({} requests in all)",
            l.expected,
            l.samples.len(),
            l.requests
        ),
    );
    report.detail(
        "latency: signatures of kept requests verified",
        l.verified.to_string(),
    );
    stage_details(l, "latency", report);
}

/// The phase again at production's role interval: its percentiles only.
pub fn production_figures(l: &Latency, interval_ms: u64, report: &mut Report) {
    interval_figures(
        l,
        &format!("latency at {interval_ms} ms role intervals"),
        report,
    );
}

/// The latency phase with wake-ups (`HARDCOUNT_LISTEN_URL`) at `interval_ms`.
pub fn listen_figures(l: &Latency, interval_ms: u64, report: &mut Report) {
    interval_figures(
        l,
        &format!("latency with wake-ups (listen URL), {interval_ms} ms role intervals"),
        report,
    );
}

fn interval_figures(l: &Latency, what: &str, report: &mut Report) {
    for (q, p) in [("p50", 50.0), ("p99", 99.0), ("max", 100.0)] {
        report.figures.push(Figure::new(
            format!("{what}: enqueue-to-delivered {q}"),
            benches::percentile_ms(&l.samples, p),
            "ms",
        ));
    }
    stage_details(l, what, report);
}

/// The stages on the database clock, one detail line.
fn stage_details(l: &Latency, what: &str, report: &mut Report) {
    let stages: Vec<String> = l
        .stages
        .iter()
        .map(|(stage, p50, p99)| format!("{stage} {p50:.1} / {p99:.1}"))
        .collect();
    report.detail(
        &format!("{what}: stages on the database clock, p50 / p99 ms"),
        stages.join("; "),
    );
}
