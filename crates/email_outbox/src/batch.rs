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

#[cfg(test)]
mod tests {
    use db::{Row, sql};
    use testbed::TestDb;

    use super::enqueue_many;
    use crate::{Email, EnqueueError};

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
