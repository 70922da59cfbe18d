-- Fewer index writes per payment attempt (issue 29, point 3; docs/adr/0055).
-- `payment_attempts_invoice_latest` (invoice_id, attempt_seq DESC) holds the
-- same keys as the unique constraint `payment_attempts_invoice_seq_key`
-- (invoice_id, attempt_seq): a B-tree is read backwards as cheaply as
-- forwards, so "the latest attempt of an invoice" (dunning's enrolment, the
-- retry's next sequence, the charge funnel's NOT EXISTS) is served by the
-- unique index alone. Every attempt's insert, and every new version of an
-- attempt whose status changes, wrote an entry into both.
DROP INDEX payment_attempts_invoice_latest;
