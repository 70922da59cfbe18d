-- The claims read their batch in index order, whatever the statistics say
-- (issue 13, point 4; docs/adr/0023).
--
-- 1. The delivery claim orders by (next_attempt_at, id). The due index held
-- next_attempt_at alone, and every delivery of one fan-out shares its
-- next_attempt_at (the fan-out transaction's now()), so the claim sorted a
-- whole fan-out's deliveries (2,500 for a batch of 500 events to 5
-- endpoints) to hand out 500 of them. With id in the key the index gives the
-- claim's order itself, and the claim stops after its batch.
CREATE INDEX webhook_deliveries_due_by_id ON webhook_deliveries (next_attempt_at, id)
    WHERE status = 'pending';
DROP INDEX webhook_deliveries_due;
ALTER INDEX webhook_deliveries_due_by_id RENAME TO webhook_deliveries_due;

-- 2. The tenant check of an inserted group of deliveries looks each distinct
-- event and each distinct endpoint up once, in one query, instead of once per
-- delivery in two (a fan-out of 500 events to 5 endpoints: 505 lookups, not
-- 5,000). Same refusals, same names and SQLSTATE as migration 0015.
CREATE OR REPLACE FUNCTION webhook_deliveries_check_tenants() RETURNS trigger
LANGUAGE plpgsql SET search_path = pg_catalog, public AS $$
DECLARE
    bad_event boolean;
    bad_endpoint boolean;
BEGIN
    EXECUTE 'SELECT EXISTS (SELECT 1 FROM (SELECT DISTINCT event_id, tenant_id FROM inserted) n
                            WHERE NOT EXISTS (SELECT 1 FROM webhook_events e
                                              WHERE e.id = n.event_id AND e.tenant_id = n.tenant_id)),
                    EXISTS (SELECT 1 FROM (SELECT DISTINCT endpoint_id, tenant_id FROM inserted) n
                            WHERE NOT EXISTS (SELECT 1 FROM webhook_endpoints ep
                                              WHERE ep.id = n.endpoint_id AND ep.tenant_id = n.tenant_id))'
        INTO bad_event, bad_endpoint;
    IF bad_event THEN
        RAISE EXCEPTION 'webhook delivery refers to no event of its tenant'
            USING ERRCODE = 'foreign_key_violation',
                  CONSTRAINT = 'webhook_deliveries_event_same_tenant',
                  TABLE = 'webhook_deliveries';
    END IF;
    IF bad_endpoint THEN
        RAISE EXCEPTION 'webhook delivery refers to no endpoint of its tenant'
            USING ERRCODE = 'foreign_key_violation',
                  CONSTRAINT = 'webhook_deliveries_endpoint_same_tenant',
                  TABLE = 'webhook_deliveries';
    END IF;
    RETURN NULL;
END $$;
