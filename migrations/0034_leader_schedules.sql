-- Cron schedules for the roles, due on the database clock (issue 28; docs/adr/0043).
--
-- A role on a cron schedule (HARDCOUNT_<ROLE>_SCHEDULE) is due at slots its
-- replicas compute from the row, and ACQUIRE decides on the database clock
-- whether a slot has come: `$slot <= statement_timestamp()` and `$slot` later
-- than `last_slot` (or, before the first slot, `last_tick_ended_at`). A
-- RELEASE of a completed tick stamps the slot it covered, so a slot runs to
-- completion once across replicas and takeovers; a failed, lost or
-- interrupted tick leaves it and the slot is retried with the usual cooldown.
--
--   schedule   what the last completed tick ran on: `every 1h`, or the cron
--              expression with its zone (`CRON_TZ=Europe/Berlin 0 0 9 * * *`)
--   last_slot  the slot the last completed tick covered; NULL when that tick
--              was an interval tick (a role moved back to an interval)
--   next_slot  when the role is next due as that tick's replica computed it:
--              the next slot, or the release plus the interval
--
-- The columns are written only by RELEASE; the interval path's ACQUIRE reads
-- none of them. leader_status shows them (appended, so the view is replaced
-- in place) and the metrics export next_slot so an alert can see a late slot.
ALTER TABLE leader_leases
    ADD COLUMN schedule text
        CONSTRAINT leader_leases_schedule_size CHECK (length(schedule) <= 512),
    ADD COLUMN last_slot timestamptz,
    ADD COLUMN next_slot timestamptz;

GRANT UPDATE (schedule, last_slot, next_slot) ON leader_leases TO hardcount_app;

CREATE OR REPLACE VIEW leader_status AS
SELECT role,
       CASE
           WHEN paused_at IS NOT NULL THEN 'paused'
           WHEN expires_at > now() THEN 'held'
           WHEN holder_id IS NOT NULL THEN 'expired'
           WHEN not_before > now() THEN 'cooling_down'
           ELSE 'idle'
       END AS state,
       holder_id,
       holder_token,
       acquired_at,
       expires_at,
       last_tick_ended_at,
       last_tick_holder,
       now() - last_tick_ended_at AS last_tick_age,
       not_before,
       paused_at,
       paused_by,
       pause_reason,
       paused_by_role,
       schedule,
       last_slot,
       next_slot
FROM leader_leases;
