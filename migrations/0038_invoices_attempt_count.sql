-- The charge claim reads only the invoices it can claim (issue 29, point 3;
-- docs/adr/0050). It wants open automatic invoices never attempted, and its
-- only index was every open automatic invoice: the ones earlier batches of
-- the tick had claimed and attempted, and the ones declined and waiting for
-- dunning, were read again by every claim and dropped by its NOT EXISTS
-- (12,800 read for a batch of 256 on a scratch database, 24.6 ms).
--
-- `attempt_count` is the provider's own field of the same name on an invoice
-- (the number of payment attempts made). Every attempt is written by one
-- statement (`billing::statements::START_ATTEMPTS`), which raises the count
-- in the same statement, so an invoice leaves this index in the transaction
-- that writes its first attempt.
ALTER TABLE invoices
    ADD COLUMN attempt_count integer NOT NULL DEFAULT 0
        CONSTRAINT invoices_attempt_count_nonnegative CHECK (attempt_count >= 0);

UPDATE invoices i SET attempt_count = a.n
FROM (SELECT invoice_id, count(*)::integer AS n FROM payment_attempts GROUP BY invoice_id) a
WHERE a.invoice_id = i.id;

CREATE INDEX invoices_charge_pending ON invoices (id)
    WHERE status = 'open' AND collection_method = 'automatic' AND attempt_count = 0;

GRANT UPDATE (attempt_count) ON invoices TO hardcount_app;
