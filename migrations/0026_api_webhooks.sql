-- The tenant API's webhook and email routes (issue 24): what the API role
-- writes to resend a delivery or an email, and the attempt budget a resend
-- gives back.
--
-- A resend puts a terminal delivery (delivered or dead) back to pending. Its
-- `attempts` is never lowered: the outcome statement's compare-and-set is on
-- (id, attempts, pending), and an attempt number handed out once must never
-- match again, or an outcome still in flight from before the resend could be
-- written over a newer claim. The resend instead moves `attempts` one past
-- every number handed out and records it here; the claim's ceiling and the
-- retry schedule count the attempts made since (attempts - resent_at_attempt).
-- NOT VALID: every row so far holds 0, so it holds for them already, and
-- the table is not scanned under its lock.
ALTER TABLE webhook_deliveries
    ADD COLUMN resent_at_attempt integer NOT NULL DEFAULT 0,
    ADD CONSTRAINT webhook_deliveries_resent_at_attempt_bounded
        CHECK (resent_at_attempt >= 0 AND resent_at_attempt <= attempts) NOT VALID;

-- POST /v1/deliveries/{id}/resend and /v1/webhook_endpoints/{id}/recover:
-- a terminal delivery back to pending, due now.
GRANT UPDATE (status, next_attempt_at, delivered_at, attempts, resent_at_attempt)
    ON webhook_deliveries TO hardcount_api;
-- POST /v1/emails/{id}/resend: a failed email back to queued, due now.
GRANT UPDATE (status, next_attempt_at) ON email_outbox TO hardcount_api;
