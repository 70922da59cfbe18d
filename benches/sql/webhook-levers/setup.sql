-- docs/adr/0126: five endpoints of one tenant and 2,000 events of about 200 bytes,
-- in 20 transactions of 100, on a freshly migrated database.
\set ON_ERROR_STOP on
INSERT INTO webhook_endpoints (tenant_id, url, secret)
SELECT 't', 'http://127.0.0.1/' || g, 'whsec_MfKQ9r8GKYqrTwjUPD8ILPZIo2LaLaSw' FROM generate_series(1, 5) g;
DO $$ BEGIN FOR i IN 1..20 LOOP
  INSERT INTO webhook_events (tenant_id, event_type, payload)
  SELECT 't', 'invoice.paid',
         jsonb_build_object('invoice', g, 'amount', 1999, 'currency', 'usd',
                            'customer', 'cus_0123456789abcdef', 'description', repeat('x', 80))
  FROM generate_series(1, 100) g;
  COMMIT; END LOOP; END $$;
CHECKPOINT;
