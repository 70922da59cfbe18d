//! Fair delivery (issue 12, point 6; docs/adr/0018): a tenant whose endpoints
//! hang holds only its share of the slots, and its endpoints' circuit
//! breakers hold their deliveries back instead of burning attempts.

use std::sync::Arc;
use std::sync::atomic::{AtomicUsize, Ordering::SeqCst};
use std::time::{Duration, Instant};

use testbed::TestDb;
use testbed::receiver::Receiver;
use tokio::io::AsyncReadExt as _;
use webhook_delivery::WorkerConfig;
use webhook_delivery::backoff::RetrySchedule;

use crate::{config, deliveries, endpoint, events, make_due, outcomes, tick, worker};

/// A tarpit: loopback ports that accept connections, read what comes and
/// never answer. Counts connections accepted and the most open at once.
struct Tarpit {
    ports: Vec<u16>,
    accepted: Arc<AtomicUsize>,
    open: Arc<AtomicUsize>,
    most: Arc<AtomicUsize>,
}

impl Tarpit {
    async fn start(ports: usize) -> Tarpit {
        let tarpit = Tarpit {
            ports: Vec::new(),
            accepted: Arc::default(),
            open: Arc::default(),
            most: Arc::default(),
        };
        let mut bound = Vec::new();
        for _ in 0..ports {
            let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
            bound.push(listener.local_addr().unwrap().port());
            let (accepted, open, most) = (
                tarpit.accepted.clone(),
                tarpit.open.clone(),
                tarpit.most.clone(),
            );
            tokio::spawn(async move {
                while let Ok((mut socket, _)) = listener.accept().await {
                    accepted.fetch_add(1, SeqCst);
                    let now = open.fetch_add(1, SeqCst) + 1;
                    most.fetch_max(now, SeqCst);
                    let open = open.clone();
                    tokio::spawn(async move {
                        let mut buf = [0; 4096];
                        // Until the client gives up and closes.
                        while matches!(socket.read(&mut buf).await, Ok(n) if n > 0) {}
                        open.fetch_sub(1, SeqCst);
                    });
                }
            });
        }
        Tarpit {
            ports: bound,
            ..tarpit
        }
    }

    fn url(&self, i: usize) -> String {
        format!("http://127.0.0.1:{}/hook", self.ports[i])
    }
}

/// One tenant's 8 endpoints at a tarpit (8 ports, so neither the endpoint nor
/// the destination share binds) and another tenant's healthy endpoint: the
/// tarpit tenant holds at most its share (4 of 8 slots) and the healthy
/// tenant's 10 deliveries all arrive well before the tarpit's requests time
/// out (1 s), in the same tick.
///
/// Mutation check: without the per-tenant permit in `Limits::turn`
/// (`tenant_share`), the tarpit's deliveries (claimed first) take all 8
/// slots for the whole timeout, the healthy ones arrive after it and the
/// tarpit sees 8 connections at once.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_tenants_tarpit_holds_only_its_share_and_another_tenant_is_delivered_promptly() {
    let t = TestDb::new().await;
    let tarpit = Tarpit::start(8).await;
    let rx = Receiver::answering(200).await;
    for i in 0..8 {
        endpoint(&t, "tenant_tarpit", &tarpit.url(i)).await;
    }
    endpoint(&t, "tenant_healthy", &rx.url()).await;
    // The tarpit's deliveries first: the claim hands them out first.
    events(&t.db, "tenant_tarpit", 2).await;
    events(&t.db, "tenant_healthy", 10).await;
    let (w, _) = worker(
        &t.db,
        WorkerConfig {
            max_in_flight: 8,
            max_in_flight_per_endpoint: 4,
            max_in_flight_per_tenant: 4,
            max_in_flight_per_destination: 16,
            // The breaker is pinned below; here only the shares act.
            breaker_timeouts: 100,
            // No retry comes due within the tick.
            retry_schedule: RetrySchedule::parse("5s").unwrap(),
            ..config()
        },
    );
    let started = Instant::now();
    let report = tick(&t.db, &w).await;
    println!("tarpit and healthy: {report:?}");
    assert_eq!(report.delivered, 10, "{report:?}");
    let latest = rx
        .requests()
        .iter()
        .map(|r| r.at.duration_since(started))
        .max()
        .unwrap();
    assert!(
        latest < Duration::from_millis(800),
        "the healthy tenant's last delivery arrived {latest:?} after the tick began: {report:?}"
    );
    assert!(
        tarpit.most.load(SeqCst) <= 4,
        "the tarpit held {} connections at once, over the tenant share of 4",
        tarpit.most.load(SeqCst)
    );
    // Every tarpit delivery was either tried (timed out, retried) or held
    // back unsent; none was lost or delivered.
    assert_eq!(report.retried + report.held, 16, "{report:?}");
    assert!(report.retried <= 4 + 4, "{report:?}");
    let rows = deliveries(&t.db).await;
    assert_eq!(rows.iter().filter(|d| d.status == "pending").count(), 16);
    assert_eq!(rows.iter().filter(|d| d.status == "delivered").count(), 10);
}

/// One endpoint at a tarpit, breaker after 2 consecutive timeouts with a 2 s
/// cool-off: the first two attempts time out and open it; then its due
/// deliveries are held (not sent, their attempts not counted, due again when
/// it half-opens); after the cool-off exactly one trial goes out while the
/// others wait, and its timeout opens the breaker again for twice as long.
///
/// Mutation check: a breaker that never opens (`breaker_opens`) lets the
/// second tick send every due delivery to the tarpit and burn their
/// attempts; an admission that ignores the half-open hold (`breaker_admit`)
/// sends all five in the third tick instead of one trial.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_breaker_opens_after_consecutive_timeouts_and_the_endpoints_deliveries_wait_until_it_half_opens()
 {
    let t = TestDb::new().await;
    let tarpit = Tarpit::start(1).await;
    endpoint(&t, "tenant_a", &tarpit.url(0)).await;
    events(&t.db, "tenant_a", 5).await;
    let cooloff = Duration::from_secs(2);
    let (w, metrics) = worker(
        &t.db,
        WorkerConfig {
            request_timeout: Duration::from_millis(400),
            connect_timeout: Duration::from_millis(400),
            max_in_flight_per_endpoint: 2,
            breaker_timeouts: 2,
            breaker_cooloff: cooloff,
            retry_schedule: RetrySchedule::parse("5s,5s,5s").unwrap(),
            ..config()
        },
    );

    // Two attempts at once, both time out: the breaker opens.
    let report = tick(&t.db, &w).await;
    let opened = Instant::now();
    println!("first tick: {report:?}");
    assert_eq!(report.retried, 2, "{report:?}");
    assert_eq!(tarpit.accepted.load(SeqCst), 2);
    let attempts = |rows: &[crate::Delivery]| rows.iter().map(|d| d.attempts).sum::<i32>();
    assert_eq!(attempts(&deliveries(&t.db).await), 2);

    // Open: every due delivery is held, none sent, no attempt counted.
    make_due(&t).await;
    let report = tick(&t.db, &w).await;
    println!("while open: {report:?}");
    assert_eq!(report.held, 5, "{report:?}");
    assert_eq!(report.retried + report.delivered + report.dead, 0);
    assert_eq!(tarpit.accepted.load(SeqCst), 2, "nothing was sent");
    let rows = deliveries(&t.db).await;
    assert_eq!(attempts(&rows), 2, "held deliveries keep their attempts");
    let left = cooloff.saturating_sub(opened.elapsed()).as_secs_f64();
    for d in &rows {
        assert_eq!(d.status, "pending", "{d:?}");
        // Due when the breaker half-opens (the database clock; a margin for the ticks).
        assert!(
            d.due_in > left - 0.5 && d.due_in <= left + 0.1,
            "{d:?}, {left} s left"
        );
    }
    // These 5, and the 3 the first tick held while the two attempts hung.
    assert_eq!(outcomes(&metrics, "held"), 8.0);

    // Half-open: one trial; the others wait for its result. It times out:
    // open again, for twice the cool-off.
    tokio::time::sleep(cooloff.saturating_sub(opened.elapsed()) + Duration::from_millis(100)).await;
    make_due(&t).await;
    let report = tick(&t.db, &w).await;
    println!("half-open: {report:?}");
    assert_eq!(tarpit.accepted.load(SeqCst), 3, "exactly one trial");
    assert_eq!(report.retried, 1, "{report:?}");
    assert_eq!(report.held, 4, "{report:?}");
    assert_eq!(attempts(&deliveries(&t.db).await), 3);
    make_due(&t).await;
    let report = tick(&t.db, &w).await;
    assert_eq!(report.held, 5, "reopened: {report:?}");
    assert_eq!(tarpit.accepted.load(SeqCst), 3);
    let due_in = deliveries(&t.db)
        .await
        .iter()
        .map(|d| d.due_in)
        .fold(f64::MAX, f64::min);
    assert!(due_in > 2.0 * cooloff.as_secs_f64() - 1.5, "{due_in}");
}
