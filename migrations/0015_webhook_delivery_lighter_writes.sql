-- Less Postgres work per delivery (issue 13, point 4; docs/adr/0019): fewer
-- index entries per delivery and per event, and the tenant check once per
-- statement instead of twice per row.

-- 1. Two indexes fewer. Each delivery row is inserted by the fan-out and
-- rewritten by its outcome (a non-HOT update: `status` leaves the pending
-- partial indexes), so every index on webhook_deliveries costs an entry at
-- the insert, every non-partial one a second entry at the outcome, and as many
-- dead entries for vacuum. Two of the five served no statement of the service:
--
-- - webhook_deliveries_pending_age (created_at WHERE pending) served only the
--   oldest-pending gauge, read once per delivery tick; the gauge now reads
--   min(created_at) in the same pass as the pending count, through
--   webhook_deliveries_due.
-- - webhook_deliveries_tenant_endpoint (tenant_id, endpoint_id, id) served
--   support queries and the endpoint foreign key's checks on a change of an
--   endpoint's key, which the service never makes (below). A tenant's
--   deliveries are found through its events (webhook_events_tenant_created)
--   and webhook_deliveries_event_endpoint_key (event_id, endpoint_id).
--
-- Left: the primary key, UNIQUE (event_id, endpoint_id) (a replayed fan-out
-- adds nothing), the claim's webhook_deliveries_due, the dead gauge's
-- webhook_deliveries_dead.
DROP INDEX webhook_deliveries_pending_age;
DROP INDEX webhook_deliveries_tenant_endpoint;

-- 2. Tenant consistency checked once per statement (docs/adr/0005 keeps its
-- guarantee: no writer can tie one tenant's event to another tenant's
-- endpoint). The two composite foreign keys ran two row triggers per inserted
-- delivery, each a query and a row lock: measured, about half the fan-out
-- statement's time (29.5 ms against 13.9 ms without them, 16-19 ms with the
-- statement check below, for 500 events x 5 endpoints).
--
-- - An insert is checked after the statement, over its inserted rows at once
--   (a transition table), and refused with the foreign keys' names and
--   SQLSTATE 23503, so callers see what they saw before.
-- - A delivery's tenant, event and endpoint never change: an UPDATE naming
--   them is refused (the service's roles have no grant for it either).
-- - An event or endpoint with deliveries cannot be deleted or moved to
--   another tenant (no service role may delete or change them; this keeps
--   the owner from doing it by mistake).
ALTER TABLE webhook_deliveries
    DROP CONSTRAINT webhook_deliveries_event_same_tenant,
    DROP CONSTRAINT webhook_deliveries_endpoint_same_tenant;

-- UNIQUE (tenant_id, id) on events was only the event foreign key's target
-- (id alone is the primary key): one index entry fewer per enqueue and per
-- dispatched stamp. The endpoints' twin stays; endpoints are rarely written.
ALTER TABLE webhook_events DROP CONSTRAINT webhook_events_tenant_id_key;

-- The checks run through EXECUTE, so each is planned for the sizes of this
-- statement and table: a plan kept by the session (PL/pgSQL keeps them) and
-- made while the table was small scans it whole for every inserted row (seen:
-- 230 ms for 2,500 rows).
CREATE FUNCTION webhook_deliveries_check_tenants() RETURNS trigger
LANGUAGE plpgsql SET search_path = pg_catalog, public AS $$
DECLARE
    bad boolean;
BEGIN
    EXECUTE 'SELECT EXISTS (SELECT 1 FROM inserted n
                            WHERE NOT EXISTS (SELECT 1 FROM webhook_events e
                                              WHERE e.id = n.event_id AND e.tenant_id = n.tenant_id))'
        INTO bad;
    IF bad THEN
        RAISE EXCEPTION 'webhook delivery refers to no event of its tenant'
            USING ERRCODE = 'foreign_key_violation',
                  CONSTRAINT = 'webhook_deliveries_event_same_tenant',
                  TABLE = 'webhook_deliveries';
    END IF;
    EXECUTE 'SELECT EXISTS (SELECT 1 FROM inserted n
                            WHERE NOT EXISTS (SELECT 1 FROM webhook_endpoints ep
                                              WHERE ep.id = n.endpoint_id AND ep.tenant_id = n.tenant_id))'
        INTO bad;
    IF bad THEN
        RAISE EXCEPTION 'webhook delivery refers to no endpoint of its tenant'
            USING ERRCODE = 'foreign_key_violation',
                  CONSTRAINT = 'webhook_deliveries_endpoint_same_tenant',
                  TABLE = 'webhook_deliveries';
    END IF;
    RETURN NULL;
END $$;

CREATE TRIGGER webhook_deliveries_same_tenant
    AFTER INSERT ON webhook_deliveries
    REFERENCING NEW TABLE AS inserted
    FOR EACH STATEMENT EXECUTE FUNCTION webhook_deliveries_check_tenants();

CREATE FUNCTION webhook_deliveries_keep_target() RETURNS trigger
LANGUAGE plpgsql SET search_path = pg_catalog, public AS $$
BEGIN
    IF (NEW.tenant_id, NEW.event_id, NEW.endpoint_id)
       IS DISTINCT FROM (OLD.tenant_id, OLD.event_id, OLD.endpoint_id) THEN
        RAISE EXCEPTION 'a webhook delivery''s tenant, event and endpoint never change'
            USING ERRCODE = 'foreign_key_violation',
                  CONSTRAINT = 'webhook_deliveries_event_same_tenant',
                  TABLE = 'webhook_deliveries';
    END IF;
    RETURN NEW;
END $$;

-- A column list: the claim's and the outcome's updates do not fire it.
CREATE TRIGGER webhook_deliveries_target_fixed
    BEFORE UPDATE OF tenant_id, event_id, endpoint_id ON webhook_deliveries
    FOR EACH ROW EXECUTE FUNCTION webhook_deliveries_keep_target();

CREATE FUNCTION webhook_delivery_referents_kept() RETURNS trigger
LANGUAGE plpgsql SET search_path = pg_catalog, public AS $$
BEGIN
    IF TG_OP = 'UPDATE' AND (NEW.id, NEW.tenant_id) IS NOT DISTINCT FROM (OLD.id, OLD.tenant_id) THEN
        RETURN NEW;
    END IF;
    IF (TG_TABLE_NAME = 'webhook_events'
        AND EXISTS (SELECT 1 FROM webhook_deliveries d WHERE d.event_id = OLD.id))
       OR (TG_TABLE_NAME = 'webhook_endpoints'
        AND EXISTS (SELECT 1 FROM webhook_deliveries d WHERE d.endpoint_id = OLD.id)) THEN
        RAISE EXCEPTION '% % has webhook deliveries: it cannot be deleted or moved to another tenant',
                        TG_TABLE_NAME, OLD.id
            USING ERRCODE = 'foreign_key_violation',
                  CONSTRAINT = CASE TG_TABLE_NAME WHEN 'webhook_events'
                                    THEN 'webhook_deliveries_event_same_tenant'
                                    ELSE 'webhook_deliveries_endpoint_same_tenant' END;
    END IF;
    RETURN CASE TG_OP WHEN 'DELETE' THEN OLD ELSE NEW END;
END $$;

-- Column lists: the dispatched stamp and an endpoint's disabling do not fire them.
CREATE TRIGGER webhook_events_deliveries_kept
    BEFORE DELETE OR UPDATE OF id, tenant_id ON webhook_events
    FOR EACH ROW EXECUTE FUNCTION webhook_delivery_referents_kept();
CREATE TRIGGER webhook_endpoints_deliveries_kept
    BEFORE DELETE OR UPDATE OF id, tenant_id ON webhook_endpoints
    FOR EACH ROW EXECUTE FUNCTION webhook_delivery_referents_kept();
