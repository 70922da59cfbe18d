//! A fake payment provider that speaks Stripe's PaymentIntents API on loopback,
//! so billing's tests, benchmarks and the local run charge over real HTTP.
//!
//! ```text
//!  every /v1/* request: Authorization: Bearer <the current secret key>, else
//!                                    ──▶ 401 invalid_request_error "Invalid API Key provided: sk_****…"
//!                                        (the key masked; nothing counted, charged or stored)
//!  POST /v1/payment_intents   form-encoded, Idempotency-Key; counted by create_requests()
//!    key > 255 chars                 ──▶ 400 idempotency_error
//!    missing / invalid / unknown param ─▶ 400 invalid_request_error with error.param
//!    metadata[NAME] not 1..40 [A-Za-z0-9_], value > 500 chars, > 50 keys
//!                                    ──▶ 400 parameter_invalid_string, param metadata
//!    amount under the currency's minimum (0 included; set_enforce_minimums)
//!                                    ──▶ 400 amount_too_small      (nothing charged, nothing stored)
//!    amount over 99999999            ──▶ 400 amount_too_large      (nothing charged, nothing stored)
//!    key seen, other parameters (metadata included)
//!                                    ──▶ 400 idempotency_error     (nothing charged)
//!    key seen, same parameters       ──▶ the stored answer again    (Idempotent-Replayed: true)
//!    key in flight                   ──▶ 409 idempotency_error
//!    the customer's behaviour, answered before executing (nothing charged, nothing stored):
//!      error (ServerError)           ──▶ that 5xx, api_error
//!      rate_limited                  ──▶ 429 rate_limit_error, Retry-After: N
//!      missing_payment_method        ──▶ 404 resource_missing, param payment_method
//!    executed (an intent is created, listed, and the answer stored under the key):
//!      decline                       ──▶ 402 card_error, code card_declined (authentication_required
//!                                        for that decline_code), decline_code; intent
//!                                        requires_payment_method with last_payment_error
//!      stored_error                  ──▶ charged, then 500 api_error [with payment_intent]
//!      processing                    ──▶ 200 status processing (charged only once settled)
//!      malformed not_json|no_id|bad_id ─▶ charged, 200 with a body billing cannot trust
//!      malformed nul_code            ──▶ 402 card_error, decline_code "gen\u0000eric"
//!      hang                          ──▶ charged and stored, then no answer ever
//!      otherwise                     ──▶ 200 payment_intent status succeeded (charged)
//!  GET  /v1/payment_intents/{id}     the intent as it is now, or 404 resource_missing param intent
//!  GET  /v1/payment_intents?customer=cus_…&created[gte]=UNIX&limit=1..100&starting_after=pi_…
//!                                    {"object":"list","url","has_more","data"} newest first
//!  GET  /_test/charges               {"by_key": {key: n}, "total": n}   (successful charges)
//!  POST /_test/behaviour             customer=cus_…&behaviour=succeed|decline|hang|error|
//!                                    stored_error|processing|missing_payment_method|malformed|
//!                                    rate_limited [&decline_code=…][&with_intent=true]
//!                                    [&kind=not_json|no_id|bad_id|nul_code][&retry_after=N]
//!  POST /_test/intents/{id}/settle   status=succeeded|failed   (a processing intent)
//!  POST /_test/prune_keys            forget every stored key (Stripe, 24 h later)
//!  POST /_test/roll_key              secret_key=…   (only that key is accepted from then on)
//! ```
//!
//! Idempotency follows Stripe: a result is stored once the request started
//! executing (a success, a decline, a 500 after the charge, a processing
//! intent, a malformed answer), never for a request refused by validation or
//! answered before executing; the same key with the same parameters answers
//! the stored result without charging again, until the keys are pruned
//! ([`FakeProvider::prune_keys`], Stripe's 24 hours): then the same key is a
//! new request and charges again. Differences from Stripe, on purpose:
//! `currency` must already be lower case, `confirm` and `off_session` must be
//! `true` (the only flow billing uses), and an injected 5xx
//! ([`Behaviour::ServerError`]) comes before execution, so it is not stored
//! and a retry with the same key charges; [`Behaviour::StoredServerError`] is
//! the 500 Stripe stores.
//!
//! **Lookup by key** is the replay: billing's payment reconciler asks about an
//! attempt whose outcome it does not know by sending the same request with the
//! same key (Stripe has no endpoint that finds a request by its key; see
//! docs/adr/0012). A stored result answers without charging again; a key never
//! executed (a 5xx, a request that never arrived) or pruned executes once.
//! Listing the customer's intents (`GET /v1/payment_intents`) finds every
//! intent ever created, whatever its key's fate.
//!
//! Guarantees the tests rely on: [`FakeProvider::charges`] counts each intent
//! that is or became `succeeded` once, under its key (its id without a key); a
//! replay is not counted, a key executed again after pruning is.

use std::collections::{BTreeMap, HashMap};
use std::net::SocketAddr;
use std::sync::{Arc, Mutex};
use std::time::{SystemTime, UNIX_EPOCH};

use axum::Router;
use axum::body::Bytes;
use axum::extract::{Path, RawQuery, State};
use axum::http::{HeaderMap, HeaderValue, StatusCode, header};
use axum::response::{IntoResponse, Response};
use axum::routing::{get, post};
use serde_json::{Value, json};

/// The secret key [`FakeProvider::start`] accepts.
pub const TEST_SECRET_KEY: &str = "sk_test_hardcount_fake";

/// Stripe's limit on an `Idempotency-Key`.
pub const MAX_IDEMPOTENCY_KEY_LEN: usize = 255;

/// Stripe's largest amount, in minor units.
pub const MAX_AMOUNT: u64 = 99_999_999;

/// The payment method Stripe's test mode always declines (`generic_decline`).
const DECLINED_CARD: &str = "pm_card_chargeDeclined";

/// The decline code of [`MalformedKind::NulCode`].
const NUL_DECLINE_CODE: &str = "gen\u{0}eric";

/// Stripe's minimum charge amounts, in minor units, for the currencies it
/// lists; others take [`DEFAULT_MINIMUM`].
const MINIMUMS: [(&str, u64); 24] = [
    ("usd", 50),
    ("eur", 50),
    ("gbp", 30),
    ("cad", 50),
    ("aud", 50),
    ("chf", 50),
    ("jpy", 50),
    ("dkk", 250),
    ("nok", 300),
    ("sek", 300),
    ("mxn", 1000),
    ("hkd", 400),
    ("sgd", 50),
    ("nzd", 50),
    ("brl", 50),
    ("inr", 50),
    ("pln", 200),
    ("czk", 1500),
    ("huf", 17500),
    ("bgn", 100),
    ("ron", 200),
    ("myr", 200),
    ("thb", 1000),
    ("aed", 200),
];

/// The minimum of a currency [`MINIMUMS`] does not list.
const DEFAULT_MINIMUM: u64 = 50;

/// Stripe's limits on `metadata`: keys, key length, value length.
const METADATA_MAX_KEYS: usize = 50;
const METADATA_MAX_KEY_LEN: usize = 40;
const METADATA_MAX_VALUE_LEN: usize = 500;

/// Stripe's page size bounds for a list, and its default.
const LIST_LIMIT_MAX: usize = 100;
const LIST_LIMIT_DEFAULT: usize = 10;

/// The smallest amount, in minor units, Stripe charges in `currency`
/// (lower case), as its minimum-amount table says.
pub fn minimum_amount(currency: &str) -> u64 {
    MINIMUMS
        .iter()
        .find(|(c, _)| *c == currency)
        .map_or(DEFAULT_MINIMUM, |(_, m)| *m)
}

/// How the fake answers charges of one customer.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Behaviour {
    Succeed,
    /// 402 `card_declined` with this `decline_code` (e.g. `insufficient_funds`);
    /// `authentication_required` is also the error's `code`, as Stripe sends it.
    Decline(String),
    /// Charge and store the result, then never answer (the client times out).
    Hang,
    /// Answer this 5xx status before executing: nothing charged or stored.
    ServerError(u16),
    /// Charge, then store and answer 500 `api_error` (Stripe stores a 500 once
    /// execution began); `with_intent` adds the succeeded `payment_intent`.
    StoredServerError {
        with_intent: bool,
    },
    /// Create the intent as `processing` and answer 200 with it; it is charged
    /// once [`FakeProvider::settle_processing`] says it succeeded.
    Processing,
    /// 404 `resource_missing` on `payment_method`: nothing charged or stored.
    MissingPaymentMethod,
    /// Execute, then answer (and store) a body a client must not trust.
    Malformed(MalformedKind),
    /// 429 `rate_limit_error` with `Retry-After`: nothing charged or stored.
    RateLimited {
        retry_after_secs: u64,
    },
}

/// The broken answers of [`Behaviour::Malformed`].
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum MalformedKind {
    /// Charged; 200 with an HTML body (a proxy in the way).
    NotJson,
    /// Charged; 200 with a payment intent that has no `id`.
    NoId,
    /// Charged; 200 with the id `pi_bad id/../x`.
    BadId,
    /// Declined; 402 `card_error` whose `decline_code` holds a NUL character.
    NulCode,
}

/// A payment intent as a test sees it ([`FakeProvider::intents`]).
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct IntentView {
    /// `pi_fake…`, the id it was created with (also for a malformed answer).
    pub id: String,
    /// The idempotency key of the request that created it.
    pub key: Option<String>,
    pub customer: String,
    /// `succeeded`, `processing` or `requires_payment_method`, as now.
    pub status: String,
    pub metadata: BTreeMap<String, String>,
}

/// The statuses a fake intent can have.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Status {
    Succeeded,
    Processing,
    RequiresPaymentMethod,
}

impl Status {
    fn as_str(self) -> &'static str {
        match self {
            Status::Succeeded => "succeeded",
            Status::Processing => "processing",
            Status::RequiresPaymentMethod => "requires_payment_method",
        }
    }
}

/// A payment intent the fake created; kept forever, whatever its key's fate.
#[derive(Debug, Clone)]
struct Intent {
    id: String,
    key: Option<String>,
    amount: u64,
    currency: String,
    customer: String,
    payment_method: String,
    status: Status,
    created: i64,
    metadata: BTreeMap<String, String>,
    last_payment_error: Option<Value>,
}

impl Intent {
    /// A new intent for validated `params`, not yet executed.
    fn new(id: String, key: Option<String>, params: &[(String, String)], created: i64) -> Intent {
        Intent {
            id,
            key,
            amount: value(params, "amount").parse().unwrap_or_default(),
            currency: value(params, "currency").to_owned(),
            customer: value(params, "customer").to_owned(),
            payment_method: value(params, "payment_method").to_owned(),
            status: Status::Processing,
            created,
            metadata: metadata(params),
            last_payment_error: None,
        }
    }

    /// Stripe's JSON of the intent as it is now.
    fn json(&self) -> Value {
        json!({
            "id": self.id,
            "object": "payment_intent",
            "amount": self.amount,
            "currency": self.currency,
            "customer": self.customer,
            "payment_method": self.payment_method,
            "confirmation_method": "automatic",
            "status": self.status.as_str(),
            "created": self.created,
            "metadata": self.metadata,
            "last_payment_error": self.last_payment_error,
        })
    }

    fn view(&self) -> IntentView {
        IntentView {
            id: self.id.clone(),
            key: self.key.clone(),
            customer: self.customer.clone(),
            status: self.status.as_str().to_owned(),
            metadata: self.metadata.clone(),
        }
    }

    /// Declined with `decline_code`: needs another payment method.
    fn decline(&mut self, decline_code: &str) {
        self.status = Status::RequiresPaymentMethod;
        self.last_payment_error = Some(card_error(decline_code));
    }

    /// The charge's key in [`FakeProvider::charges`]: its key, else its id.
    fn charge_key(&self) -> String {
        self.key.clone().unwrap_or_else(|| self.id.clone())
    }
}

/// An answer as sent, so that a stored one replays byte for byte.
#[derive(Debug, Clone)]
struct Answer {
    status: StatusCode,
    content_type: &'static str,
    body: String,
}

impl Answer {
    fn json(status: StatusCode, body: &Value) -> Answer {
        Answer {
            status,
            content_type: "application/json",
            body: body.to_string(),
        }
    }

    fn into_response(self, replayed: bool) -> Response {
        let mut r = (
            self.status,
            [(header::CONTENT_TYPE, self.content_type)],
            self.body,
        )
            .into_response();
        if replayed {
            r.headers_mut()
                .insert("idempotent-replayed", HeaderValue::from_static("true"));
        }
        r
    }
}

#[derive(Debug, Clone)]
struct Stored {
    params: Vec<(String, String)>,
    answer: Answer,
}

#[derive(Debug, Default)]
struct Ledger {
    secret_key: String,
    behaviour: HashMap<String, Behaviour>,
    by_key: HashMap<String, Stored>,
    in_flight: HashMap<String, Vec<(String, String)>>,
    charges: BTreeMap<String, u32>,
    next_intent: u64,
    /// Every intent created, in creation order; `by_id` indexes it.
    intents: Vec<Intent>,
    by_id: HashMap<String, usize>,
    create_requests: u32,
    /// Requests of any route refused with 401.
    unauthorized_requests: u32,
    ignore_minimums: bool,
    clock_offset_secs: u64,
}

impl Ledger {
    /// Unix seconds on the fake's clock (the real one, advanced by tests).
    fn now(&self) -> i64 {
        let real = SystemTime::now()
            .duration_since(UNIX_EPOCH)
            .map_or(0, |d| d.as_secs());
        i64::try_from(real.saturating_add(self.clock_offset_secs)).unwrap_or(i64::MAX)
    }

    fn intent(&self, id: &str) -> Option<&Intent> {
        self.by_id.get(id).and_then(|&i| self.intents.get(i))
    }

    /// Keep `intent`, counting its charge if it succeeded.
    fn record(&mut self, intent: Intent) {
        if intent.status == Status::Succeeded {
            *self.charges.entry(intent.charge_key()).or_default() += 1;
        }
        self.by_id.insert(intent.id.clone(), self.intents.len());
        self.intents.push(intent);
    }
}

struct Shared {
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
            ledger: Mutex::new(Ledger {
                secret_key: secret_key.to_owned(),
                ..Ledger::default()
            }),
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

    /// Whether amounts under the currency's minimum ([`minimum_amount`]) are
    /// refused with `amount_too_small` (the default); off, the floor is 1.
    pub fn set_enforce_minimums(&self, enforce: bool) {
        self.shared.ledger().ignore_minimums = !enforce;
    }

    /// Forget every stored idempotency result, as Stripe does 24 hours after
    /// a key's first use. Intents and charge counts stay; the same key with
    /// the same parameters then executes (and charges) again.
    pub fn prune_keys(&self) {
        self.shared.ledger().by_key.clear();
    }

    /// Accept only `secret_key` from now on (a rolled key): `/v1/*` requests
    /// with any other answer 401.
    pub fn roll_secret_key(&self, secret_key: &str) {
        secret_key.clone_into(&mut self.shared.ledger().secret_key);
    }

    /// Move the `processing` intent `intent_id` to `succeeded` (counted in
    /// [`FakeProvider::charges`] under its key from then on) or, when not
    /// `succeeded`, to `requires_payment_method` declined for
    /// `insufficient_funds`. False when no such intent is processing.
    pub fn settle_processing(&self, intent_id: &str, succeeded: bool) -> bool {
        settle(&mut self.shared.ledger(), intent_id, succeeded).is_ok()
    }

    /// Move the fake's clock `secs` seconds forward: intents created from now
    /// on carry a `created` that much later (for `created[gte]` windows).
    pub fn advance_clock(&self, secs: u64) {
        let mut l = self.shared.ledger();
        l.clock_offset_secs = l.clock_offset_secs.saturating_add(secs);
    }

    /// Successful charges per idempotency key (replays not counted).
    pub fn charges(&self) -> BTreeMap<String, u32> {
        self.shared.ledger().charges.clone()
    }

    /// All successful charges.
    pub fn total_charges(&self) -> u32 {
        self.shared.ledger().charges.values().sum()
    }

    /// Every intent created, in creation order, as it is now.
    pub fn intents(&self) -> Vec<IntentView> {
        self.shared
            .ledger()
            .intents
            .iter()
            .map(Intent::view)
            .collect()
    }

    /// `POST /v1/payment_intents` requests that passed authentication,
    /// replays and refusals included: whether a request was sent (again).
    pub fn create_requests(&self) -> u32 {
        self.shared.ledger().create_requests
    }

    /// Requests of any route refused with 401 (a wrong or rolled key).
    pub fn unauthorized_requests(&self) -> u32 {
        self.shared.ledger().unauthorized_requests
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
        .route(
            "/v1/payment_intents",
            post(create_payment_intent).get(list_payment_intents),
        )
        .route("/v1/payment_intents/{id}", get(retrieve_payment_intent))
        .route("/_test/charges", get(charges))
        .route("/_test/behaviour", post(set_behaviour))
        .route("/_test/intents/{id}/settle", post(settle_intent))
        .route("/_test/prune_keys", post(prune_keys))
        .route("/_test/roll_key", post(roll_key))
        .with_state(shared)
}

fn error(
    status: StatusCode,
    kind: &str,
    code: Option<&str>,
    param: Option<&str>,
    message: &str,
) -> Response {
    (
        status,
        axum::Json(json!({ "error": error_json(kind, code, param, message) })),
    )
        .into_response()
}

/// Stripe's `error` object.
fn error_json(kind: &str, code: Option<&str>, param: Option<&str>, message: &str) -> Value {
    let mut e = json!({ "type": kind, "message": message });
    if let Some(code) = code {
        e["code"] = json!(code);
    }
    if let Some(param) = param {
        e["param"] = json!(param);
    }
    e
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

/// 404 `resource_missing` naming `param`.
fn missing(param: &str, message: String) -> Response {
    error(
        StatusCode::NOT_FOUND,
        "invalid_request_error",
        Some("resource_missing"),
        Some(param),
        &message,
    )
}

fn no_such_intent(id: &str) -> Response {
    missing("intent", format!("No such payment_intent: '{id}'"))
}

/// The `card_error` of a decline with `decline_code`; Stripe puts
/// `authentication_required` in `code` too, any other in `card_declined`.
fn card_error(decline_code: &str) -> Value {
    let (code, message) = if decline_code == "authentication_required" {
        (
            "authentication_required",
            "Your card was declined. This transaction requires authentication.",
        )
    } else {
        ("card_declined", "Your card was declined.")
    };
    json!({
        "type": "card_error",
        "code": code,
        "decline_code": decline_code,
        "message": message,
    })
}

const KNOWN: [&str; 6] = [
    "amount",
    "currency",
    "customer",
    "payment_method",
    "confirm",
    "off_session",
];

/// A 400 refusal, boxed (a `Response` is large for an `Err`).
fn refuse(code: &str, param: &str, message: String) -> Box<Response> {
    Box::new(invalid(code, param, message))
}

/// `NAME` of a `metadata[NAME]` parameter, whatever NAME is.
fn metadata_name(param: &str) -> Option<&str> {
    param.strip_prefix("metadata[")?.strip_suffix(']')
}

/// The parameter an error about `param` names: `metadata` for any of its keys.
fn param_name(param: &str) -> &str {
    if param.starts_with("metadata") {
        "metadata"
    } else {
        param
    }
}

/// The parameters, validated as Stripe would, sorted (the idempotency
/// fingerprint, `metadata[…]` included), or the refusal.
fn validate(body: &[u8], enforce_minimums: bool) -> Result<Vec<(String, String)>, Box<Response>> {
    let mut params: Vec<(String, String)> = url::form_urlencoded::parse(body)
        .map(|(k, v)| (k.into_owned(), v.into_owned()))
        .collect();
    for (k, _) in &params {
        if !KNOWN.contains(&k.as_str()) && !k.starts_with("metadata") {
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
                param_name(&w[0].0),
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
    for name in KNOWN {
        if get(name).is_none_or(str::is_empty) {
            return Err(refuse(
                "parameter_missing",
                name,
                format!("Missing required param: {name}."),
            ));
        }
    }
    let amount = get("amount").unwrap_or_default();
    if !amount.bytes().all(|b| b.is_ascii_digit()) {
        return Err(refuse(
            "parameter_invalid_integer",
            "amount",
            format!("Invalid integer: {amount} (a non-negative integer of minor units)"),
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
    check_amount(amount, currency, enforce_minimums)?;
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
    check_metadata(&params)?;
    Ok(params)
}

/// `amount` (all digits) within `currency`'s minimum (when enforced, else 1)
/// and [`MAX_AMOUNT`]: Stripe's `amount_too_small` / `amount_too_large`.
fn check_amount(amount: &str, currency: &str, enforce_minimums: bool) -> Result<(), Box<Response>> {
    let minimum = if enforce_minimums {
        minimum_amount(currency)
    } else {
        1
    };
    match amount.parse::<u64>() {
        Ok(a) if a < minimum => Err(refuse(
            "amount_too_small",
            "amount",
            format!("Amount must be at least {minimum} {currency} (in minor units)"),
        )),
        Ok(a) if a <= MAX_AMOUNT => Ok(()),
        _ => Err(refuse(
            "amount_too_large",
            "amount",
            format!("Amount must be no more than {MAX_AMOUNT} {currency} (in minor units)"),
        )),
    }
}

/// Stripe's limits on `metadata[NAME]=VALUE`: NAME 1..40 of `[A-Za-z0-9_]`,
/// VALUE up to 500 characters, at most 50 keys.
fn check_metadata(params: &[(String, String)]) -> Result<(), Box<Response>> {
    let refusal = |message: String| refuse("parameter_invalid_string", "metadata", message);
    let mut keys = 0;
    for (k, v) in params.iter().filter(|(k, _)| k.starts_with("metadata")) {
        let name = metadata_name(k).unwrap_or_default();
        if name.is_empty()
            || name.len() > METADATA_MAX_KEY_LEN
            || !name.bytes().all(|b| b.is_ascii_alphanumeric() || b == b'_')
        {
            return Err(refusal(format!(
                "Invalid metadata parameter {k}: keys are metadata[NAME], NAME 1 to \
                 {METADATA_MAX_KEY_LEN} characters of A-Z, a-z, 0-9 and _"
            )));
        }
        let len = v.chars().count();
        if len > METADATA_MAX_VALUE_LEN {
            return Err(refusal(format!(
                "Metadata values can have up to {METADATA_MAX_VALUE_LEN} characters, \
                 but you passed in a value that is {len} characters long ({k})"
            )));
        }
        keys += 1;
    }
    if keys > METADATA_MAX_KEYS {
        return Err(refusal(format!(
            "You can have up to {METADATA_MAX_KEYS} metadata keys, but you passed {keys}"
        )));
    }
    Ok(())
}

/// The intent's metadata from validated `params`; an empty value unsets its
/// key, as on Stripe (it stays part of the fingerprint).
fn metadata(params: &[(String, String)]) -> BTreeMap<String, String> {
    params
        .iter()
        .filter(|(_, v)| !v.is_empty())
        .filter_map(|(k, v)| Some((metadata_name(k)?.to_owned(), v.clone())))
        .collect()
}

fn value<'a>(params: &'a [(String, String)], name: &str) -> &'a str {
    params
        .iter()
        .find(|(k, _)| k == name)
        .map_or("", |(_, v)| v.as_str())
}

/// The 401 for a `/v1/*` request without the current secret key, if it is
/// one. The message masks the key presented, as Stripe does.
fn unauthorized(shared: &Shared, headers: &HeaderMap) -> Option<Box<Response>> {
    let presented = headers
        .get("authorization")
        .and_then(|v| v.to_str().ok())
        .and_then(|v| v.strip_prefix("Bearer "))
        .unwrap_or_default();
    let mut l = shared.ledger();
    if !presented.is_empty() && presented == l.secret_key {
        return None;
    }
    l.unauthorized_requests += 1;
    drop(l);
    Some(Box::new(error(
        StatusCode::UNAUTHORIZED,
        "invalid_request_error",
        None,
        None,
        &format!("Invalid API Key provided: {}", masked(presented)),
    )))
}

/// `sk_****` and, for a key long enough that it gives little away, its last
/// four characters: never the key itself.
fn masked(key: &str) -> String {
    let chars: Vec<char> = key.chars().collect();
    let tail: String = if chars.len() >= 12 {
        chars[chars.len() - 4..].iter().collect()
    } else {
        String::new()
    };
    format!("sk_****{tail}")
}

/// The `Idempotency-Key` header, if any, or the 400 for a malformed one.
fn idempotency_key(headers: &HeaderMap) -> Result<Option<String>, Box<Response>> {
    match headers.get("idempotency-key").map(|v| v.to_str()) {
        None => Ok(None),
        Some(Ok(k)) if !k.is_empty() && k.len() <= MAX_IDEMPOTENCY_KEY_LEN => {
            Ok(Some(k.to_owned()))
        }
        Some(_) => Err(Box::new(error(
            StatusCode::BAD_REQUEST,
            "idempotency_error",
            None,
            None,
            "Idempotency-Key must be 1 to 255 visible ASCII characters.",
        ))),
    }
}

/// What executing a request does to its intent.
#[derive(Debug, Clone)]
enum Effect {
    /// Succeeded (charged), answered 200 in this shape.
    Charge(Shape),
    /// Declined with this `decline_code`, answered 402.
    Decline(String),
    /// Succeeded (charged), answered 500, with the intent or not.
    StoredError { with_intent: bool },
    /// Processing (not charged yet), answered 200.
    Processing,
}

/// The body of a 200 for a charge.
#[derive(Debug, Clone, Copy)]
enum Shape {
    Intent,
    NotJson,
    NoId,
    BadId,
}

/// What `behaviour` does with a request for `payment_method`: the answer
/// given before executing (nothing charged or stored), or the execution.
fn plan(behaviour: &Behaviour, payment_method: &str) -> Result<Effect, Box<Response>> {
    Ok(match behaviour {
        Behaviour::ServerError(code) => {
            let status = StatusCode::from_u16(*code).unwrap_or(StatusCode::INTERNAL_SERVER_ERROR);
            return Err(Box::new(api_error(status)));
        }
        Behaviour::RateLimited { retry_after_secs } => {
            return Err(Box::new(rate_limited(*retry_after_secs)));
        }
        Behaviour::MissingPaymentMethod => {
            return Err(Box::new(missing(
                "payment_method",
                format!("No such PaymentMethod: '{payment_method}'"),
            )));
        }
        Behaviour::Succeed | Behaviour::Hang if payment_method == DECLINED_CARD => {
            Effect::Decline("generic_decline".to_owned())
        }
        Behaviour::Succeed | Behaviour::Hang => Effect::Charge(Shape::Intent),
        Behaviour::Decline(code) => Effect::Decline(code.clone()),
        Behaviour::StoredServerError { with_intent } => Effect::StoredError {
            with_intent: *with_intent,
        },
        Behaviour::Processing => Effect::Processing,
        Behaviour::Malformed(MalformedKind::NotJson) => Effect::Charge(Shape::NotJson),
        Behaviour::Malformed(MalformedKind::NoId) => Effect::Charge(Shape::NoId),
        Behaviour::Malformed(MalformedKind::BadId) => Effect::Charge(Shape::BadId),
        Behaviour::Malformed(MalformedKind::NulCode) => {
            Effect::Decline(NUL_DECLINE_CODE.to_owned())
        }
    })
}

fn api_error(status: StatusCode) -> Response {
    error(
        status,
        "api_error",
        None,
        None,
        "An unknown error occurred.",
    )
}

fn rate_limited(retry_after_secs: u64) -> Response {
    let mut r = error(
        StatusCode::TOO_MANY_REQUESTS,
        "rate_limit_error",
        None,
        None,
        "Too many requests",
    );
    r.headers_mut()
        .insert(header::RETRY_AFTER, HeaderValue::from(retry_after_secs));
    r
}

/// Execute `effect` on `intent` and say what Stripe answers.
fn execute(effect: &Effect, intent: &mut Intent) -> Answer {
    match effect {
        Effect::Charge(shape) => {
            intent.status = Status::Succeeded;
            charged(*shape, intent)
        }
        Effect::Decline(decline_code) => {
            intent.decline(decline_code);
            let mut e = card_error(decline_code);
            e["payment_intent"] = intent.json();
            Answer::json(StatusCode::PAYMENT_REQUIRED, &json!({ "error": e }))
        }
        Effect::StoredError { with_intent } => {
            intent.status = Status::Succeeded;
            let mut e = error_json("api_error", None, None, "An unknown error occurred.");
            if *with_intent {
                e["payment_intent"] = intent.json();
            }
            Answer::json(StatusCode::INTERNAL_SERVER_ERROR, &json!({ "error": e }))
        }
        Effect::Processing => {
            intent.status = Status::Processing;
            Answer::json(StatusCode::OK, &intent.json())
        }
    }
}

/// The 200 of a succeeded `intent`, in `shape`.
fn charged(shape: Shape, intent: &Intent) -> Answer {
    match shape {
        Shape::Intent => Answer::json(StatusCode::OK, &intent.json()),
        Shape::NotJson => Answer {
            status: StatusCode::OK,
            content_type: "text/html",
            body: "<html>upstream proxy error</html>".to_owned(),
        },
        Shape::NoId => Answer::json(
            StatusCode::OK,
            &json!({ "object": "payment_intent", "status": "succeeded" }),
        ),
        Shape::BadId => {
            let mut body = intent.json();
            body["id"] = json!("pi_bad id/../x");
            Answer::json(StatusCode::OK, &body)
        }
    }
}

/// The stored answer for `key` if it is a replay, the refusal if the key is
/// reused with other parameters or in flight; None for a new request.
fn replay_or_refusal(l: &Ledger, key: &str, params: &[(String, String)]) -> Option<Response> {
    if let Some(stored) = l.by_key.get(key) {
        if stored.params != params {
            return Some(idempotency_mismatch(key));
        }
        return Some(stored.answer.clone().into_response(true));
    }
    if l.in_flight.contains_key(key) {
        return Some(error(
            StatusCode::CONFLICT,
            "idempotency_error",
            None,
            None,
            "There is currently another in-progress request using this Idempotency-Key.",
        ));
    }
    None
}

async fn create_payment_intent(
    State(shared): State<Arc<Shared>>,
    headers: HeaderMap,
    body: Bytes,
) -> Response {
    if let Some(refusal) = unauthorized(&shared, &headers) {
        return *refusal;
    }
    let enforce_minimums = {
        let mut l = shared.ledger();
        l.create_requests += 1;
        !l.ignore_minimums
    };
    let key = match idempotency_key(&headers) {
        Ok(k) => k,
        Err(refusal) => return *refusal,
    };
    let params = match validate(&body, enforce_minimums) {
        Ok(p) => p,
        Err(refusal) => return *refusal,
    };
    let customer = value(&params, "customer");
    let (effect, mut intent, hang) = {
        let mut l = shared.ledger();
        if let Some(answer) = key
            .as_deref()
            .and_then(|k| replay_or_refusal(&l, k, &params))
        {
            return answer;
        }
        let behaviour = l
            .behaviour
            .get(customer)
            .cloned()
            .unwrap_or(Behaviour::Succeed);
        let effect = match plan(&behaviour, value(&params, "payment_method")) {
            Ok(e) => e,
            Err(answer) => return *answer,
        };
        l.next_intent += 1;
        let id = format!("pi_fake{:08}", l.next_intent);
        let intent = Intent::new(id, key.clone(), &params, l.now());
        if let Some(k) = &key {
            l.in_flight.insert(k.clone(), params.clone());
        }
        (effect, intent, behaviour == Behaviour::Hang)
    };
    let answer = execute(&effect, &mut intent);
    {
        let mut l = shared.ledger();
        l.record(intent);
        if let Some(k) = &key {
            l.in_flight.remove(k);
            l.by_key.insert(
                k.clone(),
                Stored {
                    params: params.clone(),
                    answer: answer.clone(),
                },
            );
        }
    }
    if hang {
        std::future::pending::<()>().await;
    }
    answer.into_response(false)
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

async fn retrieve_payment_intent(
    State(shared): State<Arc<Shared>>,
    Path(id): Path<String>,
    headers: HeaderMap,
) -> Response {
    if let Some(refusal) = unauthorized(&shared, &headers) {
        return *refusal;
    }
    match shared.ledger().intent(&id) {
        Some(intent) => axum::Json(intent.json()).into_response(),
        None => no_such_intent(&id),
    }
}

/// The query of a list request, validated.
#[derive(Debug)]
struct ListQuery {
    customer: Option<String>,
    created_gte: Option<i64>,
    limit: usize,
    starting_after: Option<String>,
}

fn list_query(raw: Option<&str>) -> Result<ListQuery, Box<Response>> {
    let mut q = ListQuery {
        customer: None,
        created_gte: None,
        limit: LIST_LIMIT_DEFAULT,
        starting_after: None,
    };
    for (k, v) in url::form_urlencoded::parse(raw.unwrap_or_default().as_bytes()) {
        match k.as_ref() {
            "customer" => q.customer = Some(v.into_owned()),
            "starting_after" => q.starting_after = Some(v.into_owned()),
            "created[gte]" => {
                q.created_gte = Some(v.parse().map_err(|_| {
                    refuse(
                        "parameter_invalid_integer",
                        "created[gte]",
                        format!("Invalid integer: {v}"),
                    )
                })?);
            }
            "limit" => {
                q.limit = v
                    .parse()
                    .ok()
                    .filter(|l| (1..=LIST_LIMIT_MAX).contains(l))
                    .ok_or_else(|| {
                        refuse(
                            "parameter_invalid_integer",
                            "limit",
                            format!("Invalid integer: {v} (limit is 1 to {LIST_LIMIT_MAX})"),
                        )
                    })?;
            }
            other => {
                return Err(refuse(
                    "parameter_unknown",
                    other,
                    format!("Received unknown parameter: {other}"),
                ));
            }
        }
    }
    Ok(q)
}

/// Stripe's list object of the intents `q` selects: newest first, from just
/// before `starting_after` (in that order), `limit` of them.
fn list(l: &Ledger, q: &ListQuery) -> Result<Value, Box<Response>> {
    let before = match &q.starting_after {
        Some(id) => *l.by_id.get(id).ok_or_else(|| {
            Box::new(missing(
                "starting_after",
                format!("No such payment_intent: '{id}'"),
            ))
        })?,
        None => l.intents.len(),
    };
    let mut selected = l.intents[..before].iter().rev().filter(|i| {
        q.customer.as_ref().is_none_or(|c| *c == i.customer)
            && q.created_gte.is_none_or(|gte| i.created >= gte)
    });
    let data: Vec<Value> = selected.by_ref().take(q.limit).map(Intent::json).collect();
    let has_more = selected.next().is_some();
    Ok(json!({
        "object": "list",
        "url": "/v1/payment_intents",
        "has_more": has_more,
        "data": data,
    }))
}

async fn list_payment_intents(
    State(shared): State<Arc<Shared>>,
    RawQuery(raw): RawQuery,
    headers: HeaderMap,
) -> Response {
    if let Some(refusal) = unauthorized(&shared, &headers) {
        return *refusal;
    }
    let listed = list_query(raw.as_deref()).and_then(|q| list(&shared.ledger(), &q));
    match listed {
        Ok(body) => axum::Json(body).into_response(),
        Err(refusal) => *refusal,
    }
}

async fn charges(State(shared): State<Arc<Shared>>) -> Response {
    let l = shared.ledger();
    let total: u32 = l.charges.values().sum();
    axum::Json(json!({ "by_key": l.charges, "total": total })).into_response()
}

fn form(body: &[u8]) -> HashMap<String, String> {
    url::form_urlencoded::parse(body).into_owned().collect()
}

async fn set_behaviour(State(shared): State<Arc<Shared>>, body: Bytes) -> Response {
    let form = form(&body);
    let Some(customer) = form.get("customer").filter(|c| c.starts_with("cus_")) else {
        return invalid(
            "parameter_missing",
            "customer",
            "customer (cus_…) is required".into(),
        );
    };
    let behaviour = match behaviour_from(&form) {
        Ok(b) => b,
        Err(refusal) => return *refusal,
    };
    shared
        .ledger()
        .behaviour
        .insert(customer.clone(), behaviour);
    StatusCode::NO_CONTENT.into_response()
}

/// The [`Behaviour`] a `/_test/behaviour` form names.
fn behaviour_from(form: &HashMap<String, String>) -> Result<Behaviour, Box<Response>> {
    let field = |name: &str| form.get(name).map(String::as_str);
    Ok(match field("behaviour") {
        Some("succeed") => Behaviour::Succeed,
        Some("decline") => Behaviour::Decline(
            field("decline_code")
                .unwrap_or("generic_decline")
                .to_owned(),
        ),
        Some("hang") => Behaviour::Hang,
        Some("error") => Behaviour::ServerError(500),
        Some("stored_error") => Behaviour::StoredServerError {
            with_intent: match field("with_intent") {
                None | Some("false") => false,
                Some("true") => true,
                Some(other) => {
                    return Err(refuse(
                        "parameter_invalid_boolean",
                        "with_intent",
                        format!("with_intent is true or false, not {other}"),
                    ));
                }
            },
        },
        Some("processing") => Behaviour::Processing,
        Some("missing_payment_method") => Behaviour::MissingPaymentMethod,
        Some("malformed") => Behaviour::Malformed(match field("kind") {
            Some("not_json") => MalformedKind::NotJson,
            Some("no_id") => MalformedKind::NoId,
            Some("bad_id") => MalformedKind::BadId,
            Some("nul_code") => MalformedKind::NulCode,
            _ => {
                return Err(refuse(
                    "parameter_invalid_string",
                    "kind",
                    "kind is one of not_json, no_id, bad_id, nul_code".into(),
                ));
            }
        }),
        Some("rate_limited") => Behaviour::RateLimited {
            retry_after_secs: field("retry_after").unwrap_or("1").parse().map_err(|_| {
                refuse(
                    "parameter_invalid_integer",
                    "retry_after",
                    "retry_after is a number of seconds".into(),
                )
            })?,
        },
        _ => {
            return Err(refuse(
                "parameter_invalid_string",
                "behaviour",
                "behaviour is one of succeed, decline, hang, error, stored_error, processing, \
                 missing_payment_method, malformed, rate_limited"
                    .into(),
            ));
        }
    })
}

/// Settle the processing intent `id` (see [`FakeProvider::settle_processing`]):
/// its JSON now, or the 404 / 400 for an unknown or not processing one.
fn settle(l: &mut Ledger, id: &str, succeeded: bool) -> Result<Value, Box<Response>> {
    let found = l.by_id.get(id).copied();
    let Some(intent) = found.and_then(|i| l.intents.get_mut(i)) else {
        return Err(Box::new(no_such_intent(id)));
    };
    if intent.status != Status::Processing {
        return Err(refuse(
            "payment_intent_unexpected_state",
            "intent",
            format!(
                "payment_intent {id} is {}, not processing",
                intent.status.as_str()
            ),
        ));
    }
    if succeeded {
        intent.status = Status::Succeeded;
    } else {
        intent.status = Status::RequiresPaymentMethod;
        intent.last_payment_error = Some(card_error("insufficient_funds"));
    }
    let (json, charge_key) = (intent.json(), intent.charge_key());
    if succeeded {
        *l.charges.entry(charge_key).or_default() += 1;
    }
    Ok(json)
}

async fn settle_intent(
    State(shared): State<Arc<Shared>>,
    Path(id): Path<String>,
    body: Bytes,
) -> Response {
    let succeeded = match form(&body).get("status").map(String::as_str) {
        Some("succeeded") => true,
        Some("failed") => false,
        _ => {
            return invalid(
                "parameter_invalid_string",
                "status",
                "status is succeeded or failed".into(),
            );
        }
    };
    match settle(&mut shared.ledger(), &id, succeeded) {
        Ok(intent) => axum::Json(intent).into_response(),
        Err(refusal) => *refusal,
    }
}

async fn prune_keys(State(shared): State<Arc<Shared>>) -> Response {
    shared.ledger().by_key.clear();
    StatusCode::NO_CONTENT.into_response()
}

async fn roll_key(State(shared): State<Arc<Shared>>, body: Bytes) -> Response {
    let Some(key) = form(&body).remove("secret_key").filter(|k| !k.is_empty()) else {
        return invalid(
            "parameter_missing",
            "secret_key",
            "secret_key is required".into(),
        );
    };
    shared.ledger().secret_key = key;
    StatusCode::NO_CONTENT.into_response()
}
