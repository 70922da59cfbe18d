-- Definer functions cannot be hijacked, and hardcount_app loses grants no
-- role statement uses (issue 26, points 3 and 7; docs/adr/0031,
-- docs/security.md).
--
-- Point 3. A function whose search_path does not name pg_temp has Postgres
-- search the caller's temporary schema FIRST for tables, views and types
-- (never for functions or operators). Every login role may create temp
-- tables (PUBLIC holds TEMPORARY on a new database), so hardcount_operator
-- could create a temp table named leader_leases and have leader_pause, which
-- runs as the owner with `search_path = pg_catalog, public` (0012), update
-- that table instead of the lease row. PostgreSQL's rule for SECURITY
-- DEFINER functions ("Writing SECURITY DEFINER Functions Safely") is to name
-- pg_temp last; 0019's billing_settle_attempt already does.
--
-- The functions that run as their caller get the same path, so that one
-- rule holds for every function (and the catalog test can say so): the
-- triggers check the app's own writes (a token only grows, a delivery's
-- tenants agree), and a check that read a temp table of the writer's making
-- would be answered by the writer.
--
-- ALTER, not CREATE OR REPLACE: the bodies stay as 0004, 0012, 0015, 0017
-- and 0022 wrote them.
ALTER FUNCTION leader_pause(text, text, text) SET search_path = pg_catalog, public, pg_temp;
ALTER FUNCTION leader_unpause(text) SET search_path = pg_catalog, public, pg_temp;

ALTER FUNCTION leader_fence(text, bigint) SET search_path = pg_catalog, public, pg_temp;
ALTER FUNCTION leader_leases_token_only_grows() SET search_path = pg_catalog, public, pg_temp;
ALTER FUNCTION leader_leases_token_bounded() SET search_path = pg_catalog, public, pg_temp;
ALTER FUNCTION webhook_deliveries_check_tenants() SET search_path = pg_catalog, public, pg_temp;
ALTER FUNCTION webhook_deliveries_keep_target() SET search_path = pg_catalog, public, pg_temp;
ALTER FUNCTION webhook_delivery_referents_kept() SET search_path = pg_catalog, public, pg_temp;
ALTER FUNCTION email_address_valid(text) SET search_path = pg_catalog, public, pg_temp;
ALTER FUNCTION email_mailbox_valid(text) SET search_path = pg_catalog, public, pg_temp;

-- Point 7. Column rights hardcount_app was given and no statement of the
-- role loops writes (read from every UPDATE in crates/*/src): what a
-- tenant (through the API) or the owner writes, never a loop.
--   customers (email, name, provider_customer_id, payment_method_id) and
--     INSERT on customers, plans and subscriptions: the API's and the
--     owner's (tests seed them as the API role, testbed::tenant_writer);
--     billing and dunning only read them.
--   plans (name): the API's.
--   subscriptions (trial_end, collection_method): the API's; billing and
--     dunning move periods, status and pauses only.
--   invoices (number, balance_applied, carried_to_balance, finalized_at):
--     written once by billing's INSERT, never updated.
--   dunning_policies (name, retry_offsets_secs, final_action, warn_after,
--     final_notice, is_default): dunning inserts the default policy and
--     changes none, pause_behavior included.
--   email_address_valid, email_mailbox_valid: called only by the CHECKs of
--     customers and tenant_settings, which the app no longer writes.
REVOKE UPDATE (email, name, provider_customer_id, payment_method_id) ON customers FROM hardcount_app;
REVOKE INSERT ON customers, plans, subscriptions FROM hardcount_app;
REVOKE UPDATE (name) ON plans FROM hardcount_app;
REVOKE UPDATE (trial_end, collection_method) ON subscriptions FROM hardcount_app;
REVOKE UPDATE (number, balance_applied, carried_to_balance, finalized_at) ON invoices FROM hardcount_app;
REVOKE UPDATE (name, retry_offsets_secs, final_action, warn_after, final_notice, is_default,
                pause_behavior)
    ON dunning_policies FROM hardcount_app;
REVOKE EXECUTE ON FUNCTION email_address_valid(text), email_mailbox_valid(text) FROM hardcount_app;
