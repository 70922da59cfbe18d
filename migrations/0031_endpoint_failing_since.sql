-- Endpoints that fail for days are turned off (issue 25, point 3; docs/adr/0041).
--
-- failing_since is when the endpoint's current run of failed attempts began:
-- set by webhook_delivery's outcome statement when a group of outcomes holds
-- only failures for the endpoint and it was not failing, cleared by one that
-- delivered (each a write only when the state changes, so a healthy endpoint's
-- row is not written per delivery). Enabling an endpoint clears it. The role's
-- fenced disabling step turns off an enabled endpoint whose run is older than
-- HARDCOUNT_WEBHOOK_DISABLE_AFTER (5 days by default) and tells its tenant.
ALTER TABLE webhook_endpoints ADD COLUMN failing_since timestamptz;

-- The disabling step's claim: the few enabled endpoints that are failing.
CREATE INDEX webhook_endpoints_failing ON webhook_endpoints (failing_since)
    WHERE enabled AND failing_since IS NOT NULL;

GRANT SELECT (failing_since), UPDATE (failing_since) ON webhook_endpoints TO hardcount_app, hardcount_api;

-- The notice of a turned-off endpoint goes to its tenant's contact.
GRANT SELECT (id, contact_email) ON tenants TO hardcount_app;
