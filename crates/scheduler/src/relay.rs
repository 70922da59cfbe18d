//! Claims made for a role by another role of the same process
//! (docs/adr/0087): the webhook fan-out hands deliveries to the delivery role
//! when that role leads here, through the delivery role's [`crate::Wake`],
//! instead of leaving them for a claim statement (a `webhook_handoffs` row
//! stands for them until the delivery role writes them, docs/adr/0124).
//!
//! The receiving role publishes its lead while a tick runs ([`Relay::lead`]):
//! its fence token, the claim lease and how many rows, and how many bytes of
//! them, may wait. The sender
//! reads it ([`Relay::offer`]) and proves that token in its own statement
//! (`leader_fence`), so a lead that ended meanwhile claims nothing. The rows
//! wait here with the instant they were claimed at; the receiver takes them
//! before it claims ([`Relay::take`]), and a row that waits past its lease is
//! simply claimed again, as a claim whose worker died is (for the webhook
//! roles: inserted pending by the fan-out once its handoff's lease ends).
//!
//! A sender that finds the room more than half taken waits for the receiver
//! to take ([`Relay::offer_with_room`], docs/adr/0125) instead of writing what
//! does not fit where the receiver's claim statement would read it again.

use std::any::Any;
use std::collections::VecDeque;
use std::sync::Mutex;
use std::sync::atomic::{AtomicUsize, Ordering::Relaxed};
use std::time::{Duration, Instant};

use tokio::sync::Notify;

/// What the receiving role lets a sender claim for it now.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Offer {
    /// The receiving tick's fence token, to prove in the sender's statement.
    pub token: i64,
    /// The claim lease the receiver would set itself.
    pub lease: Duration,
    /// How many more rows may wait to be taken.
    pub room: usize,
    /// How many more bytes (as the sender counts them: the rows' payloads)
    /// may wait: rows alone do not bound the memory they hold.
    pub bytes: usize,
    /// The receiver had room within the sender's wait
    /// ([`Relay::offer_with_room`]): the sender claims only about what fits
    /// and leaves the rest where it waits. Otherwise (a plain
    /// [`Relay::offer`], or a wait that ran out) it claims as it would
    /// without an offer and hands over what fits.
    pub bounded: bool,
}

/// How full the relay is, as a sender waiting for room sees it.
enum Room {
    /// No receiver leads.
    Unled,
    /// The receiver leads open with more than half its rows or bytes waiting.
    Filling,
    /// The receiver leads, closed or with room.
    Free,
}

/// Rows claimed for a role by another, waiting to be taken. Cheap to share
/// (the [`crate::Wake`] holds it); every method takes one short lock.
#[derive(Debug, Default)]
pub struct Relay {
    state: Mutex<State>,
    /// Told when rows are taken or the lead changes: a sender waiting for
    /// room looks again.
    changed: Notify,
    /// Senders waiting for room now.
    senders: AtomicUsize,
}

/// One sender counted in [`Relay::senders_waiting`] until dropped.
struct Waiting<'a>(&'a AtomicUsize);

impl Drop for Waiting<'_> {
    fn drop(&mut self) {
        self.0.fetch_sub(1, Relaxed);
    }
}

#[derive(Debug, Default)]
struct State {
    lead: Option<Lead>,
    /// Each row with the instant it was claimed at and its size in bytes.
    /// The relay does not know what the roles hand over: the sender's type
    /// is the receiver's ([`Relay::take`]).
    rows: VecDeque<(Instant, Box<dyn Any + Send>, usize)>,
    /// The sum of the waiting rows' sizes.
    bytes: usize,
}

#[derive(Debug, Clone, Copy)]
struct Lead {
    token: i64,
    lease: Duration,
    capacity: usize,
    bytes: usize,
}

impl Relay {
    /// The receiving role leads under `token` until [`Relay::unlead`]: a
    /// sender may claim for it with `lease`, while fewer than `capacity` rows
    /// and fewer than `bytes` bytes of them wait.
    pub fn lead(&self, token: i64, lease: Duration, capacity: usize, bytes: usize) {
        self.lock().lead = Some(Lead {
            token,
            lease,
            capacity,
            bytes,
        });
        self.changed.notify_waiters();
    }

    /// The tick that led under `token` ended: no more claims for it. A later
    /// tick's lead is left as it is.
    pub fn unlead(&self, token: i64) {
        let mut s = self.lock();
        if s.lead.is_some_and(|l| l.token == token) {
            s.lead = None;
        }
        drop(s);
        self.changed.notify_waiters();
    }

    /// What a sender may claim now; `None` while the receiver does not lead
    /// here or no room is left.
    pub fn offer(&self) -> Option<Offer> {
        let s = self.lock();
        let lead = s.lead?;
        let room = lead.capacity.saturating_sub(s.rows.len());
        let bytes = lead.bytes.saturating_sub(s.bytes);
        (room > 0 && bytes > 0).then_some(Offer {
            token: lead.token,
            lease: lead.lease,
            room,
            bytes,
            bounded: false,
        })
    }

    /// [`Relay::offer`], once the receiver has room: while it leads open (a
    /// capacity above zero) with more than half its rows or bytes waiting,
    /// wait until no more than half are, for up to `wait`. A lead that ends
    /// during the wait is waited out too (the receiver's next tick leads
    /// again after its last one collected its attempts). An offer found
    /// within the wait is [`Offer::bounded`]; after it, the offer is what
    /// room there is (`None` if none), not bounded. Without a lead when the
    /// wait begins, or with the relay closed, no wait.
    ///
    /// A sender that claims only about what a bounded offer holds leaves the
    /// rest where it waited before it was claimed, instead of writing it for
    /// the receiver's claim statement (docs/adr/0125).
    pub async fn offer_with_room(&self, wait: Duration) -> Option<Offer> {
        let until = tokio::time::Instant::now() + wait;
        let mut led = false;
        let mut waiting = None;
        loop {
            let changed = self.changed.notified();
            tokio::pin!(changed);
            // Registered before the state is read: a take between the read
            // and the wait still wakes this sender.
            changed.as_mut().enable();
            match self.room() {
                Room::Filling => led = true,
                Room::Unled if led => {}
                Room::Free | Room::Unled => {
                    return self.offer().map(|o| Offer { bounded: true, ..o });
                }
            }
            if waiting.is_none() {
                self.senders.fetch_add(1, Relaxed);
                waiting = Some(Waiting(&self.senders));
            }
            if tokio::time::timeout_at(until, changed).await.is_err() {
                return self.offer();
            }
        }
    }

    /// How many senders wait for room ([`Relay::offer_with_room`]) now.
    pub fn senders_waiting(&self) -> usize {
        self.senders.load(Relaxed)
    }

    fn room(&self) -> Room {
        let s = self.lock();
        match s.lead {
            None => Room::Unled,
            Some(l)
                if l.capacity > 0 && (s.rows.len() > l.capacity / 2 || s.bytes > l.bytes / 2) =>
            {
                Room::Filling
            }
            Some(_) => Room::Free,
        }
    }

    /// Rows a sender claimed at `at` (an instant taken before its statement
    /// was sent, so no later than the lease's start on the database), each
    /// with its size in bytes.
    pub fn hand<T: Send + 'static>(&self, at: Instant, rows: impl IntoIterator<Item = (T, usize)>) {
        let mut s = self.lock();
        for (row, bytes) in rows {
            s.bytes += bytes;
            s.rows.push_back((at, Box::new(row), bytes));
        }
    }

    /// Up to `limit` waiting rows, oldest first, each with the instant it was
    /// claimed at. A row handed as another type than `T` is taken and
    /// dropped: one relay serves one kind of row, so that is a defect of the
    /// caller, and the row is claimed again after its lease as any row that
    /// is never written.
    pub fn take<T: 'static>(&self, limit: usize) -> Vec<(Instant, T)> {
        let mut s = self.lock();
        let n = limit.min(s.rows.len());
        let taken: Vec<(Instant, Box<dyn Any + Send>, usize)> = s.rows.drain(..n).collect();
        s.bytes -= taken.iter().map(|t| t.2).sum::<usize>();
        drop(s);
        if n > 0 {
            self.changed.notify_waiters();
        }
        taken
            .into_iter()
            .filter_map(|(at, row, _)| match row.downcast::<T>() {
                Ok(row) => Some((at, *row)),
                Err(_) => {
                    debug_assert!(false, "a relay row of another type");
                    tracing::error!(
                        "a relay row of another type than its taker's was dropped; it is claimed again after its lease"
                    );
                    None
                }
            })
            .collect()
    }

    /// Rows waiting to be taken.
    pub fn waiting(&self) -> usize {
        self.lock().rows.len()
    }

    fn lock(&self) -> std::sync::MutexGuard<'_, State> {
        self.state.lock().unwrap_or_else(|p| p.into_inner())
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn an_offer_needs_a_lead_and_room_and_ends_with_its_own_tick() {
        let relay = Relay::default();
        assert_eq!(relay.offer(), None, "no lead");
        relay.lead(7, Duration::from_secs(30), 2, 100);
        assert_eq!(
            relay.offer(),
            Some(Offer {
                token: 7,
                lease: Duration::from_secs(30),
                room: 2,
                bytes: 100,
                bounded: false
            })
        );
        relay.lead(7, Duration::from_secs(30), 2, 0);
        assert_eq!(relay.offer(), None, "no bytes left");
        relay.lead(8, Duration::from_secs(30), 2, 100);
        relay.unlead(7);
        assert_eq!(
            relay.offer().map(|o| o.token),
            Some(8),
            "a later lead stays"
        );
        relay.unlead(8);
        assert_eq!(relay.offer(), None);
        assert!(relay.take::<()>(10).is_empty());
    }

    /// Without a lead, or with the relay closed (no capacity: the receiver's
    /// claim statement has a backlog), a sender does not wait; an empty open
    /// relay is offered at once.
    #[tokio::test]
    async fn an_offer_with_room_waits_only_on_an_open_relay_filling() {
        let relay = Relay::default();
        let offer = || async {
            tokio::time::timeout(
                Duration::from_secs(5),
                relay.offer_with_room(Duration::from_secs(60)),
            )
            .await
            .expect("offered without waiting")
        };
        assert_eq!(offer().await, None, "no lead");
        relay.lead(7, Duration::from_secs(30), 0, 100);
        assert_eq!(offer().await, None, "closed");
        relay.lead(7, Duration::from_secs(30), 2, 100);
        assert_eq!(offer().await.map(|o| o.room), Some(2), "empty");
    }
}
