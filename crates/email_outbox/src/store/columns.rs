//! What the enqueue and the result writes both write: the `queued` status a
//! compare-and-set expects, and the reply text as a row keeps it.

/// The status a result's or a hand-back's compare-and-set expects its email
/// in, bound as a column of the unnested group (`was`) rather than written as a
/// literal: the literal matches `email_outbox_due`'s predicate, and a table
/// whose statistics expect few queued rows was then read queued row by queued
/// row for every group (docs/adr/0023).
pub(super) const QUEUED: &str = "queued";

/// Longest `last_reply_text` kept.
const MAX_REPLY_CHARS: usize = 1000;

/// `text` as `last_reply_text` keeps it: at most [`MAX_REPLY_CHARS`]
/// characters, NUL (which Postgres text cannot hold) replaced by U+FFFD.
pub(super) fn reply_text(text: &str) -> String {
    text.chars()
        .take(MAX_REPLY_CHARS)
        .map(|c| {
            if c == '\0' {
                char::REPLACEMENT_CHARACTER
            } else {
                c
            }
        })
        .collect()
}
