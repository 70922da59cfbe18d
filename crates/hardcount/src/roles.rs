//! The roles this binary runs, each registered once: for every `leader::Role`,
//! the variables `settings` reads for it, the alert rules in
//! `deploy/prometheus/rules.yml` that watch its own series, and the series its
//! code registers.
//!
//! The table is what the rest of the binary asks about a role (`settings` reads
//! each role's interval by the name given here, `serve` opens a LISTEN wake-up
//! for the roles marked `listens`), and what the tests hold the other places
//! to: a `Role` without an entry, a variable the settings do not read, an alert
//! or a series that is not where the entry says, or one that no entry claims,
//! fails `roles::tests` (the checklist in ARCHITECTURE.md, "Adding a role").
//!
//! What every role has without saying so (the lease row's series, labelled by
//! role, and the leadership alerts on them) is in [`EVERY_ROLE_METRICS`] and
//! [`EVERY_ROLE_ALERTS`]; what no role owns (where the database is, the HTTP
//! address) in [`PROCESS_SETTINGS`].

use leader::Role;

#[cfg(test)]
mod tests;

/// One role, as this binary knows it.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct RoleEntry {
    pub role: Role,
    /// The variable that sets its tick interval (`HARDCOUNT_<ROLE>_INTERVAL`).
    pub interval: &'static str,
    /// The other variables `settings` reads for it. Each variable has one
    /// owner: dunning charges through billing's provider settings and sends
    /// from billing's `HARDCOUNT_EMAIL_FROM`, which are billing's.
    pub settings: &'static [&'static str],
    /// The alerts in `deploy/prometheus/rules.yml` on its own series (besides
    /// [`EVERY_ROLE_ALERTS`], which watch every role by its `role` label).
    pub alerts: &'static [&'static str],
    /// The `hardcount_*` series its code registers (besides [`EVERY_ROLE_METRICS`]).
    pub metrics: &'static [&'static str],
    /// Woken by its producers' `pg_notify` when `HARDCOUNT_LISTEN_URL` is set
    /// (docs/adr/0014); otherwise it polls.
    pub listens: bool,
}

/// Every role, once. Order is `Role::ALL`'s.
pub static REGISTRY: &[RoleEntry] = &[
    RoleEntry {
        role: Role::Billing,
        interval: "HARDCOUNT_BILLING_INTERVAL",
        settings: &[
            "HARDCOUNT_BILLING_SCHEDULE",
            "BILLING_PROVIDER_URL",
            "BILLING_PROVIDER_SECRET_KEY",
            "HARDCOUNT_INSTANCE_ID",
            "HARDCOUNT_BILLING_RESEND_WINDOW",
            "HARDCOUNT_EMAIL_FROM",
        ],
        alerts: &[
            "HardcountBillingBacklog",
            "HardcountPaymentProviderKeyRejected",
            "HardcountPaymentsNeedReview",
        ],
        metrics: &[
            "hardcount_billing_due_subscriptions",
            "hardcount_billing_oldest_due_age_seconds",
            "hardcount_billing_invoices_created_total",
            "hardcount_billing_closes_total",
            "hardcount_billing_charges_total",
            "hardcount_billing_reconciler_resolutions_total",
            "hardcount_billing_trials_ended_total",
            "hardcount_billing_collections_resumed_total",
            "hardcount_billing_provider_key_rejected_total",
            "hardcount_billing_payment_attempts_needing_review",
            "hardcount_billing_payment_attempts_processing",
            "hardcount_billing_payment_method_requests_total",
            "hardcount_billing_rows_undecodable_total",
        ],
        listens: false,
    },
    RoleEntry {
        role: Role::Dunning,
        interval: "HARDCOUNT_DUNNING_INTERVAL",
        // Its provider and sender are billing's (above).
        settings: &[
            "HARDCOUNT_DUNNING_SCHEDULE",
            "HARDCOUNT_DUNNING_BATCH_SIZE",
            "HARDCOUNT_DUNNING_CONCURRENCY",
            "HARDCOUNT_DUNNING_TICK_BUDGET",
        ],
        alerts: &["HardcountDunningAttemptsFailing", "HardcountDunningBacklog"],
        metrics: &[
            "hardcount_dunning_attempts_total",
            "hardcount_dunning_recoveries_total",
            "hardcount_dunning_enrolled_total",
            "hardcount_dunning_exhaustions_total",
            "hardcount_dunning_emails_refused_total",
            "hardcount_dunning_policies_skipped_total",
            "hardcount_dunning_rows_undecodable_total",
            "hardcount_dunning_active_runs",
            "hardcount_dunning_oldest_due_age_seconds",
        ],
        listens: false,
    },
    RoleEntry {
        role: Role::WebhookOutbox,
        interval: "HARDCOUNT_WEBHOOK_OUTBOX_INTERVAL",
        settings: &["HARDCOUNT_WEBHOOK_OUTBOX_SCHEDULE"],
        alerts: &["HardcountWebhookEventsUndispatched"],
        metrics: &[
            "hardcount_webhook_events_dispatched_total",
            "hardcount_webhook_events_undispatched",
            "hardcount_webhook_events_oldest_undispatched_age_seconds",
        ],
        listens: true,
    },
    RoleEntry {
        role: Role::EmailOutbox,
        interval: "HARDCOUNT_EMAIL_OUTBOX_INTERVAL",
        settings: &[
            "HARDCOUNT_EMAIL_OUTBOX_SCHEDULE",
            "SMTP_URL",
            "HARDCOUNT_SMTP_CA_FILE",
            "HARDCOUNT_SMTP_INSECURE_AUTH",
            "HARDCOUNT_EMAIL_CONNECTIONS",
        ],
        alerts: &["HardcountEmailsFailing", "HardcountEmailsDelayed"],
        // `hardcount_email_refused_total` is counted where a producer's email is
        // refused at enqueue; it is the outbox's series whoever enqueues.
        metrics: &[
            "hardcount_emails_total",
            "hardcount_emails_queued",
            "hardcount_emails_failed",
            "hardcount_email_oldest_queued_age_seconds",
            "hardcount_email_send_duration_seconds",
            "hardcount_email_refused_total",
        ],
        listens: false,
    },
    RoleEntry {
        role: Role::WebhookDelivery,
        interval: "HARDCOUNT_WEBHOOK_DELIVERY_INTERVAL",
        settings: &[
            "HARDCOUNT_WEBHOOK_DELIVERY_SCHEDULE",
            "HARDCOUNT_SECRETS_KEY",
            "HARDCOUNT_WEBHOOK_ALLOWLIST",
            "HARDCOUNT_WEBHOOK_RETRY_SCHEDULE",
            "HARDCOUNT_WEBHOOK_TIMEOUT",
            "HARDCOUNT_WEBHOOK_MAX_IN_FLIGHT",
            "HARDCOUNT_WEBHOOK_MAX_IN_FLIGHT_PER_ENDPOINT",
            "HARDCOUNT_WEBHOOK_MAX_IN_FLIGHT_PER_TENANT",
            "HARDCOUNT_WEBHOOK_MAX_IN_FLIGHT_PER_DESTINATION",
            "HARDCOUNT_WEBHOOK_BREAKER_TIMEOUTS",
            "HARDCOUNT_WEBHOOK_BREAKER_COOLOFF",
            "HARDCOUNT_WEBHOOK_MIN_PORT",
            "HARDCOUNT_WEBHOOK_DISABLE_AFTER",
            "HARDCOUNT_WEBHOOK_NOTICE_FROM",
        ],
        alerts: &[
            "HardcountWebhookSecretUnusable",
            "HardcountWebhookEndpointsFailing",
            "HardcountWebhookDeliveriesLate",
        ],
        metrics: &[
            "hardcount_webhook_deliveries_total",
            "hardcount_webhook_deliveries_secret_unusable_total",
            "hardcount_webhook_endpoints_secret_unusable",
            "hardcount_webhook_attempt_duration_seconds",
            "hardcount_webhook_breakers_open",
            "hardcount_webhook_deliveries_pending",
            "hardcount_webhook_deliveries_dead",
            "hardcount_webhook_oldest_pending_age_seconds",
            "hardcount_webhook_oldest_due_age_seconds",
            "hardcount_webhook_endpoints_disabled_total",
        ],
        listens: true,
    },
];

/// The variables no role owns: `serve` reads them for the whole process
/// (`HARDCOUNT_LISTEN_URL` is the one wake-up connection of the roles that
/// `listens`).
pub const PROCESS_SETTINGS: &[&str] = &[
    "DATABASE_URL",
    "MIGRATION_DATABASE_URL",
    "HARDCOUNT_OPERATOR_DATABASE_URL",
    "HARDCOUNT_HTTP_ADDR",
    "HARDCOUNT_ROLES",
    "HARDCOUNT_LISTEN_URL",
    "HARDCOUNT_LEASE_DATABASE_URL",
    "HARDCOUNT_LEASE_PROFILE",
    "RUST_LOG",
    "HARDCOUNT_LOG_FORMAT",
    // Traces over OTLP/HTTP when set (crates/hardcount/src/telemetry.rs).
    "OTEL_EXPORTER_OTLP_ENDPOINT",
    // Retention (docs/adr/0040): read for every role (each prunes its own
    // lease history), and the webhook kinds by both webhook roles.
    "HARDCOUNT_RETENTION_WEBHOOKS",
    "HARDCOUNT_RETENTION_EMAILS",
    "HARDCOUNT_RETENTION_PAYMENT_LOGS",
    "HARDCOUNT_RETENTION_LEASE_HISTORY",
    // The tenant API (crates/api): a producer on its own listener, not a role.
    "HARDCOUNT_API_ADDR",
    "HARDCOUNT_API_DATABASE_URL",
    "HARDCOUNT_API_RATE_LIMIT",
    "HARDCOUNT_API_RATE_BURST",
    "HARDCOUNT_API_SHORT_PLANS",
    "HARDCOUNT_OPERATOR_TOKEN",
];

/// The lease layer's series (crates/leader, crates/scheduler), one per role by
/// its `role` label: a new role has them without registering anything.
pub const EVERY_ROLE_METRICS: &[&str] = &[
    "hardcount_leader_last_tick_age_seconds",
    "hardcount_leader_last_tick_known",
    "hardcount_leader_paused",
    "hardcount_leader_lease_lost_total",
    "hardcount_leader_heartbeat_missed_total",
    "hardcount_leader_tick_duration_seconds",
    "hardcount_leader_clock_drift_seconds",
    "hardcount_leader_status_errors_total",
    "hardcount_tick_total",
    // Rows each role's retention prune deleted, by `kind` (docs/adr/0040).
    "hardcount_retention_pruned_total",
    // A role on a cron schedule (docs/adr/0043).
    "hardcount_leader_next_slot_timestamp_seconds",
    // The first slot a cron role that never completed a tick waits for (docs/adr/0121).
    "hardcount_leader_first_slot_timestamp_seconds",
    "hardcount_leader_slots_missed_total",
    "hardcount_leader_slot_lateness_seconds",
    // Wake-up notifications received, for a role that `listens` (docs/adr/0014).
    "hardcount_wakeups_total",
    // When this replica last read the role's backlog gauges, on the database
    // clock: the rules read each backlog from the newest read (docs/adr/0137).
    "hardcount_backlog_read_timestamp_seconds",
    // Failed reads of the role's backlog gauges (docs/adr/0137).
    "hardcount_backlog_read_errors_total",
];

/// The alerts on [`EVERY_ROLE_METRICS`]. One that names roles in a `role`
/// matcher (`HardcountRoleStalled`'s per-role thresholds) must name every role.
pub const EVERY_ROLE_ALERTS: &[&str] = &[
    "HardcountRoleStalled",
    "HardcountRoleLastTickUnknown",
    "HardcountRoleUnassigned",
    "HardcountRolePaused",
    "HardcountTickPanicked",
    "HardcountLeasesLost",
    "HardcountStatusReadErrors",
    "HardcountBacklogUnread",
    "HardcountNoReplicaReporting",
];

/// The entry of `role`, if it has one (the tests make sure every role does).
pub fn entry(role: Role) -> Option<&'static RoleEntry> {
    REGISTRY.iter().find(|e| e.role == role)
}
