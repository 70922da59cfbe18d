//! Wake-ups: how a listening role learns, within a millisecond or two, that a
//! commit gave it work (docs/adr/0014).
//!
//! Producers call `pg_notify(channel, '')` inside their own transaction, so
//! the notification is sent only if they commit (and works through PgBouncer
//! in transaction mode). One task per replica ([`listen`]) holds a session
//! connection (`HARDCOUNT_LISTEN_URL`), LISTENs on each role's channel and
//! pokes that role's [`Wake`]. The fenced-batch driver ([`crate::drive`]) of a
//! role with a listening `Wake` keeps its tick open after a short batch and
//! waits for a poke or the role's interval, whichever comes first, then claims
//! again. A wake-up is only a hint: every claim is still fenced, and a poke
//! that finds nothing costs one empty claim.
//!
//! Loss is harmless: a notification sent while nobody listens (between ticks,
//! during a takeover) is found by the next tick's first claim, and one lost
//! while the connection is down by the claim after the reconnect (a reconnect
//! pokes every role) or, at worst, by the interval poll.

use std::sync::Arc;
use std::sync::atomic::{AtomicBool, Ordering};
use std::time::Duration;

use leader::{Role, Telemetry};
use metrics::Counter;
use tokio::sync::Notify;
use tokio_util::sync::CancellationToken;
use tracing::{info, warn};

use crate::relay::Relay;

/// The channel a role listens on and its producers notify:
/// `hardcount_wake_<role>`.
pub fn wake_channel(role: Role) -> &'static str {
    match role {
        Role::Billing => "hardcount_wake_billing",
        Role::Dunning => "hardcount_wake_dunning",
        Role::WebhookOutbox => "hardcount_wake_webhook_outbox",
        Role::EmailOutbox => "hardcount_wake_email_outbox",
        Role::WebhookDelivery => "hardcount_wake_webhook_delivery",
    }
}

/// One role's wake-up signal. Cheap to clone; the clones share the signal.
#[derive(Debug, Clone)]
pub struct Wake {
    inner: Arc<Inner>,
}

#[derive(Debug)]
struct Inner {
    channel: &'static str,
    poll: Duration,
    notify: Notify,
    listening: AtomicBool,
    /// `hardcount_wakeups_total{role}`: notifications the listener received
    /// on this role's channel.
    received: Counter,
    /// Claims another role of this process made for this one (docs/adr/0087).
    relay: Relay,
}

impl Wake {
    /// A signal for notifications on `role`'s [`wake_channel`]; an idle
    /// listening tick still claims every `poll` (the role's interval), so a
    /// lost notification costs at most that. Not listening until [`listen`]
    /// says so.
    pub fn new(role: Role, poll: Duration) -> Wake {
        Wake::reporting(role, poll, &Telemetry::noop())
    }

    /// As [`Wake::new`], counting each notification [`listen`] receives for
    /// the role in `hardcount_wakeups_total{role}`: an operator (or a test)
    /// can tell a role that is woken from one that only polls.
    pub fn reporting(role: Role, poll: Duration, telemetry: &Telemetry) -> Wake {
        let received = telemetry.counter("hardcount_wakeups_total", &[("role", role.as_str())]);
        // The series exists from the start, at 0, so a rate over it is defined.
        received.increment(0);
        Wake {
            inner: Arc::new(Inner {
                channel: wake_channel(role),
                poll,
                notify: Notify::new(),
                listening: AtomicBool::new(false),
                received,
                relay: Relay::default(),
            }),
        }
    }

    pub fn channel(&self) -> &'static str {
        self.inner.channel
    }

    pub fn poll(&self) -> Duration {
        self.inner.poll
    }

    /// The rows another role of this process claimed for this one and hands
    /// over with its poke (docs/adr/0087).
    pub fn relay(&self) -> &Relay {
        &self.inner.relay
    }

    /// Whether a session connection currently LISTENs for this role.
    pub fn is_listening(&self) -> bool {
        self.inner.listening.load(Ordering::Acquire)
    }

    /// Wake the role: the next (or current) wait returns at once. A poke while
    /// nobody waits is kept (one, not counted), so a notification that arrives
    /// while a batch runs is not lost. The listener pokes on a notification;
    /// another role of this process pokes when it commits work for this one
    /// (a hand-over, docs/adr/0070), which ends a probing or busy tick's pause
    /// even with no listener.
    pub fn poke(&self) {
        self.inner.notify.notify_one();
    }

    /// Mark the listener up or down, and poke: a tick waiting on a listener
    /// that just went down stops waiting, and one that just came up claims
    /// what was committed while nobody listened.
    pub fn set_listening(&self, on: bool) {
        self.inner.listening.store(on, Ordering::Release);
        self.poke();
    }

    /// Wait for a poke or `at_most`. True when poked.
    pub async fn wait(&self, at_most: Duration) -> bool {
        tokio::time::timeout(at_most, self.inner.notify.notified())
            .await
            .is_ok()
    }
}

/// LISTEN on `url` (a session-capable connection: Postgres directly, or a
/// session-mode pooler) for every wake's channel and poke it on each
/// notification, until `shutdown`. A lost connection marks every wake as not
/// listening (their roles poll at their interval) and is retried every
/// `retry` until it is back.
pub async fn listen(url: String, wakes: Vec<Wake>, retry: Duration, shutdown: CancellationToken) {
    let channels: Vec<&'static str> = wakes.iter().map(Wake::channel).collect();
    let set = |on: bool| wakes.iter().for_each(|w| w.set_listening(on));
    while !shutdown.is_cancelled() {
        let connected = shutdown
            .run_until_cancelled(db::Listener::connect(&url, &channels))
            .await;
        let mut listener = match connected {
            None => break,
            Some(Ok(listener)) => listener,
            Some(Err(e)) => {
                warn!(error = %e, retry = ?retry, "cannot LISTEN for wake-ups; roles poll at their interval");
                shutdown
                    .run_until_cancelled(tokio::time::sleep(retry))
                    .await;
                continue;
            }
        };
        info!(channels = ?channels, "listening for wake-ups");
        set(true);
        loop {
            match shutdown.run_until_cancelled(listener.recv()).await {
                None => break,
                Some(Ok(channel)) => {
                    for wake in wakes.iter().filter(|w| w.channel() == channel) {
                        wake.inner.received.increment(1);
                        wake.poke();
                    }
                }
                Some(Err(e)) => {
                    warn!(error = %e, "the wake-up connection failed; roles poll at their interval until it is back");
                    break;
                }
            }
        }
        set(false);
    }
    set(false);
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn each_role_has_its_own_channel() {
        let mut channels: Vec<_> = Role::ALL.iter().map(|r| wake_channel(*r)).collect();
        channels.sort_unstable();
        channels.dedup();
        assert_eq!(channels.len(), Role::ALL.len());
        assert!(channels.iter().all(|c| c.len() < 64 && c.is_ascii()));
    }

    #[tokio::test]
    async fn a_poke_before_the_wait_is_kept_and_a_quiet_wait_times_out() {
        let wake = Wake::new(Role::WebhookOutbox, Duration::from_secs(1));
        assert!(!wake.is_listening());
        wake.poke();
        wake.poke();
        assert!(wake.wait(Duration::from_millis(50)).await, "the kept poke");
        assert!(
            !wake.wait(Duration::from_millis(20)).await,
            "two pokes keep one permit"
        );
        wake.set_listening(true);
        assert!(wake.is_listening());
        assert!(wake.wait(Duration::from_millis(50)).await);
    }
}
