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
//!      stored_rate_limited           ──▶ charged, then 429 rate_limit_error, code lock_timeout
//!      processing                    ──▶ 200 status processing (charged only once settled)
//!      requires_action               ──▶ 200 status requires_action (charged only once the
//!                                        customer completes it: settled as succeeded)
//!      malformed not_json|no_id|bad_id ─▶ charged, 200 with a body billing cannot trust
//!      malformed nul_code            ──▶ 402 card_error, decline_code "gen\u0000eric"
//!      hang                          ──▶ charged and stored, then no answer ever
//!      otherwise                     ──▶ 200 payment_intent status succeeded (charged)
//!  GET  /v1/payment_intents/{id}     the intent as it is now, or 404 resource_missing param intent
//!  GET  /v1/payment_intents?customer=cus_…&created[gte]=UNIX&limit=1..100&starting_after=pi_…
//!                                    counted by list_requests()
//!                                    {"object":"list","url","has_more","data"} newest first;
//!                                    (200 with FakeProvider::set_list_body's body instead, if set);
//!                                    a deleted customer (FakeProvider::delete_customer):
//!                                    404 resource_missing, param customer
//!  GET  /_test/charges               {"by_key": {key: n}, "total": n}   (successful charges)
//!  POST /_test/behaviour             customer=cus_…&behaviour=succeed|decline|hang|error|
//!                                    stored_error|processing|requires_action|
//!                                    missing_payment_method|malformed|
//!                                    rate_limited|stored_rate_limited [&decline_code=…][&with_intent=true]
//!                                    [&kind=not_json|no_id|bad_id|nul_code][&retry_after=N]
//!  POST /_test/intents/{id}/settle   status=succeeded|failed   (a processing intent, or one
//!                                    requiring action: the customer completes it or fails)
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
//! the 500 Stripe stores, and [`Behaviour::StoredRateLimited`] the 429 it
//! stores (a lock timeout after execution began) where its rate limiter's
//! 429 ([`Behaviour::RateLimited`]) stores nothing.
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

mod api;
mod control;
mod errors;
mod ledger;
mod validate;

pub(crate) use ledger::{Answer, Intent, Ledger, Shared, Status, Stored};

use api::*;
use control::*;
use errors::*;
use validate::*;

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
    /// Create the intent as `requires_action` (the bank asks the customer to
    /// authenticate) and answer 200 with it: nothing charged until the
    /// customer completes it, which [`FakeProvider::settle_processing`] plays.
    RequiresAction,
    /// 404 `resource_missing` on `payment_method`: nothing charged or stored.
    MissingPaymentMethod,
    /// Execute, then answer (and store) a body a client must not trust.
    Malformed(MalformedKind),
    /// 429 `rate_limit_error` with `Retry-After`: nothing charged or stored.
    RateLimited {
        retry_after_secs: u64,
    },
    /// Charge, then store and answer 429 `rate_limit_error` with code
    /// `lock_timeout`: a lock timed out once execution had begun, so the
    /// answer is saved under the key and replayed (Stripe saves a result once
    /// an endpoint begins executing, https://docs.stripe.com/api/idempotent_requests).
    StoredRateLimited,
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
    /// `pm_…`, as requested.
    pub payment_method: String,
    /// As requested: the provider's minor units (ISK in hundredths, MGA whole).
    pub amount: u64,
    /// Lower case, as requested.
    pub currency: String,
    /// `succeeded`, `processing`, `requires_action` or
    /// `requires_payment_method`, as now.
    pub status: String,
    pub metadata: BTreeMap<String, String>,
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
                run: ledger::run_id(),
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

    /// Delete `customer` (`cus_…`) at the provider: from now on a list of
    /// payment intents filtered by it is refused with 404 `resource_missing`
    /// on `customer`. Its intents and charges stay counted.
    pub fn delete_customer(&self, customer: &str) {
        self.shared
            .ledger()
            .deleted_customers
            .insert(customer.to_owned());
    }

    /// Answer every list of payment intents from now on with 200 and `body`
    /// instead of the list (a proxy or gateway in the way); `None` lists
    /// again. Still counted by [`FakeProvider::list_requests`].
    pub fn set_list_body(&self, body: Option<&str>) {
        self.shared.ledger().list_body = body.map(str::to_owned);
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

    /// Move the `processing` or `requires_action` intent `intent_id` to
    /// `succeeded` (counted in [`FakeProvider::charges`] under its key from
    /// then on) or, when not `succeeded`, to `requires_payment_method`
    /// declined for `insufficient_funds`. False when no such intent is in
    /// either state.
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

    /// `GET /v1/payment_intents` (list) requests that passed authentication.
    pub fn list_requests(&self) -> u32 {
        self.shared.ledger().list_requests
    }

    /// Requests of any route refused with 401 (a wrong or rolled key).
    pub fn unauthorized_requests(&self) -> u32 {
        self.shared.ledger().unauthorized_requests
    }

    /// Every create request waits this long before it is handled, as over a
    /// network; zero (the default) answers at once.
    pub fn set_latency(&self, latency: std::time::Duration) {
        self.shared.ledger().latency = latency;
    }

    /// The most create requests that were waiting out the latency at once
    /// (see [`set_latency`](Self::set_latency)): how many calls a client had
    /// open together.
    pub fn most_at_once(&self) -> usize {
        self.shared.ledger().most_answering
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
