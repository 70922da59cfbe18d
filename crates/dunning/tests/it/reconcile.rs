//! A retry whose call timed out after the provider charged: billing's payment
//! reconciler finds the charge by its key, and dunning never charges again.

use std::time::Duration;

use billing::{Biller, BillingConfig};
use fake_provider::{Behaviour, FakeProvider};
use leader::{Role, Telemetry};
use testbed::TestDb;

use crate::{
    as_leader, billing, config, declined_invoice, dunner_with, events, invoice_status, manager,
    policy, run_of, tick,
};

/// The provider charges retry 1 and then hangs: the attempt is unknown and
/// the run rewound; while the attempt is unknown no retry charges the
/// invoice; once billing's claim lease has expired, billing's reconciler
/// repeats the request with the same key, the stored charge answers, and the
/// invoice is settled paid; the next dunning tick ends the run as recovered.
/// The provider counted one charge.
#[tokio::test]
async fn a_timeout_whose_charge_succeeded_is_found_by_the_reconciler_by_key() {
    let t = TestDb::new().await;
    let p = FakeProvider::start().await.unwrap();
    policy(&t.db, "tenant_a", 3, "pause_collection").await;
    let a = declined_invoice(&t.db, "tenant_a").await;
    p.set_behaviour(&a.customer, Behaviour::Hang);
    let charging = BillingConfig {
        charge_lease: Duration::from_secs(1),
        ..billing(&p, Duration::from_millis(300))
    };
    let (d, _) = dunner_with(&t.db, charging.clone(), config());
    assert_eq!(tick(&t.db, &d).await.tally.rewound, 1);
    assert_eq!(run_of(&t.db, a.invoice).await, ("active".to_owned(), 0));
    assert_eq!(p.total_charges(), 1);
    // Held while unknown: nothing charged, however often dunning looks.
    p.set_behaviour(&a.customer, Behaviour::Succeed);
    assert_eq!(tick(&t.db, &d).await.tally.rewound, 1);
    assert_eq!(p.total_charges(), 1);
    tokio::time::sleep(Duration::from_millis(1200)).await;
    let biller = Biller::new(t.db.clone(), charging, Telemetry::noop()).unwrap();
    as_leader(
        &manager(&t.db, "biller"),
        Role::Billing,
        |tick| async move { biller.run_tick(&tick).await },
    )
    .await;
    assert_eq!(invoice_status(&t.db, a.invoice).await, "paid");
    let r = tick(&t.db, &d).await;
    assert_eq!(r.tally.stopped, 1, "{r:?}");
    assert_eq!(run_of(&t.db, a.invoice).await, ("recovered".to_owned(), 0));
    assert_eq!(p.total_charges(), 1, "{:?}", p.charges());
    assert_eq!(
        events(&t.db).await,
        ["dunning.started", "dunning.recovered"]
    );
}
