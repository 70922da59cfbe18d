-- Dunning (issue 11, docs/adr/0013): retry policies and one retry run per
-- declined invoice. Tenant-scoped with composite keys, like billing (0006).
-- hardcount_app may read, insert and update the mutable columns; it deletes nothing.

CREATE TABLE dunning_policies (
    id                 bigint GENERATED ALWAYS AS IDENTITY PRIMARY KEY,
    tenant_id          text NOT NULL CONSTRAINT dunning_policies_tenant_present CHECK (tenant_id <> ''),
    name               text NOT NULL CONSTRAINT dunning_policies_name_present CHECK (name <> ''),
    -- Retry n (1-based) is due retry_offsets_secs[n] seconds after the first
    -- decline; the run is exhausted when retry number cardinality() declines.
    retry_offsets_secs bigint[] NOT NULL
        CONSTRAINT dunning_policies_offsets_count CHECK (cardinality(retry_offsets_secs) BETWEEN 1 AND 20),
    -- What exhaustion does, once (docs/adr/0013).
    final_action       text NOT NULL
        CONSTRAINT dunning_policies_final_action_known
        CHECK (final_action IN ('cancel_subscription', 'pause_collection', 'mark_uncollectible')),
    -- Retries whose decline sends the customer a warning email (1-based).
    warn_after         integer[] NOT NULL DEFAULT '{}',
    -- Whether exhaustion sends a final-notice email.
    final_notice       boolean NOT NULL DEFAULT true,
    -- The policy new runs of this tenant get; one per tenant.
    is_default         boolean NOT NULL DEFAULT false,
    created_at         timestamptz NOT NULL DEFAULT now(),
    CONSTRAINT dunning_policies_tenant_id_key UNIQUE (tenant_id, id)
);

-- One default policy per tenant. Enrolment creates the built-in default
-- (1, 3, 5, 7 days; mark uncollectible) for a tenant without one.
CREATE UNIQUE INDEX dunning_policies_one_default ON dunning_policies (tenant_id) WHERE is_default;

CREATE TABLE dunning_runs (
    id                bigint GENERATED ALWAYS AS IDENTITY PRIMARY KEY,
    tenant_id         text NOT NULL CONSTRAINT dunning_runs_tenant_present CHECK (tenant_id <> ''),
    invoice_id        bigint NOT NULL,
    policy_id         bigint NOT NULL,
    status            text NOT NULL DEFAULT 'active'
        CONSTRAINT dunning_runs_status_known CHECK (status IN ('active', 'recovered', 'exhausted', 'stopped')),
    -- Retries recorded (each by a compare-and-set proving the count it read).
    attempt_count     integer NOT NULL DEFAULT 0 CONSTRAINT dunning_runs_attempt_count_nonnegative CHECK (attempt_count >= 0),
    -- The decline the run started from; every retry's time is an offset from it.
    first_declined_at timestamptz NOT NULL,
    next_attempt_at   timestamptz NOT NULL,
    last_decline_code text,
    -- Set once the final action's step ran; an exhausted run without it is
    -- listed again until it has (the step writes only what is not in force).
    final_action_at   timestamptz,
    ended_at          timestamptz,
    created_at        timestamptz NOT NULL DEFAULT now(),
    updated_at        timestamptz NOT NULL DEFAULT now(),
    CONSTRAINT dunning_runs_final_action_only_exhausted CHECK (final_action_at IS NULL OR status = 'exhausted'),
    CONSTRAINT dunning_runs_ended_not_active CHECK ((status = 'active') = (ended_at IS NULL)),
    -- An invoice is enrolled once.
    CONSTRAINT dunning_runs_invoice_key UNIQUE (invoice_id),
    CONSTRAINT dunning_runs_tenant_id_key UNIQUE (tenant_id, id),
    CONSTRAINT dunning_runs_invoice_same_tenant
        FOREIGN KEY (tenant_id, invoice_id) REFERENCES invoices (tenant_id, id),
    CONSTRAINT dunning_runs_policy_same_tenant
        FOREIGN KEY (tenant_id, policy_id) REFERENCES dunning_policies (tenant_id, id)
);

-- The fenced funnel: due active runs, and exhausted runs whose final action is owed.
CREATE INDEX dunning_runs_due ON dunning_runs (next_attempt_at, id)
    WHERE status = 'active' OR (status = 'exhausted' AND final_action_at IS NULL);
CREATE INDEX dunning_runs_tenant_policy ON dunning_runs (tenant_id, policy_id);
-- Enrolment looks for an invoice's latest attempt.
CREATE INDEX payment_attempts_invoice_latest ON payment_attempts (invoice_id, attempt_seq DESC);

-- Identity columns draw their values without a sequence grant, so the app gets none.
GRANT SELECT, INSERT ON dunning_policies, dunning_runs TO hardcount_app;
GRANT UPDATE (name, retry_offsets_secs, final_action, warn_after, final_notice, is_default)
    ON dunning_policies TO hardcount_app;
GRANT UPDATE (status, attempt_count, next_attempt_at, last_decline_code, final_action_at, ended_at,
              updated_at) ON dunning_runs TO hardcount_app;
