//! The `webhook_delivery` role: POSTs each due webhook delivery to its endpoint,
//! signed per Standard Webhooks, retries failures on a schedule with jitter, and
//! dead-letters a delivery after its last attempt. Targets on private, loopback and
//! link-local networks are refused unless configuration allows them.
//!
//! ```text
//!  webhook_deliveries                 Worker::run_tick (leader only)
//!  status = pending ──claim_due──▶ attempts += 1, claimed_until = now() + lease      (fenced,
//!  next_attempt_at <= now()        │   (a HOT update: no indexed column)              SKIP LOCKED)
//!  claimed_until null or passed    │
//!                                  ├─ endpoint disabled ─────────────────▶ dead
//!                                  ├─ its circuit breaker open ──────────▶ held (attempts -= 1,
//!                                  │                                    next_attempt_at = reopening)
//!                                  ├─ its turn's share stalls, or the ───▶ held 1 s or more
//!                                  │  batch moves on without it           (attempts -= 1)
//!                                  ├─ no turn before the start deadline ─▶ handed back (attempts -= 1)
//!                                  ├─ SSRF guard refuses ────────────────▶ pending (retry) … dead
//!                                  └─ POST (signed, bounded) ─┬─ 2xx ───▶ delivered
//!                                                             ├─ 410 ───▶ dead + endpoint disabled
//!                                                             └─ other / timeout / no connection
//!                                                                  ─────▶ pending at now() + backoff,
//!                                                                         dead after the last attempt
//!   every write above is a compare-and-set on (id, attempt, pending), or, for a delivery
//!   handed over unwritten, an insert a written pair refuses (adr/0124); outcomes are
//!   written in groups, one statement each (… WHERE d.id = o.id AND d.attempts = o.attempt
//!   AND d.status = o.was, was = 'pending'), the 410 one on its own with the endpoint's
//!   disabling; claims and outcome groups plan by key whatever the statistics (adr/0023)
//! ```
//!
//! Guarantees:
//!
//! - **At-least-once.** A claim sets `claimed_until` a lease ahead
//!   (`request_timeout + claim_margin`) before anything is sent. If the process
//!   dies, is frozen, or loses its lease mid-attempt, the delivery comes due
//!   again when the lease ends. A delivery the fan-out handed over unwritten
//!   has its pair in a `webhook_handoffs` row with the same lease, which the
//!   fan-out turns into a pending delivery if the lease ends before the row is
//!   written (docs/adr/0124). Nothing is deleted but handoffs (once written, or
//!   once the fan-out has inserted them) and what retention prunes; a dead
//!   delivery stays in the table with its last error, counted by
//!   `hardcount_webhook_deliveries_dead`.
//! - **Duplicates** reach a receiver only when an attempt's result was not
//!   recorded: the receiver took the request but the answer was lost or late
//!   (a timeout), the outcome write failed, or the process died or was replaced
//!   between the POST and the write. Every attempt carries the same
//!   `webhook-id`, so receivers can drop repeats.
//! - **A late result never overwrites a newer one.** Each claim increments
//!   `attempts`, and an outcome is written only while the row still holds that
//!   attempt number and is pending. A result that loses is logged and counted
//!   as `outcome="stale"`, never applied. Outcomes are buffered and written in
//!   groups (up to 512, or after 20 ms, or when the batch has nothing left in
//!   flight), one statement per group, each row still its own compare-and-set;
//!   an outcome that cannot be written leaves its delivery to come due again
//!   after its claim lease. A handed delivery's first outcome is an insert
//!   that a pair already written makes stale, in the same way.
//! - **A replaced leader claims nothing**: the claim proves
//!   `leader_fence($role, $token)` in its innermost WHERE, and
//!   [`Worker::claim_due`] takes a [`leader::Fence`].
//! - **Bounded**: requests in flight globally, per endpoint, per tenant and
//!   per resolved destination, each attempt's time (connect and total), the
//!   response bytes read, and the tick's time.
//! - **Fair** (docs/adr/0018): an attempt waits for its endpoint's, its
//!   tenant's and its destination's permits before a global one
//!   (`fairness.rs`), so a tenant whose endpoints hang holds at most its share
//!   of the slots, and a waiting attempt gives up (is held) when its share
//!   stops moving; a batch whose attempts stop finishing is carried and the
//!   next claim goes on, so a hung request delays no other tenant's deliveries; an
//!   endpoint that times out `breaker_timeouts` times in a row is backed off by
//!   its circuit breaker (`breaker.rs`, in memory): its deliveries are held
//!   in the table, unsent and their attempts not counted, until one trial
//!   goes through. Held deliveries are neither burned nor lost.
//! - **A tick's end decides its release.** The tick is the fenced-batch
//!   driver ([`scheduler::drive`]): a claim that finds nothing ends it drained
//!   (due after the interval, or at once if the tick found work), too little
//!   budget for another attempt ends it with more work (due again at once), a
//!   failed claim ends it failed (due after the short failure cooldown).
//! - **Woken by the fan-out** (docs/adr/0014): a [`Worker`] given a listening
//!   [`scheduler::Wake`] ([`Worker::with_wake`]) keeps its tick open and
//!   claims when the outbox's fan-out commits (its `pg_notify`), or every
//!   interval; without one, a tick that finds work claims again every
//!   [`scheduler::BUSY_POLL`], and a [`Worker`] that probes
//!   ([`Worker::with_idle_probe`], docs/adr/0019) keeps its drained tick open
//!   too, asking every [`scheduler::IDLE_PROBE`] with one index read whether a
//!   delivery is due, until its budget. A wake that does not listen still
//!   ends those pauses when poked: the fan-out in the same process hands its
//!   deliveries over that way (`webhook_outbox::Dispatcher::with_hand_over`,
//!   docs/adr/0070).
//! - **Claimed by the fan-out** (docs/adr/0087, 0124): while a tick runs, it
//!   publishes its token on its wake's [`scheduler::Relay`], and the fan-out
//!   of this process hands up to eight batches of deliveries to it, proving
//!   that token, without inserting them (one `webhook_handoffs` row holds
//!   their pairs). The tick takes them before it claims (the claim statement
//!   still runs for the rest of a batch, and at least every second), knows
//!   each by a negative id until it is written (`unwritten.rs`), and inserts
//!   each once, with its first outcome; a cancelled tick inserts pending
//!   those it did not take, and the fan-out inserts pending any left
//!   unwritten when their handoff's lease ends.
//! - **Signing secrets rotate without a gap** (Standard Webhooks):
//!   [`rotate_secret`] makes a fresh secret current and keeps the replaced one
//!   as the endpoint's `previous_secret` until `now() + overlap` (migration
//!   0008). The claim returns the previous secret only while that expiry is
//!   ahead of its own `now()`, on the database clock, and while it does every
//!   delivery is signed with both, new first, space-separated
//!   (`webhook-signature: v1,<sig-new> v1,<sig-old>`), so a receiver verifies
//!   with either secret; after it, with the new one only. Keys shorter than 24
//!   bytes are refused ([`signature::SecretError::KeyTooShort`]): such an
//!   endpoint's deliveries are not sent (`bad_secret`).
//! - **Signing secrets are sealed at rest** ([`sealed`], migration 0012):
//!   XChaCha20-Poly1305 under the application key (`HARDCOUNT_SECRETS_KEY`,
//!   [`WorkerConfig::secrets`]), the key id stored with each ciphertext and the
//!   tenant bound into it. [`create_endpoint`] and [`rotate_secret`] seal (as
//!   `hardcount_api`); only the worker opens, once per endpoint per claimed
//!   batch, into buffers shared by that batch's attempts to the endpoint and
//!   wiped when the last of them ends (docs/adr/0020).
//!   A secret that does not open is not sent: its delivery is held
//!   (`bad_secret`, attempt not counted) and only that endpoint waits.
//!   [`check_secrets`] is `serve`'s boot check (it reports such rows, it no
//!   longer refuses to start for them); [`reseal_secrets`] (as the owner)
//!   seals old clear rows and moves every secret to the current key,
//!   skipping and naming a row that does not open.
//! - **Bad settings are refused at construction** ([`Worker::new`]), naming
//!   the setting ([`ConfigError`]); nothing is clamped.
//!
//! Metrics (through the [`leader::Telemetry`] given to [`Worker::new`]):
//!
//! ```text
//! hardcount_webhook_deliveries_total{outcome}     one per attempt: delivered, retry, dead,
//!                                                 refused (SSRF, scheduled again), stale;
//!                                                 and held (not sent, due again later)
//! hardcount_webhook_breakers_open                 gauge, endpoints backed off, at each tick's end
//! hardcount_webhook_attempt_duration_seconds      histogram, each request made
//! hardcount_webhook_deliveries_pending            gauges, read at a tick's end (at most every
//! hardcount_webhook_deliveries_dead               15 s, docs/adr/0138) on the database clock;
//!                                                 the age counts from
//! hardcount_webhook_oldest_pending_age_seconds    the delivery's creation (retries included)
//! hardcount_webhook_oldest_due_age_seconds        how long the longest-due unclaimed delivery
//!                                                 has been due: the worker's lag (0 when none)
//! ```
//!
//! Modules, the layout every job crate shares (no import circle among them;
//! the top five call down, each step a free function over `Shared`):
//!
//! ```text
//! lib.rs        this overview, re-exports
//! worker.rs     Worker: construction, settings, run_tick / claim_due / deliver (its only impl)
//! tick.rs       a tick: the driver's implementation for this role, the claim, the gauges;
//!               attempts carried across batches collected at its end
//! batch.rs      a claimed batch: attempts as guarded tasks, collected, carried,
//!               outcomes and holds written in groups
//! attempt.rs    one attempt: its turn under the concurrency limits, the breaker, the signed POST
//! outcomes.rs   outcomes buffered and written in groups, holds and releases, the counter
//! unwritten.rs  the deliveries handed over and not written yet        (no SQL, no I/O)
//! shared.rs     what a worker's clones share (db, settings, client, limits, breakers)
//! config.rs     WorkerConfig: defaults and validation
//! error.rs      Error
//! store/        the SQL, a file per step: claim.rs (the fenced claim, takes &Fence; the
//!               probe), outcomes.rs (the CAS outcome writes, holds), unwritten.rs (the
//!               handed deliveries' inserts), backlog.rs (gauges), endpoints.rs (endpoints
//!               and their secrets)
//! fairness.rs   the four permits of a turn: endpoint, tenant, destination, global
//! breaker.rs    each endpoint's circuit breaker                      (no SQL, no I/O)
//! delivery.rs   Claimed and Outcome                                  (no SQL, no I/O)
//! verdict.rs    answer + attempt number + schedule -> next state     (no SQL, no I/O)
//! ```
//!
//! and the building blocks: [`signature`] (secrets and `webhook-*` headers),
//! [`sealed`] (secrets sealed at rest under the application key),
//! [`ssrf`] (which addresses may be connected to, enforced inside the HTTP
//! client's DNS resolution), [`backoff`] (the retry schedule and
//! `Retry-After`), `send` (one bounded POST) and [`create_endpoint`]. Outcome
//! choices are recorded in docs/adr/0006.

mod attempt;
pub mod backoff;
mod batch;
mod breaker;
mod config;
mod delivery;
mod disabling;
mod endpoint;
mod error;
mod failure;
mod fairness;
mod outcomes;
pub mod sealed;
mod send;
mod shared;
pub mod signature;
pub mod ssrf;
mod store;
mod tick;
mod unwritten;

/// The claim's and the outcome's statement texts, for the plan tests
/// (`tests/it/plans.rs`); not an API.
#[doc(hidden)]
pub mod statements {
    pub use crate::store::{
        APPLY_OUTCOMES, CLAIM_DUE, DISABLE_FAILING, INSERT_OUTCOMES, INSERT_OUTCOMES_TOLERANT,
        PRUNE_FINISHED,
    };
}
mod verdict;
mod worker;

pub use config::{ConfigError, WorkerConfig};
pub use delivery::{Claimed, Outcome};
pub use disabling::ENDPOINT_DISABLED;
pub use endpoint::{
    Endpoint, EndpointError, MAX_ROTATION_OVERLAP, MAX_URL_LEN, ResealReport, RotateError,
    SecretsError, SecretsReport, check_secrets, create_endpoint, create_endpoint_in,
    parse_endpoint_url, redacted_url, reseal_secrets, rotate_secret, rotate_secret_in,
};
pub use error::Error;
pub use failure::Failure;
pub use sealed::{Keyring, KeyringError, SECRETS_KEY_VAR};
pub use tick::TickReport;
pub use worker::{OUTCOMES_ALERTED, Worker};
