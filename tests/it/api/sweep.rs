//! Every route of the served OpenAPI document, swept four ways by one test:
//! a valid request per route (its answer checked against the schema the
//! document declares for that status), the same request with another
//! tenant's ids (404, and that tenant's rows byte for byte unchanged), a set
//! of requests that break the document (each a documented 4xx in the one
//! error shape, never a 500), and no key at all (401). Then no secret shown
//! in any answer appears in the replica's log.
//!
//! A route added to the API without an example here fails the sweep: add
//! its valid request to [`CREATES`] or [`ACTIONS`].

use std::collections::BTreeMap;

use reqwest::Method;
use serde_json::{Value, json};

use super::{Answer, ApiBed};

/// A valid body for each POST that creates a resource, in the order the
/// resources can be made: (collection, label, body). The id made is kept
/// under its label; a path's `{id}` is the id kept under its collection's
/// path. In a body, `{label}` stands for the id kept under that label and
/// `{marker}` for a text only this tenant's rows hold.
const CREATES: &[(&str, &str, &str)] = &[
    (
        "/v1/events",
        "/v1/events",
        r#"{"type": "marker.{marker}", "data": {"marker": "{marker}"}}"#,
    ),
    (
        "/v1/customers",
        "/v1/customers",
        r#"{"email": "ada@example.org", "name": "{marker}", "payment_method": "pm_card_visa", "provider_customer_id": "cus_{marker}"}"#,
    ),
    (
        "/v1/plans",
        "/v1/plans",
        r#"{"name": "{marker}", "amount": 1200, "currency": "EUR", "interval": "month"}"#,
    ),
    (
        "/v1/plans",
        "plan 2",
        r#"{"name": "{marker} pro", "amount": 2400, "currency": "EUR", "interval": "month"}"#,
    ),
    (
        "/v1/subscriptions",
        "/v1/subscriptions",
        r#"{"customer": {/v1/customers}, "plan": {/v1/plans}}"#,
    ),
    (
        "/v1/webhook_endpoints",
        "/v1/webhook_endpoints",
        r#"{"url": "https://hooks.example.com/{marker}", "event_types": ["marker.{marker}"]}"#,
    ),
    (
        "/v1/emails",
        "/v1/emails",
        r#"{"from": "Shop <billing@example.com>", "to": ["ada@example.org"], "subject": "{marker}", "text": "Hello"}"#,
    ),
];

/// Every other route that takes a body or changes something, in the order
/// they are run on the caller's own resources: (method, path, body, status).
/// An empty body is no body.
const ACTIONS: &[(&str, &str, &str, u16)] = &[
    (
        "POST",
        "/v1/customers/{id}",
        r#"{"name": "{marker} renamed"}"#,
        200,
    ),
    (
        "PUT",
        "/v1/dunning/policy",
        r#"{"retry_offsets_secs": [86400, 259200], "final_action": "mark_uncollectible"}"#,
        200,
    ),
    (
        "POST",
        "/v1/subscriptions/{id}/pause",
        r#"{"behavior": "keep_as_draft"}"#,
        200,
    ),
    ("POST", "/v1/subscriptions/{id}/resume", "", 200),
    (
        "POST",
        "/v1/subscriptions/{id}/change_plan",
        r#"{"plan": {plan 2}}"#,
        200,
    ),
    (
        "POST",
        "/v1/subscriptions/{id}/cancel",
        r#"{"at_period_end": true}"#,
        200,
    ),
    (
        "POST",
        "/v1/webhook_endpoints/{id}",
        r#"{"event_types": []}"#,
        200,
    ),
    (
        "POST",
        "/v1/webhook_endpoints/{id}/rotate_secret",
        r#"{"overlap_seconds": 60}"#,
        200,
    ),
    ("POST", "/v1/webhook_endpoints/{id}/disable", "", 200),
    ("POST", "/v1/webhook_endpoints/{id}/enable", "", 200),
    (
        "POST",
        "/v1/webhook_endpoints/{id}/recover",
        r#"{"since": "2026-01-01T00:00:00Z"}"#,
        200,
    ),
    ("POST", "/v1/deliveries/{id}/resend", "", 200),
    ("POST", "/v1/emails/{id}/resend", "", 200),
];

/// The query a list needs to answer 200 (the rest need none).
const QUERIES: &[(&str, &str)] = &[("/v1/deliveries", "?event_id={/v1/events}")];

/// Rows the roles make (an invoice, a dunning run, a delivery), written as
/// the schema owner for `tenant` beside what the API made; the email made is
/// marked failed, as a send would leave it, so it can be resent.
async fn seed_role_made(bed: &ApiBed, tenant: &str, made: &mut Made) {
    let mut owner = bed.t.superuser().await;
    let id = |label: &str| made.ids[label];
    let invoice: i64 = sqlx::query_scalar(
        "INSERT INTO invoices (tenant_id, subscription_id, period_start, period_end, amount, \
                               currency, collection_method) \
         VALUES ($1, $2, now() - interval '30 days', now(), 1200, 'EUR', 'automatic') \
         RETURNING id",
    )
    .bind(tenant)
    .bind(id("/v1/subscriptions"))
    .fetch_one(&mut owner)
    .await
    .unwrap();
    let run: i64 = sqlx::query_scalar(
        "WITH p AS (INSERT INTO dunning_policies (tenant_id, name, retry_offsets_secs, final_action) \
                    VALUES ($1, 'Seeded', '{86400}', 'mark_uncollectible') RETURNING id) \
         INSERT INTO dunning_runs (tenant_id, invoice_id, policy_id, first_declined_at, next_attempt_at) \
         SELECT $1, $2, id, now(), now() + interval '1 day' FROM p RETURNING id",
    )
    .bind(tenant)
    .bind(invoice)
    .fetch_one(&mut owner)
    .await
    .unwrap();
    let delivery: i64 = sqlx::query_scalar(
        "INSERT INTO webhook_deliveries (tenant_id, event_id, endpoint_id, status, attempts, delivered_at) \
         VALUES ($1, $2, $3, 'delivered', 1, now()) RETURNING id",
    )
    .bind(tenant)
    .bind(id("/v1/events"))
    .bind(id("/v1/webhook_endpoints"))
    .fetch_one(&mut owner)
    .await
    .unwrap();
    sqlx::query("UPDATE email_outbox SET status = 'failed' WHERE id = $1")
        .bind(id("/v1/emails"))
        .execute(&mut owner)
        .await
        .unwrap();
    made.ids.insert("/v1/invoices".into(), invoice);
    made.ids.insert("/v1/dunning/runs".into(), run);
    made.ids.insert("/v1/deliveries".into(), delivery);
}

struct Op {
    method: String,
    path: String,
    body: bool,
    query: Vec<String>,
}

fn operations(doc: &Value) -> Vec<Op> {
    let mut ops = Vec::new();
    for (path, item) in doc["paths"].as_object().unwrap() {
        for (method, op) in item.as_object().unwrap() {
            let query = op["parameters"]
                .as_array()
                .map(|ps| {
                    ps.iter()
                        .filter(|p| p["in"] == "query")
                        .map(|p| p["name"].as_str().unwrap().to_owned())
                        .collect()
                })
                .unwrap_or_default();
            ops.push(Op {
                method: method.to_uppercase(),
                path: path.clone(),
                body: op.get("requestBody").is_some(),
                query,
            });
        }
    }
    ops
}

/// The collection a path's `{id}` belongs to: `/v1/subscriptions/{id}/cancel`
/// → `/v1/subscriptions`.
fn collection(path: &str) -> &str {
    path.split("/{id}").next().unwrap()
}

struct Contract<'d> {
    doc: &'d Value,
}

impl Contract<'_> {
    fn response(&self, op: &Op, status: u16) -> Option<&Value> {
        let r = &self.doc["paths"][&op.path][op.method.to_lowercase()]["responses"];
        r.get(status.to_string())
    }

    /// The answer's status is one the document declares for the route, and
    /// its body is valid under the schema declared for that status.
    fn check(&self, op: &Op, what: &str, a: &Answer) {
        let Some(declared) = self.response(op, a.status) else {
            panic!(
                "{} {} ({what}): status {} is not in the document: {}",
                op.method, op.path, a.status, a.text
            );
        };
        let Some(schema) = declared["content"]["application/json"].get("schema") else {
            return;
        };
        let root = json!({
            "$schema": "https://json-schema.org/draft/2020-12/schema",
            "components": self.doc["components"],
            "allOf": [schema],
        });
        let validator = jsonschema::validator_for(&root).unwrap_or_else(|e| {
            panic!(
                "{} {}: the declared schema does not compile: {e}",
                op.method, op.path
            )
        });
        let errors: Vec<String> = validator
            .iter_errors(&a.json)
            .map(|e| format!("{} at {}", e, e.instance_path()))
            .collect();
        assert!(
            errors.is_empty(),
            "{} {} ({what}): the {} answer breaks its schema: {errors:?}\n{}",
            op.method,
            op.path,
            a.status,
            a.text
        );
    }
}

/// A tenant's resources as the sweep made them.
struct Made {
    key: String,
    /// Secrets the API showed this tenant (an endpoint's `whsec_…`).
    shown: Vec<String>,
    marker: String,
    ids: BTreeMap<String, i64>,
}

fn fill(template: &str, made: &Made) -> String {
    let mut out = template.replace("{marker}", &made.marker);
    for (collection, id) in &made.ids {
        out = out.replace(&format!("{{{collection}}}"), &id.to_string());
    }
    out
}

async fn make(bed: &ApiBed, tenant: &str, contract: &Contract<'_>, ops: &[Op]) -> Made {
    let mut made = Made {
        key: bed.tenant(tenant),
        shown: Vec::new(),
        marker: format!("marker{tenant}"),
        ids: BTreeMap::new(),
    };
    for (path, label, body) in CREATES {
        let body = fill(body, &made);
        let a = bed
            .call(Method::POST, path, Some(&made.key), Some(&body), &[])
            .await;
        assert_eq!(a.status, 201, "POST {path} {body}: {}", a.text);
        let op = ops
            .iter()
            .find(|o| o.method == "POST" && o.path == *path)
            .unwrap_or_else(|| panic!("CREATES names {path}, which the document lacks"));
        contract.check(op, "create", &a);
        secrets_in(&a.json, &mut made.shown);
        made.ids
            .insert((*label).to_owned(), a.json["id"].as_i64().unwrap());
    }
    seed_role_made(bed, tenant, &mut made).await;
    made
}

/// Every tenant table's rows of `tenant`, as the schema owner sees them: the
/// tables are the ones with a row-level security policy.
async fn snapshot(bed: &ApiBed, tenant: &str) -> BTreeMap<String, String> {
    let mut owner = bed.t.superuser().await;
    let tables: Vec<String> = sqlx::query_scalar(
        "SELECT tablename::text FROM pg_policies WHERE policyname = 'tenant_isolation' ORDER BY 1",
    )
    .fetch_all(&mut owner)
    .await
    .unwrap();
    assert!(tables.len() >= 10, "{tables:?}");
    let mut out = BTreeMap::new();
    for table in tables {
        let digest: String = sqlx::query_scalar(sqlx::AssertSqlSafe(format!(
            "SELECT md5(coalesce(string_agg(x::text, '|' ORDER BY x::text), '')) \
             FROM {table} x WHERE tenant_id = $1"
        )))
        .bind(tenant)
        .fetch_one(&mut owner)
        .await
        .unwrap();
        out.insert(table, digest);
    }
    out
}

fn path_of(op: &Op, made: &Made) -> String {
    if op.path.contains("{id}") {
        let id = made.ids.get(collection(&op.path)).unwrap_or_else(|| {
            panic!(
                "{} {}: nothing made under {}",
                op.method,
                op.path,
                collection(&op.path)
            )
        });
        op.path.replace("{id}", &id.to_string())
    } else {
        op.path.clone()
    }
}

/// The caller's own request answered `status`, in its schema, holding no
/// row of the tenant whose rows hold `other_marker`; secrets it shows kept.
fn own(
    contract: &Contract<'_>,
    op: &Op,
    r: &Answer,
    status: u16,
    other_marker: &str,
    shown: &mut Vec<String>,
) {
    assert_eq!(r.status, status, "{} {}: {}", op.method, op.path, r.text);
    contract.check(op, "the caller's own", r);
    assert!(
        !r.text.contains(other_marker),
        "{} {} shows another tenant's rows: {}",
        op.method,
        op.path,
        r.text
    );
    secrets_in(&r.json, shown);
}

fn secrets_in(v: &Value, out: &mut Vec<String>) {
    match v {
        Value::Object(m) => {
            for (k, v) in m {
                if k.contains("secret")
                    && let Some(s) = v.as_str()
                {
                    out.push(s.to_owned());
                }
                secrets_in(v, out);
            }
        }
        Value::Array(a) => a.iter().for_each(|v| secrets_in(v, out)),
        _ => {}
    }
}

/// Catches: a route that reaches another tenant's row when both guards
/// fail (seen: with the webhook_events policy made permissive and the
/// `tenant_id = api_tenant()` filter dropped from `events::read`, bravo's
/// event answers 200 to alpha's key; either guard alone holds, and
/// `an_unfiltered_query_in_the_api_path_sees_only_its_tenant` pins the
/// policy by itself), a status or a field the document does not declare,
/// an input that breaks the document and is answered 500.
#[tokio::test]
async fn every_route_keeps_to_its_tenant_and_answers_as_its_document_says() {
    // No role touches a tenant's rows while the sweep compares them: only
    // billing runs, and its next tick is a month away.
    let bed = ApiBed::start(&[
        ("HARDCOUNT_ROLES", "billing"),
        ("HARDCOUNT_BILLING_INTERVAL", "30d"),
    ])
    .await;
    let served = bed.http.get(bed.url("/openapi.json")).send().await.unwrap();
    let doc: Value = serde_json::from_str(&served.text().await.unwrap()).unwrap();
    assert_eq!(doc, serde_json::to_value(api::openapi()).unwrap());
    let ops = operations(&doc);
    let contract = Contract { doc: &doc };
    let a = make(&bed, "alpha", &contract, &ops).await;
    let b = make(&bed, "bravo", &contract, &ops).await;
    let b_before = snapshot(&bed, "bravo").await;
    let mut shown = vec![a.key.clone(), b.key.clone()];
    shown.extend(a.shown.iter().chain(&b.shown).cloned());
    assert!(
        shown.iter().any(|s| s.starts_with("whsec_")),
        "creating an endpoint shows its secret once"
    );

    for op in &ops {
        let method = Method::from_bytes(op.method.as_bytes()).unwrap();
        let has_id = op.path.contains("{id}");
        let action = ACTIONS
            .iter()
            .find(|(m, p, _, _)| *m == op.method && *p == op.path);
        let creates = CREATES.iter().find(|(p, _, _)| *p == op.path);
        if op.method != "GET" {
            assert!(
                action.is_some() || creates.is_some(),
                "{} {} has no example request: add one to CREATES or ACTIONS",
                op.method,
                op.path
            );
        }
        let body_for = |made: &Made| -> Option<String> {
            match (action, creates) {
                (Some((_, _, "", _)), _) => None,
                (Some((_, _, body, _)), _) => Some(fill(body, made)),
                (None, Some((_, _, body))) => Some(fill(body, made)),
                (None, None) => None,
            }
        };
        let path_for = |made: &Made| path_of(op, made);

        // Another tenant's resource: 404, as if it did not exist.
        if has_id {
            let path = path_for(&b);
            let body = body_for(&a);
            let r = bed
                .call(method.clone(), &path, Some(&a.key), body.as_deref(), &[])
                .await;
            assert_eq!(
                r.status, 404,
                "{} {path} with another tenant's id: {}",
                op.method, r.text
            );
            contract.check(op, "another tenant's id", &r);
        }
        // Refusals of requests that break the document.
        let mut broken: Vec<(String, Option<String>)> = Vec::new();
        if op.body {
            for bad in ["{", "[]", r#"{"zz_not_a_field": 1}"#, "\"text\"", "7"] {
                broken.push((path_for(&a), Some(bad.to_owned())));
            }
        }
        if has_id {
            for bad in ["0", "-1", "x", "99999999999999999999"] {
                broken.push((op.path.replace("{id}", bad), body_for(&a)));
            }
        }
        if op.method == "GET" && !op.query.is_empty() {
            broken.push((format!("{}?zz_not_a_param=1", path_for(&a)), None));
            if op.query.iter().any(|q| q == "limit") {
                for bad in ["0", "101", "x", "-5"] {
                    broken.push((format!("{}?limit={bad}", path_for(&a)), None));
                }
            }
            if op.query.iter().any(|q| q == "starting_after") {
                broken.push((format!("{}?starting_after=%%%", path_for(&a)), None));
            }
        }
        for (path, body) in &broken {
            let r = bed
                .call(method.clone(), path, Some(&a.key), body.as_deref(), &[])
                .await;
            assert!(
                (400..500).contains(&r.status),
                "{} {path} {body:?}: {}",
                op.method,
                r.text
            );
            contract.check(op, "a request that breaks the document", &r);
        }
        // No key.
        let r = bed
            .call(
                method.clone(),
                &path_for(&a),
                None,
                body_for(&a).as_deref(),
                &[],
            )
            .await;
        assert_eq!(r.status, 401, "{} {}: {}", op.method, op.path, r.text);
        contract.check(op, "no key", &r);

        // The caller's own reads (the writes follow, in their order): a
        // documented success in its schema, nothing of the other tenant.
        if op.method == "GET" {
            let query = QUERIES
                .iter()
                .find(|(p, _)| *p == op.path)
                .map(|(_, q)| fill(q, &a))
                .unwrap_or_default();
            let r = bed
                .call(
                    method.clone(),
                    &format!("{}{query}", path_for(&a)),
                    Some(&a.key),
                    None,
                    &[],
                )
                .await;
            own(&contract, op, &r, 200, &b.marker, &mut shown);
        }
    }
    for (m, path, body, status) in ACTIONS {
        let op = ops
            .iter()
            .find(|o| o.method == *m && o.path == *path)
            .unwrap_or_else(|| panic!("ACTIONS names {m} {path}, which the document lacks"));
        let body = (!body.is_empty()).then(|| fill(body, &a));
        let method = Method::from_bytes(m.as_bytes()).unwrap();
        let r = bed
            .call(method, &path_of(op, &a), Some(&a.key), body.as_deref(), &[])
            .await;
        own(&contract, op, &r, *status, &b.marker, &mut shown);
    }

    assert_eq!(
        snapshot(&bed, "bravo").await,
        b_before,
        "another tenant's key changed this tenant's rows"
    );
    let log = bed.log_text();
    assert!(log.contains("tenant API listening"), "{log}");
    for secret in shown.iter().filter(|s| s.len() >= 16) {
        assert!(!log.contains(secret.as_str()), "a secret reached the log");
        // The secret part alone, too (a key's prefix may be logged).
        let tail = &secret[secret.len() - 16..];
        assert!(!log.contains(tail), "part of a secret reached the log");
    }
}
