-- Signing-secret rotation per Standard Webhooks (issue 12, point 3).
--
-- An endpoint may hold, beside its current secret, the previous one until an
-- expiry: `webhook_delivery::rotate_secret` moves the current secret here with
-- `previous_secret_expires_at = now() + overlap` and stores a new one. While the
-- expiry is ahead on the database clock, the delivery claim returns the previous
-- secret too and every delivery carries both signatures, space-separated
-- (`v1,<sig-new> v1,<sig-old>`), so a receiver can switch keys at its own pace.
-- After the expiry the column is ignored (it is overwritten by the next rotation).
ALTER TABLE webhook_endpoints
    ADD COLUMN previous_secret text
        CONSTRAINT webhook_endpoints_previous_secret_format CHECK (previous_secret LIKE 'whsec\_%'),
    ADD COLUMN previous_secret_expires_at timestamptz,
    ADD CONSTRAINT webhook_endpoints_previous_secret_has_expiry
        CHECK ((previous_secret IS NULL) = (previous_secret_expires_at IS NULL));

-- The app reads the new columns through its table-wide SELECT (migration 0002)
-- and may update only these two (and `secret`, already granted); no INSERT or
-- DELETE right changes.
GRANT UPDATE (previous_secret, previous_secret_expires_at) ON webhook_endpoints TO hardcount_app;
