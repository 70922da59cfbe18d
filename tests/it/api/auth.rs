//! Who the caller is: a missing, malformed, unknown or revoked key gets one
//! 401, and inside an authenticated request's transaction an unfiltered
//! query sees only the key's tenant (row-level security).

use db::Row as _;
use serde_json::Value;
use testbed::{Leg, TestDb};

use super::ApiBed;

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

/// `hardcount tenants settings`: an operator gives a tenant its own sender and
/// invoice prefix; the tenant's email from that domain is then accepted by the
/// served API, and a bad prefix is refused by name with nothing changed
/// (docs/adr/0148). A sender is set only with `HARDCOUNT_EMAIL_FROM` in the
/// CLI's environment, and never at its domain (docs/adr/0151).
///
/// Mutation `cli_sender_unchecked` (the shipped default used when the
/// variable is missing) fails here.
#[tokio::test]
async fn an_operator_sets_a_tenants_sender_from_the_cli() {
    let bed = ApiBed::start(&[]).await;
    let key = bed.tenant("acme");
    let email = serde_json::json!({"from": "orders@acme.example", "to": ["a@example.org"],
                                   "subject": "Hello", "text": "Hi"});
    assert_eq!(bed.post("/v1/emails", &key, &email).await.status, 400);
    let set = [
        "tenants",
        "settings",
        "acme",
        "--invoice-prefix",
        "ACME",
        "--email-from",
        "Acme Billing <billing@acme.example>",
    ];
    for env in [
        &[][..],
        &[("HARDCOUNT_EMAIL_FROM", "Platform <billing@acme.example>")][..],
    ] {
        let refused = bed.cli_output_with(&set, env);
        let said = crate::text(&refused);
        assert!(
            !refused.status.success()
                && said.contains("HARDCOUNT_EMAIL_FROM")
                && said.contains("nothing was changed"),
            "{env:?}: {said}"
        );
    }
    let out = bed.cli_output_with(
        &set,
        &[(
            "HARDCOUNT_EMAIL_FROM",
            "Platform <billing@platform.example>",
        )],
    );
    assert!(out.status.success(), "{}", crate::text(&out));
    let out = String::from_utf8(out.stdout).unwrap();
    assert!(
        out.contains("invoice_prefix     ACME") && out.contains("<billing@acme.example>"),
        "{out}"
    );
    assert_eq!(bed.post("/v1/emails", &key, &email).await.status, 201);
    let bad = bed.cli_output(&["tenants", "settings", "acme", "--invoice-prefix", "acme"]);
    let said = crate::text(&bad);
    assert!(
        !bad.status.success()
            && said.contains("invoice_prefix")
            && said.contains("nothing was changed"),
        "{said}"
    );
    let out = bed.cli(&[
        "tenants",
        "settings",
        "acme",
        "--default-email-from",
        "--json",
    ]);
    let now: Value = serde_json::from_str(&out).unwrap();
    assert_eq!(
        (&now["invoice_prefix"], &now["email_from"]),
        (&Value::from("ACME"), &Value::Null)
    );
}
