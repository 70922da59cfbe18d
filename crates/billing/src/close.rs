//! Closing a period: from the snapshot of a due subscription, the period that
//! follows and the invoice for the one that ended. Pure: no SQL, no I/O.
//!
//! Billing is in arrears: closing the period `[start, end)` invoices exactly
//! that period, and the next period runs from `end` to the next boundary of
//! the anchor's grid ([`crate::period::end_after`]).
//!
//! **Pro rata.** A period that is a whole period of the anchor's grid is
//! invoiced at the plan's amount. A partial one (it starts off the grid
//! because a trial ended or a plan changed mid-period, or it was truncated by
//! a plan change) is invoiced `amount × used / full`, where `full` is the
//! length of the grid period containing its start and `used` its own length,
//! both in milliseconds, **rounded half up to the minor unit**
//! ([`crate::period::pro_rata`]). A partial February of an anchor on the
//! 31st is measured against February's own length (28 or 29 days).

use chrono::{DateTime, Utc};

use crate::period::{self, Interval, Unit};

/// A due subscription as the funnel read it: the snapshot its closing proves.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Due {
    pub subscription_id: i64,
    pub tenant_id: String,
    pub status: String,
    pub billing_anchor: DateTime<Utc>,
    pub current_period_start: DateTime<Utc>,
    pub current_period_end: DateTime<Utc>,
    /// The watermark as read.
    pub next_billing_at: DateTime<Utc>,
    pub collection_method: String,
    pub interval_unit: String,
    pub interval_count: i32,
    /// Integer minor units of `currency`.
    pub amount: i64,
    pub currency: String,
    /// Whether the subscription ends after this period (proven by the closing).
    pub cancel_at_period_end: bool,
}

/// Why an invoice is made: the `reason` column and what else is announced.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Reason {
    /// A period ended (the tick).
    Period,
    /// A plan change truncated the period (`subscription.updated` too).
    PlanChange,
    /// A cancel truncated the period and ended the subscription.
    Cancel,
}

impl Reason {
    pub fn as_str(self) -> &'static str {
        match self {
            Reason::Period => "period",
            Reason::PlanChange => "plan_change",
            Reason::Cancel => "cancel",
        }
    }
}

/// What one closing writes, if its snapshot still holds.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Closing {
    pub subscription_id: i64,
    pub tenant_id: String,
    /// The snapshot proven per row: (status, period start, watermark).
    pub status: String,
    pub period_start: DateTime<Utc>,
    pub watermark: DateTime<Utc>,
    /// The period that follows; its end is the new watermark.
    pub next_start: DateTime<Utc>,
    pub next_end: DateTime<Utc>,
    /// The invoice for the period that ended: `[period_start, next_start)`.
    pub amount: i64,
    pub currency: String,
    pub collection_method: String,
    /// The plan the next period is on, when it changes (a plan change);
    /// `None` keeps the subscription's plan.
    pub plan_id: Option<i64>,
    /// The `cancel_at_period_end` read, proven by the compare-and-set.
    pub cancel_at_period_end: bool,
    pub reason: Reason,
    /// The subscription ends with this closing (a cancel, or a period
    /// closed under `cancel_at_period_end`).
    pub ends: bool,
    /// Whether `[period_start, next_start)` is invoiced (a cancel the tenant
    /// set not to invoice, or one at the period's very start, is not).
    pub invoiced: bool,
}

/// A plan a subscription changes to.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Plan {
    pub id: i64,
    pub interval_unit: String,
    pub interval_count: i32,
    /// Integer minor units of `currency`.
    pub amount: i64,
    pub currency: String,
}

/// Why a due subscription cannot be closed. Billing treats these as corrupt
/// rows: the tick raises them as a panic under the guard (see `tick`).
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum Unbillable {
    #[error("plan interval `{count} {unit}` is not an interval")]
    Interval { unit: String, count: i32 },
    #[error("the period after {0} ends past the representable calendar")]
    OutOfRange(DateTime<Utc>),
}

/// The closing of `due`'s current period.
///
/// # Errors
/// [`Unbillable`] for an interval the schema should have refused, or a next
/// period end past chrono's range (about year 262 000).
pub fn close(due: &Due) -> Result<Closing, Unbillable> {
    let interval = interval(&due.interval_unit, due.interval_count)?;
    let next_start = due.current_period_end;
    let next_end = period::end_after(due.billing_anchor, interval, next_start)
        .ok_or(Unbillable::OutOfRange(next_start))?;
    let amount = amount_for(due, interval, due.current_period_start, next_start)?;
    Ok(Closing {
        subscription_id: due.subscription_id,
        tenant_id: due.tenant_id.clone(),
        status: due.status.clone(),
        period_start: due.current_period_start,
        watermark: due.next_billing_at,
        next_start,
        next_end,
        amount,
        currency: due.currency.clone(),
        collection_method: due.collection_method.clone(),
        plan_id: None,
        cancel_at_period_end: due.cancel_at_period_end,
        reason: Reason::Period,
        ends: due.cancel_at_period_end,
        invoiced: true,
    })
}

/// The periods a subscription is behind, closed one after another from
/// `due`, while each next watermark has passed at `now`, at most `max`:
/// catch-up after an outage, or an hourly plan under a slower tick. The
/// chain stops after a period that ends the subscription.
///
/// # Errors
/// [`Unbillable`] for the first period that cannot be computed (the whole
/// chain is refused: the subscription is left out, as for one period).
pub fn close_behind(due: &Due, now: DateTime<Utc>, max: usize) -> Result<Vec<Closing>, Unbillable> {
    let mut chain = vec![close(due)?];
    while chain.len() < max.max(1) {
        let last = &chain[chain.len() - 1];
        if last.ends || last.next_end > now {
            break;
        }
        let next = Due {
            current_period_start: last.next_start,
            current_period_end: last.next_end,
            next_billing_at: last.next_end,
            ..due.clone()
        };
        chain.push(close(&next)?);
    }
    Ok(chain)
}

/// A cancel at `at`: the current period truncated to `[start, at)` and, when
/// `invoice` says so and any of it was used, invoiced pro rata; the
/// subscription ends.
///
/// # Errors
/// [`Unbillable`] for an interval that is not one, or a period out of range.
pub fn cancel(due: &Due, at: DateTime<Utc>, invoice: bool) -> Result<Closing, Unbillable> {
    let interval = interval(&due.interval_unit, due.interval_count)?;
    let used = at > due.current_period_start;
    let amount = if used {
        amount_for(due, interval, due.current_period_start, at)?
    } else {
        0
    };
    Ok(Closing {
        subscription_id: due.subscription_id,
        tenant_id: due.tenant_id.clone(),
        status: due.status.clone(),
        period_start: due.current_period_start,
        watermark: due.next_billing_at,
        next_start: at,
        next_end: due.current_period_end.max(at),
        amount,
        currency: due.currency.clone(),
        collection_method: due.collection_method.clone(),
        plan_id: None,
        cancel_at_period_end: due.cancel_at_period_end,
        reason: Reason::Cancel,
        ends: true,
        invoiced: invoice && used,
    })
}

/// A cancel now of a subscription that may be behind (docs/adr/0077): the
/// periods that ended before `now` closed as the tick would close them
/// ([`close_behind`], at most `max`), then the period holding `now`
/// truncated there by [`cancel`]. Not behind: [`cancel`] at `now`, held to
/// the current period. A period that ends the subscription
/// (`cancel_at_period_end`) ends the chain, with no cancel after it.
///
/// # Errors
/// [`Unbillable`] as [`close_behind`] and [`cancel`]; `Ok(None)` when `now`
/// is still more than `max` periods ahead (the tick catches up first).
pub fn cancel_behind(
    due: &Due,
    now: DateTime<Utc>,
    invoice: bool,
    max: usize,
) -> Result<Option<Vec<Closing>>, Unbillable> {
    behind_then(due, now, max, |d, at| cancel(d, at, invoice))
}

/// A plan change now of a subscription that may be behind (docs/adr/0088):
/// as [`cancel_behind`], with [`truncate`] onto `plan` in place of the
/// cancel. `Ok(None)` also when a period that ends the subscription
/// (`cancel_at_period_end`) ended at or before `now`: there is no period
/// left to change.
///
/// # Errors
/// [`Unbillable`] as [`close_behind`] and [`truncate`].
pub fn truncate_behind(
    due: &Due,
    plan: &Plan,
    now: DateTime<Utc>,
    max: usize,
) -> Result<Option<Vec<Closing>>, Unbillable> {
    // Its period set to end it has ended, at `now` or before.
    if due.cancel_at_period_end && now >= due.current_period_end {
        return Ok(None);
    }
    // So no closing of the chain ends the subscription: it ends in the change.
    behind_then(due, now, max, |d, at| truncate(d, plan, at))
}

/// The periods `due` is behind at `now` closed ([`close_behind`], at most
/// `max`), then `at_now` for the period holding `now`, at `now`; not behind,
/// `at_now` for the current period at `now`, never before its start. A chain
/// that ends the subscription is returned as it is, without `at_now`.
/// `Ok(None)` when `now` is more than `max` periods ahead.
fn behind_then(
    due: &Due,
    now: DateTime<Utc>,
    max: usize,
    at_now: impl FnOnce(&Due, DateTime<Utc>) -> Result<Closing, Unbillable>,
) -> Result<Option<Vec<Closing>>, Unbillable> {
    if now <= due.current_period_end {
        let at = now.max(due.current_period_start);
        return Ok(Some(vec![at_now(due, at)?]));
    }
    let mut chain = close_behind(due, now, max)?;
    let last = &chain[chain.len() - 1];
    if last.ends {
        return Ok(Some(chain));
    }
    if last.next_end < now {
        return Ok(None);
    }
    let holding_now = Due {
        current_period_start: last.next_start,
        current_period_end: last.next_end,
        next_billing_at: last.next_end,
        ..due.clone()
    };
    chain.push(at_now(&holding_now, now)?);
    Ok(Some(chain))
}

/// A plan change at `at`: the current period truncated to `[start, at)` and
/// invoiced pro rata on the old plan; the next period `[at, end)` on `plan`,
/// ending at the next boundary of the anchor's grid for `plan`'s interval.
///
/// # Errors
/// [`Unbillable`] for an interval that is not one, or a period end out of range.
pub fn truncate(due: &Due, plan: &Plan, at: DateTime<Utc>) -> Result<Closing, Unbillable> {
    let old = interval(&due.interval_unit, due.interval_count)?;
    let new = interval(&plan.interval_unit, plan.interval_count)?;
    let next_end =
        period::end_after(due.billing_anchor, new, at).ok_or(Unbillable::OutOfRange(at))?;
    let amount = amount_for(due, old, due.current_period_start, at)?;
    Ok(Closing {
        subscription_id: due.subscription_id,
        tenant_id: due.tenant_id.clone(),
        status: due.status.clone(),
        period_start: due.current_period_start,
        watermark: due.next_billing_at,
        next_start: at,
        next_end,
        amount,
        currency: due.currency.clone(),
        collection_method: due.collection_method.clone(),
        plan_id: Some(plan.id),
        cancel_at_period_end: due.cancel_at_period_end,
        reason: Reason::PlanChange,
        ends: false,
        invoiced: at > due.current_period_start,
    })
}

pub(crate) fn interval(unit: &str, count: i32) -> Result<Interval, Unbillable> {
    let bad = || Unbillable::Interval {
        unit: unit.to_owned(),
        count,
    };
    Ok(Interval {
        unit: Unit::parse(unit).ok_or_else(bad)?,
        count: u32::try_from(count)
            .ok()
            .filter(|c| *c > 0)
            .ok_or_else(bad)?,
    })
}

/// The invoice amount of `[start, end)` on `due`'s plan: whole or pro rata,
/// in the steps its currency is charged in (docs/adr/0086).
fn amount_for(
    due: &Due,
    interval: Interval,
    start: DateTime<Utc>,
    end: DateTime<Utc>,
) -> Result<i64, Unbillable> {
    let (b, b_next) = period::containing(due.billing_anchor, interval, start)
        .ok_or(Unbillable::OutOfRange(start))?;
    if start == b && end >= b_next {
        return Ok(due.amount);
    }
    let step = crate::provider::amount_step(&due.currency);
    Ok(period::pro_rata_in_steps(
        due.amount,
        end - start,
        b_next - b,
        step,
    ))
}

#[cfg(test)]
mod tests;
