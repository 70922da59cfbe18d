//! Writing invoices: the transaction every period writer shares (the tick's
//! closing, a catch-up chain, a plan change, a cancel), and the pure rules
//! that decide what an invoice is when it is made (docs/adr/0025).
//!
//! ```text
//!  one transaction per batch of closings (a catch-up chain of one
//!  subscription is one compare-and-set and several invoices):
//!    1. UPDATE subscriptions … FROM unnest(…)   the CAS on (status, period start,
//!         watermark, cancel_at_period_end) as read; ends the subscription when
//!         the closing says so; RETURNING the pause behaviour and the email
//!    2. SELECT customer_balances … FOR UPDATE    what the customers carry
//!    3. dispose (pure), in period order:        draft | void | uncollectible
//!         (paused), paid (nothing due), paid and carried (under the provider's
//!         minimum), else open
//!    4. INSERT … invoice_counters ON CONFLICT   one number per finalized invoice,
//!         DO UPDATE, per tenant                  given back if the transaction rolls back
//!    5. INSERT invoices … ON CONFLICT (dedup)   a hit rolls back, redone without it
//!    6. the balances' net change (one upsert)
//!    7. events (one statement) and receipts of invoices paid at once
//!  COMMIT
//! ```

use std::collections::{HashMap, HashSet};
use std::time::Duration;

use chrono::{DateTime, Utc};
use db::{Db, Row, sql};

use crate::Error;
use crate::close::Closing;
use crate::money;

mod announce;
mod dispose;

use announce::{announce, announce_subscriptions};
pub(crate) use dispose::{Disposed, dispose};

/// What became of one closing.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Closed {
    /// This closing advanced the period and created this invoice.
    Invoiced { invoice_id: i64 },
    /// This closing's compare-and-set was written and made no invoice: a
    /// plan change or cancel with nothing of the period used, or a cancel the
    /// tenant set not to invoice.
    Advanced,
    /// The (status, period start, watermark) snapshot no longer held: another
    /// writer moved the period first. Nothing was written.
    PeriodMoved,
    /// The snapshot held but an invoice for (subscription, period start)
    /// already exists. Nothing was written (the period was not advanced).
    AlreadyInvoiced,
}

/// What the closing transaction needs besides the closings.
#[derive(Debug, Clone, Copy)]
pub(crate) struct Writing<'a> {
    /// The sender of receipts when the tenant names none.
    pub email_from: &'a str,
    /// Where a refused receipt is counted (it is recorded failed, never a rollback).
    pub telemetry: &'a leader::Telemetry,
    pub statement_timeout: Duration,
}

/// Close `closings` (several consecutive ones of one subscription are a
/// catch-up chain), each subscription by its compare-and-set, in one
/// transaction; a dedup hit rolls it back and the rest are closed again
/// without that subscription. One outcome per invoice made, and one per
/// subscription that made none.
///
/// # Errors
/// A database error or a refused event; nothing was written for any of
/// `closings`.
pub(crate) async fn close_periods(
    db: &Db,
    closings: &[Closing],
    how: Writing<'_>,
) -> Result<Vec<(i64, Closed)>, Error> {
    let mut outcomes = Vec::with_capacity(closings.len());
    let mut pending: Vec<&Closing> = closings.iter().collect();
    loop {
        match close_once(db, &pending, how).await? {
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

pub(crate) enum Attempt {
    /// Written (committed by `close_periods`; the caller's to commit after `close_in`).
    Committed(Vec<(i64, Closed)>),
    /// Rolled back: these subscriptions won the compare-and-set but hit the dedup index.
    Deduplicated(HashSet<i64>),
}

/// A subscription that won its compare-and-set, as the update returned it.
struct Won {
    customer_id: i64,
    /// The subscription's plan after the compare-and-set (a plan change's
    /// new one), which its `subscription.*` event names.
    plan_id: i64,
    pause: Option<String>,
    resumes_at: Option<DateTime<Utc>>,
}

impl Won {
    /// The pause `c`'s invoice is made under: the subscription's, when the
    /// period ended before the pause's resume time (or it has none). A
    /// period's invoice is made when it ends, and a pause applies to the
    /// invoices made while it stands (docs/adr/0110), whenever billing
    /// closes the period.
    fn pause_of(&self, c: &Closing) -> Option<&str> {
        self.pause
            .as_deref()
            .filter(|_| self.resumes_at.is_none_or(|at| c.next_start < at))
    }
}

/// One invoice to insert.
struct NewInvoice<'a> {
    closing: &'a Closing,
    d: Disposed,
    number: Option<String>,
}

async fn close_once(db: &Db, closings: &[&Closing], how: Writing<'_>) -> Result<Attempt, Error> {
    if closings.is_empty() {
        return Ok(Attempt::Committed(Vec::new()));
    }
    // Index-driven (docs/adr/0060): the compare-and-set and the writes after
    // it join the batch to their tables by key. Planned freely, with
    // statistics that had seen the subscriptions, the compare-and-set read
    // every subscription into a hash for each batch.
    let mut tx = db.begin_index_driven(how.statement_timeout).await?;
    let attempt = close_in(&mut tx, closings, how).await?;
    match attempt {
        Attempt::Committed(_) => tx.commit().await?,
        Attempt::Deduplicated(_) => tx.rollback().await?,
    }
    Ok(attempt)
}

/// One subscription's chain of closings written by a cancel or a plan change
/// ([`close_in`], in the caller's transaction; a period that ended before
/// its pause of collection's resume time is invoiced under the pause), then
/// the pause lifted if its resume time has passed, as the tick lifts it once
/// the periods behind are closed (docs/adr/0088, 0110): every invoice it made is
/// counted in `hardcount_billing_invoices_created_total{source}`. Returns the
/// last closing's own invoice, when it made one (the used part).
///
/// # Errors
/// [`Error::SubscriptionPeriodMoved`] when the chain's compare-and-set lost
/// or one of its periods was already invoiced (the caller must roll back),
/// or a database error.
pub(crate) async fn close_chain_in(
    biller: &crate::Biller,
    tx: &mut db::Tx,
    closings: &[Closing],
    source: &'static str,
) -> Result<Option<i64>, Error> {
    let moved = || Error::SubscriptionPeriodMoved {
        subscription: closings[0].subscription_id,
    };
    let refs: Vec<&Closing> = closings.iter().collect();
    let outcomes = match close_in(tx, &refs, biller.writing()).await? {
        Attempt::Deduplicated(_) => return Err(moved()),
        Attempt::Committed(outcomes) => outcomes,
    };
    // A pause past its resume time is lifted once the periods that ended
    // under it are closed under it, as the tick lifts it (docs/adr/0110).
    crate::lifecycle::resume_lifted_pause_in(biller, tx, closings[0].subscription_id).await?;
    let mut invoices = Vec::new();
    for (_, outcome) in outcomes {
        match outcome {
            Closed::Invoiced { invoice_id } => invoices.push(invoice_id),
            // Nothing used: no invoice, only the subscription's new period.
            Closed::Advanced => {}
            _ => return Err(moved()),
        }
    }
    if !invoices.is_empty() {
        biller
            .inner
            .telemetry
            .counter(
                "hardcount_billing_invoices_created_total",
                &[("source", source)],
            )
            .increment(invoices.len() as u64);
    }
    let last_invoiced = closings.last().is_some_and(|c| c.invoiced);
    Ok(invoices.last().copied().filter(|_| last_invoiced))
}

/// [`close_periods`]' work inside the caller's transaction, without its
/// retry: on a dedup hit the caller must roll back (what was written before
/// the hit is part of the transaction).
pub(crate) async fn close_in(
    tx: &mut db::Tx,
    closings: &[&Closing],
    how: Writing<'_>,
) -> Result<Attempt, Error> {
    // A chain's head holds the snapshot, its tail the period that follows.
    let mut heads: Vec<&Closing> = Vec::new();
    let mut tails: HashMap<i64, &Closing> = HashMap::new();
    for c in closings {
        if tails.insert(c.subscription_id, c).is_none() {
            heads.push(c);
        }
    }
    let tail = |c: &Closing| tails[&c.subscription_id];
    // The compare-and-set, the transaction's first write to the subscription
    // (a cancel or a plan change may have locked its row before, reading
    // it): a concurrent closer waits on the row lock,
    // re-checks against the winner's row and matches nothing. A chain that
    // ends the subscription leaves it on the chain's last period, cut where
    // it ended, not on the oldest period the chain closed (docs/adr/0135).
    let rows = tx
        .fetch_all(
            sql("UPDATE subscriptions s \
                 SET current_period_start = CASE WHEN i.ends THEN i.last_start ELSE i.next_start END, \
                     current_period_end = CASE WHEN NOT i.ends THEN i.next_end \
                                               WHEN i.next_start > i.last_start THEN i.next_start \
                                               ELSE i.next_end END, \
                     next_billing_at = CASE WHEN i.ends THEN NULL ELSE i.next_end END, \
                     status = CASE WHEN i.ends THEN 'canceled' ELSE s.status END, \
                     canceled_at = CASE WHEN i.ends THEN now() ELSE s.canceled_at END, \
                     plan_id = COALESCE(i.plan_id, s.plan_id), \
                     updated_at = now() \
                 FROM unnest($1::bigint[], $2::text[], $3::timestamptz[], $4::timestamptz[], \
                             $5::timestamptz[], $6::timestamptz[], $7::bigint[], $8::bool[], $9::bool[], \
                             $10::timestamptz[]) \
                      AS i(id, status, period_start, watermark, next_start, next_end, plan_id, cape, ends, \
                           last_start) \
                 WHERE s.id = i.id \
                   AND s.status = i.status \
                   AND s.current_period_start = i.period_start \
                   AND s.next_billing_at = i.watermark \
                   AND s.cancel_at_period_end = i.cape \
                 RETURNING s.id, s.customer_id, s.plan_id, s.pause_collection_behavior, \
                           s.pause_collection_resumes_at")
            .bind(heads.iter().map(|c| c.subscription_id).collect::<Vec<_>>())
            .bind(heads.iter().map(|c| c.status.clone()).collect::<Vec<_>>())
            .bind(heads.iter().map(|c| c.period_start).collect::<Vec<_>>())
            .bind(heads.iter().map(|c| c.watermark).collect::<Vec<_>>())
            .bind(heads.iter().map(|c| tail(c).next_start).collect::<Vec<_>>())
            .bind(heads.iter().map(|c| tail(c).next_end).collect::<Vec<_>>())
            .bind(heads.iter().map(|c| tail(c).plan_id).collect::<Vec<_>>())
            .bind(heads.iter().map(|c| c.cancel_at_period_end).collect::<Vec<_>>())
            .bind(heads.iter().map(|c| tail(c).ends).collect::<Vec<_>>())
            .bind(heads.iter().map(|c| tail(c).period_start).collect::<Vec<_>>()),
        )
        .await?;
    let mut won: HashMap<i64, Won> = HashMap::with_capacity(rows.len());
    for r in &rows {
        won.insert(
            r.try_get("id").map_err(db::Error::from)?,
            Won {
                customer_id: r.try_get("customer_id").map_err(db::Error::from)?,
                plan_id: r.try_get("plan_id").map_err(db::Error::from)?,
                pause: r
                    .try_get("pause_collection_behavior")
                    .map_err(db::Error::from)?,
                resumes_at: r
                    .try_get("pause_collection_resumes_at")
                    .map_err(db::Error::from)?,
            },
        );
    }
    let invoiced: Vec<&Closing> = closings
        .iter()
        .copied()
        .filter(|c| c.invoiced && won.contains_key(&c.subscription_id))
        .collect();
    let invoices = dispose_all(tx, &invoiced, &won).await?;
    let (numbered, senders) = number(tx, &invoices).await?;
    let created = insert_invoices(tx, &numbered).await?;
    if created.len() < numbered.len() {
        let hits = numbered
            .iter()
            .map(|n| n.closing)
            .filter(|c| !created.contains_key(&(c.subscription_id, c.period_start)))
            .map(|c| c.subscription_id)
            .collect();
        return Ok(Attempt::Deduplicated(hits));
    }
    write_balances(tx, &numbered, &won).await?;
    announce(tx, &numbered, &created, &won, &senders, how).await?;
    // A chain's end is its tail's: a cancel after the periods it was behind
    // (docs/adr/0077) is announced by its last closing, not its first.
    let tails_of: Vec<&Closing> = heads.iter().map(|c| tail(c)).collect();
    announce_subscriptions(tx, &tails_of, &won).await?;
    let mut outcomes = Vec::with_capacity(closings.len());
    for c in &heads {
        if !won.contains_key(&c.subscription_id) {
            outcomes.push((c.subscription_id, Closed::PeriodMoved));
            continue;
        }
        let mut any = false;
        for n in numbered
            .iter()
            .filter(|n| n.closing.subscription_id == c.subscription_id)
        {
            let invoice_id = created[&(c.subscription_id, n.closing.period_start)];
            outcomes.push((c.subscription_id, Closed::Invoiced { invoice_id }));
            any = true;
        }
        if !any {
            outcomes.push((c.subscription_id, Closed::Advanced));
        }
    }
    Ok(Attempt::Committed(outcomes))
}

type BalanceKey = (String, i64, String);

/// Read the balances the invoices may take in (locked), and dispose each
/// invoice in order.
async fn dispose_all<'a>(
    tx: &mut db::Tx,
    invoiced: &[&'a Closing],
    won: &HashMap<i64, Won>,
) -> Result<Vec<NewInvoice<'a>>, Error> {
    let key = |c: &Closing| -> BalanceKey {
        (
            c.tenant_id.clone(),
            won[&c.subscription_id].customer_id,
            c.currency.clone(),
        )
    };
    let unpaused: Vec<BalanceKey> = invoiced
        .iter()
        .filter(|c| won[&c.subscription_id].pause_of(c).is_none())
        .map(|c| key(c))
        .collect();
    let mut balances: HashMap<BalanceKey, i64> = HashMap::new();
    if !unpaused.is_empty() {
        let rows = tx
            .fetch_all(
                sql("SELECT b.tenant_id, b.customer_id, b.currency, b.amount \
                     FROM customer_balances b \
                     JOIN unnest($1::text[], $2::bigint[], $3::text[]) AS k(t, c, cur) \
                       ON b.tenant_id = k.t AND b.customer_id = k.c AND b.currency = k.cur \
                     WHERE b.amount <> 0 \
                     ORDER BY b.tenant_id, b.customer_id, b.currency \
                     FOR UPDATE OF b")
                .bind(unpaused.iter().map(|k| k.0.clone()).collect::<Vec<_>>())
                .bind(unpaused.iter().map(|k| k.1).collect::<Vec<_>>())
                .bind(unpaused.iter().map(|k| k.2.clone()).collect::<Vec<_>>()),
            )
            .await?;
        for r in &rows {
            balances.insert(
                (
                    r.try_get("tenant_id").map_err(db::Error::from)?,
                    r.try_get("customer_id").map_err(db::Error::from)?,
                    r.try_get("currency").map_err(db::Error::from)?,
                ),
                r.try_get("amount").map_err(db::Error::from)?,
            );
        }
    }
    let mut out = Vec::with_capacity(invoiced.len());
    for c in invoiced {
        let k = key(c);
        let balance = balances.get(&k).copied().unwrap_or(0);
        let (d, left) = dispose(
            c.amount,
            won[&c.subscription_id].pause_of(c),
            balance,
            c.collection_method == "automatic",
            money::provider_minimum(&c.currency),
        );
        if left != balance || balances.contains_key(&k) {
            balances.insert(k, left);
        }
        out.push(NewInvoice {
            closing: c,
            d,
            number: None,
        });
    }
    Ok(out)
}

/// Give every finalized invoice its tenant's next number (one statement for
/// the batch; the counter rows are taken in tenant order), and read each
/// tenant's sender.
async fn number<'a>(
    tx: &mut db::Tx,
    invoices: &[NewInvoice<'a>],
) -> Result<(Vec<NewInvoice<'a>>, HashMap<String, String>), Error> {
    let mut per_tenant: Vec<(String, i64)> = Vec::new();
    for n in invoices.iter().filter(|n| n.d.status != "draft") {
        match per_tenant
            .iter_mut()
            .find(|(t, _)| *t == n.closing.tenant_id)
        {
            Some((_, count)) => *count += 1,
            None => per_tenant.push((n.closing.tenant_id.clone(), 1)),
        }
    }
    per_tenant.sort();
    let mut next: HashMap<String, (String, i64)> = HashMap::new();
    let mut senders = HashMap::new();
    if !per_tenant.is_empty() {
        let rows = tx
            .fetch_all(
                sql("WITH c AS ( \
                       INSERT INTO invoice_counters AS ic (tenant_id, last_number) \
                       SELECT * FROM unnest($1::text[], $2::bigint[]) \
                       ON CONFLICT (tenant_id) DO UPDATE SET last_number = ic.last_number + EXCLUDED.last_number \
                       RETURNING ic.tenant_id, ic.last_number \
                     ) \
                     SELECT c.tenant_id, c.last_number, \
                            COALESCE(ts.invoice_prefix, 'INV') AS prefix, ts.email_from \
                     FROM c LEFT JOIN tenant_settings ts ON ts.tenant_id = c.tenant_id")
                .bind(per_tenant.iter().map(|p| p.0.clone()).collect::<Vec<_>>())
                .bind(per_tenant.iter().map(|p| p.1).collect::<Vec<_>>()),
            )
            .await?;
        for r in &rows {
            let tenant: String = r.try_get("tenant_id").map_err(db::Error::from)?;
            let last: i64 = r.try_get("last_number").map_err(db::Error::from)?;
            let count = per_tenant.iter().find(|p| p.0 == tenant).map_or(0, |p| p.1);
            let prefix: String = r.try_get("prefix").map_err(db::Error::from)?;
            if let Some(from) = r
                .try_get::<Option<String>, _>("email_from")
                .map_err(db::Error::from)?
            {
                senders.insert(tenant.clone(), from);
            }
            next.insert(tenant, (prefix, last - count + 1));
        }
    }
    let numbered = invoices
        .iter()
        .map(|n| {
            let number = (n.d.status != "draft").then(|| {
                let (prefix, seq) = next
                    .get_mut(&n.closing.tenant_id)
                    .expect("every finalized invoice's tenant was counted");
                let number = format!("{prefix}-{seq:06}");
                *seq += 1;
                number
            });
            NewInvoice {
                closing: n.closing,
                d: n.d,
                number,
            }
        })
        .collect();
    Ok((numbered, senders))
}

/// Insert the invoices under the dedup index; returns the ids of those made,
/// by (subscription, period start).
async fn insert_invoices(
    tx: &mut db::Tx,
    invoices: &[NewInvoice<'_>],
) -> Result<HashMap<(i64, DateTime<Utc>), i64>, Error> {
    if invoices.is_empty() {
        return Ok(HashMap::new());
    }
    let col = |f: fn(&NewInvoice<'_>) -> DateTime<Utc>| invoices.iter().map(f).collect::<Vec<_>>();
    let text = |f: fn(&NewInvoice<'_>) -> String| invoices.iter().map(f).collect::<Vec<_>>();
    let int = |f: fn(&NewInvoice<'_>) -> i64| invoices.iter().map(f).collect::<Vec<_>>();
    let rows = tx
        .fetch_all(
            sql(
                "INSERT INTO invoices (tenant_id, subscription_id, period_start, period_end, \
                                       amount, currency, collection_method, status, number, \
                                       balance_applied, carried_to_balance, reason, \
                                       finalized_at, paid_at, closed_at) \
                 SELECT t, sub, ps, pe, amt, cur, cm, st, num, ba, ca, re, \
                        CASE WHEN st = 'draft' THEN NULL ELSE now() END, \
                        CASE WHEN st = 'paid' THEN now() END, \
                        CASE WHEN st IN ('void', 'uncollectible') THEN now() END \
                 FROM unnest($1::text[], $2::bigint[], $3::timestamptz[], $4::timestamptz[], \
                             $5::bigint[], $6::text[], $7::text[], $8::text[], $9::text[], \
                             $10::bigint[], $11::bigint[], $12::text[]) \
                      AS i(t, sub, ps, pe, amt, cur, cm, st, num, ba, ca, re) \
                 ON CONFLICT ON CONSTRAINT idx_invoices_billing_period_dedup DO NOTHING \
                 RETURNING id, subscription_id, period_start",
            )
            .bind(text(|n| n.closing.tenant_id.clone()))
            .bind(int(|n| n.closing.subscription_id))
            .bind(col(|n| n.closing.period_start))
            .bind(col(|n| n.closing.next_start))
            .bind(int(|n| n.d.amount))
            .bind(text(|n| n.closing.currency.clone()))
            .bind(text(|n| n.closing.collection_method.clone()))
            .bind(text(|n| n.d.status.to_owned()))
            .bind(
                invoices
                    .iter()
                    .map(|n| n.number.clone())
                    .collect::<Vec<_>>(),
            )
            .bind(int(|n| n.d.balance_applied))
            .bind(int(|n| n.d.carried))
            .bind(text(|n| n.closing.reason.as_str().to_owned())),
        )
        .await?;
    let mut created = HashMap::with_capacity(rows.len());
    for r in &rows {
        created.insert(
            (
                r.try_get("subscription_id").map_err(db::Error::from)?,
                r.try_get("period_start").map_err(db::Error::from)?,
            ),
            r.try_get("id").map_err(db::Error::from)?,
        );
    }
    Ok(created)
}

/// The customers' balances moved by what the invoices took in and carried:
/// one upsert of the net change per (tenant, customer, currency).
async fn write_balances(
    tx: &mut db::Tx,
    invoices: &[NewInvoice<'_>],
    won: &HashMap<i64, Won>,
) -> Result<(), Error> {
    let mut delta: HashMap<BalanceKey, i64> = HashMap::new();
    for n in invoices {
        let change = n.d.carried - n.d.balance_applied;
        if change != 0 {
            let c = n.closing;
            *delta
                .entry((
                    c.tenant_id.clone(),
                    won[&c.subscription_id].customer_id,
                    c.currency.clone(),
                ))
                .or_default() += change;
        }
    }
    let mut delta: Vec<(BalanceKey, i64)> = delta.into_iter().filter(|(_, d)| *d != 0).collect();
    if delta.is_empty() {
        return Ok(());
    }
    delta.sort();
    tx.execute(
        sql(
            "INSERT INTO customer_balances AS b (tenant_id, customer_id, currency, amount) \
             SELECT * FROM unnest($1::text[], $2::bigint[], $3::text[], $4::bigint[]) \
             ON CONFLICT (tenant_id, customer_id, currency) \
             DO UPDATE SET amount = b.amount + EXCLUDED.amount, updated_at = now()",
        )
        .bind(delta.iter().map(|d| d.0.0.clone()).collect::<Vec<_>>())
        .bind(delta.iter().map(|d| d.0.1).collect::<Vec<_>>())
        .bind(delta.iter().map(|d| d.0.2.clone()).collect::<Vec<_>>())
        .bind(delta.iter().map(|d| d.1).collect::<Vec<_>>()),
    )
    .await?;
    Ok(())
}
