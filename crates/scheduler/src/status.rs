//! Leader metrics read from the table: a cluster fact any replica can export.

use db::Db;
use leader::{Role, Telemetry};
use tracing::warn;

/// The lease-lost reasons an alert counts with `increase()`
/// (`HardcountTickPanicked`, `HardcountLeasesLost`).
const ALERTED_LOSSES: [&str; 5] = [
    "panicked",
    "heartbeat_failed",
    "superseded",
    "heartbeat_timeout",
    "expired",
];

/// Create the series that must exist before anything happens, so an alert on
/// `increase(...[1h]) > 0` fires on the first event after a start (a series
/// born at 1 has no increase to show): `hardcount_leader_lease_lost_total`
/// at 0 for every role and every reason an alert counts, and
/// `hardcount_leader_status_errors_total` at 0 (its first failed read after a
/// start was not a rate), and `hardcount_backlog_read_errors_total` at 0 for
/// every role (`HardcountBacklogUnread`, docs/adr/0137). (A role's own series
/// are born where the role is built: billing's key refusal in `Biller::new`.)
pub fn precreate_series(telemetry: &Telemetry) {
    telemetry
        .counter("hardcount_leader_status_errors_total", &[])
        .increment(0);
    for role in Role::ALL {
        telemetry.precreate_backlog_read_errors(role);
        for reason in ALERTED_LOSSES {
            telemetry
                .counter(
                    "hardcount_leader_lease_lost_total",
                    &[("role", role.as_str()), ("reason", reason)],
                )
                .increment(0);
        }
    }
}

/// Export one reading of `leader_status`:
/// `hardcount_leader_last_tick_age_seconds{role}` (only for a role that has
/// completed a tick, never negative), `hardcount_leader_last_tick_known{role}`
/// (0 when the role never completed a tick or the read failed: alert on it
/// rather than on a missing age), `hardcount_leader_paused{role}`, and
/// `hardcount_leader_next_slot_timestamp_seconds{role}` (when the role is
/// next due, epoch seconds on the database clock: its next cron slot, or its
/// last completed tick plus the interval; an alert on `time() - it` sees a
/// late slot, docs/adr/0043).
///
/// The ages are exported for `roles` only (the roles the deployment runs), so
/// a role this build does not run is not reported as stalled; `paused` is
/// exported for every role.
pub async fn export_status(db: &Db, telemetry: &Telemetry, roles: &[Role]) {
    match leader::store::status(db).await {
        Ok(rows) => {
            // A role of this replica with no lease row (deleted by hand) has
            // no last tick to show.
            for role in roles {
                if !rows.iter().any(|r| r.role.as_str() == role.as_str()) {
                    telemetry
                        .gauge(
                            "hardcount_leader_last_tick_known",
                            &[("role", role.as_str())],
                        )
                        .set(0.0);
                }
            }
            for row in rows {
                let role = row.role.as_str();
                let paused = if row.paused_at.is_some() { 1.0 } else { 0.0 };
                telemetry
                    .gauge("hardcount_leader_paused", &[("role", role)])
                    .set(paused);
                if !roles.iter().any(|r| r.as_str() == role) {
                    continue;
                }
                let known = match row.last_tick_age_seconds {
                    Some(age) => {
                        telemetry
                            .gauge("hardcount_leader_last_tick_age_seconds", &[("role", role)])
                            .set(age.max(0.0));
                        1.0
                    }
                    None => 0.0,
                };
                telemetry
                    .gauge("hardcount_leader_last_tick_known", &[("role", role)])
                    .set(known);
                if let Some(next) = row.next_slot_epoch {
                    telemetry
                        .gauge(
                            "hardcount_leader_next_slot_timestamp_seconds",
                            &[("role", role)],
                        )
                        .set(next);
                }
            }
        }
        Err(e) => {
            warn!(error = %e, "cannot read leader_status for metrics");
            mark_status_unknown(telemetry, roles);
        }
    }
}

/// What a replica that could not read `leader_status` exports: the read
/// counted failed and the last tick of each of `roles` (the roles the
/// deployment runs, as [`export_status`] takes them) unknown, never the ages
/// of its last good read, which would stay healthy while nothing runs
/// (ADR-114: an error state is exported as such; docs/adr/0097). A role the
/// deployment does not run gets no series: nothing would set it back once
/// the database answers, and it would page for a role no one runs. For a
/// read that failed, timed out, or was not made because the database did not
/// answer its readiness check.
///
/// Every role's `paused` goes to 0: this replica cannot say a role is paused,
/// and the alerts take the largest `paused` of all replicas, so a 1 kept from
/// its last good read would hold back every replica's stall alert for a role
/// unpaused since (docs/adr/0111). The replicas that can read say the truth.
pub fn mark_status_unknown(telemetry: &Telemetry, roles: &[Role]) {
    telemetry
        .counter("hardcount_leader_status_errors_total", &[])
        .increment(1);
    for role in Role::ALL {
        telemetry
            .gauge("hardcount_leader_paused", &[("role", role.as_str())])
            .set(0.0);
    }
    for role in roles {
        telemetry
            .gauge(
                "hardcount_leader_last_tick_known",
                &[("role", role.as_str())],
            )
            .set(0.0);
    }
}
