//! The demo tenant: a webhook endpoint on a receiver in this process, and a
//! trickle of events for it, each with a receipt email. Seeding is idempotent: a second run reuses the
//! tenant's endpoint and points it at this run's receiver.

use std::time::{Duration, SystemTime, UNIX_EPOCH};

use anyhow::{Context, Result};
use axum::Router;
use axum::http::HeaderMap;
use axum::routing::post;
use db::{Db, Row, sql};
use tokio::net::TcpListener;
use tokio_util::sync::CancellationToken;

pub const TENANT: &str = "demo";
const EVENT_TYPE: &str = "invoice.finalized";

/// Start the receiver on loopback; it prints one line per delivered webhook.
/// Returns its URL.
pub async fn start_receiver(shutdown: CancellationToken) -> Result<String> {
    async fn receive(headers: HeaderMap, body: String) -> &'static str {
        let header = |name: &str| {
            headers
                .get(name)
                .and_then(|v| v.to_str().ok())
                .unwrap_or("-")
                .to_owned()
        };
        let payload: serde_json::Value = serde_json::from_str(&body).unwrap_or_default();
        let enqueued_ms = payload
            .pointer("/data/enqueued_at_ms")
            .or_else(|| payload.get("enqueued_at_ms"))
            .and_then(|v| v.as_u64());
        let after = enqueued_ms
            .map(|at| format!(", {} ms after enqueue", now_ms().saturating_sub(at)))
            .unwrap_or_default();
        println!(
            "delivered webhook {} ({}{after}): {body}",
            header("webhook-id"),
            if header("webhook-signature").starts_with("v1,") {
                "signed"
            } else {
                "UNSIGNED"
            },
        );
        "ok"
    }
    let listener = TcpListener::bind("127.0.0.1:0")
        .await
        .context("demo receiver")?;
    let url = format!("http://{}/webhooks", listener.local_addr()?);
    let app = Router::new().route("/webhooks", post(receive));
    tokio::spawn(async move {
        let _ = axum::serve(listener, app)
            .with_graceful_shutdown(async move { shutdown.cancelled().await })
            .await;
    });
    Ok(url)
}

/// The demo tenant's endpoint, created once and pointed at `receiver_url`.
pub async fn seed(db: &Db, keyring: &webhook_delivery::Keyring, receiver_url: &str) -> Result<()> {
    let existing = db
        .fetch_optional(
            sql("SELECT id FROM webhook_endpoints WHERE tenant_id = $1 ORDER BY id LIMIT 1")
                .bind(TENANT),
        )
        .await?;
    match existing {
        Some(row) => {
            let id: i64 = row.get("id");
            db.execute(
                sql("UPDATE webhook_endpoints SET url = $2 WHERE id = $1")
                    .bind(id)
                    .bind(receiver_url.to_owned()),
            )
            .await?;
            println!("demo tenant {TENANT:?}: reusing endpoint #{id}, now at {receiver_url}");
        }
        None => {
            let endpoint =
                webhook_delivery::create_endpoint(db, keyring, TENANT, receiver_url, &[EVENT_TYPE])
                    .await
                    .context("create the demo endpoint")?;
            println!(
                "demo tenant {TENANT:?}: created endpoint #{} at {receiver_url}",
                endpoint.id
            );
        }
    }
    Ok(())
}

/// Enqueue one `invoice.finalized` event every `every` until `shutdown`, as the
/// billing product would: through `outbox::webhook::enqueue` in a transaction.
pub async fn trickle(db: Db, every: Duration, shutdown: CancellationToken) {
    let mut ticker = tokio::time::interval(every);
    let mut n: u64 = 0;
    while shutdown.run_until_cancelled(ticker.tick()).await.is_some() {
        n += 1;
        let payload = format!(
            r#"{{"invoice":"in_demo_{n}","amount":1200,"currency":"eur","enqueued_at_ms":{}}}"#,
            now_ms()
        );
        // The receipt email goes in the same transaction as the event, as a
        // billing change would queue both.
        let receipt = outbox::email::Email {
            from: "Demo Billing <billing@demo.example>".to_owned(),
            to: vec!["customer@demo.example".to_owned()],
            subject: format!("Receipt for in_demo_{n}"),
            text: format!("We received 12.00 EUR for invoice in_demo_{n}. Thank you."),
            html: Some(format!(
                "<p>We received <b>12.00 EUR</b> for invoice in_demo_{n}. Thank you.</p>"
            )),
        };
        let enqueued = async {
            let mut tx = db.begin().await?;
            let id = outbox::webhook::enqueue(&mut tx, TENANT, EVENT_TYPE, &payload).await?;
            let email = outbox::email::enqueue(&mut tx, TENANT, &receipt).await?;
            tx.commit().await?;
            anyhow::Ok((id, email))
        };
        match enqueued.await {
            Ok((id, email)) => {
                println!("enqueued event #{id} ({EVENT_TYPE}) and receipt email #{email}")
            }
            Err(e) => eprintln!("could not enqueue a demo event: {e:#}"),
        }
    }
}

fn now_ms() -> u64 {
    SystemTime::now()
        .duration_since(UNIX_EPOCH)
        .map_or(0, |d| d.as_millis() as u64)
}
