-- A dunning retry answered `processing` and later declined is announced like a
-- retry declined at once: `dunning.attempt_failed` and the policy's warning
-- (docs/adr/0085). The run records which of its attempts still owes those
-- notices; the listing marks such a run once that attempt has settled, and the
-- decline's compare-and-set clears it with the announcement, so the notices go
-- out once. NULL: nothing owed.
ALTER TABLE dunning_runs ADD COLUMN owed_notice_attempt integer;

GRANT UPDATE (owed_notice_attempt) ON dunning_runs TO hardcount_app;
