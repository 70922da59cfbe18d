//! The two roles wired the way the binary wires them: `scheduler::run_role`
//! with `scheduler::work` around each crate's `run_tick`.

use std::time::Duration;

use leader::{Role, Telemetry};
use scheduler::{RoleSpec, run_role, work};
use testbed::TestDb;
use testbed::leadership::until_ticks;
use tokio_util::sync::CancellationToken;
use webhook_outbox::{Dispatcher, DispatcherConfig};

use crate::{config, deliveries, endpoint, manager, verify, worker};
use testbed::receiver::Receiver;

#[tokio::test]
async fn an_enqueued_event_reaches_its_receiver_through_both_role_loops() {
    let t = TestDb::new().await;
    let rx = Receiver::answering(200).await;
    let ep = endpoint(&t, "tenant_a", &rx.url()).await;
    let dispatcher =
        Dispatcher::new(t.db.clone(), DispatcherConfig::default(), Telemetry::noop()).unwrap();
    let (w, _) = worker(&t.db, config());
    let interval = Duration::from_millis(100);
    let specs = [
        RoleSpec {
            role: Role::WebhookOutbox,
            interval,
            work: work(move |tick| {
                let dispatcher = dispatcher.clone();
                async move { dispatcher.run_tick(&tick).await.end }
            }),
        },
        RoleSpec {
            role: Role::WebhookDelivery,
            interval,
            work: work(move |tick| {
                let w = w.clone();
                async move { w.run_tick(&tick).await.end }
            }),
        },
    ];
    let shutdown = CancellationToken::new();
    let replica = manager(&t.db, "replica");
    let mut ticks = replica.ticks();
    let loops: Vec<_> = specs
        .into_iter()
        .map(|spec| tokio::spawn(run_role(replica.clone(), spec, shutdown.clone())))
        .collect();

    let mut tx = t.db.begin().await.unwrap();
    webhook_outbox::enqueue(
        &mut tx,
        "tenant_a",
        "invoice.paid",
        r#"{"invoice": "in_9"}"#,
    )
    .await
    .unwrap();
    tx.commit().await.unwrap();
    let waited = rx.until_count(1, Duration::from_secs(10)).await;
    println!("commit to receiver through two role loops: {waited:?}");
    verify(&ep.secret.expose(), &rx.requests()[0]).unwrap();
    // The tick that sent it was still waiting for the answer: its end, after
    // the outcome is written, is the next delivery tick announced.
    let sent_during = ticks.borrow().role(Role::WebhookDelivery).completed;
    until_ticks(
        &mut ticks,
        Duration::from_secs(10),
        "the sending tick's end",
        |l| l.role(Role::WebhookDelivery).completed > sent_during,
    )
    .await;
    assert_eq!(deliveries(&t.db).await[0].status, "delivered");
    shutdown.cancel();
    for l in loops {
        l.await.unwrap();
    }
    assert_eq!(rx.requests().len(), 1);
}
