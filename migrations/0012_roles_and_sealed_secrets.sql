-- A database role per duty, and webhook secrets sealed at rest (issue 12,
-- points 1, 2 and 9; docs/adr/0015, docs/security.md).
--
--   hardcount_app       the role loops: leases, the jobs' own columns. Reads a
--                       webhook secret only as ciphertext; cannot create or
--                       repoint an endpoint, rotate a secret or pause a role.
--   hardcount_api       what tenants write: endpoints (sealed secrets only),
--                       customers, plans, subscriptions; reads their results.
--   hardcount_operator  reads leader_status and calls leader_pause /
--                       leader_unpause; nothing else.
--
-- Roles are cluster-wide while each test creates a database of its own, so
-- each is created only when missing (as migration 0001 does for hardcount_app).
DO $$
DECLARE
    r text;
BEGIN
    FOREACH r IN ARRAY ARRAY['hardcount_api', 'hardcount_operator'] LOOP
        BEGIN
            IF NOT EXISTS (SELECT 1 FROM pg_roles WHERE rolname = r) THEN
                EXECUTE format('CREATE ROLE %I LOGIN NOSUPERUSER NOCREATEDB NOCREATEROLE NOINHERIT', r);
            END IF;
        EXCEPTION
            -- Two databases migrated at once on one cluster race to create the role.
            WHEN duplicate_object OR unique_violation THEN NULL;
        END;
        -- The same floor as hardcount_app's (migration 0004).
        EXECUTE format('ALTER ROLE %I IN DATABASE %I SET idle_in_transaction_session_timeout = %L',
                       r, current_database(), '60s');
    END LOOP;
END
$$;

GRANT USAGE ON SCHEMA public TO hardcount_api, hardcount_operator;
GRANT SELECT ON _sqlx_migrations TO hardcount_api;

-- Point 9: who paused, as the database knows it (session_user: the login, not
-- the function owner), beside the name the caller declares. The functions run
-- as their owner (SECURITY DEFINER, fixed search_path), so the operator needs
-- no right on leader_leases itself.
ALTER TABLE leader_leases ADD COLUMN paused_by_role text;

CREATE OR REPLACE FUNCTION leader_pause(p_role text, p_by text, p_reason text) RETURNS void
LANGUAGE plpgsql SECURITY DEFINER SET search_path = pg_catalog, public AS $$
BEGIN
    UPDATE leader_leases
    SET holder_id = NULL,
        expires_at = NULL,
        paused_at = now(),
        paused_by = p_by,
        paused_by_role = session_user,
        pause_reason = p_reason
    WHERE role = p_role;
    IF NOT FOUND THEN
        RAISE EXCEPTION 'unknown role "%": expected one of billing, dunning, webhook_outbox, email_outbox, webhook_delivery', p_role
            USING ERRCODE = 'invalid_parameter_value';
    END IF;
END
$$;

CREATE OR REPLACE FUNCTION leader_unpause(p_role text) RETURNS void
LANGUAGE plpgsql SECURITY DEFINER SET search_path = pg_catalog, public AS $$
BEGIN
    UPDATE leader_leases
    SET paused_at = NULL, paused_by = NULL, paused_by_role = NULL, pause_reason = NULL
    WHERE role = p_role;
    IF NOT FOUND THEN
        RAISE EXCEPTION 'unknown role "%": expected one of billing, dunning, webhook_outbox, email_outbox, webhook_delivery', p_role
            USING ERRCODE = 'invalid_parameter_value';
    END IF;
END
$$;

CREATE OR REPLACE VIEW leader_status AS
SELECT role,
       CASE
           WHEN paused_at IS NOT NULL THEN 'paused'
           WHEN expires_at > now() THEN 'held'
           WHEN holder_id IS NOT NULL THEN 'expired'
           WHEN not_before > now() THEN 'cooling_down'
           ELSE 'idle'
       END AS state,
       holder_id,
       holder_token,
       acquired_at,
       expires_at,
       last_tick_ended_at,
       last_tick_holder,
       now() - last_tick_ended_at AS last_tick_age,
       not_before,
       paused_at,
       paused_by,
       pause_reason,
       paused_by_role
FROM leader_leases;

-- Pausing is the operator's, no longer the role loops'.
REVOKE EXECUTE ON FUNCTION leader_pause(text, text, text) FROM hardcount_app;
REVOKE EXECUTE ON FUNCTION leader_unpause(text) FROM hardcount_app;
REVOKE UPDATE (paused_at, paused_by, pause_reason) ON leader_leases FROM hardcount_app;
GRANT EXECUTE ON FUNCTION leader_pause(text, text, text) TO hardcount_operator;
GRANT EXECUTE ON FUNCTION leader_unpause(text) TO hardcount_operator;
GRANT SELECT ON leader_status TO hardcount_operator;

-- Point 2: a secret is stored sealed (XChaCha20-Poly1305 under an application
-- key, webhook_delivery::sealed): the 24-byte nonce and the ciphertext with its
-- tag in `*_ciphertext`, the id of the key in `*_key_id`. The clear columns
-- stay only for rows written before this migration, until
-- `hardcount secrets rotate-key` (as the owner) seals them; no role but the
-- owner may read or write them.
ALTER TABLE webhook_endpoints
    ALTER COLUMN secret DROP NOT NULL,
    ADD COLUMN secret_ciphertext bytea
        CONSTRAINT webhook_endpoints_secret_ciphertext_size CHECK (octet_length(secret_ciphertext) BETWEEN 41 AND 512),
    ADD COLUMN secret_key_id text
        CONSTRAINT webhook_endpoints_secret_key_id_shape CHECK (secret_key_id ~ '^[A-Za-z0-9_-]{1,32}$'),
    ADD COLUMN previous_secret_ciphertext bytea
        CONSTRAINT webhook_endpoints_previous_secret_ciphertext_size
        CHECK (octet_length(previous_secret_ciphertext) BETWEEN 41 AND 512),
    ADD COLUMN previous_secret_key_id text
        CONSTRAINT webhook_endpoints_previous_secret_key_id_shape CHECK (previous_secret_key_id ~ '^[A-Za-z0-9_-]{1,32}$'),
    DROP CONSTRAINT webhook_endpoints_previous_secret_has_expiry,
    -- Exactly one form of the current secret: sealed, or (old rows) clear.
    ADD CONSTRAINT webhook_endpoints_secret_one_form CHECK ((secret IS NULL) <> (secret_ciphertext IS NULL)),
    ADD CONSTRAINT webhook_endpoints_secret_sealed_has_key
        CHECK ((secret_ciphertext IS NULL) = (secret_key_id IS NULL)),
    ADD CONSTRAINT webhook_endpoints_previous_secret_sealed_has_key
        CHECK ((previous_secret_ciphertext IS NULL) = (previous_secret_key_id IS NULL)),
    ADD CONSTRAINT webhook_endpoints_previous_secret_one_form
        CHECK (previous_secret IS NULL OR previous_secret_ciphertext IS NULL),
    ADD CONSTRAINT webhook_endpoints_previous_secret_has_expiry
        CHECK ((previous_secret IS NULL AND previous_secret_ciphertext IS NULL) = (previous_secret_expires_at IS NULL));

-- hardcount_app: the delivery claim reads the sealed columns, the fan-out the
-- routing ones; a 410 disables an endpoint. No INSERT, no clear secret, no
-- url/event_types/secret update.
REVOKE SELECT, INSERT, UPDATE ON webhook_endpoints FROM hardcount_app;
GRANT SELECT (id, tenant_id, url, event_types, enabled, disabled_reason, disabled_at, created_at,
              secret_ciphertext, secret_key_id, previous_secret_ciphertext, previous_secret_key_id,
              previous_secret_expires_at)
    ON webhook_endpoints TO hardcount_app;
GRANT UPDATE (enabled, disabled_reason, disabled_at) ON webhook_endpoints TO hardcount_app;

-- hardcount_api: what tenants write. Endpoints are created and rotated sealed
-- only; the clear columns are not theirs.
GRANT SELECT (id, tenant_id, url, event_types, enabled, disabled_reason, disabled_at, created_at,
              secret_ciphertext, secret_key_id, previous_secret_ciphertext, previous_secret_key_id,
              previous_secret_expires_at)
    ON webhook_endpoints TO hardcount_api;
GRANT INSERT (tenant_id, url, event_types, enabled, disabled_reason, disabled_at, secret_ciphertext, secret_key_id)
    ON webhook_endpoints TO hardcount_api;
GRANT UPDATE (url, event_types, enabled, disabled_reason, disabled_at, secret_ciphertext, secret_key_id,
              previous_secret_ciphertext, previous_secret_key_id, previous_secret_expires_at)
    ON webhook_endpoints TO hardcount_api;
GRANT SELECT, INSERT ON customers, plans, subscriptions TO hardcount_api;
GRANT UPDATE (email, name, payment_method_id) ON customers TO hardcount_api;
GRANT UPDATE (name) ON plans TO hardcount_api;
GRANT UPDATE (plan_id, status, trial_end, collection_method, pause_collection_behavior,
              pause_collection_resumes_at, pause_collection_set_by, canceled_at, updated_at)
    ON subscriptions TO hardcount_api;
GRANT SELECT ON invoices, payment_attempts, webhook_events, webhook_deliveries TO hardcount_api;
