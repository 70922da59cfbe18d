//! One bad row never stops every tenant: a policy the schedule checks refuse
//! (written before them) and a run row that does not decode are left out of
//! the tick, named in a log line and counted, while every other tenant's runs
//! go on; the table refuses such policies when written.

use std::time::Duration;

use db::{Row, sql};
use fake_provider::FakeProvider;
use testbed::TestDb;

use crate::{config, declined_invoice, dunner, policy, run_of, tick};

const CALL: Duration = Duration::from_secs(5);

/// The schedule checks of migration 0021 refuse, by name, a NULL offset, an
/// offset of 0 or past 366 days, and a warning after a retry the schedule
/// does not have; a good policy is taken.
///
/// Mutation checks: `dunning_offsets_null` (no NULL check) lets the NULL
/// offset in, `dunning_offsets_range` (no range check) the 0 and the
/// 366 days and a second; each seen failing under it.
#[tokio::test]
async fn a_policy_with_a_null_or_out_of_range_offset_is_refused_by_the_table() {
    let t = TestDb::new().await;
    let cases: [(&str, &str, Option<&str>); 6] = [
        (
            "{60, NULL}",
            "{1}",
            Some("dunning_policies_offsets_in_range"),
        ),
        ("{0}", "{1}", Some("dunning_policies_offsets_in_range")),
        (
            "{31622401}",
            "{}",
            Some("dunning_policies_offsets_in_range"),
        ),
        (
            "{60, 120}",
            "{3}",
            Some("dunning_policies_warn_after_in_range"),
        ),
        (
            "{60, 120}",
            "{NULL}",
            Some("dunning_policies_warn_after_in_range"),
        ),
        ("{1, 31622400}", "{1, 2}", None),
    ];
    for (n, (offsets, warn_after, refused_by)) in cases.into_iter().enumerate() {
        let written =
            t.db.execute(
                sql(
                    "INSERT INTO dunning_policies (tenant_id, name, retry_offsets_secs, \
                                                   final_action, warn_after) \
                     VALUES ($1, 'Bad', $2::bigint[], 'pause_collection', $3::int4[])",
                )
                .bind(format!("tenant_{n}"))
                .bind(offsets)
                .bind(warn_after),
            )
            .await;
        match (written, refused_by) {
            (Ok(_), None) => {}
            (Err(e), Some(name)) => assert_eq!(e.constraint(), Some(name), "{offsets}: {e}"),
            (other, _) => panic!("{offsets} {warn_after}: {other:?}"),
        }
    }
}

/// Three tenants' due runs in one batch; two tenants' policies were written
/// before the checks, one with a NULL offset and one with an offset no time
/// can hold. Their runs are left out (nothing counted, nothing charged), the
/// skip is counted, and the third tenant's run is retried in the same tick,
/// which is not failed.
///
/// Mutation check: `dunning_policy_skip` (the listing takes every policy as
/// valid) fails to decode one row and panics on the other; seen failing
/// under it.
#[tokio::test]
async fn a_corrupt_policy_is_skipped_by_name_and_other_tenants_go_on() {
    let t = TestDb::new().await;
    let p = FakeProvider::start().await.unwrap();
    let a_policy = policy(&t.db, "tenant_a", 2, "pause_collection").await;
    policy(&t.db, "tenant_b", 2, "pause_collection").await;
    let c_policy = policy(&t.db, "tenant_c", 2, "pause_collection").await;
    let a = declined_invoice(&t.db, "tenant_a").await;
    let b = declined_invoice(&t.db, "tenant_b").await;
    let c = declined_invoice(&t.db, "tenant_c").await;
    let (d, metrics) = dunner(&t.db, &p, CALL, config());
    crate::enrol(&t.db, &d).await;
    let mut su = t.superuser().await;
    sqlx::query("ALTER TABLE dunning_policies DROP CONSTRAINT dunning_policies_offsets_in_range")
        .execute(&mut su)
        .await
        .unwrap();
    for (id, offsets) in [
        (a_policy, "{60, NULL}"),
        (c_policy, "{60, 9223372036854775807}"),
    ] {
        sqlx::query("UPDATE dunning_policies SET retry_offsets_secs = $2::bigint[] WHERE id = $1")
            .bind(id)
            .bind(offsets)
            .execute(&mut su)
            .await
            .unwrap();
    }
    let r = tick(&t.db, &d).await;
    assert!(!matches!(r.end, leader::TickEnd::Failed(_)), "{r:?}");
    assert_eq!((r.tally.left_out, r.tally.recovered), (2, 1), "{r:?}");
    assert_eq!(run_of(&t.db, a.invoice).await, ("active".to_owned(), 0));
    assert_eq!(run_of(&t.db, b.invoice).await, ("recovered".to_owned(), 1));
    assert_eq!(run_of(&t.db, c.invoice).await, ("active".to_owned(), 0));
    assert_eq!(p.total_charges(), 1);
    let rendered = metrics.render();
    assert!(
        rendered.contains("hardcount_dunning_policies_skipped_total 2"),
        "{rendered}"
    );
}

/// A run row whose `first_declined_at` is `infinity` (the driver panics
/// decoding it) listed before another tenant's due run: the row is left out and
/// counted, the claim goes on, the other run is retried.
///
/// Mutation check: `dunning_undecodable` (the listing decodes each row
/// unguarded) panics the claim and retries nothing; seen failing under it.
#[tokio::test]
async fn a_run_row_that_does_not_decode_is_left_out_and_the_claim_goes_on() {
    let t = TestDb::new().await;
    let p = FakeProvider::start().await.unwrap();
    policy(&t.db, "tenant_a", 2, "pause_collection").await;
    policy(&t.db, "tenant_b", 2, "pause_collection").await;
    let a = declined_invoice(&t.db, "tenant_a").await;
    let b = declined_invoice(&t.db, "tenant_b").await;
    let (d, metrics) = dunner(&t.db, &p, CALL, config());
    crate::enrol(&t.db, &d).await;
    sqlx::query(
        "UPDATE dunning_runs SET first_declined_at = 'infinity', \
                next_attempt_at = now() - interval '1 day' WHERE invoice_id = $1",
    )
    .bind(a.invoice)
    .execute(&mut t.superuser().await)
    .await
    .unwrap();
    let r = tick(&t.db, &d).await;
    assert!(!matches!(r.end, leader::TickEnd::Failed(_)), "{r:?}");
    assert_eq!((r.tally.left_out, r.tally.recovered), (1, 1), "{r:?}");
    assert_eq!(run_of(&t.db, a.invoice).await, ("active".to_owned(), 0));
    assert_eq!(run_of(&t.db, b.invoice).await, ("recovered".to_owned(), 1));
    let rendered = metrics.render();
    assert!(
        rendered.contains("hardcount_dunning_rows_undecodable_total 1"),
        "{rendered}"
    );
}

/// A tenant whose default policy was written before the checks, with a first
/// offset no interval can hold: its declined invoice comes first in id order
/// and the enrolment's limit is one, yet the tick enrols the next tenant's
/// invoice (with the built-in default) and leaves the corrupt tenant's alone,
/// tick after tick, without failing.
///
/// Mutation check: `enrol_policy_skip` (the runs' insert checks no range of
/// the first offset) fails the enrolment on the corrupt offset; seen failing
/// under it.
#[tokio::test]
async fn a_corrupt_default_policy_enrols_nothing_and_takes_no_other_tenants_place() {
    let t = TestDb::new().await;
    let p = FakeProvider::start().await.unwrap();
    let a_policy = policy(&t.db, "tenant_a", 2, "pause_collection").await;
    let a = declined_invoice(&t.db, "tenant_a").await;
    let b = declined_invoice(&t.db, "tenant_b").await;
    let mut su = t.superuser().await;
    sqlx::query("ALTER TABLE dunning_policies DROP CONSTRAINT dunning_policies_offsets_in_range")
        .execute(&mut su)
        .await
        .unwrap();
    sqlx::query(
        "UPDATE dunning_policies SET retry_offsets_secs = '{9223372036854775807}' WHERE id = $1",
    )
    .bind(a_policy)
    .execute(&mut su)
    .await
    .unwrap();
    let (d, _) = dunner(
        &t.db,
        &p,
        CALL,
        dunning::DunningConfig {
            enrol_limit: 1,
            ..config()
        },
    );
    for enrolled in [1, 0] {
        let r = tick(&t.db, &d).await;
        assert!(!matches!(r.end, leader::TickEnd::Failed(_)), "{r:?}");
        assert_eq!(r.enrolled, enrolled, "{r:?}");
    }
    let runs =
        t.db.fetch_all(sql("SELECT r.invoice_id, p.name FROM dunning_runs r \
             JOIN dunning_policies p ON p.id = r.policy_id ORDER BY r.invoice_id"))
            .await
            .unwrap();
    let runs: Vec<(i64, String)> = runs
        .iter()
        .map(|r| (r.get("invoice_id"), r.get("name")))
        .collect();
    assert_eq!(runs, [(b.invoice, "Default".to_owned())]);
    assert!(a.invoice < b.invoice);
}
