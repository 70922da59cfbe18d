//! Customers: create one, read one, list them, update its email, name or
//! payment method, and give it its provider customer once (docs/adr/0149). The billing role charges a customer's saved payment
//! method off session; receipts and dunning notices go to its email.

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
use crate::scope::{Idempotency, Scope};
use crate::state::Api;
use crate::valid;

/// The longest name accepted, in characters.
pub const MAX_NAME_CHARS: usize = 200;
/// The longest email address accepted (RFC 5321's path limit).
pub const MAX_EMAIL_CHARS: usize = 320;

/// A customer to create.
#[derive(Debug, Deserialize, ToSchema)]
#[serde(deny_unknown_fields)]
pub struct NewCustomer {
    /// A bare address (`ada@example.org`), checked as the email outbox
    /// checks a recipient (`email_address_valid`, migration 0022).
    #[schema(max_length = 320)]
    pub email: String,
    #[schema(max_length = 200)]
    pub name: Option<String>,
    /// The saved payment method charged off session, e.g. `pm_card_visa`;
    /// needs `provider_customer_id`.
    #[schema(pattern = r"^pm_[A-Za-z0-9_]+$", max_length = 255)]
    pub payment_method: Option<String>,
    /// The provider's customer, e.g. `cus_123`; one customer of one tenant
    /// in the deployment (docs/adr/0103).
    #[schema(pattern = r"^cus_[A-Za-z0-9_]+$", max_length = 255)]
    pub provider_customer_id: Option<String>,
}

/// What to change; a field left out is unchanged. `name` and
/// `payment_method` given as `null` are removed; `email` cannot be.
#[derive(Debug, Deserialize, ToSchema)]
#[serde(deny_unknown_fields)]
pub struct CustomerUpdate {
    /// `null` is refused: every customer has an email, where its receipts
    /// and dunning notices go.
    #[serde(default, deserialize_with = "given")]
    #[schema(value_type = String, max_length = 320)]
    pub email: Option<Option<String>>,
    /// `null` removes the name.
    #[serde(default, deserialize_with = "given")]
    #[schema(value_type = Option<String>, max_length = 200)]
    pub name: Option<Option<String>>,
    /// Needs the customer's `provider_customer_id`. `null` removes the saved
    /// payment method: the customer's invoices then wait for a new one
    /// (billing asks the customer for one; dunning counts its retries "not
    /// attempted").
    #[serde(default, deserialize_with = "given")]
    #[schema(value_type = Option<String>, pattern = r"^pm_[A-Za-z0-9_]+$", max_length = 255)]
    pub payment_method: Option<Option<String>>,
    /// The provider's customer, e.g. `cus_123`, for a customer made without
    /// one (a payment method may come in the same call). Set once: a
    /// customer's charges are sent and looked up under it, so another value
    /// is refused (409) and the same one changes nothing; `null` is refused.
    /// One customer of one tenant in the deployment (docs/adr/0103, 0149).
    #[serde(default, deserialize_with = "given")]
    #[schema(value_type = String, pattern = r"^cus_[A-Za-z0-9_]+$", max_length = 255)]
    pub provider_customer_id: Option<Option<String>>,
}

/// A field given (`Some`), `null` included (`Some(None)`), as against left
/// out (`None`, through `#[serde(default)]`).
pub(crate) fn given<'de, D, T>(d: D) -> Result<Option<Option<T>>, D::Error>
where
    D: serde::Deserializer<'de>,
    T: Deserialize<'de>,
{
    Option::<T>::deserialize(d).map(Some)
}

#[derive(Debug, Serialize, ToSchema)]
pub struct Customer {
    pub id: i64,
    pub email: String,
    pub name: Option<String>,
    pub payment_method: Option<String>,
    pub provider_customer_id: Option<String>,
    pub created_at: DateTime<Utc>,
}

/// The columns [`Customer::from_row`] reads.
macro_rules! columns {
    () => {
        "id, email, name, payment_method_id, provider_customer_id, created_at"
    };
}

impl Customer {
    fn from_row(row: &PgRow) -> Result<Customer, db::Error> {
        Ok(Customer {
            id: row.try_get("id")?,
            email: row.try_get("email")?,
            name: row.try_get("name")?,
            payment_method: row.try_get("payment_method_id")?,
            provider_customer_id: row.try_get("provider_customer_id")?,
            created_at: row.try_get("created_at")?,
        })
    }
}

#[derive(Debug, Deserialize, IntoParams)]
#[serde(deny_unknown_fields)]
#[into_params(parameter_in = Query)]
pub struct ListCustomers {
    /// Page size, 1 to 100 (default 20).
    #[param(minimum = 1, maximum = 100)]
    pub limit: Option<u32>,
    /// The `next_cursor` of the page before.
    pub starting_after: Option<String>,
}

/// `email` as the outbox takes a recipient: no NUL, CR or LF, within the
/// length, and accepted by `email_address_valid` (the CHECK
/// `customers_email_valid` calls it), asked in the request's transaction.
async fn check_email(scope: &mut Scope, email: &str) -> Result<(), ApiError> {
    valid::text("email", email, MAX_EMAIL_CHARS)?;
    if outbox::email::mailbox("email", email).is_err() {
        return Err(ApiError::param(
            "email",
            "email is not an address the email outbox can send to",
        ));
    }
    let row = scope
        .tx()
        .fetch_one(db::sql("SELECT email_address_valid($1) AS ok").bind(email.to_owned()))
        .await?;
    let ok: Option<bool> = row.try_get("ok").map_err(db::Error::from)?;
    if ok != Some(true) {
        return Err(ApiError::param(
            "email",
            "email is not a bare address the email outbox can send to (e.g. ada@example.org)",
        ));
    }
    Ok(())
}

fn check_name(name: &Option<String>) -> Result<(), ApiError> {
    match name {
        Some(n) => valid::text("name", n, MAX_NAME_CHARS),
        None => Ok(()),
    }
}

/// Create a customer.
#[utoipa::path(
    post, path = "/v1/customers", tag = "customers", operation_id = "create_customer",
    params(("Idempotency-Key" = Option<String>, Header, min_length = 1, max_length = 255, pattern = r"^[\x21-\x7E]+$", nullable = false, description = "Retry safely: the same key and body return the first answer for 24 hours.")),
    request_body = NewCustomer,
    responses((status = 201, description = "Created.", body = Customer), WriteErrors),
)]
pub async fn create(
    State(api): State<Api>,
    caller: Caller,
    idem: Idempotency,
    body: JsonBody<NewCustomer>,
) -> Result<Response, ApiError> {
    let c = &body.value;
    check_name(&c.name)?;
    if let Some(pm) = &c.payment_method {
        valid::provider_id("payment_method", pm, "pm_")?;
        if c.provider_customer_id.is_none() {
            return Err(ApiError::param(
                "payment_method",
                "a payment method needs the provider's customer: send provider_customer_id too",
            ));
        }
    }
    if let Some(cus) = &c.provider_customer_id {
        valid::provider_id("provider_customer_id", cus, "cus_")?;
    }
    let mut scope = Scope::begin(&api, &caller).await?;
    if let Some(replay) = scope.idempotent(&idem, &body.raw).await? {
        return Ok(replay);
    }
    check_email(&mut scope, &c.email).await?;
    let row = scope
        .tx()
        .fetch_one(
            db::sql(concat!("INSERT INTO customers (tenant_id, email, name, payment_method_id, provider_customer_id)
                 VALUES (api_tenant(), $1, $2, $3, $4)
                 RETURNING ", columns!(), ""))
            .bind(c.email.clone())
            .bind(c.name.clone())
            .bind(c.payment_method.clone())
            .bind(c.provider_customer_id.clone()),
        )
        .await
        .map_err(|e| provider_customer_taken(&e))?;
    let customer = Customer::from_row(&row)?;
    scope.respond(StatusCode::CREATED, &customer).await
}

/// A write refused because another customer has its provider customer: the
/// same answer for a customer of another tenant (migration 0045), which
/// names neither it nor its tenant.
fn provider_customer_taken(e: &db::Error) -> ApiError {
    match e.constraint() {
        Some("customers_provider_customer_key" | "customers_provider_customer_of_one_tenant") => {
            ApiError::conflict(
                Code::AlreadyExists,
                "another customer has this provider_customer_id: a provider customer \
                 belongs to one customer",
            )
        }
        _ => ApiError::from_db(e),
    }
}

/// Update a customer's email, name, payment method or (once) provider customer.
#[utoipa::path(
    post, path = "/v1/customers/{id}", tag = "customers", operation_id = "update_customer",
    params(
        ("id" = i64, Path, description = "The customer's id.", minimum = 1),
        ("Idempotency-Key" = Option<String>, Header, min_length = 1, max_length = 255, pattern = r"^[\x21-\x7E]+$", nullable = false, description = "Retry safely: the same key and body return the first answer for 24 hours."),
    ),
    request_body = CustomerUpdate,
    responses((status = 200, description = "Updated.", body = Customer), WriteErrors),
)]
pub async fn update(
    State(api): State<Api>,
    caller: Caller,
    idem: Idempotency,
    Id(id): Id,
    body: JsonBody<CustomerUpdate>,
) -> Result<Response, ApiError> {
    let u = &body.value;
    if u.email == Some(None) {
        return Err(ApiError::param(
            "email",
            "email cannot be removed: every customer has one (its receipts and dunning notices go there); give the new address",
        ));
    }
    check_name(u.name.as_ref().unwrap_or(&None))?;
    if let Some(Some(pm)) = &u.payment_method {
        valid::provider_id("payment_method", pm, "pm_")?;
    }
    match &u.provider_customer_id {
        Some(Some(cus)) => valid::provider_id("provider_customer_id", cus, "cus_")?,
        Some(None) => {
            return Err(ApiError::param(
                "provider_customer_id",
                "provider_customer_id cannot be removed: it is set once, since the \
                 customer's charges are sent and looked up under it",
            ));
        }
        None => {}
    }
    let new_provider_customer = u.provider_customer_id.clone().flatten();
    let mut scope = Scope::begin(&api, &caller).await?;
    if let Some(replay) = scope.idempotent(&idem, &body.raw).await? {
        return Ok(replay);
    }
    if let Some(Some(email)) = &u.email {
        check_email(&mut scope, email).await?;
    }
    let current = scope
        .tx()
        .fetch_optional(
            db::sql(concat!(
                "SELECT ",
                columns!(),
                " FROM customers WHERE tenant_id = api_tenant() AND id = $1 FOR UPDATE"
            ))
            .bind(id),
        )
        .await?
        .ok_or_else(|| ApiError::missing("customer", id))?;
    let current = Customer::from_row(&current)?;
    if let (Some(now), Some(given)) = (&current.provider_customer_id, &new_provider_customer)
        && now != given
    {
        return Err(ApiError::conflict(
            Code::InvalidState,
            "this customer already has a provider_customer_id, which is set once: its charges \
             were sent and are looked up under it; make a new customer for another",
        ));
    }
    let customer_given = current.provider_customer_id.is_some() || new_provider_customer.is_some();
    if matches!(u.payment_method, Some(Some(_))) && !customer_given {
        return Err(ApiError::param(
            "payment_method",
            "this customer has no provider_customer_id, which a payment method needs: give it in the same call",
        ));
    }
    let row = scope
        .tx()
        .fetch_one(
            db::sql(concat!(
                "UPDATE customers SET email = COALESCE($2, email),
                        name = CASE WHEN $5 THEN $3 ELSE name END,
                        payment_method_id = CASE WHEN $6 THEN $4 ELSE payment_method_id END,
                        provider_customer_id = COALESCE(provider_customer_id, $7)
                 WHERE tenant_id = api_tenant() AND id = $1
                 RETURNING ",
                columns!(),
                ""
            ))
            .bind(id)
            .bind(u.email.clone().flatten())
            .bind(u.name.clone().flatten())
            .bind(u.payment_method.clone().flatten())
            .bind(u.name.is_some())
            .bind(u.payment_method.is_some())
            .bind(new_provider_customer),
        )
        .await
        .map_err(|e| provider_customer_taken(&e))?;
    let customer = Customer::from_row(&row)?;
    scope.respond(StatusCode::OK, &customer).await
}

/// Read a customer.
#[utoipa::path(
    get, path = "/v1/customers/{id}", tag = "customers", operation_id = "get_customer",
    params(("id" = i64, Path, description = "The customer's id.", minimum = 1)),
    responses((status = 200, body = Customer), ReadErrors),
)]
pub async fn get(State(api): State<Api>, caller: Caller, Id(id): Id) -> Result<Response, ApiError> {
    let mut scope = Scope::begin(&api, &caller).await?;
    let row = scope
        .tx()
        .fetch_optional(
            db::sql(concat!(
                "SELECT ",
                columns!(),
                " FROM customers WHERE tenant_id = api_tenant() AND id = $1"
            ))
            .bind(id),
        )
        .await?
        .ok_or_else(|| ApiError::missing("customer", id))?;
    let customer = Customer::from_row(&row)?;
    scope.respond(StatusCode::OK, &customer).await
}

/// List customers, newest first.
#[utoipa::path(
    get, path = "/v1/customers", tag = "customers", operation_id = "list_customers",
    params(ListCustomers),
    responses((status = 200, body = List<Customer>), ReadErrors),
)]
pub async fn list(
    State(api): State<Api>,
    caller: Caller,
    Query(q): Query<ListCustomers>,
) -> Result<Response, ApiError> {
    let page = Page::new(q.limit, q.starting_after.as_deref())?;
    let mut scope = Scope::begin(&api, &caller).await?;
    let rows = scope
        .tx()
        .fetch_all(
            db::sql(concat!(
                "SELECT ",
                columns!(),
                " FROM customers
                 WHERE tenant_id = api_tenant() AND ($1::bigint IS NULL OR id < $1)
                 ORDER BY id DESC LIMIT $2"
            ))
            .bind(page.before)
            .bind(page.fetch()),
        )
        .await?;
    let list = page.rows(&rows, Customer::from_row, |c| c.id)?;
    scope.respond(StatusCode::OK, &list).await
}
