//! The operator's statements on the lease rows: pause, unpause, clear a
//! cooldown, and read `leader_status` and the lease history (as
//! `hardcount_operator`, or any session the functions are granted to).

use std::time::Duration;

use db::{Db, Row, sql};
use serde::Serialize;

use super::StoreError;
use crate::Role;

/// Pause `role` (any session can do the same with `SELECT leader_pause(...)`).
pub async fn pause(db: &Db, role: Role, by: &str, reason: &str) -> Result<(), StoreError> {
    db.execute(
        sql("SELECT leader_pause($1, $2, $3)")
            .bind(role.as_str())
            .bind(by.to_owned())
            .bind(reason.to_owned()),
    )
    .await?;
    Ok(())
}

/// Unpause `role`. Leaves `not_before` alone.
pub async fn unpause(db: &Db, role: Role) -> Result<(), StoreError> {
    db.execute(sql("SELECT leader_unpause($1)").bind(role.as_str()))
        .await?;
    Ok(())
}

/// What [`clear_cooldown`] found.
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct ClearedCooldown {
    /// How much of the cooldown was left, on the database clock (None when none held).
    pub left: Option<Duration>,
    /// The role is paused: its cooldown is gone but it stays paused until unpaused.
    pub paused: bool,
}

/// Clear `role`'s cooldown (`not_before`, migration 0028) so it is due at the
/// next poll. Leaves the holder and a pause alone (docs/adr/0037).
pub async fn clear_cooldown(db: &Db, role: Role) -> Result<ClearedCooldown, StoreError> {
    let row = db
        .fetch_one(
            sql(
                "SELECT extract(epoch FROM cooldown_left)::float8 AS left_secs, paused \
                 FROM leader_clear_cooldown($1)",
            )
            .bind(role.as_str()),
        )
        .await?;
    let left: Option<f64> = row.try_get("left_secs").map_err(StoreError::from_row)?;
    Ok(ClearedCooldown {
        left: left.map(|s| Duration::from_secs_f64(s.max(0.0))),
        paused: row.try_get("paused").map_err(StoreError::from_row)?,
    })
}

/// One row of `leader_status`, for the CLI and the metrics scrape.
#[derive(Debug, Clone, Serialize)]
pub struct LeaseStatus {
    pub role: String,
    pub state: String,
    pub holder_id: Option<String>,
    pub holder_token: i64,
    pub acquired_at: Option<String>,
    pub expires_at: Option<String>,
    pub last_tick_ended_at: Option<String>,
    pub last_tick_holder: Option<String>,
    /// Seconds since the last completed tick, on the database clock; None if it never completed.
    pub last_tick_age_seconds: Option<f64>,
    pub not_before: Option<String>,
    pub paused_at: Option<String>,
    pub paused_by: Option<String>,
    pub pause_reason: Option<String>,
    /// The login that paused (`session_user`, migration 0012), beside the
    /// self-declared `paused_by`.
    pub paused_by_role: Option<String>,
    /// What the role last completed a tick on: `every 1h`, or a cron
    /// expression (`CRON_TZ=Europe/Berlin 0 0 9 * * MON-FRI`); None before
    /// its first completed tick since migration 0034.
    pub schedule: Option<String>,
    /// The slot its last completed tick covered (a cron schedule only).
    pub last_slot: Option<String>,
    /// When it is next due: the next slot, or the last completed tick plus
    /// the interval.
    pub next_slot: Option<String>,
    /// `next_slot` in epoch seconds, for the metric.
    pub next_slot_epoch: Option<f64>,
}

/// Every row of `leader_status`, ordered by role.
pub async fn status(db: &Db) -> Result<Vec<LeaseStatus>, StoreError> {
    let rows = db
        .fetch_all(sql(
            "SELECT role, state, holder_id, holder_token, \
                    acquired_at::text, expires_at::text, last_tick_ended_at::text, last_tick_holder, \
                    extract(epoch FROM last_tick_age)::float8 AS last_tick_age_seconds, \
                    not_before::text, paused_at::text, paused_by, pause_reason, paused_by_role, \
                    schedule, last_slot::text, next_slot::text, \
                    extract(epoch FROM next_slot)::float8 AS next_slot_epoch \
             FROM leader_status ORDER BY role",
        ))
        .await?;
    rows.iter()
        .map(|r| {
            Ok::<_, db::Error>(LeaseStatus {
                role: r.try_get("role")?,
                state: r.try_get("state")?,
                holder_id: r.try_get("holder_id")?,
                holder_token: r.try_get("holder_token")?,
                acquired_at: r.try_get("acquired_at")?,
                expires_at: r.try_get("expires_at")?,
                last_tick_ended_at: r.try_get("last_tick_ended_at")?,
                last_tick_holder: r.try_get("last_tick_holder")?,
                last_tick_age_seconds: r.try_get("last_tick_age_seconds")?,
                not_before: r.try_get("not_before")?,
                paused_at: r.try_get("paused_at")?,
                paused_by: r.try_get("paused_by")?,
                pause_reason: r.try_get("pause_reason")?,
                paused_by_role: r.try_get("paused_by_role")?,
                schedule: r.try_get("schedule")?,
                last_slot: r.try_get("last_slot")?,
                next_slot: r.try_get("next_slot")?,
                next_slot_epoch: r.try_get("next_slot_epoch")?,
            })
        })
        .collect::<Result<_, db::Error>>()
        .map_err(StoreError::from_row)
}

/// One term of the lease history (`leader_history`): a won ACQUIRE, from the
/// claim to its release or expiry.
#[derive(Debug, Clone, PartialEq, Serialize)]
pub struct Term {
    pub role: String,
    pub token: i64,
    pub holder_id: String,
    pub acquired_at: String,
    pub last_renewed_at: Option<String>,
    /// The expiry the term's last ACQUIRE or RENEW set.
    pub expires_at: String,
    pub released_at: Option<String>,
    /// How the tick ended ([`Release::as_str`], or `paused`); None if never released.
    pub tick_end: Option<String>,
    /// `held`, `released` or `expired`.
    pub state: String,
    /// The span, epoch microseconds on the database clock: from the claim
    /// to `min(released_at, expires_at)`.
    pub acquired_epoch_us: i64,
    pub ended_epoch_us: i64,
}

/// The lease history, newest term first: `role`'s terms, or every role's,
/// at most `limit` (1 to 10000). Reads the `leader_history` view, which the
/// operator role (hardcount_operator) may read and the app role may not.
pub async fn history(db: &Db, role: Option<Role>, limit: u32) -> Result<Vec<Term>, StoreError> {
    let limit = i64::from(limit.clamp(1, HISTORY_LIMIT_MAX));
    let rows = db
        .fetch_all(
            sql(
                "SELECT role, token, holder_id, acquired_at::text, last_renewed_at::text, \
                        expires_at::text, released_at::text, tick_end, state, \
                        (extract(epoch FROM acquired_at) * 1000000)::bigint AS acquired_us, \
                        (extract(epoch FROM ended_at) * 1000000)::bigint AS ended_us \
                 FROM leader_history \
                 WHERE $1::text IS NULL OR role = $1 \
                 ORDER BY acquired_at DESC, role, token DESC \
                 LIMIT $2",
            )
            .bind(role.map(|r| r.as_str().to_owned()))
            .bind(limit),
        )
        .await?;
    rows.iter()
        .map(|r| {
            Ok::<_, db::Error>(Term {
                role: r.try_get("role")?,
                token: r.try_get("token")?,
                holder_id: r.try_get("holder_id")?,
                acquired_at: r.try_get("acquired_at")?,
                last_renewed_at: r.try_get("last_renewed_at")?,
                expires_at: r.try_get("expires_at")?,
                released_at: r.try_get("released_at")?,
                tick_end: r.try_get("tick_end")?,
                state: r.try_get("state")?,
                acquired_epoch_us: r.try_get("acquired_us")?,
                ended_epoch_us: r.try_get("ended_us")?,
            })
        })
        .collect::<Result<_, db::Error>>()
        .map_err(StoreError::from_row)
}

/// The most terms [`history`] returns in one call.
pub const HISTORY_LIMIT_MAX: u32 = 10_000;
