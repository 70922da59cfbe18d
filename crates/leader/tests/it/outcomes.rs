//! Release outcomes: completed, interrupted, lost (paused), panicked, and their precedence.

use std::panic::AssertUnwindSafe;
use std::time::{Duration, Instant};

use futures::FutureExt;
use leader::{LostReason, Role, TickEnd, TickOutcome};
use testbed::TestDb;
use tokio_util::sync::CancellationToken;

use crate::{drained, fast, lease, manager, series};

const LOST: &str = "hardcount_leader_lease_lost_total";

#[tokio::test]
async fn a_completed_tick_stamps_last_tick_and_the_role_waits_its_interval() {
    let t = TestDb::new().await;
    let (m, _) = manager(&t.db, fast(), "a");
    let shutdown = CancellationToken::new();
    let out = m
        .lead(
            Role::Billing,
            Duration::from_secs(3600),
            &shutdown,
            |_| async { TickEnd::Drained },
        )
        .await
        .unwrap();
    assert_eq!(out, TickOutcome::Completed);
    let l = lease(&t.db, Role::Billing).await;
    assert!(l.completed && l.holder_id.is_none() && l.cooldown.is_none());
    // Not due for an hour: the next poll is refused and told to come back at max poll.
    match m
        .lead(
            Role::Billing,
            Duration::from_secs(3600),
            &shutdown,
            |_| async { TickEnd::Drained },
        )
        .await
        .unwrap()
    {
        TickOutcome::NotLed {
            retry_in,
            paused: false,
        } => assert_eq!(retry_in, fast().max_poll),
        other => panic!("expected NotLed, got {other:?}"),
    }
}

/// Pause mid-tick: the heartbeat's next RENEW finds the holder gone, the work is
/// cancelled within one heartbeat, ACQUIRE is refused on every replica; unpause
/// makes the role due at the next poll, and leaves `not_before` alone.
///
/// Mutation check: dropping `AND holder_id IS NOT NULL` from RENEW lets the
/// paused holder keep renewing; the work is then never cancelled and this fails.
#[tokio::test]
async fn pause_mid_tick_cancels_within_a_heartbeat_and_refuses_acquire_everywhere() {
    let t = TestDb::new().await;
    let (a, a_metrics) = manager(&t.db, fast(), "a");
    let (b, _) = manager(&t.db, fast(), "b");
    let shutdown = CancellationToken::new();
    // Pausing is the operator role's (migration 0012).
    let db = t.operator();
    let paused_at = std::sync::Arc::new(std::sync::Mutex::new(None));
    let cancelled_after = {
        let paused_at = paused_at.clone();
        a.lead(
            Role::EmailOutbox,
            Duration::ZERO,
            &shutdown,
            |tick| async move {
                leader::store::pause(&db, Role::EmailOutbox, "ops", "rotating SMTP key")
                    .await
                    .unwrap();
                *paused_at.lock().unwrap() = Some(Instant::now());
                tick.cancel.cancelled().await;
                TickEnd::Drained
            },
        )
        .await
        .unwrap()
    };
    let took = paused_at.lock().unwrap().unwrap().elapsed();
    assert_eq!(cancelled_after, TickOutcome::Lost(LostReason::Paused));
    assert!(
        took <= fast().heartbeat + fast().statement_timeout,
        "cancelled {took:?} after the pause"
    );
    assert_eq!(
        series(&a_metrics, LOST, "role=\"email_outbox\",reason=\"paused\""),
        Some(1.0)
    );

    for m in [&a, &b] {
        let out = m
            .lead(Role::EmailOutbox, Duration::ZERO, &shutdown, |_| async {
                panic!("ran while paused")
            })
            .await;
        assert!(matches!(
            out.unwrap(),
            TickOutcome::NotLed { paused: true, .. }
        ));
    }
    // A cooldown set before the pause survives unpause.
    let mut su = t.superuser().await;
    sqlx::raw_sql("UPDATE leader_leases SET not_before = now() + interval '1 hour' WHERE role = 'email_outbox'")
        .execute(&mut su)
        .await
        .unwrap();
    leader::store::unpause(&t.operator(), Role::EmailOutbox)
        .await
        .unwrap();
    let l = lease(&t.db, Role::EmailOutbox).await;
    assert!(!l.paused);
    assert!(
        l.cooldown.unwrap() > 3500.0,
        "leader_unpause cleared not_before"
    );
    sqlx::raw_sql("UPDATE leader_leases SET not_before = NULL WHERE role = 'email_outbox'")
        .execute(&mut su)
        .await
        .unwrap();
    let out = b
        .lead(Role::EmailOutbox, Duration::ZERO, &shutdown, |_| async {
            TickEnd::Drained
        })
        .await
        .unwrap();
    assert_eq!(
        out,
        TickOutcome::Completed,
        "unpaused role is due at the next poll"
    );
}

/// Shutdown mid-tick releases at once, with no cooldown, and another manager
/// acquires on its next poll (docs/adr/0003).
#[tokio::test]
async fn clean_shutdown_releases_at_once_and_another_manager_acquires() {
    let t = TestDb::new().await;
    let (a, _) = manager(&t.db, fast(), "a");
    let (b, _) = manager(&t.db, fast(), "b");
    let shutdown = CancellationToken::new();
    let trigger = shutdown.clone();
    let started = Instant::now();
    let out = a
        .lead(
            Role::WebhookOutbox,
            Duration::from_secs(60),
            &shutdown,
            |tick| async move {
                trigger.cancel();
                tick.cancel.cancelled().await;
                TickEnd::Drained
            },
        )
        .await
        .unwrap();
    assert_eq!(out, TickOutcome::Interrupted);
    assert!(
        started.elapsed() < Duration::from_millis(500),
        "{:?}",
        started.elapsed()
    );
    let l = lease(&t.db, Role::WebhookOutbox).await;
    assert!(l.holder_id.is_none() && !l.completed && l.cooldown.is_none());
    let out = drained(&b, Role::WebhookOutbox, Duration::from_secs(60)).await;
    assert_eq!(out, TickOutcome::Completed);
}

/// A panicking tick is released as not completed, with a full-interval cooldown,
/// `panicked` counted, and the panic continues to the caller.
///
/// Mutation check: releasing a panicked tick as `completed` (a panic is never a
/// completion, docs/design.md §5) stamps `last_tick_ended_at`; this test then
/// fails.
#[tokio::test]
async fn a_panicking_tick_is_not_a_completion() {
    let t = TestDb::new().await;
    let (m, metrics) = manager(&t.db, fast(), "a");
    let shutdown = CancellationToken::new();
    let r = AssertUnwindSafe(m.lead(
        Role::Billing,
        Duration::from_secs(600),
        &shutdown,
        |_| async { panic!("malformed row 42") },
    ))
    .catch_unwind()
    .await;
    let payload = r.expect_err("the panic continues to the caller");
    assert_eq!(payload.downcast_ref::<&str>(), Some(&"malformed row 42"));
    let l = lease(&t.db, Role::Billing).await;
    assert!(!l.completed && l.holder_id.is_none());
    let cooldown = l.cooldown.expect("a cooldown");
    assert!((590.0..=600.0).contains(&cooldown), "cooldown {cooldown}");
    assert_eq!(
        series(&metrics, LOST, "role=\"billing\",reason=\"panicked\""),
        Some(1.0)
    );
}

/// A tick that shutdown cancelled and that then panics is released as
/// interrupted (a deploy adds no wait), and the panic is still reported.
#[tokio::test]
async fn a_panic_after_shutdown_is_released_as_interrupted() {
    let t = TestDb::new().await;
    let (m, metrics) = manager(&t.db, fast(), "a");
    let shutdown = CancellationToken::new();
    let trigger = shutdown.clone();
    let r = AssertUnwindSafe(m.lead(
        Role::Dunning,
        Duration::from_secs(600),
        &shutdown,
        |tick| async move {
            trigger.cancel();
            tick.cancel.cancelled().await;
            panic!("panicked while winding down")
        },
    ))
    .catch_unwind()
    .await;
    assert!(r.is_err());
    let l = lease(&t.db, Role::Dunning).await;
    assert!(!l.completed && l.holder_id.is_none());
    assert!(l.cooldown.is_none(), "an interrupted tick gets no cooldown");
    assert_eq!(
        series(&metrics, LOST, "role=\"dunning\",reason=\"panicked\""),
        Some(1.0)
    );
}

/// A tick whose lease was lost and whose work then panics reports only the loss.
#[tokio::test]
async fn a_panic_after_a_lost_lease_reports_only_the_loss() {
    let t = TestDb::new().await;
    let (m, metrics) = manager(&t.db, fast(), "a");
    let shutdown = CancellationToken::new();
    let db = t.operator();
    let r = AssertUnwindSafe(m.lead(
        Role::WebhookDelivery,
        Duration::from_secs(600),
        &shutdown,
        |tick| async move {
            leader::store::pause(&db, Role::WebhookDelivery, "ops", "test")
                .await
                .unwrap();
            tick.cancel.cancelled().await;
            panic!("panicked on the cancelled tick")
        },
    ))
    .catch_unwind()
    .await;
    assert!(r.is_err(), "the panic still continues");
    assert_eq!(
        series(
            &metrics,
            LOST,
            "role=\"webhook_delivery\",reason=\"paused\""
        ),
        Some(1.0)
    );
    assert_eq!(
        series(
            &metrics,
            LOST,
            "role=\"webhook_delivery\",reason=\"panicked\""
        ),
        None
    );
}

/// `TickEnd::DrainedDueNow` (docs/adr/0014) is released as completed (stamped,
/// no cooldown) and leaves the role due at once: an hourly role is acquired
/// again by the next poll, and after a plain `Drained` it is not.
///
/// Mutation check: releasing it as `Completed` (stamped now) makes the second
/// poll wait the hour and this test fails (scripts/mutation-check
/// `due_now_as_completed`).
#[tokio::test]
async fn a_tick_drained_due_now_is_stamped_completed_and_due_again_at_once() {
    let t = TestDb::new().await;
    let (m, _) = manager(&t.db, fast(), "a");
    let shutdown = CancellationToken::new();
    let hour = Duration::from_secs(3600);
    let out = m
        .lead(Role::Billing, hour, &shutdown, |_| async {
            TickEnd::DrainedDueNow
        })
        .await
        .unwrap();
    assert_eq!(out, TickOutcome::Completed);
    let l = lease(&t.db, Role::Billing).await;
    assert!(l.completed && l.holder_id.is_none() && l.cooldown.is_none());
    let again = m
        .lead(Role::Billing, hour, &shutdown, |_| async {
            TickEnd::Drained
        })
        .await
        .unwrap();
    assert_eq!(again, TickOutcome::Completed, "due again at once");
    let after_drained = m
        .lead(Role::Billing, hour, &shutdown, |_| async {
            TickEnd::Drained
        })
        .await
        .unwrap();
    assert!(
        matches!(after_drained, TickOutcome::NotLed { .. }),
        "{after_drained:?}"
    );
}

/// A waiter polls a lease another replica holds every `held_poll` (1 s with
/// the design's timings), not every `max_poll` (5 s): a holder that shuts
/// down releases at once, so the waiter's next poll, at most a second away,
/// takes the role (issue 27: a SIGTERMed leader replaced within 1.5 s at the
/// median; docs/adr/0047). A lease nobody holds keeps the 5 s poll.
///
/// Mutation check: `false AS held` in ACQUIRE (or `poll_cap` returning
/// `max_poll` whatever it is told) sends the waiter away for 5 s and this
/// fails.
#[tokio::test]
async fn a_held_lease_is_polled_every_held_poll_so_a_release_on_shutdown_is_seen_within_it() {
    let t = TestDb::new().await;
    let design = leader::Timing::ADR;
    let (a, _) = manager(&t.db, design, "a");
    let (b, _) = manager(&t.db, design, "b");
    let shutdown = CancellationToken::new();
    let (started, mut is_started) = tokio::sync::mpsc::channel::<()>(1);
    let holder = tokio::spawn({
        let shutdown = shutdown.clone();
        async move {
            a.lead(
                Role::Dunning,
                Duration::from_secs(3600),
                &shutdown,
                |tick| async move {
                    let _ = started.send(()).await;
                    tick.cancel.cancelled().await;
                    TickEnd::Drained
                },
            )
            .await
            .unwrap()
        }
    });
    is_started.recv().await.unwrap();
    let retry_in = match drained(&b, Role::Dunning, Duration::from_secs(3600)).await {
        TickOutcome::NotLed { retry_in, .. } => retry_in,
        other => panic!("expected NotLed while a holds the lease, got {other:?}"),
    };
    assert_eq!(
        retry_in, design.held_poll,
        "a held lease (expiring in about 10 s) is polled again after held_poll"
    );
    shutdown.cancel();
    assert_eq!(holder.await.unwrap(), TickOutcome::Interrupted);
    tokio::time::sleep(retry_in).await;
    let out = drained(&b, Role::Dunning, Duration::from_secs(3600)).await;
    assert_eq!(
        out,
        TickOutcome::Completed,
        "released on shutdown: due at once"
    );
    // Completed and due in an hour, held by nobody: the poll waits max_poll.
    match drained(&b, Role::Dunning, Duration::from_secs(3600)).await {
        TickOutcome::NotLed { retry_in, .. } => assert_eq!(retry_in, design.max_poll),
        other => panic!("expected NotLed, got {other:?}"),
    }
}

/// A tick whose lease expires under it, with nobody taking over, and which
/// then says it drained (its claims, fenced, found nothing), ends lost: the
/// manager reports `Lost(Expired)`, counts `reason="expired"` and the tick as
/// `lost`, and the lease keeps no completed tick, so the role is due again
/// after the lost cooldown instead of its hour (docs/adr/0145).
///
/// Mutation check: the manager keeping its own outcome after the release's
/// downgrade (`expired_reported_completed`) reports `Completed`, and this
/// test fails.
#[tokio::test]
async fn a_tick_whose_lease_expired_under_it_ends_lost_not_completed() {
    let t = TestDb::new().await;
    let (m, metrics) = manager(&t.db, fast(), "a");
    let shutdown = CancellationToken::new();
    let url = t.superuser_url();
    let out = m
        .lead(
            Role::Billing,
            Duration::from_secs(3600),
            &shutdown,
            |_| async move {
                let mut su = <sqlx::PgConnection as sqlx::Connection>::connect(&url)
                    .await
                    .unwrap();
                sqlx::query(
                    "UPDATE leader_leases SET expires_at = statement_timestamp() - interval '1 second' \
                     WHERE role = 'billing'",
                )
                .execute(&mut su)
                .await
                .unwrap();
                TickEnd::Drained
            },
        )
        .await
        .unwrap();
    assert_eq!(out, TickOutcome::Lost(LostReason::Expired));
    let l = lease(&t.db, Role::Billing).await;
    assert!(
        !l.completed && l.holder_id.is_none(),
        "not completed, released"
    );
    assert!(l.cooldown.is_some(), "the lost cooldown");
    assert_eq!(
        series(&metrics, LOST, "role=\"billing\",reason=\"expired\""),
        Some(1.0)
    );
}
