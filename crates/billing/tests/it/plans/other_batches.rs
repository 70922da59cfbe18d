//! Billing's batches outside the charge path (docs/adr/0062) read only their
//! batch on tables never analyzed: the retention's clearing of raw answers,
//! the stale-hold sweep, the reconciler's claim of unknown attempts and its
//! look for intents operators settled, and the lifecycle's listings and
//! compare-and-sets.

use std::time::Duration;

use testbed::TestDb;
use testbed::plans::{
    INDEX_DRIVEN_SETTINGS, PlansNoticed, assert_planned_with, explain_index_driven_after,
};

use billing::statements::{
    CLAIM_UNKNOWN, CLEAR_RAW_ANSWERS, FREE_STALE_HOLDS, NO_SEQUENTIAL_SCAN, OPERATOR_SETTLED,
};

use fake_provider::FakeProvider;

use super::claimed;
use crate::{biller, charging, config, due_monthly, tick};

/// Guard: the retention's clearing of old raw answers (`CLEAR_RAW_ANSWERS`)
/// reads the attempts it clears in `payment_attempts_raw_answer_kept`
/// order, the batch and no more, on a table never analyzed: 12,800 attempts
/// resolved between 400 and 397 days ago, one in 64 keeping its answer (an
/// answer is kept only for review). The clearing runs after
/// `NO_SEQUENTIAL_SCAN`, as the role runs it (pinned by
/// `the_charge_paths_own_calls_plan_as_their_tests_do`). Seen failing without
/// it: a Seq Scan of every attempt, estimated at 32 rows, and a Sort, for each
/// batch (this test found it; the statement had no plan test before). And
/// with the statement ordered by `p.id` alone (mutation `raw_answers_order`
/// in scripts/mutation-check).
#[tokio::test]
async fn the_raw_answers_clearing_reads_its_batch_in_index_order() {
    let t = TestDb::new().await;
    claimed(&t).await;
    let mut su = t.superuser().await;
    sqlx::raw_sql(
        "UPDATE payment_attempts SET provider_status = 'succeeded', \
                raw_answer = CASE WHEN id % 64 = 0 THEN 'kept' END, \
                resolved_at = now() - interval '400 days' + id * interval '20 seconds' \
         WHERE idempotency_key LIKE 'plan:%'",
    )
    .execute(&mut su)
    .await
    .unwrap();
    let plan =
        explain_index_driven_after(&t.db, Some(NO_SEQUENTIAL_SCAN), CLEAR_RAW_ANSWERS, |s| {
            s.bind("billing")
                .bind(1_i64)
                .bind(30.0 * 86_400.0_f64)
                .bind(1000_i64)
        })
        .await;
    assert!(
        plan.contains("Index Scan using payment_attempts_raw_answer_kept on payment_attempts p"),
        "{plan}"
    );
    for absent in ["Sort", "Bitmap", "Seq Scan", "Hash"] {
        assert!(!plan.contains(absent), "{absent} in\n{plan}");
    }
}

/// Guard (issue 29, point 3): the stale-hold sweep (`FREE_STALE_HOLDS`), as
/// the role's own tick runs it, reaches the expired claims through
/// `invoices_auto_charge_claims` and frees each by its key, on a table never
/// analyzed: 12,800 claimed invoices, 300 of them expired (a replica that
/// died mid-charge). Without an index-driven transaction it hashed the batch
/// and joined it to a read of every invoice, for each batch of the sweep
/// (this test found it; the statement had no plan test before). The batch's
/// ids are still made distinct by a `HashAggregate`, which reads only them. Seen failing with the sweep in a
/// plain `begin_with_timeout` (mutation `stale_holds_index_driven` in
/// scripts/mutation-check).
#[tokio::test]
async fn the_stale_hold_sweep_frees_its_batch_by_key() {
    let t = TestDb::with_plans_noticed().await;
    claimed(&t).await;
    let mut su = t.superuser().await;
    sqlx::raw_sql(
        "UPDATE invoices SET auto_charge_claimed_until = now() - id * interval '1 second' \
         WHERE id IN (SELECT id FROM invoices WHERE number LIKE 'PLAN-%' ORDER BY id LIMIT 300)",
    )
    .execute(&mut su)
    .await
    .unwrap();
    let (b, _) = biller(&t.db, config());
    let sweep = PlansNoticed::start();
    assert_eq!(tick(&t.db, &b).await.reconciled.holds_freed, 300);
    let plans = sweep.plans_of(FREE_STALE_HOLDS);
    assert!(!plans.is_empty(), "no plan noticed for the sweep");
    assert_planned_with(&plans, &INDEX_DRIVEN_SETTINGS);
    for plan in &plans {
        for by_key in [
            "Index Scan using invoices_auto_charge_claims on invoices",
            "Index Scan using invoices_pkey on invoices ",
        ] {
            assert!(plan.contains(by_key), "{by_key} not in\n{plan}");
        }
        for absent in ["Seq Scan", "Hash Join", "Bitmap"] {
            assert!(!plan.contains(absent), "{absent} in\n{plan}");
        }
    }
}

/// Guard (issue 29, point 3): the reconciler's claim of open attempts
/// (`CLAIM_UNKNOWN`), as the role's own tick runs it, walks
/// `payment_attempts_open` and reaches each attempt's invoice, subscription
/// and customer by key, on tables never analyzed: 12,800 invoices each with
/// an attempt never answered, all but three still claimed by a charge in
/// flight; the three are then sent and paid. Seen failing with the claim in
/// a plain `begin_with_timeout` (this test found it; the statement had no
/// plan test before): a Bitmap Heap Scan of every open attempt and a Sort,
/// for each batch (mutation `unknown_claim_index_driven` in
/// scripts/mutation-check). The one scan allowed is of the tenants' default
/// policies, for the business window of a never-sent retry: one hashed
/// subplan, built once per statement, as dunning's funnel has it
/// (docs/adr/0147).
#[tokio::test]
async fn the_reconcilers_claim_reaches_each_attempts_rows_by_key() {
    let t = TestDb::with_plans_noticed().await;
    let p = FakeProvider::start().await.unwrap();
    claimed(&t).await;
    let mut su = t.superuser().await;
    sqlx::raw_sql(
        "UPDATE invoices SET auto_charge_claimed_until = NULL, auto_charge_claimed_by = NULL \
         WHERE id IN (SELECT id FROM invoices WHERE number LIKE 'PLAN-%' ORDER BY id LIMIT 3)",
    )
    .execute(&mut su)
    .await
    .unwrap();
    let (b, _) = biller(&t.db, charging(&p, Duration::from_secs(5)));
    let sweep = PlansNoticed::start();
    let report = tick(&t.db, &b).await;
    let plans = sweep.plans_of(CLAIM_UNKNOWN);
    assert!(!plans.is_empty(), "no plan noticed for the claim");
    // Its joins as written (docs/adr/0154; mutation `unknown_claim_as_written`).
    assert_planned_with(
        &plans,
        &[&INDEX_DRIVEN_SETTINGS[..], &["join_collapse_limit = '1'"]].concat(),
    );
    for plan in &plans {
        for by_key in [
            "Index Scan using payment_attempts_open on payment_attempts a_1",
            "Index Scan using invoices_pkey on invoices i ",
            "Index Scan using subscriptions_pkey on subscriptions s_1",
            "Index Scan using customers_pkey on customers c_1",
        ] {
            assert!(plan.contains(by_key), "{by_key} not in\n{plan}");
        }
        assert!(plan.contains("NOT (hashed SubPlan"), "{plan}");
        let rest = plan.replace("Seq Scan on dunning_policies w ", "");
        for absent in [
            "Seq Scan",
            "Hash Join",
            "Bitmap",
            "Merge Join",
            "Sort Key: a_1",
        ] {
            assert!(!rest.contains(absent), "{absent} in\n{plan}");
        }
    }
    assert_eq!(report.reconciled.paid, 3, "{report:?}");
}

/// Guard (issue 29, point 3): the lifecycle's fenced listings and
/// compare-and-sets, as the role's own tick runs them, read only their batch
/// on a table never analyzed: 12,800 active subscriptions not due, 300
/// trials ended and 300 collection pauses past their resume time. The
/// listings walk `subscriptions_trial_due` and `subscriptions_pause_resumes`
/// in order; the compare-and-sets reach each listed subscription by its key.
/// This test found them reading more (the statements had no plan test
/// before): in plain transactions (`begin_with_timeout`) the listings sorted
/// what they read, and the trials' compare-and-set, with `s.status =
/// 'trialing'` written as a literal, walked every trial through
/// `subscriptions_trial_due` and ran the whole batch for each. Seen failing
/// under mutations `trials_index_driven`, `trial_cas_index_driven`,
/// `resume_cas_index_driven` (each transaction plain) and
/// `trial_status_per_row` (the literal status) in scripts/mutation-check.
/// The pause listing walked its index in a plain transaction too, on these
/// rows; it runs index-driven like the other three, and only its plan is
/// pinned here.
#[tokio::test]
async fn the_lifecycle_reads_only_its_batches() {
    let t = TestDb::with_plans_noticed().await;
    due_monthly(&t.db, "tenant_a", 1).await;
    let mut su = t.superuser().await;
    sqlx::raw_sql(
        "INSERT INTO subscriptions (tenant_id, customer_id, plan_id, status, billing_anchor, \
                                    current_period_start, current_period_end, next_billing_at, \
                                    trial_end, pause_collection_behavior, \
                                    pause_collection_resumes_at, pause_collection_set_by) \
         SELECT s.tenant_id, s.customer_id, s.plan_id, \
                CASE WHEN g <= 300 THEN 'trialing' ELSE 'active' END, \
                now() - interval '14 days', now() - interval '14 days', \
                CASE WHEN g <= 300 THEN now() - g * interval '1 second' \
                     ELSE now() + interval '16 days' END, \
                CASE WHEN g <= 300 THEN NULL ELSE now() + interval '16 days' END, \
                CASE WHEN g <= 300 THEN now() - g * interval '1 second' END, \
                CASE WHEN g > 300 AND g <= 600 THEN 'keep_as_draft' END, \
                CASE WHEN g > 300 AND g <= 600 THEN now() - g * interval '1 second' END, \
                CASE WHEN g > 300 AND g <= 600 THEN 'api' END \
         FROM (SELECT * FROM subscriptions LIMIT 1) s, generate_series(1, 13400) g",
    )
    .execute(&mut su)
    .await
    .unwrap();
    let (b, _) = biller(&t.db, config());
    let lifecycle = PlansNoticed::start();
    let report = tick(&t.db, &b).await;
    assert_eq!(
        (report.lifecycle.trials_ended, report.lifecycle.resumed),
        (300, 300),
        "{report:?}"
    );
    // A listing walks its index in order; a compare-and-set runs its batch
    // (`i`) and reaches each row by an index condition on its id.
    let walk = |index: &str| format!("Index Scan using {index} on subscriptions s ");
    let by_key = |plan: &str| {
        plan.contains("Function Scan on i ")
            && plan
                .lines()
                .any(|l| l.contains("Index Cond: ") && l.contains("id = i.id)"))
    };
    for (marker, listing) in [
        (
            "WHERE s.status = 'trialing' AND s.trial_end <= now()",
            Some("subscriptions_trial_due"),
        ),
        (
            "WHERE s.pause_collection_resumes_at <= now()",
            Some("subscriptions_pause_resumes"),
        ),
        (
            "SET status = 'active', current_period_start = i.trial_end",
            None,
        ),
        ("SET pause_collection_behavior = NULL", None),
    ] {
        let plans = lifecycle.plans_containing(marker);
        assert!(!plans.is_empty(), "no plan noticed for {marker}");
        for plan in &plans {
            match listing {
                Some(index) => assert!(
                    plan.contains(&walk(index)),
                    "{} not in\n{plan}",
                    walk(index)
                ),
                None => assert!(by_key(plan), "the batch not reached by key in\n{plan}"),
            }
            for absent in ["Seq Scan", "Hash Join", "Bitmap", "Sort"] {
                assert!(!plan.contains(absent), "{absent} in\n{plan}");
            }
        }
    }
}

/// Guard: the reconciler's look for intents an operator's settle already pays
/// (`OPERATOR_SETTLED`, docs/adr/0120) reads at most one attempt per intent,
/// through the unique index of paid intents, on a table never analyzed:
/// 12,800 attempts paid by billing, each with its intent, and 8 settled by
/// an operator. Without `payment_attempts_one_paid_intent` (migration 0052,
/// which dropped 0051's index) it read every attempt: mutation
/// `operator_intent_unindexed`.
#[tokio::test]
async fn the_operator_intent_check_reads_at_most_one_attempt_per_intent() {
    let t = TestDb::new().await;
    claimed(&t).await;
    let mut su = t.superuser().await;
    sqlx::raw_sql(
        "UPDATE payment_attempts SET provider_status = 'succeeded', \
                provider_payment_intent = 'pi_plan' || id, resolved_at = now(), \
                reviewed_at = CASE WHEN id % 1600 = 0 THEN now() END \
         WHERE idempotency_key LIKE 'plan:%'",
    )
    .execute(&mut su)
    .await
    .unwrap();
    let mut tx =
        t.db.begin_with_timeout(Duration::from_secs(5))
            .await
            .unwrap();
    let text: &'static str = format!("EXPLAIN {OPERATOR_SETTLED}").leak();
    let plan: Vec<String> = tx
        .fetch_all(db::sql(text).bind(vec!["pi_plan1".to_owned(), "pi_plan2".to_owned()]))
        .await
        .unwrap()
        .iter()
        .map(|r| db::Row::get::<String, _>(r, 0))
        .collect();
    let plan = plan.join("\n");
    assert!(plan.contains("payment_attempts_one_paid_intent"), "{plan}");
    assert!(!plan.contains("Seq Scan"), "{plan}");
}
