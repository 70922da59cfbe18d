//! Dunning policies and what a decline does to a run: pure, no I/O.

use chrono::{DateTime, TimeDelta, Utc};

/// What exhaustion does, once.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum FinalAction {
    /// The subscription → `canceled`.
    CancelSubscription,
    /// The subscription's collection paused with the policy's
    /// [`PauseBehavior`], set by dunning (it replaces any other pause).
    PauseCollection,
    /// The invoice → `uncollectible`.
    MarkUncollectible,
}

impl FinalAction {
    pub fn as_str(self) -> &'static str {
        match self {
            FinalAction::CancelSubscription => "cancel_subscription",
            FinalAction::PauseCollection => "pause_collection",
            FinalAction::MarkUncollectible => "mark_uncollectible",
        }
    }

    /// The column's value; `None` for a value the CHECK does not allow.
    pub fn parse(s: &str) -> Option<FinalAction> {
        Some(match s {
            "cancel_subscription" => FinalAction::CancelSubscription,
            "pause_collection" => FinalAction::PauseCollection,
            "mark_uncollectible" => FinalAction::MarkUncollectible,
            _ => return None,
        })
    }
}

/// What happens to invoices made while dunning's pause holds: Stripe's three
/// `pause_collection.behavior` values.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum PauseBehavior {
    /// Kept as drafts: not finalized, announced or charged.
    KeepAsDraft,
    /// Finalized as `uncollectible`.
    MarkUncollectible,
    /// Finalized as `void`.
    Void,
}

impl PauseBehavior {
    pub fn as_str(self) -> &'static str {
        match self {
            PauseBehavior::KeepAsDraft => "keep_as_draft",
            PauseBehavior::MarkUncollectible => "mark_uncollectible",
            PauseBehavior::Void => "void",
        }
    }

    /// The column's value; `None` for a value the CHECK does not allow.
    pub fn parse(s: &str) -> Option<PauseBehavior> {
        Some(match s {
            "keep_as_draft" => PauseBehavior::KeepAsDraft,
            "mark_uncollectible" => PauseBehavior::MarkUncollectible,
            "void" => PauseBehavior::Void,
            _ => return None,
        })
    }
}

/// A tenant's retry policy.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Policy {
    /// Retry n (1-based) is due `offsets_secs[n - 1]` seconds after the first decline.
    pub offsets_secs: Vec<i64>,
    pub final_action: FinalAction,
    /// The behaviour `pause_collection` writes (unused by the other actions).
    pub pause_behavior: PauseBehavior,
    /// Retries whose decline sends a warning email (1-based).
    pub warn_after: Vec<i32>,
    /// Whether exhaustion sends a final-notice email.
    pub final_notice: bool,
}

/// The built-in default a tenant without a policy gets at its first
/// enrolment: retries 1, 3, 5 and 7 days after the first decline, a warning
/// after the first three, a final notice, and the invoice written off.
pub const DEFAULT_OFFSETS_SECS: [i64; 4] = [86_400, 3 * 86_400, 5 * 86_400, 7 * 86_400];
pub const DEFAULT_WARN_AFTER: [i32; 3] = [1, 2, 3];
pub const DEFAULT_FINAL_ACTION: FinalAction = FinalAction::MarkUncollectible;

/// The most retries a policy holds (`dunning_policies_offsets_count`).
pub const MAX_RETRIES: usize = 20;
/// The longest offset of a retry from the first decline: 366 days
/// (`dunning_policies_offsets_in_range`).
pub const MAX_OFFSET_SECS: i64 = 31_622_400;

/// Why a schedule is refused: the rules of migrations 0010 and 0021's
/// CHECKs (which the funnel's `policy_valid` repeats), each naming its field.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum ScheduleInvalid {
    #[error("a policy has 1 to {MAX_RETRIES} retries, not {0}")]
    RetryCount(usize),
    #[error("retry {index} is {secs} s after the first decline; each is 1 to {MAX_OFFSET_SECS} s")]
    Offset { index: usize, secs: i64 },
    #[error(
        "retry_offsets_secs[{index}] is {secs} s, not after the retry before it ({before} s): \
         each offset counts from the first decline, so they increase"
    )]
    NotLater {
        index: usize,
        secs: i64,
        before: i64,
    },
    #[error("warn_after names retry {retry}; a policy of {retries} retries has 1 to {retries}")]
    WarnAfter {
        index: usize,
        retry: i32,
        retries: usize,
    },
    /// A retry named twice: each is warned after at most once, so the list
    /// holds at most as many entries as the policy has retries (docs/adr/0141).
    #[error("warn_after names retry {retry} twice; each retry at most once")]
    WarnAfterRepeated { index: usize, retry: i32 },
}

impl ScheduleInvalid {
    /// The field at fault: `retry_offsets_secs`, `retry_offsets_secs[i]`
    /// or `warn_after[i]` (0-based).
    pub fn field(&self) -> String {
        match self {
            ScheduleInvalid::RetryCount(_) => "retry_offsets_secs".to_owned(),
            ScheduleInvalid::Offset { index, .. } | ScheduleInvalid::NotLater { index, .. } => {
                format!("retry_offsets_secs[{index}]")
            }
            ScheduleInvalid::WarnAfter { index, .. }
            | ScheduleInvalid::WarnAfterRepeated { index, .. } => format!("warn_after[{index}]"),
        }
    }
}

/// Check a schedule as the table's CHECKs do, so a policy the API writes is
/// one the funnel follows; and, the API's own rule, that each offset is
/// later than the one before.
///
/// # Errors
/// The first rule broken, in field order.
pub fn check_schedule(offsets_secs: &[i64], warn_after: &[i32]) -> Result<(), ScheduleInvalid> {
    if offsets_secs.is_empty() || offsets_secs.len() > MAX_RETRIES {
        return Err(ScheduleInvalid::RetryCount(offsets_secs.len()));
    }
    if let Some((index, &secs)) = offsets_secs
        .iter()
        .enumerate()
        .find(|(_, s)| !(1..=MAX_OFFSET_SECS).contains(*s))
    {
        return Err(ScheduleInvalid::Offset { index, secs });
    }
    // Not a CHECK of the table (a row written before this rule is followed
    // as it is): the API's own, since a later retry at an earlier offset
    // runs back to back with the one before (docs/adr/0117).
    if let Some(index) = (1..offsets_secs.len()).find(|&i| offsets_secs[i] <= offsets_secs[i - 1]) {
        return Err(ScheduleInvalid::NotLater {
            index,
            secs: offsets_secs[index],
            before: offsets_secs[index - 1],
        });
    }
    let retries = offsets_secs.len();
    if let Some((index, &retry)) = warn_after
        .iter()
        .enumerate()
        .find(|(_, r)| !(1..=retries as i32).contains(*r))
    {
        return Err(ScheduleInvalid::WarnAfter {
            index,
            retry,
            retries,
        });
    }
    // Each in range and none twice: at most `retries` (20) entries, where an
    // unbounded list was stored and read back with every run the listing
    // returns (docs/adr/0141).
    if let Some((index, &retry)) = warn_after
        .iter()
        .enumerate()
        .find(|(i, r)| warn_after[..*i].contains(r))
    {
        return Err(ScheduleInvalid::WarnAfterRepeated { index, retry });
    }
    Ok(())
}

/// What a decline of retry `attempt` (1-based) leads to.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum AfterDecline {
    /// The next retry, at this time.
    Next { at: DateTime<Utc> },
    /// That was the last retry: the run is exhausted.
    Exhausted,
}

impl Policy {
    /// What a decline of retry `attempt` (1-based), made (or counted) at
    /// `now`, leads to. Planned before the charge, from the run as listed.
    ///
    /// The next retry is at its offset from the first decline, but never
    /// sooner after this one than the policy's gap between the two offsets:
    /// a retry made late (collection paused, a business window shut, the
    /// role down) moves the rest of the schedule on by its lateness, instead
    /// of leaving every later retry due at once (docs/adr/0092).
    ///
    /// # Panics
    /// When the next retry's time is out of range (an offset the funnel's
    /// check should have refused, or a corrupt `first_declined_at`). The panic
    /// guard rewinds the attempt and leaves the run out of the tick.
    pub fn after_decline(
        &self,
        first_declined_at: DateTime<Utc>,
        attempt: i32,
        now: DateTime<Utc>,
    ) -> AfterDecline {
        let n = usize::try_from(attempt).unwrap_or(0);
        match self.offsets_secs.get(n) {
            None => AfterDecline::Exhausted,
            Some(&secs) => {
                let out_of_range = || -> ! {
                    panic!(
                        "dunning policy offset {secs} s (retry {}) is out of range",
                        n + 1
                    )
                };
                let at = TimeDelta::try_seconds(secs)
                    .filter(|d| *d > TimeDelta::zero())
                    .and_then(|d| first_declined_at.checked_add_signed(d))
                    .unwrap_or_else(|| out_of_range());
                let previous = n
                    .checked_sub(1)
                    .and_then(|i| self.offsets_secs.get(i))
                    .copied()
                    .unwrap_or(0);
                let gap = TimeDelta::try_seconds((secs - previous).max(0))
                    .and_then(|gap| now.checked_add_signed(gap))
                    .unwrap_or_else(|| out_of_range());
                AfterDecline::Next { at: at.max(gap) }
            }
        }
    }

    /// Whether a decline of retry `attempt` sends a warning email.
    pub fn warns_after(&self, attempt: i32) -> bool {
        self.warn_after.contains(&attempt)
    }

    /// Whether retry `attempt` (1-based) has another planned after it.
    pub fn has_retry_after(&self, attempt: i32) -> bool {
        usize::try_from(attempt).is_ok_and(|n| n < self.offsets_secs.len())
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn policy(offsets: &[i64]) -> Policy {
        Policy {
            offsets_secs: offsets.to_vec(),
            final_action: FinalAction::PauseCollection,
            pause_behavior: PauseBehavior::KeepAsDraft,
            warn_after: vec![1],
            final_notice: true,
        }
    }

    #[test]
    fn each_decline_schedules_from_the_first_decline_until_the_last_retry() {
        let p = policy(&DEFAULT_OFFSETS_SECS);
        let t0: DateTime<Utc> = "2026-01-31T10:00:00Z".parse().unwrap();
        let day = TimeDelta::days(1);
        // Retry 1 declined on time → retry 2 at day 3, not day 1 + 3.
        assert_eq!(
            p.after_decline(t0, 1, t0 + day),
            AfterDecline::Next { at: t0 + day * 3 }
        );
        assert_eq!(
            p.after_decline(t0, 3, t0 + day * 5),
            AfterDecline::Next { at: t0 + day * 7 }
        );
        assert_eq!(
            p.after_decline(t0, 4, t0 + day * 7),
            AfterDecline::Exhausted
        );
        assert!(p.warns_after(1) && !p.warns_after(2));
    }

    /// A retry made late moves the rest on by its lateness: retry 1 (day 1)
    /// made on day 10 schedules retry 2 two days on (the gap between days 1
    /// and 3), not at day 3, which has passed; retry 2 made a day late
    /// schedules retry 3 two days on, at day 6 instead of day 5.
    ///
    /// Mutation check: the offset alone (`dunning_retry_gap`: the gap's floor
    /// dropped, as before) schedules retry 2 at once, and this test fails.
    #[test]
    fn a_late_retry_moves_the_rest_of_the_schedule_on() {
        let p = policy(&DEFAULT_OFFSETS_SECS);
        let t0: DateTime<Utc> = "2026-01-31T10:00:00Z".parse().unwrap();
        let day = TimeDelta::days(1);
        assert_eq!(
            p.after_decline(t0, 1, t0 + day * 10),
            AfterDecline::Next { at: t0 + day * 12 }
        );
        assert_eq!(
            p.after_decline(t0, 2, t0 + day * 4),
            AfterDecline::Next { at: t0 + day * 6 }
        );
    }

    #[test]
    #[should_panic(expected = "out of range")]
    fn a_corrupt_offset_panics_rather_than_schedules() {
        policy(&[60, i64::MAX]).after_decline(Utc::now(), 1, Utc::now());
    }

    #[test]
    fn a_schedule_is_checked_as_the_table_checks_it() {
        let ok: &[(&[i64], &[i32])] = &[
            (&[1], &[]),
            (&[60, 31_622_400], &[1, 2]),
            (&[1, 2, 3, 4, 5], &[5]),
        ];
        for (offsets, warn) in ok {
            assert_eq!(
                check_schedule(offsets, warn),
                Ok(()),
                "{offsets:?} {warn:?}"
            );
        }
        let bad: &[(&[i64], &[i32], &str)] = &[
            (&[], &[], "retry_offsets_secs"),
            (&[5; 21], &[], "retry_offsets_secs"),
            (&[60, 0], &[], "retry_offsets_secs[1]"),
            (&[31_622_401], &[], "retry_offsets_secs[0]"),
            (&[60, 120], &[1, 3], "warn_after[1]"),
            (&[60, 60], &[], "retry_offsets_secs[1]"),
            (&[60, 120, 90], &[], "retry_offsets_secs[2]"),
            (&[60], &[0], "warn_after[0]"),
            // Each retry at most once: an unbounded list was stored and read
            // with every run (docs/adr/0141; mutation `warn_after_repeats`).
            (&[60, 120], &[2, 1, 2], "warn_after[2]"),
            (&[60], &[1; 10_000], "warn_after[1]"),
        ];
        for (offsets, warn, field) in bad {
            let e = check_schedule(offsets, warn).unwrap_err();
            assert_eq!(e.field(), *field, "{offsets:?} {warn:?}");
        }
    }

    #[test]
    fn final_actions_round_trip_their_column_values() {
        for a in [
            FinalAction::CancelSubscription,
            FinalAction::PauseCollection,
            FinalAction::MarkUncollectible,
        ] {
            assert_eq!(FinalAction::parse(a.as_str()), Some(a));
        }
        assert_eq!(FinalAction::parse("refund"), None);
        for b in [
            PauseBehavior::KeepAsDraft,
            PauseBehavior::MarkUncollectible,
            PauseBehavior::Void,
        ] {
            assert_eq!(PauseBehavior::parse(b.as_str()), Some(b));
        }
        assert_eq!(PauseBehavior::parse("keep"), None);
    }
}
