//! Billing's retention of the tenant API's idempotency keys (docs/adr/0117):
//! a key is deleted once it can no longer be replayed, and its statement
//! reads only its batch on a table never analyzed.

use std::time::Duration;

use db::{Row, sql};
use testbed::TestDb;
use testbed::plans::explain_index_driven_after;

use billing::statements::{DELETE_IDEMPOTENCY_KEYS, NO_SEQUENTIAL_SCAN};

use crate::{biller, config, tick};

/// Keys of two tenants, `n` of them `age` old, named `prefix-i`.
async fn keys(t: &TestDb, prefix: &str, n: i64, age: &str) {
    let mut su = t.superuser().await;
    sqlx::query(
        "INSERT INTO api_idempotency_keys (tenant_id, idempotency_key, request_hash, status, \
                                           response, created_at) \
         SELECT CASE WHEN i % 2 = 0 THEN 'tenant_a' ELSE 'tenant_b' END, $1 || '-' || i, \
                '\\x00', 201, '{\"email\": \"ada@example.org\"}', \
                now() - $3::interval + i * interval '1 millisecond' \
         FROM generate_series(1, $2) AS i",
    )
    .bind(prefix)
    .bind(n)
    .bind(age)
    .execute(&mut su)
    .await
    .unwrap();
}

/// A billing tick that prunes deletes the keys older than a day, with their
/// answers, and keeps the younger ones, which may still be replayed; the
/// deletions are counted under `kind="idempotency_keys"`. Before, no
/// statement deleted a key: every keyed request's answer stayed for ever.
///
/// Mutation check: `idempotency_keys_kept` (the prune left out of the tick)
/// seen failing it.
#[tokio::test]
async fn keys_older_than_a_day_are_deleted_and_younger_ones_kept() {
    let t = TestDb::new().await;
    keys(&t, "old", 1_500, "25 hours").await;
    keys(&t, "young", 20, "23 hours").await;
    let month = Duration::from_secs(30 * 86_400);
    let (b, metrics) = biller(&t.db, config());
    let b = b.with_retention(scheduler::Retention {
        keep: month,
        lease_history: month,
        every: Duration::ZERO,
        batch: 1000,
    });
    tick(&t.db, &b).await;
    let left: Vec<String> =
        t.db.fetch_all(sql(
            "SELECT idempotency_key FROM api_idempotency_keys ORDER BY created_at",
        ))
        .await
        .unwrap()
        .iter()
        .map(|r| r.get(0))
        .collect();
    assert_eq!(left.len(), 20, "{:?}", &left[..left.len().min(5)]);
    assert!(left.iter().all(|k| k.starts_with("young-")), "{left:?}");
    let rendered = metrics.render();
    assert!(
        rendered.contains("hardcount_retention_pruned_total{kind=\"idempotency_keys\"} 1500"),
        "{rendered}"
    );
}

/// Guard: the deletion reads its batch through `api_idempotency_keys_created`
/// in age order, on a table never analyzed (12,800 keys, a fifth of them
/// past their life), with no sort, bitmap or sequential scan.
#[tokio::test]
async fn the_key_prune_reads_its_batch_in_index_order() {
    let t = TestDb::new().await;
    keys(&t, "old", 2_560, "30 hours").await;
    keys(&t, "young", 10_240, "2 hours").await;
    let plan = explain_index_driven_after(
        &t.db,
        Some(NO_SEQUENTIAL_SCAN),
        DELETE_IDEMPOTENCY_KEYS,
        |s| {
            s.bind("billing")
                .bind(1_i64)
                .bind(86_400.0_f64)
                .bind(1000_i64)
        },
    )
    .await;
    assert!(
        plan.contains("Index Scan using api_idempotency_keys_created on api_idempotency_keys k"),
        "{plan}"
    );
    for absent in ["Sort", "Bitmap", "Seq Scan", "Hash"] {
        assert!(!plan.contains(absent), "{absent} in\n{plan}");
    }
}
