//! The failure harness (issue 27, point 3; docs/adr/0038): a private
//! Postgres and PgBouncer ([`testbed::cluster`]), `hardcount serve` replicas
//! each reaching PgBouncer through a fault proxy of its own
//! ([`testbed::proxy`]) for both its job and lease paths, the SMTP sink, a
//! webhook receiver, the fake provider, and a workload that keeps all five
//! roles busy: due subscriptions (billing charges them; one customer in five
//! declines, so dunning retries), webhook events (billing's and the
//! workload's own) to three endpoints, and queued emails.

use std::path::PathBuf;
use std::time::{Duration, Instant};

use db::Db;
use fake_provider::{FakeProvider, TEST_SECRET_KEY};
use sqlx::postgres::PgConnection;
use sqlx::{Connection, Row};
use testbed::SmtpSink;
use testbed::cluster::{Cluster, DATABASE};
use testbed::proxy::{FaultProxy, Mode};
use testbed::receiver::Receiver;
use tokio::task::JoinHandle;
use tokio_util::sync::CancellationToken;

use super::checker::{self, Report};
use super::history::{self, Term};
use crate::serve::Serve;

/// libfaketime, as Debian's `faketime` package installs it.
pub const LIBFAKETIME: &str = "/usr/lib/x86_64-linux-gnu/faketime/libfaketime.so.1";

pub struct Replica {
    pub serve: Option<Serve>,
    pub proxy: FaultProxy,
    /// A libfaketime offset (`+1h`, `-1h`) for its next start.
    pub skew: Option<String>,
    pub stopped: bool,
    pub log: PathBuf,
}

pub struct Harness {
    pub cluster: Cluster,
    pub replicas: Vec<Replica>,
    pub sink: SmtpSink,
    pub rx: Receiver,
    pub provider: FakeProvider,
    pub dir: PathBuf,
    /// `HARDCOUNT_LEASE_PROFILE` of every replica; None: the default.
    pub lease_profile: Option<String>,
    feeder: Option<(CancellationToken, JoinHandle<()>)>,
}

async fn exec(su: &mut PgConnection, q: &str) -> Result<(), sqlx::Error> {
    sqlx::raw_sql(sqlx::AssertSqlSafe(q.to_owned()))
        .execute(su)
        .await
        .map(|_| ())
}

/// `n` due subscriptions, a month behind and due a minute ago, each of a
/// customer of its own (one in five with the card the provider always
/// declines). Customers of their own keep each customer's intents few: the
/// reconciler settles an unknown attempt from the customer's recent intents,
/// and a customer with thousands in minutes would be no workload's shape.
fn due_subscriptions(n: usize) -> String {
    format!(
        "WITH c AS ( \
           INSERT INTO customers (tenant_id, email, provider_customer_id, payment_method_id) \
           SELECT 'tenant_a', x || '@example.org', 'cus_' || x, \
                  CASE WHEN g % 5 = 0 THEN 'pm_card_chargeDeclined' ELSE 'pm_card_visa' END \
           FROM (SELECT g, md5(random()::text || clock_timestamp()::text || g) AS x \
                 FROM generate_series(1, {n}) g) s \
           RETURNING id) \
         INSERT INTO subscriptions (tenant_id, customer_id, plan_id, status, billing_anchor, \
                                    current_period_start, current_period_end, next_billing_at) \
         SELECT 'tenant_a', c.id, p.id, 'active', now() - interval '1 month 1 minute', \
                now() - interval '1 month 1 minute', now() - interval '1 minute', \
                now() - interval '1 minute' \
         FROM c, plans p WHERE p.name = 'Pro'"
    )
}

fn events(n: usize) -> String {
    format!(
        "INSERT INTO webhook_events (tenant_id, event_type, payload) \
         SELECT 'tenant_a', 'invoice.finalized', jsonb_build_object('chaos', g) \
         FROM generate_series(1, {n}) g"
    )
}

fn emails(n: usize) -> String {
    format!(
        "INSERT INTO email_outbox (tenant_id, message_id, sender, recipients, subject, text_body) \
         SELECT 'tenant_a', '<' || md5(random()::text || clock_timestamp()::text || g) || '@example.com>', \
                'Billing <billing@example.com>', ARRAY['c' || g || '@example.org'], \
                'Chaos ' || g, 'Nothing to see' \
         FROM generate_series(1, {n}) g"
    )
}

impl Harness {
    /// Everything up, `n` replicas serving all five roles, no workload yet
    /// ([`Harness::feed`]).
    pub async fn start(n: usize) -> Harness {
        Harness::start_with(n, None).await
    }

    /// [`Harness::start`] with every replica on `lease_profile`
    /// (`standard` or `fast`, docs/adr/0047).
    pub async fn start_with(n: usize, lease_profile: Option<&str>) -> Harness {
        let cluster = Cluster::start().await;
        let provider = FakeProvider::start().await.unwrap();
        let rx = Receiver::answering(200).await;
        let sink = SmtpSink::start();
        let dir = std::env::temp_dir().join(format!("hardcount-chaos-{}", std::process::id()));
        std::fs::create_dir_all(&dir).unwrap();

        let mut su = cluster.superuser(DATABASE).await;
        exec(
            &mut su,
            "INSERT INTO dunning_policies (tenant_id, name, retry_offsets_secs, final_action, is_default) \
               VALUES ('tenant_a', 'Fast', '{1, 2}', 'pause_collection', true); \
             INSERT INTO customers (tenant_id, email, provider_customer_id, payment_method_id) \
               VALUES ('tenant_a', 'good1@example.org', 'cus_good_1', 'pm_card_visa'); \
             INSERT INTO plans (tenant_id, name, amount, currency, interval_unit, interval_count) \
               VALUES ('tenant_a', 'Pro', 1200, 'EUR', 'month', 1)",
        )
        .await
        .unwrap();
        let _ = su.close().await;
        let api = Db::connect_lazy(
            &Cluster::url_via(
                &cluster.bouncer_addr().to_string(),
                "hardcount_api",
                DATABASE,
            ),
            1,
        )
        .unwrap();
        let keyring = webhook_delivery::Keyring::parse(testbed::SECRETS_KEY).unwrap();
        for ep in ["one", "two", "three"] {
            webhook_delivery::create_endpoint::<&str>(
                &api,
                &keyring,
                "tenant_a",
                &rx.url_at(&format!("/ep/{ep}")),
                &[],
            )
            .await
            .unwrap();
        }

        let mut h = Harness {
            cluster,
            replicas: Vec::new(),
            sink,
            rx,
            provider,
            dir,
            lease_profile: lease_profile.map(str::to_owned),
            feeder: None,
        };
        for i in 0..n {
            let proxy = FaultProxy::start(h.cluster.bouncer_addr()).await;
            h.replicas.push(Replica {
                serve: None,
                proxy,
                skew: None,
                stopped: false,
                log: h.dir.join(format!("replica-{i}.log")),
            });
            h.start_replica(i).await;
        }
        println!(
            "harness: {n} replicas, Postgres {}, PgBouncer {}, logs in {}",
            h.cluster.pg_addr(),
            h.cluster.bouncer_addr(),
            h.dir.display()
        );
        h
    }

    fn env(&self, i: usize) -> Vec<(String, String)> {
        let via = self.replicas[i].proxy.host_port();
        let mut env: Vec<(String, String)> = [
            (
                "HARDCOUNT_ROLES",
                "billing,dunning,webhook_outbox,email_outbox,webhook_delivery",
            ),
            ("HARDCOUNT_BILLING_INTERVAL", "1s"),
            ("HARDCOUNT_DUNNING_INTERVAL", "1s"),
            ("HARDCOUNT_EMAIL_OUTBOX_INTERVAL", "1s"),
            ("HARDCOUNT_WEBHOOK_ALLOWLIST", "127.0.0.0/8"),
            ("HARDCOUNT_WEBHOOK_TIMEOUT", "5s"),
            ("HARDCOUNT_EMAIL_FROM", "Billing <billing@example.com>"),
            ("BILLING_PROVIDER_SECRET_KEY", TEST_SECRET_KEY),
            ("RUST_LOG", "info"),
        ]
        .iter()
        .map(|(k, v)| ((*k).to_owned(), (*v).to_owned()))
        .collect();
        env.push((
            "HARDCOUNT_LEASE_DATABASE_URL".into(),
            Cluster::url_via(&via, "hardcount_app", "hardcount_leases"),
        ));
        if let Some(p) = &self.lease_profile {
            env.push(("HARDCOUNT_LEASE_PROFILE".into(), p.clone()));
        }
        env.push(("SMTP_URL".into(), self.sink.url()));
        env.push(("BILLING_PROVIDER_URL".into(), self.provider.base_url()));
        if let Some(skew) = &self.replicas[i].skew {
            env.push(("LD_PRELOAD".into(), LIBFAKETIME.into()));
            env.push(("FAKETIME".into(), skew.clone()));
            // The wall clock only: timers and Instant keep the real pace.
            env.push(("FAKETIME_DONT_FAKE_MONOTONIC".into(), "1".into()));
        }
        env
    }

    /// (Re)start replica `i` through its proxy (which is left as it is).
    pub async fn start_replica(&mut self, i: usize) {
        if let Some(old) = self.replicas[i].serve.take() {
            if self.replicas[i].stopped {
                old.signal("CONT");
            }
            drop(old);
        }
        self.replicas[i].stopped = false;
        let via = self.replicas[i].proxy.host_port();
        let env = self.env(i);
        let env: Vec<(&str, &str)> = env.iter().map(|(k, v)| (k.as_str(), v.as_str())).collect();
        // Appended, so a restart keeps the earlier run's log.
        let log = std::fs::OpenOptions::new()
            .create(true)
            .append(true)
            .open(&self.replicas[i].log)
            .unwrap();
        let serve = Serve::start_with_stderr(
            &Cluster::url_via(&via, "hardcount_app", DATABASE),
            &env,
            std::process::Stdio::from(log),
        )
        .await;
        self.replicas[i].serve = Some(serve);
    }

    pub fn pid(&self, i: usize) -> Option<u32> {
        self.replicas[i].serve.as_ref().map(|s| s.child.id())
    }

    /// The replica whose process holds `holder`, if it is one of ours still.
    pub fn index_of(&self, holder: &str) -> Option<usize> {
        (0..self.replicas.len()).find(|&i| {
            self.pid(i)
                .is_some_and(|p| holder.contains(&format!(":{p}:")))
        })
    }

    pub async fn su(&self) -> PgConnection {
        self.cluster.superuser(DATABASE).await
    }

    /// Replica `i`'s process, once it is there.
    pub fn serve(&self, i: usize) -> &Serve {
        self.replicas[i].serve.as_ref().expect("replica running")
    }

    pub fn signal(&mut self, i: usize, sig: &str) {
        self.serve(i).signal(sig);
        match sig {
            "STOP" => self.replicas[i].stopped = true,
            "CONT" => self.replicas[i].stopped = false,
            _ => {}
        }
    }

    /// Until `role` has an open term held by one of the replicas; which, and the term.
    pub async fn until_held(&self, role: &str, limit: Duration) -> Option<(usize, Term)> {
        let deadline = Instant::now() + limit;
        let mut su = self.su().await;
        loop {
            if let Some(t) = history::open_term(&mut su, role).await
                && let Some(i) = self.index_of(&t.holder)
                && !self.replicas[i].stopped
            {
                return Some((i, t));
            }
            if Instant::now() > deadline {
                return None;
            }
            tokio::time::sleep(Duration::from_millis(20)).await;
        }
    }

    /// Keep the roles busy: every second, five due subscriptions (one a
    /// decline), five events and five emails. Errors (a fault on the way)
    /// are retried next second.
    pub fn feed(&mut self) {
        let stop = CancellationToken::new();
        let url = self.cluster.superuser_url();
        let token = stop.clone();
        let task = tokio::spawn(async move {
            let mut su: Option<PgConnection> = None;
            while !token.is_cancelled() {
                if su.is_none() {
                    su = PgConnection::connect(&url).await.ok();
                }
                if let Some(c) = su.as_mut() {
                    let q = format!("{}; {}; {}", due_subscriptions(5), events(5), emails(5));
                    if exec(c, &q).await.is_err() {
                        su = None;
                    }
                }
                let _ = token
                    .run_until_cancelled(tokio::time::sleep(Duration::from_secs(1)))
                    .await;
            }
        });
        self.feeder = Some((stop, task));
    }

    pub async fn stop_feeding(&mut self) {
        if let Some((stop, task)) = self.feeder.take() {
            stop.cancel();
            let _ = task.await;
        }
    }

    /// A burst of work for `role`'s next tick, so that it runs long enough
    /// to be faulted mid-tick.
    pub async fn burst(&self, role: &str) {
        let q = match role {
            "billing" | "dunning" => due_subscriptions(300),
            "email_outbox" => emails(400),
            _ => events(200),
        };
        let mut su = self.su().await;
        let _ = exec(&mut su, &q).await;
    }

    /// Work left: undispatched events, pending deliveries, queued emails,
    /// due subscriptions, unsettled charges, declined invoices dunning has
    /// not enrolled yet (its next tick does, with a `dunning.started` event
    /// each: the drain once returned between a decline and that tick, and the
    /// checker found five events not yet fanned out), dunning runs owing a
    /// step.
    pub async fn work_left(&self) -> Option<i64> {
        let mut su = PgConnection::connect(&self.cluster.superuser_url())
            .await
            .ok()?;
        let row = sqlx::query(
            "SELECT (SELECT count(*) FROM webhook_events WHERE dispatched_at IS NULL) \
                  + (SELECT count(*) FROM webhook_deliveries WHERE status = 'pending') \
                  + (SELECT count(*) FROM webhook_handoffs) \
                  + (SELECT count(*) FROM email_outbox WHERE status = 'queued') \
                  + (SELECT count(*) FROM subscriptions WHERE status = 'active' AND next_billing_at <= now()) \
                  + (SELECT count(*) FROM payment_attempts WHERE provider_status = 'unknown') \
                  + (SELECT count(*) FROM invoices i WHERE status = 'open' AND collection_method = 'automatic' \
                       AND NOT EXISTS (SELECT 1 FROM payment_attempts a WHERE a.invoice_id = i.id)) \
                  + (SELECT count(*) FROM invoices i WHERE status = 'open' AND collection_method = 'automatic' \
                       AND (SELECT a.provider_status FROM payment_attempts a WHERE a.invoice_id = i.id \
                            ORDER BY a.attempt_seq DESC LIMIT 1) = 'declined' \
                       AND NOT EXISTS (SELECT 1 FROM dunning_runs r WHERE r.invoice_id = i.id)) \
                  + (SELECT count(*) FROM dunning_runs \
                       WHERE status = 'active' OR (status = 'exhausted' AND final_action_at IS NULL)) AS n",
        )
        .fetch_one(&mut su)
        .await
        .ok()?;
        let _ = su.close().await;
        Some(row.get("n"))
    }

    /// Until nothing is left to do (the feeder stopped), or panic after `limit`.
    ///
    /// Some work waits only for a database clock to pass: a charge whose
    /// outcome a fault left unknown is settled by the reconciler once its
    /// claim (10 minutes) has expired, a dunning retry waits for the
    /// invoice's claim, a claimed email or delivery whose sender died is
    /// due again at its claim's end, and the deliveries of a handoff whose
    /// replica died are inserted at its lease's end (docs/adr/0124). After `SETTLE` without
    /// progress, with nothing in flight any more, those times are written
    /// into the past, as the suite does for such waits (ARCHITECTURE.md).
    pub async fn drain(&self, limit: Duration) {
        const SETTLE: Duration = Duration::from_secs(5);
        let deadline = Instant::now() + limit;
        let mut left = None;
        let mut since = Instant::now();
        while Instant::now() < deadline {
            let now = self.work_left().await;
            if now == Some(0) {
                // A tick still running may commit work after this read (a
                // closing's events, a settle's emails): nothing left means
                // nothing left at three more reads, a second apart. Seen in
                // CI on the PgBouncer leg: two events committed after the
                // first zero (one read a second later did not catch them),
                // then five events after two zeros a second apart.
                let zero = Instant::now();
                let mut held = true;
                for _ in 0..3 {
                    tokio::time::sleep(Duration::from_secs(1)).await;
                    let again = self.work_left().await;
                    if again != Some(0) {
                        println!(
                            "drain: {again:?} items left {:.1?} after nothing was",
                            zero.elapsed()
                        );
                        held = false;
                        break;
                    }
                }
                if held {
                    return;
                }
                continue;
            }
            if now != left {
                left = now;
                since = Instant::now();
            } else if since.elapsed() > SETTLE {
                if let Ok(mut su) = PgConnection::connect(&self.cluster.superuser_url()).await {
                    let _ = exec(
                        &mut su,
                        "UPDATE invoices SET auto_charge_claimed_until = now() \
                         WHERE auto_charge_claimed_until > now(); \
                         UPDATE dunning_runs SET next_attempt_at = now() \
                         WHERE next_attempt_at > now() \
                           AND (status = 'active' OR (status = 'exhausted' AND final_action_at IS NULL)); \
                         UPDATE email_outbox SET next_attempt_at = now() \
                         WHERE status = 'queued' AND next_attempt_at > now(); \
                         UPDATE webhook_deliveries SET next_attempt_at = now() \
                         WHERE status = 'pending' AND next_attempt_at > now(); \
                         UPDATE webhook_handoffs SET until = now() WHERE until > now()",
                    )
                    .await;
                    let _ = su.close().await;
                }
                since = Instant::now();
            }
            tokio::time::sleep(Duration::from_millis(250)).await;
        }
        panic!("the workload did not drain within {limit:?}: {left:?} items left");
    }

    /// Stop feeding, drain, run the checker, assert it green; feed again.
    pub async fn check(&mut self, after: &str) -> Report {
        self.check_within(after, Duration::from_secs(300)).await
    }

    /// [`check`](Self::check) with the drain allowed `limit`: a figures run
    /// feeds for most of an hour and leaves a backlog the scenarios' five
    /// minutes do not drain on 2 cores.
    pub async fn check_within(&mut self, after: &str, limit: Duration) -> Report {
        let started = Instant::now();
        self.stop_feeding().await;
        self.drain(limit).await;
        let drained = started.elapsed();
        // A last duplicate may still be on its way to the receiver or sink.
        tokio::time::sleep(Duration::from_millis(500)).await;
        let mut su = self.su().await;
        let logs: Vec<String> = (0..self.replicas.len())
            .map(|i| {
                std::fs::read_to_string(self.dir.join(format!("replica-{i}.log")))
                    .unwrap_or_default()
            })
            .collect();
        let unrecorded = checker::Unrecorded::from_logs(&logs);
        let report =
            checker::check(&mut su, &self.provider, &self.rx, &self.sink, unrecorded).await;
        println!(
            "checker after {after} (drained in {drained:.1?}): {}",
            report.summary()
        );
        report.assert_green(after);
        self.feed();
        report
    }

    /// Undo every fault: links passed, the database writable, stopped
    /// replicas continued, exited ones started again.
    pub async fn heal(&mut self) {
        self.cluster.set_read_only(false).await;
        for i in 0..self.replicas.len() {
            self.replicas[i].proxy.set(Mode::Pass);
            if self.replicas[i].stopped {
                self.signal(i, "CONT");
            }
            let exited = match self.replicas[i].serve.as_mut() {
                None => true,
                Some(s) => s.child.try_wait().unwrap().is_some(),
            };
            if exited {
                self.start_replica(i).await;
            }
        }
    }

    /// Until replica `i`'s /readyz says `ready` (200) or not (503).
    pub async fn until_ready(&self, i: usize, ready: bool, limit: Duration) -> Duration {
        let started = Instant::now();
        let want = if ready { 200 } else { 503 };
        loop {
            let got = reqwest::get(self.serve(i).url("/readyz"))
                .await
                .map(|r| r.status().as_u16())
                .unwrap_or(0);
            if got == want {
                return started.elapsed();
            }
            assert!(
                started.elapsed() < limit,
                "replica {i}'s /readyz did not answer {want} within {limit:?} (it answers {got})"
            );
            tokio::time::sleep(Duration::from_millis(100)).await;
        }
    }

    /// The sum of replica `i`'s `hardcount_leader_lease_lost_total` for `role`, any reason.
    pub async fn lost(&self, i: usize, role: &str) -> f64 {
        let (_, body) = self.serve(i).get("/metrics").await;
        let prefix = format!("hardcount_leader_lease_lost_total{{role=\"{role}\"");
        body.lines()
            .filter(|l| l.starts_with(&prefix))
            .filter_map(|l| l.rsplit(' ').next()?.parse::<f64>().ok())
            .sum()
    }
}

impl Drop for Harness {
    fn drop(&mut self) {
        // The replicas' logs stay after a failure, to read.
        if !std::thread::panicking() {
            let _ = std::fs::remove_dir_all(&self.dir);
        }
        if let Some((stop, _)) = &self.feeder {
            stop.cancel();
        }
        for r in &mut self.replicas {
            if let Some(s) = &r.serve
                && r.stopped
            {
                s.signal("CONT");
            }
        }
    }
}
