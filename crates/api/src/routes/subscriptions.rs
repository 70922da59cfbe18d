//! Subscriptions: create one (active now, or trialing until `trial_end`),
//! read one, list them, and the lifecycle actions, each through billing's
//! own producer in the request's transaction (`Biller::*_in`), so the
//! change, its invoice and its events commit with the answer or not at all.
//!
//! What the actions rely on from Stripe's model:
//! - cancel: "Cancels a customer's subscription immediately. The customer
//!   won't be charged again" (docs.stripe.com/api/subscriptions/cancel);
//!   `at_period_end` is Stripe's `cancel_at_period_end`: the current period
//!   is billed in full and then the subscription ends. A cancel now invoices
//!   the used part unless the tenant's `invoice_on_cancel` is off.
//! - pause: Stripe's `pause_collection` — the subscription stays active and
//!   invoices are still made, but payment is not collected; `behavior` is one
//!   of `keep_as_draft`, `mark_uncollectible`, `void`, and `resumes_at` is
//!   optional (docs.stripe.com/billing/subscriptions/pause-payment). Resume
//!   clears it.
//! - change_plan: Stripe refuses a price in another currency on a
//!   subscription; so does billing (409 `currency_mismatch`).

use axum::extract::State;
use axum::http::StatusCode;
use axum::response::Response;
use billing::period::{self, Interval, Unit};
use chrono::{DateTime, TimeDelta, Utc};
use db::{PgRow, Row as _};
use serde::{Deserialize, Serialize};
use utoipa::{IntoParams, ToSchema};

use crate::auth::Caller;
use crate::error::{ApiError, Code};
use crate::extract::{Id, JsonBody, Query};
use crate::page::{List, Page};
use crate::responses::{ReadErrors, WriteErrors};
use crate::scope::{Idempotency, Scope};
use crate::state::Api;
use crate::valid;

/// The latest a trial may end: two years on, as Stripe allows.
pub const MAX_TRIAL_DAYS: i64 = 730;

/// How invoices are collected (`subscriptions_collection_method_known`).
#[derive(Debug, Clone, Copy, Deserialize, ToSchema)]
#[serde(rename_all = "snake_case")]
pub enum CollectionMethod {
    /// Charged off session with the customer's saved payment method.
    Automatic,
    /// Sent to the customer, who pays them.
    SendInvoice,
}

/// A subscription to create.
#[derive(Debug, Deserialize, ToSchema)]
#[serde(deny_unknown_fields)]
pub struct NewSubscription {
    /// The customer's id.
    #[schema(minimum = 1)]
    pub customer: i64,
    /// The plan's id.
    #[schema(minimum = 1)]
    pub plan: i64,
    /// Every period boundary is `billing_anchor + k × interval`; default:
    /// the trial's end, or now. At most one interval after now (or the
    /// trial's end). The first period runs from now (or the trial's end) to
    /// the grid's next boundary and is invoiced pro rata.
    pub billing_anchor: Option<DateTime<Utc>>,
    /// A trial until this time (in the future, at most 730 days on): no
    /// period is billed before it.
    pub trial_end: Option<DateTime<Utc>>,
    /// Default `automatic`.
    pub collection_method: Option<CollectionMethod>,
}

/// A pause of collection as the subscription holds it.
#[derive(Debug, Serialize, ToSchema)]
pub struct PauseCollection {
    /// `keep_as_draft`, `mark_uncollectible` or `void`.
    pub behavior: String,
    pub resumes_at: Option<DateTime<Utc>>,
    /// Who paused it: `api`, `dunning`, or an operator's name.
    pub set_by: Option<String>,
}

#[derive(Debug, Serialize, ToSchema)]
pub struct Subscription {
    pub id: i64,
    pub customer: i64,
    pub plan: i64,
    /// `trialing`, `active` or `canceled`. A pause of collection leaves it
    /// `active` and shows in `pause_collection`.
    pub status: String,
    pub billing_anchor: DateTime<Utc>,
    pub current_period_start: DateTime<Utc>,
    pub current_period_end: DateTime<Utc>,
    /// When billing next closes the period; null unless active.
    pub next_billing_at: Option<DateTime<Utc>>,
    pub trial_end: Option<DateTime<Utc>>,
    pub collection_method: String,
    pub cancel_at_period_end: bool,
    pub canceled_at: Option<DateTime<Utc>>,
    pub pause_collection: Option<PauseCollection>,
    pub created_at: DateTime<Utc>,
    pub updated_at: DateTime<Utc>,
}

macro_rules! columns {
    () => {
        "id, customer_id, plan_id, status, billing_anchor, current_period_start, \
         current_period_end, next_billing_at, trial_end, collection_method, \
         cancel_at_period_end, canceled_at, pause_collection_behavior, \
         pause_collection_resumes_at, pause_collection_set_by, created_at, updated_at"
    };
}

impl Subscription {
    fn from_row(row: &PgRow) -> Result<Subscription, db::Error> {
        let behavior: Option<String> = row.try_get("pause_collection_behavior")?;
        let pause_collection = match behavior {
            Some(behavior) => Some(PauseCollection {
                behavior,
                resumes_at: row.try_get("pause_collection_resumes_at")?,
                set_by: row.try_get("pause_collection_set_by")?,
            }),
            None => None,
        };
        Ok(Subscription {
            id: row.try_get("id")?,
            customer: row.try_get("customer_id")?,
            plan: row.try_get("plan_id")?,
            status: row.try_get("status")?,
            billing_anchor: row.try_get("billing_anchor")?,
            current_period_start: row.try_get("current_period_start")?,
            current_period_end: row.try_get("current_period_end")?,
            next_billing_at: row.try_get("next_billing_at")?,
            trial_end: row.try_get("trial_end")?,
            collection_method: row.try_get("collection_method")?,
            cancel_at_period_end: row.try_get("cancel_at_period_end")?,
            canceled_at: row.try_get("canceled_at")?,
            pause_collection,
            created_at: row.try_get("created_at")?,
            updated_at: row.try_get("updated_at")?,
        })
    }
}

#[derive(Debug, Deserialize, IntoParams)]
#[serde(deny_unknown_fields)]
#[into_params(parameter_in = Query)]
pub struct ListSubscriptions {
    /// Page size, 1 to 100 (default 20).
    #[param(minimum = 1, maximum = 100)]
    pub limit: Option<u32>,
    /// The `next_cursor` of the page before.
    pub starting_after: Option<String>,
    /// Only this customer's subscriptions.
    #[param(minimum = 1)]
    pub customer: Option<i64>,
}

mod actions;

pub use actions::*;

const IDEM: &str = "Retry safely: the same key and body return the first answer for 24 hours.";

async fn db_now(scope: &mut Scope) -> Result<DateTime<Utc>, ApiError> {
    let row = scope.tx().fetch_one(db::sql("SELECT now() AS now")).await?;
    Ok(row.try_get("now").map_err(db::Error::from)?)
}

async fn read(scope: &mut Scope, id: i64) -> Result<Option<Subscription>, ApiError> {
    let row = scope
        .tx()
        .fetch_optional(
            db::sql(concat!(
                "SELECT ",
                columns!(),
                " FROM subscriptions WHERE tenant_id = api_tenant() AND id = $1"
            ))
            .bind(id),
        )
        .await?;
    Ok(row.as_ref().map(Subscription::from_row).transpose()?)
}

/// The subscription after an action, in the action's transaction.
async fn answer(scope: Scope, id: i64) -> Result<Response, ApiError> {
    let mut scope = scope;
    let s = read(&mut scope, id).await?.ok_or_else(ApiError::internal)?;
    scope.respond(StatusCode::OK, &s).await
}

fn missing_ref(what: &str, param: &str, id: i64) -> ApiError {
    let mut e = ApiError::missing(what, id);
    e.param = Some(param.to_owned());
    e
}

/// Create a subscription.
#[utoipa::path(
    post, path = "/v1/subscriptions", tag = "subscriptions", operation_id = "create_subscription",
    params(("Idempotency-Key" = Option<String>, Header, min_length = 1, max_length = 255, pattern = r"^[\x21-\x7E]+$", nullable = false, description = IDEM)),
    request_body = NewSubscription,
    responses((status = 201, description = "Created; announced with subscription.created.", body = Subscription), WriteErrors),
)]
pub async fn create(
    State(api): State<Api>,
    caller: Caller,
    idem: Idempotency,
    body: JsonBody<NewSubscription>,
) -> Result<Response, ApiError> {
    let n = &body.value;
    if let Some(a) = n.billing_anchor {
        valid::time_in_range("billing_anchor", a)?;
    }
    let mut scope = Scope::begin(&api, &caller).await?;
    if let Some(replay) = scope.idempotent(&idem, &body.raw).await? {
        return Ok(replay);
    }
    let customer = scope
        .tx()
        .fetch_optional(
            db::sql("SELECT id FROM customers WHERE tenant_id = api_tenant() AND id = $1")
                .bind(n.customer),
        )
        .await?;
    if customer.is_none() {
        return Err(missing_ref("customer", "customer", n.customer));
    }
    let plan = scope
        .tx()
        .fetch_optional(
            db::sql(
                "SELECT interval_unit, interval_count FROM plans
                 WHERE tenant_id = api_tenant() AND id = $1",
            )
            .bind(n.plan),
        )
        .await?
        .ok_or_else(|| missing_ref("plan", "plan", n.plan))?;
    let unit: String = plan.try_get("interval_unit").map_err(db::Error::from)?;
    let count: i32 = plan.try_get("interval_count").map_err(db::Error::from)?;
    let interval = Unit::parse(&unit)
        .zip(u32::try_from(count).ok().filter(|c| *c > 0))
        .map(|(unit, count)| Interval { unit, count })
        .ok_or_else(|| {
            ApiError::conflict(Code::InvalidState, "the plan's interval cannot be billed")
        })?;
    let now = db_now(&mut scope).await?;
    if let Some(t) = n.trial_end
        && (t <= now || t > now + TimeDelta::days(MAX_TRIAL_DAYS))
    {
        return Err(ApiError::out_of_range(
            "trial_end",
            format!("trial_end is in the future, at most {MAX_TRIAL_DAYS} days on"),
        ));
    }
    // The anchor's grid sets where the first period ends: its first boundary
    // after the start. An anchor more than one interval after the start made
    // a first period longer than the plan's interval, and billing prices a
    // period pro rata of at most one interval: months of service invoiced as
    // one, or, far enough ahead, a subscription never invoiced. As the
    // provider answers ("billing_cycle_anchor cannot be later than next
    // natural billing date"), refused (docs/adr/0096).
    let start = n.trial_end.unwrap_or(now);
    if let Some(a) = n.billing_anchor
        && period::boundary(start, interval, 1).is_none_or(|natural| a > natural)
    {
        return Err(ApiError::out_of_range(
            "billing_anchor",
            "billing_anchor is at most one interval after the first period's start (now, or trial_end)",
        ));
    }
    // As billing expects a row (its test seeders and the trial step): an
    // active subscription's period runs from now to the anchor's next
    // boundary and its watermark is that end; a trialing one's "period" is
    // the trial, with no watermark, and the trial step starts its first
    // paid period at trial_end.
    let anchor = n.billing_anchor.or(n.trial_end).unwrap_or(now);
    let (status, start, end, watermark) = match n.trial_end {
        Some(t) => ("trialing", now, t, None),
        None => {
            let end = period::end_after(anchor, interval, now)
                .filter(|e| valid::time_in_range("billing_anchor", *e).is_ok())
                .ok_or_else(|| {
                    ApiError::out_of_range(
                        "billing_anchor",
                        "the first period from this anchor ends out of range",
                    )
                })?;
            ("active", now, end, Some(end))
        }
    };
    let method = match n.collection_method {
        Some(CollectionMethod::SendInvoice) => "send_invoice",
        _ => "automatic",
    };
    let row = scope
        .tx()
        .fetch_one(
            db::sql(concat!(
                "INSERT INTO subscriptions (tenant_id, customer_id, plan_id, status, billing_anchor,
                     current_period_start, current_period_end, next_billing_at, trial_end,
                     collection_method)
                 VALUES (api_tenant(), $1, $2, $3, $4, $5, $6, $7, $8, $9) RETURNING ",
                columns!()
            ))
            .bind(n.customer)
            .bind(n.plan)
            .bind(status)
            .bind(anchor)
            .bind(start)
            .bind(end)
            .bind(watermark)
            .bind(n.trial_end)
            .bind(method),
        )
        .await?;
    let s = Subscription::from_row(&row)?;
    let tenant = scope.tenant().to_owned();
    let payload = serde_json::json!({
        "object": "subscription",
        "id": s.id,
        "customer": s.customer,
        "plan": s.plan,
        "status": s.status,
        "current_period_start": s.current_period_start.to_rfc3339(),
        "current_period_end": s.current_period_end.to_rfc3339(),
        "trial_end": s.trial_end.map(|t| t.to_rfc3339()),
    })
    .to_string();
    outbox::webhook::enqueue(scope.tx(), &tenant, "subscription.created", &payload)
        .await
        .map_err(valid::enqueue_error)?;
    scope.respond(StatusCode::CREATED, &s).await
}

/// Read a subscription.
#[utoipa::path(
    get, path = "/v1/subscriptions/{id}", tag = "subscriptions", operation_id = "get_subscription",
    params(("id" = i64, Path, description = "The subscription's id.", minimum = 1)),
    responses((status = 200, body = Subscription), ReadErrors),
)]
pub async fn get(State(api): State<Api>, caller: Caller, Id(id): Id) -> Result<Response, ApiError> {
    let mut scope = Scope::begin(&api, &caller).await?;
    let s = read(&mut scope, id)
        .await?
        .ok_or_else(|| ApiError::missing("subscription", id))?;
    scope.respond(StatusCode::OK, &s).await
}

/// List subscriptions, newest first.
#[utoipa::path(
    get, path = "/v1/subscriptions", tag = "subscriptions", operation_id = "list_subscriptions",
    params(ListSubscriptions),
    responses((status = 200, body = List<Subscription>), ReadErrors),
)]
pub async fn list(
    State(api): State<Api>,
    caller: Caller,
    Query(q): Query<ListSubscriptions>,
) -> Result<Response, ApiError> {
    let page = Page::new(q.limit, q.starting_after.as_deref())?;
    if q.customer.is_some_and(|id| id < 1) {
        return Err(ApiError::param("customer", "customer is a positive id"));
    }
    let mut scope = Scope::begin(&api, &caller).await?;
    let rows = scope
        .tx()
        .fetch_all(
            db::sql(concat!(
                "SELECT ",
                columns!(),
                " FROM subscriptions
                 WHERE tenant_id = api_tenant() AND ($1::bigint IS NULL OR id < $1)
                   AND ($2::bigint IS NULL OR customer_id = $2)
                 ORDER BY id DESC LIMIT $3"
            ))
            .bind(page.before)
            .bind(q.customer)
            .bind(page.fetch()),
        )
        .await?;
    let list = page.rows(&rows, Subscription::from_row, |s| s.id)?;
    scope.respond(StatusCode::OK, &list).await
}
