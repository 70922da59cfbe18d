-- The billing funnels list in (time, id) order, but their indexes held the
-- time alone. Subscriptions that share one watermark (every monthly plan
-- bought on a month's first day, every seeded benchmark row) form one group
-- of equal keys that Postgres must sort whole for each batch's LIMIT: 120 ms
-- per batch at 1,000,000 due rows, so a tick slowed as the due set grew
-- (measured: 10,742 invoices/s at 100,000, about 1,200/s at 1,000,000).
-- With the id in the index the listing reads a batch's rows in order and
-- stops, whatever the group's size. The dunning funnel's index already has
-- this shape (0010).
DROP INDEX subscriptions_due;
CREATE INDEX subscriptions_due ON subscriptions (next_billing_at, id) WHERE status = 'active';
DROP INDEX subscriptions_trial_due;
CREATE INDEX subscriptions_trial_due ON subscriptions (trial_end, id) WHERE status = 'trialing';
DROP INDEX subscriptions_pause_resumes;
CREATE INDEX subscriptions_pause_resumes ON subscriptions (pause_collection_resumes_at, id)
    WHERE pause_collection_resumes_at IS NOT NULL;
