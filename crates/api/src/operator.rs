//! The operator API (docs/adr/0042): what `hardcount leader …`, `tenants …`,
//! `keys …` and `billing review|settle` do, over HTTP, for people and tools
//! that do not run the CLI. Served beside the tenant API under
//! `/operator/v1`, on its own bearer token (`HARDCOUNT_OPERATOR_TOKEN`), over
//! the operator role's pool (`hardcount_operator`, which works across
//! tenants). Answers use the tenant API's error shape.
//!
//! ```text
//! GET  /operator/v1/leaders                       leader_status
//! GET  /operator/v1/leaders/history?role=&limit=  the lease history
//! POST /operator/v1/leaders/{role}/pause          {"reason", "by"}
//! POST /operator/v1/leaders/{role}/unpause
//! POST /operator/v1/leaders/{role}/clear-cooldown
//! GET  /operator/v1/tenants                       POST {"id", "name", "contact_email"}
//! GET  /operator/v1/tenants/{id}/settings         PATCH {"invoice_prefix", "invoice_on_cancel", "email_from", "payment_page_url"}
//! GET  /operator/v1/keys?tenant=                  POST {"tenant_id", "name"}: the key, once
//! POST /operator/v1/keys/{prefix}/revoke
//! GET  /operator/v1/payment-attempts/needs-review
//! POST /operator/v1/payment-attempts/{id}/settle  {"outcome": "paid"|"failed", "by", "note", "payment_intent"}
//! POST /operator/v1/deliveries/replay             {"since", "tenant_id", "endpoint_id", "limit"}
//! ```

use axum::Router;
use axum::extract::{FromRequestParts, Path, State};
use axum::http::request::Parts;
use axum::http::{StatusCode, header};
use axum::response::{IntoResponse, Response};
use axum::routing::{get, post};
use chrono::{DateTime, Utc};
use db::{Db, Row as _};
use leader::Role;
use serde::{Deserialize, Serialize};
use serde_json::json;
use sha2::{Digest as _, Sha256};

use crate::error::{ApiError, Code};
use crate::extract::{Id, JsonBody, Query};
use crate::keys::{self, KeysError};

/// The shortest operator token accepted: 32 characters (of a random
/// generator's output, say `openssl rand -hex 32`).
pub const MIN_TOKEN_CHARS: usize = 32;

/// The operator API's state: the operator role's pool and the token's hash.
#[derive(Clone)]
pub struct Operator {
    db: Db,
    token_hash: [u8; 32],
    /// The deployment's sender (`HARDCOUNT_EMAIL_FROM`), whose domain no
    /// tenant's sender may have (docs/adr/0151).
    platform_from: String,
}

impl std::fmt::Debug for Operator {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Operator").finish_non_exhaustive()
    }
}

impl Operator {
    /// `db` as `hardcount_operator`; `token` is what a caller presents as
    /// `Authorization: Bearer <token>` (only its hash is kept).
    ///
    /// # Errors
    /// A token shorter than [`MIN_TOKEN_CHARS`] (the message never shows it).
    pub fn new(db: Db, token: &str) -> Result<Operator, String> {
        if token.trim().chars().count() < MIN_TOKEN_CHARS {
            return Err(format!(
                "the operator token is too short: at least {MIN_TOKEN_CHARS} characters \
                 (make one with `openssl rand -hex 32`)"
            ));
        }
        Ok(Operator {
            db,
            token_hash: Sha256::digest(token.trim().as_bytes()).into(),
            platform_from: billing::BillingConfig::default().email_from,
        })
    }

    /// The deployment's sender, as `HARDCOUNT_EMAIL_FROM` sets it (the
    /// default's until then).
    #[must_use]
    pub fn with_platform_sender(mut self, from: &str) -> Operator {
        from.clone_into(&mut self.platform_from);
        self
    }
}

/// The largest operator request body: every body is a few small fields.
pub const MAX_BODY_BYTES: usize = 64 * 1024;

/// Operator requests served at once, the rest waiting: one per connection of
/// the operator role's pool (`hardcount serve` opens this many).
pub const MAX_CONCURRENT: usize = 4;

/// How long an operator request may run before it is answered 503. A replay
/// of its largest limit is well inside it.
pub const REQUEST_TIMEOUT: std::time::Duration = std::time::Duration::from_secs(30);

/// The operator routes, to merge beside [`crate::router`]'s. They carry
/// limits of their own (a router's layers do not reach routes merged into it
/// later): the body limit, a timeout and a concurrency cap, with the limit
/// layers' empty answers given the one error shape.
pub fn router(op: Operator) -> Router {
    let routes = Router::new()
        .route("/operator/v1/leaders", get(leaders))
        .route("/operator/v1/leaders/history", get(history))
        .route("/operator/v1/leaders/{role}/pause", post(pause))
        .route("/operator/v1/leaders/{role}/unpause", post(unpause))
        .route(
            "/operator/v1/leaders/{role}/clear-cooldown",
            post(clear_cooldown),
        )
        .route("/operator/v1/tenants", get(tenants).post(create_tenant))
        .route(
            "/operator/v1/tenants/{id}/settings",
            get(tenant_settings).patch(set_tenant_settings),
        )
        .route("/operator/v1/keys", get(list_keys).post(create_key))
        .route("/operator/v1/keys/{prefix}/revoke", post(revoke_key))
        .route(
            "/operator/v1/payment-attempts/needs-review",
            get(needs_review),
        )
        .route("/operator/v1/payment-attempts/{id}/settle", post(settle))
        .route("/operator/v1/deliveries/replay", post(replay))
        .with_state(op);
    crate::with_limits(
        routes,
        crate::Limits {
            body: MAX_BODY_BYTES,
            timeout: REQUEST_TIMEOUT,
            concurrent: MAX_CONCURRENT,
            timed_out: ApiError::operator_timeout,
        },
    )
}

/// A caller that presented the operator token.
pub struct OperatorCaller;

impl FromRequestParts<Operator> for OperatorCaller {
    type Rejection = ApiError;

    async fn from_request_parts(parts: &mut Parts, op: &Operator) -> Result<Self, ApiError> {
        let presented = parts
            .headers
            .get(header::AUTHORIZATION)
            .and_then(|v| v.to_str().ok())
            .and_then(crate::auth::bearer)
            .map(|t| Sha256::digest(t.trim().as_bytes()));
        match presented {
            // Both sides are hashes, compared whole: no early exit on the
            // token's text.
            Some(h)
                if h.iter()
                    .zip(op.token_hash)
                    .fold(0u8, |acc, (a, b)| acc | (a ^ b))
                    == 0 =>
            {
                Ok(OperatorCaller)
            }
            _ => Err(ApiError::unauthorized()),
        }
    }
}

fn ok<T: Serialize>(status: StatusCode, body: &T) -> Response {
    (status, axum::Json(body)).into_response()
}

fn role(name: &str) -> Result<Role, ApiError> {
    name.parse::<Role>()
        .map_err(|_| ApiError::missing("role", name))
}

fn store_error(e: leader::store::StoreError) -> ApiError {
    match e {
        leader::store::StoreError::Db(e) => ApiError::from_db(&e),
        other => {
            tracing::error!(error = %other, "operator API: lease store");
            ApiError::internal()
        }
    }
}

fn keys_error(e: KeysError) -> ApiError {
    match e {
        KeysError::BadTenantId(_) => ApiError::param("id", e.to_string()),
        KeysError::TenantExists(_) => ApiError::conflict(Code::AlreadyExists, e.to_string()),
        KeysError::NoTenant(id) => ApiError::missing("tenant", id),
        KeysError::NoKey(prefix) => ApiError::missing("API key", prefix),
        KeysError::BadContactEmail(_) => ApiError::param("contact_email", e.to_string()),
        KeysError::Invalid(m) => ApiError::invalid(Code::ParameterInvalid, "body", m),
        KeysError::BadSetting { param, message } => {
            ApiError::invalid(Code::ParameterInvalid, param, message)
        }
        KeysError::Db(e) => ApiError::from_db(&e),
    }
}

/// A definer function's refusal (RAISE): 404 for `what` that does not
/// exist, 409 with the function's own words for a state it refuses (a plain
/// RAISE, or `object_not_in_prerequisite_state`: a second settle, an invoice
/// not open, an intent that pays another attempt), 400 with them for a value
/// it refuses (`invalid_parameter_value`). Those were a 500 and a 400 that
/// named neither (docs/adr/0106).
fn refusal(what: &'static str, id: i64) -> impl Fn(db::Error) -> ApiError {
    move |e| match (e.code().as_deref(), e.server_message()) {
        (Some("P0002"), _) => ApiError::missing(what, id),
        (Some("P0001" | "55000"), Some(m)) => ApiError::conflict(Code::InvalidState, m.to_owned()),
        (Some("22023"), Some(m)) => ApiError::invalid(Code::ParameterInvalid, "body", m),
        _ => ApiError::from_db(&e),
    }
}

async fn leaders(State(op): State<Operator>, _: OperatorCaller) -> Result<Response, ApiError> {
    let rows = leader::store::status(&op.db).await.map_err(store_error)?;
    Ok(ok(StatusCode::OK, &json!({ "data": rows })))
}

#[derive(Deserialize)]
#[serde(deny_unknown_fields)]
struct HistoryQuery {
    role: Option<String>,
    limit: Option<u32>,
}

async fn history(
    State(op): State<Operator>,
    _: OperatorCaller,
    Query(q): Query<HistoryQuery>,
) -> Result<Response, ApiError> {
    let role = q.role.as_deref().map(role).transpose()?;
    let limit = q.limit.unwrap_or(50);
    if !(1..=1000).contains(&limit) {
        return Err(ApiError::out_of_range("limit", "limit is 1 to 1000"));
    }
    let rows = leader::store::history(&op.db, role, limit)
        .await
        .map_err(store_error)?;
    Ok(ok(StatusCode::OK, &json!({ "data": rows })))
}

#[derive(Deserialize)]
#[serde(deny_unknown_fields)]
struct PauseBody {
    reason: String,
    by: String,
}

async fn pause(
    State(op): State<Operator>,
    _: OperatorCaller,
    Path(name): Path<String>,
    body: JsonBody<PauseBody>,
) -> Result<Response, ApiError> {
    let role = role(&name)?;
    let PauseBody { reason, by } = &body.value;
    // The bounds of `leader_leases` (migration 0007) and the CLI's.
    for (field, value, most) in [("reason", reason, 500), ("by", by, 200)] {
        if value.trim().is_empty() || value.chars().count() > most {
            return Err(ApiError::param(
                field,
                format!("{field} is 1 to {most} characters"),
            ));
        }
    }
    leader::store::pause(&op.db, role, by, reason)
        .await
        .map_err(store_error)?;
    leaders_one(&op, role).await
}

async fn unpause(
    State(op): State<Operator>,
    _: OperatorCaller,
    Path(name): Path<String>,
) -> Result<Response, ApiError> {
    let role = role(&name)?;
    leader::store::unpause(&op.db, role)
        .await
        .map_err(store_error)?;
    leaders_one(&op, role).await
}

async fn clear_cooldown(
    State(op): State<Operator>,
    _: OperatorCaller,
    Path(name): Path<String>,
) -> Result<Response, ApiError> {
    let role = role(&name)?;
    let cleared = leader::store::clear_cooldown(&op.db, role)
        .await
        .map_err(store_error)?;
    Ok(ok(
        StatusCode::OK,
        &json!({
            "role": role.as_str(),
            "cooldown_left_seconds": cleared.left.map(|d| d.as_secs_f64()),
            "paused": cleared.paused,
        }),
    ))
}

async fn leaders_one(op: &Operator, role: Role) -> Result<Response, ApiError> {
    let rows = leader::store::status(&op.db).await.map_err(store_error)?;
    let row = rows
        .into_iter()
        .find(|r| r.role == role.as_str())
        .ok_or_else(ApiError::internal)?;
    Ok(ok(StatusCode::OK, &row))
}

#[derive(Serialize)]
struct TenantOut {
    id: String,
    name: String,
    contact_email: Option<String>,
    created_at: DateTime<Utc>,
}

async fn tenants(State(op): State<Operator>, _: OperatorCaller) -> Result<Response, ApiError> {
    let rows = keys::list_tenants(&op.db).await.map_err(keys_error)?;
    let data: Vec<TenantOut> = rows
        .into_iter()
        .map(|t| TenantOut {
            id: t.id,
            name: t.name,
            contact_email: t.contact_email,
            created_at: t.created_at,
        })
        .collect();
    Ok(ok(StatusCode::OK, &json!({ "data": data })))
}

#[derive(Deserialize)]
#[serde(deny_unknown_fields)]
struct NewTenant {
    id: String,
    name: String,
    contact_email: Option<String>,
}

async fn create_tenant(
    State(op): State<Operator>,
    _: OperatorCaller,
    body: JsonBody<NewTenant>,
) -> Result<Response, ApiError> {
    let NewTenant {
        id,
        name,
        contact_email,
    } = &body.value;
    let t = keys::create_tenant(&op.db, id, name, contact_email.as_deref())
        .await
        .map_err(keys_error)?;
    Ok(ok(
        StatusCode::CREATED,
        &TenantOut {
            id: t.id,
            name: t.name,
            contact_email: t.contact_email,
            created_at: t.created_at,
        },
    ))
}

#[derive(Serialize)]
struct SettingsOut {
    tenant_id: String,
    invoice_prefix: String,
    invoice_on_cancel: bool,
    /// `null`: the deployment's `HARDCOUNT_EMAIL_FROM`.
    email_from: Option<String>,
    /// `null`: the emails link no payment page.
    payment_page_url: Option<String>,
    updated_at: Option<DateTime<Utc>>,
}

impl From<keys::TenantSettings> for SettingsOut {
    fn from(s: keys::TenantSettings) -> Self {
        SettingsOut {
            tenant_id: s.tenant_id,
            invoice_prefix: s.invoice_prefix,
            invoice_on_cancel: s.invoice_on_cancel,
            email_from: s.email_from,
            payment_page_url: s.payment_page_url,
            updated_at: s.updated_at,
        }
    }
}

async fn tenant_settings(
    State(op): State<Operator>,
    _: OperatorCaller,
    Path(id): Path<String>,
) -> Result<Response, ApiError> {
    let s = keys::tenant_settings(&op.db, &id)
        .await
        .map_err(keys_error)?;
    Ok(ok(StatusCode::OK, &SettingsOut::from(s)))
}

/// A settings change: a field left out is left as it is; `email_from: null`
/// goes back to the deployment's sender, `payment_page_url: null` to no
/// payment page.
#[derive(Deserialize)]
#[serde(deny_unknown_fields)]
struct SettingsPatch {
    invoice_prefix: Option<String>,
    invoice_on_cancel: Option<bool>,
    #[serde(default, deserialize_with = "crate::routes::customers::given")]
    email_from: Option<Option<String>>,
    #[serde(default, deserialize_with = "crate::routes::customers::given")]
    payment_page_url: Option<Option<String>>,
}

async fn set_tenant_settings(
    State(op): State<Operator>,
    _: OperatorCaller,
    Path(id): Path<String>,
    body: JsonBody<SettingsPatch>,
) -> Result<Response, ApiError> {
    let b = &body.value;
    let change = keys::SettingsChange {
        invoice_prefix: b.invoice_prefix.clone(),
        invoice_on_cancel: b.invoice_on_cancel,
        email_from: b.email_from.clone(),
        payment_page_url: b.payment_page_url.clone(),
    };
    let s = keys::set_tenant_settings(&op.db, &id, &change, &op.platform_from)
        .await
        .map_err(keys_error)?;
    Ok(ok(StatusCode::OK, &SettingsOut::from(s)))
}

#[derive(Serialize)]
struct KeyOut {
    id: i64,
    tenant_id: String,
    prefix: String,
    name: String,
    created_at: DateTime<Utc>,
    revoked_at: Option<DateTime<Utc>>,
    /// The key itself: only in the answer that made it.
    #[serde(skip_serializing_if = "Option::is_none")]
    key: Option<String>,
}

fn key_out(k: keys::KeyInfo, key: Option<String>) -> KeyOut {
    KeyOut {
        id: k.id,
        tenant_id: k.tenant_id,
        prefix: k.prefix,
        name: k.name,
        created_at: k.created_at,
        revoked_at: k.revoked_at,
        key,
    }
}

#[derive(Deserialize)]
#[serde(deny_unknown_fields)]
struct KeysQuery {
    tenant: Option<String>,
}

async fn list_keys(
    State(op): State<Operator>,
    _: OperatorCaller,
    Query(q): Query<KeysQuery>,
) -> Result<Response, ApiError> {
    let rows = keys::list_keys(&op.db, q.tenant.as_deref())
        .await
        .map_err(keys_error)?;
    let data: Vec<KeyOut> = rows.into_iter().map(|k| key_out(k, None)).collect();
    Ok(ok(StatusCode::OK, &json!({ "data": data })))
}

#[derive(Deserialize)]
#[serde(deny_unknown_fields)]
struct NewKeyBody {
    tenant_id: String,
    name: String,
}

async fn create_key(
    State(op): State<Operator>,
    _: OperatorCaller,
    body: JsonBody<NewKeyBody>,
) -> Result<Response, ApiError> {
    let made = keys::create_key(&op.db, &body.value.tenant_id, &body.value.name)
        .await
        .map_err(keys_error)?;
    Ok(ok(StatusCode::CREATED, &key_out(made.info, Some(made.key))))
}

async fn revoke_key(
    State(op): State<Operator>,
    _: OperatorCaller,
    Path(prefix): Path<String>,
) -> Result<Response, ApiError> {
    let k = keys::revoke_key(&op.db, &prefix)
        .await
        .map_err(keys_error)?;
    Ok(ok(StatusCode::OK, &key_out(k, None)))
}

async fn needs_review(State(op): State<Operator>, _: OperatorCaller) -> Result<Response, ApiError> {
    let rows = billing::review::needing_review(&op.db).await?;
    Ok(ok(StatusCode::OK, &json!({ "data": rows })))
}

#[derive(Deserialize)]
#[serde(deny_unknown_fields, rename_all = "snake_case")]
enum SettleOutcome {
    Paid,
    Failed,
}

#[derive(Deserialize)]
#[serde(deny_unknown_fields)]
struct SettleBody {
    outcome: SettleOutcome,
    by: String,
    note: String,
    payment_intent: Option<String>,
}

async fn settle(
    State(op): State<Operator>,
    _: OperatorCaller,
    Id(id): Id,
    body: JsonBody<SettleBody>,
) -> Result<Response, ApiError> {
    let b = &body.value;
    let how = match b.outcome {
        SettleOutcome::Paid => billing::review::Settlement::Paid,
        SettleOutcome::Failed => billing::review::Settlement::Failed,
    };
    let settled =
        billing::review::settle(&op.db, id, how, b.payment_intent.as_deref(), &b.by, &b.note)
            .await
            .map_err(refusal("payment attempt", id))?;
    Ok(ok(
        StatusCode::OK,
        &json!({ "attempt_id": id, "settled": settled }),
    ))
}

#[derive(Deserialize)]
#[serde(deny_unknown_fields)]
struct ReplayBody {
    since: DateTime<Utc>,
    tenant_id: Option<String>,
    endpoint_id: Option<i64>,
    limit: Option<i32>,
}

async fn replay(
    State(op): State<Operator>,
    _: OperatorCaller,
    body: JsonBody<ReplayBody>,
) -> Result<Response, ApiError> {
    let b = &body.value;
    let limit = b.limit.unwrap_or(10_000);
    if !(1..=100_000).contains(&limit) {
        return Err(ApiError::out_of_range("limit", "limit is 1 to 100000"));
    }
    let row = op
        .db
        .fetch_one(
            db::sql("SELECT operator_replay_deliveries($1, $2, $3, $4) AS n")
                .bind(b.since)
                .bind(b.tenant_id.clone())
                .bind(b.endpoint_id)
                .bind(limit),
        )
        .await
        .map_err(refusal("endpoint", b.endpoint_id.unwrap_or(0)))?;
    let n: i64 = row.try_get("n").map_err(db::Error::Sql)?;
    Ok(ok(
        StatusCode::OK,
        &json!({ "replayed": n, "limit": limit, "more_may_remain": n == i64::from(limit) }),
    ))
}
