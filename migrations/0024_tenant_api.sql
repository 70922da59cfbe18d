-- The tenant HTTP API (issue 24; docs/adr/0035): tenants and their API keys,
-- idempotency keys, a delivery's attempt history, and row-level security on
-- every tenant table.
--
-- The API connects as hardcount_api and, in each transaction, first calls
-- api_authenticate(hash of the presented key). That function (SECURITY
-- DEFINER: hardcount_api cannot read api_keys) finds the key's tenant and sets
-- it as the transaction-local setting `hardcount.tenant_id`
-- (set_config(..., true): it ends with the transaction, so it is safe on a
-- server connection PgBouncer hands to another client at COMMIT). Every
-- tenant table's policy for hardcount_api compares tenant_id with that
-- setting, so a statement of the API that forgets its tenant filter still
-- reads and writes only the caller's rows; outside an authenticated
-- transaction the setting is NULL and the API role sees nothing.
--
-- The role loops (hardcount_app) and operators (hardcount_operator) work
-- across tenants: their policies pass every row. The schema owner, which
-- owns the tables and the definer functions, is not subject to the policies
-- (no FORCE ROW LEVEL SECURITY).

CREATE TABLE tenants (
    id            text PRIMARY KEY
        CONSTRAINT tenants_id_shape CHECK (id ~ '^[a-z0-9][a-z0-9_-]{0,62}$'),
    name          text NOT NULL CONSTRAINT tenants_name_present CHECK (name <> '' AND length(name) <= 200),
    -- Operational notices (an endpoint turned off) go here.
    contact_email text CONSTRAINT tenants_contact_email_valid CHECK (email_address_valid(contact_email)),
    created_at    timestamptz NOT NULL DEFAULT now()
);

-- A key is `hc_<prefix>_<secret>`: the prefix (8 characters) is stored in
-- clear so an operator can tell keys apart; the whole key only as its SHA-256
-- (the key is 256 random bits, so a fast hash is enough).
CREATE TABLE api_keys (
    id          bigint GENERATED ALWAYS AS IDENTITY PRIMARY KEY,
    tenant_id   text NOT NULL REFERENCES tenants (id),
    prefix      text NOT NULL CONSTRAINT api_keys_prefix_shape CHECK (prefix ~ '^[a-z0-9]{8}$'),
    key_hash    bytea NOT NULL CONSTRAINT api_keys_hash_size CHECK (octet_length(key_hash) = 32),
    name        text NOT NULL DEFAULT '' CONSTRAINT api_keys_name_length CHECK (length(name) <= 200),
    created_at  timestamptz NOT NULL DEFAULT now(),
    revoked_at  timestamptz,
    CONSTRAINT api_keys_prefix_key UNIQUE (prefix),
    CONSTRAINT api_keys_hash_key UNIQUE (key_hash)
);
CREATE INDEX api_keys_tenant ON api_keys (tenant_id, id);

-- The tenant of a live key, set for the rest of the transaction; NULL (and
-- nothing set) for an unknown or revoked key.
CREATE FUNCTION api_authenticate(p_key_hash bytea) RETURNS text
LANGUAGE plpgsql SECURITY DEFINER SET search_path = pg_catalog, public, pg_temp AS $$
DECLARE
    t text;
BEGIN
    SELECT tenant_id INTO t FROM api_keys WHERE key_hash = p_key_hash AND revoked_at IS NULL;
    IF t IS NOT NULL THEN
        PERFORM set_config('hardcount.tenant_id', t, true);
    END IF;
    RETURN t;
END
$$;
REVOKE EXECUTE ON FUNCTION api_authenticate(bytea) FROM PUBLIC;
GRANT EXECUTE ON FUNCTION api_authenticate(bytea) TO hardcount_api;

-- The caller's tenant in an authenticated API transaction, else NULL.
CREATE FUNCTION api_tenant() RETURNS text
LANGUAGE sql STABLE PARALLEL SAFE SET search_path = pg_catalog, public, pg_temp AS $$
    SELECT nullif(current_setting('hardcount.tenant_id', true), '')
$$;
-- Only the API role's policies call it.
REVOKE EXECUTE ON FUNCTION api_tenant() FROM PUBLIC;
GRANT EXECUTE ON FUNCTION api_tenant() TO hardcount_api;

-- A POST's idempotency key, kept 24 hours (Stripe keeps them as long:
-- docs.stripe.com/api/idempotent_requests). The response is stored in the
-- transaction that did the work, so a key is either unused, or bound to one
-- committed result; a concurrent retry waits on the row's index entry and
-- then reads that result.
CREATE TABLE api_idempotency_keys (
    tenant_id       text NOT NULL,
    idempotency_key text NOT NULL
        CONSTRAINT api_idempotency_keys_key_shape CHECK (idempotency_key ~ '^[\x21-\x7e]{1,255}$'),
    request_hash    bytea NOT NULL,
    status          smallint,
    -- The first answer's body as sent, so a replay is byte for byte the same.
    response        text,
    created_at      timestamptz NOT NULL DEFAULT now(),
    PRIMARY KEY (tenant_id, idempotency_key)
);
CREATE INDEX api_idempotency_keys_created ON api_idempotency_keys (created_at);

-- A delivery's attempt history: one row per attempt that did not deliver
-- (a failure, a timeout, a refused answer), written by the outcome statement
-- of webhook_delivery. The delivering attempt is the delivery row's own
-- last_* columns, so a delivery that succeeds at once writes nothing here.
CREATE TABLE webhook_delivery_attempts (
    tenant_id        text NOT NULL,
    delivery_id      bigint NOT NULL,
    attempt          integer NOT NULL,
    attempted_at     timestamptz NOT NULL DEFAULT now(),
    status_code      integer,
    latency_ms       integer,
    error_category   text,
    response_snippet text CONSTRAINT webhook_delivery_attempts_snippet_bounded CHECK (length(response_snippet) <= 1024),
    PRIMARY KEY (delivery_id, attempt)
);

-- Listing an endpoint's deliveries (GET /v1/deliveries?endpoint_id=).
CREATE INDEX webhook_deliveries_endpoint ON webhook_deliveries (endpoint_id, id);

-- Row-level security on every tenant table.
DO $$
DECLARE
    t text;
BEGIN
    FOREACH t IN ARRAY ARRAY[
        'customers', 'plans', 'subscriptions', 'invoices', 'payment_attempts',
        'customer_balances', 'tenant_settings', 'invoice_counters',
        'dunning_policies', 'dunning_runs',
        'webhook_endpoints', 'webhook_events', 'webhook_deliveries', 'webhook_delivery_attempts',
        'email_outbox', 'api_idempotency_keys'
    ] LOOP
        EXECUTE format('ALTER TABLE %I ENABLE ROW LEVEL SECURITY', t);
        EXECUTE format(
            'CREATE POLICY tenant_isolation ON %I TO hardcount_api '
            'USING (tenant_id = api_tenant()) WITH CHECK (tenant_id = api_tenant())', t);
        EXECUTE format(
            'CREATE POLICY service_roles ON %I TO hardcount_app, hardcount_operator '
            'USING (true) WITH CHECK (true)', t);
    END LOOP;
END
$$;

GRANT SELECT, INSERT, UPDATE (status, response) ON api_idempotency_keys TO hardcount_api;
GRANT UPDATE (request_hash, created_at) ON api_idempotency_keys TO hardcount_api;
GRANT SELECT ON webhook_delivery_attempts TO hardcount_api;
GRANT SELECT, INSERT ON webhook_delivery_attempts TO hardcount_app;
-- Publishing an event and queueing an email through the API.
GRANT INSERT ON webhook_events TO hardcount_api;
GRANT SELECT, INSERT ON email_outbox TO hardcount_api;

-- Operators create tenants and keys, list them, and revoke keys
-- (`hardcount tenants create`, `hardcount keys create|list|revoke`).
GRANT SELECT, INSERT ON tenants TO hardcount_operator;
GRANT SELECT, INSERT ON api_keys TO hardcount_operator;
GRANT UPDATE (revoked_at) ON api_keys TO hardcount_operator;
-- tenants_contact_email_valid calls it (0022 revoked it from PUBLIC).
GRANT EXECUTE ON FUNCTION email_address_valid(text) TO hardcount_operator;
