-- Dunning's half of the billing lifecycle (issue 22, docs/adr/0026): the pause
-- behaviour a policy's final action writes, and schedules the table refuses
-- when they cannot be followed.

-- What `pause_collection` writes as the subscription's pause behaviour.
ALTER TABLE dunning_policies
    ADD COLUMN pause_behavior text NOT NULL DEFAULT 'keep_as_draft'
        CONSTRAINT dunning_policies_pause_behavior_known
        CHECK (pause_behavior IN ('keep_as_draft', 'mark_uncollectible', 'void'));

-- A schedule dunning can follow: one dimension, no NULL, each offset from one
-- second to 366 days; warnings name retries of it (no NULL, each between 1 and
-- the number of retries; none is valid). NOT VALID: rows written before are
-- not checked here. The funnel (crates/dunning, store::list_due) evaluates the
-- same expressions to leave out a policy written before these CHECKs; keep the
-- two alike. CASE first: array_position refuses a multidimensional array.
-- (Inline, not a function: the app would need EXECUTE on it, and the role
-- tests pin the app to executing leader_fence alone.)
ALTER TABLE dunning_policies
    ADD CONSTRAINT dunning_policies_offsets_in_range CHECK (
        CASE WHEN array_ndims(retry_offsets_secs) = 1
             THEN array_position(retry_offsets_secs, NULL) IS NULL
                  AND 1 <= ALL (retry_offsets_secs) AND 31622400 >= ALL (retry_offsets_secs)
             ELSE false END
    ) NOT VALID,
    ADD CONSTRAINT dunning_policies_warn_after_in_range CHECK (
        CASE WHEN cardinality(warn_after) = 0 THEN true
             WHEN array_ndims(warn_after) = 1
             THEN array_position(warn_after, NULL) IS NULL
                  AND 1 <= ALL (warn_after) AND cardinality(retry_offsets_secs) >= ALL (warn_after)
             ELSE false END
    ) NOT VALID;

GRANT UPDATE (pause_behavior) ON dunning_policies TO hardcount_app;
