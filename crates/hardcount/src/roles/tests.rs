//! The registry held to the places it names: `Role::ALL`, the settings (clap's
//! `env` names, as `hardcount serve --help` lists them, and README.md's table),
//! `deploy/prometheus/rules.yml`, and the series the crates register.
//!
//! Each check is a function from a registry to its problems, so each test also
//! runs it on copies of the registry with one thing taken out (an entry, a
//! setting, an alert, a series) and expects a problem: the mutation "forget
//! one" is part of the test, not a thing to remember to try.

use std::collections::{BTreeMap, BTreeSet};
use std::path::{Path, PathBuf};

use clap::{CommandFactory, Parser};

use super::*;

mod alerts;

fn repo_root() -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR")).join("../..")
}

fn read(relative: &str) -> String {
    let path = repo_root().join(relative);
    std::fs::read_to_string(&path).unwrap_or_else(|e| panic!("cannot read {}: {e}", path.display()))
}

/// Leak a copy (tests only), so a mutated registry has the registry's type.
fn leak<T: Clone>(items: Vec<T>) -> &'static [T] {
    Box::leak(items.into_boxed_slice())
}

/// Copies of `registry` with one entry left out, one per entry.
fn without_each_entry(registry: &[RoleEntry]) -> Vec<(String, Vec<RoleEntry>)> {
    (0..registry.len())
        .map(|i| {
            let mut copy = registry.to_vec();
            let gone = copy.remove(i);
            (format!("without {}", gone.role), copy)
        })
        .collect()
}

/// Copies of `registry` with one item of one entry's list left out, for every
/// item of that list in every entry.
fn without_each_item(
    registry: &[RoleEntry],
    list: fn(&mut RoleEntry) -> &mut &'static [&'static str],
) -> Vec<(String, Vec<RoleEntry>)> {
    let mut out = Vec::new();
    for i in 0..registry.len() {
        let mut probe = registry[i];
        let items = list(&mut probe).to_vec();
        for (j, item) in items.iter().enumerate() {
            let mut copy = registry.to_vec();
            let mut rest = items.clone();
            rest.remove(j);
            *list(&mut copy[i]) = leak(rest);
            out.push((format!("{} without {item}", registry[i].role), copy));
        }
    }
    out
}

fn assert_each_is_caught(
    what: &str,
    mutants: Vec<(String, Vec<RoleEntry>)>,
    check: impl Fn(&[RoleEntry]) -> Vec<String>,
) {
    assert!(!mutants.is_empty(), "{what}: no mutant to try");
    for (name, mutant) in mutants {
        assert!(
            !check(&mutant).is_empty(),
            "{what}: the registry {name} passes the check, so forgetting it would go unnoticed"
        );
    }
}

// --- Role::ALL ---------------------------------------------------------------

fn entry_problems(registry: &[RoleEntry]) -> Vec<String> {
    let mut problems = Vec::new();
    for role in Role::ALL {
        match registry.iter().filter(|e| e.role == role).count() {
            1 => {}
            0 => problems.push(format!(
                "{role} has no entry in crates/hardcount/src/roles.rs"
            )),
            n => problems.push(format!("{role} has {n} entries; register a role once")),
        }
    }
    let order: Vec<Role> = registry.iter().map(|e| e.role).collect();
    if problems.is_empty() && order != Role::ALL {
        problems.push(format!("entries in {order:?}, not Role::ALL's order"));
    }
    problems
}

/// Fails when a `Role::ALL` member has no entry (or two). Mutation: delete any
/// entry from `REGISTRY` (tried: billing's; also run below for each entry).
#[test]
fn every_role_has_one_entry() {
    assert_eq!(entry_problems(REGISTRY), Vec::<String>::new());
    assert_each_is_caught("entries", without_each_entry(REGISTRY), entry_problems);
    let mut twice = REGISTRY.to_vec();
    twice.push(REGISTRY[0]);
    assert!(!entry_problems(&twice).is_empty());
}

// --- settings ----------------------------------------------------------------

/// Every variable `hardcount serve` reads: the `env` of each argument of the
/// command line's root (the settings every command shares) and of `serve`.
fn serve_variables() -> BTreeSet<String> {
    let root = crate::Cli::command();
    let serve = root
        .find_subcommand("serve")
        .expect("a serve subcommand")
        .clone();
    root.get_arguments()
        .chain(serve.get_arguments())
        .filter_map(|a| a.get_env())
        .map(|v| v.to_string_lossy().into_owned())
        .collect()
}

/// The variables README.md's environment table names (`| `VAR` | ...`).
fn readme_variables(readme: &str) -> BTreeSet<String> {
    readme
        .lines()
        .filter_map(|line| line.strip_prefix("| `"))
        .filter_map(|rest| rest.split('`').next())
        .map(str::to_owned)
        .collect()
}

fn settings_problems(
    registry: &[RoleEntry],
    serve: &BTreeSet<String>,
    readme: &BTreeSet<String>,
) -> Vec<String> {
    let mut problems = Vec::new();
    let mut owner: BTreeMap<&str, String> = PROCESS_SETTINGS
        .iter()
        .map(|v| (*v, "PROCESS_SETTINGS".to_owned()))
        .collect();
    for e in registry {
        let expected = format!(
            "HARDCOUNT_{}_INTERVAL",
            e.role.as_str().to_ascii_uppercase()
        );
        if e.interval != expected {
            problems.push(format!(
                "{}: interval {} is not {expected}, the name the scheduler refuses a bad interval by",
                e.role, e.interval
            ));
        }
        if e.listens && !serve.contains("HARDCOUNT_LISTEN_URL") {
            problems.push(format!(
                "{} listens, but serve reads no HARDCOUNT_LISTEN_URL",
                e.role
            ));
        }
        for var in std::iter::once(&e.interval).chain(e.settings) {
            if !serve.contains(*var) {
                problems.push(format!(
                    "{}: {var} is not a variable of `hardcount serve` (no clap `env` reads it)",
                    e.role
                ));
            }
            // The intervals are one row of the README's table, HARDCOUNT_<ROLE>_INTERVAL.
            if *var != e.interval && !readme.contains(*var) {
                problems.push(format!(
                    "{}: {var} is not in README.md's environment table",
                    e.role
                ));
            }
            if let Some(first) = owner.insert(var, e.role.to_string()) {
                problems.push(format!(
                    "{var} is listed by {first} and {}: give each variable one owner",
                    e.role
                ));
            }
        }
    }
    for var in serve {
        if !owner.contains_key(var.as_str()) {
            problems.push(format!(
                "`hardcount serve` reads {var}, which no entry in roles.rs (nor PROCESS_SETTINGS) claims"
            ));
        }
    }
    problems
}

/// Fails when an entry names a variable `serve` does not read or README.md does
/// not document, when `serve` reads one no entry claims, or when two entries
/// claim one. Mutations: delete
/// `HARDCOUNT_WEBHOOK_MIN_PORT` from webhook_delivery's entry (tried; and
/// below, every setting of every entry and every entry); rename dunning's
/// interval to `HARDCOUNT_DUNNING_INTERVALS` (tried).
#[test]
fn each_roles_settings_are_variables_serve_reads_and_the_readme_documents() {
    let serve = serve_variables();
    let readme = readme_variables(&read("README.md"));
    assert!(serve.contains("HARDCOUNT_BILLING_INTERVAL"), "{serve:?}");
    assert!(readme.contains("SMTP_URL"), "{readme:?}");
    let check = |r: &[RoleEntry]| settings_problems(r, &serve, &readme);
    assert_eq!(check(REGISTRY), Vec::<String>::new());
    assert_each_is_caught("settings", without_each_entry(REGISTRY), check);
    assert_each_is_caught(
        "settings",
        without_each_item(REGISTRY, |e| &mut e.settings),
        check,
    );
    let mut renamed = REGISTRY.to_vec();
    renamed[1].interval = "HARDCOUNT_DUNNING_INTERVALS";
    assert!(!check(&renamed).is_empty());
}

/// Each entry's interval is the one `settings` applies to that role: a value
/// out of bounds given under it is refused by its name. Fails if `config`
/// reads a role's interval from another field, or not at all. Mutation: map
/// dunning's interval to billing's field in `ServeSettings::interval` (tried).
#[test]
fn each_roles_interval_is_read_for_that_role() {
    let serve = crate::Cli::command()
        .find_subcommand("serve")
        .unwrap()
        .clone();
    for e in REGISTRY {
        let flag = serve
            .get_arguments()
            .find(|a| a.get_env().is_some_and(|v| v == e.interval))
            .and_then(|a| a.get_long())
            .unwrap_or_else(|| panic!("{}: no flag reads {}", e.role, e.interval));
        let cli = crate::Cli::try_parse_from([
            "hardcount",
            "serve",
            "--roles",
            e.role.as_str(),
            &format!("--{flag}"),
            "31d",
        ])
        .unwrap();
        let crate::Command::Serve(settings) = cli.command else {
            unreachable!()
        };
        let refusal = settings
            .config("postgres://x".into(), None)
            .map(|c| format!("accepted: {:?}", c.roles))
            .unwrap_or_else(|e| format!("{e:#}"));
        assert!(
            refusal.contains(e.interval) && refusal.contains("30 days"),
            "{}: 31d under {} gave {refusal}",
            e.role,
            e.interval
        );
    }
}

// --- series -------------------------------------------------------------------

/// The `hardcount_*` series each crate registers: the string literal right
/// after a `.counter(`, `.gauge(` or `.histogram(` call in its `src/`
/// (`leader::Telemetry`'s methods, which every crate registers through).
fn registered_series() -> BTreeMap<String, BTreeSet<String>> {
    let mut found: BTreeMap<String, BTreeSet<String>> = BTreeMap::new();
    let crates = repo_root().join("crates");
    for krate in std::fs::read_dir(&crates).unwrap().flatten() {
        let name = krate.file_name().to_string_lossy().into_owned();
        let mut text = String::new();
        sources(&krate.path().join("src"), &mut text);
        for call in [".counter(", ".gauge(", ".histogram("] {
            for (at, _) in text.match_indices(call) {
                let rest = text[at + call.len()..].trim_start();
                let Some(literal) = rest.strip_prefix('"') else {
                    continue;
                };
                let series = &literal[..literal.find('"').unwrap_or(0)];
                if series.starts_with("hardcount_") {
                    found
                        .entry(series.to_owned())
                        .or_default()
                        .insert(name.clone());
                }
            }
        }
    }
    found
}

fn sources(dir: &Path, out: &mut String) {
    let Ok(entries) = std::fs::read_dir(dir) else {
        return;
    };
    for entry in entries.flatten() {
        let path = entry.path();
        if path.is_dir() {
            sources(&path, out);
        } else if path.extension().is_some_and(|e| e == "rs") {
            out.push_str(&std::fs::read_to_string(&path).unwrap_or_default());
        }
    }
}

fn metric_problems(
    registry: &[RoleEntry],
    registered: &BTreeMap<String, BTreeSet<String>>,
) -> Vec<String> {
    let mut problems = Vec::new();
    let mut claimed: BTreeMap<&str, Vec<String>> = BTreeMap::new();
    for m in EVERY_ROLE_METRICS {
        claimed
            .entry(m)
            .or_default()
            .push("EVERY_ROLE_METRICS".into());
    }
    for e in registry {
        if e.metrics.is_empty() {
            problems.push(format!("{} exports no series of its own", e.role));
        }
        for m in e.metrics {
            claimed.entry(m).or_default().push(e.role.to_string());
        }
    }
    for (series, by) in &claimed {
        if by.len() > 1 {
            problems.push(format!("{series} is claimed by {by:?}; one owner each"));
        }
        if !registered.contains_key(*series) {
            problems.push(format!(
                "{} lists {series}, which no crate registers (no `.counter/.gauge/.histogram(\"{series}\"`)",
                by.join(", ")
            ));
        }
    }
    for (series, crates) in registered {
        if !claimed.contains_key(series.as_str()) {
            problems.push(format!(
                "{crates:?} register {series}, which no entry in roles.rs (nor EVERY_ROLE_METRICS) lists"
            ));
        }
    }
    problems
}

/// Fails when an entry lists a series no crate registers, or a crate registers
/// one no entry lists. Mutations: delete `hardcount_billing_closes_total` from
/// billing's entry (tried; and below, every series of every entry and every
/// entry); list a series nothing registers (below).
#[test]
fn each_roles_series_are_the_ones_its_code_registers() {
    let registered = registered_series();
    assert!(
        registered.contains_key("hardcount_leader_lease_lost_total")
            && registered.contains_key("hardcount_webhook_deliveries_total"),
        "the scan found too little: {registered:?}"
    );
    let check = |r: &[RoleEntry]| metric_problems(r, &registered);
    assert_eq!(check(REGISTRY), Vec::<String>::new());
    assert_each_is_caught("series", without_each_entry(REGISTRY), check);
    assert_each_is_caught(
        "series",
        without_each_item(REGISTRY, |e| &mut e.metrics),
        check,
    );
    let mut stale = REGISTRY.to_vec();
    stale[2].metrics = leak([stale[2].metrics, &["hardcount_webhook_gone_total"]].concat());
    assert!(!check(&stale).is_empty());
}
