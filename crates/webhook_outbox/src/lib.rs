//! The webhook outbox: events written next to the change that caused them, and
//! the `webhook_outbox` role that fans each one out into deliveries.
//!
//! ```text
//!  producer's transaction                 webhook_outbox tick (leader only)
//!  ─────────────────────                  ─────────────────────────────────
//!  UPDATE invoices …                      BEGIN, then one statement:
//!  enqueue(tx, tenant, type, json) ──┐      claim ≤ batch undispatched events      (fenced,
//!    (+ pg_notify, sent at commit)   │        FOR UPDATE SKIP LOCKED, mark them    SKIP LOCKED)
//!  COMMIT                            │      insert one delivery per enabled endpoint
//!                                    └──▶     of the same tenant subscribed to the type
//!                    webhook_events          ON CONFLICT (event_id, endpoint_id) DO NOTHING
//!                                           pg_notify(webhook_delivery) if any inserted
//!                                         COMMIT                  ──▶ webhook_deliveries
//! ```
//!
//! Guarantees:
//!
//! - **An event exists iff its producer committed.** [`enqueue`] (and
//!   [`enqueue_many`], many events with one statement) runs inside the
//!   caller's [`db::Tx`]; a rollback leaves no event, and a payload that is not
//!   JSON, or is over [`MAX_PAYLOAD_BYTES`], is refused before anything is written
//!   (a CHECK constraint backs the size limit).
//! - **Each event is fanned out once per subscribed endpoint.** Claim, fan-out
//!   and the `dispatched_at` stamp are one transaction, so a crash leaves the
//!   batch undispatched and it is claimed again whole. A replayed batch (an
//!   operator clearing `dispatched_at`, or a stale leader whose transaction
//!   committed late) adds nothing: `UNIQUE (event_id, endpoint_id)` absorbs it.
//!   Duplicates to receivers come only from the delivery side (see
//!   `webhook_delivery`), never from here.
//! - **A replaced leader claims nothing.** The claim carries
//!   `AND leader_fence($role, $token)` in its innermost WHERE, and
//!   [`Dispatcher::dispatch_batch`] takes a [`leader::Fence`], which only a won
//!   lease can build.
//!
//! - **A tick's end decides its release.** The tick is the fenced-batch driver
//!   ([`scheduler::drive`]): a claim that finds nothing ends it drained (due
//!   after the interval, or at once if the tick found work), the budget with
//!   events left ends it with more work (due again at once), a failed batch
//!   (rolled back) ends it failed (due after the short failure cooldown).
//! - **Woken, not only polled** (docs/adr/0014). [`enqueue`] also sends
//!   `pg_notify` on the role's channel ([`scheduler::wake_channel`]) in the
//!   producer's transaction, and the fan-out notifies `webhook_delivery` when
//!   it inserted deliveries. A [`Dispatcher`] given a listening
//!   [`scheduler::Wake`] ([`Dispatcher::with_wake`]) keeps its tick open
//!   between notifications; without one, a tick that finds work claims again
//!   every [`scheduler::BUSY_POLL`], and a [`Dispatcher`] that probes
//!   ([`Dispatcher::with_idle_probe`], docs/adr/0019) keeps its drained tick
//!   open too, asking every [`scheduler::IDLE_PROBE`] with one index read
//!   whether an event waits, until its budget.
//! - **Deliveries stay inside their tenant**: the insert's tenant check runs
//!   once per statement over every row it inserted (migration 0015).
//! - **Bad settings are refused at construction**, by name
//!   ([`ConfigError`]); nothing is clamped.
//!
//! Modules: `config` (defaults and validation), `store` (all SQL: the insert
//! and the fenced funnel), `tick` ([`Dispatcher`], the driver's implementation
//! for this role).
//!
//! Subscription is read at dispatch time: an endpoint created or disabled
//! between the enqueue and the fan-out is taken as it is at the fan-out. An
//! endpoint with no event types receives every type (docs/adr/0005).

mod config;
mod store;
mod tick;

/// The claim-and-fan-out statement text, for the plan test
/// (`tests/it/plans.rs`); not an API.
#[doc(hidden)]
pub mod statements {
    pub use crate::store::CLAIM_AND_FAN_OUT;
}

pub use config::{ConfigError, DispatcherConfig};
pub use tick::{Dispatcher, TickReport};

/// Why [`enqueue`] refused an event. Nothing was written.
#[derive(Debug, thiserror::Error)]
pub enum EnqueueError {
    #[error("webhook event has an empty tenant_id")]
    EmptyTenant,
    #[error("webhook event has an empty event type")]
    EmptyEventType,
    /// The payload is not one JSON value. The message names the line and column.
    #[error("webhook payload for `{event_type}` is not valid JSON: {problem}")]
    InvalidJson { event_type: String, problem: String },
    /// The payload's JSON text is larger than [`MAX_PAYLOAD_BYTES`]; nothing was
    /// sent and `tx` is still usable. (A payload that passes this check but that
    /// Postgres renders past the `webhook_events_payload_bounded` backstop, e.g.
    /// `1e300` written out in full, is refused by the insert: [`EnqueueError::Db`].)
    #[error(
        "webhook payload for `{event_type}` is {bytes} bytes; at most {max} bytes are accepted"
    )]
    PayloadTooLarge {
        event_type: String,
        bytes: usize,
        max: usize,
    },
    /// The statement failed. The caller's transaction is aborted: roll it back.
    #[error("could not enqueue the webhook event: {0}")]
    Db(#[from] db::Error),
}

/// The largest payload [`enqueue`] accepts: 256 KiB of JSON text, as given.
///
/// Every delivery of an event holds its payload in memory and POSTs it, once per
/// subscribed endpoint and attempt; an unbounded payload lets one event exhaust
/// the delivery role's memory on every leader in turn (issue 12). 256 KiB is far
/// above what a billing event carries (ids and amounts) and matches email's body
/// limit. Migration 0007 backs it with `webhook_events_payload_bounded`: the
/// payload as Postgres renders it (what the claim reads and the worker sends) is
/// at most 1 MiB, which leaves room for jsonb's rendering (a space after each `:`
/// and `,`, at most 1.5×) and refuses inserts that bypass `enqueue`.
pub const MAX_PAYLOAD_BYTES: usize = 256 * 1024;

/// Errors of the dispatcher: a setting refused at construction, or its store.
#[derive(Debug, thiserror::Error)]
pub enum Error {
    #[error(transparent)]
    Config(#[from] ConfigError),
    #[error("webhook outbox: {0}")]
    Db(#[from] db::Error),
}

/// Add a webhook event to the outbox inside the caller's transaction and
/// return its id. The event is dispatched only if the caller commits.
///
/// `payload_json` is the event's `data`: one JSON value (usually an object).
///
/// # Errors
///
/// [`EnqueueError::InvalidJson`] (with line and column) when `payload_json` is not
/// JSON, [`EnqueueError::PayloadTooLarge`] past [`MAX_PAYLOAD_BYTES`], and
/// [`EnqueueError::EmptyTenant`] / [`EnqueueError::EmptyEventType`]; in
/// these cases nothing was sent to the database and `tx` is still usable.
/// [`EnqueueError::Db`] when the insert failed, which aborts `tx`.
pub async fn enqueue(
    tx: &mut db::Tx,
    tenant_id: &str,
    event_type: &str,
    payload_json: &str,
) -> Result<i64, EnqueueError> {
    check(tenant_id, event_type, payload_json)?;
    store::insert_event(tx, tenant_id, event_type, payload_json)
        .await
        .map_err(EnqueueError::Db)
}

/// One event for [`enqueue_many`]: (tenant, event type, payload JSON).
pub type NewEvent<'a> = (&'a str, &'a str, &'a str);

/// [`enqueue`] for many events with one statement (a producer that announces
/// a batch, such as billing's closing); returns how many were added. Every
/// event is checked first, as [`enqueue`] checks it.
///
/// # Errors
/// The first event [`enqueue`] would refuse, before anything was sent (`tx`
/// is still usable); [`EnqueueError::Db`] when the insert failed (`tx` is
/// aborted: roll it back).
pub async fn enqueue_many(tx: &mut db::Tx, events: &[NewEvent<'_>]) -> Result<u64, EnqueueError> {
    for (tenant_id, event_type, payload_json) in events {
        check(tenant_id, event_type, payload_json)?;
    }
    store::insert_events(tx, events)
        .await
        .map_err(EnqueueError::Db)
}

/// What [`enqueue`] refuses before it sends anything.
fn check(tenant_id: &str, event_type: &str, payload_json: &str) -> Result<(), EnqueueError> {
    if tenant_id.trim().is_empty() {
        return Err(EnqueueError::EmptyTenant);
    }
    if event_type.trim().is_empty() {
        return Err(EnqueueError::EmptyEventType);
    }
    if payload_json.len() > MAX_PAYLOAD_BYTES {
        return Err(EnqueueError::PayloadTooLarge {
            event_type: event_type.to_owned(),
            bytes: payload_json.len(),
            max: MAX_PAYLOAD_BYTES,
        });
    }
    let invalid = |problem: String| EnqueueError::InvalidJson {
        event_type: event_type.to_owned(),
        problem,
    };
    let value: serde_json::Value =
        serde_json::from_str(payload_json).map_err(|e| invalid(e.to_string()))?;
    // JSON allows \u0000 in strings; jsonb refuses it, and would abort `tx`.
    if contains_nul(&value) {
        return Err(invalid(
            "a string contains \\u0000 (NUL), which Postgres jsonb cannot store".to_owned(),
        ));
    }
    Ok(())
}

/// True if a string or key anywhere in `value` holds a NUL character.
fn contains_nul(value: &serde_json::Value) -> bool {
    use serde_json::Value;
    match value {
        Value::String(s) => s.contains('\0'),
        Value::Array(items) => items.iter().any(contains_nul),
        Value::Object(map) => map.iter().any(|(k, v)| k.contains('\0') || contains_nul(v)),
        Value::Null | Value::Bool(_) | Value::Number(_) => false,
    }
}
