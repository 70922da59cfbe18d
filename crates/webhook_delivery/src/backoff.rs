//! When a failed delivery is tried again, and when it is given up as dead.
//!
//! The default schedule spreads 8 attempts over about a day and a half, so a
//! receiver that is down for a deploy or an afternoon still gets its events:
//!
//! ```text
//! attempt   1    2    3     4      5    6    7     8
//! after     0    5s   5m    30m    2h   5h   10h   10h   -> dead after the 8th failure
//! ```
//!
//! Each delay gets ±20 % jitter so deliveries that failed together (one receiver's
//! outage) do not all come back in the same second.
//!
//! A receiver may answer with `Retry-After` (429 or 503). The rule is: **the next
//! attempt waits max(schedule delay, Retry-After)**, with Retry-After capped at
//! [`MAX_RETRY_AFTER`]. Retry-After can only postpone an attempt; it never brings
//! one forward, and it never revives a delivery whose schedule is exhausted.

use rand::Rng;
use std::str::FromStr;
use std::time::{Duration, SystemTime};

/// The longest `Retry-After` honoured, so one header cannot park a delivery forever.
pub const MAX_RETRY_AFTER: Duration = Duration::from_secs(24 * 60 * 60);

/// The jitter applied to each scheduled delay: ±20 %.
const JITTER: f64 = 0.2;

/// Delays before each retry: entry `i` is the wait after the `i + 1`-th failed attempt.
/// A delivery gets `len() + 1` attempts in all.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct RetrySchedule(pub Vec<Duration>);

/// A retry schedule string that could not be parsed.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum ScheduleError {
    #[error("retry schedule is empty; expected delays like `5s,5m,30m,2h`")]
    Empty,
    #[error(
        "invalid retry delay `{item}` in retry schedule: expected a whole number \
         followed by ms, s, m, h or d (like `30s` or `2h`)"
    )]
    InvalidItem { item: String },
}

impl Default for RetrySchedule {
    fn default() -> Self {
        const MIN: u64 = 60;
        const HOUR: u64 = 60 * MIN;
        Self(
            [
                5,
                5 * MIN,
                30 * MIN,
                2 * HOUR,
                5 * HOUR,
                10 * HOUR,
                10 * HOUR,
            ]
            .map(Duration::from_secs)
            .to_vec(),
        )
    }
}

impl RetrySchedule {
    /// Parses a comma-separated list of delays such as `5s,5m,30m,2h`.
    /// Units: `ms`, `s`, `m`, `h`, `d`; whitespace around items is ignored.
    ///
    /// # Errors
    ///
    /// [`ScheduleError::InvalidItem`] naming the first bad item, or
    /// [`ScheduleError::Empty`] for a blank string.
    pub fn parse(text: &str) -> Result<Self, ScheduleError> {
        if text.trim().is_empty() {
            return Err(ScheduleError::Empty);
        }
        text.split(',')
            .map(|item| {
                parse_delay(item.trim()).ok_or_else(|| ScheduleError::InvalidItem {
                    item: item.trim().to_owned(),
                })
            })
            .collect::<Result<_, _>>()
            .map(Self)
    }

    /// Attempts a delivery gets before it is dead: the first plus one per delay.
    pub fn max_attempts(&self) -> u32 {
        u32::try_from(self.0.len()).map_or(u32::MAX, |retries| retries.saturating_add(1))
    }

    /// The jittered wait before the next attempt, given how many attempts have been
    /// made (all of them failed). `None` means the delivery is dead.
    /// `attempts_made == 0` is the first attempt, which is immediate.
    pub fn next_delay(&self, attempts_made: u32, jitter: &mut impl Rng) -> Option<Duration> {
        let Some(index) = attempts_made.checked_sub(1) else {
            return Some(Duration::ZERO);
        };
        let base = *self.0.get(usize::try_from(index).ok()?)?;
        Some(base.mul_f64(jitter.random_range(1.0 - JITTER..=1.0 + JITTER)))
    }

    /// [`next_delay`](Self::next_delay) combined with a receiver's `Retry-After`:
    /// max of the two, and still `None` once the schedule is exhausted.
    pub fn next_delay_with_retry_after(
        &self,
        attempts_made: u32,
        retry_after: Option<Duration>,
        jitter: &mut impl Rng,
    ) -> Option<Duration> {
        let scheduled = self.next_delay(attempts_made, jitter)?;
        Some(retry_after.map_or(scheduled, |asked| scheduled.max(asked.min(MAX_RETRY_AFTER))))
    }
}

impl FromStr for RetrySchedule {
    type Err = ScheduleError;

    fn from_str(text: &str) -> Result<Self, Self::Err> {
        Self::parse(text)
    }
}

fn parse_delay(item: &str) -> Option<Duration> {
    let unit_start = item.find(|c: char| !c.is_ascii_digit())?;
    let (digits, unit) = item.split_at(unit_start);
    let unit_ms: u64 = match unit {
        "ms" => 1,
        "s" => 1_000,
        "m" => 60_000,
        "h" => 3_600_000,
        "d" => 86_400_000,
        _ => return None,
    };
    // An empty or overflowing number fails here.
    let value: u64 = digits.parse().ok()?;
    Some(Duration::from_millis(value.checked_mul(unit_ms)?))
}

/// Parses a `Retry-After` header: delta-seconds (`120`) or an HTTP-date
/// (`Wed, 21 Oct 2015 07:28:00 GMT`), as a wait from `now`, capped at
/// [`MAX_RETRY_AFTER`]. A date in the past is a zero wait. Anything else,
/// including the obsolete RFC 850 and asctime date forms, is `None`.
pub fn parse_retry_after(header: &str, now: SystemTime) -> Option<Duration> {
    let header = header.trim();
    let wait = if !header.is_empty() && header.bytes().all(|b| b.is_ascii_digit()) {
        // All digits: only overflow can fail, and an overflowing value means "a long time".
        Duration::from_secs(header.parse().unwrap_or(u64::MAX))
    } else {
        let at = chrono::DateTime::parse_from_rfc2822(header).ok()?;
        let now = chrono::DateTime::<chrono::Utc>::from(now);
        (at.to_utc() - now).to_std().unwrap_or(Duration::ZERO)
    };
    Some(wait.min(MAX_RETRY_AFTER))
}

#[cfg(test)]
mod tests {
    use super::*;
    use rand::SeedableRng as _;
    use rand::rngs::StdRng;

    const MIN: u64 = 60;
    const HOUR: u64 = 60 * MIN;

    fn secs(s: u64) -> Duration {
        Duration::from_secs(s)
    }

    #[test]
    fn default_schedule_gives_eight_attempts() {
        let schedule = RetrySchedule::default();
        let expected = [
            5,
            5 * MIN,
            30 * MIN,
            2 * HOUR,
            5 * HOUR,
            10 * HOUR,
            10 * HOUR,
        ];
        assert_eq!(schedule.0, expected.map(secs).to_vec());
        assert_eq!(schedule.max_attempts(), 8);
    }

    #[test]
    fn parse_accepts_units_and_whitespace() {
        let parsed = RetrySchedule::parse(" 250ms, 5s ,5m,30m,2h,1d").unwrap();
        let expected = vec![
            Duration::from_millis(250),
            secs(5),
            secs(5 * MIN),
            secs(30 * MIN),
            secs(2 * HOUR),
            secs(24 * HOUR),
        ];
        assert_eq!(parsed.0, expected);
        assert_eq!(
            "5s,5m".parse::<RetrySchedule>().unwrap().0,
            [secs(5), secs(300)]
        );
    }

    #[test]
    fn parse_names_the_bad_item() {
        for (text, bad) in [
            ("5s,5x,30m", "5x"),
            ("5s,,30m", ""),
            ("5s, h", "h"),
            ("5", "5"),
            ("-5s", "-5s"),
            ("1.5h", "1.5h"),
            ("5 s", "5 s"),
            ("99999999999999999999s", "99999999999999999999s"),
        ] {
            let err = RetrySchedule::parse(text).unwrap_err();
            assert_eq!(
                err,
                ScheduleError::InvalidItem { item: bad.into() },
                "{text}"
            );
            assert!(err.to_string().contains(&format!("`{bad}`")), "{err}");
        }
        assert_eq!(RetrySchedule::parse("  "), Err(ScheduleError::Empty));
    }

    #[test]
    fn next_delay_follows_the_schedule_then_dies() {
        let schedule = RetrySchedule::default();
        let mut rng = StdRng::seed_from_u64(7);
        assert_eq!(schedule.next_delay(0, &mut rng), Some(Duration::ZERO));
        for (made, base) in (1..).zip(&schedule.0) {
            let delay = schedule.next_delay(made, &mut rng).unwrap();
            assert!(
                delay >= base.mul_f64(0.8) && delay <= base.mul_f64(1.2),
                "{made}: {delay:?}"
            );
        }
        assert_eq!(schedule.next_delay(8, &mut rng), None);
        assert_eq!(schedule.next_delay(u32::MAX, &mut rng), None);
    }

    #[test]
    fn jitter_spreads_delays_within_twenty_percent() {
        let schedule = RetrySchedule(vec![secs(100)]);
        let mut rng = StdRng::seed_from_u64(42);
        let delays: Vec<_> = (0..1000)
            .map(|_| schedule.next_delay(1, &mut rng).unwrap())
            .collect();
        let (min, max) = (delays.iter().min().unwrap(), delays.iter().max().unwrap());
        assert!(*min >= secs(80) && *max <= secs(120), "{min:?}..{max:?}");
        // Spread over most of the band, not stuck at one value.
        assert!(*min < secs(85) && *max > secs(115), "{min:?}..{max:?}");
    }

    #[test]
    fn retry_after_postpones_but_never_shortens_or_revives() {
        let schedule = RetrySchedule(vec![secs(100)]);
        let mut rng = StdRng::seed_from_u64(1);
        let longer = schedule.next_delay_with_retry_after(1, Some(secs(1000)), &mut rng);
        assert_eq!(longer, Some(secs(1000)));
        let shorter = schedule
            .next_delay_with_retry_after(1, Some(secs(1)), &mut rng)
            .unwrap();
        assert!(shorter >= secs(80), "{shorter:?}");
        let capped = schedule.next_delay_with_retry_after(1, Some(secs(10 * 24 * HOUR)), &mut rng);
        assert_eq!(capped, Some(MAX_RETRY_AFTER));
        assert_eq!(
            schedule.next_delay_with_retry_after(2, Some(secs(1)), &mut rng),
            None
        );
    }

    #[test]
    fn retry_after_accepts_delta_seconds() {
        let now = SystemTime::UNIX_EPOCH + secs(1_000_000);
        assert_eq!(parse_retry_after("120", now), Some(secs(120)));
        assert_eq!(parse_retry_after(" 0 ", now), Some(Duration::ZERO));
        assert_eq!(parse_retry_after("999999999", now), Some(MAX_RETRY_AFTER));
        assert_eq!(
            parse_retry_after("99999999999999999999999", now),
            Some(MAX_RETRY_AFTER)
        );
    }

    #[test]
    fn retry_after_accepts_http_dates() {
        // Wed, 21 Oct 2015 07:28:00 GMT is unix 1445412480.
        let date = "Wed, 21 Oct 2015 07:28:00 GMT";
        let at = SystemTime::UNIX_EPOCH + secs(1_445_412_480);
        assert_eq!(parse_retry_after(date, at - secs(90)), Some(secs(90)));
        assert_eq!(parse_retry_after(date, at), Some(Duration::ZERO));
        assert_eq!(
            parse_retry_after(date, at + secs(3600)),
            Some(Duration::ZERO)
        );
        assert_eq!(
            parse_retry_after(date, at - secs(3 * 24 * HOUR)),
            Some(MAX_RETRY_AFTER)
        );
    }

    #[test]
    fn retry_after_rejects_garbage() {
        let now = SystemTime::UNIX_EPOCH;
        for header in [
            "",
            "  ",
            "-5",
            "1.5",
            "soon",
            "12abc",
            "Wed, 99 Oct 2015 07:28:00 GMT",
        ] {
            assert_eq!(parse_retry_after(header, now), None, "{header:?}");
        }
    }
}
