//! Retries not attempted (docs/adr/0026): a due retry that cannot be charged
//! (no payment method, or a hard decline on the payment method the customer
//! still has) is counted without a provider call, so the run reaches its
//! final action on time; a payment method added before the count is charged
//! instead. A run whose retries are spent (its last answered `processing`,
//! docs/adr/0073) is exhausted at its count once that attempt has settled,
//! and waits a hold while it has not; a run whose earlier retry was answered
//! `processing` and has since been declined has that decline announced and
//! its next retry scheduled (docs/adr/0085). None of them makes a call.

use std::collections::{HashMap, HashSet};

use chrono::{DateTime, Utc};
use db::{Row, Tx, sql};
use leader::Role;
use tracing::warn;

use crate::Error;
use crate::ctx::Ctx;
use crate::final_action;
use crate::notices::{not_attempted, sender};
use crate::outcomes::{self, Decline, Waiting, payload};
use crate::policy::AfterDecline;
use crate::run::{NotChargeable, Outcome, Retry, Run};

/// Due retries that cannot be charged (no payment method, or a hard
/// decline on the payment method the customer still has): per run, under
/// the guard, the next retry from the policy (or exhaustion) and the
/// warning; then ONE transaction counts them all by the attempt
/// compare-and-set ([`not_attempted_in`]), or, when it fails, one
/// transaction per run (docs/adr/0120); then each exhausted run's final
/// action. No provider call.
pub(crate) async fn count(ctx: &Ctx, runs: Vec<Run>) -> Vec<(Run, Outcome)> {
    let c = &ctx.config;
    let t = &ctx.telemetry;
    let mut exhausted: Vec<(&Run, String)> = Vec::new();
    let mut out: HashMap<i64, Outcome> = HashMap::with_capacity(runs.len());
    let mut rows: Vec<NotAttempted<'_>> = Vec::new();
    // Spent runs whose last retry is still unsettled: a hold, nothing counted.
    let mut waiting: Vec<Waiting<'_>> = Vec::new();
    // Retries answered `processing` since declined: announced as a decline.
    let mut declines: Vec<Decline<'_>> = Vec::new();
    for run in &runs {
        let Some(why) = run.not_chargeable else {
            continue;
        };
        match why {
            NotChargeable::OutcomePending => {
                waiting.push(Waiting {
                    run,
                    count: run.attempt_count,
                    was: run.next_attempt_at,
                    next: None,
                });
                continue;
            }
            // Nothing to plan: the policy has no retry left.
            NotChargeable::RetriesSpent => {
                rows.push(NotAttempted {
                    run,
                    why,
                    next: None,
                    email: None,
                });
                continue;
            }
            NotChargeable::DeclineUnannounced => {
                let step = format!("dunning/run {} (tenant {})", run.id, run.tenant_id);
                match scheduler::catch(step, async { owed_decline(ctx, run) }).await {
                    Ok(d) => declines.push(d),
                    Err(payload) => {
                        out.insert(run.id, Some(Err(payload)));
                    }
                }
                continue;
            }
            NotChargeable::NoPaymentMethod | NotChargeable::PaymentMethodUnchanged => {}
        }
        let attempt = run.attempt_count + 1;
        let step = format!("dunning/run {} (tenant {})", run.id, run.tenant_id);
        let prepared = scheduler::catch(step, async {
            match run
                .policy
                .after_decline(run.first_declined_at, attempt, run.database_now())
            {
                AfterDecline::Next { at } => {
                    let from = sender(run, &c.email_from);
                    let email = run
                        .policy
                        .warns_after(attempt)
                        .then(|| not_attempted(run, from, why, at));
                    (Some(at), email)
                }
                AfterDecline::Exhausted => (None, None),
            }
        })
        .await;
        match prepared {
            Ok((next, email)) => rows.push(NotAttempted {
                run,
                why,
                next,
                email: ctx.sendable(run, email),
            }),
            Err(payload) => {
                out.insert(run.id, Some(Err(payload)));
            }
        }
    }
    let (won, waited, announced) = match counted_in(ctx, &rows, &waiting, &declines).await {
        Ok(x) => x,
        Err(e) => {
            // Rolled back. One run at a time, so that a run whose own write
            // fails (every time, for a row that breaks a check) stays as
            // listed and holds back no other run: the batch's rollback had
            // left every run of it as listed, tick after tick (docs/adr/0120).
            warn!(role = %Role::Dunning, error = %e, runs = rows.len() + waiting.len() + declines.len(), "retries not attempted were not counted together; one run at a time");
            let mut won = HashSet::new();
            let mut waited = HashMap::new();
            let mut announced = HashSet::new();
            let mut not_counted = |id: i64, e: Error| {
                warn!(role = %Role::Dunning, run = id, error = %e, "retry not attempted was not counted; the run is as listed");
                out.insert(id, Some(Ok(Err(Error::NotCounted(e.to_string())))));
            };
            for n in &rows {
                match counted_in(ctx, std::slice::from_ref(n), &[], &[]).await {
                    Ok((w, _, _)) => won.extend(w),
                    Err(e) => not_counted(n.run.id, e),
                }
            }
            for w in &waiting {
                match counted_in(ctx, &[], std::slice::from_ref(w), &[]).await {
                    Ok((_, w, _)) => waited.extend(w),
                    Err(e) => not_counted(w.run.id, e),
                }
            }
            for d in &declines {
                match counted_in(ctx, &[], &[], std::slice::from_ref(d)).await {
                    Ok((_, _, a)) => announced.extend(a),
                    Err(e) => not_counted(d.run.id, e),
                }
            }
            (won, waited, announced)
        }
    };
    for d in &declines {
        let id = d.run.id;
        if out.contains_key(&id) {
            continue;
        }
        if !announced.contains(&id) {
            out.insert(id, Some(Ok(Ok(Retry::Lost))));
        } else if d.next.is_some() {
            let code = d.code.clone();
            out.insert(id, Some(Ok(Ok(Retry::Declined { code }))));
        } else {
            exhausted.push((d.run, d.code.clone()));
        }
    }
    for w in &waiting {
        if out.contains_key(&w.run.id) {
            continue;
        }
        let r = match waited.get(&w.run.id) {
            Some(&next_attempt_at) => Retry::Pending { next_attempt_at },
            None => Retry::Lost,
        };
        out.insert(w.run.id, Some(Ok(Ok(r))));
    }
    for n in rows {
        let id = n.run.id;
        if out.contains_key(&id) {
            continue;
        }
        if !won.contains(&id) {
            out.insert(id, Some(Ok(Ok(Retry::Lost))));
            continue;
        }
        // A spent run's exhaustion makes no attempt.
        if n.why != NotChargeable::RetriesSpent {
            t.counter(
                "hardcount_dunning_attempts_total",
                &[("outcome", "not_attempted")],
            )
            .increment(1);
        }
        match n.next {
            Some(_) => {
                out.insert(id, Some(Ok(Ok(Retry::NotAttempted { why: n.why }))));
            }
            None => exhausted.push((n.run, n.why.as_str().to_owned())),
        }
    }
    out.extend(final_action::all_exhausted(ctx, exhausted).await);
    runs.into_iter()
        .map(|run| {
            let outcome = out.remove(&run.id).unwrap_or(None);
            (run, outcome)
        })
        .collect()
}

/// Count `rows`, hold `waiting` and announce `declines` in one transaction:
/// the runs counted, the holds written and the declines announced.
async fn counted_in(
    ctx: &Ctx,
    rows: &[NotAttempted<'_>],
    waiting: &[Waiting<'_>],
    declines: &[Decline<'_>],
) -> Result<(HashSet<i64>, HashMap<i64, DateTime<Utc>>, HashSet<i64>), Error> {
    let c = &ctx.config;
    let mut tx = ctx.db.begin_with_timeout(c.statement_timeout).await?;
    let won = not_attempted_in(&mut tx, rows).await?;
    let waited = outcomes::wait_in(&mut tx, waiting, c.attempt_hold).await?;
    let announced = outcomes::decline_in(&mut tx, declines).await?;
    tx.commit().await?;
    Ok((won, waited, announced))
}

/// The decline of a run's last retry, answered `processing` and since
/// settled without paying (docs/adr/0085), as a decline at once would have
/// been written: the next retry from the policy (or, if the policy has none
/// left now, exhaustion) and the warning, over the run's count and the hold
/// it was listed with. The count does not move: the retry was counted when
/// it was answered.
fn owed_decline<'a>(ctx: &Ctx, run: &'a Run) -> Decline<'a> {
    let code = run
        .owed_code
        .clone()
        .unwrap_or_else(|| "declined".to_owned());
    // Announced now: the next retry no sooner than the policy's gap from now.
    let plan =
        run.policy
            .after_decline(run.first_declined_at, run.attempt_count, run.database_now());
    let listed = (run.attempt_count, run.next_attempt_at);
    Decline::planned(ctx, run, listed, code, plan)
}

/// A due retry that cannot be charged, as [`not_attempted_in`] counts it.
struct NotAttempted<'a> {
    pub run: &'a Run,
    pub why: NotChargeable,
    /// The next retry; `None`: this was the last, the run is exhausted.
    pub next: Option<DateTime<Utc>>,
    /// The warning, if the policy warns after this retry.
    pub email: Option<outbox::email::Email>,
}

impl NotAttempted<'_> {
    /// What the run's count advances by: a retry not attempted counts; a
    /// spent run is exhausted at the count its last retry left.
    fn step(&self) -> i32 {
        i32::from(self.why != NotChargeable::RetriesSpent)
    }
}

/// Count due retries that cannot be charged, one statement in the caller's
/// transaction: per run, by the attempt compare-and-set (the count as
/// listed), only while the invoice is open and the customer's payment method
/// is still the one listed (a method added since is charged instead): the
/// count advances and the next retry is scheduled, or the run is exhausted.
/// Then `dunning.retry_skipped` / `dunning.exhausted` and the warnings of the
/// runs that changed. No provider call, no `payment.failed`. Returns the runs
/// that changed (an exhausted one owes its final action).
async fn not_attempted_in(tx: &mut Tx, rows: &[NotAttempted<'_>]) -> Result<HashSet<i64>, Error> {
    if rows.is_empty() {
        return Ok(HashSet::new());
    }
    let mut rows: Vec<&NotAttempted<'_>> = rows.iter().collect();
    rows.sort_by_key(|n| n.run.id);
    let changed = tx
        .fetch_all(
            sql("UPDATE dunning_runs r \
                 SET attempt_count = r.attempt_count + u.step, \
                     next_attempt_at = COALESCE(u.next, now()), \
                     status = CASE WHEN u.next IS NULL THEN 'exhausted' ELSE 'active' END, \
                     ended_at = CASE WHEN u.next IS NULL THEN now() END, \
                     updated_at = now() \
                 FROM unnest($1::bigint[], $2::int4[], $3::timestamptz[], $4::text[], \
                             $5::int4[]) \
                      AS u(id, expected, next, payment_method, step), \
                      invoices i, subscriptions s, customers c \
                 WHERE r.id = u.id AND r.status = 'active' AND r.attempt_count = u.expected \
                   AND i.tenant_id = r.tenant_id AND i.id = r.invoice_id AND i.status = 'open' \
                   AND s.tenant_id = i.tenant_id AND s.id = i.subscription_id \
                   AND c.tenant_id = s.tenant_id AND c.id = s.customer_id \
                   AND (u.step = 0 \
                        OR c.payment_method_id IS NOT DISTINCT FROM u.payment_method) \
                 RETURNING r.id")
            .bind(rows.iter().map(|n| n.run.id).collect::<Vec<_>>())
            .bind(rows.iter().map(|n| n.run.attempt_count).collect::<Vec<_>>())
            .bind(rows.iter().map(|n| n.next).collect::<Vec<_>>())
            .bind(
                rows.iter()
                    .map(|n| n.run.payment_method.clone())
                    .collect::<Vec<_>>(),
            )
            .bind(rows.iter().map(|n| n.step()).collect::<Vec<_>>()),
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
                n.run.attempt_count + n.step(),
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
    let events: Vec<outbox::webhook::NewEvent<'_>> = payloads
        .iter()
        .map(|(t, e, p)| (*t, *e, p.as_str()))
        .collect();
    outbox::webhook::enqueue_many(tx, &events).await?;
    let emails: Vec<(&str, &outbox::email::Email)> = applied
        .iter()
        .filter_map(|n| n.email.as_ref().map(|e| (n.run.tenant_id.as_str(), e)))
        .collect();
    outbox::email::enqueue_many(tx, &emails).await?;
    Ok(won)
}
