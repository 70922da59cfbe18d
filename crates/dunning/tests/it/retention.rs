//! Retention (docs/adr/0040) as the money roles run it: billing clears the
//! raw provider answers of attempts resolved long ago, each role deletes its
//! own old lease terms, and no invoice, payment attempt or dunning run is
//! ever deleted, however old.

use std::time::Duration;

use billing::{Biller, BillingConfig};
use db::{Row, sql};
use leader::{Role, Telemetry};
use scheduler::Retention;
use testbed::TestDb;

use crate::{as_leader, config, declined_invoice, dunner_with, enrol, manager, tick};

const MONTH: Duration = Duration::from_secs(30 * 86_400);

fn retention() -> Retention {
    Retention {
        keep: MONTH,
        lease_history: MONTH,
        every: Duration::ZERO,
        batch: 1000,
    }
}

async fn owner(t: &TestDb, statement: &str) {
    let mut su = t.superuser().await;
    sqlx::raw_sql(sqlx::AssertSqlSafe(statement.to_owned()))
        .execute(&mut su)
        .await
        .unwrap();
}

async fn count(t: &TestDb, query: &'static str) -> i64 {
    let mut su = t.superuser().await;
    let row = sqlx::query(query).fetch_one(&mut su).await.unwrap();
    sqlx::Row::get(&row, 0)
}

/// Two declined invoices with runs, everything about them a year old, one
/// attempt's raw answer resolved a year ago and one resolved yesterday; old
/// lease terms of billing and dunning and a young one of dunning. Dunning's
/// prune takes only its own old term; billing's clears only the old raw
/// answer and its own old term. Every invoice, attempt and run is still
/// there, with its amounts and statuses.
#[tokio::test]
async fn money_rows_survive_every_prune_and_only_old_logs_and_terms_go() {
    let t = TestDb::new().await;
    let a = declined_invoice(&t.db, "tenant_a").await;
    let b = declined_invoice(&t.db, "tenant_a").await;
    let (d, _) = dunner_with(&t.db, BillingConfig::default(), config());
    assert_eq!(enrol(&t.db, &d).await, 2);
    owner(
        &t,
        &format!(
            "UPDATE invoices SET created_at = now() - interval '400 days'; \
             UPDATE dunning_runs SET first_declined_at = now() - interval '400 days'; \
             UPDATE payment_attempts SET created_at = now() - interval '400 days', \
                    resolved_at = now() - interval '400 days', raw_answer = 'old answer' \
             WHERE invoice_id = {}; \
             UPDATE payment_attempts SET created_at = now() - interval '400 days', \
                    resolved_at = now() - interval '1 day', raw_answer = 'young answer' \
             WHERE invoice_id = {}; \
             INSERT INTO leader_terms (role, token, holder_id, acquired_at, expires_at, released_at, tick_end) \
             VALUES ('billing', -1, 'gone', now() - interval '400 days', now() - interval '400 days', \
                     now() - interval '400 days', 'completed'), \
                    ('dunning', -1, 'gone', now() - interval '400 days', now() - interval '400 days', \
                     now() - interval '400 days', 'completed'), \
                    ('dunning', -2, 'kept', now() - interval '1 day', now() - interval '1 day', \
                     now() - interval '1 day', 'completed')",
            a.invoice, b.invoice
        ),
    )
    .await;
    let money = "SELECT (SELECT count(*) FROM invoices) * 10000 \
                      + (SELECT count(*) FROM payment_attempts) * 100 \
                      + (SELECT count(*) FROM dunning_runs)";
    assert_eq!(count(&t, money).await, 20202);

    let (d, _) = dunner_with(&t.db, BillingConfig::default(), config());
    tick(&t.db, &d.with_retention(retention())).await;
    let terms = "SELECT string_agg(role || token, ',' ORDER BY role, token) FROM leader_terms WHERE token < 0";
    let mut su = t.superuser().await;
    let left: String = sqlx::Row::get(&sqlx::query(terms).fetch_one(&mut su).await.unwrap(), 0);
    assert_eq!(left, "billing-1,dunning-2");

    let biller = Biller::new(t.db.clone(), BillingConfig::default(), Telemetry::noop())
        .unwrap()
        .with_retention(retention());
    as_leader(
        &manager(&t.db, "biller"),
        Role::Billing,
        |tick| async move { biller.run_tick(&tick).await },
    )
    .await;
    let left: String = sqlx::Row::get(&sqlx::query(terms).fetch_one(&mut su).await.unwrap(), 0);
    assert_eq!(left, "dunning-2");
    let answers: Vec<Option<String>> =
        t.db.fetch_all(sql(
            "SELECT raw_answer FROM payment_attempts ORDER BY invoice_id",
        ))
        .await
        .unwrap()
        .iter()
        .map(|r| r.get("raw_answer"))
        .collect();
    assert_eq!(answers, vec![None, Some("young answer".to_owned())]);
    assert_eq!(count(&t, money).await, 20202);
    assert_eq!(
        count(
            &t,
            "SELECT count(*) FROM payment_attempts \
             WHERE provider_status = 'declined' AND amount = 1200 AND resolved_at IS NOT NULL"
        )
        .await,
        2
    );
}
