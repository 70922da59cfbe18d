//! The drain: a subscription whose closing panics is left out, every other due
//! subscription is billed in the same tick, and the tick ends as panicked.

use std::panic::AssertUnwindSafe;
use std::sync::Arc;
use std::time::Duration;

use chrono::{TimeZone, Utc};
use futures::FutureExt;
use leader::{Manager, Role, Telemetry};
use metrics_exporter_prometheus::PrometheusBuilder;
use testbed::TestDb;
use testbed::leadership::fast_timing;
use tokio_util::sync::CancellationToken;

use crate::{biller, config, due_monthly, finalized, invoices, plan, subscription};

/// Five due subscriptions and one whose next period cannot be computed (its
/// plan's interval unit is one the schema refuses today, written before the
/// CHECK existed), in batches of two so the bad row would fill one batch
/// after another if it were not left out. The five are billed, the bad row is
/// untouched, the tick's panic reaches the lease manager, which counts it as
/// `reason="panicked"` and does not stamp a completed tick.
///
/// Mutation check: making `Panics::finish` drop the payload
/// (`finish_swallows`, already in the list) makes the tick a completion.
#[tokio::test]
async fn a_subscription_whose_closing_panics_is_left_out_and_the_others_are_billed() {
    scheduler::install_panic_hook();
    let t = TestDb::new().await;
    let good = due_monthly(&t.db, "tenant_a", 5).await;
    let corrupt = plan(&t.db, "tenant_a", "year", 1, 100).await;
    let start = Utc.with_ymd_and_hms(2024, 1, 1, 0, 0, 0).unwrap();
    let bad = subscription(
        &t.db,
        "tenant_a",
        corrupt,
        start,
        start,
        start + chrono::TimeDelta::days(1),
    )
    .await;
    let mut su = t.superuser().await;
    sqlx::raw_sql(
        "ALTER TABLE plans DROP CONSTRAINT plans_interval_unit_known; \
         UPDATE plans SET interval_unit = 'fortnight' WHERE name = 'Pro' AND amount = 100",
    )
    .execute(&mut su)
    .await
    .unwrap();
    // Due now, oldest of all, so it is listed first in every batch it can be.
    sqlx::query(
        "UPDATE subscriptions SET next_billing_at = now() - interval '1 day' WHERE id = $1",
    )
    .bind(bad)
    .execute(&mut su)
    .await
    .unwrap();
    let (b, _) = biller(
        &t.db,
        billing::BillingConfig {
            batch_size: 2,
            ..config()
        },
    );
    let recorder = PrometheusBuilder::new().build_recorder();
    let metrics = recorder.handle();
    let m = Manager::with_holder_id(
        t.db.clone(),
        fast_timing(),
        Telemetry::new(Arc::new(recorder)),
        "panicky:1:00000000".to_owned(),
    );
    let shutdown = CancellationToken::new();
    let report = Arc::new(std::sync::Mutex::new(None));
    let slot = report.clone();
    let led = AssertUnwindSafe(m.lead(
        Role::Billing,
        Duration::ZERO,
        &shutdown,
        |tick| async move {
            let r = b.run_tick(&tick).await;
            *slot.lock().unwrap() = Some(r.tally.clone());
            r.end
        },
    ))
    .catch_unwind()
    .await;
    let payload = led.expect_err("the tick's panic reaches the lease manager");
    let message = scheduler::panic_message(&*payload);
    assert!(
        message.contains(&format!("subscription {bad}")),
        "{message}"
    );
    // The tick panicked at its end, after the log line, so no report came back;
    // what it billed is in the database.
    assert!(report.lock().unwrap().is_none());
    let inv = invoices(&t.db).await;
    let billed: Vec<i64> = inv.iter().map(|i| i.subscription).collect();
    assert_eq!(billed, good);
    assert_eq!(finalized(&t.db).await.len(), 5);
    let rendered = metrics.render();
    assert!(
        rendered.lines().any(|l| l.starts_with(
            "hardcount_leader_lease_lost_total{role=\"billing\",reason=\"panicked\"}"
        ) && l.ends_with(" 1")),
        "{rendered}"
    );
    let completed: bool =
        t.db.fetch_one(db::sql(
            "SELECT last_tick_ended_at IS NOT NULL AS c FROM leader_leases WHERE role = 'billing'",
        ))
        .await
        .map(|r| db::Row::get(&r, "c"))
        .unwrap();
    assert!(!completed, "a panicked tick is not a completion");
}
