-- Per-tenant business windows for dunning (issue 28, point 4; docs/adr/0045):
-- the local hours and ISO weekdays in which a tenant's runs are listed, so its
-- retries, warnings and final actions (with their emails) go out only then.
--
--   window_time_zone  an IANA zone name (`Europe/Berlin`); the local time is
--                     `now() AT TIME ZONE window_time_zone`, on the database clock
--   window_opens      local time the window opens, from 00:00 to before 24:00
--   window_closes     local time it closes (exclusive), up to 24:00 (end of the
--                     day); earlier than `window_opens` means the window runs
--                     past midnight into the next day (22:00 to 06:00)
--   window_weekdays   ISO weekdays (1 Monday … 7 Sunday) on which the window
--                     OPENS: a Friday 22:00 to 06:00 window ends Saturday 06:00
--
-- All four NULL: no window, always open (every policy written before this).
-- Only the tenant's default policy's window is in force, for all of its runs,
-- read by the listing at each listing: a new default written by the API moves
-- the runs already scheduled (their schedule stays their own policy's).
--
-- The zone CHECK converts a fixed instant: a name the server's time zone data
-- does not know raises (22023) rather than passes, so the listing's
-- `AT TIME ZONE` does not fail on a stored name (unless an upgrade of the
-- server's zone data drops one; docs/adr/0045 says what then). It cannot tell
-- an IANA name from a POSIX string (`XYZ5`, which Postgres accepts): the API
-- refuses those by chrono-tz's list of IANA names before writing. (Inline, not
-- a function catching the error: the app would need EXECUTE on it, as 0021
-- says.)
--
-- The columns are new, so every existing row holds NULLs, which pass: the
-- CHECKs are added valid (the scan reads dunning_policies, one row per tenant
-- and edit). The app and the API already hold table-wide SELECT and INSERT on
-- dunning_policies (0010, 0025), which cover the new columns; neither may
-- UPDATE them (a change is a new default row, as for the schedule).
ALTER TABLE dunning_policies
    ADD COLUMN window_time_zone text,
    ADD COLUMN window_opens time,
    ADD COLUMN window_closes time,
    ADD COLUMN window_weekdays integer[],
    ADD CONSTRAINT dunning_policies_window_whole CHECK (
        num_nulls(window_time_zone, window_opens, window_closes, window_weekdays) IN (0, 4)
    ),
    ADD CONSTRAINT dunning_policies_window_zone_known CHECK (
        window_time_zone IS NULL
        OR (length(window_time_zone) BETWEEN 1 AND 64
            AND (timestamptz '2000-01-01 00:00:00+00' AT TIME ZONE window_time_zone) IS NOT NULL)
    ),
    ADD CONSTRAINT dunning_policies_window_times CHECK (
        window_opens < time '24:00' AND window_opens <> window_closes
    ),
    -- CASE first: array_position refuses a multidimensional array; an empty
    -- array has no dimension and is refused.
    ADD CONSTRAINT dunning_policies_window_weekdays_in_range CHECK (
        window_weekdays IS NULL
        OR CASE WHEN array_ndims(window_weekdays) = 1
                THEN array_position(window_weekdays, NULL) IS NULL
                     AND 1 <= ALL (window_weekdays) AND 7 >= ALL (window_weekdays)
                ELSE false END
    );
