//! Business windows (issue 28, point 4; docs/adr/0045): a tenant's runs are
//! listed only inside its default policy's window, on the database clock, so
//! a retry, its warning and a final action (with its notice) wait for the
//! window's opening. Each window is set relative to the database's current
//! time, so "until it opens" takes seconds, not hours.
//!
//! Guard: the window predicate of `listing::LIST_DUE` (`AND r.tenant_id NOT
//! IN (…the tenants whose window is closed…)`). Checked by removing it (the
//! subquery made to match no tenant, `dunning_window` in
//! `scripts/mutation-check`): the five tests of the listing here fail. Seen failing too:
//! the zone test (and the opening's and the final action's) with the local
//! time taken `AT TIME ZONE 'UTC'` (`dunning_window_zone`); the weekday test
//! with the weekday dropped from a same-day window (`dunning_window_weekday`);
//! the policy edit with `w.is_default` dropped (`dunning_window_default`).

use std::time::Duration;

use db::{Db, Row, sql};
use fake_provider::{Behaviour, FakeProvider};
use testbed::TestDb;

use crate::{
    config, declined_invoice, dunner, dunning_emails, enrol, events, invoice_status, run_of, tick,
};

const CALL: Duration = Duration::from_secs(5);
const EVERY_DAY: [i32; 7] = [1, 2, 3, 4, 5, 6, 7];

/// A business window as written: zone, opening and closing local times
/// (`HH:MM:SS`) and the weekdays it opens on.
#[derive(Debug, Clone)]
struct Window {
    zone: String,
    opens: String,
    closes: String,
    days: Vec<i32>,
}

/// The local time in `zone` `secs` seconds from the database's now.
async fn local(db: &Db, zone: &str, secs: i64) -> String {
    db.fetch_one(
        sql("SELECT to_char((now() + make_interval(secs => $2)) AT TIME ZONE $1, 'HH24:MI:SS') AS t")
            .bind(zone.to_owned())
            .bind(secs as f64),
    )
    .await
    .unwrap()
    .get("t")
}

/// A window in `zone` from `from` to `to` seconds around the database's now,
/// every day (it may run past midnight).
async fn around_now(db: &Db, zone: &str, from: i64, to: i64) -> Window {
    Window {
        zone: zone.to_owned(),
        opens: local(db, zone, from).await,
        closes: local(db, zone, to).await,
        days: EVERY_DAY.to_vec(),
    }
}

/// `tenant`'s default policy: retries 60, 120, … s after the first decline
/// (an hour ago, so all due), a warning after retry 1, `action`, and
/// `window`. As the app may write it (enrolment's insert); no run exists yet.
async fn windowed_policy(db: &Db, tenant: &str, retries: i64, action: &str, w: &Window) -> i64 {
    let offsets: Vec<i64> = (1..=retries).map(|n| 60 * n).collect();
    db.fetch_one(
        sql(
            "INSERT INTO dunning_policies (tenant_id, name, retry_offsets_secs, final_action, \
                                           warn_after, final_notice, is_default, window_time_zone, \
                                           window_opens, window_closes, window_weekdays) \
             VALUES ($1, 'Windowed', $2, $3, '{1}', true, true, $4, $5::time, $6::time, $7) \
             RETURNING id",
        )
        .bind(tenant.to_owned())
        .bind(offsets)
        .bind(action.to_owned())
        .bind(w.zone.clone())
        .bind(w.opens.clone())
        .bind(w.closes.clone())
        .bind(w.days.clone()),
    )
    .await
    .unwrap()
    .get("id")
}

/// A new default policy for `tenant`, as the API writes one (the old default
/// unmarked, the new row inserted, one transaction as `hardcount_api`):
/// runs in flight keep their policy's schedule. `None`: no window.
async fn edit_policy(db: &Db, tenant: &str, w: Option<&Window>) -> i64 {
    let writer = testbed::tenant_writer(db, tenant);
    let mut tx = writer.begin().await.unwrap();
    tx.execute(sql(
        "UPDATE dunning_policies SET is_default = false WHERE tenant_id = api_tenant() AND is_default",
    ))
    .await
    .unwrap();
    let id: i64 = tx
        .fetch_one(
            sql(
                "INSERT INTO dunning_policies (tenant_id, name, retry_offsets_secs, final_action, \
                                               warn_after, is_default, window_time_zone, \
                                               window_opens, window_closes, window_weekdays) \
                 VALUES (api_tenant(), 'Edited', '{60, 120, 180}', 'mark_uncollectible', '{1}', \
                         true, $1, $2::time, $3::time, $4) RETURNING id",
            )
            .bind(w.map(|w| w.zone.clone()))
            .bind(w.map(|w| w.opens.clone()))
            .bind(w.map(|w| w.closes.clone()))
            .bind(w.map(|w| w.days.clone())),
        )
        .await
        .unwrap()
        .get("id");
    tx.commit().await.unwrap();
    id
}

async fn policy_of_run(db: &Db, invoice: i64) -> i64 {
    db.fetch_one(sql("SELECT policy_id FROM dunning_runs WHERE invoice_id = $1").bind(invoice))
        .await
        .unwrap()
        .get("policy_id")
}

/// A tenant whose window opens in about five seconds: its due run is not
/// retried (no attempt, no warning) until the database's clock passes the
/// opening; the first tick after it retries the run and queues the warning.
#[tokio::test]
async fn a_run_due_before_its_window_opens_waits_for_the_opening_then_goes_out() {
    let t = TestDb::new().await;
    let p = FakeProvider::start().await.unwrap();
    let zone = "America/New_York";
    let opening: chrono::DateTime<chrono::Utc> =
        t.db.fetch_one(sql(
            "SELECT date_trunc('second', now() + interval '5 seconds') AS at",
        ))
        .await
        .unwrap()
        .get("at");
    let opens: String =
        t.db.fetch_one(
            sql("SELECT to_char($1::timestamptz AT TIME ZONE $2, 'HH24:MI:SS') AS t")
                .bind(opening)
                .bind(zone),
        )
        .await
        .unwrap()
        .get("t");
    let window = Window {
        zone: zone.to_owned(),
        opens,
        closes: local(&t.db, zone, 3600).await,
        days: EVERY_DAY.to_vec(),
    };
    windowed_policy(&t.db, "tenant_a", 3, "mark_uncollectible", &window).await;
    let a = declined_invoice(&t.db, "tenant_a").await;
    p.set_behaviour(&a.customer, Behaviour::Decline("insufficient_funds".into()));
    let (d, _) = dunner(&t.db, &p, CALL, config());
    let r = tick(&t.db, &d).await;
    let before: bool =
        t.db.fetch_one(sql("SELECT now() < $1::timestamptz AS b").bind(opening))
            .await
            .unwrap()
            .get("b");
    assert!(
        before,
        "the first tick ended after the opening; the test needs a faster bed"
    );
    assert_eq!((r.enrolled, r.claimed), (1, 0), "{r:?}");
    assert_eq!(run_of(&t.db, a.invoice).await, ("active".to_owned(), 0));
    assert!(dunning_emails(&t.db).await.is_empty());
    assert_eq!(p.create_requests(), 0);
    // Wait on the database's clock, the one the listing reads.
    loop {
        let open: bool =
            t.db.fetch_one(sql("SELECT now() >= $1::timestamptz AS o").bind(opening))
                .await
                .unwrap()
                .get("o");
        if open {
            break;
        }
        tokio::time::sleep(Duration::from_millis(100)).await;
    }
    let r = tick(&t.db, &d).await;
    assert_eq!(r.tally.declined, 1, "{r:?}");
    assert_eq!(run_of(&t.db, a.invoice).await, ("active".to_owned(), 1));
    assert_eq!(dunning_emails(&t.db).await.len(), 1);
    assert_eq!(
        events(&t.db).await,
        ["dunning.started", "dunning.attempt_failed"]
    );
}

/// Two tenants, both in Asia/Tokyo (UTC+9): one's window is the hour either
/// side of Tokyo's time, the other's the hour either side of UTC's time of
/// day. The first is retried, the second waits: the hours are local, not
/// the database's UTC.
#[tokio::test]
async fn the_window_is_in_the_tenants_zone_not_the_databases() {
    let t = TestDb::new().await;
    let p = FakeProvider::start().await.unwrap();
    let local_hours = around_now(&t.db, "Asia/Tokyo", -3600, 3600).await;
    let utc_hours = Window {
        zone: "Asia/Tokyo".to_owned(),
        ..around_now(&t.db, "UTC", -3600, 3600).await
    };
    windowed_policy(&t.db, "tenant_a", 2, "mark_uncollectible", &local_hours).await;
    windowed_policy(&t.db, "tenant_b", 2, "mark_uncollectible", &utc_hours).await;
    let a = declined_invoice(&t.db, "tenant_a").await;
    let b = declined_invoice(&t.db, "tenant_b").await;
    for c in [&a.customer, &b.customer] {
        p.set_behaviour(c, Behaviour::Decline("insufficient_funds".into()));
    }
    let (d, _) = dunner(&t.db, &p, CALL, config());
    let r = tick(&t.db, &d).await;
    assert_eq!((r.enrolled, r.tally.declined), (2, 1), "{r:?}");
    assert_eq!(run_of(&t.db, a.invoice).await, ("active".to_owned(), 1));
    assert_eq!(run_of(&t.db, b.invoice).await, ("active".to_owned(), 0));
    assert_eq!(dunning_emails(&t.db).await.len(), 1);
}

/// A window open all day on the local weekday of today (in a zone where it
/// is about noon, so the test never straddles a local midnight) lists the
/// run; one open all day on every other weekday does not.
#[tokio::test]
async fn a_window_opens_only_on_its_weekdays() {
    let t = TestDb::new().await;
    let p = FakeProvider::start().await.unwrap();
    let utc_hour: i32 =
        t.db.fetch_one(sql(
            "SELECT extract(hour FROM now() AT TIME ZONE 'UTC')::integer AS h",
        ))
        .await
        .unwrap()
        .get("h");
    // Etc/GMT-N is N hours east of UTC.
    let zone = match 12 - utc_hour {
        0 => "Etc/GMT".to_owned(),
        east if east > 0 => format!("Etc/GMT-{east}"),
        west => format!("Etc/GMT+{}", -west),
    };
    let today: i32 =
        t.db.fetch_one(
            sql("SELECT extract(isodow FROM now() AT TIME ZONE $1)::integer AS d")
                .bind(zone.clone()),
        )
        .await
        .unwrap()
        .get("d");
    let all_day = |days: Vec<i32>| Window {
        zone: zone.clone(),
        opens: "00:00:00".to_owned(),
        closes: "24:00:00".to_owned(),
        days,
    };
    let others: Vec<i32> = EVERY_DAY.into_iter().filter(|&d| d != today).collect();
    windowed_policy(
        &t.db,
        "tenant_a",
        2,
        "mark_uncollectible",
        &all_day(vec![today]),
    )
    .await;
    windowed_policy(&t.db, "tenant_b", 2, "mark_uncollectible", &all_day(others)).await;
    let a = declined_invoice(&t.db, "tenant_a").await;
    let b = declined_invoice(&t.db, "tenant_b").await;
    for c in [&a.customer, &b.customer] {
        p.set_behaviour(c, Behaviour::Decline("insufficient_funds".into()));
    }
    let (d, _) = dunner(&t.db, &p, CALL, config());
    let r = tick(&t.db, &d).await;
    assert_eq!(r.tally.declined, 1, "{zone} today {today}: {r:?}");
    assert_eq!(run_of(&t.db, a.invoice).await.1, 1);
    assert_eq!(run_of(&t.db, b.invoice).await.1, 0);
}

/// The window in force is the tenant's default policy's, read at each
/// listing: a run enrolled under a closed window is retried once a new
/// default (the API's edit) opens it, and waits again when the next edit
/// closes it, while the run keeps its own policy throughout.
#[tokio::test]
async fn a_policy_edit_moves_the_runs_already_scheduled() {
    let t = TestDb::new().await;
    let p = FakeProvider::start().await.unwrap();
    let closed = around_now(&t.db, "Europe/Berlin", 2 * 3600, 3 * 3600).await;
    let open = around_now(&t.db, "Europe/Berlin", -3600, 3600).await;
    let first = windowed_policy(&t.db, "tenant_a", 3, "mark_uncollectible", &closed).await;
    let a = declined_invoice(&t.db, "tenant_a").await;
    p.set_behaviour(&a.customer, Behaviour::Decline("insufficient_funds".into()));
    let (d, _) = dunner(&t.db, &p, CALL, config());
    assert_eq!(tick(&t.db, &d).await.claimed, 0);
    assert_eq!(run_of(&t.db, a.invoice).await.1, 0);
    edit_policy(&t.db, "tenant_a", Some(&open)).await;
    let r = tick(&t.db, &d).await;
    assert_eq!(r.tally.declined, 1, "{r:?}");
    assert_eq!(run_of(&t.db, a.invoice).await.1, 1);
    // Retry 2 is due (made due, as a minute on), but the window closed.
    crate::due_now(&t.db).await;
    edit_policy(&t.db, "tenant_a", Some(&closed)).await;
    assert_eq!(tick(&t.db, &d).await.claimed, 0);
    assert_eq!(run_of(&t.db, a.invoice).await.1, 1);
    // No window at all: always open.
    edit_policy(&t.db, "tenant_a", None).await;
    assert_eq!(tick(&t.db, &d).await.tally.declined, 1);
    assert_eq!(run_of(&t.db, a.invoice).await.1, 2);
    assert_eq!(policy_of_run(&t.db, a.invoice).await, first);
}

/// An exhausted run owing its final action outside the window: no write-off
/// and no final notice until the window opens (here by an edit).
#[tokio::test]
async fn a_final_action_and_its_notice_wait_for_the_window() {
    let t = TestDb::new().await;
    let p = FakeProvider::start().await.unwrap();
    let closed = around_now(&t.db, "Australia/Sydney", 2 * 3600, 3 * 3600).await;
    let open = around_now(&t.db, "Australia/Sydney", -3600, 3600).await;
    windowed_policy(&t.db, "tenant_a", 1, "mark_uncollectible", &closed).await;
    let a = declined_invoice(&t.db, "tenant_a").await;
    let (d, _) = dunner(&t.db, &p, CALL, config());
    assert_eq!(enrol(&t.db, &d).await, 1);
    // As a tick that exhausted the run and crashed before its final action.
    t.db.execute(
        sql(
            "UPDATE dunning_runs SET status = 'exhausted', attempt_count = 1, ended_at = now() \
             WHERE invoice_id = $1",
        )
        .bind(a.invoice),
    )
    .await
    .unwrap();
    assert_eq!(tick(&t.db, &d).await.claimed, 0);
    assert_eq!(invoice_status(&t.db, a.invoice).await, "open");
    assert!(dunning_emails(&t.db).await.is_empty());
    edit_policy(&t.db, "tenant_a", Some(&open)).await;
    let r = tick(&t.db, &d).await;
    assert_eq!(r.tally.final_actions, 1, "{r:?}");
    assert_eq!(invoice_status(&t.db, a.invoice).await, "uncollectible");
    let emails = dunning_emails(&t.db).await;
    assert!(
        emails.len() == 1 && emails[0].starts_with("Final notice"),
        "{emails:?}"
    );
}

/// `hardcount_dunning_oldest_due_age_seconds` (docs/adr/0135): the age of the
/// oldest retry the listing would make now. Tenant A's run has waited three
/// hours for a window that opens in an hour: it is not late. Tenant B (no
/// window) has four runs. Three have waited three hours too, but billing holds
/// them on purpose: collection paused, the invoice under review, the last
/// attempt still processing. The fourth's invoice is held by a charge's claim
/// lease for another hour, so its retry, due about an hour, stays due: the
/// gauge reads that hour.
/// Mutations that leave each hold out of the gauge, `dunning_gauge_window`,
/// `dunning_gauge_paused`, `dunning_gauge_review` and `dunning_gauge_unsettled`,
/// read three hours; each seen failing.
#[tokio::test]
async fn the_oldest_due_gauge_leaves_out_runs_waiting_for_their_window() {
    let t = TestDb::new().await;
    let p = FakeProvider::start().await.unwrap();
    let closed = around_now(&t.db, "UTC", 3600, 7200).await;
    windowed_policy(&t.db, "tenant_a", 2, "mark_uncollectible", &closed).await;
    crate::policy(&t.db, "tenant_b", 2, "mark_uncollectible").await;
    let a = declined_invoice(&t.db, "tenant_a").await;
    let b = declined_invoice(&t.db, "tenant_b").await;
    let paused = declined_invoice(&t.db, "tenant_b").await;
    let review = declined_invoice(&t.db, "tenant_b").await;
    let processing = declined_invoice(&t.db, "tenant_b").await;
    let (d, metrics) = dunner(&t.db, &p, CALL, config());
    assert_eq!(enrol(&t.db, &d).await, 5);
    let mut su = t.superuser().await;
    for held in [&a, &paused, &review, &processing] {
        sqlx::query(
            "UPDATE dunning_runs SET next_attempt_at = now() - interval '3 hours' \
             WHERE invoice_id = $1",
        )
        .bind(held.invoice)
        .execute(&mut su)
        .await
        .unwrap();
    }
    for (statement, held) in [
        (
            "UPDATE invoices SET auto_charge_claimed_until = now() + interval '1 hour' \
             WHERE id = $1",
            &b,
        ),
        (
            "UPDATE subscriptions s SET pause_collection_behavior = 'keep_as_draft' \
             FROM invoices i WHERE i.id = $1 AND s.id = i.subscription_id",
            &paused,
        ),
        (
            "UPDATE invoices SET review_since = now() WHERE id = $1",
            &review,
        ),
        (
            "UPDATE payment_attempts SET provider_status = 'processing', decline_code = NULL \
             WHERE invoice_id = $1",
            &processing,
        ),
    ] {
        sqlx::query(statement)
            .bind(held.invoice)
            .execute(&mut su)
            .await
            .unwrap();
    }
    tick(&t.db, &d).await;
    assert_eq!(run_of(&t.db, b.invoice).await, ("active".to_owned(), 0));
    let age: f64 = metrics
        .render()
        .lines()
        .find_map(|l| l.strip_prefix("hardcount_dunning_oldest_due_age_seconds "))
        .expect("the gauge is exported")
        .parse()
        .unwrap();
    assert!((3000.0..3700.0).contains(&age), "{age}");
}
