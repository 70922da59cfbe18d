//! wrk, the load generator: the Lua scripts it runs, one run, and the figures
//! read from its output.

use std::path::PathBuf;
use std::process::Stdio;

use anyhow::{Context, Result, bail, ensure};

use crate::PUBLISH_BODY;

/// What one wrk run measured.
#[derive(Debug, Clone)]
pub struct Run {
    pub rps: f64,
    pub p50_ms: f64,
    pub p99_ms: f64,
    pub errors: u64,
}

pub fn publish_lua(key: &str, idempotent: bool) -> String {
    let idem = if idempotent {
        r#"
local counter = 0
local thread_id = 0
function setup(thread)
  thread_id = thread_id + 1
  thread:set("tid", thread_id)
end
function request()
  counter = counter + 1
  wrk.headers["Idempotency-Key"] = "bench-" .. tid .. "-" .. counter .. "-" .. os.time()
  return wrk.format()
end
"#
    } else {
        ""
    };
    format!(
        "wrk.method = \"POST\"\nwrk.body = '{PUBLISH_BODY}'\nwrk.headers[\"Content-Type\"] = \"application/json\"\nwrk.headers[\"Authorization\"] = \"Bearer {key}\"\n{idem}"
    )
}

pub fn get_lua(key: &str) -> String {
    format!("wrk.method = \"GET\"\nwrk.headers[\"Authorization\"] = \"Bearer {key}\"\n")
}

pub fn tempdir() -> Result<PathBuf> {
    let dir = std::env::temp_dir().join(format!("hardcount-api-bench-{}", std::process::id()));
    std::fs::create_dir_all(&dir)?;
    Ok(dir)
}

pub fn script(dir: &std::path::Path, name: &str, text: &str) -> Result<PathBuf> {
    let path = dir.join(name);
    std::fs::write(&path, text)?;
    Ok(path)
}

pub fn which(cmd: &str) -> Result<()> {
    let ok = std::process::Command::new("sh")
        .args(["-c", &format!("command -v {cmd}")])
        .stdout(Stdio::null())
        .status()?
        .success();
    if ok { Ok(()) } else { bail!("{cmd} not found") }
}

/// One wrk run: 2 threads, `connections`, `seconds`, latency distribution.
pub async fn wrk(script: &PathBuf, url: &str, connections: usize, seconds: u64) -> Result<Run> {
    let out = tokio::process::Command::new("wrk")
        .arg("-t2")
        .arg(format!("-c{connections}"))
        .arg(format!("-d{seconds}s"))
        .arg("--latency")
        .arg("-s")
        .arg(script)
        .arg(url)
        .output()
        .await?;
    let text = String::from_utf8_lossy(&out.stdout).into_owned();
    ensure!(out.status.success(), "wrk failed: {text}");
    parse_wrk(&text).with_context(|| format!("cannot read wrk's output:\n{text}"))
}

fn parse_wrk(text: &str) -> Option<Run> {
    let mut rps = None;
    let (mut p50, mut p99) = (None, None);
    let mut errors = 0;
    for line in text.lines() {
        let l = line.trim();
        if let Some(v) = l.strip_prefix("Requests/sec:") {
            rps = v.trim().parse().ok();
        } else if let Some(v) = l.strip_prefix("50%") {
            p50 = ms(v.trim());
        } else if let Some(v) = l.strip_prefix("99%") {
            p99 = ms(v.trim());
        } else if let Some(v) = l.strip_prefix("Non-2xx or 3xx responses:") {
            errors += v.trim().parse::<u64>().unwrap_or(0);
        } else if let Some(v) = l.strip_prefix("Socket errors:") {
            errors += v
                .split(',')
                .filter_map(|p| p.split_whitespace().last()?.parse::<u64>().ok())
                .sum::<u64>();
        }
    }
    Some(Run {
        rps: rps?,
        p50_ms: p50?,
        p99_ms: p99?,
        errors,
    })
}

fn ms(v: &str) -> Option<f64> {
    let (num, factor) = if let Some(n) = v.strip_suffix("us") {
        (n, 0.001)
    } else if let Some(n) = v.strip_suffix("ms") {
        (n, 1.0)
    } else if let Some(n) = v.strip_suffix('s') {
        (n, 1000.0)
    } else {
        return None;
    };
    num.parse::<f64>().ok().map(|n| n * factor)
}
