-- Less Postgres work per delivery (issue 13, point 4; docs/adr/0014).
--
-- A claim used to push `next_attempt_at` (indexed by webhook_deliveries_due) a
-- lease ahead, so every claim was a non-HOT update: a new entry in each of the
-- table's five indexes. The claim's lease now lives in its own column, which no
-- index names: a claim changes only unindexed columns (attempts,
-- last_attempt_at, claimed_until) and is a HOT update when its page has room.
-- A pending delivery is due when both `next_attempt_at` and `claimed_until`
-- (if set) have passed; the claim's index scan skips rows whose lease is
-- running (there are at most the worker's in-flight count of them).
ALTER TABLE webhook_deliveries ADD COLUMN claimed_until timestamptz;

-- Room on each page for the claim's new row version: inserts fill a page only
-- half, so the claim is HOT. Measured (issue 13's benchmark, 400 events x 5
-- endpoints): fillfactor 70 made about 40 % of claims HOT, 50 about 90 %
-- (docs/adr/0014). Once vacuum has reclaimed a page's finished rows, later
-- inserts fill it again up to half.
ALTER TABLE webhook_deliveries SET (fillfactor = 50);

GRANT UPDATE (claimed_until) ON webhook_deliveries TO hardcount_app;
