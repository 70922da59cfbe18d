//! Cancels (the functions the HTTP API and dunning's final action call):
//! now, with the used part of the current period invoiced pro rata, or at
//! the period's end, which bills the last full period (docs/adr/0025).
//!
//! ```text
//!  now         fresh snapshot: the active subscription, its plan, the tenant's
//!              invoice_on_cancel (default true), now()
//!              close::cancel_behind (pure): the periods ended before now closed
//!                as the tick would, then invoice [period start, now) pro rata, or
//!                none (docs/adr/0077)
//!              invoice::close_chain_in: the CAS on (status, period start,
//!                watermark, cancel_at_period_end) sets status = 'canceled';
//!                the invoice (reason 'cancel'), invoice.finalized,
//!                subscription.canceled; then a pause past its resume time
//!                lifted (docs/adr/0088, 0110); CAS lost ─▶ SubscriptionPeriodMoved
//!  period end  close_ended_in: the periods ended before now closed as the tick
//!              would (docs/adr/0096), then UPDATE … SET cancel_at_period_end =
//!              true + subscription.updated; the tick closes the period holding
//!              now as usual and ends the subscription in the same
//!              compare-and-set (close::close)
//! ```

use chrono::{DateTime, Utc};
use db::{Row, sql};

use crate::close::{self, Due};
use crate::invoice;
use crate::{Biller, Error};

/// When a cancel takes effect.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum CancelAt {
    /// Now: the used part of the period is invoiced unless the tenant's
    /// `invoice_on_cancel` is false.
    Now,
    /// When the current period ends, after it is invoiced in full.
    PeriodEnd,
}

pub use payments::Canceled;

/// The body of [`Biller::cancel_subscription`]: [`cancel_subscription_in`]
/// in its own transaction, committed only when the cancel was written.
pub(crate) async fn cancel_subscription(
    biller: &Biller,
    tenant_id: &str,
    subscription: i64,
    at: CancelAt,
) -> Result<Canceled, Error> {
    let timeout = biller.inner.config.statement_timeout;
    let mut tx = biller.inner.db.begin_with_timeout(timeout).await?;
    let written = cancel_subscription_in(biller, &mut tx, tenant_id, subscription, at).await;
    tx.commit_if_ok(written).await
}

/// The body of [`Biller::cancel_subscription_in`]: the subscription's row
/// locked by the snapshot, so the compare-and-set that follows in `tx`
/// holds; on an error the caller must roll back.
pub(crate) async fn cancel_subscription_in(
    biller: &Biller,
    tx: &mut db::Tx,
    tenant_id: &str,
    subscription: i64,
    at: CancelAt,
) -> Result<Canceled, Error> {
    let not_found = || Error::SubscriptionNotFound {
        tenant: tenant_id.to_owned(),
        subscription,
        plan: 0,
    };
    if at == CancelAt::PeriodEnd {
        return match cancel_at_period_end_in(biller, tx, tenant_id, subscription).await? {
            true => Ok(Canceled { invoice_id: None }),
            false => Err(not_found()),
        };
    }
    if cancel_trial_in(tx, tenant_id, subscription).await? {
        return Ok(Canceled { invoice_id: None });
    }
    // A trial that ended is activated first, as the tick would, so the
    // cancel invoices the paid time since (docs/adr/0077).
    crate::lifecycle::activate_ended_trial_in(tx, tenant_id, subscription).await?;
    match cancel_now_in(biller, tx, tenant_id, subscription).await? {
        Some(canceled) => Ok(canceled),
        None => Err(not_found()),
    }
}

/// The body of [`Biller::cancel_now_in`]: `None` when the subscription is
/// not active (or not this tenant's).
///
/// A subscription behind (its period ended before `now` and the tick has
/// not closed it yet) has those periods closed and invoiced first, as the
/// tick would, in the same compare-and-set, and the period holding `now`
/// truncated there (docs/adr/0077): a cancel never drops the time used
/// since the last closing. More than `catch_up_periods` behind, nothing is
/// written ([`Error::SubscriptionPeriodMoved`]: once the tick catches up,
/// the cancel goes through).
pub(crate) async fn cancel_now_in(
    biller: &Biller,
    tx: &mut db::Tx,
    tenant_id: &str,
    subscription: i64,
) -> Result<Option<Canceled>, Error> {
    let moved = || Error::SubscriptionPeriodMoved { subscription };
    let Some((due, invoice, now)) = snapshot_in(tx, tenant_id, subscription).await? else {
        return Ok(None);
    };
    let max = biller.inner.config.catch_up_periods;
    let closings = close::cancel_behind(&due, now, invoice, max)?.ok_or_else(moved)?;
    let invoice_id = invoice::close_chain_in(biller, tx, &closings, "cancel").await?;
    Ok(Some(Canceled { invoice_id }))
}

/// The periods an active subscription is behind (ended at the database's
/// now, not closed yet by the tick) closed and invoiced as the tick would
/// close them, in `tx` with its row locked (docs/adr/0096): so that a change
/// that takes effect now (a cancel at the period's end, a pause or a resume
/// of collection) never reaches back into a period that ended before it.
/// A trial that ended is activated first, as cancel now does (docs/adr/0077,
/// 0134). Nothing when the subscription is not active or not behind. `source` is
/// the label of `hardcount_billing_invoices_created_total`.
///
/// # Errors
/// [`Error::SubscriptionPeriodMoved`] when it is more than
/// `catch_up_periods` behind (once the tick catches up, the change goes
/// through) or the closing's compare-and-set lost; a database error. On any
/// error the caller must roll back.
pub(crate) async fn close_ended_in(
    biller: &Biller,
    tx: &mut db::Tx,
    tenant_id: &str,
    subscription: i64,
    source: &'static str,
) -> Result<(), Error> {
    // A trial that ended is active from its end, as the tick would make it:
    // its first paid period may have ended too (docs/adr/0134).
    crate::lifecycle::activate_ended_trial_in(tx, tenant_id, subscription).await?;
    match snapshot_in(tx, tenant_id, subscription).await? {
        Some((due, _, now)) => close_snapshot_ended(biller, tx, &due, now, source).await,
        None => Ok(()),
    }
}

/// [`close_ended_in`] on a snapshot the caller read (and locked) in `tx`.
async fn close_snapshot_ended(
    biller: &Biller,
    tx: &mut db::Tx,
    due: &Due,
    now: DateTime<Utc>,
    source: &'static str,
) -> Result<(), Error> {
    let subscription = due.subscription_id;
    if due.current_period_end > now {
        return Ok(());
    }
    let max = biller.inner.config.catch_up_periods;
    let closings = close::close_behind(due, now, max)?;
    let last = &closings[closings.len() - 1];
    if !last.ends && last.next_end <= now {
        return Err(Error::SubscriptionPeriodMoved { subscription });
    }
    invoice::close_chain_in(biller, tx, &closings, source).await?;
    Ok(())
}

/// An active subscription's snapshot, whether its tenant invoices a cancel,
/// and the database's now, in the caller's transaction, the subscription's row locked
/// so that the cancel's compare-and-set in the same transaction holds.
async fn snapshot_in(
    tx: &mut db::Tx,
    tenant_id: &str,
    subscription: i64,
) -> Result<Option<(Due, bool, DateTime<Utc>)>, db::Error> {
    let row = tx
        .fetch_optional(
            sql(
                "SELECT s.id, s.tenant_id, s.status, s.billing_anchor, s.current_period_start, \
                        s.current_period_end, s.next_billing_at, s.collection_method, \
                        s.cancel_at_period_end, \
                        p.interval_unit, p.interval_count, p.amount, p.currency, \
                        COALESCE(ts.invoice_on_cancel, true) AS invoice_on_cancel, now() AS at \
                 FROM subscriptions s \
                 JOIN plans p ON p.tenant_id = s.tenant_id AND p.id = s.plan_id \
                 LEFT JOIN tenant_settings ts ON ts.tenant_id = s.tenant_id \
                 WHERE s.tenant_id = $1 AND s.id = $2 AND s.status = 'active' \
                 FOR UPDATE OF s",
            )
            .bind(tenant_id.to_owned())
            .bind(subscription),
        )
        .await?;
    row.map(|r| {
        Ok((
            crate::store::due(&r)?,
            r.try_get("invoice_on_cancel")?,
            r.try_get("at")?,
        ))
    })
    .transpose()
}

/// Cancel a trialing subscription now: nothing was used that is paid for,
/// so nothing is invoiced (as a provider cancels a trial), announced with
/// `subscription.canceled`; `false` when it is not trialing, or its trial
/// has ended (its paid time is invoiced by the cancel of the activated
/// subscription, docs/adr/0077).
async fn cancel_trial_in(
    tx: &mut db::Tx,
    tenant_id: &str,
    subscription: i64,
) -> Result<bool, Error> {
    let row = tx
        .fetch_optional(
            sql(
                "UPDATE subscriptions SET status = 'canceled', canceled_at = now(), \
                        updated_at = now() \
                 WHERE tenant_id = $1 AND id = $2 AND status = 'trialing' \
                   AND trial_end > now() \
                 RETURNING plan_id, trial_end",
            )
            .bind(tenant_id.to_owned())
            .bind(subscription),
        )
        .await?;
    let Some(row) = row else {
        return Ok(false);
    };
    let plan: i64 = row.try_get("plan_id").map_err(db::Error::from)?;
    let trial_end: DateTime<Utc> = row.try_get("trial_end").map_err(db::Error::from)?;
    let payload = serde_json::json!({
        "object": "subscription",
        "id": subscription,
        "status": "canceled",
        "plan": plan,
        "trial_end": trial_end.to_rfc3339(),
        "cancel_at_period_end": false,
    })
    .to_string();
    outbox::webhook::enqueue(tx, tenant_id, "subscription.canceled", &payload).await?;
    Ok(true)
}

/// Mark an active subscription to end with its period, announced with
/// `subscription.updated`; `false` when there is no such subscription. The
/// period is the one holding now: the periods that ended before it are
/// closed first, whole. Marked already, nothing is written or announced.
async fn cancel_at_period_end_in(
    biller: &Biller,
    tx: &mut db::Tx,
    tenant_id: &str,
    subscription: i64,
) -> Result<bool, Error> {
    // The snapshot locks the row for the update below.
    let Some((due, _, now)) = snapshot_in(tx, tenant_id, subscription).await? else {
        return Ok(false);
    };
    // Marked already: nothing changes, so nothing is written or announced
    // again (docs/adr/0135). The period that ended, if any, is its last, as
    // the tick will close it.
    if due.cancel_at_period_end {
        return Ok(true);
    }
    close_snapshot_ended(biller, tx, &due, now, "cancel").await?;
    let row = tx
        .fetch_optional(
            sql(
                "UPDATE subscriptions SET cancel_at_period_end = true, updated_at = now() \
                 WHERE tenant_id = $1 AND id = $2 AND status = 'active' \
                 RETURNING current_period_end",
            )
            .bind(tenant_id.to_owned())
            .bind(subscription),
        )
        .await?;
    let Some(row) = row else {
        return Ok(false);
    };
    let end: DateTime<Utc> = row.try_get("current_period_end").map_err(db::Error::from)?;
    let payload = serde_json::json!({
        "object": "subscription",
        "id": subscription,
        "status": "active",
        "cancel_at_period_end": true,
        "cancel_at": end.to_rfc3339(),
    })
    .to_string();
    outbox::webhook::enqueue(tx, tenant_id, "subscription.updated", &payload).await?;
    Ok(true)
}
