//! The fake provider over real HTTP: what it charges, what it stores under an
//! idempotency key, and what it refuses, as Stripe would.

use std::time::Duration;

use fake_provider::{Behaviour, FakeProvider, TEST_SECRET_KEY};
use serde_json::Value;

const GOOD: &str = "amount=1200&currency=eur&customer=cus_ada&payment_method=pm_card_visa&confirm=true&off_session=true";

struct Answer {
    status: u16,
    replayed: bool,
    body: Value,
}

async fn post(p: &FakeProvider, key: Option<&str>, secret: &str, body: &str) -> Answer {
    let mut req = reqwest::Client::new()
        .post(format!("{}/v1/payment_intents", p.base_url()))
        .header("authorization", format!("Bearer {secret}"))
        .header("content-type", "application/x-www-form-urlencoded")
        .body(body.to_owned());
    if let Some(k) = key {
        req = req.header("idempotency-key", k);
    }
    let r = req.send().await.unwrap();
    let status = r.status().as_u16();
    let replayed = r.headers().get("idempotent-replayed").is_some();
    let body = serde_json::from_str(&r.text().await.unwrap()).unwrap();
    Answer {
        status,
        replayed,
        body,
    }
}

async fn charge(p: &FakeProvider, key: &str, body: &str) -> Answer {
    post(p, Some(key), TEST_SECRET_KEY, body).await
}

#[tokio::test]
async fn a_charge_succeeds_and_is_counted_under_its_key() {
    let p = FakeProvider::start().await.unwrap();
    let a = charge(&p, "k1", GOOD).await;
    assert_eq!(a.status, 200, "{}", a.body);
    assert_eq!(a.body["object"], "payment_intent");
    assert_eq!(a.body["status"], "succeeded");
    assert_eq!(a.body["amount"], 1200);
    assert!(a.body["id"].as_str().unwrap().starts_with("pi_"));
    assert_eq!(p.charges().get("k1"), Some(&1));
    let over_http: Value = serde_json::from_str(
        &reqwest::get(format!("{}/_test/charges", p.base_url()))
            .await
            .unwrap()
            .text()
            .await
            .unwrap(),
    )
    .unwrap();
    assert_eq!(over_http["total"], 1);
    assert_eq!(over_http["by_key"]["k1"], 1);
}

#[tokio::test]
async fn the_same_key_and_parameters_answer_the_stored_result_without_charging_again() {
    let p = FakeProvider::start().await.unwrap();
    let first = charge(&p, "k1", GOOD).await;
    // The same parameters in another order are the same request.
    let reordered = "off_session=true&confirm=true&payment_method=pm_card_visa&customer=cus_ada&currency=eur&amount=1200";
    let again = charge(&p, "k1", reordered).await;
    assert_eq!(again.status, 200);
    assert!(again.replayed);
    assert_eq!(again.body["id"], first.body["id"]);
    assert_eq!(p.total_charges(), 1);
}

#[tokio::test]
async fn the_same_key_with_another_amount_is_refused_as_stripe_refuses_it() {
    let p = FakeProvider::start().await.unwrap();
    charge(&p, "k1", GOOD).await;
    let other = GOOD.replace("amount=1200", "amount=1300");
    let a = charge(&p, "k1", &other).await;
    assert_eq!(a.status, 400);
    assert_eq!(a.body["error"]["type"], "idempotency_error");
    assert_eq!(p.total_charges(), 1);
    assert_eq!(p.charges().get("k1"), Some(&1));
}

#[tokio::test]
async fn a_declining_customer_answers_402_card_declined_with_its_code_and_the_decline_is_stored() {
    let p = FakeProvider::start().await.unwrap();
    p.set_behaviour("cus_ada", Behaviour::Decline("insufficient_funds".into()));
    let a = charge(&p, "k1", GOOD).await;
    assert_eq!(a.status, 402);
    assert_eq!(a.body["error"]["type"], "card_error");
    assert_eq!(a.body["error"]["code"], "card_declined");
    assert_eq!(a.body["error"]["decline_code"], "insufficient_funds");
    // The decline is the key's result, even once the customer would succeed.
    p.set_behaviour("cus_ada", Behaviour::Succeed);
    let again = charge(&p, "k1", GOOD).await;
    assert_eq!((again.status, again.replayed), (402, true));
    assert_eq!(p.total_charges(), 0);
}

#[tokio::test]
async fn a_hanging_customer_is_charged_once_and_a_retry_with_the_key_answers_the_charge() {
    let p = FakeProvider::start().await.unwrap();
    p.set_behaviour("cus_ada", Behaviour::Hang);
    let hung = reqwest::Client::builder()
        .timeout(Duration::from_millis(300))
        .build()
        .unwrap()
        .post(format!("{}/v1/payment_intents", p.base_url()))
        .header("authorization", format!("Bearer {TEST_SECRET_KEY}"))
        .header("idempotency-key", "k1")
        .body(GOOD)
        .send()
        .await;
    assert!(hung.unwrap_err().is_timeout());
    assert_eq!(p.charges().get("k1"), Some(&1));
    p.set_behaviour("cus_ada", Behaviour::Succeed);
    let retry = charge(&p, "k1", GOOD).await;
    assert_eq!((retry.status, retry.replayed), (200, true));
    assert_eq!(p.total_charges(), 1);
}

#[tokio::test]
async fn a_5xx_customer_is_not_charged_and_the_key_stays_usable() {
    let p = FakeProvider::start().await.unwrap();
    p.set_behaviour("cus_ada", Behaviour::ServerError(503));
    let a = charge(&p, "k1", GOOD).await;
    assert_eq!(a.status, 503);
    assert_eq!(a.body["error"]["type"], "api_error");
    assert_eq!(p.total_charges(), 0);
    assert!(!p.has_result("k1"));
    p.set_behaviour("cus_ada", Behaviour::Succeed);
    assert_eq!(charge(&p, "k1", GOOD).await.status, 200);
    assert_eq!(p.total_charges(), 1);
}

#[tokio::test]
async fn what_stripe_refuses_is_refused_naming_the_parameter_and_nothing_is_charged() {
    let p = FakeProvider::start().await.unwrap();
    let cases: Vec<(String, &str, &str)> = vec![
        (
            GOOD.replace("amount=1200&", ""),
            "parameter_missing",
            "amount",
        ),
        (
            GOOD.replace("amount=1200", "amount=12.00"),
            "parameter_invalid_integer",
            "amount",
        ),
        (
            GOOD.replace("amount=1200", "amount=0"),
            "parameter_invalid_integer",
            "amount",
        ),
        (
            GOOD.replace("currency=eur", "currency=EURO"),
            "parameter_invalid_string",
            "currency",
        ),
        (
            GOOD.replace("cus_ada", "ada"),
            "resource_missing",
            "customer",
        ),
        (
            GOOD.replace("pm_card_visa", "card_visa"),
            "resource_missing",
            "payment_method",
        ),
        (
            GOOD.replace("confirm=true", "confirm=false"),
            "parameter_invalid_boolean",
            "confirm",
        ),
        (
            GOOD.replace("&off_session=true", ""),
            "parameter_missing",
            "off_session",
        ),
        (
            format!("{GOOD}&amount_cents=1200"),
            "parameter_unknown",
            "amount_cents",
        ),
    ];
    for (i, (body, code, param)) in cases.iter().enumerate() {
        let a = charge(&p, &format!("bad{i}"), body).await;
        assert_eq!(a.status, 400, "{body}: {}", a.body);
        assert_eq!(a.body["error"]["type"], "invalid_request_error", "{body}");
        assert_eq!(a.body["error"]["code"], *code, "{body}");
        assert_eq!(a.body["error"]["param"], *param, "{body}");
        // Refused by validation: nothing stored, the key stays usable.
        assert!(!p.has_result(&format!("bad{i}")));
    }
    let long = "k".repeat(256);
    let a = charge(&p, &long, GOOD).await;
    assert_eq!(
        (a.status, a.body["error"]["type"].as_str()),
        (400, Some("idempotency_error"))
    );
    assert_eq!(charge(&p, &"k".repeat(255), GOOD).await.status, 200);
    let a = post(&p, Some("k2"), "sk_test_wrong", GOOD).await;
    assert_eq!(a.status, 401);
    assert_eq!(p.total_charges(), 1);
}

#[tokio::test]
async fn the_behaviour_can_be_set_over_http_for_the_local_run() {
    let p = FakeProvider::start().await.unwrap();
    let r = reqwest::Client::new()
        .post(format!("{}/_test/behaviour", p.base_url()))
        .body("customer=cus_ada&behaviour=decline&decline_code=expired_card")
        .send()
        .await
        .unwrap();
    assert_eq!(r.status().as_u16(), 204);
    let a = charge(&p, "k1", GOOD).await;
    assert_eq!(a.body["error"]["decline_code"], "expired_card");
}
