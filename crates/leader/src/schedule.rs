//! When a role is due: an interval after its last completed tick, or the slots
//! of a cron expression in a time zone (docs/adr/0043).
//!
//! This module is pure: it turns a last completed slot and a reading of the
//! database's clock into the slot to claim or the next one to wait for. The
//! clock is always the database's (an ACQUIRE's `statement_timestamp()`,
//! carried forward by the monotonic clock); nothing here reads the
//! replica's wall clock, so a replica whose clock is an hour off computes
//! the same slots as the others. Whether a slot is due is still decided by
//! ACQUIRE, on the database clock ([`crate::store::acquire_slot`]).
//!
//! Daylight-saving transitions follow croner's rules (Vixie cron's): a
//! fixed-time slot in a spring-forward gap runs at the first instant after
//! the gap, once; a fixed-time slot in a fall-back overlap runs once, at its
//! first pass; a wildcard or step field (every hour, every 5 s) runs at
//! every instant that matches on the wall clock. Slots are instants, so a
//! slot computed once is the same slot on every replica.

use std::fmt;
use std::time::Duration;

use chrono::{DateTime, Utc};
use chrono_tz::Tz;
use croner::Cron;
use croner::parser::{CronParser, Seconds};

/// How a role is due.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Schedule {
    /// An interval after the last completed tick (`HARDCOUNT_<ROLE>_INTERVAL`).
    Every(Duration),
    /// The slots of a cron expression (`HARDCOUNT_<ROLE>_SCHEDULE`).
    Cron(Box<CronSchedule>),
}

impl From<Duration> for Schedule {
    fn from(d: Duration) -> Schedule {
        Schedule::Every(d)
    }
}

impl fmt::Display for Schedule {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            Schedule::Every(d) => write!(f, "every {}", short(*d)),
            Schedule::Cron(c) => c.fmt(f),
        }
    }
}

/// `1h`, `15m`, `1s`, `250ms`: a duration as the settings write it.
fn short(d: Duration) -> String {
    let ms = d.as_millis();
    let units = [
        (86_400_000, "d"),
        (3_600_000, "h"),
        (60_000, "m"),
        (1000, "s"),
    ];
    for (unit, name) in units {
        if ms >= unit && ms.is_multiple_of(unit) {
            return format!("{}{name}", ms / unit);
        }
    }
    format!("{ms}ms")
}

/// A cron expression with seconds (`0 5 * * * *`; five fields mean second
/// 0), an alias (`@hourly`, `@daily`, ...), in a time zone (an IANA name;
/// UTC when none is given).
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct CronSchedule {
    cron: Cron,
    zone: Tz,
    /// The expression as given, without a `CRON_TZ=` prefix.
    expr: String,
}

/// Why a schedule was refused.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum ScheduleError {
    #[error("{expr:?} is not a cron expression: {reason}")]
    Parse { expr: String, reason: String },
    #[error("{zone:?} is not an IANA time zone (like Europe/Berlin or UTC)")]
    Zone { zone: String },
    #[error("{expr:?} never fires (no slot after {after})")]
    Never { expr: String, after: String },
}

/// How far ahead a schedule must have a slot to be accepted: a year and a
/// day covers every yearly pattern, and `0 0 0 29 2 *` (a leap day) too.
const MUST_FIRE_WITHIN_DAYS: i64 = 366 * 4 + 1;

/// The longest schedule text accepted: `leader_leases.schedule` keeps at
/// most this many characters (migration 0034), and a release that wrote a
/// longer one failed at every tick, so its slot ran again each lease lifetime
/// (docs/adr/0111).
pub const MAX_SCHEDULE_CHARS: usize = 512;

/// At most this many skipped slots are counted after a downtime (a 1-second
/// schedule down for a day skips 86 400): past it the count says "at least".
pub const MISSED_COUNT_LIMIT: u64 = 10_000;

impl CronSchedule {
    /// Parse `text`: an optional `CRON_TZ=<zone> ` prefix, then the
    /// expression. `zone` (a separate setting) applies when there is no
    /// prefix; both at once is refused as ambiguous. `now` is only the
    /// start of the "does it ever fire" check.
    ///
    /// # Errors
    /// The expression does not parse, the zone is unknown, or it has no
    /// slot in the next four years.
    pub fn parse(
        text: &str,
        zone: Option<&str>,
        now: DateTime<Utc>,
    ) -> Result<CronSchedule, ScheduleError> {
        let text = text.trim();
        let (prefix_zone, expr) = match text.strip_prefix("CRON_TZ=") {
            Some(rest) => {
                let (z, e) = rest.split_once(char::is_whitespace).unwrap_or((rest, ""));
                (Some(z), e.trim())
            }
            None => (None, text),
        };
        let zone_name = match (prefix_zone, zone.map(str::trim).filter(|z| !z.is_empty())) {
            (Some(_), Some(_)) => {
                return Err(ScheduleError::Parse {
                    expr: text.to_owned(),
                    reason: "a CRON_TZ= prefix and a separate time zone were both given".into(),
                });
            }
            (Some(z), None) | (None, Some(z)) => z,
            (None, None) => "UTC",
        };
        let zone: Tz = zone_name.parse().map_err(|_| ScheduleError::Zone {
            zone: zone_name.to_owned(),
        })?;
        let cron = CronParser::builder()
            .seconds(Seconds::Optional)
            .build()
            .parse(expr)
            .map_err(|e| ScheduleError::Parse {
                expr: expr.to_owned(),
                reason: e.to_string(),
            })?;
        let schedule = CronSchedule {
            cron,
            zone,
            expr: expr.to_owned(),
        };
        let written = schedule.to_string().chars().count();
        if written > MAX_SCHEDULE_CHARS {
            return Err(ScheduleError::Parse {
                expr: format!("{}…", expr.chars().take(40).collect::<String>()),
                reason: format!(
                    "{written} characters, more than the {MAX_SCHEDULE_CHARS} leader_status keeps"
                ),
            });
        }
        match schedule.next_after(now) {
            Some(next) if next - now <= chrono::TimeDelta::days(MUST_FIRE_WITHIN_DAYS) => {
                Ok(schedule)
            }
            _ => Err(ScheduleError::Never {
                expr: expr.to_owned(),
                after: now.to_rfc3339(),
            }),
        }
    }

    pub fn zone(&self) -> Tz {
        self.zone
    }

    /// The first slot strictly after `t`.
    pub fn next_after(&self, t: DateTime<Utc>) -> Option<DateTime<Utc>> {
        self.cron
            .find_next_occurrence(&t.with_timezone(&self.zone), false)
            .ok()
            .map(|s| s.with_timezone(&Utc))
    }

    /// The last slot at or before `t`.
    pub fn latest_at_or_before(&self, t: DateTime<Utc>) -> Option<DateTime<Utc>> {
        self.cron
            .find_previous_occurrence(&t.with_timezone(&self.zone), true)
            .ok()
            .map(|s| s.with_timezone(&Utc))
    }

    /// What is due at `now` (the database's clock) for a role whose last
    /// completed slot (or, before its first, the instant it was last
    /// done or first seen) is `since`: the latest slot after `since` that
    /// has come, with the number of slots between them that will never run
    /// (a downtime runs the latest slot once, not each missed one); or the
    /// next slot to wait for.
    pub fn due(&self, since: DateTime<Utc>, now: DateTime<Utc>) -> Due {
        match self.latest_at_or_before(now) {
            Some(slot) if slot > since => Due::Slot {
                slot,
                missed: self.count_between(since, slot),
            },
            _ => match self.next_after(since.max(now)) {
                Some(next) => Due::Wait { next },
                None => Due::Never,
            },
        }
    }

    /// Slots strictly between `from` and `to`, at most [`MISSED_COUNT_LIMIT`].
    pub fn count_between(&self, from: DateTime<Utc>, to: DateTime<Utc>) -> u64 {
        let mut n = 0;
        let mut t = from;
        while n < MISSED_COUNT_LIMIT {
            match self.next_after(t) {
                Some(s) if s < to => {
                    n += 1;
                    t = s;
                }
                _ => break,
            }
        }
        n
    }
}

impl fmt::Display for CronSchedule {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        if self.zone == Tz::UTC {
            f.write_str(&self.expr)
        } else {
            write!(f, "CRON_TZ={} {}", self.zone.name(), self.expr)
        }
    }
}

/// What [`CronSchedule::due`] found.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Due {
    /// `slot` has come and has not run; `missed` slots before it never will.
    Slot { slot: DateTime<Utc>, missed: u64 },
    /// Nothing has come since; `next` is the next slot.
    Wait { next: DateTime<Utc> },
    /// No slot is left (croner searches up to the year 5000).
    Never,
}

#[cfg(test)]
mod tests {
    use super::*;

    fn utc(s: &str) -> DateTime<Utc> {
        DateTime::parse_from_rfc3339(s).unwrap().with_timezone(&Utc)
    }

    fn cron(text: &str) -> CronSchedule {
        CronSchedule::parse(text, None, utc("2026-01-01T00:00:00Z")).unwrap()
    }

    /// Every slot from `from` to `to`, as the role loop meets them: due,
    /// run, stamped, next.
    fn slots(s: &CronSchedule, from: DateTime<Utc>, to: DateTime<Utc>) -> Vec<DateTime<Utc>> {
        let mut out = Vec::new();
        let mut since = from;
        while let Some(next) = s.next_after(since).filter(|n| *n <= to) {
            // At the slot's instant it is due, with nothing missed.
            assert_eq!(
                s.due(since, next),
                Due::Slot {
                    slot: next,
                    missed: 0
                }
            );
            out.push(next);
            since = next;
        }
        out
    }

    #[test]
    fn expressions_aliases_and_zones_parse_and_bad_ones_are_named() {
        assert_eq!(cron("0 5 * * * *").to_string(), "0 5 * * * *");
        assert_eq!(cron("@hourly").to_string(), "@hourly");
        let berlin = cron("CRON_TZ=Europe/Berlin 0 0 9 * * MON-FRI");
        assert_eq!(berlin.zone(), chrono_tz::Europe::Berlin);
        assert_eq!(
            berlin.to_string(),
            "CRON_TZ=Europe/Berlin 0 0 9 * * MON-FRI"
        );
        let now = utc("2026-01-01T00:00:00Z");
        let separate = CronSchedule::parse("@daily", Some("Europe/Berlin"), now).unwrap();
        assert_eq!(separate.zone(), chrono_tz::Europe::Berlin);
        assert!(matches!(
            CronSchedule::parse("0 5 * * * * * *", None, now),
            Err(ScheduleError::Parse { .. })
        ));
        assert!(matches!(
            CronSchedule::parse("CRON_TZ=Mars/Olympus 0 * * * * *", None, now),
            Err(ScheduleError::Zone { .. })
        ));
        assert!(matches!(
            CronSchedule::parse("CRON_TZ=UTC @daily", Some("UTC"), now),
            Err(ScheduleError::Parse { .. })
        ));
        // February 30th never comes.
        let err = CronSchedule::parse("0 0 0 30 2 *", None, now).unwrap_err();
        assert!(matches!(err, ScheduleError::Never { .. }), "{err}");
        assert!(err.to_string().contains("never fires"), "{err}");
        // A leap day does, within four years.
        assert!(CronSchedule::parse("0 0 0 29 2 *", None, now).is_ok());
        // Longer than leader_status keeps: every release would fail
        // (docs/adr/0111). Mutation `schedule_length_unchecked`.
        let minutes = (0..60).map(|m| m.to_string()).collect::<Vec<_>>().join(",");
        let long = format!("{minutes},{minutes},{minutes},{minutes} * * * *");
        let err = CronSchedule::parse(&long, None, now).unwrap_err();
        assert!(err.to_string().contains("more than the 512"), "{err}");
        let fits = format!("{minutes} * * * *");
        assert!(CronSchedule::parse(&fits, None, now).is_ok());
    }

    #[test]
    fn five_fields_mean_second_zero_and_six_give_seconds() {
        let s = cron("5 * * * *");
        assert_eq!(
            s.next_after(utc("2026-03-01T10:00:00Z")),
            Some(utc("2026-03-01T10:05:00Z"))
        );
        let s = cron("*/5 * * * * *");
        assert_eq!(
            s.next_after(utc("2026-03-01T10:00:00Z")),
            Some(utc("2026-03-01T10:00:05Z"))
        );
    }

    #[test]
    fn a_downtime_runs_the_latest_slot_once_and_counts_the_others() {
        let s = cron("0 5 * * * *");
        // Last ran 10:05; back at 13:30: 13:05 runs, 11:05 and 12:05 are missed.
        assert_eq!(
            s.due(utc("2026-03-01T10:05:00Z"), utc("2026-03-01T13:30:00Z")),
            Due::Slot {
                slot: utc("2026-03-01T13:05:00Z"),
                missed: 2
            }
        );
        // Once 13:05 is stamped, the next is 14:05.
        assert_eq!(
            s.due(utc("2026-03-01T13:05:00Z"), utc("2026-03-01T13:30:00Z")),
            Due::Wait {
                next: utc("2026-03-01T14:05:00Z")
            }
        );
        // A second before its time a slot is not due.
        assert_eq!(
            s.due(utc("2026-03-01T13:05:00Z"), utc("2026-03-01T14:04:59Z")),
            Due::Wait {
                next: utc("2026-03-01T14:05:00Z")
            }
        );
        let every_second = cron("* * * * * *");
        let day =
            every_second.count_between(utc("2026-03-01T00:00:00Z"), utc("2026-03-02T00:00:00Z"));
        assert_eq!(day, MISSED_COUNT_LIMIT, "the count stops at its limit");
    }

    /// Europe/Berlin springs forward on 2026-03-29: 02:00 CET becomes
    /// 03:00 CEST. A daily 02:30 runs once that day, at 03:00 CEST (the
    /// first instant after the gap), and at 02:30 CEST the next day; an
    /// hourly schedule runs each real hour, none twice, none skipped.
    #[test]
    fn spring_forward_in_berlin_neither_skips_nor_repeats_a_slot() {
        let daily = cron("CRON_TZ=Europe/Berlin 0 30 2 * * *");
        let got = slots(
            &daily,
            utc("2026-03-27T12:00:00Z"),
            utc("2026-03-31T12:00:00Z"),
        );
        assert_eq!(
            got,
            [
                utc("2026-03-28T01:30:00Z"), // 02:30 CET
                utc("2026-03-29T01:00:00Z"), // 03:00 CEST: 02:30 never came
                utc("2026-03-30T00:30:00Z"), // 02:30 CEST
                utc("2026-03-31T00:30:00Z"),
            ]
        );
        let hourly = cron("CRON_TZ=Europe/Berlin @hourly");
        let got = slots(
            &hourly,
            utc("2026-03-28T23:00:00Z"),
            utc("2026-03-29T23:00:00Z"),
        );
        assert_eq!(got.len(), 24, "{got:?}");
        assert!(
            got.windows(2)
                .all(|w| w[1] - w[0] == chrono::TimeDelta::hours(1))
        );
    }

    /// Europe/Berlin falls back on 2026-10-25: 03:00 CEST becomes 02:00
    /// CET, so 02:00 to 03:00 comes twice. A daily 02:30 runs once, at its
    /// first pass (02:30 CEST); the hourly runs each real hour, 25 local
    /// hours that day.
    #[test]
    fn fall_back_in_berlin_neither_skips_nor_repeats_a_slot() {
        let daily = cron("CRON_TZ=Europe/Berlin 0 30 2 * * *");
        let got = slots(
            &daily,
            utc("2026-10-23T12:00:00Z"),
            utc("2026-10-27T12:00:00Z"),
        );
        assert_eq!(
            got,
            [
                utc("2026-10-24T00:30:00Z"), // 02:30 CEST
                utc("2026-10-25T00:30:00Z"), // 02:30 CEST, first pass only
                utc("2026-10-26T01:30:00Z"), // 02:30 CET
                utc("2026-10-27T01:30:00Z"),
            ]
        );
        // Stamped at the first pass, the second pass (02:30 CET) is not due.
        assert_eq!(
            daily.due(utc("2026-10-25T00:30:00Z"), utc("2026-10-25T01:30:00Z")),
            Due::Wait {
                next: utc("2026-10-26T01:30:00Z")
            }
        );
        let hourly = cron("CRON_TZ=Europe/Berlin 0 0 * * * *");
        let got = slots(
            &hourly,
            utc("2026-10-24T22:00:00Z"),
            utc("2026-10-25T22:00:00Z"),
        );
        assert_eq!(got.len(), 24, "{got:?}");
        assert!(
            got.windows(2)
                .all(|w| w[1] - w[0] == chrono::TimeDelta::hours(1))
        );
        let berlin = chrono_tz::Europe::Berlin;
        let local: Vec<String> = got
            .iter()
            .map(|t| t.with_timezone(&berlin).format("%H").to_string())
            .collect();
        assert_eq!(local.iter().filter(|h| *h == "02").count(), 2, "{local:?}");
    }

    /// The slots depend only on the clock reading they are given: a
    /// replica whose own clock is an hour ahead or behind, handed the
    /// database's reading, computes the same slot. (The role loop never
    /// gives them its own clock: `Manager` carries the database's reading
    /// forward on the monotonic clock.)
    #[test]
    fn slots_follow_the_reading_given_not_the_replicas_clock() {
        let s = cron("*/5 * * * * *");
        let db_now = utc("2026-06-01T12:00:07Z");
        let since = utc("2026-06-01T12:00:00Z");
        let expected = Due::Slot {
            slot: utc("2026-06-01T12:00:05Z"),
            missed: 0,
        };
        assert_eq!(s.due(since, db_now), expected);
        for skew in [-3600, 3600] {
            // What a skewed replica would compute from its own clock.
            let own = db_now + chrono::TimeDelta::seconds(skew);
            assert_ne!(s.due(since, own), expected, "skew {skew}s");
        }
    }

    #[test]
    fn durations_read_as_the_settings_write_them() {
        assert_eq!(
            Schedule::from(Duration::from_secs(3600)).to_string(),
            "every 1h"
        );
        assert_eq!(
            Schedule::from(Duration::from_secs(90)).to_string(),
            "every 90s"
        );
        assert_eq!(
            Schedule::from(Duration::from_millis(250)).to_string(),
            "every 250ms"
        );
    }
}
