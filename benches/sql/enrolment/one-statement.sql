BEGIN;
EXPLAIN (ANALYZE, BUFFERS, COSTS OFF, SUMMARY ON)
WITH candidates AS (
  SELECT i.tenant_id, i.id, l.declined_at
  FROM invoices i
  JOIN LATERAL (SELECT a.provider_status, COALESCE(a.resolved_at, a.created_at) AS declined_at
                FROM payment_attempts a WHERE a.invoice_id = i.id
                ORDER BY a.attempt_seq DESC LIMIT 1) l ON true
  WHERE i.status = 'open' AND i.collection_method = 'automatic'
    AND i.attempt_count > 0
    AND l.provider_status = 'declined'
    AND NOT EXISTS (SELECT 1 FROM dunning_runs r WHERE r.invoice_id = i.id)
    AND NOT EXISTS (SELECT 1 FROM dunning_policies p
                    WHERE p.tenant_id = i.tenant_id AND p.is_default
                      AND NOT (array_ndims(p.retry_offsets_secs) = 1
                               AND p.retry_offsets_secs[1] BETWEEN 1 AND 31622400))
  ORDER BY i.id LIMIT 1000
), created AS (
  INSERT INTO dunning_policies (tenant_id, name, retry_offsets_secs, final_action, warn_after, final_notice, is_default)
  SELECT DISTINCT c.tenant_id, 'Default', '{86400}'::bigint[], 'mark_uncollectible', '{1}'::int[], true, true
  FROM candidates c
  WHERE NOT EXISTS (SELECT 1 FROM dunning_policies p WHERE p.tenant_id = c.tenant_id AND p.is_default)
  ON CONFLICT (tenant_id) WHERE is_default DO NOTHING
  RETURNING id, tenant_id, retry_offsets_secs
), defaults AS (
  SELECT id, tenant_id, retry_offsets_secs FROM created
  UNION ALL
  SELECT p.id, p.tenant_id, p.retry_offsets_secs FROM dunning_policies p
  WHERE p.is_default AND p.tenant_id IN (SELECT tenant_id FROM candidates)
)
INSERT INTO dunning_runs (tenant_id, invoice_id, policy_id, first_declined_at, next_attempt_at)
SELECT c.tenant_id, c.id, d.id, c.declined_at,
       c.declined_at + make_interval(secs => d.retry_offsets_secs[1]::float8)
FROM candidates c JOIN defaults d ON d.tenant_id = c.tenant_id
ORDER BY c.id
ON CONFLICT (invoice_id) DO NOTHING
RETURNING id;
ROLLBACK;
