//! Webhook signing secrets sealed at rest (issue 12, point 2): what the
//! database holds opens only with the application key, only for its tenant,
//! and only in the delivery worker.

use db::{Row, sql};
use testbed::TestDb;
use testbed::receiver::Receiver;

use crate::{config, deliveries, endpoint, events, series, tick, verify, worker};

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
    // A copy across tenants: only the schema owner can still make one (the
    // API role's row-level security shows it one tenant at a time).
    let mut owner = t.superuser().await;
    sqlx::query(
        "UPDATE webhook_endpoints \
         SET secret_ciphertext = (SELECT secret_ciphertext FROM webhook_endpoints WHERE id = $1), \
             secret_key_id = (SELECT secret_key_id FROM webhook_endpoints WHERE id = $1) \
         WHERE id = $2",
    )
    .bind(a.id)
    .bind(b.id)
    .execute(&mut owner)
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

/// One endpoint whose secret this replica cannot open (sealed under a key it
/// does not hold) stops nothing else (issue 26, point 4): the other
/// endpoint's delivery goes out, the bad one is held with `bad_secret`, its
/// attempt not counted, due again after the hold, and counted for the alert;
/// once the key is given the held delivery goes out as a first attempt.
///
/// Catches: a bad secret treated as an attempt that heard nothing
/// (`secret_hold`: the held delivery's attempt is counted and scheduled as a
/// retry, so it would die of a missing key).
#[tokio::test]
async fn an_endpoint_whose_secret_cannot_be_opened_waits_and_the_others_are_delivered() {
    let t = TestDb::new().await;
    let rx = Receiver::answering(204).await;
    let good = endpoint(&t, "tenant_a", &rx.url()).await;
    let bad = endpoint(&t, "tenant_a", &format!("{}other", rx.url())).await;
    let other = webhook_delivery::Keyring::parse(
        &webhook_delivery::Keyring::generate_entry("other").unwrap(),
    )
    .unwrap();
    let sealed = other.seal("tenant_a", &bad.secret);
    let mut su = t.superuser().await;
    sqlx::query(
        "UPDATE webhook_endpoints SET secret_ciphertext = $1, secret_key_id = $2 WHERE id = $3",
    )
    .bind(sealed.ciphertext.clone())
    .bind(sealed.key_id.clone())
    .bind(bad.id)
    .execute(&mut su)
    .await
    .unwrap();
    events(&t.db, "tenant_a", 1).await;
    let (w, m) = worker(&t.db, config());
    tick(&t.db, &w).await;
    let ds = deliveries(&t.db).await;
    let of = |ep: i64| ds.iter().find(|d| d.endpoint_id == ep).unwrap().clone();
    assert!(of(good.id).delivered, "{ds:?}");
    let held = of(bad.id);
    assert_eq!(
        (
            held.status.as_str(),
            held.attempts,
            held.last_error.as_deref()
        ),
        ("pending", 0, Some("bad_secret")),
        "{ds:?}"
    );
    assert!(held.due_in > 50.0, "held for the secret hold: {held:?}");
    assert_eq!(
        rx.requests().len(),
        1,
        "nothing was sent to the bad endpoint"
    );
    assert_eq!(
        series(&m, "hardcount_webhook_deliveries_secret_unusable_total", ""),
        Some(1.0)
    );

    // A replica with the key that sealed it: its first attempt goes out.
    crate::make_due(&t).await;
    let (w, _m) = worker(
        &t.db,
        webhook_delivery::WorkerConfig {
            secrets: Some(other.clone()),
            ..config()
        },
    );
    tick(&t.db, &w).await;
    let after = deliveries(&t.db).await;
    let held = after.iter().find(|d| d.endpoint_id == bad.id).unwrap();
    assert!(held.delivered && held.attempts == 1, "{after:?}");
}
