//! Figures and how they are written: the table, the run details, the machine
//! and the settings, as the generated part of `docs/benchmarks/webhooks.md`, and
//! `webhooks.json`. What the figures mean is the hand-written part of the
//! markdown, which this module never writes.

use std::path::Path;

use anyhow::Result;
use benches::CpuUse;
use leader::Timing;
use serde_json::{Map, Value, json};
use testbed::Leg;

use crate::args::{Args, path_name};
use crate::workload::payload;

/// The command that refreshes the reports, from the repository root.
pub const COMMAND: &str = "scripts/bed run cargo run --release -p benches --bin webhooks";

#[derive(Clone, Copy)]
pub enum Target {
    AtLeast(f64),
    AtMost(f64),
}

/// One reported number, with the target when it sets one.
pub struct Figure {
    name: String,
    value: f64,
    unit: &'static str,
    target: Option<Target>,
}

impl Figure {
    pub fn new(name: impl Into<String>, value: f64, unit: &'static str) -> Figure {
        Figure {
            name: name.into(),
            value,
            unit,
            target: None,
        }
    }

    pub fn target(self, target: Target) -> Figure {
        Figure {
            target: Some(target),
            ..self
        }
    }

    fn met(&self) -> Option<bool> {
        self.target.map(|t| match t {
            Target::AtLeast(x) => self.value >= x,
            Target::AtMost(x) => self.value <= x,
        })
    }
}

/// Everything a run measured: the figures (markdown table and JSON) and the
/// counts behind them (markdown only).
#[derive(Default)]
pub struct Report {
    pub figures: Vec<Figure>,
    details: Vec<(String, String)>,
}

impl Report {
    pub fn detail(&mut self, name: &str, value: String) {
        self.details.push((name.to_owned(), value));
    }

    /// Write the generated part of `webhooks.md` (in place, between its markers)
    /// and all of `webhooks.json` to `dir`.
    pub fn write(
        &self,
        dir: &Path,
        machine: &Map<String, Value>,
        settings: &Map<String, Value>,
    ) -> Result<()> {
        benches::write_generated(dir, "webhooks.md", &self.markdown(machine, settings))?;
        let records: Vec<Value> = self
            .figures
            .iter()
            .map(|f| json!({"name": f.name, "value": f.value, "unit": f.unit, "machine": machine, "settings": settings}))
            .collect();
        std::fs::write(
            dir.join("webhooks.json"),
            serde_json::to_string_pretty(&records)? + "\n",
        )?;
        Ok(())
    }

    /// The table and the details, for the terminal.
    pub fn summary(&self) -> String {
        format!("{}\n{}", self.table(), self.details_list())
    }

    fn markdown(&self, machine: &Map<String, Value>, settings: &Map<String, Value>) -> String {
        let mut out = String::new();
        out.push_str(&format!(
            "<!-- Written by benches/src/bin/webhooks; refresh with `{COMMAND}`. -->\n\n"
        ));
        out.push_str("## Results\n\n");
        out.push_str(&self.table());
        out.push_str("\n## Run details\n\n");
        out.push_str(&self.details_list());
        out.push_str("\n## Machine\n\n");
        out.push_str(&benches::markdown_list(machine));
        out.push_str("\n## Settings\n\n");
        out.push_str(&benches::markdown_list(settings));
        out
    }

    fn details_list(&self) -> String {
        self.details
            .iter()
            .map(|(k, v)| format!("- {k}: {v}\n"))
            .collect()
    }

    fn table(&self) -> String {
        let mut out = String::from("| figure | value | target | met |\n|---|---:|---|---|\n");
        for f in &self.figures {
            let value = match f.unit {
                "ms" if f.value < 10.0 => format!("{:.2} ms", f.value),
                "ms" => format!("{:.1} ms", f.value),
                "s" => format!("{:.2} s", f.value),
                "ratio" => format!("{:.4}", f.value),
                "% of all CPUs" | "% of the pool" => format!("{:.0} {}", f.value, f.unit),
                unit => format!("{:.2} {unit}", f.value),
            };
            let target = match f.target {
                Some(Target::AtLeast(t)) => format!(">= {t} {}", f.unit),
                Some(Target::AtMost(t)) => format!("<= {t} {}", f.unit),
                None => String::new(),
            };
            let met = match f.met() {
                Some(true) => "yes",
                Some(false) => "**no**",
                None => "",
            };
            out.push_str(&format!("| {} | {value} | {target} | {met} |\n", f.name));
        }
        out
    }
}

/// CPU shares of the whole machine (all CPUs) over a phase's wall time.
pub fn cpu_figures(phase: &str, cpu: &CpuUse, wall: f64, figures: &mut Vec<Figure>) {
    let capacity = if cpu.capacity > 0.0 {
        cpu.capacity
    } else {
        wall
    };
    for (who, secs) in [
        (
            "this process (role loops, HTTP client, receiver)",
            cpu.this_process,
        ),
        ("Postgres", cpu.postgres),
        ("PgBouncer", cpu.pgbouncer),
        ("other processes", cpu.others),
    ] {
        figures.push(Figure::new(
            format!("{phase}: CPU, {who}"),
            100.0 * secs / capacity,
            "% of all CPUs",
        ));
    }
    figures.push(Figure::new(
        format!("{phase}: CPU, machine busy"),
        100.0 * cpu.machine_busy_share,
        "% of all CPUs",
    ));
}

/// The settings a run used, as `key: value`; the keys are stable (the JSON has them).
pub fn settings(args: &Args, leg: Leg) -> Map<String, Value> {
    let w = args.worker_config();
    let t = Timing::ADR;
    let mut m = Map::new();
    let mut set = |k: &str, v: Value| {
        m.insert(k.to_owned(), v);
    };
    set("build_profile", json!(benches::build_profile()));
    set("date", json!(benches::now_utc()));
    set("app_path", json!(path_name(leg)));
    set("pgbouncer_pool_mode", json!("transaction"));
    set(
        "pgbouncer_default_pool_size",
        json!(benches::bed_bouncer_pool_size()),
    );
    set("app_pool_max_connections", json!(args.pool));
    set("producer_pool_max_connections", json!(args.producer_pool));
    set(
        "throughput_shipped_shape",
        json!(args.shipped_shape().describe()),
    );
    // The tuned shape: its throughput row, the latency and fairness phases.
    set("role_interval_ms", json!(args.interval_ms));
    set("outbox_batch_size", json!(args.outbox_batch));
    set("delivery_batch_size", json!(w.batch_size));
    set("delivery_max_in_flight", json!(w.max_in_flight));
    set(
        "delivery_max_in_flight_per_endpoint",
        json!(w.max_in_flight_per_endpoint),
    );
    set(
        "delivery_timeouts",
        json!(format!(
            "connect {:?}, request {:?}, claim margin {:?}, tick budget {:?}",
            w.connect_timeout, w.request_timeout, w.claim_margin, w.tick_budget
        )),
    );
    set(
        "leader_timing",
        json!(format!(
            "ttl {:?}, heartbeat {:?}, statement_timeout {:?}, max_poll {:?}",
            t.ttl, t.heartbeat, t.statement_timeout, t.max_poll
        )),
    );
    set("throughput_runs", json!(args.runs));
    set("throughput_events", json!(args.events));
    set("throughput_endpoints", json!(args.endpoints));
    set(
        "throughput_preload_events_per_tx",
        json!(args.events_per_tx),
    );
    set(
        "throughput_enqueue",
        json!(if args.enqueue_each {
            "enqueue, one statement per event"
        } else {
            "enqueue_many, one statement per transaction"
        }),
    );
    set("latency_rate_events_per_s", json!(args.rate));
    set("latency_producer_secs", json!(args.latency_secs));
    set("latency_endpoints", json!(args.latency_endpoints));
    set("payload_bytes", json!(payload(0).len()));
    set(
        "tokio_worker_threads",
        json!(std::thread::available_parallelism().map_or(0, |n| n.get())),
    );
    m
}
