//! The email outbox: emails written next to the change that caused them, and the
//! `email_outbox` role that sends each one over SMTP.
//!
//! ```text
//!  producer's transaction             email_outbox tick (leader only)
//!  ─────────────────────              ────────────────────────────────────────────
//!  UPDATE invoices …                  claim ≤ batch due queued emails       (fenced,
//!  enqueue(tx, tenant, email) ──┐       attempts += 1, next_attempt_at       SKIP LOCKED)
//!  COMMIT                       │       = now() + claim lease
//!                               └──▶  send each through the pool: ≤ max_connections
//!                  email_outbox         open at once, TCP_NODELAY (docs/adr/0016)
//!                                     ├─ 2xx ───────────────────────────▶ sent
//!                                     ├─ 4xx, no reply (connect, TLS) ──▶ queued at now() + backoff,
//!                                     │                                    failed after the last
//!                                     ├─ 5xx ───────────────────────────▶ failed, reply kept
//!                                     └─ server unreachable ─▶ the rest handed back unattempted
//!   every write is a compare-and-set on (id, attempts, queued), in groups, one statement each
//! ```
//!
//! Guarantees:
//!
//! - **An email exists iff its producer committed.** [`enqueue`] (and
//!   [`enqueue_many`], a batch in one statement) runs inside the
//!   caller's [`db::Tx`], and refuses bad input (naming the field) before anything
//!   is written.
//! - **A bad email never rolls back its producer** when the producer asks so:
//!   [`enqueue_many_or_record`] (and [`enqueue_or_record`]) writes an email it
//!   refuses for its content as a `failed` row with its reason (`refused`,
//!   `last_reply_text`), queues the rest, and counts the refusal in
//!   `hardcount_email_refused_total{reason}`. Billing's settle and dunning use
//!   it. Addresses are also checked where they are written
//!   (`email_address_valid`, migration 0022, docs/adr/0027), by rules never
//!   looser than lettre's.
//! - **At least once, never lost.** A claim moves `next_attempt_at` a lease ahead
//!   before anything is sent; if the process dies, freezes or loses its lease, the
//!   email comes due again. Nothing is deleted; a failed email keeps the server's
//!   last reply.
//! - **Duplicates** reach a recipient only when a send's result was not recorded
//!   (the server took the message but the reply was lost, the write failed, or the
//!   process died between the send and the write). Every attempt carries the
//!   `Message-ID` fixed at enqueue, so the receiving side can recognise a resend.
//! - **A late result never overwrites a newer one**: results are written only
//!   while the row holds the attempt number its claim set.
//! - **A replaced leader claims nothing**: the claim proves
//!   `leader_fence('email_outbox', $token)` and takes a [`leader::Fence`].
//! - **Credentials never reach a log or an error**: `SMTP_URL` is never echoed.
//!
//! Modules (no import circle among them; each uses only the ones below it):
//!
//! ```text
//! lib.rs        this overview, re-exports (enqueue and Email live in the `outbox` crate)
//! tick.rs       Sender: the driver's implementation for this role, sends and their results
//! send.rs       one send through the pool, turned into a Reply
//! pool.rs       the SMTP connections: at most max_connections open, reused while healthy
//! smtp.rs       SMTP_URL, and how one connection is opened from it
//! failure.rs    why a send got no SMTP answer                        (no SQL, no I/O)
//! store/        the SQL, a file per step: claim.rs (the fenced claim, takes &Fence),
//!               results.rs (the CAS result writes, hand-backs), backlog.rs (gauges),
//!               columns.rs (what they share)
//! message.rs    Queued, and the MIME message it becomes             (no SQL, no I/O)
//! verdict.rs    SMTP reply + attempt number -> next state            (no SQL, no I/O)
//! config.rs     SenderConfig: defaults and validation
//! error.rs      Error and EnqueueError
//! ```

mod config;
mod error;
mod failure;
pub mod message;
mod pool;
mod send;
pub mod smtp;
mod store;

/// The claim and result statement texts, for the plan tests
/// (`tests/it/plans.rs`); not an API.
#[doc(hidden)]
pub mod statements {
    pub use crate::store::{CLAIM_DUE, PRUNE_FINISHED, RECORD_RESULTS};
}
mod tick;
pub mod verdict;

pub use config::{ConfigError, SenderConfig};
pub use error::Error;
/// The producers' API lives in the `outbox` crate; re-exported for this
/// role's tests and tools.
pub use outbox::email::{
    Email, EnqueueError, Enqueued, Invalid, MAX_BODY_BYTES, check_sender, enqueue, enqueue_many,
    enqueue_many_or_record, enqueue_or_record,
};
pub use smtp::{SmtpUrl, SmtpUrlError, TlsMode};
pub use tick::{OUTCOMES_ALERTED, Sender, Tally, TickReport};
