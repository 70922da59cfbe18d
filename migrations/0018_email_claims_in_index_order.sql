-- The email claim reads its batch in index order (docs/adr/0023, as migration
-- 0017 for webhook deliveries). The claim orders by (next_attempt_at, id), and
-- every email queued by one transaction shares its next_attempt_at (that
-- transaction's now()), so with next_attempt_at alone in the key the claim
-- sorted a whole producer batch to hand out one claim's worth. Same name, same
-- predicate.
CREATE INDEX email_outbox_due_by_id ON email_outbox (next_attempt_at, id)
    WHERE status = 'queued';
DROP INDEX email_outbox_due;
ALTER INDEX email_outbox_due_by_id RENAME TO email_outbox_due;
