-- The fan-out writes its deliveries already claimed; the delivery role reads them by id
-- (with their events and endpoints, as its claim returns them) instead of claiming (see run.sh).
DO $$ DECLARE ids bigint[]; BEGIN FOR i IN 1..4 LOOP
  WITH c AS (SELECT id FROM webhook_events WHERE dispatched_at IS NULL AND tenant_id = 't' ORDER BY id LIMIT 500 FOR UPDATE SKIP LOCKED),
       s AS (UPDATE webhook_events e SET dispatched_at = now() FROM c WHERE e.id = c.id RETURNING e.id, e.tenant_id, e.event_type),
       ins AS (INSERT INTO webhook_deliveries (tenant_id, event_id, endpoint_id, attempts, claimed_until, last_attempt_at)
               SELECT s.tenant_id, s.id, ep.id, 1, now() + interval '30 s', now()
               FROM s JOIN webhook_endpoints ep ON ep.tenant_id = s.tenant_id AND ep.enabled
               ORDER BY s.id, ep.id ON CONFLICT (event_id, endpoint_id) DO NOTHING RETURNING id)
  SELECT array_agg(id ORDER BY id) INTO ids FROM ins;
  COMMIT;
  FOR g IN 0..4 LOOP
    EXECUTE 'SELECT count(*) FROM (SELECT d.id, ep.url, ep.secret_ciphertext, e.event_type, e.message_id, e.payload::text
    FROM unnest($1) AS o(id)
    JOIN webhook_deliveries d ON d.id = o.id AND d.status = ''pending'' AND d.claimed_until > now()
    JOIN webhook_events e ON e.id = d.event_id JOIN webhook_endpoints ep ON ep.id = d.endpoint_id) x' USING ids[g*500+1:g*500+500];
    COMMIT;
  END LOOP;
  FOR g IN 0..9 LOOP
    EXECUTE 'UPDATE webhook_deliveries d SET status = ''delivered'', claimed_until = NULL, delivered_at = now(),
           last_status_code = 200, last_error = NULL, last_latency_ms = 2
    FROM unnest($1) AS o(id)
    WHERE d.id = o.id AND d.attempts = 1 AND d.status = ''pending''' USING ids[g*250+1:g*250+250];
    COMMIT;
  END LOOP;
END LOOP; END $$;
