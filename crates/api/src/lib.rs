//! The tenant HTTP API: what producers in any language call to run billing,
//! webhooks and email through hardcount (docs/adr/0035).
//!
//! A producer, never a role: it writes rows and outbox rows in the caller's
//! transaction, exactly as the roles' own producers do, and the roles pick
//! them up. It holds no lease and fences nothing.
//!
//! ```text
//!  request ─▶ limits (body, timeout, concurrency) ─▶ Caller (key shape, rate limit)
//!    ─▶ Scope::begin: BEGIN; api_authenticate(sha256(key)) sets hardcount.tenant_id
//!       for this transaction ─▶ [POST: Idempotency-Key bound] ─▶ the route's SQL,
//!       every table filtered by row-level security to the caller's tenant
//!    ─▶ Scope::respond: answer recorded under the key, COMMIT
//! ```
//!
//! # Guarantees
//! - One error shape everywhere ([`error::ErrorBody`]), stable codes; a bad
//!   body, query or path names its field (`param`).
//! - A key that is missing, malformed, unknown or revoked: 401, one body.
//! - A tenant's key reads and writes only that tenant's rows, whatever a
//!   statement's own filter says: Postgres enforces it (migration 0024).
//! - A POST retried with the same `Idempotency-Key` and body within 24 hours
//!   returns the first answer and does nothing again; with another body, 409.
//! - Lists page by cursor, newest first; inserts while paging shift nothing
//!   (a row committed late with an id above the cursor, among the ids
//!   already passed, is not in that walk: `page`).

pub mod auth;
pub mod error;
mod extract;
pub mod keys;
mod limit;
pub mod operator;
mod page;
mod responses;
pub mod routes;
pub mod scope;
mod state;
mod valid;

use axum::Router;
use axum::body::Body;
use axum::http::{Response, StatusCode, header};
use axum::response::IntoResponse;
use tower::ServiceBuilder;
use tower::limit::GlobalConcurrencyLimitLayer;
use tower_http::limit::RequestBodyLimitLayer;
use tower_http::timeout::TimeoutLayer;
use utoipa::openapi::security::{HttpAuthScheme, HttpBuilder, SecurityScheme};
use utoipa::{Modify, OpenApi};
use utoipa_axum::router::OpenApiRouter;
use utoipa_axum::routes;

pub use error::{ApiError, Code, ErrorType};
pub use state::{Api, ApiConfig};

use crate::routes::{
    customers, deliveries, dunning, emails, endpoints, events, invoices, plans, subscriptions,
};

/// The largest request body accepted: an email's two bodies at their limit
/// and its headers fit.
pub const MAX_BODY_BYTES: usize = 1024 * 1024;

#[derive(OpenApi)]
#[openapi(
    info(
        title = "hardcount tenant API",
        description = "Billing, webhooks and email, run by hardcount. Every route but /openapi.json takes `Authorization: Bearer <API key>`.",
        version = "1"
    ),
    modifiers(&BearerAuth),
    security(("api_key" = [])),
    components(schemas(error::ErrorBody, error::ErrorDetail, error::ErrorType, error::Code)),
    tags(
        (name = "events", description = "Publish events; the webhook roles deliver them."),
        (name = "customers", description = "Who is billed: an email and a saved payment method."),
        (name = "plans", description = "What is billed: an amount every interval."),
        (name = "subscriptions", description = "A customer on a plan; billing closes its periods. Cancel, pause, resume, change plan."),
        (name = "invoices", description = "What billing invoiced, with its payment attempts."),
        (name = "dunning", description = "The retry policy and the runs that retry declined invoices."),
        (name = "webhook_endpoints", description = "Where events are delivered: register, filter, rotate secrets, disable, recover."),
        (name = "deliveries", description = "Each event's delivery to each endpoint, with every attempt; resend one."),
        (name = "emails", description = "Queue emails; the email_outbox role sends them."),
    )
)]
struct ApiDoc;

struct BearerAuth;

impl Modify for BearerAuth {
    fn modify(&self, openapi: &mut utoipa::openapi::OpenApi) {
        let components = openapi.components.get_or_insert_with(Default::default);
        components.add_security_scheme(
            "api_key",
            SecurityScheme::Http(
                HttpBuilder::new()
                    .scheme(HttpAuthScheme::Bearer)
                    .bearer_format("hc_<prefix>_<secret>")
                    .build(),
            ),
        );
    }
}

fn routes() -> OpenApiRouter<Api> {
    OpenApiRouter::with_openapi(ApiDoc::openapi())
        .routes(routes!(events::publish, events::list))
        .routes(routes!(events::get))
        .routes(routes!(customers::create, customers::list))
        .routes(routes!(customers::get, customers::update))
        .routes(routes!(plans::create, plans::list))
        .routes(routes!(plans::get))
        .routes(routes!(subscriptions::create, subscriptions::list))
        .routes(routes!(subscriptions::get))
        .routes(routes!(subscriptions::cancel))
        .routes(routes!(subscriptions::pause))
        .routes(routes!(subscriptions::resume))
        .routes(routes!(subscriptions::change_plan))
        .routes(routes!(invoices::list))
        .routes(routes!(invoices::get))
        .routes(routes!(dunning::get_policy, dunning::put_policy))
        .routes(routes!(dunning::list_runs))
        .routes(routes!(dunning::get_run))
        .routes(routes!(endpoints::create, endpoints::list))
        .routes(routes!(endpoints::get, endpoints::update))
        .routes(routes!(endpoints::rotate_secret))
        .routes(routes!(endpoints::disable))
        .routes(routes!(endpoints::enable))
        .routes(routes!(endpoints::recover))
        .routes(routes!(deliveries::list))
        .routes(routes!(deliveries::get))
        .routes(routes!(deliveries::resend))
        .routes(routes!(emails::create, emails::list))
        .routes(routes!(emails::get))
        .routes(routes!(emails::resend))
}

/// The OpenAPI 3.1 document of every route, generated from the handlers.
pub fn openapi() -> utoipa::openapi::OpenApi {
    routes().split_for_parts().1
}

/// The API's router: `/v1/…` and `/openapi.json`, with the limits around
/// every route.
pub fn router(api: Api) -> Router {
    let (routes, doc) = routes().split_for_parts();
    let doc = doc
        .to_pretty_json()
        .expect("the OpenAPI document serializes");
    let timeout = api.config().request_timeout;
    let concurrent = api.config().max_concurrent;
    let routes = routes
        .route(
            "/openapi.json",
            axum::routing::get(move || async move {
                ([(header::CONTENT_TYPE, "application/json")], doc.clone())
            }),
        )
        .fallback(|| async { ApiError::route_not_found() })
        .method_not_allowed_fallback(|| async { ApiError::method_not_allowed() })
        .with_state(api);
    with_limits(
        routes,
        Limits {
            body: MAX_BODY_BYTES,
            timeout,
            concurrent,
            timed_out: ApiError::timeout,
        },
    )
}

/// The limits a router's routes are served within.
pub(crate) struct Limits {
    /// The largest request body, in bytes.
    pub body: usize,
    /// How long a request that holds a place may run before a 503.
    pub timeout: std::time::Duration,
    /// Requests served at once; the rest wait.
    pub concurrent: usize,
    /// The 503 a request that ran out of time is answered with.
    pub timed_out: fn() -> ApiError,
}

/// `router` with `limits` around every route it has now (a layer does not
/// reach routes merged in later), and the limit layers' empty answers in the
/// one error shape. The body limit also goes to the body extractor, which
/// names it in a 413 for a body cut while read.
pub(crate) fn with_limits(router: Router, limits: Limits) -> Router {
    let Limits {
        body,
        timeout,
        concurrent,
        timed_out,
    } = limits;
    router.layer(
        ServiceBuilder::new()
            .map_response(move |r| json_errors(r, body, timed_out))
            .layer(TimeoutLayer::with_status_code(
                StatusCode::SERVICE_UNAVAILABLE,
                timeout,
            ))
            .layer(GlobalConcurrencyLimitLayer::new(concurrent))
            // tower-http wraps the body; the timeout above needs axum's.
            .map_response(|r: Response<_>| r.map(Body::new))
            .layer(RequestBodyLimitLayer::new(body))
            .layer(axum::Extension(extract::BodyLimit(body))),
    )
}

/// The limit layers answer with empty bodies, and axum's own extractors
/// (a path segment that is not UTF-8) in plain text; give them the one
/// error shape, naming the body limit of the routes they guard and
/// answering a timeout with `timeout`.
fn json_errors(
    response: Response<Body>,
    body_limit: usize,
    timeout: fn() -> ApiError,
) -> Response<Body> {
    let status = response.status();
    let is_json = response
        .headers()
        .get(header::CONTENT_TYPE)
        .is_some_and(|v| v.as_bytes().starts_with(b"application/json"));
    if !status.is_client_error() && !status.is_server_error() || is_json {
        return response;
    }
    match status {
        StatusCode::PAYLOAD_TOO_LARGE => ApiError::body_too_large(body_limit),
        StatusCode::SERVICE_UNAVAILABLE | StatusCode::REQUEST_TIMEOUT => timeout(),
        StatusCode::NOT_FOUND => ApiError::route_not_found(),
        StatusCode::METHOD_NOT_ALLOWED => ApiError::method_not_allowed(),
        s if s.is_client_error() => ApiError::unreadable_request(),
        _ => ApiError::internal(),
    }
    .into_response()
}
