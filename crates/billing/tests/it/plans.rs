//! The charge path's batch statements reach each row of their batch once,
//! by its key, on a table whose statistics know nothing of it (issue 29,
//! point 3; docs/adr/0023): 12,800 invoices claimed by earlier batches of the
//! tick, as in the billing benchmark, and a batch of 256 to write. Here those
//! invoices ([`claimed`]); the tests in the modules below: the batch writes,
//! the claims, the charge path's own calls, and billing's other batches.

mod claims;
mod other_batches;
mod own_calls;
mod writes;

use db::{Row, sql};
use testbed::TestDb;

use crate::due_monthly;

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
