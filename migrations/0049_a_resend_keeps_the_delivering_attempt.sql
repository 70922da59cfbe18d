-- A resend of a delivered webhook delivery keeps its delivering attempt in the
-- history (docs/adr/0119). That attempt lives only in the delivery row's last_*
-- columns (migration 0024), which the resent delivery's next attempt overwrote,
-- so the record of what was delivered before was lost. The tenant API writes it
-- into webhook_delivery_attempts in the resend's transaction; row-level
-- security (tenant_isolation, migration 0024) holds the insert to the caller's
-- tenant.
GRANT INSERT ON webhook_delivery_attempts TO hardcount_api;
