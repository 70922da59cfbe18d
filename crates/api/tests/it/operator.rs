//! The operator API under /operator/v1, merged beside the tenant API as
//! `hardcount serve` merges it, over the operator role's pool.

use reqwest::StatusCode;
use serde_json::{Value, json};
use testbed::TestDb;
use testbed::receiver::Receiver;

use crate::hooks::{deliver, new_endpoint, worker};
use crate::{Answer, Served, tenant};

const TOKEN: &str = "op-token-0123456789abcdef0123456789abcdef";

async fn serve(t: &TestDb) -> Served {
    let keyring = webhook_delivery::Keyring::parse(testbed::SECRETS_KEY).unwrap();
    let tenant_api = api::router(api::Api::new(t.api(), Some(keyring), crate::config()));
    let operator = api::operator::Operator::new(t.operator(), TOKEN).unwrap();
    let app = tenant_api.merge(api::operator::router(operator));
    let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
    let addr = listener.local_addr().unwrap();
    tokio::spawn(async move { axum::serve(listener, app).await.unwrap() });
    Served {
        base: format!("http://{addr}"),
        client: reqwest::Client::new(),
    }
}

async fn op(s: &Served, method: &str, path: &str, body: Option<Value>) -> Answer {
    s.call(method, path, TOKEN, body.as_ref(), None).await
}

/// Without the token, with a tenant's key or a wrong token: the one 401 on
/// every route. A short token is refused when the API is built.
///
/// Catches: a route left outside the token check (each is called).
#[tokio::test]
async fn every_operator_route_wants_the_operator_token() {
    let t = TestDb::new().await;
    let s = serve(&t).await;
    let tenant_key = tenant(&t, "acme").await;
    let routes = [
        ("GET", "/operator/v1/leaders"),
        ("GET", "/operator/v1/leaders/history"),
        ("POST", "/operator/v1/leaders/billing/pause"),
        ("POST", "/operator/v1/leaders/billing/unpause"),
        ("POST", "/operator/v1/leaders/billing/clear-cooldown"),
        ("GET", "/operator/v1/tenants"),
        ("POST", "/operator/v1/tenants"),
        ("GET", "/operator/v1/tenants/acme/settings"),
        ("PATCH", "/operator/v1/tenants/acme/settings"),
        ("GET", "/operator/v1/keys"),
        ("POST", "/operator/v1/keys"),
        ("POST", "/operator/v1/keys/abcdefgh/revoke"),
        ("GET", "/operator/v1/payment-attempts/needs-review"),
        ("POST", "/operator/v1/payment-attempts/1/settle"),
        ("POST", "/operator/v1/deliveries/replay"),
    ];
    for (method, path) in routes {
        for presented in [
            tenant_key.as_str(),
            "op-token-wrong-0123456789abcdef0123456789",
            "",
        ] {
            let a = s
                .call(method, path, presented, Some(&json!({})), None)
                .await;
            assert_eq!(
                a.status,
                StatusCode::UNAUTHORIZED,
                "{method} {path}: {}",
                a.text
            );
            assert_eq!(a.code(), "unauthorized");
        }
    }
    assert!(api::operator::Operator::new(t.operator(), "short").is_err());
    // The tenant's key still works on the tenant API beside it.
    assert_eq!(
        s.get("/v1/events", &tenant_key).await.status,
        StatusCode::OK
    );
}

/// Leader status, pause, unpause and clear a cooldown; tenants and keys; the
/// needs-review list and a refused settle.
#[tokio::test]
async fn an_operator_steers_roles_tenants_and_keys_over_http() {
    let t = TestDb::new().await;
    let s = serve(&t).await;
    let status = op(&s, "GET", "/operator/v1/leaders", None).await;
    assert_eq!(status.status, StatusCode::OK, "{}", status.text);
    assert_eq!(
        status.json["data"].as_array().unwrap().len(),
        leader::Role::ALL.len()
    );

    let paused = op(
        &s,
        "POST",
        "/operator/v1/leaders/billing/pause",
        Some(json!({"reason": "provider incident", "by": "ops"})),
    )
    .await;
    assert_eq!(paused.status, StatusCode::OK, "{}", paused.text);
    assert_eq!(paused.json["pause_reason"], "provider incident");
    assert!(paused.json["paused_at"].is_string());
    let cleared = op(
        &s,
        "POST",
        "/operator/v1/leaders/billing/clear-cooldown",
        None,
    )
    .await;
    assert_eq!(
        (cleared.status, &cleared.json["paused"]),
        (StatusCode::OK, &json!(true))
    );
    let unpaused = op(&s, "POST", "/operator/v1/leaders/billing/unpause", None).await;
    assert!(unpaused.json["paused_at"].is_null(), "{}", unpaused.text);
    let unknown = op(&s, "POST", "/operator/v1/leaders/nope/unpause", None).await;
    assert_eq!(unknown.status, StatusCode::NOT_FOUND);
    let no_reason = op(
        &s,
        "POST",
        "/operator/v1/leaders/billing/pause",
        Some(json!({"reason": " ", "by": "ops"})),
    )
    .await;
    assert_eq!(
        (no_reason.status, no_reason.param()),
        (StatusCode::BAD_REQUEST, "reason")
    );
    // `by` is bounded at the column's 200 characters, with the API's own
    // words (it was checked at 500, and 201 to 500 met the CHECK's message).
    let long_by = op(
        &s,
        "POST",
        "/operator/v1/leaders/billing/pause",
        Some(json!({"reason": "incident", "by": "o".repeat(201)})),
    )
    .await;
    assert_eq!(
        (long_by.status, long_by.param()),
        (StatusCode::BAD_REQUEST, "by"),
        "{}",
        long_by.text
    );
    assert!(
        long_by.text.contains("1 to 200 characters"),
        "{}",
        long_by.text
    );

    let made = op(
        &s,
        "POST",
        "/operator/v1/tenants",
        Some(json!({"id": "beta", "name": "Beta", "contact_email": "ops@beta.example"})),
    )
    .await;
    assert_eq!(made.status, StatusCode::CREATED, "{}", made.text);
    let again = op(
        &s,
        "POST",
        "/operator/v1/tenants",
        Some(json!({"id": "beta", "name": "B"})),
    )
    .await;
    assert_eq!(again.status, StatusCode::CONFLICT);
    let bad = op(
        &s,
        "POST",
        "/operator/v1/tenants",
        Some(json!({"id": "Not Valid", "name": "x"})),
    )
    .await;
    assert_eq!((bad.status, bad.param()), (StatusCode::BAD_REQUEST, "id"));
    // A display name parses as a mailbox but the column holds a bare
    // address; a space at the end passes the parser (it trims) and only the
    // column's rule refuses it. Both name the field and create nothing.
    for contact in ["Ops <ops@gamma.example>", "ops@gamma.example "] {
        let named = op(
            &s,
            "POST",
            "/operator/v1/tenants",
            Some(json!({"id": "gamma", "name": "Gamma", "contact_email": contact})),
        )
        .await;
        assert_eq!(
            (named.status, named.param()),
            (StatusCode::BAD_REQUEST, "contact_email"),
            "{}",
            named.text
        );
        assert!(named.text.contains("bare email address"), "{}", named.text);
    }
    let tenants = op(&s, "GET", "/operator/v1/tenants", None).await;
    assert!(
        tenants.text.contains("ops@beta.example") && !tenants.text.contains("gamma"),
        "{}",
        tenants.text
    );

    let key = op(
        &s,
        "POST",
        "/operator/v1/keys",
        Some(json!({"tenant_id": "beta", "name": "ci"})),
    )
    .await;
    assert_eq!(key.status, StatusCode::CREATED, "{}", key.text);
    let secret = key.json["key"].as_str().unwrap().to_owned();
    assert_eq!(s.get("/v1/events", &secret).await.status, StatusCode::OK);
    let listed = op(&s, "GET", "/operator/v1/keys?tenant=beta", None).await;
    assert!(!listed.text.contains(&secret[12..]), "a list shows the key");
    let prefix = key.json["prefix"].as_str().unwrap();
    let revoked = op(
        &s,
        "POST",
        &format!("/operator/v1/keys/{prefix}/revoke"),
        None,
    )
    .await;
    assert!(revoked.json["revoked_at"].is_string(), "{}", revoked.text);
    assert_eq!(
        s.get("/v1/events", &secret).await.status,
        StatusCode::UNAUTHORIZED
    );

    let review = op(
        &s,
        "GET",
        "/operator/v1/payment-attempts/needs-review",
        None,
    )
    .await;
    assert_eq!(
        (review.status, &review.json["data"]),
        (StatusCode::OK, &json!([]))
    );
    let settle = op(
        &s,
        "POST",
        "/operator/v1/payment-attempts/999/settle",
        Some(json!({"outcome": "paid", "by": "ops", "note": "seen in the dashboard"})),
    )
    .await;
    assert_eq!(settle.status, StatusCode::NOT_FOUND, "{}", settle.text);
    let wrong = op(
        &s,
        "POST",
        "/operator/v1/payment-attempts/999/settle",
        Some(json!({"outcome": "maybe", "by": "ops", "note": "x"})),
    )
    .await;
    assert_eq!(
        (wrong.status, wrong.param()),
        (StatusCode::BAD_REQUEST, "outcome")
    );
}

/// A settle the function refuses answers in its words: a 409 for the
/// attempt's state (a declined attempt is not waiting for review; it was a
/// 500 that named nothing, which a tool may retry), a 400 for a value (an
/// intent of the wrong shape; it was a 400 about a NUL character). Mutation
/// `settle_refusal_500` (the state refusal left to the generic mapping) and
/// the first is 500.
#[tokio::test]
async fn a_refused_settle_answers_in_the_functions_words() {
    let t = TestDb::new().await;
    let s = serve(&t).await;
    tenant(&t, "acme").await;
    crate::dunning::declined_invoice(&t, "acme").await;
    let attempt: i64 = db::Row::get(
        &t.db
            .fetch_one(db::sql("SELECT id FROM payment_attempts"))
            .await
            .unwrap(),
        0,
    );
    let path = format!("/operator/v1/payment-attempts/{attempt}/settle");
    let state = op(
        &s,
        "POST",
        &path,
        Some(json!({"outcome": "failed", "by": "ops", "note": "drill"})),
    )
    .await;
    assert_eq!(state.status, StatusCode::CONFLICT, "{}", state.text);
    assert!(
        state.text.contains("not waiting for review"),
        "{}",
        state.text
    );
    let value = op(
        &s,
        "POST",
        &path,
        Some(json!({"outcome": "paid", "by": "ops", "note": "drill", "payment_intent": "nope"})),
    )
    .await;
    assert_eq!(value.status, StatusCode::BAD_REQUEST, "{}", value.text);
    assert!(
        value.text.contains("not a PaymentIntent id"),
        "{}",
        value.text
    );
}

/// Replay across tenants: dead deliveries of enabled endpoints since a time
/// back to pending, for one tenant or all, each once.
///
/// Catches: the tenant filter ignored (seen: the first call replayed both).
#[tokio::test]
async fn an_operator_replays_dead_deliveries_across_tenants() {
    let t = TestDb::new().await;
    let s = serve(&t).await;
    let rx = Receiver::answering(410).await;
    let mut endpoints = Vec::new();
    for name in ["acme", "beta"] {
        let key = tenant(&t, name).await;
        let ep = new_endpoint(&s, &key, &rx.url()).await;
        s.post("/v1/events", &key, json!({"type": "a.b", "data": {}}))
            .await;
        endpoints.push((key, ep["id"].as_i64().unwrap()));
    }
    deliver(&t, &worker(&t)).await;
    // The 410 turned both endpoints off; a replay waits for them to be on.
    let none = op(
        &s,
        "POST",
        "/operator/v1/deliveries/replay",
        Some(json!({"since": "2000-01-01T00:00:00Z"})),
    )
    .await;
    assert_eq!(none.json["replayed"], 0, "{}", none.text);
    for (key, id) in &endpoints {
        crate::hooks::enable(&s, key, *id).await;
    }
    let acme = op(
        &s,
        "POST",
        "/operator/v1/deliveries/replay",
        Some(json!({"since": "2000-01-01T00:00:00Z", "tenant_id": "acme"})),
    )
    .await;
    assert_eq!(acme.json["replayed"], 1, "{}", acme.text);
    let rest = op(
        &s,
        "POST",
        "/operator/v1/deliveries/replay",
        Some(json!({"since": "2000-01-01T00:00:00Z"})),
    )
    .await;
    assert_eq!(rest.json["replayed"], 1, "{}", rest.text);
    let bad = op(
        &s,
        "POST",
        "/operator/v1/deliveries/replay",
        Some(json!({"since": "yesterday"})),
    )
    .await;
    assert_eq!(
        (bad.status, bad.param()),
        (StatusCode::BAD_REQUEST, "since")
    );
}

/// A replay puts back at most its limit, however the batch is planned: five
/// dead deliveries, a limit of two, come back as 2, 2, 1 (the answer's
/// `more_may_remain` true, true, false). A `LIMIT … FOR UPDATE SKIP LOCKED`
/// picked in a subquery of an UPDATE can be scanned again after rows were
/// updated and take the next ones (docs/adr/0102 saw it put back 4 for 2).
/// Mutation `replay_limit` (the limit multiplied) fails it; seen failing.
#[tokio::test]
async fn an_operator_replay_puts_back_at_most_its_limit() {
    let t = TestDb::new().await;
    let s = serve(&t).await;
    let key = tenant(&t, "acme").await;
    crate::hooks::dead_on_enabled_endpoint(&t, &s, &key, 5).await;
    let mut seen = Vec::new();
    for _ in 0..3 {
        let a = op(
            &s,
            "POST",
            "/operator/v1/deliveries/replay",
            Some(json!({"since": "2000-01-01T00:00:00Z", "limit": 2})),
        )
        .await;
        seen.push((
            a.json["replayed"].clone(),
            a.json["more_may_remain"].clone(),
        ));
    }
    assert_eq!(
        seen,
        [
            (json!(2), json!(true)),
            (json!(2), json!(true)),
            (json!(1), json!(false))
        ]
    );
}

/// The operator routes carry their own limits (docs/adr/0120): a body over
/// their 64 KiB is a 413 in the one error shape naming that limit, whether
/// the limit layer refused it from its Content-Length or the body ran over
/// while read (no Content-Length). Merged after the tenant API's layers, the
/// routes had none of them: the first answer was an empty 413, the second
/// named the tenant API's 1 MiB. Called in process (`oneshot`): over a socket
/// the server answers from the Content-Length and closes while the client
/// still writes. Mutations `operator_errors_bare` (the error mapping taken
/// out) and `operator_limit_named` (the extractor names the tenant API's
/// limit) each fail it. A path axum cannot read is a 400 in the same shape.
#[tokio::test]
async fn an_operator_body_over_its_limit_or_a_bad_path_is_refused_in_the_one_shape() {
    use tower::ServiceExt as _;
    let t = TestDb::new().await;
    let big = json!({"reason": "x".repeat(api::operator::MAX_BODY_BYTES), "by": "ops"}).to_string();
    let limit = api::operator::MAX_BODY_BYTES.to_string();
    for declared in [true, false] {
        let operator = api::operator::Operator::new(t.operator(), TOKEN).unwrap();
        let mut request = axum::http::Request::post("/operator/v1/leaders/billing/pause")
            .header("authorization", format!("Bearer {TOKEN}"))
            .header("content-type", "application/json");
        if declared {
            request = request.header("content-length", big.len());
        }
        let answer = api::operator::router(operator)
            .oneshot(request.body(axum::body::Body::from(big.clone())).unwrap())
            .await
            .unwrap();
        assert_eq!(answer.status(), StatusCode::PAYLOAD_TOO_LARGE);
        let body = axum::body::to_bytes(answer.into_body(), usize::MAX)
            .await
            .unwrap();
        let v: Value = serde_json::from_slice(&body).unwrap_or(Value::Null);
        assert_eq!(
            v["error"]["code"], "body_too_large",
            "declared {declared}: {v}"
        );
        let message = v["error"]["message"].as_str().unwrap_or_default();
        assert!(message.contains(&limit), "declared {declared}: {message}");
    }
    // A path segment that is not UTF-8, refused by axum's own extractor in
    // plain text: a 400 in the one shape, not a 500 (mutation
    // `unreadable_as_internal`).
    let operator = api::operator::Operator::new(t.operator(), TOKEN).unwrap();
    let request = axum::http::Request::post("/operator/v1/leaders/%FF/unpause")
        .header("authorization", format!("Bearer {TOKEN}"))
        .body(axum::body::Body::empty())
        .unwrap();
    let answer = api::operator::router(operator)
        .oneshot(request)
        .await
        .unwrap();
    assert_eq!(answer.status(), StatusCode::BAD_REQUEST);
    let body = axum::body::to_bytes(answer.into_body(), usize::MAX)
        .await
        .unwrap();
    let v: Value = serde_json::from_slice(&body).unwrap_or(Value::Null);
    assert_eq!(v["error"]["code"], "parameter_invalid", "{v}");
    // Nothing was paused.
    let s = serve(&t).await;
    let status = op(&s, "GET", "/operator/v1/leaders", None).await;
    assert!(
        status.json["data"]
            .as_array()
            .unwrap()
            .iter()
            .all(|r| r["paused_at"].is_null()),
        "{}",
        status.text
    );
}

/// A tenant's settings, read and changed by an operator (docs/adr/0148): the
/// defaults until set; a change leaves the fields it does not name; a sender
/// set here is the domain the tenant's own emails may come from
/// (docs/adr/0143), and `null` gives the deployment's back; a bad value is
/// refused by name and changes nothing; an unknown tenant is 404. The tenant
/// API's role can no longer write the settings itself (migration 0056).
///
/// Catches: the sender's setting not written (the tenant's email refused),
/// `null` read as "leave it" (its email still accepted after the reset), a
/// partial change resetting the other fields, the API role's write left.
#[tokio::test]
async fn an_operator_sets_a_tenants_settings_and_its_sender_domain_follows() {
    let t = TestDb::new().await;
    let s = serve(&t).await;
    let key = tenant(&t, "acme").await;
    let path = "/operator/v1/tenants/acme/settings";
    let got = op(&s, "GET", path, None).await;
    assert_eq!(got.status, StatusCode::OK, "{}", got.text);
    assert_eq!(
        (
            &got.json["invoice_prefix"],
            &got.json["invoice_on_cancel"],
            &got.json["email_from"]
        ),
        (&json!("INV"), &json!(true), &Value::Null)
    );
    let email = |from: &str| json!({"from": from, "to": ["a@example.org"], "subject": "Hello", "text": "Hi"});
    let refused = s
        .post("/v1/emails", &key, email("orders@acme.example"))
        .await;
    assert_eq!(
        (refused.status, refused.param()),
        (StatusCode::BAD_REQUEST, "from")
    );

    let set = op(
        &s,
        "PATCH",
        path,
        Some(json!({"email_from": "Acme <billing@acme.example>"})),
    )
    .await;
    assert_eq!(set.status, StatusCode::OK, "{}", set.text);
    assert_eq!(set.json["email_from"], json!("Acme <billing@acme.example>"));
    let sent = s
        .post("/v1/emails", &key, email("orders@acme.example"))
        .await;
    assert_eq!(sent.status, StatusCode::CREATED, "{}", sent.text);
    // Another tenant may not have the same domain: each could send in the
    // other's name.
    tenant(&t, "beta").await;
    let shared = op(
        &s,
        "PATCH",
        "/operator/v1/tenants/beta/settings",
        Some(json!({"email_from": "billing@ACME.example"})),
    )
    .await;
    assert_eq!(
        (shared.status, shared.param()),
        (StatusCode::BAD_REQUEST, "email_from"),
        "{}",
        shared.text
    );
    assert!(shared.text.contains("tenant acme"), "{}", shared.text);

    let prefix = op(
        &s,
        "PATCH",
        path,
        Some(json!({"invoice_prefix": "ACME", "invoice_on_cancel": false})),
    )
    .await;
    assert_eq!(prefix.status, StatusCode::OK, "{}", prefix.text);
    assert_eq!(
        (
            &prefix.json["invoice_prefix"],
            &prefix.json["invoice_on_cancel"],
            &prefix.json["email_from"]
        ),
        (
            &json!("ACME"),
            &json!(false),
            &json!("Acme <billing@acme.example>")
        )
    );
    for (body, param) in [
        (json!({"invoice_prefix": "acme"}), "invoice_prefix"),
        (json!({"invoice_prefix": ""}), "invoice_prefix"),
        (json!({"email_from": "not an address"}), "email_from"),
        (
            json!({"email_from": "Acme <billing@acme.example>\r\nBcc: x@evil.test"}),
            "email_from",
        ),
    ] {
        let bad = op(&s, "PATCH", path, Some(body.clone())).await;
        assert_eq!(
            (bad.status, bad.param()),
            (StatusCode::BAD_REQUEST, param),
            "{body}: {}",
            bad.text
        );
    }
    let unknown = op(&s, "PATCH", path, Some(json!({"invoce_prefix": "X"}))).await;
    assert_eq!(unknown.status, StatusCode::BAD_REQUEST, "{}", unknown.text);
    let after = op(&s, "GET", path, None).await;
    assert_eq!(
        after.json["invoice_prefix"],
        json!("ACME"),
        "nothing changed by the refusals"
    );

    let reset = op(&s, "PATCH", path, Some(json!({"email_from": null}))).await;
    assert_eq!(
        (reset.status, &reset.json["email_from"]),
        (StatusCode::OK, &Value::Null),
        "{}",
        reset.text
    );
    assert_eq!(reset.json["invoice_prefix"], json!("ACME"));
    let refused = s
        .post("/v1/emails", &key, email("orders@acme.example"))
        .await;
    assert_eq!(
        (refused.status, refused.param()),
        (StatusCode::BAD_REQUEST, "from")
    );

    let missing = op(&s, "GET", "/operator/v1/tenants/nobody/settings", None).await;
    assert_eq!(missing.status, StatusCode::NOT_FOUND, "{}", missing.text);
    let missing = op(
        &s,
        "PATCH",
        "/operator/v1/tenants/nobody/settings",
        Some(json!({"invoice_prefix": "X"})),
    )
    .await;
    assert_eq!(missing.status, StatusCode::NOT_FOUND, "{}", missing.text);

    let denied = t
        .api()
        .execute(db::sql(
            "UPDATE tenant_settings SET email_from = 'x@evil.test'",
        ))
        .await
        .unwrap_err();
    assert_eq!(denied.code().as_deref(), Some("42501"), "{denied}");
}

/// A tenant's payment page (docs/adr/0150), set by an operator: stored as
/// given and returned; refused by name, nothing changed, when it is not
/// https, carries credentials, holds a space or does not parse; `null` takes
/// it away and leaves the other settings. Migration 0058's CHECK holds a
/// writer that skips the route's rule (the owner here).
///
/// Mutation `payment_page_any_scheme` (the route's https rule taken out)
/// fails here: the CHECK then refuses with its own message, by constraint.
#[tokio::test]
async fn an_operator_sets_a_tenants_payment_page() {
    let t = TestDb::new().await;
    let s = serve(&t).await;
    tenant(&t, "acme").await;
    let path = "/operator/v1/tenants/acme/settings";
    let page = "https://acme.example/billing/pay?invoice={invoice}";
    let set = op(&s, "PATCH", path, Some(json!({"payment_page_url": page}))).await;
    assert_eq!(set.status, StatusCode::OK, "{}", set.text);
    assert_eq!(set.json["payment_page_url"], json!(page));
    for (bad, why) in [
        ("http://acme.example/pay/{invoice}", "is not https"),
        ("https://user:pw@acme.example/pay", "carries credentials"),
        ("https://acme.example/pay me", "has a space"),
        ("https:///pay", "names no host"),
        ("https://[acme/pay", "is not an address"),
        ("acme.example/pay", "is not https"),
    ] {
        let refused = op(&s, "PATCH", path, Some(json!({"payment_page_url": bad}))).await;
        assert_eq!(
            (refused.status, refused.param()),
            (StatusCode::BAD_REQUEST, "payment_page_url"),
            "{bad}: {}",
            refused.text
        );
        assert!(refused.text.contains(why), "{bad}: {}", refused.text);
    }
    let after = op(&s, "GET", path, None).await;
    assert_eq!(
        after.json["payment_page_url"],
        json!(page),
        "nothing changed"
    );
    let cleared = op(
        &s,
        "PATCH",
        path,
        Some(json!({"payment_page_url": null, "invoice_prefix": "ACME"})),
    )
    .await;
    assert_eq!(
        (
            cleared.status,
            &cleared.json["payment_page_url"],
            &cleared.json["invoice_prefix"]
        ),
        (StatusCode::OK, &Value::Null, &json!("ACME")),
        "{}",
        cleared.text
    );
    let mut su = t.superuser().await;
    for bad in [
        "http://acme.example/pay",
        "https://user@acme.example/pay",
        "https://acme.example/a b",
    ] {
        let refused = sqlx::query("UPDATE tenant_settings SET payment_page_url = $1")
            .bind(bad)
            .execute(&mut su)
            .await
            .unwrap_err();
        let refused = refused.as_database_error().map(|e| e.constraint());
        assert_eq!(
            refused,
            Some(Some("tenant_settings_payment_page_url_shape")),
            "{bad}"
        );
    }
}

/// A tenant's sender domain is refused (by name, nothing changed) when it is
/// the deployment's own (`HARDCOUNT_EMAIL_FROM`'s: the tenant could send as
/// the platform), or another tenant's written in another form: IDNA's
/// Unicode and ASCII forms of one domain are one domain (docs/adr/0151).
///
/// Mutations `platform_sender_domain` (the deployment's domain let through)
/// and `sender_domain_ascii_only` (domains compared in lower case only) each
/// fail here.
#[tokio::test]
async fn a_sender_at_the_platforms_domain_or_another_tenants_in_another_form_is_refused() {
    let t = TestDb::new().await;
    let s = serve(&t).await;
    tenant(&t, "acme").await;
    tenant(&t, "beta").await;
    let platform = billing::BillingConfig::default().email_from;
    assert!(platform.ends_with("@example.com>"), "{platform}");
    let path = "/operator/v1/tenants/acme/settings";
    let own = op(
        &s,
        "PATCH",
        path,
        Some(json!({"email_from": "Acme <acme@EXAMPLE.com>"})),
    )
    .await;
    assert_eq!(
        (own.status, own.param()),
        (StatusCode::BAD_REQUEST, "email_from"),
        "{}",
        own.text
    );
    assert!(own.text.contains("HARDCOUNT_EMAIL_FROM"), "{}", own.text);
    let set = op(
        &s,
        "PATCH",
        path,
        Some(json!({"email_from": "Bücher <billing@bücher.example>"})),
    )
    .await;
    assert_eq!(set.status, StatusCode::OK, "{}", set.text);
    let shared = op(
        &s,
        "PATCH",
        "/operator/v1/tenants/beta/settings",
        Some(json!({"email_from": "billing@XN--BCHER-KVA.example"})),
    )
    .await;
    assert_eq!(
        (shared.status, shared.param()),
        (StatusCode::BAD_REQUEST, "email_from"),
        "{}",
        shared.text
    );
    assert!(shared.text.contains("tenant acme"), "{}", shared.text);
}

/// Two sender changes wait for each other, so two tenants cannot both find
/// one domain free at the same instant (docs/adr/0151). Here a transaction
/// holds the settings' lock (the key `set_tenant_settings` takes) while
/// beta's change to `shared.example` starts; the change waits, acme's sender
/// at that domain commits, and the change, run after it, is refused.
///
/// Mutation `sender_change_unserialized` (no lock taken) fails here: the
/// change completes while the other transaction is open, and beta gets the
/// domain acme then also has.
#[tokio::test]
async fn two_sender_changes_at_one_domain_wait_for_each_other() {
    use sqlx::Connection as _;
    let t = TestDb::new().await;
    tenant(&t, "acme").await;
    tenant(&t, "beta").await;
    let mut su = t.superuser().await;
    let mut holder = su.begin().await.unwrap();
    sqlx::query(
        "SELECT pg_advisory_xact_lock(hashtextextended('hardcount tenant sender domains', 0))",
    )
    .execute(&mut *holder)
    .await
    .unwrap();
    let db = t.operator();
    let change = api::keys::SettingsChange {
        email_from: Some(Some("billing@shared.example".to_owned())),
        ..Default::default()
    };
    let platform = billing::BillingConfig::default().email_from;
    let beta = tokio::spawn(async move {
        api::keys::set_tenant_settings(&db, "beta", &change, &platform).await
    });
    tokio::time::sleep(std::time::Duration::from_millis(700)).await;
    assert!(
        !beta.is_finished(),
        "beta's change did not wait for the lock"
    );
    sqlx::query("INSERT INTO tenant_settings (tenant_id, email_from) VALUES ('acme', 'billing@shared.example')")
        .execute(&mut *holder)
        .await
        .unwrap();
    holder.commit().await.unwrap();
    let refused = beta.await.unwrap().unwrap_err();
    assert!(
        matches!(
            &refused,
            api::keys::KeysError::BadSetting {
                param: "email_from",
                ..
            }
        ),
        "{refused:?}"
    );
}
