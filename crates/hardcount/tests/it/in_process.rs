//! [`hardcount::run`] in this process, on a listener the test bound on port 0.

use std::time::{Duration, Instant};

use clap::Parser;
use db::{Row, sql};
use hardcount::{Cli, Command};
use testbed::{Leg, TestDb};
use tokio::net::TcpListener;
use tokio_util::sync::CancellationToken;

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn run_serves_on_the_callers_listener_and_releases_its_leases_when_cancelled() {
    let t = TestDb::new().await;
    let cli = Cli::try_parse_from([
        "hardcount",
        "serve",
        "--roles",
        "webhook_outbox,webhook_delivery",
    ])
    .unwrap();
    let Command::Serve(settings) = cli.command else {
        panic!("not serve: {:?}", cli.command)
    };
    let config = settings.config(t.app_url(Leg::current())).unwrap();
    let listener = TcpListener::bind("127.0.0.1:0").await.unwrap();
    let base = format!("http://{}", listener.local_addr().unwrap());
    let shutdown = CancellationToken::new();
    let server = tokio::spawn(hardcount::run(config, listener, shutdown.clone()));

    let deadline = Instant::now() + Duration::from_secs(20);
    let ticked = "hardcount_leader_last_tick_known{role=\"webhook_outbox\"} 1";
    loop {
        let body = match reqwest::get(format!("{base}/metrics")).await {
            Ok(r) if r.status().is_success() => r.text().await.unwrap(),
            _ => String::new(),
        };
        if body.contains(ticked) {
            break;
        }
        assert!(
            Instant::now() < deadline,
            "webhook_outbox never completed a tick; /metrics:\n{body}"
        );
        tokio::time::sleep(Duration::from_millis(100)).await;
    }
    let ready = reqwest::get(format!("{base}/readyz")).await.unwrap();
    assert_eq!(ready.status().as_u16(), 200);

    shutdown.cancel();
    tokio::time::timeout(Duration::from_secs(15), server)
        .await
        .expect("run returns after cancel")
        .unwrap()
        .unwrap();
    let held: i64 =
        t.db.fetch_one(sql(
            "SELECT count(*) AS n FROM leader_leases WHERE holder_id IS NOT NULL",
        ))
        .await
        .unwrap()
        .get("n");
    assert_eq!(held, 0, "a lease is still held after run returned");
    assert!(reqwest::get(format!("{base}/healthz")).await.is_err());
}
