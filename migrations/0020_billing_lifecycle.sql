-- The billing lifecycle (issue 22, docs/adr/0025): pause behaviours, free and
-- tiny invoices with a customer balance, no payment method, cancels, per-tenant
-- settings and gap-free invoice numbers, and timestamps a row decoder can hold.

-- Invoices made while collection is paused with `keep_as_draft` stay drafts:
-- not finalized, not numbered, not announced, not charged.
ALTER TABLE invoices DROP CONSTRAINT invoices_status_known;
ALTER TABLE invoices ADD CONSTRAINT invoices_status_known
    CHECK (status IN ('draft', 'open', 'paid', 'uncollectible', 'void'));
ALTER TABLE invoices ALTER COLUMN finalized_at DROP NOT NULL;
ALTER TABLE invoices ADD CONSTRAINT invoices_draft_not_finalized
    CHECK ((status = 'draft') = (finalized_at IS NULL));

ALTER TABLE invoices
    -- `PREFIX-000123`, per tenant, sequential without gaps (invoice_counters);
    -- NULL for drafts and for invoices made before numbering existed.
    ADD COLUMN number text CONSTRAINT invoices_number_shape CHECK (number ~ '^[A-Z0-9]{1,12}-[0-9]{6,}$'),
    -- The customer's carried balance this invoice took in (included in amount).
    ADD COLUMN balance_applied bigint NOT NULL DEFAULT 0,
    -- Under the provider's minimum: not charged, carried to the customer's balance.
    ADD COLUMN carried_to_balance bigint NOT NULL DEFAULT 0
        CONSTRAINT invoices_carried_nonnegative CHECK (carried_to_balance >= 0),
    -- Why the invoice exists: a closed period, a plan change, or a cancel.
    ADD COLUMN reason text NOT NULL DEFAULT 'period'
        CONSTRAINT invoices_reason_known CHECK (reason IN ('period', 'plan_change', 'cancel')),
    -- Set once, with the "please add a payment method" email and
    -- invoice.payment_action_required, in one transaction.
    ADD COLUMN action_required_at timestamptz,
    ADD CONSTRAINT invoices_tenant_number_key UNIQUE (tenant_id, number);

-- The open automatic invoices whose customer may lack a payment method.
CREATE INDEX invoices_action_required_pending ON invoices (id)
    WHERE status = 'open' AND collection_method = 'automatic' AND action_required_at IS NULL;

-- What a customer owes (positive) or is owed (negative) outside any invoice,
-- per currency: a tiny invoice's amount, taken in by the next invoice.
CREATE TABLE customer_balances (
    tenant_id   text NOT NULL CONSTRAINT customer_balances_tenant_present CHECK (tenant_id <> ''),
    customer_id bigint NOT NULL,
    currency    text NOT NULL CONSTRAINT customer_balances_currency_iso4217 CHECK (currency ~ '^[A-Z]{3}$'),
    amount      bigint NOT NULL DEFAULT 0,
    updated_at  timestamptz NOT NULL DEFAULT now(),
    PRIMARY KEY (tenant_id, customer_id, currency),
    CONSTRAINT customer_balances_customer_same_tenant
        FOREIGN KEY (tenant_id, customer_id) REFERENCES customers (tenant_id, id)
);

-- Per-tenant settings; a tenant without a row has the defaults.
CREATE TABLE tenant_settings (
    tenant_id         text PRIMARY KEY CONSTRAINT tenant_settings_tenant_present CHECK (tenant_id <> ''),
    invoice_prefix    text NOT NULL DEFAULT 'INV'
        CONSTRAINT tenant_settings_invoice_prefix_shape CHECK (invoice_prefix ~ '^[A-Z0-9]{1,12}$'),
    -- Whether a cancel invoices the used part of the current period.
    invoice_on_cancel boolean NOT NULL DEFAULT true,
    -- The sender of this tenant's receipts and dunning mail; NULL: HARDCOUNT_EMAIL_FROM.
    email_from        text CONSTRAINT tenant_settings_email_from_length CHECK (char_length(email_from) BETWEEN 3 AND 320),
    updated_at        timestamptz NOT NULL DEFAULT now()
);

-- The last invoice number given per tenant, advanced in the invoice's own
-- transaction: a rolled-back invoice gives its number back.
CREATE TABLE invoice_counters (
    tenant_id   text PRIMARY KEY CONSTRAINT invoice_counters_tenant_present CHECK (tenant_id <> ''),
    last_number bigint NOT NULL DEFAULT 0 CONSTRAINT invoice_counters_nonnegative CHECK (last_number >= 0)
);

ALTER TABLE subscriptions
    -- The current period is billed in full, then the subscription ends.
    ADD COLUMN cancel_at_period_end boolean NOT NULL DEFAULT false;

-- Timestamps a tenant or the API writes are finite and within what the
-- service's date types hold: `infinity` or year 200000 would fail row decoding
-- inside the billing claims. NOT VALID: rows already written are not checked
-- here; the claims read the same predicate, leave such a row out, log its id
-- and count it.
-- Written out per column rather than through a function: the CHECK runs on
-- every update of a subscription (the closing's compare-and-set included), and
-- an inlined comparison costs nothing next to a function call. A bound pair
-- excludes ±infinity too.
ALTER TABLE subscriptions
    ADD CONSTRAINT subscriptions_times_in_range CHECK (
        billing_anchor >= '1970-01-01 00:00:00+00' AND billing_anchor < '10000-01-01 00:00:00+00'
        AND current_period_start >= '1970-01-01 00:00:00+00' AND current_period_start < '10000-01-01 00:00:00+00'
        AND current_period_end >= '1970-01-01 00:00:00+00' AND current_period_end < '10000-01-01 00:00:00+00'
        AND (next_billing_at IS NULL
             OR (next_billing_at >= '1970-01-01 00:00:00+00' AND next_billing_at < '10000-01-01 00:00:00+00'))
        AND (trial_end IS NULL
             OR (trial_end >= '1970-01-01 00:00:00+00' AND trial_end < '10000-01-01 00:00:00+00'))
        AND (pause_collection_resumes_at IS NULL
             OR (pause_collection_resumes_at >= '1970-01-01 00:00:00+00'
                 AND pause_collection_resumes_at < '10000-01-01 00:00:00+00'))
        AND (canceled_at IS NULL
             OR (canceled_at >= '1970-01-01 00:00:00+00' AND canceled_at < '10000-01-01 00:00:00+00'))
    ) NOT VALID;

GRANT SELECT, INSERT ON customer_balances, invoice_counters TO hardcount_app;
GRANT UPDATE (amount, updated_at) ON customer_balances TO hardcount_app;
GRANT UPDATE (last_number) ON invoice_counters TO hardcount_app;
GRANT SELECT ON tenant_settings TO hardcount_app;
GRANT UPDATE (number, balance_applied, carried_to_balance, action_required_at, finalized_at)
    ON invoices TO hardcount_app;
GRANT UPDATE (cancel_at_period_end) ON subscriptions TO hardcount_app;

GRANT SELECT, INSERT ON tenant_settings TO hardcount_api;
GRANT UPDATE (invoice_prefix, invoice_on_cancel, email_from, updated_at) ON tenant_settings TO hardcount_api;
GRANT UPDATE (cancel_at_period_end) ON subscriptions TO hardcount_api;
GRANT SELECT ON customer_balances TO hardcount_api;
