//! The leader runtime against real Postgres, directly and through PgBouncer.
//!
//! Each guard test names, in its comment, the mutation that makes it fail.

mod contention;
mod failures;
mod history;
mod lease_path;
mod outcomes;
mod safety;
mod schedules;

use std::sync::Arc;
use std::time::Duration;

use db::{Db, Row, sql};
use leader::{Fence, Manager, Role, Telemetry, TickEnd, TickOutcome, Timing};
use metrics_exporter_prometheus::{PrometheusBuilder, PrometheusHandle};
use testbed::TestDb;
use tokio_util::sync::CancellationToken;

pub use testbed::leadership::fast_timing as fast;

/// A manager with its own metrics recorder, named `name`.
pub fn manager(db: &Db, timing: Timing, name: &str) -> (Manager, PrometheusHandle) {
    let recorder = PrometheusBuilder::new().build_recorder();
    let handle = recorder.handle();
    let m = Manager::with_holder_id(
        db.clone(),
        timing,
        Telemetry::new(Arc::new(recorder)),
        format!(
            "{name}:{}:{:08x}",
            std::process::id(),
            rand::random::<u32>()
        ),
    );
    (m, handle)
}

/// The value of one series in a Prometheus text rendering, if present.
pub fn series(handle: &PrometheusHandle, name: &str, labels: &str) -> Option<f64> {
    let wanted = format!("{name}{{{labels}}} ");
    handle
        .render()
        .lines()
        .find_map(|l| l.strip_prefix(&wanted).map(|v| v.trim().parse().unwrap()))
}

pub struct Lease {
    pub holder_id: Option<String>,
    pub token: i64,
    pub completed: bool,
    /// `not_before - now()` in seconds, on the database clock.
    pub cooldown: Option<f64>,
    pub paused: bool,
}

/// One poll of `role` by `m` whose work, if it leads, drains at once.
pub async fn drained(m: &Manager, role: Role, interval: Duration) -> TickOutcome {
    m.lead(role, interval, &CancellationToken::new(), |_| async {
        TickEnd::Drained
    })
    .await
    .unwrap()
}

pub async fn lease(db: &Db, role: Role) -> Lease {
    let r = db
        .fetch_one(
            sql("SELECT holder_id, holder_token, last_tick_ended_at IS NOT NULL AS completed, \
                        extract(epoch FROM not_before - now())::float8 AS cooldown, paused_at IS NOT NULL AS paused \
                 FROM leader_leases WHERE role = $1")
            .bind(role.as_str()),
        )
        .await
        .unwrap();
    Lease {
        holder_id: r.get("holder_id"),
        token: r.get("holder_token"),
        completed: r.get("completed"),
        cooldown: r.get("cooldown"),
        paused: r.get("paused"),
    }
}

/// A table of jobs and a fenced claim on it, standing in for a role's funnel.
pub async fn make_jobs(t: &TestDb, n: i64) {
    let mut su = t.superuser().await;
    sqlx::raw_sql(
        "CREATE TABLE jobs (id bigserial PRIMARY KEY, claimed_by bigint); \
         GRANT SELECT, UPDATE ON jobs TO hardcount_app",
    )
    .execute(&mut su)
    .await
    .unwrap();
    sqlx::query("INSERT INTO jobs (claimed_by) SELECT NULL FROM generate_series(1, $1)")
        .bind(n)
        .execute(&mut su)
        .await
        .unwrap();
}

/// Claim up to 10 jobs under `fence`; returns how many were claimed.
pub async fn claim_jobs(db: &Db, fence: &Fence) -> u64 {
    db.execute(
        sql("UPDATE jobs SET claimed_by = $2 WHERE id IN ( \
               SELECT id FROM jobs WHERE claimed_by IS NULL \
                 AND leader_fence($1, $2) \
               ORDER BY id LIMIT 10 FOR UPDATE SKIP LOCKED)")
        .bind(fence.role_name())
        .bind(fence.token()),
    )
    .await
    .unwrap()
}

#[test]
fn the_role_list_is_five_names() {
    assert_eq!(Role::ALL.len(), 5);
}

#[tokio::test]
async fn the_role_list_equals_the_check_constraint() {
    let t = TestDb::new().await;
    let mut from_check = leader::store::roles_allowed_by_check(&t.db).await.unwrap();
    from_check.sort();
    let mut ours: Vec<String> = Role::ALL.iter().map(|r| r.as_str().to_owned()).collect();
    ours.sort();
    assert_eq!(ours, from_check);
    leader::store::check_roles_seeded(&t.db).await.unwrap();
}

/// docs/adr/0002: a missing row is refused at boot, naming the role, and ACQUIRE
/// never recreates it.
#[tokio::test]
async fn a_missing_lease_row_is_named_at_boot_and_never_recreated() {
    let t = TestDb::new().await;
    let mut su = t.superuser().await;
    sqlx::raw_sql("DELETE FROM leader_leases WHERE role = 'dunning'")
        .execute(&mut su)
        .await
        .unwrap();
    let err = leader::store::check_roles_seeded(&t.db)
        .await
        .unwrap_err()
        .to_string();
    assert!(err.contains("dunning"), "{err}");
    let (m, _) = manager(&t.db, fast(), "a");
    let shutdown = tokio_util::sync::CancellationToken::new();
    let err = m
        .lead(Role::Dunning, Duration::ZERO, &shutdown, |_| async {
            TickEnd::Drained
        })
        .await
        .unwrap_err()
        .to_string();
    assert!(err.contains("no row for role dunning"), "{err}");
}
