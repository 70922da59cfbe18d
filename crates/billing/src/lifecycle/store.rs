//! The trial and resume steps' SQL: fenced listings and the
//! compare-and-sets on what they read, each with its event.

use std::time::Duration;

use chrono::{DateTime, Utc};
use db::{Db, Row, sql};
use leader::Fence;

use crate::Error;
use crate::store::{Listed, decode_each};

/// A trialing subscription whose trial has ended, as the trial funnel read it.
#[derive(Debug, Clone, PartialEq, Eq)]
pub(crate) struct TrialEnded {
    pub subscription_id: i64,
    pub tenant_id: String,
    pub billing_anchor: DateTime<Utc>,
    /// The trial end as read: proven by the activation, and where the first
    /// paid period starts.
    pub trial_end: DateTime<Utc>,
    pub interval_unit: String,
    pub interval_count: i32,
}

/// The fenced trial funnel: up to `limit` trialing subscriptions whose trial
/// ended, oldest first, leaving out `except`.
pub(crate) async fn claim_trials(
    db: &Db,
    fence: &Fence,
    limit: usize,
    except: &[i64],
    statement_timeout: Duration,
) -> Result<Listed<TrialEnded>, db::Error> {
    let limit = i64::try_from(limit).unwrap_or(i64::MAX);
    let mut tx = db.begin_index_driven(statement_timeout).await?;
    let rows = tx
        .fetch_all(
            sql("SELECT s.id, s.tenant_id, s.billing_anchor, s.trial_end, \
                        p.interval_unit, p.interval_count, \
                        (LEAST(s.billing_anchor, s.trial_end) >= '1970-01-01 00:00:00+00' \
                         AND GREATEST(s.billing_anchor, s.trial_end) \
                             < '10000-01-01 00:00:00+00') AS decodable \
                 FROM subscriptions s \
                 JOIN plans p ON p.tenant_id = s.tenant_id AND p.id = s.plan_id \
                 WHERE s.status = 'trialing' AND s.trial_end <= now() \
                   AND s.id <> ALL ($3) \
                   AND leader_fence($1, $2) \
                 ORDER BY s.trial_end, s.id \
                 LIMIT $4 \
                 FOR UPDATE OF s SKIP LOCKED")
            .bind(fence.role_name())
            .bind(fence.token())
            .bind(except.to_vec())
            .bind(limit),
        )
        .await?;
    tx.commit().await?;
    Ok(decode_each(&rows, trial_ended))
}

/// A trialing subscription row as [`claim_trials`] and [`ended_trial_in`] read it.
fn trial_ended(r: &db::PgRow) -> Result<TrialEnded, db::Error> {
    Ok(TrialEnded {
        subscription_id: r.try_get("id")?,
        tenant_id: r.try_get("tenant_id")?,
        billing_anchor: r.try_get("billing_anchor")?,
        trial_end: r.try_get("trial_end")?,
        interval_unit: r.try_get("interval_unit")?,
        interval_count: r.try_get("interval_count")?,
    })
}

/// Activate ended trials, one transaction: per row, trialing → active by
/// compare-and-set on the status and the trial end read, the first paid
/// period `[trial_end, period_end)`, and `subscription.trial_ended`. Returns
/// the subscriptions activated; a lost compare-and-set writes nothing.
pub(crate) async fn activate_trials(
    db: &Db,
    trials: &[(TrialEnded, DateTime<Utc>)],
    statement_timeout: Duration,
) -> Result<Vec<i64>, Error> {
    if trials.is_empty() {
        return Ok(Vec::new());
    }
    let mut tx = db.begin_index_driven(statement_timeout).await?;
    let activated = activate_trials_in(&mut tx, trials).await?;
    tx.commit().await?;
    Ok(activated)
}

/// [`activate_trials`] in the caller's transaction (a cancel now of a
/// trial that ended and was not activated yet, docs/adr/0077).
pub(crate) async fn activate_trials_in(
    tx: &mut db::Tx,
    trials: &[(TrialEnded, DateTime<Utc>)],
) -> Result<Vec<i64>, Error> {
    if trials.is_empty() {
        return Ok(Vec::new());
    }
    let rows = tx
        .fetch_all(
            sql("UPDATE subscriptions s \
                 SET status = 'active', current_period_start = i.trial_end, \
                     current_period_end = i.period_end, next_billing_at = i.period_end, \
                     updated_at = now() \
                 FROM unnest($1::bigint[], $2::timestamptz[], $3::timestamptz[], $4::text[]) \
                      AS i(id, trial_end, period_end, status) \
                 WHERE s.id = i.id AND s.status = i.status AND s.trial_end = i.trial_end \
                 RETURNING s.id, s.tenant_id, s.current_period_start, s.current_period_end")
            .bind(
                trials
                    .iter()
                    .map(|(t, _)| t.subscription_id)
                    .collect::<Vec<_>>(),
            )
            .bind(trials.iter().map(|(t, _)| t.trial_end).collect::<Vec<_>>())
            .bind(trials.iter().map(|(_, end)| *end).collect::<Vec<_>>())
            // The expected status per row, not a literal: a literal
            // `'trialing'` lets the planner walk every trial through
            // `subscriptions_trial_due` instead of reaching the batch by key
            // (docs/adr/0053's reason, for the settle).
            .bind(vec!["trialing"; trials.len()]),
        )
        .await?;
    let mut activated = Vec::with_capacity(rows.len());
    let mut events = Vec::with_capacity(rows.len());
    for r in &rows {
        let id: i64 = r.try_get("id").map_err(db::Error::from)?;
        let tenant: String = r.try_get("tenant_id").map_err(db::Error::from)?;
        let start: DateTime<Utc> = r.try_get("current_period_start").map_err(db::Error::from)?;
        let end: DateTime<Utc> = r.try_get("current_period_end").map_err(db::Error::from)?;
        let payload = serde_json::json!({
            "object": "subscription",
            "id": id,
            "status": "active",
            "trial_end": start.to_rfc3339(),
            "current_period_start": start.to_rfc3339(),
            "current_period_end": end.to_rfc3339(),
        });
        events.push((tenant, payload.to_string()));
        activated.push(id);
    }
    outbox::webhook::enqueue_many_of(tx, "subscription.trial_ended", &events).await?;
    Ok(activated)
}

/// `tenant_id`'s subscription `subscription` if it is trialing and its trial
/// has ended (at the transaction's `now()`), its row locked.
pub(crate) async fn ended_trial_in(
    tx: &mut db::Tx,
    tenant_id: &str,
    subscription: i64,
) -> Result<Option<TrialEnded>, db::Error> {
    let row = tx
        .fetch_optional(
            sql("SELECT s.id, s.tenant_id, s.billing_anchor, s.trial_end, \
                        p.interval_unit, p.interval_count \
                 FROM subscriptions s \
                 JOIN plans p ON p.tenant_id = s.tenant_id AND p.id = s.plan_id \
                 WHERE s.tenant_id = $1 AND s.id = $2 \
                   AND s.status = 'trialing' AND s.trial_end <= now() \
                 FOR UPDATE OF s")
            .bind(tenant_id.to_owned())
            .bind(subscription),
        )
        .await?;
    row.as_ref().map(trial_ended).transpose()
}

/// A pause-collection whose resume time has passed, as the resume funnel read it.
#[derive(Debug, Clone, PartialEq, Eq)]
pub(crate) struct LiftedPause {
    pub subscription_id: i64,
    pub tenant_id: String,
    pub behavior: String,
    pub resumes_at: DateTime<Utc>,
    pub set_by: Option<String>,
}

/// The fenced resume funnel: up to `limit` subscriptions whose
/// pause-collection resume time has passed, oldest first, and which are not
/// behind: a period that ended before the resume time is closed under the
/// pause first, by the due billing after this step, and the next tick lifts
/// the pause (docs/adr/0110).
pub(crate) async fn claim_lifted_pauses(
    db: &Db,
    fence: &Fence,
    limit: usize,
    except: &[i64],
    statement_timeout: Duration,
) -> Result<Listed<LiftedPause>, db::Error> {
    let limit = i64::try_from(limit).unwrap_or(i64::MAX);
    let mut tx = db.begin_index_driven(statement_timeout).await?;
    // The "not behind" predicate made a table never analyzed look cheaper to
    // read whole and sort than to walk the index in order.
    tx.fetch_all(sql(db::NO_SEQUENTIAL_SCAN)).await?;
    let rows = tx
        .fetch_all(
            sql("SELECT s.id, s.tenant_id, s.pause_collection_behavior, \
                        s.pause_collection_resumes_at, s.pause_collection_set_by, \
                        (s.pause_collection_resumes_at >= '1970-01-01 00:00:00+00' \
                         AND s.pause_collection_resumes_at < '10000-01-01 00:00:00+00') AS decodable \
                 FROM subscriptions s \
                 WHERE s.pause_collection_resumes_at <= now() \
                   AND (s.next_billing_at IS NULL OR s.next_billing_at > now()) \
                   AND s.id <> ALL ($4) \
                   AND leader_fence($1, $2) \
                 ORDER BY s.pause_collection_resumes_at, s.id \
                 LIMIT $3 \
                 FOR UPDATE OF s SKIP LOCKED")
            .bind(fence.role_name())
            .bind(fence.token())
            .bind(limit)
            .bind(except.to_vec()),
        )
        .await?;
    tx.commit().await?;
    Ok(decode_each(&rows, lifted_pause))
}

fn lifted_pause(r: &db::PgRow) -> Result<LiftedPause, db::Error> {
    Ok(LiftedPause {
        subscription_id: r.try_get("id")?,
        tenant_id: r.try_get("tenant_id")?,
        behavior: r.try_get("pause_collection_behavior")?,
        resumes_at: r.try_get("pause_collection_resumes_at")?,
        set_by: r.try_get("pause_collection_set_by")?,
    })
}

/// `subscription`'s pause-collection if its resume time has passed (at the
/// transaction's `now()`), its row locked.
pub(crate) async fn lifted_pause_in(
    tx: &mut db::Tx,
    subscription: i64,
) -> Result<Option<LiftedPause>, db::Error> {
    let row = tx
        .fetch_optional(
            sql("SELECT s.id, s.tenant_id, s.pause_collection_behavior, \
                        s.pause_collection_resumes_at, s.pause_collection_set_by \
                 FROM subscriptions s \
                 WHERE s.id = $1 AND s.pause_collection_resumes_at <= now() \
                   AND s.pause_collection_resumes_at >= '1970-01-01 00:00:00+00' \
                 FOR UPDATE OF s")
            .bind(subscription),
        )
        .await?;
    row.as_ref().map(lifted_pause).transpose()
}

/// Resume collection, one transaction: per row, the pause cleared by
/// compare-and-set on the pause as read (behaviour, resume time, setter),
/// and `subscription.collection_resumed` in the same transaction. Returns the
/// subscriptions resumed; a lost compare-and-set writes and announces nothing.
pub(crate) async fn resume_lifted_pauses(
    db: &Db,
    pauses: &[LiftedPause],
    statement_timeout: Duration,
) -> Result<Vec<i64>, Error> {
    if pauses.is_empty() {
        return Ok(Vec::new());
    }
    let mut tx = db.begin_index_driven(statement_timeout).await?;
    let resumed = resume_lifted_pauses_in(&mut tx, pauses).await?;
    tx.commit().await?;
    Ok(resumed)
}

/// [`resume_lifted_pauses`] in the caller's transaction.
pub(crate) async fn resume_lifted_pauses_in(
    tx: &mut db::Tx,
    pauses: &[LiftedPause],
) -> Result<Vec<i64>, Error> {
    let rows = tx
        .fetch_all(
            sql("UPDATE subscriptions s \
                 SET pause_collection_behavior = NULL, pause_collection_resumes_at = NULL, \
                     pause_collection_set_by = NULL, updated_at = now() \
                 FROM unnest($1::bigint[], $2::text[], $3::timestamptz[], $4::text[]) \
                      AS i(id, behavior, resumes_at, set_by) \
                 WHERE s.id = i.id \
                   AND s.pause_collection_behavior = i.behavior AND s.pause_collection_resumes_at = i.resumes_at AND s.pause_collection_set_by IS NOT DISTINCT FROM i.set_by \
                 RETURNING s.id, s.tenant_id")
            .bind(pauses.iter().map(|p| p.subscription_id).collect::<Vec<_>>())
            .bind(pauses.iter().map(|p| p.behavior.clone()).collect::<Vec<_>>())
            .bind(pauses.iter().map(|p| p.resumes_at).collect::<Vec<_>>())
            .bind(pauses.iter().map(|p| p.set_by.clone()).collect::<Vec<_>>()),
        )
        .await?;
    let by_id: std::collections::HashMap<i64, &LiftedPause> =
        pauses.iter().map(|p| (p.subscription_id, p)).collect();
    let mut resumed = Vec::with_capacity(rows.len());
    let mut events = Vec::with_capacity(rows.len());
    for r in &rows {
        let id: i64 = r.try_get("id").map_err(db::Error::from)?;
        let tenant: String = r.try_get("tenant_id").map_err(db::Error::from)?;
        let p = by_id.get(&id);
        let payload = serde_json::json!({
            "object": "subscription",
            "id": id,
            "pause_collection": null,
            "previous_pause_collection": p.map(|p| serde_json::json!({
                "behavior": p.behavior,
                "resumes_at": p.resumes_at.to_rfc3339(),
            })),
        });
        events.push((tenant, payload.to_string()));
        resumed.push(id);
    }
    outbox::webhook::enqueue_many_of(tx, "subscription.collection_resumed", &events).await?;
    Ok(resumed)
}
