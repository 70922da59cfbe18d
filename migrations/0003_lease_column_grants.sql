-- Narrow hardcount_app's UPDATE on leader_leases to the columns the four
-- statements write, and let a token only grow (docs/adr/0002): the app cannot
-- rename a role's row or hand out a token at or below one already issued.
REVOKE UPDATE ON leader_leases FROM hardcount_app;
GRANT UPDATE (holder_token, holder_id, acquired_at, expires_at, last_tick_ended_at,
              last_tick_holder, paused_at, paused_by, pause_reason, not_before)
    ON leader_leases TO hardcount_app;

CREATE FUNCTION leader_leases_token_only_grows() RETURNS trigger
LANGUAGE plpgsql AS $$
BEGIN
    IF NEW.holder_token < OLD.holder_token THEN
        RAISE EXCEPTION 'leader_leases.holder_token of role "%" may only grow (% to %)',
            OLD.role, OLD.holder_token, NEW.holder_token
            USING ERRCODE = 'check_violation';
    END IF;
    RETURN NEW;
END
$$;

CREATE TRIGGER leader_leases_token_only_grows
    BEFORE UPDATE OF holder_token ON leader_leases
    FOR EACH ROW EXECUTE FUNCTION leader_leases_token_only_grows();
