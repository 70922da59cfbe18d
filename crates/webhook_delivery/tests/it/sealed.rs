//! Webhook signing secrets sealed at rest (issue 12, point 2): what the
//! database holds opens only with the application key, only for its tenant,
//! and only in the delivery worker.

use db::{Row, sql};
use testbed::TestDb;
use testbed::receiver::Receiver;

use crate::{config, deliveries, endpoint, events, tick, verify, worker};

/// Everything the table holds, as a dump would show it, contains neither the
/// secret's text nor its key bytes; the role loops' role cannot read the
/// clear columns at all, and still delivers a verifiable webhook.
#[tokio::test]
async fn a_dump_of_the_endpoints_holds_no_usable_secret() {
    let t = TestDb::new().await;
    let rx = Receiver::answering(204).await;
    let ep = endpoint(&t, "tenant_a", &rx.url()).await;
    let secret = ep.secret.expose();
    let key_b64 = secret.trim_start_matches("whsec_");
    let mut su = t.superuser().await;
    let dump: String = sqlx::query_scalar(
        "SELECT string_agg(row_to_json(e)::text || encode(secret_ciphertext, 'base64') \
                || encode(secret_ciphertext, 'escape'), ' ') FROM webhook_endpoints e",
    )
    .fetch_one(&mut su)
    .await
    .unwrap();
    assert!(dump.contains("secret_ciphertext"), "{dump}");
    assert!(
        !dump.contains(key_b64) && !dump.contains("whsec_"),
        "{dump}"
    );

    for column in ["secret", "previous_secret"] {
        let err = match column {
            "secret" => {
                t.db.fetch_one(sql("SELECT secret FROM webhook_endpoints"))
                    .await
            }
            _ => {
                t.db.fetch_one(sql("SELECT previous_secret FROM webhook_endpoints"))
                    .await
            }
        }
        .unwrap_err();
        assert_eq!(err.code().as_deref(), Some("42501"), "{column}: {err}");
    }

    events(&t.db, "tenant_a", 1).await;
    let (w, _m) = worker(&t.db, config());
    assert_eq!(tick(&t.db, &w).await.delivered, 1);
    verify(&secret, &rx.requests()[0]).expect("signed with the secret created");
}

/// A sealed secret is bound to its tenant: copied onto another tenant's
/// endpoint (by whoever could write the column) it does not open, and that
/// endpoint gets nothing sent (`bad_secret`) rather than a webhook signed with
/// the first tenant's key. Without a key the worker sends nothing either.
///
/// Catches: a seal that leaves the tenant out of the associated data
/// (`seal_aad_tenant`: tenant_b's delivery goes out signed with tenant_a's key).
#[tokio::test]
async fn a_sealed_secret_copied_to_another_tenant_does_not_open() {
    let t = TestDb::new().await;
    let rx = Receiver::answering(204).await;
    let a = endpoint(&t, "tenant_a", &rx.url()).await;
    let b = endpoint(&t, "tenant_b", &rx.url()).await;
    t.api()
        .execute(
            sql("UPDATE webhook_endpoints \
                 SET secret_ciphertext = (SELECT secret_ciphertext FROM webhook_endpoints WHERE id = $1), \
                     secret_key_id = (SELECT secret_key_id FROM webhook_endpoints WHERE id = $1) \
                 WHERE id = $2")
            .bind(a.id)
            .bind(b.id),
        )
        .await
        .unwrap();
    events(&t.db, "tenant_b", 1).await;
    let (w, _m) = worker(&t.db, config());
    tick(&t.db, &w).await;
    assert_eq!(
        rx.connections(),
        0,
        "a webhook went out with another tenant's key"
    );
    let ds = deliveries(&t.db).await;
    assert_eq!(ds[0].last_error.as_deref(), Some("bad_secret"), "{ds:?}");

    // No key configured: nothing is signed, nothing is sent.
    let t = TestDb::new().await;
    endpoint(&t, "tenant_a", &rx.url()).await;
    events(&t.db, "tenant_a", 1).await;
    let (w, _m) = worker(
        &t.db,
        webhook_delivery::WorkerConfig {
            secrets: None,
            ..config()
        },
    );
    tick(&t.db, &w).await;
    assert_eq!(rx.connections(), 0);
    let row =
        t.db.fetch_one(sql("SELECT last_error FROM webhook_deliveries"))
            .await
            .unwrap();
    assert_eq!(row.get::<String, _>("last_error"), "bad_secret");
}
