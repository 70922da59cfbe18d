//! All of billing's SQL: the fenced due-billing funnel, the period close (one
//! compare-and-set per row, then the invoices and their `invoice.finalized`
//! events in the same transaction), and the backlog gauges.

use std::collections::HashSet;
use std::time::Duration;

use chrono::{DateTime, Utc};
use db::{Db, PgRow, Row, sql};
use leader::Fence;

use crate::Error;
use crate::close::{Closing, Due};

fn due(r: &PgRow) -> Result<Due, db::Error> {
    Ok(Due {
        subscription_id: r.try_get("id")?,
        tenant_id: r.try_get("tenant_id")?,
        status: r.try_get("status")?,
        billing_anchor: r.try_get("billing_anchor")?,
        current_period_start: r.try_get("current_period_start")?,
        current_period_end: r.try_get("current_period_end")?,
        next_billing_at: r.try_get("next_billing_at")?,
        collection_method: r.try_get("collection_method")?,
        interval_unit: r.try_get("interval_unit")?,
        interval_count: r.try_get("interval_count")?,
        amount: r.try_get("amount")?,
        currency: r.try_get("currency")?,
    })
}

/// The fenced funnel: up to `limit` active subscriptions whose watermark has
/// passed, oldest watermark first, with their plan, leaving out `except`
/// (rows this tick already left out). A listing, not a lease: what it returns
/// is the snapshot each closing proves, and the closing's compare-and-set, not
/// this claim, is what stops a second biller.
///
/// The fence sits in the innermost WHERE, next to `FOR UPDATE SKIP LOCKED`: a
/// stale token lists nothing, and rows a closing transaction holds are skipped.
pub(crate) async fn claim_due(
    db: &Db,
    fence: &Fence,
    limit: usize,
    except: &[i64],
    statement_timeout: Duration,
) -> Result<Vec<Due>, db::Error> {
    let limit = i64::try_from(limit).unwrap_or(i64::MAX);
    let mut tx = db.begin_with_timeout(statement_timeout).await?;
    let rows = tx
        .fetch_all(
            sql(
                "SELECT s.id, s.tenant_id, s.status, s.billing_anchor, s.current_period_start, \
                        s.current_period_end, s.next_billing_at, s.collection_method, \
                        p.interval_unit, p.interval_count, p.amount, p.currency \
                 FROM subscriptions s \
                 JOIN plans p ON p.tenant_id = s.tenant_id AND p.id = s.plan_id \
                 WHERE s.status = 'active' \
                   AND s.next_billing_at <= now() \
                   AND s.id <> ALL ($3) \
                   AND leader_fence($1, $2) \
                 ORDER BY s.next_billing_at, s.id \
                 LIMIT $4 \
                 FOR UPDATE OF s SKIP LOCKED",
            )
            .bind(fence.role_name())
            .bind(fence.token())
            .bind(except.to_vec())
            .bind(limit),
        )
        .await?;
    tx.commit().await?;
    rows.iter().map(due).collect::<Result<Vec<_>, _>>()
}

/// What became of one closing.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Closed {
    /// This closing advanced the period and created this invoice.
    Invoiced { invoice_id: i64 },
    /// The (status, period start, watermark) snapshot no longer held: another
    /// writer moved the period first. Nothing was written.
    PeriodMoved,
    /// The snapshot held but an invoice for (subscription, period start)
    /// already exists. Nothing was written (the period was not advanced).
    AlreadyInvoiced,
}

/// Close `closings` in one transaction whose first statement is the
/// compare-and-set on each subscription; then one invoice per subscription
/// that won, under `idx_invoices_billing_period_dedup`, and one
/// `invoice.finalized` event per invoice created. A subscription that lost its
/// compare-and-set or hit the dedup index writes and announces nothing.
///
/// A dedup hit rolls the whole transaction back and closes the others again
/// without it, so that its period is not advanced either.
///
/// # Errors
/// A database error or a refused event; the transaction rolled back and
/// nothing was written for any of `closings`.
pub(crate) async fn close_periods(
    db: &Db,
    closings: &[Closing],
    statement_timeout: Duration,
) -> Result<Vec<(i64, Closed)>, Error> {
    let mut outcomes = Vec::with_capacity(closings.len());
    let mut pending: Vec<&Closing> = closings.iter().collect();
    loop {
        match close_once(db, &pending, statement_timeout).await? {
            Attempt::Committed(done) => {
                outcomes.extend(done);
                return Ok(outcomes);
            }
            Attempt::Deduplicated(hits) => {
                pending.retain(|c| !hits.contains(&c.subscription_id));
                outcomes.extend(hits.into_iter().map(|id| (id, Closed::AlreadyInvoiced)));
            }
        }
    }
}

enum Attempt {
    Committed(Vec<(i64, Closed)>),
    /// Rolled back: these subscriptions won the compare-and-set but hit the dedup index.
    Deduplicated(HashSet<i64>),
}

async fn close_once(
    db: &Db,
    closings: &[&Closing],
    statement_timeout: Duration,
) -> Result<Attempt, Error> {
    if closings.is_empty() {
        return Ok(Attempt::Committed(Vec::new()));
    }
    let col = |f: fn(&Closing) -> DateTime<Utc>| closings.iter().map(|c| f(c)).collect::<Vec<_>>();
    let ids: Vec<i64> = closings.iter().map(|c| c.subscription_id).collect();
    let statuses: Vec<String> = closings.iter().map(|c| c.status.clone()).collect();
    let mut tx = db.begin_with_timeout(statement_timeout).await?;
    // The compare-and-set, first statement of the transaction: each row is
    // updated only if it still holds the snapshot its closing was computed
    // from. A concurrent closer waits on the row lock, then re-checks these
    // predicates against the row the winner wrote, and matches nothing.
    let won = tx
        .fetch_all(
            sql("UPDATE subscriptions s \
                 SET current_period_start = i.next_start, \
                     current_period_end = i.next_end, \
                     next_billing_at = i.next_end, \
                     updated_at = now() \
                 FROM unnest($1::bigint[], $2::text[], $3::timestamptz[], $4::timestamptz[], \
                             $5::timestamptz[], $6::timestamptz[]) \
                      AS i(id, status, period_start, watermark, next_start, next_end) \
                 WHERE s.id = i.id \
                   AND s.status = i.status \
                   AND s.current_period_start = i.period_start \
                   AND s.next_billing_at = i.watermark \
                 RETURNING s.id")
            .bind(ids.clone())
            .bind(statuses)
            .bind(col(|c| c.period_start))
            .bind(col(|c| c.watermark))
            .bind(col(|c| c.next_start))
            .bind(col(|c| c.next_end)),
        )
        .await?;
    let won: HashSet<i64> = won
        .iter()
        .map(|r| r.try_get::<i64, _>("id"))
        .collect::<Result<_, _>>()
        .map_err(db::Error::from)?;
    let winners: Vec<&Closing> = closings
        .iter()
        .copied()
        .filter(|c| won.contains(&c.subscription_id))
        .collect();
    let created = if winners.is_empty() {
        Vec::new()
    } else {
        let col =
            |f: fn(&Closing) -> DateTime<Utc>| winners.iter().map(|c| f(c)).collect::<Vec<_>>();
        tx.fetch_all(
            sql(
                "INSERT INTO invoices (tenant_id, subscription_id, period_start, period_end, \
                                       amount, currency, collection_method) \
                 SELECT * FROM unnest($1::text[], $2::bigint[], $3::timestamptz[], \
                                      $4::timestamptz[], $5::bigint[], $6::text[], $7::text[]) \
                 ON CONFLICT ON CONSTRAINT idx_invoices_billing_period_dedup DO NOTHING \
                 RETURNING id, subscription_id",
            )
            .bind(
                winners
                    .iter()
                    .map(|c| c.tenant_id.clone())
                    .collect::<Vec<_>>(),
            )
            .bind(
                winners
                    .iter()
                    .map(|c| c.subscription_id)
                    .collect::<Vec<_>>(),
            )
            .bind(col(|c| c.period_start))
            .bind(col(|c| c.next_start))
            .bind(winners.iter().map(|c| c.amount).collect::<Vec<_>>())
            .bind(
                winners
                    .iter()
                    .map(|c| c.currency.clone())
                    .collect::<Vec<_>>(),
            )
            .bind(
                winners
                    .iter()
                    .map(|c| c.collection_method.clone())
                    .collect::<Vec<_>>(),
            ),
        )
        .await?
    };
    let mut invoice_of = std::collections::HashMap::with_capacity(created.len());
    for r in &created {
        let sub: i64 = r.try_get("subscription_id").map_err(db::Error::from)?;
        let id: i64 = r.try_get("id").map_err(db::Error::from)?;
        invoice_of.insert(sub, id);
    }
    if invoice_of.len() < winners.len() {
        tx.rollback().await?;
        let hits = winners
            .iter()
            .map(|c| c.subscription_id)
            .filter(|id| !invoice_of.contains_key(id))
            .collect();
        return Ok(Attempt::Deduplicated(hits));
    }
    for c in &winners {
        let invoice_id = invoice_of[&c.subscription_id];
        let payload = finalized_payload(invoice_id, c);
        webhook_outbox::enqueue(&mut tx, &c.tenant_id, "invoice.finalized", &payload).await?;
    }
    tx.commit().await?;
    Ok(Attempt::Committed(
        closings
            .iter()
            .map(|c| {
                let outcome = match invoice_of.get(&c.subscription_id) {
                    Some(&invoice_id) => Closed::Invoiced { invoice_id },
                    None => Closed::PeriodMoved,
                };
                (c.subscription_id, outcome)
            })
            .collect(),
    ))
}

/// The `invoice.finalized` event's data.
fn finalized_payload(invoice_id: i64, c: &Closing) -> String {
    serde_json::json!({
        "object": "invoice",
        "id": invoice_id,
        "subscription": c.subscription_id,
        "status": "open",
        "amount_due": c.amount,
        "currency": c.currency,
        "collection_method": c.collection_method,
        "period_start": c.period_start.to_rfc3339(),
        "period_end": c.next_start.to_rfc3339(),
    })
    .to_string()
}

/// The due backlog, for the gauges.
#[derive(Debug, Clone, Copy, PartialEq)]
pub(crate) struct Backlog {
    pub due: i64,
    /// Seconds since the oldest due watermark passed; 0 when nothing is due.
    pub oldest_due_age: f64,
}

pub(crate) async fn backlog(db: &Db, statement_timeout: Duration) -> Result<Backlog, db::Error> {
    let mut tx = db.begin_with_timeout(statement_timeout).await?;
    let row = tx
        .fetch_one(sql("SELECT count(*) AS due, \
                    COALESCE(extract(epoch FROM now() - min(next_billing_at)), 0)::float8 AS age \
             FROM subscriptions WHERE status = 'active' AND next_billing_at <= now()"))
        .await?;
    tx.commit().await?;
    Ok(Backlog {
        due: row.try_get("due")?,
        oldest_due_age: row.try_get("age")?,
    })
}
