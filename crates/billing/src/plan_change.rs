//! A plan change (the function the HTTP API will call): the current period
//! truncated at the change, through the same compare-and-set as a closing.
//!
//! ```text
//!  fresh snapshot: the active subscription, its plan, the new plan, now()
//!  close::truncate_behind (pure): the periods ended before now closed as the tick
//!                          would (docs/adr/0088), then
//!                          invoice [period start, now) pro rata on the old plan
//!                          next period [now, end_after(anchor, new interval)) on the new plan
//!  more than catch_up_periods behind ─▶ Error::SubscriptionPeriodMoved; nothing written
//!  written by invoice::close_chain_in: each period under the pause it ended in, then
//!                          a pause past its resume time lifted (docs/adr/0110)
//!  one transaction, the caller's (`change_plan_in`) or its own (invoice::close_in, as the tick's closing):
//!    1. UPDATE subscriptions … WHERE status, period start, watermark = $read  (CAS)
//!    2. INSERT the invoice under idx_invoices_billing_period_dedup
//!    3. invoice.finalized, subscription.updated
//!  another currency ─▶ Error::PlanCurrencyMismatch (`plan_currency_mismatch`, 409); nothing written
//!  CAS lost ─▶ Error::SubscriptionPeriodMoved (`subscription_period_moved`, 409); nothing written
//! ```
//!
//! Rounding: the used part is `amount × used / full` in milliseconds, rounded
//! half up to the minor unit ([`crate::period::pro_rata`]). Nothing is
//! credited for the unused part: billing is in arrears, so the unused part
//! was never invoiced.

use chrono::{DateTime, Utc};
use db::{Row, sql};

use crate::close::{self, Closing, Due, Plan};
use crate::invoice;
use crate::period;
use crate::store::due;
use crate::{Biller, Error};

/// A plan change computed from a fresh snapshot, not yet written.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct PlanChange {
    /// The snapshot the change proves.
    pub due: Due,
    pub plan: Plan,
    /// When the old plan stops (the database's now at the snapshot).
    pub at: DateTime<Utc>,
    /// The periods the subscription is behind, closed as the tick would,
    /// then the truncated period; never empty.
    closings: Vec<Closing>,
}

impl PlanChange {
    /// The truncated period's invoice amount (old plan, pro rata).
    pub fn amount(&self) -> i64 {
        self.change().amount
    }

    /// The new period `[at, end)`.
    pub fn next_period(&self) -> (DateTime<Utc>, DateTime<Utc>) {
        (self.change().next_start, self.change().next_end)
    }

    /// How many periods that had ended are closed before the change.
    pub fn closed_behind(&self) -> usize {
        self.closings.len() - 1
    }

    fn change(&self) -> &Closing {
        &self.closings[self.closings.len() - 1]
    }
}

/// What a plan change wrote.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct PlanChanged {
    /// The invoice of the used part; `None` when nothing of the period was used.
    pub invoice_id: Option<i64>,
}

/// The body of [`Biller::change_plan`]: [`change_plan_in`] in its own
/// transaction, committed only when the change was written.
pub(crate) async fn change_plan(
    biller: &Biller,
    tenant_id: &str,
    subscription: i64,
    plan: i64,
) -> Result<PlanChanged, Error> {
    let mut tx = biller
        .inner
        .db
        .begin_with_timeout(biller.inner.config.statement_timeout)
        .await?;
    let written = change_plan_in(biller, &mut tx, tenant_id, subscription, plan).await;
    tx.commit_if_ok(written).await
}

/// The body of [`Biller::change_plan_in`]: the snapshot read (not locked:
/// the compare-and-set proves it) and the change written, in `tx`.
pub(crate) async fn change_plan_in(
    biller: &Biller,
    tx: &mut db::Tx,
    tenant_id: &str,
    subscription: i64,
    plan: i64,
) -> Result<PlanChanged, Error> {
    let max = biller.inner.config.catch_up_periods;
    let change = plan_change_in(tx, tenant_id, subscription, plan, max).await?;
    apply_plan_change_in(biller, tx, &change).await
}

/// The body of [`Biller::plan_change`].
pub(crate) async fn plan_change(
    biller: &Biller,
    tenant_id: &str,
    subscription: i64,
    plan: i64,
) -> Result<PlanChange, Error> {
    let timeout = biller.inner.config.statement_timeout;
    let mut tx = biller.inner.db.begin_with_timeout(timeout).await?;
    let max = biller.inner.config.catch_up_periods;
    let change = plan_change_in(&mut tx, tenant_id, subscription, plan, max).await;
    tx.commit().await?;
    change
}

/// A fresh snapshot read in `tx` and the change computed from it, after
/// at most `max` periods the subscription is behind.
async fn plan_change_in(
    tx: &mut db::Tx,
    tenant_id: &str,
    subscription: i64,
    plan: i64,
    max: usize,
) -> Result<PlanChange, Error> {
    let Some((due, new_plan, now)) =
        plan_change_snapshot(tx, tenant_id, subscription, plan).await?
    else {
        return Err(Error::SubscriptionNotFound {
            tenant: tenant_id.to_owned(),
            subscription,
            plan,
        });
    };
    // Stripe refuses a price in another currency on a subscription; so
    // do we: the customer's balance and invoices are in one currency.
    if new_plan.currency != due.currency {
        return Err(Error::PlanCurrencyMismatch {
            subscription,
            from: due.currency,
            to: new_plan.currency,
        });
    }
    // Never before the period's start (a clock step back). Past its end,
    // the periods that ended are closed first, as the tick would close
    // them: the time used since is invoiced on the old plan (docs/adr/0088).
    let at = now.max(due.current_period_start);
    let closings = close::truncate_behind(&due, &new_plan, at, max)?
        .ok_or(Error::SubscriptionPeriodMoved { subscription })?;
    // The change keeps the anchor's grid. Before the first period has begun,
    // an anchor more than one of the new plan's intervals ahead would make a
    // period longer than the one interval it is priced by (docs/adr/0096).
    let new = close::interval(&new_plan.interval_unit, new_plan.interval_count).ok();
    // (Only then: from an anchor in the past the grid's next boundary is
    // within an interval, a few days past it at a month's end.)
    if let Some(c) = closings.last()
        && due.billing_anchor > c.next_start
        && new
            .and_then(|i| period::boundary(c.next_start, i, 1))
            .is_some_and(|natural| c.next_end > natural)
    {
        return Err(Error::InvalidState {
            subscription,
            reason: "the billing anchor is more than one of the new plan's intervals ahead: \
                     change the plan once the first period has begun, or to a longer interval",
        });
    }
    Ok(PlanChange {
        due,
        plan: new_plan,
        at,
        closings,
    })
}

/// The body of [`Biller::apply_plan_change`]: [`apply_plan_change_in`] in
/// its own transaction.
pub(crate) async fn apply_plan_change(
    biller: &Biller,
    change: &PlanChange,
) -> Result<PlanChanged, Error> {
    let mut tx = biller
        .inner
        .db
        .begin_with_timeout(biller.inner.config.statement_timeout)
        .await?;
    let written = apply_plan_change_in(biller, &mut tx, change).await;
    tx.commit_if_ok(written).await
}

/// Write `change` in `tx` if its snapshot still holds. On
/// [`Error::SubscriptionPeriodMoved`] (the compare-and-set lost, or the
/// period is already invoiced: a dedup hit has written into `tx` before it)
/// the caller must roll back.
pub(crate) async fn apply_plan_change_in(
    biller: &Biller,
    tx: &mut db::Tx,
    change: &PlanChange,
) -> Result<PlanChanged, Error> {
    let invoice_id = invoice::close_chain_in(biller, tx, &change.closings, "plan_change").await?;
    Ok(PlanChanged { invoice_id })
}

/// A subscription's fresh snapshot for a plan change, the new plan, and the
/// database's now.
async fn plan_change_snapshot(
    tx: &mut db::Tx,
    tenant_id: &str,
    subscription_id: i64,
    plan_id: i64,
) -> Result<Option<(Due, crate::close::Plan, DateTime<Utc>)>, db::Error> {
    let row = tx
        .fetch_optional(
            sql(
                "SELECT s.id, s.tenant_id, s.status, s.billing_anchor, s.current_period_start, \
                        s.current_period_end, s.next_billing_at, s.collection_method, \
                        s.cancel_at_period_end, \
                        p.interval_unit, p.interval_count, p.amount, p.currency, \
                        n.id AS new_id, n.interval_unit AS new_unit, \
                        n.interval_count AS new_count, n.amount AS new_amount, \
                        n.currency AS new_currency, now() AS at \
                 FROM subscriptions s \
                 JOIN plans p ON p.tenant_id = s.tenant_id AND p.id = s.plan_id \
                 JOIN plans n ON n.tenant_id = s.tenant_id AND n.id = $3 \
                 WHERE s.tenant_id = $1 AND s.id = $2 AND s.status = 'active'",
            )
            .bind(tenant_id.to_owned())
            .bind(subscription_id)
            .bind(plan_id),
        )
        .await?;
    row.map(|r| {
        Ok((
            due(&r)?,
            crate::close::Plan {
                id: r.try_get("new_id")?,
                interval_unit: r.try_get("new_unit")?,
                interval_count: r.try_get("new_count")?,
                amount: r.try_get("new_amount")?,
                currency: r.try_get("new_currency")?,
            },
            r.try_get("at")?,
        ))
    })
    .transpose()
}
