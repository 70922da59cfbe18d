//! What the fake stores under an idempotency key: a charge counted under its
//! key, the stored answer replayed for the same parameters (metadata
//! included), other parameters under the key refused, and a pruned key a new
//! request that charges again.

use fake_provider::FakeProvider;
use serde_json::Value;

use crate::{GOOD, charge, control};

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
