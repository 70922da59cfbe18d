-- An email refused for its content at enqueue (docs/adr/0027) is written
-- `failed` with no attempt, so its last_attempt_at stayed NULL: the retention
-- prune orders and compares finished emails by last_attempt_at
-- (email_outbox_finished, migration 0030), and a NULL is never older than the
-- cut, so those rows (recipients and bodies) were kept for ever and
-- hardcount_emails_failed grew without bound (docs/adr/0100). The insert now
-- stamps a refused row's last_attempt_at with its refusal; the rows refused
-- before take their creation time.
UPDATE email_outbox SET last_attempt_at = created_at
WHERE status = 'failed' AND refused IS NOT NULL AND last_attempt_at IS NULL;
