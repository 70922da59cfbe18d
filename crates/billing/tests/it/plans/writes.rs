//! The charge path's batch writes, the settle (`SETTLE`, `SETTLE_OPEN`,
//! `SETTLE_CLOSED`) and
//! the attempts insert (`START_ATTEMPTS`), reach each invoice and attempt of their batch by
//! its key, also on statistics gathered while nothing was claimed.

use testbed::TestDb;
use testbed::plans::explain_index_driven;

use billing::statements::{SETTLE, SETTLE_CLOSED, SETTLE_OPEN, START_ATTEMPTS};

use super::{BATCH, claimed};

/// Statistics gathered while nothing was claimed, as after an analyze at a
/// quiet moment: the invoices of [`claimed`] unclaimed and their attempts
/// settled, both tables analyzed (autovacuum off for them), then claimed and
/// open again. The statistics then estimate one claimed invoice and one open
/// attempt, each partial index of those looking nearly empty.
async fn statistics_without_claims(t: &TestDb) {
    let mut su = t.superuser().await;
    sqlx::raw_sql(
        "ALTER TABLE invoices SET (autovacuum_enabled = false); \
         ALTER TABLE payment_attempts SET (autovacuum_enabled = false); \
         UPDATE invoices SET auto_charge_claimed_until = NULL, auto_charge_claimed_by = NULL \
         WHERE number LIKE 'PLAN-%'; \
         UPDATE payment_attempts SET provider_status = 'succeeded' \
         WHERE idempotency_key LIKE 'plan:%'; \
         ANALYZE invoices; ANALYZE payment_attempts; \
         UPDATE invoices SET auto_charge_claimed_until = now() + interval '5 minutes', \
                             auto_charge_claimed_by = 'c1' \
         WHERE number LIKE 'PLAN-%'; \
         UPDATE payment_attempts SET provider_status = 'unknown' \
         WHERE idempotency_key LIKE 'plan:%'",
    )
    .execute(&mut su)
    .await
    .unwrap();
}

/// Each invoice and attempt reached by its primary key: no partial index of
/// the claims or open attempts, no bitmap or sequential scan, no join filter.
fn reaches_each_by_key(plan: &str) {
    for present in [
        "Index Scan using invoices_pkey on invoices i",
        "Index Scan using payment_attempts_pkey on payment_attempts a",
    ] {
        assert!(plan.contains(present), "{present} not in\n{plan}");
    }
    for absent in [
        "invoices_auto_charge_claims",
        "payment_attempts_open",
        "Bitmap",
        "Seq Scan",
        "Join Filter",
    ] {
        assert!(!plan.contains(absent), "{absent} in\n{plan}");
    }
}

/// The settle's plan for the batch `invoices` / `attempts`, all succeeded.
async fn settle_plan(t: &TestDb, invoices: Vec<i64>, attempts: Vec<i64>) -> String {
    explain_index_driven(&t.db, SETTLE, move |s| {
        s.bind(invoices)
            .bind(vec!["c1".to_owned(); BATCH])
            .bind(attempts)
            .bind(vec!["succeeded".to_owned(); BATCH])
            .bind(vec![None::<String>; BATCH])
            .bind(vec![Some("pi_1".to_owned()); BATCH])
            .bind(vec![None::<String>; BATCH])
            .bind(vec!["{}".to_owned(); BATCH])
            .bind(1.0_f64)
            .bind(vec!["open".to_owned(); BATCH])
            .bind(vec![None::<String>; BATCH])
    })
    .await
}

/// The attempts insert's plan for the batch `invoices`, second attempts.
async fn attempts_plan(t: &TestDb, invoices: Vec<i64>) -> String {
    explain_index_driven(&t.db, START_ATTEMPTS, move |s| {
        s.bind(invoices)
            .bind(vec![2_i32; BATCH])
            .bind("plan-test")
            .bind(vec!["c1".to_owned(); BATCH])
            .bind(vec!["cus_plan".to_owned(); BATCH])
            .bind(vec!["pm_plan".to_owned(); BATCH])
            .bind(vec!["open".to_owned(); BATCH])
    })
    .await
}

/// Guards: `inv` carrying each row's answer through its `RETURNING`, so that
/// `att` joins only the invoices written, the expected status bound per row
/// (`was`, seen failing as the literal `'open'`: a Seq Scan of `invoices`),
/// and the settings of `begin_index_driven`. Seen failing with `att` joining the unnested batch
/// to `inv` again (a nested loop over the two CTE scans, 65,280 rows filtered
/// for 256: mutation `settle_carried` in scripts/mutation-check) and with the
/// EXPLAIN planned freely (a Bitmap Heap Scan of every claimed invoice).
#[tokio::test]
async fn a_settle_reaches_each_invoice_and_attempt_by_its_key() {
    let t = TestDb::new().await;
    let (invoices, attempts) = claimed(&t).await;
    let plan = settle_plan(&t, invoices, attempts).await;
    reaches_each_by_key(&plan);
}

/// The settle on statistics gathered while nothing was claimed (a table
/// analyzed before the tick, the usual case): they estimate one claimed
/// invoice and one open attempt, and each matching partial index looked like
/// the cheapest outer side of the nested loop. Guards: the claim's expiry and
/// the attempt's status compared through `coalesce`, so neither partial index
/// serves the settle. Seen failing with the plain comparisons (mutation
/// `settle_coalesce` in scripts/mutation-check): `invoices_auto_charge_claims`
/// and `payment_attempts_open` drove the two nested loops, each joined to the
/// batch by a Join Filter (in the dunning benchmark, 249,500 rows removed for
/// a batch of 500).
#[tokio::test]
async fn a_settle_reaches_its_batch_by_key_when_the_statistics_saw_no_claim() {
    let t = TestDb::new().await;
    let (invoices, attempts) = claimed(&t).await;
    statistics_without_claims(&t).await;
    let plan = settle_plan(&t, invoices, attempts).await;
    reaches_each_by_key(&plan);
}

/// Guards: the expected status bound per row (`was`) and the settings of
/// `begin_index_driven` (the charge claim's transaction). Seen failing with
/// `i.status = 'open'` written as a literal (a Seq Scan of `invoices` joined
/// to the batch by a filter: mutation `attempts_was` in
/// scripts/mutation-check) and with the EXPLAIN planned freely (the claims
/// index read for every invoice the tick had claimed).
#[tokio::test]
async fn the_attempts_of_a_batch_reach_each_invoice_by_its_key() {
    let t = TestDb::new().await;
    let (invoices, _) = claimed(&t).await;
    let plan = attempts_plan(&t, invoices).await;
    assert!(
        plan.contains("Index Scan using invoices_pkey on invoices i"),
        "{plan}"
    );
    for absent in ["invoices_auto_charge_claims", "Bitmap", "Seq Scan"] {
        assert!(!plan.contains(absent), "{absent} in\n{plan}");
    }
}

/// The attempts insert on statistics gathered while nothing was claimed
/// ([`statistics_without_claims`]). Guard: the claim's expiry compared
/// through `coalesce`. Seen failing with the plain comparison (mutation
/// `attempts_coalesce` in scripts/mutation-check): `invoices_auto_charge_claims`
/// drove the loop with a Join Filter over the batch (in the dunning
/// benchmark, 249,500 rows removed for a batch of 500).
#[tokio::test]
async fn the_attempts_of_a_batch_reach_each_invoice_by_its_key_when_the_statistics_saw_no_claim() {
    let t = TestDb::new().await;
    let (invoices, _) = claimed(&t).await;
    statistics_without_claims(&t).await;
    let plan = attempts_plan(&t, invoices).await;
    assert!(
        plan.contains("Index Scan using invoices_pkey on invoices i"),
        "{plan}"
    );
    for absent in [
        "invoices_auto_charge_claims",
        "Bitmap",
        "Seq Scan",
        "Join Filter",
    ] {
        assert!(!plan.contains(absent), "{absent} in\n{plan}");
    }
}

/// The settle of rows left open (`SETTLE_OPEN`) on statistics gathered while
/// nothing was claimed: each invoice reached by its key to prove and share-lock
/// its claim, each attempt by its key. Guard: the attempt's open status
/// compared through `coalesce`; seen failing with the plain `IN` (mutation
/// `settle_open_coalesce`: `payment_attempts_open` drove the loop with a Join
/// Filter over the batch).
#[tokio::test]
async fn a_settle_left_open_reaches_its_batch_by_key_when_the_statistics_saw_no_claim() {
    let t = TestDb::new().await;
    let (invoices, attempts) = claimed(&t).await;
    statistics_without_claims(&t).await;
    let plan = explain_index_driven(&t.db, SETTLE_OPEN, move |s| {
        s.bind(attempts)
            .bind(vec!["not sent".to_owned(); BATCH])
            .bind(vec![None::<String>; BATCH])
            .bind(vec![Some(0.0_f64); BATCH])
            .bind(vec![true; BATCH])
            .bind(1.0_f64)
            .bind(invoices)
            .bind(vec!["c1".to_owned(); BATCH])
    })
    .await;
    reaches_each_by_key(&plan);
}

/// The review of paid answers whose invoice was closed (`SETTLE_CLOSED`) on
/// statistics gathered while nothing was claimed: each invoice and attempt
/// of the batch reached by its key, though the statement runs only for rows
/// the settle lost. (Its first form filtered the invoices on a literal status
/// before locking them, and was read by a sequential scan; the status is now
/// tested on the locked row.)
#[tokio::test]
async fn a_settle_of_closed_invoices_reaches_its_batch_by_key() {
    let t = TestDb::new().await;
    let (invoices, attempts) = claimed(&t).await;
    statistics_without_claims(&t).await;
    let plan = explain_index_driven(&t.db, SETTLE_CLOSED, move |s| {
        s.bind(invoices)
            .bind(attempts)
            .bind(vec!["c1".to_owned(); BATCH])
            .bind(vec!["succeeded".to_owned(); BATCH])
            .bind(vec![Some("pi_1".to_owned()); BATCH])
            .bind(vec!["open".to_owned(); BATCH])
            .bind(vec![None::<String>; BATCH])
    })
    .await;
    reaches_each_by_key(&plan);
}
