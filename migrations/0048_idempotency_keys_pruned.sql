-- Tenant API idempotency keys are deleted once they can no longer be replayed
-- (docs/adr/0117). A key answers its first request's answer for 24 hours
-- (docs/adr/0035) and is reused in place after that, but no statement ever
-- deleted one: every keyed request kept its row, with the whole answer (an
-- event's payload, a customer's email), for ever, past every retention. The
-- billing role's retention now deletes keys older than a day, a batch at a
-- time in created_at order (api_idempotency_keys_created, migration 0024).
-- hardcount_app reads only the columns that choose and name a row.
GRANT SELECT (tenant_id, idempotency_key, created_at), DELETE ON api_idempotency_keys
    TO hardcount_app;
