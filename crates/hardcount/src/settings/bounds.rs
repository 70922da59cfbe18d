//! The bounds of the webhook settings, named where the values are refused.

use std::ops::RangeInclusive;
use std::time::Duration;

/// The bounds of a webhook retry delay: shorter hammers a failing receiver,
/// longer outlives any receiver's memory of the event.
pub const RETRY_DELAY: RangeInclusive<Duration> =
    Duration::from_secs(1)..=Duration::from_secs(7 * 86_400);

/// The bounds of one webhook attempt: a hung receiver must not hold a delivery
/// (and the tick's budget) for minutes.
pub const WEBHOOK_TIMEOUT: RangeInclusive<Duration> =
    Duration::from_secs(1)..=Duration::from_secs(60);

/// The bounds of each webhook concurrency setting.
pub const WEBHOOK_IN_FLIGHT: RangeInclusive<usize> = 1..=1024;

/// The bounds of the breaker's cool-off: shorter is no back-off at all,
/// longer (16 times, after failed trials) outlives the retry schedule.
pub const BREAKER_COOLOFF: RangeInclusive<Duration> =
    Duration::from_secs(1)..=Duration::from_secs(3600);

/// The bounds of how long an endpoint fails before it is turned off: less
/// than an hour turns off an endpoint for one bad deploy of its receiver,
/// more than 90 days outlives any retention of its deliveries.
pub const DISABLE_AFTER: RangeInclusive<Duration> =
    Duration::from_secs(3600)..=Duration::from_secs(90 * 86_400);
/// The bounds of each retention setting: shorter deletes what an operator
/// still looks at the morning after; longer is keeping everything.
pub const RETENTION: RangeInclusive<Duration> =
    Duration::from_secs(3600)..=Duration::from_secs(3650 * 86_400);
