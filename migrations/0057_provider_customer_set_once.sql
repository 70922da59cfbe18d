-- A customer made without its provider customer gets one later through the tenant
-- API (`POST /v1/customers/{id}` with `provider_customer_id`, docs/adr/0149), and
-- keeps it: a charge's attempt records the provider customer it was sent under and
-- the reconciler lists that customer's intents, so a customer moved to another
-- `cus_…` would have its charges looked up, and paid, as another's. The grant is the
-- column's; the trigger refuses any change once it is set, whoever writes it.
GRANT UPDATE (provider_customer_id) ON customers TO hardcount_api;

CREATE FUNCTION customers_provider_customer_set_once() RETURNS trigger
LANGUAGE plpgsql SET search_path = pg_catalog, public, pg_temp AS $$
BEGIN
    IF OLD.provider_customer_id IS NOT NULL
       AND NEW.provider_customer_id IS DISTINCT FROM OLD.provider_customer_id THEN
        RAISE EXCEPTION 'customer % keeps its provider customer %: it is set once',
                        OLD.id, OLD.provider_customer_id
            USING ERRCODE = 'object_not_in_prerequisite_state';
    END IF;
    RETURN NEW;
END
$$;

CREATE TRIGGER customers_provider_customer_set_once
    BEFORE UPDATE OF provider_customer_id ON customers
    FOR EACH ROW EXECUTE FUNCTION customers_provider_customer_set_once();
