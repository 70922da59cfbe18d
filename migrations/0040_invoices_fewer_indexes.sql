-- One index write fewer per invoice version (issue 29, point 3; docs/adr/0057).
-- An invoice gets a new version when it is billed, claimed for a charge or a
-- retry, and settled; none of them can be a HOT update, so each writes an
-- entry into every index of `invoices`.
--
-- `invoices_tenant_created` (tenant_id, created_at) has no reader: the API
-- lists a tenant's invoices by id (`invoices_tenant_id_key`), retention keeps
-- every invoice, and no statement filters or orders invoices by creation.
DROP INDEX invoices_tenant_created;
