//! The deploy/ files that can be checked without a database: the Prometheus alert
//! rules, against promtool and against the metric names the service exports.

use std::collections::BTreeSet;
use std::path::{Path, PathBuf};
use std::process::Command;

/// Every series the rules may name: what the binary's role registry says
/// hardcount exports (`hardcount::roles`: each role's series and the lease
/// layer's, held against the code by the registry's own tests). A rule on any
/// other name never fires.
fn exported() -> Vec<&'static str> {
    hardcount::roles::REGISTRY
        .iter()
        .flat_map(|e| e.metrics.iter().copied())
        .chain(hardcount::roles::EVERY_ROLE_METRICS.iter().copied())
        .collect()
}

/// Histograms among them, which Prometheus also knows as `_bucket`, `_sum`, `_count`.
const HISTOGRAMS: &[&str] = &[
    "hardcount_leader_tick_duration_seconds",
    "hardcount_webhook_attempt_duration_seconds",
    "hardcount_email_send_duration_seconds",
];

/// What an operator pages on; rules.yml must keep alerting on each.
const PAGED_ON: &[&str] = &[
    "hardcount_leader_last_tick_age_seconds",
    "hardcount_leader_last_tick_known",
    "hardcount_leader_paused",
    "hardcount_leader_lease_lost_total",
    "hardcount_leader_status_errors_total",
    "hardcount_billing_oldest_due_age_seconds",
    "hardcount_dunning_attempts_total",
    "hardcount_billing_provider_key_rejected_total",
    "hardcount_billing_payment_attempts_needing_review",
    "hardcount_webhook_endpoints_secret_unusable",
];

const RULES: &str = "deploy/prometheus/rules.yml";
const RULES_TEST: &str = "deploy/prometheus/rules_test.yml";

#[test]
fn alert_rules_pass_their_promtool_tests() {
    promtool(&["check", "rules", RULES]);
    promtool(&["test", "rules", RULES_TEST]);
}

#[test]
fn alert_rules_name_only_metrics_the_service_exports() {
    let root = repo_root();
    let mut used = BTreeSet::new();
    for file in [RULES, RULES_TEST] {
        let text = read(&root.join(file));
        let names = metric_names(&text);
        for name in &names {
            assert!(
                exported_series(name).is_some(),
                "{file} names {name}, which hardcount does not export; it exports {:?}",
                exported()
            );
        }
        if file == RULES {
            for name in PAGED_ON {
                assert!(names.contains(*name), "{RULES} no longer alerts on {name}");
            }
        }
        used.extend(names);
    }

    // The list above can go stale too: each name a rule uses must still be a string
    // literal in the crates that record it.
    let mut sources = String::new();
    rust_sources(&root.join("crates"), &mut sources);
    for name in &used {
        let series = exported_series(name).unwrap();
        assert!(
            sources.contains(&format!("\"{series}\"")),
            "{RULES} alerts on {series}, but no crate records a metric by that name any more"
        );
    }
}

pub(crate) fn repo_root() -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR")).join("..")
}

pub(crate) fn read(path: &Path) -> String {
    std::fs::read_to_string(path).unwrap_or_else(|e| panic!("cannot read {}: {e}", path.display()))
}

/// Run promtool in the repository root; on failure, panic with its output.
fn promtool(args: &[&str]) {
    let out = match Command::new("promtool")
        .args(args)
        .current_dir(repo_root())
        .output()
    {
        Ok(out) => out,
        Err(e) if e.kind() == std::io::ErrorKind::NotFound => panic!(
            "promtool is not on PATH. It comes with Debian's `prometheus` package, which \
             scripts/bed installs: run the tests with `scripts/bed test`, or \
             `apt-get install prometheus` first"
        ),
        Err(e) => panic!("cannot run promtool: {e}"),
    };
    let text = crate::text(&out);
    assert!(
        out.status.success(),
        "promtool {} failed\n{text}",
        args.join(" ")
    );
}

/// Every `hardcount_...` name in `text`, ending where a metric name ends (`{`, space,
/// `)`, `[`, quote, ...).
pub(crate) fn metric_names(text: &str) -> BTreeSet<String> {
    let in_name = |b: u8| b.is_ascii_alphanumeric() || b == b'_' || b == b':';
    let bytes = text.as_bytes();
    let mut names = BTreeSet::new();
    let mut from = 0;
    while let Some(at) = text[from..].find("hardcount_") {
        let start = from + at;
        let mut end = start;
        while end < bytes.len() && in_name(bytes[end]) {
            end += 1;
        }
        if start == 0 || !in_name(bytes[start - 1]) {
            names.insert(text[start..end].to_owned());
        }
        from = end;
    }
    names
}

/// The exported series a name refers to (a histogram's `_bucket` is its histogram).
pub(crate) fn exported_series(name: &str) -> Option<&'static str> {
    if let Some(series) = exported().into_iter().find(|s| *s == name) {
        return Some(series);
    }
    HISTOGRAMS.iter().copied().find(|h| {
        name.strip_prefix(h)
            .is_some_and(|rest| ["_bucket", "_sum", "_count"].contains(&rest))
    })
}

/// Append the text of every `.rs` file under `crates/*/src`.
pub(crate) fn rust_sources(crates: &Path, out: &mut String) {
    fn walk(dir: &Path, out: &mut String) {
        let Ok(entries) = std::fs::read_dir(dir) else {
            return;
        };
        for entry in entries.flatten() {
            let path = entry.path();
            if path.is_dir() {
                walk(&path, out);
            } else if path.extension().is_some_and(|e| e == "rs") {
                out.push_str(&std::fs::read_to_string(&path).unwrap_or_default());
            }
        }
    }
    for krate in std::fs::read_dir(crates).unwrap().flatten() {
        walk(&krate.path().join("src"), out);
    }
}

const RUNBOOK: &str = "docs/runbook.md";

/// Every alert in rules.yml has an entry in the runbook, and every series and
/// `hardcount` subcommand the runbook names exists.
///
/// Catches: an alert added without saying what to do, a runbook line on a
/// renamed series or command.
#[test]
fn every_alert_has_a_runbook_entry_and_the_runbook_names_what_exists() {
    let root = repo_root();
    let runbook = read(&root.join(RUNBOOK));
    let rules = read(&root.join(RULES));
    let alerts: Vec<&str> = rules
        .lines()
        .filter_map(|l| l.trim().strip_prefix("- alert: "))
        .collect();
    assert!(alerts.len() > 10, "{alerts:?}");
    for alert in &alerts {
        assert!(
            runbook.contains(&format!("**{alert}**")),
            "{RUNBOOK} has no entry for {alert}"
        );
    }
    // Database logins and the provider metadata key share the prefix.
    let not_series = [
        "hardcount_operator",
        "hardcount_app",
        "hardcount_api",
        "hardcount_attempt",
    ];
    for name in metric_names(&runbook) {
        // A URL's `user:password@` ends a login with a colon.
        let name = name.trim_end_matches(':');
        if not_series.contains(&name) {
            continue;
        }
        assert!(
            exported_series(name).is_some(),
            "{RUNBOOK} names {name}, which hardcount does not export"
        );
    }
    // `hardcount WORD WORD` in code spans: each parses as far as its subcommands.
    for span in runbook.split('`').skip(1).step_by(2) {
        let Some(rest) = span.strip_prefix("hardcount ") else {
            continue;
        };
        let words: Vec<&str> = rest
            .split_whitespace()
            .take_while(|w| {
                w.starts_with(|c: char| c.is_ascii_lowercase())
                    && w.chars().all(|c| c.is_ascii_lowercase() || c == '-')
            })
            .collect();
        let out = Command::new(env!("CARGO_BIN_EXE_hardcount-under-test"))
            .args(&words)
            .arg("--help")
            .output()
            .unwrap();
        assert!(
            out.status.success(),
            "{RUNBOOK}: `hardcount {}` is not a command\n{}",
            words.join(" "),
            crate::text(&out)
        );
    }
}
