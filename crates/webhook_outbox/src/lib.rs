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
//!                                           pg_notify(webhook_delivery) if any made
//!                                         COMMIT                  ──▶ webhook_deliveries
//! ```
//!
//! While the delivery role leads in the same process, the statement hands up
//! to its room of those deliveries to it instead of inserting them: one
//! `webhook_handoffs` row holds their pairs until the delivery role writes
//! each with its first outcome. The pairs of handoffs whose lease ended
//! unwritten are inserted pending by their own fenced statement, run by a
//! batch that claims nothing and at most once a second while batches claim
//! (docs/adr/0087, 0124, 0127). A batch
//! that finds that role's relay more than half full first waits for room (up
//! to 500 ms); with room found within the wait it claims about what fits,
//! leaving the rest undispatched, and after a wait that ran out it fans out
//! as before (docs/adr/0125).
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
//!   committed late) adds nothing: `UNIQUE (event_id, endpoint_id)` absorbs it,
//!   and a pair already written is never handed over. Duplicates to receivers
//!   come only from the delivery side (see `webhook_delivery`), and from a
//!   replay of an event one of whose first attempts is still in flight
//!   unwritten (docs/adr/0124).
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
    pub use crate::store::{
        BACKLOG, CLAIM_AND_FAN_OUT, PRUNE_DISPATCHED, PruneCursor, PrunedEvents, pruned_events,
    };
}

pub use config::{ConfigError, DispatcherConfig};
pub use tick::{Dispatcher, TickReport};

/// The producers' API lives in the `outbox` crate; re-exported for this
/// role's tests and tools.
pub use outbox::webhook::{EnqueueError, MAX_PAYLOAD_BYTES, NewEvent, enqueue, enqueue_many};

/// Errors of the dispatcher: a setting refused at construction, or its store.
#[derive(Debug, thiserror::Error)]
pub enum Error {
    #[error(transparent)]
    Config(#[from] ConfigError),
    #[error("webhook outbox: {0}")]
    Db(#[from] db::Error),
    /// A fan-out statement's handed parts did not fit together (a pair
    /// without its event's or endpoint's part; docs/adr/0127): a defect.
    /// The statement was rolled back, so nothing was claimed.
    #[error("webhook outbox: {0}")]
    Handed(String),
}
