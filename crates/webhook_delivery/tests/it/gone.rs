//! A 410 Gone turns its endpoint off: the delivery dead, the endpoint's other
//! pending deliveries dead without a request, and new events skipping it;
//! but only while the endpoint still has the address that answered
//! (docs/adr/0112).

use std::time::Duration;

use testbed::TestDb;
use testbed::receiver::{Receiver, Reply};
use webhook_delivery::WorkerConfig;

use crate::{config, deliveries, endpoint, endpoint_state, events, outcomes, series, tick, worker};

/// 410 Gone: the delivery is dead, the endpoint disabled with the reason, and
/// the endpoint's other pending deliveries die without a request.
#[tokio::test]
async fn a_410_kills_the_delivery_and_disables_the_endpoint() {
    let t = TestDb::new().await;
    let rx = Receiver::answering(410).await;
    let ep = endpoint(&t, "tenant_a", &rx.url()).await;
    events(&t.db, "tenant_a", 3).await;
    let config = WorkerConfig {
        batch_size: 1,
        ..config()
    };
    let (w, metrics) = worker(&t.db, config);

    let report = tick(&t.db, &w).await;
    assert_eq!((report.claimed, report.dead), (3, 3), "{report:?}");
    assert_eq!(rx.requests().len(), 1, "only the first delivery was sent");
    let ds = deliveries(&t.db).await;
    assert!(ds.iter().all(|d| d.status == "dead"), "{ds:?}");
    assert_eq!(ds[0].last_status_code, Some(410));
    assert_eq!(ds[0].last_error.as_deref(), Some("endpoint_gone"));
    for d in &ds[1..] {
        assert_eq!(d.last_error.as_deref(), Some("endpoint_disabled"), "{d:?}");
    }
    let off = endpoint_state(&t.db, ep.id).await;
    assert!(!off.enabled && off.stamped, "{off:?}");
    let reason = off.reason.unwrap_or_default();
    assert_eq!(
        reason,
        format!("receiver answered 410 Gone to delivery {}", ds[0].id)
    );
    assert_eq!(outcomes(&metrics, "dead"), 3.0);
    assert_eq!(
        series(&metrics, "hardcount_webhook_deliveries_dead", ""),
        Some(3.0)
    );

    // New events skip the disabled endpoint.
    events(&t.db, "tenant_a", 1).await;
    assert_eq!(deliveries(&t.db).await.len(), 3);
}

/// A 410 from the address the endpoint had when the attempt was claimed,
/// heard after the tenant moved the endpoint to a new address (the old host
/// being retired): the delivery is dead, but the endpoint stays on, and the
/// next event is delivered to the new address. Before, the 410 turned the
/// endpoint off as it is now, and every event published until the tenant
/// noticed was never delivered.
///
/// Mutation check: `gone_any_url` (the turn-off without `AND url = $3`)
/// disables the endpoint, and this test fails; seen failing.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_410_from_an_address_the_endpoint_has_left_does_not_turn_it_off() {
    let t = TestDb::new().await;
    let rx = Receiver::start(|req| {
        if req.path == "/old" {
            Reply::Delayed(Duration::from_millis(800), 410)
        } else {
            Reply::Status(200)
        }
    })
    .await;
    let ep = endpoint(&t, "tenant_a", &rx.url_at("/old")).await;
    events(&t.db, "tenant_a", 1).await;
    let (w, _) = worker(&t.db, config());
    let ticking = tokio::spawn({
        let db = t.db.clone();
        async move { tick(&db, &w).await }
    });
    rx.until_count(1, Duration::from_secs(10)).await;
    sqlx::query("UPDATE webhook_endpoints SET url = $2 WHERE id = $1")
        .bind(ep.id)
        .bind(rx.url_at("/new"))
        .execute(&mut t.superuser().await)
        .await
        .unwrap();
    let report = ticking.await.unwrap();
    assert_eq!(report.dead, 1, "{report:?}");
    let enabled = endpoint_state(&t.db, ep.id).await.enabled;
    assert!(
        enabled,
        "the 410 of the old address turned the endpoint off"
    );

    events(&t.db, "tenant_a", 1).await;
    let (w, _) = worker(&t.db, config());
    let report = tick(&t.db, &w).await;
    assert_eq!(report.delivered, 1, "{report:?}");
    let paths: Vec<String> = rx.requests().iter().map(|r| r.path.clone()).collect();
    assert_eq!(paths, ["/old", "/new"]);
}
