//! Queueing emails in the producer's transaction: one ([`enqueue`]), many in
//! one statement ([`enqueue_many`], which refuses the batch for one bad
//! email), and [`enqueue_many_or_record`], which records a bad email as
//! failed and queues the rest (what a settle uses: a side effect never rolls
//! it back).

use db::Tx;
use leader::Telemetry;
use tracing::warn;

use super::store::{self, NewRow};
use super::{Email, Invalid, new_message_id};

/// Why [`enqueue`] refused an email.
#[derive(Debug, thiserror::Error)]
pub enum EnqueueError {
    /// Bad input, naming the field. Nothing was sent to the database; the
    /// caller's transaction is still usable.
    #[error(transparent)]
    Invalid(#[from] Invalid),
    /// The insert failed, which aborts the caller's transaction: roll it back.
    #[error("could not enqueue the email: {0}")]
    Db(#[from] db::Error),
}

/// Queue `email` for `tenant_id` inside the caller's transaction and return its
/// id. It is sent only if the caller commits. Its `Message-ID` is fixed here.
///
/// # Errors
/// [`EnqueueError::Invalid`] naming the field (nothing written, `tx` usable);
/// [`EnqueueError::Db`] when the insert failed (`tx` is aborted).
pub async fn enqueue(tx: &mut Tx, tenant_id: &str, email: &Email) -> Result<i64, EnqueueError> {
    if tenant_id.trim().is_empty() {
        return Err(Invalid::EmptyTenant.into());
    }
    email.validate()?;
    let message_id = new_message_id(&email.from);
    Ok(store::insert_email(tx, tenant_id, email, &message_id).await?)
}

/// [`enqueue`] for many emails with one statement; returns how
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
    let rows: Vec<NewRow<'_>> = emails
        .iter()
        .map(|(tenant_id, email)| NewRow {
            tenant_id,
            email,
            refused: None,
        })
        .collect();
    Ok(store::insert_batch(tx, &rows).await?)
}

/// What [`enqueue_many_or_record`] did with a batch.
#[derive(Debug, Default, Clone, PartialEq, Eq)]
pub struct Enqueued {
    /// Emails queued to be sent.
    pub queued: u64,
    /// Emails refused for their content and recorded `failed` instead: each
    /// one's index in the batch, and why.
    pub refused: Vec<(usize, Invalid)>,
}

/// Queue many emails with one statement, as [`enqueue_many`] does, except
/// that an email `enqueue` would refuse for its content (a sender or
/// recipient lettre cannot parse, no recipients, a body too large, a NUL, …)
/// is written in the same statement as a `failed` row whose `refused` column
/// names the reason and whose `last_reply_text` says which field was wrong
/// (its bodies are not kept). The rest are queued, and the caller's
/// transaction goes on.
///
/// Billing's settle and dunning's transitions use this: a receipt that cannot
/// be sent must not roll back the charge it reports. Each refusal is logged
/// (tenant and reason, never the address) and counted in
/// `hardcount_email_refused_total{reason}` when it is written, so a
/// transaction rolled back afterwards still counted it.
///
/// # Errors
/// [`Invalid::EmptyTenant`] (a caller's bug, not content) before anything was
/// sent (`tx` is still usable); [`EnqueueError::Db`] when the insert failed
/// (`tx` is aborted: roll it back).
pub async fn enqueue_many_or_record(
    tx: &mut Tx,
    emails: &[(&str, &Email)],
    telemetry: &Telemetry,
) -> Result<Enqueued, EnqueueError> {
    if emails
        .iter()
        .any(|(tenant_id, _)| tenant_id.trim().is_empty())
    {
        return Err(Invalid::EmptyTenant.into());
    }
    let verdicts: Vec<Result<(), Invalid>> = emails.iter().map(|(_, e)| e.validate()).collect();
    let records: Vec<Option<Email>> = emails
        .iter()
        .zip(&verdicts)
        .map(|((_, e), v)| v.as_ref().err().map(|_| e.refusal_record()))
        .collect();
    let rows: Vec<NewRow<'_>> = emails
        .iter()
        .zip(&verdicts)
        .zip(&records)
        .map(|(((tenant_id, email), verdict), record)| NewRow {
            tenant_id,
            email: record.as_ref().unwrap_or(email),
            refused: verdict.as_ref().err(),
        })
        .collect();
    store::insert_batch(tx, &rows).await?;
    let mut done = Enqueued::default();
    for (i, ((tenant_id, _), verdict)) in emails.iter().zip(verdicts).enumerate() {
        match verdict {
            Ok(()) => done.queued += 1,
            Err(why) => {
                let reason = why.reason();
                warn!(tenant = %tenant_id, reason, "email refused for its content: recorded as failed");
                telemetry
                    .counter("hardcount_email_refused_total", &[("reason", reason)])
                    .increment(1);
                done.refused.push((i, why));
            }
        }
    }
    Ok(done)
}

/// [`enqueue_many_or_record`] for one email.
///
/// # Errors
/// As [`enqueue_many_or_record`].
pub async fn enqueue_or_record(
    tx: &mut Tx,
    tenant_id: &str,
    email: &Email,
    telemetry: &Telemetry,
) -> Result<Enqueued, EnqueueError> {
    enqueue_many_or_record(tx, &[(tenant_id, email)], telemetry).await
}

#[cfg(test)]
mod tests {
    use db::{Row, sql};
    use testbed::TestDb;

    use super::enqueue_many;
    use crate::email::{Email, EnqueueError};

    fn email(to: &[&str], subject: &str) -> Email {
        Email {
            from: "billing@example.com".to_owned(),
            to: to.iter().map(|s| (*s).to_owned()).collect(),
            subject: subject.to_owned(),
            text: "body\n".to_owned(),
            html: None,
        }
    }

    /// Each email keeps its own recipients (a slice of the flat array), its
    /// own tenant and a Message-ID of its own.
    #[tokio::test]
    async fn many_emails_in_one_statement_keep_their_own_recipients() {
        let t = TestDb::new().await;
        let a = email(&["a@example.com", "b@example.com"], "two");
        let b = email(&["c@example.com"], "one");
        let c = email(
            &["d@example.com", "e@example.com", "f@example.com"],
            "three",
        );
        let mut tx = t.db.begin().await.unwrap();
        let n = enqueue_many(&mut tx, &[("t1", &a), ("t2", &b), ("t1", &c)])
            .await
            .unwrap();
        tx.commit().await.unwrap();
        assert_eq!(n, 3);
        let rows =
            t.db.fetch_all(sql(
                "SELECT tenant_id, recipients, subject, message_id FROM email_outbox ORDER BY id",
            ))
            .await
            .unwrap();
        let got: Vec<(String, Vec<String>, String)> = rows
            .iter()
            .map(|r| (r.get(0), r.get(1), r.get(2)))
            .collect();
        let v = |s: &[&str]| s.iter().map(|x| (*x).to_owned()).collect::<Vec<_>>();
        assert_eq!(
            got,
            vec![
                (
                    "t1".into(),
                    v(&["a@example.com", "b@example.com"]),
                    "two".into()
                ),
                ("t2".into(), v(&["c@example.com"]), "one".into()),
                (
                    "t1".into(),
                    v(&["d@example.com", "e@example.com", "f@example.com"]),
                    "three".into()
                ),
            ]
        );
        let ids: std::collections::HashSet<String> = rows.iter().map(|r| r.get(3)).collect();
        assert_eq!(ids.len(), 3, "each email its own Message-ID");
    }

    /// A bad email anywhere in the batch refuses the batch, naming the field,
    /// before anything is sent: the transaction is still usable.
    #[tokio::test]
    async fn one_bad_email_refuses_the_batch_before_anything_is_written() {
        let t = TestDb::new().await;
        let good = email(&["a@example.com"], "fine");
        let bad = email(&[], "nobody");
        let mut tx = t.db.begin().await.unwrap();
        let e = enqueue_many(&mut tx, &[("t1", &good), ("t1", &bad)])
            .await
            .unwrap_err();
        assert!(matches!(e, EnqueueError::Invalid(_)), "{e}");
        let left = tx
            .fetch_one(sql("SELECT count(*) AS n FROM email_outbox"))
            .await
            .unwrap();
        assert_eq!(left.get::<i64, _>("n"), 0);
        tx.commit().await.unwrap();
    }
}
