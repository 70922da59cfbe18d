//! Dunning's pause, the `pause_collection` final action (docs/design.md
//! §4.3), in the final action's transaction: the subscription's row locked
//! first, then by the pause as read: dunning's own pause in force is already
//! held; a pause that has lifted is cleared by a compare-and-set on it
//! (`subscription.collection_resumed`); no pause, or anyone else's, is
//! replaced by dunning's by a compare-and-set on what was read
//! (`subscription.collection_paused`). Per run ([`pause`]) and per batch
//! ([`pauses`]).

use std::collections::{HashMap, HashSet};

use db::{Row, Tx, sql};

use crate::Error;
use crate::run::Run;

/// Dunning's pause, in the final action's transaction (the resume rule,
/// docs/design.md §4.3):
/// the subscription's row lock first, which serializes this with every other
/// pause writer; then, by the pause as read:
///
/// - invoice not open, subscription canceled, or dunning's own pause in
///   force ("already held") → nothing written: `Some([])`;
/// - a pause that has lifted (`resumes_at <= now()`) → cleared by a
///   compare-and-set on it, with `subscription.collection_resumed`, then
///   dunning's pause;
/// - no pause, or a pause set by anyone else (with or without a resume
///   time) → replaced by dunning's pause, with the policy's behaviour and no
///   resume time, and `subscription.collection_paused`.
///
/// `None` when a compare-and-set missed (the pause moved): roll back.
pub(super) async fn pause(
    tx: &mut Tx,
    run: &Run,
) -> Result<Option<Vec<(&'static str, serde_json::Value)>>, Error> {
    let Some(read) = tx
        .fetch_optional(
            sql("SELECT s.pause_collection_behavior AS behavior, \
                        to_json(s.pause_collection_resumes_at) #>> '{}' AS resumes_at, \
                        s.pause_collection_set_by AS set_by, \
                        s.pause_collection_resumes_at <= now() AS lifted \
                 FROM subscriptions s \
                 JOIN invoices i ON i.tenant_id = s.tenant_id AND i.subscription_id = s.id \
                 WHERE i.id = $1 AND i.status = 'open' AND s.status <> 'canceled' \
                 FOR UPDATE OF s")
            .bind(run.invoice_id),
        )
        .await?
    else {
        return Ok(Some(Vec::new()));
    };
    let mut behavior: Option<String> = read.try_get("behavior").map_err(db::Error::from)?;
    let mut resumes_at: Option<String> = read.try_get("resumes_at").map_err(db::Error::from)?;
    let mut set_by: Option<String> = read.try_get("set_by").map_err(db::Error::from)?;
    let lifted: Option<bool> = read.try_get("lifted").map_err(db::Error::from)?;
    if set_by.as_deref() == Some("dunning") && lifted != Some(true) {
        return Ok(Some(Vec::new()));
    }
    let mut events = Vec::new();
    let mut replaced = serde_json::Value::Null;
    if lifted == Some(true) {
        let cleared = tx
            .execute(
                sql(
                    "UPDATE subscriptions SET pause_collection_behavior = NULL, \
                            pause_collection_resumes_at = NULL, pause_collection_set_by = NULL, \
                            updated_at = now() \
                     WHERE id = $1 AND pause_collection_behavior = $2 \
                       AND pause_collection_resumes_at = $3::timestamptz \
                       AND pause_collection_resumes_at <= now() \
                       AND pause_collection_set_by IS NOT DISTINCT FROM $4",
                )
                .bind(run.subscription_id)
                .bind(behavior.clone())
                .bind(resumes_at.clone())
                .bind(set_by.clone()),
            )
            .await?;
        if cleared != 1 {
            return Ok(None);
        }
        events.push((
            "subscription.collection_resumed",
            serde_json::json!({"object": "subscription", "id": run.subscription_id,
                               "pause_collection": null,
                               "previous_pause_collection": {"behavior": behavior,
                                                             "resumes_at": resumes_at}}),
        ));
        (behavior, resumes_at, set_by) = (None, None, None);
    } else if behavior.is_some() {
        replaced = serde_json::json!({"behavior": behavior, "resumes_at": resumes_at,
                                      "set_by": set_by});
    }
    let paused = tx
        .execute(
            sql(
                "UPDATE subscriptions s SET pause_collection_behavior = $2, \
                        pause_collection_resumes_at = NULL, pause_collection_set_by = 'dunning', \
                        updated_at = now() \
                 FROM invoices i \
                 WHERE i.id = $1 AND s.tenant_id = i.tenant_id AND s.id = i.subscription_id \
                   AND i.status = 'open' AND s.status <> 'canceled' \
                   AND s.pause_collection_behavior IS NOT DISTINCT FROM $3 \
                   AND s.pause_collection_resumes_at IS NOT DISTINCT FROM $4::timestamptz \
                   AND s.pause_collection_set_by IS NOT DISTINCT FROM $5",
            )
            .bind(run.invoice_id)
            .bind(run.policy.pause_behavior.as_str())
            .bind(behavior)
            .bind(resumes_at)
            .bind(set_by),
        )
        .await?;
    if paused != 1 {
        return Ok(None);
    }
    events.push((
        "subscription.collection_paused",
        serde_json::json!({"object": "subscription", "id": run.subscription_id,
                           "pause_collection": {"behavior": run.policy.pause_behavior.as_str(),
                                                "resumes_at": null},
                           "replaced_pause_collection": replaced,
                           "invoice": run.invoice_id, "dunning_run": run.id}),
    ));
    Ok(Some(events))
}

/// [`pause`] for many runs with three statements: their subscriptions read
/// and locked in id order; the lifted pauses cleared (`subscription.collection_resumed`);
/// dunning's pause written over what was read. A subscription two runs
/// share is paused by the first; the second finds it held. Returns, per run
/// whose pause landed, its events.
pub(super) async fn pauses(
    tx: &mut Tx,
    runs: &[&Run],
) -> Result<Vec<(i64, Vec<(&'static str, serde_json::Value)>)>, Error> {
    if runs.is_empty() {
        return Ok(Vec::new());
    }
    let rows = tx
        .fetch_all(
            sql(
                "SELECT s.id, i.id AS invoice, s.pause_collection_behavior AS behavior, \
                        to_json(s.pause_collection_resumes_at) #>> '{}' AS resumes_at, \
                        s.pause_collection_set_by AS set_by, \
                        s.pause_collection_resumes_at <= now() AS lifted \
                 FROM subscriptions s \
                 JOIN invoices i ON i.tenant_id = s.tenant_id AND i.subscription_id = s.id \
                 WHERE i.id = ANY($1) AND i.status = 'open' AND s.status <> 'canceled' \
                 ORDER BY s.id \
                 FOR UPDATE OF s",
            )
            .bind(runs.iter().map(|r| r.invoice_id).collect::<Vec<_>>()),
        )
        .await?;
    // (behavior, resumes_at, set_by, lifted) per subscription, as read.
    type Read = (Option<String>, Option<String>, Option<String>, Option<bool>);
    let mut read: HashMap<i64, Read> = HashMap::new();
    let mut open: HashSet<i64> = HashSet::new();
    for r in &rows {
        open.insert(r.try_get("invoice").map_err(db::Error::from)?);
        let get = |c: &str| r.try_get::<Option<String>, _>(c).map_err(db::Error::from);
        read.insert(
            r.try_get("id").map_err(db::Error::from)?,
            (
                get("behavior")?,
                get("resumes_at")?,
                get("set_by")?,
                r.try_get("lifted").map_err(db::Error::from)?,
            ),
        );
    }
    let (mut clears, mut writes, mut out) = (Vec::new(), Vec::new(), Vec::new());
    let mut taken: HashSet<i64> = HashSet::new();
    for run in runs {
        let Some((behavior, resumes_at, set_by, lifted)) = read.get(&run.subscription_id) else {
            continue; // invoice no longer open, or the subscription canceled
        };
        if !open.contains(&run.invoice_id) {
            continue;
        }
        if !taken.insert(run.subscription_id) {
            continue; // another run of this batch pauses it
        }
        let lifted = *lifted == Some(true);
        if set_by.as_deref() == Some("dunning") && !lifted {
            continue; // already held
        }
        let mut events = Vec::new();
        let mut replaced = serde_json::Value::Null;
        if lifted {
            clears.push((
                run.subscription_id,
                behavior.clone(),
                resumes_at.clone(),
                set_by.clone(),
            ));
            events.push((
                "subscription.collection_resumed",
                serde_json::json!({"object": "subscription", "id": run.subscription_id,
                                   "pause_collection": null,
                                   "previous_pause_collection": {"behavior": behavior,
                                                                 "resumes_at": resumes_at}}),
            ));
            writes.push((run, None, None, None));
        } else {
            if behavior.is_some() {
                replaced = serde_json::json!({"behavior": behavior, "resumes_at": resumes_at,
                                              "set_by": set_by});
            }
            writes.push((run, behavior.clone(), resumes_at.clone(), set_by.clone()));
        }
        events.push((
            "subscription.collection_paused",
            serde_json::json!({"object": "subscription", "id": run.subscription_id,
                               "pause_collection": {"behavior": run.policy.pause_behavior.as_str(),
                                                    "resumes_at": null},
                               "replaced_pause_collection": replaced,
                               "invoice": run.invoice_id, "dunning_run": run.id}),
        ));
        out.push((run.id, events));
    }
    if !clears.is_empty() {
        let n = tx
            .execute(
                sql(
                    "UPDATE subscriptions s SET pause_collection_behavior = NULL, \
                            pause_collection_resumes_at = NULL, pause_collection_set_by = NULL, \
                            updated_at = now() \
                     FROM unnest($1::bigint[], $2::text[], $3::text[], $4::text[]) \
                          AS c(id, behavior, resumes_at, set_by) \
                     WHERE s.id = c.id AND s.pause_collection_behavior = c.behavior \
                       AND s.pause_collection_resumes_at = c.resumes_at::timestamptz \
                       AND s.pause_collection_resumes_at <= now() \
                       AND s.pause_collection_set_by IS NOT DISTINCT FROM c.set_by",
                )
                .bind(clears.iter().map(|c| c.0).collect::<Vec<_>>())
                .bind(clears.iter().map(|c| c.1.clone()).collect::<Vec<_>>())
                .bind(clears.iter().map(|c| c.2.clone()).collect::<Vec<_>>())
                .bind(clears.iter().map(|c| c.3.clone()).collect::<Vec<_>>()),
            )
            .await?;
        if n as usize != clears.len() {
            return Err(Error::NotCounted(
                "a lifted pause moved under its lock".into(),
            ));
        }
    }
    if !writes.is_empty() {
        let n = tx
            .execute(
                sql("UPDATE subscriptions s SET pause_collection_behavior = w.behavior, \
                            pause_collection_resumes_at = NULL, pause_collection_set_by = 'dunning', \
                            updated_at = now() \
                     FROM unnest($1::bigint[], $2::text[], $3::text[], $4::text[], $5::text[]) \
                          AS w(id, behavior, was_behavior, was_resumes_at, was_set_by) \
                     WHERE s.id = w.id AND s.status <> 'canceled' \
                       AND s.pause_collection_behavior IS NOT DISTINCT FROM w.was_behavior \
                       AND s.pause_collection_resumes_at IS NOT DISTINCT FROM w.was_resumes_at::timestamptz \
                       AND s.pause_collection_set_by IS NOT DISTINCT FROM w.was_set_by")
                .bind(writes.iter().map(|w| w.0.subscription_id).collect::<Vec<_>>())
                .bind(
                    writes
                        .iter()
                        .map(|w| w.0.policy.pause_behavior.as_str().to_owned())
                        .collect::<Vec<_>>(),
                )
                .bind(writes.iter().map(|w| w.1.clone()).collect::<Vec<_>>())
                .bind(writes.iter().map(|w| w.2.clone()).collect::<Vec<_>>())
                .bind(writes.iter().map(|w| w.3.clone()).collect::<Vec<_>>()),
            )
            .await?;
        if n as usize != writes.len() {
            return Err(Error::NotCounted("a pause moved under its lock".into()));
        }
    }
    Ok(out)
}
