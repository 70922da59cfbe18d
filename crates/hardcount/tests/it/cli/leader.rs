//! `leader status`, `pause` and `unpause`: what the operator's commands show
//! and what they refuse.

use db::Row;
use testbed::{Leg, TestDb};

use crate::{hardcount, text};

#[tokio::test]
async fn leader_cli_pauses_shows_and_unpauses_a_role() {
    let t = TestDb::new().await;
    let url = t.app_url(Leg::current());
    // The role loops' credential can read the status but not pause (migration
    // 0012); the refusal names the setting that fixes it.
    let out = hardcount()
        .args(["leader", "pause", "email_outbox", "--reason", "x"])
        .env("DATABASE_URL", &url)
        .output()
        .unwrap();
    let all = text(&out);
    assert!(!out.status.success(), "{all}");
    assert!(all.contains("HARDCOUNT_OPERATOR_DATABASE_URL"), "{all}");
    let operator = t.operator_url(Leg::current());
    let run = |args: &[&str]| {
        hardcount()
            .args(args)
            .env("DATABASE_URL", &url)
            .env("HARDCOUNT_OPERATOR_DATABASE_URL", &operator)
            .output()
            .unwrap()
    };

    let out = run(&[
        "leader",
        "pause",
        "email_outbox",
        "--reason",
        "rotating SMTP key",
        "--by",
        "oncall",
    ]);
    assert!(out.status.success(), "{}", text(&out));
    let out = run(&["leader", "status", "--json"]);
    assert!(out.status.success(), "{}", text(&out));
    let rows: Vec<serde_json::Value> = serde_json::from_slice(&out.stdout).unwrap();
    assert_eq!(rows.len(), 5);
    let email = rows.iter().find(|r| r["role"] == "email_outbox").unwrap();
    assert_eq!(email["state"], "paused");
    assert_eq!(email["paused_by"], "oncall");
    assert_eq!(email["pause_reason"], "rotating SMTP key");
    // The login that paused, recorded by the database (migration 0012).
    assert_eq!(email["paused_by_role"], "hardcount_operator");
    let table = run(&["leader", "status"]);
    let table = String::from_utf8_lossy(&table.stdout).into_owned();
    assert!(
        table.contains("paused by oncall: rotating SMTP key (login hardcount_operator)"),
        "{table}"
    );

    let out = run(&["leader", "unpause", "email_outbox"]);
    assert!(out.status.success(), "{}", text(&out));
    let rows: Vec<serde_json::Value> =
        serde_json::from_slice(&run(&["leader", "status", "--json"]).stdout).unwrap();
    assert_eq!(
        rows.iter().find(|r| r["role"] == "email_outbox").unwrap()["state"],
        "idle"
    );

    let out = run(&["leader", "pause", "emails", "--reason", "x"]);
    let all = text(&out);
    assert_eq!(out.status.code(), Some(2), "{all}");
    assert!(all.contains("unknown role \"emails\""), "{all}");
}

/// Issue 12, point 9: `leader status` printed `--reason` raw, so a reason
/// holding an escape sequence drove the operator's terminal; and `--reason` had
/// no length limit. The reason is set here through `leader_pause` directly (as
/// any holder of the credential could); the table shows it escaped. Fails
/// without `printable` in `print_status` (checked: ESC reached stdout) or
/// without the length check (the 501-character reason was stored).
#[tokio::test]
async fn leader_status_escapes_control_characters_and_pause_bounds_its_reason() {
    let t = TestDb::new().await;
    let url = t.operator_url(Leg::current());
    let run = |args: &[&str]| {
        hardcount()
            .args(args)
            .env("HARDCOUNT_OPERATOR_DATABASE_URL", &url)
            .output()
            .unwrap()
    };
    t.operator()
        .execute(
            db::sql("SELECT leader_pause('billing', $1, $2)")
                .bind("oncall\u{1b}]0;owned\u{7}".to_owned())
                .bind("disk \u{1b}[2J full\nnext line".to_owned()),
        )
        .await
        .unwrap();
    let out = run(&["leader", "status"]);
    assert!(out.status.success(), "{}", text(&out));
    assert!(
        !out.stdout.iter().any(|b| *b == 0x1b || *b == 0x07),
        "{}",
        text(&out)
    );
    let table = String::from_utf8_lossy(&out.stdout);
    assert!(
        table
            .contains("paused by oncall\\u{1b}]0;owned\\u{7}: disk \\u{1b}[2J full\\u{a}next line"),
        "{table}"
    );

    let long = "x".repeat(501);
    let out = run(&["leader", "pause", "email_outbox", "--reason", &long]);
    let all = text(&out);
    assert_eq!(out.status.code(), Some(1), "{all}");
    assert!(
        all.contains("--reason is 501 characters; at most 500"),
        "{all}"
    );
    let paused: bool =
        t.db.fetch_one(db::sql(
            "SELECT paused_at IS NOT NULL AS p FROM leader_leases WHERE role = 'email_outbox'",
        ))
        .await
        .unwrap()
        .get("p");
    assert!(!paused);
}

/// Issue 28, point 5: `leader status` shows each role's schedule, last slot
/// and next slot, in the table and in `--json`. The values are written here
/// as a completed cron tick's RELEASE writes them (migration 0034).
#[tokio::test]
async fn leader_status_shows_the_schedule_and_its_last_and_next_slot() {
    let t = TestDb::new().await;
    let url = t.operator_url(Leg::current());
    let mut su = t.superuser().await;
    sqlx::raw_sql(
        "UPDATE leader_leases SET schedule = 'CRON_TZ=Europe/Berlin 0 0 9 * * MON-FRI', \
                last_slot = '2026-12-01 08:00:00+00', next_slot = '2026-12-02 08:00:00+00' \
         WHERE role = 'dunning'",
    )
    .execute(&mut su)
    .await
    .unwrap();
    let run = |args: &[&str]| {
        hardcount()
            .args(args)
            .env("HARDCOUNT_OPERATOR_DATABASE_URL", &url)
            .output()
            .unwrap()
    };
    let out = run(&["leader", "status"]);
    assert!(out.status.success(), "{}", text(&out));
    let table = String::from_utf8_lossy(&out.stdout).into_owned();
    assert!(
        table.lines().next().unwrap().contains("SCHEDULE"),
        "{table}"
    );
    let dunning = table.lines().find(|l| l.starts_with("dunning")).unwrap();
    assert!(
        dunning.contains("CRON_TZ=Europe/Berlin 0 0 9 * * MON-FRI")
            && dunning.contains("2026-12-01 08:00:00+00")
            && dunning.contains("2026-12-02 08:00:00+00"),
        "{table}"
    );
    let rows: Vec<serde_json::Value> =
        serde_json::from_slice(&run(&["leader", "status", "--json"]).stdout).unwrap();
    let row = rows.iter().find(|r| r["role"] == "dunning").unwrap();
    assert_eq!(row["schedule"], "CRON_TZ=Europe/Berlin 0 0 9 * * MON-FRI");
    assert_eq!(row["next_slot_epoch"], 1_796_198_400.0);
}
