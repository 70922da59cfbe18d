-- Today's write shape (see run.sh).
DO $$ BEGIN FOR i IN 1..4 LOOP
  WITH c AS (SELECT id FROM webhook_events WHERE dispatched_at IS NULL AND tenant_id = 't' ORDER BY id LIMIT 500 FOR UPDATE SKIP LOCKED),
       s AS (UPDATE webhook_events e SET dispatched_at = now() FROM c WHERE e.id = c.id RETURNING e.id, e.tenant_id, e.event_type)
  INSERT INTO webhook_deliveries (tenant_id, event_id, endpoint_id)
  SELECT s.tenant_id, s.id, ep.id FROM s JOIN webhook_endpoints ep ON ep.tenant_id = s.tenant_id AND ep.enabled
  ORDER BY s.id, ep.id ON CONFLICT (event_id, endpoint_id) DO NOTHING;
  COMMIT; END LOOP; END $$;
DO $$ DECLARE ids bigint[]; BEGIN FOR i IN 1..20 LOOP
  WITH c AS (SELECT id FROM webhook_deliveries WHERE status = 'pending' AND tenant_id = 't' AND next_attempt_at <= now()
             ORDER BY next_attempt_at, id LIMIT 500 FOR UPDATE SKIP LOCKED),
       u AS (UPDATE webhook_deliveries d SET attempts = d.attempts + 1, claimed_until = now() + interval '30 s', last_attempt_at = now()
             FROM c WHERE d.id = c.id RETURNING d.id)
  SELECT array_agg(id) INTO ids FROM u;
  COMMIT;
  FOR g IN 0..1 LOOP
    UPDATE webhook_deliveries d SET status = 'delivered', claimed_until = NULL, delivered_at = now(),
           last_status_code = 200, last_error = NULL, last_latency_ms = 2
    FROM unnest(ids[g*250+1:g*250+250]) AS o(id)
    WHERE d.id = o.id AND d.attempts = 1 AND d.status = 'pending';
    COMMIT;
  END LOOP;
END LOOP; END $$;
