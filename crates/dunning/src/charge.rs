//! The charged path of a batch (docs/adr/0017): ONE transaction counts every
//! run's attempt by its compare-and-set ([`record_attempts_in`]), has billing
//! claim the invoices and record their attempts, and rewinds the runs that
//! panicked or found their invoice held; then billing's calls (concurrent)
//! and its one settling transaction; then ONE transaction for the outcomes
//! (recovered, declined or exhausted, rewound), and, when it fails, each
//! run's transition in its own transaction (a run whose own fails too is
//! left as its record wrote it, counted and held, for the listing to write
//! its outcome from its attempt: docs/adr/0120). Exhausted runs then take
//! their final action.

use std::collections::{HashMap, HashSet};
use std::time::{Duration, Instant};

use chrono::{DateTime, Utc};
use db::{Row, Tx, sql};
use leader::Role;
use payments::{NotCharged, Retried, RetryRequest, StartedRetry};
use tracing::{debug, warn};

use crate::Error;
use crate::ctx::Ctx;
use crate::final_action;
use crate::outcomes::{self, Decline, Waiting, stopped};
use crate::policy::AfterDecline;
use crate::run::{Outcome, Retry, Run};

/// The charged path of `Dunner::retry_runs` for active runs
/// whose invoice was listed open.
pub(crate) async fn charge_runs(
    ctx: &Ctx,
    runs: Vec<Run>,
    deadline: Instant,
    cancelled: impl Fn() -> bool + Copy + Sync,
) -> Vec<(Run, Outcome)> {
    let db = &ctx.db;
    let c = &ctx.config;
    let t = &ctx.telemetry;
    let collector = &*ctx.collector;
    let timeout = c.statement_timeout;
    let mut out: HashMap<i64, Outcome> = HashMap::with_capacity(runs.len());
    // Per run, under the guard: what a decline would do (pure; a corrupt
    // policy panics here, before anything of this run is charged).
    let mut planned: HashMap<i64, AfterDecline> = HashMap::new();
    let mut panicked: Vec<(i64, scheduler::Payload)> = Vec::new();
    // 1. One transaction: the attempt compare-and-set of every run, the
    //    plan under the guard, billing's claims and attempts, and the
    //    rewind of the runs that cannot be charged now.
    let first = async {
        // Index-driven (docs/adr/0023): every statement of it is keyed by
        // the batch (runs, invoices), and billing's retry claim then reaches
        // each invoice by its key (`billing::statements::START_RETRIES`).
        let mut tx = db.begin_index_driven(timeout).await?;
        let refs: Vec<&Run> = runs.iter().collect();
        let held = record_attempts_in(&mut tx, &refs, c.attempt_hold).await?;
        let mut wanted = Vec::new();
        for run in runs.iter().filter(|r| held.contains_key(&r.id)) {
            let attempt = run.attempt_count + 1;
            let step = format!("dunning/run {} (tenant {})", run.id, run.tenant_id);
            let plan = scheduler::catch(step, async {
                run.policy
                    .after_decline(run.first_declined_at, attempt, run.database_now())
            })
            .await;
            match plan {
                Ok(plan) => {
                    planned.insert(run.id, plan);
                    wanted.push((
                        run,
                        RetryRequest {
                            invoice_id: run.invoice_id,
                            claimed_by: claim_identity(run),
                        },
                    ));
                }
                Err(payload) => panicked.push((run.id, payload)),
            }
        }
        let requests: Vec<RetryRequest> = wanted.iter().map(|(_, w)| w.clone()).collect();
        let started = collector.start_retries_in(&mut tx, &requests).await?;
        let mut to_rewind: Vec<(&Run, DateTime<Utc>)> = Vec::new();
        let mut charged = Vec::new();
        let mut not_charged = Vec::new();
        for ((run, _), s) in wanted.into_iter().zip(started) {
            match s {
                Ok(s) => charged.push((run, s)),
                Err(why) => {
                    to_rewind.push((run, held[&run.id]));
                    not_charged.push((run, why));
                }
            }
        }
        // The runs whose planning panicked: rewound in this transaction.
        for (id, _) in &panicked {
            if let Some(run) = runs.iter().find(|r| r.id == *id) {
                to_rewind.push((run, held[&run.id]));
            }
        }
        outcomes::rewind_in(&mut tx, &to_rewind).await?;
        tx.commit().await?;
        Ok::<_, Error>((held, charged, not_charged))
    };
    let (held, charged, not_charged) = match first.await {
        Ok(x) => x,
        Err(e) => {
            // Rolled back: nothing of this batch was counted or claimed.
            warn!(role = %Role::Dunning, error = %e, runs = runs.len(), "batch not started; nothing counted");
            let why = e.to_string();
            let mut result: Vec<(Run, Outcome)> = Vec::with_capacity(runs.len());
            let mut panicked: HashMap<i64, scheduler::Payload> = panicked.into_iter().collect();
            for run in runs {
                let outcome = match panicked.remove(&run.id) {
                    Some(p) => Err(p),
                    None => Ok(Err(Error::BatchNotStarted(why.clone()))),
                };
                result.push((run, Some(outcome)));
            }
            return result;
        }
    };
    for run in runs.iter().filter(|r| !held.contains_key(&r.id)) {
        out.insert(run.id, Some(Ok(Ok(Retry::Lost))));
    }
    for (id, payload) in panicked {
        out.insert(id, Some(Err(payload)));
    }
    for (run, why) in not_charged {
        t.counter(
            "hardcount_dunning_attempts_total",
            &[("outcome", "not_charged")],
        )
        .increment(1);
        let result = match why {
            NotCharged::InvoiceClosed { status } => outcomes::stop(db, run, &status, timeout)
                .await
                .map(|applied| stopped(applied, &status)),
            why => Ok(Retry::Rewound {
                why: format!("{why:?}"),
                unanswered: false,
            }),
        };
        out.insert(run.id, Some(Ok(result)));
    }
    // 2. Billing's calls, concurrent, and its one settling transaction.
    let run_of: HashMap<i64, &Run> = charged
        .iter()
        .map(|(r, s)| (s.claim.invoice_id, *r))
        .collect();
    let started: Vec<StartedRetry> = charged.into_iter().map(|(_, s)| s).collect();
    let finished = collector
        .finish_retries(
            started,
            &ctx.calls,
            deadline,
            &cancelled,
            &|s: &StartedRetry| {
                format!(
                    "dunning/charge invoice {} (tenant {})",
                    s.claim.invoice_id, s.claim.tenant_id
                )
            },
        )
        .await;
    // 3. The outcomes: recoveries, declines (the next retry scheduled, or
    //    the run exhausted) and rewinds in one transaction.
    let mut recover: Vec<(&Run, i32)> = Vec::new();
    let mut rewind: Vec<(&Run, DateTime<Utc>, Outcome)> = Vec::new();
    let mut declined: Vec<(&Run, String)> = Vec::new();
    // Answered `processing` (docs/adr/0073): the attempt counts, and the run
    // waits for its next retry (or, after its last, a hold) while billing's
    // reconciler settles the attempt.
    let mut waiting: Vec<Waiting<'_>> = Vec::new();
    for (s, result) in finished {
        let Some(&run) = run_of.get(&s.claim.invoice_id) else {
            continue;
        };
        let hold = held[&run.id];
        let label = match &result {
            Ok(Ok(Retried::Paid { .. })) => "succeeded",
            Ok(Ok(Retried::Declined { .. })) => "declined",
            Ok(Ok(Retried::Processing { .. })) => "processing",
            Ok(Ok(Retried::Unknown { .. })) => "unknown",
            Ok(Ok(Retried::NotCharged(_))) => "not_charged",
            Ok(Err(_)) => "error",
            Err(_) => "panicked",
        };
        t.counter("hardcount_dunning_attempts_total", &[("outcome", label)])
            .increment(1);
        match result {
            Ok(Ok(Retried::Paid { .. })) => recover.push((run, run.attempt_count + 1)),
            Ok(Ok(Retried::Declined { code, .. })) => declined.push((run, code)),
            Ok(Ok(Retried::Processing { .. })) => waiting.push(Waiting {
                run,
                count: run.attempt_count + 1,
                was: hold,
                next: match planned.get(&run.id) {
                    Some(AfterDecline::Next { at }) => Some(*at),
                    _ => None,
                },
            }),
            Ok(Ok(Retried::Unknown {
                reason, unanswered, ..
            })) => {
                let r = Retry::Rewound {
                    why: reason,
                    unanswered,
                };
                rewind.push((run, hold, Some(Ok(Ok(r)))));
            }
            Ok(Ok(Retried::NotCharged(why))) => {
                let r = Retry::Rewound {
                    why: format!("{why:?}"),
                    unanswered: false,
                };
                rewind.push((run, hold, Some(Ok(Ok(r)))));
            }
            Ok(Err(e)) => rewind.push((run, hold, Some(Ok(Err(Error::Billing(e)))))),
            Err(payload) => rewind.push((run, hold, Some(Err(payload)))),
        }
    }
    // Per declined run, under the guard: the transition it takes (from the
    // plan made before the charge) and its warning; a panic here rewinds
    // that run with the others.
    let mut declines: Vec<Decline<'_>> = Vec::new();
    for (run, code) in declined {
        let attempt = run.attempt_count + 1;
        let plan = planned.get(&run.id).cloned();
        let step = format!("dunning/run {} (tenant {})", run.id, run.tenant_id);
        let prepared = scheduler::catch(step, async {
            let plan = plan.unwrap_or_else(|| {
                run.policy
                    .after_decline(run.first_declined_at, attempt, run.database_now())
            });
            Decline::planned(ctx, run, (attempt, held[&run.id]), code, plan)
        })
        .await;
        match prepared {
            Ok(decline) => declines.push(decline),
            Err(payload) => rewind.push((run, held[&run.id], Some(Err(payload)))),
        }
    }
    let pairs: Vec<(&Run, DateTime<Utc>)> = rewind.iter().map(|(r, h, _)| (*r, *h)).collect();
    let last = async {
        // Index-driven (docs/adr/0023, 0060): each statement joins the
        // batch to `dunning_runs` by key. Planned freely, with statistics
        // that had seen the runs, each read every active run into a hash.
        let mut tx = db.begin_index_driven(timeout).await?;
        let recovered = outcomes::recover_in(&mut tx, &recover).await?;
        let declined = outcomes::decline_in(&mut tx, &declines).await?;
        let rewound = outcomes::rewind_in(&mut tx, &pairs).await?;
        let waited = outcomes::wait_in(&mut tx, &waiting, c.attempt_hold).await?;
        tx.commit().await?;
        Ok::<_, Error>((recovered, declined, rewound, waited))
    };
    let (recovered, declined, rewound, waited) = match last.await {
        Ok(x) => x,
        Err(e) => {
            let batch = Transitions {
                recover: &recover,
                declines: &declines,
                rewind: &pairs,
                waiting: &waiting,
            };
            one_at_a_time(ctx, e, batch, &mut out).await
        }
    };
    for w in &waiting {
        let id = w.run.id;
        if out.contains_key(&id) {
            continue;
        }
        let r = match waited.get(&id) {
            Some(&next_attempt_at) => Retry::Pending { next_attempt_at },
            None => Retry::Lost,
        };
        out.insert(id, Some(Ok(Ok(r))));
    }
    for (run, _) in recover {
        if out.contains_key(&run.id) {
            continue;
        }
        let r = if recovered.contains(&run.id) {
            t.counter("hardcount_dunning_recoveries_total", &[])
                .increment(1);
            Retry::Recovered
        } else {
            Retry::Lost
        };
        out.insert(run.id, Some(Ok(Ok(r))));
    }
    for (run, _, outcome) in rewind {
        let outcome = match outcome {
            // A rewind that found the run moved: another worker's.
            Some(Ok(Ok(Retry::Rewound { .. }))) if !rewound.contains(&run.id) => {
                Some(Ok(Ok(Retry::Lost)))
            }
            other => other,
        };
        out.insert(run.id, outcome);
    }
    // The declines that applied; an exhausted run's final action is its
    // own transaction (stamped once; a crash before it is finished by the
    // next tick's funnel).
    let mut exhausted = Vec::new();
    for d in declines {
        let id = d.run.id;
        if out.contains_key(&id) {
            continue;
        }
        let outcome = match (declined.contains(&id), d.next) {
            (false, _) => Ok(Ok(Retry::Lost)),
            (true, Some(_)) => Ok(Ok(Retry::Declined { code: d.code })),
            (true, None) => {
                exhausted.push((d.run, d.code));
                continue;
            }
        };
        out.insert(id, Some(outcome));
    }
    out.extend(final_action::all_exhausted(ctx, exhausted).await);
    runs.into_iter()
        .map(|run| {
            let outcome = out.remove(&run.id).unwrap_or(None);
            (run, outcome)
        })
        .collect()
}

/// The transitions of a batch's outcomes, as its last transaction writes them.
struct Transitions<'b, 'r> {
    recover: &'b [(&'r Run, i32)],
    declines: &'b [Decline<'r>],
    rewind: &'b [(&'r Run, DateTime<Utc>)],
    waiting: &'b [Waiting<'r>],
}

/// The fallback when the outcomes' one transaction failed (`e`): each run's
/// transition in its own transaction. Returns the runs recovered, declined
/// (or exhausted), rewound and waiting; the error of a run whose own
/// transition failed goes in `out`.
async fn one_at_a_time(
    ctx: &Ctx,
    e: Error,
    batch: Transitions<'_, '_>,
    out: &mut HashMap<i64, Outcome>,
) -> (
    HashSet<i64>,
    HashSet<i64>,
    HashSet<i64>,
    HashMap<i64, DateTime<Utc>>,
) {
    let Transitions {
        recover,
        declines,
        rewind: pairs,
        waiting,
    } = batch;
    let (db, timeout) = (&ctx.db, ctx.config.statement_timeout);
    // One at a time, as before batching.
    debug!(role = %Role::Dunning, error = %e, "batched transitions failed; one run at a time");
    let mut failed: Vec<(&Run, Error)> = Vec::new();
    let mut declined = HashSet::new();
    for d in declines {
        let email = d.email.clone();
        let applied = match d.next {
            Some(at) => {
                let attempt = (d.attempt, d.held);
                outcomes::decline(db, d.run, attempt, (&d.code, at), email, timeout).await
            }
            None => outcomes::exhaust(db, d.run, d.attempt, &d.code, timeout).await,
        };
        match applied {
            Ok(true) => {
                declined.insert(d.run.id);
            }
            Ok(false) => {}
            Err(e) => failed.push((d.run, e)),
        }
    }
    let mut recovered = HashSet::new();
    for (run, attempt) in recover {
        match outcomes::recover(db, run, *attempt, timeout).await {
            Ok(true) => {
                recovered.insert(run.id);
            }
            Ok(false) => {}
            Err(e) => failed.push((run, e)),
        }
    }
    let mut waited = HashMap::new();
    for w in waiting {
        let one = async {
            let mut tx = db.begin_with_timeout(timeout).await?;
            let waits =
                outcomes::wait_in(&mut tx, std::slice::from_ref(w), ctx.config.attempt_hold)
                    .await?;
            tx.commit().await?;
            Ok::<_, Error>(waits)
        };
        match one.await {
            Ok(waits) => waited.extend(waits),
            Err(e) => failed.push((w.run, e)),
        }
    }
    // A run whose own transition failed too had an answer that billing
    // settled. It is left as its record wrote it: counted, held for
    // `attempt_hold`, owing its decline when a retry follows (docs/adr/0115),
    // as a crash leaves it. Once the hold has passed, the listing writes the
    // outcome from the attempt: a decline announced once with the policy's
    // next retry, a last retry exhausted, a paid invoice recovered, a
    // processing one waited on. Rewound, the run was charged again at once,
    // and its decline was never announced (docs/adr/0120).
    for (run, e) in failed {
        warn!(role = %Role::Dunning, run = run.id, tenant = %run.tenant_id, error = %e, "retry outcome not written; the run waits out its hold, then its outcome is read from its attempt");
        out.insert(run.id, Some(Ok(Err(e))));
    }
    let mut rewound = HashSet::new();
    for (run, hold) in pairs {
        if let Ok(true) = outcomes::rewind(db, run, *hold, timeout).await {
            rewound.insert(run.id);
        }
    }
    (recovered, declined, rewound, waited)
}

/// The attempt compare-and-set of a batch, one statement in the caller's transaction:
/// each run counted only if it still has the count it was listed with
/// (`attempt_count = $expected`, per row). Returns the runs counted, with the
/// hold each was given (which [`outcomes::rewind_in`] proves).
///
/// A retry with another planned after it is marked as owing its decline's
/// notices (`owed_notice_attempt`) from here, before billing is called: the
/// outcome that announces a decline clears the mark, a rewind takes it back.
/// A mark already at the run's count is kept: that retry's decline is still
/// owed (a run held by a pause of collection is charged, refused by billing
/// and rewound), and the rewind gives it back with the count.
/// A process that dies after billing settled the retry's decline and before
/// the outcome leaves the run counted and held; once the hold has passed, the
/// listing finds the decline unannounced and writes it as the outcome would
/// have (docs/adr/0115), where it used to charge the next retry at once. The
/// last retry is not marked: its decline exhausts the run, as a spent run's
/// listing does (docs/adr/0085).
pub(crate) async fn record_attempts_in(
    tx: &mut Tx,
    runs: &[&Run],
    hold: Duration,
) -> Result<HashMap<i64, DateTime<Utc>>, db::Error> {
    if runs.is_empty() {
        return Ok(HashMap::new());
    }
    // In id order, so two workers counting overlapping batches lock their
    // rows in one order rather than deadlocking (the statement locks them in
    // the batch's order).
    let mut runs = runs.to_vec();
    runs.sort_by_key(|r| r.id);
    let rows = tx
        .fetch_all(
            sql(outcomes::update_held_runs!(
                batch: "unnest($1::bigint[], $2::int4[], $4::bool[]) AS u(id, expected, owes)",
                check: "r.status = 'active' AND r.attempt_count = u.expected",
                set: "attempt_count = r.attempt_count + 1, \
                      next_attempt_at = now() + make_interval(secs => $3), \
                      owed_notice_attempt = CASE WHEN u.owes AND r.owed_notice_attempt \
                                                   IS DISTINCT FROM r.attempt_count \
                                                 THEN r.attempt_count + 1 \
                                                 ELSE r.owed_notice_attempt END, \
                      updated_at = now()",
                returning: "r.id, r.next_attempt_at",
            ))
            .bind(runs.iter().map(|r| r.id).collect::<Vec<_>>())
            .bind(runs.iter().map(|r| r.attempt_count).collect::<Vec<_>>())
            .bind(hold.as_secs_f64())
            .bind(
                runs.iter()
                    .map(|r| r.policy.has_retry_after(r.attempt_count + 1))
                    .collect::<Vec<_>>(),
            ),
        )
        .await?;
    let mut held = HashMap::with_capacity(rows.len());
    for r in &rows {
        held.insert(r.try_get("id")?, r.try_get("next_attempt_at")?);
    }
    Ok(held)
}

/// A claim identity no other claim shares: the run, its attempt, this process
/// and a per-process sequence.
fn claim_identity(run: &Run) -> String {
    use std::sync::atomic::{AtomicU64, Ordering};
    static CLAIMS: AtomicU64 = AtomicU64::new(0);
    let n = CLAIMS.fetch_add(1, Ordering::Relaxed);
    format!(
        "dunning:{}:{}:{}:{n}",
        run.id,
        run.attempt_count + 1,
        std::process::id()
    )
}
