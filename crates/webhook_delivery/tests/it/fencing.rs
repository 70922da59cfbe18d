//! The two guards: the fence on the claim, and the compare-and-set on the outcome.

use std::sync::Arc;
use std::time::Duration;

use leader::Role;
use testbed::TestDb;
use webhook_delivery::Outcome;

use crate::{
    as_leader, config, deliveries, endpoint, events, make_due, manager, outcomes, tick, worker,
};
use testbed::receiver::{Receiver, Reply};

/// The one due delivery claimed, then made due and claimed again: the first
/// claim superseded by the second.
async fn claimed_twice(
    t: &TestDb,
    w: &webhook_delivery::Worker,
) -> (webhook_delivery::Claimed, webhook_delivery::Claimed) {
    as_leader(
        &manager(&t.db, "w"),
        Role::WebhookDelivery,
        |tick| async move {
            let first = w.claim_due(&tick.fence, 10).await.unwrap().pop().unwrap();
            make_due(t).await;
            let second = w.claim_due(&tick.fence, 10).await.unwrap().pop().unwrap();
            (first, second)
        },
    )
    .await
}

/// A leader replaced by a takeover claims nothing with its old token, while
/// the new leader's claim in the same moment takes the due deliveries.
///
/// Mutation check: removing `AND leader_fence($1, $2)` from the claim in
/// `store::claim_due` makes the old token claim all three; this test was run
/// against that mutation and failed, then the predicate was restored.
#[tokio::test]
async fn a_stale_token_claims_nothing_after_a_takeover() {
    let t = TestDb::new().await;
    let rx = Receiver::answering(200).await;
    endpoint(&t, "tenant_a", &rx.url()).await;
    events(&t.db, "tenant_a", 3).await;
    let (w, _) = worker(&t.db, config());
    let old = as_leader(
        &manager(&t.db, "old"),
        Role::WebhookDelivery,
        |tick| async move { tick.fence },
    )
    .await;
    let (by_old, by_new) = as_leader(
        &manager(&t.db, "new"),
        Role::WebhookDelivery,
        |tick| async move {
            assert!(tick.fence.token() > old.token());
            let by_old = w.claim_due(&old, 10).await.unwrap().len();
            let by_new = w.claim_due(&tick.fence, 10).await.unwrap().len();
            (by_old, by_new)
        },
    )
    .await;
    assert_eq!((by_old, by_new), (0, 3));
    assert!(deliveries(&t.db).await.iter().all(|d| d.attempts == 1));
    assert_eq!(rx.requests().len(), 0);
}

/// Attempt 1 is claimed, its claim lease runs out (forced here), and attempt 2
/// is claimed. Attempt 1's result then arrives: the receiver did get the POST,
/// but the write proving `attempts = 1` matches no row, so nothing is applied
/// and the attempt is counted as stale. Attempt 2's result is applied.
///
/// Mutation check: removing `AND d.attempts = o.attempt` from the batched
/// outcome statement in `store::apply_outcomes` lets attempt 1's late result
/// mark the delivery delivered; this test was run against that mutation and
/// failed, then the predicate was restored.
#[tokio::test]
async fn a_late_result_from_a_stale_attempt_is_refused_and_counted() {
    let t = TestDb::new().await;
    let rx = Receiver::answering(200).await;
    endpoint(&t, "tenant_a", &rx.url()).await;
    events(&t.db, "tenant_a", 1).await;
    let (w, metrics) = worker(&t.db, config());

    let (first, second) = claimed_twice(&t, &w).await;
    assert_eq!(
        (first.id(), first.attempt(), second.attempt()),
        (second.id(), 1, 2)
    );

    assert_eq!(w.deliver(first).await, Outcome::Stale);
    assert_eq!(rx.requests().len(), 1, "the stale attempt was sent");
    let d = &deliveries(&t.db).await[0];
    assert_eq!(
        (d.status.as_str(), d.attempts, d.last_status_code),
        ("pending", 2, None)
    );
    assert!(!d.delivered);
    assert_eq!(outcomes(&metrics, "stale"), 1.0);

    assert_eq!(w.deliver(second).await, Outcome::Delivered);
    let d = &deliveries(&t.db).await[0];
    assert_eq!(
        (d.status.as_str(), d.attempts, d.last_status_code),
        ("delivered", 2, Some(200))
    );
    assert_eq!(outcomes(&metrics, "delivered"), 1.0);
}

/// A claim whose start deadline passed is not sent, even if its turn is free:
/// it is handed back unsent; if a later claim superseded it meanwhile, the hand-back writes nothing and says
/// so: `Stale`, counted, not `Released` (docs/adr/0084). The later claim's
/// attempt is untouched and delivers.
///
/// Mutation checks: `release_superseded` (the hand-back reporting `Released`
/// whatever it matched) and `late_turn_started` (a turn ready at once taken
/// past the start deadline: the superseded claim is sent) fail this test.
#[tokio::test]
async fn an_unsent_claim_superseded_before_its_hand_back_is_stale() {
    let t = TestDb::new().await;
    let rx = Receiver::answering(200).await;
    endpoint(&t, "tenant_a", &rx.url()).await;
    events(&t.db, "tenant_a", 1).await;
    let (w, metrics) = worker(&t.db, config());
    let (first, second) = claimed_twice(&t, &w).await;
    // Past the first claim's start deadline (claimed_at + claim_margin).
    tokio::time::sleep(config().claim_margin + Duration::from_millis(200)).await;
    assert_eq!(w.deliver(first).await, Outcome::Stale);
    assert!(
        rx.requests().is_empty(),
        "the superseded claim sent nothing"
    );
    assert_eq!(outcomes(&metrics, "stale"), 1.0);
    let d = &deliveries(&t.db).await[0];
    assert_eq!((d.status.as_str(), d.attempts), ("pending", 2));
    assert_eq!(
        w.deliver(second).await,
        Outcome::Released,
        "its turn is past too"
    );
    assert_eq!(deliveries(&t.db).await[0].attempts, 1, "handed back");
}

/// The same for a claim held back rather than released: here its endpoint's
/// secret cannot be opened with the worker's keyring. The superseded claim's
/// hold writes nothing and says so (`Stale`, counted); the later claim's hold
/// lands (`Held`).
///
/// Mutation checks: `hold_superseded` (the hold reporting `Released` whenever
/// it held nothing, as it did before) and `hold_superseded_counted` (the
/// superseded hold not counted `stale`, as the tick's hold also did not)
/// fail this test.
#[tokio::test]
async fn a_held_claim_superseded_before_its_hold_is_stale() {
    let t = TestDb::new().await;
    let rx = Receiver::answering(200).await;
    endpoint(&t, "tenant_a", &rx.url()).await;
    events(&t.db, "tenant_a", 1).await;
    let other = webhook_delivery::Keyring::parse(
        &webhook_delivery::Keyring::generate_entry("other").unwrap(),
    )
    .unwrap();
    let config = webhook_delivery::WorkerConfig {
        secrets: Some(other),
        ..config()
    };
    let (w, metrics) = worker(&t.db, config);
    let (first, second) = claimed_twice(&t, &w).await;
    assert_eq!(w.deliver(first).await, Outcome::Stale);
    assert_eq!(outcomes(&metrics, "stale"), 1.0);
    assert_eq!(deliveries(&t.db).await[0].attempts, 2, "the later claim's");
    assert_eq!(w.deliver(second).await, Outcome::Held);
    let d = &deliveries(&t.db).await[0];
    assert_eq!(
        (d.attempts, d.last_error.as_deref()),
        (1, Some("bad_secret"))
    );
    assert!(rx.requests().is_empty(), "nothing was sent");
}

/// A claim sets `claimed_until` a lease ahead, so a worker that dies after
/// claiming leaves the delivery to come due again by itself, and not before:
/// a tick right after the claim finds nothing due.
///
/// Mutation check: the claim without its lease predicate (`AND
/// (claimed_until IS NULL OR claimed_until <= now())` removed) hands the
/// delivery out again at once and this test fails (scripts/mutation-check
/// `claim_lease`).
#[tokio::test]
async fn a_claim_that_is_never_finished_comes_due_again_after_its_lease() {
    let t = TestDb::new().await;
    let rx = Receiver::answering(200).await;
    endpoint(&t, "tenant_a", &rx.url()).await;
    events(&t.db, "tenant_a", 1).await;
    let (w, _) = worker(&t.db, config());
    let lease = config().claim_lease().as_secs_f64();
    let wr = &w;
    let claimed = as_leader(
        &manager(&t.db, "w"),
        Role::WebhookDelivery,
        |tick| async move { wr.claim_due(&tick.fence, 10).await.unwrap() },
    )
    .await;
    assert_eq!(claimed.len(), 1);
    drop(claimed); // the worker "dies" here
    let d = &deliveries(&t.db).await[0];
    assert_eq!((d.status.as_str(), d.attempts), ("pending", 1));
    assert!(d.due_in > lease - 1.0 && d.due_in <= lease, "{d:?}");
    let report = crate::tick(&t.db, &w).await;
    assert_eq!(
        report.claimed, 0,
        "claimed again inside its lease: {report:?}"
    );

    // The lease passes (moved into the past on the database clock rather than
    // waited for): the delivery is due again by itself.
    let mut su = t.superuser().await;
    sqlx::raw_sql("UPDATE webhook_deliveries SET claimed_until = now() - interval '1 second'")
        .execute(&mut su)
        .await
        .unwrap();
    let report = crate::tick(&t.db, &w).await;
    assert_eq!(report.delivered, 1, "{report:?}");
    let d = &deliveries(&t.db).await[0];
    assert_eq!((d.status.as_str(), d.attempts), ("delivered", 2));
}

/// Outcomes that finish together are written as one group (one statement),
/// and each row of it is still its own compare-and-set: while three attempts
/// are in flight, a later claim of one of them is forced; that one's result is
/// refused and counted as stale, the other two are applied.
#[tokio::test]
async fn a_grouped_outcome_write_refuses_only_its_stale_rows() {
    let t = TestDb::new().await;
    let rx = Arc::new(Receiver::start(|_| Reply::Delayed(Duration::from_millis(300), 200)).await);
    endpoint(&t, "tenant_a", &rx.url()).await;
    events(&t.db, "tenant_a", 3).await;
    let (w, metrics) = worker(&t.db, config());
    let seen = rx.clone();
    let mut su = t.superuser().await;
    let supersede = tokio::spawn(async move {
        seen.until_count(3, Duration::from_secs(10)).await;
        sqlx::raw_sql(
            "UPDATE webhook_deliveries SET attempts = attempts + 1 \
             WHERE id = (SELECT min(id) FROM webhook_deliveries)",
        )
        .execute(&mut su)
        .await
        .unwrap();
    });
    let report = tick(&t.db, &w).await;
    supersede.await.unwrap();
    assert_eq!(
        (report.claimed, report.delivered, report.stale),
        (3, 2, 1),
        "{report:?}"
    );
    let ds = deliveries(&t.db).await;
    assert_eq!(
        (
            ds[0].status.as_str(),
            ds[0].attempts,
            ds[0].last_status_code
        ),
        ("pending", 2, None)
    );
    assert!(
        ds[1..]
            .iter()
            .all(|d| d.status == "delivered" && d.attempts == 1 && d.last_status_code == Some(200)),
        "{ds:?}"
    );
    assert_eq!(
        (outcomes(&metrics, "stale"), outcomes(&metrics, "delivered")),
        (1.0, 2.0)
    );
}

/// The attempt ceiling lives in the claim itself (issue 12, point 5): a worker
/// that dies while attempting (a payload that exhausts memory) never writes an
/// outcome, and the claim lease would bring the row back to every next leader.
/// A row already claimed `max_attempts` times is marked dead by the claim, with
/// the category `attempts_exhausted`, and not handed out; a row one below the
/// ceiling gets its last attempt.
///
/// Mutation check: turning the `exhausted` CTE's predicate into `false` (no row
/// marked dead) leaves the exhausted row pending; this test was run against that
/// mutation and failed, then the predicate was restored. The death is counted
/// as any other (`outcome="dead"`); mutation `ceiling_death_counted` (the
/// count dropped) fails here.
#[tokio::test]
async fn a_delivery_past_the_attempt_ceiling_is_marked_dead_by_the_claim() {
    let t = TestDb::new().await;
    let rx = Receiver::answering(200).await;
    endpoint(&t, "tenant_a", &rx.url()).await;
    events(&t.db, "tenant_a", 2).await;
    let cfg = config();
    let max = i32::try_from(cfg.retry_schedule.max_attempts()).unwrap();
    let mut su = t.superuser().await;
    sqlx::query(
        "UPDATE webhook_deliveries SET attempts = CASE WHEN id = (SELECT min(id) FROM webhook_deliveries) \
                                                THEN $1 ELSE $1 - 1 END, \
                next_attempt_at = now() - interval '1 second'",
    )
    .bind(max)
    .execute(&mut su)
    .await
    .unwrap();
    let (w, metrics) = worker(&t.db, cfg);
    let claimed = as_leader(
        &manager(&t.db, "worker"),
        Role::WebhookDelivery,
        |tick| async move { w.claim_due(&tick.fence, 10).await.unwrap().len() },
    )
    .await;
    assert_eq!(claimed, 1);
    let rendered = metrics.render();
    assert!(
        rendered.contains("hardcount_webhook_deliveries_total{outcome=\"dead\"} 1"),
        "{rendered}"
    );
    let d = deliveries(&t.db).await;
    assert_eq!(
        (
            d[0].status.as_str(),
            d[0].attempts,
            d[0].last_error.as_deref()
        ),
        ("dead", max, Some("attempts_exhausted"))
    );
    assert_eq!((d[1].status.as_str(), d[1].attempts), ("pending", max));
    assert_eq!(rx.requests().len(), 0);
}

/// The claim walks tenants a statement at a time, each committed on its own
/// (docs/adr/0048). A delivery the first statement marked dead at its ceiling
/// stays dead when a later statement of the same claim errors, so it is
/// counted then too (docs/adr/0141): here the claim takes one tenant a
/// statement (`limit` 1), tenant_a's only due delivery is at its ceiling, and
/// a trigger makes the claim of tenant_b's delivery raise.
///
/// Mutation check: counted only when the walk returned
/// (`delivery_ceiling_lost_on_error`) leaves the death uncounted; seen
/// failing under it.
#[tokio::test]
async fn a_delivery_dead_at_its_ceiling_is_counted_when_the_claim_then_errors() {
    let t = TestDb::new().await;
    let rx = Receiver::answering(200).await;
    endpoint(&t, "tenant_a", &rx.url()).await;
    endpoint(&t, "tenant_b", &rx.url()).await;
    events(&t.db, "tenant_a", 1).await;
    events(&t.db, "tenant_b", 1).await;
    let cfg = config();
    let max = i32::try_from(cfg.retry_schedule.max_attempts()).unwrap();
    t.refuse_updates(
        "webhook_deliveries",
        "refuse_tenant_b",
        "NEW.tenant_id = 'tenant_b'",
    )
    .await;
    sqlx::query(
        "UPDATE webhook_deliveries SET attempts = $1, next_attempt_at = now() - interval '1 second' \
         WHERE tenant_id = 'tenant_a'",
    )
    .bind(max)
    .execute(&mut t.superuser().await)
    .await
    .unwrap();
    let (w, metrics) = worker(&t.db, cfg);
    let claimed = as_leader(
        &manager(&t.db, "worker"),
        Role::WebhookDelivery,
        |tick| async move { w.claim_due(&tick.fence, 1).await.map(|c| c.len()) },
    )
    .await;
    let error = claimed.expect_err("tenant_b's claim raises").to_string();
    assert!(error.contains("refused for the test"), "{error}");
    let d = deliveries(&t.db).await;
    assert_eq!(
        d.iter()
            .map(|d| (d.status.as_str(), d.attempts))
            .collect::<Vec<_>>(),
        vec![("dead", max), ("pending", 0)],
        "tenant_a's statement committed before tenant_b's raised"
    );
    let rendered = metrics.render();
    assert!(
        rendered.contains("hardcount_webhook_deliveries_total{outcome=\"dead\"} 1"),
        "{rendered}"
    );
    assert_eq!(rx.requests().len(), 0);
}

/// A new worker exports at 0 each outcome `HardcountWebhookEndpointsFailing`
/// reads: a series made at its first outcome had that outcome unseen by the
/// alert's `increase()` (docs/adr/0141). Mutation
/// `delivery_outcomes_not_zeroed` fails here.
#[tokio::test]
async fn a_new_worker_exports_the_alerted_outcomes_at_zero() {
    let t = TestDb::new().await;
    let (_, metrics) = worker(&t.db, config());
    let rendered = metrics.render();
    for outcome in webhook_delivery::OUTCOMES_ALERTED {
        let line = format!("hardcount_webhook_deliveries_total{{outcome=\"{outcome}\"}} 0");
        assert!(rendered.lines().any(|l| l == line), "{line} in {rendered}");
    }
}
