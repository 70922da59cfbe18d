-- leader_pause locks the lease row whatever its holder (docs/adr/0146). Its lock
-- was taken only on a row whose committed version had a holder, so a pause that
-- met an ACQUIRE not yet committed locked nothing, read no token, then waited
-- for the ACQUIRE in its UPDATE and paused the role: the new term kept no
-- release in the history, and `hardcount leader history` could later report
-- two replicas leading at once. Locking the row waits for that ACQUIRE and
-- reads its token. Its stamps are the clock once the lock is held, not the
-- start of an operator's open transaction (nor of the statement, which may
-- have begun before the ACQUIRE it waited for), so a term never ends before
-- it began.
CREATE OR REPLACE FUNCTION leader_pause(p_role text, p_by text, p_reason text) RETURNS void
LANGUAGE plpgsql SECURITY DEFINER SET search_path = pg_catalog, public, pg_temp AS $$
DECLARE
    held bigint;
    stamp timestamptz;
BEGIN
    SELECT CASE WHEN holder_id IS NOT NULL THEN holder_token END INTO held
    FROM leader_leases
    WHERE role = p_role
    FOR UPDATE;
    stamp := clock_timestamp();
    UPDATE leader_leases
    SET holder_id = NULL,
        expires_at = NULL,
        paused_at = stamp,
        paused_by = p_by,
        paused_by_role = session_user,
        pause_reason = p_reason
    WHERE role = p_role;
    IF NOT FOUND THEN
        RAISE EXCEPTION 'unknown role "%": expected one of billing, dunning, webhook_outbox, email_outbox, webhook_delivery', p_role
            USING ERRCODE = 'invalid_parameter_value';
    END IF;
    UPDATE leader_terms
    SET released_at = stamp, tick_end = 'paused'
    WHERE role = p_role AND token = held AND released_at IS NULL;
END
$$;
