//! The backlog gauges' read at a tick's end: stamped when it succeeds,
//! counted when it fails (docs/adr/0137).

use testbed::TestDb;

use crate::{biller, config, due_monthly, tick};

const ERRORS: &str = "hardcount_backlog_read_errors_total{role=\"billing\"} ";
const STAMP: &str = "hardcount_backlog_read_timestamp_seconds{role=\"billing\"} ";

fn value<'a>(text: &'a str, series: &str) -> Option<&'a str> {
    text.lines().find_map(|l| l.strip_prefix(series))
}

/// A billing tick whose backlog read fails (the app role lost its grant on
/// the review view the read counts) still bills and completes, counts the
/// failure in `hardcount_backlog_read_errors_total{role="billing"}` (which
/// `HardcountBacklogUnread` reads) and stamps no read; with the grant back,
/// the next tick's read is stamped and nothing more is counted. Mutation
/// `backlog_read_failure_counted` drops billing's count and is seen failing
/// here.
#[tokio::test]
async fn a_failed_backlog_read_is_counted_and_not_stamped() {
    let t = TestDb::new().await;
    due_monthly(&t.db, "tenant_a", 2).await;
    let mut su = t.superuser().await;
    sqlx::raw_sql("REVOKE SELECT ON payment_attempts_needing_review FROM hardcount_app")
        .execute(&mut su)
        .await
        .unwrap();
    let (b, metrics) = biller(&t.db, config());
    let report = tick(&t.db, &b).await;
    assert_eq!(report.tally.invoiced, 2, "{report:?}");
    let text = metrics.render();
    assert_eq!(value(&text, ERRORS), Some("1"), "{text}");
    assert_eq!(value(&text, STAMP), None, "{text}");

    sqlx::raw_sql("GRANT SELECT ON payment_attempts_needing_review TO hardcount_app")
        .execute(&mut su)
        .await
        .unwrap();
    tick(&t.db, &b).await;
    let text = metrics.render();
    assert_eq!(value(&text, ERRORS), Some("1"), "{text}");
    assert!(value(&text, STAMP).is_some(), "{text}");
}
