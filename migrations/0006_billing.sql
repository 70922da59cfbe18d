-- Billing: customers, plans, subscriptions, invoices and payment attempts
-- (docs/adr/0010). Every row belongs to one tenant; each reference to another
-- table is a composite foreign key through (tenant_id, id), so no statement can
-- invoice one tenant's subscription to another tenant's customer or plan.
-- Money is integer minor units (bigint) with an ISO 4217 code; never a float.
-- hardcount_app may read, insert and update the mutable columns; it deletes nothing.

CREATE TABLE customers (
    id                   bigint GENERATED ALWAYS AS IDENTITY PRIMARY KEY,
    tenant_id            text NOT NULL CONSTRAINT customers_tenant_present CHECK (tenant_id <> ''),
    email                text NOT NULL CONSTRAINT customers_email_shape CHECK (email ~ '^[^@\s]+@[^@\s]+$'),
    name                 text,
    -- The payment provider's customer (`cus_…`) and the saved card charged off
    -- session (`pm_…`); both absent until the customer is set up at the provider.
    provider_customer_id text CONSTRAINT customers_provider_customer_shape CHECK (provider_customer_id ~ '^cus_[A-Za-z0-9_]+$'),
    payment_method_id    text CONSTRAINT customers_payment_method_shape CHECK (payment_method_id ~ '^pm_[A-Za-z0-9_]+$'),
    created_at           timestamptz NOT NULL DEFAULT now(),
    CONSTRAINT customers_payment_method_needs_customer
        CHECK (payment_method_id IS NULL OR provider_customer_id IS NOT NULL),
    CONSTRAINT customers_tenant_id_key UNIQUE (tenant_id, id),
    CONSTRAINT customers_provider_customer_key UNIQUE (tenant_id, provider_customer_id)
);

CREATE TABLE plans (
    id             bigint GENERATED ALWAYS AS IDENTITY PRIMARY KEY,
    tenant_id      text NOT NULL CONSTRAINT plans_tenant_present CHECK (tenant_id <> ''),
    name           text NOT NULL CONSTRAINT plans_name_present CHECK (name <> ''),
    -- Integer minor units of `currency` (cents for EUR, yen for JPY).
    amount         bigint NOT NULL CONSTRAINT plans_amount_nonnegative CHECK (amount >= 0),
    -- ISO 4217, upper case as the standard writes it (the provider client lowers it).
    currency       text NOT NULL CONSTRAINT plans_currency_iso4217 CHECK (currency ~ '^[A-Z]{3}$'),
    interval_unit  text NOT NULL
        CONSTRAINT plans_interval_unit_known CHECK (interval_unit IN ('hour', 'day', 'week', 'month', 'year')),
    interval_count integer NOT NULL
        CONSTRAINT plans_interval_count_range CHECK (interval_count BETWEEN 1 AND 1000),
    created_at     timestamptz NOT NULL DEFAULT now(),
    CONSTRAINT plans_tenant_id_key UNIQUE (tenant_id, id)
);

CREATE TABLE subscriptions (
    id                          bigint GENERATED ALWAYS AS IDENTITY PRIMARY KEY,
    tenant_id                   text NOT NULL CONSTRAINT subscriptions_tenant_present CHECK (tenant_id <> ''),
    customer_id                 bigint NOT NULL,
    plan_id                     bigint NOT NULL,
    status                      text NOT NULL
        CONSTRAINT subscriptions_status_known CHECK (status IN ('trialing', 'active', 'paused', 'canceled')),
    -- Every period boundary is computed from this instant (UTC), never chained
    -- from the previous boundary, so a month-end clamp does not drift (docs/adr/0010).
    billing_anchor              timestamptz NOT NULL,
    current_period_start        timestamptz NOT NULL,
    current_period_end          timestamptz NOT NULL,
    -- The watermark: when the current period is next closed. Every period writer
    -- proves (status, current_period_start, next_billing_at) as it read them.
    next_billing_at             timestamptz,
    trial_end                   timestamptz,
    collection_method           text NOT NULL DEFAULT 'automatic'
        CONSTRAINT subscriptions_collection_method_known CHECK (collection_method IN ('automatic', 'send_invoice')),
    -- Pause collection: invoices are still made, but not charged, until
    -- resumes_at (or until cleared when it is NULL).
    pause_collection_behavior   text
        CONSTRAINT subscriptions_pause_behavior_known
        CHECK (pause_collection_behavior IN ('keep_as_draft', 'mark_uncollectible', 'void')),
    pause_collection_resumes_at timestamptz,
    pause_collection_set_by     text,
    canceled_at                 timestamptz,
    created_at                  timestamptz NOT NULL DEFAULT now(),
    updated_at                  timestamptz NOT NULL DEFAULT now(),
    CONSTRAINT subscriptions_period_ordered CHECK (current_period_end > current_period_start),
    CONSTRAINT subscriptions_active_has_watermark CHECK (status <> 'active' OR next_billing_at IS NOT NULL),
    CONSTRAINT subscriptions_trialing_has_trial_end CHECK (status <> 'trialing' OR trial_end IS NOT NULL),
    CONSTRAINT subscriptions_canceled_has_time CHECK ((status = 'canceled') = (canceled_at IS NOT NULL)),
    CONSTRAINT subscriptions_resume_needs_pause
        CHECK (pause_collection_resumes_at IS NULL OR pause_collection_behavior IS NOT NULL),
    CONSTRAINT subscriptions_tenant_id_key UNIQUE (tenant_id, id),
    CONSTRAINT subscriptions_customer_same_tenant
        FOREIGN KEY (tenant_id, customer_id) REFERENCES customers (tenant_id, id),
    CONSTRAINT subscriptions_plan_same_tenant
        FOREIGN KEY (tenant_id, plan_id) REFERENCES plans (tenant_id, id)
);

-- The due-billing funnel: active subscriptions by watermark.
CREATE INDEX subscriptions_due ON subscriptions (next_billing_at) WHERE status = 'active';
-- Expired trials and lifted pauses (later steps of the billing tick).
CREATE INDEX subscriptions_trial_due ON subscriptions (trial_end) WHERE status = 'trialing';
CREATE INDEX subscriptions_pause_resumes ON subscriptions (pause_collection_resumes_at)
    WHERE pause_collection_resumes_at IS NOT NULL;
CREATE INDEX subscriptions_tenant_customer ON subscriptions (tenant_id, customer_id);
CREATE INDEX subscriptions_tenant_plan ON subscriptions (tenant_id, plan_id);

CREATE TABLE invoices (
    id                      bigint GENERATED ALWAYS AS IDENTITY PRIMARY KEY,
    tenant_id               text NOT NULL CONSTRAINT invoices_tenant_present CHECK (tenant_id <> ''),
    subscription_id         bigint NOT NULL,
    period_start            timestamptz NOT NULL,
    period_end              timestamptz NOT NULL,
    amount                  bigint NOT NULL CONSTRAINT invoices_amount_nonnegative CHECK (amount >= 0),
    currency                text NOT NULL CONSTRAINT invoices_currency_iso4217 CHECK (currency ~ '^[A-Z]{3}$'),
    -- Copied from the subscription when the invoice is made: auto-charge takes
    -- only `automatic` invoices.
    collection_method       text NOT NULL
        CONSTRAINT invoices_collection_method_known CHECK (collection_method IN ('automatic', 'send_invoice')),
    status                  text NOT NULL DEFAULT 'open'
        CONSTRAINT invoices_status_known CHECK (status IN ('open', 'paid', 'uncollectible', 'void')),
    -- The auto-charge claim lease: a worker charges this invoice only while it
    -- holds an unexpired claim it took by a conditional UPDATE.
    auto_charge_claimed_until timestamptz,
    auto_charge_claimed_by    text,
    finalized_at            timestamptz NOT NULL DEFAULT now(),
    paid_at                 timestamptz,
    closed_at               timestamptz,
    created_at              timestamptz NOT NULL DEFAULT now(),
    CONSTRAINT invoices_period_ordered CHECK (period_end > period_start),
    CONSTRAINT invoices_paid_has_time CHECK ((status = 'paid') = (paid_at IS NOT NULL)),
    CONSTRAINT invoices_tenant_id_key UNIQUE (tenant_id, id),
    -- One invoice per (subscription, period start): the backstop every period
    -- writer inserts under (ON CONFLICT ON CONSTRAINT … DO NOTHING).
    CONSTRAINT idx_invoices_billing_period_dedup UNIQUE (subscription_id, period_start),
    CONSTRAINT invoices_subscription_same_tenant
        FOREIGN KEY (tenant_id, subscription_id) REFERENCES subscriptions (tenant_id, id)
);

-- Auto-charge (a later step): open automatic invoices.
CREATE INDEX invoices_open_automatic ON invoices (id) WHERE status = 'open' AND collection_method = 'automatic';
CREATE INDEX invoices_tenant_created ON invoices (tenant_id, created_at);

CREATE TABLE payment_attempts (
    id                      bigint GENERATED ALWAYS AS IDENTITY PRIMARY KEY,
    tenant_id               text NOT NULL CONSTRAINT payment_attempts_tenant_present CHECK (tenant_id <> ''),
    invoice_id              bigint NOT NULL,
    attempt_seq             integer NOT NULL CONSTRAINT payment_attempts_seq_positive CHECK (attempt_seq >= 1),
    -- Sent as the provider's Idempotency-Key (at most 255 characters); one per
    -- (invoice, attempt_seq), so a retried call can never charge twice.
    idempotency_key         text NOT NULL
        CONSTRAINT payment_attempts_key_length CHECK (length(idempotency_key) BETWEEN 1 AND 255),
    amount                  bigint NOT NULL CONSTRAINT payment_attempts_amount_nonnegative CHECK (amount >= 0),
    currency                text NOT NULL CONSTRAINT payment_attempts_currency_iso4217 CHECK (currency ~ '^[A-Z]{3}$'),
    -- Recorded as unknown before the call; the answer (or the reconciler) settles it.
    provider_status         text NOT NULL DEFAULT 'unknown'
        CONSTRAINT payment_attempts_status_known CHECK (provider_status IN ('succeeded', 'declined', 'unknown')),
    decline_code            text,
    provider_payment_intent text CONSTRAINT payment_attempts_intent_shape CHECK (provider_payment_intent ~ '^pi_[A-Za-z0-9_]+$'),
    last_error              text,
    last_checked_at         timestamptz,
    resolved_at             timestamptz,
    created_at              timestamptz NOT NULL DEFAULT now(),
    CONSTRAINT payment_attempts_decline_code_only_declined
        CHECK (decline_code IS NULL OR provider_status = 'declined'),
    CONSTRAINT payment_attempts_invoice_seq_key UNIQUE (invoice_id, attempt_seq),
    CONSTRAINT payment_attempts_idempotency_key_key UNIQUE (idempotency_key),
    CONSTRAINT payment_attempts_tenant_id_key UNIQUE (tenant_id, id),
    CONSTRAINT payment_attempts_invoice_same_tenant
        FOREIGN KEY (tenant_id, invoice_id) REFERENCES invoices (tenant_id, id)
);

-- The reconciler's unknown-outcome sweep (a later step): least recently checked first.
CREATE INDEX payment_attempts_unknown ON payment_attempts (last_checked_at NULLS FIRST, id)
    WHERE provider_status = 'unknown';

-- Identity columns draw their values without a sequence grant, so the app gets none.
GRANT SELECT, INSERT ON customers, plans, subscriptions, invoices, payment_attempts TO hardcount_app;
GRANT UPDATE (email, name, provider_customer_id, payment_method_id) ON customers TO hardcount_app;
GRANT UPDATE (name) ON plans TO hardcount_app;
GRANT UPDATE (plan_id, status, current_period_start, current_period_end, next_billing_at, trial_end,
              collection_method, pause_collection_behavior, pause_collection_resumes_at,
              pause_collection_set_by, canceled_at, updated_at) ON subscriptions TO hardcount_app;
GRANT UPDATE (status, auto_charge_claimed_until, auto_charge_claimed_by, paid_at, closed_at)
    ON invoices TO hardcount_app;
GRANT UPDATE (provider_status, decline_code, provider_payment_intent, last_error, last_checked_at,
              resolved_at) ON payment_attempts TO hardcount_app;
