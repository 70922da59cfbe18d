//! A dunning retry charge: one more attempt on an open automatic invoice whose
//! earlier attempts were declined, under the same guards as auto-charge.
//!
//! ```text
//!  lock the invoice         open, automatic, claim lease free or expired,
//!                           no attempt of unknown outcome, card saved, not paused
//!  INSERT attempt N         N = the invoice's last attempt + 1, key = (invoice, N),
//!                           under that row lock, with the card it will charge
//!  claim the invoice        only if its attempt was written: lease = now() +
//!                           charge_lease, claimed_by = the caller's, count + 1
//!  POST /v1/payment_intents with that Idempotency-Key
//!    succeeded ─▶ invoice paid (claim still ours) + invoice.paid, payment.succeeded, receipt
//!    declined  ─▶ attempt declined(code), claim released, payment.failed (the
//!                 customer's email is the dunning policy's, docs/adr/0114)
//!    unknown   ─▶ attempt stays unknown for the reconciler; no claim takes the
//!                 invoice again until the reconciler settles it
//! ```
//!
//! The claim is not fenced: the dunning role's funnel and its run
//! compare-and-set decide who retries; this lease only stops two workers
//! charging one invoice at once (docs/design.md §4.2 and §3.3).
//!
//! Dunning's tick retries a batch (docs/adr/0017; a single retry is a batch
//! of one) with [`Biller::start_retries_in`] (the claims and attempts,
//! set-based, in dunning's own transaction, so its attempt compare-and-set
//! commits with them) and [`Biller::finish_retries`] (the calls, concurrent,
//! and one settling transaction for the batch, `crate::batch`).

use std::collections::HashMap;
use std::time::Instant;

use db::{Row, sql};
use scheduler::Payload;

use crate::batch::{self, Answer, chargeable_invoice, insert_attempts};
use crate::batch::{ChargeClaim, Settled};
use crate::provider::ChargeOutcome;
use crate::{Biller, Error};

pub use payments::{NotCharged, Retried, RetryRequest, StartedRetry};

/// The first statement of [`start_retries_in`]; `pub` only for the plan
/// test (`tests/it/plans.rs`). It locks each wanted invoice that is
/// chargeable now and writes its next attempt (as `unknown`, key of instance
/// `$2`, under the (invoice, attempt) unique key); [`CLAIM_RETRIES`], in the
/// same transaction, then leases and counts exactly the invoices whose
/// attempt was written, in one new version of each (docs/adr/0055). Dunning
/// runs both in a `begin_index_driven` transaction.
///
/// Each wanted invoice is reached and locked, with its subscription and
/// customer, in a LATERAL subquery evaluated once per row of the batch
/// (docs/adr/0066), so the batch drives the loop and each invoice is read by
/// its key whatever the statistics say. Written as one join of the batch to
/// `invoices`, the planner could drive the loop from `invoices` and join the
/// batch by a filter: on tables never analyzed the chargeable conditions'
/// default selectivities made every open invoice look like one, and a batch
/// of 500 then read all of them for each of its rows (0.8 to 1.1 s at 10,000
/// invoices; before that, docs/adr/0055's binding of the status per row
/// (`was`) and [`WRITTEN_JOIN_ORDER`], both kept, had stopped the drive from
/// `invoices_open_automatic` and from a sequential scan). (One statement, as
/// auto-charge's, would join the inserted rows to the locked ones for each
/// row's holder: a nested loop of the batch against itself once hash joins
/// are off, 15 % fewer runs a second.)
pub const START_RETRIES: &str = concat!(
    "WITH picked AS ( \
       SELECT p.* FROM unnest($1::bigint[], $3::text[]) AS u(invoice_id, was) \
       CROSS JOIN LATERAL ( \
         SELECT i.id, i.tenant_id, i.created_at, i.amount, i.currency, \
                c.provider_customer_id, c.payment_method_id, \
                (SELECT COALESCE(max(a.attempt_seq), 0) + 1 FROM payment_attempts a \
                 WHERE a.invoice_id = i.id) AS seq \
         FROM invoices i \
         JOIN subscriptions s ON s.tenant_id = i.tenant_id AND s.id = i.subscription_id \
         JOIN customers c ON c.tenant_id = s.tenant_id AND c.id = s.customer_id \
         WHERE i.id = u.invoice_id AND ",
    chargeable_invoice!("u.was"),
    "\
           AND i.review_since IS NULL \
           AND NOT EXISTS (SELECT 1 FROM payment_attempts a \
                           WHERE a.invoice_id = i.id \
                             AND a.provider_status IN ('unknown', 'processing', 'needs_review')) \
         FOR UPDATE OF i SKIP LOCKED \
       ) p \
     ), started AS ( ",
    insert_attempts!(
        "$2",
        "p",
        "p.seq",
        "p.provider_customer_id",
        "p.payment_method_id"
    ),
    "FROM picked p \
       ON CONFLICT DO NOTHING \
       RETURNING id, invoice_id, attempt_seq, idempotency_key, provider_customer_id, \
                 payment_method_id \
     ) \
     SELECT id, invoice_id, attempt_seq, idempotency_key, provider_customer_id, \
            payment_method_id \
     FROM started"
);

/// Set before [`START_RETRIES`], for the transaction: the planner keeps the
/// joins inside its LATERAL subquery in the order written (each invoice by
/// key, then its subscription and customer). [`ANY_JOIN_ORDER`] undoes it
/// after. (It also turned sequential scans off until the LATERAL subquery
/// made that change no plan, docs/adr/0066.)
pub const WRITTEN_JOIN_ORDER: &str = "SELECT set_config('join_collapse_limit', '1', true)";

/// Set after [`START_RETRIES`]: the setting back at its reset value, which
/// is the one the transaction had (neither `begin_index_driven` nor the app
/// sets it).
pub const ANY_JOIN_ORDER: &str = "SELECT set_config(name, reset_val, true) FROM pg_settings \
     WHERE name = 'join_collapse_limit'";

/// The second statement of [`start_retries_in`]: the lease (`$3` seconds)
/// and `attempt_count` of each invoice `$1` whose attempt [`START_RETRIES`]
/// wrote, under its holder `$2`, reached by its key; the row lock
/// `START_RETRIES` took holds it meanwhile. `pub` only for the plan test.
pub const CLAIM_RETRIES: &str = "WITH claimed AS ( \
       UPDATE invoices i \
       SET auto_charge_claimed_until = now() + make_interval(secs => $3), \
           auto_charge_claimed_by = u.claimed_by, \
           attempt_count = i.attempt_count + 1 \
       FROM unnest($1::bigint[], $2::text[]) AS u(invoice_id, claimed_by) \
       WHERE i.id = u.invoice_id \
       RETURNING i.id, i.tenant_id, i.subscription_id, i.amount, i.currency, \
                 i.auto_charge_claimed_by, i.number \
     ) \
     SELECT k.id, k.tenant_id, k.subscription_id, k.amount, k.currency, \
            k.auto_charge_claimed_by, k.number, \
            (SELECT ts.email_from FROM tenant_settings ts \
             WHERE ts.tenant_id = k.tenant_id) AS tenant_from, \
            c.email, c.provider_customer_id, c.payment_method_id \
     FROM claimed k \
     JOIN subscriptions s ON s.tenant_id = k.tenant_id AND s.id = k.subscription_id \
     JOIN customers c ON c.tenant_id = s.tenant_id AND c.id = s.customer_id";

/// An attempt `START_RETRIES` wrote, as it wrote it.
struct Written {
    attempt_id: i64,
    attempt_seq: i32,
    key: String,
    customer: String,
    card: String,
}

/// The body of [`Biller::start_retries_in`].
pub(crate) async fn start_retries_in(
    biller: &Biller,
    tx: &mut db::Tx,
    wanted: &[RetryRequest],
) -> Result<Vec<Result<StartedRetry, NotCharged>>, Error> {
    if biller.inner.provider.is_none() {
        return Ok(wanted.iter().map(|_| Err(NotCharged::NoProvider)).collect());
    }
    if wanted.is_empty() {
        return Ok(Vec::new());
    }
    let c = &biller.inner.config;
    let ids: Vec<i64> = wanted.iter().map(|w| w.invoice_id).collect();
    // The locking loop in the written join order, from the batch to each
    // invoice by its key (docs/adr/0055); reset for the rest of the caller's
    // transaction.
    tx.fetch_all(sql(WRITTEN_JOIN_ORDER)).await?;
    let rows = tx
        .fetch_all(
            sql(START_RETRIES)
                .bind(ids.clone())
                .bind(c.instance_id.clone())
                .bind(vec![batch::OPEN; ids.len()]),
        )
        .await?;
    tx.fetch_all(sql(ANY_JOIN_ORDER)).await?;
    let mut written: HashMap<i64, Written> = HashMap::with_capacity(rows.len());
    for r in &rows {
        written.insert(
            r.try_get("invoice_id").map_err(db::Error::from)?,
            Written {
                attempt_id: r.try_get("id").map_err(db::Error::from)?,
                attempt_seq: r.try_get("attempt_seq").map_err(db::Error::from)?,
                key: r.try_get("idempotency_key").map_err(db::Error::from)?,
                customer: r.try_get("provider_customer_id").map_err(db::Error::from)?,
                card: r.try_get("payment_method_id").map_err(db::Error::from)?,
            },
        );
    }
    let (claim_ids, holders): (Vec<i64>, Vec<String>) = wanted
        .iter()
        .filter(|w| written.contains_key(&w.invoice_id))
        .map(|w| (w.invoice_id, w.claimed_by.clone()))
        .unzip();
    let rows = if claim_ids.is_empty() {
        Vec::new()
    } else {
        tx.fetch_all(
            sql(CLAIM_RETRIES)
                .bind(claim_ids)
                .bind(holders)
                .bind(c.charge_lease.as_secs_f64()),
        )
        .await?
    };
    let mut started: HashMap<i64, StartedRetry> = HashMap::with_capacity(rows.len());
    for r in &rows {
        let by: String = r
            .try_get("auto_charge_claimed_by")
            .map_err(db::Error::from)?;
        let mut claim = ChargeClaim::decode(r, by)?;
        let Some(w) = written.remove(&claim.invoice_id) else {
            continue;
        };
        // The call charges what the attempt recorded. `CLAIM_RETRIES` reads
        // the customer again with a later snapshot, and a card changed in
        // between must not be charged under an attempt that names the old one.
        claim.provider_customer = w.customer;
        claim.payment_method = w.card;
        started.insert(
            claim.invoice_id,
            StartedRetry {
                claim,
                attempt_id: w.attempt_id,
                attempt_seq: w.attempt_seq,
                key: w.key,
                first_send: true,
            },
        );
    }
    // Why the others were not claimed: the invoice closed, or held.
    let unclaimed: Vec<i64> = ids
        .iter()
        .copied()
        .filter(|id| !started.contains_key(id))
        .collect();
    let mut closed: HashMap<i64, String> = HashMap::new();
    if !unclaimed.is_empty() {
        let rows = tx
            .fetch_all(
                sql("SELECT id, status FROM invoices WHERE id = ANY($1) AND status <> 'open'")
                    .bind(unclaimed),
            )
            .await?;
        for r in &rows {
            closed.insert(
                r.try_get("id").map_err(db::Error::from)?,
                r.try_get("status").map_err(db::Error::from)?,
            );
        }
    }
    Ok(wanted
        .iter()
        .map(|w| match started.remove(&w.invoice_id) {
            Some(s) => Ok(s),
            None => Err(match closed.remove(&w.invoice_id) {
                Some(status) => NotCharged::InvoiceClosed { status },
                None => NotCharged::Held,
            }),
        })
        .collect())
}

/// The body of [`Biller::finish_retries`].
pub(crate) async fn finish_retries(
    biller: &Biller,
    started: Vec<StartedRetry>,
    calls: &tokio::sync::Semaphore,
    deadline: Instant,
    cancelled: impl Fn() -> bool + Copy,
    step: impl Fn(&StartedRetry) -> String + Copy,
) -> Vec<(StartedRetry, Result<Result<Retried, Error>, Payload>)> {
    let Some(provider) = &biller.inner.provider else {
        return started
            .into_iter()
            .map(|s| (s, Ok(Ok(Retried::NotCharged(NotCharged::NoProvider)))))
            .collect();
    };
    // A refused key stops the rest of this batch's calls (one refused call).
    let gate = batch::Gate::default();
    let called = batch::call_all(provider, started, calls, deadline, cancelled, step, &gate).await;
    let answered: Vec<(&StartedRetry, &Answer)> = called
        .iter()
        .filter_map(|(s, r)| r.as_ref().ok().map(|a| (s, a)))
        .collect();
    let mut settled = batch::settle_all(&biller.inner.db, &answered, biller.settling())
        .await
        .into_iter();
    called
        .into_iter()
        .map(|(s, r)| {
            let out = match r {
                Err(payload) => Err(payload),
                Ok(answer) => {
                    let settled = settled.next().unwrap_or_else(|| Ok(Settled::Lost));
                    // A refused key is this deployment's error, not the
                    // customer's: the row was rewound, and the caller's
                    // tick fails on it (counted and logged once here).
                    match answer {
                        Answer::Called(ChargeOutcome::KeyRejected { status, message }) => {
                            Ok(Err(biller.key_rejected(status, message)))
                        }
                        answer => Ok(settled.map(|w| retried(s.attempt_seq, answer, w))),
                    }
                }
            };
            (s, out)
        })
        .collect()
}

/// A settled answer as [`Retried`].
fn retried(attempt_seq: i32, answer: Answer, settled: Settled) -> Retried {
    match (answer, settled) {
        (Answer::Called(ChargeOutcome::Unknown { reason, .. }), Settled::Reviewed) => {
            Retried::Unknown {
                attempt_seq,
                reason: format!("{reason}; {}", batch::CLOSED_FOR_REVIEW),
                unanswered: true,
            }
        }
        (_, Settled::Reviewed) => Retried::Unknown {
            attempt_seq,
            reason: batch::CLOSED_FOR_REVIEW.to_owned(),
            unanswered: false,
        },
        (Answer::Called(ChargeOutcome::Succeeded { payment_intent }), Settled::Written) => {
            Retried::Paid {
                attempt_seq,
                payment_intent,
            }
        }
        (Answer::Called(ChargeOutcome::Succeeded { .. }), Settled::Lost) => Retried::Unknown {
            attempt_seq,
            reason: "charged, but the claim was lost before settling".to_owned(),
            unanswered: false,
        },
        (Answer::Called(ChargeOutcome::Declined { code, .. }), Settled::Written) => {
            Retried::Declined { attempt_seq, code }
        }
        (Answer::Called(ChargeOutcome::Declined { .. }), Settled::Lost) => Retried::Unknown {
            attempt_seq,
            reason: "declined, but the claim was lost before settling".to_owned(),
            unanswered: false,
        },
        (Answer::Called(ChargeOutcome::Processing { payment_intent }), Settled::Written) => {
            Retried::Processing {
                attempt_seq,
                payment_intent,
            }
        }
        (Answer::Called(ChargeOutcome::Processing { .. }), Settled::Lost) => Retried::Unknown {
            attempt_seq,
            reason: "processing, but the claim was lost before settling".to_owned(),
            unanswered: false,
        },
        (Answer::Called(ChargeOutcome::Unknown { reason, .. }), _) => Retried::Unknown {
            attempt_seq,
            reason,
            unanswered: true,
        },
        // Refused before execution for load: what an outage looks like to
        // dunning's rule, which then stops its tick for the cooldown instead
        // of sending the rest of its due runs into the limit (docs/adr/0092).
        (
            Answer::Called(ChargeOutcome::RetryLater {
                reason,
                in_flight: false,
                ..
            }),
            _,
        ) => Retried::Unknown {
            attempt_seq,
            reason,
            unanswered: true,
        },
        // Not a definite answer for dunning: the run is rewound, and no retry
        // of the invoice is claimed while its attempt waits for an operator.
        (Answer::Called(other), _) => Retried::Unknown {
            attempt_seq,
            reason: format!("{other:?}"),
            unanswered: false,
        },
        (Answer::NotSent, _) => Retried::Unknown {
            attempt_seq,
            reason: batch::NOT_SENT.to_owned(),
            unanswered: false,
        },
    }
}

/// Billing is dunning's collector (docs/adr/0029): the port's calls are the
/// methods above and [`Biller::cancel_now_in`], with billing's errors carried
/// as [`payments::Error`] (a refused key by name, so dunning fails its tick).
impl payments::Collector for Biller {
    fn has_provider(&self) -> bool {
        self.inner.provider.is_some()
    }

    fn call_timeout(&self) -> std::time::Duration {
        self.inner
            .config
            .provider
            .as_ref()
            .map(|p| p.timeout)
            .unwrap_or_default()
    }

    fn start_retries_in<'a>(
        &'a self,
        tx: &'a mut db::Tx,
        wanted: &'a [RetryRequest],
    ) -> futures::future::BoxFuture<
        'a,
        Result<Vec<Result<StartedRetry, NotCharged>>, payments::Error>,
    > {
        Box::pin(async move { self.start_retries_in(tx, wanted).await.map_err(port_error) })
    }

    fn finish_retries<'a>(
        &'a self,
        started: Vec<StartedRetry>,
        calls: &'a tokio::sync::Semaphore,
        deadline: Instant,
        cancelled: &'a (dyn Fn() -> bool + Sync),
        step: &'a (dyn Fn(&StartedRetry) -> String + Sync),
    ) -> futures::future::BoxFuture<'a, Vec<payments::Finished>> {
        Box::pin(async move {
            self.finish_retries(started, calls, deadline, cancelled, step)
                .await
                .into_iter()
                .map(|(s, r)| (s, r.map(|r| r.map_err(port_error))))
                .collect()
        })
    }

    fn cancel_now_in<'a>(
        &'a self,
        tx: &'a mut db::Tx,
        tenant_id: &'a str,
        subscription: i64,
    ) -> futures::future::BoxFuture<'a, Result<Option<payments::Canceled>, payments::Error>> {
        Box::pin(async move {
            self.cancel_now_in(tx, tenant_id, subscription)
                .await
                .map_err(port_error)
        })
    }
}

/// Billing's error as the collection port carries it.
fn port_error(e: Error) -> payments::Error {
    match e {
        Error::ProviderKeyRejected { status } => payments::Error::ProviderKeyRejected { status },
        other => payments::Error::Failed(Box::new(other)),
    }
}
