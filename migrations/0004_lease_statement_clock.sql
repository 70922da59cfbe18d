-- Lease safety (docs/adr/0008).
--
-- 1. The fence reads the statement's clock. now() is the start of the
--    transaction, so a claim in a transaction begun before the lease expired
--    passed the fence after it expired. statement_timestamp() is the start of
--    the claim statement itself, and like now() it is fixed within that
--    statement, so the function stays STABLE.
CREATE OR REPLACE FUNCTION leader_fence(p_role text, p_token bigint) RETURNS boolean
LANGUAGE sql STABLE AS $$
    SELECT EXISTS (
        SELECT 1 FROM leader_leases
        WHERE role = p_role
          AND holder_token = p_token
          AND paused_at IS NULL
          AND expires_at > statement_timestamp()
    )
$$;

-- 2. Every app transaction ends within a bound when its client stalls. The
--    lease statements set a tight bound themselves (SET LOCAL in
--    db::Db::begin_with_timeout); this is the floor for every other
--    transaction of hardcount_app in this database. It applies to sessions
--    that start after it (through PgBouncer: server connections opened after).
DO $$
BEGIN
    EXECUTE format('ALTER ROLE hardcount_app IN DATABASE %I SET idle_in_transaction_session_timeout = %L',
                   current_database(), '60s');
END
$$;
