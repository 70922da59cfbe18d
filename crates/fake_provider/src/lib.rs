//! A fake payment provider that speaks Stripe's PaymentIntents API on loopback,
//! so billing's tests, benchmarks and the local run charge over real HTTP.
//!
//! ```text
//!  POST /v1/payment_intents   form-encoded, Authorization: Bearer sk_…, Idempotency-Key
//!    bad auth                        ──▶ 401 invalid_request_error
//!    key > 255 chars                 ──▶ 400 idempotency_error
//!    key seen, other parameters      ──▶ 400 idempotency_error     (nothing charged)
//!    key seen, same parameters       ──▶ the stored answer again    (Idempotent-Replayed: true)
//!    key in flight                   ──▶ 409 idempotency_error
//!    missing / invalid / unknown param ─▶ 400 invalid_request_error with error.param
//!    customer told to answer 5xx     ──▶ 500 api_error             (nothing charged, nothing stored)
//!    customer told to decline        ──▶ 402 card_error, code card_declined, decline_code (stored)
//!    customer told to hang           ──▶ charged and stored, then no answer ever
//!    otherwise                       ──▶ 200 payment_intent status succeeded (charged, stored)
//!  GET  /_test/charges        {"by_key": {key: n}, "total": n}   (successful charges)
//!  POST /_test/behaviour      customer=cus_…&behaviour=succeed|decline|hang|error[&decline_code=…]
//! ```
//!
//! Idempotency follows Stripe: a result is stored once the request started
//! executing (a success or a decline), never for a request refused by
//! validation; the same key with the same parameters answers the stored
//! result without charging again. Differences from Stripe, on purpose:
//! `currency` must already be lower case, `confirm` and `off_session` must be
//! `true` (the only flow billing uses), and a 5xx is injected before
//! execution, so it is not stored and a retry with the same key charges.
//!
//! **Lookup by key** is the replay: billing's payment reconciler asks about an
//! attempt whose outcome it does not know by sending the same request with the
//! same key (Stripe has no endpoint that finds a request by its key; see
//! docs/adr/0012). A stored result answers without charging again; a key never
//! executed (a 5xx, a request that never arrived) executes once.
//!
//! Guarantees the tests rely on: [`FakeProvider::charges`] counts each
//! successful execution per key; a replay is not counted.

use std::collections::{BTreeMap, HashMap};
use std::net::SocketAddr;
use std::sync::{Arc, Mutex};

use axum::Router;
use axum::body::Bytes;
use axum::extract::State;
use axum::http::{HeaderMap, StatusCode};
use axum::response::{IntoResponse, Response};
use axum::routing::{get, post};
use serde_json::{Value, json};

/// The secret key [`FakeProvider::start`] accepts.
pub const TEST_SECRET_KEY: &str = "sk_test_hardcount_fake";

/// Stripe's limit on an `Idempotency-Key`.
pub const MAX_IDEMPOTENCY_KEY_LEN: usize = 255;

/// How the fake answers charges of one customer.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Behaviour {
    Succeed,
    /// 402 `card_declined` with this `decline_code` (e.g. `insufficient_funds`).
    Decline(String),
    /// Charge and store the result, then never answer (the client times out).
    Hang,
    /// Answer this 5xx status before executing: nothing charged or stored.
    ServerError(u16),
}

#[derive(Debug, Clone)]
struct Stored {
    params: Vec<(String, String)>,
    status: StatusCode,
    body: Value,
}

#[derive(Debug, Default)]
struct Ledger {
    behaviour: HashMap<String, Behaviour>,
    by_key: HashMap<String, Stored>,
    in_flight: HashMap<String, Vec<(String, String)>>,
    charges: BTreeMap<String, u32>,
    next_intent: u64,
}

struct Shared {
    secret_key: String,
    ledger: Mutex<Ledger>,
}

impl Shared {
    fn ledger(&self) -> std::sync::MutexGuard<'_, Ledger> {
        self.ledger.lock().unwrap_or_else(|p| p.into_inner())
    }
}

/// A running fake provider. Stops (aborting hung requests) when dropped.
pub struct FakeProvider {
    shared: Arc<Shared>,
    addr: SocketAddr,
    server: tokio::task::JoinHandle<()>,
}

impl std::fmt::Debug for FakeProvider {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("FakeProvider")
            .field("addr", &self.addr)
            .finish_non_exhaustive()
    }
}

impl FakeProvider {
    /// Start on a free loopback port, accepting [`TEST_SECRET_KEY`].
    ///
    /// # Errors
    /// The listener could not be bound.
    pub async fn start() -> std::io::Result<FakeProvider> {
        FakeProvider::start_on(
            "127.0.0.1:0".parse().expect("a loopback address"),
            TEST_SECRET_KEY,
        )
        .await
    }

    /// Start on `addr`, accepting `secret_key` as the bearer token.
    ///
    /// # Errors
    /// The listener could not be bound.
    pub async fn start_on(addr: SocketAddr, secret_key: &str) -> std::io::Result<FakeProvider> {
        let listener = tokio::net::TcpListener::bind(addr).await?;
        let addr = listener.local_addr()?;
        let shared = Arc::new(Shared {
            secret_key: secret_key.to_owned(),
            ledger: Mutex::new(Ledger::default()),
        });
        let app = router(shared.clone());
        let server = tokio::spawn(async move {
            if let Err(e) = axum::serve(listener, app).await {
                tracing::error!(error = %e, "fake provider stopped");
            }
        });
        Ok(FakeProvider {
            shared,
            addr,
            server,
        })
    }

    /// `http://127.0.0.1:PORT`, without a trailing slash.
    pub fn base_url(&self) -> String {
        format!("http://{}", self.addr)
    }

    pub fn addr(&self) -> SocketAddr {
        self.addr
    }

    /// How charges of `customer` (`cus_…`) are answered from now on.
    pub fn set_behaviour(&self, customer: &str, behaviour: Behaviour) {
        self.shared
            .ledger()
            .behaviour
            .insert(customer.to_owned(), behaviour);
    }

    /// Successful charges per idempotency key (replays not counted).
    pub fn charges(&self) -> BTreeMap<String, u32> {
        self.shared.ledger().charges.clone()
    }

    /// All successful charges.
    pub fn total_charges(&self) -> u32 {
        self.shared.ledger().charges.values().sum()
    }

    /// Requests that are executing or hanging now.
    pub fn in_flight(&self) -> usize {
        self.shared.ledger().in_flight.len()
    }

    /// Whether a result is stored under `key`.
    pub fn has_result(&self, key: &str) -> bool {
        self.shared.ledger().by_key.contains_key(key)
    }
}

impl Drop for FakeProvider {
    fn drop(&mut self) {
        self.server.abort();
    }
}

fn router(shared: Arc<Shared>) -> Router {
    Router::new()
        .route("/v1/payment_intents", post(create_payment_intent))
        .route("/_test/charges", get(charges))
        .route("/_test/behaviour", post(set_behaviour))
        .with_state(shared)
}

fn error(
    status: StatusCode,
    kind: &str,
    code: Option<&str>,
    param: Option<&str>,
    message: &str,
) -> Response {
    let mut e = json!({ "type": kind, "message": message });
    if let Some(code) = code {
        e["code"] = json!(code);
    }
    if let Some(param) = param {
        e["param"] = json!(param);
    }
    (status, axum::Json(json!({ "error": e }))).into_response()
}

fn invalid(code: &str, param: &str, message: String) -> Response {
    error(
        StatusCode::BAD_REQUEST,
        "invalid_request_error",
        Some(code),
        Some(param),
        &message,
    )
}

const KNOWN: [&str; 6] = [
    "amount",
    "currency",
    "customer",
    "payment_method",
    "confirm",
    "off_session",
];

/// The parameters, validated as Stripe would, sorted (the idempotency
/// fingerprint), or the refusal.
fn refuse(code: &str, param: &str, message: String) -> Box<Response> {
    Box::new(invalid(code, param, message))
}

fn validate(body: &[u8]) -> Result<Vec<(String, String)>, Box<Response>> {
    let mut params: Vec<(String, String)> = url::form_urlencoded::parse(body)
        .map(|(k, v)| (k.into_owned(), v.into_owned()))
        .collect();
    for (k, _) in &params {
        if !KNOWN.contains(&k.as_str()) {
            return Err(refuse(
                "parameter_unknown",
                k,
                format!("Received unknown parameter: {k}"),
            ));
        }
    }
    params.sort();
    for w in params.windows(2) {
        if w[0].0 == w[1].0 {
            return Err(refuse(
                "parameter_invalid_string",
                &w[0].0,
                format!("Received {} more than once", w[0].0),
            ));
        }
    }
    let get = |name: &str| {
        params
            .iter()
            .find(|(k, _)| k == name)
            .map(|(_, v)| v.as_str())
    };
    for name in [
        "amount",
        "currency",
        "customer",
        "payment_method",
        "confirm",
        "off_session",
    ] {
        if get(name).is_none_or(str::is_empty) {
            return Err(refuse(
                "parameter_missing",
                name,
                format!("Missing required param: {name}."),
            ));
        }
    }
    let amount = get("amount").unwrap_or_default();
    if !amount.bytes().all(|b| b.is_ascii_digit())
        || amount
            .parse::<u64>()
            .map_or(true, |a| !(1..=99_999_999).contains(&a))
    {
        return Err(refuse(
            "parameter_invalid_integer",
            "amount",
            format!("Invalid integer: {amount} (a positive integer of minor units up to 99999999)"),
        ));
    }
    let currency = get("currency").unwrap_or_default();
    if currency.len() != 3 || !currency.bytes().all(|b| b.is_ascii_lowercase()) {
        return Err(refuse(
            "parameter_invalid_string",
            "currency",
            format!("Invalid currency: {currency} (a lowercase ISO 4217 code)"),
        ));
    }
    for (name, prefix) in [("customer", "cus_"), ("payment_method", "pm_")] {
        let v = get(name).unwrap_or_default();
        if !v.starts_with(prefix) || v.len() == prefix.len() {
            return Err(refuse(
                "resource_missing",
                name,
                format!("No such {name}: '{v}'"),
            ));
        }
    }
    for name in ["confirm", "off_session"] {
        if get(name) != Some("true") {
            return Err(refuse(
                "parameter_invalid_boolean",
                name,
                format!("{name} must be true for an off-session charge of a saved card"),
            ));
        }
    }
    Ok(params)
}

fn value<'a>(params: &'a [(String, String)], name: &str) -> &'a str {
    params
        .iter()
        .find(|(k, _)| k == name)
        .map_or("", |(_, v)| v.as_str())
}

fn authorized(shared: &Shared, headers: &HeaderMap) -> bool {
    headers
        .get("authorization")
        .and_then(|v| v.to_str().ok())
        .and_then(|v| v.strip_prefix("Bearer "))
        .is_some_and(|k| k == shared.secret_key)
}

async fn create_payment_intent(
    State(shared): State<Arc<Shared>>,
    headers: HeaderMap,
    body: Bytes,
) -> Response {
    if !authorized(&shared, &headers) {
        return error(
            StatusCode::UNAUTHORIZED,
            "invalid_request_error",
            None,
            None,
            "Invalid API Key provided.",
        );
    }
    let key = match headers.get("idempotency-key").map(|v| v.to_str()) {
        None => None,
        Some(Ok(k)) if !k.is_empty() && k.len() <= MAX_IDEMPOTENCY_KEY_LEN => Some(k.to_owned()),
        Some(_) => {
            return error(
                StatusCode::BAD_REQUEST,
                "idempotency_error",
                None,
                None,
                "Idempotency-Key must be 1 to 255 visible ASCII characters.",
            );
        }
    };
    let params = match validate(&body) {
        Ok(p) => p,
        Err(refusal) => return *refusal,
    };
    let customer = value(&params, "customer").to_owned();
    let (behaviour, intent) = {
        let mut l = shared.ledger();
        if let Some(k) = &key {
            if let Some(stored) = l.by_key.get(k) {
                if stored.params != params {
                    return idempotency_mismatch(k);
                }
                let mut r = (stored.status, axum::Json(stored.body.clone())).into_response();
                r.headers_mut().insert(
                    "idempotent-replayed",
                    "true".parse().expect("a header value"),
                );
                return r;
            }
            if l.in_flight.contains_key(k) {
                return error(
                    StatusCode::CONFLICT,
                    "idempotency_error",
                    None,
                    None,
                    "There is currently another in-progress request using this Idempotency-Key.",
                );
            }
        }
        let behaviour = l
            .behaviour
            .get(&customer)
            .cloned()
            .unwrap_or(Behaviour::Succeed);
        if let Behaviour::ServerError(code) = behaviour {
            let status = StatusCode::from_u16(code).unwrap_or(StatusCode::INTERNAL_SERVER_ERROR);
            return error(
                status,
                "api_error",
                None,
                None,
                "An unknown error occurred.",
            );
        }
        l.next_intent += 1;
        let intent = format!("pi_fake{:08}", l.next_intent);
        if let Some(k) = &key {
            l.in_flight.insert(k.clone(), params.clone());
        }
        (behaviour, intent)
    };
    let payment_intent = |status: &str| {
        json!({
            "id": intent,
            "object": "payment_intent",
            "amount": value(&params, "amount").parse::<u64>().unwrap_or_default(),
            "currency": value(&params, "currency"),
            "customer": customer,
            "payment_method": value(&params, "payment_method"),
            "confirmation_method": "automatic",
            "status": status,
        })
    };
    let declined_by = match &behaviour {
        Behaviour::Decline(code) => Some(code.clone()),
        _ if value(&params, "payment_method") == "pm_card_chargeDeclined" => {
            Some("generic_decline".to_owned())
        }
        _ => None,
    };
    let (status, body) = match declined_by {
        Some(decline_code) => (
            StatusCode::PAYMENT_REQUIRED,
            json!({ "error": {
                "type": "card_error",
                "code": "card_declined",
                "decline_code": decline_code,
                "message": "Your card was declined.",
                "payment_intent": payment_intent("requires_payment_method"),
            }}),
        ),
        None => (StatusCode::OK, payment_intent("succeeded")),
    };
    {
        let mut l = shared.ledger();
        if status == StatusCode::OK {
            *l.charges
                .entry(key.clone().unwrap_or_else(|| intent.clone()))
                .or_default() += 1;
        }
        if let Some(k) = &key {
            l.in_flight.remove(k);
            l.by_key.insert(
                k.clone(),
                Stored {
                    params: params.clone(),
                    status,
                    body: body.clone(),
                },
            );
        }
    }
    if behaviour == Behaviour::Hang {
        std::future::pending::<()>().await;
    }
    (status, axum::Json(body)).into_response()
}

fn idempotency_mismatch(key: &str) -> Response {
    error(
        StatusCode::BAD_REQUEST,
        "idempotency_error",
        None,
        None,
        &format!(
            "Keys for idempotent requests can only be used with the same parameters they were first used with. \
             Try using a key other than '{key}' if you meant to execute a different request."
        ),
    )
}

async fn charges(State(shared): State<Arc<Shared>>) -> Response {
    let l = shared.ledger();
    let total: u32 = l.charges.values().sum();
    axum::Json(json!({ "by_key": l.charges, "total": total })).into_response()
}

async fn set_behaviour(State(shared): State<Arc<Shared>>, body: Bytes) -> Response {
    let form: HashMap<String, String> = url::form_urlencoded::parse(&body).into_owned().collect();
    let Some(customer) = form.get("customer").filter(|c| c.starts_with("cus_")) else {
        return invalid(
            "parameter_missing",
            "customer",
            "customer (cus_…) is required".into(),
        );
    };
    let behaviour = match form.get("behaviour").map(String::as_str) {
        Some("succeed") => Behaviour::Succeed,
        Some("decline") => Behaviour::Decline(
            form.get("decline_code")
                .cloned()
                .unwrap_or_else(|| "generic_decline".into()),
        ),
        Some("hang") => Behaviour::Hang,
        Some("error") => Behaviour::ServerError(500),
        _ => {
            return invalid(
                "parameter_invalid_string",
                "behaviour",
                "behaviour is one of succeed, decline, hang, error".into(),
            );
        }
    };
    shared
        .ledger()
        .behaviour
        .insert(customer.clone(), behaviour);
    StatusCode::NO_CONTENT.into_response()
}
