-- The operator API's replay across tenants (issue 25, point 5; docs/adr/0042).
--
-- operator_replay_deliveries puts dead deliveries whose last attempt (or, never
-- attempted, creation) was at or after p_since back to pending, due now, their
-- attempts counted afresh, as a tenant's own recover does for one endpoint; for
-- one tenant or every tenant, one endpoint or all, only to enabled endpoints (a
-- disabled one would kill them again at once), at most p_limit a call, oldest
-- first. It returns how many. SECURITY DEFINER: hardcount_operator has no right
-- to write deliveries, only to call this.
CREATE FUNCTION operator_replay_deliveries(
    p_since timestamptz, p_tenant text, p_endpoint bigint, p_limit integer
) RETURNS bigint
LANGUAGE plpgsql SECURITY DEFINER SET search_path = pg_catalog, public, pg_temp AS $$
DECLARE
    n bigint;
BEGIN
    IF p_since IS NULL THEN
        RAISE EXCEPTION 'replaying deliveries needs a time to replay from (since)';
    END IF;
    IF p_limit IS NULL OR p_limit < 1 OR p_limit > 100000 THEN
        RAISE EXCEPTION 'limit % is out of range: 1 to 100000', p_limit;
    END IF;
    WITH picked AS (
        SELECT d.id FROM webhook_deliveries d
        JOIN webhook_endpoints e ON e.id = d.endpoint_id AND e.enabled
        WHERE d.status = 'dead'
          AND coalesce(d.last_attempt_at, d.created_at) >= p_since
          AND (p_tenant IS NULL OR d.tenant_id = p_tenant)
          AND (p_endpoint IS NULL OR d.endpoint_id = p_endpoint)
        ORDER BY d.id
        LIMIT p_limit
        FOR UPDATE OF d SKIP LOCKED
    ), reset AS (
        UPDATE webhook_deliveries d
        SET status = 'pending', next_attempt_at = now(), delivered_at = NULL,
            attempts = d.attempts + 1, resent_at_attempt = d.attempts + 1
        FROM picked WHERE d.id = picked.id AND d.status = 'dead'
        RETURNING 1
    )
    SELECT count(*) INTO n FROM reset;
    RETURN n;
END
$$;
REVOKE EXECUTE ON FUNCTION operator_replay_deliveries(timestamptz, text, bigint, integer) FROM PUBLIC;
GRANT EXECUTE ON FUNCTION operator_replay_deliveries(timestamptz, text, bigint, integer) TO hardcount_operator;
