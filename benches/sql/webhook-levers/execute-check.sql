-- The tenant check as migration 0017 wrote it: its query planned at every insert.
CREATE OR REPLACE FUNCTION webhook_deliveries_check_tenants() RETURNS trigger
LANGUAGE plpgsql SET search_path = pg_catalog, public, pg_temp AS $$
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
    IF bad_event OR bad_endpoint THEN
        RAISE EXCEPTION 'tenant check failed' USING ERRCODE = 'foreign_key_violation';
    END IF;
    RETURN NULL;
END $$;
