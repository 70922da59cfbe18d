//! `hardcount serve` as a real process.

use std::process::{Child, Stdio};
use std::time::{Duration, Instant};

use testbed::{Leg, TestDb};

use crate::hardcount;

pub struct Serve {
    pub child: Child,
    pub port: u16,
}

impl Serve {
    /// Start `hardcount serve` on `database_url` with extra env; wait for /healthz.
    pub async fn start(database_url: &str, env: &[(&str, &str)]) -> Serve {
        Serve::start_logged(database_url, env, None).await
    }

    /// [`Serve::start`] with its log (stderr) written to `log`, to read after.
    pub async fn start_logged(
        database_url: &str,
        env: &[(&str, &str)],
        log: Option<&std::path::Path>,
    ) -> Serve {
        let stderr = if let Some(path) = log {
            Stdio::from(std::fs::File::create(path).unwrap())
        } else if std::env::var_os("HARDCOUNT_TEST_SERVE_LOGS").is_some() {
            Stdio::inherit()
        } else {
            Stdio::null()
        };
        Serve::start_with_stderr(database_url, env, stderr).await
    }

    /// [`Serve::start`] with its log (stderr) sent to `stderr`.
    pub async fn start_with_stderr(
        database_url: &str,
        env: &[(&str, &str)],
        stderr: Stdio,
    ) -> Serve {
        let port = testbed::free_port();
        let mut cmd = hardcount();
        cmd.arg("serve")
            .env("DATABASE_URL", database_url)
            .env("HARDCOUNT_HTTP_ADDR", format!("127.0.0.1:{port}"))
            // email_outbox runs by default and needs an SMTP_URL; these tests
            // queue no email, and the transport connects only to send one.
            .env("SMTP_URL", "smtp://127.0.0.1:9")
            // The key the tests' endpoints are sealed with (webhook_delivery
            // refuses to start without it once endpoints exist).
            .env("HARDCOUNT_SECRETS_KEY", testbed::SECRETS_KEY)
            .stdout(Stdio::null())
            // Set HARDCOUNT_TEST_SERVE_LOGS=1 to see the replicas' logs.
            .stderr(stderr);
        for (k, v) in env {
            cmd.env(k, v);
        }
        let child = cmd.spawn().unwrap();
        let serve = Serve { child, port };
        let deadline = Instant::now() + Duration::from_secs(20);
        loop {
            if let Ok(r) = reqwest::get(serve.url("/healthz")).await
                && r.status().is_success()
            {
                return serve;
            }
            assert!(
                Instant::now() < deadline,
                "hardcount serve did not answer /healthz"
            );
            tokio::time::sleep(Duration::from_millis(100)).await;
        }
    }

    pub fn url(&self, path: &str) -> String {
        format!("http://127.0.0.1:{}{path}", self.port)
    }

    pub async fn get(&self, path: &str) -> (u16, String) {
        let r = reqwest::get(self.url(path)).await.unwrap();
        (r.status().as_u16(), r.text().await.unwrap())
    }

    pub fn signal(&self, sig: &str) {
        let ok = std::process::Command::new("kill")
            .args([&format!("-{sig}"), &self.child.id().to_string()])
            .status()
            .unwrap()
            .success();
        assert!(ok, "kill -{sig}");
    }

    /// Wait for the process to exit; its exit code.
    pub async fn wait(&mut self, limit: Duration) -> Option<i32> {
        let deadline = Instant::now() + limit;
        loop {
            if let Some(status) = self.child.try_wait().unwrap() {
                return status.code();
            }
            assert!(
                Instant::now() < deadline,
                "hardcount serve did not exit within {limit:?}"
            );
            tokio::time::sleep(Duration::from_millis(50)).await;
        }
    }
}

impl Drop for Serve {
    fn drop(&mut self) {
        let _ = self.child.kill();
        let _ = self.child.wait();
    }
}

pub(crate) fn metric(body: &str, series: &str) -> Option<f64> {
    body.lines()
        .find_map(|l| {
            l.strip_prefix(series)
                .and_then(|rest| rest.strip_prefix(' '))
        })
        .map(|v| v.trim().parse().unwrap())
}

#[tokio::test]
async fn metrics_expose_the_leader_series_with_panicked_at_zero_before_any_tick() {
    let t = TestDb::new().await;
    let mut su = t.superuser().await;
    // webhook_outbox completed a tick 42 s ago and is not due for an hour;
    // webhook_delivery is paused, so it never completes one here.
    sqlx::raw_sql(
        "UPDATE leader_leases SET last_tick_ended_at = now() - interval '42 seconds' WHERE role = 'webhook_outbox'; \
         SELECT leader_pause('webhook_delivery', 'oncall', 'receiver incident')",
    )
    .execute(&mut su)
    .await
    .unwrap();
    let mut serve = Serve::start(
        &t.app_url(Leg::current()),
        &[
            ("HARDCOUNT_ROLES", "webhook_outbox,webhook_delivery"),
            ("HARDCOUNT_WEBHOOK_OUTBOX_INTERVAL", "1h"),
        ],
    )
    .await;
    // /readyz answers from a snapshot refreshed in the background: ready once
    // the first check has run.
    let deadline = Instant::now() + Duration::from_secs(15);
    while serve.get("/readyz").await.0 != 200 {
        assert!(Instant::now() < deadline, "/readyz never became ready");
        tokio::time::sleep(Duration::from_millis(100)).await;
    }
    // The status gauges come from the same refresh, but a read of leader_status
    // that outlives its deadline on a loaded machine leaves them for the next
    // refresh (readiness does not wait for it): wait for the series.
    let body = loop {
        let (status, body) = serve.get("/metrics").await;
        assert_eq!(status, 200);
        if metric(&body, "hardcount_leader_paused{role=\"billing\"}").is_some() {
            break body;
        }
        assert!(
            Instant::now() < deadline,
            "no hardcount_leader_paused series in\n{body}"
        );
        tokio::time::sleep(Duration::from_millis(100)).await;
    };
    for role in [
        "billing",
        "dunning",
        "webhook_outbox",
        "email_outbox",
        "webhook_delivery",
    ] {
        let lost =
            format!("hardcount_leader_lease_lost_total{{role=\"{role}\",reason=\"panicked\"}}");
        assert_eq!(metric(&body, &lost), Some(0.0), "{lost} in\n{body}");
        let paused = format!("hardcount_leader_paused{{role=\"{role}\"}}");
        let expected = if role == "webhook_delivery" { 1.0 } else { 0.0 };
        assert_eq!(metric(&body, &paused), Some(expected), "{paused}");
    }
    let age = metric(
        &body,
        "hardcount_leader_last_tick_age_seconds{role=\"webhook_outbox\"}",
    )
    .expect("webhook_outbox age");
    assert!((42.0..60.0).contains(&age), "{age}");
    assert_eq!(
        metric(
            &body,
            "hardcount_leader_last_tick_known{role=\"webhook_outbox\"}"
        ),
        Some(1.0)
    );
    // A role that never completed a tick has no age, never a negative one, and says so.
    assert_eq!(
        metric(
            &body,
            "hardcount_leader_last_tick_age_seconds{role=\"webhook_delivery\"}"
        ),
        None
    );
    assert_eq!(
        metric(
            &body,
            "hardcount_leader_last_tick_known{role=\"webhook_delivery\"}"
        ),
        Some(0.0)
    );
    // A role this deployment does not run is not reported as stalled.
    assert_eq!(
        metric(&body, "hardcount_leader_last_tick_known{role=\"billing\"}"),
        None
    );

    serve.signal("TERM");
    assert_eq!(serve.wait(Duration::from_secs(10)).await, Some(0));
}

#[tokio::test]
async fn readyz_reports_a_database_that_went_away() {
    let port = testbed::free_port();
    let t = TestDb::new().await;
    let serve = Serve::start(&t.app_url(Leg::current()), &[]).await;
    assert_eq!(serve.get("/readyz").await.0, 200);
    drop(t); // drops the database under the running server
    // /readyz reads a snapshot the background check refreshes every 2 s, each
    // check bounded by 2 s: the loss shows within one cycle, every probe is
    // answered at once, and the body is generic (the reason is logged).
    let dropped = Instant::now();
    let (status, body) = loop {
        let answer = serve.get("/readyz").await;
        if answer.0 != 200 || dropped.elapsed() > Duration::from_secs(10) {
            break answer;
        }
        tokio::time::sleep(Duration::from_millis(200)).await;
    };
    assert_eq!((status, body.as_str()), (503, "not ready\n"));
    println!(
        "not ready {:?} after the database went away",
        dropped.elapsed()
    );
    let _ = port;
}
