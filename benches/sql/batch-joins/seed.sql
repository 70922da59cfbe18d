-- The dunning benchmark's state before its tick, never analyzed (benches/sql/batch-joins/run.sh):
-- :n customers of one tenant, each with a subscription, an open automatic invoice whose
-- one attempt was declined an hour ago, and an active run due a minute ago.
SELECT format('ALTER TABLE %I SET (autovacuum_enabled = false)', relname)
FROM pg_stat_user_tables \gexec
INSERT INTO dunning_policies (tenant_id, name, retry_offsets_secs, final_action, warn_after, is_default)
SELECT 'tenant_bench', 'Bench', '{60, 120}', 'pause_collection', '{1}', true;
INSERT INTO plans (tenant_id, name, amount, currency, interval_unit, interval_count)
SELECT 'tenant_bench', 'Pro', 1200, 'EUR', 'month', 1;
INSERT INTO customers (tenant_id, email, provider_customer_id, payment_method_id)
SELECT 'tenant_bench', 'c' || g || '@example.org', 'cus_bench_' || g, 'pm_card_visa'
FROM generate_series(1, :n) g;
INSERT INTO subscriptions (tenant_id, customer_id, plan_id, status, billing_anchor,
                           current_period_start, current_period_end, next_billing_at)
SELECT 'tenant_bench', c.id, p.id, 'active', now(), now(), now() + interval '30 days',
       now() + interval '30 days' FROM customers c, plans p;
INSERT INTO invoices (tenant_id, subscription_id, period_start, period_end, amount, currency,
                      collection_method, attempt_count)
SELECT 'tenant_bench', id, now() - interval '30 days', now(), 1200, 'EUR', 'automatic', 1
FROM subscriptions;
INSERT INTO payment_attempts (tenant_id, invoice_id, attempt_seq, idempotency_key, amount,
                              currency, provider_status, decline_code, resolved_at)
SELECT 'tenant_bench', id, 1, 'k-' || id, 1200, 'EUR', 'declined', 'insufficient_funds',
       now() - interval '1 hour' FROM invoices;
INSERT INTO dunning_runs (tenant_id, invoice_id, policy_id, first_declined_at, next_attempt_at)
SELECT 'tenant_bench', i.id, p.id, now() - interval '1 hour', now() - interval '1 minute'
FROM invoices i, dunning_policies p;
