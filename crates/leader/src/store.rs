//! All of `leader_leases`' and `leader_terms`' SQL. Each lease statement is
//! one self-contained statement evaluated on the database clock; none
//! compares a database timestamp with an application one. ACQUIRE and RENEW
//! read `statement_timestamp()`, not `now()`: `now()` is the start of the
//! transaction, and a lease's expiry and its predicates must hold when the
//! statement runs (docs/adr/0008). RELEASE's stamps on the lease row keep
//! `now()`, one round trip older, on the transaction it began itself.
//!
//! Each lease statement also writes the term's row in `leader_terms` (the
//! lease history, migration 0027) in the same statement, through a
//! data-modifying CTE on what the lease row's UPDATE returned: ACQUIRE
//! inserts the term, RENEW stamps `last_renewed_at` and the new expiry,
//! RELEASE stamps `released_at` and the tick's end. A statement that changes
//! no lease row writes no term, so the history says what the leases did, at
//! no extra round trip. [`history`] reads it back (`leader_history`, as the
//! operator) and [`crate::overlapping_terms`] checks it.

use std::time::Duration;

use chrono::{DateTime, Utc};
use db::{Db, Row, sql};

use crate::{Fence, Role};

mod operate;
pub use operate::{
    ClearedCooldown, HISTORY_LIMIT_MAX, LeaseStatus, Term, clear_cooldown, history, pause, status,
    unpause,
};

#[derive(Debug, thiserror::Error)]
pub enum StoreError {
    #[error(
        "leader_leases has no row for role {0}: the app never inserts lease rows (docs/adr/0002); \
         re-run the seed from migrations/0001_leader_leases.sql as the schema owner"
    )]
    MissingRow(Role),
    #[error(
        "leader_leases is missing rows for {0:?}; re-run the seed from migrations/0001_leader_leases.sql as the schema owner"
    )]
    MissingRoles(Vec<String>),
    /// No answer within the server's `statement_timeout` and a margin: the
    /// link to the database went silent (no reset, no reply), so the server's
    /// own timeout cannot answer either.
    #[error(
        "{statement} for role {role} got no answer within {after:?}: the connection to the \
         database is stalled; the role polls again"
    )]
    NoAnswer {
        role: Role,
        statement: &'static str,
        after: Duration,
    },
    #[error(transparent)]
    Db(#[from] db::Error),
}

/// How long past a lease statement's server `statement_timeout` the client
/// waits before it gives up on a silent link.
pub const CLIENT_MARGIN: Duration = Duration::from_millis(500);

/// `call` (a lease statement of `role`), given up as
/// [`StoreError::NoAnswer`] after `after`.
pub(crate) async fn answered<T>(
    role: Role,
    statement: &'static str,
    after: Duration,
    call: impl std::future::Future<Output = Result<T, StoreError>>,
) -> Result<T, StoreError> {
    tokio::time::timeout(after, call)
        .await
        .unwrap_or(Err(StoreError::NoAnswer {
            role,
            statement,
            after,
        }))
}

impl StoreError {
    fn from_row(e: impl Into<db::Error>) -> StoreError {
        StoreError::Db(e.into())
    }
}

/// What ACQUIRE saw.
#[derive(Debug, Clone, Copy, PartialEq)]
pub enum Acquire {
    /// We lead this tick with this token. `db_now` is the database's clock at the claim.
    Won { token: i64, db_now_epoch: f64 },
    /// Not due, held, paused or cooling down. `due_in` is how long until the row
    /// says it could be claimed, on the database clock (None when paused).
    /// `held`: another term's lease is live, so a graceful RELEASE can free
    /// the role before `due_in` (the poller then watches it more often).
    Lost {
        due_in: Option<Duration>,
        paused: bool,
        held: bool,
    },
}

/// ACQUIRE: claim `role` for one tick if it is unpaused, unheld (or expired),
/// due by `last_tick_ended_at + interval`, and past `not_before`. Racing
/// replicas serialize on the row lock and the loser re-evaluates the WHERE
/// against the winner's row, so at most one wins.
pub async fn acquire(
    db: &Db,
    role: Role,
    holder: &str,
    ttl: Duration,
    interval: Duration,
    statement_timeout: Duration,
) -> Result<Acquire, StoreError> {
    // Under a server timeout: a claim stuck behind a row lock must not come
    // back long after its own statement_timestamp(), with a lease that is
    // already short. The token is at least the epoch milliseconds of the claim,
    // so committed ACQUIREs lost in a failover or restore cannot make a token
    // be issued twice (the seed uses the same unit).
    let mut tx = db.begin_with_timeout(statement_timeout).await?;
    let row = tx
        .fetch_optional(
            sql("WITH claimed AS ( \
                   UPDATE leader_leases \
                   SET holder_token = GREATEST(holder_token + 1, \
                                              (extract(epoch FROM clock_timestamp()) * 1000)::bigint), \
                       holder_id = $2, acquired_at = statement_timestamp(), \
                       expires_at = statement_timestamp() + make_interval(secs => $3) \
                   WHERE role = $1 \
                     AND paused_at IS NULL \
                     AND (expires_at IS NULL OR expires_at <= statement_timestamp()) \
                     AND (last_tick_ended_at IS NULL OR last_tick_ended_at <= statement_timestamp() - make_interval(secs => $4)) \
                     AND (not_before IS NULL OR not_before <= statement_timestamp()) \
                   RETURNING role, holder_token, holder_id, expires_at, clock_timestamp() AS taken_at), \
               term AS ( \
                   INSERT INTO leader_terms (role, token, holder_id, acquired_at, expires_at) \
                   SELECT role, holder_token, holder_id, taken_at, expires_at FROM claimed) \
                 SELECT (SELECT holder_token FROM claimed) AS token, \
                        extract(epoch FROM statement_timestamp())::float8 AS db_now, \
                        l.paused_at IS NOT NULL AS paused, \
                        COALESCE(l.expires_at > statement_timestamp(), false) AS held, \
                        extract(epoch FROM GREATEST(l.expires_at, \
                                                    l.last_tick_ended_at + make_interval(secs => $4), \
                                                    l.not_before) - statement_timestamp())::float8 AS due_in \
                 FROM leader_leases l WHERE l.role = $1")
            .bind(role.as_str())
            .bind(holder.to_owned())
            .bind(ttl.as_secs_f64())
            .bind(interval.as_secs_f64()),
        )
        .await?
        .ok_or(StoreError::MissingRow(role))?;
    tx.commit().await?;
    let token: Option<i64> = row.try_get("token").map_err(StoreError::from_row)?;
    let db_now_epoch: f64 = row.try_get("db_now").map_err(StoreError::from_row)?;
    if let Some(token) = token {
        return Ok(Acquire::Won {
            token,
            db_now_epoch,
        });
    }
    let paused: bool = row.try_get("paused").map_err(StoreError::from_row)?;
    let held: bool = row.try_get("held").map_err(StoreError::from_row)?;
    let due_in: Option<f64> = row.try_get("due_in").map_err(StoreError::from_row)?;
    let due_in = if paused {
        None
    } else {
        Some(Duration::from_secs_f64(due_in.unwrap_or(0.0).max(0.0)))
    };
    Ok(Acquire::Lost {
        due_in,
        paused,
        held,
    })
}

/// What ACQUIRE of a slot saw (a role on a cron schedule, docs/adr/0043).
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct SlotAcquire {
    /// The token when we lead this tick.
    pub token: Option<i64>,
    /// The database's clock at the statement.
    pub db_now: DateTime<Utc>,
    /// What the row said before the claim: the last completed slot, else
    /// the last completed tick (an interval tick, before the schedule).
    pub since: Option<DateTime<Utc>>,
    /// How long the row is held or cooling down, on the database clock.
    pub blocked_for: Duration,
    pub paused: bool,
    /// Another term's lease is live (see [`Acquire::Lost`]).
    pub held: bool,
}

/// ACQUIRE for a slot: claim `role` for one tick if it is unpaused, unheld
/// (or expired), past `not_before`, and `slot` has come on the database
/// clock (`slot <= statement_timestamp()`) and is later than the last
/// completed slot (or, before the first, the last completed tick). The
/// replica computes `slot` from the reading this statement returns; the
/// database decides whether it is due, so a replica's clock plays no part.
/// A slot is run by one tick at a time, and once completed (RELEASE stamps
/// `last_slot`) by no other. `slot = None` claims nothing: it only reads.
pub async fn acquire_slot(
    db: &Db,
    role: Role,
    holder: &str,
    ttl: Duration,
    slot: Option<DateTime<Utc>>,
    statement_timeout: Duration,
) -> Result<SlotAcquire, StoreError> {
    let mut tx = db.begin_with_timeout(statement_timeout).await?;
    let row = tx
        .fetch_optional(
            sql("WITH claimed AS ( \
                   UPDATE leader_leases \
                   SET holder_token = GREATEST(holder_token + 1, \
                                              (extract(epoch FROM clock_timestamp()) * 1000)::bigint), \
                       holder_id = $2, acquired_at = statement_timestamp(), \
                       expires_at = statement_timestamp() + make_interval(secs => $3) \
                   WHERE role = $1 \
                     AND paused_at IS NULL \
                     AND (expires_at IS NULL OR expires_at <= statement_timestamp()) \
                     AND $4::timestamptz <= statement_timestamp() \
                     AND $4::timestamptz > COALESCE(last_slot, last_tick_ended_at, '-infinity') \
                     AND (not_before IS NULL OR not_before <= statement_timestamp()) \
                   RETURNING role, holder_token, holder_id, expires_at, clock_timestamp() AS taken_at), \
               term AS ( \
                   INSERT INTO leader_terms (role, token, holder_id, acquired_at, expires_at) \
                   SELECT role, holder_token, holder_id, taken_at, expires_at FROM claimed) \
                 SELECT (SELECT holder_token FROM claimed) AS token, \
                        statement_timestamp() AS db_now, \
                        COALESCE(l.last_slot, l.last_tick_ended_at) AS since, \
                        l.paused_at IS NOT NULL AS paused, \
                        COALESCE(l.expires_at > statement_timestamp(), false) AS held, \
                        extract(epoch FROM GREATEST(l.expires_at, l.not_before) - statement_timestamp())::float8 AS blocked_for \
                 FROM leader_leases l WHERE l.role = $1")
            .bind(role.as_str())
            .bind(holder.to_owned())
            .bind(ttl.as_secs_f64())
            .bind(slot),
        )
        .await?
        .ok_or(StoreError::MissingRow(role))?;
    tx.commit().await?;
    let blocked: Option<f64> = row.try_get("blocked_for").map_err(StoreError::from_row)?;
    Ok(SlotAcquire {
        token: row.try_get("token").map_err(StoreError::from_row)?,
        db_now: row.try_get("db_now").map_err(StoreError::from_row)?,
        since: row.try_get("since").map_err(StoreError::from_row)?,
        blocked_for: Duration::from_secs_f64(blocked.unwrap_or(0.0).max(0.0)),
        paused: row.try_get("paused").map_err(StoreError::from_row)?,
        held: row.try_get("held").map_err(StoreError::from_row)?,
    })
}

/// What a RELEASE records of the role's schedule (migration 0034), shown by
/// `leader_status`.
#[derive(Debug, Clone, Default, PartialEq)]
pub struct SlotStamp {
    /// The schedule the tick ran on, as the settings wrote it.
    pub schedule: String,
    /// The slot the tick covered: stamped as `last_slot` when it completed.
    /// None for an interval tick (which clears `last_slot`).
    pub slot: Option<DateTime<Utc>>,
    /// The next slot after it. None for an interval tick: the next due time
    /// is then the release plus the interval.
    pub next_slot: Option<DateTime<Utc>>,
}

/// What RENEW saw.
#[derive(Debug, Clone, Copy, PartialEq)]
pub enum Renew {
    /// Extended; the database clock at the renewal.
    Extended { db_now_epoch: f64 },
    /// No row of ours: taken over, released or paused. Definitive.
    Gone { paused: bool },
}

/// RENEW: extend the lease only for this token and a live holder, while it
/// has not expired: a renewal that arrives after the expiry (a process
/// suspended past its TTL with nobody taking over) would hide the gap in the
/// term's history and let the tick go on as if it had held throughout; it is
/// `Gone`, as after a takeover (docs/adr/0145). The server
/// cancels the statement after `statement_timeout` (`SET LOCAL`), so a blocked
/// renewal does not linger after we have given up on it.
pub async fn renew(
    db: &Db,
    role: Role,
    token: i64,
    ttl: Duration,
    statement_timeout: Duration,
) -> Result<Renew, StoreError> {
    let mut tx = db.begin_with_timeout(statement_timeout).await?;
    let row = tx
        .fetch_optional(
            sql(
                "WITH renewed AS ( \
                   UPDATE leader_leases SET expires_at = statement_timestamp() + make_interval(secs => $3) \
                   WHERE role = $1 AND holder_token = $2 AND holder_id IS NOT NULL \
                     AND expires_at > statement_timestamp() \
                   RETURNING role, holder_token, expires_at), \
                 term AS ( \
                   UPDATE leader_terms t SET last_renewed_at = statement_timestamp(), expires_at = r.expires_at \
                   FROM renewed r WHERE t.role = r.role AND t.token = r.holder_token) \
                 SELECT extract(epoch FROM statement_timestamp())::float8 AS db_now FROM renewed",
            )
            .bind(role.as_str())
            .bind(token)
            .bind(ttl.as_secs_f64()),
        )
        .await?;
    let out = match row {
        Some(row) => Renew::Extended {
            db_now_epoch: row.try_get("db_now").map_err(StoreError::from_row)?,
        },
        None => {
            let paused = tx
                .fetch_optional(
                    sql(
                        "SELECT paused_at IS NOT NULL AS paused FROM leader_leases WHERE role = $1",
                    )
                    .bind(role.as_str()),
                )
                .await?
                .map(|r| r.try_get::<bool, _>("paused"))
                .transpose()
                .map_err(StoreError::from_row)?
                .unwrap_or(false);
            Renew::Gone { paused }
        }
    };
    tx.commit().await?;
    Ok(out)
}

/// How a tick ended, as RELEASE records it (docs/adr/0003).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Release {
    /// Stamps `last_tick_ended_at` and `last_tick_holder`, clears `not_before`.
    Completed,
    /// Shutdown cancelled the tick: the role stays due, no cooldown.
    Interrupted,
    /// The lease was lost: `not_before = now() + min(interval, 60 s)`.
    Lost,
    /// The work panicked: `not_before = now() + interval`.
    Panicked,
    /// The work stopped at its budget with work left: not stamped, `not_before`
    /// cleared, so the role is due again at once (docs/adr/0007).
    MoreWork,
    /// The work failed: not stamped, `not_before = now() + min(interval,
    /// failure cooldown)` (docs/adr/0007).
    Failed,
    /// The work drained its queue and asks to be due again at once (it found
    /// work, or it listens for wake-ups): stamped like [`Release::Completed`]
    /// but one interval back, `now() - interval`, so the due predicate
    /// `last_tick_ended_at + interval <= now()` holds at once (docs/adr/0014).
    CompletedDueNow,
}

impl Release {
    pub fn as_str(self) -> &'static str {
        match self {
            Release::Completed => "completed",
            Release::Interrupted => "interrupted",
            Release::Lost => "lost",
            Release::Panicked => "panicked",
            Release::MoreWork => "more_work",
            Release::Failed => "failed",
            Release::CompletedDueNow => "completed_due_now",
        }
    }

    /// The `end` label on `hardcount_tick_total`: how the tick ended as the
    /// operator sees it (a completed tick drained its work).
    pub fn tick_end_label(self) -> &'static str {
        match self {
            Release::Completed | Release::CompletedDueNow => "drained",
            other => other.as_str(),
        }
    }
}

/// What a RELEASE wrote.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Released {
    /// Whether it changed the row (false after a takeover or pause).
    pub changed: bool,
    /// The outcome recorded: the one asked for, or `Lost` for a completed or
    /// more-work tick whose lease had expired before the release.
    pub recorded: Release,
}

/// RELEASE: clear the holder if this term still owns the row, recording the
/// outcome. A tick that says its work is done (completed, completed and due
/// now, more work) on a lease that expired before the release, with nobody
/// taking over, is recorded `lost`: no slot or tick time stamped, the lost
/// cooldown. Its claims ran with a false fence and claimed nothing, which
/// reads as drained; stamped completed, a cron slot whose work never ran was
/// done for good (docs/adr/0145).
#[allow(clippy::too_many_arguments)]
pub async fn release(
    db: &Db,
    role: Role,
    token: i64,
    outcome: Release,
    interval: Duration,
    failure_cooldown: Duration,
    stamp: &SlotStamp,
    statement_timeout: Duration,
) -> Result<Released, StoreError> {
    let mut tx = db.begin_with_timeout(statement_timeout).await?;
    let row = tx
        .fetch_one(
            sql("WITH cur AS ( \
                 SELECT role, CASE WHEN expires_at <= statement_timestamp() \
                                    AND $3 IN ('completed', 'completed_due_now', 'more_work') \
                               THEN 'lost' ELSE $3 END AS o \
                 FROM leader_leases \
                 WHERE role = $1 AND holder_token = $2 AND holder_id IS NOT NULL \
                 FOR UPDATE), \
               released AS ( \
                 UPDATE leader_leases l SET holder_id = NULL, expires_at = NULL, \
                   last_tick_ended_at = CASE c.o \
                       WHEN 'completed' THEN now() \
                       WHEN 'completed_due_now' THEN now() - make_interval(secs => $4) \
                       ELSE l.last_tick_ended_at END, \
                   last_tick_holder = CASE WHEN c.o IN ('completed', 'completed_due_now') \
                                           THEN l.holder_id ELSE l.last_tick_holder END, \
                   not_before = CASE c.o \
                       WHEN 'completed' THEN NULL \
                       WHEN 'completed_due_now' THEN NULL \
                       WHEN 'lost' THEN now() + LEAST(make_interval(secs => $4), interval '60 seconds') \
                       WHEN 'panicked' THEN now() + make_interval(secs => $4) \
                       WHEN 'failed' THEN now() + LEAST(make_interval(secs => $4), make_interval(secs => $5)) \
                       WHEN 'more_work' THEN NULL \
                       ELSE l.not_before END, \
                   schedule = CASE WHEN c.o IN ('completed', 'completed_due_now') THEN NULLIF($6, '') ELSE l.schedule END, \
                   last_slot = CASE WHEN c.o IN ('completed', 'completed_due_now') THEN $7 ELSE l.last_slot END, \
                   next_slot = CASE c.o \
                       WHEN 'completed' THEN COALESCE($8, now() + make_interval(secs => $4)) \
                       WHEN 'completed_due_now' THEN now() \
                       ELSE l.next_slot END \
                 FROM cur c WHERE l.role = c.role \
                 RETURNING l.role, c.o), \
               term AS ( \
                 UPDATE leader_terms t SET released_at = statement_timestamp(), tick_end = r.o \
                 FROM released r WHERE t.role = r.role AND t.token = $2) \
               SELECT count(*) AS changed, bool_or(o = 'lost' AND $3 <> 'lost') AS downgraded \
               FROM released")
            .bind(role.as_str())
            .bind(token)
            .bind(outcome.as_str())
            .bind(interval.as_secs_f64())
            .bind(failure_cooldown.as_secs_f64())
            .bind(stamp.schedule.clone())
            .bind(stamp.slot)
            .bind(stamp.next_slot),
        )
        .await?;
    tx.commit().await?;
    let changed: i64 = row.try_get("changed").map_err(StoreError::from_row)?;
    let downgraded: Option<bool> = row.try_get("downgraded").map_err(StoreError::from_row)?;
    Ok(Released {
        changed: changed == 1,
        recorded: if downgraded == Some(true) {
            Release::Lost
        } else {
            outcome
        },
    })
}

/// Delete at most `limit` (1 to 10000) terms of the lease history that ended
/// more than `older_than` ago (on the database clock), oldest first, and
/// return how many went. A term that is held, or ended more recently, is
/// kept. One call is one bounded batch. Unfenced, for the schema owner: the
/// roles prune their own terms with [`prune_own_terms`].
///
/// Runs `leader_terms_prune` (migration 0027), a definer function no service
/// role may execute until the retention work's migration grants it to the
/// role that runs it; today only the schema owner can.
///
/// # Errors
/// A database error, or the function's refusal of a `limit` outside 1 to
/// 10000 (SQLSTATE 22023).
pub async fn prune_terms(db: &Db, older_than: Duration, limit: u32) -> Result<u64, StoreError> {
    let row = db
        .fetch_one(
            sql("SELECT leader_terms_prune(make_interval(secs => $1), $2) AS pruned")
                .bind(older_than.as_secs_f64())
                .bind(i32::try_from(limit).unwrap_or(i32::MAX)),
        )
        .await?;
    let n: i64 = row.try_get("pruned").map_err(StoreError::from_row)?;
    Ok(u64::try_from(n).unwrap_or(0))
}

/// Delete at most `limit` (1 to 10000) of `fence`'s role's own lease terms
/// that ended more than `older_than` ago, oldest first, and return how many
/// went: the retention prune of the lease history (docs/adr/0040). Fenced: a
/// replaced leader (or a paused role) deletes nothing, and no role deletes
/// another's terms. A term that is held, or ended more recently, is kept.
///
/// Runs `leader_terms_prune_fenced` (migration 0030), a definer function:
/// hardcount_app reads and deletes nothing of `leader_terms` itself.
///
/// # Errors
/// A database error, or the function's refusal of a `limit` outside 1 to
/// 10000 (SQLSTATE 22023).
pub async fn prune_own_terms(
    db: &Db,
    fence: &Fence,
    older_than: Duration,
    limit: u32,
) -> Result<u64, StoreError> {
    let row = db
        .fetch_one(
            sql(
                "SELECT leader_terms_prune_fenced($1, $2, make_interval(secs => $3), $4) AS pruned",
            )
            .bind(fence.role_name())
            .bind(fence.token())
            .bind(older_than.as_secs_f64())
            .bind(i32::try_from(limit).unwrap_or(i32::MAX)),
        )
        .await?;
    let n: i64 = row.try_get("pruned").map_err(StoreError::from_row)?;
    Ok(u64::try_from(n).unwrap_or(0))
}

/// The boot check (docs/adr/0002): every role has its row.
pub async fn check_roles_seeded(db: &Db) -> Result<(), StoreError> {
    let rows = db.fetch_all(sql("SELECT role FROM leader_leases")).await?;
    let present: Vec<String> = rows
        .iter()
        .map(|r| r.try_get::<String, _>("role"))
        .collect::<Result<_, _>>()
        .map_err(StoreError::from_row)?;
    let missing: Vec<String> = Role::ALL
        .iter()
        .map(|r| r.as_str().to_owned())
        .filter(|r| !present.contains(r))
        .collect();
    if missing.is_empty() {
        Ok(())
    } else {
        Err(StoreError::MissingRoles(missing))
    }
}

/// The role names the table's CHECK constraint allows, read from the catalog.
pub async fn roles_allowed_by_check(db: &Db) -> Result<Vec<String>, StoreError> {
    let row = db
        .fetch_one(sql(
            "SELECT pg_get_constraintdef(oid) AS def FROM pg_constraint WHERE conname = 'leader_leases_role_known'",
        ))
        .await?;
    let def: String = row.try_get("def").map_err(StoreError::from_row)?;
    Ok(def
        .split('\'')
        .enumerate()
        .filter(|(i, _)| i % 2 == 1)
        .map(|(_, s)| s.to_owned())
        .collect())
}
