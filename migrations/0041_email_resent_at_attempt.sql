-- The email claim's attempt ceiling counts the attempts made since the last
-- resend (docs/adr/0072), as the webhook delivery claim does (migration 0026).
--
-- Since 0072 the claim marks an email `failed` (`attempts_exhausted`) once it
-- has been claimed as many times as it has attempts with no result written.
-- A resend (POST /v1/emails/{id}/resend) puts a failed email back to queued
-- and keeps `attempts`, so that an attempt number handed out once never
-- matches a result again. Counted from zero, every resent email that had
-- used its attempts would be failed by its next claim without a send. The
-- resend now records `attempts` here and the ceiling counts from it.
-- NOT VALID: every row so far holds 0, so it holds for them already, and the
-- table is not scanned under its lock.
ALTER TABLE email_outbox
    ADD COLUMN resent_at_attempt integer NOT NULL DEFAULT 0,
    ADD CONSTRAINT email_outbox_resent_at_attempt_bounded
        CHECK (resent_at_attempt >= 0 AND resent_at_attempt <= attempts) NOT VALID;

GRANT UPDATE (resent_at_attempt) ON email_outbox TO hardcount_api;
