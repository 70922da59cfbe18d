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
