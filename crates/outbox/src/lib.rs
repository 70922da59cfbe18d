//! The producers' API: what billing, dunning, the local run (and any other
//! producer) call to queue a webhook event or an email inside their own
//! transaction. An event or an email exists iff its producer committed; bad
//! input is refused by name before anything is written.
//!
//! ```text
//!  producer's transaction                       the roles that send them
//!  ─────────────────────                        ────────────────────────
//!  UPDATE invoices …
//!  outbox::webhook::enqueue(tx, …) ──▶ webhook_events  ──▶ webhook_outbox → webhook_delivery
//!    (+ pg_notify, sent at commit)
//!  outbox::email::enqueue(tx, …)   ──▶ email_outbox    ──▶ email_outbox
//!  COMMIT
//! ```
//!
//! **Architecture Invariant**: this crate depends on no role crate, and the
//! role crates that produce (billing, dunning) depend on it instead of on the
//! roles that send. It writes only the producers' inserts; claims, sends and
//! outcomes are the roles'.
//!
//! Modules: `webhook` (events: checks, the insert with the role's wake-up),
//! `email` (the email, its checks and `Message-ID`; `enqueue`,
//! `enqueue_many`, `enqueue_many_or_record`).

pub mod email;
pub mod webhook;
