//! A database role per duty (issue 12, point 1; migration 0012). Each test
//! connects as the role, lists what it may do from the catalog, compares that
//! with the grants its statements need, and tries statements it must not run.

use db::{Db, Row, sql};
use testbed::TestDb;

/// Every privilege `current_user` holds on `public`'s tables, views and
/// functions, as `relation:PRIV` (table-wide), `relation.column:PRIV` (a
/// column grant not implied by a table-wide one) and `function():EXECUTE`
/// (trigger functions left out: they cannot be called), sorted.
async fn privileges(db: &Db) -> Vec<String> {
    let rows = db
        .fetch_all(sql(
            "WITH rel AS (SELECT c.oid, c.relname FROM pg_class c \
                          WHERE c.relnamespace = 'public'::regnamespace AND c.relkind IN ('r', 'v', 'p')), \
                  priv(p) AS (VALUES ('SELECT'), ('INSERT'), ('UPDATE'), ('DELETE'), ('TRUNCATE'), \
                                     ('REFERENCES'), ('TRIGGER')) \
             SELECT relname || ':' || p AS g FROM rel, priv \
             WHERE has_table_privilege(current_user, rel.oid, p) \
             UNION ALL \
             SELECT relname || '.' || a.attname || ':' || p FROM rel \
             JOIN pg_attribute a ON a.attrelid = rel.oid AND a.attnum > 0 AND NOT a.attisdropped, priv \
             WHERE p IN ('SELECT', 'INSERT', 'UPDATE', 'REFERENCES') \
               AND has_column_privilege(current_user, rel.oid, a.attnum, p) \
               AND NOT has_table_privilege(current_user, rel.oid, p) \
             UNION ALL \
             SELECT proname || '():EXECUTE' FROM pg_proc \
             WHERE pronamespace = 'public'::regnamespace AND prorettype <> 'trigger'::regtype \
               AND has_function_privilege(current_user, oid, 'EXECUTE') \
             ORDER BY 1",
        ))
        .await
        .unwrap();
    rows.iter().map(|r| r.get::<String, _>("g")).collect()
}

async fn me(db: &Db) -> String {
    db.fetch_one(sql("SELECT current_user::text AS me"))
        .await
        .unwrap()
        .get("me")
}

/// Each statement is refused for want of a privilege (SQLSTATE 42501).
async fn refused(db: &Db, role: &str, statements: &[&'static str]) {
    for stmt in statements {
        let err = db.execute(sql(stmt)).await.unwrap_err();
        assert_eq!(
            err.code().as_deref(),
            Some("42501"),
            "{role}: `{stmt}` was not refused for lack of privilege: {err}"
        );
    }
}

fn expect(list: &[&str]) -> Vec<String> {
    let mut v: Vec<String> = list.iter().map(|s| s.to_string()).collect();
    v.sort();
    v
}

/// hardcount_operator reads leader_status and pauses or unpauses, lists and settles
/// payment attempts that need review (migration 0019), makes tenants and keys and
/// sets a tenant's settings; nothing else.
///
/// Catches: leader_pause running as its caller (`pause_security_definer`:
/// the operator then needs UPDATE on leader_leases and the pause is refused).
#[tokio::test]
async fn the_operator_role_reads_leader_status_and_pauses_and_nothing_else() {
    let t = TestDb::new().await;
    let op = t.operator();
    assert_eq!(me(&op).await, "hardcount_operator");
    assert_eq!(
        privileges(&op).await,
        expect(&[
            // Tenants and API keys (migration 0024).
            "api_keys.revoked_at:UPDATE",
            "api_keys:INSERT",
            "api_keys:SELECT",
            "billing_settle_attempt():EXECUTE",
            "email_address_valid():EXECUTE",
            "leader_history:SELECT",
            "leader_clear_cooldown():EXECUTE",
            "leader_pause():EXECUTE",
            "leader_status:SELECT",
            "leader_unpause():EXECUTE",
            // Replaying dead deliveries across tenants (migration 0032).
            "operator_replay_deliveries():EXECUTE",
            "payment_attempts_needing_review:SELECT",
            // A tenant's settings (migration 0056); the sender's CHECK calls
            // email_mailbox_valid as the writing role.
            "email_mailbox_valid():EXECUTE",
            "tenant_settings:SELECT",
            "tenant_settings.tenant_id:INSERT",
            "tenant_settings.invoice_prefix:INSERT",
            "tenant_settings.invoice_on_cancel:INSERT",
            "tenant_settings.email_from:INSERT",
            "tenant_settings.updated_at:INSERT",
            // Its payment page (migration 0058).
            "tenant_settings.payment_page_url:INSERT",
            "tenant_settings.invoice_prefix:UPDATE",
            "tenant_settings.invoice_on_cancel:UPDATE",
            "tenant_settings.email_from:UPDATE",
            "tenant_settings.updated_at:UPDATE",
            "tenant_settings.payment_page_url:UPDATE",
            "tenants:INSERT",
            "tenants:SELECT",
        ])
    );
    op.execute(sql("SELECT leader_pause('dunning', 'oncall', 'drill')"))
        .await
        .unwrap();
    op.execute(sql("SELECT leader_unpause('dunning')"))
        .await
        .unwrap();
    // Migration 0028.
    op.execute(sql("SELECT leader_clear_cooldown('dunning')"))
        .await
        .unwrap();
    let n: i64 = op
        .fetch_one(sql("SELECT count(*) AS n FROM leader_status"))
        .await
        .unwrap()
        .get("n");
    assert_eq!(n, 5);
    refused(
        &op,
        "hardcount_operator",
        &[
            "SELECT * FROM leader_leases",
            "UPDATE leader_leases SET paused_at = now()",
            "SELECT leader_fence('billing', 1)",
            // Migration 0027: the history through its view only, no pruning.
            "SELECT * FROM leader_terms",
            "SELECT leader_terms_prune(interval '1 day', 10)",
            "SELECT * FROM webhook_endpoints",
            "SELECT id FROM webhook_deliveries",
            "INSERT INTO webhook_events (tenant_id, event_type, payload) VALUES ('t', 'x', '{}')",
            "SELECT * FROM customers",
            "SELECT * FROM _sqlx_migrations",
            "CREATE TABLE sneaky (x int)",
        ],
    )
    .await;
}

/// hardcount_api writes what tenants write: endpoints (sealed secrets only),
/// customers, plans, subscriptions, events and emails to send (the tenant
/// API, migration 0024); it reads their results, and nothing of leadership,
/// API keys or a secret in clear.
#[tokio::test]
async fn the_api_role_writes_what_tenants_write_and_reads_no_secret_in_clear() {
    let t = TestDb::new().await;
    let api = t.api();
    assert_eq!(me(&api).await, "hardcount_api");
    let endpoint_cols = [
        "id",
        "tenant_id",
        "url",
        "event_types",
        "enabled",
        "disabled_reason",
        "disabled_at",
        "created_at",
        "secret_ciphertext",
        "secret_key_id",
        "previous_secret_ciphertext",
        "previous_secret_key_id",
        "previous_secret_expires_at",
    ];
    let mut want: Vec<String> = endpoint_cols
        .iter()
        .map(|c| format!("webhook_endpoints.{c}:SELECT"))
        .collect();
    for c in [
        "tenant_id",
        "url",
        "event_types",
        "enabled",
        "disabled_reason",
        "disabled_at",
        "secret_ciphertext",
        "secret_key_id",
    ] {
        want.push(format!("webhook_endpoints.{c}:INSERT"));
    }
    for c in [
        "url",
        "event_types",
        "enabled",
        "disabled_reason",
        "disabled_at",
        "secret_ciphertext",
        "secret_key_id",
        "previous_secret_ciphertext",
        "previous_secret_key_id",
        "previous_secret_expires_at",
    ] {
        want.push(format!("webhook_endpoints.{c}:UPDATE"));
    }
    for t in ["customers", "plans", "subscriptions"] {
        want.push(format!("{t}:SELECT"));
        want.push(format!("{t}:INSERT"));
    }
    // The provider customer once (migration 0057; a trigger keeps it).
    for c in ["email", "name", "payment_method_id", "provider_customer_id"] {
        want.push(format!("customers.{c}:UPDATE"));
    }
    want.push("plans.name:UPDATE".into());
    // The CHECK on customers.email calls it as the writing role (migration
    // 0022); tenant_settings.email_from's is the operators' since 0056.
    want.push("email_address_valid():EXECUTE".into());
    // The end of a subscription at its period's end (migration 0020); the
    // balances and the tenant settings are read only (operators set those,
    // migration 0056).
    want.push("tenant_settings:SELECT".into());
    want.push("customer_balances:SELECT".into());
    for c in [
        "plan_id",
        "status",
        "trial_end",
        "collection_method",
        "pause_collection_behavior",
        "pause_collection_resumes_at",
        "pause_collection_set_by",
        "canceled_at",
        "updated_at",
        "cancel_at_period_end",
    ] {
        want.push(format!("subscriptions.{c}:UPDATE"));
    }
    for t in [
        "invoices",
        "payment_attempts",
        "webhook_events",
        "webhook_deliveries",
        "_sqlx_migrations",
    ] {
        want.push(format!("{t}:SELECT"));
    }
    // The tenant API (migration 0024): its caller's tenant, its idempotency
    // keys, publishing events and queueing email, a delivery's attempts.
    for f in ["api_authenticate", "api_tenant"] {
        want.push(format!("{f}():EXECUTE"));
    }
    want.push("api_idempotency_keys:SELECT".into());
    want.push("api_idempotency_keys:INSERT".into());
    for c in ["status", "response", "request_hash", "created_at"] {
        want.push(format!("api_idempotency_keys.{c}:UPDATE"));
    }
    want.push("webhook_events:INSERT".into());
    want.push("email_outbox:SELECT".into());
    want.push("email_outbox:INSERT".into());
    want.push("webhook_delivery_attempts:SELECT".into());
    // Migration 0049: a resend keeps the delivering attempt in the history.
    want.push("webhook_delivery_attempts:INSERT".into());
    // Billing's producers in the API's transaction, and the dunning policy
    // and runs (migration 0025).
    for c in [
        "current_period_start",
        "current_period_end",
        "next_billing_at",
    ] {
        want.push(format!("subscriptions.{c}:UPDATE"));
    }
    want.push("invoices:INSERT".into());
    want.push("invoice_counters:SELECT".into());
    want.push("invoice_counters:INSERT".into());
    want.push("invoice_counters.last_number:UPDATE".into());
    want.push("customer_balances:INSERT".into());
    for c in ["amount", "updated_at"] {
        want.push(format!("customer_balances.{c}:UPDATE"));
    }
    want.push("dunning_policies:SELECT".into());
    want.push("dunning_policies:INSERT".into());
    want.push("dunning_policies.is_default:UPDATE".into());
    want.push("dunning_runs:SELECT".into());
    // Resending a delivery or an email, recovering an endpoint's dead
    // deliveries (migration 0026).
    for c in [
        "status",
        "next_attempt_at",
        "delivered_at",
        "attempts",
        "resent_at_attempt",
    ] {
        want.push(format!("webhook_deliveries.{c}:UPDATE"));
    }
    // A resend records where the claim's ceiling counts from (migration
    // 0041) and moves the attempt number past the last (migration 0042).
    for c in ["status", "next_attempt_at", "resent_at_attempt", "attempts"] {
        want.push(format!("email_outbox.{c}:UPDATE"));
    }
    // Turning an endpoint on again ends its failing run (migration 0031).
    want.push("webhook_endpoints.failing_since:SELECT".into());
    want.push("webhook_endpoints.failing_since:UPDATE".into());
    want.sort();
    assert_eq!(privileges(&api).await, want);
    refused(
        &api,
        "hardcount_api",
        &[
            "SELECT secret FROM webhook_endpoints",
            "SELECT previous_secret FROM webhook_endpoints",
            "UPDATE webhook_endpoints SET secret = 'whsec_AAAA'",
            "INSERT INTO webhook_endpoints (tenant_id, url, secret) VALUES ('t', 'https://x/', 'whsec_AAAA')",
            "DELETE FROM webhook_endpoints",
            "DELETE FROM webhook_events",
            "UPDATE webhook_deliveries SET last_status_code = 200",
            "UPDATE webhook_deliveries SET claimed_until = NULL",
            "UPDATE webhook_delivery_attempts SET status_code = 200",
            "DELETE FROM webhook_delivery_attempts",
            "UPDATE invoices SET status = 'paid'",
            "UPDATE email_outbox SET sent_at = now()",
            "UPDATE email_outbox SET last_reply_code = 250",
            "SELECT * FROM api_keys",
            "SELECT * FROM tenants",
            "SELECT * FROM leader_status",
            "SELECT leader_pause('billing', 'x', 'y')",
            "SELECT leader_clear_cooldown('billing')",
            "UPDATE leader_leases SET holder_id = NULL",
            "DELETE FROM customers",
            "CREATE TABLE sneaky (x int)",
        ],
    )
    .await;
}

/// hardcount_app, the role loops' role, lost what no loop uses: it reads a
/// webhook secret only sealed, creates and repoints no endpoint, rotates no
/// secret and pauses no role; and (migration 0023) it renames, reprices or
/// re-terms nothing a tenant owns: no customer's email, name or provider id,
/// no plan's name, no subscription's trial or collection method, no
/// policy's terms, no invoice's number or amounts once written; and it
/// creates no customer, plan or subscription, changes no payment method and
/// calls no address check (rows tenants write, as `hardcount_api`). Seen
/// failing on the schema of migration 0022, at `UPDATE customers SET email`.
///
/// Catches: the app keeping its table-wide SELECT on webhook_endpoints
/// (`app_reads_clear_secret`: `SELECT secret` is allowed again).
#[tokio::test]
async fn the_app_role_reads_secrets_only_sealed_and_cannot_repoint_endpoints_or_pause() {
    let t = TestDb::new().await;
    assert_eq!(me(&t.db).await, "hardcount_app");
    let granted = privileges(&t.db).await;
    let endpoints: Vec<&String> = granted
        .iter()
        .filter(|g| g.starts_with("webhook_endpoints"))
        .collect();
    let mut want: Vec<String> = [
        "id",
        "tenant_id",
        "url",
        "event_types",
        "enabled",
        "disabled_reason",
        "disabled_at",
        "created_at",
        "secret_ciphertext",
        "secret_key_id",
        "previous_secret_ciphertext",
        "previous_secret_key_id",
        "previous_secret_expires_at",
        // Kept by the outcome statement; the disabling step reads it (0031).
        "failing_since",
    ]
    .iter()
    .map(|c| format!("webhook_endpoints.{c}:SELECT"))
    .chain(
        ["enabled", "disabled_reason", "disabled_at", "failing_since"]
            .iter()
            .map(|c| format!("webhook_endpoints.{c}:UPDATE")),
    )
    .collect();
    want.sort();
    assert_eq!(endpoints, want.iter().collect::<Vec<_>>());
    let functions: Vec<&String> = granted
        .iter()
        .filter(|g| g.ends_with("():EXECUTE"))
        .collect();
    // The address checks run only in the CHECKs of rows tenants write (as
    // hardcount_api), never the app's (migration 0023).
    // Migration 0030: each role prunes its own lease terms through a fenced
    // definer function.
    assert_eq!(
        functions,
        [
            "leader_fence():EXECUTE",
            "leader_terms_prune_fenced():EXECUTE"
        ]
    );
    let lease_writes: Vec<&String> = granted
        .iter()
        .filter(|g| g.starts_with("leader_leases") && !g.ends_with(":SELECT"))
        .collect();
    assert_eq!(
        lease_writes,
        [
            "leader_leases.acquired_at:UPDATE",
            "leader_leases.expires_at:UPDATE",
            "leader_leases.holder_id:UPDATE",
            "leader_leases.holder_token:UPDATE",
            "leader_leases.last_slot:UPDATE",
            "leader_leases.last_tick_ended_at:UPDATE",
            "leader_leases.last_tick_holder:UPDATE",
            "leader_leases.next_slot:UPDATE",
            "leader_leases.not_before:UPDATE",
            // Migration 0034: RELEASE stamps the schedule and its slots.
            "leader_leases.schedule:UPDATE",
        ]
    );
    // Migration 0027: the lease statements write their term; nothing else.
    let term_rights: Vec<&String> = granted
        .iter()
        .filter(|g| g.starts_with("leader_terms") || g.starts_with("leader_history"))
        .collect();
    assert_eq!(
        term_rights,
        [
            "leader_terms.acquired_at:INSERT",
            "leader_terms.expires_at:INSERT",
            "leader_terms.expires_at:UPDATE",
            "leader_terms.holder_id:INSERT",
            "leader_terms.last_renewed_at:UPDATE",
            "leader_terms.released_at:UPDATE",
            "leader_terms.role:INSERT",
            "leader_terms.role:SELECT",
            "leader_terms.tick_end:UPDATE",
            "leader_terms.token:INSERT",
            "leader_terms.token:SELECT",
            // Migration 0030: its own old terms, through the fenced prune.
            "leader_terms_prune_fenced():EXECUTE",
        ]
    );
    // Migration 0030: the retention prunes delete finished webhook and email
    // rows; migration 0048 idempotency keys a day old; migration 0053 the
    // webhook handoffs whose deliveries are written; nothing else, and never
    // money (invoices, attempts, runs).
    let deletes: Vec<&String> = granted
        .iter()
        .filter(|g| g.contains(":DELETE") || g.contains(":TRUNCATE"))
        .collect();
    assert_eq!(
        deletes,
        [
            "api_idempotency_keys:DELETE",
            "email_outbox:DELETE",
            "webhook_deliveries:DELETE",
            "webhook_delivery_attempts:DELETE",
            "webhook_events:DELETE",
            "webhook_handoffs:DELETE",
        ],
        "{granted:?}"
    );
    refused(
        &t.db,
        "hardcount_app",
        &[
            "SELECT * FROM leader_history",
            "SELECT holder_id FROM leader_terms",
            "DELETE FROM leader_terms",
            "UPDATE leader_terms SET acquired_at = now()",
            "DELETE FROM invoices",
            "DELETE FROM payment_attempts",
            "DELETE FROM dunning_runs",
            "DELETE FROM customers",
            "DELETE FROM subscriptions",
            "TRUNCATE webhook_deliveries",
            "SELECT leader_terms_prune(interval '1 day', 10)",
            "SELECT secret FROM webhook_endpoints",
            "SELECT previous_secret FROM webhook_endpoints",
            "SELECT * FROM webhook_endpoints",
            "INSERT INTO webhook_endpoints (tenant_id, url, secret_ciphertext, secret_key_id) \
             VALUES ('t', 'https://x/', decode(repeat('00', 64), 'hex'), 'k')",
            "UPDATE webhook_endpoints SET url = 'https://attacker.example/'",
            "UPDATE webhook_endpoints SET event_types = '{}'",
            "UPDATE webhook_endpoints SET secret_ciphertext = NULL",
            "UPDATE webhook_endpoints SET previous_secret_expires_at = now()",
            "SELECT leader_pause('billing', 'x', 'y')",
            "SELECT leader_unpause('billing')",
            "SELECT leader_clear_cooldown('billing')",
            "UPDATE leader_leases SET paused_at = now(), paused_by = 'x'",
            // Migration 0023: written by the API or the owner, never by a loop.
            "UPDATE customers SET email = 'mallory@example.org'",
            "UPDATE customers SET name = 'Mallory'",
            "UPDATE customers SET provider_customer_id = 'cus_elsewhere'",
            "UPDATE plans SET name = 'Free'",
            "UPDATE subscriptions SET trial_end = now()",
            "UPDATE subscriptions SET collection_method = 'send_invoice'",
            "UPDATE invoices SET number = 'INV-000001'",
            "UPDATE invoices SET balance_applied = 0",
            "UPDATE invoices SET carried_to_balance = 0",
            "UPDATE invoices SET finalized_at = now()",
            "UPDATE dunning_policies SET name = 'x'",
            "UPDATE dunning_policies SET retry_offsets_secs = '{1}'",
            "UPDATE dunning_policies SET final_action = 'write_off'",
            "UPDATE dunning_policies SET warn_after = '{}'",
            "UPDATE dunning_policies SET final_notice = false",
            "UPDATE dunning_policies SET is_default = false",
            "UPDATE dunning_policies SET pause_behavior = 'void'",
            "UPDATE customers SET payment_method_id = NULL",
            "INSERT INTO customers (tenant_id, email) VALUES ('t', 'a@example.org')",
            "INSERT INTO plans (tenant_id, name, amount, currency, interval_unit, interval_count) \
             VALUES ('t', 'p', 1, 'EUR', 'month', 1)",
            "INSERT INTO subscriptions (tenant_id, customer_id, plan_id, status, billing_anchor, \
             current_period_start, current_period_end) VALUES ('t', 1, 1, 'active', now(), now(), now())",
            "SELECT email_address_valid('a@example.org')",
        ],
    )
    .await;
}

/// No role but the owner (and superusers, and Postgres's predefined
/// `pg_read_all_data`, which only a superuser can grant) can read a webhook
/// secret in clear: asked of every role in the cluster, from the catalog.
#[tokio::test]
async fn no_role_but_the_owner_can_read_a_clear_secret() {
    let t = TestDb::new().await;
    let rows = t
        .db
        .fetch_all(sql(
            "SELECT r.rolname::text AS r FROM pg_roles r \
             WHERE NOT r.rolsuper AND r.rolname NOT LIKE 'pg\\_%' \
               AND r.oid <> (SELECT relowner FROM pg_class WHERE oid = 'webhook_endpoints'::regclass) \
               AND (has_column_privilege(r.oid, 'webhook_endpoints', 'secret', 'SELECT') \
                    OR has_column_privilege(r.oid, 'webhook_endpoints', 'previous_secret', 'SELECT'))",
        ))
        .await
        .unwrap();
    let readers: Vec<String> = rows.iter().map(|r| r.get("r")).collect();
    assert!(readers.is_empty(), "{readers:?} can read a clear secret");
    // The roles exist, log in, and hold no power over the cluster.
    let row = t
        .db
        .fetch_one(sql(
            "SELECT count(*) AS n, bool_and(rolcanlogin) AS login, \
                    bool_or(rolsuper OR rolcreaterole OR rolcreatedb OR rolinherit) AS power \
             FROM pg_roles WHERE rolname IN ('hardcount_app', 'hardcount_api', 'hardcount_operator')",
        ))
        .await
        .unwrap();
    assert_eq!(row.get::<i64, _>("n"), 3);
    assert!(row.get::<bool, _>("login"));
    assert!(!row.get::<bool, _>("power"));
}
