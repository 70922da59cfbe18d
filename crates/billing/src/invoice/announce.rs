//! What the invoices of a closing announce: their events (one statement)
//! and the receipts of those paid when made.

use std::collections::HashMap;

use chrono::{DateTime, Utc};
use db::{Row, sql};

use super::{NewInvoice, Won, Writing};
use crate::Error;
use crate::close::{Closing, Reason};
use crate::money;

/// The events of the invoices made (one statement) and the receipts of those
/// paid at once.
pub(super) async fn announce(
    tx: &mut db::Tx,
    invoices: &[NewInvoice<'_>],
    created: &HashMap<(i64, DateTime<Utc>), i64>,
    won: &HashMap<i64, Won>,
    senders: &HashMap<String, String>,
    how: Writing<'_>,
) -> Result<(), Error> {
    let mut events: Vec<(String, &'static str, String)> = Vec::new();
    let mut receipts = Vec::new();
    // The addresses of the customers owed a receipt (invoices paid at once are
    // few): read only when there is one.
    let owed: Vec<i64> = invoices
        .iter()
        .filter(|n| n.d.status == "paid")
        .map(|n| won[&n.closing.subscription_id].customer_id)
        .collect();
    let mut email_of: HashMap<i64, String> = HashMap::new();
    if !owed.is_empty() {
        let rows = tx
            .fetch_all(sql("SELECT id, email FROM customers WHERE id = ANY($1)").bind(owed))
            .await?;
        for r in &rows {
            email_of.insert(
                r.try_get("id").map_err(db::Error::from)?,
                r.try_get("email").map_err(db::Error::from)?,
            );
        }
    }
    for n in invoices {
        let c = n.closing;
        let id = created[&(c.subscription_id, c.period_start)];
        let followed_by = match n.d.status {
            "draft" => continue,
            "paid" => Some("invoice.paid"),
            "void" => Some("invoice.voided"),
            "uncollectible" => Some("invoice.marked_uncollectible"),
            _ => None,
        };
        let payload = invoice_payload(id, n);
        events.push((c.tenant_id.clone(), "invoice.finalized", payload.clone()));
        if let Some(kind) = followed_by {
            events.push((c.tenant_id.clone(), kind, payload));
        }
        if n.d.status == "paid" {
            let from = senders
                .get(&c.tenant_id)
                .map_or(how.email_from, String::as_str);
            let to = email_of
                .get(&won[&c.subscription_id].customer_id)
                .map_or("", String::as_str);
            receipts.push((c.tenant_id.as_str(), paid_at_once(n, to, from)));
        }
    }
    let refs: Vec<outbox::webhook::NewEvent<'_>> = events
        .iter()
        .map(|(t, k, p)| (t.as_str(), *k, p.as_str()))
        .collect();
    outbox::webhook::enqueue_many(tx, &refs).await?;
    if !receipts.is_empty() {
        let refs: Vec<(&str, &outbox::email::Email)> =
            receipts.iter().map(|(t, e)| (*t, e)).collect();
        outbox::email::enqueue_many_or_record(tx, &refs, how.telemetry).await?;
    }
    Ok(())
}

/// `subscription.updated` for a plan change, `subscription.canceled` for an
/// end, of the subscriptions that won; `last` holds each chain's last closing.
pub(super) async fn announce_subscriptions(
    tx: &mut db::Tx,
    last: &[&Closing],
    won: &HashMap<i64, Won>,
) -> Result<(), Error> {
    let mut events = Vec::new();
    for c in last.iter() {
        let Some(w) = won.get(&c.subscription_id) else {
            continue;
        };
        let (kind, status) = match c.reason {
            Reason::Cancel => ("subscription.canceled", "canceled"),
            Reason::Period if c.ends => ("subscription.canceled", "canceled"),
            Reason::PlanChange => ("subscription.updated", "active"),
            Reason::Period => continue,
        };
        let payload = serde_json::json!({
            "object": "subscription",
            "id": c.subscription_id,
            "status": status,
            // The row's plan: a closing that changes none carries no plan
            // of its own (it announced "plan": null).
            "plan": w.plan_id,
            // As the row has it: the period that ended for a closing that
            // ends the subscription, the new one otherwise (docs/adr/0135).
            "current_period_start": (if c.ends { c.period_start } else { c.next_start }).to_rfc3339(),
            "cancel_at_period_end": c.cancel_at_period_end,
        })
        .to_string();
        events.push((c.tenant_id.clone(), kind, payload));
    }
    if events.is_empty() {
        return Ok(());
    }
    let refs: Vec<outbox::webhook::NewEvent<'_>> = events
        .iter()
        .map(|(t, k, p)| (t.as_str(), *k, p.as_str()))
        .collect();
    outbox::webhook::enqueue_many(tx, &refs).await?;
    Ok(())
}

/// An invoice event's data.
fn invoice_payload(invoice_id: i64, n: &NewInvoice<'_>) -> String {
    let c = n.closing;
    serde_json::json!({
        "object": "invoice",
        "id": invoice_id,
        "number": n.number,
        "subscription": c.subscription_id,
        "status": n.d.status,
        "reason": c.reason.as_str(),
        "amount_due": n.d.amount,
        "amount_paid": if n.d.status == "paid" { n.d.amount - n.d.carried } else { 0 },
        "balance_applied": n.d.balance_applied,
        "carried_to_balance": n.d.carried,
        "currency": c.currency,
        "collection_method": c.collection_method,
        "period_start": c.period_start.to_rfc3339(),
        "period_end": c.next_start.to_rfc3339(),
    })
    .to_string()
}

/// The receipt of an invoice paid when it was made: nothing was charged.
fn paid_at_once(n: &NewInvoice<'_>, to: &str, from: &str) -> outbox::email::Email {
    let c = n.closing;
    let number = n.number.as_deref().unwrap_or("");
    let text = if n.d.carried > 0 {
        format!(
            "Invoice {number} comes to {}, less than the smallest amount we can charge. \
             It is added to your next invoice; nothing was charged today.\n",
            money::money(n.d.amount, &c.currency)
        )
    } else {
        format!(
            "Invoice {number} comes to {}: there is nothing to pay and nothing was charged.\n",
            money::money(n.d.amount, &c.currency)
        )
    };
    outbox::email::Email {
        from: from.to_owned(),
        to: vec![to.to_owned()],
        subject: format!("Receipt for invoice {number}"),
        text,
        html: None,
    }
}
