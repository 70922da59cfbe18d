-- One charge pays one invoice, as a constraint (docs/adr/0122, amends 0120).
-- Migrations 0050 and 0051 check it twice, each before writing: an operator's
-- paid settle looks for another attempt carrying the intent, and the reconciler
-- looks for an operator-settled attempt carrying the intent it found paid.
-- Each reads before the other commits, so a settle and a reconciler write of
-- the same intent in the same moment both passed. A unique index over the
-- intents of succeeded attempts makes the second writer wait for the first and
-- fail: billing's settle of that row fails (its attempt stays open, and the
-- next look sends it to review), and the operator's settle is refused with
-- 0050's words. Every succeeded charge writes one entry into it. The
-- reconciler's look (OPERATOR_SETTLED) reads through it, at most one attempt
-- per intent, so 0051's index of operator-settled attempts goes.
--
-- An existing pair of succeeded attempts with one intent (paid twice before
-- 0050, or by a fake provider before it numbered its intents per run) stops
-- the migration, naming how many intents and the first one's attempts; ADR
-- 0122 says how a person decides which invoice the charge paid. The table is
-- locked against writes first, so none slips in between the check and the
-- index. The index is built without CONCURRENTLY (a transaction forbids it):
-- it reads payment_attempts once, and the DROP INDEX after it holds every
-- read and write of the table until the migration commits.
--
-- The function is 0050's with its attempt write caught for that refusal; the
-- owner, SECURITY DEFINER, the search path and the grants stay.

LOCK TABLE payment_attempts IN SHARE MODE;

DO $$
DECLARE
    d record;
BEGIN
    SELECT count(*) OVER () AS intents, provider_payment_intent AS intent,
           array_agg(id ORDER BY id) AS attempts
    INTO d
    FROM payment_attempts
    WHERE provider_status = 'succeeded' AND provider_payment_intent IS NOT NULL
    GROUP BY provider_payment_intent
    HAVING count(*) > 1
    ORDER BY provider_payment_intent
    LIMIT 1;
    IF FOUND THEN
        RAISE EXCEPTION '% payment intent(s) are recorded paid for more than one payment attempt, the first % for attempts %: one charge pays one invoice; decide which invoice each paid before this migration (docs/adr/0122, "Existing duplicates")', d.intents, d.intent, d.attempts
            USING ERRCODE = 'unique_violation';
    END IF;
END
$$;

CREATE UNIQUE INDEX payment_attempts_one_paid_intent ON payment_attempts (provider_payment_intent)
    WHERE provider_status = 'succeeded' AND provider_payment_intent IS NOT NULL;
DROP INDEX payment_attempts_operator_intent;

CREATE OR REPLACE FUNCTION billing_settle_attempt(p_attempt bigint, p_paid boolean, p_intent text,
                                       p_by text, p_note text) RETURNS text
LANGUAGE plpgsql SECURITY DEFINER SET search_path = pg_catalog, public, pg_temp AS $$
DECLARE
    a payment_attempts%ROWTYPE;
    inv invoices%ROWTYPE;
    other payment_attempts%ROWTYPE;
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
    -- The intent an attempt already carries is the one its key made: another
    -- named in its place is a slip (a search by customer and amount finding a
    -- sibling's charge).
    IF p_intent IS NOT NULL AND a.provider_payment_intent IS NOT NULL
       AND p_intent <> a.provider_payment_intent THEN
        RAISE EXCEPTION 'payment attempt % carries payment intent %, not %: settle it with its own', p_attempt, a.provider_payment_intent, p_intent
            USING ERRCODE = 'invalid_parameter_value';
    END IF;
    -- One charge pays one invoice. The lock orders two operators settling
    -- with the same intent, so the second sees the first's write.
    IF p_paid AND coalesce(p_intent, a.provider_payment_intent) IS NOT NULL THEN
        PERFORM pg_advisory_xact_lock(hashtext('billing_settle_attempt:' || coalesce(p_intent, a.provider_payment_intent)));
        -- Another invoice's attempt holds the intent in any state: an intent
        -- belongs to the key that made it, and one still unknown or waiting
        -- for review may yet be found paid. Of this invoice's own attempts,
        -- only one that may have charged (not declined, not failed) holds it.
        SELECT * INTO other FROM payment_attempts o
        WHERE o.provider_payment_intent = coalesce(p_intent, a.provider_payment_intent)
          AND o.id <> a.id
          AND (o.invoice_id <> a.invoice_id OR o.provider_status NOT IN ('declined', 'failed'))
        ORDER BY o.id
        LIMIT 1;
        IF FOUND THEN
            RAISE EXCEPTION 'payment intent % belongs to payment attempt % (invoice %, %): one charge pays one invoice; find this attempt''s own intent (its key: %)', coalesce(p_intent, a.provider_payment_intent), other.id, other.invoice_id, other.provider_status, a.idempotency_key
                USING ERRCODE = 'object_not_in_prerequisite_state';
        END IF;
    END IF;
    IF p_paid AND inv.status <> 'open' THEN
        RAISE EXCEPTION 'invoice % is %, not open: settle the attempt as not charged, or refund at the provider', inv.id, inv.status
            USING ERRCODE = 'object_not_in_prerequisite_state';
    END IF;
    BEGIN
        UPDATE payment_attempts
        SET provider_status = CASE WHEN p_paid THEN 'succeeded' ELSE 'failed' END,
            provider_payment_intent = coalesce(p_intent, provider_payment_intent),
            resolved_at = coalesce(resolved_at, now()),
            reviewed_at = now(), reviewed_by = p_by, reviewed_by_role = session_user,
            review_note = p_note
        WHERE id = a.id;
    EXCEPTION WHEN unique_violation THEN
        -- Billing recorded the intent paid for another attempt while this
        -- settle ran (the check above read before billing committed).
        RAISE EXCEPTION 'payment intent % was just recorded paid for another payment attempt: one charge pays one invoice; find this attempt''s own intent (its key: %)', coalesce(p_intent, a.provider_payment_intent), a.idempotency_key
            USING ERRCODE = 'object_not_in_prerequisite_state';
    END;
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
