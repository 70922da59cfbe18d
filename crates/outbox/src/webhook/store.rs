//! The producers' SQL for webhook events: each insert wakes the
//! `webhook_outbox` role in the same statement.

use db::{Row, Tx, sql};
use leader::Role;
use scheduler::wake_channel;

/// Insert one event inside `tx` and wake the `webhook_outbox` role
/// (`pg_notify`, sent only if `tx` commits; docs/adr/0014), in one statement.
/// The payload is bound as text and cast, so the stored jsonb is exactly what
/// the caller validated.
pub(crate) async fn insert_event(
    tx: &mut Tx,
    tenant_id: &str,
    event_type: &str,
    payload_json: &str,
) -> Result<i64, db::Error> {
    let row = tx
        .fetch_one(
            sql("WITH e AS ( \
                   INSERT INTO webhook_events (tenant_id, event_type, payload) \
                   VALUES ($1, $2, $3::jsonb) RETURNING id), \
                 wake AS (SELECT pg_notify($4, '')) \
                 SELECT e.id FROM e, wake")
            .bind(tenant_id.to_owned())
            .bind(event_type.to_owned())
            .bind(payload_json.to_owned())
            .bind(wake_channel(Role::WebhookOutbox)),
        )
        .await?;
    Ok(row.try_get("id")?)
}

/// [`insert_event`], returning the row as stored.
pub(crate) async fn insert_event_returning(
    tx: &mut Tx,
    tenant_id: &str,
    event_type: &str,
    payload_json: &str,
) -> Result<db::PgRow, db::Error> {
    tx.fetch_one(
        sql("WITH e AS ( \
               INSERT INTO webhook_events (tenant_id, event_type, payload) \
               VALUES ($1, $2, $3::jsonb) \
               RETURNING id, event_type, payload, message_id, created_at, dispatched_at), \
             wake AS (SELECT pg_notify($4, '')) \
             SELECT e.* FROM e, wake")
        .bind(tenant_id.to_owned())
        .bind(event_type.to_owned())
        .bind(payload_json.to_owned())
        .bind(wake_channel(Role::WebhookOutbox)),
    )
    .await
}

/// [`insert_event_returning`] for the tenant the same message set
/// (`api_tenant()`), as text for [`db::Db::run_once`]: no row, and nothing
/// written, when it set none.
pub(crate) fn insert_event_for_caller(event_type: &str, payload_json: &str) -> String {
    format!(
        "WITH e AS ( \
           INSERT INTO webhook_events (tenant_id, event_type, payload) \
           SELECT api_tenant(), {}, {}::jsonb WHERE api_tenant() IS NOT NULL \
           RETURNING id, event_type, payload, message_id, created_at, dispatched_at), \
         wake AS (SELECT pg_notify({}, '') FROM e) \
         SELECT e.* FROM e, wake",
        db::hex_text(event_type),
        db::hex_text(payload_json),
        db::hex_text(wake_channel(Role::WebhookOutbox)),
    )
}

/// Insert many events inside `tx` and wake the `webhook_outbox` role, in one
/// statement (`pg_notify`, sent only if `tx` commits; docs/adr/0014); how
/// many.
pub(crate) async fn insert_events(
    tx: &mut Tx,
    events: &[super::NewEvent<'_>],
) -> Result<u64, db::Error> {
    if events.is_empty() {
        return Ok(0);
    }
    let tenants: Vec<String> = events.iter().map(|e| e.0.to_owned()).collect();
    let types: Vec<String> = events.iter().map(|e| e.1.to_owned()).collect();
    let payloads: Vec<String> = events.iter().map(|e| e.2.to_owned()).collect();
    let row = tx
        .fetch_one(
            sql("WITH ins AS ( \
                   INSERT INTO webhook_events (tenant_id, event_type, payload) \
                   SELECT tenant_id, event_type, payload::jsonb \
                   FROM unnest($1::text[], $2::text[], $3::text[]) AS e(tenant_id, event_type, payload) \
                   RETURNING 1), \
                 notify AS (SELECT pg_notify($4, '') WHERE EXISTS (SELECT 1 FROM ins)) \
                 SELECT (SELECT count(*) FROM ins) AS inserted, (SELECT count(*) FROM notify) AS woken")
            // `woken` is read only so that the `notify` CTE runs: Postgres
            // skips a read-only CTE that nothing references.
            .bind(tenants)
            .bind(types)
            .bind(payloads)
            .bind(wake_channel(Role::WebhookOutbox)),
        )
        .await?;
    let inserted: i64 = row.try_get("inserted")?;
    Ok(u64::try_from(inserted).unwrap_or(0))
}
