//! The producers' SQL: one email, or a batch that may record refusals, each
//! inserted inside the producer's transaction.

use db::{Row, Tx, sql};

use super::{Email, Invalid, new_message_id};

/// The status of an email waiting to be sent.
const QUEUED: &str = "queued";

/// Longest `last_reply_text` kept.
const MAX_REPLY_CHARS: usize = 1000;

/// `text` as `last_reply_text` keeps it: at most 1,000 characters, NUL
/// (which Postgres text cannot hold) replaced by U+FFFD. The sender's result
/// writes keep a reply the same way.
pub fn reply_text(text: &str) -> String {
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

pub(crate) async fn insert_email(
    tx: &mut Tx,
    tenant_id: &str,
    email: &Email,
    message_id: &str,
) -> Result<i64, db::Error> {
    let row = tx
        .fetch_one(
            sql("INSERT INTO email_outbox \
                   (tenant_id, message_id, sender, recipients, subject, text_body, html_body) \
                 VALUES ($1, $2, $3, $4, $5, $6, $7) RETURNING id")
            .bind(tenant_id.to_owned())
            .bind(message_id.to_owned())
            .bind(email.from.clone())
            .bind(email.to.clone())
            .bind(email.subject.clone())
            .bind(email.text.clone())
            .bind(email.html.clone()),
        )
        .await?;
    Ok(row.try_get("id")?)
}

/// One row of [`insert_batch`]: an email to queue, or a refused one to record
/// `failed` with its refusal.
pub(crate) struct NewRow<'a> {
    pub tenant_id: &'a str,
    pub email: &'a Email,
    pub refused: Option<&'a Invalid>,
}

/// Insert many emails with one statement; returns how many rows were written.
/// Each gets its own `Message-ID`. A refused row is written as given: the
/// caller passes [`Email::refusal_record`].
pub(crate) async fn insert_batch(tx: &mut Tx, rows: &[NewRow<'_>]) -> Result<u64, db::Error> {
    if rows.is_empty() {
        return Ok(0);
    }
    let col = |f: &dyn Fn(&NewRow<'_>) -> String| rows.iter().map(f).collect::<Vec<_>>();
    let opt = |f: &dyn Fn(&NewRow<'_>) -> Option<String>| rows.iter().map(f).collect::<Vec<_>>();
    // Recipients vary in number per email: one flat array, and each email's
    // slice of it (1-based, inclusive bounds; empty when hi < lo).
    let (mut flat, mut lo, mut hi) = (Vec::new(), Vec::new(), Vec::new());
    for r in rows {
        lo.push(i32::try_from(flat.len() + 1).unwrap_or(i32::MAX));
        flat.extend(r.email.to.iter().cloned());
        hi.push(i32::try_from(flat.len()).unwrap_or(i32::MAX));
    }
    tx.execute(
        sql("INSERT INTO email_outbox \
               (tenant_id, message_id, sender, recipients, subject, text_body, html_body, \
                status, refused, last_reply_text, last_attempt_at) \
             SELECT e.tenant_id, e.message_id, e.sender, ($4::text[])[e.lo:e.hi], e.subject, \
                    e.text_body, e.html_body, e.status, e.refused, e.reply_text, \
                    CASE WHEN e.refused IS NOT NULL THEN now() END \
             FROM unnest($1::text[], $2::text[], $3::text[], $5::int4[], $6::int4[], \
                         $7::text[], $8::text[], $9::text[], $10::text[], $11::text[], \
                         $12::text[]) \
                  AS e(tenant_id, message_id, sender, lo, hi, subject, text_body, html_body, \
                       status, refused, reply_text)")
        .bind(col(&|r| r.tenant_id.to_owned()))
        .bind(col(&|r| new_message_id(&r.email.from)))
        .bind(col(&|r| r.email.from.clone()))
        .bind(flat)
        .bind(lo)
        .bind(hi)
        .bind(col(&|r| r.email.subject.clone()))
        .bind(col(&|r| r.email.text.clone()))
        .bind(opt(&|r| r.email.html.clone()))
        .bind(col(&|r| {
            if r.refused.is_some() {
                "failed"
            } else {
                QUEUED
            }
            .to_owned()
        }))
        .bind(opt(&|r| r.refused.map(|i| i.reason().to_owned())))
        .bind(opt(&|r| r.refused.map(|i| reply_text(&i.to_string())))),
    )
    .await
}
