//! Webhook benchmark (issue 5, item 7): throughput and latency of the
//! `webhook_outbox` and `webhook_delivery` roles, run as `hardcount serve` runs
//! them, POSTing to `testbed`'s receiver on 127.0.0.1.
//!
//! How it measures, and what is inside and outside the clock, is written once,
//! by hand, in `docs/benchmarks/webhooks.md`; this binary rewrites only that
//! file's generated part (between its marker comments) and `webhooks.json`.
//! Change the two together.
//!
//! Run on the test bed, which exports `HARDCOUNT_TEST_PG` and `HARDCOUNT_TEST_BOUNCER`:
//!
//! ```sh
//! scripts/bed run cargo run --release -p benches --bin webhooks
//! ```
//!
//! One concern per module: `args` (flags, the roles' shape), `loops` (the two
//! role loops: the only calls into the roles' tick code), `workload` (endpoints
//! and events in, arrivals and signatures out), `throughput`, `fairness` and
//! `latency` (the phases and their figures), `bouncer` (PgBouncer's counters), `report` (the
//! table, the generated markdown, the JSON).

mod args;
mod bouncer;
mod fairness;
mod latency;
mod loops;
mod pgwork;
mod report;
mod throughput;
mod workload;

use std::time::Duration;

use anyhow::{Result, ensure};
use clap::Parser as _;
use serde_json::json;
use testbed::TestDb;
use testbed::receiver::Receiver;

use crate::args::{Args, other, path_name};
use crate::report::Report;

#[tokio::main]
async fn main() -> Result<()> {
    let args = Args::parse();
    args.validate()?;
    let leg = args.path.leg();
    let mut settings = report::settings(&args, leg);
    let mut report = Report::default();

    let receiver = Receiver::answering(200).await;
    progress(&format!(
        "setup: receiver on {}; app pool through {} ({})",
        receiver.base_url(),
        path_name(leg),
        leg.addr()
    ));
    let mut machine = {
        let t = TestDb::new().await;
        let mut su = t.superuser().await;
        benches::machine(&mut su).await?
    };

    let shape = args.shape();
    let shipped = args.shipped_shape();
    if !args.skip_throughput {
        // The tuned shape's runs interleaved with the shipped defaults', so the
        // machine's drift falls on both (issue 13: defaults >= 90 % of tuned).
        let (mut runs, mut tuned) = (Vec::new(), Vec::new());
        for run in 1..=args.runs {
            progress(&format!(
                "phase 1/5: throughput run {run}/{} at the shipped defaults: {} events x {} endpoints",
                args.runs, args.events, args.endpoints
            ));
            let r = throughput::run(&args, &shipped, leg, &receiver, &format!("run{run}")).await?;
            progress(&format!(
                "phase 1/5: run {run}: {} deliveries in {:.2} s = {:.0} deliveries/s (fan-out done at {:.2} s)",
                r.deliveries,
                r.wall.as_secs_f64(),
                r.rate(),
                r.fanned_out_after
            ));
            runs.push(r);
            if !args.skip_comparison_runs {
                let label = format!("tuned{run}");
                let r = throughput::run(&args, &shape, leg, &receiver, &label).await?;
                progress(&format!(
                    "phase 1/5: run {run}, tuned: {} deliveries in {:.2} s = {:.0} deliveries/s",
                    r.deliveries,
                    r.wall.as_secs_f64(),
                    r.rate()
                ));
                tuned.push(r);
            }
        }
        throughput::figures(&args, &shipped, &runs, &mut report);

        if !args.skip_comparison_runs {
            let what = format!("tuned: {}", shape.describe());
            throughput::tuned_figures(&what, &runs, &tuned, &mut report);
            let what = format!("shipped defaults, {}", path_name(other(leg)));
            progress(&format!("phase 2/5: one throughput run, {what}"));
            let r = throughput::run(&args, &shipped, other(leg), &receiver, "other-path").await?;
            progress(&format!(
                "phase 2/5: {} deliveries in {:.2} s = {:.0} deliveries/s",
                r.deliveries,
                r.wall.as_secs_f64(),
                r.rate()
            ));
            throughput::comparison_figures(&format!("{what} (one run)"), &r, &mut report);
        }
    }

    if !args.fairness.skip_fairness {
        progress(&format!(
            "fairness: {} pairs of runs, {} events x 2 endpoints, alone and beside 8 tarpit endpoints",
            args.fairness.fairness_runs, args.fairness.fairness_events
        ));
        let (alone, beside) = fairness::phase(&args.fairness, &shape, leg, &receiver).await?;
        fairness::figures(&alone, &beside, &mut report);
    }

    if !args.skip_latency {
        progress(&format!(
            "phase 3/5: latency: {} events/s for {} s, {} endpoint(s), role interval {} ms",
            args.rate, args.latency_secs, args.latency_endpoints, args.interval_ms
        ));
        let l = latency::phase(&args, &shape, leg, &receiver, "steady").await?;
        latency::figures(&l, &mut report);
        if args.production_interval_ms > 0 {
            let interval = args.production_interval_ms;
            progress(&format!(
                "phase 4/5: latency again at production's role interval, {interval} ms"
            ));
            let slow = shape.with_interval(Duration::from_millis(interval));
            let l = latency::phase(&args, &slow, leg, &receiver, "production").await?;
            latency::production_figures(&l, interval, &mut report);
            ensure!(
                l.samples.len() == l.expected,
                "{} of {} deliveries arrived at {interval} ms intervals",
                l.samples.len(),
                l.expected,
            );
        }
        if !args.skip_listen {
            let interval = args.production_interval_ms.max(args.interval_ms);
            progress(&format!(
                "phase 4/5: latency with wake-ups (listen URL), {interval} ms role intervals"
            ));
            let woken = shape
                .with_interval(Duration::from_millis(interval))
                .listening();
            let l = latency::phase(&args, &woken, leg, &receiver, "listen").await?;
            latency::listen_figures(&l, interval, &mut report);
            ensure!(
                l.samples.len() == l.expected,
                "{} of {} deliveries arrived with wake-ups",
                l.samples.len(),
                l.expected,
            );
        }
    }

    benches::machine_at_end(&mut machine);
    settings.insert("date".into(), json!(benches::now_utc()));
    progress("phase 5/5: writing docs/benchmarks/webhooks.{md,json}");
    let dir = benches::report_dir(args.out_dir.clone())?;
    report.write(&dir, &machine, &settings)?;
    println!("{}", report.summary());
    progress(&format!("wrote {}/webhooks.{{md,json}}", dir.display()));
    Ok(())
}

fn progress(msg: &str) {
    eprintln!(
        "[webhooks bench {}] {msg}",
        chrono::Utc::now().format("%H:%M:%S")
    );
}

#[cfg(test)]
mod tests {
    use clap::CommandFactory as _;

    use super::Args;

    fn methodology() -> String {
        let doc = concat!(
            env!("CARGO_MANIFEST_DIR"),
            "/../docs/benchmarks/webhooks.md"
        );
        let text = std::fs::read_to_string(doc).unwrap();
        let end = text
            .find(benches::GENERATED_BEGIN)
            .expect("webhooks.md has a generated part");
        assert!(text.contains(benches::GENERATED_END));
        text[..end].to_owned()
    }

    /// A new flag changes what the benchmark does, so the hand-written
    /// methodology must say what it is for.
    #[test]
    fn the_methodology_names_every_flag() {
        let prose = methodology();
        for arg in Args::command().get_arguments() {
            if let Some(long) = arg.get_long().filter(|l| *l != "help") {
                assert!(
                    prose.contains(&format!("`--{long}")),
                    "docs/benchmarks/webhooks.md does not mention --{long}"
                );
            }
        }
    }
}
