-- The claims of the three queues interleave tenants (issue 25, point 4;
-- docs/adr/0048): each claim walks its index one tenant at a time (a loose
-- scan) and gives every tenant with work a share of the batch, so one
-- tenant's backlog no longer stands in front of every other tenant's rows.
-- That needs the claim index to lead with tenant_id. Each index below
-- replaces the one the claim read before, same name and same predicate, so
-- a delivery, event or email still writes one claim-index entry and no more.
CREATE INDEX webhook_deliveries_due_by_tenant ON webhook_deliveries (tenant_id, next_attempt_at, id)
    WHERE status = 'pending';
DROP INDEX webhook_deliveries_due;
ALTER INDEX webhook_deliveries_due_by_tenant RENAME TO webhook_deliveries_due;

CREATE INDEX webhook_events_undispatched_by_tenant ON webhook_events (tenant_id, id)
    WHERE dispatched_at IS NULL;
DROP INDEX webhook_events_undispatched;
ALTER INDEX webhook_events_undispatched_by_tenant RENAME TO webhook_events_undispatched;

CREATE INDEX email_outbox_due_by_tenant ON email_outbox (tenant_id, next_attempt_at, id)
    WHERE status = 'queued';
DROP INDEX email_outbox_due;
ALTER INDEX email_outbox_due_by_tenant RENAME TO email_outbox_due;

-- Billing's due listing walks its subscriptions the same way (the charge
-- claim follows the invoices in the order the listing made them).
CREATE INDEX subscriptions_due_by_tenant ON subscriptions (tenant_id, next_billing_at, id)
    WHERE status = 'active';
DROP INDEX subscriptions_due;
ALTER INDEX subscriptions_due_by_tenant RENAME TO subscriptions_due;
