-- Delivering straight from claimed events (see run.sh).
DO $$ DECLARE ids bigint[]; BEGIN FOR i IN 1..20 LOOP
  WITH c AS (SELECT id FROM webhook_events WHERE dispatched_at IS NULL AND tenant_id = 't'
               AND (claimed_until IS NULL OR claimed_until < now()) ORDER BY id LIMIT 100 FOR UPDATE SKIP LOCKED),
       u AS (UPDATE webhook_events e SET claimed_until = now() + interval '30 s', attempts = e.attempts + 1
             FROM c WHERE e.id = c.id RETURNING e.id)
  SELECT array_agg(id) INTO ids FROM u;
  COMMIT;
  FOR g IN 0..1 LOOP
    WITH s AS (UPDATE webhook_events e SET dispatched_at = now(), claimed_until = NULL
               FROM unnest(ids[g*50+1:g*50+50]) AS o(id) WHERE e.id = o.id RETURNING e.id, e.tenant_id)
    INSERT INTO webhook_deliveries (tenant_id, event_id, endpoint_id, attempts, status, next_attempt_at,
                                    last_attempt_at, last_status_code, last_latency_ms, delivered_at)
    SELECT s.tenant_id, s.id, ep.id, 1, 'delivered', now(), now(), 200, 2, now()
    FROM s JOIN webhook_endpoints ep ON ep.tenant_id = s.tenant_id AND ep.enabled
    ORDER BY s.id, ep.id ON CONFLICT (event_id, endpoint_id) DO NOTHING;
    COMMIT;
  END LOOP;
END LOOP; END $$;
