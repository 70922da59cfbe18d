//! A tick ends with the backlog gauges' read at most once per
//! `backlog_read_every` (docs/adr/0138): the read counts every pending
//! delivery, however few the tick took.

use std::time::Duration;

use testbed::TestDb;
use testbed::receiver::{Receiver, Reply};
use webhook_delivery::WorkerConfig;

use crate::{config, endpoint, events, series, tick, worker};

const STAMP: &str = "hardcount_backlog_read_timestamp_seconds";
const ROLE: &str = "role=\"webhook_delivery\"";
const PENDING: &str = "hardcount_webhook_deliveries_pending";

/// Each delivery is answered 429 with `Retry-After: 120`: it stays pending,
/// not due, so the pending count grows by what each tick attempted. With the
/// delivery tick's end reading without asking (mutation
/// `delivery_backlog_read_ungated`) the second tick reads 3 and stamps again,
/// and this fails.
#[tokio::test]
async fn a_tick_within_the_interval_leaves_the_last_read_standing() {
    let t = TestDb::new().await;
    let rx =
        Receiver::start(|_| Reply::WithHeaders(429, vec![("retry-after", "120".into())])).await;
    endpoint(&t, "tenant_a", &rx.url()).await;
    events(&t.db, "tenant_a", 1).await;
    let hourly = WorkerConfig {
        backlog_read_every: Duration::from_secs(3600),
        ..config()
    };
    let (w, metrics) = worker(&t.db, hourly);
    tick(&t.db, &w).await;
    assert_eq!(series(&metrics, PENDING, ""), Some(1.0));
    let read = series(&metrics, STAMP, ROLE).expect("the first tick reads and stamps");

    events(&t.db, "tenant_a", 2).await;
    let report = tick(&t.db, &w).await;
    assert_eq!(report.retried, 2, "{report:?}");
    assert_eq!(series(&metrics, PENDING, ""), Some(1.0));
    assert_eq!(series(&metrics, STAMP, ROLE), Some(read));

    // A worker that reads at every tick's end reads again at its second.
    let every_tick = WorkerConfig {
        backlog_read_every: Duration::ZERO,
        ..config()
    };
    let (w, metrics) = worker(&t.db, every_tick);
    tick(&t.db, &w).await;
    assert_eq!(series(&metrics, PENDING, ""), Some(3.0));
    events(&t.db, "tenant_a", 1).await;
    tick(&t.db, &w).await;
    assert_eq!(series(&metrics, PENDING, ""), Some(4.0));
}
