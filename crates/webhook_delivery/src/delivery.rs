//! A claimed delivery and what became of it: domain types, no SQL and no I/O.

use std::fmt;
use std::time::Instant;

use crate::store::ClaimedRow;

/// A delivery claimed for one attempt. Its `Debug` shows no secret or URL.
pub struct Claimed {
    pub(crate) row: ClaimedRow,
    /// Taken before the claim was sent: the lease ends no earlier than this + lease.
    pub(crate) claimed_at: Instant,
}

impl Claimed {
    pub fn id(&self) -> i64 {
        self.row.id
    }
    pub fn tenant_id(&self) -> &str {
        &self.row.tenant_id
    }
    pub fn event_id(&self) -> i64 {
        self.row.event_id
    }
    pub fn endpoint_id(&self) -> i64 {
        self.row.endpoint_id
    }
    /// This attempt's number (1 for the first); its outcome must prove it.
    pub fn attempt(&self) -> u32 {
        u32::try_from(self.row.attempt).unwrap_or(0)
    }
    /// The `webhook-id` sent with every attempt of this event.
    pub fn message_id(&self) -> &str {
        &self.row.message_id
    }
    pub fn event_type(&self) -> &str {
        &self.row.event_type
    }

    /// The request body: a Standard Webhooks envelope around the payload,
    /// `{"type":…,"timestamp":…,"data":…}`, the same bytes on every attempt.
    pub fn body(&self) -> Vec<u8> {
        let event_type = serde_json::Value::String(self.row.event_type.clone());
        let timestamp = serde_json::Value::String(self.row.event_time.clone());
        format!(
            "{{\"type\":{event_type},\"timestamp\":{timestamp},\"data\":{}}}",
            self.row.payload
        )
        .into_bytes()
    }
}

impl fmt::Debug for Claimed {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("Claimed")
            .field("id", &self.row.id)
            .field("tenant_id", &self.row.tenant_id)
            .field("event_id", &self.row.event_id)
            .field("endpoint_id", &self.row.endpoint_id)
            .field("attempt", &self.row.attempt)
            .finish_non_exhaustive()
    }
}

/// What became of one claimed delivery.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Outcome {
    /// A 2xx answer; recorded.
    Delivered,
    /// Failed; recorded and scheduled again.
    Retry,
    /// Failed for the last time, answered 410, or its endpoint is disabled; recorded.
    Dead,
    /// The SSRF guard refused the target (no connection made); recorded and
    /// scheduled again like any failure (dead after the last attempt).
    Refused,
    /// A later claim superseded this attempt: its result was not written.
    Stale,
    /// Never sent (out of time, or cancelled): handed back, attempt not counted.
    Released,
    /// Never sent, and handed back to come due later (its endpoint's circuit
    /// breaker is open, or no turn came while its batch ran): attempt not counted.
    Held,
    /// Sent, but the outcome could not be written; the claim's lease brings
    /// the delivery back (the receiver may see it again).
    Unrecorded,
}

impl Outcome {
    /// The `outcome` label on `hardcount_webhook_deliveries_total`, if counted there.
    pub fn label(&self) -> Option<&'static str> {
        Some(match self {
            Outcome::Delivered => "delivered",
            Outcome::Retry => "retry",
            Outcome::Dead => "dead",
            Outcome::Refused => "refused",
            Outcome::Stale => "stale",
            Outcome::Held => "held",
            Outcome::Released | Outcome::Unrecorded => return None,
        })
    }
}
