//! All of dunning's SQL: enrolment and the due-run listing (both fenced), the
//! attempt compare-and-set and its rewind, the transitions with their events
//! and emails (a retry not attempted among them), and the final action.
//!
//! Every run write proves `status` and the `attempt_count` it was derived
//! from; an event or email is queued in the write's transaction and only when
//! the write changed the row.

use std::collections::{HashMap, HashSet};
use std::panic::AssertUnwindSafe;
use std::time::Duration;

use chrono::{DateTime, Utc};
use db::{Db, PgRow, Row, Tx, sql};
use leader::Fence;

use crate::Error;
use crate::policy::{self, FinalAction, PauseBehavior, Policy};

/// A run as the funnel listed it: the snapshot every write of this retry proves.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Run {
    pub id: i64,
    pub tenant_id: String,
    pub invoice_id: i64,
    /// The invoice's `PREFIX-000123`, once billing numbers it.
    pub invoice_number: Option<String>,
    pub subscription_id: i64,
    pub policy_id: i64,
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
    /// The customer's payment method when listed (a retry not attempted
    /// proves it unchanged).
    pub payment_method: Option<String>,
    /// Why an active run's due retry cannot be charged, if it cannot.
    pub not_chargeable: Option<NotChargeable>,
    /// The tenant's sender (`tenant_settings.email_from`), if it set one.
    pub email_from: Option<String>,
    pub policy: Policy,
}

/// Why a due retry is counted without a provider call.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum NotChargeable {
    /// The customer has no payment method.
    NoPaymentMethod,
    /// The last attempt was a hard decline (or wanted authentication) on the
    /// payment method the customer still has (docs/adr/0024).
    PaymentMethodUnchanged,
}

impl NotChargeable {
    pub fn as_str(self) -> &'static str {
        match self {
            NotChargeable::NoPaymentMethod => "no_payment_method",
            NotChargeable::PaymentMethodUnchanged => "payment_method_unchanged",
        }
    }

    fn parse(s: &str) -> Option<NotChargeable> {
        Some(match s {
            "no_payment_method" => NotChargeable::NoPaymentMethod,
            "payment_method_unchanged" => NotChargeable::PaymentMethodUnchanged,
            _ => return None,
        })
    }
}

/// A listed row the funnel leaves out of the tick; every other row goes on.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum LeftOut {
    /// The run's policy fails the schedule checks of migration 0021 (written
    /// before them): its runs wait until the policy is mended.
    Policy {
        run: i64,
        tenant_id: String,
        policy_id: i64,
    },
    /// The row did not decode (a value the service's types cannot hold).
    Undecodable { run: i64, error: String },
}

impl LeftOut {
    pub fn run(&self) -> i64 {
        match self {
            LeftOut::Policy { run, .. } | LeftOut::Undecodable { run, .. } => *run,
        }
    }
}

/// What the funnel listed: the runs to retry, and the rows it left out.
#[derive(Debug, Default)]
pub(crate) struct Listing {
    pub runs: Vec<Run>,
    pub left_out: Vec<LeftOut>,
}

/// A column of `r`, its decoding error as text.
macro_rules! get {
    ($r:expr, $column:literal) => {
        $r.try_get($column).map_err(|e| e.to_string())
    };
}

fn run(r: &PgRow) -> Result<Run, String> {
    let action: String = get!(r, "final_action")?;
    let behavior: String = get!(r, "pause_behavior")?;
    let not_chargeable: Option<String> = get!(r, "not_chargeable")?;
    Ok(Run {
        id: get!(r, "id")?,
        tenant_id: get!(r, "tenant_id")?,
        invoice_id: get!(r, "invoice_id")?,
        invoice_number: get!(r, "invoice_number")?,
        subscription_id: get!(r, "subscription_id")?,
        policy_id: get!(r, "policy_id")?,
        status: get!(r, "status")?,
        attempt_count: get!(r, "attempt_count")?,
        first_declined_at: get!(r, "first_declined_at")?,
        next_attempt_at: get!(r, "next_attempt_at")?,
        invoice_status: get!(r, "invoice_status")?,
        amount: get!(r, "amount")?,
        currency: get!(r, "currency")?,
        email: get!(r, "email")?,
        payment_method: get!(r, "payment_method_id")?,
        not_chargeable: not_chargeable
            .map(|s| NotChargeable::parse(&s).ok_or(format!("not_chargeable {s:?}")))
            .transpose()?,
        email_from: get!(r, "email_from")?,
        policy: Policy {
            offsets_secs: get!(r, "retry_offsets_secs")?,
            // The CHECKs allow only these; anything else is a corrupt row.
            final_action: FinalAction::parse(&action)
                .ok_or(format!("final_action {action:?} is not one of the three"))?,
            pause_behavior: PauseBehavior::parse(&behavior).ok_or(format!(
                "pause_behavior {behavior:?} is not one of the three"
            ))?,
            warn_after: get!(r, "warn_after")?,
            final_notice: get!(r, "final_notice")?,
        },
    })
}

/// One listed row: its run, or why it is left out. A decoding panic (the
/// driver panics on a timestamp past chrono's range, `infinity` among them)
/// is caught here, so one row never stops the listing.
fn listed(r: &PgRow) -> Result<Run, LeftOut> {
    let id: i64 = r.try_get("id").unwrap_or_default();
    let decoded = std::panic::catch_unwind(AssertUnwindSafe(|| {
        let valid: Option<bool> = get!(r, "policy_valid")?;
        if valid != Some(true) {
            let tenant_id: String = get!(r, "tenant_id")?;
            let policy_id: i64 = get!(r, "policy_id")?;
            return Ok(Err(LeftOut::Policy {
                run: id,
                tenant_id,
                policy_id,
            }));
        }
        run(r).map(Ok)
    }));
    match decoded {
        Ok(Ok(listed)) => listed,
        Ok(Err(error)) => Err(LeftOut::Undecodable { run: id, error }),
        Err(payload) => Err(LeftOut::Undecodable {
            run: id,
            error: scheduler::panic_message(&*payload),
        }),
    }
}

/// Enrol, fenced: create the built-in default policy for tenants without one,
/// then a run for up to `limit` enrollable invoices with their tenant's
/// default policy (one per invoice, `ON CONFLICT DO NOTHING`), and
/// `dunning.started` for each run created; one transaction. A tenant whose
/// default policy's first offset is out of range (written before migration
/// 0021's checks) enrols nothing: its offset would fail the statement for
/// every tenant.
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
                   AND array_ndims(p.retry_offsets_secs) = 1 \
                   AND p.retry_offsets_secs[1] BETWEEN 1 AND 31622400 \
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

/// The decline codes after which the same card is not tried again: until the
/// customer's payment method changes, each due retry is counted without a
/// provider call (docs/adr/0024, docs/adr/0026).
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
/// leaving out `except` (runs this tick already left out). Each active run
/// says whether its retry can be charged: not when the customer has no
/// payment method, nor when its last attempt was a hard decline (or wanted
/// authentication) on the payment method the customer still has. A run
/// whose subscription's collection is paused is not marked: billing's claim
/// holds it (rewound), so a pause stops the schedule as it stops charges. Rows whose
/// policy fails the schedule checks (`policy_valid`: migration 0021's CHECK
/// expressions, repeated here), or that do not decode, come back as
/// [`LeftOut`]. A listing, not a lease: the attempt compare-and-set decides
/// who retries.
pub(crate) async fn list_due(
    db: &Db,
    fence: &Fence,
    limit: usize,
    except: &[i64],
    statement_timeout: Duration,
) -> Result<Listing, db::Error> {
    let limit = i64::try_from(limit).unwrap_or(i64::MAX);
    let mut tx = db.begin_with_timeout(statement_timeout).await?;
    let rows = tx
        .fetch_all(
            sql("SELECT r.id, r.tenant_id, r.invoice_id, r.policy_id, r.status, r.attempt_count, \
                        r.first_declined_at, r.next_attempt_at, \
                        i.status AS invoice_status, i.number AS invoice_number, i.subscription_id, \
                        i.amount, i.currency, c.email, c.payment_method_id, ts.email_from, \
                        CASE WHEN r.status <> 'active' THEN NULL \
                             WHEN s.pause_collection_behavior IS NOT NULL THEN NULL \
                             WHEN c.payment_method_id IS NULL THEN 'no_payment_method' \
                             WHEN EXISTS ( \
                               SELECT 1 FROM (SELECT a.decline_code, a.payment_method_id \
                                              FROM payment_attempts a WHERE a.invoice_id = r.invoice_id \
                                              ORDER BY a.attempt_seq DESC LIMIT 1) l \
                               WHERE l.decline_code = ANY ($5) \
                                 AND l.payment_method_id IS NOT DISTINCT FROM c.payment_method_id) \
                             THEN 'payment_method_unchanged' END AS not_chargeable, \
                        COALESCE(CASE WHEN array_ndims(p.retry_offsets_secs) = 1 \
                          THEN array_position(p.retry_offsets_secs, NULL) IS NULL \
                               AND 1 <= ALL (p.retry_offsets_secs) \
                               AND 31622400 >= ALL (p.retry_offsets_secs) \
                          ELSE false END \
                          AND CASE WHEN cardinality(p.warn_after) = 0 THEN true \
                            WHEN array_ndims(p.warn_after) = 1 \
                            THEN array_position(p.warn_after, NULL) IS NULL \
                                 AND 1 <= ALL (p.warn_after) \
                                 AND cardinality(p.retry_offsets_secs) >= ALL (p.warn_after) \
                            ELSE false END, false) AS policy_valid, \
                        p.retry_offsets_secs, p.final_action, p.pause_behavior, p.warn_after, \
                        p.final_notice \
                 FROM dunning_runs r \
                 JOIN dunning_policies p ON p.tenant_id = r.tenant_id AND p.id = r.policy_id \
                 JOIN invoices i ON i.tenant_id = r.tenant_id AND i.id = r.invoice_id \
                 JOIN subscriptions s ON s.tenant_id = i.tenant_id AND s.id = i.subscription_id \
                 JOIN customers c ON c.tenant_id = s.tenant_id AND c.id = s.customer_id \
                 LEFT JOIN tenant_settings ts ON ts.tenant_id = r.tenant_id \
                 WHERE ((r.status = 'active' AND r.next_attempt_at <= now()) \
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
    let mut listing = Listing::default();
    for r in &rows {
        match listed(r) {
            Ok(run) => listing.runs.push(run),
            Err(left_out) => listing.left_out.push(left_out),
        }
    }
    Ok(listing)
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
    /// The hold [`record_attempts_in`] wrote: the decline lands only over it,
    /// so a decline written once (an outcome whose commit was answered by an
    /// error, then written again by the fallback) is not written twice.
    pub held: DateTime<Utc>,
    pub code: String,
    /// The next retry; `None`: this was the last, the run is exhausted.
    pub next: Option<DateTime<Utc>>,
    /// The warning, if the policy sends one (the final notice is the final
    /// action's, sent only if the action changed something).
    pub email: Option<email_outbox::Email>,
}

/// [`decline`] and [`exhaust`] for a batch, in the caller's transaction: one
/// statement for the runs whose next retry is scheduled, one for the runs
/// exhausted, each run only while it holds the count and the hold its retry
/// wrote; then
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
                     FROM unnest($1::bigint[], $2::int4[], $3::timestamptz[], $4::text[], \
                                 $5::timestamptz[]) AS u(id, attempt, next, code, held) \
                     WHERE r.id = u.id AND r.status = 'active' AND r.attempt_count = u.attempt \
                       AND r.next_attempt_at = u.held \
                     RETURNING r.id")
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

/// A due retry that cannot be charged, as [`not_attempted_in`] counts it.
pub(crate) struct NotAttempted<'a> {
    pub run: &'a Run,
    pub why: NotChargeable,
    /// The next retry; `None`: this was the last, the run is exhausted.
    pub next: Option<DateTime<Utc>>,
    /// The warning, if the policy warns after this retry.
    pub email: Option<email_outbox::Email>,
}

/// Count due retries that cannot be charged, one statement in the caller's
/// transaction: per run, by the attempt compare-and-set (the count as
/// listed), only while the invoice is open and the customer's payment method
/// is still the one listed (a method added since is charged instead): the
/// count advances and the next retry is scheduled, or the run is exhausted.
/// Then `dunning.retry_skipped` / `dunning.exhausted` and the warnings of the
/// runs that changed. No provider call, no `payment.failed`. Returns the runs
/// that changed (an exhausted one owes its final action).
pub(crate) async fn not_attempted_in(
    tx: &mut Tx,
    rows: &[NotAttempted<'_>],
) -> Result<HashSet<i64>, Error> {
    if rows.is_empty() {
        return Ok(HashSet::new());
    }
    let mut rows: Vec<&NotAttempted<'_>> = rows.iter().collect();
    rows.sort_by_key(|n| n.run.id);
    let changed = tx
        .fetch_all(
            sql("UPDATE dunning_runs r \
                 SET attempt_count = r.attempt_count + 1, \
                     next_attempt_at = COALESCE(u.next, now()), \
                     status = CASE WHEN u.next IS NULL THEN 'exhausted' ELSE 'active' END, \
                     ended_at = CASE WHEN u.next IS NULL THEN now() END, \
                     updated_at = now() \
                 FROM unnest($1::bigint[], $2::int4[], $3::timestamptz[], $4::text[]) \
                      AS u(id, expected, next, payment_method), \
                      invoices i, subscriptions s, customers c \
                 WHERE r.id = u.id AND r.status = 'active' AND r.attempt_count = u.expected \
                   AND i.tenant_id = r.tenant_id AND i.id = r.invoice_id AND i.status = 'open' \
                   AND s.tenant_id = i.tenant_id AND s.id = i.subscription_id \
                   AND c.tenant_id = s.tenant_id AND c.id = s.customer_id \
                   AND c.payment_method_id IS NOT DISTINCT FROM u.payment_method \
                 RETURNING r.id")
            .bind(rows.iter().map(|n| n.run.id).collect::<Vec<_>>())
            .bind(rows.iter().map(|n| n.run.attempt_count).collect::<Vec<_>>())
            .bind(rows.iter().map(|n| n.next).collect::<Vec<_>>())
            .bind(
                rows.iter()
                    .map(|n| n.run.payment_method.clone())
                    .collect::<Vec<_>>(),
            ),
        )
        .await?;
    let mut won: HashSet<i64> = HashSet::with_capacity(changed.len());
    for r in &changed {
        won.insert(r.try_get("id").map_err(db::Error::from)?);
    }
    let applied: Vec<&&NotAttempted<'_>> =
        rows.iter().filter(|n| won.contains(&n.run.id)).collect();
    let payloads: Vec<(&str, &'static str, String)> = applied
        .iter()
        .map(|n| {
            let (tenant, attempt, why) = (
                n.run.tenant_id.as_str(),
                n.run.attempt_count + 1,
                n.why.as_str(),
            );
            match n.next {
                Some(at) => {
                    let extra =
                        serde_json::json!({"reason": why, "next_attempt_at": at.to_rfc3339()});
                    (
                        tenant,
                        "dunning.retry_skipped",
                        payload(n.run, "active", attempt, extra),
                    )
                }
                None => {
                    let extra = serde_json::json!({
                        "reason": why,
                        "final_action": n.run.policy.final_action.as_str(),
                    });
                    (
                        tenant,
                        "dunning.exhausted",
                        payload(n.run, "exhausted", attempt, extra),
                    )
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
        .filter_map(|n| n.email.as_ref().map(|e| (n.run.tenant_id.as_str(), e)))
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
/// Lands only over the hold its record wrote (as [`decline_in`]).
pub(crate) async fn decline(
    db: &Db,
    run: &Run,
    (attempt, held): (i32, DateTime<Utc>),
    (code, next): (&str, DateTime<Utc>),
    email: Option<email_outbox::Email>,
    statement_timeout: Duration,
) -> Result<bool, Error> {
    let update = sql(
        "UPDATE dunning_runs SET next_attempt_at = $3, last_decline_code = $4, \
                             updated_at = now() \
                      WHERE id = $1 AND status = 'active' AND attempt_count = $2 \
                        AND next_attempt_at = $5",
    )
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

/// What the final-action step wrote.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum FinalActed {
    /// This call took the action, announced it and sent the final notice.
    Written,
    /// The action was already in force (dunning's pause held, the
    /// subscription canceled) or the invoice is no longer open: nothing
    /// written, announced or sent.
    NothingToDo,
    /// Another call already ran the step, or the pause moved under it:
    /// nothing written (a step not stamped is listed again).
    Lost,
}

/// The final-action step of an exhausted run, one transaction: first the
/// run's stamp (`final_action_at`, only if unset: one step per run), then the
/// action itself by a conditional write; its events and `notice` (the final
/// notice, if the policy sends one) are queued only if it changed a row.
pub(crate) async fn final_action(
    db: &Db,
    biller: &billing::Biller,
    run: &Run,
    notice: Option<email_outbox::Email>,
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
    // Billing's cancel writes its own events.
    let mut changed = false;
    let events = match run.policy.final_action {
        FinalAction::PauseCollection => match pause(&mut tx, run).await? {
            Some(events) => events,
            None => {
                tx.rollback().await?;
                return Ok(FinalActed::Lost);
            }
        },
        FinalAction::CancelSubscription => {
            // Only while the invoice is still open; then billing's cancel in
            // this transaction: the used part of the period invoiced pro rata
            // (unless the tenant says not to) and `subscription.canceled`,
            // written by billing's one writer of invoices (docs/adr/0025).
            let open = tx
                .fetch_optional(
                    sql("SELECT 1 FROM invoices WHERE id = $1 AND status = 'open' FOR UPDATE")
                        .bind(run.invoice_id),
                )
                .await?
                .is_some();
            if open
                && biller
                    .cancel_now_in(&mut tx, &run.tenant_id, run.subscription_id)
                    .await?
                    .is_some()
            {
                changed = true;
            }
            Vec::new()
        }
        FinalAction::MarkUncollectible => {
            let written = tx
                .execute(
                    sql(
                        "UPDATE invoices SET status = 'uncollectible', closed_at = now() \
                         WHERE id = $1 AND status = 'open'",
                    )
                    .bind(run.invoice_id),
                )
                .await?;
            let event = serde_json::json!({"object": "invoice", "id": run.invoice_id,
                                           "subscription": run.subscription_id,
                                           "status": "uncollectible", "dunning_run": run.id});
            if written == 1 {
                vec![("invoice.marked_uncollectible", event)]
            } else {
                Vec::new()
            }
        }
    };
    let acted = if events.is_empty() && !changed {
        FinalActed::NothingToDo
    } else {
        for (event_type, object) in &events {
            webhook_outbox::enqueue(&mut tx, &run.tenant_id, event_type, &object.to_string())
                .await?;
        }
        if let Some(notice) = notice {
            email_outbox::enqueue(&mut tx, &run.tenant_id, &notice).await?;
        }
        FinalActed::Written
    };
    tx.commit().await?;
    Ok(acted)
}

/// The final actions of runs a batch just exhausted, in one transaction and
/// a handful of statements, with the rules of [`final_action`]: each run
/// stamped once; write-offs by one conditional UPDATE; pauses by one locking
/// read of their subscriptions (in id order), then the lifted pauses cleared
/// and dunning's pause written by compare-and-set on what was read, one
/// statement each; cancels through billing's cancel in the same
/// transaction; the events and final notices of the runs whose action
/// changed something, one statement each. On an error nothing is written
/// and the caller runs [`final_action`] per run.
pub(crate) async fn final_actions(
    db: &Db,
    biller: &billing::Biller,
    runs: &[(&Run, Option<email_outbox::Email>)],
    statement_timeout: Duration,
) -> Result<Vec<FinalActed>, Error> {
    let mut tx = db.begin_with_timeout(statement_timeout).await?;
    let ids: Vec<i64> = runs.iter().map(|(r, _)| r.id).collect();
    let stamped: HashSet<i64> = tx
        .fetch_all(
            sql(
                "UPDATE dunning_runs SET final_action_at = now(), updated_at = now() \
                 WHERE id = ANY($1) AND status = 'exhausted' AND final_action_at IS NULL \
                 RETURNING id",
            )
            .bind(ids),
        )
        .await?
        .iter()
        .map(|r| r.try_get::<i64, _>("id"))
        .collect::<Result<_, _>>()
        .map_err(db::Error::from)?;
    let mut changed: HashMap<i64, Vec<(&'static str, serde_json::Value)>> = HashMap::new();
    let of = |action: FinalAction| -> Vec<&Run> {
        runs.iter()
            .map(|(r, _)| *r)
            .filter(|r| stamped.contains(&r.id) && r.policy.final_action == action)
            .collect()
    };
    // Write-offs.
    let writes_off = of(FinalAction::MarkUncollectible);
    if !writes_off.is_empty() {
        let rows = tx
            .fetch_all(
                sql(
                    "UPDATE invoices SET status = 'uncollectible', closed_at = now() \
                     WHERE id = ANY($1) AND status = 'open' RETURNING id",
                )
                .bind(writes_off.iter().map(|r| r.invoice_id).collect::<Vec<_>>()),
            )
            .await?;
        for row in &rows {
            let invoice: i64 = row.try_get("id").map_err(db::Error::from)?;
            for r in writes_off.iter().filter(|r| r.invoice_id == invoice) {
                let event = serde_json::json!({"object": "invoice", "id": invoice,
                                               "subscription": r.subscription_id,
                                               "status": "uncollectible", "dunning_run": r.id});
                changed.insert(r.id, vec![("invoice.marked_uncollectible", event)]);
            }
        }
    }
    // Pauses.
    for (run, events) in pauses(&mut tx, &of(FinalAction::PauseCollection)).await? {
        changed.insert(run, events);
    }
    // Cancels, through billing's one writer of invoices.
    for r in of(FinalAction::CancelSubscription) {
        let open = tx
            .fetch_optional(
                sql("SELECT 1 FROM invoices WHERE id = $1 AND status = 'open' FOR UPDATE")
                    .bind(r.invoice_id),
            )
            .await?
            .is_some();
        if open
            && biller
                .cancel_now_in(&mut tx, &r.tenant_id, r.subscription_id)
                .await?
                .is_some()
        {
            changed.insert(r.id, Vec::new());
        }
    }
    let events: Vec<(String, &'static str, String)> = runs
        .iter()
        .filter_map(|(r, _)| changed.get(&r.id).map(|e| (r, e)))
        .flat_map(|(r, e)| {
            e.iter()
                .map(|(kind, object)| (r.tenant_id.clone(), *kind, object.to_string()))
        })
        .collect();
    let refs: Vec<webhook_outbox::NewEvent<'_>> = events
        .iter()
        .map(|(t, k, p)| (t.as_str(), *k, p.as_str()))
        .collect();
    webhook_outbox::enqueue_many(&mut tx, &refs).await?;
    let notices: Vec<(&str, &email_outbox::Email)> = runs
        .iter()
        .filter(|(r, _)| changed.contains_key(&r.id))
        .filter_map(|(r, n)| n.as_ref().map(|n| (r.tenant_id.as_str(), n)))
        .collect();
    email_outbox::enqueue_many(&mut tx, &notices).await?;
    tx.commit().await?;
    Ok(runs
        .iter()
        .map(|(r, _)| {
            if !stamped.contains(&r.id) {
                FinalActed::Lost
            } else if changed.contains_key(&r.id) {
                FinalActed::Written
            } else {
                FinalActed::NothingToDo
            }
        })
        .collect())
}

/// [`pause`] for many runs with three statements: their subscriptions read
/// and locked in id order; the lifted pauses cleared (`subscription.collection_resumed`);
/// dunning's pause written over what was read. A subscription two runs
/// share is paused by the first; the second finds it held. Returns, per run
/// whose pause landed, its events.
async fn pauses(
    tx: &mut Tx,
    runs: &[&Run],
) -> Result<Vec<(i64, Vec<(&'static str, serde_json::Value)>)>, Error> {
    if runs.is_empty() {
        return Ok(Vec::new());
    }
    let rows = tx
        .fetch_all(
            sql(
                "SELECT s.id, i.id AS invoice, s.pause_collection_behavior AS behavior, \
                        to_json(s.pause_collection_resumes_at) #>> '{}' AS resumes_at, \
                        s.pause_collection_set_by AS set_by, \
                        s.pause_collection_resumes_at <= now() AS lifted \
                 FROM subscriptions s \
                 JOIN invoices i ON i.tenant_id = s.tenant_id AND i.subscription_id = s.id \
                 WHERE i.id = ANY($1) AND i.status = 'open' AND s.status <> 'canceled' \
                 ORDER BY s.id \
                 FOR UPDATE OF s",
            )
            .bind(runs.iter().map(|r| r.invoice_id).collect::<Vec<_>>()),
        )
        .await?;
    // (behavior, resumes_at, set_by, lifted) per subscription, as read.
    type Read = (Option<String>, Option<String>, Option<String>, Option<bool>);
    let mut read: HashMap<i64, Read> = HashMap::new();
    let mut open: HashSet<i64> = HashSet::new();
    for r in &rows {
        open.insert(r.try_get("invoice").map_err(db::Error::from)?);
        let get = |c: &str| r.try_get::<Option<String>, _>(c).map_err(db::Error::from);
        read.insert(
            r.try_get("id").map_err(db::Error::from)?,
            (
                get("behavior")?,
                get("resumes_at")?,
                get("set_by")?,
                r.try_get("lifted").map_err(db::Error::from)?,
            ),
        );
    }
    let (mut clears, mut writes, mut out) = (Vec::new(), Vec::new(), Vec::new());
    let mut taken: HashSet<i64> = HashSet::new();
    for run in runs {
        let Some((behavior, resumes_at, set_by, lifted)) = read.get(&run.subscription_id) else {
            continue; // invoice no longer open, or the subscription canceled
        };
        if !open.contains(&run.invoice_id) {
            continue;
        }
        if !taken.insert(run.subscription_id) {
            continue; // another run of this batch pauses it
        }
        let lifted = *lifted == Some(true);
        if set_by.as_deref() == Some("dunning") && !lifted {
            continue; // already held
        }
        let mut events = Vec::new();
        let mut replaced = serde_json::Value::Null;
        if lifted {
            clears.push((
                run.subscription_id,
                behavior.clone(),
                resumes_at.clone(),
                set_by.clone(),
            ));
            events.push((
                "subscription.collection_resumed",
                serde_json::json!({"object": "subscription", "id": run.subscription_id,
                                   "pause_collection": null,
                                   "previous_pause_collection": {"behavior": behavior,
                                                                 "resumes_at": resumes_at}}),
            ));
            writes.push((run, None, None, None));
        } else {
            if behavior.is_some() {
                replaced = serde_json::json!({"behavior": behavior, "resumes_at": resumes_at,
                                              "set_by": set_by});
            }
            writes.push((run, behavior.clone(), resumes_at.clone(), set_by.clone()));
        }
        events.push((
            "subscription.collection_paused",
            serde_json::json!({"object": "subscription", "id": run.subscription_id,
                               "pause_collection": {"behavior": run.policy.pause_behavior.as_str(),
                                                    "resumes_at": null},
                               "replaced_pause_collection": replaced,
                               "invoice": run.invoice_id, "dunning_run": run.id}),
        ));
        out.push((run.id, events));
    }
    if !clears.is_empty() {
        let n = tx
            .execute(
                sql(
                    "UPDATE subscriptions s SET pause_collection_behavior = NULL, \
                            pause_collection_resumes_at = NULL, pause_collection_set_by = NULL, \
                            updated_at = now() \
                     FROM unnest($1::bigint[], $2::text[], $3::text[], $4::text[]) \
                          AS c(id, behavior, resumes_at, set_by) \
                     WHERE s.id = c.id AND s.pause_collection_behavior = c.behavior \
                       AND s.pause_collection_resumes_at = c.resumes_at::timestamptz \
                       AND s.pause_collection_resumes_at <= now() \
                       AND s.pause_collection_set_by IS NOT DISTINCT FROM c.set_by",
                )
                .bind(clears.iter().map(|c| c.0).collect::<Vec<_>>())
                .bind(clears.iter().map(|c| c.1.clone()).collect::<Vec<_>>())
                .bind(clears.iter().map(|c| c.2.clone()).collect::<Vec<_>>())
                .bind(clears.iter().map(|c| c.3.clone()).collect::<Vec<_>>()),
            )
            .await?;
        if n as usize != clears.len() {
            return Err(Error::NotCounted(
                "a lifted pause moved under its lock".into(),
            ));
        }
    }
    if !writes.is_empty() {
        let n = tx
            .execute(
                sql("UPDATE subscriptions s SET pause_collection_behavior = w.behavior, \
                            pause_collection_resumes_at = NULL, pause_collection_set_by = 'dunning', \
                            updated_at = now() \
                     FROM unnest($1::bigint[], $2::text[], $3::text[], $4::text[], $5::text[]) \
                          AS w(id, behavior, was_behavior, was_resumes_at, was_set_by) \
                     WHERE s.id = w.id AND s.status <> 'canceled' \
                       AND s.pause_collection_behavior IS NOT DISTINCT FROM w.was_behavior \
                       AND s.pause_collection_resumes_at IS NOT DISTINCT FROM w.was_resumes_at::timestamptz \
                       AND s.pause_collection_set_by IS NOT DISTINCT FROM w.was_set_by")
                .bind(writes.iter().map(|w| w.0.subscription_id).collect::<Vec<_>>())
                .bind(
                    writes
                        .iter()
                        .map(|w| w.0.policy.pause_behavior.as_str().to_owned())
                        .collect::<Vec<_>>(),
                )
                .bind(writes.iter().map(|w| w.1.clone()).collect::<Vec<_>>())
                .bind(writes.iter().map(|w| w.2.clone()).collect::<Vec<_>>())
                .bind(writes.iter().map(|w| w.3.clone()).collect::<Vec<_>>()),
            )
            .await?;
        if n as usize != writes.len() {
            return Err(Error::NotCounted("a pause moved under its lock".into()));
        }
    }
    Ok(out)
}

/// Dunning's pause, in the final action's transaction (the resume rule,
/// docs/design.md §4.3):
/// the subscription's row lock first, which serializes this with every other
/// pause writer; then, by the pause as read:
///
/// - invoice not open, subscription canceled, or dunning's own pause in
///   force ("already held") → nothing written: `Some([])`;
/// - a pause that has lifted (`resumes_at <= now()`) → cleared by a
///   compare-and-set on it, with `subscription.collection_resumed`, then
///   dunning's pause;
/// - no pause, or a pause set by anyone else (with or without a resume
///   time) → replaced by dunning's pause, with the policy's behaviour and no
///   resume time, and `subscription.collection_paused`.
///
/// `None` when a compare-and-set missed (the pause moved): roll back.
async fn pause(
    tx: &mut Tx,
    run: &Run,
) -> Result<Option<Vec<(&'static str, serde_json::Value)>>, Error> {
    let Some(read) = tx
        .fetch_optional(
            sql("SELECT s.pause_collection_behavior AS behavior, \
                        to_json(s.pause_collection_resumes_at) #>> '{}' AS resumes_at, \
                        s.pause_collection_set_by AS set_by, \
                        s.pause_collection_resumes_at <= now() AS lifted \
                 FROM subscriptions s \
                 JOIN invoices i ON i.tenant_id = s.tenant_id AND i.subscription_id = s.id \
                 WHERE i.id = $1 AND i.status = 'open' AND s.status <> 'canceled' \
                 FOR UPDATE OF s")
            .bind(run.invoice_id),
        )
        .await?
    else {
        return Ok(Some(Vec::new()));
    };
    let mut behavior: Option<String> = read.try_get("behavior").map_err(db::Error::from)?;
    let mut resumes_at: Option<String> = read.try_get("resumes_at").map_err(db::Error::from)?;
    let mut set_by: Option<String> = read.try_get("set_by").map_err(db::Error::from)?;
    let lifted: Option<bool> = read.try_get("lifted").map_err(db::Error::from)?;
    if set_by.as_deref() == Some("dunning") && lifted != Some(true) {
        return Ok(Some(Vec::new()));
    }
    let mut events = Vec::new();
    let mut replaced = serde_json::Value::Null;
    if lifted == Some(true) {
        let cleared = tx
            .execute(
                sql(
                    "UPDATE subscriptions SET pause_collection_behavior = NULL, \
                            pause_collection_resumes_at = NULL, pause_collection_set_by = NULL, \
                            updated_at = now() \
                     WHERE id = $1 AND pause_collection_behavior = $2 \
                       AND pause_collection_resumes_at = $3::timestamptz \
                       AND pause_collection_resumes_at <= now() \
                       AND pause_collection_set_by IS NOT DISTINCT FROM $4",
                )
                .bind(run.subscription_id)
                .bind(behavior.clone())
                .bind(resumes_at.clone())
                .bind(set_by.clone()),
            )
            .await?;
        if cleared != 1 {
            return Ok(None);
        }
        events.push((
            "subscription.collection_resumed",
            serde_json::json!({"object": "subscription", "id": run.subscription_id,
                               "pause_collection": null,
                               "previous_pause_collection": {"behavior": behavior,
                                                             "resumes_at": resumes_at}}),
        ));
        (behavior, resumes_at, set_by) = (None, None, None);
    } else if behavior.is_some() {
        replaced = serde_json::json!({"behavior": behavior, "resumes_at": resumes_at,
                                      "set_by": set_by});
    }
    let paused = tx
        .execute(
            sql(
                "UPDATE subscriptions s SET pause_collection_behavior = $2, \
                        pause_collection_resumes_at = NULL, pause_collection_set_by = 'dunning', \
                        updated_at = now() \
                 FROM invoices i \
                 WHERE i.id = $1 AND s.tenant_id = i.tenant_id AND s.id = i.subscription_id \
                   AND i.status = 'open' AND s.status <> 'canceled' \
                   AND s.pause_collection_behavior IS NOT DISTINCT FROM $3 \
                   AND s.pause_collection_resumes_at IS NOT DISTINCT FROM $4::timestamptz \
                   AND s.pause_collection_set_by IS NOT DISTINCT FROM $5",
            )
            .bind(run.invoice_id)
            .bind(run.policy.pause_behavior.as_str())
            .bind(behavior)
            .bind(resumes_at)
            .bind(set_by),
        )
        .await?;
    if paused != 1 {
        return Ok(None);
    }
    events.push((
        "subscription.collection_paused",
        serde_json::json!({"object": "subscription", "id": run.subscription_id,
                           "pause_collection": {"behavior": run.policy.pause_behavior.as_str(),
                                                "resumes_at": null},
                           "replaced_pause_collection": replaced,
                           "invoice": run.invoice_id, "dunning_run": run.id}),
    ));
    Ok(Some(events))
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
