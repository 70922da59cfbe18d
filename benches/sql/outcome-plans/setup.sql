-- One tenant's five endpoints and 4,096 events of about 170 bytes, analyzed.
INSERT INTO webhook_endpoints (tenant_id, url, secret)
SELECT 't', 'http://127.0.0.1:9/' || g, 'whsec_MfKQ9r8GKYqrTwjUPD8ILPZIo2LaLaSw' FROM generate_series(1, 5) g;
INSERT INTO webhook_events (tenant_id, event_type, payload)
SELECT 't', 'invoice.paid', jsonb_build_object('n', g, 'pad', repeat('x', 150)) FROM generate_series(1, 4096) g;
ANALYZE;
