-- Hardening (issue 12): bounded inputs and schema hygiene.

-- Point 5: the payload size backstop behind webhook_outbox::enqueue's 256 KiB limit
-- (MAX_PAYLOAD_BYTES). It bounds the payload as Postgres renders it, which is what
-- the delivery claim reads and the worker POSTs: at most 1 MiB, room for jsonb's
-- rendering (a space after each ':' and ','), and a refusal for any insert that
-- bypasses enqueue. NOT VALID: enforced on every new or updated row without
-- scanning (and locking) the existing outbox; the claim's attempt ceiling retires
-- an old oversized row.
ALTER TABLE webhook_events
    ADD CONSTRAINT webhook_events_payload_bounded
    CHECK (octet_length(payload::text) <= 1048576) NOT VALID;
