//! Closing a period: from the snapshot of a due subscription, the period that
//! follows and the invoice for the one that ended. Pure: no SQL, no I/O.
//!
//! Billing is in arrears: closing the period `[start, end)` invoices exactly
//! that period, at the plan's amount, and the next period runs from `end` to
//! the next boundary of the anchor's grid ([`crate::period::end_after`]).

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
    let bad = || Unbillable::Interval {
        unit: due.interval_unit.clone(),
        count: due.interval_count,
    };
    let interval = Interval {
        unit: Unit::parse(&due.interval_unit).ok_or_else(bad)?,
        count: u32::try_from(due.interval_count)
            .ok()
            .filter(|c| *c > 0)
            .ok_or_else(bad)?,
    };
    let next_start = due.current_period_end;
    let next_end = period::end_after(due.billing_anchor, interval, next_start)
        .ok_or(Unbillable::OutOfRange(next_start))?;
    Ok(Closing {
        subscription_id: due.subscription_id,
        tenant_id: due.tenant_id.clone(),
        status: due.status.clone(),
        period_start: due.current_period_start,
        watermark: due.next_billing_at,
        next_start,
        next_end,
        amount: due.amount,
        currency: due.currency.clone(),
        collection_method: due.collection_method.clone(),
    })
}

#[cfg(test)]
mod tests {
    use super::*;
    use chrono::TimeZone;

    fn at(y: i32, m: u32, d: u32) -> DateTime<Utc> {
        Utc.with_ymd_and_hms(y, m, d, 0, 0, 0).unwrap()
    }

    fn due(anchor: DateTime<Utc>, start: DateTime<Utc>, end: DateTime<Utc>) -> Due {
        Due {
            subscription_id: 7,
            tenant_id: "t".into(),
            status: "active".into(),
            billing_anchor: anchor,
            current_period_start: start,
            current_period_end: end,
            next_billing_at: end,
            collection_method: "automatic".into(),
            interval_unit: "month".into(),
            interval_count: 1,
            amount: 1200,
            currency: "EUR".into(),
        }
    }

    #[test]
    fn closing_invoices_the_ended_period_and_opens_the_next_on_the_anchors_grid() {
        let cases = [
            // (anchor, current start, current end) → (next start, next end)
            (
                at(2024, 1, 31),
                at(2024, 1, 31),
                at(2024, 2, 29),
                at(2024, 3, 31),
            ),
            (
                at(2024, 1, 31),
                at(2024, 2, 29),
                at(2024, 3, 31),
                at(2024, 4, 30),
            ),
            (
                at(2025, 1, 31),
                at(2025, 1, 31),
                at(2025, 2, 28),
                at(2025, 3, 31),
            ),
        ];
        for (anchor, start, end, next_end) in cases {
            let c = close(&due(anchor, start, end)).unwrap();
            assert_eq!(
                (c.period_start, c.next_start, c.next_end),
                (start, end, next_end)
            );
            assert_eq!(
                (c.watermark, c.amount, c.currency.as_str()),
                (end, 1200, "EUR")
            );
        }
    }

    #[test]
    fn an_impossible_row_is_unbillable_not_a_wrong_invoice() {
        let mut d = due(at(2024, 1, 1), at(2024, 1, 1), at(2024, 2, 1));
        d.interval_count = 0;
        assert!(matches!(close(&d), Err(Unbillable::Interval { .. })));
        d.interval_count = 1;
        d.interval_unit = "fortnight".into();
        assert!(matches!(close(&d), Err(Unbillable::Interval { .. })));
        let far = at(262_000, 1, 1);
        let mut d = due(far, far, far + chrono::TimeDelta::days(1));
        d.interval_unit = "year".into();
        d.interval_count = 1000;
        assert!(matches!(close(&d), Err(Unbillable::OutOfRange(_))));
    }
}
