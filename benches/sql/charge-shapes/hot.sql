-- The hot shape: today's writes, but the claim's invoice version touches no indexed
-- column (the lease's index and the never-attempted index are dropped, the count moves
-- to the settle), so on a table with free room in its pages it is a HOT update with no
-- index entry. The walk goes on from its last batch by id, as the service's does
-- (docs/adr/0064), since claimed invoices stay in the open invoices' index. PL/pgSQL carries the batch between statements,
-- as the service's memory does, and EXECUTEs each, so that it is planned at every call
-- as the service's unnamed statements are; no HTTP, no round trips.
\set ON_ERROR_STOP on
SET enable_bitmapscan = off; SET enable_hashjoin = off; SET enable_mergejoin = off;
SET enable_material = off; SET jit = off;
-- The claim and the settle commit as the service's transactions do; without waiting
-- for the WAL flush, so that the wall time is about the backend's CPU.
SET synchronous_commit = off;
DO $$
DECLARE last bigint := 0; ids bigint[]; aids bigint[]; tenants text[]; n bigint;
BEGIN
  LOOP
    EXECUTE $q$
    WITH picked AS (
      SELECT i.id, i.tenant_id, i.created_at, i.amount, i.currency,
             c.provider_customer_id, c.payment_method_id
      FROM invoices i
      JOIN subscriptions s ON s.tenant_id = i.tenant_id AND s.id = i.subscription_id
      JOIN customers c ON c.tenant_id = s.tenant_id AND c.id = s.customer_id
      WHERE i.status = 'open' AND i.collection_method = 'automatic'
        AND (i.auto_charge_claimed_until IS NULL OR i.auto_charge_claimed_until <= now())
        AND s.pause_collection_behavior IS NULL AND c.payment_method_id IS NOT NULL
        AND i.id > $1
        AND NOT EXISTS (SELECT 1 FROM payment_attempts a WHERE a.invoice_id = i.id)
      ORDER BY i.id LIMIT 256 FOR UPDATE OF i SKIP LOCKED
    ), started AS (
      INSERT INTO payment_attempts (tenant_id, invoice_id, attempt_seq, idempotency_key,
                                    amount, currency, provider_customer_id, payment_method_id)
      SELECT p.tenant_id, p.id, 1,
             'hc:bench:invoice:' || p.id || ':'
               || (extract(epoch FROM p.created_at) * 1000000)::bigint || ':attempt:1',
             p.amount, p.currency, p.provider_customer_id, p.payment_method_id
      FROM picked p ON CONFLICT DO NOTHING
      RETURNING id, invoice_id
    ), claimed AS (
      UPDATE invoices i SET auto_charge_claimed_until = now() + interval '300 seconds',
             auto_charge_claimed_by = 'h'
      FROM started WHERE i.id = started.invoice_id
      RETURNING i.id, i.tenant_id, started.id AS attempt_id
    )
    SELECT array_agg(id ORDER BY id), array_agg(attempt_id ORDER BY id),
           array_agg(tenant_id ORDER BY id) FROM claimed
    $q$ INTO ids, aids, tenants USING last;
    EXIT WHEN ids IS NULL;
    last := ids[array_upper(ids, 1)];
    COMMIT;
    EXECUTE $q$
    WITH u AS (SELECT * FROM unnest($1, $2) AS u(invoice_id, attempt_id)),
    inv AS (
      UPDATE invoices i SET status = 'paid', paid_at = now(),
             auto_charge_claimed_until = NULL, auto_charge_claimed_by = NULL,
             attempt_count = i.attempt_count + 1
      FROM u WHERE i.id = u.invoice_id AND i.status = 'open'
        AND i.auto_charge_claimed_by = 'h'
        AND coalesce(i.auto_charge_claimed_until, '-infinity') > now()
      RETURNING i.id, u.attempt_id
    )
    UPDATE payment_attempts a SET provider_status = 'succeeded',
           provider_payment_intent = 'pi_' || v.id, raw_answer = '{"id":"pi_' || v.id || '","status":"succeeded"}',
           resolved_at = now(), last_checked_at = now(), lookups = a.lookups + 1
    FROM inv v WHERE a.id = v.attempt_id AND a.provider_status = 'unknown'
    $q$ USING ids, aids, tenants;
    EXECUTE $q$
    WITH ev AS (
      INSERT INTO webhook_events (tenant_id, event_type, payload)
      SELECT x.t, e.e, jsonb_build_object('object', 'event', 'type', e.e, 'invoice', x.i,
                                          'amount', 1200, 'currency', 'eur',
                                          'payment_intent', 'pi_' || x.i, 'customer', 'cus_x')
      FROM unnest($1, $3) AS x(i, t),
           unnest(ARRAY['invoice.paid', 'payment.succeeded']) AS e(e)
      RETURNING id)
    SELECT count(*) FROM ev
    $q$ INTO n USING ids, aids, tenants;
    EXECUTE $q$
    WITH em AS (
      INSERT INTO email_outbox (tenant_id, message_id, sender, recipients, subject, text_body,
                                html_body)
      SELECT x.t, '<' || gen_random_uuid() || '@hardcount.example>', 'billing@example.org',
             ARRAY['c' || x.i || '@example.org'], 'Receipt for invoice INV-' || x.i,
             repeat('Thank you for your payment. ', 20),
             repeat('<p>Thank you for your payment.</p>', 30)
      FROM unnest($1, $3) AS x(i, t)
      RETURNING id)
    SELECT count(*) FROM em
    $q$ INTO n USING ids, aids, tenants;
    COMMIT;
  END LOOP;
END $$;
