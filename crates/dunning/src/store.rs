//! All of dunning's SQL: enrolment and the due-run listing (both fenced), the
//! attempt compare-and-set and its rewind, the transitions with their events
//! and emails, and the final action.
//!
//! Every run write proves `status` and the `attempt_count` it was derived
//! from; an event or email is queued in the write's transaction and only when
//! the write changed the row.

use std::collections::{HashMap, HashSet};
use std::time::Duration;

use chrono::{DateTime, Utc};
use db::{Db, PgRow, Row, Tx, sql};
use leader::Fence;

use crate::Error;
use crate::policy::{self, FinalAction, Policy};

/// A run as the funnel listed it: the snapshot every write of this retry proves.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Run {
    pub id: i64,
    pub tenant_id: String,
    pub invoice_id: i64,
    pub subscription_id: i64,
    /// `active`, or `exhausted` with its final action still owed.
    pub status: String,
    pub attempt_count: i32,
    pub first_declined_at: DateTime<Utc>,
    pub next_attempt_at: DateTime<Utc>,
    /// The invoice's status when listed.
    pub invoice_status: String,
    pub amount: i64,
    pub currency: String,
    pub email: String,
    pub policy: Policy,
}

fn run(r: &PgRow) -> Result<Run, db::Error> {
    let action: String = r.try_get("final_action")?;
    Ok(Run {
        id: r.try_get("id")?,
        tenant_id: r.try_get("tenant_id")?,
        invoice_id: r.try_get("invoice_id")?,
        subscription_id: r.try_get("subscription_id")?,
        status: r.try_get("status")?,
        attempt_count: r.try_get("attempt_count")?,
        first_declined_at: r.try_get("first_declined_at")?,
        next_attempt_at: r.try_get("next_attempt_at")?,
        invoice_status: r.try_get("invoice_status")?,
        amount: r.try_get("amount")?,
        currency: r.try_get("currency")?,
        email: r.try_get("email")?,
        policy: Policy {
            offsets_secs: r.try_get("retry_offsets_secs")?,
            // The CHECK allows only the three; anything else is a corrupt row.
            final_action: FinalAction::parse(&action).unwrap_or_else(|| {
                panic!("dunning policy final_action {action:?} is not one of the three")
            }),
            warn_after: r.try_get("warn_after")?,
            final_notice: r.try_get("final_notice")?,
        },
    })
}

/// Enrol, fenced: create the built-in default policy for tenants without one,
/// then a run for up to `limit` enrollable invoices with their tenant's
/// default policy (one per invoice, `ON CONFLICT DO NOTHING`), and
/// `dunning.started` for each run created; one transaction.
pub(crate) async fn enrol(
    db: &Db,
    fence: &Fence,
    limit: usize,
    statement_timeout: Duration,
) -> Result<usize, Error> {
    let limit = i64::try_from(limit).unwrap_or(i64::MAX);
    let mut tx = db.begin_with_timeout(statement_timeout).await?;
    tx.execute(
        sql("INSERT INTO dunning_policies (tenant_id, name, retry_offsets_secs, final_action, \
                                           warn_after, final_notice, is_default) \
             SELECT DISTINCT i.tenant_id, 'Default', $3, $4, $5, true, true \
             FROM invoices i \
             JOIN LATERAL (SELECT a.provider_status FROM payment_attempts a \
                           WHERE a.invoice_id = i.id ORDER BY a.attempt_seq DESC LIMIT 1) l ON true \
             WHERE i.status = 'open' AND i.collection_method = 'automatic' \
               AND l.provider_status = 'declined' \
               AND NOT EXISTS (SELECT 1 FROM dunning_runs r WHERE r.invoice_id = i.id) \
               AND NOT EXISTS (SELECT 1 FROM dunning_policies p \
                               WHERE p.tenant_id = i.tenant_id AND p.is_default) \
               AND leader_fence($1, $2) \
             ON CONFLICT (tenant_id) WHERE is_default DO NOTHING")
        .bind(fence.role_name())
        .bind(fence.token())
        .bind(policy::DEFAULT_OFFSETS_SECS.to_vec())
        .bind(policy::DEFAULT_FINAL_ACTION.as_str())
        .bind(policy::DEFAULT_WARN_AFTER.to_vec()),
    )
    .await?;
    let rows = tx
        .fetch_all(
            sql("INSERT INTO dunning_runs (tenant_id, invoice_id, policy_id, first_declined_at, \
                                           next_attempt_at) \
                 SELECT i.tenant_id, i.id, p.id, l.declined_at, \
                        l.declined_at + make_interval(secs => p.retry_offsets_secs[1]::float8) \
                 FROM invoices i \
                 JOIN LATERAL (SELECT a.provider_status, COALESCE(a.resolved_at, a.created_at) AS declined_at \
                               FROM payment_attempts a \
                               WHERE a.invoice_id = i.id ORDER BY a.attempt_seq DESC LIMIT 1) l ON true \
                 JOIN dunning_policies p ON p.tenant_id = i.tenant_id AND p.is_default \
                 WHERE i.status = 'open' AND i.collection_method = 'automatic' \
                   AND l.provider_status = 'declined' \
                   AND NOT EXISTS (SELECT 1 FROM dunning_runs r WHERE r.invoice_id = i.id) \
                   AND leader_fence($1, $2) \
                 ORDER BY i.id \
                 LIMIT $3 \
                 ON CONFLICT (invoice_id) DO NOTHING \
                 RETURNING id, tenant_id, invoice_id, next_attempt_at")
            .bind(fence.role_name())
            .bind(fence.token())
            .bind(limit),
        )
        .await?;
    for r in &rows {
        let tenant: String = r.try_get("tenant_id").map_err(db::Error::from)?;
        let next: DateTime<Utc> = r.try_get("next_attempt_at").map_err(db::Error::from)?;
        let payload = serde_json::json!({
            "object": "dunning_run",
            "id": r.try_get::<i64, _>("id").map_err(db::Error::from)?,
            "invoice": r.try_get::<i64, _>("invoice_id").map_err(db::Error::from)?,
            "status": "active",
            "attempt_count": 0,
            "next_attempt_at": next.to_rfc3339(),
        });
        webhook_outbox::enqueue(&mut tx, &tenant, "dunning.started", &payload.to_string()).await?;
    }
    tx.commit().await?;
    Ok(rows.len())
}

/// The decline codes after which the same card is not tried again: the run
/// waits until the customer's payment method changes (docs/adr/0024).
fn held_declines() -> Vec<String> {
    billing::provider::HARD_DECLINES
        .iter()
        .copied()
        .chain(["authentication_required"])
        .map(str::to_owned)
        .collect()
}

/// The fenced funnel: up to `limit` runs that are due (active, next attempt
/// passed) or owe their final action (exhausted, not yet acted), oldest first,
/// leaving out `except` (runs this tick already left out), and active runs
/// whose last attempt was a hard decline (or wanted authentication) on the
/// payment method the customer still has. A listing, not a
/// lease: the attempt compare-and-set decides who retries.
pub(crate) async fn list_due(
    db: &Db,
    fence: &Fence,
    limit: usize,
    except: &[i64],
    statement_timeout: Duration,
) -> Result<Vec<Run>, db::Error> {
    let limit = i64::try_from(limit).unwrap_or(i64::MAX);
    let mut tx = db.begin_with_timeout(statement_timeout).await?;
    let rows = tx
        .fetch_all(
            sql("SELECT r.id, r.tenant_id, r.invoice_id, r.status, r.attempt_count, \
                        r.first_declined_at, r.next_attempt_at, \
                        i.status AS invoice_status, i.subscription_id, i.amount, i.currency, c.email, \
                        p.retry_offsets_secs, p.final_action, p.warn_after, p.final_notice \
                 FROM dunning_runs r \
                 JOIN dunning_policies p ON p.tenant_id = r.tenant_id AND p.id = r.policy_id \
                 JOIN invoices i ON i.tenant_id = r.tenant_id AND i.id = r.invoice_id \
                 JOIN subscriptions s ON s.tenant_id = i.tenant_id AND s.id = i.subscription_id \
                 JOIN customers c ON c.tenant_id = s.tenant_id AND c.id = s.customer_id \
                 WHERE ((r.status = 'active' AND r.next_attempt_at <= now() \
                         AND NOT EXISTS ( \
                           SELECT 1 FROM (SELECT a.decline_code, a.payment_method_id \
                                          FROM payment_attempts a WHERE a.invoice_id = r.invoice_id \
                                          ORDER BY a.attempt_seq DESC LIMIT 1) l \
                           WHERE l.decline_code = ANY ($5) \
                             AND l.payment_method_id IS NOT DISTINCT FROM c.payment_method_id)) \
                        OR (r.status = 'exhausted' AND r.final_action_at IS NULL)) \
                   AND r.id <> ALL ($3) \
                   AND leader_fence($1, $2) \
                 ORDER BY r.next_attempt_at, r.id \
                 LIMIT $4 \
                 FOR UPDATE OF r SKIP LOCKED")
            .bind(fence.role_name())
            .bind(fence.token())
            .bind(except.to_vec())
            .bind(limit)
            .bind(held_declines()),
        )
        .await?;
    tx.commit().await?;
    rows.iter().map(run).collect()
}

/// Undo [`record_attempts_in`] for one run through the same compare-and-set: the run is again
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
            sql("UPDATE dunning_runs SET attempt_count = $2, next_attempt_at = $3, updated_at = now() \
                 WHERE id = $1 AND status = 'active' AND attempt_count = $2 + 1 \
                   AND next_attempt_at = $4")
            .bind(run.id)
            .bind(run.attempt_count)
            .bind(run.next_attempt_at)
            .bind(held),
        )
        .await?;
    tx.commit().await?;
    Ok(n == 1)
}

/// [`record_attempt`] for a batch, one statement in the caller's transaction:
/// each run counted only if it still has the count it was listed with
/// (`attempt_count = $expected`, per row). Returns the runs counted, with the
/// hold each was given (which [`rewind_in`] proves).
pub(crate) async fn record_attempts_in(
    tx: &mut Tx,
    runs: &[&Run],
    hold: Duration,
) -> Result<HashMap<i64, DateTime<Utc>>, db::Error> {
    if runs.is_empty() {
        return Ok(HashMap::new());
    }
    // In id order, so two workers counting overlapping batches lock their
    // rows in one order rather than deadlocking.
    let mut runs = runs.to_vec();
    runs.sort_by_key(|r| r.id);
    let rows = tx
        .fetch_all(
            sql("UPDATE dunning_runs r \
                 SET attempt_count = r.attempt_count + 1, \
                     next_attempt_at = now() + make_interval(secs => $3), updated_at = now() \
                 FROM unnest($1::bigint[], $2::int4[]) AS u(id, expected) \
                 WHERE r.id = u.id AND r.status = 'active' AND r.attempt_count = u.expected \
                 RETURNING r.id, r.next_attempt_at")
            .bind(runs.iter().map(|r| r.id).collect::<Vec<_>>())
            .bind(runs.iter().map(|r| r.attempt_count).collect::<Vec<_>>())
            .bind(hold.as_secs_f64()),
        )
        .await?;
    let mut held = HashMap::with_capacity(rows.len());
    for r in &rows {
        held.insert(r.try_get("id")?, r.try_get("next_attempt_at")?);
    }
    Ok(held)
}

/// [`rewind`] for a batch, one statement in the caller's transaction: each
/// run back to its listed count and next attempt, only while it holds the
/// count and the hold its record wrote. Returns the runs rewound.
pub(crate) async fn rewind_in(
    tx: &mut Tx,
    runs: &[(&Run, DateTime<Utc>)],
) -> Result<HashSet<i64>, db::Error> {
    if runs.is_empty() {
        return Ok(HashSet::new());
    }
    let rows = tx
        .fetch_all(
            sql("UPDATE dunning_runs r \
                 SET attempt_count = u.listed, next_attempt_at = u.listed_at, updated_at = now() \
                 FROM unnest($1::bigint[], $2::int4[], $3::timestamptz[], $4::timestamptz[]) \
                      AS u(id, listed, listed_at, held) \
                 WHERE r.id = u.id AND r.status = 'active' AND r.attempt_count = u.listed + 1 \
                   AND r.next_attempt_at = u.held \
                 RETURNING r.id")
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
            sql("UPDATE dunning_runs r \
                 SET status = 'recovered', ended_at = now(), updated_at = now() \
                 FROM unnest($1::bigint[], $2::int4[]) AS u(id, attempt) \
                 WHERE r.id = u.id AND r.status = 'active' AND r.attempt_count = u.attempt \
                 RETURNING r.id")
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
    let events: Vec<webhook_outbox::NewEvent<'_>> = payloads
        .iter()
        .map(|(t, p)| (*t, "dunning.recovered", p.as_str()))
        .collect();
    webhook_outbox::enqueue_many(tx, &events).await?;
    Ok(won)
}

/// A definite decline of a run's retry, as [`decline_in`] writes it.
pub(crate) struct Decline<'a> {
    pub run: &'a Run,
    /// The retry declined: the count [`record_attempts_in`] wrote.
    pub attempt: i32,
    pub code: String,
    /// The next retry; `None`: this was the last, the run is exhausted.
    pub next: Option<DateTime<Utc>>,
    /// The warning (or, exhausted, the final notice) if the policy sends one.
    pub email: Option<email_outbox::Email>,
}

/// [`decline`] and [`exhaust`] for a batch, in the caller's transaction: one
/// statement for the runs whose next retry is scheduled, one for the runs
/// exhausted, each run only while it holds the count its retry wrote; then
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
                sql("UPDATE dunning_runs r \
                     SET next_attempt_at = u.next, last_decline_code = u.code, updated_at = now() \
                     FROM unnest($1::bigint[], $2::int4[], $3::timestamptz[], $4::text[]) \
                          AS u(id, attempt, next, code) \
                     WHERE r.id = u.id AND r.status = 'active' AND r.attempt_count = u.attempt \
                     RETURNING r.id")
                .bind(next.iter().map(|d| d.run.id).collect::<Vec<_>>())
                .bind(next.iter().map(|d| d.attempt).collect::<Vec<_>>())
                .bind(next.iter().map(|d| d.next).collect::<Vec<_>>())
                .bind(next.iter().map(|d| d.code.clone()).collect::<Vec<_>>()),
            )
            .await?;
        for r in &changed {
            won.insert(r.try_get("id").map_err(db::Error::from)?);
        }
    }
    if !last.is_empty() {
        let changed = tx
            .fetch_all(
                sql("UPDATE dunning_runs r \
                     SET status = 'exhausted', ended_at = now(), next_attempt_at = now(), \
                         last_decline_code = u.code, updated_at = now() \
                     FROM unnest($1::bigint[], $2::int4[], $3::text[]) AS u(id, attempt, code) \
                     WHERE r.id = u.id AND r.status = 'active' AND r.attempt_count = u.attempt \
                     RETURNING r.id")
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
    let events: Vec<webhook_outbox::NewEvent<'_>> = payloads
        .iter()
        .map(|(t, e, p)| (*t, *e, p.as_str()))
        .collect();
    webhook_outbox::enqueue_many(tx, &events).await?;
    let emails: Vec<(&str, &email_outbox::Email)> = applied
        .iter()
        .filter_map(|d| d.email.as_ref().map(|e| (d.run.tenant_id.as_str(), e)))
        .collect();
    email_outbox::enqueue_many(tx, &emails).await?;
    Ok(won)
}

fn payload(run: &Run, status: &str, attempt: i32, extra: serde_json::Value) -> String {
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
    email: Option<email_outbox::Email>,
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
    email: Option<email_outbox::Email>,
) -> Result<(), Error> {
    webhook_outbox::enqueue(tx, &run.tenant_id, event_type, &payload).await?;
    if let Some(email) = email {
        email_outbox::enqueue(tx, &run.tenant_id, &email).await?;
    }
    Ok(())
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
pub(crate) async fn decline(
    db: &Db,
    run: &Run,
    attempt: i32,
    (code, next): (&str, DateTime<Utc>),
    email: Option<email_outbox::Email>,
    statement_timeout: Duration,
) -> Result<bool, Error> {
    let update = sql(
        "UPDATE dunning_runs SET next_attempt_at = $3, last_decline_code = $4, \
                             updated_at = now() \
                      WHERE id = $1 AND status = 'active' AND attempt_count = $2",
    )
    .bind(run.id)
    .bind(attempt)
    .bind(next)
    .bind(code.to_owned());
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
/// `dunning.exhausted`, and the final notice if the policy sends one.
pub(crate) async fn exhaust(
    db: &Db,
    run: &Run,
    attempt: i32,
    code: &str,
    email: Option<email_outbox::Email>,
    statement_timeout: Duration,
) -> Result<bool, Error> {
    let update = sql(
        "UPDATE dunning_runs SET status = 'exhausted', ended_at = now(), \
                             next_attempt_at = now(), last_decline_code = $3, updated_at = now() \
                      WHERE id = $1 AND status = 'active' AND attempt_count = $2",
    )
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
        email,
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

/// What the final-action step wrote.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum FinalActed {
    /// This call took the action and announced it.
    Written,
    /// The action was already in force (the pause held, the subscription
    /// canceled) or the invoice is no longer open: nothing written.
    NothingToDo,
    /// Another call already ran the step: nothing written.
    Lost,
}

/// The final-action step of an exhausted run, one transaction: first the
/// run's stamp (`final_action_at`, only if unset: one step per run), then the
/// action itself by a conditional write, announced only if it changed a row.
pub(crate) async fn final_action(
    db: &Db,
    run: &Run,
    statement_timeout: Duration,
) -> Result<FinalActed, Error> {
    let mut tx = db.begin_with_timeout(statement_timeout).await?;
    let stamped = tx
        .execute(
            sql(
                "UPDATE dunning_runs SET final_action_at = now(), updated_at = now() \
                 WHERE id = $1 AND status = 'exhausted' AND final_action_at IS NULL",
            )
            .bind(run.id),
        )
        .await?;
    if stamped != 1 {
        tx.rollback().await?;
        return Ok(FinalActed::Lost);
    }
    let (written, event_type, object) = match run.policy.final_action {
        // Written only if this call paused it: a pause in force (dunning's
        // own, an operator's) or a settled invoice writes nothing.
        FinalAction::PauseCollection => (
            tx.execute(
                sql(
                    "UPDATE subscriptions s SET pause_collection_behavior = 'keep_as_draft', \
                            pause_collection_set_by = 'dunning', updated_at = now() \
                     FROM invoices i \
                     WHERE i.id = $1 AND s.tenant_id = i.tenant_id AND s.id = i.subscription_id \
                       AND i.status = 'open' AND s.status <> 'canceled' \
                       AND s.pause_collection_behavior IS NULL",
                )
                .bind(run.invoice_id),
            )
            .await?,
            "subscription.collection_paused",
            serde_json::json!({"object": "subscription", "id": run.subscription_id,
                               "pause_collection": {"behavior": "keep_as_draft"},
                               "invoice": run.invoice_id, "dunning_run": run.id}),
        ),
        FinalAction::CancelSubscription => (
            tx.execute(
                sql(
                    "UPDATE subscriptions s SET status = 'canceled', canceled_at = now(), \
                            updated_at = now() \
                     FROM invoices i \
                     WHERE i.id = $1 AND s.tenant_id = i.tenant_id AND s.id = i.subscription_id \
                       AND i.status = 'open' AND s.status <> 'canceled'",
                )
                .bind(run.invoice_id),
            )
            .await?,
            "subscription.canceled",
            serde_json::json!({"object": "subscription", "id": run.subscription_id,
                               "status": "canceled", "invoice": run.invoice_id,
                               "dunning_run": run.id}),
        ),
        FinalAction::MarkUncollectible => (
            tx.execute(
                sql(
                    "UPDATE invoices SET status = 'uncollectible', closed_at = now() \
                     WHERE id = $1 AND status = 'open'",
                )
                .bind(run.invoice_id),
            )
            .await?,
            "invoice.marked_uncollectible",
            serde_json::json!({"object": "invoice", "id": run.invoice_id,
                               "subscription": run.subscription_id, "status": "uncollectible",
                               "dunning_run": run.id}),
        ),
    };
    let acted = if written == 1 {
        webhook_outbox::enqueue(&mut tx, &run.tenant_id, event_type, &object.to_string()).await?;
        FinalActed::Written
    } else {
        FinalActed::NothingToDo
    };
    tx.commit().await?;
    Ok(acted)
}

/// Active runs, for the gauge.
pub(crate) async fn active_runs(db: &Db, statement_timeout: Duration) -> Result<i64, db::Error> {
    let mut tx = db.begin_with_timeout(statement_timeout).await?;
    let row = tx
        .fetch_one(sql(
            "SELECT count(*) AS n FROM dunning_runs WHERE status = 'active'",
        ))
        .await?;
    tx.commit().await?;
    Ok(row.try_get("n")?)
}
