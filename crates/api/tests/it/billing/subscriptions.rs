//! Subscriptions over HTTP: started (active or trialing) as billing expects,
//! paused, resumed and canceled through billing, each refusing what the state
//! does not allow, another tenant's customer, plan and subscription missing.

use db::{Row as _, sql};
use reqwest::Method;
use serde_json::{Value, json};

use super::{bed, events};

#[tokio::test]
async fn a_subscription_starts_as_billing_expects_and_refuses_another_tenants_customer() {
    let b = bed().await;
    let plan = b.plan(&b.a, "EUR", 3000).await;
    let s = b.subscription(&b.a, plan).await;
    assert_eq!(s["status"], "active");
    // The watermark is the period's end: billing's due funnel closes it then.
    assert_eq!(s["next_billing_at"], s["current_period_end"]);
    assert_eq!(s["billing_anchor"], s["current_period_start"]);
    let id = s["id"].as_i64().unwrap();
    let events: i64 = b
        .t
        .db
        .fetch_one(sql(
            "SELECT count(*) AS n FROM webhook_events WHERE event_type = 'subscription.created'",
        ))
        .await
        .unwrap()
        .get("n");
    assert_eq!(events, 1);

    let trial = b.trialing(&b.a, plan).await;
    let customer = b.customer(&b.a).await;
    assert_eq!(
        (trial["status"].as_str(), &trial["next_billing_at"]),
        (Some("trialing"), &Value::Null)
    );
    assert_eq!(trial["current_period_end"], trial["trial_end"]);

    // An anchor inside the first interval ends the first period there.
    let anchor = days_on(20);
    let anchored = b
        .created(
            &b.a,
            "/v1/subscriptions",
            json!({"customer": customer, "plan": plan, "billing_anchor": anchor}),
        )
        .await;
    assert_eq!(
        anchored["current_period_end"].as_str().map(at),
        Some(at(&anchor))
    );
    let customer = b.customer(&b.a).await;

    let other_customer = b.customer(&b.b).await;
    let other_plan = b.plan(&b.b, "EUR", 100).await;
    let p = Method::POST;
    let path = "/v1/subscriptions".to_string();
    b.check_refusals(
        &b.a,
        &[
            (p.clone(), path.clone(), Some(json!({"customer": other_customer, "plan": plan})), 404, "resource_missing", "customer"),
            (p.clone(), path.clone(), Some(json!({"customer": customer, "plan": other_plan})), 404, "resource_missing", "plan"),
            (p.clone(), path.clone(), Some(json!({"customer": customer, "plan": plan, "trial_end": "2001-01-01T00:00:00Z"})), 400, "parameter_out_of_range", "trial_end"),
            (p.clone(), path.clone(), Some(json!({"customer": customer, "plan": plan, "trial_end": "2099-01-01T00:00:00Z"})), 400, "parameter_out_of_range", "trial_end"),
            (p.clone(), path.clone(), Some(json!({"customer": customer, "plan": plan, "billing_anchor": "yesterday"})), 400, "parameter_invalid", "billing_anchor"),
            // More than one interval (a month) after the start, with and
            // without a trial: the first period would be longer than the
            // interval, priced as one (docs/adr/0096). Mutation
            // `anchor_beyond_interval` (the check removed) answers 201; seen failing.
            (p.clone(), path.clone(), Some(json!({"customer": customer, "plan": plan, "billing_anchor": days_on(45)})), 400, "parameter_out_of_range", "billing_anchor"),
            (p.clone(), path.clone(), Some(json!({"customer": customer, "plan": plan, "trial_end": days_on(7), "billing_anchor": days_on(45)})), 400, "parameter_out_of_range", "billing_anchor"),
            (p.clone(), path.clone(), Some(json!({"customer": customer, "plan": plan, "collection_method": "cash"})), 400, "parameter_invalid", "collection_method"),
        ],
    )
    .await;
    // A list filter is a positive id, as the document says (`minimum: 1`),
    // not an empty page (mutation `list_filter_any_id`).
    b.check_refusals(
        &b.a,
        &[
            (
                Method::GET,
                "/v1/subscriptions?customer=0".to_owned(),
                None,
                400,
                "parameter_invalid",
                "customer",
            ),
            (
                Method::GET,
                "/v1/invoices?subscription=-1".to_owned(),
                None,
                400,
                "parameter_invalid",
                "subscription",
            ),
        ],
    )
    .await;
    b.check_refusals(
        &b.b,
        &[
            (
                Method::GET,
                format!("/v1/subscriptions/{id}"),
                None,
                404,
                "resource_missing",
                "id",
            ),
            (
                p.clone(),
                format!("/v1/subscriptions/{id}/cancel"),
                Some(json!({})),
                404,
                "resource_missing",
                "id",
            ),
            (
                p.clone(),
                format!("/v1/subscriptions/{id}/pause"),
                Some(json!({"behavior": "void"})),
                404,
                "resource_missing",
                "id",
            ),
            (
                p.clone(),
                format!("/v1/subscriptions/{id}/resume"),
                None,
                404,
                "resource_missing",
                "id",
            ),
            (
                p.clone(),
                format!("/v1/subscriptions/{id}/change_plan"),
                Some(json!({"plan": other_plan})),
                404,
                "resource_missing",
                "id",
            ),
        ],
    )
    .await;
}

/// `days` days from now, as the API takes a time.
fn days_on(days: i64) -> String {
    (chrono::Utc::now() + chrono::TimeDelta::days(days)).to_rfc3339()
}

/// A time the API gave back, to the second.
fn at(text: &str) -> i64 {
    chrono::DateTime::parse_from_rfc3339(text)
        .unwrap()
        .timestamp()
}

#[tokio::test]
async fn pause_resume_and_cancel_go_through_billing_and_refuse_what_the_state_does_not_allow() {
    let b = bed().await;
    let plan = b.plan(&b.a, "EUR", 3000).await;
    let s = b.subscription(&b.a, plan).await;
    let id = s["id"].as_i64().unwrap();
    let path = |a: &str| format!("/v1/subscriptions/{id}/{a}");
    // Resuming what is not paused is a state conflict, with no body or an
    // empty one sent with a JSON content type, as many clients send every
    // request (it was a 400 invalid_json). Mutation `empty_body_typed` (the
    // content type decides before the body) and the second is 400.
    let r =
        b.s.call(Method::POST, &path("resume"), &b.a, None, None)
            .await;
    assert_eq!(
        (r.status.as_u16(), r.refusal().0.as_str()),
        (409, "invalid_state"),
        "{}",
        r.text
    );
    let typed = reqwest::Client::new()
        .post(format!("{}{}", b.s.base, path("resume")))
        .bearer_auth(&b.a)
        .header("content-type", "application/json")
        .send()
        .await
        .unwrap();
    assert_eq!(typed.status(), 409, "{}", typed.text().await.unwrap());

    let p = Method::POST;
    b.check_refusals(
        &b.a,
        &[
            (
                p.clone(),
                path("pause"),
                Some(json!({"behavior": "stop"})),
                400,
                "parameter_invalid",
                "behavior",
            ),
            (
                p.clone(),
                path("pause"),
                Some(json!({"behavior": "void", "resumes_at": "2001-01-01T00:00:00Z"})),
                400,
                "parameter_out_of_range",
                "resumes_at",
            ),
            (
                p.clone(),
                path("pause"),
                Some(json!({})),
                400,
                "parameter_missing",
                "behavior",
            ),
            (
                p.clone(),
                path("cancel"),
                Some(json!({"at_period_end": "yes"})),
                400,
                "parameter_invalid_type",
                "at_period_end",
            ),
        ],
    )
    .await;
    let paused =
        b.s.call(
            Method::POST,
            &path("pause"),
            &b.a,
            Some(&json!({"behavior": "keep_as_draft"})),
            Some("p-1"),
        )
        .await;
    assert_eq!(paused.status, 200, "{}", paused.text);
    assert_eq!(paused.json["pause_collection"]["behavior"], "keep_as_draft");
    assert_eq!(paused.json["pause_collection"]["set_by"], "api");
    let replay =
        b.s.call(
            Method::POST,
            &path("pause"),
            &b.a,
            Some(&json!({"behavior": "keep_as_draft"})),
            Some("p-1"),
        )
        .await;
    assert_eq!(
        (replay.text.as_str(), replay.replayed),
        (paused.text.as_str(), true)
    );
    let resumed =
        b.s.call(Method::POST, &path("resume"), &b.a, None, None)
            .await;
    assert_eq!(
        (resumed.status.as_u16(), &resumed.json["pause_collection"]),
        (200, &Value::Null),
        "{}",
        resumed.text
    );
    let kinds = events(&b.t).await;
    assert!(
        kinds.contains(&"subscription.collection_paused".to_owned())
            && kinds.contains(&"subscription.collection_resumed".to_owned()),
        "{kinds:?}"
    );

    let at_end =
        b.s.post(&path("cancel"), &b.a, json!({"at_period_end": true}))
            .await;
    assert_eq!(
        (at_end.status.as_u16(), &at_end.json["cancel_at_period_end"]),
        (200, &json!(true)),
        "{}",
        at_end.text
    );
    assert_eq!(at_end.json["status"], "active");
    let now = b.s.post(&path("cancel"), &b.a, json!({})).await;
    assert_eq!(
        (now.status.as_u16(), now.json["status"].as_str()),
        (200, Some("canceled")),
        "{}",
        now.text
    );
    let again = b.s.post(&path("cancel"), &b.a, json!({})).await;
    assert_eq!(
        (again.status.as_u16(), again.refusal().0.as_str()),
        (409, "invalid_state")
    );
    let pause =
        b.s.post(&path("pause"), &b.a, json!({"behavior": "void"}))
            .await;
    assert_eq!(
        (pause.status.as_u16(), pause.refusal().0.as_str()),
        (409, "invalid_state")
    );
    assert!(
        events(&b.t)
            .await
            .contains(&"subscription.canceled".to_owned())
    );
}

/// A trialing subscription is canceled now with nothing invoiced and
/// `subscription.canceled` announced; canceling it at its period's end is
/// refused by the field, and a canceled one cannot be canceled again.
///
/// Catches: the trial cancel missing (seen: 409 `invalid_state`, "the
/// subscription is not active"); a `null` body refused.
#[tokio::test]
async fn a_trialing_subscription_is_canceled_now_with_nothing_invoiced() {
    let b = bed().await;
    let plan = b.plan(&b.a, "EUR", 3000).await;
    let trial = b.trialing(&b.a, plan).await;
    let id = trial["id"].as_i64().unwrap();
    let cancel = format!("/v1/subscriptions/{id}/cancel");
    let later =
        b.s.post(&cancel, &b.a, json!({"at_period_end": true}))
            .await;
    assert_eq!(later.status, 400, "{:?}", later.json);
    assert_eq!(later.refusal().1.as_deref(), Some("at_period_end"));
    // A JSON `null`, which the OpenAPI document allows for this optional
    // body, is the body left out (mutation `optional_body_null`: a 400).
    let now = b.s.post(&cancel, &b.a, Value::Null).await;
    assert_eq!(now.status, 200, "{:?}", now.json);
    assert_eq!(now.json["status"], "canceled");
    let count = |q: &'static str| {
        let db = b.t.db.clone();
        async move { db.fetch_one(sql(q)).await.unwrap().get::<i64, _>("n") }
    };
    assert_eq!(count("SELECT count(*) AS n FROM invoices").await, 0);
    assert_eq!(
        count(
            "SELECT count(*) AS n FROM webhook_events WHERE event_type = 'subscription.canceled'"
        )
        .await,
        1
    );
    let again = b.s.post(&cancel, &b.a, json!({})).await;
    assert_eq!(again.status, 409, "{:?}", again.json);
}

/// A subscription paused without a resume time and then canceled can still
/// be resumed (docs/adr/0110). Every charger holds a paused subscription's
/// invoices, canceled or not (docs/adr/0071), and only a resume lifts such a
/// pause: refused with 409 on a canceled subscription, it left the invoices
/// made before the pause open and uncharged for ever. The resume keeps the
/// subscription canceled and announces itself.
///
/// Mutation check: `resume_canceled_refused` (the resume refusing a canceled
/// subscription, as before) fails this test; seen failing under it.
#[tokio::test]
async fn a_canceled_subscription_whose_collection_is_paused_can_be_resumed() {
    let b = bed().await;
    let plan = b.plan(&b.a, "EUR", 3000).await;
    let s = b.subscription(&b.a, plan).await;
    let id = s["id"].as_i64().unwrap();
    let path = |a: &str| format!("/v1/subscriptions/{id}/{a}");
    let paused =
        b.s.post(&path("pause"), &b.a, json!({"behavior": "keep_as_draft"}))
            .await;
    assert_eq!(paused.status, 200, "{}", paused.text);
    let canceled = b.s.post(&path("cancel"), &b.a, json!({})).await;
    assert_eq!(canceled.json["status"], "canceled", "{}", canceled.text);
    assert_eq!(
        canceled.json["pause_collection"]["behavior"],
        "keep_as_draft"
    );
    let resumed =
        b.s.call(Method::POST, &path("resume"), &b.a, None, None)
            .await;
    assert_eq!(
        (
            resumed.status.as_u16(),
            resumed.json["status"].as_str(),
            &resumed.json["pause_collection"]
        ),
        (200, Some("canceled"), &Value::Null),
        "{}",
        resumed.text
    );
    let held: bool =
        b.t.db
            .fetch_one(sql(
                "SELECT pause_collection_behavior IS NOT NULL AS held FROM subscriptions",
            ))
            .await
            .unwrap()
            .get("held");
    assert!(!held);
    assert!(
        events(&b.t)
            .await
            .contains(&"subscription.collection_resumed".to_owned())
    );
    let again =
        b.s.call(Method::POST, &path("resume"), &b.a, None, None)
            .await;
    assert_eq!(
        (again.status.as_u16(), again.refusal().0.as_str()),
        (409, "invalid_state")
    );
}

/// A pause of a subscription set to end with its period, when that period
/// has ended and billing has not closed it yet: the closing the pause makes
/// first cancels it, and the refusal rolls that back, so the subscription
/// still reads active. The 409 says so, instead of "a canceled
/// subscription's collection cannot be paused" about a subscription the
/// caller reads as active (docs/adr/0110). Mutation `pause_ended_reason`
/// (the old reason) fails it; seen failing.
#[tokio::test]
async fn a_pause_after_the_last_period_ended_says_billing_ends_it() {
    let b = bed().await;
    let plan = b.plan(&b.a, "EUR", 3000).await;
    let s = b.subscription(&b.a, plan).await;
    let id = s["id"].as_i64().unwrap();
    sqlx::query(
        "UPDATE subscriptions SET cancel_at_period_end = true, \
                current_period_start = now() - interval '40 days', \
                current_period_end = now() - interval '10 days', \
                next_billing_at = now() - interval '10 days', \
                billing_anchor = now() - interval '40 days' \
         WHERE id = $1",
    )
    .bind(id)
    .execute(&mut b.t.superuser().await)
    .await
    .unwrap();
    let path = format!("/v1/subscriptions/{id}/pause");
    let r = b.s.post(&path, &b.a, json!({"behavior": "void"})).await;
    assert_eq!(
        (r.status.as_u16(), r.refusal().0.as_str()),
        (409, "invalid_state"),
        "{}",
        r.text
    );
    assert!(r.text.contains("ends with its period"), "{}", r.text);
    let now =
        b.s.call(
            Method::GET,
            &format!("/v1/subscriptions/{id}"),
            &b.a,
            None,
            None,
        )
        .await;
    assert_eq!(now.json["status"], "active", "{}", now.text);
}
