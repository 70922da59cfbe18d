-- Webhooks: the outbox, the endpoints, one delivery per (event, endpoint)
-- (docs/adr/0005, 0006). Every row belongs to one tenant; a delivery's event and
-- endpoint are tied to the delivery's tenant by composite foreign keys, so no
-- statement can deliver one tenant's event to another tenant's endpoint.
-- hardcount_app may read, insert and update the mutable columns; it deletes nothing.

CREATE TABLE webhook_endpoints (
    id              bigint GENERATED ALWAYS AS IDENTITY PRIMARY KEY,
    tenant_id       text NOT NULL CONSTRAINT webhook_endpoints_tenant_present CHECK (tenant_id <> ''),
    url             text NOT NULL CONSTRAINT webhook_endpoints_url_http CHECK (url ~* '^https?://'),
    -- `whsec_` + base64 of the key; needed in clear to sign, never logged.
    secret          text NOT NULL CONSTRAINT webhook_endpoints_secret_format CHECK (secret LIKE 'whsec\_%'),
    -- The event types this endpoint receives. Empty means every type.
    event_types     text[] NOT NULL DEFAULT '{}'
        CONSTRAINT webhook_endpoints_event_types_no_nulls CHECK (array_position(event_types, NULL) IS NULL),
    enabled         boolean NOT NULL DEFAULT true,
    disabled_reason text,
    disabled_at     timestamptz,
    created_at      timestamptz NOT NULL DEFAULT now(),
    CONSTRAINT webhook_endpoints_disabled_has_reason CHECK (enabled OR disabled_reason IS NOT NULL),
    CONSTRAINT webhook_endpoints_tenant_id_key UNIQUE (tenant_id, id)
);

-- The fan-out joins an event's tenant to its enabled endpoints.
CREATE INDEX webhook_endpoints_tenant_enabled ON webhook_endpoints (tenant_id) WHERE enabled;

-- The outbox. Producers insert in their own transaction (webhook_outbox::enqueue);
-- the webhook_outbox role fans each event out and stamps dispatched_at.
CREATE TABLE webhook_events (
    id            bigint GENERATED ALWAYS AS IDENTITY PRIMARY KEY,
    tenant_id     text NOT NULL CONSTRAINT webhook_events_tenant_present CHECK (tenant_id <> ''),
    event_type    text NOT NULL CONSTRAINT webhook_events_type_present CHECK (event_type <> ''),
    payload       jsonb NOT NULL,
    -- The Standard Webhooks `webhook-id`: random, so it reveals no volume, and the
    -- same on every attempt and every endpoint of this event.
    message_id    text NOT NULL DEFAULT ('msg_' || replace(gen_random_uuid()::text, '-', '')),
    created_at    timestamptz NOT NULL DEFAULT now(),
    dispatched_at timestamptz,
    CONSTRAINT webhook_events_tenant_id_key UNIQUE (tenant_id, id)
);

-- The dispatcher's claim: undispatched events, oldest first.
CREATE INDEX webhook_events_undispatched ON webhook_events (id) WHERE dispatched_at IS NULL;
CREATE INDEX webhook_events_tenant_created ON webhook_events (tenant_id, created_at);

CREATE TABLE webhook_deliveries (
    id               bigint GENERATED ALWAYS AS IDENTITY PRIMARY KEY,
    tenant_id        text NOT NULL,
    event_id         bigint NOT NULL,
    endpoint_id      bigint NOT NULL,
    -- Claims made so far; the outcome of attempt n is written only while this is n.
    attempts         integer NOT NULL DEFAULT 0 CONSTRAINT webhook_deliveries_attempts_nonnegative CHECK (attempts >= 0),
    status           text NOT NULL DEFAULT 'pending'
        CONSTRAINT webhook_deliveries_status_known CHECK (status IN ('pending', 'delivered', 'dead')),
    -- When a pending delivery is due: the next retry, or the end of a claim's lease.
    next_attempt_at  timestamptz NOT NULL DEFAULT now(),
    last_attempt_at  timestamptz,
    last_status_code integer,
    last_error       text,
    last_latency_ms  integer,
    delivered_at     timestamptz,
    created_at       timestamptz NOT NULL DEFAULT now(),
    CONSTRAINT webhook_deliveries_event_endpoint_key UNIQUE (event_id, endpoint_id),
    CONSTRAINT webhook_deliveries_delivered_has_time CHECK ((status = 'delivered') = (delivered_at IS NOT NULL)),
    CONSTRAINT webhook_deliveries_event_same_tenant
        FOREIGN KEY (tenant_id, event_id) REFERENCES webhook_events (tenant_id, id),
    CONSTRAINT webhook_deliveries_endpoint_same_tenant
        FOREIGN KEY (tenant_id, endpoint_id) REFERENCES webhook_endpoints (tenant_id, id)
);

-- The worker's claim: due pending deliveries.
CREATE INDEX webhook_deliveries_due ON webhook_deliveries (next_attempt_at) WHERE status = 'pending';
-- The oldest-pending gauge and the dead gauge read these, not the table.
CREATE INDEX webhook_deliveries_pending_age ON webhook_deliveries (created_at) WHERE status = 'pending';
CREATE INDEX webhook_deliveries_dead ON webhook_deliveries (tenant_id, id) WHERE status = 'dead';
-- A tenant's deliveries per endpoint (support, replay), and the endpoint foreign key.
CREATE INDEX webhook_deliveries_tenant_endpoint ON webhook_deliveries (tenant_id, endpoint_id, id);

-- Identity columns draw their values without a sequence grant, so the app gets none.
GRANT SELECT, INSERT ON webhook_endpoints, webhook_events, webhook_deliveries TO hardcount_app;
GRANT UPDATE (url, secret, event_types, enabled, disabled_reason, disabled_at) ON webhook_endpoints TO hardcount_app;
GRANT UPDATE (dispatched_at) ON webhook_events TO hardcount_app;
GRANT UPDATE (attempts, status, next_attempt_at, last_attempt_at, last_status_code, last_error,
              last_latency_ms, delivered_at) ON webhook_deliveries TO hardcount_app;
