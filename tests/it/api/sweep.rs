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
/// resources can be made. In a body, `{/v1/…}` stands for the id of the
/// resource the named collection made for the same tenant, and `{marker}`
/// for a text only that tenant's rows hold.
const CREATES: &[(&str, &str)] = &[(
    "/v1/events",
    r#"{"type": "marker.{marker}", "data": {"marker": "{marker}"}}"#,
)];

/// A valid request for every other route that takes a body or changes a
/// resource: method, path template (`{id}` is the id the collection before
/// it made), body, and the status it answers for the caller's own resource.
const ACTIONS: &[(&str, &str, &str, u16)] = &[];

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
        marker: format!("marker{tenant}"),
        ids: BTreeMap::new(),
    };
    for (path, body) in CREATES {
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
        made.ids
            .insert((*path).to_owned(), a.json["id"].as_i64().unwrap());
    }
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

    for op in &ops {
        let method = Method::from_bytes(op.method.as_bytes()).unwrap();
        let has_id = op.path.contains("{id}");
        let action = ACTIONS
            .iter()
            .find(|(m, p, _, _)| *m == op.method && *p == op.path);
        let creates = CREATES.iter().find(|(p, _)| *p == op.path);
        let body_for = |made: &Made| -> Option<String> {
            if let Some((_, _, body, _)) = action {
                Some(fill(body, made))
            } else {
                creates.map(|(_, body)| fill(body, made))
            }
        };
        if op.body || op.method != "GET" {
            assert!(
                action.is_some() || creates.is_some(),
                "{} {} has no example request: add one to CREATES or ACTIONS",
                op.method,
                op.path
            );
        }
        let path_for = |made: &Made| -> String {
            if has_id {
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
        };

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
            for bad in ["{", "[]", r#"{"zz_not_a_field": 1}"#, "null", "\"text\""] {
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

        // The caller's own: a documented success, in its schema; a list
        // holds nothing of the other tenant.
        let expected = action
            .map(|(_, _, _, s)| *s)
            .unwrap_or(match op.method.as_str() {
                "POST" => 201,
                _ => 200,
            });
        let r = bed
            .call(
                method.clone(),
                &path_for(&a),
                Some(&a.key),
                body_for(&a).as_deref(),
                &[],
            )
            .await;
        assert_eq!(r.status, expected, "{} {}: {}", op.method, op.path, r.text);
        contract.check(op, "the caller's own", &r);
        assert!(
            !r.text.contains(&b.marker),
            "{} {} shows another tenant's rows: {}",
            op.method,
            op.path,
            r.text
        );
        secrets_in(&r.json, &mut shown);
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
