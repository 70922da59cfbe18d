//! A provider that fails: a call that hangs (charged once), a 5xx (nothing
//! charged, the key usable again), a stored 500 replayed with or without its
//! intent, answers that do not parse (stored and replayed as sent), and a 429
//! with `Retry-After` (nothing stored) or after execution began (stored).

use std::time::Duration;

use fake_provider::{Behaviour, FakeProvider, MalformedKind, TEST_SECRET_KEY};
use serde_json::Value;

use crate::{GOOD, charge, charge_of, control, get_v1, post_raw};

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

/// A 429 that came after execution began (a lock timeout) charged and is
/// stored: the same key answers it again, `Idempotent-Replayed`, without a
/// second charge, and the form names it.
#[tokio::test]
async fn a_stored_429_is_charged_once_and_replayed_with_the_header() {
    let p = FakeProvider::start().await.unwrap();
    let form = "customer=cus_ada&behaviour=stored_rate_limited";
    assert_eq!(control(&p, "behaviour", form).await, 204);
    let a = charge(&p, "k1", GOOD).await;
    assert_eq!((a.status, a.replayed), (429, false));
    assert_eq!(a.body["error"]["type"], "rate_limit_error");
    assert_eq!(a.body["error"]["code"], "lock_timeout");
    assert_eq!(
        p.charges().get("k1"),
        Some(&1),
        "it executed before the 429"
    );
    assert_eq!(p.intents()[0].status, "succeeded");
    assert!(p.has_result("k1"));
    p.set_behaviour("cus_ada", Behaviour::Succeed);
    let again = charge(&p, "k1", GOOD).await;
    assert_eq!((again.status, again.replayed), (429, true));
    assert_eq!(again.body, a.body);
    assert_eq!(p.total_charges(), 1);
}
