-- INSERT_OUTCOMES (crates/webhook_delivery/src/store/unwritten.rs, with endpoint_health!
-- from outcomes.rs, as of 65643ae; keep it in step) as a PL/pgSQL function whose plan is
-- kept for the session and made generic at once. run.sh's fn_auto variant resets
-- plan_cache_mode to auto (custom plans first).
CREATE FUNCTION hc_outcomes(text[], int8[], int8[], int4[], text[], float8[], int4[], text[], int4[], text[], float8[])
RETURNS TABLE (event_id bigint, endpoint_id bigint) LANGUAGE plpgsql
SET plan_cache_mode = force_generic_plan AS $f$
#variable_conflict use_column
BEGIN
  RETURN QUERY WITH o AS MATERIALIZED (
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
   SELECT applied.event_id, applied.endpoint_id FROM applied
;
END $f$;
