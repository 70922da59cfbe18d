//! Pause and resume collection (the functions the HTTP API calls), in the
//! caller's transaction with their event, as dunning's pause writes its own.
//!
//! ```text
//!  both    cancel::close_ended_in: the periods ended before now closed as the
//!          tick would, before the change (docs/adr/0096)
//!  pause   SELECT … FOR UPDATE (the row lock serializes every pause writer)
//!          canceled ─▶ Error::InvalidState; nothing written
//!          the same pause in force (by the API) ─▶ nothing written or announced
//!          UPDATE … SET pause_collection_* = (behavior, resumes_at, 'api')
//!          + subscription.collection_paused (the pause it replaced, if any)
//!  resume  SELECT … FOR UPDATE
//!          no pause in force ─▶ Error::InvalidState; nothing written
//!          UPDATE … SET pause_collection_* = NULL
//!          + subscription.collection_resumed (the pause it cleared)
//! ```
//!
//! Stripe's model: `pause_collection.behavior` is one of `keep_as_draft`,
//! `mark_uncollectible`, `void`; `resumes_at` is optional; resuming clears
//! the pause (docs.stripe.com/billing/subscriptions/pause-payment). A pause
//! replaces any other, dunning's included; the tick's resume step clears it
//! once `resumes_at` passes.

use chrono::{DateTime, SubsecRound, Utc};
use db::{Row, Tx, sql};

use crate::{Biller, Error};

/// Who writes a pause through these functions (`pause_collection_set_by`).
pub const SET_BY_API: &str = "api";

/// A pause as the row holds it.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct CollectionPause {
    pub behavior: String,
    pub resumes_at: Option<DateTime<Utc>>,
    pub set_by: Option<String>,
}

/// The subscription's row locked: its status and pause.
async fn locked(
    tx: &mut Tx,
    tenant_id: &str,
    subscription: i64,
) -> Result<(String, Option<CollectionPause>), Error> {
    let row = tx
        .fetch_optional(
            sql(
                "SELECT status, pause_collection_behavior, pause_collection_resumes_at, \
                        pause_collection_set_by \
                 FROM subscriptions WHERE tenant_id = $1 AND id = $2 FOR UPDATE",
            )
            .bind(tenant_id.to_owned())
            .bind(subscription),
        )
        .await?
        .ok_or_else(|| Error::SubscriptionNotFound {
            tenant: tenant_id.to_owned(),
            subscription,
            plan: 0,
        })?;
    let status: String = row.try_get("status").map_err(db::Error::from)?;
    let behavior: Option<String> = row
        .try_get("pause_collection_behavior")
        .map_err(db::Error::from)?;
    let pause = match behavior {
        Some(behavior) => Some(CollectionPause {
            behavior,
            resumes_at: row
                .try_get("pause_collection_resumes_at")
                .map_err(db::Error::from)?,
            set_by: row
                .try_get("pause_collection_set_by")
                .map_err(db::Error::from)?,
        }),
        None => None,
    };
    Ok((status, pause))
}

fn pause_json(p: &CollectionPause) -> serde_json::Value {
    serde_json::json!({
        "behavior": p.behavior,
        "resumes_at": p.resumes_at.map(|t| t.to_rfc3339()),
        "set_by": p.set_by,
    })
}

/// The body of [`crate::Biller::pause_collection_in`].
///
/// The periods that ended before now are closed first, as the tick would
/// have closed them without this pause (docs/adr/0096): a pause never voids,
/// writes off or drafts time used before it.
pub(crate) async fn pause_collection_in(
    biller: &Biller,
    tx: &mut Tx,
    tenant_id: &str,
    subscription: i64,
    behavior: &str,
    resumes_at: Option<DateTime<Utc>>,
) -> Result<CollectionPause, Error> {
    let (before, _) = locked(tx, tenant_id, subscription).await?;
    crate::cancel::close_ended_in(biller, tx, tenant_id, subscription, "collection").await?;
    let (status, replaced) = locked(tx, tenant_id, subscription).await?;
    if status == "canceled" {
        // Canceled by the closing just made, which the refusal rolls back:
        // the subscription still reads active until the tick closes it.
        let reason = if before == "canceled" {
            "a canceled subscription's collection cannot be paused"
        } else {
            "the subscription ends with its period, which has ended; billing cancels it at its next tick"
        };
        return Err(Error::InvalidState {
            subscription,
            reason,
        });
    }
    let pause = CollectionPause {
        behavior: behavior.to_owned(),
        // As the row keeps it, to the microsecond.
        resumes_at: resumes_at.map(|t| t.trunc_subsecs(6)),
        set_by: Some(SET_BY_API.to_owned()),
    };
    // The same pause again changes nothing: nothing is written or announced
    // (docs/adr/0135). The closing above, if any, stands.
    if replaced.as_ref() == Some(&pause) {
        return Ok(pause);
    }
    tx.execute(
        sql("UPDATE subscriptions SET pause_collection_behavior = $3, \
                    pause_collection_resumes_at = $4, pause_collection_set_by = $5, \
                    updated_at = now() \
             WHERE tenant_id = $1 AND id = $2")
        .bind(tenant_id.to_owned())
        .bind(subscription)
        .bind(behavior.to_owned())
        .bind(resumes_at)
        .bind(SET_BY_API),
    )
    .await?;
    let payload = serde_json::json!({
        "object": "subscription",
        "id": subscription,
        "pause_collection": pause_json(&pause),
        "replaced_pause_collection": replaced.as_ref().map(pause_json),
    });
    outbox::webhook::enqueue(
        tx,
        tenant_id,
        "subscription.collection_paused",
        &payload.to_string(),
    )
    .await?;
    Ok(pause)
}

/// The body of [`crate::Biller::resume_collection_in`].
///
/// The periods that ended before now are closed first, under the pause they
/// ended in (docs/adr/0096): a resume does not make them chargeable.
pub(crate) async fn resume_collection_in(
    biller: &Biller,
    tx: &mut Tx,
    tenant_id: &str,
    subscription: i64,
) -> Result<CollectionPause, Error> {
    let (_, before) = locked(tx, tenant_id, subscription).await?;
    let Some(before) = before else {
        return Err(Error::InvalidState {
            subscription,
            reason: "the subscription's collection is not paused",
        });
    };
    crate::cancel::close_ended_in(biller, tx, tenant_id, subscription, "collection").await?;
    // A pause past its resume time is lifted (and announced) by the closing,
    // as the tick lifts it: resumed already.
    let (_, pause) = locked(tx, tenant_id, subscription).await?;
    let Some(pause) = pause else {
        return Ok(before);
    };
    tx.execute(
        sql(
            "UPDATE subscriptions SET pause_collection_behavior = NULL, \
                    pause_collection_resumes_at = NULL, pause_collection_set_by = NULL, \
                    updated_at = now() \
             WHERE tenant_id = $1 AND id = $2",
        )
        .bind(tenant_id.to_owned())
        .bind(subscription),
    )
    .await?;
    let payload = serde_json::json!({
        "object": "subscription",
        "id": subscription,
        "pause_collection": null,
        "previous_pause_collection": pause_json(&pause),
    });
    outbox::webhook::enqueue(
        tx,
        tenant_id,
        "subscription.collection_resumed",
        &payload.to_string(),
    )
    .await?;
    Ok(pause)
}
