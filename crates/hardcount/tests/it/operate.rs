//! `hardcount leader clear-cooldown` and `hardcount leader status --watch`
//! (issue 25, point 5) as the real binary against the bed's Postgres.

use std::io::Read;
use std::process::Stdio;
use std::time::{Duration, Instant};

use db::Row;
use testbed::{Leg, TestDb};

use crate::{hardcount, text};

/// The `not_before` still ahead for `role`, in seconds (None when none holds).
async fn cooldown_left(t: &TestDb, role: &str) -> Option<f64> {
    t.db.fetch_one(
        db::sql(
            "SELECT extract(epoch FROM not_before - now())::float8 AS left_secs \
             FROM leader_leases WHERE role = $1 AND not_before > now()",
        )
        .bind(role.to_owned()),
    )
    .await
    .ok()
    .map(|r| r.get("left_secs"))
}

/// A cooldown left by a lost or panicked tick is cleared by the operator, who
/// is told how much was left; a pause stays; a second clear says there was
/// none; the app's credential is refused naming the setting; an unknown role is
/// refused by the parser.
///
/// Catches: the function not clearing `not_before` (the role stays
/// `cooling_down`), clearing a pause with it, or running as its caller (the
/// operator has no UPDATE on leader_leases and is refused).
#[tokio::test]
async fn clear_cooldown_makes_a_cooling_role_due_and_leaves_a_pause() {
    let t = TestDb::new().await;
    let mut su = t.superuser().await;
    sqlx::raw_sql(
        "UPDATE leader_leases SET not_before = now() + interval '1 hour' \
         WHERE role IN ('billing', 'dunning'); \
         SELECT leader_pause('dunning', 'oncall', 'provider incident')",
    )
    .execute(&mut su)
    .await
    .unwrap();
    let app = t.app_url(Leg::current());
    let operator = t.operator_url(Leg::current());
    let run = |url: &str, args: &[&str]| {
        hardcount()
            .args(args)
            .env("HARDCOUNT_OPERATOR_DATABASE_URL", url)
            .output()
            .unwrap()
    };

    let out = run(&app, &["leader", "clear-cooldown", "billing"]);
    let all = text(&out);
    assert_eq!(out.status.code(), Some(1), "{all}");
    assert!(all.contains("HARDCOUNT_OPERATOR_DATABASE_URL"), "{all}");
    assert!(cooldown_left(&t, "billing").await.is_some());

    let state = |role: &'static str| {
        let out = run(&operator, &["leader", "status", "--json"]);
        assert!(out.status.success(), "{}", text(&out));
        let rows: Vec<serde_json::Value> = serde_json::from_slice(&out.stdout).unwrap();
        rows.iter().find(|r| r["role"] == role).unwrap()["state"]
            .as_str()
            .unwrap()
            .to_owned()
    };
    assert_eq!(state("billing"), "cooling_down");

    let out = run(&operator, &["leader", "clear-cooldown", "billing"]);
    let all = text(&out);
    assert!(out.status.success(), "{all}");
    assert!(
        all.contains("cleared the cooldown of billing (3600s were left)")
            || all.contains("cleared the cooldown of billing (3599s were left)"),
        "{all}"
    );
    assert_eq!(cooldown_left(&t, "billing").await, None);
    assert_eq!(state("billing"), "idle");

    let out = run(&operator, &["leader", "clear-cooldown", "billing"]);
    let all = text(&out);
    assert!(out.status.success(), "{all}");
    assert!(all.contains("billing had no cooldown"), "{all}");

    // Paused and cooling down: the cooldown goes, the pause stays.
    let out = run(&operator, &["leader", "clear-cooldown", "dunning"]);
    let all = text(&out);
    assert!(out.status.success(), "{all}");
    assert!(all.contains("it is still paused"), "{all}");
    assert_eq!(cooldown_left(&t, "dunning").await, None);
    assert_eq!(state("dunning"), "paused");

    let out = run(&operator, &["leader", "clear-cooldown", "billings"]);
    let all = text(&out);
    assert_eq!(out.status.code(), Some(2), "{all}");
    assert!(all.contains("unknown role \"billings\""), "{all}");
}

/// `--watch` redraws the table each second, shows a change made between two
/// frames, and ends with status 0 on Ctrl-C (SIGINT).
///
/// Catches: a watch that prints once and exits (no second frame), one that
/// does not reread the view (the pause never shows), and Ctrl-C reported as a
/// failure (`interrupted`, status 1).
#[tokio::test]
async fn status_watch_redraws_each_second_until_ctrl_c() {
    let t = TestDb::new().await;
    let spawned = Instant::now();
    let mut child = hardcount()
        .args(["leader", "status", "--watch"])
        .env(
            "HARDCOUNT_OPERATOR_DATABASE_URL",
            t.operator_url(Leg::current()),
        )
        .stdout(Stdio::piped())
        .stderr(Stdio::piped())
        .spawn()
        .unwrap();
    let mut stdout = child.stdout.take().unwrap();
    let (tx, rx) = std::sync::mpsc::channel::<Vec<u8>>();
    std::thread::spawn(move || {
        let mut buf = [0u8; 4096];
        while let Ok(n) = stdout.read(&mut buf) {
            if n == 0 || tx.send(buf[..n].to_vec()).is_err() {
                break;
            }
        }
    });
    let mut seen = String::new();
    let frames = |s: &str| s.matches("\x1b[H\x1b[2J").count();
    let wait_for = |what: &dyn Fn(&str) -> bool, seen: &mut String| {
        let deadline = Instant::now() + Duration::from_secs(15);
        while !what(seen) {
            assert!(Instant::now() < deadline, "watch output so far:\n{seen}");
            if let Ok(chunk) = rx.recv_timeout(Duration::from_millis(100)) {
                seen.push_str(&String::from_utf8_lossy(&chunk));
            }
        }
    };
    wait_for(
        &|s| frames(s) >= 1 && s.contains("webhook_delivery"),
        &mut seen,
    );
    t.operator()
        .execute(db::sql(
            "SELECT leader_pause('email_outbox', 'oncall', 'watched from another terminal')",
        ))
        .await
        .unwrap();
    wait_for(
        &|s| s.contains("paused by oncall: watched from another terminal"),
        &mut seen,
    );
    let n = frames(&seen);
    assert!(n >= 2, "{n} frames:\n{seen}");
    // About one frame a second, not a busy loop.
    let most = spawned.elapsed().as_secs() as usize + 2;
    assert!(n <= most, "{n} frames in {:?}", spawned.elapsed());
    let ok = std::process::Command::new("kill")
        .args(["-INT", &child.id().to_string()])
        .status()
        .unwrap()
        .success();
    assert!(ok);
    let deadline = Instant::now() + Duration::from_secs(10);
    let status = loop {
        if let Some(status) = child.try_wait().unwrap() {
            break status;
        }
        assert!(Instant::now() < deadline, "watch did not stop on SIGINT");
        std::thread::sleep(Duration::from_millis(50));
    };
    let mut err = String::new();
    child
        .stderr
        .take()
        .unwrap()
        .read_to_string(&mut err)
        .unwrap();
    assert_eq!(status.code(), Some(0), "stderr:\n{err}\nstdout:\n{seen}");
}
