//! Wake-ups across a crash (docs/adr/0014): the replica listening for
//! wake-ups is SIGKILLed; the next leader listens in its turn, is woken by
//! each event and delivers it, not after its 5 s intervals. Without a listener, the
//! served roles' idle probes deliver within about two probes (docs/adr/0019).

use std::time::{Duration, Instant};

use db::{Row, sql};
use testbed::receiver::Receiver;
use testbed::{Leg, TestDb};

use crate::serve::{Serve, metric};

async fn holders(t: &TestDb) -> Vec<Option<String>> {
    t.db.fetch_all(sql("SELECT holder_id FROM leader_leases \
         WHERE role IN ('webhook_outbox', 'webhook_delivery') ORDER BY role"))
        .await
        .unwrap()
        .iter()
        .map(|r| r.get("holder_id"))
        .collect()
}

fn held_by(holders: &[Option<String>], pid: u32) -> bool {
    let pid = format!(":{pid}:");
    holders
        .iter()
        .all(|h| h.as_deref().is_some_and(|h| h.contains(&pid)))
}

/// Enqueue one event and return how long until the receiver had its POST.
async fn one_delivery(t: &TestDb, rx: &Receiver, n: usize) -> Duration {
    let before = rx.count();
    let started = Instant::now();
    let mut tx = t.db.begin().await.unwrap();
    webhook_outbox::enqueue(
        &mut tx,
        "tenant_a",
        "invoice.paid",
        &format!(r#"{{"n":{n}}}"#),
    )
    .await
    .unwrap();
    tx.commit().await.unwrap();
    rx.until(Duration::from_secs(30), &format!("event {n}"), |r| {
        r.count() > before
    })
    .await;
    started.elapsed()
}

/// `hardcount_wakeups_total` of the two webhook roles on `serve`'s /metrics.
async fn wakeups(serve: &Serve) -> (f64, f64) {
    let (status, body) = serve.get("/metrics").await;
    assert_eq!(status, 200);
    let of = |role: &str| {
        metric(
            &body,
            &format!("hardcount_wakeups_total{{role=\"{role}\"}}"),
        )
        .unwrap_or_else(|| panic!("no hardcount_wakeups_total for {role} in\n{body}"))
    };
    (of("webhook_outbox"), of("webhook_delivery"))
}

/// Until replica `pid` has led both webhook roles for over a second without a
/// break: its ticks stay open, so they listen (or, without a listener, probe). (A tick that started before the
/// replica's listener was up ends at once, as without one.)
async fn until_listening_leader(t: &TestDb, pid: u32, limit: Duration) {
    let started = Instant::now();
    let mut since: Option<Instant> = None;
    loop {
        if held_by(&holders(t).await, pid) {
            if since.get_or_insert_with(Instant::now).elapsed() > Duration::from_millis(1200) {
                return;
            }
        } else {
            since = None;
        }
        assert!(
            started.elapsed() < limit,
            "replica {pid} never kept both webhook roles"
        );
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn after_a_sigkill_of_the_listening_leader_the_next_leader_listens_and_delivers() {
    let t = TestDb::new().await;
    let rx = Receiver::answering(200).await;
    webhook_delivery::create_endpoint(
        &t.api(),
        &webhook_delivery::Keyring::parse(testbed::SECRETS_KEY).unwrap(),
        "tenant_a",
        &rx.url_at("/a"),
        &["invoice.paid"],
    )
    .await
    .unwrap();
    let listen_url = t.app_url(Leg::Direct);
    let env = [
        ("HARDCOUNT_ROLES", "webhook_outbox,webhook_delivery"),
        ("HARDCOUNT_WEBHOOK_ALLOWLIST", "127.0.0.0/8"),
        ("HARDCOUNT_WEBHOOK_OUTBOX_INTERVAL", "5s"),
        ("HARDCOUNT_WEBHOOK_DELIVERY_INTERVAL", "5s"),
        ("HARDCOUNT_LISTEN_URL", listen_url.as_str()),
    ];
    let url = t.app_url(Leg::current());
    let mut a = Serve::start(&url, &env).await;
    until_listening_leader(&t, a.child.id(), Duration::from_secs(30)).await;
    let first = one_delivery(&t, &rx, 0).await;
    let b = Serve::start(&url, &env).await;
    a.signal("KILL");
    a.wait(Duration::from_secs(5)).await;
    // The killed leases expire after their TTL (10 s); B then leads both roles.
    until_listening_leader(&t, b.child.id(), Duration::from_secs(60)).await;
    let before = wakeups(&b).await;
    let mut after = Vec::new();
    for n in 1..=3 {
        after.push(one_delivery(&t, &rx, n).await);
        tokio::time::sleep(Duration::from_millis(100)).await;
    }
    let woken = wakeups(&b).await;
    println!(
        "commit to POST: {first:?} from the first leader, {after:?} from the next; \
         wake-ups received by the next (outbox, delivery): {before:?} then {woken:?}"
    );
    // A listening tick waits for a poke or its 5 s interval: each event is
    // delivered well inside one, so each was poked (scripts/mutation-check
    // `wake_pokes`: a listener that counts but does not poke fails here).
    let waits: Vec<Duration> = std::iter::once(first).chain(after).collect();
    assert!(
        waits.iter().all(|w| *w < Duration::from_secs(1)),
        "{waits:?}"
    );
    // And the next leader listens: each event's commit woke its outbox (the
    // producer's pg_notify) and each fan-out its delivery role. Without a
    // listener the idle probes also deliver within a second (docs/adr/0019),
    // and on a loaded 2-core machine the waits alone cannot tell the two
    // apart (an earlier form of this test asked for two of four under 40 ms
    // and failed once so); the counter can (`serve_listens`: serve without
    // its listener fails here).
    assert!(
        woken.0 - before.0 >= 3.0 && woken.1 - before.1 >= 3.0,
        "the next leader was not woken by each event: {before:?} then {woken:?}"
    );
    drop(b);
}

/// Without `HARDCOUNT_LISTEN_URL`, the leader's idle ticks probe (docs/adr/0019):
/// an event into idle roles with 5 s intervals is delivered well inside one
/// interval, each of three.
///
/// Mutation check: `serve` building the dispatcher without
/// `with_idle_probe` leaves the outbox to its 5 s interval and this test
/// fails (scripts/mutation-check `serve_probes`).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn without_a_listen_url_an_event_into_idle_served_roles_is_delivered_within_probes() {
    let t = TestDb::new().await;
    let rx = Receiver::answering(200).await;
    webhook_delivery::create_endpoint(
        &t.api(),
        &webhook_delivery::Keyring::parse(testbed::SECRETS_KEY).unwrap(),
        "tenant_a",
        &rx.url_at("/a"),
        &["invoice.paid"],
    )
    .await
    .unwrap();
    let env = [
        ("HARDCOUNT_ROLES", "webhook_outbox,webhook_delivery"),
        ("HARDCOUNT_WEBHOOK_ALLOWLIST", "127.0.0.0/8"),
        ("HARDCOUNT_WEBHOOK_OUTBOX_INTERVAL", "5s"),
        ("HARDCOUNT_WEBHOOK_DELIVERY_INTERVAL", "5s"),
    ];
    let a = Serve::start(&t.app_url(Leg::current()), &env).await;
    until_listening_leader(&t, a.child.id(), Duration::from_secs(30)).await;
    let mut waits = Vec::new();
    for n in 0..3 {
        waits.push(one_delivery(&t, &rx, n).await);
        tokio::time::sleep(Duration::from_millis(70)).await;
    }
    println!("commit to POST without a listener: {waits:?}");
    assert!(
        waits.iter().all(|w| *w < Duration::from_millis(1000)),
        "{waits:?}"
    );
    drop(a);
}
