-- A delivery handed to the delivery role of the fan-out's own process is
-- written once, with its first attempt's outcome (docs/adr/0124). Until then
-- the pairs of a fan-out statement that were handed over are kept here, one
-- row per statement, with the lease of the claim they stand for: a row still
-- here when its lease has ended is what a process that died mid-delivery left,
-- and the next fan-out inserts its pairs pending (attempt 1 counted, as an
-- expired claim counts it), skipping those already written.
--
-- Rows live for the length of an attempt: the delivery role deletes a row
-- once every pair of it is written. No index but the primary key: the fan-out
-- reads the expired ones in the same statement that claims events, and the
-- table holds about one row per fan-out statement in flight.
CREATE TABLE webhook_handoffs (
    id           bigint GENERATED ALWAYS AS IDENTITY PRIMARY KEY,
    -- The end of the handed claims' lease, on the database clock.
    until        timestamptz NOT NULL,
    -- When the fan-out handed the pairs over (for an operator reading the table;
    -- each pair's attempt time comes back with its row instead).
    created_at   timestamptz NOT NULL DEFAULT now(),
    tenant_ids   text[] NOT NULL,
    event_ids    bigint[] NOT NULL,
    endpoint_ids bigint[] NOT NULL,
    CONSTRAINT webhook_handoffs_pairs CHECK (
        cardinality(event_ids) > 0
        AND cardinality(tenant_ids) = cardinality(event_ids)
        AND cardinality(endpoint_ids) = cardinality(event_ids))
);

GRANT SELECT, INSERT, DELETE ON webhook_handoffs TO hardcount_app;
