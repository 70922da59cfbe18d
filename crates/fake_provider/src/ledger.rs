//! The provider's record: intents, stored answers by idempotency key, the
//! counters the tests read, and the lock that guards them.

use super::*;

/// The statuses a fake intent can have.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) enum Status {
    Succeeded,
    Processing,
    RequiresAction,
    RequiresPaymentMethod,
}

impl Status {
    pub(crate) fn as_str(self) -> &'static str {
        match self {
            Status::Succeeded => "succeeded",
            Status::Processing => "processing",
            Status::RequiresAction => "requires_action",
            Status::RequiresPaymentMethod => "requires_payment_method",
        }
    }
}

/// A payment intent the fake created; kept forever, whatever its key's fate.
#[derive(Debug, Clone)]
pub(crate) struct Intent {
    pub(crate) id: String,
    pub(crate) key: Option<String>,
    pub(crate) amount: u64,
    pub(crate) currency: String,
    pub(crate) customer: String,
    pub(crate) payment_method: String,
    pub(crate) status: Status,
    pub(crate) created: i64,
    pub(crate) metadata: BTreeMap<String, String>,
    pub(crate) last_payment_error: Option<Value>,
}

impl Intent {
    /// A new intent for validated `params`, not yet executed.
    pub(crate) fn new(
        id: String,
        key: Option<String>,
        params: &[(String, String)],
        created: i64,
    ) -> Intent {
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
    pub(crate) fn json(&self) -> Value {
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

    pub(crate) fn view(&self) -> IntentView {
        IntentView {
            id: self.id.clone(),
            key: self.key.clone(),
            customer: self.customer.clone(),
            payment_method: self.payment_method.clone(),
            amount: self.amount,
            currency: self.currency.clone(),
            status: self.status.as_str().to_owned(),
            metadata: self.metadata.clone(),
        }
    }

    /// Declined with `decline_code`: needs another payment method.
    pub(crate) fn decline(&mut self, decline_code: &str) {
        self.status = Status::RequiresPaymentMethod;
        self.last_payment_error = Some(card_error(decline_code));
    }

    /// The charge's key in [`FakeProvider::charges`]: its key, else its id.
    pub(crate) fn charge_key(&self) -> String {
        self.key.clone().unwrap_or_else(|| self.id.clone())
    }
}

/// An answer as sent, so that a stored one replays byte for byte.
#[derive(Debug, Clone)]
pub(crate) struct Answer {
    pub(crate) status: StatusCode,
    pub(crate) content_type: &'static str,
    pub(crate) body: String,
}

impl Answer {
    pub(crate) fn json(status: StatusCode, body: &Value) -> Answer {
        Answer {
            status,
            content_type: "application/json",
            body: body.to_string(),
        }
    }

    pub(crate) fn into_response(self, replayed: bool) -> Response {
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
pub(crate) struct Stored {
    pub(crate) params: Vec<(String, String)>,
    pub(crate) answer: Answer,
}

#[derive(Debug, Default)]
pub(crate) struct Ledger {
    pub(crate) secret_key: String,
    pub(crate) behaviour: HashMap<String, Behaviour>,
    pub(crate) by_key: HashMap<String, Stored>,
    pub(crate) in_flight: HashMap<String, Vec<(String, String)>>,
    pub(crate) charges: BTreeMap<String, u32>,
    pub(crate) next_intent: u64,
    /// This fake's part of every intent id (`pi_fake{run}_{n}`): a database
    /// kept across restarts (`hardcount dev`, compose) never sees an id
    /// twice, as it never would from the provider (docs/adr/0122).
    pub(crate) run: String,
    /// Every intent created, in creation order; `by_id` indexes it.
    pub(crate) intents: Vec<Intent>,
    pub(crate) by_id: HashMap<String, usize>,
    pub(crate) create_requests: u32,
    /// `GET /v1/payment_intents` requests that passed authentication.
    pub(crate) list_requests: u32,
    /// Requests of any route refused with 401.
    pub(crate) unauthorized_requests: u32,
    pub(crate) ignore_minimums: bool,
    /// Customers deleted at the provider: a list filtered by one is refused
    /// with 404 `resource_missing` on `customer`.
    pub(crate) deleted_customers: std::collections::HashSet<String>,
    /// A 200 body every list answers instead of the list (a proxy or
    /// gateway in the way); `None`: the list.
    pub(crate) list_body: Option<String>,
    pub(crate) clock_offset_secs: u64,
    /// How long a create request waits before it is handled (zero: none).
    pub(crate) latency: std::time::Duration,
    /// Create requests waiting out `latency` now, and the most at once.
    pub(crate) answering: usize,
    pub(crate) most_answering: usize,
}

/// A fake's `run`, unique among the fakes of this machine's processes: the
/// start time in nanoseconds, and a count within the process.
pub(crate) fn run_id() -> String {
    static STARTED: std::sync::atomic::AtomicU64 = std::sync::atomic::AtomicU64::new(0);
    let nanos = SystemTime::now()
        .duration_since(UNIX_EPOCH)
        .map_or(0, |d| d.as_nanos());
    let n = STARTED.fetch_add(1, std::sync::atomic::Ordering::Relaxed);
    format!("{nanos:x}{n:x}")
}

impl Ledger {
    /// Unix seconds on the fake's clock (the real one, advanced by tests).
    pub(crate) fn now(&self) -> i64 {
        let real = SystemTime::now()
            .duration_since(UNIX_EPOCH)
            .map_or(0, |d| d.as_secs());
        i64::try_from(real.saturating_add(self.clock_offset_secs)).unwrap_or(i64::MAX)
    }

    pub(crate) fn intent(&self, id: &str) -> Option<&Intent> {
        self.by_id.get(id).and_then(|&i| self.intents.get(i))
    }

    /// Keep `intent`, counting its charge if it succeeded.
    pub(crate) fn record(&mut self, intent: Intent) {
        if intent.status == Status::Succeeded {
            *self.charges.entry(intent.charge_key()).or_default() += 1;
        }
        self.by_id.insert(intent.id.clone(), self.intents.len());
        self.intents.push(intent);
    }
}

pub(crate) struct Shared {
    pub(crate) ledger: Mutex<Ledger>,
}

impl Shared {
    pub(crate) fn ledger(&self) -> std::sync::MutexGuard<'_, Ledger> {
        self.ledger.lock().unwrap_or_else(|p| p.into_inner())
    }
}
