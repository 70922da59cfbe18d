//! Throughput: a backlog enqueued before the loops start, timed until every
//! delivery is `delivered`.

use std::sync::Arc;
use std::sync::atomic::Ordering::Relaxed;
use std::time::{Duration, Instant};

use anyhow::{Result, bail, ensure};
use benches::{CpuSnapshot, CpuUse};
use db::Db;
use testbed::receiver::Receiver;
use testbed::{Leg, TestDb};

use crate::args::{Args, Shape};
use crate::bouncer::{self, Bouncer, PoolSampler};
use crate::loops::{Loops, Ticks};
use crate::pgwork::PgWork;
use crate::progress;
use crate::report::{Figure, Report, Target, cpu_figures};
use crate::workload::{Arrivals, endpoints, preload};

/// The target for the median run.
pub const TARGET: f64 = 2000.0;
/// How often the run counts delivered rows.
pub const POLL: Duration = Duration::from_millis(25);
/// A run that has not drained by then fails.
const GIVE_UP: Duration = Duration::from_secs(300);

pub struct Run {
    pub deliveries: usize,
    /// Until the poll saw every delivery `delivered`.
    pub wall: Duration,
    /// The same on the database clock: the last `delivered_at` minus the start.
    db_wall: f64,
    /// When the last event was stamped dispatched, on the database clock.
    pub fanned_out_after: f64,
    /// When the first event was stamped dispatched, and the first delivery
    /// delivered, on the database clock.
    first_dispatched: f64,
    first_delivered: f64,
    attempts: i64,
    /// Per tenth of `db_wall`: events enqueued, events fanned out, deliveries
    /// claimed (their last attempt's start) and delivered.
    timeline: [Vec<i64>; 4],
    pub cpu: CpuUse,
    bouncer: Option<Bouncer>,
    ticks: Arc<Ticks>,
    verified: usize,
    /// Postgres work per delivery.
    pub pg: PgWork,
}

impl Run {
    pub fn rate(&self) -> f64 {
        self.deliveries as f64 / self.wall.as_secs_f64()
    }

    /// CPU seconds of this process, Postgres and PgBouncer per delivery.
    pub fn cpu_per_delivery(&self) -> f64 {
        (self.cpu.this_process + self.cpu.postgres + self.cpu.pgbouncer) / self.deliveries as f64
    }
}

/// One run on a fresh database: endpoints on the receiver under `/{label}/`,
/// the backlog enqueued, then the loops started and the clock with them.
pub async fn run(
    args: &Args,
    shape: &Shape,
    leg: Leg,
    receiver: &Receiver,
    label: &str,
) -> Result<Run> {
    let t = TestDb::new().await;
    // Three pools, so each one's work is counted where it belongs: setup
    // (closed before the first reading of the Postgres counters), producers
    // and the roles' (closed before the second).
    let setup = Db::connect_lazy(&t.app_url(leg), 2)?;
    // Endpoints are written by the API role, the only one that may (docs/adr/0015).
    let endpoints = endpoints(&t.api(), &receiver.base_url(), label, args.endpoints).await?;
    if args.enqueue_outside_clock {
        preload(&setup, args.events, args.events_per_tx, args.enqueue_each).await?;
    }
    setup.close().await;
    let db = Db::connect_lazy(&t.app_url(leg), args.pool)?;
    let producers = Db::connect_lazy(&t.app_url(leg), args.producer_pool)?;
    let deliveries = args.events * args.endpoints;
    let mut su = t.superuser().await;
    let _ = receiver.take();
    let pg0 = PgWork::take(&mut su).await?;

    let bouncer0 = bouncer::snapshot(leg, t.name()).await;
    let sampler = PoolSampler::start(leg, t.name());
    let cpu0 = CpuSnapshot::take();
    let db_t0: f64 = sqlx::query_scalar("SELECT extract(epoch FROM clock_timestamp())::float8")
        .fetch_one(&mut su)
        .await?;
    let started = Instant::now();
    let loops = Loops::start(&db, shape, &t.app_url(Leg::Direct)).await?;
    if !args.enqueue_outside_clock {
        // Like for like with a job queue whose insert is timed: the events are
        // enqueued inside the clock, while the roles run.
        preload(
            &producers,
            args.events,
            args.events_per_tx,
            args.enqueue_each,
        )
        .await?;
    }
    let mut reported = Instant::now();
    let wall = loop {
        // Cheap enough to poll often: the probes stop at the first row of a
        // partial index (undispatched events, pending deliveries) or of the
        // handoffs of deliveries still in flight unwritten (docs/adr/0124).
        let busy: bool = sqlx::query_scalar(
            "SELECT EXISTS (SELECT 1 FROM webhook_events WHERE dispatched_at IS NULL) \
                 OR EXISTS (SELECT 1 FROM webhook_deliveries WHERE status = 'pending') \
                 OR EXISTS (SELECT 1 FROM webhook_handoffs)",
        )
        .fetch_one(&mut su)
        .await?;
        if !busy {
            break started.elapsed();
        }
        if started.elapsed() > GIVE_UP {
            bail!("not all delivered after {GIVE_UP:?}");
        }
        if reported.elapsed() >= Duration::from_secs(1) {
            reported = Instant::now();
            progress(&format!(
                "  {:>5.1} s: {} requests received",
                started.elapsed().as_secs_f64(),
                receiver.count()
            ));
        }
        tokio::time::sleep(POLL).await;
    };
    let cpu = CpuSnapshot::take().since(&cpu0);
    let sampled = sampler.stop().await;
    let bouncer = Bouncer::delta(bouncer0, bouncer::snapshot(leg, t.name()).await, sampled);
    let ticks = loops.stop().await?;

    let (delivered, dead): (i64, i64) = sqlx::query_as(
        "SELECT count(*) FILTER (WHERE status = 'delivered'), count(*) FILTER (WHERE status = 'dead') \
         FROM webhook_deliveries",
    )
    .fetch_one(&mut su)
    .await?;
    ensure!(
        delivered as usize == deliveries && dead == 0,
        "{delivered} of {deliveries} delivered and {dead} dead (see last_error)"
    );
    let (db_wall, fanned_out_after, first_dispatched, first_delivered, attempts): (
        f64,
        f64,
        f64,
        f64,
        i64,
    ) = sqlx::query_as(
        "SELECT extract(epoch FROM (SELECT max(delivered_at) FROM webhook_deliveries))::float8 - $1, \
                extract(epoch FROM (SELECT max(dispatched_at) FROM webhook_events))::float8 - $1, \
                extract(epoch FROM (SELECT min(dispatched_at) FROM webhook_events))::float8 - $1, \
                extract(epoch FROM (SELECT min(delivered_at) FROM webhook_deliveries))::float8 - $1, \
                (SELECT sum(attempts) FROM webhook_deliveries)::int8",
    )
    .bind(db_t0)
    .fetch_one(&mut su)
    .await?;
    let timeline = timeline(&mut su, db_t0, db_wall).await?;
    let got = Arrivals::of(&receiver.take(), &endpoints)?;
    ensure!(
        got.first.len() == deliveries,
        "the receiver saw {} distinct deliveries, expected {deliveries}",
        got.first.len()
    );
    if got.repeats > 0 || got.requests != deliveries {
        progress(&format!(
            "  note: {} requests for {deliveries} deliveries ({} repeats)",
            got.requests, got.repeats
        ));
    }
    db.close().await;
    producers.close().await;
    let pg = pg0.per_delivery(&PgWork::take(&mut su).await?, deliveries);
    drop(su);
    Ok(Run {
        deliveries,
        wall,
        db_wall,
        fanned_out_after,
        first_dispatched,
        first_delivered,
        attempts,
        timeline,
        cpu,
        bouncer,
        ticks,
        verified: got.verified,
        pg,
    })
}

/// How the run's work spread over its wall time, in tenths of `db_wall` from
/// `db_t0` (both on the database clock): where the pipeline filled, and where
/// a stage waited on the one before it.
async fn timeline(su: &mut sqlx::PgConnection, db_t0: f64, db_wall: f64) -> Result<[Vec<i64>; 4]> {
    let (enqueued, fanned_out, claimed, delivered): (Vec<i64>, Vec<i64>, Vec<i64>, Vec<i64>) =
        sqlx::query_as(
            "WITH b AS (SELECT g AS tenth FROM generate_series(1, 10) g), \
                  t(at, stage) AS ( \
                    SELECT created_at, 0 FROM webhook_events \
                    UNION ALL SELECT dispatched_at, 1 FROM webhook_events \
                    UNION ALL SELECT last_attempt_at, 2 FROM webhook_deliveries \
                    UNION ALL SELECT delivered_at, 3 FROM webhook_deliveries), \
                  c AS ( \
                    SELECT stage, least(10, greatest(1, width_bucket( \
                             extract(epoch FROM at)::float8 - $1, 0, $2, 10))) AS tenth \
                    FROM t WHERE at IS NOT NULL) \
             SELECT array_agg((SELECT count(*) FROM c WHERE c.stage = 0 AND c.tenth = b.tenth) ORDER BY tenth), \
                    array_agg((SELECT count(*) FROM c WHERE c.stage = 1 AND c.tenth = b.tenth) ORDER BY tenth), \
                    array_agg((SELECT count(*) FROM c WHERE c.stage = 2 AND c.tenth = b.tenth) ORDER BY tenth), \
                    array_agg((SELECT count(*) FROM c WHERE c.stage = 3 AND c.tenth = b.tenth) ORDER BY tenth) \
             FROM b",
        )
        .bind(db_t0)
        .bind(db_wall.max(1e-3))
        .fetch_one(su)
        .await?;
    Ok([enqueued, fanned_out, claimed, delivered])
}

/// The median run's figures and details, and every run's rate.
pub fn figures(args: &Args, shape: &Shape, runs: &[Run], report: &mut Report) {
    let Some(m) = median_run(runs) else {
        return;
    };
    let name = if runs.len() > 1 {
        format!(
            "throughput at the shipped defaults: signed deliveries/s, median of {} runs",
            runs.len()
        )
    } else {
        "throughput at the shipped defaults: signed deliveries/s".to_owned()
    };
    let figures = &mut report.figures;
    figures.push(Figure::new(name, m.rate(), "deliveries/s").target(Target::AtLeast(TARGET)));
    for (i, r) in runs.iter().enumerate() {
        figures.push(Figure::new(
            format!("throughput: run {}: deliveries/s", i + 1),
            r.rate(),
            "deliveries/s",
        ));
    }
    let wall = m.wall.as_secs_f64();
    figures.push(Figure::new(
        "throughput (median run): wall time, loop start to all delivered (polled)",
        wall,
        "s",
    ));
    figures.push(Figure::new(
        "throughput (median run): wall time on the database clock (last delivered_at)",
        m.db_wall,
        "s",
    ));
    figures.push(Figure::new(
        "throughput (median run): fan-out started (first dispatched_at)",
        m.first_dispatched,
        "s",
    ));
    figures.push(Figure::new(
        "throughput (median run): first delivery written (first delivered_at)",
        m.first_delivered,
        "s",
    ));
    figures.push(Figure::new(
        "throughput (median run): fan-out done (last dispatched_at)",
        m.fanned_out_after,
        "s",
    ));
    figures.push(Figure::new(
        "throughput (median run): attempts per delivery",
        m.attempts as f64 / m.deliveries as f64,
        "attempts",
    ));
    let batches = m.ticks.delivery_batches.load(Relaxed);
    figures.push(Figure::new(
        "throughput (median run): deliveries claimed per batch, mean",
        m.ticks.claimed.load(Relaxed) as f64 / batches.max(1) as f64,
        "deliveries",
    ));
    let nproc = benches::nproc() as f64;
    let cpu_per_delivery = m.cpu_per_delivery();
    figures.push(Figure::new(
        "throughput (median run): CPU per delivery, this process + Postgres + PgBouncer",
        cpu_per_delivery * 1e3,
        "ms",
    ));
    figures.push(Figure::new(
        "throughput (median run): CPU ceiling, all CPUs / CPU per delivery",
        nproc / cpu_per_delivery,
        "deliveries/s",
    ));
    figures.push(Figure::new(
        "throughput (median run): Postgres CPU per delivery",
        m.cpu.postgres / m.deliveries as f64 * 1e3,
        "ms",
    ));
    cpu_figures("throughput (median run)", &m.cpu, wall, figures);
    m.pg.figures("throughput (median run)", report);
    let figures = &mut report.figures;
    if let Some(b) = &m.bouncer {
        b.figures("throughput (median run)", m.deliveries, figures);
    }

    let per = |secs: f64| secs / m.deliveries as f64 * 1e3;
    let c = &m.cpu;
    let t = &m.ticks;
    report.detail("throughput: the shipped defaults", shape.describe());
    report.detail(
        "throughput (median run): deliveries",
        format!(
            "{} ({} events x {} endpoints) in {wall:.2} s",
            m.deliveries, args.events, args.endpoints
        ),
    );
    report.detail(
        "throughput (median run): outbox ticks",
        format!(
            "{}, fanning out {} events",
            t.outbox_ticks.load(Relaxed),
            t.outbox_events.load(Relaxed)
        ),
    );
    report.detail(
        "throughput (median run): delivery ticks",
        format!(
            "{}, claiming {} deliveries in {batches} batches; {} delivered, {} otherwise",
            t.delivery_ticks.load(Relaxed),
            t.claimed.load(Relaxed),
            t.delivered.load(Relaxed),
            t.not_delivered.load(Relaxed)
        ),
    );
    let [enqueued, fanned_out, claimed, delivered] = &m.timeline;
    let tenths = |v: &Vec<i64>| {
        v.iter()
            .map(ToString::to_string)
            .collect::<Vec<_>>()
            .join(" ")
    };
    report.detail(
        "throughput (median run): by tenth of the database-clock wall time",
        format!(
            "events enqueued {}; fanned out {}; deliveries claimed {}; delivered {}",
            tenths(enqueued),
            tenths(fanned_out),
            tenths(claimed),
            tenths(delivered)
        ),
    );
    report.detail(
        "throughput (median run): signatures of kept requests verified",
        m.verified.to_string(),
    );
    report.detail(
        "throughput (median run): CPU per delivery by process",
        format!(
            "this process {:.2} ms, Postgres {:.2} ms, PgBouncer {:.2} ms",
            per(c.this_process),
            per(c.postgres),
            per(c.pgbouncer)
        ),
    );
    report.detail(
        "throughput (median run): CPU seconds",
        format!(
            "this process {:.2}, Postgres {:.2}, PgBouncer {:.2}, others {:.2}, of {:.2} available ({nproc} CPUs x wall)",
            c.this_process, c.postgres, c.pgbouncer, c.others, c.capacity
        ),
    );
    report.detail(
        "throughput target: most CPU per delivery that meets it on all CPUs",
        format!(
            "{:.2} ms ({nproc} CPUs / {TARGET} deliveries/s)",
            nproc * 1e3 / TARGET
        ),
    );
}

/// The figures of a single comparison run.
pub fn comparison_figures(what: &str, r: &Run, report: &mut Report) {
    report.figures.push(Figure::new(
        format!("throughput, {what}: deliveries/s"),
        r.rate(),
        "deliveries/s",
    ));
    report.figures.push(Figure::new(
        format!("throughput, {what}: CPU per delivery"),
        r.cpu_per_delivery() * 1e3,
        "ms",
    ));
    report.figures.push(Figure::new(
        format!("throughput, {what}: Postgres CPU per delivery"),
        r.cpu.postgres / r.deliveries as f64 * 1e3,
        "ms",
    ));
    r.pg.figures(&format!("throughput, {what}"), report);
    report.figures.push(Figure::new(
        format!("throughput, {what}: CPU, other processes"),
        100.0 * r.cpu.others / r.cpu.capacity.max(f64::MIN_POSITIVE),
        "% of all CPUs",
    ));
}

/// The tuned runs (interleaved with the shipped ones): their median run's
/// figures, every run's rate, and the shipped defaults' median as a share of
/// the tuned median against the target.
pub fn tuned_figures(what: &str, shipped: &[Run], tuned: &[Run], report: &mut Report) {
    let Some(m) = median_run(tuned) else {
        return;
    };
    comparison_figures(&format!("{what} (median of {})", tuned.len()), m, report);
    let rates: Vec<String> = tuned.iter().map(|r| format!("{:.0}", r.rate())).collect();
    report.detail(
        &format!("throughput, {what}: every run (deliveries/s)"),
        rates.join(", "),
    );
    if let Some(s) = median_run(shipped) {
        report.figures.push(
            Figure::new(
                "throughput at the shipped defaults, share of the tuned shape's (medians of interleaved runs)",
                100.0 * s.rate() / m.rate(),
                "%",
            )
            .target(Target::AtLeast(DEFAULTS_SHARE_TARGET)),
        );
    }
}

/// The target for the shipped defaults against the tuned shape, in %.
pub const DEFAULTS_SHARE_TARGET: f64 = 90.0;

/// The run of median rate (the upper one of an even count).
fn median_run(runs: &[Run]) -> Option<&Run> {
    let mut order: Vec<&Run> = runs.iter().collect();
    order.sort_by(|a, b| a.rate().total_cmp(&b.rate()));
    order.get(order.len() / 2).copied()
}
