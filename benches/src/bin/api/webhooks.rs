//! The webhook benchmark, run beside the API: its binary's throughput phase,
//! the paced publishing load beside it, and the share of the cores that load
//! takes.

use std::process::Stdio;
use std::time::Duration;

use anyhow::{Context, Result, ensure};
use serde_json::Value;
use tokio_util::sync::CancellationToken;

use crate::PUBLISH_BODY;

/// The webhook benchmark's flags: its throughput phase only.
pub const WEBHOOK_FLAGS: &[&str] = &[
    "--skip-latency",
    "--skip-comparison-runs",
    "--skip-fairness",
];

/// The webhook benchmark's throughput phase, as its own release binary
/// (built beside this one), its report in `dir`; the median deliveries/s.
pub async fn webhooks_bench(dir: &std::path::Path) -> Result<f64> {
    std::fs::create_dir_all(dir)?;
    // The report's hand-written half is copied from docs/benchmarks.
    let exe = std::env::current_exe()?.with_file_name("webhooks");
    ensure!(
        exe.exists(),
        "{} is missing: cargo build --release -p benches --bin webhooks",
        exe.display()
    );
    let status = tokio::process::Command::new(&exe)
        .args(WEBHOOK_FLAGS)
        .arg("--out-dir")
        .arg(dir)
        .stdout(Stdio::null())
        .status()
        .await?;
    ensure!(status.success(), "the webhook benchmark failed");
    let report: Value = serde_json::from_str(&std::fs::read_to_string(dir.join("webhooks.json"))?)?;
    report
        .as_array()
        .and_then(|rows| {
            rows.iter().find(|r| {
                r["name"]
                    .as_str()
                    .is_some_and(|n| n.starts_with("throughput at the shipped defaults"))
            })
        })
        .and_then(|r| r["value"].as_f64())
        .context("no throughput row in the webhook benchmark's report")
}

/// Publish at `rate` per second until `stop`; (published, failed).
pub async fn paced_publish(
    url: String,
    key: String,
    rate: u32,
    stop: CancellationToken,
) -> Result<(u64, u64)> {
    let client = reqwest::Client::new();
    let mut tick = tokio::time::interval(Duration::from_secs(1) / rate.max(1));
    tick.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Delay);
    let sent = std::sync::Arc::new(std::sync::atomic::AtomicU64::new(0));
    let failed = std::sync::Arc::new(std::sync::atomic::AtomicU64::new(0));
    let tasks = tokio_util::task::TaskTracker::new();
    while !stop.is_cancelled() {
        tokio::select! {
            () = stop.cancelled() => break,
            _ = tick.tick() => {}
        }
        let (client, url, key) = (client.clone(), url.clone(), key.clone());
        let (sent, failed) = (sent.clone(), failed.clone());
        tasks.spawn(async move {
            let ok = client
                .post(&url)
                .header("authorization", format!("Bearer {key}"))
                .header("content-type", "application/json")
                .body(PUBLISH_BODY)
                .send()
                .await
                .is_ok_and(|r| r.status().as_u16() == 201);
            let counter = if ok { &sent } else { &failed };
            counter.fetch_add(1, std::sync::atomic::Ordering::Relaxed);
        });
    }
    tasks.close();
    tasks.wait().await;
    Ok((
        sent.load(std::sync::atomic::Ordering::Relaxed),
        failed.load(std::sync::atomic::Ordering::Relaxed),
    ))
}

/// This process's CPU time so far (user + system), in seconds.
pub fn own_cpu_seconds() -> f64 {
    benches::process_cpu_seconds(std::process::id())
}

pub fn cores() -> f64 {
    std::thread::available_parallelism().map_or(1.0, |n| n.get() as f64)
}
