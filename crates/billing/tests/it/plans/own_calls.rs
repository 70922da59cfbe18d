//! The charge path's own calls, as `auto_explain` reports the plans they ran,
//! run with the settings the other plan tests apply themselves.

use std::time::Duration;

use testbed::TestDb;
use testbed::plans::{INDEX_DRIVEN_SETTINGS, PlansNoticed, assert_planned_with, planner_settings};

use billing::statements::{
    CLAIM_AND_START, CLAIM_DUE, CLAIM_RETRIES, CLEAR_RAW_ANSWERS, SETTLE, SETTLE_OPEN,
    START_RETRIES,
};

use billing::RetryRequest;
use fake_provider::{Behaviour, FakeProvider};

use crate::{biller, charging, open_invoices, tick};

/// Guard (issue 29, point 3): the settings the other plan tests (`writes`,
/// `claims`, `other_batches`) apply themselves are the ones the charge
/// path's own calls run with. The plans
/// are those the calls ran, reported by `auto_explain`: the closing's listing
/// (`CLAIM_DUE`) and compare-and-set of a tick invoicing four subscriptions, a tick charging the four
/// invoices (one answered 429, left open), which runs its batch claim
/// (`CLAIM_AND_START`), its settle (`SETTLE`, and `SETTLE_OPEN` for the row
/// left open) and its retention's `CLEAR_RAW_ANSWERS` in index-driven
/// transactions (the last without sequential scans), and `Biller::start_retries_in`
/// (in the index-driven transaction dunning opens for it) runs
/// `START_RETRIES` in the written join order without sequential scans, then
/// `CLAIM_RETRIES` with both back at their defaults. Seen failing under each
/// of the mutations `closing_index_driven`, `close_index_driven`, `claim_index_driven`,
/// `settle_index_driven` and `raw_answers_index_driven` (a plain
/// `begin_with_timeout` in `store::claim_due`,
/// `charge::store::claim_and_start`, `batch::settle::settle_once`,
/// `retention`), `raw_answers_seqscan` (the clearing without
/// `NO_SEQUENTIAL_SCAN`), `retry_written_order` (`start_retries_in`
/// without `WRITTEN_JOIN_ORDER`), `retry_order_reset` (without
/// `ANY_JOIN_ORDER`) and `claim_written_order` (the batch claim free to
/// reorder its joins, docs/adr/0065) in scripts/mutation-check.
#[tokio::test]
async fn the_charge_paths_own_calls_plan_as_their_tests_do() {
    let t = TestDb::with_plans_noticed().await;
    let p = FakeProvider::start().await.unwrap();
    let closing = PlansNoticed::start();
    let invoices = open_invoices(&t.db, 4).await;
    assert_planned_with(&closing.plans_of(CLAIM_DUE), &INDEX_DRIVEN_SETTINGS);
    // The closing's compare-and-set (`invoice::close_once`, docs/adr/0060).
    let cas = closing.plans_containing("UPDATE subscriptions s SET current_period_start");
    assert_eq!(cas.len(), 1, "{cas:#?}");
    assert_planned_with(&cas, &INDEX_DRIVEN_SETTINGS);
    drop(closing);
    let month = Duration::from_secs(30 * 86_400);
    let (b, _) = biller(&t.db, charging(&p, Duration::from_secs(5)));
    let b = b.with_retention(scheduler::Retention {
        keep: month,
        lease_history: month,
        every: Duration::ZERO,
        batch: 1000,
    });
    let written_order = ["join_collapse_limit = '1'"];

    // A retry started and rolled back: the invoices stay open and unclaimed.
    let retries = PlansNoticed::start();
    let mut tx =
        t.db.begin_index_driven(Duration::from_secs(5))
            .await
            .unwrap();
    let wanted = [RetryRequest {
        invoice_id: invoices[0].0,
        claimed_by: "plans".to_owned(),
    }];
    let started = b.start_retries_in(&mut tx, &wanted).await.unwrap();
    assert!(started[0].is_ok(), "{:?}", started[0].as_ref().err());
    drop(tx);
    assert_planned_with(
        &[retries.plan_of(START_RETRIES)],
        &[&INDEX_DRIVEN_SETTINGS[..], &written_order].concat(),
    );
    let claim = retries.plan_of(CLAIM_RETRIES);
    let claim = planner_settings(&claim);
    for set in written_order {
        assert!(!claim.contains(set), "{set} still in {claim:?}");
    }
    drop(retries);

    let charges = PlansNoticed::start();
    p.set_behaviour(
        &invoices[3].1,
        Behaviour::RateLimited {
            retry_after_secs: 60,
        },
    );
    assert_eq!(tick(&t.db, &b).await.charges.paid, 3);
    assert_planned_with(
        &charges.plans_of(CLAIM_AND_START),
        &[&INDEX_DRIVEN_SETTINGS[..], &["join_collapse_limit = '1'"]].concat(),
    );
    assert_planned_with(&charges.plans_of(SETTLE), &INDEX_DRIVEN_SETTINGS);
    assert_planned_with(&charges.plans_of(SETTLE_OPEN), &INDEX_DRIVEN_SETTINGS);
    assert_planned_with(
        &charges.plans_of(CLEAR_RAW_ANSWERS),
        &[&INDEX_DRIVEN_SETTINGS[..], &["enable_seqscan = 'off'"]].concat(),
    );
}
