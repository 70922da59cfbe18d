//! Periods through the database: month-end anchors and leap years, billed by
//! real ticks from a subscription far behind until it has caught up.

use billing::period::{Interval, Unit, boundary};
use chrono::{DateTime, TimeZone, Utc};
use testbed::TestDb;

use crate::{biller, config, invoices, period, plan, subscription, tick};

fn at(y: i32, m: u32, d: u32, h: u32) -> DateTime<Utc> {
    Utc.with_ymd_and_hms(y, m, d, h, 0, 0).unwrap()
}

/// Tick until nothing is due, at most `ticks` ticks.
async fn catch_up(t: &TestDb, b: &billing::Biller, ticks: usize) {
    for _ in 0..ticks {
        if tick(&t.db, b).await.claimed == 0 {
            return;
        }
    }
    panic!("still due after {ticks} ticks");
}

/// (unit, count, anchor, invoices the first periods must have)
#[tokio::test]
async fn month_end_anchors_and_leap_years_bill_the_right_periods() {
    let t = TestDb::new().await;
    let cases = [
        (
            "month",
            1,
            at(2024, 1, 31, 10),
            vec![
                (at(2024, 1, 31, 10), at(2024, 2, 29, 10)),
                (at(2024, 2, 29, 10), at(2024, 3, 31, 10)),
                (at(2024, 3, 31, 10), at(2024, 4, 30, 10)),
                (at(2024, 4, 30, 10), at(2024, 5, 31, 10)),
            ],
        ),
        (
            "month",
            1,
            at(2025, 1, 31, 0),
            vec![
                (at(2025, 1, 31, 0), at(2025, 2, 28, 0)),
                (at(2025, 2, 28, 0), at(2025, 3, 31, 0)),
            ],
        ),
        (
            "month",
            3,
            at(2023, 11, 30, 0),
            vec![
                (at(2023, 11, 30, 0), at(2024, 2, 29, 0)),
                (at(2024, 2, 29, 0), at(2024, 5, 30, 0)),
            ],
        ),
        (
            "year",
            1,
            at(2024, 2, 29, 12),
            vec![
                (at(2024, 2, 29, 12), at(2025, 2, 28, 12)),
                (at(2025, 2, 28, 12), at(2026, 2, 28, 12)),
            ],
        ),
        (
            "week",
            1,
            at(2024, 2, 26, 0),
            vec![(at(2024, 2, 26, 0), at(2024, 3, 4, 0))],
        ),
    ];
    let mut subs = Vec::new();
    for (unit, count, anchor, _) in &cases {
        let p = plan(&t.db, "tenant_a", unit, *count, 999).await;
        let interval = Interval {
            unit: Unit::parse(unit).unwrap(),
            count: u32::try_from(*count).unwrap(),
        };
        let first_end = boundary(*anchor, interval, 1).unwrap();
        subs.push(subscription(&t.db, "tenant_a", p, *anchor, *anchor, first_end).await);
    }
    // Batches of one are always full, so one tick closes period after period
    // until nothing is due.
    let (b, _) = biller(
        &t.db,
        billing::BillingConfig {
            batch_size: 1,
            ..config()
        },
    );
    catch_up(&t, &b, 5).await;
    let now = Utc::now();
    let all = invoices(&t.db).await;
    for ((unit, count, anchor, first), sub) in cases.iter().zip(&subs) {
        let mine: Vec<_> = all.iter().filter(|i| i.subscription == *sub).collect();
        let got: Vec<_> = mine.iter().map(|i| (i.start, i.end)).collect();
        assert_eq!(
            &got[..first.len()],
            &first[..],
            "{unit} ×{count} from {anchor}"
        );
        // Every period up to now, each on the anchor's grid, none twice, none skipped.
        let interval = Interval {
            unit: Unit::parse(unit).unwrap(),
            count: u32::try_from(*count).unwrap(),
        };
        let expected: Vec<_> = (0..)
            .map(|k| {
                (
                    boundary(*anchor, interval, k).unwrap(),
                    boundary(*anchor, interval, k + 1).unwrap(),
                )
            })
            .take_while(|(_, end)| *end <= now)
            .collect();
        assert_eq!(got, expected, "{unit} ×{count} from {anchor}");
        assert!(mine.iter().all(|i| i.amount == 999));
        // The open period is the next one on the grid, and it is not due.
        let (start, end, watermark) = period(&t.db, *sub).await;
        assert_eq!(start, expected.last().unwrap().1);
        assert_eq!(
            end,
            boundary(*anchor, interval, expected.len() as u32 + 1).unwrap()
        );
        assert_eq!(watermark, end);
        assert!(watermark > now);
    }
}
