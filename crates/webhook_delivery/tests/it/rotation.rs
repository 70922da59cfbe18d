//! Signing-secret rotation per Standard Webhooks (issue 12, point 3): during the
//! overlap a delivery carries the new and the previous signature, after it only
//! the new one; keys shorter than 24 bytes are refused.

use std::time::Duration;

use db::{Row, sql};
use testbed::TestDb;
use testbed::receiver::Receiver;
use testbed::webhook_verify::verify_signature;
use webhook_delivery::{MAX_ROTATION_OVERLAP, RotateError, rotate_secret};

use crate::{config, deliveries, endpoint, events, keyring, tick, verify, worker};

/// The `webhook-signature` values of a received request, in order.
fn signatures(r: &testbed::receiver::Received) -> Vec<String> {
    r.header("webhook-signature")
        .split(' ')
        .map(str::to_owned)
        .collect()
}

/// During the overlap the header is `v1,<sig-new> v1,<sig-old>` and the
/// independent verifier accepts the request with either secret.
///
/// Catches: dropping the previous secret's signature (`rotation_both_signatures`,
/// only the new one is sent), the claim not returning the previous secret
/// (`rotation_claim_previous`), and a rotation whose overlap is ignored
/// (`rotation_overlap`, the previous secret expires at once; the stored expiry
/// is checked first). Each was run and seen failing.
#[tokio::test]
async fn during_the_overlap_a_delivery_carries_both_signatures_and_verifies_with_either_secret() {
    let t = TestDb::new().await;
    let rx = Receiver::answering(204).await;
    let ep = endpoint(&t, "tenant_a", &rx.url()).await;
    let old = ep.secret.expose();

    // Another tenant cannot rotate it, nor can anyone keep a previous secret for months.
    let (api, keys) = (t.api(), keyring());
    let err = rotate_secret(&api, &keys, "tenant_b", ep.id, Duration::from_secs(3600))
        .await
        .unwrap_err();
    assert!(matches!(err, RotateError::NotFound { .. }), "{err}");
    let err = rotate_secret(
        &api,
        &keys,
        "tenant_a",
        ep.id,
        MAX_ROTATION_OVERLAP + Duration::from_secs(1),
    )
    .await
    .unwrap_err();
    assert!(matches!(err, RotateError::OverlapTooLong { .. }), "{err}");

    let new = rotate_secret(&api, &keys, "tenant_a", ep.id, Duration::from_secs(3600))
        .await
        .unwrap()
        .expose();
    assert_ne!(new, old);
    let row =
        t.db.fetch_one(
            sql(
                "SELECT secret_ciphertext, secret_key_id, previous_secret_ciphertext, \
                        previous_secret_key_id, \
                        extract(epoch FROM previous_secret_expires_at - now())::float8 AS left \
                 FROM webhook_endpoints WHERE id = $1",
            )
            .bind(ep.id),
        )
        .await
        .unwrap();
    let open = |ct: &str, id: &str| {
        keys.open(
            "tenant_a",
            &row.get::<String, _>(id),
            &row.get::<Vec<u8>, _>(ct),
        )
        .unwrap()
        .expose()
    };
    assert_eq!(open("secret_ciphertext", "secret_key_id"), new);
    assert_eq!(
        open("previous_secret_ciphertext", "previous_secret_key_id"),
        old
    );
    let left: f64 = row.get("left");
    assert!((3590.0..=3600.0).contains(&left), "expires in {left} s");

    events(&t.db, "tenant_a", 1).await;
    let (w, _metrics) = worker(&t.db, config());
    let report = tick(&t.db, &w).await;
    assert_eq!(report.delivered, 1, "{report:?}");
    let received = rx.requests();
    assert_eq!(received.len(), 1);
    let r = &received[0];
    let sigs = signatures(r);
    assert_eq!(sigs.len(), 2, "two signatures during the overlap: {sigs:?}");
    verify(&new, r).expect("verifies with the new secret");
    verify(&old, r).expect("verifies with the previous secret");
    // The new secret's signature first, the previous one second.
    let (id, ts) = (r.header("webhook-id"), r.header("webhook-timestamp"));
    verify_signature(&new, id, ts, &r.body, &sigs[0]).unwrap();
    verify_signature(&old, id, ts, &r.body, &sigs[1]).unwrap();
}

/// After the expiry (on the database clock) only the new secret signs: the
/// previous one no longer verifies.
///
/// Catches: the claim ignoring `previous_secret_expires_at`
/// (`rotation_expiry`, the previous secret signs forever).
#[tokio::test]
async fn after_the_expiry_a_delivery_carries_only_the_new_signature() {
    let t = TestDb::new().await;
    let rx = Receiver::answering(204).await;
    let ep = endpoint(&t, "tenant_a", &rx.url()).await;
    let old = ep.secret.expose();
    let new = rotate_secret(
        &t.api(),
        &keyring(),
        "tenant_a",
        ep.id,
        Duration::from_secs(3600),
    )
    .await
    .unwrap()
    .expose();
    // The overlap has passed, as time passing would make it.
    t.api_as("tenant_a")
        .execute(
            sql("UPDATE webhook_endpoints \
             SET previous_secret_expires_at = now() - interval '1 second' WHERE id = $1")
            .bind(ep.id),
        )
        .await
        .unwrap();

    events(&t.db, "tenant_a", 1).await;
    let (w, _metrics) = worker(&t.db, config());
    let report = tick(&t.db, &w).await;
    assert_eq!(report.delivered, 1, "{report:?}");
    let received = rx.requests();
    assert_eq!(received.len(), 1);
    let r = &received[0];
    assert_eq!(signatures(r).len(), 1, "{:?}", signatures(r));
    verify(&new, r).expect("verifies with the new secret");
    let err = verify(&old, r).unwrap_err();
    assert!(err.contains("does not match"), "{err}");
}

/// A key shorter than 24 bytes is refused: an endpoint whose stored secret is
/// short gets nothing sent (`last_error = bad_secret`), and the schema keeps a
/// previous secret's format in check like the current one's.
///
/// Catches: dropping the length check in `Secret::parse` (`short_key`, the
/// delivery goes out signed with a 4-byte key).
#[tokio::test]
async fn a_secret_shorter_than_24_bytes_is_refused_and_nothing_is_sent() {
    let t = TestDb::new().await;
    let rx = Receiver::answering(204).await;
    let ep = endpoint(&t, "tenant_a", &rx.url()).await;
    // Stored around create_endpoint (which generates 24 bytes): "test", 4 bytes.
    let short = keyring().seal_text("tenant_a", "whsec_dGVzdA==");
    t.api_as("tenant_a")
        .execute(
            sql("UPDATE webhook_endpoints SET secret_ciphertext = $2, secret_key_id = $3 WHERE id = $1")
                .bind(ep.id)
                .bind(short.ciphertext)
                .bind(short.key_id),
        )
        .await
        .unwrap();

    events(&t.db, "tenant_a", 1).await;
    let (w, _metrics) = worker(&t.db, config());
    tick(&t.db, &w).await;
    assert_eq!(
        rx.connections(),
        0,
        "a request signed with a short key was sent"
    );
    let ds = deliveries(&t.db).await;
    assert_eq!(ds.len(), 1);
    assert_eq!(
        ds[0].last_error.as_deref(),
        Some("bad_secret"),
        "{:?}",
        ds[0]
    );

    // The clear column (the owner's, for rows older than migration 0012)
    // keeps its format check.
    let mut owner = t.superuser().await;
    let err = sqlx::query(
        "UPDATE webhook_endpoints \
         SET previous_secret = 'sk_not_a_webhook_secret', \
             previous_secret_expires_at = now() + interval '1 hour' WHERE id = $1",
    )
    .bind(ep.id)
    .execute(&mut owner)
    .await
    .unwrap_err();
    assert_eq!(
        err.as_database_error().and_then(|e| e.constraint()),
        Some("webhook_endpoints_previous_secret_format"),
        "{err}"
    );
    let err = t
        .api_as("tenant_a")
        .execute(
            sql("UPDATE webhook_endpoints \
                 SET previous_secret_ciphertext = secret_ciphertext, \
                     previous_secret_key_id = secret_key_id WHERE id = $1")
            .bind(ep.id),
        )
        .await
        .unwrap_err();
    assert_eq!(
        err.constraint(),
        Some("webhook_endpoints_previous_secret_has_expiry"),
        "{err}"
    );
}
