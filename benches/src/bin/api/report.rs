//! The figures and how they are written: medians over runs, `api.json`, and
//! the generated part of `docs/benchmarks/api.md`.

use std::path::PathBuf;

use anyhow::Result;
use serde_json::{Value, json};

use crate::wrk::Run;

pub fn median(mut v: Vec<f64>) -> f64 {
    v.sort_by(f64::total_cmp);
    v[v.len() / 2]
}

pub fn summary(runs: &[Run]) -> Value {
    json!({
        "requests_per_s_median": median(runs.iter().map(|r| r.rps).collect()),
        "p50_ms_median": median(runs.iter().map(|r| r.p50_ms).collect()),
        "p99_ms_median": median(runs.iter().map(|r| r.p99_ms).collect()),
        "errors": runs.iter().map(|r| r.errors).sum::<u64>(),
        "runs": runs.iter().map(|r| json!({
            "requests_per_s": r.rps, "p50_ms": r.p50_ms, "p99_ms": r.p99_ms, "errors": r.errors,
        })).collect::<Vec<_>>(),
    })
}

pub fn write_report(report: &Value, out_dir: Option<PathBuf>) -> Result<()> {
    let dir = benches::report_dir(out_dir)?;
    std::fs::write(
        dir.join("api.json"),
        serde_json::to_string_pretty(report)? + "\n",
    )?;
    let r = &report["results"];
    let row = |k: &str| -> String {
        let v = &r[k];
        if v.is_null() {
            return "| (not run) | | | |".to_owned();
        }
        format!(
            "| {:.0} | {:.2} | {:.2} | {} |",
            v["requests_per_s_median"].as_f64().unwrap_or(0.0),
            v["p50_ms_median"].as_f64().unwrap_or(0.0),
            v["p99_ms_median"].as_f64().unwrap_or(0.0),
            v["errors"]
        )
    };
    let mut md = String::new();
    md.push_str(
        "| Measure | Row-level security | Requests/s (median) | p50 ms | p99 ms | Errors |\n",
    );
    md.push_str("|---|---|---:|---:|---:|---:|\n");
    for (name, label) in [
        ("publish", "POST /v1/events"),
        (
            "publish_idempotent",
            "POST /v1/events with an Idempotency-Key",
        ),
        ("page_100", "GET /v1/events?limit=100"),
    ] {
        for (rls, on) in [("rls_on", "on"), ("rls_off", "off")] {
            let key = format!("{rls}.{name}");
            if r[&key].is_null() {
                continue;
            }
            md.push_str(&format!("| {label} | {on} {}\n", row(&key)));
        }
    }
    let w = &report["webhooks"];
    if !w.is_null() {
        md.push_str(&format!(
            "\nWebhook throughput benchmark (`webhooks {}`), interleaved rounds, medians: \
             {:.0} deliveries/s alone.\n\n\
             | API load | Deliveries/s | Ratio to alone | API process's share of the cores | 1 − that share | the load alone: API, Postgres and PgBouncer's share of the cores | 1 − that share |\n\
             |---|---:|---:|---:|---:|---:|---:|\n",
            w["webhook_bench_flags"].as_str().unwrap_or(""),
            w["deliveries_per_s_alone_median"].as_f64().unwrap_or(0.0),
        ));
        for b in w["beside"].as_array().into_iter().flatten() {
            md.push_str(&format!(
                "| {} events/s | {:.0} | {:.2} | {:.1} % | {:.2} | {:.1} % | {:.2} |\n",
                b["api_events_per_s"],
                b["deliveries_per_s_median"].as_f64().unwrap_or(0.0),
                b["ratio"].as_f64().unwrap_or(0.0),
                b["api_process_core_share_median"].as_f64().unwrap_or(0.0) * 100.0,
                b["ratio_expected_from_core_share"].as_f64().unwrap_or(0.0),
                b["load_alone"]["core_share"].as_f64().unwrap_or(0.0) * 100.0,
                b["ratio_expected_from_load_alone"].as_f64().unwrap_or(0.0),
            ));
        }
    }
    md.push('\n');
    md.push_str(&benches::machine_and_settings(report));
    benches::write_generated(&dir, "api.md", &md)
}
