-- The tenant check of inserted deliveries is planned once per session, not at
-- every insert (issue 29, point 1; docs/adr/0126).
--
-- 0017's check runs its query through EXECUTE, so that each insert plans it
-- for the sizes of that statement and table: 0015 saw a plan that PL/pgSQL
-- kept from a small table scan webhook_events whole for every inserted row.
-- Planning it at every insert was about 0.6 of the 1.3 microseconds a
-- delivery's check cost (250 deliveries a statement, SQL alone:
-- benches/sql/webhook-levers).
--
-- Here the query is static, so PL/pgSQL plans it once and keeps the plan, and
-- the function runs with sequential scans, hash joins and merge joins off:
-- the only plan left reaches each distinct event and endpoint by its key, in
-- a nested loop, whatever the table's size or statistics when it was made.
-- The transition table is read in full either way. Same query, same
-- refusals, same names and SQLSTATE as 0015 and 0017; the search path is
-- 0023's.
CREATE OR REPLACE FUNCTION webhook_deliveries_check_tenants() RETURNS trigger
LANGUAGE plpgsql
SET search_path = pg_catalog, public, pg_temp
SET enable_seqscan = off
SET enable_hashjoin = off
SET enable_mergejoin = off
AS $$
DECLARE
    bad_event boolean;
    bad_endpoint boolean;
BEGIN
    SELECT EXISTS (SELECT 1 FROM (SELECT DISTINCT event_id, tenant_id FROM inserted) n
                   WHERE NOT EXISTS (SELECT 1 FROM webhook_events e
                                     WHERE e.id = n.event_id AND e.tenant_id = n.tenant_id)),
           EXISTS (SELECT 1 FROM (SELECT DISTINCT endpoint_id, tenant_id FROM inserted) n
                   WHERE NOT EXISTS (SELECT 1 FROM webhook_endpoints ep
                                     WHERE ep.id = n.endpoint_id AND ep.tenant_id = n.tenant_id))
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
