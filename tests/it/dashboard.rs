//! `deploy/grafana/dashboards/hardcount.json` against a real `hardcount serve`:
//! every series a panel's query names is one the service exports, and every
//! alert a panel's description names is one `rules.yml` defines.

use std::collections::BTreeSet;
use std::time::{Duration, Instant};

use db::{Db, Row, sql};
use fake_provider::{FakeProvider, TEST_SECRET_KEY};
use testbed::{Leg, TestDb};

use crate::deploy::{exported_series, metric_names, read, repo_root, rust_sources};
use crate::serve::Serve;

const DASHBOARD: &str = "deploy/grafana/dashboards/hardcount.json";

/// What the dashboard must keep showing (issue 25, point 7).
const SHOWN: &[&str] = &[
    "hardcount_leader_last_tick_age_seconds",
    "hardcount_tick_total",
    "hardcount_leader_lease_lost_total",
    "hardcount_webhook_deliveries_pending",
    "hardcount_webhook_oldest_due_age_seconds",
    "hardcount_webhook_deliveries_total",
    "hardcount_webhook_attempt_duration_seconds_bucket",
    "hardcount_emails_total",
    "hardcount_emails_queued",
    "hardcount_billing_due_subscriptions",
    "hardcount_billing_invoices_created_total",
    "hardcount_billing_charges_total",
    "hardcount_billing_payment_attempts_needing_review",
    "hardcount_dunning_attempts_total",
    "hardcount_dunning_active_runs",
    "hardcount_dunning_oldest_due_age_seconds",
];

/// Every `expr` in the dashboard (panels' targets, and any variable's query).
fn queries(value: &serde_json::Value, out: &mut Vec<String>) {
    match value {
        serde_json::Value::Object(map) => {
            for (k, v) in map {
                match (k.as_str(), v) {
                    ("expr" | "query", serde_json::Value::String(q)) => out.push(q.clone()),
                    _ => queries(v, out),
                }
            }
        }
        serde_json::Value::Array(items) => items.iter().for_each(|v| queries(v, out)),
        _ => {}
    }
}

/// The series names a `/metrics` body holds (`name{...} v` or `name v`).
fn served(body: &str) -> BTreeSet<String> {
    body.lines()
        .filter(|l| !l.starts_with('#') && !l.is_empty())
        .map(|l| l.split(['{', ' ']).next().unwrap().to_owned())
        .collect()
}

/// A serve running every role, once each has completed a tick: each series the
/// dashboard queries is in its /metrics, or (a counter whose labels appear only
/// once something is counted: a charge's outcome, a dead delivery) in the role
/// registry and still recorded by name in the code. Alerts named in panel
/// descriptions are the rules' own.
///
/// Catches: a panel on a series renamed or never exported (it draws nothing,
/// silently), a panel naming an alert that was renamed.
///
/// The same serve stamps each role's backlog read
/// (`hardcount_backlog_read_timestamp_seconds{role}`, on the database clock,
/// within the test's own readings of it), which the rules read each backlog
/// alert by (docs/adr/0137). Without the stamp of one role, its alert's rule
/// reads nothing and never fires: mutation `backlog_read_stamped` in
/// scripts/mutation-check drops the email role's call and is seen failing here.
#[tokio::test]
async fn every_dashboard_query_names_a_series_a_real_serve_exports() {
    let root = repo_root();
    let text = read(&root.join(DASHBOARD));
    let dashboard: serde_json::Value = serde_json::from_str(&text).unwrap();
    let mut exprs = Vec::new();
    queries(&dashboard, &mut exprs);
    assert!(exprs.len() > 20, "{DASHBOARD} has {} queries", exprs.len());
    let named: BTreeSet<String> = exprs.iter().flat_map(|q| metric_names(q)).collect();
    for name in SHOWN {
        assert!(named.contains(*name), "{DASHBOARD} no longer shows {name}");
    }

    let t = TestDb::new().await;
    let provider = FakeProvider::start().await.unwrap();
    let url = provider.base_url();
    let started = db_epoch(&t.db).await;
    let serve = Serve::start(
        &t.app_url(Leg::current()),
        &[
            (
                "HARDCOUNT_ROLES",
                "billing,dunning,webhook_outbox,email_outbox,webhook_delivery",
            ),
            ("BILLING_PROVIDER_URL", url.as_str()),
            ("BILLING_PROVIDER_SECRET_KEY", TEST_SECRET_KEY),
        ],
    )
    .await;
    // Each role's gauges are set by its first tick: wait for every role's.
    // webhook_delivery keeps its tick open until its budget (60 s) and sets
    // its gauges as it ends.
    let roles = [
        "billing",
        "dunning",
        "webhook_outbox",
        "email_outbox",
        "webhook_delivery",
    ];
    let deadline = Instant::now() + Duration::from_secs(120);
    let body = loop {
        let (status, body) = serve.get("/metrics").await;
        assert_eq!(status, 200);
        let ticked = |role: &str| {
            body.contains(&format!(
                "hardcount_leader_last_tick_known{{role=\"{role}\"}} 1"
            ))
        };
        let stamped = |role: &str| {
            body.contains(&format!(
                "hardcount_backlog_read_timestamp_seconds{{role=\"{role}\"}}"
            ))
        };
        if roles.iter().all(|r| ticked(r) && stamped(r))
            && body.contains("hardcount_webhook_oldest_due_age_seconds")
        {
            break body;
        }
        assert!(
            Instant::now() < deadline,
            "not every role completed a tick and stamped its backlog read:\n{body}"
        );
        tokio::time::sleep(Duration::from_millis(200)).await;
    };
    let live = served(&body);
    let ended = db_epoch(&t.db).await;
    for role in roles {
        let stamp = format!("hardcount_backlog_read_timestamp_seconds{{role=\"{role}\"}} ");
        let at: f64 = body
            .lines()
            .find_map(|l| l.strip_prefix(stamp.as_str()))
            .unwrap_or_else(|| panic!("no backlog read stamped for {role}:\n{body}"))
            .parse()
            .unwrap();
        assert!(
            (started..=ended).contains(&at),
            "{role}'s backlog read at {at}, not between {started} and {ended}"
        );
    }

    let mut sources = String::new();
    rust_sources(&root.join("crates"), &mut sources);
    let mut registry_only = Vec::new();
    for name in &named {
        if live.contains(name) {
            continue;
        }
        let series = exported_series(name).unwrap_or_else(|| {
            panic!(
                "{DASHBOARD} queries {name}, which hardcount does not export; /metrics has {live:?}"
            )
        });
        assert!(
            sources.contains(&format!("\"{series}\"")),
            "{DASHBOARD} queries {series}, but no crate records a metric by that name any more"
        );
        registry_only.push(name.as_str());
    }
    println!(
        "{} series checked in /metrics, {} only in the registry: {registry_only:?}",
        named.len() - registry_only.len(),
        registry_only.len()
    );

    let rules = read(&root.join("deploy/prometheus/rules.yml"));
    let alerts: BTreeSet<&str> = rules
        .lines()
        .filter_map(|l| l.trim().strip_prefix("- alert: "))
        .collect();
    let mut rest = text.as_str();
    while let Some(at) = rest.find("Hardcount") {
        let name: String = rest[at..]
            .chars()
            .take_while(|c| c.is_ascii_alphanumeric())
            .collect();
        assert!(
            alerts.contains(name.as_str()),
            "{DASHBOARD} names the alert {name}, which rules.yml does not define"
        );
        rest = &rest[at + name.len()..];
    }
    drop(serve);
}

/// The database clock, in epoch seconds.
async fn db_epoch(db: &Db) -> f64 {
    db.fetch_one(sql("SELECT extract(epoch FROM now())::float8 AS now"))
        .await
        .unwrap()
        .get("now")
}
