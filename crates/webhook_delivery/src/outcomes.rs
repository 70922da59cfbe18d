//! Writing attempts' outcomes: each by compare-and-set on (delivery, attempt,
//! pending), buffered and written in groups, one statement per group; handing
//! back unsent claims (at once, or held until later); the outcome counter.

use std::collections::HashSet;
use std::future::Future;
use std::sync::Arc;
use std::time::Duration;

use tracing::{debug, warn};

use crate::delivery::Outcome;
use crate::shared::Shared;
use crate::store::{self, HoldRow, NewRow, NextState, OutcomeRow};
use leader::Role;

/// Write one outcome (a 410's, with its endpoint disabled in the same
/// transaction while it still has the URL that answered) by compare-and-set
/// on (`id`, `attempt`, pending); not counted.
pub(crate) async fn record(
    shared: &Shared,
    row: OutcomeRow,
    disable_endpoint: Option<store::Gone>,
) -> Outcome {
    let new = new_rows(shared, [&row]).1.pop();
    if row.id < 0 && new.is_none() {
        return forgotten(&row);
    }
    let written = store::record_outcome(
        &shared.db,
        &row,
        new.as_ref(),
        disable_endpoint,
        shared.config.statement_timeout,
    )
    .await;
    settle(shared, new.iter().map(|n| n.key), written.is_ok()).await;
    match written {
        Ok(applied) => applied_outcome(&row, false, applied),
        Err(e) => {
            warn!(
                role = %Role::WebhookDelivery, delivery = row.id, attempt = row.attempt, error = %e,
                "could not record a webhook attempt; the delivery comes due again when its claim lease ends"
            );
            Outcome::Unrecorded
        }
    }
}

/// Write a group of outcomes ([`store::record_outcomes`]): the deliveries in
/// the table with one statement, those handed over unwritten with another, a
/// transaction each, and count each. Returns each one's key and outcome: the
/// ones whose compare-and-set matched no row (or whose pair was written
/// already) are `Stale`; if a write fails, its rows are `Unrecorded` (the
/// table's come due again after their claim lease, the handed ones are
/// inserted by the fan-out after their handoff's lease).
pub(crate) async fn write_outcomes(shared: &Shared, group: Vec<Finished>) -> Written {
    let (rows, new) = new_rows(shared, group.iter().map(|f| &f.row));
    let timeout = shared.config.statement_timeout;
    // The deliveries in the table and those handed over unwritten
    // (docs/adr/0124) in a transaction each: each statement keeps its
    // endpoints' `failing_since` over its own rows, and no transaction locks
    // endpoints in two statements, which two groups could do in opposite
    // orders.
    let table = store::record_outcomes(&shared.db, &rows, &[], timeout).await;
    let handed = store::record_outcomes(&shared.db, &[], &new, timeout).await;
    settle(shared, new.iter().map(|n| n.key), handed.is_ok()).await;
    for (n, written) in [(rows.len(), &table), (new.len(), &handed)] {
        if let Err(e) = written {
            warn!(
                role = %Role::WebhookDelivery, outcomes = n, error = %e,
                "could not record webhook attempts; their deliveries come due again when their claim leases end"
            );
        }
    }
    let known: HashSet<i64> = new.iter().map(|n| n.key).collect();
    let outcomes: Vec<_> = group
        .iter()
        .map(|f| {
            let key = (f.row.id, f.row.attempt);
            let written = if f.row.id > 0 {
                &table
            } else if known.contains(&f.row.id) {
                &handed
            } else {
                return (key, forgotten(&f.row));
            };
            let outcome = match written {
                Ok(applied) => applied_outcome(&f.row, f.refused, applied.contains(&key)),
                Err(_) => Outcome::Unrecorded,
            };
            (key, outcome)
        })
        .collect();
    for (_, outcome) in &outcomes {
        count(shared, outcome);
    }
    outcomes
}

pub(crate) async fn release(shared: &Shared, id: i64, attempt: i32) -> Outcome {
    let statement_timeout = shared.config.statement_timeout;
    let new = unsent(shared, &[(id, attempt, Duration::ZERO, None)])
        .1
        .pop();
    if id < 0 && new.is_none() {
        return Outcome::Unrecorded;
    }
    let released =
        store::release_unsent(&shared.db, id, attempt, new.as_ref(), statement_timeout).await;
    settle(shared, new.iter().map(|n| n.key), released.is_ok()).await;
    match released {
        Ok(true) => {
            debug!(
                role = %Role::WebhookDelivery,
                delivery = id,
                attempt,
                "unsent webhook claim handed back"
            )
        }
        Ok(false) => {
            // A later claim has the delivery: nothing was handed back.
            debug!(
                role = %Role::WebhookDelivery,
                delivery = id,
                attempt,
                "unsent webhook claim already superseded"
            );
            return Outcome::Stale;
        }
        Err(e) => warn!(
            role = %Role::WebhookDelivery, delivery = id, attempt, error = %e,
            "could not hand back an unsent webhook claim; it comes due when its lease ends"
        ),
    }
    Outcome::Released
}

/// What one hand-back statement did: the claims held, and the claims a later
/// claim had superseded (left alone).
#[derive(Debug, Default, Clone, Copy, PartialEq, Eq)]
pub(crate) struct Holds {
    pub held: usize,
    pub stale: usize,
}

/// Hand back unsent claims to come due after their waits, in one statement
/// ([`store::hold_unsent`]); counts each held one `held`, and each claim a
/// later claim superseded meanwhile (left alone) `stale`. Returns both
/// counts, or `None` if the write failed: the claims then come due when
/// their claim leases end.
pub(crate) async fn hold(shared: &Shared, held: &[HoldRow]) -> Option<Holds> {
    let statement_timeout = shared.config.statement_timeout;
    let (rows, new) = unsent(shared, held);
    let written = store::hold_unsent(&shared.db, &rows, &new, statement_timeout).await;
    settle(shared, new.iter().map(|n| n.key), written.is_ok()).await;
    match written {
        Ok(n) => {
            let n = usize::try_from(n).unwrap_or(usize::MAX).min(held.len());
            for _ in 0..n {
                count(shared, &Outcome::Held);
            }
            for _ in n..held.len() {
                count(shared, &Outcome::Stale);
            }
            debug!(role = %Role::WebhookDelivery, held = n, "unsent webhook claims handed back for later");
            Some(Holds {
                held: n,
                stale: held.len() - n,
            })
        }
        Err(e) => {
            warn!(
                role = %Role::WebhookDelivery, claims = held.len(), error = %e,
                "could not hand back unsent webhook claims; they come due when their leases end"
            );
            None
        }
    }
}

pub(crate) fn count(shared: &Shared, outcome: &Outcome) {
    if let Some(label) = outcome.label() {
        shared
            .telemetry
            .counter("hardcount_webhook_deliveries_total", &[("outcome", label)])
            .increment(1);
    }
}

/// Outcomes written with one statement at most this many at a time. Each
/// statement costs Postgres a fixed part (its transaction, about 0.25 ms of
/// planning, the tenant check of the rows it inserts) whatever its size, so a
/// bigger group costs less per outcome; the linger below bounds how long an
/// outcome waits for it. At the benchmark's rate (about 18,000 deliveries/s)
/// groups of 256 filled before the linger; 512 took about 7 % off Postgres's
/// CPU per delivery (docs/adr/0126; docs/adr/0019 chose 256 at 160 a group).
pub(crate) const OUTCOME_GROUP: usize = 512;
/// A buffered outcome waits at most this long for others to join its group.
pub(crate) const OUTCOME_LINGER: Duration = Duration::from_millis(20);

/// Each outcome of a written group, by (id, attempt).
type Written = Vec<((i64, i32), Outcome)>;

/// What an attempt left to do.
pub(crate) enum Step {
    /// Nothing: handed back, or already written (a 410). Not yet counted.
    Done(Outcome),
    /// Its outcome is still to be written.
    Write(Finished),
}

/// A finished attempt whose outcome is not written yet.
pub(crate) struct Finished {
    pub row: OutcomeRow,
    /// Refused by the SSRF guard: counted as `refused` when written as a retry.
    pub refused: bool,
}

/// Outcomes waiting for their group's write. Dropped with outcomes still in
/// it (the tick was abandoned mid-batch), it hands them to a task of their
/// own, so they are written anyway; only if there is no runtime left are they
/// not written, and then their deliveries come due again after the claim
/// lease (at-least-once).
pub(crate) struct OutcomeBuffer {
    pub shared: Arc<Shared>,
    pub rows: Vec<Finished>,
    /// When the first buffered outcome has waited [`OUTCOME_LINGER`].
    pub flush_at: Option<tokio::time::Instant>,
}

impl OutcomeBuffer {
    pub fn push(&mut self, finished: Finished) {
        if self.rows.is_empty() {
            self.flush_at = Some(tokio::time::Instant::now() + OUTCOME_LINGER);
        }
        self.rows.push(finished);
    }

    /// Hand the buffered outcomes to a task that writes them; resolves to
    /// their number and their outcomes (already counted in the metrics).
    pub fn flush(
        &mut self,
    ) -> impl Future<Output = (usize, Result<Written, tokio::task::JoinError>)> + use<> {
        let group = std::mem::take(&mut self.rows);
        self.flush_at = None;
        let n = group.len();
        let shared = Arc::clone(&self.shared);
        let task = tokio::spawn(async move { write_outcomes(&shared, group).await });
        async move { (n, task.await) }
    }
}

impl Drop for OutcomeBuffer {
    fn drop(&mut self) {
        if self.rows.is_empty() {
            return;
        }
        let group = std::mem::take(&mut self.rows);
        match tokio::runtime::Handle::try_current() {
            Ok(runtime) => {
                let shared = Arc::clone(&self.shared);
                runtime.spawn(async move { write_outcomes(&shared, group).await });
            }
            Err(_) => warn!(
                role = %Role::WebhookDelivery,
                outcomes = group.len(),
                "webhook outcomes not written (no runtime); their deliveries come due again when their claim leases end"
            ),
        }
    }
}

/// `rows` split into the outcomes of deliveries in the table and the rows of
/// deliveries handed over unwritten (docs/adr/0124). A negative id this
/// process no longer knows (claimed long before, by a tick that was dropped)
/// is in neither: the fan-out inserts it pending after its handoff's lease.
fn new_rows<'a>(
    shared: &Shared,
    rows: impl IntoIterator<Item = &'a OutcomeRow>,
) -> (Vec<OutcomeRow>, Vec<NewRow>) {
    let mut table = Vec::new();
    let mut new = Vec::new();
    for row in rows {
        if row.id > 0 {
            table.push(row.clone());
        } else if let Some((pair, _)) = shared.unwritten.get(row.id) {
            new.push(NewRow::outcome(row, pair));
        }
    }
    (table, new)
}

/// `held` split as [`new_rows`] splits outcomes.
fn unsent(shared: &Shared, held: &[HoldRow]) -> (Vec<HoldRow>, Vec<NewRow>) {
    let mut table = Vec::new();
    let mut new = Vec::new();
    for h in held {
        if h.0 > 0 {
            table.push(*h);
        } else if let Some((pair, _)) = shared.unwritten.get(h.0) {
            new.push(NewRow::unsent(h.0, pair, h.2, h.3.map(|f| f.to_string())));
        }
    }
    (table, new)
}

/// After a write of unwritten deliveries' rows (`keys`): if it succeeded
/// (`ok`), each is in the table now, inserted or found written, and the
/// handoffs with nothing left to write are deleted; if it failed, they are
/// forgotten here and left to the fan-out.
async fn settle(shared: &Shared, keys: impl Iterator<Item = i64>, ok: bool) {
    if !ok {
        shared.unwritten.failed(keys);
        return;
    }
    let done = shared.unwritten.written(keys);
    let timeout = shared.config.statement_timeout;
    if let Err(e) = store::delete_handoffs(&shared.db, &done, timeout).await {
        warn!(
            role = %Role::WebhookDelivery, handoffs = done.len(), error = %e,
            "could not delete written handoffs; the fan-out finds their deliveries written after their lease"
        );
    }
}

/// A delivery handed over unwritten that this process no longer knows: not
/// written here (docs/adr/0124).
fn forgotten(row: &OutcomeRow) -> Outcome {
    warn!(
        role = %Role::WebhookDelivery,
        attempt = row.attempt,
        "webhook attempt of a handed-over delivery claimed too long ago to write; the fan-out inserts it pending after its handoff's lease"
    );
    Outcome::Unrecorded
}

/// The outcome of a written (`applied`) or stale attempt; logs a stale one.
fn applied_outcome(row: &OutcomeRow, refused: bool, applied: bool) -> Outcome {
    if !applied {
        warn!(
            role = %Role::WebhookDelivery,
            delivery = row.id,
            attempt = row.attempt,
            "stale webhook attempt: a later claim superseded it, so its result is not written"
        );
        return Outcome::Stale;
    }
    match row.next {
        NextState::Delivered => Outcome::Delivered,
        NextState::RetryAfter(_) if refused => Outcome::Refused,
        NextState::RetryAfter(_) => Outcome::Retry,
        NextState::Dead => Outcome::Dead,
    }
}
