//! Billing periods: where each period of a subscription ends. Pure: no SQL, no I/O.
//!
//! Every boundary is computed from the subscription's **anchor**, in UTC, as
//! `anchor + k × count × unit` for k = 0, 1, 2, … — never by adding one interval
//! to the previous boundary. For minutes, hours, days and weeks a unit is a fixed length
//! (60 s, 3600 s, 86 400 s, 604 800 s; UTC has no daylight saving). For months and
//! years the date moves by whole calendar months, and a day that does not exist
//! in the target month is clamped to its last day, keeping the time of day:
//!
//! ```text
//!  anchor 2024-01-31 10:00, monthly:  Jan 31 → Feb 29 → Mar 31 → Apr 30 → May 31
//!  (chaining would drift:             Jan 31 → Feb 29 → Mar 29 → Apr 29 → …)
//!  anchor 2024-02-29, yearly:         2024-02-29 → 2025-02-28 → 2026-02-28 → 2028-02-29
//! ```
//!
//! A boundary past chrono's range (about year 262 000) is `None`.

use chrono::{DateTime, Datelike, Months, TimeDelta, Utc};

/// The unit of a plan's interval.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Unit {
    /// For short demo plans (the local run); 60 s.
    Minute,
    Hour,
    Day,
    Week,
    Month,
    Year,
}

impl Unit {
    /// The unit as the `plans.interval_unit` column spells it.
    pub fn parse(s: &str) -> Option<Unit> {
        Some(match s {
            "minute" => Unit::Minute,
            "hour" => Unit::Hour,
            "day" => Unit::Day,
            "week" => Unit::Week,
            "month" => Unit::Month,
            "year" => Unit::Year,
            _ => return None,
        })
    }

    /// Whole months per unit, for the calendar units.
    fn months(self) -> Option<u32> {
        match self {
            Unit::Month => Some(1),
            Unit::Year => Some(12),
            Unit::Minute | Unit::Hour | Unit::Day | Unit::Week => None,
        }
    }

    /// Seconds per unit, for the fixed-length units.
    fn seconds(self) -> Option<i64> {
        match self {
            Unit::Minute => Some(60),
            Unit::Hour => Some(3600),
            Unit::Day => Some(86_400),
            Unit::Week => Some(7 * 86_400),
            Unit::Month | Unit::Year => None,
        }
    }
}

/// A plan's interval: `count` × `unit`, `count` ≥ 1.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Interval {
    pub unit: Unit,
    pub count: u32,
}

/// The k-th boundary from `anchor`: `anchor + k × interval` (k = 0 is the anchor).
/// `None` when it is past chrono's range or `interval.count` is 0.
pub fn boundary(anchor: DateTime<Utc>, interval: Interval, k: u32) -> Option<DateTime<Utc>> {
    if interval.count == 0 {
        return None;
    }
    let steps = k.checked_mul(interval.count)?;
    if let Some(months) = interval.unit.months() {
        anchor.checked_add_months(Months::new(steps.checked_mul(months)?))
    } else {
        let secs = interval.unit.seconds()?.checked_mul(i64::from(steps))?;
        anchor.checked_add_signed(TimeDelta::try_seconds(secs)?)
    }
}

/// The first boundary of `anchor`'s grid strictly after `after`: where a period
/// that starts at `after` ends. `None` when it is past chrono's range.
pub fn end_after(
    anchor: DateTime<Utc>,
    interval: Interval,
    after: DateTime<Utc>,
) -> Option<DateTime<Utc>> {
    boundary(anchor, interval, index_after(anchor, interval, after)?)
}

/// The k of [`end_after`]: the least k with `boundary(k) > after`.
fn index_after(anchor: DateTime<Utc>, interval: Interval, after: DateTime<Utc>) -> Option<u32> {
    if interval.count == 0 {
        return None;
    }
    // Estimate k from below, then step: the estimate is at most one or two short.
    let estimate: i64 = if after <= anchor {
        0
    } else if let Some(months) = interval.unit.months() {
        let elapsed = i64::from(after.year() - anchor.year()) * 12 + i64::from(after.month0())
            - i64::from(anchor.month0());
        elapsed / i64::from(months * interval.count) - 1
    } else {
        let unit = interval.unit.seconds()? * i64::from(interval.count);
        (after - anchor).num_seconds() / unit - 1
    };
    let mut k = u32::try_from(estimate.max(0)).ok()?;
    loop {
        if boundary(anchor, interval, k)? > after {
            return Some(k);
        }
        k = k.checked_add(1)?;
    }
}

/// The period of `anchor`'s grid that contains `at`: `(b_k, b_k+1)` with
/// `b_k <= at < b_k+1`. Before the anchor it is the grid's first period.
/// `None` when a boundary is past chrono's range.
pub fn containing(
    anchor: DateTime<Utc>,
    interval: Interval,
    at: DateTime<Utc>,
) -> Option<(DateTime<Utc>, DateTime<Utc>)> {
    let k = index_after(anchor, interval, at)?.max(1);
    Some((
        boundary(anchor, interval, k - 1)?,
        boundary(anchor, interval, k)?,
    ))
}

/// `amount` × `used` / `full`, in integer minor units, **rounded half up**
/// (half a minor unit or more rounds up; never a float). `used` is clamped
/// to `[0, full]`; a zero or negative `full` charges the whole amount.
pub fn pro_rata(amount: i64, used: TimeDelta, full: TimeDelta) -> i64 {
    pro_rata_in_steps(amount, used, full, 1)
}

/// [`pro_rata`] rounded half up to a multiple of `step` minor units (1:
/// the minor unit itself): what a provider that takes a currency only in
/// steps of `step` can charge (`provider::amount_step`, docs/adr/0086).
/// A `step` below 1 is 1.
pub fn pro_rata_in_steps(amount: i64, used: TimeDelta, full: TimeDelta, step: i64) -> i64 {
    let full = i128::from(full.num_milliseconds());
    if full <= 0 {
        return amount;
    }
    let used = i128::from(used.num_milliseconds()).clamp(0, full);
    let (amount, step) = (i128::from(amount), i128::from(step.max(1)));
    let rounded = (2 * amount * used + full * step) / (2 * full * step) * step;
    i64::try_from(rounded).unwrap_or(i64::MAX)
}

#[cfg(test)]
mod tests {
    use super::*;
    use chrono::TimeZone;

    fn at(y: i32, m: u32, d: u32, h: u32) -> DateTime<Utc> {
        Utc.with_ymd_and_hms(y, m, d, h, 0, 0).unwrap()
    }

    fn every(count: u32, unit: Unit) -> Interval {
        Interval { unit, count }
    }

    /// (anchor, interval, k, the k-th boundary)
    #[test]
    fn boundaries_follow_the_anchor_and_clamp_at_month_ends() {
        let cases = [
            // An anchor on the 31st: clamped in short months, back on the 31st after.
            (
                at(2024, 1, 31, 10),
                every(1, Unit::Month),
                1,
                at(2024, 2, 29, 10),
            ),
            (
                at(2024, 1, 31, 10),
                every(1, Unit::Month),
                2,
                at(2024, 3, 31, 10),
            ),
            (
                at(2024, 1, 31, 10),
                every(1, Unit::Month),
                3,
                at(2024, 4, 30, 10),
            ),
            (
                at(2024, 1, 31, 10),
                every(1, Unit::Month),
                4,
                at(2024, 5, 31, 10),
            ),
            (
                at(2025, 1, 31, 0),
                every(1, Unit::Month),
                1,
                at(2025, 2, 28, 0),
            ),
            (
                at(2025, 1, 31, 0),
                every(1, Unit::Month),
                2,
                at(2025, 3, 31, 0),
            ),
            (
                at(2025, 1, 30, 0),
                every(1, Unit::Month),
                1,
                at(2025, 2, 28, 0),
            ),
            (
                at(2025, 1, 30, 0),
                every(1, Unit::Month),
                2,
                at(2025, 3, 30, 0),
            ),
            (
                at(2025, 8, 31, 0),
                every(1, Unit::Month),
                1,
                at(2025, 9, 30, 0),
            ),
            (
                at(2025, 8, 31, 0),
                every(3, Unit::Month),
                2,
                at(2026, 2, 28, 0),
            ),
            (
                at(2025, 12, 31, 0),
                every(2, Unit::Month),
                1,
                at(2026, 2, 28, 0),
            ),
            (
                at(2027, 12, 31, 0),
                every(2, Unit::Month),
                1,
                at(2028, 2, 29, 0),
            ),
            // Leap days: yearly from Feb 29 clamps to Feb 28, returns on leap years.
            (
                at(2024, 2, 29, 0),
                every(1, Unit::Year),
                1,
                at(2025, 2, 28, 0),
            ),
            (
                at(2024, 2, 29, 0),
                every(1, Unit::Year),
                4,
                at(2028, 2, 29, 0),
            ),
            (
                at(2024, 2, 29, 0),
                every(1, Unit::Year),
                76,
                at(2100, 2, 28, 0),
            ),
            (
                at(2096, 2, 29, 0),
                every(2, Unit::Year),
                2,
                at(2100, 2, 28, 0),
            ),
            (
                at(2000, 2, 29, 0),
                every(1, Unit::Month),
                12,
                at(2001, 2, 28, 0),
            ),
            // Fixed lengths: across a leap day and a year end, no calendar.
            (
                at(2024, 2, 28, 12),
                every(1, Unit::Day),
                1,
                at(2024, 2, 29, 12),
            ),
            (
                at(2024, 2, 28, 12),
                every(1, Unit::Day),
                2,
                at(2024, 3, 1, 12),
            ),
            (
                at(2024, 12, 31, 23),
                every(1, Unit::Hour),
                1,
                at(2025, 1, 1, 0),
            ),
            (
                at(2024, 12, 31, 23),
                every(6, Unit::Hour),
                1,
                at(2025, 1, 1, 5),
            ),
            (
                at(2024, 2, 26, 0),
                every(1, Unit::Week),
                1,
                at(2024, 3, 4, 0),
            ),
            (
                at(2024, 1, 1, 0),
                every(2, Unit::Week),
                26,
                at(2024, 12, 30, 0),
            ),
            // k = 0 is the anchor itself.
            (
                at(2024, 1, 31, 10),
                every(1, Unit::Month),
                0,
                at(2024, 1, 31, 10),
            ),
        ];
        for (anchor, interval, k, expected) in cases {
            assert_eq!(
                boundary(anchor, interval, k),
                Some(expected),
                "{anchor} + {k} × {interval:?}"
            );
        }
    }

    /// (anchor, interval, a period start, where that period ends)
    #[test]
    fn a_period_ends_at_the_next_boundary_of_the_anchors_grid() {
        let m = every(1, Unit::Month);
        let cases = [
            // From a clamped boundary, the next one is the anchor's day again.
            (
                at(2024, 1, 31, 10),
                m,
                at(2024, 2, 29, 10),
                at(2024, 3, 31, 10),
            ),
            (
                at(2025, 1, 31, 10),
                m,
                at(2025, 2, 28, 10),
                at(2025, 3, 31, 10),
            ),
            (
                at(2024, 1, 31, 10),
                m,
                at(2024, 1, 31, 10),
                at(2024, 2, 29, 10),
            ),
            // A start between boundaries (a truncated period) ends on the grid.
            (
                at(2024, 1, 31, 10),
                m,
                at(2024, 3, 5, 0),
                at(2024, 3, 31, 10),
            ),
            (
                at(2024, 1, 31, 10),
                m,
                at(2024, 3, 31, 9),
                at(2024, 3, 31, 10),
            ),
            (
                at(2024, 1, 31, 10),
                m,
                at(2024, 3, 31, 10),
                at(2024, 4, 30, 10),
            ),
            // Far from the anchor: the estimate does not overshoot.
            (
                at(2000, 1, 31, 0),
                m,
                at(2099, 12, 31, 0),
                at(2100, 1, 31, 0),
            ),
            (
                at(2000, 1, 31, 0),
                m,
                at(2100, 2, 27, 0),
                at(2100, 2, 28, 0),
            ),
            (
                at(2000, 2, 29, 0),
                every(1, Unit::Year),
                at(2099, 6, 1, 0),
                at(2100, 2, 28, 0),
            ),
            (
                at(2024, 1, 1, 0),
                every(1, Unit::Hour),
                at(2024, 6, 1, 0),
                at(2024, 6, 1, 1),
            ),
            (
                at(2024, 1, 1, 0),
                every(1, Unit::Hour),
                at(2024, 6, 1, 0) + TimeDelta::seconds(1),
                at(2024, 6, 1, 1),
            ),
            (
                at(2024, 1, 1, 0),
                every(3, Unit::Day),
                at(2024, 1, 5, 0),
                at(2024, 1, 7, 0),
            ),
            // A start before the anchor ends at the anchor.
            (
                at(2024, 1, 31, 10),
                m,
                at(2024, 1, 1, 0),
                at(2024, 1, 31, 10),
            ),
        ];
        for (anchor, interval, start, expected) in cases {
            assert_eq!(
                end_after(anchor, interval, start),
                Some(expected),
                "anchor {anchor}, {interval:?}, start {start}"
            );
        }
    }

    #[test]
    fn chaining_boundaries_agrees_with_the_anchor_for_long_runs() {
        // Walking period by period through end_after gives the anchor's grid.
        for (anchor, interval) in [
            (at(2024, 1, 31, 10), every(1, Unit::Month)),
            (at(2023, 3, 31, 0), every(5, Unit::Month)),
            (at(2024, 2, 29, 0), every(1, Unit::Year)),
            (at(2024, 2, 29, 7), every(9, Unit::Hour)),
        ] {
            let mut start = anchor;
            for k in 1..=300 {
                let end = end_after(anchor, interval, start).unwrap();
                assert_eq!(Some(end), boundary(anchor, interval, k), "{anchor} k={k}");
                start = end;
            }
        }
    }

    #[test]
    fn out_of_range_and_zero_counts_are_none_not_panics() {
        let far = at(262_000, 1, 1, 0);
        assert_eq!(boundary(far, every(1000, Unit::Year), 1), None);
        assert_eq!(end_after(far, every(1000, Unit::Year), far), None);
        assert_eq!(boundary(at(2024, 1, 1, 0), every(0, Unit::Day), 1), None);
        assert_eq!(
            boundary(at(2024, 1, 1, 0), every(1, Unit::Day), u32::MAX),
            None
        );
        assert_eq!(Unit::parse("fortnight"), None);
        assert_eq!(Unit::parse("month"), Some(Unit::Month));
    }
}
