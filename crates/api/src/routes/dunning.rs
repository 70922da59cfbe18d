//! Dunning: the tenant's retry policy (read it; write a new one, which new
//! runs get while runs in flight keep their schedule) with its business
//! window (which every run of the tenant follows from the next listing on,
//! docs/adr/0045), and its runs, each with the payment attempts of its
//! invoice. The dunning role writes the runs.

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

/// A business window to write: the local hours and weekdays in which the
/// tenant's dunning runs are retried, warned and ended. A run due outside it
/// waits for its opening.
#[derive(Debug, Deserialize, ToSchema)]
#[serde(deny_unknown_fields)]
pub struct NewBusinessWindow {
    /// An IANA time zone name, such as `Europe/Berlin`; local times follow
    /// its daylight-saving rules.
    #[schema(example = "Europe/Berlin")]
    pub time_zone: String,
    /// The local time it opens, `HH:MM` or `HH:MM:SS`, before `24:00`.
    #[schema(example = "09:00")]
    pub opens: String,
    /// The local time it closes (not included), `HH:MM` or `HH:MM:SS`, up to
    /// `24:00`; earlier than `opens` closes the next day (`22:00` to `06:00`).
    #[schema(example = "17:00")]
    pub closes: String,
    /// ISO weekdays on which it opens, 1 (Monday) to 7 (Sunday), each once;
    /// default all seven.
    #[schema(min_items = 1, max_items = 7, example = json!([1, 2, 3, 4, 5]))]
    pub weekdays: Option<Vec<i32>>,
}

/// A policy's business window.
#[derive(Debug, Serialize, ToSchema)]
pub struct BusinessWindow {
    pub time_zone: String,
    /// `HH:MM`, or `HH:MM:SS` when the seconds are not zero.
    pub opens: String,
    /// `HH:MM` (`24:00` for the end of the day), or `HH:MM:SS`.
    pub closes: String,
    pub weekdays: Vec<i32>,
}

/// The tenant's policy to write.
#[derive(Debug, Deserialize, ToSchema)]
#[serde(deny_unknown_fields)]
pub struct NewPolicy {
    /// Default `Default`.
    #[schema(min_length = 1, max_length = 200)]
    pub name: Option<String>,
    /// Retry n is due `retry_offsets_secs[n - 1]` seconds after the first
    /// decline, and never sooner after retry n - 1 than the gap between
    /// their offsets: a retry made late (collection paused, a business
    /// window shut) moves the rest on. 1 to 20 retries, each 1 s to 366 days
    /// and later than the one before.
    #[schema(min_items = 1, max_items = 20)]
    pub retry_offsets_secs: Vec<i64>,
    pub final_action: FinalAction,
    /// What `pause_collection` writes; default `keep_as_draft`.
    pub pause_behavior: Option<PauseBehavior>,
    /// Retries (1-based) whose decline sends the customer a warning email,
    /// each at most once; default none.
    #[serde(default)]
    #[schema(max_items = 20)]
    pub warn_after: Vec<i32>,
    /// Whether exhaustion sends a final notice; default true.
    pub final_notice: Option<bool>,
    /// When the tenant's runs may go out; default none (any time). Every run
    /// of the tenant follows the window of its latest policy, including runs
    /// already scheduled.
    pub business_window: Option<NewBusinessWindow>,
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
    /// Null when the runs may go out any time.
    pub business_window: Option<BusinessWindow>,
    pub created_at: Option<DateTime<Utc>>,
}

macro_rules! policy_columns {
    () => {
        "id, name, retry_offsets_secs, final_action, pause_behavior, warn_after, final_notice, \
         window_time_zone, extract(epoch FROM window_opens)::integer AS window_opens_secs, \
         extract(epoch FROM window_closes)::integer AS window_closes_secs, window_weekdays, \
         created_at"
    };
}

/// A stored time of day as the API shows it: migration 0035's columns are
/// `time`s, whose seconds are 0 to 86,400 (`24:00`), and all four are set
/// together, so neither the clamp nor the default ever applies.
fn local_time(secs: Option<i32>) -> String {
    let secs = u32::try_from(secs.unwrap_or(0).clamp(0, 86_400)).unwrap_or(0);
    dunning::LocalTime::from_secs(secs)
        .unwrap_or(dunning::LocalTime::END_OF_DAY)
        .to_string()
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
            business_window: match row.try_get::<Option<String>, _>("window_time_zone")? {
                None => None,
                Some(time_zone) => Some(BusinessWindow {
                    time_zone,
                    opens: local_time(row.try_get("window_opens_secs")?),
                    closes: local_time(row.try_get("window_closes_secs")?),
                    weekdays: row
                        .try_get::<Option<Vec<i32>>, _>("window_weekdays")?
                        .unwrap_or_default(),
                }),
            },
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
            business_window: None,
            created_at: None,
        }
    }
}

/// The window as written, checked by dunning's rules, each refusal a 400
/// naming its field under `business_window`.
fn check_window(w: &NewBusinessWindow) -> Result<dunning::BusinessWindow, ApiError> {
    let days = w.weekdays.as_deref().unwrap_or(&dunning::window::EVERY_DAY);
    dunning::check_window(&w.time_zone, &w.opens, &w.closes, days).map_err(|e| {
        let code = if e.out_of_range() {
            Code::ParameterOutOfRange
        } else {
            Code::ParameterInvalid
        };
        ApiError::invalid(
            code,
            format!("business_window.{}", e.field()),
            e.to_string(),
        )
    })
}

#[derive(Debug, Serialize, ToSchema)]
pub struct Run {
    pub id: i64,
    pub invoice: i64,
    pub policy: i64,
    /// `active`, `recovered`, `exhausted` or `stopped`. An `exhausted` run
    /// whose final action was still owed becomes `recovered` if its invoice
    /// is paid first (`dunning.recovered`).
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
    /// `GET /v1/dunning/runs/{id}` (never `null`: absent from lists).
    #[serde(skip_serializing_if = "Option::is_none")]
    #[schema(nullable = false)]
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
    get, path = "/v1/dunning/policy", tag = "dunning", operation_id = "get_dunning_policy",
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
    put, path = "/v1/dunning/policy", tag = "dunning", operation_id = "put_dunning_policy",
    params(("Idempotency-Key" = Option<String>, Header, min_length = 1, max_length = 255, pattern = r"^[\x21-\x7E]+$", nullable = false, description = "Retry safely: the same key and body return the first answer for 24 hours.")),
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
            dunning::ScheduleInvalid::RetryCount(_)
            | dunning::ScheduleInvalid::NotLater { .. }
            | dunning::ScheduleInvalid::WarnAfterRepeated { .. } => Code::ParameterInvalid,
            _ => Code::ParameterOutOfRange,
        };
        ApiError::invalid(code, e.field(), e.to_string())
    })?;
    let final_action = dunning::FinalAction::from(p.final_action);
    let pause =
        dunning::PauseBehavior::from(p.pause_behavior.unwrap_or(PauseBehavior::KeepAsDraft));
    let window = p.business_window.as_ref().map(check_window).transpose()?;
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
                     pause_behavior, warn_after, final_notice, is_default, window_time_zone,
                     window_opens, window_closes, window_weekdays)
                 VALUES (api_tenant(), $1, $2, $3, $4, $5, $6, true, $7, $8::time, $9::time, $10)
                 ON CONFLICT (tenant_id) WHERE is_default DO NOTHING
                 RETURNING ",
                policy_columns!()
            ))
            .bind(name)
            .bind(p.retry_offsets_secs.clone())
            .bind(final_action.as_str())
            .bind(pause.as_str())
            .bind(p.warn_after.clone())
            .bind(p.final_notice.unwrap_or(true))
            .bind(window.as_ref().map(|w| w.time_zone.clone()))
            .bind(window.as_ref().map(|w| w.opens.to_sql()))
            .bind(window.as_ref().map(|w| w.closes.to_sql()))
            .bind(window.as_ref().map(|w| w.weekdays.clone())),
        )
        .await
        .map_err(|e| zone_unknown_to_the_database(e, window.as_ref()))?
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

/// An IANA zone chrono-tz knows but the database's zone data does not (older
/// than chrono-tz's): migration 0035's CHECK raises 22023. The caller's 400,
/// naming the field; any other error as the database's.
fn zone_unknown_to_the_database(e: db::Error, w: Option<&dunning::BusinessWindow>) -> ApiError {
    match w {
        Some(w) if e.code().as_deref() == Some("22023") => ApiError::param(
            "business_window.time_zone",
            format!("the database does not know the time zone {:?}", w.time_zone),
        ),
        _ => ApiError::from_db(&e),
    }
}

/// Read a dunning run with its invoice's payment attempts.
#[utoipa::path(
    get, path = "/v1/dunning/runs/{id}", tag = "dunning", operation_id = "get_dunning_run",
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
    get, path = "/v1/dunning/runs", tag = "dunning", operation_id = "list_dunning_runs",
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
