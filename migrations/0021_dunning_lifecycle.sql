-- Dunning's half of the billing lifecycle (issue 22, docs/adr/0026): the pause
-- behaviour a policy's final action writes, and schedules the table refuses
-- when they cannot be followed.

-- What `pause_collection` writes as the subscription's pause behaviour.
ALTER TABLE dunning_policies
    ADD COLUMN pause_behavior text NOT NULL DEFAULT 'keep_as_draft'
        CONSTRAINT dunning_policies_pause_behavior_known
        CHECK (pause_behavior IN ('keep_as_draft', 'mark_uncollectible', 'void'));

-- A schedule dunning can follow: one dimension, no NULL, each offset from one
-- second to 366 days. The funnel calls the same function to leave out a policy
-- written before this CHECK (NOT VALID: old rows are not checked here).
CREATE FUNCTION dunning_offsets_valid(offsets bigint[]) RETURNS boolean
    LANGUAGE sql IMMUTABLE PARALLEL SAFE
    SET search_path = pg_catalog, public
AS $$
    SELECT COALESCE(array_ndims(offsets) = 1
                    AND NOT EXISTS (SELECT 1 FROM unnest(offsets) o
                                    WHERE o IS NULL OR o NOT BETWEEN 1 AND 31622400),
                    false)
$$;

-- Warnings name retries of the schedule: no NULL, each between 1 and the
-- number of retries. An empty list (no warnings) is valid.
CREATE FUNCTION dunning_warn_after_valid(warn_after integer[], retries integer) RETURNS boolean
    LANGUAGE sql IMMUTABLE PARALLEL SAFE
    SET search_path = pg_catalog, public
AS $$
    SELECT COALESCE(COALESCE(array_ndims(warn_after), 1) = 1
                    AND NOT EXISTS (SELECT 1 FROM unnest(warn_after) w
                                    WHERE w IS NULL OR w NOT BETWEEN 1 AND retries),
                    false)
$$;

ALTER TABLE dunning_policies
    ADD CONSTRAINT dunning_policies_offsets_in_range
        CHECK (dunning_offsets_valid(retry_offsets_secs)) NOT VALID,
    ADD CONSTRAINT dunning_policies_warn_after_in_range
        CHECK (dunning_warn_after_valid(warn_after, cardinality(retry_offsets_secs))) NOT VALID;

REVOKE ALL ON FUNCTION dunning_offsets_valid(bigint[]) FROM PUBLIC;
REVOKE ALL ON FUNCTION dunning_warn_after_valid(integer[], integer) FROM PUBLIC;
GRANT EXECUTE ON FUNCTION dunning_offsets_valid(bigint[]) TO hardcount_app;
GRANT EXECUTE ON FUNCTION dunning_warn_after_valid(integer[], integer) TO hardcount_app;

GRANT UPDATE (pause_behavior) ON dunning_policies TO hardcount_app;
