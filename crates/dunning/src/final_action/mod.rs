//! The final action of an exhausted run, once: per run (its own
//! transaction) and for the runs a batch just exhausted (one transaction, a
//! per-run fallback). The step stamps the run first (`final_action_at`, only
//! if unset), then writes the write-off, the cancel (billing's) or the pause
//! ([`pause`]: the pause rules) by a conditional write; its events and the
//! final notice are queued only if it changed a row. A run whose invoice is
//! found paid, under the invoice's row lock, takes no step: it ends
//! `recovered` ([`recover_paid`], docs/adr/0147).

mod pause;

use std::collections::{HashMap, HashSet};
use std::time::Duration;

use db::{Db, Row, Tx, sql};
use leader::Role;
use tracing::{info, warn};

use crate::Error;
use crate::ctx::Ctx;
use crate::policy::FinalAction;
use crate::run::{FinalActed, Outcome, Retry, Run};

/// The write-off of [`final_action`] and [`final_actions`]: the invoices of
/// `$1` still open written off, unless a charge of theirs may be in flight
/// (billing's claim on the invoice unexpired, or an attempt sent and not
/// settled: unknown, processing or under review, a never-sent one aside). A
/// charge settles only an open invoice, and the reconciler looks only at
/// open invoices' attempts: written off under a charge in flight, a paid
/// answer was never recorded and its attempt stayed unknown for good
/// (docs/adr/0141). The claim is checked on the invoice's row, so an update
/// that waited for a claim being taken sees it. Returns each invoice of `$1`
/// that was open, and whether it was written off (those not were held).
const WRITE_OFF: &str = "WITH w AS ( \
       UPDATE invoices i SET status = 'uncollectible', closed_at = now() \
       WHERE i.id = ANY($1) AND i.status = 'open' \
         AND coalesce(i.auto_charge_claimed_until, '-infinity') <= now() \
         AND NOT EXISTS (SELECT 1 FROM payment_attempts a \
                         WHERE a.invoice_id = i.id \
                           AND a.provider_status IN ('unknown', 'processing', 'needs_review') \
                           AND (a.first_sent_at IS NOT NULL OR a.provider_status <> 'unknown')) \
       RETURNING i.id) \
     SELECT o.id, EXISTS (SELECT 1 FROM w WHERE w.id = o.id) AS written \
     FROM invoices o WHERE o.id = ANY($1) AND o.status = 'open'";

/// Each invoice of `invoices` that was open, and whether [`WRITE_OFF`] wrote
/// it off.
async fn write_off(tx: &mut db::Tx, invoices: Vec<i64>) -> Result<Vec<(i64, bool)>, Error> {
    let rows = tx.fetch_all(sql(WRITE_OFF).bind(invoices)).await?;
    rows.iter()
        .map(|r| Ok((r.try_get("id")?, r.try_get("written")?)))
        .collect::<Result<_, db::Error>>()
        .map_err(Error::from)
}

/// Final actions of a batch run at once, each its own transaction.
pub const FINAL_ACTIONS_AT_ONCE: usize = 8;

/// The final actions of runs just exhausted: all in one transaction
/// ([`final_actions`]); on an error or a panic, [`exhausted`] for each run,
/// [`FINAL_ACTIONS_AT_ONCE`] at a time (a group waits for its slowest): each
/// final action is its own short transaction on its own subscription's row
/// (two on one subscription wait on its lock).
pub(crate) async fn all_exhausted(ctx: &Ctx, runs: Vec<(&Run, String)>) -> Vec<(i64, Outcome)> {
    if runs.is_empty() {
        return Vec::new();
    }
    // First all in one transaction; on an error or a panic, each on its own.
    let (db, timeout) = (&ctx.db, ctx.config.statement_timeout);
    let step = format!("dunning/final actions of {} runs", runs.len());
    let batch = scheduler::catch(step, async {
        let items: Vec<(&Run, Option<outbox::email::Email>)> = runs
            .iter()
            .map(|(run, _)| (*run, ctx.final_notice(run)))
            .collect();
        final_actions(db, &*ctx.collector, &items, timeout).await
    })
    .await;
    match batch {
        Ok(Ok(acted)) => {
            return runs
                .into_iter()
                .zip(acted)
                .map(|((run, code), final_action)| {
                    count_exhaustion(ctx, run);
                    if final_action == FinalActed::Recovered {
                        count_recovery(ctx);
                    }
                    (
                        run.id,
                        Some(Ok(Ok(Retry::Exhausted { code, final_action }))),
                    )
                })
                .collect();
        }
        Ok(Err(e)) => {
            warn!(role = %Role::Dunning, error = %e, runs = runs.len(), "final actions of the batch not written together; each on its own")
        }
        Err(_) => {
            warn!(role = %Role::Dunning, runs = runs.len(), "final actions of the batch panicked together; each on its own")
        }
    }
    let mut done = Vec::with_capacity(runs.len());
    for chunk in runs.chunks(FINAL_ACTIONS_AT_ONCE) {
        let mut acting = Vec::with_capacity(chunk.len());
        for (run, code) in chunk {
            acting.push(exhausted(ctx, run, code.clone()));
        }
        let results = futures::future::join_all(acting).await;
        for ((run, _), r) in chunk.iter().zip(results) {
            done.push((run.id, Some(r)));
        }
    }
    done
}

/// A write-off held back by a charge of its invoice that may be in flight.
fn held(run: &Run) {
    info!(role = %Role::Dunning, run = run.id, invoice = run.invoice_id, "write-off waits: a charge of the invoice may be in flight (billing's claim, or an attempt not settled); the step is taken again by a later listing");
}

/// A run recovered in place of its final action, counted as every recovery.
pub(crate) fn count_recovery(ctx: &Ctx) {
    ctx.telemetry
        .counter("hardcount_dunning_recoveries_total", &[])
        .increment(1);
}

/// Of `runs`, stamped in `tx`, those whose invoice is paid: each ends
/// `recovered` (its stamp taken back, `ended_at` now) with
/// `dunning.recovered`, and takes no step. The invoices are locked next
/// (`FOR NO KEY UPDATE`, the lock a settle's update takes, so an insert
/// checking a foreign key to one is not held), after the runs (the order of
/// every dunning write), and read as locked: a
/// settle in flight is waited for and seen, and none can pay an invoice
/// while the step that follows runs. Before, a held write-off whose charge
/// settled paid was stamped with nothing to do, and the run stayed
/// `exhausted` beside its paid invoice (docs/adr/0147).
async fn recover_paid(tx: &mut Tx, runs: &[&Run]) -> Result<HashSet<i64>, Error> {
    if runs.is_empty() {
        return Ok(HashSet::new());
    }
    let mut invoices: Vec<i64> = runs.iter().map(|r| r.invoice_id).collect();
    invoices.sort_unstable();
    let mut paid = HashSet::new();
    for row in tx
        .fetch_all(
            sql("SELECT id, status FROM invoices WHERE id = ANY($1) ORDER BY id FOR NO KEY UPDATE")
                .bind(invoices),
        )
        .await?
    {
        let status: String = row.try_get("status").map_err(db::Error::from)?;
        if status == "paid" {
            paid.insert(row.try_get::<i64, _>("id").map_err(db::Error::from)?);
        }
    }
    let ending: Vec<i64> = runs
        .iter()
        .filter(|r| paid.contains(&r.invoice_id))
        .map(|r| r.id)
        .collect();
    if ending.is_empty() {
        return Ok(HashSet::new());
    }
    // The count as written: a run a batch just exhausted counted one more
    // retry than it was listed with.
    let mut recovered: HashMap<i64, i32> = HashMap::new();
    for row in tx
        .fetch_all(
            sql(
                "UPDATE dunning_runs SET status = 'recovered', final_action_at = NULL, \
                        ended_at = now(), updated_at = now() \
                 WHERE id = ANY($1) AND status = 'exhausted' RETURNING id, attempt_count",
            )
            .bind(ending),
        )
        .await?
    {
        recovered.insert(
            row.try_get("id").map_err(db::Error::from)?,
            row.try_get("attempt_count").map_err(db::Error::from)?,
        );
    }
    let events: Vec<(String, String)> = runs
        .iter()
        .filter_map(|r| recovered.get(&r.id).map(|n| (*r, *n)))
        .map(|(r, attempts)| {
            let extra = serde_json::json!({"invoice_status": "paid", "settled_elsewhere": true});
            let payload = crate::outcomes::payload(r, "recovered", attempts, extra);
            (r.tenant_id.clone(), payload)
        })
        .collect();
    let refs: Vec<outbox::webhook::NewEvent<'_>> = events
        .iter()
        .map(|(t, p)| (t.as_str(), "dunning.recovered", p.as_str()))
        .collect();
    outbox::webhook::enqueue_many(tx, &refs).await?;
    Ok(recovered.into_keys().collect())
}

fn count_exhaustion(ctx: &Ctx, run: &Run) {
    let action = run.policy.final_action.as_str();
    ctx.telemetry
        .counter(
            "hardcount_dunning_exhaustions_total",
            &[("final_action", action)],
        )
        .increment(1);
}

/// A run just exhausted: counted, and its final action's step run under
/// the guard (stamped once; a crash before it is finished by the next
/// tick's funnel).
async fn exhausted(
    ctx: &Ctx,
    run: &Run,
    code: String,
) -> Result<Result<Retry, Error>, scheduler::Payload> {
    count_exhaustion(ctx, run);
    let step = format!("dunning/run {} (tenant {})", run.id, run.tenant_id);
    let (db, timeout) = (&ctx.db, ctx.config.statement_timeout);
    scheduler::catch(step, async {
        let notice = ctx.final_notice(run);
        let final_action = final_action(db, &*ctx.collector, run, notice, timeout).await?;
        if final_action == FinalActed::Recovered {
            count_recovery(ctx);
        }
        Ok(Retry::Exhausted { code, final_action })
    })
    .await
}

/// The final-action step of an exhausted run, one transaction: first the
/// run's stamp (`final_action_at`, only if unset: one step per run), then the
/// action itself by a conditional write; its events and `notice` (the final
/// notice, if the policy sends one) are queued only if it changed a row.
pub(crate) async fn final_action(
    db: &Db,
    collector: &dyn payments::Collector,
    run: &Run,
    notice: Option<outbox::email::Email>,
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
    if !recover_paid(&mut tx, &[run]).await?.is_empty() {
        tx.commit().await?;
        return Ok(FinalActed::Recovered);
    }
    // Billing's cancel writes its own events.
    let mut changed = false;
    let events = match run.policy.final_action {
        FinalAction::PauseCollection => match pause::pause(&mut tx, run).await? {
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
                && collector
                    .cancel_now_in(&mut tx, &run.tenant_id, run.subscription_id)
                    .await?
                    .is_some()
            {
                changed = true;
            }
            Vec::new()
        }
        FinalAction::MarkUncollectible => {
            let open = write_off(&mut tx, vec![run.invoice_id]).await?;
            if open.iter().any(|(_, written)| !written) {
                // Not stamped: a later listing takes the step again.
                tx.rollback().await?;
                held(run);
                return Ok(FinalActed::Held);
            }
            let event = serde_json::json!({"object": "invoice", "id": run.invoice_id,
                                           "subscription": run.subscription_id,
                                           "status": "uncollectible", "dunning_run": run.id});
            if open.is_empty() {
                Vec::new()
            } else {
                vec![("invoice.marked_uncollectible", event)]
            }
        }
    };
    let acted = if events.is_empty() && !changed {
        FinalActed::NothingToDo
    } else {
        for (event_type, object) in &events {
            outbox::webhook::enqueue(&mut tx, &run.tenant_id, event_type, &object.to_string())
                .await?;
        }
        if let Some(notice) = notice {
            outbox::email::enqueue(&mut tx, &run.tenant_id, &notice).await?;
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
async fn final_actions(
    db: &Db,
    collector: &dyn payments::Collector,
    runs: &[(&Run, Option<outbox::email::Email>)],
    statement_timeout: Duration,
) -> Result<Vec<FinalActed>, Error> {
    // Index-driven (docs/adr/0060): the batch's runs, invoices and
    // subscriptions by key, whatever the statistics say.
    let mut tx = db.begin_index_driven(statement_timeout).await?;
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
    let acting: Vec<&Run> = runs
        .iter()
        .map(|(r, _)| *r)
        .filter(|r| stamped.contains(&r.id))
        .collect();
    let recovered = recover_paid(&mut tx, &acting).await?;
    let mut changed: HashMap<i64, Vec<(&'static str, serde_json::Value)>> = HashMap::new();
    let of = |action: FinalAction| -> Vec<&Run> {
        acting
            .iter()
            .copied()
            .filter(|r| !recovered.contains(&r.id) && r.policy.final_action == action)
            .collect()
    };
    // Write-offs.
    let writes_off = of(FinalAction::MarkUncollectible);
    let mut waiting: HashSet<i64> = HashSet::new();
    if !writes_off.is_empty() {
        let open = write_off(&mut tx, writes_off.iter().map(|r| r.invoice_id).collect()).await?;
        for &(invoice, written) in &open {
            if !written {
                for r in writes_off.iter().filter(|r| r.invoice_id == invoice) {
                    held(r);
                    waiting.insert(r.id);
                }
                continue;
            }
            for r in writes_off.iter().filter(|r| r.invoice_id == invoice) {
                let event = serde_json::json!({"object": "invoice", "id": invoice,
                                               "subscription": r.subscription_id,
                                               "status": "uncollectible", "dunning_run": r.id});
                changed.insert(r.id, vec![("invoice.marked_uncollectible", event)]);
            }
        }
    }
    // Pauses.
    for (run, events) in pause::pauses(&mut tx, &of(FinalAction::PauseCollection)).await? {
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
            && collector
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
    let refs: Vec<outbox::webhook::NewEvent<'_>> = events
        .iter()
        .map(|(t, k, p)| (t.as_str(), *k, p.as_str()))
        .collect();
    outbox::webhook::enqueue_many(&mut tx, &refs).await?;
    let notices: Vec<(&str, &outbox::email::Email)> = runs
        .iter()
        .filter(|(r, _)| changed.contains_key(&r.id))
        .filter_map(|(r, n)| n.as_ref().map(|n| (r.tenant_id.as_str(), n)))
        .collect();
    outbox::email::enqueue_many(&mut tx, &notices).await?;
    if !waiting.is_empty() {
        // Their stamps taken back: a later listing takes their step again.
        tx.execute(
            sql("UPDATE dunning_runs SET final_action_at = NULL WHERE id = ANY($1)")
                .bind(waiting.iter().copied().collect::<Vec<_>>()),
        )
        .await?;
    }
    tx.commit().await?;
    Ok(runs
        .iter()
        .map(|(r, _)| {
            if !stamped.contains(&r.id) {
                FinalActed::Lost
            } else if recovered.contains(&r.id) {
                FinalActed::Recovered
            } else if waiting.contains(&r.id) {
                FinalActed::Held
            } else if changed.contains_key(&r.id) {
                FinalActed::Written
            } else {
                FinalActed::NothingToDo
            }
        })
        .collect())
}
