//! The fake provider over real HTTP: what it charges, what it stores under an
//! idempotency key, and what it refuses, as Stripe would. Here the requests
//! the tests make and the answers they read; the tests, by what they cover, in
//! the modules below.

mod declines;
mod failures;
mod idempotency;
mod intents;
mod refusals;

use fake_provider::{FakeProvider, TEST_SECRET_KEY};
use serde_json::Value;

const GOOD: &str = "amount=1200&currency=eur&customer=cus_ada&payment_method=pm_card_visa&confirm=true&off_session=true";

struct Answer {
    status: u16,
    replayed: bool,
    body: Value,
}

/// An answer as received, for bodies that are not JSON.
struct Raw {
    status: u16,
    headers: reqwest::header::HeaderMap,
    text: String,
}

impl Raw {
    fn json(self) -> Answer {
        let body = serde_json::from_str(&self.text)
            .unwrap_or_else(|e| panic!("{e}: not JSON: {}", self.text));
        Answer {
            status: self.status,
            replayed: self.headers.get("idempotent-replayed").is_some(),
            body,
        }
    }
}

async fn raw(r: reqwest::RequestBuilder) -> Raw {
    let r = r.send().await.unwrap();
    let status = r.status().as_u16();
    let headers = r.headers().clone();
    Raw {
        status,
        headers,
        text: r.text().await.unwrap(),
    }
}

async fn post_raw(p: &FakeProvider, key: Option<&str>, secret: &str, body: &str) -> Raw {
    let mut req = reqwest::Client::new()
        .post(format!("{}/v1/payment_intents", p.base_url()))
        .header("authorization", format!("Bearer {secret}"))
        .header("content-type", "application/x-www-form-urlencoded")
        .body(body.to_owned());
    if let Some(k) = key {
        req = req.header("idempotency-key", k);
    }
    raw(req).await
}

async fn post(p: &FakeProvider, key: Option<&str>, secret: &str, body: &str) -> Answer {
    post_raw(p, key, secret, body).await.json()
}

/// `GET /v1/{path}` with `secret`.
async fn get_v1(p: &FakeProvider, path: &str, secret: &str) -> Answer {
    let req = reqwest::Client::new()
        .get(format!("{}/v1/{path}", p.base_url()))
        .header("authorization", format!("Bearer {secret}"));
    raw(req).await.json()
}

/// `POST /_test/{path}` with a form; the status.
async fn control(p: &FakeProvider, path: &str, form: &str) -> u16 {
    reqwest::Client::new()
        .post(format!("{}/_test/{path}", p.base_url()))
        .header("content-type", "application/x-www-form-urlencoded")
        .body(form.to_owned())
        .send()
        .await
        .unwrap()
        .status()
        .as_u16()
}

async fn charge(p: &FakeProvider, key: &str, body: &str) -> Answer {
    post(p, Some(key), TEST_SECRET_KEY, body).await
}

/// The body of a charge of `amount` minor units of `currency` for `customer`.
fn charge_of(customer: &str, amount: u64, currency: &str) -> String {
    format!(
        "amount={amount}&currency={currency}&customer={customer}&payment_method=pm_card_visa&confirm=true&off_session=true"
    )
}
