-- Email addresses checked where they are written, by the rules the outbox
-- sends by (docs/adr/0027), and emails the outbox refuses recorded instead of
-- rolled back.
--
-- email_address_valid(text) accepts a bare address only when lettre (the
-- outbox's SMTP library, 0.11) accepts it both as an `Address` and as the
-- `Mailbox` the outbox parses a recipient into; it is never looser than lettre,
-- and stricter in three corners lettre reaches through IDNA or trimming:
--   * a domain label must begin and end with an ASCII letter or digit, or with
--     a letter of the scripts listed below (lettre also takes any Unicode
--     alphanumeric, and labels IDNA can map, such as `☃`);
--   * no White_Space character at either end (lettre's mailbox parser trims
--     it, so the address sent would not be the one stored);
--   * a quoted local part must unquote to a dot-atom (`"john.doe"`), which is
--     what lettre's mailbox parser sends to; `"john doe"` is refused by both.
-- IP literals (`user@[192.0.2.1]`) are refused: lettre's Address takes them
-- and its mailbox parser does not. The table test
-- (crates/email_outbox/tests/it/addresses.rs) pins both verdicts address by
-- address, and a sweep of every code point pins "never looser".

CREATE FUNCTION email_address_valid(address text) RETURNS boolean
    LANGUAGE sql IMMUTABLE STRICT PARALLEL SAFE
    SET search_path = pg_catalog, public
AS $fn$
WITH k AS (
    SELECT 'A-Za-z0-9!#$%&''*+/=?^_`{|}~' AS ascii_atext,
           '\u0080-\U0010ffff' AS non_ascii,
           -- Letters a domain label may begin and end with: ASCII letters and
           -- digits, Latin-1 and Latin Extended, IPA, Greek, Cyrillic, Hebrew,
           -- Arabic, Vietnamese, kana, CJK and Hangul letters (each one
           -- alphanumeric to Rust, so lettre takes it without IDNA).
           'A-Za-z0-9\u00c0-\u00d6\u00d8-\u00f6\u00f8-\u02af\u0386\u0388-\u038a\u038c'
           '\u038e-\u03a1\u03a3-\u03f5\u03f7-\u03ff\u0400-\u0481\u048a-\u052f\u05d0-\u05ea'
           '\u0620-\u064a\u1e00-\u1eff\u3041-\u3096\u30a1-\u30fa\u30fc\u4e00-\u9fff\uac00-\ud7a3'
               AS edge_letters
), r AS (
    SELECT '[' || ascii_atext || non_ascii || '-]' AS atext,
           '[' || edge_letters || ']' AS edge,
           '[' || ascii_atext || '.' || non_ascii || '-]' AS quoted_char,
           '\\[' || ascii_atext || '.-]' AS quoted_pair
    FROM k
), pattern AS (
    SELECT '^' || atext || '+(\.' || atext || '+)*$' AS dot_atom,
           '^"(' || quoted_char || '|' || quoted_pair || ')+"$' AS quoted,
           '^' || edge || '(' || atext || '*' || edge || ')?'
               || '(\.' || edge || '(' || atext || '*' || edge || ')?)*$' AS domain
    FROM r
), part AS (
    -- lettre splits at the last '@'.
    SELECT substring(address FROM '^(.*)@') AS local_part,
           substring(address FROM '^.*@(.*)$') AS domain
)
SELECT coalesce(
    address !~ '^[\u0085\u00a0\u1680\u2000-\u200a\u2028\u2029\u202f\u205f\u3000]'
    AND octet_length(part.local_part) BETWEEN 1 AND 64
    AND octet_length(part.domain) BETWEEN 1 AND 254
    AND (part.local_part ~ pattern.dot_atom
         OR (part.local_part ~ pattern.quoted
             AND regexp_replace(substr(part.local_part, 2, length(part.local_part) - 2),
                                '\\(.)', '\1', 'g') ~ pattern.dot_atom))
    AND part.domain ~ pattern.domain
    AND NOT EXISTS (SELECT FROM regexp_split_to_table(part.domain, '\.') AS l(label)
                    WHERE octet_length(l.label) > 63),
    false)
FROM part, pattern
$fn$;

-- A sender as `HARDCOUNT_EMAIL_FROM` and `tenant_settings.email_from` take it:
-- a bare address, or `Display Name <address>` (display name optional), the
-- address by email_address_valid. The display name is words (atoms of atext,
-- or quoted strings of printable characters) with single spaces or dots
-- between them; lettre also takes runs of spaces, control characters in
-- quoted strings and surrounding white space, which this refuses.
CREATE FUNCTION email_mailbox_valid(mailbox text) RETURNS boolean
    LANGUAGE sql IMMUTABLE STRICT PARALLEL SAFE
    SET search_path = pg_catalog, public
AS $fn$
WITH k AS (
    SELECT '[A-Za-z0-9!#$%&''*+/=?^_`{|}~\u0080-\U0010ffff-]+' AS atom,
           '"([\u0020\u0021\u0023-\u005b\u005d-\u007e\u0080-\U0010ffff]|\\[\u0020-\u007e])*"' AS quoted
), pattern AS (
    SELECT '^((' || atom || '|' || quoted || ')( ?(' || atom || '|' || quoted || '|\.))* ?)?$'
               AS display_name
    FROM k
)
SELECT CASE
    WHEN mailbox ~ '^[^<>]*<[^<>]*>$' THEN
        coalesce(substring(mailbox FROM '^([^<>]*)<') ~ pattern.display_name, false)
        AND email_address_valid(substring(mailbox FROM '<([^<>]*)>$'))
    ELSE email_address_valid(mailbox)
END
FROM pattern
$fn$;

REVOKE ALL ON FUNCTION email_address_valid(text) FROM PUBLIC;
REVOKE ALL ON FUNCTION email_mailbox_valid(text) FROM PUBLIC;
-- A CHECK calls its function as the writing role: the roles that write
-- customers and tenant settings.
GRANT EXECUTE ON FUNCTION email_address_valid(text), email_mailbox_valid(text)
    TO hardcount_app, hardcount_api;

-- NOT VALID: rows already written are not checked here. An existing row that
-- fails is refused at its next update, naming this constraint.
ALTER TABLE customers
    DROP CONSTRAINT customers_email_shape,
    ADD CONSTRAINT customers_email_valid CHECK (email_address_valid(email)) NOT VALID;

ALTER TABLE tenant_settings
    ADD CONSTRAINT tenant_settings_email_from_valid CHECK (email_mailbox_valid(email_from)) NOT VALID;

-- An email the outbox refuses for its content (a recipient or sender lettre
-- cannot parse, a body too large, …) inside a batch that must commit (a
-- settle: email_outbox::enqueue_many_or_record) is written `failed` with the
-- reason, instead of failing the producer's transaction. `refused` holds the
-- reason's short name (the `reason` label of hardcount_email_refused_total),
-- `last_reply_text` the refusal naming the field; such a row has no
-- attempts, no reply code, and no bodies. The recipient and subject checks
-- make room for a refusal of an email without them. All NOT VALID: no row
-- written so far has `refused` set, so each holds for them already.
ALTER TABLE email_outbox
    ADD COLUMN refused text,
    ADD CONSTRAINT email_outbox_refused_reason CHECK (refused ~ '^[a-z_]{1,32}$') NOT VALID,
    ADD CONSTRAINT email_outbox_refused_is_failed CHECK (refused IS NULL OR status = 'failed') NOT VALID,
    DROP CONSTRAINT email_outbox_has_recipients,
    ADD CONSTRAINT email_outbox_has_recipients
        CHECK ((cardinality(recipients) > 0 OR refused IS NOT NULL)
               AND array_position(recipients, NULL) IS NULL) NOT VALID,
    DROP CONSTRAINT email_outbox_subject_present,
    ADD CONSTRAINT email_outbox_subject_present CHECK (subject <> '' OR refused IS NOT NULL) NOT VALID;
