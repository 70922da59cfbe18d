//! Invoices (read only: billing writes them): read one with its payment
//! attempts, list them, optionally one subscription's.

use axum::extract::State;
use axum::http::StatusCode;
use axum::response::Response;
use chrono::{DateTime, Utc};
use db::{PgRow, Row as _};
use serde::{Deserialize, Serialize};
use utoipa::{IntoParams, ToSchema};

use crate::auth::Caller;
use crate::error::ApiError;
use crate::extract::{Id, Query};
use crate::page::{List, Page};
use crate::responses::ReadErrors;
use crate::scope::Scope;
use crate::state::Api;

#[derive(Debug, Serialize, ToSchema)]
pub struct PaymentAttempt {
    pub id: i64,
    /// 1 for the first charge, then each retry.
    pub attempt: i32,
    pub amount: i64,
    pub currency: String,
    /// `succeeded` or `declined`; `unknown` until the answer (or the
    /// reconciler) settles it; `processing` while the provider settles it
    /// (a bank debit); `needs_review` while an operator decides an answer
    /// that cannot be relied on; `failed` when the provider refused the
    /// request before executing it, or an operator settled it as not
    /// charged for this invoice.
    pub status: String,
    pub decline_code: Option<String>,
    pub payment_intent: Option<String>,
    pub created_at: DateTime<Utc>,
    pub resolved_at: Option<DateTime<Utc>>,
}

impl PaymentAttempt {
    fn from_row(row: &PgRow) -> Result<PaymentAttempt, db::Error> {
        Ok(PaymentAttempt {
            id: row.try_get("id")?,
            attempt: row.try_get("attempt_seq")?,
            amount: row.try_get("amount")?,
            currency: row.try_get("currency")?,
            status: row.try_get("provider_status")?,
            decline_code: row.try_get("decline_code")?,
            payment_intent: row.try_get("provider_payment_intent")?,
            created_at: row.try_get("created_at")?,
            resolved_at: row.try_get("resolved_at")?,
        })
    }
}

#[derive(Debug, Serialize, ToSchema)]
pub struct Invoice {
    pub id: i64,
    pub subscription: i64,
    /// `PREFIX-000123`; null for a draft.
    pub number: Option<String>,
    /// `draft`, `open`, `paid`, `uncollectible` or `void`.
    pub status: String,
    /// What is due, in minor units (the balance taken in included).
    pub amount: i64,
    pub currency: String,
    pub period_start: DateTime<Utc>,
    pub period_end: DateTime<Utc>,
    pub collection_method: String,
    /// `period`, `plan_change` or `cancel`.
    pub reason: String,
    pub balance_applied: i64,
    pub carried_to_balance: i64,
    pub finalized_at: Option<DateTime<Utc>>,
    pub paid_at: Option<DateTime<Utc>>,
    pub closed_at: Option<DateTime<Utc>>,
    pub created_at: DateTime<Utc>,
    /// Oldest first; only on `GET /v1/invoices/{id}` (never `null`: absent
    /// from lists).
    #[serde(skip_serializing_if = "Option::is_none")]
    #[schema(nullable = false)]
    pub payment_attempts: Option<Vec<PaymentAttempt>>,
}

macro_rules! columns {
    () => {
        "id, subscription_id, number, status, amount, currency, period_start, period_end, \
         collection_method, reason, balance_applied, carried_to_balance, finalized_at, \
         paid_at, closed_at, created_at"
    };
}

impl Invoice {
    fn from_row(row: &PgRow) -> Result<Invoice, db::Error> {
        Ok(Invoice {
            id: row.try_get("id")?,
            subscription: row.try_get("subscription_id")?,
            number: row.try_get("number")?,
            status: row.try_get("status")?,
            amount: row.try_get("amount")?,
            currency: row.try_get("currency")?,
            period_start: row.try_get("period_start")?,
            period_end: row.try_get("period_end")?,
            collection_method: row.try_get("collection_method")?,
            reason: row.try_get("reason")?,
            balance_applied: row.try_get("balance_applied")?,
            carried_to_balance: row.try_get("carried_to_balance")?,
            finalized_at: row.try_get("finalized_at")?,
            paid_at: row.try_get("paid_at")?,
            closed_at: row.try_get("closed_at")?,
            created_at: row.try_get("created_at")?,
            payment_attempts: None,
        })
    }
}

/// An invoice's payment attempts, oldest first, in `scope`.
pub(crate) async fn attempts(
    scope: &mut Scope,
    invoice: i64,
) -> Result<Vec<PaymentAttempt>, ApiError> {
    let rows = scope
        .tx()
        .fetch_all(
            db::sql(
                "SELECT id, attempt_seq, amount, currency, provider_status, decline_code,
                        provider_payment_intent, created_at, resolved_at
                 FROM payment_attempts WHERE tenant_id = api_tenant() AND invoice_id = $1
                 ORDER BY attempt_seq",
            )
            .bind(invoice),
        )
        .await?;
    Ok(rows
        .iter()
        .map(PaymentAttempt::from_row)
        .collect::<Result<Vec<_>, _>>()?)
}

#[derive(Debug, Deserialize, IntoParams)]
#[serde(deny_unknown_fields)]
#[into_params(parameter_in = Query)]
pub struct ListInvoices {
    /// Page size, 1 to 100 (default 20).
    #[param(minimum = 1, maximum = 100)]
    pub limit: Option<u32>,
    /// The `next_cursor` of the page before.
    pub starting_after: Option<String>,
    /// Only this subscription's invoices.
    #[param(minimum = 1)]
    pub subscription: Option<i64>,
}

/// Read an invoice with its payment attempts.
#[utoipa::path(
    get, path = "/v1/invoices/{id}", tag = "invoices", operation_id = "get_invoice",
    params(("id" = i64, Path, description = "The invoice's id.", minimum = 1)),
    responses((status = 200, body = Invoice), ReadErrors),
)]
pub async fn get(State(api): State<Api>, caller: Caller, Id(id): Id) -> Result<Response, ApiError> {
    let mut scope = Scope::begin(&api, &caller).await?;
    let row = scope
        .tx()
        .fetch_optional(
            db::sql(concat!(
                "SELECT ",
                columns!(),
                " FROM invoices WHERE tenant_id = api_tenant() AND id = $1"
            ))
            .bind(id),
        )
        .await?
        .ok_or_else(|| ApiError::missing("invoice", id))?;
    let mut invoice = Invoice::from_row(&row)?;
    invoice.payment_attempts = Some(attempts(&mut scope, id).await?);
    scope.respond(StatusCode::OK, &invoice).await
}

/// List invoices, newest first.
#[utoipa::path(
    get, path = "/v1/invoices", tag = "invoices", operation_id = "list_invoices",
    params(ListInvoices),
    responses((status = 200, body = List<Invoice>), ReadErrors),
)]
pub async fn list(
    State(api): State<Api>,
    caller: Caller,
    Query(q): Query<ListInvoices>,
) -> Result<Response, ApiError> {
    let page = Page::new(q.limit, q.starting_after.as_deref())?;
    if q.subscription.is_some_and(|id| id < 1) {
        return Err(ApiError::param(
            "subscription",
            "subscription is a positive id",
        ));
    }
    let mut scope = Scope::begin(&api, &caller).await?;
    let rows = scope
        .tx()
        .fetch_all(
            db::sql(concat!(
                "SELECT ",
                columns!(),
                " FROM invoices
                 WHERE tenant_id = api_tenant() AND ($1::bigint IS NULL OR id < $1)
                   AND ($2::bigint IS NULL OR subscription_id = $2)
                 ORDER BY id DESC LIMIT $3"
            ))
            .bind(page.before)
            .bind(q.subscription)
            .bind(page.fetch()),
        )
        .await?;
    let list = page.rows(&rows, Invoice::from_row, |i| i.id)?;
    scope.respond(StatusCode::OK, &list).await
}
