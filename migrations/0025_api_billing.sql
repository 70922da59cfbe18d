-- The tenant API's billing and dunning routes (issue 24): what the API role
-- needs to run billing's own producers in the request's transaction (a plan
-- change and a cancel close the current period through the closing's
-- compare-and-set, write the invoice, its number and the balance, and queue
-- their events and receipts there), and to read and write the tenant's
-- dunning policy and read its runs. Row-level security (0024) keeps each of
-- these to the caller's tenant.

-- The closing's compare-and-set moves the period and the watermark.
GRANT UPDATE (current_period_start, current_period_end, next_billing_at) ON subscriptions TO hardcount_api;
-- The used part of a period, invoiced at a plan change or a cancel.
GRANT INSERT ON invoices TO hardcount_api;
-- Gap-free invoice numbers (INSERT … ON CONFLICT DO UPDATE reads the row).
GRANT SELECT, INSERT ON invoice_counters TO hardcount_api;
GRANT UPDATE (last_number) ON invoice_counters TO hardcount_api;
-- A tiny invoice carried to the customer's balance, or a balance taken in.
GRANT INSERT ON customer_balances TO hardcount_api;
GRANT UPDATE (amount, updated_at) ON customer_balances TO hardcount_api;
-- The tenant's dunning policy: a new default row replaces the old one
-- (runs in flight keep the policy they started with), and its runs.
GRANT SELECT, INSERT ON dunning_policies TO hardcount_api;
GRANT UPDATE (is_default) ON dunning_policies TO hardcount_api;
GRANT SELECT ON dunning_runs TO hardcount_api;
