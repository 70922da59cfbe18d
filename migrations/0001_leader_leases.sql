-- Leadership as a row per role (ADR-114; docs/adr/0002, 0003).
-- The application role is created here if the cluster does not have it yet.
-- It logs in, owns nothing, and gets only the grants below.
DO $$
BEGIN
    IF NOT EXISTS (SELECT 1 FROM pg_roles WHERE rolname = 'hardcount_app') THEN
        CREATE ROLE hardcount_app LOGIN NOSUPERUSER NOCREATEDB NOCREATEROLE NOINHERIT;
    END IF;
EXCEPTION
    -- Two databases migrated at once on one cluster race to create the role.
    WHEN duplicate_object OR unique_violation THEN NULL;
END
$$;

GRANT USAGE ON SCHEMA public TO hardcount_app;
GRANT SELECT ON _sqlx_migrations TO hardcount_app;

CREATE TABLE leader_leases (
    role               text PRIMARY KEY
        CONSTRAINT leader_leases_role_known
        CHECK (role IN ('billing', 'dunning', 'webhook_outbox', 'email_outbox', 'webhook_delivery')),
    -- Bumped by every ACQUIRE; the fence compares against it.
    holder_token       bigint NOT NULL,
    -- hostname:pid:8hex of the current holder; observability only, never fenced on.
    holder_id          text,
    acquired_at        timestamptz,
    expires_at         timestamptz,
    -- Completed ticks only: an interrupted, lost or panicked tick leaves these alone.
    last_tick_ended_at timestamptz,
    last_tick_holder   text,
    paused_at          timestamptz,
    paused_by          text,
    pause_reason       text,
    -- Cooldown after a lost or panicked tick; leader_unpause leaves it alone.
    not_before         timestamptz,
    CONSTRAINT leader_leases_held_has_expiry
        CHECK ((holder_id IS NULL) = (expires_at IS NULL)),
    CONSTRAINT leader_leases_paused_is_unheld
        CHECK (paused_at IS NULL OR holder_id IS NULL)
);

-- Epoch milliseconds: a rollback and re-apply seeds above any token ever issued,
-- since tokens grow by one per tick and ticks are far rarer than one per millisecond.
INSERT INTO leader_leases (role, holder_token)
SELECT r, (extract(epoch FROM clock_timestamp()) * 1000)::bigint
FROM unnest(ARRAY['billing', 'dunning', 'webhook_outbox', 'email_outbox', 'webhook_delivery']) AS r;

-- True only for the current token of a held, unpaused, unexpired lease. STABLE,
-- so within one statement it sees that statement's snapshot.
CREATE FUNCTION leader_fence(p_role text, p_token bigint) RETURNS boolean
LANGUAGE sql STABLE AS $$
    SELECT EXISTS (
        SELECT 1 FROM leader_leases
        WHERE role = p_role
          AND holder_token = p_token
          AND paused_at IS NULL
          AND expires_at > now()
    )
$$;

-- Nulls the holder and pauses the role in one statement: the fence is false
-- from this commit, the holder's next RENEW finds nothing, ACQUIRE is refused.
CREATE FUNCTION leader_pause(p_role text, p_by text, p_reason text) RETURNS void
LANGUAGE plpgsql AS $$
BEGIN
    UPDATE leader_leases
    SET holder_id = NULL,
        expires_at = NULL,
        paused_at = now(),
        paused_by = p_by,
        pause_reason = p_reason
    WHERE role = p_role;
    IF NOT FOUND THEN
        RAISE EXCEPTION 'unknown role "%": expected one of billing, dunning, webhook_outbox, email_outbox, webhook_delivery', p_role
            USING ERRCODE = 'invalid_parameter_value';
    END IF;
END
$$;

-- Leaves not_before alone: a cooldown set by a lost or panicked tick still holds.
CREATE FUNCTION leader_unpause(p_role text) RETURNS void
LANGUAGE plpgsql AS $$
BEGIN
    UPDATE leader_leases
    SET paused_at = NULL, paused_by = NULL, pause_reason = NULL
    WHERE role = p_role;
    IF NOT FOUND THEN
        RAISE EXCEPTION 'unknown role "%": expected one of billing, dunning, webhook_outbox, email_outbox, webhook_delivery', p_role
            USING ERRCODE = 'invalid_parameter_value';
    END IF;
END
$$;

CREATE VIEW leader_status AS
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
       pause_reason
FROM leader_leases;

GRANT SELECT, UPDATE ON leader_leases TO hardcount_app;
GRANT SELECT ON leader_status TO hardcount_app;
REVOKE ALL ON FUNCTION leader_fence(text, bigint) FROM PUBLIC;
REVOKE ALL ON FUNCTION leader_pause(text, text, text) FROM PUBLIC;
REVOKE ALL ON FUNCTION leader_unpause(text) FROM PUBLIC;
GRANT EXECUTE ON FUNCTION leader_fence(text, bigint) TO hardcount_app;
GRANT EXECUTE ON FUNCTION leader_pause(text, text, text) TO hardcount_app;
GRANT EXECUTE ON FUNCTION leader_unpause(text) TO hardcount_app;
