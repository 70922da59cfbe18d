//! The invariant checker (issue 27, point 6), run after every scenario: from
//! the database and the fakes' own counts (the provider's charges, the
//! receiver's requests, the SMTP sink's mailbox), never from the replicas'
//! word.

use std::collections::{BTreeMap, HashMap};

use fake_provider::FakeProvider;
use sqlx::Row;
use sqlx::postgres::PgConnection;
use testbed::SmtpSink;
use testbed::receiver::Receiver;

use super::history;

#[derive(Debug, Default)]
pub struct Report {
    pub violations: Vec<String>,
    pub invoices: i64,
    pub charges: u32,
    pub dunning_retries: i64,
    /// Retries recorded but not counted by their run: each had an unknown
    /// answer, was rewound and was settled by the reconciler.
    pub dunning_uncounted: i64,
    pub deliveries: usize,
    pub webhook_duplicates: usize,
    pub emails: usize,
    pub email_duplicates: usize,
    pub terms: usize,
    /// Terms per role that ended without a clean release.
    pub unclean: BTreeMap<String, usize>,
}

impl Report {
    pub fn summary(&self) -> String {
        format!(
            "{} invoices, {} charges, {} dunning retries ({} uncounted after an unknown answer), \
             {} deliveries ({} duplicates), {} emails ({} duplicates), {} terms, unclean ends {:?}, \
             {} violations",
            self.invoices,
            self.charges,
            self.dunning_retries,
            self.dunning_uncounted,
            self.deliveries,
            self.webhook_duplicates,
            self.emails,
            self.email_duplicates,
            self.terms,
            self.unclean,
            self.violations.len()
        )
    }

    /// # Panics
    /// Listing every violation, when there is one.
    pub fn assert_green(&self, after: &str) {
        assert!(
            self.violations.is_empty(),
            "invariants broken after {after}:\n  {}\n({})",
            self.violations.join("\n  "),
            self.summary()
        );
    }
}

async fn rows(su: &mut PgConnection, q: &str) -> Vec<sqlx::postgres::PgRow> {
    sqlx::query(sqlx::AssertSqlSafe(q.to_owned()))
        .fetch_all(su)
        .await
        .unwrap_or_else(|e| panic!("checker query failed: {e}\n{q}"))
}

fn message_id(raw: &str) -> Option<String> {
    raw.lines().find_map(|l| {
        let (name, value) = l.split_once(':')?;
        name.eq_ignore_ascii_case("message-id")
            .then(|| value.trim().to_owned())
    })
}

/// Results a role could not write, by the replicas' own logs: each one's
/// message or delivery comes due again when its claim lease ends and is sent
/// again, inside a term that may end cleanly (a Postgres restart shorter
/// than the leader lease fails the write and spares the term).
#[derive(Debug, Default, Clone, Copy)]
pub struct Unrecorded {
    pub emails: usize,
    pub deliveries: usize,
}

impl Unrecorded {
    /// Count them in the replicas' logs: the warning each role writes when a
    /// result write fails, with the number of rows it carried.
    pub fn from_logs(logs: &[String]) -> Unrecorded {
        let field = |line: &str, name: &str| -> usize {
            line.split_whitespace()
                .find_map(|w| w.strip_prefix(name)?.parse().ok())
                .unwrap_or(1)
        };
        let mut u = Unrecorded::default();
        for line in logs.iter().flat_map(|l| l.lines()) {
            if line.contains("could not record send results") {
                u.emails += field(line, "emails=");
            } else if line.contains("could not record a webhook attempt") {
                u.deliveries += 1;
            } else if line.contains("could not record webhook attempts")
                || line.contains("a webhook outcome write did not finish")
            {
                u.deliveries += field(line, "outcomes=");
            }
        }
        u
    }
}

/// Check everything; the workload must have drained first (see
/// `Harness::drain`), or what is still in flight reads as missing.
/// Duplicates are explained by a term of their role that ended uncleanly,
/// or by results that role logged as unwritten, at most one each.
pub async fn check(
    su: &mut PgConnection,
    provider: &FakeProvider,
    rx: &Receiver,
    sink: &SmtpSink,
    unrecorded: Unrecorded,
) -> Report {
    let mut r = Report::default();
    let mut violations = Vec::new();
    let v = &mut violations;

    // One invoice per (subscription, period).
    for row in rows(
        su,
        "SELECT subscription_id, period_start::text AS p, count(*) AS n FROM invoices \
         GROUP BY 1, 2 HAVING count(*) > 1",
    )
    .await
    {
        v.push(format!(
            "subscription {} has {} invoices for the period from {}",
            row.get::<i64, _>("subscription_id"),
            row.get::<i64, _>("n"),
            row.get::<String, _>("p")
        ));
    }
    r.invoices = rows(su, "SELECT count(*) AS n FROM invoices").await[0].get("n");

    // No invoice charged twice, by the provider's own count.
    let key_invoice: HashMap<String, i64> = rows(
        su,
        "SELECT idempotency_key, invoice_id FROM payment_attempts",
    )
    .await
    .iter()
    .map(|row| (row.get("idempotency_key"), row.get("invoice_id")))
    .collect();
    let mut per_invoice: BTreeMap<i64, u32> = BTreeMap::new();
    for (key, n) in provider.charges() {
        r.charges += n;
        match key_invoice.get(&key) {
            Some(inv) => *per_invoice.entry(*inv).or_default() += n,
            None => v.push(format!(
                "the provider charged key {key} that no payment attempt records"
            )),
        }
    }
    for (inv, n) in per_invoice.iter().filter(|(_, n)| **n > 1) {
        v.push(format!(
            "invoice {inv} was charged {n} times by the provider's count"
        ));
    }

    // No dunning attempt counted twice: a run never counts more retries than
    // its invoice records. A run counts each retry whose answer was definite;
    // one whose answer was unknown (a timeout, a lost tick, a call not sent)
    // is rewound, not counted, and settled later by billing's reconciler
    // under its key (docs/adr/0013: a customer may see more provider attempts
    // than the policy's count, never a double charge). Those are reported.
    for row in rows(
        su,
        "SELECT r.id, r.attempt_count, \
                (SELECT count(*) FROM payment_attempts a \
                 WHERE a.invoice_id = r.invoice_id AND a.attempt_seq > 1) AS recorded \
         FROM dunning_runs r",
    )
    .await
    {
        let (count, recorded): (i32, i64) = (row.get("attempt_count"), row.get("recorded"));
        r.dunning_retries += recorded;
        let uncounted = recorded - i64::from(count);
        if uncounted < 0 {
            v.push(format!(
                "dunning run {} counts {count} retries but only {recorded} are recorded",
                row.get::<i64, _>("id")
            ));
        }
        r.dunning_uncounted += uncounted.max(0);
    }

    // The lease history: no two terms of a role overlap.
    let terms = history::terms(su).await;
    r.terms = terms.len();
    for (role, a, b) in history::overlaps(&terms) {
        v.push(format!("{role}: term {b} began before term {a} ended"));
    }
    // A term still open is not an unclean end.
    let at = history::now();
    for t in terms
        .iter()
        .filter(|t| t.unclean() && (t.released.is_some() || t.expires <= at))
    {
        *r.unclean.entry(t.role.clone()).or_default() += 1;
    }
    let unclean_of = r.unclean.clone();
    let unclean = |role: &str| unclean_of.get(role).copied().unwrap_or(0);

    // Every event to every subscribed endpoint, at least once.
    for row in rows(
        su,
        "SELECT count(*) AS n FROM webhook_events WHERE dispatched_at IS NULL",
    )
    .await
    {
        let n: i64 = row.get("n");
        if n > 0 {
            v.push(format!("{n} webhook events were never fanned out"));
        }
    }
    for row in rows(
        su,
        "SELECT e.id AS event, ep.id AS endpoint FROM webhook_events e \
         JOIN webhook_endpoints ep ON ep.tenant_id = e.tenant_id AND ep.enabled \
          AND (cardinality(ep.event_types) = 0 OR e.event_type = ANY (ep.event_types)) \
          AND ep.created_at <= e.created_at \
         WHERE NOT EXISTS (SELECT 1 FROM webhook_deliveries d \
                           WHERE d.event_id = e.id AND d.endpoint_id = ep.id) \
         LIMIT 20",
    )
    .await
    {
        v.push(format!(
            "event {} has no delivery to endpoint {}",
            row.get::<i64, _>("event"),
            row.get::<i64, _>("endpoint")
        ));
    }
    let expected: Vec<(String, String, String)> = rows(
        su,
        "SELECT ep.url, e.message_id, d.status FROM webhook_deliveries d \
         JOIN webhook_events e ON e.id = d.event_id \
         JOIN webhook_endpoints ep ON ep.id = d.endpoint_id",
    )
    .await
    .iter()
    .map(|row| (row.get("url"), row.get("message_id"), row.get("status")))
    .collect();
    let mut received: HashMap<(String, String), usize> = HashMap::new();
    for req in rx.requests() {
        let id = req.try_header("webhook-id").unwrap_or("").to_owned();
        *received.entry((req.path.clone(), id)).or_default() += 1;
    }
    let base = rx.base_url();
    let mut missing = 0;
    for (url, id, status) in &expected {
        let path = url.strip_prefix(&base).unwrap_or(url).to_owned();
        match received.get(&(path.clone(), id.clone())) {
            Some(n) => r.webhook_duplicates += n - 1,
            None => {
                missing += 1;
                if missing <= 10 {
                    v.push(format!(
                        "event {id} never reached {path} (its delivery is {status})"
                    ));
                }
            }
        }
        if status != "delivered" && received.contains_key(&(path, id.clone())) {
            v.push(format!(
                "event {id} was received but its delivery is {status}"
            ));
        }
    }
    if missing > 10 {
        v.push(format!(
            "... {missing} deliveries in all never reached their endpoint"
        ));
    }
    r.deliveries = expected.len();
    if r.webhook_duplicates > unrecorded.deliveries && unclean("webhook_delivery") == 0 {
        v.push(format!(
            "{} webhook duplicates but no webhook_delivery term ended uncleanly \
             and {} outcomes went unwritten",
            r.webhook_duplicates, unrecorded.deliveries
        ));
    }

    // Every queued email sent, at least once.
    let mut sent: HashMap<String, usize> = HashMap::new();
    for m in sink.messages() {
        if let Some(id) = message_id(&m) {
            *sent.entry(id).or_default() += 1;
        }
    }
    let queued: Vec<(String, String)> = rows(su, "SELECT message_id, status FROM email_outbox")
        .await
        .iter()
        .map(|row| (row.get("message_id"), row.get("status")))
        .collect();
    let mut unsent = 0;
    for (id, status) in &queued {
        match sent.get(id) {
            Some(n) => r.email_duplicates += n - 1,
            None => {
                unsent += 1;
                if unsent <= 10 {
                    v.push(format!(
                        "email {id} never reached the sink (it is {status})"
                    ));
                }
            }
        }
        if status != "sent" && sent.contains_key(id) {
            v.push(format!("email {id} reached the sink but is {status}"));
        }
    }
    if unsent > 10 {
        v.push(format!("... {unsent} emails in all never reached the sink"));
    }
    r.emails = queued.len();
    if r.email_duplicates > unrecorded.emails && unclean("email_outbox") == 0 {
        v.push(format!(
            "{} email duplicates but no email_outbox term ended uncleanly \
             and {} send results went unwritten",
            r.email_duplicates, unrecorded.emails
        ));
    }
    r.violations = violations;
    r
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_message_id_is_read_from_its_header_whatever_its_case() {
        assert_eq!(
            message_id("From: a@b\r\nMessage-ID: <x@y>\r\n\r\nbody"),
            Some("<x@y>".to_owned())
        );
        assert_eq!(message_id("message-id:<x@y>"), Some("<x@y>".to_owned()));
        assert_eq!(message_id("Subject: hi"), None);
    }
}

/// The replicas' warnings counted as they are written (the email line is
/// the one a chaos run logged when a Postgres restart failed two result
/// writes of a clean term, whose 13 emails were then sent again).
#[test]
fn unwritten_results_are_counted_from_the_logs() {
    let logs = [
        "2026-12-03T21:18:12.310755Z  WARN tick{role=email_outbox token=1 tick=3}: \
         email_outbox::tick: could not record send results; those emails come due again \
         after their claim lease role=\"email_outbox\" error=error returned from database: \
         server login has been failing, try again later (server_login_retry) emails=5\n\
         2026-12-03T21:18:12.320915Z  WARN tick{role=email_outbox token=1 tick=3}: \
         email_outbox::tick: could not record send results; those emails come due again \
         after their claim lease role=\"email_outbox\" error=db emails=8\n"
            .to_owned(),
        "WARN webhook_delivery::outcomes: could not record a webhook attempt; the delivery \
         comes due again when its claim lease ends role=webhook_delivery delivery=7 attempt=1\n\
         WARN webhook_delivery::outcomes: could not record webhook attempts; their deliveries \
         come due again when their claim leases end role=webhook_delivery outcomes=40 error=x\n\
         WARN webhook_delivery::batch: a webhook outcome write did not finish; its deliveries \
         come due again when their claim leases end role=webhook_delivery outcomes=3 error=y\n\
         INFO email_outbox::tick: sent emails=500\n"
            .to_owned(),
    ];
    let u = Unrecorded::from_logs(&logs);
    assert_eq!((u.emails, u.deliveries), (13, 44));
}
