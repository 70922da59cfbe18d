//! The lifecycle actions on a subscription (cancel, pause and resume
//! collection, change plan), each through billing's own producer in the
//! request's transaction; what they rely on from Stripe's model is in the
//! parent module's doc.

use axum::extract::State;
use axum::response::Response;
use billing::CancelAt;
use chrono::{DateTime, Utc};
use serde::Deserialize;
use utoipa::ToSchema;

use super::{IDEM, Subscription, answer, db_now, missing_ref, read};
use crate::auth::Caller;
use crate::error::{ApiError, Code};
use crate::extract::{Id, JsonBody, OptionalJsonBody};
use crate::responses::WriteErrors;
use crate::scope::{Idempotency, Scope};
use crate::state::Api;
use crate::valid;

/// `POST /v1/subscriptions/{id}/cancel`.
#[derive(Debug, Deserialize, ToSchema)]
#[serde(deny_unknown_fields)]
pub struct Cancel {
    /// End with the current period (billed in full) instead of now
    /// (default false: now, the used part invoiced pro rata).
    #[serde(default)]
    pub at_period_end: bool,
}

/// What happens to invoices made while collection is paused
/// (`subscriptions_pause_behavior_known`; Stripe's three values).
// Named apart from dunning's policy setting of the same values in the
// OpenAPI document (docs/adr/0153).
#[derive(Debug, Clone, Copy, Deserialize, ToSchema)]
#[serde(rename_all = "snake_case")]
#[schema(as = SubscriptionPauseBehavior)]
pub enum PauseBehavior {
    /// Kept as drafts: not finalized, announced or charged.
    KeepAsDraft,
    /// Finalized as uncollectible.
    MarkUncollectible,
    /// Finalized as void.
    Void,
}

impl PauseBehavior {
    fn as_str(self) -> &'static str {
        match self {
            PauseBehavior::KeepAsDraft => "keep_as_draft",
            PauseBehavior::MarkUncollectible => "mark_uncollectible",
            PauseBehavior::Void => "void",
        }
    }
}

/// `POST /v1/subscriptions/{id}/pause`.
#[derive(Debug, Deserialize, ToSchema)]
#[serde(deny_unknown_fields)]
pub struct Pause {
    pub behavior: PauseBehavior,
    /// Collection resumes by itself at this time (in the future); absent:
    /// until resumed.
    pub resumes_at: Option<DateTime<Utc>>,
}

/// `POST /v1/subscriptions/{id}/resume`: no field (the body may be left out).
#[derive(Debug, Deserialize, ToSchema)]
#[serde(deny_unknown_fields)]
pub struct Resume {}

/// `POST /v1/subscriptions/{id}/change_plan`.
#[derive(Debug, Deserialize, ToSchema)]
#[serde(deny_unknown_fields)]
pub struct ChangePlan {
    /// The new plan's id, in the subscription's currency.
    #[schema(minimum = 1)]
    pub plan: i64,
}

/// The subscription as the action starts: 404 when the tenant has none by
/// this id, 409 `invalid_state` when it is canceled.
async fn live(scope: &mut Scope, id: i64) -> Result<Subscription, ApiError> {
    let s = read(scope, id)
        .await?
        .ok_or_else(|| ApiError::missing("subscription", id))?;
    if s.status == "canceled" {
        return Err(ApiError::conflict(
            Code::InvalidState,
            "the subscription is canceled",
        ));
    }
    Ok(s)
}

/// Cancel a subscription now (the used part invoiced; a trialing one with
/// nothing invoiced) or, an active one, at its period's end.
#[utoipa::path(
    post, path = "/v1/subscriptions/{id}/cancel", tag = "subscriptions", operation_id = "cancel_subscription",
    params(
        ("id" = i64, Path, description = "The subscription's id.", minimum = 1),
        ("Idempotency-Key" = Option<String>, Header, min_length = 1, max_length = 255, pattern = r"^[\x21-\x7E]+$", nullable = false, description = IDEM),
    ),
    request_body(content = Option<Cancel>, description = "May be left out: cancel now."),
    responses((status = 200, description = "Canceled (or set to end with its period); announced with subscription.canceled or subscription.updated. A cancel at the period's end of a subscription already set to end is announced no more.", body = Subscription), WriteErrors),
)]
pub async fn cancel(
    State(api): State<Api>,
    caller: Caller,
    idem: Idempotency,
    Id(id): Id,
    OptionalJsonBody(body): OptionalJsonBody<Cancel>,
) -> Result<Response, ApiError> {
    let mut scope = Scope::begin(&api, &caller).await?;
    if let Some(replay) = scope.idempotent(&idem, &body.raw).await? {
        return Ok(replay);
    }
    let s = live(&mut scope, id).await?;
    let trialing = s.status == "trialing";
    if trialing && body.value.at_period_end {
        return Err(ApiError::invalid(
            Code::ParameterInvalid,
            "at_period_end",
            "a trialing subscription is canceled now (nothing is invoiced); at_period_end is for an active one",
        ));
    }
    if s.status != "active" && !trialing {
        return Err(ApiError::conflict(
            Code::InvalidState,
            format!(
                "only an active or trialing subscription is canceled; this one is {}",
                s.status
            ),
        ));
    }
    let at = if body.value.at_period_end {
        CancelAt::PeriodEnd
    } else {
        CancelAt::Now
    };
    let tenant = scope.tenant().to_owned();
    api.biller()
        .cancel_subscription_in(scope.tx(), &tenant, id, at)
        .await
        .map_err(valid::billing_error)?;
    answer(scope, id).await
}

/// Pause collection: invoices are still made, none is charged.
#[utoipa::path(
    post, path = "/v1/subscriptions/{id}/pause", tag = "subscriptions", operation_id = "pause_subscription",
    params(
        ("id" = i64, Path, description = "The subscription's id.", minimum = 1),
        ("Idempotency-Key" = Option<String>, Header, min_length = 1, max_length = 255, pattern = r"^[\x21-\x7E]+$", nullable = false, description = IDEM),
    ),
    request_body = Pause,
    responses((status = 200, description = "Paused; announced with subscription.collection_paused, unless the same pause (behavior and resumes_at) set through the API was already in force.", body = Subscription), WriteErrors),
)]
pub async fn pause(
    State(api): State<Api>,
    caller: Caller,
    idem: Idempotency,
    Id(id): Id,
    body: JsonBody<Pause>,
) -> Result<Response, ApiError> {
    let p = &body.value;
    if let Some(t) = p.resumes_at {
        valid::time_in_range("resumes_at", t)?;
    }
    let mut scope = Scope::begin(&api, &caller).await?;
    if let Some(replay) = scope.idempotent(&idem, &body.raw).await? {
        return Ok(replay);
    }
    live(&mut scope, id).await?;
    if let Some(t) = p.resumes_at
        && t <= db_now(&mut scope).await?
    {
        return Err(ApiError::out_of_range(
            "resumes_at",
            "resumes_at is in the future",
        ));
    }
    let tenant = scope.tenant().to_owned();
    api.biller()
        .pause_collection_in(scope.tx(), &tenant, id, p.behavior.as_str(), p.resumes_at)
        .await
        .map_err(valid::billing_error)?;
    answer(scope, id).await
}

/// Resume collection, of a canceled subscription too (its open invoices are
/// charged again); 409 `invalid_state` when it is not paused.
#[utoipa::path(
    post, path = "/v1/subscriptions/{id}/resume", tag = "subscriptions", operation_id = "resume_subscription",
    params(
        ("id" = i64, Path, description = "The subscription's id.", minimum = 1),
        ("Idempotency-Key" = Option<String>, Header, min_length = 1, max_length = 255, pattern = r"^[\x21-\x7E]+$", nullable = false, description = IDEM),
    ),
    request_body(content = Option<Resume>, description = "No field; may be left out."),
    responses((status = 200, description = "Resumed; announced with subscription.collection_resumed.", body = Subscription), WriteErrors),
)]
pub async fn resume(
    State(api): State<Api>,
    caller: Caller,
    idem: Idempotency,
    Id(id): Id,
    OptionalJsonBody(body): OptionalJsonBody<Resume>,
) -> Result<Response, ApiError> {
    let mut scope = Scope::begin(&api, &caller).await?;
    if let Some(replay) = scope.idempotent(&idem, &body.raw).await? {
        return Ok(replay);
    }
    // A canceled subscription too: its invoices made before the pause are
    // held while it stands, and only a resume lifts a pause without a resume
    // time (docs/adr/0110).
    read(&mut scope, id)
        .await?
        .ok_or_else(|| ApiError::missing("subscription", id))?;
    let tenant = scope.tenant().to_owned();
    api.biller()
        .resume_collection_in(scope.tx(), &tenant, id)
        .await
        .map_err(valid::billing_error)?;
    answer(scope, id).await
}

/// Change the plan now: the periods that ended and billing has not closed
/// yet are invoiced first, as billing would; the period holding now is cut
/// there, its used part invoiced pro rata on the old plan, and a new period
/// starts on the new plan (docs/adr/0088).
#[utoipa::path(
    post, path = "/v1/subscriptions/{id}/change_plan", tag = "subscriptions", operation_id = "change_subscription_plan",
    params(
        ("id" = i64, Path, description = "The subscription's id.", minimum = 1),
        ("Idempotency-Key" = Option<String>, Header, min_length = 1, max_length = 255, pattern = r"^[\x21-\x7E]+$", nullable = false, description = IDEM),
    ),
    request_body = ChangePlan,
    responses((status = 200, description = "Changed; announced with invoice.finalized (each period that had ended and billing had not yet invoiced, then the used part) and subscription.updated. 409 `subscription_period_moved` when billing moved the period meanwhile, or the subscription is further behind than one billing tick closes, or its last period, set to end it, has ended (nothing written), `currency_mismatch` for a plan in another currency.", body = Subscription), WriteErrors),
)]
pub async fn change_plan(
    State(api): State<Api>,
    caller: Caller,
    idem: Idempotency,
    Id(id): Id,
    body: JsonBody<ChangePlan>,
) -> Result<Response, ApiError> {
    let plan = body.value.plan;
    let mut scope = Scope::begin(&api, &caller).await?;
    if let Some(replay) = scope.idempotent(&idem, &body.raw).await? {
        return Ok(replay);
    }
    let s = live(&mut scope, id).await?;
    let exists = scope
        .tx()
        .fetch_optional(
            db::sql("SELECT 1 FROM plans WHERE tenant_id = api_tenant() AND id = $1").bind(plan),
        )
        .await?;
    if exists.is_none() {
        return Err(missing_ref("plan", "plan", plan));
    }
    if s.status != "active" {
        return Err(ApiError::conflict(
            Code::InvalidState,
            format!(
                "only an active subscription changes plan; this one is {}",
                s.status
            ),
        ));
    }
    if s.plan == plan {
        return Err(ApiError::conflict(
            Code::InvalidState,
            "the subscription is already on this plan",
        ));
    }
    let tenant = scope.tenant().to_owned();
    api.biller()
        .change_plan_in(scope.tx(), &tenant, id, plan)
        .await
        .map_err(valid::billing_error)?;
    answer(scope, id).await
}
