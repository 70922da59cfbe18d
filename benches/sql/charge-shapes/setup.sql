-- The charge shapes of docs/adr/0057: one tenant, :n customers with a saved card,
-- each with one active subscription and one open automatic invoice never attempted,
-- as billing leaves them for auto-charge. `queue` adds what its shape needs: a queue
-- of invoices to charge, and a lease on the attempt row.
\set ON_ERROR_STOP on
INSERT INTO plans (tenant_id, name, amount, currency, interval_unit, interval_count)
VALUES ('t', 'Pro', 1200, 'EUR', 'month', 1);
INSERT INTO customers (tenant_id, email, provider_customer_id, payment_method_id)
SELECT 't', 'c' || g || '@example.org', 'cus_bench_' || g, 'pm_card_visa'
FROM generate_series(1, :n) g;
INSERT INTO subscriptions (tenant_id, customer_id, plan_id, status, billing_anchor,
                           current_period_start, current_period_end, next_billing_at)
SELECT 't', c.id, p.id, 'active', now(), now(), now() + interval '30 days',
       now() + interval '30 days'
FROM customers c, plans p;
INSERT INTO invoices (tenant_id, subscription_id, period_start, period_end, amount, currency,
                      collection_method, status, finalized_at, number)
SELECT 't', id, now() - interval '30 days', now(), 1200, 'EUR', 'automatic', 'open', now(),
       'INV-' || lpad(id::text, 8, '0')
FROM subscriptions ORDER BY id;
ALTER TABLE payment_attempts ADD COLUMN claimed_until timestamptz, ADD COLUMN claimed_by text;
CREATE TABLE charge_queue (invoice_id bigint PRIMARY KEY);
