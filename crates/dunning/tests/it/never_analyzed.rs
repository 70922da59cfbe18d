//! A dunning tick's batch statements on tables never analyzed (docs/adr/0066),
//! as a first import or a restore leaves them: the plans the role's own calls
//! ran, reported by `auto_explain`.

use std::time::Duration;

use billing::statements::START_RETRIES;
use db::{Row, sql};
use fake_provider::Behaviour;
use testbed::TestDb;
use testbed::plans::{PlansNoticed, keep_tables_unanalyzed, tables_analyzed};

use crate::{dunner, tick};

/// Runs seeded, as the dunning benchmark seeds them: 1,000 is a size at which
/// the planner, without statistics, judged the active runs and the open
/// invoices to be a few (docs/adr/0066 measured 130 ms a batch here, 0.8 to
/// 1.2 s at 10,000; at 100,000 it guessed well).
const RUNS: i64 = 1_000;

/// One tenant and `RUNS` customers, each with a subscription, an open
/// automatic invoice whose one attempt was declined an hour ago, and an
/// active run due a minute ago. Customer `cus_na_{g}`: g ≤ 400 will recover,
/// g ≤ 800 are at retry 1 of a policy whose retry 2 is a day away, the rest
/// at the last retry of a two-retry policy. Autovacuum is off on every table
/// first, so nothing is analyzed.
async fn seed(t: &TestDb) {
    let mut su = t.superuser().await;
    keep_tables_unanalyzed(&mut su).await.unwrap();
    let statements = [
        "INSERT INTO dunning_policies (tenant_id, name, retry_offsets_secs, final_action, \
                                       warn_after, is_default) \
         VALUES ('tenant_a', 'Two', '{60, 120}', 'pause_collection', '{1}', true), \
                ('tenant_a', 'A day apart', '{60, 86400}', 'pause_collection', '{1}', false)",
        "INSERT INTO plans (tenant_id, name, amount, currency, interval_unit, interval_count) \
         VALUES ('tenant_a', 'Pro', 1200, 'EUR', 'month', 1)",
        "INSERT INTO customers (tenant_id, email, provider_customer_id, payment_method_id) \
         SELECT 'tenant_a', 'c' || g || '@example.org', 'cus_na_' || g, 'pm_card_visa' \
         FROM generate_series(1, $1) g",
        "INSERT INTO subscriptions (tenant_id, customer_id, plan_id, status, billing_anchor, \
                                    current_period_start, current_period_end, next_billing_at) \
         SELECT 'tenant_a', c.id, p.id, 'active', now(), now(), now() + interval '30 days', \
                now() + interval '30 days' FROM customers c, plans p",
        "INSERT INTO invoices (tenant_id, subscription_id, period_start, period_end, amount, \
                               currency, collection_method, attempt_count) \
         SELECT 'tenant_a', id, now() - interval '30 days', now(), 1200, 'EUR', 'automatic', 1 \
         FROM subscriptions",
        "INSERT INTO payment_attempts (tenant_id, invoice_id, attempt_seq, idempotency_key, \
                                       amount, currency, provider_status, decline_code, \
                                       resolved_at) \
         SELECT 'tenant_a', id, 1, 'hardcount-invoice-' || id || '-attempt-1', 1200, 'EUR', \
                'declined', 'insufficient_funds', now() - interval '1 hour' FROM invoices",
        "INSERT INTO dunning_runs (tenant_id, invoice_id, policy_id, attempt_count, \
                                   first_declined_at, next_attempt_at) \
         SELECT 'tenant_a', i.id, p.id, CASE WHEN g.n > 800 THEN 1 ELSE 0 END, \
                now() - interval '1 hour', now() - interval '1 minute' \
         FROM invoices i \
         JOIN subscriptions s ON s.id = i.subscription_id \
         JOIN customers c ON c.id = s.customer_id \
         CROSS JOIN LATERAL (SELECT substr(c.provider_customer_id, 8)::bigint AS n) g \
         JOIN dunning_policies p ON p.is_default = NOT (g.n > 400 AND g.n <= 800)",
    ];
    for s in statements {
        sqlx::query(s).bind(RUNS).execute(&mut su).await.unwrap();
    }
}

/// Guard (issue 29, point 3): each of a tick's batch statements that joins
/// its batch to a table reaches each row of the table by its key, driven
/// from the batch, on tables never analyzed: the retry claim's locking read
/// (billing's `START_RETRIES`), the attempt compare-and-set, and the
/// recovered, declined and exhausted outcomes. Seen failing with each written
/// as one join of the batch to its table (`UPDATE dunning_runs r … FROM
/// unnest(…) u WHERE r.id = u.id AND r.status = 'active' …`, and the retry
/// claim's batch joined to `invoices`), as before docs/adr/0066: the planner
/// drove every one of them from the table (`dunning_runs_due`, or a whole
/// index of `invoices`) and joined the batch by a Join Filter, all 1,000 rows
/// read for each row of a batch of 500 (mutation `held_runs_lateral` in
/// scripts/mutation-check, which restores the join for the attempt
/// compare-and-set alone, and the whole shape checked by hand on this
/// change's parent).
#[tokio::test]
async fn a_ticks_batch_writes_reach_each_row_by_key_on_tables_never_analyzed() {
    let t = TestDb::with_plans_noticed().await;
    let p = fake_provider::FakeProvider::start().await.unwrap();
    seed(&t).await;
    for g in 401..=RUNS {
        p.set_behaviour(
            &format!("cus_na_{g}"),
            Behaviour::Decline("insufficient_funds".into()),
        );
    }
    let (d, _) = dunner(&t.db, &p, Duration::from_secs(5), crate::config());
    let noticed = PlansNoticed::start();
    let report = tick(&t.db, &d).await;
    let outcome =
        t.db.fetch_one(sql(
            "SELECT count(*) FILTER (WHERE status = 'recovered') AS recovered, \
                    count(*) FILTER (WHERE status = 'active' AND attempt_count = 1) AS declined, \
                    count(*) FILTER (WHERE status = 'exhausted') AS exhausted \
             FROM dunning_runs",
        ))
        .await
        .unwrap();
    let got = |c: &str| outcome.get::<i64, _>(c);
    assert_eq!(
        (got("recovered"), got("declined"), got("exhausted")),
        (400, 400, 200),
        "{report:?}"
    );
    let analyzed = tables_analyzed(&mut t.superuser().await).await.unwrap();
    assert!(
        analyzed.is_empty(),
        "analyzed during the test: {analyzed:?}"
    );
    for (statement, plans, key) in [
        (
            "the retry claim",
            noticed.plans_of(START_RETRIES),
            "Index Cond: (id = u.invoice_id)",
        ),
        (
            "the attempt compare-and-set",
            noticed.plans_containing("SET attempt_count = r.attempt_count + 1"),
            "Index Cond: (id = u.id)",
        ),
        (
            "the recovered outcome",
            noticed.plans_containing("SET status = 'recovered'"),
            "Index Cond: (id = u.id)",
        ),
        (
            "the declined outcome",
            noticed.plans_containing("SET next_attempt_at = u.next"),
            "Index Cond: (id = u.id)",
        ),
        (
            "the exhausted outcome",
            noticed.plans_containing("SET status = 'exhausted'"),
            "Index Cond: (id = u.id)",
        ),
    ] {
        assert!(!plans.is_empty(), "{statement}: no plan noticed");
        for plan in plans {
            assert!(plan.contains(key), "{statement}:\n{plan}");
            assert!(
                !plan
                    .lines()
                    .any(|l| l.contains("Join Filter") && l.contains("u.")),
                "{statement}: the batch joined by a filter\n{plan}"
            );
        }
    }
}
