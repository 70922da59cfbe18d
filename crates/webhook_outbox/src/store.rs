//! All of the outbox's SQL: the insert producers run in their own transaction,
//! the dispatcher's fenced claim and set-based fan-out, and the retention
//! prune of dispatched events (`prune`, docs/adr/0040).

use std::collections::HashMap;
use std::sync::Arc;
use std::time::{Duration, Instant};

use db::{Db, PgRow, Row, TENANTS_PER_CLAIM, TenantCursor, Walk, sql};
use leader::{Fence, Role};
use outbox::webhook::{HandedDelivery, HandedEndpoint, HandedEvent};
use scheduler::{Offer, wake_channel};

use crate::Error;

mod prune;
pub(crate) use prune::prune_dispatched;
pub use prune::{PRUNE_DISPATCHED, PruneCursor, PrunedEvents, pruned_events};

/// Whether any event waits to be fanned out, or a handoff's lease has ended
/// (docs/adr/0124): one read of the partial index
/// `webhook_events_undispatched`, exactly the claim's predicate without its
/// fence and lock (it claims nothing), and one of `webhook_handoffs`, a table
/// of about one row per fan-out in flight. An idle probing tick runs it every
/// `scheduler::IDLE_PROBE` (docs/adr/0019).
pub(crate) async fn any_undispatched(db: &Db) -> Result<bool, db::Error> {
    let row = db
        .fetch_one(sql(
            "SELECT EXISTS (SELECT 1 FROM webhook_events WHERE dispatched_at IS NULL) \
                 OR EXISTS (SELECT 1 FROM webhook_handoffs WHERE until < now()) AS waiting",
        ))
        .await?;
    Ok(row.try_get("waiting")?)
}

/// The statement of [`backlog`]; `pub` only for the plan test
/// (`tests/it/plans.rs`).
pub const BACKLOG: &str = "SELECT count(*) AS waiting, \
            coalesce(extract(epoch FROM now() - min(created_at)), 0)::float8 AS oldest, \
            extract(epoch FROM now())::float8 AS read_at \
     FROM webhook_events WHERE dispatched_at IS NULL";

/// Events waiting for the fan-out, how long the oldest has waited on the
/// database clock (0 when none), and when they were read (epoch seconds):
/// the role's backlog gauges. Through the
/// partial index `webhook_events_undispatched`, so dispatched events kept
/// for retention are not read.
pub(crate) async fn backlog(
    db: &Db,
    statement_timeout: Duration,
) -> Result<(i64, f64, f64), db::Error> {
    let mut tx = db.begin_index_driven(statement_timeout).await?;
    let row = tx.fetch_one(sql(BACKLOG)).await?;
    tx.commit().await?;
    Ok((
        row.try_get("waiting")?,
        row.try_get("oldest")?,
        row.try_get("read_at")?,
    ))
}

/// What one batch did.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub(crate) struct Batch {
    /// Events claimed and stamped dispatched.
    pub events: usize,
    /// Deliveries made: inserted pending (conflicts with existing ones are
    /// not counted) or handed to the delivery role unwritten.
    pub deliveries: u64,
}

/// The statement of [`claim_and_fan_out`]; `pub` only for the plan test
/// (`tests/it/plans.rs`). The claim interleaves tenants (docs/adr/0048,
/// `db::fair`): `tenants` walks `webhook_events_undispatched` (tenant, id)
/// one descent per tenant after the cursor (`$6`, at most `$7` tenants),
/// `first` takes each one's share of the limit in id order, `fill` shares the
/// rest between the tenants that took all of theirs. Both match their tenant
/// by a range (`>=` and `<=`, a row comparison in `fill`) and order by
/// `(tenant_id, id)`: with an equality the planner reduced the order to `id`
/// and, on analyzed statistics, walked the primary key filtering by tenant,
/// reading every later event of the other tenants (docs/adr/0061).
///
/// A pair is `handed` only while `row_number()` and the running byte sum,
/// both in the window's (event, endpoint) order, stay within the offer, and
/// `leads` and `first` are the same for every pair of an event: so an
/// event's handed pairs are always its first ones, and its first pair
/// (`opens`) is handed whenever any is. The `event` parts rely on that
/// (docs/adr/0127); a condition on `handed` that varies by endpoint would
/// leave a handed pair without its event, and `handed_deliveries` would
/// refuse every such statement.
pub const CLAIM_AND_FAN_OUT: &str = concat!(
    "WITH RECURSIVE ",
    db::fair_tenants!("webhook_events", "dispatched_at IS NULL", "$6", "$7", "$3"),
    "first AS MATERIALIZED ( \
           SELECT pick.* FROM tenants t CROSS JOIN share s, LATERAL ( \
             SELECT x.*, row_number() OVER () AS turn FROM ( \
               SELECT e.id, e.tenant_id FROM webhook_events e \
               WHERE e.dispatched_at IS NULL \
                 AND e.tenant_id >= t.tenant_id AND e.tenant_id <= t.tenant_id \
                 AND leader_fence($1, $2) \
               ORDER BY e.tenant_id, e.id \
               LIMIT s.quota \
               FOR UPDATE SKIP LOCKED) x) pick), \
         whole AS MATERIALIZED ( \
           SELECT f.tenant_id, f.id AS last_id FROM first f, share s WHERE f.turn = s.quota), \
         fill AS MATERIALIZED ( \
           SELECT more.* FROM whole w CROSS JOIN share s, LATERAL ( \
             SELECT x.*, s.quota + row_number() OVER () AS turn FROM ( \
               SELECT e.id, e.tenant_id FROM webhook_events e \
               WHERE e.dispatched_at IS NULL \
                 AND (e.tenant_id, e.id) > (w.tenant_id, w.last_id) AND e.tenant_id <= w.tenant_id \
                 AND leader_fence($1, $2) \
               ORDER BY e.tenant_id, e.id \
               LIMIT ($3 - (SELECT count(*) FROM first)) / greatest(1, (SELECT count(*) FROM whole)) \
               FOR UPDATE SKIP LOCKED) x) more), \
         claimed AS (SELECT id, tenant_id, turn FROM first UNION ALL SELECT id, tenant_id, turn FROM fill), \
         fan AS MATERIALIZED ( \
           SELECT t.tenant_id, \
                  (SELECT count(ep.id) FROM webhook_endpoints ep \
                   WHERE ep.tenant_id = t.tenant_id AND ep.enabled) AS endpoints \
           FROM (SELECT DISTINCT tenant_id FROM claimed) t), \
         taken AS ( \
           SELECT id FROM ( \
             SELECT c.id, sum(f.endpoints) OVER (ORDER BY c.turn, f.endpoints, c.id) \
                          - f.endpoints AS before \
             FROM claimed c JOIN fan f ON f.tenant_id = c.tenant_id) w \
           WHERE w.before < $5), \
         stamped AS ( \
           UPDATE webhook_events e SET dispatched_at = now() \
           FROM taken WHERE e.id = taken.id \
           RETURNING e.id, e.tenant_id, e.event_type, e.message_id, \
                     CASE WHEN $8::int8 IS NOT NULL THEN ",
    outbox::webhook_event_time!("e"),
    " END AS event_time, \
                     CASE WHEN $8::int8 IS NOT NULL THEN octet_length(e.payload::text) END AS bytes, \
                     (SELECT x.t FROM (SELECT e.payload::text AS t) x \
                      WHERE $8::int8 IS NOT NULL AND octet_length(x.t) <= 4096) AS payload, \
                     $8::int8 IS NOT NULL \
                       AND NOT EXISTS (SELECT 1 FROM webhook_deliveries d \
                                       WHERE d.event_id = e.id OFFSET 0) AS first), \
         relay AS MATERIALIZED ( \
           SELECT $8::int8 IS NOT NULL AND leader_fence('webhook_delivery', $8) AS leads), \
         pairs AS MATERIALIZED ( \
           SELECT s.tenant_id, s.id AS event_id, ep.id AS endpoint_id, \
                  s.event_type, s.message_id, s.payload, s.event_time, \
                  r.leads AND s.first \
                  AND row_number() OVER w <= $10 AND sum(s.bytes) OVER w <= $11 AS handed, \
                  lag(s.id) OVER w IS DISTINCT FROM s.id AS opens \
           FROM stamped s \
           JOIN webhook_endpoints ep \
             ON ep.tenant_id = s.tenant_id \
            AND ep.enabled \
            AND (cardinality(ep.event_types) = 0 OR s.event_type = ANY (ep.event_types)) \
           CROSS JOIN relay r \
           WINDOW w AS (ORDER BY s.id, ep.id)), \
         ins AS ( \
           INSERT INTO webhook_deliveries (tenant_id, event_id, endpoint_id) \
           SELECT tenant_id, event_id, endpoint_id FROM pairs WHERE NOT handed \
           ORDER BY event_id, endpoint_id \
           ON CONFLICT (event_id, endpoint_id) DO NOTHING \
           RETURNING 1), \
         handoff AS ( \
           INSERT INTO webhook_handoffs (until, tenant_ids, event_ids, endpoint_ids) \
           SELECT now() + make_interval(secs => $9), \
                  array_agg(tenant_id ORDER BY event_id, endpoint_id), \
                  array_agg(event_id ORDER BY event_id, endpoint_id), \
                  array_agg(endpoint_id ORDER BY event_id, endpoint_id) \
           FROM pairs WHERE handed \
           HAVING count(*) > 0 \
           RETURNING id, tenant_ids, event_ids, endpoint_ids), \
         handed AS ( \
           SELECT 'handoff' AS part, h.id AS handoff, \
                  extract(epoch FROM now())::float8 AS handed_at, \
                  h.tenant_ids, h.event_ids, h.endpoint_ids, NULL::int8 AS part_id, \
                  NULL::text AS event_type, NULL::text AS message_id, NULL::text AS payload, \
                  NULL::text AS event_time \
           FROM handoff h \
           UNION ALL \
           SELECT 'event', NULL, NULL, NULL, NULL, NULL, p.event_id, \
                  p.event_type, p.message_id, \
                  coalesce(p.payload, (SELECT ev.payload::text FROM webhook_events ev \
                                       WHERE ev.id = p.event_id)), \
                  p.event_time \
           FROM pairs p WHERE p.handed AND p.opens \
           UNION ALL \
           SELECT 'endpoint', NULL, NULL, NULL, NULL, NULL, hp.endpoint_id, NULL, NULL, NULL, NULL \
           FROM (SELECT DISTINCT endpoint_id FROM pairs WHERE handed) hp), \
         parts AS ( \
           SELECT x.*, ",
    outbox::webhook_claimed_columns!(endpoint "ep"),
    " \
           FROM handed x \
           LEFT JOIN webhook_endpoints ep \
             ON ep.id = CASE WHEN x.part = 'endpoint' THEN x.part_id END), \
         wake AS (SELECT pg_notify($4, '') \
                  WHERE EXISTS (SELECT 1 FROM ins) OR EXISTS (SELECT 1 FROM handoff)) \
         SELECT (SELECT count(*) FROM stamped) AS events, \
                (SELECT count(*) FROM ins) AS inserted, \
                (SELECT count(*) FROM pairs WHERE handed) AS handed_pairs, \
                (SELECT count(*) FROM wake) AS woken, \
                share.tenants, share.last_tenant, parts.* \
         FROM share LEFT JOIN parts ON true"
);

/// The fenced funnel: in one transaction and one statement, claim up to
/// `limit` undispatched events, stamp them dispatched, insert one pending
/// delivery per enabled endpoint of the event's tenant subscribed to its type,
/// and, if any was inserted, wake the `webhook_delivery` role (`pg_notify`,
/// sent at commit; docs/adr/0014).
///
/// Tenants are interleaved (docs/adr/0048): every tenant with undispatched
/// events among the next [`db::TENANTS_PER_CLAIM`] after `cursor` gets its
/// share of the batch, and `cursor` moves on. A statement that claims nothing
/// is followed by the next, until one claims or every tenant was visited
/// ([`db::Walk`]).
///
/// The fan-out is bounded per statement (issue 25, point 4): claimed events
/// are taken turn by turn (each tenant's first, then each one's second, the
/// tenant with fewer enabled endpoints first within a turn) while the
/// endpoints of the events taken before stay under `max_deliveries`; the
/// first event is always taken, so an event is never left behind, and the
/// rest of the claim is left undispatched for the next statement. A tenant
/// with 10,000 endpoints therefore fans out one event a statement instead of
/// a whole batch's 5,000,000 rows in one, and does not keep a small tenant's
/// event out of it.
///
/// One round trip for the statement whatever the batch size, in a transaction
/// that keeps the claim to ordered scans of `webhook_events_undispatched`
/// whatever the statistics say (`Db::begin_index_driven`, docs/adr/0023). The claim proves
/// the fence in its innermost WHERE, so a stale token claims nothing and
/// inserts nothing; rows another transaction holds are skipped, not waited for.
///
/// With an `offer` from the delivery role of this process (docs/adr/0087),
/// the first `offer.room` deliveries (by event and endpoint) whose payloads
/// fit in `offer.bytes` together (docs/adr/0098) are handed to it unwritten
/// (docs/adr/0124) when the statement also proves that role's token
/// (`leader_fence('webhook_delivery', $8)`; a stale one hands none): the
/// statement inserts one `webhook_handoffs` row holding their (tenant, event,
/// endpoint) pairs and its claim lease, and returns what their attempts need
/// in parts (docs/adr/0127): that row (`part` `handoff`: its id and its three
/// arrays), each handed event once (`event`) and each endpoint once
/// (`endpoint`, in the columns the delivery role's claim reads), built into
/// one [`HandedDelivery`] per pair here. The delivery role writes each
/// delivery once, with its first outcome.
///
/// The handed events' columns (type, message id, time, and the payload's
/// JSON text when it is at most 4 KiB) are made once per event by the stamp
/// and carried by its pairs through the statement; a larger payload is read
/// again by key for the event's part, so no pair carries more than 4 KiB of
/// text (docs/adr/0126).
///
/// A [`Offer::bounded`] offer (room found within the fan-out's wait) also
/// bounds the claim: events are taken only while the deliveries before them
/// are under `offer.room`, as `max_deliveries` bounds them, and the rest
/// stay undispatched (docs/adr/0125).
///
/// The handoffs whose lease has ended are not this statement's:
/// [`recover_handoffs`] takes them (docs/adr/0127).
pub(crate) async fn claim_and_fan_out(
    db: &Db,
    fence: &Fence,
    cursor: &TenantCursor,
    limit: usize,
    max_deliveries: usize,
    offer: Option<Offer>,
    statement_timeout: Duration,
) -> Result<(Batch, Handed), Error> {
    let limit = i64::try_from(limit).unwrap_or(i64::MAX);
    let bound = TENANTS_PER_CLAIM.min(limit);
    // With an offer found within the wait for room, events are taken only
    // while the deliveries before them are under its room (the first event
    // always): the rest stay undispatched for a later statement to hand
    // over, instead of being inserted pending (docs/adr/0125).
    let max_deliveries = match offer {
        Some(o) if o.bounded => max_deliveries.min(o.room),
        _ => max_deliveries,
    };
    let max_deliveries = i64::try_from(max_deliveries).unwrap_or(i64::MAX);
    let mut walk = Walk::default();
    let mut batch = Batch::default();
    let mut handed = Handed {
        at: Instant::now(),
        rows: Vec::new(),
    };
    while let Some(after) = walk.next(cursor) {
        let at = Instant::now();
        let mut tx = db.begin_index_driven(statement_timeout).await?;
        let rows = tx
            .fetch_all(
                sql(CLAIM_AND_FAN_OUT)
                    .bind(fence.role_name())
                    .bind(fence.token())
                    .bind(limit)
                    .bind(wake_channel(Role::WebhookDelivery))
                    .bind(max_deliveries)
                    .bind(after)
                    .bind(bound)
                    .bind(offer.map(|o| o.token))
                    .bind(offer.map_or(0.0, |o| o.lease.as_secs_f64()))
                    .bind(offer.map_or(0, |o| i64::try_from(o.room).unwrap_or(i64::MAX)))
                    .bind(offer.map_or(0, |o| i64::try_from(o.bytes).unwrap_or(i64::MAX))),
            )
            .await?;
        // Built before the commit: rows that cannot be read roll the
        // statement back, instead of leaving a handoff nobody holds.
        let delivered = handed_deliveries(&rows)?;
        tx.commit().await?;
        // `share` is one row: the summary, beside each part handed.
        let Some(row) = rows.first() else {
            break;
        };
        let count = |column: &str| -> Result<u64, Error> {
            let n: i64 = row.try_get(column).map_err(db::Error::from)?;
            Ok(u64::try_from(n).unwrap_or(0))
        };
        cursor.advance(
            row.try_get("tenants").map_err(db::Error::from)?,
            bound,
            row.try_get("last_tenant").map_err(db::Error::from)?,
        );
        batch = Batch {
            events: usize::try_from(count("events")?).unwrap_or(usize::MAX),
            deliveries: count("inserted")? + count("handed_pairs")?,
        };
        if batch.events > 0 {
            let rows = delivered
                .into_iter()
                .map(|d| {
                    // Each delivery's size as the offer counts it: its
                    // payload's text.
                    let bytes = d.event.payload.len();
                    (d, bytes)
                })
                .collect();
            handed = Handed { at, rows };
            break;
        }
    }
    Ok((batch, handed))
}

/// The statement of [`recover_handoffs`].
const RECOVER_HANDOFFS: &str = "WITH expired AS ( \
           DELETE FROM webhook_handoffs h \
           WHERE h.until < now() AND leader_fence($1, $2) \
           RETURNING h.tenant_ids, h.event_ids, h.endpoint_ids), \
         lost AS ( \
           SELECT p.tenant_id, p.event_id, p.endpoint_id \
           FROM expired x, unnest(x.tenant_ids, x.event_ids, x.endpoint_ids) \
                AS p(tenant_id, event_id, endpoint_id) \
           WHERE EXISTS (SELECT 1 FROM webhook_events le \
                         WHERE le.id = p.event_id AND le.tenant_id = p.tenant_id) \
             AND EXISTS (SELECT 1 FROM webhook_endpoints lp \
                         WHERE lp.id = p.endpoint_id AND lp.tenant_id = p.tenant_id)), \
         ins AS ( \
           INSERT INTO webhook_deliveries (tenant_id, event_id, endpoint_id, attempts) \
           SELECT tenant_id, event_id, endpoint_id, 1 FROM lost \
           ORDER BY event_id, endpoint_id \
           ON CONFLICT (event_id, endpoint_id) DO NOTHING \
           RETURNING 1), \
         wake AS (SELECT pg_notify($3, '') WHERE EXISTS (SELECT 1 FROM ins)) \
         SELECT (SELECT count(*) FROM ins) AS recovered, \
                (SELECT count(*) FROM wake) AS woken";

/// Take the handoffs whose lease has ended (their process died before
/// writing every pair, or wrote some and failed) and insert their pairs
/// pending at attempt 1, as an expired claim counts it, skipping pairs
/// already written and pairs whose event or endpoint is gone, and wake the
/// delivery role when any was inserted; fenced by this role's token (a stale
/// one takes none). Returns how many deliveries were inserted.
///
/// Its own statement, not a part of every fan-out statement: planning it
/// there cost each fan-out about 0.8 ms for a case that arises only when a
/// process died or failed its writes (docs/adr/0127). The tick runs it
/// about once a second while batches claim, and after every batch that
/// claims nothing.
pub(crate) async fn recover_handoffs(
    db: &Db,
    fence: &Fence,
    statement_timeout: Duration,
) -> Result<u64, db::Error> {
    let mut tx = db.begin_index_driven(statement_timeout).await?;
    let row = tx
        .fetch_one(
            sql(RECOVER_HANDOFFS)
                .bind(fence.role_name())
                .bind(fence.token())
                .bind(wake_channel(Role::WebhookDelivery)),
        )
        .await?;
    tx.commit().await?;
    let n: i64 = row.try_get("recovered")?;
    Ok(u64::try_from(n).unwrap_or(0))
}

/// Deliveries a fan-out claimed for the delivery role (docs/adr/0087), and
/// the instant before its statement was sent (no later than their lease's
/// start).
pub(crate) struct Handed {
    pub at: Instant,
    /// Each delivery with its payload's size in bytes.
    pub rows: Vec<(HandedDelivery, usize)>,
}

/// The deliveries of a fan-out's rows (docs/adr/0127): its `handoff` part
/// holds the pairs, in three arrays, and each handed event and endpoint is
/// one `event` or `endpoint` part, shared by its pairs. Empty when the
/// statement handed nothing (the summary row alone, its `part` null).
fn handed_deliveries(rows: &[PgRow]) -> Result<Vec<HandedDelivery>, Error> {
    let mut handoff = None;
    let mut events = HashMap::new();
    let mut endpoints = HashMap::new();
    for r in rows {
        match part_of(r)? {
            (None, _) => {}
            (Some("handoff"), _) => handoff = Some(HandoffPart::from_row(r)?),
            (Some("event"), Some(id)) => {
                events.insert(id, Arc::new(HandedEvent::from_row(r)?));
            }
            (Some("endpoint"), Some(id)) => {
                endpoints.insert(id, Arc::new(HandedEndpoint::from_row(r)?));
            }
            (Some(part), _) => return Err(Error::Handed(format!("a part named {part:?}"))),
        }
    }
    let Some(h) = handoff else {
        return Ok(Vec::new());
    };
    let handoff_pairs = h.event_ids.len();
    let missing = |what: &str, id: i64| {
        Error::Handed(format!("a delivery handed over without its {what} {id}"))
    };
    h.tenant_ids
        .into_iter()
        .zip(h.event_ids)
        .zip(h.endpoint_ids)
        .map(|((tenant_id, event_id), endpoint_id)| {
            Ok(HandedDelivery {
                tenant_id,
                event_id,
                endpoint_id,
                handoff: h.id,
                handoff_pairs,
                handed_at: h.handed_at,
                event: Arc::clone(
                    events
                        .get(&event_id)
                        .ok_or_else(|| missing("event", event_id))?,
                ),
                endpoint: Arc::clone(
                    endpoints
                        .get(&endpoint_id)
                        .ok_or_else(|| missing("endpoint", endpoint_id))?,
                ),
            })
        })
        .collect()
}

/// A fan-out row's part and the event's or endpoint's id it is for.
fn part_of(r: &PgRow) -> Result<(Option<&str>, Option<i64>), db::Error> {
    Ok((r.try_get("part")?, r.try_get("part_id")?))
}

/// The fan-out's `handoff` part: the `webhook_handoffs` row it inserted,
/// when, and its pairs.
struct HandoffPart {
    id: i64,
    handed_at: f64,
    tenant_ids: Vec<String>,
    event_ids: Vec<i64>,
    endpoint_ids: Vec<i64>,
}

impl HandoffPart {
    fn from_row(r: &PgRow) -> Result<HandoffPart, db::Error> {
        Ok(HandoffPart {
            id: r.try_get("handoff")?,
            handed_at: r.try_get("handed_at")?,
            tenant_ids: r.try_get("tenant_ids")?,
            event_ids: r.try_get("event_ids")?,
            endpoint_ids: r.try_get("endpoint_ids")?,
        })
    }
}
