//! Addresses checked where they are written (migration 0022, docs/adr/0027):
//! the database's `email_address_valid` and `email_mailbox_valid` against
//! lettre, address by address and code point by code point, through a real
//! connection; and the CHECKs on `customers.email` (written as the API role)
//! and `tenant_settings.email_from` (as the operator role) that use them.

use std::str::FromStr;

use db::{Db, Row, sql};
use lettre::Address;
use lettre::message::Mailbox;
use testbed::TestDb;

/// How the database's verdict on a string relates to lettre's.
#[derive(Debug, Clone, Copy, PartialEq)]
enum Verdict {
    /// Both accept it.
    Accepted,
    /// Both refuse it.
    Refused,
    /// lettre accepts it and the database refuses it: one of the corners the
    /// migration names (IDNA, White_Space at an end, display-name spacing).
    /// Never the other way round.
    OnlyLettre,
}

use Verdict::{Accepted, OnlyLettre, Refused};

/// What the outbox sends to, as a bare address: lettre takes it both as an
/// `Address` and as the `Mailbox` the outbox parses a recipient into.
fn lettre_takes_address(s: &str) -> bool {
    Address::from_str(s).is_ok() && Mailbox::from_str(s).is_ok()
}

/// What the outbox takes as a sender.
fn lettre_takes_sender(s: &str) -> bool {
    email_outbox::check_sender(s).is_ok()
}

/// Each string's verdict from the database, in one statement.
async fn database_verdicts(db: &Db, function: &'static str, strings: &[String]) -> Vec<bool> {
    let stmt = match function {
        "email_address_valid" => sql(
            "SELECT email_address_valid(s) AS ok FROM unnest($1::text[]) WITH ORDINALITY AS u(s, n) ORDER BY n",
        ),
        _ => sql(
            "SELECT email_mailbox_valid(s) AS ok FROM unnest($1::text[]) WITH ORDINALITY AS u(s, n) ORDER BY n",
        ),
    };
    db.fetch_all(stmt.bind(strings.to_vec()))
        .await
        .unwrap()
        .iter()
        .map(|r| r.get::<bool, _>("ok"))
        .collect()
}

/// Check every row of `table`: lettre's verdict (`lettre`) and the database's
/// as the row says. A string holding NUL cannot reach Postgres at all: lettre
/// must refuse it, and so must the database (by refusing the text).
async fn check(
    db: &Db,
    function: &'static str,
    lettre: fn(&str) -> bool,
    table: &[(&str, Verdict)],
) {
    let (with_nul, rows): (Vec<_>, Vec<_>) = table.iter().partition(|(s, _)| s.contains('\0'));
    let strings: Vec<String> = rows.iter().map(|(s, _)| (*s).to_owned()).collect();
    let in_db = database_verdicts(db, function, &strings).await;
    let mut wrong = Vec::new();
    for ((s, verdict), in_db) in rows.iter().zip(in_db) {
        let by_lettre = lettre(s);
        let expected = match verdict {
            Accepted => (true, true),
            Refused => (false, false),
            OnlyLettre => (true, false),
        };
        if (by_lettre, in_db) != expected {
            wrong.push(format!(
                "{s:?}: lettre {by_lettre}, database {in_db}, expected {verdict:?}"
            ));
        }
    }
    for (s, verdict) in with_nul {
        assert_eq!(verdict, Refused, "{s:?}");
        assert!(!lettre(s), "lettre took {s:?}");
        let stored = db
            .fetch_one(sql("SELECT $1::text AS s").bind((*s).to_owned()))
            .await;
        assert!(stored.is_err(), "Postgres took {s:?} as text");
    }
    assert!(wrong.is_empty(), "{}", wrong.join("\n"));
}

/// Issue 22, point 7: the database's verdict on each address is lettre's,
/// or (the rows marked) stricter, never looser. lettre's verdict is the
/// outbox's: `Address::from_str` and the `Mailbox` parse of a recipient.
///
/// Catches: the leading White_Space guard removed from `email_address_valid`
/// (`email_address_trimmed`: `"\u{a0}@…"` accepted, which lettre trims to an
/// empty local part), a quoted local part not unquoted to a dot-atom
/// (`email_address_quoted`: `"\"john..doe\""` accepted), any atext allowed at
/// a label's edge (`email_label_edges`: `ada@-example.org` accepted), a label
/// of 64 bytes (`email_label_length`).
#[tokio::test]
async fn the_database_agrees_with_lettre_on_each_address_or_is_stricter() {
    let t = TestDb::new().await;
    let long_local = format!("{}@example.org", "a".repeat(64));
    let too_long_local = format!("{}@example.org", "a".repeat(65));
    let long_label = format!("ada@{}.com", "b".repeat(63));
    let too_long_label = format!("ada@{}.com", "b".repeat(64));
    let label = "b".repeat(63);
    // 63 + 63 + 63 + 62 bytes and three dots: 254, the most lettre takes.
    let long_domain = format!("ada@{label}.{label}.{label}.{}", "c".repeat(62));
    let too_long_domain = format!("ada@{label}.{label}.{label}.{}", "c".repeat(63));
    let table: Vec<(&str, Verdict)> = vec![
        // Plain, plus tags, dots, case, digits, every atext character.
        ("ada@example.org", Accepted),
        ("Ada.Lovelace@Example.COM", Accepted),
        ("ada+billing@example.org", Accepted),
        ("first.middle.last@mail.sub.example.co.uk", Accepted),
        ("o'brien@example.ie", Accepted),
        ("!#$%&'*+-/=?^_`{|}~@example.org", Accepted),
        ("ada@localhost", Accepted),
        ("ada@192.0.2.1", Accepted),
        ("ada@b-c.example", Accepted),
        ("ada@b_c.example", Accepted),
        ("ada@b!c.example", Accepted),
        ("ada@xn--bcher-kva.example", Accepted),
        // IDN and Unicode.
        ("jörg@bücher.de", Accepted),
        ("ada@Bücher.DE", Accepted),
        ("用户@例子.广告", Accepted),
        ("почта@пример.рф", Accepted),
        ("θέμα@παράδειγμα.ελ", Accepted),
        ("ada\u{a0}lovelace@example.org", Accepted),
        ("ada@☃.net", OnlyLettre),
        ("ada@\u{301}x.example", Refused),
        ("\u{a0}ada@example.org", OnlyLettre),
        ("\u{3000}ada@example.org", OnlyLettre),
        ("\u{a0}@example.org", Refused),
        // Quoted local parts.
        ("\"john.doe\"@example.org", Accepted),
        ("\"jo\\hn\"@example.org", Accepted),
        ("\"john doe\"@example.org", Refused),
        ("\"john..doe\"@example.org", Refused),
        ("\".john\"@example.org", Refused),
        ("\"jo\\.hn\"@example.org", Accepted),
        ("\"a@b\"@example.org", Refused),
        ("\"\"@example.org", Refused),
        ("\"@example.org", Refused),
        ("\"john\".doe@example.org", Refused),
        // IP literals: lettre's Address takes them, its mailbox parser does not.
        ("ada@[192.0.2.1]", Refused),
        ("ada@[IPv6:2001:db8::1]", Refused),
        ("ada@[2001:db8::1]", Refused),
        ("ada@2001:db8::1", Refused),
        // Missing or empty parts.
        ("", Refused),
        ("plainaddress", Refused),
        ("@example.org", Refused),
        ("ada@", Refused),
        ("ada@@example.org", Refused),
        ("ada@example.org@", Refused),
        // Dots where they may not be.
        (".ada@example.org", Refused),
        ("ada.@example.org", Refused),
        ("ada..lovelace@example.org", Refused),
        ("ada@example..org", Refused),
        ("ada@.example.org", Refused),
        ("ada@example.org.", Refused),
        // Label edges.
        ("ada@-example.org", Refused),
        ("ada@example-.org", Refused),
        ("ada@_example.org", Refused),
        // Spaces.
        ("ada lovelace@example.org", Refused),
        (" ada@example.org", Refused),
        ("ada@example.org ", Refused),
        ("ada@ example.org", Refused),
        ("ada@example. org", Refused),
        ("ada @example.org", Refused),
        ("ada@exa mple.org", Refused),
        // Display names and lists are not bare addresses.
        ("Ada <ada@example.org>", Refused),
        ("<ada@example.org>", Refused),
        ("ada@example.org, bob@example.org", Refused),
        ("ada(comment)@example.org", Refused),
        // Lengths: 64 bytes of local part, 63 of a label, 254 of domain.
        (&long_local, Accepted),
        (&too_long_local, Refused),
        (&long_label, Accepted),
        (&too_long_label, Refused),
        (&long_domain, Accepted),
        (&too_long_domain, Refused),
        // Control characters, quotes and backslashes, NUL.
        ("ada\u{7}@example.org", Refused),
        ("ada\t@example.org", Refused),
        ("ada\r\n@example.org", Refused),
        ("ada@example.org\r\nBcc: eve@example.org", Refused),
        ("ada\u{7f}@example.org", Refused),
        ("ada\"@example.org", Refused),
        ("ada\\@example.org", Refused),
        ("ada@exa\u{1}mple.org", Refused),
        ("ada\0@example.org", Refused),
    ];
    check(
        &t.api(),
        "email_address_valid",
        lettre_takes_address,
        &table.iter().map(|(s, v)| (*s, *v)).collect::<Vec<_>>(),
    )
    .await;
}

/// Every code point of the Basic Multilingual Plane in three places of an
/// address: as the local part and inside a label the database agrees with
/// lettre exactly; as a label's edge it never accepts what lettre refuses.
#[tokio::test]
async fn no_code_point_makes_the_database_looser_than_lettre() {
    let t = TestDb::new().await;
    let chars: Vec<char> = (1u32..=0xFFFF).filter_map(char::from_u32).collect();
    for (place, exact) in [
        ("{}@example.org", true),
        ("ada@b{}b.example", true),
        ("ada@{}.example", false),
    ] {
        let strings: Vec<String> = chars
            .iter()
            .map(|c| place.replace("{}", &c.to_string()))
            .collect();
        let in_db = database_verdicts(&t.api(), "email_address_valid", &strings).await;
        let mut looser = Vec::new();
        let mut stricter = 0;
        for (s, in_db) in strings.iter().zip(in_db) {
            match (lettre_takes_address(s), in_db) {
                (false, true) => looser.push(format!("{s:?}")),
                (true, false) => stricter += 1,
                _ => {}
            }
        }
        assert!(
            looser.is_empty(),
            "{place}: the database takes {}",
            looser.join(", ")
        );
        if exact {
            assert_eq!(
                stricter, 0,
                "{place}: the database refuses what lettre takes"
            );
        }
    }
}

/// Senders as `tenant_settings.email_from` holds them: the database's
/// `email_mailbox_valid` against the outbox's check of `from`.
#[tokio::test]
async fn the_database_agrees_with_lettre_on_each_sender_or_is_stricter() {
    let t = TestDb::new().await;
    let table = [
        ("billing@example.com", Accepted),
        ("Example Billing <billing@example.com>", Accepted),
        ("\"Example, Inc.\" <billing@example.com>", Accepted),
        ("\"Ex \\\"Q\\\" Ltd\" <billing@example.com>", Accepted),
        ("J. Doe <j@example.com>", Accepted),
        ("Zoë Ærø <zoe@bücher.de>", Accepted),
        ("<billing@example.com>", Accepted),
        ("Billing<billing@example.com>", Accepted),
        ("\"\" <billing@example.com>", Accepted),
        ("Billing <billing@example.com", Refused),
        ("Billing billing@example.com", Refused),
        ("Billing <billing@@example.com>", Refused),
        ("Billing <>", Refused),
        ("Billing <billing@[192.0.2.1]>", Refused),
        ("Billing <\"john doe\"@example.com>", Refused),
        ("Billing <billing@example.com> x", Refused),
        ("a@b <billing@example.com>", Refused),
        ("Billing <a@example.com>, Other <b@example.com>", Refused),
        ("", Refused),
        ("not an address", Refused),
        (
            "Billing\r\nBcc: eve@example.com <billing@example.com>",
            Refused,
        ),
        ("Billing <billing@example.com>\0", Refused),
        ("  Billing <billing@example.com>", OnlyLettre),
        ("Billing  <billing@example.com>", OnlyLettre),
        ("\"Bill\u{7}\" <billing@example.com>", OnlyLettre),
    ];
    check(
        &t.operator(),
        "email_mailbox_valid",
        lettre_takes_sender,
        &table,
    )
    .await;
}

/// The CHECKs replace `customers_email_shape` and guard
/// `tenant_settings.email_from`, written as hardcount_api and (since migration
/// 0056) hardcount_operator respectively, each able to call the function its
/// writes check.
///
/// Catches: the customers CHECK not calling `email_address_valid`
/// (`customers_email_check`: `ada@@example.org` is stored), the tenant CHECK
/// missing (`tenant_email_from_check`).
#[tokio::test]
async fn customers_and_tenant_senders_are_checked_where_they_are_written() {
    let t = TestDb::new().await;
    let api = t.api_as("tenant_a");
    for (email, ok) in [
        ("ada@example.org", true),
        ("jörg@bücher.de", true),
        ("ada@@example.org", false),
        ("ada@[192.0.2.1]", false),
        ("\"john doe\"@example.org", false),
        ("ada@example.org.", false),
    ] {
        let r = api
            .execute(
                sql("INSERT INTO customers (tenant_id, email) VALUES ('tenant_a', $1)")
                    .bind(email.to_owned()),
            )
            .await;
        match (ok, r) {
            (true, Ok(1)) => {}
            (false, Err(e)) => assert_eq!(
                e.constraint(),
                Some("customers_email_valid"),
                "{email:?}: {e}"
            ),
            (_, r) => panic!("{email:?}: {r:?}"),
        }
    }
    for (i, (from, ok)) in [
        ("Shop <receipts@shop.example>", true),
        ("receipts@shop.example", true),
        ("Shop <receipts@>", false),
        ("Shop <receipts@shop.example", false),
    ]
    .into_iter()
    .enumerate()
    {
        // Operators set a tenant's sender (migration 0056).
        let r = t
            .operator()
            .execute(
                sql("INSERT INTO tenant_settings (tenant_id, email_from) VALUES ($1, $2)")
                    .bind(format!("tenant_{i}"))
                    .bind(from.to_owned()),
            )
            .await;
        match (ok, r) {
            (true, Ok(1)) => {}
            (false, Err(e)) => {
                assert_eq!(
                    e.constraint(),
                    Some("tenant_settings_email_from_valid"),
                    "{from:?}: {e}"
                )
            }
            (_, r) => panic!("{from:?}: {r:?}"),
        }
    }
}
