//! Plans: create one, read one, list them. A plan is a fixed amount billed
//! every `interval_count` × `interval`, in arrears, on the subscription's
//! anchor's grid.

use axum::extract::State;
use axum::http::StatusCode;
use axum::response::Response;
use chrono::{DateTime, Utc};
use db::{PgRow, Row as _};
use serde::{Deserialize, Serialize};
use utoipa::{IntoParams, ToSchema};

use crate::auth::Caller;
use crate::error::ApiError;
use crate::extract::{Id, JsonBody, Query};
use crate::page::{List, Page};
use crate::responses::{ReadErrors, WriteErrors};
use crate::scope::{Idempotency, Scope};
use crate::state::Api;
use crate::valid;

/// The longest plan name accepted, in characters.
pub const MAX_NAME_CHARS: usize = 200;
/// The most intervals a period spans (`plans_interval_count_range`).
pub const MAX_INTERVAL_COUNT: i32 = 1000;

/// A period's unit, as `plans_interval_unit_known` allows. `minute` and
/// `hour` are for demo plans: refused (400 on `interval`) unless the
/// deployment allows them (`HARDCOUNT_API_SHORT_PLANS`, set by
/// `hardcount dev`).
#[derive(Debug, Clone, Copy, Deserialize, Serialize, ToSchema)]
#[serde(rename_all = "snake_case")]
pub enum Interval {
    Minute,
    Hour,
    Day,
    Week,
    Month,
    Year,
}

impl Interval {
    fn as_str(self) -> &'static str {
        match self {
            Interval::Minute => "minute",
            Interval::Hour => "hour",
            Interval::Day => "day",
            Interval::Week => "week",
            Interval::Month => "month",
            Interval::Year => "year",
        }
    }
}

/// A plan to create.
#[derive(Debug, Deserialize, ToSchema)]
#[serde(deny_unknown_fields)]
pub struct NewPlan {
    #[schema(min_length = 1, max_length = 200)]
    pub name: String,
    /// Integer minor units of `currency` (cents for EUR, yen for JPY), above 0
    /// and at most what the provider charges in one payment (99,999,999 of its
    /// minor units: 999,999.99 EUR; twelve digits in IDR); in a three-decimal currency (KWD, BHD,
    /// JOD, OMR, TND) a multiple of 10, as the provider charges them.
    #[schema(minimum = 1)]
    pub amount: i64,
    /// ISO 4217, upper case (`EUR`).
    #[schema(pattern = "^[A-Z]{3}$")]
    pub currency: String,
    pub interval: Interval,
    /// Intervals per period, 1 to 1000 (default 1).
    #[schema(minimum = 1, maximum = 1000)]
    pub interval_count: Option<i32>,
}

#[derive(Debug, Serialize, ToSchema)]
pub struct Plan {
    pub id: i64,
    pub name: String,
    pub amount: i64,
    pub currency: String,
    /// `minute`, `hour`, `day`, `week`, `month` or `year`.
    pub interval: String,
    pub interval_count: i32,
    pub created_at: DateTime<Utc>,
}

macro_rules! columns {
    () => {
        "id, name, amount, currency, interval_unit, interval_count, created_at"
    };
}

impl Plan {
    fn from_row(row: &PgRow) -> Result<Plan, db::Error> {
        Ok(Plan {
            id: row.try_get("id")?,
            name: row.try_get("name")?,
            amount: row.try_get("amount")?,
            currency: row.try_get("currency")?,
            interval: row.try_get("interval_unit")?,
            interval_count: row.try_get("interval_count")?,
            created_at: row.try_get("created_at")?,
        })
    }
}

#[derive(Debug, Deserialize, IntoParams)]
#[serde(deny_unknown_fields)]
#[into_params(parameter_in = Query)]
pub struct ListPlans {
    /// Page size, 1 to 100 (default 20).
    #[param(minimum = 1, maximum = 100)]
    pub limit: Option<u32>,
    /// The `next_cursor` of the page before.
    pub starting_after: Option<String>,
}

/// Create a plan.
#[utoipa::path(
    post, path = "/v1/plans", tag = "plans", operation_id = "create_plan",
    params(("Idempotency-Key" = Option<String>, Header, min_length = 1, max_length = 255, pattern = r"^[\x21-\x7E]+$", nullable = false, description = "Retry safely: the same key and body return the first answer for 24 hours.")),
    request_body = NewPlan,
    responses((status = 201, description = "Created.", body = Plan), WriteErrors),
)]
pub async fn create(
    State(api): State<Api>,
    caller: Caller,
    idem: Idempotency,
    body: JsonBody<NewPlan>,
) -> Result<Response, ApiError> {
    let p = &body.value;
    if p.name.is_empty() {
        return Err(ApiError::param("name", "name is empty"));
    }
    valid::text("name", &p.name, MAX_NAME_CHARS)?;
    if p.amount < 1 {
        return Err(ApiError::out_of_range(
            "amount",
            "amount is in minor units, above 0",
        ));
    }
    if !(p.currency.len() == 3 && p.currency.bytes().all(|b| b.is_ascii_uppercase())) {
        return Err(ApiError::param(
            "currency",
            "currency is an ISO 4217 code in upper case, e.g. EUR",
        ));
    }
    let most = billing::provider::max_provider_amount(&p.currency);
    if billing::provider::provider_amount(p.amount, &p.currency) > most {
        return Err(ApiError::out_of_range(
            "amount",
            format!(
                "the provider charges at most {most} of its minor units of {} in one \
                 payment: {} is more",
                p.currency, p.amount
            ),
        ));
    }
    let step = billing::provider::amount_step(&p.currency);
    if p.amount % step != 0 {
        return Err(ApiError::param(
            "amount",
            format!(
                "an amount in {} is charged in steps of {step} minor units (the provider takes \
                 three-decimal currencies with a last digit of 0): make it end in 0",
                p.currency
            ),
        ));
    }
    if matches!(p.interval, Interval::Minute | Interval::Hour) && !api.config().short_plans {
        return Err(ApiError::param(
            "interval",
            format!(
                "{} plans are for demos, and this deployment does not allow them \
                 (HARDCOUNT_API_SHORT_PLANS): a plan billed every {} would charge each \
                 customer that often; use day, week, month or year",
                p.interval.as_str(),
                p.interval.as_str()
            ),
        ));
    }
    let count = p.interval_count.unwrap_or(1);
    if !(1..=MAX_INTERVAL_COUNT).contains(&count) {
        return Err(ApiError::out_of_range(
            "interval_count",
            format!("interval_count is 1 to {MAX_INTERVAL_COUNT}"),
        ));
    }
    let mut scope = Scope::begin(&api, &caller).await?;
    if let Some(replay) = scope.idempotent(&idem, &body.raw).await? {
        return Ok(replay);
    }
    let row = scope
        .tx()
        .fetch_one(
            db::sql(concat!(
                "INSERT INTO plans (tenant_id, name, amount, currency, interval_unit, interval_count)
                 VALUES (api_tenant(), $1, $2, $3, $4, $5) RETURNING ",
                columns!()
            ))
            .bind(p.name.clone())
            .bind(p.amount)
            .bind(p.currency.clone())
            .bind(p.interval.as_str())
            .bind(count),
        )
        .await?;
    let plan = Plan::from_row(&row)?;
    scope.respond(StatusCode::CREATED, &plan).await
}

/// Read a plan.
#[utoipa::path(
    get, path = "/v1/plans/{id}", tag = "plans", operation_id = "get_plan",
    params(("id" = i64, Path, description = "The plan's id.", minimum = 1)),
    responses((status = 200, body = Plan), ReadErrors),
)]
pub async fn get(State(api): State<Api>, caller: Caller, Id(id): Id) -> Result<Response, ApiError> {
    let mut scope = Scope::begin(&api, &caller).await?;
    let row = scope
        .tx()
        .fetch_optional(
            db::sql(concat!(
                "SELECT ",
                columns!(),
                " FROM plans WHERE tenant_id = api_tenant() AND id = $1"
            ))
            .bind(id),
        )
        .await?
        .ok_or_else(|| ApiError::missing("plan", id))?;
    let plan = Plan::from_row(&row)?;
    scope.respond(StatusCode::OK, &plan).await
}

/// List plans, newest first.
#[utoipa::path(
    get, path = "/v1/plans", tag = "plans", operation_id = "list_plans",
    params(ListPlans),
    responses((status = 200, body = List<Plan>), ReadErrors),
)]
pub async fn list(
    State(api): State<Api>,
    caller: Caller,
    Query(q): Query<ListPlans>,
) -> Result<Response, ApiError> {
    let page = Page::new(q.limit, q.starting_after.as_deref())?;
    let mut scope = Scope::begin(&api, &caller).await?;
    let rows = scope
        .tx()
        .fetch_all(
            db::sql(concat!(
                "SELECT ",
                columns!(),
                " FROM plans WHERE tenant_id = api_tenant() AND ($1::bigint IS NULL OR id < $1)
                 ORDER BY id DESC LIMIT $2"
            ))
            .bind(page.before)
            .bind(page.fetch()),
        )
        .await?;
    let list = page.rows(&rows, Plan::from_row, |p| p.id)?;
    scope.respond(StatusCode::OK, &list).await
}
