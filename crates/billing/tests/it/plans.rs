//! The charge path's batch statements reach each row of their batch once,
//! by its key, on a table whose statistics know nothing of it (issue 29,
//! point 3; docs/adr/0023): 12,800 invoices claimed by earlier batches of the
//! tick, as in the billing benchmark, and a batch of 256 to write.

use std::time::Duration;

use db::{Row, sql};
use leader::Role;
use testbed::TestDb;
use testbed::plans::{
    INDEX_DRIVEN_SETTINGS, PlansNoticed, assert_planned_with, explain_index_driven,
    explain_index_driven_after, planner_settings,
};

use billing::statements::{
    CLAIM_AND_START, CLAIM_CHARGES, CLAIM_DUE, CLAIM_RETRIES, CLAIM_UNKNOWN, CLEAR_RAW_ANSWERS,
    FREE_STALE_HOLDS, NO_SEQUENTIAL_SCAN, SETTLE, START_ATTEMPTS, START_RETRIES,
    WRITTEN_JOIN_ORDER,
};

use billing::RetryRequest;
use fake_provider::FakeProvider;

use crate::{as_leader, biller, charging, config, due_monthly, manager, open_invoices, tick};

const CLAIMED: i64 = 12_800;
const BATCH: usize = 256;

/// 12,800 open invoices of one subscription, all claimed by `c1`, each with
/// an unknown attempt (and counted so, as `START_ATTEMPTS` counts it); (invoice ids, attempt ids) of the first batch. Written
/// as the owner and never analyzed.
async fn claimed(t: &TestDb) -> (Vec<i64>, Vec<i64>) {
    let sub = due_monthly(&t.db, "tenant_a", 1).await[0];
    let mut su = t.superuser().await;
    sqlx::raw_sql(sqlx::AssertSqlSafe(format!(
        "INSERT INTO invoices (tenant_id, subscription_id, period_start, period_end, amount, \
                               currency, collection_method, status, finalized_at, number, \
                               auto_charge_claimed_until, auto_charge_claimed_by, attempt_count) \
         SELECT 'tenant_a', {sub}, now() - g * interval '1 hour', now() - (g - 1) * interval '1 hour', \
                1200, 'EUR', 'automatic', 'open', now(), 'PLAN-' || lpad(g::text, 6, '0'), \
                now() + interval '5 minutes', 'c1', 1 \
         FROM generate_series(1, {CLAIMED}) g; \
         INSERT INTO payment_attempts (tenant_id, invoice_id, attempt_seq, idempotency_key, \
                                       amount, currency, provider_status) \
         SELECT tenant_id, id, 1, 'plan:' || id, amount, currency, 'unknown' \
         FROM invoices WHERE number LIKE 'PLAN-%'"
    )))
    .execute(&mut su)
    .await
    .unwrap();
    let rows =
        t.db.fetch_all(sql(
            "SELECT i.id AS invoice, a.id AS attempt FROM invoices i \
             JOIN payment_attempts a ON a.invoice_id = i.id \
             WHERE i.number LIKE 'PLAN-%' ORDER BY i.id LIMIT 256",
        ))
        .await
        .unwrap();
    (
        rows.iter().map(|r| r.get("invoice")).collect(),
        rows.iter().map(|r| r.get("attempt")).collect(),
    )
}

/// Statistics gathered while nothing was claimed, as after an analyze at a
/// quiet moment: the invoices of [`claimed`] unclaimed and their attempts
/// settled, both tables analyzed (autovacuum off for them), then claimed and
/// open again. The statistics then estimate one claimed invoice and one open
/// attempt, each partial index of those looking nearly empty.
async fn statistics_without_claims(t: &TestDb) {
    let mut su = t.superuser().await;
    sqlx::raw_sql(
        "ALTER TABLE invoices SET (autovacuum_enabled = false); \
         ALTER TABLE payment_attempts SET (autovacuum_enabled = false); \
         UPDATE invoices SET auto_charge_claimed_until = NULL, auto_charge_claimed_by = NULL \
         WHERE number LIKE 'PLAN-%'; \
         UPDATE payment_attempts SET provider_status = 'succeeded' \
         WHERE idempotency_key LIKE 'plan:%'; \
         ANALYZE invoices; ANALYZE payment_attempts; \
         UPDATE invoices SET auto_charge_claimed_until = now() + interval '5 minutes', \
                             auto_charge_claimed_by = 'c1' \
         WHERE number LIKE 'PLAN-%'; \
         UPDATE payment_attempts SET provider_status = 'unknown' \
         WHERE idempotency_key LIKE 'plan:%'",
    )
    .execute(&mut su)
    .await
    .unwrap();
}

/// The settle's plan for the batch `invoices` / `attempts`, all succeeded.
async fn settle_plan(t: &TestDb, invoices: Vec<i64>, attempts: Vec<i64>) -> String {
    explain_index_driven(&t.db, SETTLE, move |s| {
        s.bind(invoices)
            .bind(vec!["c1".to_owned(); BATCH])
            .bind(attempts)
            .bind(vec!["succeeded".to_owned(); BATCH])
            .bind(vec![None::<String>; BATCH])
            .bind(vec![Some("pi_1".to_owned()); BATCH])
            .bind(vec![None::<String>; BATCH])
            .bind(vec!["{}".to_owned(); BATCH])
            .bind(1.0_f64)
            .bind(vec!["open".to_owned(); BATCH])
    })
    .await
}

/// The attempts insert's plan for the batch `invoices`, second attempts.
async fn attempts_plan(t: &TestDb, invoices: Vec<i64>) -> String {
    explain_index_driven(&t.db, START_ATTEMPTS, move |s| {
        s.bind(invoices)
            .bind(vec![2_i32; BATCH])
            .bind("plan-test")
            .bind(vec!["c1".to_owned(); BATCH])
            .bind(vec!["cus_plan".to_owned(); BATCH])
            .bind(vec!["pm_plan".to_owned(); BATCH])
            .bind(vec!["open".to_owned(); BATCH])
    })
    .await
}

/// Guards: `inv` carrying each row's answer through its `RETURNING`, so that
/// `att` joins only the invoices written, the expected status bound per row
/// (`was`, seen failing as the literal `'open'`: a Seq Scan of `invoices`),
/// and the settings of `begin_index_driven`. Seen failing with `att` joining the unnested batch
/// to `inv` again (a nested loop over the two CTE scans, 65,280 rows filtered
/// for 256: mutation `settle_carried` in scripts/mutation-check) and with the
/// EXPLAIN planned freely (a Bitmap Heap Scan of every claimed invoice).
#[tokio::test]
async fn a_settle_reaches_each_invoice_and_attempt_by_its_key() {
    let t = TestDb::new().await;
    let (invoices, attempts) = claimed(&t).await;
    let plan = settle_plan(&t, invoices, attempts).await;
    for present in [
        "Index Scan using invoices_pkey on invoices i",
        "Index Scan using payment_attempts_pkey on payment_attempts a",
    ] {
        assert!(plan.contains(present), "{present} not in\n{plan}");
    }
    for absent in [
        "invoices_auto_charge_claims",
        "Bitmap",
        "Seq Scan",
        "Join Filter",
    ] {
        assert!(!plan.contains(absent), "{absent} in\n{plan}");
    }
}

/// The settle on statistics gathered while nothing was claimed (a table
/// analyzed before the tick, the usual case): they estimate one claimed
/// invoice and one open attempt, and each matching partial index looked like
/// the cheapest outer side of the nested loop. Guards: the claim's expiry and
/// the attempt's status compared through `coalesce`, so neither partial index
/// serves the settle. Seen failing with the plain comparisons (mutation
/// `settle_coalesce` in scripts/mutation-check): `invoices_auto_charge_claims`
/// and `payment_attempts_open` drove the two nested loops, each joined to the
/// batch by a Join Filter (in the dunning benchmark, 249,500 rows removed for
/// a batch of 500).
#[tokio::test]
async fn a_settle_reaches_its_batch_by_key_when_the_statistics_saw_no_claim() {
    let t = TestDb::new().await;
    let (invoices, attempts) = claimed(&t).await;
    statistics_without_claims(&t).await;
    let plan = settle_plan(&t, invoices, attempts).await;
    for present in [
        "Index Scan using invoices_pkey on invoices i",
        "Index Scan using payment_attempts_pkey on payment_attempts a",
    ] {
        assert!(plan.contains(present), "{present} not in\n{plan}");
    }
    for absent in [
        "invoices_auto_charge_claims",
        "payment_attempts_open",
        "Bitmap",
        "Seq Scan",
        "Join Filter",
    ] {
        assert!(!plan.contains(absent), "{absent} in\n{plan}");
    }
}

/// Guards: the expected status bound per row (`was`) and the settings of
/// `begin_index_driven` (the charge claim's transaction). Seen failing with
/// `i.status = 'open'` written as a literal (a Seq Scan of `invoices` joined
/// to the batch by a filter: mutation `attempts_was` in
/// scripts/mutation-check) and with the EXPLAIN planned freely (the claims
/// index read for every invoice the tick had claimed).
#[tokio::test]
async fn the_attempts_of_a_batch_reach_each_invoice_by_its_key() {
    let t = TestDb::new().await;
    let (invoices, _) = claimed(&t).await;
    let plan = attempts_plan(&t, invoices).await;
    assert!(
        plan.contains("Index Scan using invoices_pkey on invoices i"),
        "{plan}"
    );
    for absent in ["invoices_auto_charge_claims", "Bitmap", "Seq Scan"] {
        assert!(!plan.contains(absent), "{absent} in\n{plan}");
    }
}

/// The attempts insert on statistics gathered while nothing was claimed
/// ([`statistics_without_claims`]). Guard: the claim's expiry compared
/// through `coalesce`. Seen failing with the plain comparison (mutation
/// `attempts_coalesce` in scripts/mutation-check): `invoices_auto_charge_claims`
/// drove the loop with a Join Filter over the batch (in the dunning
/// benchmark, 249,500 rows removed for a batch of 500).
#[tokio::test]
async fn the_attempts_of_a_batch_reach_each_invoice_by_its_key_when_the_statistics_saw_no_claim() {
    let t = TestDb::new().await;
    let (invoices, _) = claimed(&t).await;
    statistics_without_claims(&t).await;
    let plan = attempts_plan(&t, invoices).await;
    assert!(
        plan.contains("Index Scan using invoices_pkey on invoices i"),
        "{plan}"
    );
    for absent in [
        "invoices_auto_charge_claims",
        "Bitmap",
        "Seq Scan",
        "Join Filter",
    ] {
        assert!(!plan.contains(absent), "{absent} in\n{plan}");
    }
}

/// Dunning's retry claim, both statements: the attempts (`START_RETRIES`,
/// after `WRITTEN_JOIN_ORDER`, as `start_retries_in` runs it) and the leases
/// (`CLAIM_RETRIES`), each reaching every invoice of the batch by its key.
/// Guards: the settings of `begin_index_driven` (seen failing with the EXPLAIN
/// planned freely: a Seq Scan of `invoices` hashed against the wanted batch);
/// for the attempts, the status bound per row (seen failing without it: the
/// invoice reached through `invoices_open_automatic`, mutation `retry_was` in
/// scripts/mutation-check; before the LATERAL subquery of docs/adr/0066 the
/// locking loop was also driven from the one subscription, or from a Seq Scan
/// of `invoices`, the batch joined by a Join Filter, which sequential scans
/// turned off had stopped here; that setting changes no plan now and was
/// dropped); for the leases, the holders unnested and joined by
/// key (mutation `claim_retries_key`; the first shape of this change, one
/// statement whose update took each holder from the locking CTE, made the
/// dunning benchmark 15 % slower, docs/adr/0055). That
/// `start_retries_in` runs `WRITTEN_JOIN_ORDER` first (this test runs it
/// itself) is pinned by `the_charge_paths_own_calls_plan_as_their_tests_do`.
#[tokio::test]
async fn a_dunning_retry_claim_reaches_each_invoice_by_its_key() {
    let t = TestDb::new().await;
    let (invoices, _) = claimed(&t).await;
    let attempts = {
        let invoices = invoices.clone();
        explain_index_driven_after(&t.db, Some(WRITTEN_JOIN_ORDER), START_RETRIES, move |s| {
            s.bind(invoices)
                .bind("plan-test")
                .bind(vec!["open".to_owned(); BATCH])
        })
        .await
    };
    let claims = explain_index_driven(&t.db, CLAIM_RETRIES, move |s| {
        s.bind(invoices)
            .bind(vec!["dunning:plan".to_owned(); BATCH])
            .bind(300.0_f64)
    })
    .await;
    assert!(
        attempts.contains("Index Cond: (id = u.invoice_id)"),
        "{attempts}"
    );
    for plan in [attempts, claims] {
        assert!(
            plan.contains("Index Scan using invoices_pkey on invoices i"),
            "{plan}"
        );
        for absent in ["Bitmap", "Seq Scan", "Hash"] {
            assert!(!plan.contains(absent), "{absent} in\n{plan}");
        }
        // The batch (`u`) joined by a filter: each of its rows compared with
        // every invoice read. (The attempts' anti-join may filter an attempt
        // reached by its invoice's key; that reads nothing more.)
        assert!(
            !plan
                .lines()
                .any(|l| l.contains("Join Filter") && l.contains("u.")),
            "{plan}"
        );
    }
}

/// Guard: `i.attempt_count = 0` in the charge funnel, which lets both
/// charge claims walk `invoices_charge_pending` (docs/adr/0050). Beside the
/// 12,800 invoices earlier batches claimed and attempted, 1,000 were never
/// attempted; each claim, run for real as the leader (EXPLAIN ANALYZE, rolled
/// back), reads 256 invoices for its 256 and drops none, and the batch claim
/// (`CLAIM_AND_START`) reaches each invoice it leases by its key. Seen failing
/// with the predicate removed (mutation `charge_pending` in
/// scripts/mutation-check): the claims walk `invoices_open_automatic` and
/// drop the 12,800 by filter.
#[tokio::test]
async fn a_charge_claim_reads_only_invoices_it_can_claim() {
    let t = TestDb::new().await;
    claimed(&t).await;
    let mut su = t.superuser().await;
    sqlx::raw_sql(
        "INSERT INTO invoices (tenant_id, subscription_id, period_start, period_end, amount, \
                               currency, collection_method, status, finalized_at, number) \
         SELECT tenant_id, subscription_id, now() + g * interval '1 hour', \
                now() + (g + 1) * interval '1 hour', 1200, 'EUR', 'automatic', 'open', now(), \
                'NEXT-' || lpad(g::text, 6, '0') \
         FROM (SELECT tenant_id, subscription_id FROM invoices LIMIT 1) s, \
              generate_series(1, 1000) g",
    )
    .execute(&mut su)
    .await
    .unwrap();
    for (name, statement) in [("single", CLAIM_CHARGES), ("batch", CLAIM_AND_START)] {
        let plan = explain_charge_claim(&t, name, statement, 0).await;
        let scan = plan
            .lines()
            .position(|l| l.contains("on invoices i ") && l.contains("invoices_charge_pending"))
            .map(|n| plan.lines().skip(n).take(3).collect::<Vec<_>>().join("\n"))
            .unwrap_or_else(|| panic!("{name}: no scan of invoices_charge_pending in\n{plan}"));
        assert!(
            scan.contains(
                "Index Scan using invoices_charge_pending on invoices i (actual rows=256 loops=1)"
            ),
            "{name}: {scan}\n\nin\n{plan}"
        );
        assert!(
            !scan.contains("Rows Removed"),
            "{name}: {scan}\n\nin\n{plan}"
        );
        assert!(!plan.contains("Seq Scan"), "{name}: {plan}");
        if statement == CLAIM_AND_START {
            // The update's own alias of `invoices` (`i_1`) is Postgres's choice.
            assert!(
                plan.lines().any(
                    |l| l.contains("Index Scan using invoices_pkey on invoices i")
                        && l.contains("(actual rows=1 loops=256)")
                ),
                "{name}: {plan}"
            );
        }
    }
}

/// Guard (issue 29, point 3): the settings the plan tests above apply
/// themselves are the ones the charge path's own calls run with. The plans
/// are those the calls ran, reported by `auto_explain`: the closing's listing
/// (`CLAIM_DUE`) and compare-and-set of a tick invoicing four subscriptions, a tick charging the four
/// invoices, which runs its batch claim (`CLAIM_AND_START`), its settle
/// (`SETTLE`) and its retention's `CLEAR_RAW_ANSWERS` in index-driven
/// transactions (the last without sequential scans), and `Biller::start_retries_in`
/// (in the index-driven transaction dunning opens for it) runs
/// `START_RETRIES` in the written join order without sequential scans, then
/// `CLAIM_RETRIES` with both back at their defaults. Seen failing under each
/// of the mutations `closing_index_driven`, `close_index_driven`, `claim_index_driven`,
/// `settle_index_driven` and `raw_answers_index_driven` (a plain
/// `begin_with_timeout` in `store::claim_due`,
/// `charge::store::claim_and_start`, `batch::settle::settle_once`,
/// `retention`), `raw_answers_seqscan` (the clearing without
/// `NO_SEQUENTIAL_SCAN`), `retry_written_order` (`start_retries_in`
/// without `WRITTEN_JOIN_ORDER`), `retry_order_reset` (without
/// `ANY_JOIN_ORDER`) and `claim_written_order` (the batch claim free to
/// reorder its joins, docs/adr/0065) in scripts/mutation-check.
#[tokio::test]
async fn the_charge_paths_own_calls_plan_as_their_tests_do() {
    let t = TestDb::with_plans_noticed().await;
    let p = FakeProvider::start().await.unwrap();
    let closing = PlansNoticed::start();
    let invoices = open_invoices(&t.db, 4).await;
    assert_planned_with(&closing.plans_of(CLAIM_DUE), &INDEX_DRIVEN_SETTINGS);
    // The closing's compare-and-set (`invoice::close_once`, docs/adr/0060).
    let cas = closing.plans_containing("UPDATE subscriptions s SET current_period_start");
    assert_eq!(cas.len(), 1, "{cas:#?}");
    assert_planned_with(&cas, &INDEX_DRIVEN_SETTINGS);
    drop(closing);
    let month = Duration::from_secs(30 * 86_400);
    let (b, _) = biller(&t.db, charging(&p, Duration::from_secs(5)));
    let b = b.with_retention(scheduler::Retention {
        keep: month,
        lease_history: month,
        every: Duration::ZERO,
        batch: 1000,
    });
    let written_order = ["join_collapse_limit = '1'"];

    // A retry started and rolled back: the invoices stay open and unclaimed.
    let retries = PlansNoticed::start();
    let mut tx =
        t.db.begin_index_driven(Duration::from_secs(5))
            .await
            .unwrap();
    let wanted = [RetryRequest {
        invoice_id: invoices[0].0,
        claimed_by: "plans".to_owned(),
    }];
    let started = b.start_retries_in(&mut tx, &wanted).await.unwrap();
    assert!(started[0].is_ok(), "{:?}", started[0].as_ref().err());
    drop(tx);
    assert_planned_with(
        &[retries.plan_of(START_RETRIES)],
        &[&INDEX_DRIVEN_SETTINGS[..], &written_order].concat(),
    );
    let claim = retries.plan_of(CLAIM_RETRIES);
    let claim = planner_settings(&claim);
    for set in written_order {
        assert!(!claim.contains(set), "{set} still in {claim:?}");
    }
    drop(retries);

    let charges = PlansNoticed::start();
    assert_eq!(tick(&t.db, &b).await.charges.paid, 4);
    assert_planned_with(
        &charges.plans_of(CLAIM_AND_START),
        &[&INDEX_DRIVEN_SETTINGS[..], &["join_collapse_limit = '1'"]].concat(),
    );
    assert_planned_with(&charges.plans_of(SETTLE), &INDEX_DRIVEN_SETTINGS);
    assert_planned_with(
        &charges.plans_of(CLEAR_RAW_ANSWERS),
        &[&INDEX_DRIVEN_SETTINGS[..], &["enable_seqscan = 'off'"]].concat(),
    );
}

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
/// scripts/mutation-check).
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
    for plan in &plans {
        for by_key in [
            "Index Scan using payment_attempts_open on payment_attempts a_1",
            "Index Scan using invoices_pkey on invoices i ",
        ] {
            assert!(plan.contains(by_key), "{by_key} not in\n{plan}");
        }
        for absent in [
            "Seq Scan",
            "Hash Join",
            "Bitmap",
            "Merge Join",
            "Sort Key: a_1",
        ] {
            assert!(!plan.contains(absent), "{absent} in\n{plan}");
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

/// 500 open invoices of a customer whose card was removed stand first in id
/// order, then 1,000 of a customer with one. The batch claim (`CLAIM_AND_START`,
/// run for real as the leader, EXPLAIN ANALYZE, rolled back) started after the
/// last of the 500 (`$8`, as the auto-charge tick passes the last invoice its
/// previous batch claimed; docs/adr/0064) reads its 256 from
/// `invoices_charge_pending`; started from the beginning it reads the 500 as
/// well, as every batch of a tick did before. Seen failing with `i.id > $8`
/// removed from the funnel (mutation `charge_funnel_after`). The tick's
/// advance of the cursor is not pinned here; the multi-batch charge tests pin
/// that it skips no chargeable invoice.
#[tokio::test]
async fn a_batch_claim_walks_on_from_the_last_invoice_claimed() {
    let t = TestDb::new().await;
    let mut su = t.superuser().await;
    sqlx::raw_sql(
        "INSERT INTO plans (tenant_id, name, amount, currency, interval_unit, interval_count) \
           VALUES ('tenant_a', 'Pro', 1200, 'EUR', 'month', 1); \
         INSERT INTO customers (tenant_id, email, provider_customer_id, payment_method_id) \
           VALUES ('tenant_a', 'a@example.org', 'cus_no_card', NULL), \
                  ('tenant_a', 'b@example.org', 'cus_card', 'pm_card_visa'); \
         INSERT INTO subscriptions (tenant_id, customer_id, plan_id, status, billing_anchor, \
                                    current_period_start, current_period_end, next_billing_at) \
           SELECT 'tenant_a', c.id, p.id, 'active', now(), now(), now() + interval '30 days', \
                  now() + interval '30 days' FROM customers c, plans p;",
    )
    .execute(&mut su)
    .await
    .unwrap();
    // The 500 first, by a statement of their own: ids follow the statements.
    for (customer, first, last) in [("cus_no_card", 1, 500), ("cus_card", 501, 1500)] {
        sqlx::query(
            "INSERT INTO invoices (tenant_id, subscription_id, period_start, period_end, amount, \
                                   currency, collection_method, status, finalized_at, number) \
             SELECT 'tenant_a', s.id, now() + g * interval '1 hour', \
                    now() + (g + 1) * interval '1 hour', 1200, 'EUR', 'automatic', 'open', now(), \
                    'N-' || lpad(g::text, 6, '0') \
             FROM generate_series($2::int, $3::int) g \
             JOIN customers c ON c.provider_customer_id = $1 \
             JOIN subscriptions s ON s.customer_id = c.id \
             ORDER BY g",
        )
        .bind(customer)
        .bind(first)
        .bind(last)
        .execute(&mut su)
        .await
        .unwrap();
    }
    let passed_over: i64 = sqlx::query_scalar(
        "SELECT max(i.id) FROM invoices i JOIN subscriptions s ON s.id = i.subscription_id \
         JOIN customers c ON c.id = s.customer_id WHERE c.payment_method_id IS NULL",
    )
    .fetch_one(&mut su)
    .await
    .unwrap();
    for (after, read) in [(passed_over, BATCH), (0, BATCH + 500)] {
        let plan = explain_charge_claim(&t, "cursor", CLAIM_AND_START, after).await;
        let scan = format!(
            "Index Scan using invoices_charge_pending on invoices i (actual rows={read} loops=1)"
        );
        assert!(plan.contains(&scan), "after {after}: no {scan} in\n{plan}");
    }
}

/// The plan of a charge claim (`CLAIM_CHARGES`, or `CLAIM_AND_START` from
/// invoice `after`), run for real as the leader `name` in an index-driven
/// transaction (EXPLAIN ANALYZE, rolled back), `BATCH` at most.
async fn explain_charge_claim(
    t: &TestDb,
    name: &'static str,
    statement: &'static str,
    after: i64,
) -> String {
    let db = t.db.clone();
    as_leader(&manager(&t.db, name), Role::Billing, |tick| async move {
        let text: &'static str =
            format!("EXPLAIN (ANALYZE, COSTS OFF, TIMING OFF) {statement}").leak();
        let mut tx = db
            .begin_index_driven_as_written(Duration::from_secs(5))
            .await
            .unwrap();
        let mut q = sql(text)
            .bind(tick.fence.role_name())
            .bind(tick.fence.token())
            .bind(BATCH as i64)
            .bind(300.0_f64)
            .bind("c2".to_owned());
        if statement == CLAIM_AND_START {
            q = q.bind("plan-test".to_owned()).bind(1_i32).bind(after);
        }
        let rows = tx.fetch_all(q).await.unwrap();
        tx.rollback().await.unwrap();
        rows.iter()
            .map(|r| r.get::<String, _>(0))
            .collect::<Vec<_>>()
            .join("\n")
    })
    .await
}

/// Guard: on tables never analyzed, 1,000 customers each with one open
/// invoice, the batch claim (`CLAIM_AND_START`, in the transaction
/// `claim_and_start` opens: index-driven, joins as written) reaches each
/// invoice's subscription and customer by key, once per invoice. Left free to
/// reorder the joins, the planner joined every customer of the tenant to each
/// invoice and each such pair to the tenant's subscriptions: 255,176 pairs
/// and 31.8 s for one claim on the bed (docs/adr/0065). Seen failing with
/// this test's transaction `begin_index_driven`, free to reorder the joins
/// (the statement timeout of 5 s); that `claim_and_start` opens this
/// transaction is pinned by `the_charge_paths_own_calls_plan_as_their_tests_do`
/// (mutation `claim_written_order`).
#[tokio::test]
async fn the_batch_claim_reaches_each_subscription_and_customer_by_key() {
    let t = TestDb::new().await;
    sqlx::raw_sql(
        "INSERT INTO plans (tenant_id, name, amount, currency, interval_unit, interval_count) \
           VALUES ('tenant_a', 'Pro', 1200, 'EUR', 'month', 1); \
         INSERT INTO customers (tenant_id, email, provider_customer_id, payment_method_id) \
           SELECT 'tenant_a', 'c' || g || '@example.org', 'cus_' || g, 'pm_card_visa' \
           FROM generate_series(1, 1000) g; \
         INSERT INTO subscriptions (tenant_id, customer_id, plan_id, status, billing_anchor, \
                                    current_period_start, current_period_end, next_billing_at) \
           SELECT 'tenant_a', c.id, p.id, 'active', now(), now(), now() + interval '30 days', \
                  now() + interval '30 days' FROM customers c, plans p; \
         INSERT INTO invoices (tenant_id, subscription_id, period_start, period_end, amount, \
                               currency, collection_method, status, finalized_at, number) \
           SELECT 'tenant_a', s.id, now() - interval '30 days', now(), 1200, 'EUR', \
                  'automatic', 'open', now(), 'N-' || lpad(s.id::text, 6, '0') \
           FROM subscriptions s",
    )
    .execute(&mut t.superuser().await)
    .await
    .unwrap();
    let plan = explain_charge_claim(&t, "by-key", CLAIM_AND_START, 0).await;
    for table in ["subscriptions s ", "customers c "] {
        let line = plan
            .lines()
            .find(|l| l.contains(&format!("on {table}")) && l.contains("Index Scan"))
            .unwrap_or_else(|| panic!("no index scan of {table}in\n{plan}"));
        assert!(
            line.contains("(actual rows=1 loops=256)"),
            "{line}\n\nin\n{plan}"
        );
    }
}
