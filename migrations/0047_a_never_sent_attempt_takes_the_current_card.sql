-- A payment attempt recorded and never sent (first_sent_at NULL: the tick's
-- budget ran out before its call, or the provider refused it before its key was
-- read: a 429, a rolled key) is sent by the reconciler with the customer's
-- payment method as it is at the send, and the attempt records what it is sent
-- with (docs/adr/0113). Sent with what was recorded at its start, a card the
-- customer had replaced since was charged. Its key never executed, so the
-- request it carries may still change.
GRANT UPDATE (payment_method_id, provider_customer_id) ON payment_attempts TO hardcount_app;
