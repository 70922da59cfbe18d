//! The set-based charge primitives auto-charge and dunning's retries share
//! (docs/adr/0017): a batch's attempts recorded before its calls (by each
//! claim's own statements since docs/adr/0055; `START_ATTEMPTS` here is the
//! single charge's), the provider calls made concurrently, and every answer
//! of the batch settled in one transaction. Each row's write keeps its own condition (the claim still
//! ours and unexpired, the attempt still unknown), so a row whose condition
//! fails writes nothing while the others are written.
//!
//! ```text
//!  (the claim)                lock, INSERT attempts, lease and count the invoices
//!                             whose attempt was written        charge/store.rs, retry.rs
//!  calls                      POST /v1/payment_intents, charge_concurrency at once,
//!                             each under the panic guard
//!  settle (one transaction)   paid:     invoice open → paid + attempt → succeeded
//!                             declined: claim released + attempt → declined(code)
//!                             unknown:  attempt keeps unknown with its reason
//!                             then every event (enqueue_many) and every email
//!                             (outbox::email::enqueue_many) of the rows that won
//! ```
//!
//! A settle transaction that fails (a refused event or email, a database
//! error) rolls back whole and its rows are settled again one at a time by
//! the per-row functions of `store`, so one bad row costs that row only.

pub(crate) mod messages;
pub(crate) mod settle;

pub(crate) use settle::{Settling, settle_all};

use std::collections::HashMap;
use std::sync::atomic::{AtomicBool, Ordering};
use std::time::Instant;

use db::{Row, Tx, sql};
use futures::stream::{self, StreamExt};
use scheduler::{Payload, catch};
use tokio::sync::Semaphore;

pub use payments::{ChargeClaim, NOT_SENT, Started};

use crate::Error;
use crate::provider::{ChargeOutcome, PaymentRequest, Provider};

/// The chargeable-invoice predicate, over `invoices i` joined to its
/// `subscriptions s` and `customers c`: open, automatic, its claim lease free
/// or expired, collection not paused, a saved payment method. Auto-charge's
/// claim and dunning's retry claim both select by it (each adds which
/// attempts it tolerates), so the rule is written once and cannot drift. A
/// string literal for `concat!`, ending in a space. With an argument, the
/// status `open` is compared to that SQL expression instead of the literal:
/// a statement that reaches its batch by key binds it per row, so no partial
/// index of open invoices matches its predicate and drives the loop
/// (docs/adr/0049).
macro_rules! chargeable_invoice {
    () => {
        chargeable_invoice!("'open'")
    };
    ($open:literal) => {
        concat!(
            "i.status = ",
            $open,
            " AND i.collection_method = 'automatic' \
             AND (i.auto_charge_claimed_until IS NULL OR i.auto_charge_claimed_until <= now()) \
             AND s.pause_collection_behavior IS NULL \
             AND c.payment_method_id IS NOT NULL "
        )
    };
}
pub(crate) use chargeable_invoice;

/// An attempt's Idempotency-Key in SQL, as `provider::idempotency_key`
/// computes it (a charge test pins that the two agree): `$inst` the
/// deployment's instance (a text parameter), `$inv` the invoice's alias (its
/// `id` and `created_at`), `$seq` the attempt sequence.
macro_rules! attempt_key {
    ($inst:literal, $inv:literal, $seq:literal) => {
        concat!(
            "'hc:' || ",
            $inst,
            "::text || ':invoice:' || ",
            $inv,
            ".id || ':' \
             || (extract(epoch FROM ",
            $inv,
            ".created_at) * 1000000)::bigint \
             || ':attempt:' || ",
            $seq
        )
    };
}
pub(crate) use attempt_key;

/// The head of every statement that writes attempts, up to its `FROM`: the
/// columns of an attempt row and, from `$inv` (the invoice's alias, its
/// `tenant_id`, `id`, `amount`, `currency`, `created_at`), `$seq`, `$customer`
/// and `$card` (SQL expressions), each row's values, its key built by
/// [`attempt_key!`] for instance `$inst`. A string literal for `concat!`,
/// ending in a space.
macro_rules! insert_attempts {
    ($inst:literal, $inv:literal, $seq:literal, $customer:literal, $card:literal) => {
        concat!(
            "INSERT INTO payment_attempts (tenant_id, invoice_id, attempt_seq, \
                                           idempotency_key, amount, currency, \
                                           provider_customer_id, payment_method_id) \
             SELECT ",
            $inv,
            ".tenant_id, ",
            $inv,
            ".id, ",
            $seq,
            ", ",
            $crate::batch::attempt_key!($inst, $inv, $seq),
            ", ",
            $inv,
            ".amount, ",
            $inv,
            ".currency, ",
            $customer,
            ", ",
            $card,
            " "
        )
    };
}
pub(crate) use insert_attempts;

/// Why an answer reported [`Settled::Reviewed`] was not settled.
pub(crate) const CLOSED_FOR_REVIEW: &str =
    "its invoice was closed while the charge was in flight: the attempt needs an operator's review";

/// How a charge's answer was written.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Settled {
    Written,
    /// The claim no longer holds the invoice, or the attempt was settled by
    /// someone else: nothing written (the reconciler settles the attempt).
    Lost,
    /// The answer says the charge was or may have been made, but its invoice
    /// was closed meanwhile: the attempt and the invoice are flagged for an
    /// operator's review, nothing else is written (docs/adr/0142).
    Reviewed,
}

/// What the provider said to one started attempt.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Answer {
    /// The call was made; its outcome.
    Called(ChargeOutcome),
    /// The call was not made (the tick's budget ended, or it was cancelled):
    /// the attempt stays unknown, its claim is given back, and the reconciler
    /// sends it by its key, as after a crash between the attempt and the call.
    NotSent,
}

/// The status a charge path's compare-and-set expects its invoice in. It is
/// bound as one more column of the unnested batch (`was`), not written as a
/// literal, so that it is a join condition and not a filter of `invoices`:
/// with the literal, a never-analyzed table was estimated to hold a handful
/// of open invoices and was scanned whole against the batch (docs/adr/0049,
/// as `webhook_delivery`'s outcome statement does, docs/adr/0023).
pub(crate) const OPEN: &str = "open";

/// The statement of [`start_attempts_in`], the single charge's attempt
/// ([`crate::Biller::charge`]; a batch claim writes its attempts itself,
/// docs/adr/0055); `pub` only for the plan test
/// (`tests/it/plans.rs`). Its plan test runs it in a `begin_index_driven`
/// transaction, as the batch path did before docs/adr/0055 (the single path
/// runs it in a plain one, for one invoice); there it
/// reaches each invoice of the batch by its primary key; planned freely it
/// read the claims index whole (every invoice the tick had claimed) for each
/// batch (issue 29, point 3). It raises each attempted invoice's
/// `attempt_count` in the same statement: the charge claim's index holds only
/// invoices never attempted (docs/adr/0050). The claim's expiry is compared
/// through `coalesce`, as in the settle, so no partial index drives the loop
/// on statistics gathered while nothing was claimed (docs/adr/0053).
pub const START_ATTEMPTS: &str = concat!(
    "WITH started AS ( ",
    insert_attempts!("$3", "i", "u.seq", "u.customer", "u.card"),
    "FROM unnest($1::bigint[], $2::int4[], $4::text[], $5::text[], $6::text[], $7::text[]) \
          AS u(invoice_id, seq, claimed_by, customer, card, was) \
     JOIN invoices i ON i.id = u.invoice_id \
     WHERE i.status = u.was \
       AND i.auto_charge_claimed_by = u.claimed_by \
       AND coalesce(i.auto_charge_claimed_until, '-infinity') > now() \
     ON CONFLICT DO NOTHING \
     RETURNING id, invoice_id, idempotency_key \
     ), counted AS ( \
       UPDATE invoices i SET attempt_count = i.attempt_count + 1 \
       FROM started WHERE i.id = started.invoice_id \
     ) \
     SELECT id, invoice_id, idempotency_key FROM started"
);

/// Record `attempts` (claim, attempt sequence) as `unknown`, before their
/// calls, with one statement in the caller's transaction: each only while
/// its own claim still holds the invoice, under the (invoice, attempt) unique
/// key. Returns the attempts written; a row left out wrote nothing and must
/// not be called.
pub(crate) async fn start_attempts_in(
    tx: &mut Tx,
    attempts: &[(ChargeClaim, i32)],
    instance: &str,
) -> Result<Vec<Started>, db::Error> {
    if attempts.is_empty() {
        return Ok(Vec::new());
    }
    let col = |f: fn(&ChargeClaim, i32) -> String| {
        attempts.iter().map(|(c, s)| f(c, *s)).collect::<Vec<_>>()
    };
    let rows = tx
        .fetch_all(
            sql(START_ATTEMPTS)
                .bind(
                    attempts
                        .iter()
                        .map(|(c, _)| c.invoice_id)
                        .collect::<Vec<_>>(),
                )
                .bind(attempts.iter().map(|(_, s)| *s).collect::<Vec<_>>())
                .bind(instance.to_owned())
                .bind(col(|c, _| c.claimed_by.clone()))
                .bind(col(|c, _| c.provider_customer.clone()))
                .bind(col(|c, _| c.payment_method.clone()))
                .bind(vec![OPEN; attempts.len()]),
        )
        .await?;
    let mut written = HashMap::with_capacity(rows.len());
    for r in &rows {
        written.insert(
            r.try_get::<i64, _>("invoice_id")?,
            (
                r.try_get::<i64, _>("id")?,
                r.try_get::<String, _>("idempotency_key")?,
            ),
        );
    }
    Ok(attempts
        .iter()
        .filter_map(|(c, seq)| {
            written
                .remove(&c.invoice_id)
                .map(|(attempt_id, key)| Started {
                    claim: c.clone(),
                    attempt_id,
                    attempt_seq: *seq,
                    key,
                    first_send: true,
                })
        })
        .collect())
}

/// Whether the provider refused this deployment's key (401/403) during the
/// tick: then no further call is made until the next tick (one refused call,
/// not one per invoice).
#[derive(Debug, Default)]
pub(crate) struct Gate(AtomicBool);

impl Gate {
    pub(crate) fn closed(&self) -> bool {
        self.0.load(Ordering::Relaxed)
    }

    pub(crate) fn close(&self) {
        self.0.store(true, Ordering::Relaxed);
    }
}

/// Call the provider for every started attempt, each holding one of
/// `calls`' permits (the bound on calls at once, shared by the caller's
/// batches in flight, docs/adr/0054), each under the panic guard (`step`
/// names it). The batch's first call goes
/// alone: a refused key (401/403) closes `gate` and no other call is made. A
/// call that would start after `deadline`, once `cancelled` says so, or once
/// the gate is closed, is not made ([`Answer::NotSent`]). A panic is that
/// row's only: its attempt stays unknown and its claim lease expires, for
/// the reconciler.
pub(crate) async fn call_all(
    provider: &Provider,
    started: Vec<Started>,
    calls: &Semaphore,
    deadline: Instant,
    cancelled: impl Fn() -> bool + Copy,
    step: impl Fn(&Started) -> String + Copy,
    gate: &Gate,
) -> Vec<(Started, Result<Answer, Payload>)> {
    let call = provider.config().timeout;
    let one = |s: Started| async move {
        let answer = catch(step(&s), async {
            // Never closed: a permit, or none if it ever were.
            let _permit = calls.acquire().await.ok();
            if Instant::now() + call > deadline || cancelled() || gate.closed() {
                return Answer::NotSent;
            }
            let outcome = provider.create_payment_intent(&request(&s)).await;
            if matches!(outcome, ChargeOutcome::KeyRejected { .. }) {
                gate.close();
            }
            Answer::Called(outcome)
        })
        .await;
        (s, answer)
    };
    let mut started = started.into_iter();
    let Some(first) = started.next() else {
        return Vec::new();
    };
    let mut out = vec![one(first).await];
    out.extend(
        stream::iter(started)
            .map(one)
            // The permits bound the calls; the rest wait for one.
            .buffer_unordered(usize::MAX)
            .collect::<Vec<_>>()
            .await,
    );
    out
}

/// What a batch's answers say of the provider as a whole: it refused this
/// deployment's key, or it is down (every call of the batch found it down
/// now; a replayed stored answer does not count).
#[derive(Debug, Default)]
pub(crate) struct ProviderHealth {
    calls: usize,
    outages: usize,
    last_outage: String,
    rejected: Option<(u16, String)>,
}

impl ProviderHealth {
    pub(crate) fn saw(&mut self, outcome: &ChargeOutcome) {
        self.calls += 1;
        if outcome.is_outage() {
            self.outages += 1;
            self.last_outage = format!("{outcome:?}");
        }
        if let ChargeOutcome::KeyRejected { status, message } = outcome {
            self.rejected = Some((*status, message.clone()));
        }
    }

    /// The batch's error, if the provider refused the key or is down.
    pub(crate) fn verdict(self, biller: &crate::Biller) -> Result<(), Error> {
        if let Some((status, message)) = self.rejected {
            return Err(biller.key_rejected(status, message));
        }
        if self.calls > 0 && self.outages == self.calls {
            return Err(Error::ProviderOutage {
                calls: self.calls,
                last: self.last_outage,
            });
        }
        Ok(())
    }
}

/// The request `started` sends (and a resend repeats exactly).
pub(crate) fn request(started: &Started) -> PaymentRequest {
    let c = &started.claim;
    PaymentRequest {
        invoice_id: c.invoice_id,
        amount: c.amount,
        currency: c.currency.clone(),
        customer: c.provider_customer.clone(),
        payment_method: c.payment_method.clone(),
        key: started.key.clone(),
    }
}
