//! Shared helpers for the benchmark binaries in src/bin/: what machine a run was
//! on, how busy it was, PgBouncer's counters, CPU time per process group, and
//! where the reports go.

use std::collections::HashMap;
use std::path::{Path, PathBuf};
use std::time::Duration;

use anyhow::{Context as _, Result, bail};
use serde_json::{Map, Value, json};
use sqlx::postgres::PgConnection;
use sqlx::{Connection, Row};
use testbed::Leg;

/// `docs/benchmarks` of this workspace, or `out_dir` when given; created, canonical.
pub fn report_dir(out_dir: Option<PathBuf>) -> Result<PathBuf> {
    let dir = out_dir
        .unwrap_or_else(|| PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("../docs/benchmarks"));
    std::fs::create_dir_all(&dir).map_err(|e| anyhow::anyhow!("create {}: {e}", dir.display()))?;
    Ok(dir.canonicalize()?)
}

/// Opens the part of a report that the benchmark writes; everything outside the
/// markers is written by hand and kept as it is.
pub const GENERATED_BEGIN: &str = "<!-- generated: begin -->";
/// Closes the generated part of a report.
pub const GENERATED_END: &str = "<!-- generated: end -->";

/// `doc` with the text between its markers replaced by `generated`.
///
/// # Errors
/// When `doc` lacks either marker, or has them out of order.
pub fn splice_generated(doc: &str, generated: &str) -> Result<String> {
    let begin = doc
        .find(GENERATED_BEGIN)
        .with_context(|| format!("no `{GENERATED_BEGIN}` line"))?;
    let end = doc
        .find(GENERATED_END)
        .filter(|&end| end > begin)
        .with_context(|| format!("no `{GENERATED_END}` line after `{GENERATED_BEGIN}`"))?;
    let head = &doc[..begin + GENERATED_BEGIN.len()];
    let tail = &doc[end..];
    let body = generated.trim_matches('\n');
    Ok(format!("{head}\n{body}\n{tail}"))
}

/// Replace the generated part of `dir/name` with `generated`, keeping its
/// hand-written text. When that file does not exist yet (an `--out-dir` for an
/// experiment), the hand-written text comes from this workspace's copy in
/// `docs/benchmarks`.
/// The generated part's closing lines: the machine (from a report's
/// `machine`) and the settings (its `settings`), as every benchmark writes them.
pub fn machine_and_settings(report: &Value) -> String {
    let m = &report["machine"];
    let text = |v: &Value| v.as_str().unwrap_or("?").to_owned();
    format!(
        "Machine: {} cores, {}, {}; Postgres {}, {}. Load at start {}, at end {}.\nSettings: {}.\n",
        m["nproc"],
        text(&m["cpu_model"]),
        text(&m["memory"]),
        text(&m["postgres"]),
        text(&m["pgbouncer"]),
        text(&m["loadavg_at_start"]),
        text(&m["loadavg_at_end"]),
        report["settings"],
    )
}

pub fn write_generated(dir: &Path, name: &str, generated: &str) -> Result<()> {
    let target = dir.join(name);
    let source = if target.exists() {
        target.clone()
    } else {
        PathBuf::from(env!("CARGO_MANIFEST_DIR"))
            .join("../docs/benchmarks")
            .join(name)
    };
    let doc =
        std::fs::read_to_string(&source).with_context(|| format!("read {}", source.display()))?;
    let spliced = splice_generated(&doc, generated)
        .with_context(|| format!("{}: where does the generated part go?", source.display()))?;
    std::fs::write(&target, spliced).with_context(|| format!("write {}", target.display()))
}

/// CPUs this process may run on (1 when unknown).
pub fn nproc() -> usize {
    std::thread::available_parallelism().map_or(1, |n| n.get())
}

/// What the figures were measured on: CPU, memory, load at the start, versions.
pub async fn machine(su: &mut PgConnection) -> Result<Map<String, Value>> {
    let postgres: String = sqlx::query_scalar("SHOW server_version")
        .fetch_one(su)
        .await?;
    let version = |bin: &str| {
        std::process::Command::new(bin)
            .arg("--version")
            .output()
            .map(|o| first_line(&String::from_utf8_lossy(&o.stdout)))
    };
    let pgbouncer = version("pgbouncer")
        .or_else(|_| version("/usr/sbin/pgbouncer"))
        .unwrap_or_else(|e| format!("unknown ({e})"));
    // The value after `key:` on the first line of `file` that starts with `key`.
    let proc_field = |file: &str, key: &str| {
        let text = std::fs::read_to_string(file).unwrap_or_default();
        text.lines()
            .find(|l| l.starts_with(key))
            .and_then(|l| l.split_once(':'))
            .map_or_else(|| "unknown".to_owned(), |(_, v)| v.trim().to_owned())
    };
    let nproc = std::thread::available_parallelism().map_or(0, |n| n.get());
    Ok(Map::from_iter([
        ("nproc".to_owned(), json!(nproc)),
        (
            "cpu_model".to_owned(),
            json!(proc_field("/proc/cpuinfo", "model name")),
        ),
        (
            "memory".to_owned(),
            json!(proc_field("/proc/meminfo", "MemTotal")),
        ),
        ("loadavg_at_start".to_owned(), json!(loadavg())),
        ("cpu_pressure_at_start".to_owned(), json!(cpu_pressure())),
        ("postgres".to_owned(), json!(postgres)),
        ("pgbouncer".to_owned(), json!(pgbouncer)),
    ]))
}

/// For a `--never-analyzed` run of the billing and dunning benchmarks: fails
/// when any table was analyzed during the run
/// ([`testbed::plans::keep_tables_unanalyzed`] was applied at its start).
pub async fn ensure_never_analyzed(su: &mut PgConnection) -> Result<()> {
    let analyzed = testbed::plans::tables_analyzed(su).await?;
    if !analyzed.is_empty() {
        bail!("--never-analyzed, but these tables were analyzed during the run: {analyzed:?}");
    }
    Ok(())
}

/// Add the end-of-run load figures to `machine`.
pub fn machine_at_end(machine: &mut Map<String, Value>) {
    machine.insert("loadavg_at_end".into(), json!(loadavg()));
    machine.insert("cpu_pressure_at_end".into(), json!(cpu_pressure()));
}

/// Share of time some task waited for a CPU (Linux PSI), averaged over 10, 60 and 300 s.
pub fn cpu_pressure() -> String {
    let s = std::fs::read_to_string("/proc/pressure/cpu").unwrap_or_default();
    s.lines().next().unwrap_or("unavailable").to_owned()
}

/// The 1, 5 and 15 minute load averages: how busy the shared machine was.
pub fn loadavg() -> String {
    let s = std::fs::read_to_string("/proc/loadavg").unwrap_or_default();
    s.split_whitespace().take(3).collect::<Vec<_>>().join(" ")
}

fn first_line(s: &str) -> String {
    s.lines().next().unwrap_or("").trim().to_owned()
}

/// The bed's PgBouncer `default_pool_size`, read from the script that sets it.
pub fn bed_bouncer_pool_size() -> String {
    let bed = concat!(env!("CARGO_MANIFEST_DIR"), "/../scripts/bed");
    std::fs::read_to_string(bed)
        .ok()
        .and_then(|s| {
            s.lines().find_map(|l| {
                l.trim()
                    .strip_prefix("default_pool_size = ")
                    .map(str::to_owned)
            })
        })
        .unwrap_or_else(|| "unknown".to_owned())
}

pub fn build_profile() -> &'static str {
    if cfg!(debug_assertions) {
        "debug"
    } else {
        "release"
    }
}

pub fn now_utc() -> String {
    chrono::Utc::now().format("%Y-%m-%d %H:%M UTC").to_string()
}

/// Nearest-rank percentile of sorted samples, in milliseconds.
pub fn percentile_ms(sorted: &[Duration], p: f64) -> f64 {
    if sorted.is_empty() {
        return f64::NAN;
    }
    let rank = ((p / 100.0 * sorted.len() as f64).ceil() as usize).clamp(1, sorted.len());
    sorted[rank - 1].as_secs_f64() * 1e3
}

/// A `key: value` line per entry, for the Machine and Settings sections.
pub fn markdown_list(m: &Map<String, Value>) -> String {
    m.iter()
        .map(|(k, v)| match v {
            Value::String(s) => format!("- {k}: {s}\n"),
            v => format!("- {k}: {v}\n"),
        })
        .collect()
}

/// PgBouncer's admin console (the bed makes `postgres` an admin user).
pub async fn bouncer_admin() -> Result<PgConnection> {
    let url = format!("postgres://postgres@{}/pgbouncer", Leg::PgBouncer.addr());
    Ok(PgConnection::connect(&url).await?)
}

/// `database`'s row of PgBouncer's `SHOW STATS`: the `total_*` counters
/// (transactions, queries, and microseconds spent in transactions, in queries
/// and waiting for a server connection), by column name.
pub async fn bouncer_stats(
    admin: &mut PgConnection,
    database: &str,
) -> Result<HashMap<String, i64>> {
    for row in sqlx::raw_sql("SHOW STATS").fetch_all(admin).await? {
        if row.try_get::<String, _>("database")? != database {
            continue;
        }
        let mut out = HashMap::new();
        for col in [
            "total_xact_count",
            "total_query_count",
            "total_xact_time",
            "total_query_time",
            "total_wait_time",
        ] {
            // A NUMERIC sent as text (simple protocol): read the text, unchecked.
            let n: String = row.try_get_unchecked(col)?;
            out.insert(col.to_owned(), n.parse()?);
        }
        return Ok(out);
    }
    bail!("SHOW STATS has no row for {database}")
}

/// `database`'s pool for `user` in PgBouncer's `SHOW POOLS`, now: server
/// connections linked to a client (in a transaction, in transaction mode) and
/// clients waiting for one. `None` when PgBouncer has no such pool yet.
pub async fn bouncer_pool(
    admin: &mut PgConnection,
    database: &str,
    user: &str,
) -> Result<Option<(i64, i64)>> {
    for row in sqlx::raw_sql("SHOW POOLS").fetch_all(admin).await? {
        if row.try_get::<String, _>("database")? == database
            && row.try_get::<String, _>("user")? == user
        {
            let n = |col: &str| -> Result<i64> {
                let text: String = row.try_get_unchecked(col)?;
                Ok(text.parse()?)
            };
            return Ok(Some((n("sv_active")?, n("cl_waiting")?)));
        }
    }
    Ok(None)
}

/// CPU time consumed so far, split by who consumed it. Read from /proc, so
/// Linux only; every field is zero elsewhere.
#[derive(Debug, Clone, Copy, Default)]
pub struct CpuSnapshot {
    /// This process (the benchmark: role loops, HTTP client and receiver).
    pub this_process: f64,
    /// The bed's Postgres: its postmaster and every child (backends, walwriter, ...).
    pub postgres: f64,
    /// The bed's PgBouncer.
    pub pgbouncer: f64,
    /// Every CPU's busy time (all but idle and iowait), machine-wide.
    pub machine_busy: f64,
    /// Every CPU's total time, machine-wide.
    pub machine_total: f64,
}

/// CPU seconds used between two snapshots, and the machine's busy share.
#[derive(Debug, Clone, Copy)]
pub struct CpuUse {
    pub this_process: f64,
    pub postgres: f64,
    pub pgbouncer: f64,
    /// Busy CPU seconds machine-wide not accounted to the three above: other
    /// processes on the shared machine (builds, other tests).
    pub others: f64,
    /// Machine-wide busy share over all CPUs, 0..1.
    pub machine_busy_share: f64,
    /// Wall seconds between the snapshots times the number of CPUs.
    pub capacity: f64,
}

impl CpuSnapshot {
    /// Read `/proc`. The bed's Postgres is the postmaster listening on
    /// `HARDCOUNT_TEST_PG`'s port; its PgBouncer is the one whose config file
    /// is in the bed's directory (the postmaster's `-k` socket directory).
    pub fn take() -> CpuSnapshot {
        let tick = clock_ticks_per_second();
        let procs = processes();
        let port = std::env::var("HARDCOUNT_TEST_PG")
            .ok()
            .and_then(|a| a.rsplit_once(':').map(|(_, p)| p.to_owned()))
            .unwrap_or_default();
        let postmaster = procs.iter().find(|p| {
            p.comm == "postgres" && p.args.windows(2).any(|w| w[0] == "-p" && w[1] == port)
        });
        let bed_dir = postmaster.and_then(|p| {
            p.args
                .windows(2)
                .find(|w| w[0] == "-k")
                .map(|w| w[1].clone())
        });
        let mut snap = CpuSnapshot::default();
        let me = std::process::id();
        for p in &procs {
            let secs = p.ticks as f64 / tick;
            if p.pid == me {
                snap.this_process += secs;
            } else if postmaster.is_some_and(|m| p.pid == m.pid || p.ppid == m.pid) {
                snap.postgres += secs;
            } else if p.comm == "pgbouncer"
                && bed_dir
                    .as_ref()
                    .is_some_and(|d| p.args.iter().any(|a| a.starts_with(d.as_str())))
            {
                snap.pgbouncer += secs;
            }
        }
        if let Some(line) = std::fs::read_to_string("/proc/stat")
            .ok()
            .and_then(|s| s.lines().next().map(str::to_owned))
        {
            // cpu user nice system idle iowait irq softirq steal guest guest_nice
            let f: Vec<f64> = line
                .split_whitespace()
                .skip(1)
                .filter_map(|x| x.parse().ok())
                .collect();
            if f.len() >= 8 {
                let total: f64 = f[..8].iter().sum();
                snap.machine_total = total / tick;
                snap.machine_busy = (total - f[3] - f[4]) / tick;
            }
        }
        snap
    }

    pub fn since(&self, earlier: &CpuSnapshot) -> CpuUse {
        let this_process = self.this_process - earlier.this_process;
        let postgres = self.postgres - earlier.postgres;
        let pgbouncer = self.pgbouncer - earlier.pgbouncer;
        let busy = self.machine_busy - earlier.machine_busy;
        let capacity = self.machine_total - earlier.machine_total;
        CpuUse {
            this_process,
            postgres,
            pgbouncer,
            others: (busy - this_process - postgres - pgbouncer).max(0.0),
            machine_busy_share: if capacity > 0.0 { busy / capacity } else { 0.0 },
            capacity,
        }
    }
}

/// CPU seconds (user and system) process `pid` has used so far; 0 when it
/// cannot be read (gone, or not Linux).
pub fn process_cpu_seconds(pid: u32) -> f64 {
    let stat = std::fs::read_to_string(format!("/proc/{pid}/stat")).unwrap_or_default();
    // Fields after the command's closing parenthesis: utime and stime are the
    // 12th and 13th of them (the 14th and 15th of the line).
    let rest = stat.rsplit_once(')').map_or("", |(_, r)| r);
    let f: Vec<&str> = rest.split_whitespace().collect();
    let field = |i: usize| f.get(i).and_then(|x| x.parse::<f64>().ok()).unwrap_or(0.0);
    (field(11) + field(12)) / clock_ticks_per_second()
}

struct Proc {
    pid: u32,
    ppid: u32,
    comm: String,
    args: Vec<String>,
    /// utime + stime, in clock ticks.
    ticks: u64,
}

fn processes() -> Vec<Proc> {
    let Ok(dir) = std::fs::read_dir("/proc") else {
        return Vec::new();
    };
    dir.flatten()
        .filter_map(|e| e.file_name().to_str()?.parse::<u32>().ok())
        .filter_map(|pid| {
            let stat = std::fs::read_to_string(format!("/proc/{pid}/stat")).ok()?;
            // pid (comm) state ppid ... ; comm may hold spaces and parentheses.
            let open = stat.find('(')?;
            let close = stat.rfind(')')?;
            let comm = stat[open + 1..close].to_owned();
            let rest: Vec<&str> = stat[close + 1..].split_whitespace().collect();
            // rest[0] is field 3 (state); utime and stime are fields 14 and 15.
            let ppid = rest.get(1)?.parse().ok()?;
            let ticks = rest.get(11)?.parse::<u64>().ok()? + rest.get(12)?.parse::<u64>().ok()?;
            let args = std::fs::read(format!("/proc/{pid}/cmdline"))
                .map(|b| {
                    b.split(|c| *c == 0)
                        .filter(|s| !s.is_empty())
                        .map(|s| String::from_utf8_lossy(s).into_owned())
                        .collect()
                })
                .unwrap_or_default();
            Some(Proc {
                pid,
                ppid,
                comm,
                args,
                ticks,
            })
        })
        .collect()
}

fn clock_ticks_per_second() -> f64 {
    static TICKS: std::sync::OnceLock<f64> = std::sync::OnceLock::new();
    *TICKS.get_or_init(|| {
        std::process::Command::new("getconf")
            .arg("CLK_TCK")
            .output()
            .ok()
            .and_then(|o| String::from_utf8_lossy(&o.stdout).trim().parse().ok())
            .unwrap_or(100.0)
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn splicing_replaces_only_the_generated_part() {
        let doc = format!(
            "# Title\n\nHand-written.\n\n{GENERATED_BEGIN}\nold table\n{GENERATED_END}\n\nMore prose.\n"
        );
        let out = splice_generated(&doc, "\nnew table\n\n").unwrap();
        assert_eq!(
            out,
            format!(
                "# Title\n\nHand-written.\n\n{GENERATED_BEGIN}\nnew table\n{GENERATED_END}\n\nMore prose.\n"
            )
        );
        assert_eq!(
            splice_generated(&out, "new table").unwrap(),
            out,
            "idempotent"
        );
    }

    #[test]
    fn a_report_without_markers_is_refused() {
        assert!(splice_generated("# Title\nprose\n", "table").is_err());
        let reversed = format!("{GENERATED_END}\n{GENERATED_BEGIN}\n");
        assert!(splice_generated(&reversed, "table").is_err());
    }
}
