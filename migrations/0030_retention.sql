-- Retention (issue 25, point 2; docs/adr/0040): finished rows older than a
-- configured age are deleted, a bounded batch per statement, by the role that
-- finished them, each statement fenced by leader_fence(role, token) like
-- every claim.
--
--   webhook_delivery  delivered and dead deliveries, with their attempt rows
--   webhook_outbox    dispatched events none of whose deliveries remain
--   email_outbox      sent and failed emails
--   billing           the provider's raw answer kept on a resolved payment
--                     attempt (raw_answer, migration 0019): the only request
--                     or response text the service stores. The attempt row is
--                     money and is never deleted; only the column is cleared.
--   every role        its own lease history (leader_terms, migration 0027)
--
-- Invoices, payment attempts, dunning runs, customers, subscriptions and
-- balances are never pruned: no role gains DELETE on them.
--
-- Each prune walks one index in age order, oldest first, LIMIT n FOR UPDATE
-- SKIP LOCKED, so a batch reads about n index entries and locks only the rows
-- it deletes; a row another transaction holds (a resend through the API) is
-- skipped, not waited for.

-- A finished delivery's age is its next_attempt_at: when its last attempt came
-- due (the outcome that ends a delivery leaves the column as it was; a resend
-- sets it to now and makes the delivery young again). Not last_attempt_at: the
-- claim writes that column and no indexed one, so its update stays HOT
-- (docs/adr/0019); an index on it would cost every claim an index entry.
-- Partial on the finished states: a pending row has no entry, so the claim and
-- the fan-out pay nothing for it; the outcome that finishes a delivery is a
-- non-HOT update already (status leaves the pending indexes).
CREATE INDEX webhook_deliveries_finished ON webhook_deliveries (next_attempt_at, id)
    WHERE status IN ('delivered', 'dead');

-- Dispatched events, oldest stamp first. The dispatched stamp is a non-HOT
-- update already (webhook_events_undispatched's predicate names the column).
CREATE INDEX webhook_events_dispatched ON webhook_events (dispatched_at, id)
    WHERE dispatched_at IS NOT NULL;

-- Sent and failed emails by their last attempt (the claim writes
-- next_attempt_at, an indexed column, so its update is not HOT either way; the
-- partial index gains an entry only when an email is finished).
CREATE INDEX email_outbox_finished ON email_outbox (last_attempt_at, id)
    WHERE status IN ('sent', 'failed');

-- Resolved attempts that still keep a raw answer: few rows (an answer is kept
-- only when it did not parse), so a small index.
CREATE INDEX payment_attempts_raw_answer_kept ON payment_attempts (resolved_at, id)
    WHERE raw_answer IS NOT NULL AND resolved_at IS NOT NULL;

-- A role's own lease history, fenced: the caller proves it holds p_role's
-- lease with p_token, and only p_role's terms are deleted, at most p_limit,
-- oldest first. As leader_terms_prune (0027), a term still held or not yet
-- expired is never deleted. A definer function, so that hardcount_app still
-- reads and deletes nothing of the table itself; leader_terms_prune stays
-- executed by no service role.
CREATE FUNCTION leader_terms_prune_fenced(p_role text, p_token bigint, p_older_than interval,
                                          p_limit integer) RETURNS bigint
LANGUAGE plpgsql SECURITY DEFINER SET search_path = pg_catalog, public, pg_temp AS $$
DECLARE
    n bigint;
BEGIN
    IF p_limit IS NULL OR p_limit < 1 OR p_limit > 10000 THEN
        RAISE EXCEPTION 'leader_terms_prune_fenced: limit % is outside 1 to 10000', p_limit
            USING ERRCODE = 'invalid_parameter_value';
    END IF;
    IF p_older_than IS NULL OR p_older_than < interval '0' THEN
        RAISE EXCEPTION 'leader_terms_prune_fenced: older_than must be a positive interval'
            USING ERRCODE = 'invalid_parameter_value';
    END IF;
    WITH doomed AS (
        SELECT role, token FROM leader_terms
        WHERE role = p_role
          AND acquired_at < statement_timestamp() - p_older_than
          AND LEAST(released_at, expires_at) < statement_timestamp() - p_older_than
          AND leader_fence(p_role, p_token)
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

REVOKE ALL ON FUNCTION leader_terms_prune_fenced(text, bigint, interval, integer) FROM PUBLIC;
GRANT EXECUTE ON FUNCTION leader_terms_prune_fenced(text, bigint, interval, integer) TO hardcount_app;

-- The prunes' rights. Nothing else of the app's gains DELETE.
GRANT DELETE ON webhook_deliveries, webhook_delivery_attempts, webhook_events, email_outbox
    TO hardcount_app;
