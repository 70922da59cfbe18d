//! The readiness snapshot and the task that keeps it (see the parent
//! module's header): the app path's schema and writability, the lease path
//! when it is its own, and `leader_status` into the telemetry, each step
//! under [`CHECK_TIMEOUT`], every [`REFRESH_EVERY`].

use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use db::Db;
use leader::Telemetry;
use tokio_util::sync::CancellationToken;
use tracing::{info, warn};

/// How often the background task refreshes the snapshot.
pub const REFRESH_EVERY: Duration = Duration::from_secs(2);
/// The most one check (the schema, writability, then `leader_status`) may take.
pub const CHECK_TIMEOUT: Duration = Duration::from_secs(2);
/// A snapshot older than this is not ready, whatever it says: the refresher is
/// stuck. Must exceed one refresh cycle (`REFRESH_EVERY + 3 × CHECK_TIMEOUT`).
pub const STALE_AFTER: Duration = Duration::from_secs(10);
/// What the last background check found.
#[derive(Debug, Default)]
pub struct StatusSnapshot {
    /// When the last check passed; `None` when the last one failed (or none ran).
    ready_at: Mutex<Option<Instant>>,
}

impl StatusSnapshot {
    pub(crate) fn set(&self, ready: bool) {
        let mut at = self.ready_at.lock().unwrap_or_else(|e| e.into_inner());
        *at = ready.then(Instant::now);
    }

    /// Ready when the last check passed less than [`STALE_AFTER`] ago.
    pub fn is_ready(&self) -> bool {
        let at = self.ready_at.lock().unwrap_or_else(|e| e.into_inner());
        at.is_some_and(|t| t.elapsed() < STALE_AFTER)
    }
}

/// One check: the schema and writability on the app path (`db`), then the
/// cluster facts from `leader_status` into `telemetry`. `Err` says why it is
/// not ready. A check that cannot read `leader_status` exports every role's
/// last tick as unknown, never the ages of the last read (docs/adr/0097); a
/// read-only database is read, so its ages grow while nothing runs.
///
/// `leader_status` is read on `status_db`, the lease path's check connection
/// when the leases have a path of their own: a server pool job statements
/// cannot fill (docs/adr/0036). Read on the app path, a backlog that filled
/// its server pool made the read wait out its timeout on every replica, so
/// every role's last tick went unknown, which silences the stall alert and
/// pages `HardcountRoleLastTickUnknown` while the roles work (docs/adr/0134).
async fn check(
    db: &Db,
    status_db: Option<&Db>,
    telemetry: &Telemetry,
    roles: &[leader::Role],
) -> Result<(), String> {
    let ready = match app_path_ready(db).await {
        Ok(ready) => ready,
        // The app path did not answer: with no other path, neither would
        // leader_status.
        Err(why) if status_db.is_none() => {
            scheduler::mark_status_unknown(telemetry, roles);
            return Err(why);
        }
        Err(why) => Err(why),
    };
    if tokio::time::timeout(
        CHECK_TIMEOUT,
        scheduler::export_status(status_db.unwrap_or(db), telemetry, roles),
    )
    .await
    .is_err()
    {
        warn!("reading leader_status for /metrics took over {CHECK_TIMEOUT:?}");
        scheduler::mark_status_unknown(telemetry, roles);
    }
    ready
}

/// The app path's schema, then whether it takes writes. The outer `Err`: it
/// did not answer (a timeout, an error); the inner: it answered and is not
/// ready.
async fn app_path_ready(db: &Db) -> Result<Result<(), String>, String> {
    match tokio::time::timeout(CHECK_TIMEOUT, db::check_schema_ready(db)).await {
        Err(_) => return Err(format!("the readiness check took over {CHECK_TIMEOUT:?}")),
        Ok(Err(e)) => return Err(e.to_string()),
        Ok(Ok(())) => {}
    }
    // A database that takes no writes (turned read-only, a standby after a
    // failover) runs nothing: every ACQUIRE fails. Not ready, so the operator
    // and the load balancer see it (issue 27, point 5).
    let writable = db.fetch_one(db::sql(
        "SELECT NOT (pg_is_in_recovery() OR current_setting('transaction_read_only')::boolean) AS writable",
    ));
    match tokio::time::timeout(CHECK_TIMEOUT, writable).await {
        Err(_) => Err(format!("the readiness check took over {CHECK_TIMEOUT:?}")),
        Ok(Err(e)) => Err(e.to_string()),
        Ok(Ok(row)) => Ok(match db::Row::try_get::<bool, _>(&row, "writable") {
            Ok(true) => Ok(()),
            _ => Err("the database is read-only: no role can run".to_owned()),
        }),
    }
}

/// The lease path, when it is not DATABASE_URL's: answering within
/// [`CHECK_TIMEOUT`]. Without it every ACQUIRE and RENEW fails while the app
/// pool answers. The reason never shows the URL.
async fn check_lease_path(lease_db: Option<&Db>) -> Result<(), String> {
    let Some(lease_db) = lease_db else {
        return Ok(());
    };
    match tokio::time::timeout(
        CHECK_TIMEOUT,
        lease_db.fetch_one(db::sql("SELECT 1 AS one")),
    )
    .await
    {
        Err(_) => Err(format!(
            "the lease path (HARDCOUNT_LEASE_DATABASE_URL) did not answer within {CHECK_TIMEOUT:?}"
        )),
        Ok(Err(e)) => Err(format!(
            "the lease path (HARDCOUNT_LEASE_DATABASE_URL) failed: {e}"
        )),
        Ok(Ok(_)) => Ok(()),
    }
}

/// Refresh `snapshot` once now, then every [`REFRESH_EVERY`] until `stop`.
/// `lease_db` is the lease path's own check pool, when the leases have one.
/// Logs a change of readiness once, with the reason.
pub async fn refresh_status(
    db: Db,
    lease_db: Option<Db>,
    telemetry: Telemetry,
    roles: Vec<leader::Role>,
    snapshot: Arc<StatusSnapshot>,
    stop: CancellationToken,
) {
    let mut was_ready = true;
    loop {
        // Side by side, so the lease check adds nothing to a cycle's length
        // (`STALE_AFTER`).
        let (app, lease) = tokio::join!(
            check(&db, lease_db.as_ref(), &telemetry, &roles),
            check_lease_path(lease_db.as_ref())
        );
        let result = app.and(lease);
        match (&result, was_ready) {
            (Err(why), true) => warn!(reason = %why, "not ready"),
            (Ok(()), false) => info!("ready again"),
            _ => {}
        }
        was_ready = result.is_ok();
        snapshot.set(was_ready);
        if stop
            .run_until_cancelled(tokio::time::sleep(REFRESH_EVERY))
            .await
            .is_none()
        {
            return;
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_snapshot_goes_stale_only_after_a_whole_refresh_cycle() {
        assert!(STALE_AFTER > REFRESH_EVERY + CHECK_TIMEOUT * 3);
        let s = StatusSnapshot::default();
        assert!(!s.is_ready());
        s.set(true);
        assert!(s.is_ready());
        s.set(false);
        assert!(!s.is_ready());
    }
}
