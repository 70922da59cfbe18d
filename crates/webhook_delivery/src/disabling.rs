//! Endpoints that fail for days are turned off, and their tenant is told
//! (docs/adr/0041).
//!
//! The outcome statement keeps each endpoint's `failing_since`: when its
//! current run of failed attempts began (migration 0031). At the end of a
//! tick, at most once every [`CHECK_EVERY`], the leader turns off the enabled
//! endpoints whose run is older than `WorkerConfig::disable_after`, by a
//! fenced statement, and in the same transaction publishes an
//! `endpoint.disabled` event to the tenant (fanned out to its other enabled
//! endpoints that take that type, as any event) and, when the service has a
//! notice sender and the tenant a contact, queues an email to the contact.

use std::time::Duration;

use chrono::{DateTime, Utc};
use db::Row as _;
use leader::{Fence, Role};
use tracing::{info, warn};

use crate::error::Error;
use crate::shared::Shared;
use crate::store;

/// How often a leader looks for endpoints to turn off. The threshold is
/// days; a minute of lateness is nothing, and the statement reads an index
/// of failing endpoints only.
pub(crate) const CHECK_EVERY: Duration = Duration::from_secs(60);

/// The event type a tenant receives when one of its endpoints is turned off.
pub const ENDPOINT_DISABLED: &str = "endpoint.disabled";

/// One endpoint turned off.
#[derive(Debug, Clone)]
pub(crate) struct Disabled {
    pub id: i64,
    pub tenant_id: String,
    /// The URL's host: what the tenant's notice names (a URL's path or query
    /// may hold a token).
    pub host: String,
    pub failing_since: DateTime<Utc>,
    pub contact: Option<String>,
}

/// Turn off what has failed for too long, when the setting is on; how many
/// endpoints were turned off. The tick's end calls it when
/// `Shared::disabling` ([`scheduler::Every`] at [`CHECK_EVERY`]).
///
/// # Errors
/// A database error, or a notice that could not be queued: nothing was
/// turned off.
pub(crate) async fn disable_failing(shared: &Shared, fence: &Fence) -> Result<usize, Error> {
    let Some(after) = shared.config.disable_after else {
        return Ok(0);
    };
    let mut tx = shared
        .db
        .begin_with_timeout(shared.config.statement_timeout)
        .await?;
    let off = store::disable_failing(&mut tx, fence, after).await?;
    for d in &off {
        let payload = serde_json::json!({
            "endpoint_id": d.id,
            "host": d.host,
            "failing_since": d.failing_since.to_rfc3339_opts(chrono::SecondsFormat::Secs, true),
            "reason": "failing",
            "disable_after_seconds": after.as_secs(),
        })
        .to_string();
        outbox::webhook::enqueue(&mut tx, &d.tenant_id, ENDPOINT_DISABLED, &payload)
            .await
            .map_err(|e| Error::Notice(e.to_string()))?;
        if let (Some(from), Some(to)) = (&shared.config.notice_from, &d.contact) {
            let email = notice_email(from, to, d, after);
            outbox::email::enqueue_or_record(&mut tx, &d.tenant_id, &email, &shared.telemetry)
                .await
                .map_err(|e| Error::Notice(e.to_string()))?;
        }
    }
    tx.commit().await?;
    for d in &off {
        warn!(
            role = %Role::WebhookDelivery,
            endpoint = d.id,
            tenant = %d.tenant_id,
            host = %d.host,
            failing_since = %d.failing_since,
            told_by_email = d.contact.is_some() && shared.config.notice_from.is_some(),
            "every attempt to this webhook endpoint failed for too long: turned off, its tenant told"
        );
    }
    if !off.is_empty() {
        shared
            .telemetry
            .counter(
                "hardcount_webhook_endpoints_disabled_total",
                &[("reason", "failing")],
            )
            .increment(off.len() as u64);
        info!(role = %Role::WebhookDelivery, count = off.len(), "webhook endpoints turned off");
    }
    Ok(off.len())
}

/// The email a tenant's contact receives.
fn notice_email(from: &str, to: &str, d: &Disabled, after: Duration) -> outbox::email::Email {
    let days = after.as_secs_f64() / 86_400.0;
    let text = format!(
        "Your webhook endpoint {id} ({host}) has been turned off.\n\n\
         Every delivery attempt to it failed from {since} on, for more than {days:.1} days. \
         Nothing more is sent to it until you turn it on again \
         (POST /v1/webhook_endpoints/{id}/enable); its failed deliveries can then be sent again \
         with POST /v1/webhook_endpoints/{id}/recover.\n",
        id = d.id,
        host = d.host,
        since = d.failing_since.format("%Y-%m-%d %H:%M UTC"),
    );
    outbox::email::Email {
        from: from.to_owned(),
        to: vec![to.to_owned()],
        subject: format!("Webhook endpoint {} turned off: it kept failing", d.id),
        text,
        html: None,
    }
}

/// One row of [`store::disable_failing`].
pub(crate) fn row(r: &db::PgRow) -> Result<Disabled, db::Error> {
    let url: String = r.try_get("url")?;
    Ok(Disabled {
        id: r.try_get("id")?,
        tenant_id: r.try_get("tenant_id")?,
        host: url::Url::parse(&url)
            .ok()
            .and_then(|u| u.host_str().map(str::to_owned))
            .unwrap_or_default(),
        failing_since: r.try_get("failing_since")?,
        contact: r.try_get("contact_email")?,
    })
}

/// Endpoints turned off per statement.
pub(crate) const PER_STATEMENT: i64 = 100;

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_look_is_due_once_a_minute() {
        use std::time::Instant;
        let d = scheduler::Every::new(CHECK_EVERY);
        let t = Instant::now();
        assert!(d.due_at(t));
        assert!(!d.due_at(t + Duration::from_secs(59)));
        assert!(d.due_at(t + CHECK_EVERY));
    }
}
