//! The guards: the fence on the claim, the compare-and-set on the result, and
//! the claim lease that brings back what a dead sender claimed.

use std::time::Duration;

use leader::Role;
use testbed::{MinimalSink, SmtpSink, TestDb};

use crate::{
    as_leader, config, drain, email, make_due, manager, queue, queue_numbered, rows, sender, tick,
};

/// A leader replaced by a takeover claims nothing with its old token, while
/// the new leader's claim takes the due emails.
///
/// Mutation check: removing `AND leader_fence($1, $2)` from `store::claim_due`
/// makes the old token claim all three; this test was run against that
/// mutation and failed, then the predicate was restored.
#[tokio::test]
async fn a_stale_token_claims_nothing_after_a_takeover() {
    let t = TestDb::new().await;
    let sink = SmtpSink::start();
    let emails: Vec<_> = (0..3).map(|i| email("ada@example.org", i)).collect();
    queue(&t.db, "tenant_a", &emails).await;
    let (s, _) = sender(&t.db, &sink.url(), None, config());
    let old = as_leader(
        &manager(&t.db, "old"),
        Role::EmailOutbox,
        |tick| async move { tick.fence },
    )
    .await;
    let s2 = s.clone();
    let (by_old, by_new) = as_leader(
        &manager(&t.db, "new"),
        Role::EmailOutbox,
        |tick| async move {
            assert!(tick.fence.token() > old.token());
            let by_old = s2.claim_due(&old, 10).await.unwrap().len();
            let by_new = s2.claim_due(&tick.fence, 10).await.unwrap().len();
            (by_old, by_new)
        },
    )
    .await;
    assert_eq!((by_old, by_new), (0, 3));
    assert!(rows(&t.db).await.iter().all(|r| r.attempts == 1));
}

/// Attempt 1 is claimed, its claim lease runs out (forced here) and attempt 2
/// is claimed. Attempt 1's send then completes while attempt 2 is still out:
/// the sink gets the message (at least once), but the result proving
/// `attempts = 1` matches no row and is counted stale, not applied; attempt 2's
/// result is applied.
///
/// Mutation check: removing `AND m.attempts = o.attempt` from
/// `store::record_results` lets attempt 1's result mark the email sent while
/// attempt 2 is out (`stale` stays 0); this test was run against that mutation
/// and failed, then the predicate was restored.
#[tokio::test]
async fn a_late_result_from_a_stale_attempt_is_refused_and_counted() {
    let t = TestDb::new().await;
    let sink = SmtpSink::start();
    queue(&t.db, "tenant_a", &[email("ada@example.org", 1)]).await;
    let (s, _) = sender(&t.db, &sink.url(), None, config());
    let s2 = s.clone();
    let first = as_leader(&manager(&t.db, "a"), Role::EmailOutbox, |tick| async move {
        s2.claim_due(&tick.fence, 10).await.unwrap()
    })
    .await;
    make_due(&t).await;
    let s3 = s.clone();
    let second = as_leader(&manager(&t.db, "b"), Role::EmailOutbox, |tick| async move {
        s3.claim_due(&tick.fence, 10).await.unwrap()
    })
    .await;
    assert_eq!((first[0].attempt, second[0].attempt), (1, 2));
    let late = s.send_claimed(first).await;
    assert_eq!((late.sent, late.stale), (0, 1));
    let r = &rows(&t.db).await[0];
    assert_eq!((r.status.as_str(), r.attempts), ("queued", 2));
    let newer = s.send_claimed(second).await;
    assert_eq!((newer.sent, newer.stale), (1, 0));
    let r = &rows(&t.db).await[0];
    assert_eq!((r.status.as_str(), r.attempts), ("sent", 2));
    assert_eq!(sink.messages().len(), 2, "both sends reached the server");
}

/// A sender that dies mid-batch (its tick dropped while sends are in flight)
/// leaves its claims to their lease; once the lease ends another sender sends
/// every email. Nothing is lost, and duplicates are bounded by the batches
/// the dead sender had claimed: two in flight at most (docs/adr/0068), each
/// of 10 here. (It said one batch of 20, and failed now and then once a
/// second batch was in flight.)
#[tokio::test]
async fn a_sender_dropped_mid_batch_loses_nothing() {
    let t = TestDb::new().await;
    let sink = SmtpSink::start();
    let emails: Vec<_> = (0..40)
        .map(|i| email(&format!("r{i}@example.org"), i))
        .collect();
    queue(&t.db, "tenant_a", &emails).await;
    let mut c = config();
    c.batch_size = 10;
    c.max_connections = 2;
    let (s, _) = sender(&t.db, &sink.url(), None, c.clone());
    let s2 = s.clone();
    let m = manager(&t.db, "dying");
    let _ = tokio::time::timeout(
        Duration::from_millis(150),
        as_leader(&m, Role::EmailOutbox, |tick| async move {
            s2.run_tick(&tick).await
        }),
    )
    .await;
    let before: usize = sink.messages().len();
    let claimed_unfinished = rows(&t.db)
        .await
        .iter()
        .filter(|r| r.status == "queued" && r.attempts > 0)
        .count();
    println!("dying sender: {before} emails reached the sink, {claimed_unfinished} left claimed");
    assert!(
        claimed_unfinished <= 20,
        "at most two batches are in flight"
    );
    // The lease ends (forced), then another sender takes over.
    let (s, _) = sender(&t.db, &sink.url(), None, c);
    drain(&t, &s, 10).await;
    assert!(rows(&t.db).await.iter().all(|r| r.status == "sent"));
    let received = sink.messages().len();
    let duplicates = received - 40;
    println!("{received} messages for 40 emails: {duplicates} duplicates");
    assert!(
        duplicates <= 20,
        "duplicates bounded by the claimed batches"
    );
}

/// Against a server slower than the batch's window, a send is started only
/// within `tick_budget` of the batch's start: the rest of the batch is handed
/// back unattempted (queued, its attempt not counted), not sent after the
/// claim lease could have ended, when another claim may hold the same email.
/// The next ticks send them.
///
/// Mutation check (`email_send_window`): without the window every email of
/// the batch is sent in the first tick; this test was run against that
/// mutation and failed, then the window was restored.
#[tokio::test]
async fn sends_not_started_within_the_budget_are_handed_back() {
    let t = TestDb::new().await;
    // Each send takes four replies (MAIL, RCPT, DATA, the message).
    let slow = MinimalSink::start(Duration::from_millis(40)).await;
    queue_numbered(&t.db, "tenant_a", "r", 12).await;
    let mut c = config();
    c.max_connections = 1;
    c.tick_budget = Duration::from_millis(300);
    let (s, _) = sender(&t.db, &slow.url(), None, c);
    let (_, report) = tick(&t.db, &s).await;
    let tally = &report.tally;
    println!("first tick: {tally:?}");
    assert_eq!(report.claimed, 12, "one batch held every email");
    assert!(tally.sent >= 1 && tally.sent < 12, "{tally:?}");
    assert_eq!(tally.sent + tally.handed_back, 12, "{tally:?}");
    let left: Vec<_> = rows(&t.db)
        .await
        .into_iter()
        .filter(|r| r.status == "queued")
        .collect();
    assert_eq!(left.len(), tally.handed_back);
    assert!(left.iter().all(|r| r.attempts == 0), "{left:?}");
    drain(&t, &s, 20).await;
    assert!(rows(&t.db).await.iter().all(|r| r.status == "sent"));
}

/// The ceiling: an email whose every attempt was claimed and none wrote a
/// result (a sender killed during each send, as out of memory) is not claimed
/// again; the claim marks it `failed`, `attempts_exhausted`, without sending.
/// An email with an attempt left is sent as usual. The test's config allows
/// three attempts (two retry delays).
///
/// Mutation check: removing `AND due.made < $7` from the claim's update
/// (mutation `email_ceiling`) sends the exhausted email a fourth time; seen
/// failing under it (docs/adr/0072). Such a failure is counted as any other
/// (docs/adr/0109); mutation `email_ceiling_uncounted` (the count dropped)
/// fails it too.
#[tokio::test]
async fn an_email_whose_every_attempt_died_is_failed_by_the_claim_not_sent() {
    let t = TestDb::new().await;
    let sink = SmtpSink::start();
    let ids = queue(
        &t.db,
        "tenant_a",
        &[
            email("ada@example.org", 1),
            email("bob@example.org", 2),
            email("cy@example.org", 3),
        ],
    )
    .await;
    sqlx::query("UPDATE email_outbox SET attempts = CASE id WHEN $1 THEN 3 ELSE 2 END")
        .bind(ids[0])
        .execute(&mut t.superuser().await)
        .await
        .unwrap();
    make_due(&t).await;
    let (s, metrics) = sender(&t.db, &sink.url(), None, config());
    let _ = tick(&t.db, &s).await;
    let rows = rows(&t.db).await;
    assert_eq!(
        states(&rows),
        vec![("failed", 3), ("sent", 3), ("sent", 3)],
        "{rows:?}"
    );
    // Counted as any failure, so `HardcountEmailsFailing` sees it, once:
    // the count is the statement's, on each of its rows (mutation
    // `email_ceiling_counted_per_row`, seen failing).
    let failed = "hardcount_emails_total{outcome=\"failed\",smtp_class=\"none\"} 1";
    assert!(
        metrics.render().lines().any(|l| l == failed),
        "{}",
        metrics.render()
    );
    assert!(
        rows[0]
            .reply_text
            .as_deref()
            .is_some_and(|t| t.starts_with("attempts_exhausted")),
        "{rows:?}"
    );
    assert_eq!(
        sink.messages().len(),
        2,
        "only the emails with an attempt left"
    );
}

/// The claim walks tenants a statement at a time, each committed on its own
/// (docs/adr/0048). An email the first statement failed at its ceiling stays
/// failed when a later statement of the same claim errors, so it is counted
/// then too (docs/adr/0141): here the claim takes one tenant a statement
/// (`limit` 1), tenant_a's only due email is at its ceiling, and a trigger
/// makes the claim of tenant_b's email raise.
///
/// Mutation check: counted only when the walk returned
/// (`email_ceiling_lost_on_error`) leaves the failure uncounted; seen
/// failing under it.
#[tokio::test]
async fn an_email_failed_at_its_ceiling_is_counted_when_the_claim_then_errors() {
    let t = TestDb::new().await;
    let sink = SmtpSink::start();
    let spent = queue(&t.db, "tenant_a", &[email("ada@example.org", 1)]).await;
    queue(&t.db, "tenant_b", &[email("bob@example.org", 2)]).await;
    t.refuse_updates(
        "email_outbox",
        "refuse_tenant_b",
        "NEW.tenant_id = 'tenant_b'",
    )
    .await;
    sqlx::query("UPDATE email_outbox SET attempts = 3, next_attempt_at = now() WHERE id = $1")
        .bind(spent[0])
        .execute(&mut t.superuser().await)
        .await
        .unwrap();
    let (s, metrics) = sender(&t.db, &sink.url(), None, config());
    let s2 = s.clone();
    let claimed = as_leader(&manager(&t.db, "a"), Role::EmailOutbox, |tick| async move {
        s2.claim_due(&tick.fence, 1).await
    })
    .await;
    let error = claimed.expect_err("tenant_b's claim raises").to_string();
    assert!(error.contains("refused for the test"), "{error}");
    let rows = rows(&t.db).await;
    assert_eq!(
        states(&rows),
        vec![("failed", 3), ("queued", 0)],
        "tenant_a's statement committed before tenant_b's raised: {rows:?}"
    );
    let failed = "hardcount_emails_total{outcome=\"failed\",smtp_class=\"none\"} 1";
    assert!(
        metrics.render().lines().any(|l| l == failed),
        "{}",
        metrics.render()
    );
}

/// A resend (the API's: back to queued, `resent_at_attempt = attempts`) of an
/// email whose attempts were spent gets its one more attempt: the ceiling
/// counts the claims since the resend (migration 0041).
///
/// Mutation check: counting `made` from zero again (`m.attempts AS made`,
/// mutation `email_ceiling_resend`) fails the resent email at its claim,
/// `attempts_exhausted`, with nothing sent; seen failing under it.
#[tokio::test]
async fn a_resent_email_whose_attempts_were_spent_is_sent() {
    let t = TestDb::new().await;
    let sink = SmtpSink::start();
    queue(&t.db, "tenant_a", &[email("ada@example.org", 1)]).await;
    for q in [
        "UPDATE email_outbox SET status = 'failed', attempts = 3",
        "UPDATE email_outbox SET status = 'queued', next_attempt_at = now(), \
                resent_at_attempt = attempts",
    ] {
        sqlx::query(q)
            .execute(&mut t.superuser().await)
            .await
            .unwrap();
    }
    let rows = after_one_tick(&t, &sink).await;
    assert_eq!(states(&rows), vec![("sent", 4)], "{rows:?}");
    assert_eq!(sink.messages().len(), 1);
}

/// One tick of a sender to `sink`; then every email's row.
async fn after_one_tick(t: &TestDb, sink: &SmtpSink) -> Vec<crate::Row_> {
    let (s, _) = sender(&t.db, &sink.url(), None, config());
    let _ = tick(&t.db, &s).await;
    rows(&t.db).await
}

/// Each email's (status, attempts), in id order.
fn states(rows: &[crate::Row_]) -> Vec<(&str, i32)> {
    rows.iter()
        .map(|r| (r.status.as_str(), r.attempts))
        .collect()
}
