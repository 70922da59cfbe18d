-- 2,000 events in 20 transactions of 100
DO $$ BEGIN FOR i IN 1..20 LOOP
  INSERT INTO webhook_events (tenant_id, event_type, payload)
  SELECT 't', 'invoice.paid', jsonb_build_object('invoice', g, 'amount', 1999, 'currency', 'usd') FROM generate_series(1, 100) g;
  COMMIT; END LOOP; END $$;
