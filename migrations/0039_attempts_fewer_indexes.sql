-- Fewer index writes per payment attempt (issue 29, point 3; docs/adr/0055).
-- Every attempt's insert, and every new version of an attempt whose status
-- changes (its settle), writes an entry into each index below; neither serves
-- anything another index does not.
--
-- `payment_attempts_invoice_latest` (invoice_id, attempt_seq DESC) holds the
-- same keys as the unique constraint `payment_attempts_invoice_seq_key`
-- (invoice_id, attempt_seq): a B-tree is read backwards as cheaply as
-- forwards, so "the latest attempt of an invoice" (dunning's enrolment, the
-- retry's next sequence, the charge funnel's NOT EXISTS) is served by the
-- unique key alone.
DROP INDEX payment_attempts_invoice_latest;

-- `UNIQUE (tenant_id, id)` is the target a composite foreign key needs, and no
-- table references an attempt (as with webhook deliveries, docs/adr/0019). The
-- primary key already makes every (tenant_id, id) unique, and the API reads a
-- tenant's attempts by invoice (`payment_attempts_invoice_seq_key`).
ALTER TABLE payment_attempts DROP CONSTRAINT payment_attempts_tenant_id_key;
