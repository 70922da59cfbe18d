//! Declines as Stripe answers them, nothing charged: 402 `card_declined` with
//! the decline code (set by method or over HTTP), a hard decline's intent
//! kept, `authentication_required` as both codes, and a missing payment
//! method's 404.

use fake_provider::{Behaviour, FakeProvider, TEST_SECRET_KEY};

use crate::{GOOD, charge, control, get_v1};

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
