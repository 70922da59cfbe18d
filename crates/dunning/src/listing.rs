//! The fenced funnel: the due runs of a batch (and the runs owing their final
//! action) of tenants whose business window is open (docs/adr/0045), each
//! with the snapshot its writes prove, and the rows left out of the tick,
//! logged and counted: a policy failing the schedule checks, a row that does
//! not decode (even by a panic).

use chrono::{DateTime, Utc};
use std::panic::AssertUnwindSafe;
use std::time::Duration;

use db::{Db, PgRow, Row, sql};
use leader::{Fence, Role};
use tracing::warn;

use crate::Error;
use crate::ctx::Ctx;
use crate::policy::{FinalAction, PauseBehavior, Policy};
use crate::run::{NotChargeable, Run};

/// A listed row the funnel leaves out of the tick; every other row goes on.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum LeftOut {
    /// The run's policy fails the schedule checks of migration 0021 (written
    /// before them): its runs wait until the policy is mended.
    Policy {
        run: i64,
        tenant_id: String,
        policy_id: i64,
    },
    /// The row did not decode (a value the service's types cannot hold).
    Undecodable { run: i64, error: String },
}

impl LeftOut {
    pub fn run(&self) -> i64 {
        match self {
            LeftOut::Policy { run, .. } | LeftOut::Undecodable { run, .. } => *run,
        }
    }
}

/// What the funnel listed: the runs to retry, and the rows it left out.
#[derive(Debug, Default)]
pub(crate) struct Listing {
    pub runs: Vec<Run>,
    pub left_out: Vec<LeftOut>,
}

/// A column of `r`, its decoding error as text.
macro_rules! get {
    ($r:expr, $column:literal) => {
        $r.try_get($column).map_err(|e| e.to_string())
    };
}

fn run(r: &PgRow) -> Result<Run, String> {
    let action: String = get!(r, "final_action")?;
    let behavior: String = get!(r, "pause_behavior")?;
    let not_chargeable: Option<String> = get!(r, "not_chargeable")?;
    Ok(Run {
        id: get!(r, "id")?,
        tenant_id: get!(r, "tenant_id")?,
        invoice_id: get!(r, "invoice_id")?,
        invoice_number: get!(r, "invoice_number")?,
        subscription_id: get!(r, "subscription_id")?,
        policy_id: get!(r, "policy_id")?,
        status: get!(r, "status")?,
        attempt_count: get!(r, "attempt_count")?,
        first_declined_at: get!(r, "first_declined_at")?,
        next_attempt_at: get!(r, "next_attempt_at")?,
        clock_skew: get!(r, "listed_at").map(|at: DateTime<Utc>| at - Utc::now())?,
        invoice_status: get!(r, "invoice_status")?,
        amount: get!(r, "amount")?,
        currency: get!(r, "currency")?,
        email: get!(r, "email")?,
        payment_method: get!(r, "payment_method_id")?,
        not_chargeable: not_chargeable
            .map(|s| NotChargeable::parse(&s).ok_or(format!("not_chargeable {s:?}")))
            .transpose()?,
        owed_code: get!(r, "owed_code")?,
        email_from: get!(r, "email_from")?,
        payment_page_url: get!(r, "payment_page_url")?,
        policy: Policy {
            offsets_secs: get!(r, "retry_offsets_secs")?,
            // The CHECKs allow only these; anything else is a corrupt row.
            final_action: FinalAction::parse(&action)
                .ok_or(format!("final_action {action:?} is not one of the three"))?,
            pause_behavior: PauseBehavior::parse(&behavior).ok_or(format!(
                "pause_behavior {behavior:?} is not one of the three"
            ))?,
            warn_after: get!(r, "warn_after")?,
            final_notice: get!(r, "final_notice")?,
        },
    })
}

/// One listed row: its run, or why it is left out. A decoding panic (the
/// driver panics on a timestamp past chrono's range, `infinity` among them)
/// is caught here, so one row never stops the listing.
fn listed(r: &PgRow) -> Result<Run, LeftOut> {
    let id: i64 = r.try_get("id").unwrap_or_default();
    let decoded = std::panic::catch_unwind(AssertUnwindSafe(|| {
        let valid: Option<bool> = get!(r, "policy_valid")?;
        if valid != Some(true) {
            let tenant_id: String = get!(r, "tenant_id")?;
            let policy_id: i64 = get!(r, "policy_id")?;
            return Ok(Err(LeftOut::Policy {
                run: id,
                tenant_id,
                policy_id,
            }));
        }
        run(r).map(Ok)
    }));
    match decoded {
        Ok(Ok(listed)) => listed,
        Ok(Err(error)) => Err(LeftOut::Undecodable { run: id, error }),
        Err(payload) => Err(LeftOut::Undecodable {
            run: id,
            error: scheduler::panic_message(&*payload),
        }),
    }
}

/// The decline codes after which the same card is not tried again: until the
/// customer's payment method changes, each due retry is counted without a
/// provider call (docs/adr/0024, docs/adr/0026).
fn held_declines() -> Vec<String> {
    payments::HARD_DECLINES
        .iter()
        .copied()
        .chain(["authentication_required"])
        .map(str::to_owned)
        .collect()
}

pub(crate) async fn list(
    ctx: &Ctx,
    fence: &Fence,
    limit: usize,
    except: &[i64],
) -> Result<Listing, Error> {
    let timeout = ctx.config.statement_timeout;
    let listing = list_due(&ctx.db, fence, limit, except, timeout).await?;
    let t = &ctx.telemetry;
    for left in &listing.left_out {
        match left {
            LeftOut::Policy {
                run,
                tenant_id,
                policy_id,
            } => {
                warn!(role = %Role::Dunning, tenant = %tenant_id, policy = policy_id, run, "dunning policy fails the schedule checks (a NULL or out-of-range offset or warning); its runs are skipped until it is mended");
                t.counter("hardcount_dunning_policies_skipped_total", &[])
                    .increment(1);
            }
            LeftOut::Undecodable { run, error } => {
                warn!(role = %Role::Dunning, run, error = %error, "dunning run row does not decode; left out of the tick");
                t.counter("hardcount_dunning_rows_undecodable_total", &[])
                    .increment(1);
            }
        }
    }
    Ok(listing)
}

/// The gauges: active runs, and the seconds since the oldest active run's
/// retry fell due among those the listing would retry now (0 when none):
/// runs waiting for their tenant's window are not late, nor are runs billing
/// holds on purpose: collection paused, the invoice under review, or an
/// attempt still unsettled (billing's retry claim, `retry.rs`, refuses the
/// same three; each has its own signal). docs/adr/0135. The age walks
/// `dunning_runs_due` from its oldest entry and stops at the first run it
/// keeps.
pub(crate) const GAUGES: &str = concat!(
    "SELECT (SELECT count(*) FROM dunning_runs WHERE status = 'active') AS active, \
            COALESCE((SELECT extract(epoch FROM now() - r.next_attempt_at)::float8 \
                      FROM dunning_runs r \
                      JOIN invoices i ON i.id = r.invoice_id \
                      JOIN subscriptions s ON s.id = i.subscription_id \
                      WHERE r.status = 'active' AND r.next_attempt_at <= now() \
                        AND s.pause_collection_behavior IS NULL \
                        AND i.review_since IS NULL \
                        AND NOT EXISTS (SELECT 1 FROM payment_attempts a \
                                        WHERE a.invoice_id = i.id \
                                          AND a.provider_status IN ('unknown', 'processing', 'needs_review')) \
                        AND r.tenant_id NOT IN (",
    payments::window_closed_tenants!(),
    ") \
                      ORDER BY r.next_attempt_at LIMIT 1), 0) AS oldest_due_age, \
            extract(epoch FROM now())::float8 AS read_at"
);

/// The listing's window rule alone, on the instant `$5` for a window `$1`
/// (zone), `$2` and `$3` (opening and closing times as text), `$4`
/// (weekdays): the same text as [`LIST_DUE`]'s, for the table test of its
/// days and daylight-saving transitions (`tests/it/window_rule.rs`).
pub const WINDOW_OPEN_AT: &str = concat!(
    "SELECT (",
    payments::window_open!(),
    ") AS open \
     FROM (VALUES ($1::text, $2::time, $3::time, $4::integer[])) \
          AS w (window_time_zone, window_opens, window_closes, window_weekdays) \
     CROSS JOIN LATERAL (SELECT $5::timestamptz AT TIME ZONE w.window_time_zone AS t) l"
);

/// The funnel's statement (see [`list_due`]); `pub` only for the tests.
///
/// The business window (docs/adr/0045) is the tenant's default policy's,
/// whichever policy the run has, so a new default moves runs already
/// scheduled. It is one uncorrelated subquery, the tenants whose window is
/// closed at the statement's `now()`: evaluated once per statement over the
/// default policies that have a window, then a hashed lookup of each due
/// run's tenant in the due index's scan, before any join. A window that does
/// not evaluate (it cannot under 0035's CHECKs) counts as closed.
///
/// The joins are written in the order they run, each by a key of the rows
/// before it, and run so (`Db::begin_index_driven_as_written`): the due runs
/// in `dunning_runs_due` order, a batch at a time (with bitmap scans allowed,
/// every due run was read and sorted for each batch), then each run's
/// invoice, subscription and customer by their primary keys, its policy by
/// `(tenant_id, id)`. The invoice, subscription and customer are joined by id
/// alone: their composite foreign keys (migrations 0006 and 0010) already hold
/// them to the run's tenant, and an equality on `tenant_id` there let the
/// planner reach them by `tenant_id` alone where it estimated the tables tiny.
/// Searching the join orders also cost 8 to 17 ms of planning per call, more
/// than the statement's execution (docs/adr/0056).
pub const LIST_DUE: &str = concat!(
    "SELECT r.id, r.tenant_id, r.invoice_id, r.policy_id, r.status, r.attempt_count, \
            r.first_declined_at, r.next_attempt_at, now() AS listed_at, \
            i.status AS invoice_status, i.number AS invoice_number, i.subscription_id, \
            i.amount, i.currency, c.email, c.payment_method_id, ts.email_from, ts.payment_page_url, \
            CASE WHEN r.status <> 'active' THEN NULL \
                 WHEN (r.attempt_count >= cardinality(p.retry_offsets_secs) \
                       OR r.owed_notice_attempt = r.attempt_count \
                       OR c.payment_method_id IS NULL) \
                      AND coalesce(la.provider_status IN ('unknown', 'processing', 'needs_review') \
                                   AND NOT (la.first_sent_at IS NULL \
                                            AND c.payment_method_id IS NULL), false) \
                 THEN 'outcome_pending' \
                 WHEN s.pause_collection_behavior IS NOT NULL THEN NULL \
                 WHEN r.owed_notice_attempt = r.attempt_count \
                      AND (la.provider_status = 'declined' OR la.reviewed_at IS NOT NULL) \
                 THEN 'decline_unannounced' \
                 WHEN r.attempt_count >= cardinality(p.retry_offsets_secs) THEN 'retries_spent' \
                 WHEN c.payment_method_id IS NULL THEN 'no_payment_method' \
                 WHEN coalesce(la.decline_code = ANY ($5) \
                               AND la.payment_method_id IS NOT DISTINCT FROM c.payment_method_id, \
                               false) \
                 THEN 'payment_method_unchanged' END AS not_chargeable, \
            CASE WHEN r.status = 'active' AND r.owed_notice_attempt = r.attempt_count \
                 THEN coalesce(la.decline_code, la.provider_status) \
            END AS owed_code, \
            COALESCE(CASE WHEN array_ndims(p.retry_offsets_secs) = 1 \
              THEN array_position(p.retry_offsets_secs, NULL) IS NULL \
                   AND 1 <= ALL (p.retry_offsets_secs) \
                   AND 31622400 >= ALL (p.retry_offsets_secs) \
              ELSE false END \
              AND CASE WHEN cardinality(p.warn_after) = 0 THEN true \
                WHEN array_ndims(p.warn_after) = 1 \
                THEN array_position(p.warn_after, NULL) IS NULL \
                     AND 1 <= ALL (p.warn_after) \
                     AND cardinality(p.retry_offsets_secs) >= ALL (p.warn_after) \
                ELSE false END, false) AS policy_valid, \
            p.retry_offsets_secs, p.final_action, p.pause_behavior, p.warn_after, \
            p.final_notice \
     FROM dunning_runs r \
     JOIN invoices i ON i.id = r.invoice_id \
     JOIN subscriptions s ON s.id = i.subscription_id \
     JOIN customers c ON c.id = s.customer_id \
     JOIN dunning_policies p ON p.tenant_id = r.tenant_id AND p.id = r.policy_id \
     LEFT JOIN tenant_settings ts ON ts.tenant_id = r.tenant_id \
     LEFT JOIN LATERAL ( \
       SELECT a.provider_status, a.first_sent_at, a.decline_code, a.payment_method_id, \
              a.reviewed_at \
       FROM payment_attempts a WHERE a.invoice_id = r.invoice_id \
       ORDER BY a.attempt_seq DESC LIMIT 1) la ON true \
     WHERE ((r.status = 'active' AND r.next_attempt_at <= now()) \
            OR (r.status = 'exhausted' AND r.final_action_at IS NULL)) \
       AND r.id <> ALL ($3) \
       AND leader_fence($1, $2) \
       AND r.tenant_id NOT IN (",
    payments::window_closed_tenants!(),
    ") \
     ORDER BY r.next_attempt_at, r.id \
     LIMIT $4 \
     FOR UPDATE OF r SKIP LOCKED"
);

/// The fenced funnel: up to `limit` runs that are due (active, next attempt
/// passed) or owe their final action (exhausted, not yet acted), oldest first,
/// leaving out `except` (runs this tick already left out). Each active run
/// says whether its retry can be charged: not when the customer has no
/// payment method, nor when its last attempt was a hard decline (or wanted
/// authentication) on the payment method the customer still has. A run
/// whose subscription's collection is paused is not marked: billing's claim
/// holds it (rewound), so a pause stops the schedule as it stops charges. A
/// run whose retry was answered `processing` waits while that attempt is
/// pending (`outcome_pending`) and, once it settled without paying, owes its
/// decline's notices (`decline_unannounced`, docs/adr/0085); so does one
/// whose customer has no payment method left while its last retry's outcome
/// is unknown, else it would be counted, and perhaps written off or
/// canceled, over a charge that may yet be found paid (docs/adr/0103). An
/// attempt no request of which was ever sent (`first_sent_at` NULL: the
/// budget ran out, or the provider refused the call before reading its key)
/// cannot be found paid, and billing sends it only once the customer has a
/// card again: with no card, it does not hold the run, which goes on to
/// `no_payment_method` or `retries_spent` (docs/adr/0116), also when the run
/// owes that attempt's notices (a retry recorded, refused unread and never
/// rewound): no decline was made, so none is announced, and the next retry
/// is counted not attempted. Only a last attempt declined, or settled by an
/// operator (`reviewed_at`: docs/adr/0085's `failed`), is announced as owed:
/// one refused (`failed` unreviewed, a 400: not a decline, docs/adr/0024)
/// whose outcome, fallback and rewind all failed left the mark too, and was
/// announced to the customer as a decline "(failed)" (docs/adr/0141). Rows whose
/// policy fails the schedule checks (`policy_valid`: migration 0021's CHECK
/// expressions, repeated here), or that do not decode, come back as
/// [`LeftOut`]. A run of a tenant whose business window is closed at the
/// statement's clock is not listed at all (docs/adr/0045): it waits, due,
/// for the window's opening, and its retry, warning or final action (and
/// their emails) with it. A listing, not a lease: the attempt
/// compare-and-set decides who retries.
async fn list_due(
    db: &Db,
    fence: &Fence,
    limit: usize,
    except: &[i64],
    statement_timeout: Duration,
) -> Result<Listing, db::Error> {
    let limit = i64::try_from(limit).unwrap_or(i64::MAX);
    let mut tx = db.begin_index_driven_as_written(statement_timeout).await?;
    let rows = tx
        .fetch_all(
            sql(LIST_DUE)
                .bind(fence.role_name())
                .bind(fence.token())
                .bind(except.to_vec())
                .bind(limit)
                .bind(held_declines()),
        )
        .await?;
    tx.commit().await?;
    let mut listing = Listing::default();
    for r in &rows {
        match listed(r) {
            Ok(run) => listing.runs.push(run),
            Err(left_out) => listing.left_out.push(left_out),
        }
    }
    Ok(listing)
}
