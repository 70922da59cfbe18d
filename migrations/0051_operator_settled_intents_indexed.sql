-- The reconciler finds an intent an operator's settle already pays (docs/adr/0120).
-- An operator who settled one invoice's attempt with the charge of another
-- invoice whose attempt had not yet recorded its intent passed migration
-- 0050's check; the reconciler then paid that other invoice with the same
-- charge. Before it writes an answer paid, the reconciler now looks for an
-- operator-settled attempt carrying the intent, and sends the answer to review
-- instead. Only operator-settled attempts enter this index: billing's own
-- writes never set reviewed_at, so the charge path writes no entry into it.
CREATE INDEX payment_attempts_operator_intent ON payment_attempts (provider_payment_intent)
    WHERE reviewed_at IS NOT NULL AND provider_payment_intent IS NOT NULL;
