//! Deliveries the fan-out of this process handed over unwritten
//! (docs/adr/0124): each is known here by a negative id of this process until
//! its row is inserted, and each fan-out's handoff by how many of its pairs
//! are still to be written. No SQL and no I/O.

use std::collections::HashMap;
use std::sync::Mutex;
use std::time::{Duration, Instant};

use crate::store::Pair;

/// The unwritten deliveries of this process. Every method takes one short
/// lock.
#[derive(Debug, Default)]
pub(crate) struct Unwritten {
    state: Mutex<State>,
}

#[derive(Debug, Default)]
struct State {
    /// The last key given out: keys count down from -1, so they never meet a
    /// delivery's id.
    last: i64,
    /// Each unwritten delivery by its key, with when it was claimed.
    rows: HashMap<i64, (Pair, Instant)>,
    /// For each handoff of this process, the pairs of it not written yet. A
    /// pair whose write failed is never counted off, so its handoff is never
    /// deleted here but left to the fan-out, after its lease; the handoff is
    /// dropped from this map then, only to free it.
    /// With when its first pair was taken.
    left: HashMap<i64, (usize, Instant)>,
}

impl Unwritten {
    /// A delivery handed over, one of the `pairs` of its handoff, claimed at
    /// `since`: the key it goes by until it is written.
    pub(crate) fn adopt(&self, pair: Pair, pairs: usize, since: Instant) -> i64 {
        let mut s = self.lock();
        s.last -= 1;
        let key = s.last;
        s.left.entry(pair.handoff).or_insert((pairs, since));
        s.rows.insert(key, (pair, since));
        key
    }

    /// The delivery `key` stands for, and when it was claimed; `None` for a
    /// key of a row already written or forgotten.
    pub(crate) fn get(&self, key: i64) -> Option<(Pair, Instant)> {
        self.lock().rows.get(&key).cloned()
    }

    /// Rows now in the table (inserted, or found already written): returns
    /// the handoffs that have no pair left to write, to be deleted.
    pub(crate) fn written(&self, keys: impl IntoIterator<Item = i64>) -> Vec<i64> {
        let mut s = self.lock();
        let mut done = Vec::new();
        for key in keys {
            let Some((pair, _)) = s.rows.remove(&key) else {
                continue;
            };
            if let Some((left, _)) = s.left.get_mut(&pair.handoff) {
                *left = left.saturating_sub(1);
                if *left == 0 {
                    s.left.remove(&pair.handoff);
                    done.push(pair.handoff);
                }
            }
        }
        done
    }

    /// Rows whose write failed: forgotten, and their handoffs left to the
    /// fan-out, which inserts what is still unwritten once their lease ends.
    pub(crate) fn failed(&self, keys: impl IntoIterator<Item = i64>) {
        let mut s = self.lock();
        for key in keys {
            if let Some((pair, _)) = s.rows.remove(&key) {
                s.left.remove(&pair.handoff);
            }
        }
    }

    /// Forget rows claimed more than `age` ago (a tick dropped while they were
    /// in flight never writes them), and handoffs first taken from then (some
    /// of their pairs never were: the tick ended with them on the relay and
    /// the role moved on): their handoffs are the fan-out's.
    pub(crate) fn forget_older(&self, age: Duration) {
        let now = Instant::now();
        let old = |since: &Instant| now.saturating_duration_since(*since) > age;
        let mut s = self.lock();
        s.rows.retain(|_, (_, since)| !old(since));
        s.left.retain(|_, (_, since)| !old(since));
    }

    fn lock(&self) -> std::sync::MutexGuard<'_, State> {
        self.state.lock().unwrap_or_else(|p| p.into_inner())
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn pair(handoff: i64, endpoint_id: i64) -> Pair {
        Pair {
            tenant_id: "t".into(),
            event_id: 1,
            endpoint_id,
            handoff,
            handed_at: 0.0,
        }
    }

    #[test]
    fn a_handoff_is_done_when_its_last_pair_is_written_and_never_after_a_failure() {
        let u = Unwritten::default();
        let now = Instant::now();
        let a = u.adopt(pair(7, 1), 2, now);
        let b = u.adopt(pair(7, 2), 2, now);
        assert!(a < 0 && b < 0 && a != b, "negative keys, one each");
        assert!(u.written([a]).is_empty(), "one pair of two written");
        assert_eq!(u.written([b]), vec![7]);
        assert!(u.get(b).is_none(), "written rows are forgotten");

        let c = u.adopt(pair(8, 1), 2, now);
        let d = u.adopt(pair(8, 2), 2, now);
        u.failed([c]);
        assert!(
            u.written([d]).is_empty(),
            "a handoff with a failed write is left to the fan-out"
        );

        let e = u.adopt(pair(9, 1), 1, now - Duration::from_secs(60));
        u.forget_older(Duration::from_secs(30));
        assert!(u.get(e).is_none());
        assert!(u.written([e]).is_empty());
    }
}
