//! The step that asks for a payment method: an open automatic invoice whose
//! customer has none (and whose collection is not paused) gets one "please
//! add a payment method" email and `invoice.payment_action_required`, once,
//! by a marker written in the same transaction (docs/adr/0025).
//!
//! ```text
//!  one transaction per batch:
//!    UPDATE invoices SET action_required_at = now()
//!      WHERE id IN (open, automatic, action_required_at IS NULL, not paused,
//!                   customer without payment_method_id, AND leader_fence
//!                   FOR UPDATE OF i SKIP LOCKED)           (fenced)
//!      the marker is the compare-and-set: a row locked after another
//!      transaction marked it is re-checked against the marked version and
//!      left out
//!    + invoice.payment_action_required and the email of each row marked
//!  COMMIT
//! ```
//!
//! Auto-charge takes the invoice once a payment method is saved (it never
//! had an attempt); the marker is not cleared, so the customer is asked once
//! per invoice.

use std::time::{Duration, Instant};

use db::{Db, Row, sql};
use leader::{Fence, Role, Tick};
use scheduler::{FencedBatches, Panics, Shape};

use crate::money::money;
use crate::{Biller, Error};

/// What the step came to over a tick.
#[derive(Debug, Default, Clone, PartialEq, Eq)]
pub struct AskTally {
    /// Invoices whose customer was asked for a payment method.
    pub asked: usize,
}

/// The step as the driver sees it.
pub(crate) struct ActionRequired<'a> {
    pub biller: &'a Biller,
}

impl FencedBatches for ActionRequired<'_> {
    type Claim = usize;
    type Counts = AskTally;
    type Error = Error;

    fn role(&self) -> Role {
        Role::Billing
    }

    fn shape(&self) -> Shape {
        let c = &self.biller.inner.config;
        Shape {
            batch_size: c.batch_size,
            budget: c.tick_budget,
            reserve: Duration::ZERO,
        }
    }

    async fn claim(&self, fence: &Fence, limit: usize) -> Result<usize, Error> {
        let b = &self.biller.inner;
        ask(
            &b.db,
            fence,
            limit,
            &b.config.email_from,
            &b.telemetry,
            b.config.statement_timeout,
        )
        .await
    }

    fn claimed(batch: &usize) -> usize {
        *batch
    }

    async fn run(
        &self,
        batch: usize,
        _tick: &Tick,
        _deadline: Instant,
        _panics: &mut Panics,
        tally: &mut AskTally,
    ) -> Result<(), Error> {
        tally.asked += batch;
        self.biller
            .inner
            .telemetry
            .counter("hardcount_billing_payment_method_requests_total", &[])
            .increment(batch as u64);
        Ok(())
    }
}

/// Mark up to `limit` invoices and queue their event and email, in one
/// transaction; returns how many were marked.
async fn ask(
    db: &Db,
    fence: &Fence,
    limit: usize,
    email_from: &str,
    telemetry: &leader::Telemetry,
    statement_timeout: Duration,
) -> Result<usize, Error> {
    let limit = i64::try_from(limit).unwrap_or(i64::MAX);
    let mut tx = db.begin_with_timeout(statement_timeout).await?;
    let rows = tx
        .fetch_all(
            sql("WITH picked AS ( \
                   SELECT i.id FROM invoices i \
                   JOIN subscriptions s ON s.tenant_id = i.tenant_id AND s.id = i.subscription_id \
                   JOIN customers c ON c.tenant_id = s.tenant_id AND c.id = s.customer_id \
                   WHERE i.status = 'open' AND i.collection_method = 'automatic' \
                     AND i.action_required_at IS NULL \
                     AND s.pause_collection_behavior IS NULL \
                     AND c.payment_method_id IS NULL \
                     AND leader_fence($1, $2) \
                   ORDER BY i.id \
                   LIMIT $3 \
                   FOR UPDATE OF i SKIP LOCKED \
                 ), marked AS ( \
                   UPDATE invoices i SET action_required_at = now() \
                   FROM picked WHERE i.id = picked.id \
                   RETURNING i.id, i.tenant_id, i.subscription_id, i.number, i.amount, i.currency \
                 ) \
                 SELECT m.id, m.tenant_id, m.subscription_id, m.number, m.amount, m.currency, \
                        c.email, ts.email_from, ts.payment_page_url \
                 FROM marked m \
                 JOIN subscriptions s ON s.tenant_id = m.tenant_id AND s.id = m.subscription_id \
                 JOIN customers c ON c.tenant_id = s.tenant_id AND c.id = s.customer_id \
                 LEFT JOIN tenant_settings ts ON ts.tenant_id = m.tenant_id \
                 ORDER BY m.id")
            .bind(fence.role_name())
            .bind(fence.token())
            .bind(limit),
        )
        .await?;
    let mut events = Vec::with_capacity(rows.len());
    let mut emails = Vec::with_capacity(rows.len());
    for r in &rows {
        let id: i64 = r.try_get("id").map_err(db::Error::from)?;
        let tenant: String = r.try_get("tenant_id").map_err(db::Error::from)?;
        let number: Option<String> = r.try_get("number").map_err(db::Error::from)?;
        let amount: i64 = r.try_get("amount").map_err(db::Error::from)?;
        let currency: String = r.try_get("currency").map_err(db::Error::from)?;
        let to: String = r.try_get("email").map_err(db::Error::from)?;
        let from: Option<String> = r.try_get("email_from").map_err(db::Error::from)?;
        let page: Option<String> = r.try_get("payment_page_url").map_err(db::Error::from)?;
        let label = number.clone().unwrap_or_else(|| id.to_string());
        let payload = serde_json::json!({
            "object": "invoice",
            "id": id,
            "number": number,
            "subscription": r.try_get::<i64, _>("subscription_id").map_err(db::Error::from)?,
            "status": "open",
            "amount_due": amount,
            "currency": currency,
            "reason": "no_payment_method",
        })
        .to_string();
        emails.push((
            tenant.clone(),
            outbox::email::Email {
                from: from.unwrap_or_else(|| email_from.to_owned()),
                to: vec![to],
                subject: format!("Please add a payment method for invoice {label}"),
                text: format!(
                    "Invoice {label} for {} is due, and we have no payment method to charge. \
                     Please add one; we will charge it as soon as it is saved.\n{}",
                    money(amount, &currency),
                    payments::payment_page_line(page.as_deref(), id),
                ),
                html: None,
            },
        ));
        events.push((tenant, payload));
    }
    outbox::webhook::enqueue_many_of(&mut tx, "invoice.payment_action_required", &events).await?;
    let refs: Vec<(&str, &outbox::email::Email)> =
        emails.iter().map(|(t, e)| (t.as_str(), e)).collect();
    outbox::email::enqueue_many_or_record(&mut tx, &refs, telemetry).await?;
    tx.commit().await?;
    Ok(rows.len())
}
