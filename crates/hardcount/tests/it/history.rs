//! `hardcount leader history` (issue 27, point 1): the lease history as the
//! operator reads it.

use std::time::Duration;

use leader::Role;
use leader::store::{self, Acquire, Release};
use testbed::{Leg, TestDb};

use crate::{hardcount, text};

/// Two terms of billing (the first released, the second held) and one of
/// dunning: the command lists them newest first, per role, bounded by
/// `--limit`, and refuses a limit of 0.
///
/// Catches: a history that reads `leader_leases` instead of the terms (one
/// row per role), or a role filter that is ignored.
#[tokio::test]
async fn leader_history_lists_terms_newest_first_by_role_and_limit() {
    let t = TestDb::new().await;
    let timing = leader::Timing::ADR;
    let mut tokens = Vec::new();
    for (role, holder) in [
        (Role::Billing, "first:1:00000000"),
        (Role::Dunning, "other:1:00000000"),
        (Role::Billing, "second:1:00000000"),
    ] {
        let Acquire::Won { token, .. } = store::acquire(
            &t.db,
            role,
            holder,
            timing.ttl,
            Duration::ZERO,
            timing.statement_timeout,
        )
        .await
        .unwrap() else {
            panic!("{role} is acquired")
        };
        if holder == "first:1:00000000" {
            store::release(
                &t.db,
                role,
                token,
                Release::MoreWork,
                Duration::ZERO,
                timing.failure_cooldown,
                &store::SlotStamp::default(),
                timing.statement_timeout,
            )
            .await
            .unwrap();
        }
        tokens.push(token);
    }
    let operator = t.operator_url(Leg::current());
    let run = |args: &[&str]| {
        hardcount()
            .args(args)
            .env("HARDCOUNT_OPERATOR_DATABASE_URL", &operator)
            .output()
            .unwrap()
    };
    let out = run(&["leader", "history", "billing", "--json"]);
    assert!(out.status.success(), "{}", text(&out));
    let rows: Vec<serde_json::Value> = serde_json::from_slice(&out.stdout).unwrap();
    let seen: Vec<(&str, &str, &str)> = rows
        .iter()
        .map(|r| {
            (
                r["holder_id"].as_str().unwrap(),
                r["state"].as_str().unwrap(),
                r["tick_end"].as_str().unwrap_or("-"),
            )
        })
        .collect();
    assert_eq!(
        seen,
        [
            ("second:1:00000000", "held", "-"),
            ("first:1:00000000", "released", "more_work")
        ]
    );
    assert_eq!(rows[0]["token"], tokens[2]);

    let out = run(&["leader", "history", "--limit", "2"]);
    let table = String::from_utf8_lossy(&out.stdout).into_owned();
    assert!(out.status.success(), "{}", text(&out));
    assert!(table.contains("second:1:00000000"), "{table}");
    assert!(table.contains("other:1:00000000"), "{table}");
    assert!(!table.contains("first:1:00000000"), "{table}");
    assert!(table.contains("2 term(s)"), "{table}");
    assert!(!table.contains("OVERLAP"), "{table}");

    let out = run(&["leader", "history", "--limit", "0"]);
    assert_eq!(out.status.code(), Some(2), "{}", text(&out));
}

/// Two terms of one role that overlap (written by hand: the lease design
/// rules them out) are named on standard error and fail the command, with
/// `--json` too, whose standard output stays the terms as JSON; the command
/// exited 0 and `--json` did not look (docs/adr/0117). Mutation
/// `history_overlap_exits_0` seen failing it.
#[tokio::test]
async fn an_overlap_in_the_history_fails_the_command() {
    let t = TestDb::new().await;
    let mut su = t.superuser().await;
    sqlx::query(
        "INSERT INTO leader_terms (role, token, holder_id, acquired_at, expires_at, released_at, \
                                   tick_end) \
         VALUES ('dunning', 1, 'a:1:00000000', now() - interval '60 s', now() - interval '30 s', \
                 now() - interval '30 s', 'completed'), \
                ('dunning', 2, 'b:1:00000000', now() - interval '40 s', now() - interval '10 s', \
                 now() - interval '10 s', 'completed')",
    )
    .execute(&mut su)
    .await
    .unwrap();
    let operator = t.operator_url(Leg::current());
    for json in [false, true] {
        let mut args = vec!["leader", "history", "dunning"];
        if json {
            args.push("--json");
        }
        let out = hardcount()
            .args(&args)
            .env("HARDCOUNT_OPERATOR_DATABASE_URL", &operator)
            .output()
            .unwrap();
        assert!(!out.status.success(), "{json}: {}", text(&out));
        let stderr = String::from_utf8_lossy(&out.stderr);
        assert!(
            stderr.contains("OVERLAP: dunning token 2 began 10.000 s before token 1 ended"),
            "{stderr}"
        );
        if json {
            let rows: Vec<serde_json::Value> = serde_json::from_slice(&out.stdout).unwrap();
            assert_eq!(rows.len(), 2);
        }
    }
}
