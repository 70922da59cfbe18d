-- The operator clears a role's cooldown after a fix (issue 25, point 5), as
-- the operator's own login instead of an UPDATE as the owner or the app.
--
-- A lost lease leaves `not_before` up to 60 s ahead, a failed tick up to the
-- failure cooldown and a panicked tick a whole interval ahead (an hour for
-- billing); `leader_unpause` keeps it, on purpose. `leader_clear_cooldown(role)`
-- sets it to NULL, so the role is due at the next poll (unless its interval since
-- the last completed tick has not passed: that is not a cooldown), and returns
-- how much of the cooldown was left (NULL when none held) and whether the role is
-- paused. It touches nothing else: not the holder (a running tick goes on and its
-- RELEASE sets `not_before` as its outcome says), not a pause (a paused role's
-- cooldown is cleared and it stays paused until `leader_unpause`; docs/adr/0037).
--
-- Runs as its owner (SECURITY DEFINER) so hardcount_operator needs no right on
-- leader_leases; its search_path ends in pg_temp as 0023 requires of every
-- definer function (docs/adr/0031). An unknown role is refused with the same
-- message as leader_pause's. Execute: hardcount_operator only.
CREATE FUNCTION leader_clear_cooldown(p_role text)
RETURNS TABLE (cooldown_left interval, paused boolean)
LANGUAGE plpgsql SECURITY DEFINER SET search_path = pg_catalog, public, pg_temp AS $$
BEGIN
    SELECT nullif(greatest(l.not_before - statement_timestamp(), interval '0'), interval '0'),
           l.paused_at IS NOT NULL
    INTO cooldown_left, paused
    FROM leader_leases l WHERE l.role = p_role FOR UPDATE;
    IF NOT FOUND THEN
        RAISE EXCEPTION 'unknown role "%": expected one of billing, dunning, webhook_outbox, email_outbox, webhook_delivery', p_role
            USING ERRCODE = 'invalid_parameter_value';
    END IF;
    UPDATE leader_leases l SET not_before = NULL WHERE l.role = p_role;
    RETURN NEXT;
END
$$;

REVOKE ALL ON FUNCTION leader_clear_cooldown(text) FROM PUBLIC;
GRANT EXECUTE ON FUNCTION leader_clear_cooldown(text) TO hardcount_operator;
