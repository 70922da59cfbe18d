-- One batch of 500 (the last in id order) through each shape, EXPLAIN ANALYZE inside a
-- rolled-back transaction under the settings the role sets; run.sh sums Execution Time.
-- Shapes: today (as the roles ran them), keyed (-v keyed=1: the batch's ids also bound as
-- the target's condition) and lateral (-v lateral=1: each row of the batch reaches and
-- locks its row in a LATERAL subquery, so the batch drives the loop whatever the planner
-- guesses; the update then joins only the rows locked).
SELECT array_agg(r.id ORDER BY r.id)::text AS runs,
       array_agg(r.attempt_count ORDER BY r.id)::text AS attempts,
       array_agg(r.invoice_id ORDER BY r.id)::text AS invoices,
       array_agg('open'::text ORDER BY r.id)::text AS was
FROM (SELECT * FROM dunning_runs ORDER BY id DESC LIMIT 500) r \gset
\set key_runs ''
\set key_invoices ''
\if :{?keyed}
\set key_runs 'AND r.id = ANY($1::bigint[])'
\set key_invoices 'AND i.id = ANY($1::bigint[])'
\endif
-- dunning's recover (outcomes.rs), in begin_index_driven's settings
BEGIN;
\if :{?lateral}
SET LOCAL enable_bitmapscan = off; SET LOCAL enable_hashjoin = off;
SET LOCAL enable_mergejoin = off; SET LOCAL enable_material = off; SET LOCAL jit = off;
PREPARE recover(bigint[], int4[]) AS
WITH won AS (
  SELECT w.id FROM unnest($1::bigint[], $2::int4[]) AS u(id, attempt)
  CROSS JOIN LATERAL (SELECT r.id FROM dunning_runs r
                      WHERE r.id = u.id AND r.status = 'active' AND r.attempt_count = u.attempt
                      FOR UPDATE) w
)
UPDATE dunning_runs r SET status = 'recovered', ended_at = now(), updated_at = now()
FROM won WHERE r.id = won.id
RETURNING r.id;
\else
SET LOCAL enable_bitmapscan = off; SET LOCAL enable_hashjoin = off;
SET LOCAL enable_mergejoin = off; SET LOCAL enable_material = off; SET LOCAL jit = off;
PREPARE recover(bigint[], int4[]) AS
UPDATE dunning_runs r SET status = 'recovered', ended_at = now(), updated_at = now()
FROM unnest($1::bigint[], $2::int4[]) AS u(id, attempt)
WHERE r.id = u.id AND r.status = 'active' AND r.attempt_count = u.attempt :key_runs
RETURNING r.id;
\endif
EXPLAIN (ANALYZE, COSTS OFF, SUMMARY ON) EXECUTE recover(:'runs', :'attempts');
ROLLBACK;
-- billing's START_RETRIES locking read (retry.rs), with WRITTEN_JOIN_ORDER as well
BEGIN;
SET LOCAL enable_bitmapscan = off; SET LOCAL enable_hashjoin = off;
SET LOCAL enable_mergejoin = off; SET LOCAL enable_material = off; SET LOCAL jit = off;
SELECT set_config('join_collapse_limit', '1', true), set_config('enable_seqscan', 'off', true) \g /dev/null
\if :{?lateral}
PREPARE retry(bigint[], text[]) AS
SELECT p.* FROM unnest($1::bigint[], $2::text[]) AS u(invoice_id, was)
CROSS JOIN LATERAL (
  SELECT i.id, i.tenant_id, i.created_at, i.amount, i.currency, c.provider_customer_id,
         c.payment_method_id,
         (SELECT COALESCE(max(a.attempt_seq), 0) + 1 FROM payment_attempts a
          WHERE a.invoice_id = i.id) AS seq
  FROM invoices i
  JOIN subscriptions s ON s.tenant_id = i.tenant_id AND s.id = i.subscription_id
  JOIN customers c ON c.tenant_id = s.tenant_id AND c.id = s.customer_id
  WHERE i.id = u.invoice_id AND i.status = u.was AND i.collection_method = 'automatic'
    AND (i.auto_charge_claimed_until IS NULL OR i.auto_charge_claimed_until <= now())
    AND s.pause_collection_behavior IS NULL AND c.payment_method_id IS NOT NULL
    AND i.review_since IS NULL
    AND NOT EXISTS (SELECT 1 FROM payment_attempts a WHERE a.invoice_id = i.id
                      AND a.provider_status IN ('unknown', 'processing', 'needs_review'))
  FOR UPDATE OF i SKIP LOCKED) p;
\else
PREPARE retry(bigint[], text[]) AS
SELECT i.id, i.tenant_id, i.created_at, i.amount, i.currency, c.provider_customer_id,
       c.payment_method_id,
       (SELECT COALESCE(max(a.attempt_seq), 0) + 1 FROM payment_attempts a
        WHERE a.invoice_id = i.id) AS seq
FROM unnest($1::bigint[], $2::text[]) AS u(invoice_id, was)
JOIN invoices i ON i.id = u.invoice_id
JOIN subscriptions s ON s.tenant_id = i.tenant_id AND s.id = i.subscription_id
JOIN customers c ON c.tenant_id = s.tenant_id AND c.id = s.customer_id
WHERE i.status = u.was AND i.collection_method = 'automatic'
  AND (i.auto_charge_claimed_until IS NULL OR i.auto_charge_claimed_until <= now())
  AND s.pause_collection_behavior IS NULL AND c.payment_method_id IS NOT NULL
  AND i.review_since IS NULL :key_invoices
  AND NOT EXISTS (SELECT 1 FROM payment_attempts a WHERE a.invoice_id = i.id
                    AND a.provider_status IN ('unknown', 'processing', 'needs_review'))
FOR UPDATE OF i SKIP LOCKED;
\endif
EXPLAIN (ANALYZE, COSTS OFF, SUMMARY ON) EXECUTE retry(:'invoices', :'was');
ROLLBACK;
