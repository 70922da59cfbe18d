//! The payment provider client: Stripe's PaymentIntents API over reqwest.
//!
//! An off-session charge of the customer's saved card is one
//! `POST {base}/v1/payment_intents`, form-encoded, with an `Idempotency-Key`
//! fixed by (invoice, attempt sequence): a retry of the same attempt (the
//! reconciler's lookup) is the same request with the same key and cannot
//! charge twice. The secret key is sent only as the bearer token; it is never
//! in a log, an error or a `Debug` output ([`SecretKey`]).

use std::fmt;
use std::time::Duration;

/// A provider secret key (`sk_…`). `Debug` and `Display` redact it.
#[derive(Clone, PartialEq, Eq)]
pub struct SecretKey(String);

impl SecretKey {
    pub fn new(key: impl Into<String>) -> SecretKey {
        SecretKey(key.into())
    }

    pub(crate) fn expose(&self) -> &str {
        &self.0
    }
}

impl fmt::Debug for SecretKey {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str("SecretKey(redacted)")
    }
}

/// Where and how billing charges.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct ProviderConfig {
    /// `https://api.stripe.com` or the fake provider's `http://127.0.0.1:PORT`.
    pub base_url: String,
    pub secret_key: SecretKey,
    /// One call's whole budget (connect, send, answer). Default 30 s.
    pub timeout: Duration,
}

impl ProviderConfig {
    pub const DEFAULT_TIMEOUT: Duration = Duration::from_secs(30);

    pub fn new(base_url: impl Into<String>, secret_key: SecretKey) -> ProviderConfig {
        ProviderConfig {
            base_url: base_url.into(),
            secret_key,
            timeout: ProviderConfig::DEFAULT_TIMEOUT,
        }
    }
}

/// The Idempotency-Key of attempt `attempt_seq` of invoice `invoice_id`.
pub fn idempotency_key(invoice_id: i64, attempt_seq: i32) -> String {
    format!("hardcount-invoice-{invoice_id}-attempt-{attempt_seq}")
}

/// What is charged: an invoice's amount to its customer's saved card.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct PaymentRequest {
    pub invoice_id: i64,
    /// Integer minor units.
    pub amount: i64,
    /// ISO 4217 as stored (upper case); sent lower case.
    pub currency: String,
    /// `cus_…`
    pub customer: String,
    /// `pm_…`
    pub payment_method: String,
}

/// What the provider said about one attempt.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum ChargeOutcome {
    /// Charged: the PaymentIntent `pi_…` succeeded.
    Succeeded { payment_intent: String },
    /// Definitely not charged: a 402 decline (`decline_code`, else `code`), or
    /// a 4xx refusal of the request itself (its `error.code`).
    Declined {
        code: String,
        payment_intent: Option<String>,
    },
    /// Not known whether it charged: a timeout, a 5xx, a connection error, a
    /// 409/429, an answer that could not be read. Settled by the reconciler.
    Unknown { reason: String },
}

/// The client. Cheap to clone.
#[derive(Clone)]
pub struct Provider {
    client: reqwest::Client,
    config: ProviderConfig,
}

impl fmt::Debug for Provider {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("Provider")
            .field("config", &self.config)
            .finish_non_exhaustive()
    }
}

impl Provider {
    /// # Errors
    /// The HTTP client could not be built (no TLS roots); the message names
    /// neither the key nor the request.
    pub fn new(config: ProviderConfig) -> Result<Provider, String> {
        let client = reqwest::Client::builder()
            .timeout(config.timeout)
            .redirect(reqwest::redirect::Policy::none())
            .build()
            .map_err(|e| format!("payment provider client: {e}"))?;
        Ok(Provider { client, config })
    }

    pub fn config(&self) -> &ProviderConfig {
        &self.config
    }

    /// Charge `req` off session as attempt `attempt_seq`, under its
    /// idempotency key. Never errors: what cannot be known is
    /// [`ChargeOutcome::Unknown`].
    ///
    /// # Cancel safety
    /// Dropped mid-call, the charge may or may not have happened; the
    /// attempt row written before the call is what the reconciler settles.
    pub async fn create_payment_intent(
        &self,
        req: &PaymentRequest,
        attempt_seq: i32,
    ) -> ChargeOutcome {
        let key = idempotency_key(req.invoice_id, attempt_seq);
        self.payment_intent_with_key(req, &key).await
    }

    /// The same request under an explicit `Idempotency-Key`. This is also
    /// the **lookup by key** (docs/adr/0012): Stripe has no endpoint that
    /// finds a request by its key, but the same key with the same parameters
    /// answers the stored result without charging again (within Stripe's
    /// 24-hour key window), and executes the charge once if the first request
    /// never ran.
    pub async fn payment_intent_with_key(&self, req: &PaymentRequest, key: &str) -> ChargeOutcome {
        let body = url::form_urlencoded::Serializer::new(String::new())
            .append_pair("amount", &req.amount.to_string())
            .append_pair("currency", &req.currency.to_ascii_lowercase())
            .append_pair("customer", &req.customer)
            .append_pair("payment_method", &req.payment_method)
            .append_pair("confirm", "true")
            .append_pair("off_session", "true")
            .finish();
        let url = format!(
            "{}/v1/payment_intents",
            self.config.base_url.trim_end_matches('/')
        );
        let sent = self
            .client
            .post(url)
            .bearer_auth(self.config.secret_key.expose())
            .header("idempotency-key", key)
            .header("content-type", "application/x-www-form-urlencoded")
            .body(body)
            .send()
            .await;
        let response = match sent {
            Ok(r) => r,
            Err(e) => {
                return ChargeOutcome::Unknown {
                    reason: describe(e),
                };
            }
        };
        let status = response.status().as_u16();
        let text = match response.text().await {
            Ok(t) => t,
            Err(e) => {
                return ChargeOutcome::Unknown {
                    reason: describe(e),
                };
            }
        };
        classify(status, &text)
    }
}

/// The reason prefixes of an unknown outcome that says the provider is down
/// (no connection, or a 5xx), as opposed to one slow or odd answer.
const OUTAGE: [&str; 2] = ["connection failed", "HTTP 5"];

impl ChargeOutcome {
    /// Whether this answer says the provider is down: the connection was
    /// refused or failed, or it answered 5xx. A timeout is not counted: the
    /// call may have reached a slow provider.
    pub fn is_outage(&self) -> bool {
        matches!(self, ChargeOutcome::Unknown { reason } if is_outage_reason(reason))
    }
}

/// [`ChargeOutcome::is_outage`] on the reason an unknown outcome recorded.
pub fn is_outage_reason(reason: &str) -> bool {
    OUTAGE.iter().any(|p| reason.starts_with(p))
}

/// A transport error without the URL's secrets (there are none in the URL,
/// but the key is never in reqwest's errors either: it is a header).
fn describe(e: reqwest::Error) -> String {
    let kind = if e.is_timeout() {
        "timed out"
    } else if e.is_connect() {
        "connection failed"
    } else {
        "request failed"
    };
    format!("{kind}: {}", e.without_url())
}

/// An answer's meaning, by status and Stripe's error body.
pub(crate) fn classify(status: u16, body: &str) -> ChargeOutcome {
    let json: serde_json::Value = serde_json::from_str(body).unwrap_or_default();
    let s = |v: &serde_json::Value| v.as_str().map(str::to_owned);
    match status {
        200..=299 => match (s(&json["id"]), s(&json["status"])) {
            (Some(id), Some(st)) if st == "succeeded" && id.starts_with("pi_") => {
                ChargeOutcome::Succeeded { payment_intent: id }
            }
            (id, st) => ChargeOutcome::Unknown {
                reason: format!("HTTP {status}: payment intent {id:?} in status {st:?}"),
            },
        },
        402 => ChargeOutcome::Declined {
            code: s(&json["error"]["decline_code"])
                .or_else(|| s(&json["error"]["code"]))
                .unwrap_or_else(|| "card_declined".to_owned()),
            payment_intent: s(&json["error"]["payment_intent"]["id"]),
        },
        // Another request with this key is in flight, or rate-limited: try again later.
        409 | 429 => ChargeOutcome::Unknown {
            reason: format!(
                "HTTP {status}: {}",
                s(&json["error"]["type"]).unwrap_or_default()
            ),
        },
        400..=499 => ChargeOutcome::Declined {
            code: s(&json["error"]["code"])
                .or_else(|| s(&json["error"]["type"]))
                .unwrap_or_else(|| format!("http_{status}")),
            payment_intent: None,
        },
        _ => ChargeOutcome::Unknown {
            // "HTTP 5…" is an outage (`is_outage_reason`).
            reason: format!("HTTP {status} from the payment provider"),
        },
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_secret_key_is_redacted_from_debug() {
        let c = ProviderConfig::new("http://127.0.0.1:1", SecretKey::new("sk_test_very_secret"));
        let p = Provider::new(c.clone()).unwrap();
        for shown in [format!("{c:?}"), format!("{p:?}")] {
            assert!(!shown.contains("very_secret"), "{shown}");
        }
    }

    #[test]
    fn answers_are_classified_as_stripe_means_them() {
        let cases = [
            (200, r#"{"id":"pi_1","status":"succeeded"}"#, "succeeded"),
            (200, r#"{"id":"pi_1","status":"processing"}"#, "unknown"),
            (
                402,
                r#"{"error":{"code":"card_declined","decline_code":"insufficient_funds"}}"#,
                "declined:insufficient_funds",
            ),
            (
                400,
                r#"{"error":{"type":"idempotency_error"}}"#,
                "declined:idempotency_error",
            ),
            (409, r#"{"error":{"type":"idempotency_error"}}"#, "unknown"),
            (500, "", "unknown"),
            (503, "<html>", "unknown"),
        ];
        for (status, body, want) in cases {
            let got = match classify(status, body) {
                ChargeOutcome::Succeeded { .. } => "succeeded".to_owned(),
                ChargeOutcome::Declined { code, .. } => format!("declined:{code}"),
                ChargeOutcome::Unknown { .. } => "unknown".to_owned(),
            };
            assert_eq!(got, want, "{status} {body}");
        }
    }
}
