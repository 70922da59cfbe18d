-- Billing, issue 10 (docs/adr/0012): what the payment reconciler needs.
--
-- The reconciler asks the provider about an unknown attempt by repeating its
-- request with the same Idempotency-Key, and the provider refuses a key
-- reused with other parameters. So each attempt records the customer and the
-- card it was sent for, not only the amount: a card changed since cannot turn
-- the lookup into a refusal. NULL for attempts made before this migration
-- (the reconciler then uses the customer's current values).
ALTER TABLE payment_attempts
    ADD COLUMN provider_customer_id text
        CONSTRAINT payment_attempts_customer_shape CHECK (provider_customer_id ~ '^cus_[A-Za-z0-9_]+$'),
    ADD COLUMN payment_method_id text
        CONSTRAINT payment_attempts_payment_method_shape CHECK (payment_method_id ~ '^pm_[A-Za-z0-9_]+$');

-- The stale-hold sweep: claims by expiry, oldest first.
CREATE INDEX invoices_auto_charge_claims ON invoices (auto_charge_claimed_until)
    WHERE auto_charge_claimed_until IS NOT NULL;

-- A plan may also bill every N minutes, so the local run (`hardcount dev`) shows
-- invoices, charges and receipts within minutes (docs/adr/0012). Minutes are a
-- fixed 60 s, like hours, days and weeks.
ALTER TABLE plans DROP CONSTRAINT plans_interval_unit_known;
ALTER TABLE plans ADD CONSTRAINT plans_interval_unit_known
    CHECK (interval_unit IN ('minute', 'hour', 'day', 'week', 'month', 'year'));
