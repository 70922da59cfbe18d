//! The lease history (issue 27, point 1; migration 0027): every term written
//! by the lease statements themselves, read back by the operator, checked
//! for overlaps, pruned in bounded batches.

use std::time::Duration;

use db::{Db, Row};
use leader::store::{self, Acquire, Term};
use leader::{Role, overlapping_terms};
use testbed::TestDb;
use testbed::leadership::as_leader;

use crate::{fast, manager};

async fn terms(t: &TestDb, role: Role) -> Vec<Term> {
    store::history(&t.operator(), Some(role), 100)
        .await
        .unwrap()
}

/// A tick that lives past one heartbeat: its term has the holder, the
/// token ACQUIRE returned, a renewal, the release and how the tick ended.
///
/// The term is written by the lease statement itself, not by a second
/// statement after it: RENEW's stamp and the expiry it gives the term are
/// the same `statement_timestamp()` apart by exactly the TTL, which only
/// one statement's clock gives (a second statement, even in the same
/// transaction, reads a later clock).
///
/// Catches: ACQUIRE without the term's INSERT (no term), RENEW without its
/// stamp (`last_renewed_at` NULL), RELEASE without its stamp (no end).
/// Checked by hand and in scripts/mutation-check (`lease_history_acquire`, `lease_history_renew`):
/// with the `term` CTE removed from ACQUIRE, or from RENEW, this test fails.
#[tokio::test]
async fn a_tick_is_recorded_from_acquire_through_renew_to_release() {
    let t = TestDb::new().await;
    let (m, _) = manager(&t.db, fast(), "recorded");
    let token = as_leader(&m, Role::Billing, |tick| async move {
        // Three heartbeats of 300 ms: at least two RENEWs land.
        tokio::time::sleep(Duration::from_millis(900)).await;
        tick.fence.token()
    })
    .await;
    let history = terms(&t, Role::Billing).await;
    assert_eq!(history.len(), 1, "{history:?}");
    let term = &history[0];
    assert_eq!(term.token, token);
    assert_eq!(term.holder_id, m.holder_id());
    assert!(term.last_renewed_at.is_some(), "{term:?}");
    assert!(term.released_at.is_some(), "{term:?}");
    assert_eq!(term.tick_end.as_deref(), Some("completed"));
    assert_eq!(term.state, "released");
    assert!(
        term.ended_epoch_us > term.acquired_epoch_us + 800_000,
        "{term:?}"
    );
    let one_clock: bool = t
        .operator()
        .fetch_one(
            db::sql(
                "SELECT expires_at - last_renewed_at = make_interval(secs => $2) AS one_clock \
                 FROM leader_history WHERE role = 'billing' AND token = $1",
            )
            .bind(token)
            .bind(fast().ttl.as_secs_f64()),
        )
        .await
        .unwrap()
        .get("one_clock");
    assert!(
        one_clock,
        "RENEW's term stamp and its expiry come from one statement"
    );
    // The other roles were never acquired.
    assert!(terms(&t, Role::Dunning).await.is_empty());
}

/// A holder that stops (no RENEW, no RELEASE) and a successor that takes
/// over once its lease expired: two terms, the first ending at its expiry,
/// the second beginning after it, and no overlap. A term written by hand
/// inside the first one's span is found.
///
/// Catches: a check that misses an overlap (the hand-made term), or an
/// ACQUIRE that takes a held row (the takeover would overlap).
#[tokio::test]
async fn a_takeover_leaves_no_overlap_and_a_hand_made_overlap_is_found() {
    let t = TestDb::new().await;
    let timing = fast();
    let Acquire::Won { token: first, .. } = store::acquire(
        &t.db,
        Role::Dunning,
        "stopped:1:00000000",
        timing.ttl,
        Duration::ZERO,
        timing.statement_timeout,
    )
    .await
    .unwrap() else {
        panic!("the idle role is acquired")
    };
    let (b, _) = manager(&t.db, timing, "successor");
    let second = as_leader(&b, Role::Dunning, |tick| async move { tick.fence.token() }).await;
    assert!(second > first);

    let history = terms(&t, Role::Dunning).await;
    assert_eq!(history.len(), 2, "{history:?}");
    let (newer, older) = (&history[0], &history[1]);
    assert_eq!((older.token, newer.token), (first, second));
    assert_eq!(older.state, "expired");
    assert_eq!(older.released_at, None);
    assert_eq!(newer.tick_end.as_deref(), Some("completed"));
    assert!(
        newer.acquired_epoch_us >= older.ended_epoch_us,
        "{history:?}"
    );
    assert_eq!(overlapping_terms(&history), []);

    // By hand: a term that began in the middle of the first one.
    let mut su = t.superuser().await;
    sqlx::raw_sql(sqlx::AssertSqlSafe(format!(
        "INSERT INTO leader_terms (role, token, holder_id, acquired_at, expires_at) \
         SELECT role, {first} + 1, 'intruder:1:00000000', acquired_at + (expires_at - acquired_at) / 2, \
                expires_at + interval '10 seconds' \
         FROM leader_terms WHERE role = 'dunning' AND token = {first}"
    )))
    .execute(&mut su)
    .await
    .unwrap();
    let found = overlapping_terms(&terms(&t, Role::Dunning).await);
    assert_eq!(found.len(), 2, "{found:?}");
    assert_eq!(
        (found[0].earlier_token, found[0].later_token),
        (first, first + 1)
    );
    assert!(found[0].overlap_us > 0);
    // The successor began inside the intruder's span as well.
    assert_eq!(
        (found[1].earlier_token, found[1].later_token),
        (first + 1, second)
    );
}

/// An operator's pause ends the held term (tick_end `paused`), so the term
/// acquired right after an unpause does not overlap it.
///
/// Catches: leader_pause without the term's stamp: the paused term then
/// runs to its expiry and the next term overlaps it.
#[tokio::test]
async fn a_pause_ends_the_held_term_and_the_next_one_does_not_overlap_it() {
    let t = TestDb::new().await;
    let timing = leader::Timing::ADR;
    let acquire = |holder: &'static str| {
        store::acquire(
            &t.db,
            Role::EmailOutbox,
            holder,
            timing.ttl,
            Duration::ZERO,
            timing.statement_timeout,
        )
    };
    let Acquire::Won { token: paused, .. } = acquire("paused:1:00000000").await.unwrap() else {
        panic!("the idle role is acquired")
    };
    let op = t.operator();
    store::pause(&op, Role::EmailOutbox, "ops", "drill")
        .await
        .unwrap();
    store::unpause(&op, Role::EmailOutbox).await.unwrap();
    let Acquire::Won { token: next, .. } = acquire("next:1:00000000").await.unwrap() else {
        panic!("the unpaused role is acquired at once")
    };
    let history = terms(&t, Role::EmailOutbox).await;
    assert_eq!(
        history.iter().map(|h| h.token).collect::<Vec<_>>(),
        [next, paused]
    );
    assert_eq!(history[1].tick_end.as_deref(), Some("paused"));
    assert_eq!(history[0].state, "held");
    assert_eq!(overlapping_terms(&history), []);
}

/// `prune_terms` deletes terms that ended before the cutoff, oldest first,
/// at most `limit` a call, never a held one; the app role cannot call it.
///
/// Catches: a prune without its LIMIT (all old terms go at once), or one
/// that deletes a term by its start alone (the held, long-running term).
#[tokio::test]
async fn prune_deletes_old_ended_terms_a_bounded_batch_at_a_time() {
    let t = TestDb::new().await;
    let mut su = t.superuser().await;
    // Five terms that ended days ago, and one begun long ago still held.
    sqlx::raw_sql(
        "INSERT INTO leader_terms (role, token, holder_id, acquired_at, expires_at, released_at, tick_end) \
         SELECT 'billing', g, 'old:1:00000000', now() - make_interval(days => 10 - g), \
                now() - make_interval(days => 10 - g) + interval '10 seconds', \
                now() - make_interval(days => 10 - g) + interval '5 seconds', 'completed' \
         FROM generate_series(1, 5) g; \
         INSERT INTO leader_terms (role, token, holder_id, acquired_at, expires_at) \
         VALUES ('billing', 6, 'long:1:00000000', now() - interval '30 days', now() + interval '10 seconds')",
    )
    .execute(&mut su)
    .await
    .unwrap();
    let owner = Db::connect_lazy(&t.superuser_url(), 1).unwrap();
    let day = Duration::from_secs(86_400);
    assert_eq!(store::prune_terms(&owner, day, 2).await.unwrap(), 2);
    let left: Vec<i64> = terms(&t, Role::Billing)
        .await
        .iter()
        .map(|h| h.token)
        .collect();
    assert_eq!(left, [5, 4, 3, 6], "the two oldest ended terms went first");
    assert_eq!(store::prune_terms(&owner, day, 10).await.unwrap(), 3);
    assert_eq!(store::prune_terms(&owner, day, 10).await.unwrap(), 0);
    let left: Vec<i64> = terms(&t, Role::Billing)
        .await
        .iter()
        .map(|h| h.token)
        .collect();
    assert_eq!(left, [6], "a held term is kept whatever its age");

    let err = store::prune_terms(&t.db, day, 10).await.unwrap_err();
    assert!(
        matches!(&err, store::StoreError::Db(e) if e.code().as_deref() == Some("42501")),
        "{err}"
    );
    let err = store::prune_terms(&owner, day, 0).await.unwrap_err();
    assert!(
        matches!(&err, store::StoreError::Db(e) if e.code().as_deref() == Some("22023")),
        "{err}"
    );
}

/// `prune_own_terms` (migration 0030, docs/adr/0040), the app's fenced prune:
/// the leader of a role deletes that role's old ended terms and no other
/// role's, at most `limit` a call; a replaced leader's token deletes nothing.
///
/// Mutation check: removing `AND leader_fence(p_role, p_token)` from
/// `leader_terms_prune_fenced` makes the old token delete the terms; this test
/// was run against that mutation and failed, then the predicate was restored.
#[tokio::test]
async fn the_fenced_prune_deletes_only_its_roles_old_terms_and_a_stale_token_none() {
    let t = TestDb::new().await;
    let mut su = t.superuser().await;
    sqlx::raw_sql(
        "INSERT INTO leader_terms (role, token, holder_id, acquired_at, expires_at, released_at, tick_end) \
         SELECT r, -g, 'old:1:00000000', now() - interval '40 days', now() - interval '40 days', \
                now() - interval '40 days', 'completed' \
         FROM unnest(ARRAY['billing', 'dunning']) r, generate_series(1, 3) g",
    )
    .execute(&mut su)
    .await
    .unwrap();
    let month = Duration::from_secs(30 * 86_400);
    let (m, _) = manager(&t.db, fast(), "old");
    let old = as_leader(&m, Role::Billing, |tick| async move { tick.fence }).await;
    let db = &t.db;
    let (m, _) = manager(&t.db, fast(), "new");
    let (by_old, first, rest) = as_leader(&m, Role::Billing, |tick| async move {
        assert!(tick.fence.token() > old.token());
        (
            store::prune_own_terms(db, &old, month, 10).await.unwrap(),
            store::prune_own_terms(db, &tick.fence, month, 2)
                .await
                .unwrap(),
            store::prune_own_terms(db, &tick.fence, month, 10)
                .await
                .unwrap(),
        )
    })
    .await;
    assert_eq!((by_old, first, rest), (0, 2, 1));
    let left: Vec<(String, i64)> =
        sqlx::query_as("SELECT role, token FROM leader_terms WHERE token < 0 ORDER BY role, token")
            .fetch_all(&mut su)
            .await
            .unwrap();
    assert_eq!(
        left,
        [
            ("dunning".to_owned(), -3),
            ("dunning".to_owned(), -2),
            ("dunning".to_owned(), -1)
        ]
    );
}

/// An operator's pause that meets an ACQUIRE not yet committed waits for it
/// and ends the term it began (tick_end `paused`). Here the ACQUIRE's writes
/// are held open in a transaction while the pause runs, then committed.
///
/// Catches: `leader_pause` locking only a row whose committed version has a
/// holder (mutation `pause_skips_an_acquire_in_flight`, migration 0027's
/// form): it locks nothing, reads no token, and the racing term keeps no
/// release, so a later term would be reported as overlapping it.
#[tokio::test]
async fn a_pause_racing_an_acquire_ends_the_term_it_began() {
    let t = TestDb::new().await;
    let mut acquiring = t.superuser().await;
    sqlx::raw_sql("BEGIN")
        .execute(&mut acquiring)
        .await
        .unwrap();
    let token: i64 = sqlx::query_scalar(
        "WITH won AS ( \
           UPDATE leader_leases SET holder_id = 'racer:1:00000000', \
                  holder_token = (extract(epoch FROM clock_timestamp()) * 1000)::int8, \
                  expires_at = statement_timestamp() + interval '10 seconds' \
           WHERE role = 'email_outbox' RETURNING holder_token, expires_at) \
         INSERT INTO leader_terms (role, token, holder_id, acquired_at, expires_at) \
         SELECT 'email_outbox', holder_token, 'racer:1:00000000', statement_timestamp(), expires_at \
         FROM won RETURNING token",
    )
    .fetch_one(&mut acquiring)
    .await
    .unwrap();
    let op = t.operator();
    let pause = tokio::spawn(async move {
        store::pause(&op, Role::EmailOutbox, "ops", "race")
            .await
            .unwrap();
    });
    tokio::time::sleep(Duration::from_millis(300)).await;
    assert!(!pause.is_finished(), "the pause waits for the ACQUIRE");
    sqlx::raw_sql("COMMIT")
        .execute(&mut acquiring)
        .await
        .unwrap();
    pause.await.unwrap();
    let history = terms(&t, Role::EmailOutbox).await;
    let raced = history.iter().find(|h| h.token == token).unwrap();
    assert_eq!(raced.tick_end.as_deref(), Some("paused"), "{raced:?}");
    assert_ne!(raced.state, "held", "{raced:?}");
}
