//! Due billing's SQL: the fenced funnel (with the rows it cannot decode left
//! out), and the backlog gauges. The closing's transaction is `invoice`'s;
//! each other step's SQL sits with the step (`charge::store`,
//! `lifecycle::store`, `reconcile::store`, `action_required`, `cancel`,
//! `plan_change`, `retry`).

use std::time::Duration;

use chrono::{DateTime, Utc};
use db::{Db, PgRow, Row, TENANTS_PER_CLAIM, TenantCursor, Walk, sql};
use leader::Fence;

use crate::close::Due;

pub(crate) fn due(r: &PgRow) -> Result<Due, db::Error> {
    Ok(Due {
        subscription_id: r.try_get("id")?,
        tenant_id: r.try_get("tenant_id")?,
        status: r.try_get("status")?,
        billing_anchor: r.try_get("billing_anchor")?,
        current_period_start: r.try_get("current_period_start")?,
        current_period_end: r.try_get("current_period_end")?,
        next_billing_at: r.try_get("next_billing_at")?,
        collection_method: r.try_get("collection_method")?,
        interval_unit: r.try_get("interval_unit")?,
        interval_count: r.try_get("interval_count")?,
        amount: r.try_get("amount")?,
        currency: r.try_get("currency")?,
        cancel_at_period_end: r.try_get("cancel_at_period_end")?,
    })
}

/// The statement of [`claim_due`]; `pub` only for the plan and fairness
/// tests. The listing interleaves tenants (docs/adr/0048, `db::fair`):
/// `tenants` walks `subscriptions_due` (tenant, watermark, id) one descent
/// per tenant after the cursor (`$5`, at most `$6` tenants), `first` takes
/// each one's share of the limit in watermark order, `fill` shares the rest
/// between the tenants that took all of theirs.
pub const CLAIM_DUE: &str = concat!(
    "WITH RECURSIVE ",
    db::fair_tenants!("subscriptions", "status = 'active'", "$5", "$6", "$4"),
    "first AS MATERIALIZED ( \
       SELECT pick.* FROM tenants t CROSS JOIN share sh, LATERAL ( \
         SELECT x.*, row_number() OVER () AS turn FROM ( \
           SELECT s.id, s.tenant_id, s.next_billing_at FROM subscriptions s \
           WHERE s.status = 'active' AND s.tenant_id = t.tenant_id \
             AND s.next_billing_at <= now() \
             AND s.id <> ALL ($3) \
             AND leader_fence($1, $2) \
           ORDER BY s.next_billing_at, s.id \
           LIMIT sh.quota \
           FOR UPDATE SKIP LOCKED) x) pick), \
     whole AS MATERIALIZED ( \
       SELECT f.tenant_id, f.next_billing_at, f.id FROM first f, share sh \
       WHERE f.turn = sh.quota), \
     fill AS MATERIALIZED ( \
       SELECT more.* FROM whole w, LATERAL ( \
         SELECT s.id, s.tenant_id, s.next_billing_at FROM subscriptions s \
         WHERE s.status = 'active' AND s.tenant_id = w.tenant_id \
           AND s.next_billing_at <= now() \
           AND (s.next_billing_at, s.id) > (w.next_billing_at, w.id) \
           AND s.id <> ALL ($3) \
           AND leader_fence($1, $2) \
         ORDER BY s.next_billing_at, s.id \
         LIMIT ($4 - (SELECT count(*) FROM first)) / greatest(1, (SELECT count(*) FROM whole)) \
         FOR UPDATE SKIP LOCKED) more), \
     due AS (SELECT id FROM first UNION ALL SELECT id FROM fill) \
     SELECT s.id, s.tenant_id, s.status, s.billing_anchor, s.current_period_start, \
            s.current_period_end, s.next_billing_at, s.collection_method, \
            s.cancel_at_period_end, \
            p.interval_unit, p.interval_count, p.amount, p.currency, now() AS at, \
            (LEAST(s.billing_anchor, s.current_period_start, s.current_period_end, \
                   s.next_billing_at) >= '1970-01-01 00:00:00+00' \
             AND GREATEST(s.billing_anchor, s.current_period_start, \
                          s.current_period_end, s.next_billing_at) \
                 < '10000-01-01 00:00:00+00') AS decodable, \
            share.tenants, share.last_tenant \
     FROM share \
     LEFT JOIN (due JOIN subscriptions s ON s.id = due.id \
                JOIN plans p ON p.tenant_id = s.tenant_id AND p.id = s.plan_id) ON true \
     ORDER BY s.next_billing_at, s.id"
);

/// The fenced funnel: up to `limit` active subscriptions whose watermark has
/// passed, oldest watermark first within a tenant, with their plan, leaving
/// out `except` (rows this tick already left out). A listing, not a lease:
/// what it returns is the snapshot each closing proves, and the closing's
/// compare-and-set, not this claim, is what stops a second biller.
///
/// Tenants are interleaved (docs/adr/0048): every tenant with due
/// subscriptions among the next [`db::TENANTS_PER_CLAIM`] after `cursor` gets
/// its share of the batch, and `cursor` moves on. A statement that lists
/// nothing is followed by the next, until one lists or every tenant was
/// visited ([`db::Walk`]).
///
/// The fence sits in the innermost WHERE, next to `FOR UPDATE SKIP LOCKED`: a
/// stale token lists nothing, and rows a closing transaction holds are skipped.
/// It runs in a `begin_index_driven` transaction (docs/adr/0023), so the
/// listed rows are joined to their subscriptions and plans by key whatever
/// the statistics say.
pub(crate) async fn claim_due(
    db: &Db,
    fence: &Fence,
    cursor: &TenantCursor,
    limit: usize,
    except: &[i64],
    statement_timeout: Duration,
) -> Result<Listed<Due>, db::Error> {
    let limit = i64::try_from(limit).unwrap_or(i64::MAX);
    let bound = TENANTS_PER_CLAIM.min(limit);
    let mut walk = Walk::default();
    let mut listed = decode_each(&[], due);
    while let Some(after) = walk.next(cursor) {
        let mut tx = db.begin_index_driven(statement_timeout).await?;
        let rows = tx
            .fetch_all(
                sql(CLAIM_DUE)
                    .bind(fence.role_name())
                    .bind(fence.token())
                    .bind(except.to_vec())
                    .bind(limit)
                    .bind(after)
                    .bind(bound),
            )
            .await?;
        tx.commit().await?;
        let rows = cursor.claimed(rows, bound)?;
        listed = decode_each(&rows, due);
        if !rows.is_empty() {
            break;
        }
    }
    Ok(listed)
}

/// A claim's rows, and the ids of those that could not be decoded (left out
/// of the tick by the caller, logged and counted).
#[derive(Debug, Default)]
pub(crate) struct Listed<T> {
    pub rows: Vec<T>,
    pub undecodable: Vec<i64>,
    /// The database's clock at the claim.
    pub at: Option<DateTime<Utc>>,
}

/// Decode each row, leaving out (by id) one whose `decodable` column says its
/// timestamps are out of the range migration 0020's CHECK allows (1970 to
/// 9999, so never ±infinity) (decoding `infinity` would
/// panic inside the driver) or whose decoding fails.
pub(crate) fn decode_each<T>(
    rows: &[PgRow],
    decode: impl Fn(&PgRow) -> Result<T, db::Error>,
) -> Listed<T> {
    let mut listed = Listed {
        rows: Vec::with_capacity(rows.len()),
        undecodable: Vec::new(),
        at: None,
    };
    for r in rows {
        let ok = r.try_get::<bool, _>("decodable").unwrap_or(false);
        match ok.then(|| decode(r)) {
            Some(Ok(t)) => listed.rows.push(t),
            _ => listed
                .undecodable
                .push(r.try_get::<i64, _>("id").unwrap_or_default()),
        }
        if listed.at.is_none() {
            listed.at = r.try_get("at").ok();
        }
    }
    listed
}

/// The due backlog, for the gauges.
#[derive(Debug, Clone, Copy, PartialEq)]
pub(crate) struct Backlog {
    pub due: i64,
    /// Seconds since the oldest due watermark passed; 0 when nothing is due.
    pub oldest_due_age: f64,
    /// Payment attempts waiting for an operator (needs review, or failed with
    /// the invoice flagged), read by the partial indexes.
    pub needs_review: i64,
    /// Attempts the provider is still processing.
    pub processing: i64,
    /// When these were read: the transaction's `now()` in epoch seconds.
    pub read_at: f64,
}

pub(crate) async fn backlog(db: &Db, statement_timeout: Duration) -> Result<Backlog, db::Error> {
    let mut tx = db.begin_with_timeout(statement_timeout).await?;
    let row = tx
        .fetch_one(sql("SELECT count(*) AS due, \
                    COALESCE(extract(epoch FROM now() - min(next_billing_at)), 0)::float8 AS age, \
                    extract(epoch FROM now())::float8 AS read_at \
             FROM subscriptions WHERE status = 'active' AND next_billing_at <= now()"))
        .await?;
    let review = tx
        .fetch_one(sql(
            "SELECT (SELECT count(*) FROM payment_attempts_needing_review) AS needs_review, \
                    (SELECT count(*) FROM payment_attempts \
                     WHERE provider_status = 'processing') AS processing",
        ))
        .await?;
    tx.commit().await?;
    Ok(Backlog {
        due: row.try_get("due")?,
        oldest_due_age: row.try_get("age")?,
        needs_review: review.try_get("needs_review")?,
        processing: review.try_get("processing")?,
        read_at: row.try_get("read_at")?,
    })
}
