-- Operators set a tenant's settings (`hardcount tenants settings`,
-- `/operator/v1/tenants/{id}/settings`; docs/adr/0148): its invoice prefix,
-- whether a cancel invoices the used part, and its sender. A tenant's email
-- leaves from any address at its sender's domain (docs/adr/0143), a domain the
-- operator vouches for at the relay, so the tenant API's role, which no route
-- ever used to write these, no longer may. Row-level security already lets
-- hardcount_operator reach every row (0024's `service_roles`).
GRANT SELECT, INSERT (tenant_id, invoice_prefix, invoice_on_cancel, email_from, updated_at),
      UPDATE (invoice_prefix, invoice_on_cancel, email_from, updated_at)
    ON tenant_settings TO hardcount_operator;
-- `tenant_settings_email_from_valid` calls it (0022 revoked it from PUBLIC).
GRANT EXECUTE ON FUNCTION email_mailbox_valid(text) TO hardcount_operator;
REVOKE INSERT, UPDATE ON tenant_settings FROM hardcount_api;
-- Only that CHECK calls it; the API role no longer writes what it checks.
REVOKE EXECUTE ON FUNCTION email_mailbox_valid(text) FROM hardcount_api;
