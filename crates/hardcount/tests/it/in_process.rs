//! [`hardcount::run`] in this process, on a listener the test bound on port 0.

use std::time::{Duration, Instant};

use clap::Parser;
use db::{Row, sql};
use hardcount::{Cli, Command};
use testbed::{Leg, TestDb};
use tokio::net::TcpListener;
use tokio_util::sync::CancellationToken;

/// `hardcount serve` with `args` (after `serve`), run in this process on a
/// listener bound on port 0 until its `shutdown` is cancelled.
struct Served {
    base: String,
    shutdown: CancellationToken,
    server: tokio::task::JoinHandle<anyhow::Result<()>>,
}

impl Served {
    async fn start(t: &TestDb, args: &[&str]) -> Served {
        let cli = Cli::try_parse_from(["hardcount", "serve"].iter().chain(args)).unwrap();
        let Command::Serve(settings) = cli.command else {
            panic!("not serve: {:?}", cli.command)
        };
        let config = settings.config(t.app_url(Leg::current()), None).unwrap();
        let listener = TcpListener::bind("127.0.0.1:0").await.unwrap();
        let base = format!("http://{}", listener.local_addr().unwrap());
        let shutdown = CancellationToken::new();
        let server = tokio::spawn(hardcount::run(config, listener, shutdown.clone()));
        Served {
            base,
            shutdown,
            server,
        }
    }

    /// `/metrics` once `found` finds what it looks for in it (within 20 s),
    /// with what it found; `waiting_for` names it in the failure.
    async fn metrics_until<T>(
        &self,
        waiting_for: &str,
        found: impl Fn(&str) -> Option<T>,
    ) -> (T, String) {
        let deadline = Instant::now() + Duration::from_secs(20);
        loop {
            let body = match reqwest::get(format!("{}/metrics", self.base)).await {
                Ok(r) if r.status().is_success() => r.text().await.unwrap(),
                _ => String::new(),
            };
            if let Some(x) = found(&body) {
                return (x, body);
            }
            assert!(
                Instant::now() < deadline,
                "{waiting_for}; /metrics:\n{body}"
            );
            tokio::time::sleep(Duration::from_millis(100)).await;
        }
    }

    async fn stop(self) {
        self.shutdown.cancel();
        tokio::time::timeout(Duration::from_secs(15), self.server)
            .await
            .expect("run returns after cancel")
            .unwrap()
            .unwrap();
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn run_serves_on_the_callers_listener_and_releases_its_leases_when_cancelled() {
    let t = TestDb::new().await;
    let s = Served::start(&t, &["--roles", "webhook_outbox,webhook_delivery"]).await;
    let ticked = "hardcount_leader_last_tick_known{role=\"webhook_outbox\"} 1";
    s.metrics_until("webhook_outbox never completed a tick", |b| {
        b.contains(ticked).then_some(())
    })
    .await;
    let ready = reqwest::get(format!("{}/readyz", s.base)).await.unwrap();
    assert_eq!(ready.status().as_u16(), 200);

    let base = s.base.clone();
    s.stop().await;
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

/// Issue 28: `serve` leads a role on its `HARDCOUNT_<ROLE>_SCHEDULE`: billing
/// on a 2-second schedule completes a slot, stamps it on the lease row and
/// exports its next slot. Fails if serve still leads it on its interval (an
/// hour: no tick stamps a slot).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn serve_runs_a_role_on_its_cron_schedule_and_exports_the_next_slot() {
    let t = TestDb::new().await;
    let s = Served::start(
        &t,
        &["--roles", "billing", "--billing-schedule", "*/2 * * * * *"],
    )
    .await;
    let next = "hardcount_leader_next_slot_timestamp_seconds{role=\"billing\"}";
    s.metrics_until("billing never completed a slot", |b| {
        b.contains(next).then_some(())
    })
    .await;
    let row =
        t.db.fetch_one(sql(
            "SELECT schedule, extract(epoch FROM last_slot)::float8 AS last_slot \
             FROM leader_leases WHERE role = 'billing'",
        ))
        .await
        .unwrap();
    assert_eq!(
        row.get::<Option<String>, _>("schedule").as_deref(),
        Some("*/2 * * * * *")
    );
    let slot: f64 = row.get("last_slot");
    assert_eq!(slot % 2.0, 0.0, "a slot of */2 is an even second: {slot}");
    s.stop().await;
}

/// A role on a cron schedule that has not reached its first slot exports the
/// slot it waits for (`hardcount_leader_first_slot_timestamp_seconds`), so
/// `HardcountRoleLastTickUnknown` waits for it instead of paging a fresh
/// install for up to a day (docs/adr/0121). Fails if the gauge is not
/// exported, or names another slot than the next new year on the database
/// clock.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_cron_role_before_its_first_slot_exports_that_slot() {
    let t = TestDb::new().await;
    let s = Served::start(
        &t,
        &["--roles", "billing", "--billing-schedule", "0 0 0 1 1 *"],
    )
    .await;
    let new_year: f64 =
        t.db.fetch_one(sql(
            "SELECT extract(epoch FROM make_timestamptz( \
                 extract(year FROM now() AT TIME ZONE 'UTC')::int + 1, 1, 1, 0, 0, 0, 'UTC'))::float8 AS s",
        ))
        .await
        .unwrap()
        .get("s");
    let gauge = "hardcount_leader_first_slot_timestamp_seconds{role=\"billing\"} ";
    let unknown = "hardcount_leader_last_tick_known{role=\"billing\"} 0";
    // Both: the gauge is set at ACQUIRE, the tick's status by the next
    // status read, in either order.
    let (value, _) = s
        .metrics_until("no first slot exported beside an unknown last tick", |b| {
            b.contains(unknown)
                .then(|| b.lines().find_map(|l| l.strip_prefix(gauge)))
                .flatten()
                .map(|v| v.parse::<f64>().unwrap())
        })
        .await;
    assert_eq!(value, new_year);
    s.stop().await;
}

/// `serve` of webhook_outbox alone, in-process with `extra` flags, and a
/// client that wants every `/readyz` answer within a second.
struct Readyz {
    url: String,
    client: reqwest::Client,
    shutdown: CancellationToken,
    server: tokio::task::JoinHandle<anyhow::Result<()>>,
}

impl Readyz {
    async fn serve(t: &TestDb, extra: &[&str]) -> Readyz {
        let args = ["hardcount", "serve", "--roles", "webhook_outbox"];
        let cli = Cli::try_parse_from(args.iter().chain(extra)).unwrap();
        let Command::Serve(settings) = cli.command else {
            panic!("not serve: {:?}", cli.command)
        };
        let config = settings.config(t.app_url(Leg::current()), None).unwrap();
        let listener = TcpListener::bind("127.0.0.1:0").await.unwrap();
        let url = format!("http://{}/readyz", listener.local_addr().unwrap());
        let shutdown = CancellationToken::new();
        let server = tokio::spawn(hardcount::run(config, listener, shutdown.clone()));
        // Idle connections are dropped well before the server's keep-alive
        // (`HEADER_READ_TIMEOUT`, 5 s) closes them: a request on one the server
        // was closing met a reset (a test that slept 5 s between two requests
        // failed so, once, in CI).
        let client = reqwest::Client::builder()
            .timeout(Duration::from_secs(1))
            .pool_idle_timeout(Duration::from_secs(1))
            .build()
            .unwrap();
        Readyz {
            url,
            client,
            shutdown,
            server,
        }
    }

    async fn probe(&self) -> (u16, String) {
        let r = self
            .client
            .get(&self.url)
            .send()
            .await
            .expect("answered within 1 s");
        (r.status().as_u16(), r.text().await.unwrap())
    }

    /// Probe every 200 ms until the status is `want`, within `limit`.
    async fn until(&self, want: u16, limit: Duration, why: &str) -> (u16, String) {
        let deadline = Instant::now() + limit;
        loop {
            let answer = self.probe().await;
            if answer.0 == want {
                return answer;
            }
            assert!(Instant::now() < deadline, "{why}: still {answer:?}");
            tokio::time::sleep(Duration::from_millis(200)).await;
        }
    }

    /// Cancel, and `run` returns within `limit`.
    async fn stop(self, limit: Duration) {
        self.shutdown.cancel();
        tokio::time::timeout(limit, self.server)
            .await
            .expect("run returns after cancel")
            .unwrap()
            .unwrap();
    }
}

/// Issue 12, point 7: `/readyz` ran its queries on the app pool per request with
/// no deadline, and echoed driver errors. Here the schema check is blocked (an
/// owner holds `_sqlx_migrations` in ACCESS EXCLUSIVE): every probe is still
/// answered within a second, from the background snapshot, and once the
/// bounded check has failed the answer is 503 with a generic body. Fails if
/// `/readyz` queries per request (the probe hangs on the lock; checked), if the
/// background check is unbounded (mutation `readyz_check_timeout`), or if it
/// echoes the reason.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn readyz_answers_from_the_snapshot_while_the_database_is_blocked() {
    let t = TestDb::new().await;
    let served = Readyz::serve(&t, &[]).await;
    served
        .until(200, Duration::from_secs(10), "never ready")
        .await;

    let mut owner = t.superuser().await;
    sqlx::raw_sql("BEGIN; LOCK TABLE _sqlx_migrations IN ACCESS EXCLUSIVE MODE")
        .execute(&mut owner)
        .await
        .unwrap();
    // A bounded check fails within one refresh and one check timeout (4 s); a
    // snapshot left to go stale would take up to 10 s.
    let deadline = Instant::now() + Duration::from_secs(6);
    let answer = loop {
        let answer = served.probe().await;
        if answer.0 == 503 {
            break answer;
        }
        assert_eq!(answer, (200, "ready\n".to_owned()));
        assert!(
            Instant::now() < deadline,
            "still ready with the check blocked"
        );
        tokio::time::sleep(Duration::from_millis(200)).await;
    };
    assert_eq!(answer, (503, "not ready\n".to_owned()));
    sqlx::raw_sql("ROLLBACK").execute(&mut owner).await.unwrap();
    served.stop(Duration::from_secs(15)).await;
}

/// With HARDCOUNT_LEASE_DATABASE_URL, the leases have a path of their own, and
/// no role can lead while it is down even though DATABASE_URL answers: a
/// lease path that swallows everything makes `/readyz` 503 (same body) within
/// a check cycle, and ready again once it passes. Before, `/readyz` checked
/// DATABASE_URL only and stayed 200 through the outage.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn readyz_is_not_ready_while_the_lease_path_does_not_answer() {
    use testbed::proxy::{FaultProxy, Mode};
    let t = TestDb::new().await;
    let (proxy, lease_url) = FaultProxy::in_front_of(&t).await;
    let served = Readyz::serve(&t, &["--lease-database-url", &lease_url]).await;
    // Each wait: one refresh and one check timeout (4 s), with room.
    let within = Duration::from_secs(8);
    let ready = served.until(200, within, "never ready").await;
    assert_eq!(ready.1, "ready\n");
    proxy.set(Mode::Blackhole);
    let answer = served
        .until(503, within, "ready with the lease path blackholed")
        .await;
    assert_eq!(answer.1, "not ready\n");
    proxy.set(Mode::Pass);
    served
        .until(200, within, "not ready again once the lease path passes")
        .await;
    served.stop(Duration::from_secs(25)).await;
}

/// With a lease path of its own, `leader_status` is read on it: a backlog
/// that fills the app pool's server connections (here held in open
/// transactions) makes the replica not ready, but its roles' last ticks stay
/// known, so the stall alert still sees them and
/// `HardcountRoleLastTickUnknown` does not page while the roles work
/// (docs/adr/0134). Before, the read waited out its timeout in PgBouncer's
/// queue and every role went unknown on every replica. PgBouncer leg only
/// (the pool held is PgBouncer's). Mutation `status_on_app_path` (the read
/// on the app path again) fails it; seen failing.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_saturated_app_pool_leaves_the_roles_last_ticks_known() {
    if Leg::current() == Leg::Direct {
        return;
    }
    let t = TestDb::new().await;
    let lease_url = testbed::bouncer::lease_path(&t).await;
    let served = Readyz::serve(&t, &["--lease-database-url", &lease_url]).await;
    let within = Duration::from_secs(8);
    served.until(200, within, "never ready").await;
    let metrics = served.url.replace("/readyz", "/metrics");
    let known = || async {
        let text = served
            .client
            .get(&metrics)
            .send()
            .await
            .unwrap()
            .text()
            .await
            .unwrap();
        text.lines()
            .find_map(|l| {
                l.strip_prefix("hardcount_leader_last_tick_known{role=\"webhook_outbox\"} ")
                    .map(str::to_owned)
            })
            .unwrap_or_default()
    };
    // Known once the status read finds a last tick (the role's first tick
    // stays open probing for work, so one is written here).
    sqlx::raw_sql(
        "UPDATE leader_leases SET last_tick_ended_at = now() WHERE role = 'webhook_outbox'",
    )
    .execute(&mut t.superuser().await)
    .await
    .unwrap();
    let deadline = Instant::now() + within;
    while known().await != "1" {
        assert!(
            Instant::now() < deadline,
            "webhook_outbox's last tick never known"
        );
        tokio::time::sleep(Duration::from_millis(200)).await;
    }
    let held = testbed::bouncer::saturate(&t).await;
    served
        .until(503, within, "ready with the app pool held")
        .await;
    // One more refresh cycle (2 s, and a check timeout of 2 s) after it.
    tokio::time::sleep(Duration::from_secs(5)).await;
    assert_eq!(known().await, "1", "the roles' last ticks went unknown");
    testbed::bouncer::release(held).await;
    served.stop(Duration::from_secs(15)).await;
}
