//! All of billing's SQL: the fenced due-billing funnel, the period close (one
//! compare-and-set per row, then the invoices and their `invoice.finalized`
//! events in the same transaction), and the backlog gauges.

use std::time::Duration;

use chrono::{DateTime, Utc};
use db::{Db, PgRow, Row, sql};
use leader::Fence;

use crate::Error;
use crate::close::Due;
use crate::money::money;

pub(crate) fn due(r: &PgRow) -> Result<Due, db::Error> {
    Ok(Due {
        subscription_id: r.try_get("id")?,
        tenant_id: r.try_get("tenant_id")?,
        status: r.try_get("status")?,
        billing_anchor: r.try_get("billing_anchor")?,
        current_period_start: r.try_get("current_period_start")?,
        current_period_end: r.try_get("current_period_end")?,
        next_billing_at: r.try_get("next_billing_at")?,
        collection_method: r.try_get("collection_method")?,
        interval_unit: r.try_get("interval_unit")?,
        interval_count: r.try_get("interval_count")?,
        amount: r.try_get("amount")?,
        currency: r.try_get("currency")?,
        cancel_at_period_end: r.try_get("cancel_at_period_end")?,
    })
}

/// The fenced funnel: up to `limit` active subscriptions whose watermark has
/// passed, oldest watermark first, with their plan, leaving out `except`
/// (rows this tick already left out). A listing, not a lease: what it returns
/// is the snapshot each closing proves, and the closing's compare-and-set, not
/// this claim, is what stops a second biller.
///
/// The fence sits in the innermost WHERE, next to `FOR UPDATE SKIP LOCKED`: a
/// stale token lists nothing, and rows a closing transaction holds are skipped.
pub(crate) async fn claim_due(
    db: &Db,
    fence: &Fence,
    limit: usize,
    except: &[i64],
    statement_timeout: Duration,
) -> Result<Listed<Due>, db::Error> {
    let limit = i64::try_from(limit).unwrap_or(i64::MAX);
    let mut tx = db.begin_with_timeout(statement_timeout).await?;
    let rows = tx
        .fetch_all(
            sql(
                "SELECT s.id, s.tenant_id, s.status, s.billing_anchor, s.current_period_start, \
                        s.current_period_end, s.next_billing_at, s.collection_method, \
                        s.cancel_at_period_end, \
                        p.interval_unit, p.interval_count, p.amount, p.currency, now() AS at, \
                        (LEAST(s.billing_anchor, s.current_period_start, s.current_period_end, \
                               s.next_billing_at) >= '1970-01-01 00:00:00+00' \
                         AND GREATEST(s.billing_anchor, s.current_period_start, \
                                      s.current_period_end, s.next_billing_at) \
                             < '10000-01-01 00:00:00+00') AS decodable \
                 FROM subscriptions s \
                 JOIN plans p ON p.tenant_id = s.tenant_id AND p.id = s.plan_id \
                 WHERE s.status = 'active' \
                   AND s.next_billing_at <= now() \
                   AND s.id <> ALL ($3) \
                   AND leader_fence($1, $2) \
                 ORDER BY s.next_billing_at, s.id \
                 LIMIT $4 \
                 FOR UPDATE OF s SKIP LOCKED",
            )
            .bind(fence.role_name())
            .bind(fence.token())
            .bind(except.to_vec())
            .bind(limit),
        )
        .await?;
    tx.commit().await?;
    Ok(decode_each(&rows, due))
}

/// A claim's rows, and the ids of those that could not be decoded (left out
/// of the tick by the caller, logged and counted).
#[derive(Debug, Default)]
pub(crate) struct Listed<T> {
    pub rows: Vec<T>,
    pub undecodable: Vec<i64>,
    /// The database's clock at the claim.
    pub at: Option<DateTime<Utc>>,
}

/// Decode each row, leaving out (by id) one whose `decodable` column says its
/// timestamps are out of the range migration 0020's CHECK allows (1970 to
/// 9999, so never ±infinity) (decoding `infinity` would
/// panic inside the driver) or whose decoding fails.
pub(crate) fn decode_each<T>(
    rows: &[PgRow],
    decode: impl Fn(&PgRow) -> Result<T, db::Error>,
) -> Listed<T> {
    let mut listed = Listed {
        rows: Vec::with_capacity(rows.len()),
        undecodable: Vec::new(),
        at: None,
    };
    for r in rows {
        let ok = r.try_get::<bool, _>("decodable").unwrap_or(false);
        match ok.then(|| decode(r)) {
            Some(Ok(t)) => listed.rows.push(t),
            _ => listed
                .undecodable
                .push(r.try_get::<i64, _>("id").unwrap_or_default()),
        }
        if listed.at.is_none() {
            listed.at = r.try_get("at").ok();
        }
    }
    listed
}

/// The due backlog, for the gauges.
#[derive(Debug, Clone, Copy, PartialEq)]
pub(crate) struct Backlog {
    pub due: i64,
    /// Seconds since the oldest due watermark passed; 0 when nothing is due.
    pub oldest_due_age: f64,
    /// Payment attempts waiting for an operator (needs review, or failed with
    /// the invoice flagged), read by the partial indexes.
    pub needs_review: i64,
    /// Attempts the provider is still processing.
    pub processing: i64,
}

pub(crate) async fn backlog(db: &Db, statement_timeout: Duration) -> Result<Backlog, db::Error> {
    let mut tx = db.begin_with_timeout(statement_timeout).await?;
    let row = tx
        .fetch_one(sql("SELECT count(*) AS due, \
                    COALESCE(extract(epoch FROM now() - min(next_billing_at)), 0)::float8 AS age \
             FROM subscriptions WHERE status = 'active' AND next_billing_at <= now()"))
        .await?;
    let review = tx
        .fetch_one(sql(
            "SELECT (SELECT count(*) FROM payment_attempts_needing_review) AS needs_review, \
                    (SELECT count(*) FROM payment_attempts \
                     WHERE provider_status = 'processing') AS processing",
        ))
        .await?;
    tx.commit().await?;
    Ok(Backlog {
        due: row.try_get("due")?,
        oldest_due_age: row.try_get("age")?,
        needs_review: review.try_get("needs_review")?,
        processing: review.try_get("processing")?,
    })
}

/// An open automatic invoice this worker holds the auto-charge claim of.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct ChargeClaim {
    pub invoice_id: i64,
    pub tenant_id: String,
    pub subscription_id: i64,
    /// Integer minor units.
    pub amount: i64,
    pub currency: String,
    pub email: String,
    /// `cus_…`
    pub provider_customer: String,
    /// `pm_…`
    pub payment_method: String,
    /// This claim's identity, written to `auto_charge_claimed_by`.
    pub claimed_by: String,
    /// `INV-000123`; `None` for invoices made before numbering.
    pub number: Option<String>,
    /// The tenant's sender (`tenant_settings.email_from`), when it names one.
    pub email_from: Option<String>,
}

impl ChargeClaim {
    /// The invoice as people read it: its number, else its id.
    pub fn label(&self) -> String {
        self.number
            .clone()
            .unwrap_or_else(|| self.invoice_id.to_string())
    }
}

/// The fenced auto-charge funnel: up to `limit` open automatic invoices that
/// have never been attempted, whose customer has a saved card and whose
/// subscription's collection is not paused, and whose claim lease is free or
/// expired; each taken by the conditional UPDATE that sets the lease.
///
/// The lease predicate sits in the locking subquery: a row a concurrent claim
/// just took is re-checked after its lock and left alone.
pub(crate) async fn claim_charges(
    db: &Db,
    fence: &Fence,
    limit: usize,
    claimed_by: &str,
    lease: Duration,
    statement_timeout: Duration,
) -> Result<Vec<ChargeClaim>, db::Error> {
    let mut tx = db.begin_with_timeout(statement_timeout).await?;
    let claims = claim_charges_in(&mut tx, fence, limit, claimed_by, lease).await?;
    tx.commit().await?;
    Ok(claims)
}

/// [`claim_charges`] and, in the same transaction, attempt 1 of every
/// invoice claimed (`batch::start_attempts_in`): the batch's claims and
/// attempts with two statements. Only a claimed invoice whose attempt was
/// written is returned; the call may be made for it.
pub(crate) async fn claim_and_start(
    db: &Db,
    fence: &Fence,
    limit: usize,
    claimed_by: &str,
    (lease, instance): (Duration, &str),
    statement_timeout: Duration,
) -> Result<Vec<crate::batch::Started>, db::Error> {
    let mut tx = db.begin_with_timeout(statement_timeout).await?;
    let claims = claim_charges_in(&mut tx, fence, limit, claimed_by, lease).await?;
    let attempts: Vec<(ChargeClaim, i32)> = claims
        .into_iter()
        .map(|c| (c, crate::charge::AUTO_CHARGE_ATTEMPT))
        .collect();
    let started = crate::batch::start_attempts_in(&mut tx, &attempts, instance).await?;
    tx.commit().await?;
    Ok(started)
}

async fn claim_charges_in(
    tx: &mut db::Tx,
    fence: &Fence,
    limit: usize,
    claimed_by: &str,
    lease: Duration,
) -> Result<Vec<ChargeClaim>, db::Error> {
    let limit = i64::try_from(limit).unwrap_or(i64::MAX);
    let rows = tx
        .fetch_all(
            sql(
                "WITH picked AS ( \
                   SELECT i.id FROM invoices i \
                   JOIN subscriptions s ON s.tenant_id = i.tenant_id AND s.id = i.subscription_id \
                   JOIN customers c ON c.tenant_id = s.tenant_id AND c.id = s.customer_id \
                   WHERE i.status = 'open' AND i.collection_method = 'automatic' \
                     AND (i.auto_charge_claimed_until IS NULL OR i.auto_charge_claimed_until <= now()) \
                     AND s.pause_collection_behavior IS NULL \
                     AND c.payment_method_id IS NOT NULL \
                     AND NOT EXISTS (SELECT 1 FROM payment_attempts a WHERE a.invoice_id = i.id) \
                     AND leader_fence($1, $2) \
                   ORDER BY i.id \
                   LIMIT $3 \
                   FOR UPDATE OF i SKIP LOCKED \
                 ), claimed AS ( \
                   UPDATE invoices i \
                   SET auto_charge_claimed_until = now() + make_interval(secs => $4), \
                       auto_charge_claimed_by = $5 \
                   FROM picked WHERE i.id = picked.id \
                   RETURNING i.id, i.tenant_id, i.subscription_id, i.amount, i.currency, i.number \
                 ) \
                 SELECT k.id, k.tenant_id, k.subscription_id, k.amount, k.currency, k.number, \
                        c.email, c.provider_customer_id, c.payment_method_id, \
                        (SELECT ts.email_from FROM tenant_settings ts \
                         WHERE ts.tenant_id = k.tenant_id) AS tenant_from \
                 FROM claimed k \
                 JOIN subscriptions s ON s.tenant_id = k.tenant_id AND s.id = k.subscription_id \
                 JOIN customers c ON c.tenant_id = s.tenant_id AND c.id = s.customer_id \
                 ORDER BY k.id",
            )
            .bind(fence.role_name())
            .bind(fence.token())
            .bind(limit)
            .bind(lease.as_secs_f64())
            .bind(claimed_by.to_owned()),
        )
        .await?;
    rows.iter()
        .map(|r| {
            Ok(ChargeClaim {
                invoice_id: r.try_get("id")?,
                tenant_id: r.try_get("tenant_id")?,
                subscription_id: r.try_get("subscription_id")?,
                amount: r.try_get("amount")?,
                currency: r.try_get("currency")?,
                email: r.try_get("email")?,
                provider_customer: r.try_get("provider_customer_id")?,
                payment_method: r.try_get("payment_method_id")?,
                claimed_by: claimed_by.to_owned(),
                number: r.try_get("number")?,
                email_from: r.try_get("tenant_from")?,
            })
        })
        .collect()
}

/// Record attempt `attempt_seq` (as `unknown`, before the call) if the claim
/// still holds the invoice, under the key of `instance`. `None`: the claim
/// was lost or the attempt exists.
pub(crate) async fn start_attempt(
    db: &Db,
    claim: &ChargeClaim,
    attempt_seq: i32,
    instance: &str,
    statement_timeout: Duration,
) -> Result<Option<crate::batch::Started>, db::Error> {
    let mut tx = db.begin_with_timeout(statement_timeout).await?;
    let started =
        crate::batch::start_attempts_in(&mut tx, &[(claim.clone(), attempt_seq)], instance).await?;
    tx.commit().await?;
    Ok(started.into_iter().next())
}

/// How a charge's answer was written.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Settled {
    Written,
    /// The claim no longer holds the invoice, or the attempt was settled by
    /// someone else: nothing written (the reconciler settles the attempt).
    Lost,
}

/// `invoice.paid`'s data.
pub(crate) fn paid_payload(c: &ChargeClaim, payment_intent: &str) -> String {
    serde_json::json!({
        "object": "invoice",
        "id": c.invoice_id,
        "subscription": c.subscription_id,
        "status": "paid",
        "amount_paid": c.amount,
        "currency": c.currency,
        "payment_intent": payment_intent,
    })
    .to_string()
}

/// The receipt of a paid charge.
pub(crate) fn receipt(c: &ChargeClaim, from: &str) -> email_outbox::Email {
    email_outbox::Email {
        from: c.email_from.clone().unwrap_or_else(|| from.to_owned()),
        to: vec![c.email.clone()],
        subject: format!("Receipt for invoice {}", c.label()),
        text: format!(
            "We received your payment of {} for invoice {}. Thank you.\n",
            money(c.amount, &c.currency),
            c.label()
        ),
        html: None,
    }
}

/// The payment-failed email of a declined charge, asking for what the
/// decline calls for (its class, `provider::decline_class`).
pub(crate) fn failed_email(c: &ChargeClaim, code: &str, from: &str) -> email_outbox::Email {
    use crate::provider::{DeclineClass, decline_class};
    let amount = money(c.amount, &c.currency);
    let ask = match decline_class(code) {
        DeclineClass::Soft => "We will try again in a few days; you can also update your \
                               payment method now."
            .to_owned(),
        DeclineClass::Hard => "We will not try this card again: please add a new payment \
                               method, and we will charge it."
            .to_owned(),
        DeclineClass::AuthenticationRequired => "Your bank asks you to authenticate this \
                                                 payment: please confirm it, or add another \
                                                 payment method."
            .to_owned(),
    };
    email_outbox::Email {
        from: c.email_from.clone().unwrap_or_else(|| from.to_owned()),
        to: vec![c.email.clone()],
        subject: format!("Your payment for invoice {} failed", c.label()),
        text: format!(
            "We could not charge {amount} for invoice {} to your saved card ({code}). {ask}\n",
            c.label(),
        ),
        html: None,
    }
}

pub(crate) fn payment_payload(
    claim: &ChargeClaim,
    attempt_seq: i32,
    payment_intent: Option<&str>,
    decline_code: Option<&str>,
) -> String {
    serde_json::json!({
        "object": "payment",
        "invoice": claim.invoice_id,
        "attempt": attempt_seq,
        "amount": claim.amount,
        "currency": claim.currency,
        "payment_intent": payment_intent,
        "decline_code": decline_code,
    })
    .to_string()
}

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
    let mut tx = db.begin_with_timeout(statement_timeout).await?;
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
    Ok(decode_each(&rows, |r| {
        Ok(TrialEnded {
            subscription_id: r.try_get("id")?,
            tenant_id: r.try_get("tenant_id")?,
            billing_anchor: r.try_get("billing_anchor")?,
            trial_end: r.try_get("trial_end")?,
            interval_unit: r.try_get("interval_unit")?,
            interval_count: r.try_get("interval_count")?,
        })
    }))
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
    let mut tx = db.begin_with_timeout(statement_timeout).await?;
    let rows = tx
        .fetch_all(
            sql("UPDATE subscriptions s \
                 SET status = 'active', current_period_start = i.trial_end, \
                     current_period_end = i.period_end, next_billing_at = i.period_end, \
                     updated_at = now() \
                 FROM unnest($1::bigint[], $2::timestamptz[], $3::timestamptz[]) \
                      AS i(id, trial_end, period_end) \
                 WHERE s.id = i.id AND s.status = 'trialing' AND s.trial_end = i.trial_end \
                 RETURNING s.id, s.tenant_id, s.current_period_start, s.current_period_end")
            .bind(
                trials
                    .iter()
                    .map(|(t, _)| t.subscription_id)
                    .collect::<Vec<_>>(),
            )
            .bind(trials.iter().map(|(t, _)| t.trial_end).collect::<Vec<_>>())
            .bind(trials.iter().map(|(_, end)| *end).collect::<Vec<_>>()),
        )
        .await?;
    let mut activated = Vec::with_capacity(rows.len());
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
        webhook_outbox::enqueue(
            &mut tx,
            &tenant,
            "subscription.trial_ended",
            &payload.to_string(),
        )
        .await?;
        activated.push(id);
    }
    tx.commit().await?;
    Ok(activated)
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
/// pause-collection resume time has passed, oldest first.
pub(crate) async fn claim_lifted_pauses(
    db: &Db,
    fence: &Fence,
    limit: usize,
    except: &[i64],
    statement_timeout: Duration,
) -> Result<Listed<LiftedPause>, db::Error> {
    let limit = i64::try_from(limit).unwrap_or(i64::MAX);
    let mut tx = db.begin_with_timeout(statement_timeout).await?;
    let rows = tx
        .fetch_all(
            sql("SELECT s.id, s.tenant_id, s.pause_collection_behavior, \
                        s.pause_collection_resumes_at, s.pause_collection_set_by, \
                        (s.pause_collection_resumes_at >= '1970-01-01 00:00:00+00' \
                         AND s.pause_collection_resumes_at < '10000-01-01 00:00:00+00') AS decodable \
                 FROM subscriptions s \
                 WHERE s.pause_collection_resumes_at <= now() \
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
    Ok(decode_each(&rows, |r| {
        Ok(LiftedPause {
            subscription_id: r.try_get("id")?,
            tenant_id: r.try_get("tenant_id")?,
            behavior: r.try_get("pause_collection_behavior")?,
            resumes_at: r.try_get("pause_collection_resumes_at")?,
            set_by: r.try_get("pause_collection_set_by")?,
        })
    }))
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
    let mut tx = db.begin_with_timeout(statement_timeout).await?;
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
    let mut resumed = Vec::with_capacity(rows.len());
    for r in &rows {
        let id: i64 = r.try_get("id").map_err(db::Error::from)?;
        let tenant: String = r.try_get("tenant_id").map_err(db::Error::from)?;
        let p = pauses.iter().find(|p| p.subscription_id == id);
        let payload = serde_json::json!({
            "object": "subscription",
            "id": id,
            "pause_collection": null,
            "previous_pause_collection": p.map(|p| serde_json::json!({
                "behavior": p.behavior,
                "resumes_at": p.resumes_at.to_rfc3339(),
            })),
        });
        webhook_outbox::enqueue(
            &mut tx,
            &tenant,
            "subscription.collection_resumed",
            &payload.to_string(),
        )
        .await?;
        resumed.push(id);
    }
    tx.commit().await?;
    Ok(resumed)
}

/// An attempt still open (unknown or processing), with the claim the
/// reconciler took on its invoice.
#[derive(Debug, Clone, PartialEq, Eq)]
pub(crate) struct UnknownAttempt {
    pub attempt_id: i64,
    pub attempt_seq: i32,
    pub idempotency_key: String,
    /// The PaymentIntent an earlier answer named: read by id.
    pub payment_intent: Option<String>,
    /// The key is certainly alive at the provider (first sent within the
    /// resend window, on the database clock), or no request of it executed.
    pub resend_ok: bool,
    /// Unix seconds from which the customer's intents are listed.
    pub listed_since: i64,
    /// Amount, currency, customer and card as the attempt was sent.
    pub claim: ChargeClaim,
}

/// The fenced reconciler funnel: up to `limit` open attempts (unknown or
/// processing) of open invoices not flagged for review, whose auto-charge
/// claim is free or expired (so no call of theirs can still be in flight) and
/// whose next look is due, least recently checked first, only the earliest
/// open attempt of an invoice; each invoice taken under a fresh claim lease by
/// the same conditional UPDATE auto-charge uses. An attempt whose key no
/// request executed (`first_sent_at` NULL: recorded, then never sent because
/// the budget ran out or the tick was cancelled) is listed only while its
/// invoice is still chargeable (the subscription active, its collection not
/// paused; the invoice open and not flagged), and is stamped as sent now,
/// since the reconciler may send it.
pub(crate) async fn claim_unknown(
    db: &Db,
    fence: &Fence,
    limit: usize,
    except: &[i64],
    claimed_by: &str,
    (lease, resend_window): (Duration, Duration),
    statement_timeout: Duration,
) -> Result<Vec<UnknownAttempt>, db::Error> {
    let limit = i64::try_from(limit).unwrap_or(i64::MAX);
    let mut tx = db.begin_with_timeout(statement_timeout).await?;
    let rows = tx
        .fetch_all(
            sql(
                "WITH picked AS ( \
                   SELECT a.id AS attempt_id, i.id, \
                          (a.first_sent_at IS NULL \
                           OR a.first_sent_at > now() - make_interval(secs => $7)) AS resend_ok \
                   FROM payment_attempts a \
                   JOIN invoices i ON i.tenant_id = a.tenant_id AND i.id = a.invoice_id \
                   JOIN subscriptions s ON s.tenant_id = i.tenant_id AND s.id = i.subscription_id \
                   JOIN customers c ON c.tenant_id = s.tenant_id AND c.id = s.customer_id \
                   WHERE a.provider_status IN ('unknown', 'processing') AND i.status = 'open' \
                     AND i.review_since IS NULL \
                     AND (a.next_check_at IS NULL OR a.next_check_at <= now()) \
                     AND (i.auto_charge_claimed_until IS NULL OR i.auto_charge_claimed_until <= now()) \
                     AND COALESCE(a.payment_method_id, c.payment_method_id) IS NOT NULL \
                     AND (a.first_sent_at IS NOT NULL \
                          OR (s.status = 'active' AND s.pause_collection_behavior IS NULL)) \
                     AND a.id <> ALL ($6) \
                     AND NOT EXISTS (SELECT 1 FROM payment_attempts e \
                                     WHERE e.invoice_id = a.invoice_id \
                                       AND e.provider_status IN ('unknown', 'processing') \
                                       AND e.attempt_seq < a.attempt_seq) \
                     AND leader_fence($1, $2) \
                   ORDER BY a.last_checked_at NULLS FIRST, a.id \
                   LIMIT $3 \
                   FOR UPDATE OF i SKIP LOCKED \
                 ), claimed AS ( \
                   UPDATE invoices i \
                   SET auto_charge_claimed_until = now() + make_interval(secs => $4), \
                       auto_charge_claimed_by = $5 \
                   FROM (SELECT DISTINCT id FROM picked) p WHERE i.id = p.id \
                   RETURNING i.id, i.tenant_id, i.subscription_id, i.number \
                 ), sent AS ( \
                   UPDATE payment_attempts a SET first_sent_at = now() \
                   FROM picked p WHERE a.id = p.attempt_id AND a.first_sent_at IS NULL \
                 ) \
                 SELECT a.id AS attempt_id, a.attempt_seq, a.idempotency_key, a.amount, a.currency, \
                        a.provider_payment_intent, p.resend_ok, \
                        (extract(epoch FROM a.created_at))::bigint - 300 AS listed_since, \
                        k.id, k.tenant_id, k.subscription_id, k.number, c.email, \
                        (SELECT ts.email_from FROM tenant_settings ts \
                         WHERE ts.tenant_id = k.tenant_id) AS tenant_from, \
                        COALESCE(a.provider_customer_id, c.provider_customer_id) AS customer, \
                        COALESCE(a.payment_method_id, c.payment_method_id) AS card \
                 FROM claimed k \
                 JOIN picked p ON p.id = k.id \
                 JOIN payment_attempts a ON a.id = p.attempt_id \
                 JOIN subscriptions s ON s.tenant_id = k.tenant_id AND s.id = k.subscription_id \
                 JOIN customers c ON c.tenant_id = s.tenant_id AND c.id = s.customer_id \
                 ORDER BY a.last_checked_at NULLS FIRST, a.id",
            )
            .bind(fence.role_name())
            .bind(fence.token())
            .bind(limit)
            .bind(lease.as_secs_f64())
            .bind(claimed_by.to_owned())
            .bind(except.to_vec())
            .bind(resend_window.as_secs_f64()),
        )
        .await?;
    tx.commit().await?;
    rows.iter()
        .map(|r| {
            Ok(UnknownAttempt {
                attempt_id: r.try_get("attempt_id")?,
                attempt_seq: r.try_get("attempt_seq")?,
                idempotency_key: r.try_get("idempotency_key")?,
                payment_intent: r.try_get("provider_payment_intent")?,
                resend_ok: r.try_get("resend_ok")?,
                listed_since: r.try_get("listed_since")?,
                claim: ChargeClaim {
                    invoice_id: r.try_get("id")?,
                    tenant_id: r.try_get("tenant_id")?,
                    subscription_id: r.try_get("subscription_id")?,
                    amount: r.try_get("amount")?,
                    currency: r.try_get("currency")?,
                    email: r.try_get("email")?,
                    provider_customer: r.try_get("customer")?,
                    payment_method: r.try_get("card")?,
                    claimed_by: claimed_by.to_owned(),
                    number: r.try_get("number")?,
                    email_from: r.try_get("tenant_from")?,
                },
            })
        })
        .collect()
}

/// After the unknown-outcome checks of a batch: stamp every checked attempt
/// (settled, still unknown, or whose check panicked) so it goes to the back
/// of the sweep, and give back the claims the checks still hold.
pub(crate) async fn stamp_checked(
    db: &Db,
    attempt_ids: &[i64],
    invoice_ids: &[i64],
    claimed_by: &str,
    statement_timeout: Duration,
) -> Result<(), db::Error> {
    let mut tx = db.begin_with_timeout(statement_timeout).await?;
    tx.execute(
        sql("UPDATE payment_attempts SET last_checked_at = now() WHERE id = ANY($1)")
            .bind(attempt_ids.to_vec()),
    )
    .await?;
    tx.execute(
        sql(
            "UPDATE invoices SET auto_charge_claimed_until = NULL, auto_charge_claimed_by = NULL \
             WHERE id = ANY($1) AND auto_charge_claimed_by = $2",
        )
        .bind(invoice_ids.to_vec())
        .bind(claimed_by.to_owned()),
    )
    .await?;
    tx.commit().await
}

/// The stale-hold sweep, fenced: free up to `limit` auto-charge claims past
/// their expiry, the longest expired first. One statement; a freed row
/// leaves the sweep, so no row can hold up the ones behind it.
pub(crate) async fn free_stale_holds(
    db: &Db,
    fence: &Fence,
    limit: usize,
    statement_timeout: Duration,
) -> Result<u64, db::Error> {
    let limit = i64::try_from(limit).unwrap_or(i64::MAX);
    let mut tx = db.begin_with_timeout(statement_timeout).await?;
    let n = tx
        .execute(
            sql("UPDATE invoices SET auto_charge_claimed_until = NULL, auto_charge_claimed_by = NULL \
                 WHERE id IN (SELECT id FROM invoices \
                              WHERE auto_charge_claimed_until <= now() AND leader_fence($1, $2) \
                              ORDER BY auto_charge_claimed_until, id LIMIT $3 \
                              FOR UPDATE SKIP LOCKED) \
                   AND auto_charge_claimed_until <= now()")
            .bind(fence.role_name())
            .bind(fence.token())
            .bind(limit),
        )
        .await?;
    tx.commit().await?;
    Ok(n)
}

/// A subscription's fresh snapshot for a plan change, the new plan, and the
/// database's now.
pub(crate) async fn plan_change_snapshot(
    db: &Db,
    tenant_id: &str,
    subscription_id: i64,
    plan_id: i64,
    statement_timeout: Duration,
) -> Result<Option<(Due, crate::close::Plan, DateTime<Utc>)>, db::Error> {
    let mut tx = db.begin_with_timeout(statement_timeout).await?;
    let row = tx
        .fetch_optional(
            sql(
                "SELECT s.id, s.tenant_id, s.status, s.billing_anchor, s.current_period_start, \
                        s.current_period_end, s.next_billing_at, s.collection_method, \
                        s.cancel_at_period_end, \
                        p.interval_unit, p.interval_count, p.amount, p.currency, \
                        n.id AS new_id, n.interval_unit AS new_unit, \
                        n.interval_count AS new_count, n.amount AS new_amount, \
                        n.currency AS new_currency, now() AS at \
                 FROM subscriptions s \
                 JOIN plans p ON p.tenant_id = s.tenant_id AND p.id = s.plan_id \
                 JOIN plans n ON n.tenant_id = s.tenant_id AND n.id = $3 \
                 WHERE s.tenant_id = $1 AND s.id = $2 AND s.status = 'active'",
            )
            .bind(tenant_id.to_owned())
            .bind(subscription_id)
            .bind(plan_id),
        )
        .await?;
    tx.commit().await?;
    row.map(|r| {
        Ok((
            due(&r)?,
            crate::close::Plan {
                id: r.try_get("new_id")?,
                interval_unit: r.try_get("new_unit")?,
                interval_count: r.try_get("new_count")?,
                amount: r.try_get("new_amount")?,
                currency: r.try_get("new_currency")?,
            },
            r.try_get("at")?,
        ))
    })
    .transpose()
}
