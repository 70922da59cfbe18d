//! What the fake refuses, nothing charged: a request Stripe would refuse
//! (named by its parameter), an amount under the currency's minimum, the old
//! key after a roll; and a behaviour form of its own it cannot read.

use fake_provider::{FakeProvider, TEST_SECRET_KEY};

use crate::{GOOD, charge, charge_of, control, get_v1, post};

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
        get_v1(&p, "payment_intents/pi_nope", TEST_SECRET_KEY)
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
