-- A lease history: one row per term (issue 27, point 1; ARCHITECTURE.md,
-- `crates/leader`).
--
-- A term is one won ACQUIRE: (role, token). The lease statements write it
-- themselves, in the statement that changes the lease row, so the history
-- costs no round trip and cannot disagree with the lease:
--
--   ACQUIRE  inserts the term (a data-modifying CTE on the claim's RETURNING);
--   RENEW    stamps last_renewed_at and the new expires_at;
--   RELEASE  stamps released_at and how the tick ended (tick_end);
--   leader_pause stamps the held term released, tick_end 'paused'.
--
-- A term spans acquired_at .. least(released_at, expires_at): expires_at is
-- what the last ACQUIRE or RENEW of the term set (its statement's clock plus
-- the TTL), so a term nobody released (a lost holder, a refused RELEASE after
-- a takeover) ends where the lease row said it would. acquired_at is the
-- clock after the claim took the row lock (clock_timestamp() in the claim's
-- RETURNING), so it is no earlier than the commit of the RELEASE that freed
-- the row, nor than the expiry the claim's WHERE passed: two terms of a role
-- that overlap in this table overlapped on the server.
--
-- Rights: hardcount_app writes only the columns its three statements write
-- (no DELETE, no reading the history); hardcount_operator reads the
-- leader_history view and nothing of the table. Pruning is
-- leader_terms_prune, executed by no service role yet: the retention work
-- grants it to the role that runs it.
CREATE TABLE leader_terms (
    role            text NOT NULL,
    token           bigint NOT NULL,
    holder_id       text NOT NULL,
    acquired_at     timestamptz NOT NULL,
    -- The expiry the term's last ACQUIRE or RENEW set.
    expires_at      timestamptz NOT NULL,
    -- The statement clock of the term's last RENEW; NULL until one lands.
    last_renewed_at timestamptz,
    released_at     timestamptz,
    -- How the tick ended, as RELEASE says (leader::store::Release::as_str),
    -- or 'paused' when an operator's pause ended the term.
    tick_end        text
        CONSTRAINT leader_terms_tick_end_known
        CHECK (tick_end IN ('completed', 'completed_due_now', 'more_work', 'failed',
                            'interrupted', 'lost', 'panicked', 'paused')),
    PRIMARY KEY (role, token),
    CONSTRAINT leader_terms_released_has_end CHECK ((released_at IS NULL) = (tick_end IS NULL))
);

-- Pruning walks the oldest terms first, a bounded batch at a time.
CREATE INDEX leader_terms_acquired ON leader_terms (acquired_at);

-- The operator's view: each term with its end and state. `ended_at` is the
-- span's end (LEAST ignores a NULL released_at).
CREATE VIEW leader_history AS
SELECT role,
       token,
       holder_id,
       acquired_at,
       last_renewed_at,
       expires_at,
       released_at,
       tick_end,
       LEAST(released_at, expires_at) AS ended_at,
       CASE
           WHEN released_at IS NOT NULL THEN 'released'
           WHEN expires_at > now() THEN 'held'
           ELSE 'expired'
       END AS state
FROM leader_terms;

-- The pause ends the held term as well as the lease: its holder's fence is
-- false from this commit. Otherwise as 0012 wrote it (and 0023's path).
CREATE OR REPLACE FUNCTION leader_pause(p_role text, p_by text, p_reason text) RETURNS void
LANGUAGE plpgsql SECURITY DEFINER SET search_path = pg_catalog, public, pg_temp AS $$
DECLARE
    held bigint;
BEGIN
    SELECT holder_token INTO held FROM leader_leases
    WHERE role = p_role AND holder_id IS NOT NULL
    FOR UPDATE;
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
    UPDATE leader_terms
    SET released_at = now(), tick_end = 'paused'
    WHERE role = p_role AND token = held AND released_at IS NULL;
END
$$;

-- Delete at most p_limit terms that ended before now() - p_older_than, oldest
-- first; returns how many. Bounded so that one call holds few locks and
-- little WAL: the retention work calls it until it returns less than
-- p_limit. A term still held or not yet expired is never deleted.
CREATE FUNCTION leader_terms_prune(p_older_than interval, p_limit integer) RETURNS bigint
LANGUAGE plpgsql SECURITY DEFINER SET search_path = pg_catalog, public, pg_temp AS $$
DECLARE
    n bigint;
BEGIN
    IF p_limit IS NULL OR p_limit < 1 OR p_limit > 10000 THEN
        RAISE EXCEPTION 'leader_terms_prune: limit % is outside 1 to 10000', p_limit
            USING ERRCODE = 'invalid_parameter_value';
    END IF;
    IF p_older_than IS NULL OR p_older_than < interval '0' THEN
        RAISE EXCEPTION 'leader_terms_prune: older_than must be a positive interval'
            USING ERRCODE = 'invalid_parameter_value';
    END IF;
    WITH doomed AS (
        SELECT role, token FROM leader_terms
        WHERE acquired_at < statement_timestamp() - p_older_than
          AND LEAST(released_at, expires_at) < statement_timestamp() - p_older_than
        ORDER BY acquired_at
        LIMIT p_limit
        FOR UPDATE SKIP LOCKED
    )
    DELETE FROM leader_terms t USING doomed d
    WHERE t.role = d.role AND t.token = d.token;
    GET DIAGNOSTICS n = ROW_COUNT;
    RETURN n;
END
$$;

GRANT INSERT (role, token, holder_id, acquired_at, expires_at) ON leader_terms TO hardcount_app;
-- RENEW and RELEASE find their term by key.
GRANT SELECT (role, token) ON leader_terms TO hardcount_app;
GRANT UPDATE (expires_at, last_renewed_at, released_at, tick_end) ON leader_terms TO hardcount_app;
GRANT SELECT ON leader_history TO hardcount_operator;
REVOKE ALL ON FUNCTION leader_terms_prune(interval, integer) FROM PUBLIC;
