//! The claim and the result statement reach their rows through keys and
//! ordered indexes on a table whose statistics know nothing of its backlog
//! (docs/adr/0023): work per batch, not per queued email. The table is never
//! analyzed, as in a fresh database or after a burst; the plans are read with
//! EXPLAIN inside the kind of transaction the role uses, on the role's own
//! statement texts.

use email_outbox::statements::{CLAIM_DUE, RECORD_RESULTS};
use testbed::plans::{
    INDEX_DRIVEN_SETTINGS, PlansNoticed, assert_planned_with, explain_index_driven,
};
use testbed::{SmtpSink, TestDb};

use crate::{config, email, queue, sender, tick};

/// 1,000 emails queued in one transaction: they share one `next_attempt_at`.
async fn backlog(t: &TestDb) -> Vec<i64> {
    let emails: Vec<_> = (0..1000).map(|n| email("a@example.com", n)).collect();
    queue(&t.db, "tenant_a", &emails).await
}

/// Guard: the due index's key `(next_attempt_at, id)` (migration 0018; led by
/// `tenant_id` since migration 0036, docs/adr/0048). Seen
/// failing with the index on `next_attempt_at` alone (a Sort of the whole
/// producer batch). With `begin_with_timeout` in the EXPLAIN's transaction this
/// claim's plan held here; the result test below is the one that pins the
/// settings.
#[tokio::test]
async fn a_claim_reads_its_batch_in_index_order_and_sorts_nothing() {
    let t = TestDb::new().await;
    backlog(&t).await;
    let plan = explain_index_driven(&t.db, CLAIM_DUE, |s| {
        s.bind("email_outbox")
            .bind(1_i64)
            .bind(50_i64)
            .bind(30.0_f64)
            .bind("")
            .bind(50_i64)
            .bind(6_i32)
    })
    .await;
    assert!(
        plan.contains("Index Scan using email_outbox_due on email_outbox"),
        "{plan}"
    );
    for absent in ["Sort", "Bitmap", "Seq Scan on email_outbox", "Hash"] {
        assert!(!plan.contains(absent), "{absent} in\n{plan}");
    }
}

/// Guards: the compare-and-set's expected status bound per row (`was`), not
/// written as a literal, and the planner settings of `begin_index_driven`. Seen
/// failing with `m.status = 'queued'` in the statement and with
/// `begin_with_timeout` in the EXPLAIN's transaction (the queued emails scanned
/// through `email_outbox_due` for the group).
#[tokio::test]
async fn a_group_of_results_finds_each_email_by_its_key() {
    let t = TestDb::new().await;
    let ids = backlog(&t).await;
    let group: Vec<i64> = ids.iter().copied().step_by(5).take(100).collect();
    let n = group.len();
    let plan = explain_index_driven(&t.db, RECORD_RESULTS, move |s| {
        s.bind(group)
            .bind(vec![1_i32; n])
            .bind(vec!["sent".to_owned(); n])
            .bind(vec![0.0_f64; n])
            .bind(vec![Some(250_i32); n])
            .bind(vec!["ok".to_owned(); n])
            .bind(vec!["queued".to_owned(); n])
    })
    .await;
    assert!(
        plan.contains("Index Scan using email_outbox_pkey on email_outbox m"),
        "{plan}"
    );
    for absent in [
        "email_outbox_due",
        "Bitmap",
        "Hash",
        "Materialize",
        "Seq Scan on email_outbox",
    ] {
        assert!(!plan.contains(absent), "{absent} in\n{plan}");
    }
}

/// Guard: the plans above are read under `begin_index_driven`'s settings,
/// which the EXPLAIN applies itself; here a tick's own claim and results
/// (three emails to the SMTP sink), as `auto_explain` reported them, ran
/// under those settings. Seen failing with a plain `begin_with_timeout` in
/// `store::claim` or in `store::results::record_results` (mutations
/// `email_claim_index_driven` and `email_results_index_driven` in
/// scripts/mutation-check).
#[tokio::test]
async fn a_ticks_own_claim_and_results_plan_as_these_tests_do() {
    let t = TestDb::with_plans_noticed().await;
    let sink = SmtpSink::start();
    let emails: Vec<_> = (0..3).map(|n| email("a@example.com", n)).collect();
    queue(&t.db, "tenant_a", &emails).await;
    let (s, _) = sender(&t.db, &sink.url(), None, config());
    let noticed = PlansNoticed::start();
    let (_, report) = tick(&t.db, &s).await;
    for statement in [CLAIM_DUE, RECORD_RESULTS] {
        let plans = noticed.plans_of(statement);
        assert!(
            !plans.is_empty(),
            "no plan of {statement:?} in a tick: {report:?}"
        );
        assert_planned_with(&plans, &INDEX_DRIVEN_SETTINGS);
    }
}
