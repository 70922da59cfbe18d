//! The OpenAPI document: committed, current, 3.1, every refusal declared.

/// The committed document (docs/openapi.json) is the one the code
/// generates: a route, parameter or schema changed without it fails here.
/// `HARDCOUNT_WRITE_OPENAPI=1 cargo test -p api openapi` rewrites it.
#[test]
fn the_committed_openapi_document_is_the_generated_one() {
    let generated = api::openapi()
        .to_pretty_json()
        .expect("the document serializes")
        + "\n";
    let path = std::path::Path::new(env!("CARGO_MANIFEST_DIR")).join("../../docs/openapi.json");
    let committed = std::fs::read_to_string(&path).unwrap_or_default();
    if committed == generated {
        return;
    }
    if std::env::var_os("HARDCOUNT_WRITE_OPENAPI").is_some_and(|v| v == "1") {
        std::fs::write(&path, &generated).unwrap();
        return;
    }
    panic!(
        "{} is not the document the code generates; rerun with HARDCOUNT_WRITE_OPENAPI=1 \
         and commit it",
        path.display()
    );
}

/// OpenAPI 3.1, as the issue asks, and every `/v1` route answers 401 and
/// 400 in the document (the extractors can refuse any of them).
#[test]
fn the_document_is_openapi_3_1_and_every_route_declares_its_refusals() {
    let doc = serde_json::to_value(api::openapi()).unwrap();
    assert!(
        doc["openapi"].as_str().unwrap().starts_with("3.1"),
        "{}",
        doc["openapi"]
    );
    let paths = doc["paths"].as_object().unwrap();
    assert!(!paths.is_empty());
    for (path, item) in paths {
        for (method, op) in item.as_object().unwrap() {
            for status in ["400", "401", "429", "500", "503"] {
                assert!(
                    op["responses"].get(status).is_some(),
                    "{method} {path} does not declare {status}"
                );
            }
        }
    }
}

/// Every operation has an `operationId` of its own, a verb and what it acts
/// on (`list_plans`): a client generator names a method by it, and two
/// alike (utoipa's default is the handler's name, `list` eight times)
/// overwrite each other or fail the generation. Mutation
/// `openapi_ids_by_handler` (one route back on its handler's name) fails
/// here.
#[test]
fn every_operation_has_an_id_of_its_own() {
    let doc = serde_json::to_value(api::openapi()).unwrap();
    let mut seen = std::collections::BTreeMap::new();
    for (path, item) in doc["paths"].as_object().unwrap() {
        for (method, op) in item.as_object().unwrap() {
            let id = op["operationId"].as_str().unwrap_or_default().to_owned();
            // The resource: the path's first part after /v1 (dunning's
            // second), singular or plural (`deliver` in both forms).
            let parts: Vec<&str> = path.trim_start_matches("/v1/").split('/').collect();
            let resource = if parts[0] == "dunning" {
                parts[1]
            } else {
                parts[0]
            };
            let stem = resource
                .strip_suffix("ies")
                .unwrap_or_else(|| resource.trim_end_matches('s'));
            assert!(
                id.contains('_') && id.contains(stem),
                "{method} {path}: operationId {id:?} does not name {resource}"
            );
            if let Some(other) = seen.insert(id.clone(), format!("{method} {path}")) {
                panic!("operationId {id:?} is both {other} and {method} {path}");
            }
        }
    }
    assert!(seen.len() > 30, "{seen:?}");
}
