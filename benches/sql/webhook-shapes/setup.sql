-- The shapes of docs/adr/0052: an event lease and attempt count the from-events shape needs.
\set ON_ERROR_STOP on
INSERT INTO webhook_endpoints (tenant_id, url, secret)
SELECT 't', 'http://127.0.0.1/' || g, 'whsec_MfKQ9r8GKYqrTwjUPD8ILPZIo2LaLaSw' FROM generate_series(1, 5) g;
ALTER TABLE webhook_events ADD COLUMN claimed_until timestamptz, ADD COLUMN attempts integer NOT NULL DEFAULT 0;
