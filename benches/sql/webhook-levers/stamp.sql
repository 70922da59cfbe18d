-- The fan-out's dispatched stamp alone: four batches of 500 events, each claimed
-- FOR UPDATE SKIP LOCKED and stamped, one transaction each.
DO $$ BEGIN FOR i IN 1..4 LOOP
  WITH c AS (SELECT id FROM webhook_events WHERE dispatched_at IS NULL AND tenant_id = 't'
             ORDER BY tenant_id, id LIMIT 500 FOR UPDATE SKIP LOCKED)
  UPDATE webhook_events e SET dispatched_at = now() FROM c WHERE e.id = c.id;
  COMMIT; END LOOP; END $$;
