//! [`enqueue_many`]: many emails in one statement, for a producer that settles
//! a batch in one transaction (billing's charges).

use db::{Tx, sql};

use crate::EnqueueError;
use crate::email::{self, Email, Invalid};

/// [`enqueue`](crate::enqueue) for many emails with one statement; returns how
/// many were added. Every email is checked first, as `enqueue` checks it, and
/// gets its own `Message-ID`.
///
/// # Errors
/// The first email `enqueue` would refuse, before anything was sent (`tx` is
/// still usable); [`EnqueueError::Db`] when the insert failed (`tx` is
/// aborted: roll it back).
pub async fn enqueue_many(tx: &mut Tx, emails: &[(&str, &Email)]) -> Result<u64, EnqueueError> {
    for (tenant_id, email) in emails {
        if tenant_id.trim().is_empty() {
            return Err(Invalid::EmptyTenant.into());
        }
        email.validate()?;
    }
    if emails.is_empty() {
        return Ok(0);
    }
    let col =
        |f: fn(&str, &Email) -> String| emails.iter().map(|(t, e)| f(t, e)).collect::<Vec<_>>();
    // Recipients vary in number per email: one flat array, and each email's
    // slice of it (1-based, inclusive bounds).
    let (mut flat, mut lo, mut hi) = (Vec::new(), Vec::new(), Vec::new());
    for (_, e) in emails {
        lo.push(i32::try_from(flat.len() + 1).unwrap_or(i32::MAX));
        flat.extend(e.to.iter().cloned());
        hi.push(i32::try_from(flat.len()).unwrap_or(i32::MAX));
    }
    let n = tx
        .execute(
            sql("INSERT INTO email_outbox \
                   (tenant_id, message_id, sender, recipients, subject, text_body, html_body) \
                 SELECT e.tenant_id, e.message_id, e.sender, \
                        ($4::text[])[e.lo:e.hi], e.subject, e.text_body, e.html_body \
                 FROM unnest($1::text[], $2::text[], $3::text[], $5::int4[], $6::int4[], \
                             $7::text[], $8::text[], $9::text[]) \
                      AS e(tenant_id, message_id, sender, lo, hi, subject, text_body, html_body)")
            .bind(col(|t, _| t.to_owned()))
            .bind(col(|_, e| email::new_message_id(&e.from)))
            .bind(col(|_, e| e.from.clone()))
            .bind(flat)
            .bind(lo)
            .bind(hi)
            .bind(col(|_, e| e.subject.clone()))
            .bind(col(|_, e| e.text.clone()))
            .bind(
                emails
                    .iter()
                    .map(|(_, e)| e.html.clone())
                    .collect::<Vec<_>>(),
            ),
        )
        .await?;
    Ok(n)
}
