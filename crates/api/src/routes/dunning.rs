//! Dunning: the tenant's retry policy (read it; write a new one, which new
//! runs get while runs in flight keep theirs) and its runs, each with the
//! payment attempts of its invoice. The dunning role writes the runs.

use axum::extract::State;
use axum::http::StatusCode;
use axum::response::Response;
use chrono::{DateTime, Utc};
use db::{PgRow, Row as _};
use serde::{Deserialize, Serialize};
use utoipa::{IntoParams, ToSchema};

use crate::auth::Caller;
use crate::error::{ApiError, Code};
use crate::extract::{Id, JsonBody, Query};
use crate::page::{List, Page};
use crate::responses::{ReadErrors, WriteErrors};
use crate::routes::invoices::{PaymentAttempt, attempts};
use crate::scope::{Idempotency, Scope};
use crate::state::Api;
use crate::valid;

/// The longest policy name accepted, in characters.
pub const MAX_NAME_CHARS: usize = 200;

/// What exhaustion does, once (`dunning_policies_final_action_known`).
#[derive(Debug, Clone, Copy, Deserialize, ToSchema)]
#[serde(rename_all = "snake_case")]
pub enum FinalAction {
    CancelSubscription,
    PauseCollection,
    MarkUncollectible,
}

impl From<FinalAction> for dunning::FinalAction {
    fn from(a: FinalAction) -> Self {
        match a {
            FinalAction::CancelSubscription => dunning::FinalAction::CancelSubscription,
            FinalAction::PauseCollection => dunning::FinalAction::PauseCollection,
            FinalAction::MarkUncollectible => dunning::FinalAction::MarkUncollectible,
        }
    }
}

/// The behaviour `pause_collection` writes (`dunning_policies_pause_behavior_known`).
#[derive(Debug, Clone, Copy, Deserialize, ToSchema)]
#[serde(rename_all = "snake_case")]
pub enum PauseBehavior {
    KeepAsDraft,
    MarkUncollectible,
    Void,
}

impl From<PauseBehavior> for dunning::PauseBehavior {
    fn from(b: PauseBehavior) -> Self {
        match b {
            PauseBehavior::KeepAsDraft => dunning::PauseBehavior::KeepAsDraft,
            PauseBehavior::MarkUncollectible => dunning::PauseBehavior::MarkUncollectible,
            PauseBehavior::Void => dunning::PauseBehavior::Void,
        }
    }
}

/// The tenant's policy to write.
#[derive(Debug, Deserialize, ToSchema)]
#[serde(deny_unknown_fields)]
pub struct NewPolicy {
    /// Default `Default`.
    #[schema(min_length = 1, max_length = 200)]
    pub name: Option<String>,
    /// Retry n is due `retry_offsets_secs[n - 1]` seconds after the first
    /// decline: 1 to 20 retries, each 1 s to 366 days.
    #[schema(min_items = 1, max_items = 20)]
    pub retry_offsets_secs: Vec<i64>,
    pub final_action: FinalAction,
    /// What `pause_collection` writes; default `keep_as_draft`.
    pub pause_behavior: Option<PauseBehavior>,
    /// Retries (1-based) whose decline sends the customer a warning email;
    /// default none.
    #[serde(default)]
    pub warn_after: Vec<i32>,
    /// Whether exhaustion sends a final notice; default true.
    pub final_notice: Option<bool>,
}

#[derive(Debug, Serialize, ToSchema)]
pub struct Policy {
    /// Null for the built-in default, which the tenant's first run creates.
    pub id: Option<i64>,
    pub name: String,
    pub retry_offsets_secs: Vec<i64>,
    pub final_action: String,
    pub pause_behavior: String,
    pub warn_after: Vec<i32>,
    pub final_notice: bool,
    pub created_at: Option<DateTime<Utc>>,
}

macro_rules! policy_columns {
    () => {
        "id, name, retry_offsets_secs, final_action, pause_behavior, warn_after, final_notice, created_at"
    };
}

impl Policy {
    fn from_row(row: &PgRow) -> Result<Policy, db::Error> {
        Ok(Policy {
            id: row.try_get("id")?,
            name: row.try_get("name")?,
            retry_offsets_secs: row.try_get("retry_offsets_secs")?,
            final_action: row.try_get("final_action")?,
            pause_behavior: row.try_get("pause_behavior")?,
            warn_after: row.try_get("warn_after")?,
            final_notice: row.try_get("final_notice")?,
            created_at: row.try_get("created_at")?,
        })
    }

    fn built_in() -> Policy {
        Policy {
            id: None,
            name: "Default".to_owned(),
            retry_offsets_secs: dunning::policy::DEFAULT_OFFSETS_SECS.to_vec(),
            final_action: dunning::policy::DEFAULT_FINAL_ACTION.as_str().to_owned(),
            pause_behavior: dunning::PauseBehavior::KeepAsDraft.as_str().to_owned(),
            warn_after: dunning::policy::DEFAULT_WARN_AFTER.to_vec(),
            final_notice: true,
            created_at: None,
        }
    }
}

#[derive(Debug, Serialize, ToSchema)]
pub struct Run {
    pub id: i64,
    pub invoice: i64,
    pub policy: i64,
    /// `active`, `recovered`, `exhausted` or `stopped`.
    pub status: String,
    /// Retries recorded.
    pub attempt_count: i32,
    pub first_declined_at: DateTime<Utc>,
    pub next_attempt_at: DateTime<Utc>,
    pub last_decline_code: Option<String>,
    pub final_action_at: Option<DateTime<Utc>>,
    pub ended_at: Option<DateTime<Utc>>,
    pub created_at: DateTime<Utc>,
    pub updated_at: DateTime<Utc>,
    /// The invoice's payment attempts, oldest first; only on
    /// `GET /v1/dunning/runs/{id}`.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub attempts: Option<Vec<PaymentAttempt>>,
}

macro_rules! run_columns {
    () => {
        "id, invoice_id, policy_id, status, attempt_count, first_declined_at, next_attempt_at, \
         last_decline_code, final_action_at, ended_at, created_at, updated_at"
    };
}

impl Run {
    fn from_row(row: &PgRow) -> Result<Run, db::Error> {
        Ok(Run {
            id: row.try_get("id")?,
            invoice: row.try_get("invoice_id")?,
            policy: row.try_get("policy_id")?,
            status: row.try_get("status")?,
            attempt_count: row.try_get("attempt_count")?,
            first_declined_at: row.try_get("first_declined_at")?,
            next_attempt_at: row.try_get("next_attempt_at")?,
            last_decline_code: row.try_get("last_decline_code")?,
            final_action_at: row.try_get("final_action_at")?,
            ended_at: row.try_get("ended_at")?,
            created_at: row.try_get("created_at")?,
            updated_at: row.try_get("updated_at")?,
            attempts: None,
        })
    }
}

#[derive(Debug, Deserialize, IntoParams)]
#[serde(deny_unknown_fields)]
#[into_params(parameter_in = Query)]
pub struct ListRuns {
    /// Page size, 1 to 100 (default 20).
    #[param(minimum = 1, maximum = 100)]
    pub limit: Option<u32>,
    /// The `next_cursor` of the page before.
    pub starting_after: Option<String>,
}

/// Read the tenant's policy (the built-in default, id null, until one is written or a first run creates it).
#[utoipa::path(
    get, path = "/v1/dunning/policy", tag = "dunning",
    responses((status = 200, body = Policy), ReadErrors),
)]
pub async fn get_policy(State(api): State<Api>, caller: Caller) -> Result<Response, ApiError> {
    let mut scope = Scope::begin(&api, &caller).await?;
    let row = scope
        .tx()
        .fetch_optional(db::sql(concat!(
            "SELECT ",
            policy_columns!(),
            " FROM dunning_policies WHERE tenant_id = api_tenant() AND is_default"
        )))
        .await?;
    let policy = match row {
        Some(r) => Policy::from_row(&r)?,
        None => Policy::built_in(),
    };
    scope.respond(StatusCode::OK, &policy).await
}

/// Write the tenant's policy: new runs get it; runs in flight keep theirs.
#[utoipa::path(
    put, path = "/v1/dunning/policy", tag = "dunning",
    params(("Idempotency-Key" = Option<String>, Header, description = "Retry safely: the same key and body return the first answer for 24 hours.")),
    request_body = NewPolicy,
    responses((status = 200, description = "Written.", body = Policy), WriteErrors),
)]
pub async fn put_policy(
    State(api): State<Api>,
    caller: Caller,
    idem: Idempotency,
    body: JsonBody<NewPolicy>,
) -> Result<Response, ApiError> {
    let p = &body.value;
    let name = p.name.clone().unwrap_or_else(|| "Default".to_owned());
    if name.is_empty() {
        return Err(ApiError::param("name", "name is empty"));
    }
    valid::text("name", &name, MAX_NAME_CHARS)?;
    dunning::check_schedule(&p.retry_offsets_secs, &p.warn_after).map_err(|e| {
        let code = match e {
            dunning::ScheduleInvalid::RetryCount(_) => Code::ParameterInvalid,
            _ => Code::ParameterOutOfRange,
        };
        ApiError::invalid(code, e.field(), e.to_string())
    })?;
    let final_action = dunning::FinalAction::from(p.final_action);
    let pause =
        dunning::PauseBehavior::from(p.pause_behavior.unwrap_or(PauseBehavior::KeepAsDraft));
    let mut scope = Scope::begin(&api, &caller).await?;
    if let Some(replay) = scope.idempotent(&idem, &body.raw).await? {
        return Ok(replay);
    }
    scope
        .tx()
        .execute(db::sql(
            "UPDATE dunning_policies SET is_default = false
             WHERE tenant_id = api_tenant() AND is_default",
        ))
        .await?;
    let row = scope
        .tx()
        .fetch_optional(
            db::sql(concat!(
                "INSERT INTO dunning_policies (tenant_id, name, retry_offsets_secs, final_action,
                     pause_behavior, warn_after, final_notice, is_default)
                 VALUES (api_tenant(), $1, $2, $3, $4, $5, $6, true)
                 ON CONFLICT (tenant_id) WHERE is_default DO NOTHING
                 RETURNING ",
                policy_columns!()
            ))
            .bind(name)
            .bind(p.retry_offsets_secs.clone())
            .bind(final_action.as_str())
            .bind(pause.as_str())
            .bind(p.warn_after.clone())
            .bind(p.final_notice.unwrap_or(true)),
        )
        .await?
        // A concurrent write (another request, or the first run's built-in
        // default) made the default first.
        .ok_or_else(|| {
            ApiError::conflict(
                Code::InvalidState,
                "the policy was written concurrently; read it and retry",
            )
        })?;
    let policy = Policy::from_row(&row)?;
    scope.respond(StatusCode::OK, &policy).await
}

/// Read a dunning run with its invoice's payment attempts.
#[utoipa::path(
    get, path = "/v1/dunning/runs/{id}", tag = "dunning",
    params(("id" = i64, Path, description = "The run's id.", minimum = 1)),
    responses((status = 200, body = Run), ReadErrors),
)]
pub async fn get_run(
    State(api): State<Api>,
    caller: Caller,
    Id(id): Id,
) -> Result<Response, ApiError> {
    let mut scope = Scope::begin(&api, &caller).await?;
    let row = scope
        .tx()
        .fetch_optional(
            db::sql(concat!(
                "SELECT ",
                run_columns!(),
                " FROM dunning_runs WHERE tenant_id = api_tenant() AND id = $1"
            ))
            .bind(id),
        )
        .await?
        .ok_or_else(|| ApiError::missing("dunning run", id))?;
    let mut run = Run::from_row(&row)?;
    run.attempts = Some(attempts(&mut scope, run.invoice).await?);
    scope.respond(StatusCode::OK, &run).await
}

/// List dunning runs, newest first.
#[utoipa::path(
    get, path = "/v1/dunning/runs", tag = "dunning",
    params(ListRuns),
    responses((status = 200, body = List<Run>), ReadErrors),
)]
pub async fn list_runs(
    State(api): State<Api>,
    caller: Caller,
    Query(q): Query<ListRuns>,
) -> Result<Response, ApiError> {
    let page = Page::new(q.limit, q.starting_after.as_deref())?;
    let mut scope = Scope::begin(&api, &caller).await?;
    let rows = scope
        .tx()
        .fetch_all(
            db::sql(concat!(
                "SELECT ",
                run_columns!(),
                " FROM dunning_runs
                 WHERE tenant_id = api_tenant() AND ($1::bigint IS NULL OR id < $1)
                 ORDER BY id DESC LIMIT $2"
            ))
            .bind(page.before)
            .bind(page.fetch()),
        )
        .await?;
    let list = page.rows(&rows, Run::from_row, |r| r.id)?;
    scope.respond(StatusCode::OK, &list).await
}
