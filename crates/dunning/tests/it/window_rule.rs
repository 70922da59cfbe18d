//! The business window's rule as the listing evaluates it (docs/adr/0045),
//! on fixed instants: hours, weekdays, windows past midnight, the end of the
//! day, zones, and both daylight-saving transitions of Europe/Berlin in 2026.
//! And the plans: the window is one hashed lookup per due run, each due run
//! reaches its rows by their keys, and the listing and the retries run with
//! the planner settings their plan tests assume (as `auto_explain` reports
//! the role's own calls).

use std::time::Duration;

use billing::statements::{CLAIM_RETRIES, START_RETRIES};
use db::{Row, sql};
use dunning::statements::{LIST_DUE, WINDOW_OPEN_AT};
use leader::Role;
use testbed::TestDb;
use testbed::plans::{
    INDEX_DRIVEN_SETTINGS, PlansNoticed, assert_planned_with, explain_index_driven_after,
};

use crate::{as_leader, declined_invoice, dunner, enrol, manager, policy, run_of, tick};

/// (zone, opens, closes, weekdays, instant in UTC, open?)
type Case = (
    &'static str,
    &'static str,
    &'static str,
    &'static [i32],
    &'static str,
    bool,
);

const WEEKDAYS: &[i32] = &[1, 2, 3, 4, 5];
const EVERY_DAY: &[i32] = &[1, 2, 3, 4, 5, 6, 7];

const CASES: &[Case] = &[
    // 30 November 2026 is a Monday; the closing time is not in the window.
    (
        "UTC",
        "09:00",
        "17:00",
        WEEKDAYS,
        "2026-11-30T09:00:00Z",
        true,
    ),
    (
        "UTC",
        "09:00",
        "17:00",
        WEEKDAYS,
        "2026-11-30T08:59:59Z",
        false,
    ),
    (
        "UTC",
        "09:00",
        "17:00",
        WEEKDAYS,
        "2026-11-30T16:59:59Z",
        true,
    ),
    (
        "UTC",
        "09:00",
        "17:00",
        WEEKDAYS,
        "2026-11-30T17:00:00Z",
        false,
    ),
    (
        "UTC",
        "09:00",
        "17:00",
        WEEKDAYS,
        "2026-12-05T12:00:00Z",
        false,
    ),
    // Local hours, in winter (CET, +1) and summer (CEST, +2).
    (
        "Europe/Berlin",
        "09:00",
        "17:00",
        EVERY_DAY,
        "2026-12-02T08:30:00Z",
        true,
    ),
    (
        "Europe/Berlin",
        "09:00",
        "17:00",
        EVERY_DAY,
        "2026-12-02T16:30:00Z",
        false,
    ),
    (
        "Europe/Berlin",
        "09:00",
        "17:00",
        EVERY_DAY,
        "2026-07-01T07:30:00Z",
        true,
    ),
    (
        "Europe/Berlin",
        "09:00",
        "17:00",
        EVERY_DAY,
        "2026-07-01T15:30:00Z",
        false,
    ),
    // Past midnight: the window belongs to the weekday it opens on (Friday).
    ("UTC", "22:00", "06:00", &[5], "2026-12-04T23:00:00Z", true),
    ("UTC", "22:00", "06:00", &[5], "2026-12-05T05:59:59Z", true),
    ("UTC", "22:00", "06:00", &[5], "2026-12-05T06:00:00Z", false),
    ("UTC", "22:00", "06:00", &[5], "2026-12-05T23:00:00Z", false),
    ("UTC", "22:00", "06:00", &[5], "2026-12-04T05:00:00Z", false),
    // 24:00 is the end of the day.
    ("UTC", "18:00", "24:00", &[1], "2026-11-30T23:59:59Z", true),
    ("UTC", "18:00", "24:00", &[1], "2026-12-01T00:00:00Z", false),
    // The weekday is the local one: Wednesday starts at 15:00 UTC in Tokyo.
    (
        "Asia/Tokyo",
        "00:00",
        "24:00",
        &[3],
        "2026-12-01T15:00:00Z",
        true,
    ),
    (
        "Asia/Tokyo",
        "00:00",
        "24:00",
        &[3],
        "2026-12-01T14:59:59Z",
        false,
    ),
    // Spring forward, 29 March 2026 at 01:00 UTC: 02:00 CET becomes 03:00
    // CEST. An edge in the skipped hour takes effect at the jump.
    (
        "Europe/Berlin",
        "02:30",
        "18:00",
        EVERY_DAY,
        "2026-03-29T00:59:59Z",
        false,
    ),
    (
        "Europe/Berlin",
        "02:30",
        "18:00",
        EVERY_DAY,
        "2026-03-29T01:00:00Z",
        true,
    ),
    (
        "Europe/Berlin",
        "00:00",
        "02:30",
        EVERY_DAY,
        "2026-03-29T00:59:59Z",
        true,
    ),
    (
        "Europe/Berlin",
        "00:00",
        "02:30",
        EVERY_DAY,
        "2026-03-29T01:00:00Z",
        false,
    ),
    // Fall back, 25 October 2026 at 01:00 UTC: 03:00 CEST becomes 02:00 CET.
    // The hour from 02:00 is lived twice, and an edge in it is crossed twice.
    (
        "Europe/Berlin",
        "00:00",
        "02:30",
        EVERY_DAY,
        "2026-10-25T00:15:00Z",
        true,
    ),
    (
        "Europe/Berlin",
        "00:00",
        "02:30",
        EVERY_DAY,
        "2026-10-25T00:30:00Z",
        false,
    ),
    (
        "Europe/Berlin",
        "00:00",
        "02:30",
        EVERY_DAY,
        "2026-10-25T01:00:00Z",
        true,
    ),
    (
        "Europe/Berlin",
        "00:00",
        "02:30",
        EVERY_DAY,
        "2026-10-25T01:30:00Z",
        false,
    ),
    (
        "Europe/Berlin",
        "02:30",
        "18:00",
        EVERY_DAY,
        "2026-10-25T00:30:00Z",
        true,
    ),
    (
        "Europe/Berlin",
        "02:30",
        "18:00",
        EVERY_DAY,
        "2026-10-25T01:00:00Z",
        false,
    ),
    (
        "Europe/Berlin",
        "02:30",
        "18:00",
        EVERY_DAY,
        "2026-10-25T01:30:00Z",
        true,
    ),
];

/// Each case through the listing's own rule text (`WINDOW_OPEN_AT` shares
/// `window_open!` with `LIST_DUE`), on the database's zone data.
#[tokio::test]
async fn the_window_rule_follows_local_hours_weekdays_and_both_dst_transitions() {
    let t = TestDb::new().await;
    let mut wrong = Vec::new();
    for &(zone, opens, closes, days, at, want) in CASES {
        let open: Option<bool> =
            t.db.fetch_one(
                sql(WINDOW_OPEN_AT)
                    .bind(zone)
                    .bind(opens)
                    .bind(closes)
                    .bind(days.to_vec())
                    .bind(at),
            )
            .await
            .unwrap()
            .get("open");
        if open != Some(want) {
            wrong.push(format!(
                "{zone} {opens}-{closes} {days:?} at {at}: {open:?}"
            ));
        }
    }
    assert!(wrong.is_empty(), "{wrong:#?}");
}

/// The listing's plan on never-analyzed tables, in the listing's kind of
/// transaction: the closed tenants are one hashed subplan, evaluated once
/// and probed in the due runs' scan, so a closed tenant's due runs cost a
/// hash probe each and no join (docs/adr/0045 has the figures).
///
/// Guard: the window as an uncorrelated `NOT IN`. Seen failing with it
/// written as a correlated `NOT EXISTS (SELECT 1 FROM (…closed tenants…) c
/// WHERE c.tenant_id = r.tenant_id)` (an anti join, per due run).
#[tokio::test]
async fn the_window_is_one_hashed_lookup_in_the_due_runs_scan() {
    let t = twenty_enrolled_runs().await;
    let joined = listing_plan(&t).await;
    let plan: Vec<&str> = joined.lines().collect();
    let scan = plan
        .iter()
        .position(|l| l.contains("on dunning_runs r"))
        .unwrap_or_else(|| panic!("no scan of dunning_runs in\n{joined}"));
    let filter = plan[scan + 1..]
        .iter()
        .find(|l| l.trim_start().starts_with("Filter:"))
        .unwrap_or_else(|| panic!("no filter on the due runs' scan in\n{joined}"));
    assert!(filter.contains("NOT (hashed SubPlan"), "{joined}");
    assert!(!joined.contains("Anti Join"), "{joined}");
}

/// A database whose one tenant has 20 declined invoices, each enrolled in a
/// dunning run; its tables never analyzed.
async fn twenty_enrolled_runs() -> TestDb {
    let t = TestDb::new().await;
    let p = fake_provider::FakeProvider::start().await.unwrap();
    enrol_twenty(&t, &p).await;
    t
}

/// Twenty declined invoices of one tenant on `t`, each enrolled in a dunning
/// run; the dunner that enrolled them.
async fn enrol_twenty(t: &TestDb, p: &fake_provider::FakeProvider) -> dunning::Dunner {
    policy(&t.db, "tenant_a", 2, "pause_collection").await;
    for _ in 0..20 {
        declined_invoice(&t.db, "tenant_a").await;
    }
    let (d, _) = dunner(&t.db, p, Duration::from_secs(5), crate::config());
    assert_eq!(enrol(&t.db, &d).await, 20);
    d
}

/// EXPLAIN of `LIST_DUE` as the role plans it (an index-driven transaction
/// with the joins in their written order), on tables never analyzed.
async fn listing_plan(t: &TestDb) -> String {
    explain_index_driven_after(&t.db, Some(db::AS_WRITTEN), LIST_DUE, |s| {
        s.bind("dunning")
            .bind(1_i64)
            .bind(Vec::<i64>::new())
            .bind(500_i64)
            .bind(vec!["card_declined".to_owned()])
    })
    .await
}

/// Guard (issue 29, point 3): the listing reads the due runs in
/// `dunning_runs_due` order (no sort of every due run) and reaches each run's
/// invoice, subscription, customer and policy by its key, on tables that
/// were never analyzed. Seen failing with the invoice, subscription and
/// customer joined on `tenant_id` as well as their ids: on these small tables
/// the planner then reached the invoices and subscriptions by `tenant_id`
/// alone (`invoices_tenant_number_key`, `subscriptions_tenant_plan`)
/// (scripts/mutation-check `listing_tenant_join`). And with bitmap scans
/// allowed the due runs were all read and sorted (docs/adr/0056).
///
/// The plan is the one the role's own call ran (`Dunner::list_due` as the
/// leader, reported by `auto_explain`), so the transaction's planner settings
/// are pinned as well: the index-driven ones and the written join order
/// (`Db::begin_index_driven_as_written`). Seen failing with `list_due`
/// opening a plain `begin_index_driven` transaction (mutation
/// `listing_as_written`): the settings lacked `join_collapse_limit`. The
/// plan's shape did not change on these tables; what the setting saves there
/// is the search of join orders at every call, 8 to 17 ms of planning
/// (docs/adr/0056), which no plan shows.
#[tokio::test]
async fn the_listing_reaches_each_due_runs_rows_by_their_keys() {
    let t = TestDb::with_plans_noticed().await;
    let p = fake_provider::FakeProvider::start().await.unwrap();
    let d = enrol_twenty(&t, &p).await;
    let noticed = PlansNoticed::start();
    let listed = as_leader(&manager(&t.db, "plans"), Role::Dunning, |tick| async move {
        d.list_due(&tick.fence, 500).await.unwrap().len()
    })
    .await;
    assert_eq!(listed, 20);
    let plan = noticed.plan_of(LIST_DUE);
    assert_planned_with(
        std::slice::from_ref(&plan),
        &[&INDEX_DRIVEN_SETTINGS[..], &["join_collapse_limit = '1'"]].concat(),
    );
    let lines: Vec<&str> = plan.lines().map(str::trim).collect();
    let reached = |scan: &str, cond: &str| {
        let at = lines
            .iter()
            .position(|l| l.contains(&format!("Index Scan using {scan} ")))
            .unwrap_or_else(|| panic!("no index scan {scan:?} in\n{plan}"));
        assert!(
            lines.get(at + 1) == Some(&cond),
            "{scan:?} not reached by {cond:?} in\n{plan}"
        );
    };
    assert!(
        lines
            .iter()
            .any(|l| l.contains("Index Scan using dunning_runs_due on dunning_runs r ")),
        "{plan}"
    );
    reached(
        "invoices_pkey on invoices i",
        "Index Cond: (id = r.invoice_id)",
    );
    reached(
        "subscriptions_pkey on subscriptions s",
        "Index Cond: (id = i.subscription_id)",
    );
    reached(
        "customers_pkey on customers c",
        "Index Cond: (id = s.customer_id)",
    );
    reached(
        "dunning_policies_tenant_id_key on dunning_policies p",
        "Index Cond: ((tenant_id = r.tenant_id) AND (id = r.policy_id))",
    );
    assert!(!plan.contains("Sort Key"), "{plan}");
    assert!(!plan.contains("Join Filter"), "{plan}");
}

/// Guard (issue 29, point 3): a tick starts its retries (billing's
/// `START_RETRIES`, then `CLAIM_RETRIES`) in an index-driven transaction
/// (`dunning::charge`), and writes their outcomes in another, the settings under which billing's plan test
/// (`a_dunning_retry_claim_reaches_each_invoice_by_its_key`) shows each
/// invoice reached by its key; that test applies them itself. The plans here
/// are the ones the tick ran, reported by `auto_explain`. Seen failing with
/// either transaction opened by a plain `begin_with_timeout` (mutations
/// `retry_index_driven` and `dunning_outcomes_index_driven` in
/// scripts/mutation-check).
#[tokio::test]
async fn a_tick_starts_its_retries_in_an_index_driven_transaction() {
    let t = TestDb::with_plans_noticed().await;
    let p = fake_provider::FakeProvider::start().await.unwrap();
    let d = enrol_twenty(&t, &p).await;
    let noticed = PlansNoticed::start();
    let report = tick(&t.db, &d).await;
    assert_eq!(p.total_charges(), 20, "{report:?}");
    let mut plans = noticed.plans_of(START_RETRIES);
    plans.extend(noticed.plans_of(CLAIM_RETRIES));
    // The batch's outcomes (`outcomes::recover_in`): twenty recovered runs.
    plans.extend(noticed.plans_containing("SET status = 'recovered', ended_at = now()"));
    assert_eq!(plans.len(), 3, "{plans:#?}");
    assert_planned_with(&plans, &INDEX_DRIVEN_SETTINGS);
}

/// Guard (docs/adr/0060): a tick writes its batch's declines, the runs they
/// exhaust (`outcomes::decline_in`) and their final actions
/// (`final_action::final_actions`) in index-driven transactions: each
/// statement joins the batch to its table by key. The plans are the ones the
/// tick ran, reported by `auto_explain`. Seen failing with either
/// transaction opened by a plain `begin_with_timeout` (mutations
/// `dunning_outcomes_index_driven` and `final_actions_index_driven` in
/// scripts/mutation-check); planned freely on the dunning benchmark's 20,000
/// runs, each of these statements read every active run into a hash.
#[tokio::test]
async fn a_ticks_declines_and_final_actions_run_in_index_driven_transactions() {
    let t = TestDb::with_plans_noticed().await;
    let p = fake_provider::FakeProvider::start().await.unwrap();
    policy(&t.db, "tenant_a", 1, "pause_collection").await;
    let declined = declined_invoice(&t.db, "tenant_a").await;
    p.set_behaviour(
        &declined.customer,
        fake_provider::Behaviour::Decline("insufficient_funds".into()),
    );
    let (d, _) = dunner(&t.db, &p, Duration::from_secs(5), crate::config());
    assert_eq!(enrol(&t.db, &d).await, 1);
    let noticed = PlansNoticed::start();
    let report = tick(&t.db, &d).await;
    assert_eq!(
        run_of(&t.db, declined.invoice).await.0,
        "exhausted",
        "{report:?}"
    );
    let exhausts =
        noticed.plans_containing("SET status = 'exhausted', ended_at = now(), next_attempt_at");
    let stamps = noticed.plans_containing("UPDATE dunning_runs SET final_action_at = now()");
    assert_eq!(
        (exhausts.len(), stamps.len()),
        (1, 1),
        "{report:?}\n{:#?}",
        noticed.plans_containing("")
    );
    assert_planned_with(&[exhausts, stamps].concat(), &INDEX_DRIVEN_SETTINGS);
}
