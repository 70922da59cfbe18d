//! The tenant API as `hardcount serve` serves it (issue 24), on its own
//! bound listener, through the current leg: keys made with the real CLI,
//! every answer in the one error shape, idempotent POSTs, cursor pages, the
//! rate limit, the tenant boundary over every route of the OpenAPI document,
//! each answer checked against the schema the document declares for it, and
//! no secret in the log of the run.

mod sweep;

use std::path::PathBuf;
use std::time::{Duration, Instant};

use db::Row as _;
use reqwest::Method;
use serde_json::{Value, json};
use testbed::{Leg, TestDb};

use crate::hardcount;
use crate::serve::Serve;

/// A replica serving the tenant API (and the webhook roles) on a fresh
/// database, with its log kept.
pub struct ApiBed {
    pub t: TestDb,
    pub _serve: Serve,
    pub port: u16,
    pub http: reqwest::Client,
    pub log: PathBuf,
}

/// One answer: status, headers, body as text and (when it parses) JSON.
#[derive(Debug)]
pub struct Answer {
    pub status: u16,
    pub headers: reqwest::header::HeaderMap,
    pub text: String,
    pub json: Value,
}

impl Answer {
    /// The error's `(code, param)`.
    pub fn error(&self) -> (String, Option<String>) {
        let e = &self.json["error"];
        (
            e["code"].as_str().unwrap_or_default().to_owned(),
            e["param"].as_str().map(str::to_owned),
        )
    }
}

impl ApiBed {
    pub async fn start(extra: &[(&str, &str)]) -> ApiBed {
        ApiBed::start_on(TestDb::new().await, extra).await
    }

    /// [`ApiBed::start`] on a database the caller made (to seed its URLs).
    pub async fn start_on(t: TestDb, extra: &[(&str, &str)]) -> ApiBed {
        let leg = Leg::current();
        let port = testbed::free_port();
        let addr = format!("127.0.0.1:{port}");
        let api_url = t.role_url("hardcount_api", leg);
        let log = std::env::temp_dir().join(format!("{}-serve.log", t.name()));
        let mut env = vec![
            ("HARDCOUNT_API_ADDR", addr.as_str()),
            ("HARDCOUNT_API_DATABASE_URL", api_url.as_str()),
        ];
        if !extra.iter().any(|(k, _)| *k == "HARDCOUNT_ROLES") {
            env.push(("HARDCOUNT_ROLES", "webhook_outbox,webhook_delivery"));
        }
        env.extend_from_slice(extra);
        let serve = Serve::start_logged(&t.app_url(leg), &env, Some(&log)).await;
        let bed = ApiBed {
            t,
            _serve: serve,
            port,
            http: reqwest::Client::new(),
            log,
        };
        let deadline = Instant::now() + Duration::from_secs(20);
        while bed.http.get(bed.url("/openapi.json")).send().await.is_err() {
            assert!(Instant::now() < deadline, "the tenant API did not listen");
            tokio::time::sleep(Duration::from_millis(50)).await;
        }
        bed
    }

    pub fn url(&self, path: &str) -> String {
        format!("http://127.0.0.1:{}{path}", self.port)
    }

    /// `hardcount ARGS` as the operator; its stdout. Panics on failure.
    pub fn cli(&self, args: &[&str]) -> String {
        let out = self.cli_output(args);
        assert!(out.status.success(), "{}", crate::text(&out));
        String::from_utf8(out.stdout).unwrap()
    }

    pub fn cli_output(&self, args: &[&str]) -> std::process::Output {
        hardcount()
            .args(args)
            .env(
                "HARDCOUNT_OPERATOR_DATABASE_URL",
                self.t.operator_url(Leg::current()),
            )
            .output()
            .unwrap()
    }

    /// A tenant made with `hardcount tenants create` and its key from
    /// `hardcount keys create`.
    pub fn tenant(&self, id: &str) -> String {
        self.cli(&[
            "tenants",
            "create",
            id,
            "--contact-email",
            "ops@example.org",
        ]);
        let key = self.cli(&["keys", "create", id, "--name", "tests"]);
        key.trim().to_owned()
    }

    pub async fn call(
        &self,
        method: Method,
        path: &str,
        key: Option<&str>,
        body: Option<&str>,
        headers: &[(&str, &str)],
    ) -> Answer {
        let mut r = self.http.request(method, self.url(path));
        if let Some(key) = key {
            r = r.header("authorization", format!("Bearer {key}"));
        }
        if let Some(body) = body {
            r = r
                .header("content-type", "application/json")
                .body(body.to_owned());
        }
        for (k, v) in headers {
            r = r.header(*k, *v);
        }
        let resp = r.send().await.unwrap();
        let status = resp.status().as_u16();
        let headers = resp.headers().clone();
        let text = resp.text().await.unwrap();
        let json = serde_json::from_str(&text).unwrap_or(Value::Null);
        Answer {
            status,
            headers,
            text,
            json,
        }
    }

    pub async fn get(&self, path: &str, key: &str) -> Answer {
        self.call(Method::GET, path, Some(key), None, &[]).await
    }

    pub async fn post(&self, path: &str, key: &str, body: &Value) -> Answer {
        self.call(Method::POST, path, Some(key), Some(&body.to_string()), &[])
            .await
    }

    pub fn log_text(&self) -> String {
        std::fs::read_to_string(&self.log).unwrap_or_default()
    }
}

/// README's "call it": a tenant and its key from the CLI, an event
/// published, read back, listed, and fanned out by the webhook_outbox role.
#[tokio::test]
async fn a_tenant_publishes_an_event_and_reads_it_back() {
    let bed = ApiBed::start(&[]).await;
    let key = bed.tenant("acme");
    let a = bed
        .post(
            "/v1/events",
            &key,
            &json!({"type": "invoice.paid", "data": {"invoice": 7}}),
        )
        .await;
    assert_eq!(a.status, 201, "{}", a.text);
    let id = a.json["id"].as_i64().unwrap();
    assert_eq!(a.json["type"], "invoice.paid");
    assert_eq!(a.json["data"], json!({"invoice": 7}));
    assert!(a.json["message_id"].as_str().unwrap().starts_with("msg_"));

    let got = bed.get(&format!("/v1/events/{id}"), &key).await;
    assert_eq!(got.status, 200, "{}", got.text);
    assert_eq!(got.json["id"], id);
    let list = bed.get("/v1/events?type=invoice.paid", &key).await;
    assert_eq!(list.status, 200);
    assert_eq!(list.json["data"][0]["id"], id);
    assert_eq!(list.json["has_more"], false);

    // The webhook_outbox role fans it out (to no endpoint) and stamps it.
    let deadline = Instant::now() + Duration::from_secs(15);
    loop {
        let got = bed.get(&format!("/v1/events/{id}"), &key).await;
        if got.json["dispatched_at"].is_string() {
            break;
        }
        assert!(Instant::now() < deadline, "never dispatched: {}", got.text);
        tokio::time::sleep(Duration::from_millis(200)).await;
    }
}

/// No key, a malformed header, a key of the right shape that was never
/// made, and a revoked key: one 401, byte for byte.
///
/// Catches: `api_authenticate` ignoring `revoked_at` (the revoked key reads).
#[tokio::test]
async fn a_missing_malformed_unknown_or_revoked_key_gets_one_401() {
    let bed = ApiBed::start(&[]).await;
    let key = bed.tenant("acme");
    assert_eq!(bed.get("/v1/events", &key).await.status, 200);
    let prefix = &key[3..11];
    let out = bed.cli(&["keys", "list", "--tenant", "acme"]);
    assert!(out.contains(prefix), "{out}");
    assert!(!out.contains(&key[12..]), "keys list shows the key: {out}");
    bed.cli(&["keys", "revoke", prefix]);

    let unknown = format!("hc_{}_{}", "zzzzzzzz", &key[12..]);
    let mut bodies = Vec::new();
    for (auth, label) in [
        (None, "no header"),
        (Some("Basic dXNlcjpwYXNz".to_owned()), "not a bearer"),
        (Some("Bearer not-a-key".to_owned()), "malformed"),
        (Some(format!("Bearer {unknown}")), "unknown"),
        (Some(format!("Bearer {key}")), "revoked"),
    ] {
        let mut r = bed.http.get(bed.url("/v1/events"));
        if let Some(a) = auth {
            r = r.header("authorization", a);
        }
        let resp = r.send().await.unwrap();
        assert_eq!(resp.status().as_u16(), 401, "{label}");
        bodies.push(resp.text().await.unwrap());
    }
    assert!(bodies.windows(2).all(|w| w[0] == w[1]), "{bodies:#?}");
    let body: Value = serde_json::from_str(&bodies[0]).unwrap();
    assert_eq!(body["error"]["type"], "authentication_error");
    assert_eq!(body["error"]["code"], "unauthorized");
}

/// Bad input of each kind answers 400 with the field named, and the rest
/// of the one error shape: an unknown route 404, a wrong method 405, a body
/// that is not JSON 415, one too large 413.
#[tokio::test]
async fn every_refusal_has_the_one_shape_and_names_its_field() {
    let bed = ApiBed::start(&[]).await;
    let key = bed.tenant("acme");
    // (method, path, body, status, code, param)
    type Case<'a> = (
        Method,
        &'a str,
        Option<String>,
        u16,
        &'a str,
        Option<&'a str>,
    );
    let cases: Vec<Case> = vec![
        (
            Method::POST,
            "/v1/events",
            Some("{".into()),
            400,
            "invalid_json",
            Some("body"),
        ),
        (
            Method::POST,
            "/v1/events",
            Some(r#"{"data": {}}"#.into()),
            400,
            "parameter_missing",
            Some("type"),
        ),
        (
            Method::POST,
            "/v1/events",
            Some(r#"{"type": "a", "data": 1, "colour": 2}"#.into()),
            400,
            "parameter_unknown",
            Some("colour"),
        ),
        (
            Method::POST,
            "/v1/events",
            Some(r#"{"type": 5, "data": {}}"#.into()),
            400,
            "parameter_invalid_type",
            Some("type"),
        ),
        (
            Method::POST,
            "/v1/events",
            Some(r#"{"type": "no spaces", "data": {}}"#.into()),
            400,
            "parameter_invalid",
            Some("type"),
        ),
        (
            Method::POST,
            "/v1/events",
            Some(format!(
                r#"{{"type": "a", "data": "{}"}}"#,
                "x".repeat(300 * 1024)
            )),
            400,
            "parameter_out_of_range",
            Some("data"),
        ),
        (
            Method::GET,
            "/v1/events?limit=0",
            None,
            400,
            "parameter_out_of_range",
            Some("limit"),
        ),
        (
            Method::GET,
            "/v1/events?limit=many",
            None,
            400,
            "parameter_invalid_type",
            Some("limit"),
        ),
        (
            Method::GET,
            "/v1/events?colour=red",
            None,
            400,
            "parameter_unknown",
            Some("colour"),
        ),
        (
            Method::GET,
            "/v1/events?starting_after=nonsense",
            None,
            400,
            "parameter_invalid",
            Some("starting_after"),
        ),
        (
            Method::GET,
            "/v1/events/0",
            None,
            400,
            "parameter_out_of_range",
            Some("id"),
        ),
        (
            Method::GET,
            "/v1/events/seven",
            None,
            400,
            "parameter_invalid_type",
            Some("id"),
        ),
        (
            Method::GET,
            "/v1/events/424242",
            None,
            404,
            "resource_missing",
            None,
        ),
        (
            Method::GET,
            "/v1/nothing",
            None,
            404,
            "route_not_found",
            None,
        ),
        (
            Method::DELETE,
            "/v1/events",
            None,
            405,
            "method_not_allowed",
            None,
        ),
    ];
    for (method, path, body, status, code, param) in cases {
        let a = bed
            .call(method.clone(), path, Some(&key), body.as_deref(), &[])
            .await;
        assert_eq!(a.status, status, "{method} {path}: {}", a.text);
        let (got_code, got_param) = a.error();
        assert_eq!(got_code, code, "{method} {path}: {}", a.text);
        if param.is_some() {
            assert_eq!(got_param.as_deref(), param, "{method} {path}: {}", a.text);
        }
        assert!(
            a.json["error"]["message"]
                .as_str()
                .is_some_and(|m| !m.is_empty())
        );
        assert!(a.json["error"]["type"].is_string());
    }
    // Not JSON at all.
    let a = bed
        .http
        .post(bed.url("/v1/events"))
        .header("authorization", format!("Bearer {key}"))
        .header("content-type", "text/plain")
        .body("type=a")
        .send()
        .await
        .unwrap();
    assert_eq!(a.status().as_u16(), 415);
    let v: Value = serde_json::from_str(&a.text().await.unwrap()).unwrap();
    assert_eq!(v["error"]["code"], "unsupported_media_type");
    // Too large: last, since the server closes the connection without
    // reading the rest of the body, and a pooled client could reuse it.
    let a = bed
        .call(
            Method::POST,
            "/v1/events",
            Some(&key),
            Some(&"x".repeat(api::MAX_BODY_BYTES + 1024)),
            &[],
        )
        .await;
    assert_eq!(a.status, 413, "{}", a.text);
    assert_eq!(a.error().0, "body_too_large");
    // Nothing of all that was stored (asked on a fresh connection).
    let fresh = ApiBed {
        http: reqwest::Client::new(),
        ..bed
    };
    let list = fresh.get("/v1/events", &key).await;
    assert_eq!(list.json["data"], json!([]), "{}", list.text);
}

/// A POST retried with its `Idempotency-Key` and body returns the first
/// answer and publishes nothing more, even when the retries race; another
/// body under the key answers 409; after 24 hours the key is forgotten.
///
/// Catches: dropping the fingerprint comparison in `Scope::idempotent` (the
/// other body gets the first answer), and binding the key outside the
/// request's transaction (the racing retries publish twice).
#[tokio::test]
async fn a_retry_with_the_same_idempotency_key_returns_the_first_answer() {
    let bed = ApiBed::start(&[]).await;
    let key = bed.tenant("acme");
    let body = r#"{"type": "order.created", "data": {"n": 1}}"#;
    let idem = [("idempotency-key", "order-1")];
    let first = bed
        .call(Method::POST, "/v1/events", Some(&key), Some(body), &idem)
        .await;
    assert_eq!(first.status, 201, "{}", first.text);
    let mut racing = Vec::new();
    for _ in 0..8 {
        racing.push(bed.call(Method::POST, "/v1/events", Some(&key), Some(body), &idem));
    }
    // Polled together: each waits on the first request's key row.
    for again in futures::future::join_all(racing).await {
        assert_eq!(again.status, 201);
        assert_eq!(again.text, first.text);
        assert_eq!(again.headers["idempotent-replayed"], "true");
    }
    let other = bed
        .call(
            Method::POST,
            "/v1/events",
            Some(&key),
            Some(r#"{"type": "order.created", "data": {"n": 2}}"#),
            &idem,
        )
        .await;
    assert_eq!(other.status, 409, "{}", other.text);
    assert_eq!(other.error().0, "idempotency_key_reused");
    let bad = bed
        .call(
            Method::POST,
            "/v1/events",
            Some(&key),
            Some(body),
            &[("idempotency-key", "has space")],
        )
        .await;
    assert_eq!(bad.status, 400);
    assert_eq!(
        bad.error(),
        (
            "idempotency_key_invalid".into(),
            Some("Idempotency-Key".into())
        )
    );
    let list = bed.get("/v1/events", &key).await;
    assert_eq!(
        list.json["data"].as_array().unwrap().len(),
        1,
        "{}",
        list.text
    );

    // A day later the key is forgotten: the same request publishes again.
    let mut owner = bed.t.superuser().await;
    sqlx::query(
        "UPDATE api_idempotency_keys SET created_at = now() - interval '24 hours 1 second'",
    )
    .execute(&mut owner)
    .await
    .unwrap();
    let later = bed
        .call(Method::POST, "/v1/events", Some(&key), Some(body), &idem)
        .await;
    assert_eq!(later.status, 201);
    assert_ne!(later.json["id"], first.json["id"]);
    assert!(later.headers.get("idempotent-replayed").is_none());
}

/// Paging newest first by cursor while events keep arriving: every event
/// that existed when paging began is read exactly once, none twice.
#[tokio::test]
async fn pages_neither_skip_nor_repeat_while_events_arrive() {
    let bed = ApiBed::start(&[]).await;
    let key = bed.tenant("acme");
    let mut before = Vec::new();
    for n in 0..25 {
        let a = bed
            .post(
                "/v1/events",
                &key,
                &json!({"type": "tick", "data": {"n": n}}),
            )
            .await;
        before.push(a.json["id"].as_i64().unwrap());
    }
    let mut seen = Vec::new();
    let mut cursor: Option<String> = None;
    loop {
        let path = match &cursor {
            Some(c) => format!("/v1/events?limit=10&starting_after={c}"),
            None => "/v1/events?limit=10".to_owned(),
        };
        let page = bed.get(&path, &key).await;
        assert_eq!(page.status, 200, "{}", page.text);
        for e in page.json["data"].as_array().unwrap() {
            seen.push(e["id"].as_i64().unwrap());
        }
        // Another producer publishes between pages.
        bed.post("/v1/events", &key, &json!({"type": "tick", "data": {}}))
            .await;
        match page.json["next_cursor"].as_str() {
            Some(c) => cursor = Some(c.to_owned()),
            None => break,
        }
    }
    before.reverse();
    assert_eq!(seen, before, "newest first, each once");
}

/// A key over its rate is answered 429 with `Retry-After`; another key is
/// not held back by it.
#[tokio::test]
async fn a_key_over_its_rate_gets_429_with_retry_after() {
    let bed = ApiBed::start(&[
        ("HARDCOUNT_API_RATE_LIMIT", "1"),
        ("HARDCOUNT_API_RATE_BURST", "3"),
    ])
    .await;
    let key = bed.tenant("acme");
    let other = bed.tenant("globex");
    let mut statuses = Vec::new();
    let mut retry_after = None;
    for _ in 0..6 {
        let a = bed.get("/v1/events", &key).await;
        if a.status == 429 {
            assert_eq!(a.error().0, "rate_limited");
            retry_after = a.headers.get("retry-after").cloned();
        }
        statuses.push(a.status);
    }
    assert!(statuses.contains(&429), "{statuses:?}");
    let secs: u64 = retry_after
        .expect("Retry-After on a 429")
        .to_str()
        .unwrap()
        .parse()
        .unwrap();
    assert!((1..=2).contains(&secs), "{secs}");
    assert_eq!(bed.get("/v1/events", &other).await.status, 200);
}

/// A deliberately unfiltered query, run in the API's own request
/// transaction (`Scope::begin`, as every route runs), sees only the caller's
/// rows in every tenant table, and cannot write another tenant's; outside an
/// authenticated transaction the API role sees nothing at all.
///
/// Catches: a tenant table without its policy (seen: with `tenant_isolation`
/// dropped from webhook_events the first query returns bravo's events too),
/// and a tenant setting that outlives its transaction (the last query, on a
/// pooled connection after a commit, would see alpha's rows).
#[tokio::test]
async fn an_unfiltered_query_in_the_api_path_sees_only_its_tenant() {
    let t = TestDb::new().await;
    let op = t.operator();
    for id in ["alpha", "bravo"] {
        api::keys::create_tenant(&op, id, id, None).await.unwrap();
        let mut tx = t.db.begin().await.unwrap();
        for n in 0..3 {
            webhook_outbox::enqueue(&mut tx, id, "seeded", &format!("{{\"n\": {n}}}"))
                .await
                .unwrap();
        }
        tx.commit().await.unwrap();
    }
    let key = api::keys::create_key(&op, "alpha", "t").await.unwrap();
    // One connection: the checks below share it with the request's.
    let pool = db::Db::connect_lazy(&t.role_url("hardcount_api", Leg::current()), 1).unwrap();
    let state = api::Api::new(pool.clone(), None, api::ApiConfig::default());
    let caller = api::auth::Caller(api::auth::parse(&key.key).unwrap());

    let mut scope = api::scope::Scope::begin(&state, &caller).await.unwrap();
    assert_eq!(scope.tenant(), "alpha");
    let tenants: Vec<String> = scope
        .tx()
        .fetch_all(db::sql("SELECT tenant_id FROM webhook_events"))
        .await
        .unwrap()
        .iter()
        .map(|r| r.get("tenant_id"))
        .collect();
    assert_eq!(tenants, ["alpha"; 3], "an unfiltered read crossed tenants");

    let mut owner = t.superuser().await;
    let tables: Vec<String> = sqlx::query_scalar(
        "SELECT tablename::text FROM pg_policies WHERE policyname = 'tenant_isolation' ORDER BY 1",
    )
    .fetch_all(&mut owner)
    .await
    .unwrap();
    for table in &tables {
        // Every tenant table has RLS on and a policy for the API role.
        let text: &'static str = Box::leak(
            format!("SELECT count(*) AS n FROM {table} WHERE tenant_id IS DISTINCT FROM 'alpha'")
                .into_boxed_str(),
        );
        let (n, aborted): (i64, bool) = match scope.tx().fetch_one(db::sql(text)).await {
            Ok(row) => (row.get("n"), false),
            // A table the API role may not read at all is as closed.
            Err(e) if e.code().as_deref() == Some("42501") => (0, true),
            Err(e) => panic!("{table}: {e}"),
        };
        if aborted {
            drop(scope);
            scope = api::scope::Scope::begin(&state, &caller).await.unwrap();
        }
        assert_eq!(n, 0, "{table}: the API role reads another tenant's rows");
    }
    let err = scope
        .tx()
        .execute(db::sql(
            "INSERT INTO webhook_events (tenant_id, event_type, payload) VALUES ('bravo', 'x', '{}')",
        ))
        .await
        .unwrap_err();
    assert_eq!(err.code().as_deref(), Some("42501"), "{err}");
    drop(scope);

    // The same pooled connection, outside a request: nothing.
    let row = pool
        .fetch_one(db::sql("SELECT count(*) AS n FROM webhook_events"))
        .await
        .unwrap();
    assert_eq!(row.get::<i64, _>("n"), 0);
}
