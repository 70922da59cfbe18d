//! Exhaustion: the final action runs once, also when its step is retried
//! after a crash between the exhaustion and the action.

use std::time::Duration;

use db::{Row, sql};
use fake_provider::{Behaviour, FakeProvider};
use leader::Role;
use testbed::TestDb;

use crate::{
    as_leader, config, declined_invoice, dunner, dunning_emails, events, invoice_status, manager,
    policy, run_of, tick,
};

const CALL: Duration = Duration::from_secs(5);

async fn paused_by(db: &db::Db, subscription: i64) -> Option<String> {
    db.fetch_one(
        sql("SELECT pause_collection_set_by FROM subscriptions WHERE id = $1").bind(subscription),
    )
    .await
    .unwrap()
    .get(0)
}

/// Two retries, both declined: the run is exhausted and pauses collection
/// once, with one `subscription.collection_paused`, one final notice.
/// The step retried (its stamp cleared, as if it had never committed) finds
/// the pause in force and writes nothing.
#[tokio::test]
async fn exhaustion_runs_the_final_action_once() {
    let t = TestDb::new().await;
    let p = FakeProvider::start().await.unwrap();
    policy(&t.db, "tenant_a", 2, "pause_collection").await;
    // The final notice links no payment page: nothing charges the invoice
    // after the final action, so a new payment method would not pay it
    // (docs/adr/0150).
    testbed::payments::set_payment_page(&t, "tenant_a", "https://acme.example/pay/{invoice}").await;
    let a = declined_invoice(&t.db, "tenant_a").await;
    p.set_behaviour(&a.customer, Behaviour::Decline("card_declined".into()));
    let (d, metrics) = dunner(&t.db, &p, CALL, config());
    assert_eq!(tick(&t.db, &d).await.tally.declined, 1);
    crate::due_now(&t.db).await;
    let r = tick(&t.db, &d).await;
    assert_eq!(r.tally.exhausted, 1, "{r:?}");
    assert_eq!(run_of(&t.db, a.invoice).await, ("exhausted".to_owned(), 2));
    assert_eq!(
        paused_by(&t.db, a.subscription).await.as_deref(),
        Some("dunning")
    );
    t.db.execute(
        sql("UPDATE dunning_runs SET final_action_at = NULL WHERE invoice_id = $1").bind(a.invoice),
    )
    .await
    .unwrap();
    let r = tick(&t.db, &d).await;
    assert_eq!(r.tally.final_actions, 1, "{r:?}");
    assert_eq!(tick(&t.db, &d).await.claimed, 0);
    assert_eq!(
        events(&t.db).await,
        [
            "dunning.started",
            "dunning.attempt_failed",
            "dunning.exhausted",
            "subscription.collection_paused"
        ]
    );
    assert_eq!(
        dunning_emails(&t.db).await,
        [
            format!("Payment for invoice {} failed: we will retry", a.invoice),
            format!("Final notice for invoice {}", a.invoice)
        ]
    );
    // Those two are every email: billing sends none for a retry's decline,
    // whose "we will try again" would be untrue after the last (docs/adr/0114;
    // mutation `retry_decline_billing_email`).
    let all = crate::strings(&t.db, "SELECT subject FROM email_outbox ORDER BY id").await;
    assert_eq!(all, dunning_emails(&t.db).await);
    let last = crate::strings(
        &t.db,
        "SELECT text_body FROM email_outbox ORDER BY id DESC LIMIT 1",
    )
    .await;
    assert!(
        last[0].ends_with("remains unpaid.\n") && !last[0].contains("https://"),
        "{last:?}"
    );
    assert_eq!(crate::attempts(&t.db, a.invoice).await.len(), 3);
    let rendered = metrics.render();
    assert!(
        rendered
            .contains("hardcount_dunning_exhaustions_total{final_action=\"pause_collection\"} 1"),
        "{rendered}"
    );
}

/// A crash after the exhaustion committed and before its final action: the
/// run is exhausted with the action owed. The old leader (from its listing)
/// and the new leader's tick run the step concurrently: the invoice is
/// written off once, announced once; nothing is charged.
#[tokio::test]
async fn a_final_action_owed_after_a_crash_runs_once_under_a_race() {
    let t = TestDb::new().await;
    let p = FakeProvider::start().await.unwrap();
    policy(&t.db, "tenant_a", 2, "mark_uncollectible").await;
    let a = declined_invoice(&t.db, "tenant_a").await;
    let (d, _) = dunner(&t.db, &p, CALL, config());
    let d2 = d.clone();
    as_leader(
        &manager(&t.db, "enroller"),
        Role::Dunning,
        |tick| async move { d2.enrol(&tick.fence).await.unwrap() },
    )
    .await;
    // What the exhaustion's transaction leaves behind.
    t.db.execute(
        sql(
            "UPDATE dunning_runs SET status = 'exhausted', attempt_count = 2, ended_at = now(), \
                    last_decline_code = 'card_declined' WHERE invoice_id = $1",
        )
        .bind(a.invoice),
    )
    .await
    .unwrap();
    let d2 = d.clone();
    let stale = as_leader(&manager(&t.db, "old"), Role::Dunning, |tick| async move {
        d2.list_due(&tick.fence, 10).await.unwrap()
    })
    .await;
    assert_eq!(stale.len(), 1);
    let d2 = d.clone();
    let (by_old, by_new) = as_leader(&manager(&t.db, "new"), Role::Dunning, |tick| async move {
        tokio::join!(d2.retry(&stale[0]), d2.run_tick(&tick))
    })
    .await;
    let by_old = by_old.unwrap();
    assert!(
        matches!(by_old, dunning::Retry::FinalAction(_)),
        "{by_old:?}"
    );
    // The new tick listed the run only if the old step had not committed yet.
    assert!(
        by_new.tally.final_actions + by_new.tally.lost <= 1,
        "{by_new:?}"
    );
    assert_eq!(invoice_status(&t.db, a.invoice).await, "uncollectible");
    let written: i64 = t
        .db
        .fetch_one(sql(
            "SELECT count(*) AS n FROM webhook_events WHERE event_type = 'invoice.marked_uncollectible'",
        ))
        .await
        .unwrap()
        .get("n");
    assert_eq!(written, 1);
    assert_eq!(crate::attempts(&t.db, a.invoice).await.len(), 1);
    assert_eq!(tick(&t.db, &d).await.claimed, 0);
}

/// A final action owed (cancel the subscription) on an invoice that was
/// voided in the meantime writes nothing: the subscription stays active,
/// nothing is announced, no final notice is sent, and the step is stamped so
/// it is not owed again. (An invoice paid meanwhile ends the run recovered
/// instead: `a_held_write_off_then_paid_recovers_the_run`.)
///
/// Mutation check: `dunning_notice_when_changed` (the final action's
/// transaction queues the notice whether or not the action changed
/// anything) sends a final notice here; seen failing under it.
#[tokio::test]
async fn a_final_action_finds_the_invoice_voided_and_writes_nothing() {
    let t = TestDb::new().await;
    let p = FakeProvider::start().await.unwrap();
    policy(&t.db, "tenant_a", 1, "cancel_subscription").await;
    let a = declined_invoice(&t.db, "tenant_a").await;
    let (d, _) = dunner(&t.db, &p, CALL, config());
    let d2 = d.clone();
    as_leader(
        &manager(&t.db, "enroller"),
        Role::Dunning,
        |tick| async move { d2.enrol(&tick.fence).await.unwrap() },
    )
    .await;
    t.db.execute(
        sql(
            "UPDATE dunning_runs SET status = 'exhausted', attempt_count = 1, ended_at = now() \
             WHERE invoice_id = $1",
        )
        .bind(a.invoice),
    )
    .await
    .unwrap();
    t.db.execute(
        sql("UPDATE invoices SET status = 'void', closed_at = now() WHERE id = $1").bind(a.invoice),
    )
    .await
    .unwrap();
    let r = tick(&t.db, &d).await;
    assert_eq!(r.tally.final_actions, 1, "{r:?}");
    let sub: String =
        t.db.fetch_one(sql("SELECT status FROM subscriptions WHERE id = $1").bind(a.subscription))
            .await
            .unwrap()
            .get("status");
    assert_eq!(sub, "active");
    assert_eq!(events(&t.db).await, ["dunning.started"]);
    assert_eq!(dunning_emails(&t.db).await, Vec::<String>::new());
    assert_eq!(tick(&t.db, &d).await.claimed, 0);
}

/// The cancel final action, owed and open: the subscription is canceled once,
/// the used part of its period invoiced pro rata by billing's cancel in the
/// same transaction, and `subscription.canceled` announced once, however
/// often the step runs.
#[tokio::test]
async fn a_cancel_final_action_cancels_once() {
    let t = TestDb::new().await;
    let p = FakeProvider::start().await.unwrap();
    policy(&t.db, "tenant_a", 1, "cancel_subscription").await;
    let a = declined_invoice(&t.db, "tenant_a").await;
    p.set_behaviour(&a.customer, Behaviour::Decline("expired_card".into()));
    let (d, _) = dunner(&t.db, &p, CALL, config());
    let r = tick(&t.db, &d).await;
    assert_eq!(r.tally.exhausted, 1, "{r:?}");
    t.db.execute(
        sql("UPDATE dunning_runs SET final_action_at = NULL WHERE invoice_id = $1").bind(a.invoice),
    )
    .await
    .unwrap();
    assert_eq!(tick(&t.db, &d).await.tally.final_actions, 1);
    let sub: String =
        t.db.fetch_one(sql("SELECT status FROM subscriptions WHERE id = $1").bind(a.subscription))
            .await
            .unwrap()
            .get("status");
    assert_eq!(sub, "canceled");
    assert_eq!(
        events(&t.db).await,
        [
            "dunning.started",
            "dunning.exhausted",
            "invoice.finalized",
            "subscription.canceled"
        ]
    );
    assert_eq!(invoice_status(&t.db, a.invoice).await, "open");
    let reasons: Vec<String> =
        t.db.fetch_all(sql("SELECT reason FROM invoices ORDER BY id"))
            .await
            .unwrap()
            .iter()
            .map(|r| r.get(0))
            .collect();
    assert_eq!(reasons, ["period", "cancel"]);
}

/// What the exhaustion's transaction leaves behind, without the retries: the
/// run of `invoice` exhausted after `attempts`, its final action owed.
async fn exhausted(db: &db::Db, d: &dunning::Dunner, invoice: i64, attempts: i32) {
    crate::enrol(db, d).await;
    db.execute(
        sql(
            "UPDATE dunning_runs SET status = 'exhausted', attempt_count = $2, ended_at = now(), \
                    last_decline_code = 'card_declined' WHERE invoice_id = $1",
        )
        .bind(invoice)
        .bind(attempts),
    )
    .await
    .unwrap();
}

/// (behaviour, resumes_at is set, set_by) of the subscription's pause.
async fn pause_of(db: &db::Db, subscription: i64) -> (Option<String>, bool, Option<String>) {
    let r = db
        .fetch_one(
            sql(
                "SELECT pause_collection_behavior, pause_collection_resumes_at IS NOT NULL AS resumes, \
                        pause_collection_set_by FROM subscriptions WHERE id = $1",
            )
            .bind(subscription),
        )
        .await
        .unwrap();
    (r.get(0), r.get(1), r.get(2))
}

/// The payloads of events of `event_type`, in order.
async fn payloads(db: &db::Db, event_type: &str) -> Vec<serde_json::Value> {
    db.fetch_all(
        sql("SELECT payload::text AS p FROM webhook_events WHERE event_type = $1 ORDER BY id")
            .bind(event_type.to_owned()),
    )
    .await
    .unwrap()
    .iter()
    .map(|r| serde_json::from_str(&r.get::<String, _>("p")).unwrap())
    .collect()
}

/// An operator's pause in force (`mark_uncollectible`, resuming tomorrow)
/// when dunning's final action is owed: dunning's pause replaces it, with the
/// behaviour its policy names (`void`) and no resume time, announced with the
/// pause it replaced, and the final notice says collection is paused. The
/// step retried finds dunning's own pause ("already held") and writes,
/// announces and sends nothing.
///
/// Mutation checks: `dunning_pause_replaces` (the pause written only where
/// none is in force) writes nothing here; `dunning_pause_behavior` (always
/// `keep_as_draft`) writes the wrong behaviour; `dunning_pause_held` (the
/// already-held rule removed) pauses and announces a second time; each seen
/// failing under it.
#[tokio::test]
async fn dunnings_pause_replaces_a_pause_in_force_with_its_policys_behaviour() {
    let t = TestDb::new().await;
    let p = FakeProvider::start().await.unwrap();
    let policy_id = policy(&t.db, "tenant_a", 2, "pause_collection").await;
    // A tenant's own setting (the API will write it): as the owner here.
    sqlx::query("UPDATE dunning_policies SET pause_behavior = 'void' WHERE id = $1")
        .bind(policy_id)
        .execute(&mut t.superuser().await)
        .await
        .unwrap();
    let a = declined_invoice(&t.db, "tenant_a").await;
    let (d, _) = dunner(&t.db, &p, CALL, config());
    exhausted(&t.db, &d, a.invoice, 2).await;
    t.db.execute(
        sql(
            "UPDATE subscriptions SET pause_collection_behavior = 'mark_uncollectible', \
                    pause_collection_resumes_at = now() + interval '1 day', \
                    pause_collection_set_by = 'operator' WHERE id = $1",
        )
        .bind(a.subscription),
    )
    .await
    .unwrap();
    let r = tick(&t.db, &d).await;
    assert_eq!(r.tally.final_actions, 1, "{r:?}");
    assert_eq!(
        pause_of(&t.db, a.subscription).await,
        (Some("void".into()), false, Some("dunning".into()))
    );
    let paused = payloads(&t.db, "subscription.collection_paused").await;
    assert_eq!(paused.len(), 1);
    assert_eq!(paused[0]["pause_collection"]["behavior"], "void");
    assert_eq!(
        paused[0]["replaced_pause_collection"]["behavior"],
        "mark_uncollectible"
    );
    // The step again, as if its stamp had never committed: already held.
    t.db.execute(
        sql("UPDATE dunning_runs SET final_action_at = NULL WHERE invoice_id = $1").bind(a.invoice),
    )
    .await
    .unwrap();
    assert_eq!(tick(&t.db, &d).await.tally.final_actions, 1);
    assert_eq!(
        events(&t.db).await,
        ["dunning.started", "subscription.collection_paused"]
    );
    let notices = crate::strings(
        &t.db,
        "SELECT text_body FROM email_outbox WHERE subject LIKE 'Final notice%'",
    )
    .await;
    assert_eq!(notices.len(), 1, "{notices:?}");
    assert!(
        notices[0].contains("Collection of payments for your subscription is paused")
            && notices[0].contains("voided"),
        "{notices:?}"
    );
}

/// An operator's pause that has already lifted (its resume time passed, the
/// billing tick not yet run): dunning's final action first clears it with
/// `subscription.collection_resumed`, then pauses with
/// `subscription.collection_paused`, in one transaction (the resume rule,
/// docs/design.md §4.3).
///
/// Mutation check: `dunning_pause_lifted` (a lifted pause treated as one in
/// force) replaces it without announcing the resume; seen failing under it.
#[tokio::test]
async fn a_lifted_pause_is_resumed_then_dunnings_pause_lands() {
    let t = TestDb::new().await;
    let p = FakeProvider::start().await.unwrap();
    policy(&t.db, "tenant_a", 2, "pause_collection").await;
    let a = declined_invoice(&t.db, "tenant_a").await;
    let (d, _) = dunner(&t.db, &p, CALL, config());
    exhausted(&t.db, &d, a.invoice, 2).await;
    t.db.execute(
        sql(
            "UPDATE subscriptions SET pause_collection_behavior = 'void', \
                    pause_collection_resumes_at = now() - interval '1 hour', \
                    pause_collection_set_by = 'operator' WHERE id = $1",
        )
        .bind(a.subscription),
    )
    .await
    .unwrap();
    let r = tick(&t.db, &d).await;
    assert_eq!(r.tally.final_actions, 1, "{r:?}");
    assert_eq!(
        pause_of(&t.db, a.subscription).await,
        (Some("keep_as_draft".into()), false, Some("dunning".into()))
    );
    assert_eq!(
        events(&t.db).await,
        [
            "dunning.started",
            "subscription.collection_resumed",
            "subscription.collection_paused"
        ]
    );
    let resumed = payloads(&t.db, "subscription.collection_resumed").await;
    assert_eq!(resumed[0]["previous_pause_collection"]["behavior"], "void");
    assert_eq!(dunning_emails(&t.db).await.len(), 1);
}

/// The final notice says what each final action did: the subscription
/// canceled, collection paused, or the invoice written off.
#[tokio::test]
async fn each_final_notice_says_what_its_action_did() {
    let t = TestDb::new().await;
    let p = FakeProvider::start().await.unwrap();
    let (d, _) = dunner(&t.db, &p, CALL, config());
    let cases = [
        (
            "tenant_a",
            "cancel_subscription",
            "Your subscription has been canceled",
        ),
        (
            "tenant_b",
            "pause_collection",
            "is paused: we will not charge you",
        ),
        ("tenant_c", "mark_uncollectible", "marked it uncollectible"),
    ];
    let mut invoices = Vec::new();
    for (tenant, action, _) in cases {
        policy(&t.db, tenant, 1, action).await;
        invoices.push(declined_invoice(&t.db, tenant).await.invoice);
    }
    crate::enrol(&t.db, &d).await;
    t.db.execute(sql(
        "UPDATE dunning_runs SET status = 'exhausted', attempt_count = 1, ended_at = now()",
    ))
    .await
    .unwrap();
    assert_eq!(tick(&t.db, &d).await.tally.final_actions, 3);
    for ((tenant, _, says), invoice) in cases.iter().zip(invoices) {
        let body: String =
            t.db.fetch_one(
                sql("SELECT text_body FROM email_outbox WHERE tenant_id = $1 AND subject = $2")
                    .bind(tenant.to_string())
                    .bind(format!("Final notice for invoice {invoice}")),
            )
            .await
            .unwrap()
            .get(0);
        assert!(body.contains(says), "{tenant}: {body}");
    }
}

/// Two invoices of one subscription exhausted in the same tick take their
/// final actions together (one transaction for the batch): the subscription
/// is paused once, announced once, and only the run whose pause landed sends
/// a final notice; the other found the pause held.
///
/// Mutation check: queueing every stamped run's notice, changed or not
/// (`dunning_batch_notice_when_changed`), sends two notices.
#[tokio::test]
async fn a_batch_exhausting_two_invoices_of_one_subscription_pauses_it_once() {
    let t = TestDb::new().await;
    let p = FakeProvider::start().await.unwrap();
    policy(&t.db, "tenant_a", 1, "pause_collection").await;
    let a = declined_invoice(&t.db, "tenant_a").await;
    // A second open invoice of the same subscription, declined too.
    let second: i64 =
        t.db.fetch_one(
            sql(
                "INSERT INTO invoices (tenant_id, subscription_id, period_start, period_end, \
                                       amount, currency, collection_method) \
                 VALUES ('tenant_a', $1, now() - interval '60 days', now() - interval '30 days', \
                         1200, 'EUR', 'automatic') RETURNING id",
            )
            .bind(a.subscription),
        )
        .await
        .unwrap()
        .get(0);
    t.db.execute(
        sql("WITH a AS ( \
               INSERT INTO payment_attempts (tenant_id, invoice_id, attempt_seq, idempotency_key, \
                                             amount, currency, provider_status, decline_code, \
                                             resolved_at) \
               VALUES ('tenant_a', $1, 1, 'hardcount-invoice-' || $1 || '-attempt-1', 1200, \
                       'EUR', 'declined', 'insufficient_funds', now() - interval '1 hour') \
               RETURNING invoice_id) \
             UPDATE invoices SET attempt_count = attempt_count + 1 \
             WHERE id IN (SELECT invoice_id FROM a)")
        .bind(second),
    )
    .await
    .unwrap();
    p.set_behaviour(&a.customer, Behaviour::Decline("insufficient_funds".into()));
    let (d, _) = dunner(&t.db, &p, CALL, config());
    let r = tick(&t.db, &d).await;
    assert_eq!((r.tally.exhausted, r.tally.declined), (2, 0), "{r:?}");
    let paused: i64 =
        t.db.fetch_one(sql(
            "SELECT count(*) FROM webhook_events WHERE event_type = 'subscription.collection_paused'",
        ))
        .await
        .unwrap()
        .get(0);
    assert_eq!(paused, 1);
    let notices: i64 =
        t.db.fetch_one(sql(
            "SELECT count(*) FROM email_outbox WHERE subject LIKE 'Final notice%'",
        ))
        .await
        .unwrap()
        .get(0);
    assert_eq!(notices, 1);
    let set_by: Option<String> =
        t.db.fetch_one(
            sql("SELECT pause_collection_set_by FROM subscriptions WHERE id = $1")
                .bind(a.subscription),
        )
        .await
        .unwrap()
        .get(0);
    assert_eq!(set_by.as_deref(), Some("dunning"));
}

/// What a charge in flight on `invoice` looks like to the write-off, set by
/// SQL: billing's claim on the invoice unexpired (`claim`), and its one
/// attempt's state (`attempt`: `declined` as `declined_invoice` left it,
/// `sent` for unknown and sent, `never_sent` for unknown and never sent).
async fn in_flight(t: &TestDb, invoice: i64, claim: bool, attempt: &str) {
    let claim = if claim {
        "now() + interval '10 minutes', 'billing-test'"
    } else {
        "NULL, NULL"
    };
    let attempt = match attempt {
        "declined" => "'declined', 'insufficient_funds', now(), now()",
        "sent" => "'unknown', NULL, NULL, now()",
        "never_sent" => "'unknown', NULL, NULL, NULL",
        other => panic!("{other}"),
    };
    let mut su = t.superuser().await;
    sqlx::raw_sql(sqlx::AssertSqlSafe(format!(
        "UPDATE invoices SET (auto_charge_claimed_until, auto_charge_claimed_by) = ({claim}) \
         WHERE id = {invoice}; \
         UPDATE payment_attempts SET (provider_status, decline_code, resolved_at, first_sent_at) \
             = ({attempt}) WHERE invoice_id = {invoice}"
    )))
    .execute(&mut su)
    .await
    .unwrap();
}

/// (invoice status, `invoice.marked_uncollectible` events, the run's final
/// action stamped).
async fn write_off_state(db: &db::Db, invoice: i64) -> (String, i64, bool) {
    let r = db
        .fetch_one(
            sql("SELECT i.status, \
                        (SELECT count(*) FROM webhook_events \
                         WHERE event_type = 'invoice.marked_uncollectible') AS events, \
                        r.final_action_at IS NOT NULL AS stamped \
                 FROM invoices i JOIN dunning_runs r ON r.invoice_id = i.id WHERE i.id = $1")
            .bind(invoice),
        )
        .await
        .unwrap();
    (r.get("status"), r.get("events"), r.get("stamped"))
}

/// A write-off waits while a charge of its invoice may be in flight (review
/// of the money path): billing settles a charge only on an open invoice, and
/// its reconciler looks only at open invoices' attempts, so an invoice
/// written off under a charge in flight kept a paid answer unrecorded and
/// its attempt unknown for good, the customer charged and told "we will not
/// charge you for it again". Here an exhausted run owes its write-off (a
/// crash came between the two). Under billing's claim, and then with its
/// attempt sent and unknown, the step writes nothing and stays owed; with
/// the claim free and the attempt never sent (the reconciler sends only an
/// open invoice's, under its claim), it writes the invoice off once
/// (docs/adr/0141).
///
/// Mutations `write_off_ignores_claim` and `write_off_ignores_attempts` (each
/// predicate dropped) write the invoice off at the first or second step;
/// seen failing under each.
#[tokio::test]
async fn a_write_off_waits_for_a_charge_in_flight_on_its_invoice() {
    let t = TestDb::new().await;
    let p = FakeProvider::start().await.unwrap();
    policy(&t.db, "tenant_a", 1, "mark_uncollectible").await;
    let a = declined_invoice(&t.db, "tenant_a").await;
    let (d, _) = dunner(&t.db, &p, CALL, config());
    exhausted(&t.db, &d, a.invoice, 1).await;
    let waits = ("open".to_owned(), 0, false);
    for (claim, attempt) in [(true, "declined"), (false, "sent")] {
        in_flight(&t, a.invoice, claim, attempt).await;
        let r = tick(&t.db, &d).await;
        assert_eq!(r.tally.final_actions, 1, "{claim} {attempt}: {r:?}");
        assert_eq!(
            write_off_state(&t.db, a.invoice).await,
            waits,
            "{claim} {attempt}"
        );
    }
    assert_eq!(dunning_emails(&t.db).await, Vec::<String>::new());
    in_flight(&t, a.invoice, false, "never_sent").await;
    tick(&t.db, &d).await;
    assert_eq!(
        write_off_state(&t.db, a.invoice).await,
        ("uncollectible".to_owned(), 1, true)
    );
    assert_eq!(tick(&t.db, &d).await.claimed, 0);
}

/// A write-off held by a charge in flight, which then settles paid after the
/// run was listed and before its step runs (the reconciler found the charge,
/// or an operator settled it): the step reads the invoice under its lock,
/// finds it paid, takes no step, and the run ends recovered, with
/// `dunning.recovered` and a recovery counted. Before, the step found the
/// invoice no longer open and stamped itself done: the run stayed
/// `exhausted` beside a paid invoice, with no `dunning.recovered`
/// (docs/adr/0147).
///
/// Mutation `owed_step_paid_left_exhausted` (the paid invoices not read)
/// leaves the run exhausted; seen failing under it.
#[tokio::test]
async fn a_held_write_off_then_paid_recovers_the_run() {
    let t = TestDb::new().await;
    let p = FakeProvider::start().await.unwrap();
    policy(&t.db, "tenant_a", 1, "mark_uncollectible").await;
    let a = declined_invoice(&t.db, "tenant_a").await;
    let (d, metrics) = dunner(&t.db, &p, CALL, config());
    exhausted(&t.db, &d, a.invoice, 1).await;
    in_flight(&t, a.invoice, false, "sent").await;
    tick(&t.db, &d).await;
    assert_eq!(
        write_off_state(&t.db, a.invoice).await,
        ("open".to_owned(), 0, false)
    );
    // Listed while the invoice is open; paid before the step runs.
    let d2 = d.clone();
    let listed = as_leader(
        &manager(&t.db, "lister"),
        Role::Dunning,
        |tick| async move { d2.list_due(&tick.fence, 10).await.unwrap() },
    )
    .await;
    assert_eq!(listed[0].invoice_status, "open");
    sqlx::raw_sql(sqlx::AssertSqlSafe(format!(
        "UPDATE payment_attempts SET provider_status = 'succeeded', resolved_at = now() \
         WHERE invoice_id = {0}; \
         UPDATE invoices SET status = 'paid', paid_at = now() WHERE id = {0}",
        a.invoice
    )))
    .execute(&mut t.superuser().await)
    .await
    .unwrap();
    let done = d.retry(&listed[0]).await.unwrap();
    assert!(matches!(done, dunning::Retry::Stopped { .. }), "{done:?}");
    assert_eq!(run_of(&t.db, a.invoice).await.0, "recovered");
    assert_eq!(
        write_off_state(&t.db, a.invoice).await,
        ("paid".to_owned(), 0, false)
    );
    assert_eq!(
        events(&t.db).await,
        ["dunning.started", "dunning.recovered"]
    );
    assert_eq!(dunning_emails(&t.db).await, Vec::<String>::new());
    assert!(
        metrics
            .render()
            .contains("hardcount_dunning_recoveries_total 1"),
        "{}",
        metrics.render()
    );
    assert_eq!(tick(&t.db, &d).await.claimed, 0);
}

/// The same where the batch that exhausts the run takes its step at once
/// (the batched final actions): the invoice is paid as the run is exhausted
/// (a trigger pays it in the exhaustion's transaction, standing for a
/// payment that lands between the two), so the batched step finds it paid
/// and ends the run recovered instead of stamping a cancel with nothing to
/// do. Mutation `owed_step_paid_left_exhausted`; seen failing under it.
#[tokio::test]
async fn a_run_paid_as_its_batch_exhausts_it_is_recovered() {
    let t = TestDb::new().await;
    let p = FakeProvider::start().await.unwrap();
    policy(&t.db, "tenant_a", 1, "cancel_subscription").await;
    let a = declined_invoice(&t.db, "tenant_a").await;
    p.set_behaviour(&a.customer, Behaviour::Decline("expired_card".into()));
    let (d, metrics) = dunner(&t.db, &p, CALL, config());
    sqlx::raw_sql(
        "CREATE FUNCTION pay_on_exhaust() RETURNS trigger LANGUAGE plpgsql AS $$ \
         BEGIN UPDATE invoices SET status = 'paid', paid_at = now() WHERE id = NEW.invoice_id; \
         RETURN NULL; END $$; \
         CREATE TRIGGER pay_on_exhaust AFTER UPDATE OF status ON dunning_runs \
         FOR EACH ROW WHEN (NEW.status = 'exhausted') EXECUTE FUNCTION pay_on_exhaust()",
    )
    .execute(&mut t.superuser().await)
    .await
    .unwrap();
    let r = tick(&t.db, &d).await;
    assert_eq!(r.tally.exhausted, 1, "{r:?}");
    assert_eq!(run_of(&t.db, a.invoice).await.0, "recovered");
    let sub: String =
        t.db.fetch_one(sql("SELECT status FROM subscriptions WHERE id = $1").bind(a.subscription))
            .await
            .unwrap()
            .get("status");
    assert_eq!(sub, "active", "no cancel");
    assert_eq!(
        events(&t.db).await,
        ["dunning.started", "dunning.exhausted", "dunning.recovered"]
    );
    // The recovery names the count the exhaustion wrote, not the one listed.
    let counts: Vec<i64> =
        t.db.fetch_all(sql(
            "SELECT (payload->>'attempt_count')::bigint AS n FROM webhook_events \
             WHERE event_type IN ('dunning.exhausted', 'dunning.recovered') ORDER BY id",
        ))
        .await
        .unwrap()
        .iter()
        .map(|r| r.get("n"))
        .collect();
    assert_eq!(counts, [1, 1]);
    assert!(
        metrics
            .render()
            .contains("hardcount_dunning_recoveries_total 1"),
        "{}",
        metrics.render()
    );
}

/// The same wait where the batch that exhausts the run acts at once (the
/// batched final actions, `final_actions`): a run whose retries are spent,
/// its invoice under billing's claim, is exhausted and its write-off left
/// owed (the stamp taken back), then written off once the claim is gone.
/// Mutation `write_off_batch_stamps_held` (the held runs' stamps kept) leaves
/// the invoice open for good; seen failing under it.
#[tokio::test]
async fn a_batch_exhausting_a_run_leaves_a_held_write_off_owed() {
    let t = TestDb::new().await;
    let p = FakeProvider::start().await.unwrap();
    policy(&t.db, "tenant_a", 1, "mark_uncollectible").await;
    let a = declined_invoice(&t.db, "tenant_a").await;
    let (d, _) = dunner(&t.db, &p, CALL, config());
    crate::enrol(&t.db, &d).await;
    t.db.execute(
        sql("UPDATE dunning_runs SET attempt_count = 1, next_attempt_at = now() WHERE invoice_id = $1")
            .bind(a.invoice),
    )
    .await
    .unwrap();
    in_flight(&t, a.invoice, true, "declined").await;
    let r = tick(&t.db, &d).await;
    assert_eq!(r.tally.exhausted, 1, "{r:?}");
    assert_eq!(run_of(&t.db, a.invoice).await.0, "exhausted");
    assert_eq!(
        write_off_state(&t.db, a.invoice).await,
        ("open".to_owned(), 0, false)
    );
    in_flight(&t, a.invoice, false, "declined").await;
    tick(&t.db, &d).await;
    assert_eq!(
        write_off_state(&t.db, a.invoice).await,
        ("uncollectible".to_owned(), 1, true)
    );
}

/// A write-off held by a charge in flight is left out for the rest of the
/// tick: its run sorts first (its time is its exhaustion's), so each later
/// listing took it again and only held it, and with batches of one the tick
/// never reached the runs due after it. Here the held step is taken once
/// and the other run's retry is charged in the same tick (docs/adr/0141).
/// Mutation `held_write_off_listed_again` (the held run not left out) takes
/// the held step again and again until the budget ends; seen failing under
/// it.
#[tokio::test]
async fn a_held_write_off_does_not_hold_the_tick_s_other_runs() {
    let t = TestDb::new().await;
    let p = FakeProvider::start().await.unwrap();
    policy(&t.db, "tenant_a", 2, "mark_uncollectible").await;
    // More held runs than batches in flight (three of one run each), so the
    // first held batch has ended before the listing is done with them.
    let mut held = Vec::new();
    for _ in 0..4 {
        held.push(declined_invoice(&t.db, "tenant_a").await.invoice);
    }
    let b = declined_invoice(&t.db, "tenant_a").await;
    let config = dunning::DunningConfig {
        batch_size: 1,
        tick_budget: Duration::from_secs(10),
        ..config()
    };
    let (d, _) = dunner(&t.db, &p, CALL, config);
    for &invoice in &held {
        exhausted(&t.db, &d, invoice, 2).await;
        in_flight(&t, invoice, true, "declined").await;
    }
    t.db.execute(sql(
        "UPDATE dunning_runs SET next_attempt_at = now() - interval '1 hour' \
             WHERE status = 'exhausted'",
    ))
    .await
    .unwrap();
    crate::due_now(&t.db).await;
    let r = tick(&t.db, &d).await;
    assert_eq!(r.tally.recovered, 1, "{r:?}");
    assert_eq!(r.tally.final_actions, 4, "each held step taken once: {r:?}");
    assert_eq!(p.create_requests(), 1);
    assert_eq!(run_of(&t.db, b.invoice).await.0, "recovered");
    for &invoice in &held {
        assert_eq!(
            write_off_state(&t.db, invoice).await,
            ("open".to_owned(), 0, false)
        );
    }
}
