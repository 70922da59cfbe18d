//! What the roles are given (endpoints on the receiver, invoice-shaped events)
//! and what came out at the receiver (first arrivals, repeats, verified signatures).

use std::collections::HashMap;
use std::collections::hash_map::Entry;
use std::time::Instant;

use anyhow::{Context, Result, anyhow, ensure};
use db::Db;
use testbed::receiver::Received;
use webhook_delivery::create_endpoint;

pub const TENANT: &str = "tenant_bench";
pub const EVENT_TYPE: &str = "invoice.finalized";
/// Signed requests kept per endpoint and checked after each phase.
pub const SAMPLES_PER_ENDPOINT: usize = 5;

/// An endpoint of the tenant: its path on the receiver and its `whsec_` secret.
pub struct Endpoint {
    pub path: String,
    pub secret: String,
}

/// `n` endpoints of the tenant at `/{prefix}/ep{i}` on the receiver at `base_url`.
pub async fn endpoints(db: &Db, base_url: &str, prefix: &str, n: usize) -> Result<Vec<Endpoint>> {
    let mut out = Vec::with_capacity(n);
    for i in 0..n {
        let path = format!("/{prefix}/ep{i}");
        let url = format!("{base_url}{path}");
        let ep = create_endpoint(db, &bench_keyring(), TENANT, &url, &[] as &[&str]).await?;
        out.push(Endpoint {
            path,
            secret: ep.secret.expose(),
        });
    }
    Ok(out)
}

/// The key the bench seals its endpoints' secrets with (the test bed's).
pub fn bench_keyring() -> webhook_delivery::Keyring {
    webhook_delivery::Keyring::parse(testbed::SECRETS_KEY).expect("the test bed's key parses")
}

/// An invoice-shaped payload of about 200 bytes.
pub fn payload(i: usize) -> String {
    format!(
        r#"{{"invoice":"in_{i:08}","customer":"cus_{:08x}","status":"open","currency":"eur","amount_due":{},"lines":[{{"price":"price_basic","quantity":1}}],"period_end":"2026-12-01T00:00:00Z"}}"#,
        i.wrapping_mul(2_654_435_761) & 0xffff_ffff,
        1000 + i % 90_000
    )
}

/// Enqueue `events` events, `per_tx` to a transaction: each transaction's with
/// one `webhook_outbox::enqueue_many` statement, or with `webhook_outbox::enqueue`
/// once per event when `each`.
pub async fn preload(db: &Db, events: usize, per_tx: usize, each: bool) -> Result<()> {
    let mut next = 0;
    while next < events {
        let end = (next + per_tx).min(events);
        let mut tx = db.begin().await?;
        if each {
            for i in next..end {
                webhook_outbox::enqueue(&mut tx, TENANT, EVENT_TYPE, &payload(i)).await?;
            }
        } else {
            let payloads: Vec<String> = (next..end).map(payload).collect();
            let batch: Vec<webhook_outbox::NewEvent<'_>> = payloads
                .iter()
                .map(|p| (TENANT, EVENT_TYPE, p.as_str()))
                .collect();
            webhook_outbox::enqueue_many(&mut tx, &batch).await?;
        }
        tx.commit().await?;
        next = end;
    }
    Ok(())
}

/// What reached the receiver during a phase.
pub struct Arrivals {
    pub requests: usize,
    /// Requests whose (webhook-id, path) had arrived before.
    pub repeats: usize,
    /// First arrival per (webhook-id, path).
    pub first: HashMap<(String, String), Instant>,
    /// Kept requests whose signature verified.
    pub verified: usize,
}

impl Arrivals {
    /// Sort the phase's requests: every one must carry the three `webhook-*`
    /// headers, and the first [`SAMPLES_PER_ENDPOINT`] of each endpoint must
    /// verify against its secret with `testbed::webhook_verify`.
    pub fn of(received: &[Received], endpoints: &[Endpoint]) -> Result<Arrivals> {
        let mut first = HashMap::with_capacity(received.len());
        let (mut unsigned, mut repeats) = (0, 0);
        let mut samples: HashMap<&str, Vec<&Received>> = HashMap::new();
        for r in received {
            let signed = ["webhook-timestamp", "webhook-signature"]
                .iter()
                .all(|h| r.try_header(h).is_some());
            let Some(id) = r.try_header("webhook-id").filter(|_| signed) else {
                unsigned += 1;
                continue;
            };
            let key = (id.to_owned(), r.path.clone());
            match first.entry(key) {
                Entry::Occupied(_) => repeats += 1,
                Entry::Vacant(slot) => {
                    slot.insert(r.at);
                }
            }
            let kept = samples.entry(r.path.as_str()).or_default();
            if kept.len() < SAMPLES_PER_ENDPOINT {
                kept.push(r);
            }
        }
        ensure!(unsigned == 0, "{unsigned} requests came unsigned");
        let mut verified = 0;
        for ep in endpoints {
            let kept = samples
                .get(ep.path.as_str())
                .ok_or_else(|| anyhow!("no request reached {}", ep.path))?;
            for r in kept {
                testbed::webhook_verify::verify(&ep.secret, r)
                    .map_err(anyhow::Error::msg)
                    .with_context(|| format!("endpoint {}", ep.path))?;
                verified += 1;
            }
        }
        Ok(Arrivals {
            requests: received.len(),
            repeats,
            first,
            verified,
        })
    }
}
