-- Where a tenant's customers pay an invoice or change their payment method
-- (docs/adr/0150). The emails that ask a customer to act (a declined first
-- charge, dunning's warnings and the final notice of an invoice left unpaid,
-- the ask for a payment method) link to it, `{invoice}` replaced by the
-- invoice's id. Set by operators with the tenant's other settings (0056): an
-- https address, no credentials in it, at most 2,000 characters; the CLI and
-- the operator API say which part they refuse, this CHECK holds every writer.
ALTER TABLE tenant_settings
    ADD COLUMN payment_page_url text
        CONSTRAINT tenant_settings_payment_page_url_shape CHECK (
            char_length(payment_page_url) <= 2000
            AND payment_page_url ~ '^https://[^[:space:][:cntrl:]/?#@]+([/?#][^[:space:][:cntrl:]]*)?$'
        );

GRANT INSERT (payment_page_url), UPDATE (payment_page_url) ON tenant_settings TO hardcount_operator;
