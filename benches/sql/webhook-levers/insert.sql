-- 10,000 deliveries inserted delivered, 250 a statement and a transaction, in the
-- shape of the outcome insert's INSERT (not its CTEs): with the conflict clause of
-- `lever.insert` ('plain', 'conflict' or 'notexists').
DO $$ DECLARE ep bigint[]; form text := current_setting('lever.insert'); BEGIN
  SELECT array_agg(id ORDER BY id) INTO ep FROM webhook_endpoints;
  FOR i IN 0..39 LOOP
    EXECUTE format(
      'INSERT INTO webhook_deliveries (tenant_id, event_id, endpoint_id, attempts, status,
                                       next_attempt_at, last_attempt_at, delivered_at,
                                       last_status_code, last_error, last_latency_ms)
       SELECT %L, e.id, x.ep, 1, %L, now(), now(), now(), 200, NULL, 3
       FROM (SELECT id FROM webhook_events ORDER BY id OFFSET %s LIMIT 50) e
       CROSS JOIN unnest(%L::int8[]) x(ep) %s ORDER BY e.id, x.ep %s',
      't', 'delivered', i * 50, ep,
      CASE WHEN form = 'notexists'
           THEN 'WHERE NOT EXISTS (SELECT 1 FROM webhook_deliveries d
                                   WHERE d.event_id = e.id AND d.endpoint_id = x.ep)' ELSE '' END,
      CASE WHEN form = 'conflict' THEN 'ON CONFLICT (event_id, endpoint_id) DO NOTHING' ELSE '' END);
    COMMIT;
  END LOOP; END $$;
