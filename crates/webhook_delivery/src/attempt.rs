//! One delivery's attempt: wait for a turn under the concurrency limits
//! ([`crate::fairness`]), ask the endpoint's circuit breaker
//! ([`crate::breaker`]), sign and POST it, and turn the answer into the
//! outcome to write ([`verdict`]).

use std::sync::Arc;
use std::time::{Duration, Instant};

use tokio_util::sync::CancellationToken;
use tracing::{debug, warn};
use url::Url;

use crate::backoff::RetrySchedule;
use crate::breaker::Admit;
use crate::delivery::Claimed;
use crate::fairness::{Stalled, Turn};
use crate::outcomes::{self, Finished, Step};
use crate::sealed::{Keyring, OpenError, SECRETS_KEY_VAR, Sealed};
use crate::send::{self, Answer, Limits, Request};
use crate::signature::Secret;
use crate::store::{ClaimedRow, NextState, Observed, OutcomeRow};
use leader::Role;

use crate::failure::Failure;
use crate::shared::Shared;
use crate::verdict::{self, Heard, Verdict, status_error};

/// A claim whose turn did not come before its batch moved on is held this
/// long, then claimed again (its endpoint, tenant or destination is busy).
pub(crate) const BUSY_HOLD: Duration = Duration::from_secs(1);

/// A delivery whose endpoint's secret this replica cannot open (sealed under
/// a key it does not hold, stored in clear, or not opening) is held this
/// long, its attempt not counted, and tried again: it waits for the key, it
/// never burns its retries or dies of it, and the rest of the batch goes on.
pub(crate) const SECRET_HOLD: Duration = Duration::from_secs(60);

/// An endpoint's parsed URL and opened signing secrets, or why it is unusable
/// (its failure category and the operator-log detail). A batch prepares one
/// per endpoint and shares it among its attempts to that endpoint
/// (docs/adr/0020): the secrets are wiped when the last of them ends.
pub(crate) type Prepared = Result<Target, (Failure, String)>;

pub(crate) struct Target {
    url: Url,
    secret: Secret,
    /// The previous secret while a rotation's overlap lasts.
    previous: Option<Secret>,
}

/// When an attempt must have started, and what stops it from starting.
pub(crate) struct StartBy {
    pub deadline: Instant,
    pub cancel: CancellationToken,
    /// Fires when the batch moves on (its slow attempts carried, the next
    /// claim made): an attempt still waiting for its turn is then held for
    /// [`BUSY_HOLD`] instead of queueing, so a busy tenant's backlog does not
    /// sit in memory claimed.
    pub busy: CancellationToken,
}

/// What an attempt left to do.
pub(crate) enum Attempted {
    /// An outcome (written or to write), or handed back to come due at once.
    Step(Step),
    /// Not sent: hand it back to come due after `wait` (attempt not counted),
    /// with `why` written as its `last_error` when it says one.
    Hold {
        id: i64,
        attempt: i32,
        wait: Duration,
        why: Option<Failure>,
    },
}

/// How waiting for a turn ended.
enum Waited {
    Turn(Turn),
    /// The start deadline passed, or the tick was cancelled: hand it back.
    OutOfTime,
    /// The batch moved on: hold it briefly.
    Busy,
    /// A share it waited on made no progress for this long: hold it for
    /// about twice that (at least [`BUSY_HOLD`], at most the request timeout).
    Stalled(Duration),
}

/// One delivery: wait for its turn and send, unless its endpoint's breaker
/// is open (held until the breaker lets a trial through). The outcome is
/// left to write ([`Step::Write`]) unless it was handed back, held, or was
/// a 410 (written at once, with the endpoint disabled in the same
/// transaction).
///
/// `target` is the endpoint's [`Prepared`] URL and secrets when the batch
/// prepared them; without it the attempt prepares its own.
pub(crate) async fn attempt(
    shared: &Shared,
    d: Claimed,
    target: Option<Arc<Prepared>>,
    start_by: &StartBy,
) -> Attempted {
    let (id, attempt) = (d.row.id, d.row.attempt);
    let endpoint = d.row.endpoint_id;
    let (heard, observed) = if d.row.enabled {
        let breakers = &shared.breakers;
        if let Some(wait) = breakers.open_for(endpoint, Instant::now()) {
            return Attempted::Hold {
                id,
                attempt,
                wait,
                why: None,
            };
        }
        let target = target.unwrap_or_else(|| Arc::new(prepare(shared, &d.row)));
        if let Err((Failure::BadSecret, error)) = target.as_ref() {
            return secret_unusable(shared, &d, error);
        }
        let turn = match wait_turn(shared, &d, start_by).await {
            Waited::Turn(turn) => turn,
            Waited::OutOfTime => {
                return Attempted::Step(Step::Done(
                    Box::pin(outcomes::release(shared, id, attempt)).await,
                ));
            }
            Waited::Busy => {
                return Attempted::Hold {
                    id,
                    attempt,
                    wait: BUSY_HOLD,
                    why: None,
                };
            }
            Waited::Stalled(quiet) => {
                let timeout = shared.config.request_timeout;
                let wait = (quiet * 2).clamp(BUSY_HOLD, timeout.max(BUSY_HOLD));
                return Attempted::Hold {
                    id,
                    attempt,
                    wait,
                    why: None,
                };
            }
        };
        let admitted = breakers.admit(endpoint, Instant::now());
        if let Admit::Hold(wait) = admitted {
            return Attempted::Hold {
                id,
                attempt,
                wait,
                why: None,
            };
        }
        let (heard, observed) = sign_and_post(shared, &d, &target).await;
        drop(target);
        drop(turn);
        let timed_out = observed.error.as_deref() == Some(Failure::Timeout.as_str());
        if let Some(cooloff) = breakers.record(endpoint, admitted, timed_out, Instant::now()) {
            warn!(
                role = %Role::WebhookDelivery,
                endpoint,
                tenant = %d.row.tenant_id,
                cooloff = ?cooloff,
                "webhook endpoint keeps timing out: circuit breaker open, its deliveries wait"
            );
        }
        (heard, observed)
    } else {
        let reason = d
            .row
            .disabled_reason
            .as_deref()
            .unwrap_or("no reason given");
        debug!(role = %Role::WebhookDelivery, delivery = id, endpoint = d.row.endpoint_id, reason, "webhook endpoint disabled; the delivery is dead");
        let observed = Observed {
            error: Some(Failure::EndpointDisabled.to_string()),
            ..Observed::default()
        };
        (Heard::EndpointDisabled, observed)
    };
    // The schedule starts again at a resend (migration 0026).
    let made = u32::try_from(attempt - d.row.resent_at_attempt).unwrap_or(0);
    let schedule = &shared.config.retry_schedule;
    let verdict = verdict::verdict(heard, made, schedule, &mut rand::rng());
    let next = match verdict {
        Verdict::Delivered => NextState::Delivered,
        Verdict::RetryAfter(wait) => NextState::RetryAfter(wait),
        Verdict::Dead => NextState::Dead,
        Verdict::EndpointGone => {
            // A delivery handed over unwritten has no id yet (docs/adr/0124).
            let reason = if id > 0 {
                format!("receiver answered 410 Gone to delivery {id}")
            } else {
                format!(
                    "receiver answered 410 Gone to the first attempt of event {} to this endpoint",
                    d.row.message_id
                )
            };
            warn!(
                role = %Role::WebhookDelivery,
                delivery = id,
                endpoint = d.row.endpoint_id,
                "410 Gone: disabling the webhook endpoint"
            );
            let row = OutcomeRow {
                id,
                attempt,
                next: NextState::Dead,
                observed,
            };
            let gone = crate::store::Gone {
                endpoint_id: d.row.endpoint_id,
                url: d.row.url.clone(),
                reason,
            };
            let outcome = Box::pin(outcomes::record(shared, row, Some(gone))).await;
            return Attempted::Step(Step::Done(outcome));
        }
    };
    Attempted::Step(Step::Write(Finished {
        row: OutcomeRow {
            id,
            attempt,
            next,
            observed,
        },
        refused: heard == Heard::Refused,
    }))
}

/// A delivery whose endpoint's secret cannot be opened here: held for
/// [`SECRET_HOLD`] with `bad_secret` as its error, its attempt not counted,
/// and counted on `hardcount_webhook_deliveries_secret_unusable_total` (the
/// alert `HardcountWebhookSecretUnusable`). Only this endpoint's deliveries
/// wait; nothing else stops.
fn secret_unusable(shared: &Shared, d: &Claimed, error: &str) -> Attempted {
    debug!(
        role = %Role::WebhookDelivery,
        delivery = d.row.id,
        endpoint = d.row.endpoint_id,
        category = %Failure::BadSecret,
        error = %error,
        "delivery held: its endpoint's secret cannot be opened here"
    );
    shared
        .telemetry
        .counter("hardcount_webhook_deliveries_secret_unusable_total", &[])
        .increment(1);
    Attempted::Hold {
        id: d.row.id,
        attempt: d.row.attempt,
        wait: SECRET_HOLD,
        why: Some(Failure::BadSecret),
    }
}

/// Parse `row`'s endpoint URL and open its secrets (in this worker's
/// memory only). A previous secret that does not open or parse (a key
/// under 24 bytes, stored before they were refused) is left out: the
/// deliveries go out signed with the current one.
pub(crate) fn prepare(shared: &Shared, row: &ClaimedRow) -> Prepared {
    let keyring = shared.config.secrets.as_ref();
    let url = Url::parse(&row.url)
        .map_err(|e| (Failure::BadUrl, format!("endpoint URL does not parse: {e}")))?;
    let secret = open_secret(keyring, &row.tenant_id, row.secret.as_ref()).map_err(|e| {
        // Once per endpoint per batch (a batch prepares each version of an
        // endpoint once).
        warn!(
            role = %Role::WebhookDelivery,
            endpoint = row.endpoint_id,
            tenant = %row.tenant_id,
            category = %Failure::BadSecret,
            error = %e,
            "webhook endpoint's secret cannot be opened here; its deliveries wait for the key, the others go on"
        );
        (
            Failure::BadSecret,
            format!("endpoint secret is unusable: {e}"),
        )
    })?;
    let previous = row.previous_secret.as_ref().and_then(|sealed| {
        open_secret(keyring, &row.tenant_id, Some(sealed))
            .inspect_err(|e| {
                warn!(role = %Role::WebhookDelivery, endpoint = row.endpoint_id, error = %e, "previous webhook secret unusable; signing with the current one only");
            })
            .ok()
    });
    Ok(Target {
        url,
        secret,
        previous,
    })
}

/// Sign and POST one claimed delivery to its prepared endpoint; what it
/// heard, and what to keep of it.
async fn sign_and_post(shared: &Shared, d: &Claimed, target: &Prepared) -> (Heard, Observed) {
    let id = d.row.id;
    let observed_started = Instant::now();
    let Target {
        url,
        secret,
        previous,
    } = match target {
        Ok(t) => t,
        Err((category, error)) => {
            warn!(role = %Role::WebhookDelivery, delivery = id, endpoint = d.row.endpoint_id, %category, error = %error, "webhook endpoint unusable");
            let observed = Observed {
                error: Some(category.to_string()),
                ..Observed::default()
            };
            return (Heard::NoAnswer, observed);
        }
    };
    let config = &shared.config;
    let sent = send::post(
        &shared.client,
        Request {
            url,
            message_id: &d.row.message_id,
            secret,
            previous_secret: previous.as_ref(),
            body: d.body(),
        },
        &Limits {
            allowlist: &config.allowlist,
            ports: config.ports,
            timeout: config.request_timeout,
            max_response_bytes: config.max_response_bytes,
        },
    )
    .await;
    shared
        .telemetry
        .histogram("hardcount_webhook_attempt_duration_seconds", &[])
        .record(observed_started.elapsed().as_secs_f64());
    let host = url.host_str().unwrap_or("");
    let latency = Some(sent.latency);
    match sent.answer {
        Answer::Status {
            code,
            retry_after,
            abort,
            body,
        } => {
            let failed = !(200..300).contains(&code);
            if failed && code != 410 {
                debug!(
                    role = %Role::WebhookDelivery,
                    delivery = id,
                    endpoint = d.row.endpoint_id,
                    host,
                    code,
                    answer = %status_error(code, &body),
                    "webhook receiver answered with a failure"
                );
            }
            let observed = Observed {
                status_code: Some(code),
                error: failed.then(|| {
                    if abort && code != 410 {
                        Failure::Aborted.to_string()
                    } else {
                        Failure::of_status(code).to_string()
                    }
                }),
                latency,
                // The tenant's own receiver's answer, shown to that tenant in
                // its attempt history; only an answer from an address the
                // SSRF guard let through is ever read.
                response_snippet: failed.then(|| verdict::response_snippet(&body)),
            };
            let heard = Heard::Status {
                code,
                retry_after,
                abort,
            };
            (heard, observed)
        }
        Answer::Refused { category, detail } => {
            warn!(role = %Role::WebhookDelivery, delivery = id, endpoint = d.row.endpoint_id, %category, error = %detail, "webhook target refused by the SSRF guard");
            let observed = Observed {
                error: Some(category.to_string()),
                ..Observed::default()
            };
            (Heard::Refused, observed)
        }
        Answer::Failed { category, detail } => {
            debug!(role = %Role::WebhookDelivery, delivery = id, endpoint = d.row.endpoint_id, host, %category, error = %detail, "webhook attempt failed");
            let observed = Observed {
                error: Some(category.to_string()),
                latency,
                ..Observed::default()
            };
            (Heard::NoAnswer, observed)
        }
    }
}

/// The four permits ([`crate::fairness::Limits::turn`]), unless the start
/// deadline or a cancel comes first, or the batch moves on.
async fn wait_turn(shared: &Shared, d: &Claimed, start_by: &StartBy) -> Waited {
    let turn = shared
        .limits
        .turn(d.row.endpoint_id, &d.row.tenant_id, &d.row.url);
    let deadline = tokio::time::Instant::from_std(start_by.deadline);
    tokio::select! {
        biased;
        _ = start_by.cancel.cancelled() => Waited::OutOfTime,
        _ = start_by.busy.cancelled() => Waited::Busy,
        turn = tokio::time::timeout_at(deadline, turn) => match turn {
            // A turn ready at once is taken even past the deadline (the
            // timeout polls it first): a task scheduled late must not start
            // a request that could outlast its claim (docs/adr/0084).
            Ok(Ok(_)) if tokio::time::Instant::now() >= deadline => Waited::OutOfTime,
            Ok(Ok(turn)) => Waited::Turn(turn),
            Ok(Err(Stalled(quiet))) => Waited::Stalled(quiet),
            Err(_) => Waited::OutOfTime,
        },
    }
}

/// The next state of attempt `attempt` of a delivery last resent at
/// `resent_at` that failed hearing nothing (its processing panicked, say): a
/// retry on the schedule, or dead. The schedule starts again at a resend, as
/// an answered attempt's verdict does (migration 0026).
pub(crate) fn after_failure(
    schedule: &RetrySchedule,
    (attempt, resent_at): (i32, i32),
) -> NextState {
    let made = u32::try_from(attempt - resent_at).unwrap_or(0);
    match verdict::verdict(Heard::NoAnswer, made, schedule, &mut rand::rng()) {
        Verdict::RetryAfter(wait) => NextState::RetryAfter(wait),
        _ => NextState::Dead,
    }
}

/// Open a claimed endpoint's sealed secret in this worker's memory only.
fn open_secret(
    keyring: Option<&Keyring>,
    tenant_id: &str,
    sealed: Option<&Sealed>,
) -> Result<Secret, String> {
    let keyring = keyring.ok_or_else(|| format!("{SECRETS_KEY_VAR} is not set"))?;
    let sealed =
        sealed.ok_or("the secret is stored in clear: run `hardcount secrets rotate-key`")?;
    keyring
        .open(tenant_id, &sealed.key_id, &sealed.ciphertext)
        .map_err(|e: OpenError| e.to_string())
}

#[cfg(test)]
mod after_failure_tests {
    use super::*;

    /// A panicked attempt of a resent delivery counts from the resend, as an
    /// answered one does: the default schedule allows eight attempts, so the
    /// 8th since the resend is the last and an earlier one is retried. Seen
    /// failing with `attempt - resent_at` made `attempt` (mutation
    /// `panic_after_resend`): the resent delivery's first panic was its death.
    #[test]
    fn a_panicked_attempt_counts_from_the_last_resend() {
        let schedule = RetrySchedule::default();
        let last = i32::try_from(schedule.0.len()).unwrap() + 1;
        let retried = |s| matches!(s, NextState::RetryAfter(_));
        assert!(retried(after_failure(&schedule, (1, 0))));
        assert!(!retried(after_failure(&schedule, (last, 0))));
        // Resent after a death at `last`: attempts since then start at one.
        assert!(retried(after_failure(&schedule, (last + 2, last + 1))));
        assert!(!retried(after_failure(&schedule, (2 * last + 1, last + 1))));
    }
}
