//! What the result writes share: the `queued` status a compare-and-set
//! expects, and the reply text as a row keeps it (the producers' crate,
//! `outbox`, keeps it the same way).

/// The status a result's or a hand-back's compare-and-set expects its email
/// in, bound as a column of the unnested group (`was`) rather than written as a
/// literal: the literal matches `email_outbox_due`'s predicate, and a table
/// whose statistics expect few queued rows was then read queued row by queued
/// row for every group (docs/adr/0023).
pub(super) const QUEUED: &str = "queued";

pub(super) use outbox::email::reply_text;
