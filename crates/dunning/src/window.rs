//! A tenant's business window (docs/adr/0045): the local hours and ISO
//! weekdays in which its runs are listed, so its retries, warnings and final
//! actions go out only then. Pure: what a window is and the checks a written
//! one passes (migration 0035's CHECKs, and an IANA zone name, which the
//! table cannot tell from a POSIX string). The listing applies the window in
//! SQL on the database clock (`listing.rs`), never here.

use std::fmt;

/// Seconds in a local day (without a daylight-saving jump).
const DAY_SECS: u32 = 86_400;

/// A local time of day in whole seconds, from 00:00 to 24:00 (the end of the
/// day, a closing time only).
#[derive(Debug, Clone, Copy, PartialEq, Eq, PartialOrd, Ord)]
pub struct LocalTime(u32);

/// Why a local time is refused.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum TimeInvalid {
    #[error("{0:?} is not a local time: write HH:MM or HH:MM:SS, two digits each")]
    Shape(String),
    #[error("hour {0} is out of range: 00 to 23, or 24:00 for the end of the day")]
    Hour(u32),
    #[error("minute {0} is out of range: 00 to 59")]
    Minute(u32),
    #[error("second {0} is out of range: 00 to 59")]
    Second(u32),
}

impl LocalTime {
    /// 24:00, the day's end (a closing time only).
    pub const END_OF_DAY: LocalTime = LocalTime(DAY_SECS);

    /// `secs` after midnight, at most a day.
    pub fn from_secs(secs: u32) -> Option<LocalTime> {
        (secs <= DAY_SECS).then_some(LocalTime(secs))
    }

    pub fn secs(self) -> u32 {
        self.0
    }

    /// `HH:MM` or `HH:MM:SS`, two digits each; `24:00` (or `24:00:00`) is the
    /// end of the day.
    ///
    /// # Errors
    /// The text is not of that shape, or a part is out of range.
    pub fn parse(text: &str) -> Result<LocalTime, TimeInvalid> {
        let shape = || TimeInvalid::Shape(text.to_owned());
        let parts: Vec<&str> = text.split(':').collect();
        if !(2..=3).contains(&parts.len())
            || parts
                .iter()
                .any(|p| p.len() != 2 || !p.bytes().all(|b| b.is_ascii_digit()))
        {
            return Err(shape());
        }
        let n = |i: usize| parts.get(i).map_or(Ok(0), |p| p.parse::<u32>());
        let (h, m, s) = match (n(0), n(1), n(2)) {
            (Ok(h), Ok(m), Ok(s)) => (h, m, s),
            _ => return Err(shape()),
        };
        if m > 59 {
            return Err(TimeInvalid::Minute(m));
        }
        if s > 59 {
            return Err(TimeInvalid::Second(s));
        }
        if h > 24 || (h == 24 && (m, s) != (0, 0)) {
            return Err(TimeInvalid::Hour(h));
        }
        Ok(LocalTime(h * 3600 + m * 60 + s))
    }

    /// As Postgres reads a `time` (`HH:MM:SS`; `24:00:00` at the day's end).
    pub fn to_sql(self) -> String {
        let (h, m, s) = (self.0 / 3600, self.0 / 60 % 60, self.0 % 60);
        format!("{h:02}:{m:02}:{s:02}")
    }
}

/// `HH:MM`, or `HH:MM:SS` when the seconds are not zero.
impl fmt::Display for LocalTime {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        let (h, m, s) = (self.0 / 3600, self.0 / 60 % 60, self.0 % 60);
        if s == 0 {
            write!(f, "{h:02}:{m:02}")
        } else {
            write!(f, "{h:02}:{m:02}:{s:02}")
        }
    }
}

/// A checked business window. The window opens at `opens` local time on each
/// of `weekdays` and closes at `closes` (exclusive); a `closes` earlier than
/// `opens` closes the next day, so a window belongs to the weekday it opens on.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct BusinessWindow {
    /// An IANA zone name, as written.
    pub time_zone: String,
    pub opens: LocalTime,
    pub closes: LocalTime,
    /// ISO weekdays, 1 (Monday) to 7 (Sunday), each once, in the order written.
    pub weekdays: Vec<i32>,
}

/// Every ISO weekday: the weekdays of a window that does not name them.
pub const EVERY_DAY: [i32; 7] = [1, 2, 3, 4, 5, 6, 7];

/// Why a window is refused, each naming its field (relative to the window).
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum WindowInvalid {
    #[error("{0:?} is not an IANA time zone name (such as Europe/Berlin)")]
    TimeZone(String),
    #[error("opens: {0}")]
    Opens(TimeInvalid),
    #[error("closes: {0}")]
    Closes(TimeInvalid),
    #[error("a window opens before 24:00; 00:00 is the start of the day")]
    OpensAtEndOfDay,
    #[error(
        "opens and closes are both {0}: a window is not empty (for one always open, write none)"
    )]
    Empty(LocalTime),
    #[error("a window opens on at least one weekday")]
    NoWeekdays,
    #[error("weekday {day} is not an ISO weekday: 1 (Monday) to 7 (Sunday)")]
    Weekday { index: usize, day: i32 },
    #[error("weekday {day} is named twice")]
    RepeatedWeekday { index: usize, day: i32 },
}

impl WindowInvalid {
    /// The field at fault within the window: `time_zone`, `opens`,
    /// `closes`, `weekdays` or `weekdays[i]` (0-based).
    pub fn field(&self) -> String {
        match self {
            WindowInvalid::TimeZone(_) => "time_zone".to_owned(),
            WindowInvalid::Opens(_) | WindowInvalid::OpensAtEndOfDay => "opens".to_owned(),
            WindowInvalid::Closes(_) | WindowInvalid::Empty(_) => "closes".to_owned(),
            WindowInvalid::NoWeekdays => "weekdays".to_owned(),
            WindowInvalid::Weekday { index, .. } | WindowInvalid::RepeatedWeekday { index, .. } => {
                format!("weekdays[{index}]")
            }
        }
    }

    /// Whether a value is out of its range (rather than of the wrong shape).
    pub fn out_of_range(&self) -> bool {
        match self {
            WindowInvalid::Opens(t) | WindowInvalid::Closes(t) => {
                !matches!(t, TimeInvalid::Shape(_))
            }
            WindowInvalid::OpensAtEndOfDay | WindowInvalid::Weekday { .. } => true,
            _ => false,
        }
    }
}

/// Check a window as written (its times as text), so what the API writes is
/// what the table's CHECKs and the listing take. The zone must be an IANA
/// name chrono-tz knows; the database checks again that it knows it too.
///
/// # Errors
/// The first rule broken, in field order.
pub fn check_window(
    time_zone: &str,
    opens: &str,
    closes: &str,
    weekdays: &[i32],
) -> Result<BusinessWindow, WindowInvalid> {
    if time_zone.parse::<chrono_tz::Tz>().is_err() {
        return Err(WindowInvalid::TimeZone(time_zone.to_owned()));
    }
    let opens = LocalTime::parse(opens).map_err(WindowInvalid::Opens)?;
    if opens == LocalTime::END_OF_DAY {
        return Err(WindowInvalid::OpensAtEndOfDay);
    }
    let closes = LocalTime::parse(closes).map_err(WindowInvalid::Closes)?;
    if opens == closes {
        return Err(WindowInvalid::Empty(opens));
    }
    if weekdays.is_empty() {
        return Err(WindowInvalid::NoWeekdays);
    }
    for (index, &day) in weekdays.iter().enumerate() {
        if !(1..=7).contains(&day) {
            return Err(WindowInvalid::Weekday { index, day });
        }
        if weekdays[..index].contains(&day) {
            return Err(WindowInvalid::RepeatedWeekday { index, day });
        }
    }
    Ok(BusinessWindow {
        time_zone: time_zone.to_owned(),
        opens,
        closes,
        weekdays: weekdays.to_vec(),
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn local_times_parse_as_written_and_print_back() {
        for (text, secs, shown) in [
            ("00:00", 0, "00:00"),
            ("09:30", 34_200, "09:30"),
            ("23:59:59", 86_399, "23:59:59"),
            ("24:00", 86_400, "24:00"),
            ("24:00:00", 86_400, "24:00"),
            ("17:00:00", 61_200, "17:00"),
        ] {
            let t = LocalTime::parse(text).unwrap();
            assert_eq!(
                (t.secs(), t.to_string()),
                (secs, shown.to_owned()),
                "{text}"
            );
            assert_eq!(LocalTime::parse(&t.to_sql()), Ok(t));
        }
        for (text, want) in [
            ("9:00", TimeInvalid::Shape("9:00".into())),
            ("09", TimeInvalid::Shape("09".into())),
            ("09:00:00:00", TimeInvalid::Shape("09:00:00:00".into())),
            ("+9:00", TimeInvalid::Shape("+9:00".into())),
            ("09:00 ", TimeInvalid::Shape("09:00 ".into())),
            ("25:00", TimeInvalid::Hour(25)),
            ("24:01", TimeInvalid::Hour(24)),
            ("24:00:01", TimeInvalid::Hour(24)),
            ("12:60", TimeInvalid::Minute(60)),
            ("12:00:60", TimeInvalid::Second(60)),
        ] {
            assert_eq!(LocalTime::parse(text), Err(want), "{text}");
        }
    }

    /// (zone, opens, closes, weekdays, field refused, out of range?)
    type Refused<'a> = (&'a str, &'a str, &'a str, &'a [i32], &'a str, bool);

    #[test]
    fn a_window_is_checked_field_by_field() {
        let ok = check_window("Europe/Berlin", "22:00", "06:00", &[5, 1]).unwrap();
        assert_eq!(
            (ok.opens.to_string(), ok.closes.to_string(), ok.weekdays),
            ("22:00".to_owned(), "06:00".to_owned(), vec![5, 1])
        );
        assert!(check_window("UTC", "00:00", "24:00", &EVERY_DAY).is_ok());
        assert!(check_window("Etc/GMT-9", "09:00", "17:00", &[1]).is_ok());
        let bad: &[Refused] = &[
            ("Mars/Base", "09:00", "17:00", &[1], "time_zone", false),
            // Postgres takes POSIX strings; a tenant's zone is an IANA name.
            ("XYZ5", "09:00", "17:00", &[1], "time_zone", false),
            ("", "09:00", "17:00", &[1], "time_zone", false),
            ("UTC", "9am", "17:00", &[1], "opens", false),
            ("UTC", "25:00", "17:00", &[1], "opens", true),
            ("UTC", "24:00", "17:00", &[1], "opens", true),
            ("UTC", "09:00", "24:30", &[1], "closes", true),
            ("UTC", "09:00", "09:00", &[1], "closes", false),
            ("UTC", "09:00", "17:00", &[], "weekdays", false),
            ("UTC", "09:00", "17:00", &[1, 8], "weekdays[1]", true),
            ("UTC", "09:00", "17:00", &[0], "weekdays[0]", true),
            ("UTC", "09:00", "17:00", &[2, 3, 2], "weekdays[2]", false),
        ];
        for (zone, opens, closes, days, field, range) in bad {
            let e = check_window(zone, opens, closes, days).unwrap_err();
            assert_eq!(
                (e.field(), e.out_of_range()),
                ((*field).to_owned(), *range),
                "{zone} {opens} {closes} {days:?}: {e}"
            );
        }
    }
}
