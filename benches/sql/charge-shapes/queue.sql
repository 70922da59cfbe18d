-- The queue shape (docs/adr/0057): the claim takes the batch off `charge_queue` (a locked
-- delete) and writes each attempt with the lease on it; the invoice is not written until
-- the settle, which proves the attempt's lease, marks the attempt succeeded and the
-- invoice paid and counted (its one version); then the same two events
-- and email. PL/pgSQL carries the batch between statements, as the service's memory
-- does, and EXECUTEs each, so that it is planned at every call as the service's
-- unnamed statements are; no HTTP, no round trips.
\set ON_ERROR_STOP on
SET enable_bitmapscan = off; SET enable_hashjoin = off; SET enable_mergejoin = off;
SET enable_material = off; SET jit = off;
-- The claim and the settle commit as the service's transactions do; without waiting
-- for the WAL flush, so that the wall time is about the backend's CPU.
SET synchronous_commit = off;
DO $$
DECLARE ids bigint[]; aids bigint[]; tenants text[]; n bigint;
BEGIN
  LOOP
    EXECUTE $q$
    WITH picked AS (
      SELECT i.id, i.tenant_id, i.created_at, i.amount, i.currency,
             c.provider_customer_id, c.payment_method_id
      FROM charge_queue q
      JOIN invoices i ON i.id = q.invoice_id
      JOIN subscriptions s ON s.tenant_id = i.tenant_id AND s.id = i.subscription_id
      JOIN customers c ON c.tenant_id = s.tenant_id AND c.id = s.customer_id
      WHERE i.status = 'open' AND i.collection_method = 'automatic'
        AND s.pause_collection_behavior IS NULL AND c.payment_method_id IS NOT NULL
      ORDER BY q.invoice_id LIMIT 256 FOR UPDATE OF q SKIP LOCKED
    ), gone AS (
      DELETE FROM charge_queue q USING picked p WHERE q.invoice_id = p.id
      RETURNING q.invoice_id
    ), started AS (
      INSERT INTO payment_attempts (tenant_id, invoice_id, attempt_seq, idempotency_key,
                                    amount, currency, provider_customer_id, payment_method_id,
                                    claimed_until, claimed_by)
      SELECT p.tenant_id, p.id, 1,
             'hc:bench:invoice:' || p.id || ':'
               || (extract(epoch FROM p.created_at) * 1000000)::bigint || ':attempt:1',
             p.amount, p.currency, p.provider_customer_id, p.payment_method_id,
             now() + interval '300 seconds', 'h'
      FROM picked p JOIN gone g ON g.invoice_id = p.id ON CONFLICT DO NOTHING
      RETURNING id, invoice_id, tenant_id
    )
    SELECT array_agg(invoice_id ORDER BY invoice_id), array_agg(id ORDER BY invoice_id),
           array_agg(tenant_id ORDER BY invoice_id) FROM started
    $q$ INTO ids, aids, tenants;
    EXIT WHEN ids IS NULL;
    COMMIT;
    EXECUTE $q$
    WITH u AS (SELECT * FROM unnest($1, $2) AS u(invoice_id, attempt_id)),
    att AS (
      UPDATE payment_attempts a SET provider_status = 'succeeded',
             provider_payment_intent = 'pi_' || u.invoice_id,
             raw_answer = '{"id":"pi_' || u.invoice_id || '","status":"succeeded"}',
             resolved_at = now(), last_checked_at = now(), lookups = a.lookups + 1,
             claimed_until = NULL, claimed_by = NULL
      FROM u WHERE a.id = u.attempt_id AND a.provider_status = 'unknown'
        AND a.claimed_by = 'h' AND a.claimed_until > now()
      RETURNING a.invoice_id
    )
    UPDATE invoices i SET status = 'paid', paid_at = now(), attempt_count = i.attempt_count + 1
    FROM att WHERE i.id = att.invoice_id AND i.status = 'open'
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
