//! A run's life: enrolment and retries to recovery, a run whose invoice was
//! paid elsewhere, and the sender of dunning mail (`retries`); a customer
//! without a payment method it can charge (`payment_method`); a retry that
//! times out, panics, meets an outage or a rolled key (`failures`).

mod failures;
mod payment_method;
mod retries;

use std::time::Duration;

const CALL: Duration = Duration::from_secs(5);
