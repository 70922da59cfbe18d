//! The claims: dunning's retry claim reaches each invoice by its key; the
//! charge claims (`CLAIM_CHARGES`, and the batch claim `CLAIM_AND_START`) read
//! only invoices they can claim, the batch claim walking on from the last
//! invoice claimed and reaching each subscription and customer by key.

use std::time::Duration;

use db::{Row, sql};
use leader::Role;
use testbed::TestDb;
use testbed::plans::{explain_index_driven, explain_index_driven_after};

use billing::statements::{
    CLAIM_AND_START, CLAIM_CHARGES, CLAIM_RETRIES, START_RETRIES, WRITTEN_JOIN_ORDER,
};

use super::{BATCH, claimed};
use crate::{as_leader, manager};

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
