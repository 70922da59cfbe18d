//! The guards: the fence on enrolment and the funnel, and the attempt
//! compare-and-set (a stale leader racing the new one on the same run).

use std::time::Duration;

use db::{Row, sql};
use fake_provider::{Behaviour, FakeProvider};
use leader::Role;
use testbed::TestDb;

use crate::{
    as_leader, config, declined_invoice, dunner, dunning_emails, events, manager, policy, run_of,
    tick,
};

const CALL: Duration = Duration::from_secs(5);

/// A leader replaced by a takeover lists and enrols nothing with its old
/// token, while the new leader's funnel lists the due run.
///
/// Mutation check: `dunning_funnel_fence` (removing `AND leader_fence($1, $2)`
/// from `listing::list_due`) makes the old token list the run; seen failing
/// under it.
#[tokio::test]
async fn a_stale_token_lists_and_enrols_nothing_after_a_takeover() {
    let t = TestDb::new().await;
    let p = FakeProvider::start().await.unwrap();
    policy(&t.db, "tenant_a", 2, "pause_collection").await;
    declined_invoice(&t.db, "tenant_a").await;
    let second = declined_invoice(&t.db, "tenant_a").await;
    let (d, _) = dunner(&t.db, &p, CALL, config());
    let d2 = d.clone();
    let old = as_leader(&manager(&t.db, "old"), Role::Dunning, |tick| async move {
        assert_eq!(d2.enrol(&tick.fence).await.unwrap(), 2);
        tick.fence
    })
    .await;
    // A decline after the takeover: only the new leader enrols it.
    sqlx::query("DELETE FROM dunning_runs WHERE invoice_id = $1")
        .bind(second.invoice)
        .execute(&mut t.superuser().await)
        .await
        .unwrap();
    let (listed_old, enrolled_old, listed_new, enrolled_new) =
        as_leader(&manager(&t.db, "new"), Role::Dunning, |tick| async move {
            assert!(tick.fence.token() > old.token());
            let listed_old = d.list_due(&old, 10).await.unwrap().len();
            let enrolled_old = d.enrol(&old).await.unwrap();
            let enrolled_new = d.enrol(&tick.fence).await.unwrap();
            let listed_new = d.list_due(&tick.fence, 10).await.unwrap().len();
            (listed_old, enrolled_old, listed_new, enrolled_new)
        })
        .await;
    assert_eq!(
        (listed_old, enrolled_old, listed_new, enrolled_new),
        (0, 0, 2, 1)
    );
    assert_eq!(p.total_charges(), 0);
}

/// The old leader listed a due run before it was replaced and retries it
/// from that listing, concurrently with the new leader retrying the same run
/// (which declines): one attempt recorded, one request to the provider, one
/// warning email, one `dunning.attempt_failed`. Then the old leader retries
/// again from its listing and writes nothing.
///
/// Mutation check: `dunning_attempt_cas` (removing `AND r.attempt_count =
/// u.expected` from `charge::record_attempts_in`) lets both count an attempt;
/// seen failing under it.
#[tokio::test]
async fn a_stale_leader_and_the_new_leader_retry_the_same_run_once() {
    let t = TestDb::new().await;
    let p = FakeProvider::start().await.unwrap();
    policy(&t.db, "tenant_a", 3, "pause_collection").await;
    let a = declined_invoice(&t.db, "tenant_a").await;
    p.set_behaviour(&a.customer, Behaviour::Decline("insufficient_funds".into()));
    let (d, _) = dunner(&t.db, &p, CALL, config());
    let d2 = d.clone();
    let stale = as_leader(&manager(&t.db, "old"), Role::Dunning, |tick| async move {
        d2.enrol(&tick.fence).await.unwrap();
        d2.list_due(&tick.fence, 10).await.unwrap()
    })
    .await;
    assert_eq!(stale.len(), 1);
    let again = stale[0].clone();
    let d2 = d.clone();
    let (by_old, by_new) = as_leader(&manager(&t.db, "new"), Role::Dunning, |tick| async move {
        let fresh = d2.list_due(&tick.fence, 10).await.unwrap();
        // The same run as listed, but for the clock reading each listing took.
        let as_listed = |runs: &[dunning::Run]| -> Vec<dunning::Run> {
            runs.iter()
                .map(|r| dunning::Run {
                    clock_skew: fresh[0].clock_skew,
                    ..r.clone()
                })
                .collect()
        };
        assert_eq!(as_listed(&fresh), as_listed(&stale));
        tokio::join!(d2.retry(&stale[0]), d2.retry(&fresh[0]))
    })
    .await;
    let outcomes = [by_old.unwrap(), by_new.unwrap()];
    assert_eq!(
        outcomes
            .iter()
            .filter(|o| matches!(o, dunning::Retry::Declined { .. }))
            .count(),
        1,
        "{outcomes:?}"
    );
    // A retry after the first one, from the same stale listing, finds another count.
    assert_eq!(d.retry(&again).await.unwrap(), dunning::Retry::Lost);
    assert_eq!(run_of(&t.db, a.invoice).await, ("active".to_owned(), 1));
    // One request to the provider (billing's attempt 1 plus one retry).
    assert_eq!(crate::attempts(&t.db, a.invoice).await.len(), 2);
    assert_eq!(crate::attempt_key(&t.db, a.invoice, 3).await, None);
    assert_eq!(dunning_emails(&t.db).await.len(), 1);
    assert_eq!(
        events(&t.db).await,
        ["dunning.started", "dunning.attempt_failed"]
    );
}

/// Three runs listed by a leader that was then replaced; the new leader's
/// tick retries them as one batch while the old leader retries each from its
/// listing. Every retry succeeds at the provider. Each run is counted once,
/// charged once (three charges at the provider), recovered once, with one
/// `dunning.recovered` and one receipt each.
///
/// Not a mutation pin: whichever retry counts a run first, its hold keeps the
/// run out of the other's listing, so the compare-and-set is not always what
/// stops the second (`a_stale_leader_and_the_new_leader_retry_the_same_run_once`
/// pins it, through the same batched statement).
#[tokio::test]
async fn a_stale_leaders_retries_racing_the_new_leaders_batch_charge_each_run_once() {
    let t = TestDb::new().await;
    let p = FakeProvider::start().await.unwrap();
    policy(&t.db, "tenant_a", 3, "pause_collection").await;
    let mut invoices = Vec::new();
    for _ in 0..3 {
        invoices.push(declined_invoice(&t.db, "tenant_a").await.invoice);
    }
    let (d, _) = dunner(&t.db, &p, CALL, config());
    let d2 = d.clone();
    let stale = as_leader(&manager(&t.db, "old"), Role::Dunning, |tick| async move {
        d2.enrol(&tick.fence).await.unwrap();
        d2.list_due(&tick.fence, 10).await.unwrap()
    })
    .await;
    assert_eq!(stale.len(), 3);
    let d2 = d.clone();
    let (by_old, report) = as_leader(&manager(&t.db, "new"), Role::Dunning, |tick| async move {
        let old = futures::future::join_all(stale.iter().map(|r| d2.retry(r)));
        tokio::join!(old, d2.run_tick(&tick))
    })
    .await;
    let recovered_by_old = by_old
        .into_iter()
        .filter(|r| matches!(r, Ok(dunning::Retry::Recovered)))
        .count();
    assert_eq!(recovered_by_old + report.tally.recovered, 3, "{report:?}");
    for invoice in &invoices {
        assert_eq!(run_of(&t.db, *invoice).await, ("recovered".to_owned(), 1));
        // Billing's declined attempt 1 and one retry.
        assert_eq!(crate::attempts(&t.db, *invoice).await.len(), 2);
    }
    assert_eq!(p.total_charges(), 3, "{:?}", p.charges());
    let events = events(&t.db).await;
    assert_eq!(
        events.iter().filter(|e| *e == "dunning.recovered").count(),
        3,
        "{events:?}"
    );
    let receipts = crate::strings(
        &t.db,
        "SELECT subject FROM email_outbox WHERE subject LIKE 'Receipt%'",
    )
    .await;
    assert_eq!(receipts.len(), 3, "{receipts:?}");
}

/// Two runs declined in one batch; a trigger refuses one run's decline
/// (`do_not_honor`), so the batch's outcome transaction fails, and so does
/// that run's own transition in the fallback. That run is left as its record
/// wrote it: counted, held, owing its decline (docs/adr/0120), nothing
/// announced yet; the other run's decline, written by the fallback, is
/// counted once and stays. Once the hold has passed, the first run's decline
/// is announced once with the policy's warning and next retry, and its retry
/// is not charged a second time.
///
/// Mutation check: `fallback_rewinds_failed` (the fallback rewinds such a
/// run, as before: retry 1 was charged again at once and its first decline
/// never announced) fails it.
#[tokio::test]
async fn when_the_outcome_and_its_fallback_both_fail_the_decline_is_announced_after_the_hold() {
    let t = TestDb::new().await;
    let p = FakeProvider::start().await.unwrap();
    policy(&t.db, "tenant_a", 3, "pause_collection").await;
    let x = declined_invoice(&t.db, "tenant_a").await;
    let y = declined_invoice(&t.db, "tenant_a").await;
    p.set_behaviour(&x.customer, Behaviour::Decline("do_not_honor".into()));
    p.set_behaviour(&y.customer, Behaviour::Decline("insufficient_funds".into()));
    crate::refuse_run_updates(
        &t,
        "refuse_do_not_honor",
        "NEW.last_decline_code = 'do_not_honor'",
    )
    .await;
    let (d, _) = dunner(&t.db, &p, CALL, config());
    let r = tick(&t.db, &d).await;
    assert_eq!((r.tally.errors, r.tally.declined), (1, 1), "{r:?}");
    assert_eq!(p.create_requests(), 2);
    // Counted and held by its record, owing retry 1's decline.
    assert_eq!(run_of(&t.db, x.invoice).await, ("active".to_owned(), 1));
    let held = crate::next_retry_in(&t.db, x.invoice).await;
    assert!(
        held > 120.0,
        "held for attempt_hold, not the policy's gap: {held}"
    );
    let owed: Option<i32> =
        t.db.fetch_one(
            sql("SELECT owed_notice_attempt FROM dunning_runs WHERE invoice_id = $1")
                .bind(x.invoice),
        )
        .await
        .unwrap()
        .get(0);
    assert_eq!(owed, Some(1));
    assert_eq!(run_of(&t.db, y.invoice).await, ("active".to_owned(), 1));
    // Retry 2 is the policy's gap (60 s) after retry 1, made an hour late.
    let next = crate::next_retry_in(&t.db, y.invoice).await;
    assert!((55.0..=60.0).contains(&next), "{next}");
    assert_eq!(
        events(&t.db).await,
        [
            "dunning.started",
            "dunning.started",
            "dunning.attempt_failed"
        ]
    );
    crate::allow_run_updates(&t, "refuse_do_not_honor").await;
    p.set_behaviour(&x.customer, Behaviour::Decline("card_declined".into()));
    crate::due_now(&t.db).await;
    let r = tick(&t.db, &d).await;
    // x's decline announced from its attempt, y's retry 2 declined.
    assert_eq!(r.tally.declined, 2, "{r:?}");
    assert_eq!(p.create_requests(), 3, "x's retry 1 charged twice");
    assert_eq!(crate::attempts(&t.db, x.invoice).await.len(), 2);
    assert_eq!(run_of(&t.db, x.invoice).await, ("active".to_owned(), 1));
    let next = crate::next_retry_in(&t.db, x.invoice).await;
    assert!((55.0..=60.0).contains(&next), "{next}");
    let last_code: Option<String> =
        t.db.fetch_one(
            sql("SELECT last_decline_code FROM dunning_runs WHERE invoice_id = $1").bind(x.invoice),
        )
        .await
        .unwrap()
        .get(0);
    assert_eq!(last_code.as_deref(), Some("do_not_honor"));
    assert_eq!(run_of(&t.db, y.invoice).await, ("active".to_owned(), 2));
    let failed = events(&t.db)
        .await
        .into_iter()
        .filter(|e| e == "dunning.attempt_failed")
        .count();
    assert_eq!(failed, 3);
    let warnings = dunning_emails(&t.db).await;
    assert_eq!(
        warnings
            .iter()
            .filter(|s| s.contains(&x.invoice.to_string()))
            .count(),
        1,
        "{warnings:?}"
    );
    assert_eq!(tick(&t.db, &d).await.claimed, 0);
}

/// The last retry's decline, where the exhaustion and its one-run fallback
/// both fail: the run is left counted and held (docs/adr/0120). Once the hold
/// has passed, the listing finds it spent and exhausts it, with its final
/// notice; the card is not charged past the policy. (ADR 0026 rewound such a
/// run because a counted run with no schedule was charged again; the listing
/// of docs/adr/0115 reads its outcome instead.) Mutation
/// `exhaust_left_rewound` (the exhaustion's failure rewinds the run) fails
/// it; so would `fallback_rewinds_failed`, whose anchor takes the
/// exhaustion's result too.
#[tokio::test]
async fn when_the_last_retrys_exhaustion_and_its_fallback_fail_the_run_is_exhausted_after_the_hold()
{
    let t = TestDb::new().await;
    let p = FakeProvider::start().await.unwrap();
    policy(&t.db, "tenant_a", 1, "pause_collection").await;
    let x = declined_invoice(&t.db, "tenant_a").await;
    p.set_behaviour(&x.customer, Behaviour::Decline("insufficient_funds".into()));
    crate::refuse_run_updates(&t, "refuse_exhaust", "NEW.status = 'exhausted'").await;
    let (d, _) = dunner(&t.db, &p, CALL, config());
    let r = tick(&t.db, &d).await;
    assert_eq!(r.tally.errors, 1, "{r:?}");
    assert_eq!(p.create_requests(), 1);
    assert_eq!(run_of(&t.db, x.invoice).await, ("active".to_owned(), 1));
    crate::allow_run_updates(&t, "refuse_exhaust").await;
    crate::due_now(&t.db).await;
    tick(&t.db, &d).await;
    assert_eq!(p.create_requests(), 1, "charged past the policy");
    assert_eq!(run_of(&t.db, x.invoice).await.0, "exhausted");
    assert!(
        events(&t.db)
            .await
            .contains(&"dunning.exhausted".to_owned()),
        "{:?}",
        events(&t.db).await
    );
    assert_eq!(tick(&t.db, &d).await.claimed, 0);
    assert_eq!(p.create_requests(), 1);
}

/// Two runs without a payment method, counted not attempted in one batch; a
/// trigger refuses one run's count every time (a row that breaks a check).
/// The batch's transaction fails, and the other run is still counted, one
/// run at a time; the refused run stays as listed (docs/adr/0120). The batch
/// had left both as listed on every tick, so one bad row held back every run
/// listed with it. Mutation `not_attempted_no_fallback` (the per-run
/// fallback gone) fails it.
#[tokio::test]
async fn a_run_whose_count_always_fails_does_not_hold_back_the_others() {
    let t = TestDb::new().await;
    let p = FakeProvider::start().await.unwrap();
    policy(&t.db, "tenant_a", 2, "mark_uncollectible").await;
    let x = declined_invoice(&t.db, "tenant_a").await;
    let y = declined_invoice(&t.db, "tenant_a").await;
    crate::remove_payment_method(&t.db, &x.customer).await;
    crate::remove_payment_method(&t.db, &y.customer).await;
    crate::refuse_run_updates(
        &t,
        "refuse_x",
        &format!(
            "NEW.invoice_id = {} AND NEW.attempt_count > OLD.attempt_count",
            x.invoice
        ),
    )
    .await;
    let (d, _) = dunner(&t.db, &p, CALL, config());
    let r = tick(&t.db, &d).await;
    assert_eq!((r.tally.not_attempted, r.tally.errors), (1, 1), "{r:?}");
    assert_eq!(run_of(&t.db, x.invoice).await, ("active".to_owned(), 0));
    assert_eq!(run_of(&t.db, y.invoice).await, ("active".to_owned(), 1));
    crate::due_now(&t.db).await;
    tick(&t.db, &d).await;
    assert_eq!(run_of(&t.db, x.invoice).await, ("active".to_owned(), 0));
    assert_eq!(run_of(&t.db, y.invoice).await.0, "exhausted");
    assert_eq!(p.create_requests(), 0);
}

/// A crash after billing settled a retry's decline and before dunning wrote
/// it (here: a trigger refuses the outcome, its fallback and the rewind, so
/// the run is left as its record wrote it). Once the hold has passed, the
/// listing finds the decline unannounced: it is announced once, with the
/// policy's warning, and the next retry is the policy's gap from then; the
/// card is not charged again at once (docs/adr/0115).
///
/// Mutation check: `record_owes_nothing` (the record leaves
/// `owed_notice_attempt` alone, as before: the next tick charged retry 2 at
/// once and retry 1's decline was never announced) seen failing it.
#[tokio::test]
async fn a_decline_settled_before_a_crash_is_announced_after_the_hold() {
    let t = TestDb::new().await;
    let p = FakeProvider::start().await.unwrap();
    policy(&t.db, "tenant_a", 3, "pause_collection").await;
    let x = declined_invoice(&t.db, "tenant_a").await;
    p.set_behaviour(&x.customer, Behaviour::Decline("insufficient_funds".into()));
    crate::refuse_run_updates(
        &t,
        "refuse_all_but_records",
        "NEW.attempt_count <= OLD.attempt_count",
    )
    .await;
    let (d, _) = dunner(&t.db, &p, CALL, config());
    let r = tick(&t.db, &d).await;
    assert_eq!(r.tally.errors, 1, "{r:?}");
    assert_eq!(p.create_requests(), 1);
    assert_eq!(run_of(&t.db, x.invoice).await, ("active".to_owned(), 1));
    assert_eq!(events(&t.db).await, ["dunning.started"]);
    crate::allow_run_updates(&t, "refuse_all_but_records").await;
    crate::due_now(&t.db).await;
    let r = tick(&t.db, &d).await;
    assert_eq!(r.tally.declined, 1, "{r:?}");
    assert_eq!(p.create_requests(), 1, "retry 2 charged at once");
    assert_eq!(run_of(&t.db, x.invoice).await, ("active".to_owned(), 1));
    let next = crate::next_retry_in(&t.db, x.invoice).await;
    assert!((55.0..=60.0).contains(&next), "{next}");
    assert_eq!(
        events(&t.db).await,
        ["dunning.started", "dunning.attempt_failed"]
    );
    assert_eq!(
        dunning_emails(&t.db).await,
        [format!(
            "Payment for invoice {} failed: we will retry",
            x.invoice
        )]
    );
    assert_eq!(tick(&t.db, &d).await.claimed, 0);
}

/// A retry refused by the provider (400: not a decline, so nothing is sent
/// to the customer, docs/adr/0024) whose outcome, fallback and rewind all
/// failed leaves the run as its record wrote it: counted, owing the
/// attempt's notices, the attempt `failed` and the invoice under review.
/// The listing does not take that for a decline to announce: no
/// `dunning.attempt_failed`, no warning "(failed)", nothing charged
/// (docs/adr/0141). Mutation `owed_notice_of_a_refusal` (any settled last
/// attempt announced, as before) fails here.
#[tokio::test]
async fn a_refused_retry_left_owing_its_notices_is_not_announced_as_a_decline() {
    let (t, p, d) = owing_retry_2(
        "'failed', now(), now(), NULL, NULL, NULL, \
         'HTTP 400 invalid_request_error amount_too_large'",
        "review_since = now(), review_reason = 'HTTP 400 invalid_request_error amount_too_large'",
    )
    .await;
    tick(&t.db, &d).await;
    assert_eq!(events(&t.db).await, ["dunning.started"]);
    assert_eq!(dunning_emails(&t.db).await, Vec::<String>::new());
    assert_eq!(p.create_requests(), 0);
}

/// An owed decline an operator settled: a retry answered `processing`, sent
/// to review and settled by an operator as not charged (`failed`, with
/// `reviewed_at`) owes its notices as docs/adr/0085 says. It is announced,
/// with the policy's warning and the next retry the policy's gap away, and
/// not charged at once (docs/adr/0141 keeps it beside the refusal above).
/// Mutation `owed_notice_of_an_operators_settle` (only `declined` announced)
/// charges it at once and announces nothing; seen failing under it.
#[tokio::test]
async fn an_owed_decline_an_operator_settled_is_announced() {
    let (t, p, d) = owing_retry_2(
        "'failed', now(), now(), now(), 'ops', 'hardcount_operator', NULL",
        "review_since = NULL",
    )
    .await;
    tick(&t.db, &d).await;
    assert_eq!(
        events(&t.db).await,
        ["dunning.started", "dunning.attempt_failed"]
    );
    assert_eq!(dunning_emails(&t.db).await.len(), 1);
    assert_eq!(p.create_requests(), 0, "not charged at once");
}

/// A run whose retry 1 was counted and owes its notices, its attempt 2
/// settled as `attempt` says (status, resolved, first sent, reviewed at, by,
/// by role, last error: SQL values) and its invoice updated by `invoice`
/// (SQL assignments): what a record leaves when what followed it was not
/// written. Due now; three retries, warning after each.
async fn owing_retry_2(attempt: &str, invoice: &str) -> (TestDb, FakeProvider, dunning::Dunner) {
    let t = TestDb::new().await;
    let p = FakeProvider::start().await.unwrap();
    policy(&t.db, "tenant_a", 3, "pause_collection").await;
    let x = declined_invoice(&t.db, "tenant_a").await;
    let (d, _) = dunner(&t.db, &p, CALL, config());
    crate::enrol(&t.db, &d).await;
    sqlx::raw_sql(sqlx::AssertSqlSafe(format!(
        "INSERT INTO payment_attempts (tenant_id, invoice_id, attempt_seq, idempotency_key, \
                                       amount, currency, provider_status, resolved_at, \
                                       first_sent_at, reviewed_at, reviewed_by, \
                                       reviewed_by_role, last_error) \
         VALUES ('tenant_a', {i}, 2, 'hardcount-invoice-{i}-attempt-2', 1200, 'EUR', {attempt}); \
         UPDATE invoices SET attempt_count = 2, {invoice} WHERE id = {i}; \
         UPDATE dunning_runs SET attempt_count = 1, owed_notice_attempt = 1, \
                next_attempt_at = now() - interval '1 minute' WHERE invoice_id = {i}",
        i = x.invoice
    )))
    .execute(&mut t.superuser().await)
    .await
    .unwrap();
    (t, p, d)
}

/// A retry recorded and then rewound (billing found its invoice held by
/// another claim, so no call was made) keeps no mark that its decline is
/// owed: the count goes back, and a mark left at the count it had would, once
/// a retry is counted without a call (a customer without a card), take the
/// run for one whose decline waits to be announced (docs/adr/0115).
/// Mutation `rewind_keeps_owed` seen failing it.
#[tokio::test]
async fn a_run_rewound_after_its_record_owes_nothing() {
    let t = TestDb::new().await;
    let p = FakeProvider::start().await.unwrap();
    policy(&t.db, "tenant_a", 3, "pause_collection").await;
    let x = declined_invoice(&t.db, "tenant_a").await;
    let mut su = t.superuser().await;
    sqlx::query(
        "UPDATE invoices SET auto_charge_claimed_by = 'another claim', \
                auto_charge_claimed_until = now() + interval '1 hour' WHERE id = $1",
    )
    .bind(x.invoice)
    .execute(&mut su)
    .await
    .unwrap();
    let (d, _) = dunner(&t.db, &p, CALL, config());
    tick(&t.db, &d).await;
    assert_eq!(p.create_requests(), 0);
    assert_eq!(run_of(&t.db, x.invoice).await, ("active".to_owned(), 0));
    let owed: Option<i32> =
        t.db.fetch_one(
            sql("SELECT owed_notice_attempt FROM dunning_runs WHERE invoice_id = $1")
                .bind(x.invoice),
        )
        .await
        .unwrap()
        .get(0);
    assert_eq!(owed, None);
}
