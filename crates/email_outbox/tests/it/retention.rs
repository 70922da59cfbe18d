//! The retention prune of sent and failed emails (docs/adr/0040): old ones
//! go, young and queued ones stay; fenced, bounded, read in index order.

use std::time::Duration;

use db::{Db, Row, sql};
use email_outbox::statements::PRUNE_FINISHED;
use leader::{Fence, Role};
use scheduler::Retention;
use testbed::TestDb;
use testbed::plans::{
    INDEX_DRIVEN_SETTINGS, PlansNoticed, assert_planned_with, explain_index_driven,
};

use crate::{as_leader, config, email, manager, queue, sender, tick};

const MONTH: Duration = Duration::from_secs(30 * 86_400);

async fn owner(t: &TestDb, statement: String) {
    let mut su = t.superuser().await;
    sqlx::raw_sql(sqlx::AssertSqlSafe(statement))
        .execute(&mut su)
        .await
        .unwrap();
}

async fn ids(db: &Db) -> Vec<i64> {
    db.fetch_all(sql("SELECT id FROM email_outbox ORDER BY id"))
        .await
        .unwrap()
        .iter()
        .map(|r| r.get("id"))
        .collect()
}

async fn prune_with(db: &Db, fence: &Fence, limit: i64) -> u64 {
    let mut tx = db.begin_index_driven(Duration::from_secs(5)).await.unwrap();
    let n = tx
        .execute(
            sql(PRUNE_FINISHED)
                .bind(fence.role_name())
                .bind(fence.token())
                .bind(MONTH.as_secs_f64())
                .bind(limit),
        )
        .await
        .unwrap();
    tx.commit().await.unwrap();
    n
}

/// A month's retention, pruned at every tick.
fn every_tick() -> Retention {
    Retention {
        keep: MONTH,
        lease_history: MONTH,
        every: Duration::ZERO,
        batch: 1000,
    }
}

/// Finish `ids` as `status`, their last attempt `days` ago.
async fn finish(t: &TestDb, ids: &[i64], status: &str, days: u32) {
    let list = ids.iter().map(i64::to_string).collect::<Vec<_>>().join(",");
    let sent_at = if status == "sent" { "now()" } else { "NULL" };
    owner(
        t,
        format!(
            "UPDATE email_outbox SET status = '{status}', sent_at = {sent_at}, attempts = 1, \
                    last_attempt_at = now() - interval '{days} days' WHERE id IN ({list})"
        ),
    )
    .await;
}

/// e0 sent and e1 failed 40 days ago go; e2 sent and e4 failed yesterday
/// stay, and so does e3, queued (not due) with an old last attempt.
#[tokio::test]
async fn a_tick_prunes_old_sent_and_failed_emails_and_keeps_the_rest() {
    let t = TestDb::new().await;
    let emails: Vec<_> = (0..5).map(|n| email("a@example.com", n)).collect();
    let e = queue(&t.db, "tenant_a", &emails).await;
    finish(&t, &e[0..1], "sent", 40).await;
    finish(&t, &e[1..2], "failed", 40).await;
    finish(&t, &e[2..3], "sent", 1).await;
    finish(&t, &e[4..5], "failed", 1).await;
    owner(
        &t,
        format!(
            "UPDATE email_outbox SET last_attempt_at = now() - interval '40 days', \
                    next_attempt_at = now() + interval '1 hour' WHERE id = {}",
            e[3]
        ),
    )
    .await;
    // Nothing is due, so no connection is made to this address.
    let (s, metrics) = sender(&t.db, "smtp://127.0.0.1:9", None, config());
    let s = s.with_retention(every_tick());
    let _ = tick(&t.db, &s).await;
    assert_eq!(ids(&t.db).await, vec![e[2], e[3], e[4]]);
    assert!(
        metrics
            .render()
            .lines()
            .any(|l| l == "hardcount_retention_pruned_total{kind=\"emails\"} 2"),
        "{}",
        metrics.render()
    );
}

/// An email refused for its content at enqueue (written `failed`, never
/// attempted) ages from its refusal and goes with the others: one refused 40
/// days ago is pruned, one refused now stays. Before, its `last_attempt_at`
/// stayed NULL, which is never older than the cut: every refused email, with
/// its recipients and bodies, was kept for ever (docs/adr/0100). Mutation
/// `refused_email_unaged` (the insert's stamp removed) fails it; seen failing.
#[tokio::test]
async fn a_refused_email_is_pruned_once_its_refusal_is_old() {
    let t = TestDb::new().await;
    let mut refused = email("a@example.com", 0);
    refused.to = vec!["not an address".into()];
    for _ in 0..2 {
        let mut tx = t.db.begin().await.unwrap();
        email_outbox::enqueue_or_record(&mut tx, "tenant_a", &refused, &leader::Telemetry::noop())
            .await
            .unwrap();
        tx.commit().await.unwrap();
    }
    let e = ids(&t.db).await;
    owner(
        &t,
        format!(
            "UPDATE email_outbox SET created_at = created_at - interval '40 days', \
                    last_attempt_at = last_attempt_at - interval '40 days' WHERE id = {}",
            e[0]
        ),
    )
    .await;
    let (s, _) = sender(&t.db, "smtp://127.0.0.1:9", None, config());
    let s = s.with_retention(every_tick());
    let _ = tick(&t.db, &s).await;
    assert_eq!(ids(&t.db).await, vec![e[1]]);
}

/// An email the claim's ceiling fails ages from then, however old its last
/// claim: due since 40 days (the role down) with every attempt used, under a
/// month's retention, it is failed and still there after the tick that failed
/// it and pruned. Before, its last claim's time stayed its age, and that
/// tick's prune deleted it before anyone could resend it (docs/adr/0100).
/// Mutation `email_exhausted_unaged` (the ceiling's stamp removed) fails it;
/// seen failing.
#[tokio::test]
async fn an_email_failed_by_the_ceiling_is_kept_for_the_retention() {
    let t = TestDb::new().await;
    let e = queue(&t.db, "tenant_a", &[email("a@example.com", 0)]).await;
    owner(
        &t,
        format!(
            "UPDATE email_outbox SET attempts = 100, \
                    last_attempt_at = now() - interval '40 days', \
                    next_attempt_at = now() - interval '40 days' WHERE id = {}",
            e[0]
        ),
    )
    .await;
    let (s, _) = sender(&t.db, "smtp://127.0.0.1:9", None, config());
    let s = s.with_retention(every_tick());
    let _ = tick(&t.db, &s).await;
    let status: Vec<String> =
        t.db.fetch_all(sql("SELECT status FROM email_outbox"))
            .await
            .unwrap()
            .iter()
            .map(|r| r.get("status"))
            .collect();
    assert_eq!(status, ["failed"]);
}

/// Mutation check: removing `AND leader_fence($1, $2)` from PRUNE_FINISHED
/// (`store/prune.rs`) makes the old token delete the three; this test was run
/// against that mutation and failed, then the predicate was restored. The
/// batch bound: a limit of 2 deletes two of the three.
#[tokio::test]
async fn a_stale_token_prunes_no_email_and_a_batch_is_bounded() {
    let t = TestDb::new().await;
    let emails: Vec<_> = (0..3).map(|n| email("a@example.com", n)).collect();
    let e = queue(&t.db, "tenant_a", &emails).await;
    finish(&t, &e, "sent", 40).await;
    let old = as_leader(
        &manager(&t.db, "old"),
        Role::EmailOutbox,
        |tick| async move { tick.fence },
    )
    .await;
    let db = &t.db;
    let (by_old, by_new) = as_leader(
        &manager(&t.db, "new"),
        Role::EmailOutbox,
        |tick| async move {
            assert!(tick.fence.token() > old.token());
            (
                prune_with(db, &old, 100).await,
                prune_with(db, &tick.fence, 2).await,
            )
        },
    )
    .await;
    assert_eq!((by_old, by_new), (0, 2));
    assert_eq!(ids(&t.db).await, vec![e[2]]);
}

/// Guard: `email_outbox_finished (last_attempt_at, id)` (migration 0030).
/// Seen failing with the index keyed on `id` alone instead.
#[tokio::test]
async fn a_prune_reads_its_emails_in_index_order() {
    let t = TestDb::new().await;
    let emails: Vec<_> = (0..1000).map(|n| email("a@example.com", n)).collect();
    queue(&t.db, "tenant_a", &emails).await;
    let plan = explain_index_driven(&t.db, PRUNE_FINISHED, |s| {
        s.bind("email_outbox")
            .bind(1_i64)
            .bind(86_400.0_f64)
            .bind(1000_i64)
    })
    .await;
    assert!(
        plan.contains("Index Scan using email_outbox_finished on email_outbox"),
        "{plan}"
    );
    for absent in ["Sort", "Bitmap", "Seq Scan", "Hash"] {
        assert!(!plan.contains(absent), "{absent} in\n{plan}");
    }
}

/// Guard: the plan above is read under `begin_index_driven`'s settings, which
/// the EXPLAIN applies itself; here a tick's own prune, as `auto_explain`
/// reported it, ran under those settings. The transaction is
/// `scheduler::run_prune_statement`'s, which the webhook roles' prunes share.
/// Seen failing with a plain `begin_with_timeout` there (mutation
/// `prune_index_driven` in scripts/mutation-check).
#[tokio::test]
async fn a_ticks_own_prune_plans_as_this_test_does() {
    let t = TestDb::with_plans_noticed().await;
    let e = queue(&t.db, "tenant_a", &[email("a@example.com", 0)]).await;
    finish(&t, &e, "sent", 40).await;
    // Nothing is due, so no connection is made to this address.
    let (s, _) = sender(&t.db, "smtp://127.0.0.1:9", None, config());
    let s = s.with_retention(every_tick());
    let noticed = PlansNoticed::start();
    let _ = tick(&t.db, &s).await;
    assert_eq!(ids(&t.db).await, Vec::<i64>::new());
    assert_planned_with(&[noticed.plan_of(PRUNE_FINISHED)], &INDEX_DRIVEN_SETTINGS);
}
