//! Reading what billing recorded of its payment attempts, for the billing and
//! dunning tests.

use db::{Db, Row, sql};

/// The idempotency key attempt `seq` of `invoice` was sent under, as stored
/// (`None`: no such attempt was written).
pub async fn attempt_key(db: &Db, invoice: i64, seq: i32) -> Option<String> {
    db.fetch_optional(
        sql("SELECT idempotency_key FROM payment_attempts WHERE invoice_id = $1 AND attempt_seq = $2")
            .bind(invoice)
            .bind(seq),
    )
    .await
    .expect("reading a payment attempt")
    .map(|r| r.get("idempotency_key"))
}

/// The creation instant of `invoice` in microseconds since the epoch: the part
/// of an attempt's idempotency key that `billing::provider::idempotency_key`
/// takes, so a test can hold the key SQL computed against the documented one.
pub async fn invoice_created_micros(db: &Db, invoice: i64) -> i64 {
    db.fetch_one(
        sql(
            "SELECT (extract(epoch FROM created_at) * 1000000)::bigint FROM invoices WHERE id = $1",
        )
        .bind(invoice),
    )
    .await
    .expect("reading an invoice's creation instant")
    .get(0)
}

/// Give `tenant` the payment page `template` (`tenant_settings.payment_page_url`,
/// docs/adr/0150), as the schema's owner writes it, for the billing and
/// dunning tests of the emails that link it.
pub async fn set_payment_page(t: &crate::TestDb, tenant: &str, template: &str) {
    sqlx::query(
        "INSERT INTO tenant_settings (tenant_id, payment_page_url) VALUES ($1, $2) \
         ON CONFLICT (tenant_id) DO UPDATE SET payment_page_url = EXCLUDED.payment_page_url",
    )
    .bind(tenant)
    .bind(template)
    .execute(&mut t.superuser().await)
    .await
    .expect("setting a tenant's payment page");
}
