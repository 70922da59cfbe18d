//! What every step of a tick works with: the pool, the settings, the
//! collector that charges (billing, through `payments::Collector`) and the telemetry; and the three things the
//! steps ask of them together: how long one retry may take, an email as the
//! outbox takes it, and a run's final notice.

use std::sync::Arc;
use std::time::Duration;

use db::Db;
use leader::{Role, Telemetry};
use payments::Collector;
use tracing::warn;

use crate::DunningConfig;
use crate::notices::{self, final_notice, sender};
use crate::run::Run;

/// The role's handles; a [`Dunner`](crate::Dunner) holds one, each step borrows it.
#[derive(Debug)]
pub(crate) struct Ctx {
    pub db: Db,
    pub config: DunningConfig,
    /// Whoever charges invoices (billing, through the collection port).
    pub collector: Arc<dyn Collector>,
    pub telemetry: Telemetry,
    /// `concurrency` permits, one per provider call: the bound on calls at
    /// once, shared by the batches in flight (docs/adr/0054).
    pub calls: tokio::sync::Semaphore,
}

impl Ctx {
    /// How long one retry may run: the provider call and a few statements.
    pub(crate) fn call_reserve(&self) -> Duration {
        self.collector.call_timeout()
    }

    /// The final notice of `run`'s final action, if its policy sends one;
    /// queued by the action's transaction only if the action changed something.
    pub(crate) fn final_notice(&self, run: &Run) -> Option<outbox::email::Email> {
        let from = sender(run, &self.config.email_from);
        let notice = run.policy.final_notice.then(|| final_notice(run, from));
        self.sendable(run, notice)
    }

    /// `email` as the outbox takes it (a tenant's sender that does not parse
    /// replaced by the configured one), or `None`, logged and counted, when
    /// the outbox would still refuse it: the transition goes on without it
    /// rather than roll back a retry the provider answered.
    pub(crate) fn sendable(
        &self,
        run: &Run,
        email: Option<outbox::email::Email>,
    ) -> Option<outbox::email::Email> {
        match notices::sendable(email?, &self.config.email_from) {
            Ok(email) => Some(email),
            Err(e) => {
                warn!(role = %Role::Dunning, run = run.id, tenant = %run.tenant_id, error = %e, "dunning email refused; the transition goes on without it");
                self.telemetry
                    .counter("hardcount_dunning_emails_refused_total", &[])
                    .increment(1);
                None
            }
        }
    }
}
