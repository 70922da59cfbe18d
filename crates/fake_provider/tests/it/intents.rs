//! Payment intents read back: every field the client reads, an intent
//! `processing` or `requires_action` until it settles (charged only if it
//! succeeds), the list (by customer and creation, newest first, in pages),
//! and an unknown intent's 404.

use fake_provider::{Behaviour, FakeProvider, TEST_SECRET_KEY};

use crate::{Answer, GOOD, charge, charge_of, control, get_v1};

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

/// An off-session charge whose bank asks the customer to authenticate:
/// 200 `requires_action`, nothing charged; the customer completing it later
/// charges it with no request from the client (Stripe's confirm: "after
/// `next_action`s are handled by the client, no additional confirmation is
/// required to complete the payment").
#[tokio::test]
async fn an_intent_requiring_action_is_charged_only_once_the_customer_completes_it() {
    let p = FakeProvider::start().await.unwrap();
    assert_eq!(
        control(
            &p,
            "behaviour",
            "customer=cus_ada&behaviour=requires_action"
        )
        .await,
        204
    );
    let a = charge(&p, "k1", GOOD).await;
    assert_eq!(
        (a.status, a.body["status"].as_str()),
        (200, Some("requires_action"))
    );
    assert_eq!(p.total_charges(), 0);
    let id = a.body["id"].as_str().unwrap().to_owned();
    assert_eq!(p.intents()[0].status, "requires_action");
    assert!(p.settle_processing(&id, true));
    let got = get_v1(&p, &format!("payment_intents/{id}"), TEST_SECRET_KEY).await;
    assert_eq!(got.body["status"], "succeeded");
    assert_eq!(p.charges().get("k1"), Some(&1));
    assert_eq!(p.create_requests(), 1);
}

/// A body set with `set_list_body` is what every list answers, with 200 and
/// counted as a list request, until it is unset.
#[tokio::test]
async fn a_list_body_set_is_answered_instead_of_the_list_and_counted() {
    let p = FakeProvider::start().await.unwrap();
    charge(&p, "k1", GOOD).await;
    let list = "payment_intents?customer=cus_ada&limit=10";
    p.set_list_body(Some(r#"{"object":"list"}"#));
    let stub = get_v1(&p, list, TEST_SECRET_KEY).await;
    assert_eq!(
        (stub.status, stub.body.clone()),
        (200, serde_json::json!({"object": "list"}))
    );
    p.set_list_body(None);
    let real = get_v1(&p, list, TEST_SECRET_KEY).await;
    assert_eq!(real.body["data"].as_array().map(Vec::len), Some(1));
    assert_eq!(p.list_requests(), 2);
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
