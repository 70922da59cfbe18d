-- A provider customer belongs to one tenant (docs/adr/0103). Every tenant
-- charges through the deployment's one provider account, and the key below
-- was per tenant: a tenant that learned another tenant's `cus_…` and `pm_…`
-- could save them on a customer of its own and have its invoices charged to
-- that card. Rows already shared stop the migration with their ids, for an
-- operator to settle; nothing is changed for them.
DO $$
DECLARE
    shared text;
BEGIN
    SELECT string_agg(provider_customer_id, ', ' ORDER BY provider_customer_id) INTO shared
    FROM (SELECT provider_customer_id FROM customers
          WHERE provider_customer_id IS NOT NULL
          GROUP BY provider_customer_id
          HAVING count(DISTINCT tenant_id) > 1) d;
    IF shared IS NOT NULL THEN
        RAISE EXCEPTION 'customers of more than one tenant share a provider_customer_id: %', shared
            USING HINT = 'keep each on the tenant whose provider customer it is (SELECT tenant_id, id, '
                         'provider_customer_id FROM customers WHERE provider_customer_id IN (...)), '
                         'clear it on the others, then run the migration again';
    END IF;
END $$;

CREATE UNIQUE INDEX customers_provider_customer_of_one_tenant ON customers (provider_customer_id);
