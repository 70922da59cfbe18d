-- 40 groups of 510 outcomes (102 events x 5 endpoints), each group one statement and
-- one transaction, its arrays passed as parameters, under the planner settings of
-- db::Db::begin_index_driven, in which the service sends it. This file runs the statement
-- itself through EXECUTE (planned at every call, as the service's unnamed statements
-- are); its text is INSERT_OUTCOMES as of 65643ae (keep it in step with fn_generic.sql).
SET enable_bitmapscan = off; SET enable_hashjoin = off; SET enable_mergejoin = off;
SET enable_material = off; SET jit = off;
DO $$ DECLARE ep bigint[]; ev bigint[]; BEGIN
  FOR i IN 0..39 LOOP
    SELECT array_agg(e.id ORDER BY e.id, x.ep), array_agg(x.ep ORDER BY e.id, x.ep) INTO ev, ep
      FROM (SELECT id FROM webhook_events ORDER BY id OFFSET i * 102 LIMIT 102) e
      CROSS JOIN (SELECT id AS ep FROM webhook_endpoints) x;
    EXECUTE $q$WITH o AS MATERIALIZED (
     SELECT * FROM unnest($1::text[], $2::int8[], $3::int8[], $4::int4[], $5::text[],
                          $6::float8[], $7::int4[], $8::text[], $9::int4[], $10::text[],
                          $11::float8[])
          AS o(tenant_id, event_id, endpoint_id, attempt, next_state, retry_secs,
               status_code, error, latency_ms, snippet, handed_at)),
   applied AS (
     INSERT INTO webhook_deliveries
         (tenant_id, event_id, endpoint_id, attempts, status, next_attempt_at,
          last_attempt_at, delivered_at, last_status_code, last_error, last_latency_ms)
     SELECT o.tenant_id, o.event_id, o.endpoint_id, o.attempt, o.next_state,
            CASE WHEN o.next_state = 'pending'
                 THEN now() + make_interval(secs => o.retry_secs) ELSE now() END,
            CASE WHEN o.attempt > 0 THEN to_timestamp(o.handed_at) END,
            CASE WHEN o.next_state = 'delivered' THEN now() END,
            o.status_code, o.error, o.latency_ms
     FROM o
     ORDER BY o.event_id, o.endpoint_id
     RETURNING id, tenant_id, event_id, endpoint_id, attempts, status, last_attempt_at),
   history AS (
     INSERT INTO webhook_delivery_attempts
         (tenant_id, delivery_id, attempt, attempted_at, status_code, latency_ms,
          error_category, response_snippet)
     SELECT a.tenant_id, a.id, a.attempts, a.last_attempt_at, o.status_code,
            o.latency_ms, o.error, o.snippet
     FROM applied a JOIN o ON o.event_id = a.event_id AND o.endpoint_id = a.endpoint_id
     WHERE a.attempts > 0 AND a.status <> 'delivered'),
   ends AS (
     SELECT endpoint_id, bool_or(status = 'delivered') AS delivered
     FROM applied WHERE attempts > 0 GROUP BY endpoint_id),
   health AS (
       UPDATE webhook_endpoints e
       SET failing_since = CASE WHEN s.delivered THEN NULL ELSE now() END
       FROM ends s
       WHERE e.id = s.endpoint_id
         AND (e.failing_since IS NULL) = NOT s.delivered)
   SELECT event_id, endpoint_id FROM applied
$q$ USING
      array_fill('t'::text, ARRAY[510]), ev, ep, array_fill(1, ARRAY[510]), array_fill('delivered'::text, ARRAY[510]),
      array_fill(0::float8, ARRAY[510]), array_fill(200, ARRAY[510]), array_fill(NULL::text, ARRAY[510]),
      array_fill(3, ARRAY[510]), array_fill(NULL::text, ARRAY[510]), array_fill(extract(epoch FROM now())::float8, ARRAY[510]);
    COMMIT;
  END LOOP; END $$;
