//! Deliveries the fan-out claims for the delivery role of its own process
//! (docs/adr/0087): claimed only under that role's live token, sent once by
//! its tick without a claim statement, and written once, with their first
//! outcome (docs/adr/0124); inserted pending by the fan-out after their lease
//! when nobody wrote them.

use std::future::Future;
use std::sync::{Arc, Mutex};
use std::time::Duration;

use db::{Db, Row, sql};
use leader::{Role, Tick};
use outbox::webhook::HandedDelivery;
use scheduler::Wake;
use testbed::TestDb;
use testbed::receiver::{Receiver, Reply};
use webhook_delivery::{Worker, WorkerConfig};

use crate::{
    as_leader, config, deliveries, endpoint, endpoint_state, enqueue_payloads, events,
    events_handed_over, led_role, manager, payloads_handed_over, tick, worker,
};

/// A delivery worker of this bed woken by (and taking handed rows from) the
/// returned wake of its role.
fn waking_worker(db: &Db) -> (Wake, Worker) {
    let wake = Wake::new(Role::WebhookDelivery, Duration::from_secs(5));
    let (w, _) = worker(db, config());
    (wake.clone(), w.with_wake(wake))
}

/// Offer `wake`'s relay to the fan-out as a delivery tick leading under
/// `token` would (its lease, its room), then fan out `events` events of
/// tenant_a handed over to it.
async fn offered(db: &Db, wake: &Wake, token: i64, lease: Duration, room: usize, events: usize) {
    wake.relay().lead(token, lease, room, usize::MAX);
    events_handed_over(db, "tenant_a", events, Some(wake)).await;
}

/// As the delivery role's leader: [`offered`] under the tick's own token
/// (`lease`, `room`, `events`), then `then` with the tick.
async fn leading_offered<T, F, Fut>(
    db: &Db,
    wake: &Wake,
    (lease, room, events): (Duration, usize, usize),
    then: F,
) -> T
where
    F: FnOnce(Tick) -> Fut,
    Fut: Future<Output = T>,
{
    as_leader(
        &manager(db, "w"),
        Role::WebhookDelivery,
        |tick| async move {
            offered(db, wake, tick.fence.token(), lease, room, events).await;
            then(tick).await
        },
    )
    .await
}

/// While the delivery role leads under a token, a fan-out handed its relay
/// claims up to the room offered (not written: one handoff row holds their
/// pairs, the lease ahead) and inserts the rest pending; under a token the
/// role does not hold it claims none.
///
/// Mutation check: the fan-out without `leader_fence('webhook_delivery', $8)`
/// claims for the stale token too, and this test fails (scripts/mutation-check
/// `relay_fence`).
#[tokio::test]
async fn the_fan_out_claims_for_the_delivery_role_only_under_its_live_token() {
    let t = TestDb::new().await;
    endpoint(&t, "tenant_a", "http://127.0.0.1:9/a").await;
    endpoint(&t, "tenant_a", "http://127.0.0.1:9/b").await;
    let wake = Wake::new(Role::WebhookDelivery, Duration::from_secs(5));
    let (db, relay) = (t.db.clone(), wake.clone());
    as_leader(
        &manager(&t.db, "w"),
        Role::WebhookDelivery,
        |tick| async move {
            let token = tick.fence.token();
            offered(&db, &relay, token + 1, Duration::from_secs(30), 3, 1).await;
            assert_eq!(relay.relay().waiting(), 0, "a stale token claims nothing");
            offered(&db, &relay, token, Duration::from_secs(30), 3, 2).await;
            assert_eq!(relay.relay().waiting(), 3, "the room offered");
        },
    )
    .await;
    let pending: Vec<(i32, bool)> = deliveries(&t.db)
        .await
        .iter()
        .map(|d| (d.attempts, d.due_in > 20.0))
        .collect();
    assert_eq!(pending, [(0, false), (0, false), (0, false)]);
    assert_eq!(handoffs(&t.db).await, [(3, true)]);
}

/// Each `webhook_handoffs` row: its number of pairs, and whether its lease
/// ends more than 20 s from now.
async fn handoffs(db: &Db) -> Vec<(i32, bool)> {
    db.fetch_all(sql(
        "SELECT cardinality(event_ids) AS pairs, until > now() + interval '20 seconds' AS ahead \
         FROM webhook_handoffs ORDER BY id",
    ))
    .await
    .unwrap()
    .iter()
    .map(|r| (r.get("pairs"), r.get("ahead")))
    .collect()
}

/// The room is bounded in payload bytes as well as rows (docs/adr/0098): four
/// events of about 60 KiB to two endpoints (eight deliveries) under a room of
/// 100 rows and 200 KiB hand over three, and leave the rest pending for the
/// claim statement. Before, rows alone bounded it: eight batches of rows, each
/// with its own copy of a payload of up to 256 KiB, about 1 GiB held by one
/// statement's result and the relay at the shipped defaults.
///
/// Mutation check: the fan-out without its bytes bound hands all eight over,
/// and this test fails (scripts/mutation-check `relay_bytes_unbounded`).
#[tokio::test]
async fn the_fan_out_hands_over_no_more_payload_bytes_than_offered() {
    let t = TestDb::new().await;
    endpoint(&t, "tenant_a", "http://127.0.0.1:9/a").await;
    endpoint(&t, "tenant_a", "http://127.0.0.1:9/b").await;
    let wake = Wake::new(Role::WebhookDelivery, Duration::from_secs(5));
    let (db, relay) = (t.db.clone(), wake.clone());
    let blob = "x".repeat(60 * 1024);
    let payloads: Vec<String> = (0..4)
        .map(|i| format!(r#"{{"n": {i}, "blob": "{blob}"}}"#))
        .collect();
    as_leader(
        &manager(&t.db, "w"),
        Role::WebhookDelivery,
        |tick| async move {
            let lease = Duration::from_secs(30);
            relay
                .relay()
                .lead(tick.fence.token(), lease, 100, 200 * 1024);
            payloads_handed_over(&db, "tenant_a", &payloads, Some(&relay)).await;
            assert_eq!(relay.relay().waiting(), 3, "the bytes offered");
        },
    )
    .await;
    let attempts: Vec<i32> = deliveries(&t.db).await.iter().map(|d| d.attempts).collect();
    assert_eq!(attempts, [0, 0, 0, 0, 0], "the rest, pending");
    assert_eq!(handoffs(&t.db).await, [(3, true)]);
}

/// A fan-out while a delivery tick runs in the same process hands its
/// deliveries over: each is sent once, at attempt 1, and its row is inserted
/// after its attempt was claimed (`created_at` after `last_attempt_at`, the
/// fan-out's time: not inserted claimed by the fan-out as before); the
/// handoff that stood for them is deleted once all are written
/// (docs/adr/0124).
///
/// Mutation check: without the handoff's deletion the row stays and this
/// test fails (scripts/mutation-check `handoff_kept`).
///
/// Mutation check: a tick that never takes the handed deliveries leaves them
/// to their handoff's lease, after which only a fan-out would insert them
/// (none runs here), no request arrives and this test fails
/// (scripts/mutation-check `relay_taken`).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn deliveries_handed_over_are_sent_once_by_the_running_tick() {
    let t = TestDb::new().await;
    let rx = Receiver::answering(200).await;
    endpoint(&t, "tenant_a", &rx.url()).await;
    endpoint(&t, "tenant_a", &rx.url_at("/b")).await;
    let wake = Wake::new(Role::WebhookDelivery, Duration::from_secs(5));
    let (w, _) = worker(&t.db, config());
    let w = w
        .with_idle_probe(Duration::from_secs(16))
        .with_wake(wake.clone());
    let (role, shutdown) = led_role(&t.db, w);
    tokio::time::sleep(Duration::from_millis(300)).await;
    events_handed_over(&t.db, "tenant_a", 3, Some(&wake)).await;
    rx.until_count(6, Duration::from_secs(5)).await;
    tokio::time::sleep(Duration::from_millis(300)).await;
    shutdown.cancel();
    role.await.unwrap();
    assert_eq!(rx.count(), 6, "each delivery sent once");
    let d = deliveries(&t.db).await;
    assert!(d.iter().all(|d| d.delivered && d.attempts == 1), "{d:?}");
    let after: i64 =
        t.db.fetch_one(sql(
            "SELECT count(*) AS n FROM webhook_deliveries WHERE created_at > last_attempt_at",
        ))
        .await
        .unwrap()
        .get("n");
    assert_eq!(after, 6, "each written after its attempt");
    assert_eq!(handoffs(&t.db).await, [], "the handoff is deleted");
}

/// Deliveries handed over that no tick wrote (the process stopped) are not
/// lost: once their handoff's lease has passed, the fan-out inserts them
/// pending at attempt 1 (the attempt may have been made), skipping a pair
/// already written, and the claim statement of whoever leads sends them at
/// attempt 2. Before the lease ends, and under a stale token, the fan-out
/// inserts nothing.
///
/// Mutation checks: a fan-out that takes handoffs before their lease ends
/// (`handoff_early`), or under any token (`handoff_unfenced`), inserts the
/// pending row too soon and this test fails; so does one that never takes
/// them (`handoff_never`), and one whose insert meets the pair already
/// written without `ON CONFLICT` (`recover_unique`: the statement fails and
/// the pair never written is not inserted either).
#[tokio::test]
async fn handed_deliveries_nobody_wrote_are_inserted_pending_after_their_lease() {
    let t = TestDb::new().await;
    let rx = Receiver::answering(200).await;
    endpoint(&t, "tenant_a", &rx.url()).await;
    endpoint(&t, "tenant_a", &rx.url_at("/b")).await;
    let wake = Wake::new(Role::WebhookDelivery, Duration::from_secs(5));
    let offer = (Duration::from_secs(3), 10, 1);
    leading_offered(&t.db, &wake, offer, |_| async {
        assert_eq!(
            wake.relay().take::<HandedDelivery>(10).len(),
            2,
            "handed, then dropped"
        );
    })
    .await;
    // The second pair was written before the process stopped.
    t.db.execute(sql("INSERT INTO webhook_deliveries \
             (tenant_id, event_id, endpoint_id, attempts, status, delivered_at, last_attempt_at) \
         SELECT tenant_ids[2], event_ids[2], endpoint_ids[2], 1, 'delivered', now(), now() \
         FROM webhook_handoffs"))
        .await
        .unwrap();
    let (w, _) = worker(&t.db, config());
    events_handed_over(&t.db, "tenant_a", 0, None).await;
    tick(&t.db, &w).await;
    assert_eq!(rx.count(), 0, "nothing inserted while the lease runs");
    tokio::time::sleep(Duration::from_millis(3200)).await;
    let (d, db) = (dispatcher(&t.db), &t.db);
    let old = as_leader(
        &manager(db, "old"),
        Role::WebhookOutbox,
        |tick| async move { tick.fence },
    )
    .await;
    let by_old = as_leader(&manager(db, "new"), Role::WebhookOutbox, |_| async move {
        d.dispatch_batch(&old, 100).await.unwrap();
        deliveries(db).await.len()
    })
    .await;
    assert_eq!(by_old, 1, "a stale token inserts nothing");
    events_handed_over(&t.db, "tenant_a", 0, None).await;
    assert!(handoffs(&t.db).await.is_empty());
    tick(&t.db, &w).await;
    assert_eq!(rx.count(), 1, "only the pair never written");
    let d: Vec<(i32, bool)> = deliveries(&t.db)
        .await
        .iter()
        .map(|d| (d.attempts, d.delivered))
        .collect();
    assert_eq!(d, [(1, true), (2, true)]);
}

/// A fan-out dispatcher of this bed, handing nothing over.
fn dispatcher(db: &Db) -> webhook_outbox::Dispatcher {
    webhook_outbox::Dispatcher::new(
        db.clone(),
        webhook_outbox::DispatcherConfig::default(),
        leader::Telemetry::noop(),
    )
    .unwrap()
}

/// A tick cancelled (a shutdown, a lost lease) with deliveries handed over
/// and not yet taken hands them back at once, inserted pending, due now and
/// their attempt not counted, instead of leaving them to their handoff's
/// lease. One the fan-out inserted meanwhile (as after the lease) is left as
/// it is and reported stale (docs/adr/0089, 0124); the handoff is deleted.
///
/// Mutation checks: without the hand-back they stay claimed for their lease
/// and this test fails (scripts/mutation-check `relay_hand_back`); so does
/// a tick's report leaving the superseded hold out of `stale`
/// (`hold_stale_reported`).
#[tokio::test]
async fn a_cancelled_tick_hands_back_the_deliveries_it_did_not_take() {
    let t = TestDb::new().await;
    endpoint(&t, "tenant_a", "http://127.0.0.1:9/a").await;
    let (wake, w) = waking_worker(&t.db);
    let offer = (Duration::from_secs(30), 10, 3);
    let (relay, db) = (&wake, &t.db);
    let report = leading_offered(&t.db, &wake, offer, |tick| async move {
        assert_eq!(relay.relay().waiting(), 3);
        // The last one inserted by the fan-out, as after the lease.
        written_as_after_the_lease(db, 3).await;
        tick.cancel.cancel();
        w.run_tick(&tick).await
    })
    .await;
    let counts = (report.claimed, report.held, report.stale);
    assert_eq!(counts, (0, 2, 1), "{report:?}");
    assert_eq!(wake.relay().waiting(), 0);
    let d: Vec<(i32, bool)> = deliveries(&t.db)
        .await
        .iter()
        .map(|d| (d.attempts, d.due_in <= 0.0))
        .collect();
    assert_eq!(d, [(1, false), (0, true), (0, true)]);
    assert_eq!(handoffs(&t.db).await, []);
}

/// A handed delivery whose pair the fan-out wrote meanwhile (as after its
/// handoff's lease) is sent, and its outcome is stale: the pair is left as
/// the fan-out wrote it. The rest of its group is written. The group's
/// plain insert fails on the pair's key and the group is written again with
/// the insert that skips it (docs/adr/0126).
///
/// Mutation check: without that second write the group's outcomes are not
/// written, the two others are handed back or left to their lease, and
/// this test fails (scripts/mutation-check `unwritten_conflict_retried`).
#[tokio::test]
async fn an_outcome_whose_pair_was_written_meanwhile_is_stale_and_its_group_is_written() {
    let t = TestDb::new().await;
    let rx = Receiver::answering(200).await;
    endpoint(&t, "tenant_a", &rx.url()).await;
    let (wake, w) = waking_worker(&t.db);
    let offer = (Duration::from_secs(30), 10, 3);
    let (relay, db) = (&wake, &t.db);
    let report = leading_offered(&t.db, &wake, offer, |tick| async move {
        assert_eq!(relay.relay().waiting(), 3);
        written_as_after_the_lease(db, 3).await;
        w.run_tick(&tick).await
    })
    .await;
    assert_eq!(rx.count(), 3, "each handed delivery sent");
    let counts = (report.delivered, report.stale, report.unrecorded);
    assert_eq!(counts, (2, 1, 0), "{report:?}");
    let d: Vec<(i32, bool)> = deliveries(&t.db)
        .await
        .iter()
        .map(|d| (d.attempts, d.delivered))
        .collect();
    assert_eq!(d, [(1, false), (1, true), (1, true)]);
    assert_eq!(handoffs(&t.db).await, []);
}

/// Insert the `n`th pair of the (only) handoff pending at attempt 1, due in
/// an hour, as the fan-out inserts a pair after its handoff's lease.
async fn written_as_after_the_lease(db: &Db, n: i32) {
    db.execute(
        sql("INSERT INTO webhook_deliveries \
                 (tenant_id, event_id, endpoint_id, attempts, next_attempt_at) \
             SELECT tenant_ids[$1], event_ids[$1], endpoint_ids[$1], 1, now() + interval '1 hour' \
             FROM webhook_handoffs")
        .bind(n),
    )
    .await
    .unwrap();
}

/// A 410 for a handed delivery whose pair the fan-out wrote meanwhile is
/// stale: its single write (the outcome and the endpoint's disabling in one
/// transaction) fails on the pair's key, is written again skipping it, and
/// then applies nothing, so the endpoint stays on (docs/adr/0112, 0126).
///
/// Mutation check: without that second write the 410's outcome is not
/// recorded at all and this test fails (scripts/mutation-check
/// `gone_conflict_retried`).
#[tokio::test]
async fn a_410_whose_pair_was_written_meanwhile_is_stale_and_leaves_the_endpoint_on() {
    let t = TestDb::new().await;
    let rx = Receiver::answering(410).await;
    endpoint(&t, "tenant_a", &rx.url()).await;
    let (wake, w) = waking_worker(&t.db);
    let offer = (Duration::from_secs(30), 10, 1);
    let db = &t.db;
    let report = leading_offered(&t.db, &wake, offer, |tick| async move {
        written_as_after_the_lease(db, 1).await;
        w.run_tick(&tick).await
    })
    .await;
    assert_eq!(rx.count(), 1);
    let counts = (report.dead, report.stale, report.unrecorded);
    assert_eq!(counts, (0, 1, 0), "{report:?}");
    let enabled: bool =
        t.db.fetch_one(sql("SELECT enabled FROM webhook_endpoints"))
            .await
            .unwrap()
            .get("enabled");
    assert!(enabled, "a stale 410 turns nothing off");
    let d: Vec<(i32, String)> = deliveries(&t.db)
        .await
        .into_iter()
        .map(|d| (d.attempts, d.status))
        .collect();
    assert_eq!(d, [(1, "pending".to_owned())]);
}

/// A handed delivery of an event whose payload is larger than the fan-out
/// carries through its pairs (4 KiB; docs/adr/0126) sends that payload: its
/// event's part reads it from the event (docs/adr/0127).
///
/// Mutation check: the larger payloads not read (an empty object sent
/// instead) make this test fail (scripts/mutation-check
/// `carried_large_payload`).
#[tokio::test]
async fn a_handed_delivery_of_a_large_event_sends_its_payload() {
    let t = TestDb::new().await;
    let rx = Receiver::answering(200).await;
    endpoint(&t, "tenant_a", &rx.url()).await;
    let (wake, w) = waking_worker(&t.db);
    let blob = "y".repeat(6 * 1024);
    let payload = format!(r#"{{"blob": "{blob}"}}"#);
    let (db, relay) = (&t.db, &wake);
    let report = as_leader(
        &manager(&t.db, "w"),
        Role::WebhookDelivery,
        |tick| async move {
            relay
                .relay()
                .lead(tick.fence.token(), Duration::from_secs(30), 10, usize::MAX);
            payloads_handed_over(db, "tenant_a", &[payload], Some(relay)).await;
            assert_eq!(relay.relay().waiting(), 1, "handed over");
            w.run_tick(&tick).await
        },
    )
    .await;
    assert_eq!(report.delivered, 1, "{report:?}");
    let requests = rx.requests();
    let body: serde_json::Value = serde_json::from_slice(&requests[0].body).unwrap();
    assert_eq!(
        body["data"]["blob"].as_str().map(str::len),
        Some(6 * 1024),
        "{body}"
    );
}

/// A delivery handed over sends its event as one claimed from the table
/// does: the fan-out makes the event's columns once, in its stamp, and each
/// handed delivery of the event carries them (docs/adr/0126). One event for
/// two endpoints, room for one: the first endpoint's delivery is handed
/// over, the second's is inserted pending and claimed by the tick's claim
/// statement; both requests carry the same `webhook-id` and body (type,
/// event time and payload), and the body is the event's.
///
/// Mutation check: the handed event's time made otherwise than the claim's
/// (`created_at::text`) changes the handed request's body and this test
/// fails (scripts/mutation-check `carried_event_time`).
#[tokio::test]
async fn a_handed_delivery_sends_its_event_as_a_claimed_one_does() {
    let t = TestDb::new().await;
    let rx = Receiver::answering(200).await;
    endpoint(&t, "tenant_a", &rx.url_at("/a")).await;
    endpoint(&t, "tenant_a", &rx.url_at("/b")).await;
    let (wake, w) = waking_worker(&t.db);
    let offer = (Duration::from_secs(30), 1, 1);
    let relay = &wake;
    let report = leading_offered(&t.db, &wake, offer, |tick| async move {
        assert_eq!(relay.relay().waiting(), 1, "one handed over");
        w.run_tick(&tick).await
    })
    .await;
    assert_eq!(report.delivered, 2, "{report:?}");
    let mut requests = rx.requests();
    requests.sort_by(|a, b| a.path.cmp(&b.path));
    let [a, b] = &requests[..] else {
        panic!("{requests:?}")
    };
    assert_eq!(a.header("webhook-id"), b.header("webhook-id"));
    assert_eq!(
        a.body, b.body,
        "the handed request's body is the claimed one's"
    );
    let body: serde_json::Value = serde_json::from_slice(&a.body).unwrap();
    assert_eq!(body["data"]["invoice"], "in_0", "{body}");
    assert_eq!(body["type"], "invoice.finalized", "{body}");
    let time = body["timestamp"].as_str().unwrap();
    assert!(time.ends_with('Z') && time.contains('.'), "{time}");
}

/// A claim statement that comes back full means the table holds a backlog:
/// the tick closes its relay (no room offered, so the fan-out leaves its
/// deliveries pending, to be claimed in due order and by tenant) until a
/// claim comes back short, which opens it again. Each request records
/// whether the relay offered room when it arrived: the first batch's (a
/// full claim; the answers wait 50 ms, so the short claim of the backlog's
/// last row is made after it) saw none, the last request (claimed by the
/// short claim) saw some.
///
/// Mutation check: with the relay left open after a full claim, the first
/// request sees room offered and this test fails (scripts/mutation-check
/// `relay_closes`).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_full_claim_statement_closes_the_relay_until_one_comes_back_short() {
    let t = TestDb::new().await;
    let wake = Wake::new(Role::WebhookDelivery, Duration::from_secs(5));
    let seen = Arc::new(Mutex::new(Vec::new()));
    let (relay, log) = (wake.clone(), seen.clone());
    let rx = Receiver::start(move |_| {
        log.lock().unwrap().push(relay.relay().offer().is_some());
        Reply::Delayed(Duration::from_millis(50), 200)
    })
    .await;
    for path in ["/a", "/b", "/c"] {
        endpoint(&t, "tenant_a", &rx.url_at(path)).await;
    }
    // A backlog of 21 deliveries in the table, claimed two at a time.
    events(&t.db, "tenant_a", 7).await;
    let (w, _) = worker(
        &t.db,
        WorkerConfig {
            batch_size: 2,
            ..config()
        },
    );
    let w = w.with_wake(wake.clone());
    let report = tick(&t.db, &w).await;
    assert_eq!((report.claimed, report.delivered), (21, 21), "{report:?}");
    let seen = seen.lock().unwrap().clone();
    assert_eq!(seen.len(), 21);
    assert!(!seen[0], "the first, full claim closed the relay: {seen:?}");
    assert!(seen[20], "the last, short claim opened it: {seen:?}");
}

/// While deliveries handed over fill whole batches, the claim statement still
/// runs at least once a second, for half a batch, so a delivery due in the
/// table (a retry, a held one) is not kept behind a long fan-out. One
/// request at a time (`max_in_flight` 1) makes arrival order the claim's:
/// the table's delivery is in the first batch, beside one handed over, not
/// after the twenty handed over.
///
/// Mutation check: a tick that takes a whole batch from the relay whenever it
/// can sends the table's delivery last and this test fails
/// (scripts/mutation-check `relay_table_every`).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_table_is_claimed_beside_handed_deliveries_that_fill_batches() {
    let t = TestDb::new().await;
    let rx = Receiver::answering(200).await;
    endpoint(&t, "tenant_b", &rx.url_at("/table")).await;
    events(&t.db, "tenant_b", 1).await;
    endpoint(&t, "tenant_a", &rx.url_at("/a")).await;
    endpoint(&t, "tenant_a", &rx.url_at("/b")).await;
    let wake = Wake::new(Role::WebhookDelivery, Duration::from_secs(5));
    // A start deadline far enough that no handed delivery is released
    // unsent while the twenty-one go out one at a time.
    let config = WorkerConfig {
        batch_size: 2,
        max_in_flight: 1,
        claim_margin: Duration::from_secs(5),
        ..config()
    };
    let (w, _) = worker(&t.db, config);
    let w = w.with_wake(wake.clone());
    let offer = (Duration::from_secs(30), 100, 10);
    let relay = &wake;
    let report = leading_offered(&t.db, &wake, offer, |tick| async move {
        assert_eq!(relay.relay().waiting(), 20);
        w.run_tick(&tick).await
    })
    .await;
    assert_eq!(report.delivered, 21, "{report:?}");
    let paths: Vec<String> = rx.requests().into_iter().map(|r| r.path).collect();
    let table = paths.iter().position(|p| p == "/table");
    assert!(table.is_some_and(|at| at < 4), "{paths:?}");
}

/// A claim statement that fails after the batch took deliveries handed over
/// does not drop them: they are claimed already (their handoff written, their
/// lease running), so the tick sends them. The statement is made to fail by
/// a lock on `webhook_endpoints` held past the role's statement timeout.
///
/// Mutation check: a tick that returns the statement's error at once leaves
/// the handed deliveries to their 30 s lease, no request arrives, and this
/// test fails (scripts/mutation-check `relay_claim_failed`).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_failed_claim_statement_still_sends_the_deliveries_handed_over() {
    let t = TestDb::new().await;
    let rx = Receiver::answering(200).await;
    endpoint(&t, "tenant_a", &rx.url()).await;
    endpoint(&t, "tenant_a", &rx.url_at("/b")).await;
    let wake = Wake::new(Role::WebhookDelivery, Duration::from_secs(5));
    // The start deadline past the failing statement's 300 ms.
    let config = WorkerConfig {
        statement_timeout: Duration::from_millis(300),
        claim_margin: Duration::from_secs(5),
        ..config()
    };
    let (w, _) = worker(&t.db, config);
    let w = w.with_wake(wake.clone());
    let offer = (Duration::from_secs(30), 10, 2);
    let (t, rx) = (&t, &rx);
    leading_offered(&t.db, &wake, offer, |tick| async move {
        let mut su = t.superuser().await;
        sqlx::raw_sql("BEGIN; LOCK TABLE webhook_endpoints IN ACCESS EXCLUSIVE MODE")
            .execute(&mut su)
            .await
            .unwrap();
        let sent = async {
            rx.until_count(4, Duration::from_secs(5)).await;
            sqlx::raw_sql("COMMIT").execute(&mut su).await.unwrap();
        };
        tokio::join!(w.run_tick(&tick), sent);
    })
    .await;
    assert_eq!(rx.count(), 4, "each handed delivery sent once");
}

/// An event fanned out again (an operator cleared its `dispatched_at`, the
/// replay of crates/webhook_outbox's docs) hands nothing over for a pair
/// already written: the deliveries it had are not sent again, as the fan-out's
/// `ON CONFLICT DO NOTHING` keeps them when it inserts.
///
/// Mutation check: without the handed pairs' check against the table, both
/// pairs are handed over and this test fails (scripts/mutation-check
/// `handoff_rehands_written`).
#[tokio::test]
async fn a_replayed_event_hands_over_no_pair_already_written() {
    let t = TestDb::new().await;
    endpoint(&t, "tenant_a", "http://127.0.0.1:9/a").await;
    endpoint(&t, "tenant_a", "http://127.0.0.1:9/b").await;
    events(&t.db, "tenant_a", 1).await;
    let mut su = t.superuser().await;
    sqlx::raw_sql(
        "UPDATE webhook_deliveries SET status = 'delivered', delivered_at = now(), attempts = 1; \
         UPDATE webhook_events SET dispatched_at = NULL",
    )
    .execute(&mut su)
    .await
    .unwrap();
    let wake = Wake::new(Role::WebhookDelivery, Duration::from_secs(5));
    let offer = (Duration::from_secs(30), 10, 0);
    leading_offered(&t.db, &wake, offer, |_| async {
        assert_eq!(wake.relay().waiting(), 0, "nothing handed over");
    })
    .await;
    assert_eq!(handoffs(&t.db).await, []);
    let d: Vec<bool> = deliveries(&t.db)
        .await
        .iter()
        .map(|d| d.delivered)
        .collect();
    assert_eq!(d, [true, true]);
    let again: bool =
        t.db.fetch_one(sql(
            "SELECT bool_and(dispatched_at IS NOT NULL) AS again FROM webhook_events",
        ))
        .await
        .unwrap()
        .get("again");
    assert!(again, "the event was fanned out again");
}

/// A fan-out that finds the relay more than half full waits for the tick to
/// take before it claims, then claims only the events whose deliveries fit
/// in the room left: a burst is handed over whole, none of it inserted
/// pending for the claim statement to read again (docs/adr/0125). Four rows
/// of room and four waiting: the next fan-out of four events waits until the
/// tick takes them, then hands all four over. Then two rows free: a fan-out
/// of four events claims two and leaves two undispatched.
///
/// Mutation checks: a fan-out that does not wait finds no room and inserts
/// the second four pending, and this test fails (scripts/mutation-check
/// `relay_room_unwaited`); one whose claim is not bounded by the room claims
/// all four of the last fan-out and inserts two pending
/// (`relay_room_unbounded`).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_fan_out_waits_for_room_in_the_relay_and_claims_only_what_fits() {
    let t = TestDb::new().await;
    endpoint(&t, "tenant_a", "http://127.0.0.1:9/a").await;
    let wake = Wake::new(Role::WebhookDelivery, Duration::from_secs(5));
    let (db, relay) = (t.db.clone(), wake.clone());
    leading_offered(&t.db, &wake, (LEASE, 4, 4), |_| async move {
        assert_eq!(relay.relay().waiting(), 4, "the room, full");
        let taker = relay.clone();
        let taken = tokio::spawn(async move {
            until_a_sender_waits(&taker).await;
            taker.relay().take::<HandedDelivery>(4).len()
        });
        events_handed_over(&db, "tenant_a", 4, Some(&relay)).await;
        assert_eq!(taken.await.unwrap(), 4);
        assert_eq!(relay.relay().waiting(), 4, "handed over once taken");
        assert_eq!(relay.relay().take::<HandedDelivery>(2).len(), 2);
        assert_eq!(
            one_fan_out(&db, &relay, 4).await,
            2,
            "the events whose deliveries fit"
        );
        assert_eq!(relay.relay().waiting(), 4);
    })
    .await;
    assert!(deliveries(&t.db).await.is_empty(), "none inserted pending");
    assert_eq!(handoffs(&t.db).await, [(4, true), (4, true), (2, true)]);
    let undispatched: i64 =
        t.db.fetch_one(sql(
            "SELECT count(*) AS n FROM webhook_events WHERE dispatched_at IS NULL",
        ))
        .await
        .unwrap()
        .get("n");
    assert_eq!(undispatched, 2, "left for a later fan-out");
}

/// A lead that ends while the fan-out waits for room is waited out: the
/// delivery role's next tick leads again, and the fan-out hands its events
/// over to it (docs/adr/0125). A wait that runs out fans out as without
/// the wait: the whole batch, what fits handed over, the rest pending.
/// Three of four rows waiting (more than half): a tick's lead ends and a
/// new one takes them; the fan-out of four events hands all four over.
/// Then three waiting again and nobody takes: after the wait, a fan-out of
/// four events hands one over and inserts three pending.
///
/// Mutation checks: a fan-out that stops waiting when the lead ends finds
/// no offer and inserts the first four pending, and this test fails
/// (scripts/mutation-check `relay_room_unled`); one that bounds its claim
/// by the room after a wait that ran out claims one event and leaves three
/// undispatched (`relay_room_bounded_late`).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_fan_out_waits_out_a_lead_that_ends_and_after_its_wait_fans_out_as_before() {
    let t = TestDb::new().await;
    endpoint(&t, "tenant_a", "http://127.0.0.1:9/a").await;
    let wake = Wake::new(Role::WebhookDelivery, Duration::from_secs(5));
    let (db, relay) = (t.db.clone(), wake.clone());
    leading_offered(&t.db, &wake, (LEASE, 4, 3), |tick| async move {
        assert_eq!(relay.relay().waiting(), 3, "more than half the room");
        let token = tick.fence.token();
        let next = relay.clone();
        let ticks = tokio::spawn(async move {
            until_a_sender_waits(&next).await;
            next.relay().unlead(token);
            // Long enough for the waiting sender to see no lead.
            tokio::time::sleep(Duration::from_millis(100)).await;
            next.relay().lead(token, LEASE, 4, usize::MAX);
            next.relay().take::<HandedDelivery>(3).len()
        });
        events_handed_over(&db, "tenant_a", 4, Some(&relay)).await;
        assert_eq!(ticks.await.unwrap(), 3);
        assert_eq!(relay.relay().waiting(), 4, "handed to the next lead");
        assert_eq!(relay.relay().take::<HandedDelivery>(1).len(), 1);
        assert_eq!(
            one_fan_out(&db, &relay, 4).await,
            4,
            "the whole batch after the wait"
        );
        assert_eq!(relay.relay().waiting(), 4, "what fitted");
    })
    .await;
    let pending: Vec<i32> = deliveries(&t.db).await.iter().map(|d| d.attempts).collect();
    assert_eq!(pending, [0, 0, 0], "the rest of the batch, pending");
    assert_eq!(handoffs(&t.db).await, [(3, true), (4, true), (1, true)]);
}

/// The claim lease the relay tests offer.
const LEASE: Duration = Duration::from_secs(30);

/// Until a fan-out waits for room in `wake`'s relay, or 5 s have passed (a
/// fan-out that does not wait fails its test's assertions instead).
async fn until_a_sender_waits(wake: &Wake) {
    let until = tokio::time::Instant::now() + Duration::from_secs(5);
    while wake.relay().senders_waiting() == 0 && tokio::time::Instant::now() < until {
        tokio::time::sleep(Duration::from_millis(2)).await;
    }
}

/// Enqueue `n` events of tenant_a and run one fan-out batch as the outbox's
/// leader, handing over to `wake`'s relay; the events it claimed.
async fn one_fan_out(db: &Db, wake: &Wake, n: usize) -> usize {
    let payloads: Vec<String> = (0..n).map(|i| format!(r#"{{"n": {i}}}"#)).collect();
    enqueue_payloads(db, "tenant_a", &payloads).await;
    let dispatcher = dispatcher(db).with_hand_over(wake.clone());
    as_leader(
        &manager(db, "outbox"),
        Role::WebhookOutbox,
        |outbox| async move { dispatcher.dispatch_batch(&outbox.fence, 500).await.unwrap() },
    )
    .await
}

/// One fan-out hands over the events of two tenants to their endpoints
/// (two and one): each delivery carries its own event and is sent to its
/// own endpoint, each pair once, though every event and endpoint comes back
/// from the statement once and is shared by its pairs (docs/adr/0127).
///
/// Mutation checks: a pair given another event's part (any one of them)
/// sends that event's body more than once and another's never, and this
/// test fails (scripts/mutation-check `handed_event_part`); so does one given
/// another endpoint's part (`handed_endpoint_part`), and an event part made
/// for each pair but the event's first (`handed_event_opens`: tenant_b's
/// events, one pair each, get none, and the statement is refused).
#[tokio::test]
async fn each_handed_delivery_carries_its_own_event_to_its_own_endpoint() {
    let t = TestDb::new().await;
    let rx = Receiver::answering(200).await;
    endpoint(&t, "tenant_a", &rx.url_at("/a1")).await;
    endpoint(&t, "tenant_a", &rx.url_at("/a2")).await;
    endpoint(&t, "tenant_b", &rx.url_at("/b1")).await;
    let b: Vec<String> = (0..2)
        .map(|i| format!(r#"{{"invoice": "b_{i}"}}"#))
        .collect();
    enqueue_payloads(&t.db, "tenant_b", &b).await;
    let (wake, w) = waking_worker(&t.db);
    let (relay, db) = (&wake, &t.db);
    let report = leading_offered(
        &t.db,
        &wake,
        (Duration::from_secs(30), 100, 2),
        |tick| async move {
            assert_eq!(relay.relay().waiting(), 6, "all handed over");
            assert_eq!(handoffs(db).await, [(6, true)], "by one statement");
            w.run_tick(&tick).await
        },
    )
    .await;
    assert_eq!(report.delivered, 6, "{report:?}");
    let mut sent: Vec<(String, String)> = rx
        .requests()
        .iter()
        .map(|r| {
            let body: serde_json::Value = serde_json::from_slice(&r.body).unwrap();
            let invoice = body["data"]["invoice"].as_str().unwrap().to_owned();
            (r.path.clone(), invoice)
        })
        .collect();
    sent.sort();
    let expected: Vec<(String, String)> = [
        ("/a1", "in_0"),
        ("/a1", "in_1"),
        ("/a2", "in_0"),
        ("/a2", "in_1"),
        ("/b1", "b_0"),
        ("/b1", "b_1"),
    ]
    .iter()
    .map(|(p, i)| ((*p).to_owned(), (*i).to_owned()))
    .collect();
    assert_eq!(sent, expected);
    let ids: std::collections::HashSet<String> = rx
        .requests()
        .iter()
        .map(|r| r.header("webhook-id").to_owned())
        .collect();
    assert_eq!(ids.len(), 4, "one message id per event");
    let d = deliveries(&t.db).await;
    assert_eq!(d.len(), 6, "{d:?}");
    assert!(d.iter().all(|d| d.delivered && d.attempts == 1), "{d:?}");
    assert_eq!(handoffs(&t.db).await, [], "the handoff is deleted");
}

/// An expired handoff of a pair not written: the last event of `tenant_a`
/// not yet dispatched, stamped dispatched as the fan-out that handed it
/// over stamped it, and its one endpoint.
async fn expired_handoff(db: &Db) {
    db.execute(sql(
        "WITH ev AS (UPDATE webhook_events SET dispatched_at = now() \
                     WHERE id = (SELECT max(id) FROM webhook_events WHERE dispatched_at IS NULL) \
                     RETURNING id) \
         INSERT INTO webhook_handoffs (until, tenant_ids, event_ids, endpoint_ids) \
         SELECT now() - interval '1 second', ARRAY['tenant_a'], ARRAY[ev.id], ARRAY[ep.id] \
         FROM ev, webhook_endpoints ep",
    ))
    .await
    .unwrap();
}

/// Pairs of expired handoffs inserted pending (at attempt 1).
async fn recovered(db: &Db) -> i64 {
    db.fetch_one(sql(
        "SELECT count(*) AS n FROM webhook_deliveries WHERE attempts = 1 AND status = 'pending'",
    ))
    .await
    .unwrap()
    .get("n")
}

/// One batch of `d` (up to `limit` events) as the webhook_outbox leader of
/// this bed; the events it dispatched.
async fn led_batch(db: &Db, d: &webhook_outbox::Dispatcher, limit: usize) -> usize {
    as_leader(
        &manager(db, "outbox"),
        Role::WebhookOutbox,
        |tick| async move { d.dispatch_batch(&tick.fence, limit).await.unwrap() },
    )
    .await
}

/// Expired handoffs are taken by their own statement (docs/adr/0127): by a
/// dispatcher's first batch even when it claims events, then by a batch that
/// claims events only once a second has passed since (a batch that claims
/// nothing always takes them), not by every fan-out statement.
///
/// Mutation checks: taking them only in batches that claim nothing leaves
/// the first handoff to the tick's drain and this test fails
/// (scripts/mutation-check `recover_only_idle`); taking them in every batch
/// takes the second one at once and fails it too (`recover_every_batch`).
#[tokio::test]
async fn a_fan_out_that_keeps_claiming_takes_expired_handoffs_once_a_second() {
    let t = TestDb::new().await;
    endpoint(&t, "tenant_a", "http://127.0.0.1:9/").await;
    let payloads: Vec<String> = (0..5).map(|i| format!(r#"{{"n": {i}}}"#)).collect();
    enqueue_payloads(&t.db, "tenant_a", &payloads).await;
    let d = dispatcher(&t.db);
    let one_batch = || async { assert_eq!(led_batch(&t.db, &d, 1).await, 1) };
    expired_handoff(&t.db).await;
    let first = std::time::Instant::now();
    one_batch().await;
    assert_eq!(recovered(&t.db).await, 1, "taken by the first batch");
    expired_handoff(&t.db).await;
    one_batch().await;
    // Two batches (a lease each) normally take a few tens of milliseconds;
    // a bed stalled past the second would make this step say nothing.
    if first.elapsed() < Duration::from_millis(900) {
        assert_eq!(recovered(&t.db).await, 1, "not by every batch");
        assert_eq!(handoffs(&t.db).await.len(), 1);
    }
    tokio::time::sleep(Duration::from_millis(1100)).await;
    one_batch().await;
    assert_eq!(recovered(&t.db).await, 2, "a second later");
    assert!(handoffs(&t.db).await.is_empty());
}

/// A recovery that fails (here a trigger refuses the expired handoff's
/// delete) fails a batch that claims nothing, as it failed the fan-out
/// statement when it was a part of it, so the lease manager's back-off and
/// the tick metrics see it. After a batch that claims it is only logged:
/// that batch's fan-out has committed and stands (docs/adr/0127).
///
/// Mutation checks: a batch that claims nothing and ignores the failure
/// returns `Ok` and this test fails (scripts/mutation-check
/// `recover_idle_failure_ignored`); a claiming batch that returns the
/// failure fails it too (`recover_claiming_failure_fails`).
#[tokio::test]
async fn a_failed_recovery_fails_a_batch_that_claims_nothing_and_not_one_that_claims() {
    let t = TestDb::new().await;
    endpoint(&t, "tenant_a", "http://127.0.0.1:9/").await;
    let payloads: Vec<String> = (0..2).map(|i| format!(r#"{{"n": {i}}}"#)).collect();
    enqueue_payloads(&t.db, "tenant_a", &payloads).await;
    expired_handoff(&t.db).await;
    let mut su = t.superuser().await;
    sqlx::raw_sql(
        "CREATE FUNCTION refuse_handoff_delete() RETURNS trigger LANGUAGE plpgsql AS \
           $$BEGIN RAISE EXCEPTION 'refused by the test'; END$$; \
         CREATE TRIGGER refuse_handoff_delete BEFORE DELETE ON webhook_handoffs \
           FOR EACH ROW EXECUTE FUNCTION refuse_handoff_delete()",
    )
    .execute(&mut su)
    .await
    .unwrap();
    let d = dispatcher(&t.db);
    let (claiming, idle) = as_leader(
        &manager(&t.db, "outbox"),
        Role::WebhookOutbox,
        |tick| async move {
            let claiming = d.dispatch_batch(&tick.fence, 10).await;
            let idle = d.dispatch_batch(&tick.fence, 10).await;
            (claiming, idle)
        },
    )
    .await;
    // That the claiming batch tried the recovery (its first try is due at
    // once) is pinned by
    // a_fan_out_that_keeps_claiming_takes_expired_handoffs_once_a_second.
    assert_eq!(claiming.unwrap(), 1, "the claiming batch stands");
    let e = idle.expect_err("the batch that claims nothing fails");
    assert!(format!("{e:?}").contains("refused by the test"), "{e:?}");
    assert_eq!(recovered(&t.db).await, 0);
    assert_eq!(handoffs(&t.db).await.len(), 1, "left for a later try");
}

/// Pairs of an expired handoff inserted pending wake the delivery role of
/// this process: by the recovery's `pg_notify` when the role listens, by a
/// poke when it does not (it would otherwise wait out its interval). A batch
/// that recovers nothing wakes neither.
///
/// Mutation checks: the recovery without its `pg_notify` leaves the
/// listening role unwoken and this test fails (scripts/mutation-check
/// `recover_notify`); without the poke the role that does not listen is left
/// unwoken (`recover_poke`).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn recovered_deliveries_wake_the_delivery_role_listening_or_not() {
    let t = TestDb::new().await;
    endpoint(&t, "tenant_a", "http://127.0.0.1:9/").await;
    let wake = Wake::new(Role::WebhookDelivery, Duration::from_secs(5));
    let d = dispatcher(&t.db).with_hand_over(wake.clone());
    // One event, stamped dispatched and handed over by a handoff whose
    // lease has ended: every batch below claims nothing.
    let expired = || async {
        enqueue_payloads(&t.db, "tenant_a", &[r#"{"n": 1}"#.to_string()]).await;
        expired_handoff(&t.db).await;
    };
    let idle_batch = || async { assert_eq!(led_batch(&t.db, &d, 10).await, 0) };
    let woken = |wake: Wake| async move { wake.wait(Duration::from_millis(1500)).await };

    // Not listening: the dispatcher pokes.
    expired().await;
    idle_batch().await;
    assert_eq!(recovered(&t.db).await, 1);
    assert!(woken(wake.clone()).await, "poked");
    idle_batch().await;
    assert!(!woken(wake.clone()).await, "nothing recovered, not poked");

    // Listening: the recovery's notification wakes it.
    let shutdown = tokio_util::sync::CancellationToken::new();
    let listener = tokio::spawn(scheduler::listen(
        t.app_url(testbed::Leg::Direct),
        vec![wake.clone()],
        Duration::from_millis(200),
        shutdown.child_token(),
    ));
    let started = std::time::Instant::now();
    while !wake.is_listening() {
        assert!(
            started.elapsed() < Duration::from_secs(10),
            "never listening"
        );
        tokio::time::sleep(Duration::from_millis(5)).await;
    }
    assert!(woken(wake.clone()).await, "set_listening pokes");
    idle_batch().await;
    assert!(
        !woken(wake.clone()).await,
        "nothing recovered, not notified"
    );
    expired().await;
    idle_batch().await;
    assert_eq!(recovered(&t.db).await, 2);
    assert!(woken(wake.clone()).await, "notified");
    shutdown.cancel();
    listener.await.unwrap();
}

/// One batch can hold an endpoint's deliveries handed over by fan-out
/// statements before and after the tenant moved it: each is sent to the
/// address it was fanned out with, and a 410 from the address left behind
/// leaves the moved endpoint on (docs/adr/0112, 0133). Before, the batch
/// prepared each endpoint once, from its first row: the second delivery went
/// to the old address too, and its 410, written against the new address,
/// turned the endpoint off with the new address never tried.
///
/// Mutation check: a batch that prepares each endpoint once again sends both
/// to `/old` and this test fails (scripts/mutation-check
/// `target_per_endpoint`); seen failing.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_batch_sends_each_delivery_to_the_address_it_was_fanned_out_with() {
    let t = TestDb::new().await;
    let rx = Receiver::start(|req| {
        if req.path == "/old" {
            Reply::Status(410)
        } else {
            Reply::Status(200)
        }
    })
    .await;
    let ep = endpoint(&t, "tenant_a", &rx.url_at("/old")).await;
    let wake = Wake::new(Role::WebhookDelivery, Duration::from_secs(5));
    let (w, _) = worker(&t.db, config());
    let w = w.with_wake(wake.clone());
    let (relay, t_ref, new_url) = (&wake, &t, rx.url_at("/new"));
    let report = as_leader(
        &manager(&t.db, "w"),
        Role::WebhookDelivery,
        |tick| async move {
            relay
                .relay()
                .lead(tick.fence.token(), Duration::from_secs(30), 100, usize::MAX);
            events_handed_over(&t_ref.db, "tenant_a", 1, Some(relay)).await;
            sqlx::query("UPDATE webhook_endpoints SET url = $2 WHERE id = $1")
                .bind(ep.id)
                .bind(&new_url)
                .execute(&mut t_ref.superuser().await)
                .await
                .unwrap();
            events_handed_over(&t_ref.db, "tenant_a", 1, Some(relay)).await;
            assert_eq!(relay.relay().waiting(), 2);
            w.run_tick(&tick).await
        },
    )
    .await;
    // Sent at once: in either order.
    let mut paths: Vec<String> = rx.requests().into_iter().map(|r| r.path).collect();
    paths.sort();
    assert_eq!(paths, ["/new", "/old"]);
    assert_eq!((report.delivered, report.dead), (1, 1), "{report:?}");
    assert!(endpoint_state(&t.db, ep.id).await.enabled);
}

/// A delivery tick dropped mid-request (as the leader manager drops a tick
/// that outlives its cancel grace) ends its lead of the relay: no fan-out of
/// the process is offered room for it, nor waits for room it will never
/// take (docs/adr/0133). Before, the lead was ended only on the tick's
/// return, and this process's fan-out waited for room before every batch
/// until it led again.
///
/// Mutation check: without the drop guard the dropped tick's lead is still
/// offered and this test fails (scripts/mutation-check `relay_lead_dropped`);
/// seen failing.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_dropped_delivery_tick_ends_its_lead_of_the_relay() {
    let t = TestDb::new().await;
    let rx = Receiver::start(|_| Reply::Delayed(Duration::from_secs(5), 200)).await;
    endpoint(&t, "tenant_a", &rx.url()).await;
    events(&t.db, "tenant_a", 1).await;
    let wake = Wake::new(Role::WebhookDelivery, Duration::from_secs(5));
    // A request outlasting the drop.
    let config = WorkerConfig {
        request_timeout: Duration::from_secs(10),
        tick_budget: Duration::from_secs(30),
        ..config()
    };
    let (w, _) = worker(&t.db, config);
    let w = w.with_wake(wake.clone());
    let relay = &wake;
    as_leader(
        &manager(&t.db, "w"),
        Role::WebhookDelivery,
        |tick| async move {
            // Dropped once its request is at the receiver, mid-request.
            let mut ticking = Box::pin(w.run_tick(&tick));
            tokio::select! {
                report = &mut ticking => panic!("the tick returned before the drop: {report:?}"),
                _ = rx.until_count(1, Duration::from_secs(10)) => {}
            }
            assert!(relay.relay().offer().is_some(), "the running tick leads");
            drop(ticking);
            assert!(
                relay.relay().offer().is_none(),
                "the dropped tick's lead is still offered"
            );
        },
    )
    .await;
}
