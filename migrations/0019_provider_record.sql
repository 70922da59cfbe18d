-- A charge's outcome comes from the provider's record (docs/adr/0024).
--
-- An attempt is `unknown` from before its call until the provider's record says
-- what happened. New states:
--   processing    the provider answered with a PaymentIntent that has not settled
--                 (bank debits): polled by id at a backoff, never dunned meanwhile;
--   needs_review  the record cannot be read and the key may be forgotten (past the
--                 resend window), or the answer did not parse, or the provider
--                 refused the key: no one charges the invoice again until an
--                 operator settles it (`hardcount billing settle`);
--   failed        definitely not charged, and not a card decline: the provider
--                 refused the request as invalid (its message kept, the invoice
--                 flagged for review), or an operator settled it as not charged.
ALTER TABLE payment_attempts DROP CONSTRAINT payment_attempts_status_known;
ALTER TABLE payment_attempts ADD CONSTRAINT payment_attempts_status_known
    CHECK (provider_status IN ('succeeded', 'declined', 'unknown', 'processing', 'needs_review', 'failed'));

ALTER TABLE payment_attempts
    -- When the request may first have reached the provider (the database clock):
    -- set when the attempt is written, just before its call; NULL while it is
    -- certain that no request of this key executed (not sent, or refused before
    -- execution with 401/403). Resending the key is allowed only while this is
    -- within the configured resend window (at most 23 h of Stripe's 24 h).
    ADD COLUMN first_sent_at timestamptz,
    -- The reconciler looks at the attempt again only from this instant (a
    -- processing intent's poll backoff, a 429's Retry-After).
    ADD COLUMN next_check_at timestamptz,
    ADD COLUMN lookups integer NOT NULL DEFAULT 0
        CONSTRAINT payment_attempts_lookups_nonnegative CHECK (lookups >= 0),
    -- The first bytes of an answer that did not parse (escaped; secrets redacted).
    ADD COLUMN raw_answer text
        CONSTRAINT payment_attempts_raw_answer_length CHECK (length(raw_answer) <= 1024),
    -- An operator's settlement of a needs-review or failed attempt.
    ADD COLUMN reviewed_at timestamptz,
    ADD COLUMN reviewed_by text,
    ADD COLUMN reviewed_by_role text,
    ADD COLUMN review_note text;

UPDATE payment_attempts SET first_sent_at = created_at;
ALTER TABLE payment_attempts ALTER COLUMN first_sent_at SET DEFAULT now();

-- An invoice flagged for review is charged by no one (auto-charge, the
-- reconciler, dunning) until an operator settles the attempt that flagged it.
ALTER TABLE invoices
    ADD COLUMN review_since timestamptz,
    ADD COLUMN review_reason text;

-- The reconciler's sweep: attempts still open (unknown or processing), least
-- recently checked first.
DROP INDEX payment_attempts_unknown;
CREATE INDEX payment_attempts_open ON payment_attempts (last_checked_at NULLS FIRST, id)
    WHERE provider_status IN ('unknown', 'processing');
CREATE INDEX payment_attempts_needs_review ON payment_attempts (id)
    WHERE provider_status = 'needs_review';

GRANT UPDATE (first_sent_at, next_check_at, lookups, raw_answer) ON payment_attempts TO hardcount_app;
GRANT UPDATE (review_since, review_reason) ON invoices TO hardcount_app;

-- What an operator reads: every attempt waiting for a person, with its invoice.
CREATE VIEW payment_attempts_needing_review AS
SELECT a.id AS attempt_id, a.tenant_id, a.invoice_id, a.attempt_seq, a.provider_status,
       a.amount, a.currency, a.provider_customer_id, a.idempotency_key,
       a.provider_payment_intent, a.first_sent_at, a.last_error, a.raw_answer,
       i.review_since, i.review_reason
FROM payment_attempts a
JOIN invoices i ON i.tenant_id = a.tenant_id AND i.id = a.invoice_id
WHERE a.provider_status = 'needs_review'
   OR (a.provider_status = 'failed' AND a.reviewed_at IS NULL AND i.review_since IS NOT NULL);

-- An operator settles one attempt after checking the provider's dashboard:
-- `paid` (the provider charged it: the invoice paid, `invoice.paid` and
-- `payment.succeeded` announced) or not (`failed`: nothing was charged; the
-- invoice is chargeable again and dunning takes it). Who (the login and the name
-- given) and why are recorded on the attempt.
CREATE FUNCTION billing_settle_attempt(p_attempt bigint, p_paid boolean, p_intent text,
                                       p_by text, p_note text) RETURNS text
LANGUAGE plpgsql SECURITY DEFINER SET search_path = pg_catalog, public, pg_temp AS $$
DECLARE
    a payment_attempts%ROWTYPE;
    inv invoices%ROWTYPE;
BEGIN
    IF coalesce(btrim(p_by), '') = '' OR coalesce(btrim(p_note), '') = '' THEN
        RAISE EXCEPTION 'settling a payment attempt needs who (--by) and why (--reason)'
            USING ERRCODE = 'invalid_parameter_value';
    END IF;
    IF p_intent IS NOT NULL AND p_intent !~ '^pi_[A-Za-z0-9_]+$' THEN
        RAISE EXCEPTION 'payment intent "%" is not a PaymentIntent id (pi_…)', p_intent
            USING ERRCODE = 'invalid_parameter_value';
    END IF;
    SELECT * INTO a FROM payment_attempts WHERE id = p_attempt FOR UPDATE;
    IF NOT FOUND THEN
        RAISE EXCEPTION 'no payment attempt %', p_attempt USING ERRCODE = 'no_data_found';
    END IF;
    SELECT * INTO inv FROM invoices WHERE id = a.invoice_id FOR UPDATE;
    IF NOT (a.provider_status = 'needs_review'
            OR (a.provider_status = 'failed' AND a.reviewed_at IS NULL AND inv.review_since IS NOT NULL)) THEN
        RAISE EXCEPTION 'payment attempt % is %, not waiting for review', p_attempt, a.provider_status
            USING ERRCODE = 'object_not_in_prerequisite_state';
    END IF;
    IF p_paid AND a.provider_status = 'failed' THEN
        RAISE EXCEPTION 'payment attempt % was refused by the provider before it executed; it cannot have charged', p_attempt
            USING ERRCODE = 'object_not_in_prerequisite_state';
    END IF;
    IF p_paid AND inv.status <> 'open' THEN
        RAISE EXCEPTION 'invoice % is %, not open: settle the attempt as not charged, or refund at the provider', inv.id, inv.status
            USING ERRCODE = 'object_not_in_prerequisite_state';
    END IF;
    UPDATE payment_attempts
    SET provider_status = CASE WHEN p_paid THEN 'succeeded' ELSE 'failed' END,
        provider_payment_intent = coalesce(p_intent, provider_payment_intent),
        resolved_at = coalesce(resolved_at, now()),
        reviewed_at = now(), reviewed_by = p_by, reviewed_by_role = session_user,
        review_note = p_note
    WHERE id = a.id;
    UPDATE invoices
    SET review_since = NULL, review_reason = NULL,
        status = CASE WHEN p_paid THEN 'paid' ELSE status END,
        paid_at = CASE WHEN p_paid THEN now() ELSE paid_at END,
        auto_charge_claimed_until = NULL, auto_charge_claimed_by = NULL
    WHERE id = inv.id;
    IF p_paid THEN
        INSERT INTO webhook_events (tenant_id, event_type, payload)
        VALUES (inv.tenant_id, 'invoice.paid', jsonb_build_object(
                    'object', 'invoice', 'id', inv.id, 'subscription', inv.subscription_id,
                    'status', 'paid', 'amount_paid', a.amount, 'currency', a.currency,
                    'payment_intent', coalesce(p_intent, a.provider_payment_intent),
                    'settled_by_operator', true)),
               (inv.tenant_id, 'payment.succeeded', jsonb_build_object(
                    'object', 'payment', 'invoice', inv.id, 'attempt', a.attempt_seq,
                    'amount', a.amount, 'currency', a.currency,
                    'payment_intent', coalesce(p_intent, a.provider_payment_intent),
                    'decline_code', NULL, 'settled_by_operator', true));
        PERFORM pg_notify('hardcount_wake_webhook_outbox', '');
        RETURN 'paid';
    END IF;
    RETURN 'failed';
END
$$;

REVOKE EXECUTE ON FUNCTION billing_settle_attempt(bigint, boolean, text, text, text) FROM PUBLIC;
GRANT EXECUTE ON FUNCTION billing_settle_attempt(bigint, boolean, text, text, text) TO hardcount_operator;
GRANT SELECT ON payment_attempts_needing_review TO hardcount_operator, hardcount_app;
