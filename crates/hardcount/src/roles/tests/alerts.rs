//! The registry against deploy/prometheus/rules.yml: each role's alerts are
//! the rules on its series.

use std::collections::BTreeSet;

use super::*;

/// One alert of rules.yml: its name and its `expr` text.
struct Rule {
    name: String,
    expr: String,
}

/// The alerts of a rules file (the shape deploy/prometheus/rules.yml has:
/// `- alert: Name`, then `expr:` up to `for:`, `labels:` or `annotations:`).
/// A recorded series (`- record: name`, docs/adr/0137) an alert reads is
/// read through its expression: that text is added to the alert's.
fn rules(text: &str) -> Vec<Rule> {
    let mut out: Vec<Rule> = Vec::new();
    let mut records: Vec<Rule> = Vec::new();
    let mut in_expr = false;
    let mut in_record = false;
    for line in text.lines() {
        let t = line.trim_start();
        if t.starts_with('#') {
            continue;
        }
        let (alert, record) = (t.strip_prefix("- alert:"), t.strip_prefix("- record:"));
        if let Some(name) = alert.or(record) {
            let rule = Rule {
                name: name.trim().to_owned(),
                expr: String::new(),
            };
            in_record = record.is_some();
            if in_record {
                records.push(rule);
            } else {
                out.push(rule);
            }
            in_expr = false;
            continue;
        }
        let current = if in_record {
            records.last_mut()
        } else {
            out.last_mut()
        };
        if let Some(expr) = t.strip_prefix("expr:") {
            in_expr = true;
            if let Some(rule) = current {
                rule.expr.push_str(expr);
            }
        } else if ["for:", "labels:", "annotations:", "- name:"]
            .iter()
            .any(|k| t.starts_with(k))
        {
            in_expr = false;
        } else if in_expr && let Some(rule) = current {
            rule.expr.push('\n');
            rule.expr.push_str(t);
        }
    }
    for rule in &mut out {
        for record in &records {
            if names_series(&rule.expr, &record.name) {
                rule.expr.push('\n');
                rule.expr.push_str(&record.expr);
            }
        }
    }
    out
}

/// Whether `expr` names the series `name` whole (not as a part of a longer
/// name).
fn names_series(expr: &str, name: &str) -> bool {
    let in_name = |c: char| c.is_ascii_alphanumeric() || c == '_' || c == ':';
    expr.match_indices(name).any(|(at, _)| {
        !expr[..at].chars().next_back().is_some_and(in_name)
            && !expr[at + name.len()..].chars().next().is_some_and(in_name)
    })
}

/// The role names an expression's `role="…"` and `role=~"a|b"` matchers name.
fn matched_roles(expr: &str) -> Result<BTreeSet<String>, String> {
    let mut roles = BTreeSet::new();
    for (op, regex) in [("role=\"", false), ("role=~\"", true)] {
        for (at, _) in expr.match_indices(op) {
            let rest = &expr[at + op.len()..];
            let value = &rest[..rest.find('"').ok_or("an unclosed role matcher")?];
            for name in if regex {
                value.split('|').collect()
            } else {
                vec![value]
            } {
                if !name.chars().all(|c| c.is_ascii_lowercase() || c == '_') {
                    return Err(format!(
                        "role matcher {value:?}: write it as a plain name or names joined by |"
                    ));
                }
                roles.insert(name.to_owned());
            }
        }
    }
    Ok(roles)
}

/// Every `hardcount_…` name in `text`, whole (a histogram's `_bucket` kept).
fn metric_names(text: &str) -> BTreeSet<String> {
    let in_name = |c: char| c.is_ascii_alphanumeric() || c == '_' || c == ':';
    let mut names = BTreeSet::new();
    for (at, _) in text.match_indices("hardcount_") {
        if text[..at].chars().next_back().is_some_and(in_name) {
            continue;
        }
        let end = text[at..]
            .find(|c| !in_name(c))
            .map_or(text.len(), |n| at + n);
        names.insert(text[at..end].to_owned());
    }
    names
}

/// The series a name in a rule means: itself, or the histogram whose
/// `_bucket`, `_sum` or `_count` it is.
fn series<'a>(name: &'a str, known: &BTreeSet<&str>) -> &'a str {
    for suffix in ["_bucket", "_sum", "_count"] {
        if let Some(base) = name.strip_suffix(suffix)
            && known.contains(base)
        {
            return base;
        }
    }
    name
}

fn alert_problems(registry: &[RoleEntry], rules_text: &str) -> Vec<String> {
    let rules = rules(rules_text);
    let mut problems = Vec::new();
    let names: BTreeSet<&str> = rules.iter().map(|r| r.name.as_str()).collect();
    let roles: BTreeSet<&str> = registry.iter().map(|e| e.role.as_str()).collect();
    let mut owner: BTreeMap<&str, &str> = BTreeMap::new();
    for e in registry {
        for m in e.metrics {
            owner.insert(m, e.role.as_str());
        }
    }
    let known: BTreeSet<&str> = owner
        .keys()
        .copied()
        .chain(EVERY_ROLE_METRICS.iter().copied())
        .collect();

    for alert in EVERY_ROLE_ALERTS {
        if !names.contains(alert) {
            problems.push(format!("EVERY_ROLE_ALERTS names {alert}, not in rules.yml"));
        }
    }
    for e in registry {
        for alert in e.alerts {
            if !names.contains(alert) {
                problems.push(format!("{}: alert {alert} is not in rules.yml", e.role));
            }
        }
    }
    for rule in &rules {
        let claimed_by: Vec<&str> = registry
            .iter()
            .filter(|e| e.alerts.contains(&rule.name.as_str()))
            .map(|e| e.role.as_str())
            .collect();
        let every_role = EVERY_ROLE_ALERTS.contains(&rule.name.as_str());
        if claimed_by.is_empty() && !every_role {
            problems.push(format!(
                "rules.yml alert {} is claimed by no entry in roles.rs (nor EVERY_ROLE_ALERTS)",
                rule.name
            ));
        }
        // The alert is filed under each role whose series it reads, and reads
        // a series of each role it is filed under.
        let mut reads = BTreeSet::new();
        for name in metric_names(&rule.expr) {
            let s = series(&name, &known);
            match owner.get(s) {
                Some(role) => {
                    reads.insert(*role);
                }
                None if EVERY_ROLE_METRICS.contains(&s) => {}
                None => problems.push(format!(
                    "rules.yml alert {} reads {name}, a series no entry in roles.rs registers",
                    rule.name
                )),
            }
        }
        for role in &reads {
            if !claimed_by.contains(role) {
                problems.push(format!(
                    "rules.yml alert {} reads {role}'s series but is not in {role}'s alerts",
                    rule.name
                ));
            }
        }
        for role in &claimed_by {
            if !reads.contains(role) {
                problems.push(format!(
                    "{role} lists alert {}, which reads none of {role}'s series",
                    rule.name
                ));
            }
        }
        // Role matchers name registered roles, and an every-role alert that
        // names roles names them all (a per-role threshold for each).
        match matched_roles(&rule.expr) {
            Err(e) => problems.push(format!("rules.yml alert {}: {e}", rule.name)),
            Ok(matched) => {
                for name in &matched {
                    if !roles.contains(name.as_str()) {
                        problems.push(format!(
                            "rules.yml alert {} matches role {name}, which has no entry in roles.rs",
                            rule.name
                        ));
                    }
                }
                if every_role && !matched.is_empty() {
                    for role in &roles {
                        if !matched.contains(*role) {
                            problems.push(format!(
                                "rules.yml alert {} names roles but not {role}: give it a threshold for {role}",
                                rule.name
                            ));
                        }
                    }
                }
            }
        }
    }
    problems
}

/// Fails when an entry names an alert rules.yml does not have, when rules.yml
/// has an alert no entry claims or one filed under a role whose series it does
/// not read (or not filed under one it does), or when `HardcountRoleStalled`'s
/// per-role thresholds leave out a registered role or name an unregistered
/// one. Mutations: delete `HardcountEmailsDelayed` from email_outbox's entry
/// (tried; and below, every alert of every entry and every entry); drop
/// `|webhook_delivery` from the stall alert's matcher (below); add `Dunning`'s
/// alert to billing (below).
#[test]
fn each_roles_alerts_are_the_rules_on_its_series() {
    let text = read("deploy/prometheus/rules.yml");
    assert!(
        rules(&text).len() >= 10,
        "rules.yml parsed to too few alerts"
    );
    let check = |r: &[RoleEntry]| alert_problems(r, &text);
    assert_eq!(check(REGISTRY), Vec::<String>::new());
    assert_each_is_caught("alerts", without_each_entry(REGISTRY), check);
    assert_each_is_caught(
        "alerts",
        without_each_item(REGISTRY, |e| &mut e.alerts),
        check,
    );

    let anchor = "email_outbox|webhook_delivery\"";
    assert!(text.contains(anchor), "the stall alert's matcher moved");
    let stall_misses_a_role = text.replace(anchor, "email_outbox\"");
    assert!(!alert_problems(REGISTRY, &stall_misses_a_role).is_empty());
    let misfiled = {
        let mut r = REGISTRY.to_vec();
        r[0].alerts = leak([r[0].alerts, r[1].alerts].concat());
        r
    };
    assert!(!check(&misfiled).is_empty());
}

/// The counters a role makes at their first event, with the outcomes its
/// role exports at 0 from its start (docs/adr/0141).
fn born_at_zero() -> Vec<(&'static str, Vec<&'static str>)> {
    vec![
        (
            "hardcount_emails_total",
            email_outbox::OUTCOMES_ALERTED
                .iter()
                .map(|(outcome, _)| *outcome)
                .collect::<BTreeSet<_>>()
                .into_iter()
                .collect(),
        ),
        (
            "hardcount_dunning_attempts_total",
            dunning::OUTCOMES_ALERTED.to_vec(),
        ),
        (
            "hardcount_webhook_deliveries_total",
            webhook_delivery::OUTCOMES_ALERTED.to_vec(),
        ),
    ]
}

/// Each selector of `counter` in `expr` (`counter{…}`): its `outcome="a"` or
/// `outcome=~"a|b"` values, or an error for a selector with neither.
fn outcomes_selected(expr: &str, counter: &str) -> Result<Vec<String>, String> {
    let mut out = Vec::new();
    for (at, _) in expr.match_indices(counter) {
        let rest = &expr[at + counter.len()..];
        let Some(selector) = rest.strip_prefix('{') else {
            return Err(format!("{counter} read without an outcome matcher"));
        };
        let selector = &selector[..selector.find('}').ok_or("an unclosed selector")?];
        let value = ["outcome=\"", "outcome=~\""].iter().find_map(|op| {
            let from = selector.find(op)? + op.len();
            Some(&selector[from..from + selector[from..].find('"')?])
        });
        let Some(value) = value else {
            return Err(format!("{counter}{{{selector}}} has no outcome matcher"));
        };
        out.extend(value.split('|').map(str::to_owned));
    }
    Ok(out)
}

fn zero_problems(rules_text: &str, exported: &[(&str, Vec<&str>)]) -> Vec<String> {
    let mut problems = Vec::new();
    for rule in rules(rules_text) {
        for (counter, outcomes) in exported {
            match outcomes_selected(&rule.expr, counter) {
                Ok(selected) => problems.extend(
                    selected
                        .iter()
                        .filter(|o| !outcomes.contains(&o.as_str()))
                        .map(|o| {
                            format!(
                                "rules.yml alert {} takes {counter}{{outcome=\"{o}\"}}, which its role does not export at 0",
                                rule.name
                            )
                        }),
                ),
                Err(e) => problems.push(format!("rules.yml alert {}: {e}", rule.name)),
            }
        }
    }
    problems
}

/// An alert's `increase()` of a series that did not exist at the last
/// scrape misses the series' first value: a counter made at its first event
/// had that event unseen, so a new leader's first sends did not hold
/// `HardcountEmailsDelayed` (review of the operators' surface). Each outcome
/// an alert reads of these counters is one its role exports at 0 from its
/// start. Fails with an outcome left out of a role's list (below, each one),
/// and mutations `email_outcomes_not_zeroed`, `dunning_outcomes_not_zeroed`
/// and `delivery_outcomes_not_zeroed` (the role's loop skipped) fail the
/// crates' own tests.
#[test]
fn every_outcome_an_alert_reads_is_exported_at_zero() {
    let text = read("deploy/prometheus/rules.yml");
    let exported = born_at_zero();
    assert_eq!(zero_problems(&text, &exported), Vec::<String>::new());
    let mut alerted = 0;
    for (i, (_, outcomes)) in exported.iter().enumerate() {
        for j in 0..outcomes.len() {
            let mut copy = exported.clone();
            let gone = copy[i].1.remove(j);
            alerted += 1;
            assert!(
                !zero_problems(&text, &copy).is_empty(),
                "{gone} left out of {} went unnoticed",
                exported[i].0
            );
        }
    }
    assert_eq!(alerted, 2 + 5 + 4, "outcomes an alert reads, each checked");
}
