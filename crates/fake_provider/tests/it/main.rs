//! The fake provider over real HTTP: what it charges, what it stores under an
//! idempotency key, and what it refuses, as Stripe would.

use std::time::Duration;

use fake_provider::{Behaviour, FakeProvider, MalformedKind, TEST_SECRET_KEY};
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
            "amount_too_small",
            "amount",
        ),
        (
            GOOD.replace("amount=1200", "amount=100000000"),
            "amount_too_large",
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

/// The body of a charge of `amount` minor units of `currency` for `customer`.
fn charge_of(customer: &str, amount: u64, currency: &str) -> String {
    format!(
        "amount={amount}&currency={currency}&customer={customer}&payment_method=pm_card_visa&confirm=true&off_session=true"
    )
}

#[tokio::test]
async fn a_payment_intent_carries_every_field_the_client_reads() {
    let p = FakeProvider::start().await.unwrap();
    let a = charge(&p, "k1", GOOD).await;
    let pi = &a.body;
    assert_eq!(pi["object"], "payment_intent");
    assert_eq!(
        (pi["amount"].as_u64(), pi["currency"].as_str()),
        (Some(1200), Some("eur"))
    );
    assert_eq!(pi["customer"], "cus_ada");
    assert_eq!(pi["payment_method"], "pm_card_visa");
    assert!(pi["created"].as_i64().unwrap() > 1_700_000_000, "{pi}");
    assert_eq!(pi["metadata"], serde_json::json!({}));
    assert!(pi["last_payment_error"].is_null());
    let got = get_v1(
        &p,
        &format!("payment_intents/{}", pi["id"].as_str().unwrap()),
        TEST_SECRET_KEY,
    )
    .await;
    assert_eq!((got.status, &got.body), (200, pi));
}

#[tokio::test]
async fn a_pruned_key_is_a_new_request_and_charges_again() {
    let p = FakeProvider::start().await.unwrap();
    let first = charge(&p, "k1", GOOD).await;
    let replay = charge(&p, "k1", GOOD).await;
    assert!(replay.replayed);
    assert_eq!(p.charges().get("k1"), Some(&1));
    assert_eq!(control(&p, "prune_keys", "").await, 204);
    assert!(!p.has_result("k1"));
    let again = charge(&p, "k1", GOOD).await;
    assert_eq!((again.status, again.replayed), (200, false));
    assert_ne!(again.body["id"], first.body["id"]);
    // The danger the billing side must avoid: the same key charged twice.
    assert_eq!(p.charges().get("k1"), Some(&2));
    assert_eq!(p.intents().len(), 2);
    assert_eq!(p.create_requests(), 3, "replays are requests too");
    // The method prunes the same way; the intents stay.
    p.prune_keys();
    assert!(!charge(&p, "k1", GOOD).await.replayed);
    assert_eq!((p.total_charges(), p.intents().len()), (3, 3));
}

#[tokio::test]
async fn a_stored_500_is_charged_once_and_replayed_with_the_header() {
    let p = FakeProvider::start().await.unwrap();
    p.set_behaviour(
        "cus_ada",
        Behaviour::StoredServerError { with_intent: false },
    );
    let a = charge(&p, "k1", GOOD).await;
    assert_eq!((a.status, a.replayed), (500, false));
    assert_eq!(a.body["error"]["type"], "api_error");
    assert_eq!(a.body["error"]["message"], "An unknown error occurred.");
    assert!(a.body["error"].get("payment_intent").is_none());
    assert_eq!(
        p.charges().get("k1"),
        Some(&1),
        "it executed before the 500"
    );
    assert!(p.has_result("k1"));
    p.set_behaviour("cus_ada", Behaviour::Succeed);
    let again = charge(&p, "k1", GOOD).await;
    assert_eq!((again.status, again.replayed), (500, true));
    assert_eq!(again.body, a.body);
    assert_eq!(p.total_charges(), 1);
}

#[tokio::test]
async fn a_stored_500_with_its_intent_carries_the_intent_id() {
    let p = FakeProvider::start().await.unwrap();
    let form = "customer=cus_ada&behaviour=stored_error&with_intent=true";
    assert_eq!(control(&p, "behaviour", form).await, 204);
    let a = charge(&p, "k1", GOOD).await;
    assert_eq!(a.status, 500);
    let pi = &a.body["error"]["payment_intent"];
    assert_eq!(pi["id"].as_str(), Some(p.intents()[0].id.as_str()));
    assert_eq!(pi["status"], "succeeded");
    let got = get_v1(
        &p,
        &format!("payment_intents/{}", pi["id"].as_str().unwrap()),
        TEST_SECRET_KEY,
    )
    .await;
    assert_eq!(
        (got.status, got.body["status"].as_str()),
        (200, Some("succeeded"))
    );
    assert_eq!(
        charge(&p, "k1", GOOD).await.body["error"]["payment_intent"]["id"],
        pi["id"]
    );
    assert_eq!(p.total_charges(), 1);
}

#[tokio::test]
async fn a_processing_intent_is_charged_once_it_settles_as_succeeded() {
    let p = FakeProvider::start().await.unwrap();
    assert_eq!(
        control(&p, "behaviour", "customer=cus_ada&behaviour=processing").await,
        204
    );
    let a = charge(&p, "k1", GOOD).await;
    assert_eq!(
        (a.status, a.body["status"].as_str()),
        (200, Some("processing"))
    );
    assert_eq!(p.total_charges(), 0);
    let id = a.body["id"].as_str().unwrap().to_owned();
    assert_eq!(
        control(&p, &format!("intents/{id}/settle"), "status=succeeded").await,
        200
    );
    let got = get_v1(&p, &format!("payment_intents/{id}"), TEST_SECRET_KEY).await;
    assert_eq!(got.body["status"], "succeeded");
    assert!(got.body["last_payment_error"].is_null());
    assert_eq!(p.charges().get("k1"), Some(&1));
    // The key's stored answer is what was answered: still processing.
    let again = charge(&p, "k1", GOOD).await;
    assert_eq!(
        (again.replayed, again.body["status"].as_str()),
        (true, Some("processing"))
    );
    // Settled once only.
    assert!(!p.settle_processing(&id, true));
    assert_eq!(
        control(&p, &format!("intents/{id}/settle"), "status=succeeded").await,
        400
    );
    assert_eq!(
        control(&p, "intents/pi_nope/settle", "status=succeeded").await,
        404
    );
    assert_eq!(p.total_charges(), 1);
}

#[tokio::test]
async fn a_processing_intent_that_fails_needs_a_payment_method_and_is_not_charged() {
    let p = FakeProvider::start().await.unwrap();
    p.set_behaviour("cus_ada", Behaviour::Processing);
    let id = charge(&p, "k1", GOOD).await.body["id"]
        .as_str()
        .unwrap()
        .to_owned();
    assert!(p.settle_processing(&id, false));
    let got = get_v1(&p, &format!("payment_intents/{id}"), TEST_SECRET_KEY).await;
    assert_eq!(got.body["status"], "requires_payment_method");
    let e = &got.body["last_payment_error"];
    assert_eq!(
        (e["code"].as_str(), e["decline_code"].as_str()),
        (Some("card_declined"), Some("insufficient_funds"))
    );
    assert_eq!(p.intents()[0].status, "requires_payment_method");
    assert_eq!(p.total_charges(), 0);
}

#[tokio::test]
async fn after_the_key_is_rolled_the_old_one_is_refused_and_nothing_is_charged() {
    let p = FakeProvider::start().await.unwrap();
    assert_eq!(
        control(&p, "roll_key", "secret_key=sk_test_rolled_2").await,
        204
    );
    let a = post(&p, Some("k1"), TEST_SECRET_KEY, GOOD).await;
    assert_eq!(a.status, 401);
    assert_eq!(a.body["error"]["type"], "invalid_request_error");
    let message = a.body["error"]["message"].as_str().unwrap();
    assert!(
        message.starts_with("Invalid API Key provided: sk_****"),
        "{message}"
    );
    assert!(!message.contains(TEST_SECRET_KEY), "{message}");
    assert_eq!(
        get_v1(&p, "payment_intents", TEST_SECRET_KEY).await.status,
        401
    );
    assert_eq!(
        get_v1(&p, "payment_intents/pi_fake00000001", TEST_SECRET_KEY)
            .await
            .status,
        401
    );
    assert_eq!(
        (p.total_charges(), p.has_result("k1"), p.create_requests()),
        (0, false, 0)
    );
    assert!(p.intents().is_empty());
    assert_eq!(
        post(&p, Some("k1"), "sk_test_rolled_2", GOOD).await.status,
        200
    );
    // The method rolls the same way.
    p.roll_secret_key("sk_test_rolled_3");
    assert_eq!(
        post(&p, Some("k2"), "sk_test_rolled_2", GOOD).await.status,
        401
    );
    assert_eq!(p.total_charges(), 1);
}

#[tokio::test]
async fn an_amount_under_the_currency_minimum_is_refused_and_nothing_is_charged() {
    let p = FakeProvider::start().await.unwrap();
    let cases = [
        ("usd", 49, 400),
        ("usd", 50, 200),
        ("jpy", 49, 400),
        ("jpy", 50, 200),
        ("gbp", 29, 400),
        ("gbp", 30, 200),
        ("huf", 17_499, 400),
        ("huf", 17_500, 200),
        ("xof", 49, 400),
        ("xof", 50, 200),
        ("usd", 0, 400),
    ];
    for (i, (currency, amount, status)) in cases.into_iter().enumerate() {
        let key = format!("m{i}");
        let a = charge(&p, &key, &charge_of("cus_ada", amount, currency)).await;
        assert_eq!(a.status, status, "{amount} {currency}: {}", a.body);
        if status == 400 {
            assert_eq!(a.body["error"]["type"], "invalid_request_error");
            assert_eq!(a.body["error"]["code"], "amount_too_small");
            assert_eq!(a.body["error"]["param"], "amount");
            assert!(
                a.body["error"]["message"]
                    .as_str()
                    .unwrap()
                    .starts_with("Amount must be at least")
            );
            assert!(!p.has_result(&key));
        }
    }
    assert_eq!(fake_provider::minimum_amount("huf"), 17_500);
    assert_eq!((p.total_charges(), p.intents().len()), (5, 5));
    p.set_enforce_minimums(false);
    assert_eq!(
        charge(&p, "tiny", &charge_of("cus_ada", 1, "usd"))
            .await
            .status,
        200
    );
    let zero = charge(&p, "zero", &charge_of("cus_ada", 0, "usd")).await;
    assert_eq!(
        (zero.status, zero.body["error"]["code"].as_str()),
        (400, Some("amount_too_small"))
    );
}

#[tokio::test]
async fn a_hard_decline_code_passes_through_and_the_intent_is_kept() {
    let p = FakeProvider::start().await.unwrap();
    p.set_behaviour("cus_ada", Behaviour::Decline("stolen_card".into()));
    let a = charge(&p, "k1", GOOD).await;
    assert_eq!(a.status, 402);
    let e = &a.body["error"];
    assert_eq!(
        (e["type"].as_str(), e["code"].as_str()),
        (Some("card_error"), Some("card_declined"))
    );
    assert_eq!(e["decline_code"], "stolen_card");
    assert_eq!(e["payment_intent"]["status"], "requires_payment_method");
    assert_eq!(
        e["payment_intent"]["last_payment_error"]["decline_code"],
        "stolen_card"
    );
    let id = e["payment_intent"]["id"].as_str().unwrap();
    let got = get_v1(&p, &format!("payment_intents/{id}"), TEST_SECRET_KEY).await;
    assert_eq!(got.body["status"], "requires_payment_method");
    assert_eq!(
        got.body["last_payment_error"]["decline_code"],
        "stolen_card"
    );
    assert_eq!(p.total_charges(), 0);
}

#[tokio::test]
async fn authentication_required_is_the_error_code_as_well_as_the_decline_code() {
    let p = FakeProvider::start().await.unwrap();
    let form = "customer=cus_ada&behaviour=decline&decline_code=authentication_required";
    assert_eq!(control(&p, "behaviour", form).await, 204);
    let a = charge(&p, "k1", GOOD).await;
    assert_eq!(a.status, 402);
    let e = &a.body["error"];
    assert_eq!(e["type"], "card_error");
    assert_eq!(e["code"], "authentication_required");
    assert_eq!(e["decline_code"], "authentication_required");
    let pi = &e["payment_intent"];
    assert_eq!(pi["status"], "requires_payment_method");
    assert_eq!(pi["last_payment_error"]["code"], "authentication_required");
    let got = get_v1(
        &p,
        &format!("payment_intents/{}", pi["id"].as_str().unwrap()),
        TEST_SECRET_KEY,
    )
    .await;
    assert_eq!(got.body["status"], "requires_payment_method");
    assert_eq!(p.intents()[0].status, "requires_payment_method");
    assert_eq!(p.total_charges(), 0);
}

#[tokio::test]
async fn each_malformed_answer_is_stored_replayed_and_its_intent_listed() {
    let p = FakeProvider::start().await.unwrap();
    let kinds = [
        ("not_json", MalformedKind::NotJson, 200, true),
        ("no_id", MalformedKind::NoId, 200, true),
        ("bad_id", MalformedKind::BadId, 200, true),
        ("nul_code", MalformedKind::NulCode, 402, false),
    ];
    for (i, (name, kind, status, charged)) in kinds.into_iter().enumerate() {
        let customer = format!("cus_{name}");
        if i % 2 == 0 {
            p.set_behaviour(&customer, Behaviour::Malformed(kind));
        } else {
            let form = format!("customer={customer}&behaviour=malformed&kind={name}");
            assert_eq!(control(&p, "behaviour", &form).await, 204);
        }
        let body = charge_of(&customer, 1200, "eur");
        let first = post_raw(&p, Some(name), TEST_SECRET_KEY, &body).await;
        assert_eq!(first.status, status, "{name}: {}", first.text);
        match kind {
            MalformedKind::NotJson => {
                assert_eq!(first.text, "<html>upstream proxy error</html>");
                assert!(serde_json::from_str::<Value>(&first.text).is_err());
            }
            MalformedKind::NoId => {
                let v: Value = serde_json::from_str(&first.text).unwrap();
                assert_eq!(
                    v,
                    serde_json::json!({"object": "payment_intent", "status": "succeeded"})
                );
            }
            MalformedKind::BadId => {
                let v: Value = serde_json::from_str(&first.text).unwrap();
                assert_eq!(
                    (v["id"].as_str(), v["status"].as_str()),
                    (Some("pi_bad id/../x"), Some("succeeded"))
                );
            }
            MalformedKind::NulCode => {
                let v: Value = serde_json::from_str(&first.text).unwrap();
                assert_eq!(v["error"]["type"], "card_error");
                assert_eq!(v["error"]["decline_code"], "gen\u{0}eric");
                assert!(first.text.contains(r"gen\u0000eric"), "{}", first.text);
            }
        }
        let again = post_raw(&p, Some(name), TEST_SECRET_KEY, &body).await;
        assert_eq!(
            (again.status, &again.text),
            (first.status, &first.text),
            "{name}"
        );
        assert_eq!(again.headers["idempotent-replayed"], "true");
        assert_eq!(
            p.charges().get(name).copied(),
            charged.then_some(1),
            "{name}"
        );
        // Listed under its real id.
        let listed = get_v1(
            &p,
            &format!("payment_intents?customer={customer}"),
            TEST_SECRET_KEY,
        )
        .await;
        let data = listed.body["data"].as_array().unwrap();
        assert_eq!(data.len(), 1, "{name}");
        assert_eq!(data[0]["id"].as_str(), Some(p.intents()[i].id.as_str()));
        assert!(data[0]["id"].as_str().unwrap().starts_with("pi_fake"));
        let expected = if charged {
            "succeeded"
        } else {
            "requires_payment_method"
        };
        assert_eq!(data[0]["status"], expected, "{name}");
    }
    assert_eq!(p.total_charges(), 3);
}

#[tokio::test]
async fn a_rate_limited_request_answers_429_with_retry_after_and_is_not_stored() {
    let p = FakeProvider::start().await.unwrap();
    p.set_behaviour(
        "cus_ada",
        Behaviour::RateLimited {
            retry_after_secs: 7,
        },
    );
    let r = post_raw(&p, Some("k1"), TEST_SECRET_KEY, GOOD).await;
    assert_eq!(r.status, 429);
    assert_eq!(r.headers["retry-after"], "7");
    let a = r.json();
    assert_eq!(a.body["error"]["type"], "rate_limit_error");
    assert_eq!(a.body["error"]["message"], "Too many requests");
    assert_eq!(
        (p.total_charges(), p.has_result("k1"), p.intents().len()),
        (0, false, 0)
    );
    let form = "customer=cus_bob&behaviour=rate_limited&retry_after=3";
    assert_eq!(control(&p, "behaviour", form).await, 204);
    let r = post_raw(
        &p,
        Some("k2"),
        TEST_SECRET_KEY,
        &GOOD.replace("cus_ada", "cus_bob"),
    )
    .await;
    assert_eq!(
        (r.status, r.headers["retry-after"].to_str().unwrap()),
        (429, "3")
    );
    p.set_behaviour("cus_ada", Behaviour::Succeed);
    let again = charge(&p, "k1", GOOD).await;
    assert_eq!((again.status, again.replayed), (200, false));
    assert_eq!(p.charges().get("k1"), Some(&1));
}

#[tokio::test]
async fn a_missing_payment_method_answers_404_and_nothing_is_stored() {
    let p = FakeProvider::start().await.unwrap();
    assert_eq!(
        control(
            &p,
            "behaviour",
            "customer=cus_ada&behaviour=missing_payment_method"
        )
        .await,
        204
    );
    let a = charge(&p, "k1", GOOD).await;
    assert_eq!(a.status, 404);
    let e = &a.body["error"];
    assert_eq!(
        (e["type"].as_str(), e["code"].as_str()),
        (Some("invalid_request_error"), Some("resource_missing"))
    );
    assert_eq!(e["param"], "payment_method");
    assert_eq!(e["message"], "No such PaymentMethod: 'pm_card_visa'");
    assert_eq!(
        (p.total_charges(), p.has_result("k1"), p.intents().len()),
        (0, false, 0)
    );
}

#[tokio::test]
async fn the_list_filters_by_customer_and_creation_newest_first_and_pages() {
    let p = FakeProvider::start().await.unwrap();
    let ids = |a: &Answer| -> Vec<String> {
        a.body["data"]
            .as_array()
            .unwrap()
            .iter()
            .map(|i| i["id"].as_str().unwrap().to_owned())
            .collect()
    };
    let id = |a: Answer| a.body["id"].as_str().unwrap().to_owned();
    let a1 = id(charge(&p, "a1", &charge_of("cus_a", 1200, "eur")).await);
    p.set_behaviour("cus_b", Behaviour::Decline("insufficient_funds".into()));
    charge(&p, "b1", &charge_of("cus_b", 1200, "eur")).await;
    let b1 = p.intents()[1].id.clone();
    p.advance_clock(100);
    p.set_behaviour("cus_a", Behaviour::Processing);
    let a2 = id(charge(&p, "a2", &charge_of("cus_a", 1300, "eur")).await);
    p.set_behaviour("cus_a", Behaviour::Succeed);
    let a3 = id(charge(&p, "a3", &charge_of("cus_a", 1400, "eur")).await);

    let all = get_v1(&p, "payment_intents", TEST_SECRET_KEY).await;
    assert_eq!(all.status, 200);
    assert_eq!(all.body["object"], "list");
    assert_eq!(all.body["url"], "/v1/payment_intents");
    assert_eq!(all.body["has_more"], false);
    assert_eq!(
        ids(&all),
        [a3.as_str(), a2.as_str(), b1.as_str(), a1.as_str()]
    );
    assert_eq!(all.body["data"][1]["status"], "processing");
    assert_eq!(all.body["data"][2]["status"], "requires_payment_method");

    let of_a = get_v1(&p, "payment_intents?customer=cus_a", TEST_SECRET_KEY).await;
    assert_eq!(ids(&of_a), [a3.as_str(), a2.as_str(), a1.as_str()]);
    let since = all.body["data"][1]["created"].as_i64().unwrap();
    assert!(since >= all.body["data"][3]["created"].as_i64().unwrap() + 100);
    let recent = get_v1(
        &p,
        &format!("payment_intents?customer=cus_a&created%5Bgte%5D={since}"),
        TEST_SECRET_KEY,
    )
    .await;
    assert_eq!(ids(&recent), [a3.as_str(), a2.as_str()]);
    let recent_all = get_v1(
        &p,
        &format!("payment_intents?created[gte]={since}"),
        TEST_SECRET_KEY,
    )
    .await;
    assert_eq!(ids(&recent_all), [a3.as_str(), a2.as_str()]);

    let page1 = get_v1(
        &p,
        "payment_intents?customer=cus_a&limit=2",
        TEST_SECRET_KEY,
    )
    .await;
    assert_eq!(
        (ids(&page1), page1.body["has_more"].as_bool()),
        (vec![a3.clone(), a2.clone()], Some(true))
    );
    let page2 = get_v1(
        &p,
        &format!("payment_intents?customer=cus_a&limit=2&starting_after={a2}"),
        TEST_SECRET_KEY,
    )
    .await;
    assert_eq!(
        (ids(&page2), page2.body["has_more"].as_bool()),
        (vec![a1.clone()], Some(false))
    );
    let page = get_v1(
        &p,
        &format!("payment_intents?limit=1&starting_after={b1}"),
        TEST_SECRET_KEY,
    )
    .await;
    assert_eq!(
        (ids(&page), page.body["has_more"].as_bool()),
        (vec![a1.clone()], Some(false))
    );

    let unknown = get_v1(
        &p,
        "payment_intents?starting_after=pi_nope",
        TEST_SECRET_KEY,
    )
    .await;
    assert_eq!(
        (unknown.status, unknown.body["error"]["param"].as_str()),
        (404, Some("starting_after"))
    );
    for bad in ["limit=0", "limit=101", "limit=ten"] {
        let a = get_v1(&p, &format!("payment_intents?{bad}"), TEST_SECRET_KEY).await;
        assert_eq!(a.status, 400, "{bad}");
        assert_eq!(
            a.body["error"]["code"], "parameter_invalid_integer",
            "{bad}"
        );
        assert_eq!(a.body["error"]["param"], "limit", "{bad}");
    }
    assert_eq!(
        ids(&get_v1(&p, "payment_intents?limit=100", TEST_SECRET_KEY).await).len(),
        4
    );
}

#[tokio::test]
async fn metadata_is_returned_and_part_of_the_idempotency_fingerprint() {
    let p = FakeProvider::start().await.unwrap();
    let with = format!("{GOOD}&metadata%5Binvoice_id%5D=inv_42&metadata[attempt]=1");
    let a = charge(&p, "k1", &with).await;
    assert_eq!(a.status, 200, "{}", a.body);
    assert_eq!(
        a.body["metadata"],
        serde_json::json!({"invoice_id": "inv_42", "attempt": "1"})
    );
    assert_eq!(
        p.intents()[0]
            .metadata
            .get("invoice_id")
            .map(String::as_str),
        Some("inv_42")
    );
    // The same metadata in another order is the same request.
    let reordered = format!("metadata[attempt]=1&{GOOD}&metadata[invoice_id]=inv_42");
    assert!(charge(&p, "k1", &reordered).await.replayed);
    for other in [
        GOOD.to_owned(),
        with.replace("attempt%5D=1", "attempt%5D=2")
            .replace("attempt]=1", "attempt]=2"),
        format!("{with}&metadata[extra]=x"),
    ] {
        let a = charge(&p, "k1", &other).await;
        assert_eq!(a.status, 400, "{other}");
        assert_eq!(a.body["error"]["type"], "idempotency_error", "{other}");
    }
    assert_eq!(p.total_charges(), 1);

    let many: String = (0..51).map(|i| format!("&metadata[k{i}]=v")).collect();
    let fifty: String = (0..50).map(|i| format!("&metadata[k{i}]=v")).collect();
    for bad in [
        format!("{GOOD}&metadata[{}]=v", "k".repeat(41)),
        format!("{GOOD}&metadata[a-b]=v"),
        format!("{GOOD}&metadata[]=v"),
        format!("{GOOD}&metadata=v"),
        format!("{GOOD}&metadata[note]={}", "v".repeat(501)),
        format!("{GOOD}{many}"),
    ] {
        let a = charge(&p, "bad", &bad).await;
        assert_eq!(a.status, 400, "{bad}");
        assert_eq!(a.body["error"]["code"], "parameter_invalid_string", "{bad}");
        assert_eq!(a.body["error"]["param"], "metadata", "{bad}");
        assert!(!p.has_result("bad"));
    }
    let edge = format!(
        "{GOOD}&metadata[{}]={}{fifty}",
        "k".repeat(40),
        "v".repeat(500)
    );
    assert_eq!(
        charge(&p, "edge", &edge).await.status,
        400,
        "51 keys with the long one"
    );
    let edge = format!("{GOOD}&metadata[{}]={}", "k".repeat(40), "v".repeat(500));
    assert_eq!(charge(&p, "edge", &edge).await.status, 200);
    assert_eq!(
        charge(&p, "fifty", &format!("{GOOD}{fifty}")).await.status,
        200
    );
}

#[tokio::test]
async fn an_unknown_intent_is_404_resource_missing() {
    let p = FakeProvider::start().await.unwrap();
    let a = get_v1(&p, "payment_intents/pi_nope", TEST_SECRET_KEY).await;
    assert_eq!(a.status, 404);
    let e = &a.body["error"];
    assert_eq!(
        (e["type"].as_str(), e["code"].as_str()),
        (Some("invalid_request_error"), Some("resource_missing"))
    );
    assert_eq!(e["param"], "intent");
    assert_eq!(e["message"], "No such payment_intent: 'pi_nope'");
}

#[tokio::test]
async fn a_behaviour_form_the_fake_cannot_read_is_refused() {
    let p = FakeProvider::start().await.unwrap();
    for form in [
        "customer=cus_ada&behaviour=explode",
        "customer=cus_ada&behaviour=malformed",
        "customer=cus_ada&behaviour=malformed&kind=xml",
        "customer=cus_ada&behaviour=rate_limited&retry_after=soon",
        "customer=cus_ada&behaviour=stored_error&with_intent=yes",
        "behaviour=succeed",
    ] {
        assert_eq!(control(&p, "behaviour", form).await, 400, "{form}");
    }
    assert_eq!(control(&p, "roll_key", "").await, 400);
    assert_eq!(charge(&p, "k1", GOOD).await.status, 200);
}
