//! Registering endpoints.

use db::{Row, sql};
use testbed::TestDb;
use webhook_delivery::signature::Secret;
use webhook_delivery::{EndpointError, create_endpoint};

use crate::{endpoint, keyring};

#[tokio::test]
async fn create_endpoint_stores_a_fresh_secret_that_debug_never_shows() {
    let t = TestDb::new().await;
    let api = t.api();
    let ep = create_endpoint(
        &api,
        &keyring(),
        "tenant_a",
        "https://hooks.example.com/billing",
        &["invoice.paid", "invoice.finalized"],
    )
    .await
    .unwrap();
    assert!(ep.enabled);
    let secret = ep.secret.expose();
    assert!(secret.starts_with("whsec_"));
    Secret::parse(&secret).unwrap();
    let shown = format!("{ep:?}");
    assert!(
        !shown.contains(&secret) && shown.contains("Secret(***)"),
        "{shown}"
    );

    let row =
        t.db.fetch_one(
            sql(
                "SELECT tenant_id, url, secret_ciphertext, secret_key_id, event_types \
                 FROM webhook_endpoints WHERE id = $1",
            )
            .bind(ep.id),
        )
        .await
        .unwrap();
    assert_eq!(row.get::<String, _>("tenant_id"), "tenant_a");
    assert_eq!(
        row.get::<String, _>("url"),
        "https://hooks.example.com/billing"
    );
    // Stored sealed under the current key, and it opens to the secret shown.
    assert_eq!(row.get::<String, _>("secret_key_id"), "test");
    let sealed: Vec<u8> = row.get("secret_ciphertext");
    let opened = keyring().open("tenant_a", "test", &sealed).unwrap();
    assert_eq!(opened.expose(), secret);
    assert_eq!(
        row.get::<Vec<String>, _>("event_types"),
        vec!["invoice.paid", "invoice.finalized"]
    );
    let other = create_endpoint(
        &api,
        &keyring(),
        "tenant_a",
        "https://hooks.example.com/billing",
        &[] as &[&str],
    )
    .await
    .unwrap();
    assert_ne!(
        other.secret.expose(),
        secret,
        "each endpoint gets its own secret"
    );
}

#[tokio::test]
async fn create_endpoint_refuses_bad_input_with_a_clear_error_and_stores_nothing() {
    let t = TestDb::new().await;
    let (api, keys) = (t.api(), keyring());
    let none: &[&str] = &[];
    let cases: Vec<(&str, &str, &[&str], &str)> = vec![
        (
            "tenant_a",
            "hooks.example.com/x",
            none,
            "invalid webhook endpoint URL: relative URL without a base",
        ),
        (
            "tenant_a",
            "ftp://hooks.example.com/x",
            none,
            "scheme `ftp` is not allowed; use http or https",
        ),
        (
            "tenant_a",
            "file:///etc/passwd",
            none,
            "scheme `file` is not allowed",
        ),
        (
            "tenant_a",
            "https://",
            none,
            "invalid webhook endpoint URL: empty host",
        ),
        (
            "tenant_a",
            "https://hooks.example.com/x",
            &["invoice.paid", " "],
            "empty event type",
        ),
        ("", "https://hooks.example.com/x", none, "empty tenant_id"),
    ];
    for (tenant, url, types, expected) in cases {
        let err = create_endpoint(&api, &keys, tenant, url, types)
            .await
            .unwrap_err();
        assert!(err.to_string().contains(expected), "{url}: {err}");
    }
    let err = create_endpoint(&api, &keys, "t", "https://user:hunter2@exa mple.com/", none)
        .await
        .unwrap_err();
    assert!(matches!(err, EndpointError::InvalidUrl { .. }));
    assert!(!err.to_string().contains("hunter2"), "{err}");
    let n: i64 =
        t.db.fetch_one(sql("SELECT count(*) AS n FROM webhook_endpoints"))
            .await
            .unwrap()
            .get("n");
    assert_eq!(n, 0);
}

/// The database holds the line too: a writer other than `create_endpoint`
/// cannot store a non-http URL or a delivery that crosses tenants.
#[tokio::test]
async fn the_schema_refuses_bad_urls_and_cross_tenant_deliveries() {
    let t = TestDb::new().await;
    let err = t
        .api_as("a")
        .execute(sql(
            "INSERT INTO webhook_endpoints (tenant_id, url, secret_ciphertext, secret_key_id) \
             VALUES ('a', 'gopher://x', decode(repeat('00', 64), 'hex'), 'k')",
        ))
        .await
        .unwrap_err();
    assert_eq!(
        err.constraint(),
        Some("webhook_endpoints_url_http"),
        "{err}"
    );

    let ep = endpoint(&t, "tenant_a", "https://a.example.com/").await;
    let mut tx = t.db.begin().await.unwrap();
    let event = webhook_outbox::enqueue(&mut tx, "tenant_b", "invoice.paid", "{}")
        .await
        .unwrap();
    tx.commit().await.unwrap();
    for (tenant, constraint) in [
        ("tenant_a", "webhook_deliveries_event_same_tenant"),
        ("tenant_b", "webhook_deliveries_endpoint_same_tenant"),
    ] {
        let err = t
            .db
            .execute(
                sql("INSERT INTO webhook_deliveries (tenant_id, event_id, endpoint_id) VALUES ($1, $2, $3)")
                    .bind(tenant)
                    .bind(event)
                    .bind(ep.id),
            )
            .await
            .unwrap_err();
        assert_eq!(err.constraint(), Some(constraint), "{err}");
    }
    // And the app cannot delete an endpoint; it deletes deliveries only in
    // the retention prune (migration 0030, docs/adr/0040).
    let err =
        t.db.execute(sql("DELETE FROM webhook_endpoints"))
            .await
            .unwrap_err();
    assert_eq!(err.code().as_deref(), Some("42501"), "{err}");
}
