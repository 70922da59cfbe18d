-- Hardening (issue 12): bounded inputs and schema hygiene.

-- Point 5: the payload size backstop behind webhook_outbox::enqueue's 256 KiB limit
-- (MAX_PAYLOAD_BYTES). It bounds the payload as Postgres renders it, which is what
-- the delivery claim reads and the worker POSTs: at most 1 MiB, room for jsonb's
-- rendering (a space after each ':' and ','), and a refusal for any insert that
-- bypasses enqueue. NOT VALID: enforced on every new or updated row without
-- scanning (and locking) the existing outbox; the claim's attempt ceiling retires
-- an old oversized row.
ALTER TABLE webhook_events
    ADD CONSTRAINT webhook_events_payload_bounded
    CHECK (octet_length(payload::text) <= 1048576) NOT VALID;

-- Point 9: schema hygiene.

-- No one but the owner creates objects in public (Postgres 15 already defaults to
-- this for new databases; a cluster upgraded from 14 or older does not).
REVOKE CREATE ON SCHEMA public FROM PUBLIC;

-- A token past this ceiling is refused: tokens are at least the epoch
-- milliseconds of the statement clock (migration 0004) and only grow, so one set
-- near the top of bigint (by hand, or a restore from a machine whose clock ran
-- far ahead) would make every later ACQUIRE's `holder_token + 1` overflow and
-- wedge the role for good. The ceiling is one year of milliseconds ahead of the
-- clock, far past any real acquire rate.
CREATE FUNCTION leader_leases_token_bounded() RETURNS trigger
LANGUAGE plpgsql AS $$
BEGIN
    IF NEW.holder_token > (extract(epoch FROM clock_timestamp()) * 1000)::bigint + 31536000000 THEN
        RAISE EXCEPTION 'leader_leases.holder_token of role "%" is past the ceiling (one year of milliseconds ahead of the clock): %',
            NEW.role, NEW.holder_token
            USING ERRCODE = 'check_violation';
    END IF;
    RETURN NEW;
END
$$;

CREATE TRIGGER leader_leases_token_bounded
    BEFORE INSERT OR UPDATE OF holder_token ON leader_leases
    FOR EACH ROW EXECUTE FUNCTION leader_leases_token_bounded();

-- What `hardcount leader pause` records is bounded (the CLI refuses longer input
-- first, naming --reason and --by).
ALTER TABLE leader_leases
    ADD CONSTRAINT leader_leases_pause_reason_bounded CHECK (char_length(pause_reason) <= 500) NOT VALID,
    ADD CONSTRAINT leader_leases_paused_by_bounded CHECK (char_length(paused_by) <= 200) NOT VALID;

-- Every function resolves names in a fixed path, so an object planted earlier in
-- a caller's search_path cannot stand in for a table or operator they use.
ALTER FUNCTION leader_fence(text, bigint) SET search_path = pg_catalog, public;
ALTER FUNCTION leader_pause(text, text, text) SET search_path = pg_catalog, public;
ALTER FUNCTION leader_unpause(text) SET search_path = pg_catalog, public;
ALTER FUNCTION leader_leases_token_only_grows() SET search_path = pg_catalog, public;
ALTER FUNCTION leader_leases_token_bounded() SET search_path = pg_catalog, public;
