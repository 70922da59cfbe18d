//! The writes of a retry's outcome: the run recovered (paid), its decline
//! counted with the next retry scheduled or the run exhausted, the attempt
//! rewound (no definite answer), and the run stopped or recovered because
//! its invoice was settled elsewhere. Each batched (`*_in`, in the caller's
//! transaction) and one run at a time (its own transaction: the fallback).
//!
//! Every write proves `status` and the `attempt_count` it was derived from;
//! an event or email is queued in the write's transaction and only when the
//! write changed the row.

use std::collections::{HashMap, HashSet};
use std::time::Duration;

use chrono::{DateTime, Utc};
use db::{Db, Row, Tx, sql};

use crate::Error;
use crate::ctx::Ctx;
use crate::notices::{sender, warning};
use crate::policy::AfterDecline;
use crate::run::{Retry, Run};

/// A compare-and-set of a batch of runs as one statement: the batch `u`
/// (an `unnest` of arrays, one row per run, with `id`), each run locked in a
/// LATERAL subquery only while it passes `check` (conditions on `r`, the run,
/// and `u`), then `UPDATE dunning_runs r SET set FROM` the runs locked (named
/// `u` again, every column of the batch) `RETURNING returning`.
///
/// Written as `UPDATE … FROM unnest(…) WHERE r.id = u.id AND check`, the
/// planner may drive the loop from `dunning_runs` and join the batch by a
/// filter: on tables never analyzed, `status = 'active'`'s default selectivity
/// makes every active run look like a few, and a batch of 500 then read all of
/// them for each of its rows (873 ms at 10,000 runs, docs/adr/0066). The
/// LATERAL subquery can only be evaluated once per row of the batch, so each
/// run is reached by its key whatever the statistics say; the update then
/// joins only the rows locked, with no condition of its own on `r`. The rows
/// are locked in the batch's order.
macro_rules! update_held_runs {
    (batch: $batch:literal, check: $check:expr, set: $set:literal, returning: $ret:literal $(,)?) => {
        concat!(
            "WITH held AS ( \
               SELECT u.* FROM ",
            $batch,
            " \
               CROSS JOIN LATERAL (SELECT 1 FROM dunning_runs r \
                                   WHERE r.id = u.id AND ",
            $check,
            " FOR UPDATE) h \
             ) \
             UPDATE dunning_runs r SET ",
            $set,
            " FROM held u WHERE r.id = u.id RETURNING ",
            $ret
        )
    };
}
pub(crate) use update_held_runs;

/// The run's invoice is still open (`r` the run). A decline or an exhaustion
/// lands only under it: an invoice paid by hand after the run was listed
/// announces no decline (docs/adr/0094).
macro_rules! invoice_open {
    ($run:literal) => {
        concat!(
            "EXISTS (SELECT 1 FROM invoices i WHERE i.tenant_id = ",
            $run,
            ".tenant_id AND i.id = ",
            $run,
            ".invoice_id AND i.status = 'open')"
        )
    };
}

/// [`recover`] for a batch, in the caller's transaction: each run (whose
/// retry `attempt` paid its invoice) → recovered only while it holds that
/// count, with one statement, and `dunning.recovered` for each run that
/// changed, with one more. Returns the runs recovered.
pub(crate) async fn recover_in(tx: &mut Tx, runs: &[(&Run, i32)]) -> Result<HashSet<i64>, Error> {
    if runs.is_empty() {
        return Ok(HashSet::new());
    }
    let rows = tx
        .fetch_all(
            sql(update_held_runs!(
                batch: "unnest($1::bigint[], $2::int4[]) AS u(id, attempt)",
                check: "r.status = 'active' AND r.attempt_count = u.attempt",
                set: "status = 'recovered', ended_at = now(), updated_at = now()",
                returning: "r.id",
            ))
            .bind(runs.iter().map(|(r, _)| r.id).collect::<Vec<_>>())
            .bind(runs.iter().map(|(_, a)| *a).collect::<Vec<_>>()),
        )
        .await?;
    let won: HashSet<i64> = rows
        .iter()
        .map(|r| r.try_get("id"))
        .collect::<Result<_, _>>()
        .map_err(db::Error::from)?;
    let payloads: Vec<(&str, String)> = runs
        .iter()
        .filter(|(r, _)| won.contains(&r.id))
        .map(|(r, a)| {
            let p = payload(r, "recovered", *a, serde_json::json!({}));
            (r.tenant_id.as_str(), p)
        })
        .collect();
    let events: Vec<outbox::webhook::NewEvent<'_>> = payloads
        .iter()
        .map(|(t, p)| (*t, "dunning.recovered", p.as_str()))
        .collect();
    outbox::webhook::enqueue_many(tx, &events).await?;
    Ok(won)
}

/// A definite decline of a run's retry, as [`decline_in`] writes it.
pub(crate) struct Decline<'a> {
    pub run: &'a Run,
    /// The retry declined: the count `record_attempts_in` wrote.
    pub attempt: i32,
    /// The hold `record_attempts_in` wrote: the decline lands only over it,
    /// so a decline written once (an outcome whose commit was answered by an
    /// error, then written again by the fallback) is not written twice.
    pub held: DateTime<Utc>,
    pub code: String,
    /// The next retry; `None`: this was the last, the run is exhausted.
    pub next: Option<DateTime<Utc>>,
    /// The warning, if the policy sends one (the final notice is the final
    /// action's, sent only if the action changed something).
    pub email: Option<outbox::email::Email>,
}

impl<'a> Decline<'a> {
    /// The decline of `run`'s retry `attempt`, to land over `held`: the next
    /// retry as `plan` says (or exhaustion), and the warning if the policy
    /// warns after that retry (none when exhausted: the final notice is the
    /// final action's).
    pub(crate) fn planned(
        ctx: &Ctx,
        run: &'a Run,
        (attempt, held): (i32, DateTime<Utc>),
        code: String,
        plan: AfterDecline,
    ) -> Decline<'a> {
        let next = match plan {
            AfterDecline::Next { at } => Some(at),
            AfterDecline::Exhausted => None,
        };
        let email = next
            .filter(|_| run.policy.warns_after(attempt))
            .map(|at| warning(run, sender(run, &ctx.config.email_from), &code, at));
        Decline {
            run,
            attempt,
            held,
            code,
            next,
            email: ctx.sendable(run, email),
        }
    }
}

/// [`decline`] and [`exhaust`] for a batch, in the caller's transaction: one
/// statement for the runs whose next retry is scheduled, one for the runs
/// exhausted, each run only while it holds the count and the hold its retry
/// wrote and its invoice is still open (one paid by hand after the listing
/// announces no decline: docs/adr/0094); then
/// `dunning.attempt_failed` / `dunning.exhausted` and the emails of the runs
/// that changed, with one statement each. Returns the runs that changed (an
/// exhausted one still owes its final action).
pub(crate) async fn decline_in(tx: &mut Tx, rows: &[Decline<'_>]) -> Result<HashSet<i64>, Error> {
    let (next, last): (Vec<&Decline<'_>>, Vec<&Decline<'_>>) =
        rows.iter().partition(|d| d.next.is_some());
    let mut won: HashSet<i64> = HashSet::new();
    if !next.is_empty() {
        let changed = tx
            .fetch_all(
                sql(update_held_runs!(
                    batch: "unnest($1::bigint[], $2::int4[], $3::timestamptz[], $4::text[], \
                                   $5::timestamptz[]) AS u(id, attempt, next, code, held)",
                    check: concat!(
                        "r.status = 'active' AND r.attempt_count = u.attempt \
                         AND r.next_attempt_at = u.held AND ",
                        invoice_open!("r")
                    ),
                    set: "next_attempt_at = u.next, last_decline_code = u.code, \
                          owed_notice_attempt = NULL, updated_at = now()",
                    returning: "r.id",
                ))
                .bind(next.iter().map(|d| d.run.id).collect::<Vec<_>>())
                .bind(next.iter().map(|d| d.attempt).collect::<Vec<_>>())
                .bind(next.iter().map(|d| d.next).collect::<Vec<_>>())
                .bind(next.iter().map(|d| d.code.clone()).collect::<Vec<_>>())
                .bind(next.iter().map(|d| d.held).collect::<Vec<_>>()),
            )
            .await?;
        for r in &changed {
            won.insert(r.try_get("id").map_err(db::Error::from)?);
        }
    }
    if !last.is_empty() {
        let changed = tx
            .fetch_all(
                sql(update_held_runs!(
                    batch: "unnest($1::bigint[], $2::int4[], $3::text[]) AS u(id, attempt, code)",
                    check: concat!(
                        "r.status = 'active' AND r.attempt_count = u.attempt AND ",
                        invoice_open!("r")
                    ),
                    set: "status = 'exhausted', ended_at = now(), next_attempt_at = now(), \
                          last_decline_code = u.code, owed_notice_attempt = NULL, \
                          updated_at = now()",
                    returning: "r.id",
                ))
                .bind(last.iter().map(|d| d.run.id).collect::<Vec<_>>())
                .bind(last.iter().map(|d| d.attempt).collect::<Vec<_>>())
                .bind(last.iter().map(|d| d.code.clone()).collect::<Vec<_>>()),
            )
            .await?;
        for r in &changed {
            won.insert(r.try_get("id").map_err(db::Error::from)?);
        }
    }
    let applied: Vec<&Decline<'_>> = rows.iter().filter(|d| won.contains(&d.run.id)).collect();
    let payloads: Vec<(&str, &'static str, String)> = applied
        .iter()
        .map(|d| {
            let tenant = d.run.tenant_id.as_str();
            match d.next {
                Some(at) => {
                    let extra = serde_json::json!({"decline_code": d.code, "next_attempt_at": at.to_rfc3339()});
                    (tenant, "dunning.attempt_failed", payload(d.run, "active", d.attempt, extra))
                }
                None => {
                    let extra = serde_json::json!({
                        "decline_code": d.code,
                        "final_action": d.run.policy.final_action.as_str(),
                    });
                    (tenant, "dunning.exhausted", payload(d.run, "exhausted", d.attempt, extra))
                }
            }
        })
        .collect();
    let events: Vec<outbox::webhook::NewEvent<'_>> = payloads
        .iter()
        .map(|(t, e, p)| (*t, *e, p.as_str()))
        .collect();
    outbox::webhook::enqueue_many(tx, &events).await?;
    let emails: Vec<(&str, &outbox::email::Email)> = applied
        .iter()
        .filter_map(|d| d.email.as_ref().map(|e| (d.run.tenant_id.as_str(), e)))
        .collect();
    outbox::email::enqueue_many(tx, &emails).await?;
    Ok(won)
}

/// [`rewind`] for a batch, one statement in the caller's transaction: each
/// run back to its listed count and next attempt, only while it holds the
/// count and the hold its record wrote, with the mark of a decline owed that
/// the record wrote taken back (the mark at the rewound count, one a pause
/// held, stays; docs/adr/0115). Returns the runs rewound.
pub(crate) async fn rewind_in(
    tx: &mut Tx,
    runs: &[(&Run, DateTime<Utc>)],
) -> Result<HashSet<i64>, db::Error> {
    if runs.is_empty() {
        return Ok(HashSet::new());
    }
    let rows = tx
        .fetch_all(
            sql(update_held_runs!(
                batch: "unnest($1::bigint[], $2::int4[], $3::timestamptz[], $4::timestamptz[]) \
                        AS u(id, listed, listed_at, held)",
                check: "r.status = 'active' AND r.attempt_count = u.listed + 1 \
                        AND r.next_attempt_at = u.held",
                set: "attempt_count = u.listed, next_attempt_at = u.listed_at, \
                      owed_notice_attempt = NULLIF(r.owed_notice_attempt, u.listed + 1), \
                      updated_at = now()",
                returning: "r.id",
            ))
            .bind(runs.iter().map(|(r, _)| r.id).collect::<Vec<_>>())
            .bind(
                runs.iter()
                    .map(|(r, _)| r.attempt_count)
                    .collect::<Vec<_>>(),
            )
            .bind(
                runs.iter()
                    .map(|(r, _)| r.next_attempt_at)
                    .collect::<Vec<_>>(),
            )
            .bind(runs.iter().map(|(_, h)| *h).collect::<Vec<_>>()),
        )
        .await?;
    Ok(rows
        .iter()
        .map(|r| r.try_get("id"))
        .collect::<Result<_, _>>()?)
}

/// Runs that wait for a pending attempt (docs/adr/0073), one statement in the
/// caller's transaction: each run's `next_attempt_at` set to `hold` from now
/// (or its `next`, if sooner), only while it has the `count` and
/// `next_attempt_at` (`was`) given: a retry answered `processing` proves the
/// count and hold its record wrote, and a spent run waiting for its last
/// retry's outcome proves the count and time it was listed with. A retry
/// answered `processing` with a retry planned after it (`next`) also records
/// that its attempt owes its decline's notices (`owed_notice_attempt`): the
/// listing holds the run while the attempt is pending and has its decline
/// announced once it settles (docs/adr/0085). Nothing is counted or
/// announced here. Returns the runs that now wait, each with the time it
/// waits until.
pub(crate) async fn wait_in(
    tx: &mut Tx,
    runs: &[Waiting<'_>],
    hold: Duration,
) -> Result<HashMap<i64, DateTime<Utc>>, db::Error> {
    if runs.is_empty() {
        return Ok(HashMap::new());
    }
    let rows = tx
        .fetch_all(
            sql(update_held_runs!(
                batch: "unnest($1::bigint[], $2::int4[], $3::timestamptz[], $4::timestamptz[]) \
                        AS u(id, expected, was, next)",
                check: "r.status = 'active' AND r.attempt_count = u.expected \
                        AND r.next_attempt_at = u.was",
                set: "next_attempt_at = LEAST(u.next, now() + make_interval(secs => $5)), \
                      owed_notice_attempt = CASE WHEN u.next IS NOT NULL THEN u.expected \
                                                 ELSE r.owed_notice_attempt END, \
                      updated_at = now()",
                returning: "r.id, r.next_attempt_at",
            ))
            .bind(runs.iter().map(|w| w.run.id).collect::<Vec<_>>())
            .bind(runs.iter().map(|w| w.count).collect::<Vec<_>>())
            .bind(runs.iter().map(|w| w.was).collect::<Vec<_>>())
            .bind(runs.iter().map(|w| w.next).collect::<Vec<_>>())
            .bind(hold.as_secs_f64()),
        )
        .await?;
    rows.iter()
        .map(|r| Ok((r.try_get("id")?, r.try_get("next_attempt_at")?)))
        .collect()
}

/// A run [`wait_in`] sets waiting: proves `count` and `was`, then waits
/// until `next` (`None`: a hold from now).
pub(crate) struct Waiting<'a> {
    pub run: &'a Run,
    pub count: i32,
    pub was: DateTime<Utc>,
    pub next: Option<DateTime<Utc>>,
}

/// Undo `record_attempts_in` for one run through the same compare-and-set: the run is again
/// as it was listed. Proves the count and the hold that call wrote, so it
/// undoes only that attempt, and nothing once a transition moved the run.
pub(crate) async fn rewind(
    db: &Db,
    run: &Run,
    held: DateTime<Utc>,
    statement_timeout: Duration,
) -> Result<bool, db::Error> {
    let mut tx = db.begin_with_timeout(statement_timeout).await?;
    let n = tx
        .execute(
            sql(
                "UPDATE dunning_runs SET attempt_count = $2, next_attempt_at = $3, \
                        owed_notice_attempt = NULLIF(owed_notice_attempt, $2 + 1), \
                        updated_at = now() \
                 WHERE id = $1 AND status = 'active' AND attempt_count = $2 + 1 \
                   AND next_attempt_at = $4",
            )
            .bind(run.id)
            .bind(run.attempt_count)
            .bind(run.next_attempt_at)
            .bind(held),
        )
        .await?;
    tx.commit().await?;
    Ok(n == 1)
}

/// Retry `attempt` paid the invoice: the run → recovered, `dunning.recovered`.
pub(crate) async fn recover(
    db: &Db,
    run: &Run,
    attempt: i32,
    statement_timeout: Duration,
) -> Result<bool, Error> {
    let update = sql(
        "UPDATE dunning_runs SET status = 'recovered', ended_at = now(), updated_at = now() \
                      WHERE id = $1 AND status = 'active' AND attempt_count = $2",
    )
    .bind(run.id)
    .bind(attempt);
    let event = payload(run, "recovered", attempt, serde_json::json!({}));
    transition(
        db,
        statement_timeout,
        update,
        run,
        ("dunning.recovered", event),
        None,
    )
    .await
}

/// Retry `attempt` was declined and another follows at `next`:
/// `dunning.attempt_failed`, and the warning email if the policy sends one.
/// Lands only over the hold its record wrote (as [`decline_in`]).
pub(crate) async fn decline(
    db: &Db,
    run: &Run,
    (attempt, held): (i32, DateTime<Utc>),
    (code, next): (&str, DateTime<Utc>),
    email: Option<outbox::email::Email>,
    statement_timeout: Duration,
) -> Result<bool, Error> {
    let update = sql(concat!(
        "UPDATE dunning_runs r SET next_attempt_at = $3, last_decline_code = $4, \
                             owed_notice_attempt = NULL, updated_at = now() \
                      WHERE id = $1 AND status = 'active' AND attempt_count = $2 \
                        AND next_attempt_at = $5 AND ",
        invoice_open!("r")
    ))
    .bind(run.id)
    .bind(attempt)
    .bind(next)
    .bind(code.to_owned())
    .bind(held);
    let extra = serde_json::json!({"decline_code": code, "next_attempt_at": next.to_rfc3339()});
    let event = payload(run, "active", attempt, extra);
    transition(
        db,
        statement_timeout,
        update,
        run,
        ("dunning.attempt_failed", event),
        email,
    )
    .await
}

/// The last retry was declined: the run → exhausted (its final action owed),
/// `dunning.exhausted`.
pub(crate) async fn exhaust(
    db: &Db,
    run: &Run,
    attempt: i32,
    code: &str,
    statement_timeout: Duration,
) -> Result<bool, Error> {
    let update = sql(concat!(
        "UPDATE dunning_runs r SET status = 'exhausted', ended_at = now(), \
                             next_attempt_at = now(), last_decline_code = $3, \
                             owed_notice_attempt = NULL, updated_at = now() \
                      WHERE id = $1 AND status = 'active' AND attempt_count = $2 AND ",
        invoice_open!("r")
    ))
    .bind(run.id)
    .bind(attempt)
    .bind(code.to_owned());
    let extra = serde_json::json!({
        "decline_code": code,
        "final_action": run.policy.final_action.as_str(),
    });
    let event = payload(run, "exhausted", attempt, extra);
    transition(
        db,
        statement_timeout,
        update,
        run,
        ("dunning.exhausted", event),
        None,
    )
    .await
}

/// The invoice was settled elsewhere (paid by hand or by billing, voided,
/// written off): the run ends without a charge, `recovered` if the invoice
/// is paid (`dunning.recovered`), else `stopped` (`dunning.stopped`).
pub(crate) async fn stop(
    db: &Db,
    run: &Run,
    invoice_status: &str,
    statement_timeout: Duration,
) -> Result<bool, Error> {
    let (status, event_type) = if invoice_status == "paid" {
        ("recovered", "dunning.recovered")
    } else {
        ("stopped", "dunning.stopped")
    };
    let update = sql(
        "UPDATE dunning_runs SET status = $3, ended_at = now(), updated_at = now() \
                      WHERE id = $1 AND status = 'active' AND attempt_count = $2",
    )
    .bind(run.id)
    .bind(run.attempt_count)
    .bind(status);
    let extra = serde_json::json!({"invoice_status": invoice_status, "settled_elsewhere": true});
    let event = payload(run, status, run.attempt_count, extra);
    transition(
        db,
        statement_timeout,
        update,
        run,
        (event_type, event),
        None,
    )
    .await
}

pub(crate) fn stopped(applied: bool, invoice_status: &str) -> Retry {
    if applied {
        Retry::Stopped {
            invoice_status: invoice_status.to_owned(),
        }
    } else {
        Retry::Lost
    }
}

pub(crate) fn payload(run: &Run, status: &str, attempt: i32, extra: serde_json::Value) -> String {
    let mut p = serde_json::json!({
        "object": "dunning_run",
        "id": run.id,
        "invoice": run.invoice_id,
        "subscription": run.subscription_id,
        "status": status,
        "attempt_count": attempt,
    });
    if let (Some(p), serde_json::Value::Object(extra)) = (p.as_object_mut(), extra) {
        p.extend(extra);
    }
    p.to_string()
}

/// Apply one transition of the run (a statement proving `status = 'active'`
/// and `attempt_count = $2`, whose other binds `bind` adds), and if it applied,
/// queue `event` and `email` in its transaction.
async fn transition(
    db: &Db,
    statement_timeout: Duration,
    update: db::Stmt<'static>,
    run: &Run,
    event: (&str, String),
    email: Option<outbox::email::Email>,
) -> Result<bool, Error> {
    let mut tx = db.begin_with_timeout(statement_timeout).await?;
    if tx.execute(update).await? != 1 {
        tx.rollback().await?;
        return Ok(false);
    }
    announce(&mut tx, run, event, email).await?;
    tx.commit().await?;
    Ok(true)
}

async fn announce(
    tx: &mut Tx,
    run: &Run,
    (event_type, payload): (&str, String),
    email: Option<outbox::email::Email>,
) -> Result<(), Error> {
    outbox::webhook::enqueue(tx, &run.tenant_id, event_type, &payload).await?;
    if let Some(email) = email {
        outbox::email::enqueue(tx, &run.tenant_id, &email).await?;
    }
    Ok(())
}
