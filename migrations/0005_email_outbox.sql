-- The email outbox (docs/adr/0009). Producers insert in their own transaction
-- (email_outbox::enqueue); the email_outbox role sends each email over SMTP and
-- records the result by a compare-and-set on (id, attempts). Every row belongs to
-- one tenant. hardcount_app reads, inserts, and updates only the columns the
-- sender writes; it deletes nothing.

CREATE TABLE email_outbox (
    id              bigint GENERATED ALWAYS AS IDENTITY PRIMARY KEY,
    tenant_id       text NOT NULL CONSTRAINT email_outbox_tenant_present CHECK (tenant_id <> ''),
    -- The Message-ID header, fixed at enqueue: a resend after a takeover carries
    -- the same one, so the receiving side can recognise it.
    message_id      text NOT NULL CONSTRAINT email_outbox_message_id_key UNIQUE,
    sender          text NOT NULL,
    recipients      text[] NOT NULL
        CONSTRAINT email_outbox_has_recipients
        CHECK (cardinality(recipients) > 0 AND array_position(recipients, NULL) IS NULL),
    subject         text NOT NULL CONSTRAINT email_outbox_subject_present CHECK (subject <> ''),
    text_body       text NOT NULL,
    html_body       text,
    status          text NOT NULL DEFAULT 'queued'
        CONSTRAINT email_outbox_status_known CHECK (status IN ('queued', 'sent', 'failed')),
    -- Claims made so far; the result of attempt n is written only while this is n.
    attempts        integer NOT NULL DEFAULT 0 CONSTRAINT email_outbox_attempts_nonnegative CHECK (attempts >= 0),
    -- When a queued email is due: the next retry, or the end of a claim's lease.
    next_attempt_at timestamptz NOT NULL DEFAULT now(),
    last_attempt_at timestamptz,
    -- The server's last reply (code and text), or no code when there was no reply.
    last_reply_code integer,
    last_reply_text text,
    sent_at         timestamptz,
    created_at      timestamptz NOT NULL DEFAULT now(),
    CONSTRAINT email_outbox_sent_has_time CHECK ((status = 'sent') = (sent_at IS NOT NULL)),
    CONSTRAINT email_outbox_tenant_id_key UNIQUE (tenant_id, id)
);

-- The sender's claim: due queued emails.
CREATE INDEX email_outbox_due ON email_outbox (next_attempt_at) WHERE status = 'queued';
-- The oldest-queued gauge and the failed gauge read these, not the table.
CREATE INDEX email_outbox_queued_age ON email_outbox (created_at) WHERE status = 'queued';
CREATE INDEX email_outbox_failed ON email_outbox (tenant_id, id) WHERE status = 'failed';

GRANT SELECT, INSERT ON email_outbox TO hardcount_app;
GRANT UPDATE (status, attempts, next_attempt_at, last_attempt_at, last_reply_code,
              last_reply_text, sent_at) ON email_outbox TO hardcount_app;
