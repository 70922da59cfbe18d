BEGIN;
EXPLAIN (ANALYZE, BUFFERS, COSTS OFF, SUMMARY ON)
INSERT INTO dunning_policies (tenant_id, name, retry_offsets_secs, final_action, warn_after, final_notice, is_default)
SELECT DISTINCT i.tenant_id, 'Default', '{86400}'::bigint[], 'mark_uncollectible', '{1}'::int[], true, true
FROM invoices i
JOIN LATERAL (SELECT a.provider_status FROM payment_attempts a
              WHERE a.invoice_id = i.id ORDER BY a.attempt_seq DESC LIMIT 1) l ON true
WHERE i.status = 'open' AND i.collection_method = 'automatic'
  AND l.provider_status = 'declined'
  AND NOT EXISTS (SELECT 1 FROM dunning_runs r WHERE r.invoice_id = i.id)
  AND NOT EXISTS (SELECT 1 FROM dunning_policies p WHERE p.tenant_id = i.tenant_id AND p.is_default)
ON CONFLICT (tenant_id) WHERE is_default DO NOTHING;
EXPLAIN (ANALYZE, BUFFERS, COSTS OFF, SUMMARY ON)
INSERT INTO dunning_runs (tenant_id, invoice_id, policy_id, first_declined_at, next_attempt_at)
SELECT i.tenant_id, i.id, p.id, l.declined_at,
       l.declined_at + make_interval(secs => p.retry_offsets_secs[1]::float8)
FROM invoices i
JOIN LATERAL (SELECT a.provider_status, COALESCE(a.resolved_at, a.created_at) AS declined_at
              FROM payment_attempts a
              WHERE a.invoice_id = i.id ORDER BY a.attempt_seq DESC LIMIT 1) l ON true
JOIN dunning_policies p ON p.tenant_id = i.tenant_id AND p.is_default
WHERE i.status = 'open' AND i.collection_method = 'automatic'
  AND l.provider_status = 'declined'
  AND array_ndims(p.retry_offsets_secs) = 1
  AND p.retry_offsets_secs[1] BETWEEN 1 AND 31622400
  AND NOT EXISTS (SELECT 1 FROM dunning_runs r WHERE r.invoice_id = i.id)
ORDER BY i.id
LIMIT 1000
ON CONFLICT (invoice_id) DO NOTHING
RETURNING id;
ROLLBACK;
