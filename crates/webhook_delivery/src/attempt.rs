//! One delivery's attempt: wait for a turn under the concurrency limits, sign
//! and POST it, and turn the answer into the outcome to write ([`verdict`]).

use std::sync::Arc;
use std::time::Instant;

use tokio::sync::{OwnedSemaphorePermit, Semaphore};
use tokio_util::sync::CancellationToken;
use tracing::{debug, warn};
use url::Url;

use crate::delivery::Claimed;
use crate::outcomes::{Finished, Step};
use crate::sealed::{Keyring, OpenError, SECRETS_KEY_VAR, Sealed};
use crate::send::{self, Answer, Limits, Request};
use crate::signature::Secret;
use crate::store::{NextState, Observed, OutcomeRow};
use leader::Role;

use crate::failure::Failure;
use crate::tick::Worker;
use crate::verdict::{self, Heard, Verdict, status_error};

/// When an attempt must have started, and what stops it from starting.
pub(crate) struct StartBy {
    pub deadline: Instant,
    pub cancel: CancellationToken,
}

impl Worker {
    /// One delivery: wait for its turn and send. The outcome is left to write
    /// ([`Step::Write`]) unless it was handed back or was a 410 (written at
    /// once, with the endpoint disabled in the same transaction).
    pub(crate) async fn attempt(&self, d: Claimed, start_by: &StartBy) -> Step {
        let (id, attempt) = (d.row.id, d.row.attempt);
        let (heard, observed) = if d.row.enabled {
            let Some(_permits) = self.wait_turn(d.row.endpoint_id, start_by).await else {
                return Step::Done(self.release(id, attempt).await);
            };
            self.send(&d).await
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
        let made = u32::try_from(attempt).unwrap_or(0);
        let schedule = &self.inner.config.retry_schedule;
        let verdict = verdict::verdict(heard, made, schedule, &mut rand::rng());
        let next = match verdict {
            Verdict::Delivered => NextState::Delivered,
            Verdict::RetryAfter(wait) => NextState::RetryAfter(wait),
            Verdict::Dead => NextState::Dead,
            Verdict::EndpointGone => {
                let reason = format!("receiver answered 410 Gone to delivery {id}");
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
                let outcome = self.record(row, Some((d.row.endpoint_id, reason))).await;
                return Step::Done(outcome);
            }
        };
        Step::Write(Finished {
            row: OutcomeRow {
                id,
                attempt,
                next,
                observed,
            },
            refused: heard == Heard::Refused,
        })
    }

    /// Sign and POST one claimed delivery; what it heard, and what to keep of it.
    async fn send(&self, d: &Claimed) -> (Heard, Observed) {
        let id = d.row.id;
        let observed_started = Instant::now();
        let keyring = self.inner.config.secrets.as_ref();
        let prepared = Url::parse(&d.row.url)
            .map_err(|e| (Failure::BadUrl, format!("endpoint URL does not parse: {e}")))
            .and_then(|url| {
                open_secret(keyring, &d.row.tenant_id, d.row.secret.as_ref())
                    .map(|secret| (url, secret))
                    .map_err(|e| {
                        (
                            Failure::BadSecret,
                            format!("endpoint secret is unusable: {e}"),
                        )
                    })
            });
        let (url, secret) = match prepared {
            Ok(p) => p,
            Err((category, error)) => {
                warn!(role = %Role::WebhookDelivery, delivery = id, endpoint = d.row.endpoint_id, %category, error = %error, "webhook endpoint unusable");
                let observed = Observed {
                    error: Some(category.to_string()),
                    ..Observed::default()
                };
                return (Heard::NoAnswer, observed);
            }
        };
        // A previous secret that does not open or parse (a key under 24 bytes,
        // stored before they were refused) is left out: the delivery goes out
        // signed with the current one. Both are wiped when this attempt ends.
        let previous = d.row.previous_secret.as_ref().and_then(|sealed| {
            open_secret(keyring, &d.row.tenant_id, Some(sealed))
                .inspect_err(|e| {
                    warn!(role = %Role::WebhookDelivery, delivery = id, endpoint = d.row.endpoint_id, error = %e, "previous webhook secret unusable; signing with the current one only");
                })
                .ok()
        });
        let config = &self.inner.config;
        let sent = send::post(
            &self.inner.client,
            Request {
                url: &url,
                message_id: &d.row.message_id,
                secret: &secret,
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
        self.inner
            .telemetry
            .histogram("hardcount_webhook_attempt_duration_seconds", &[])
            .record(observed_started.elapsed().as_secs_f64());
        let host = url.host_str().unwrap_or("");
        let latency = Some(sent.latency);
        match sent.answer {
            Answer::Status {
                code,
                retry_after,
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
                    error: failed.then(|| Failure::of_status(code).to_string()),
                    latency,
                };
                (Heard::Status { code, retry_after }, observed)
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

    /// Both permits (the endpoint's first, so a slow endpoint's queue does not
    /// hold the global ones), or `None` if the start deadline or a cancel comes first.
    async fn wait_turn(
        &self,
        endpoint_id: i64,
        start_by: &StartBy,
    ) -> Option<(OwnedSemaphorePermit, OwnedSemaphorePermit)> {
        let endpoint = self.endpoint_limit(endpoint_id);
        let global = self.inner.in_flight.clone();
        let both = async move {
            let e = endpoint.acquire_owned().await.ok()?;
            let g = global.acquire_owned().await.ok()?;
            Some((e, g))
        };
        let deadline = tokio::time::Instant::from_std(start_by.deadline);
        tokio::select! {
            biased;
            _ = start_by.cancel.cancelled() => None,
            permits = tokio::time::timeout_at(deadline, both) => permits.ok().flatten(),
        }
    }

    fn endpoint_limit(&self, endpoint_id: i64) -> Arc<Semaphore> {
        let mut map = self
            .inner
            .per_endpoint
            .lock()
            .unwrap_or_else(|p| p.into_inner());
        map.entry(endpoint_id)
            .or_insert_with(|| {
                Arc::new(Semaphore::new(self.inner.config.max_in_flight_per_endpoint))
            })
            .clone()
    }

    /// Forget the limits of endpoints nothing is waiting on.
    pub(crate) fn prune_endpoint_limits(&self) {
        let mut map = self
            .inner
            .per_endpoint
            .lock()
            .unwrap_or_else(|p| p.into_inner());
        map.retain(|_, s| Arc::strong_count(s) > 1);
    }

    /// The next state after a failed attempt that heard nothing (its
    /// processing panicked, say): a retry on the schedule, or dead.
    pub(crate) fn after_failure(&self, attempt: i32) -> NextState {
        let made = u32::try_from(attempt).unwrap_or(0);
        let schedule = &self.inner.config.retry_schedule;
        match verdict::verdict(Heard::NoAnswer, made, schedule, &mut rand::rng()) {
            Verdict::RetryAfter(wait) => NextState::RetryAfter(wait),
            _ => NextState::Dead,
        }
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
