//! The local run's dunning demo (issue 11, point 7): a dunning policy for the
//! demo tenant and a subscription whose card declines twice and then
//! succeeds, so a newcomer sees a run enrolled, retried and recovered within
//! a minute or so.
//!
//! ```text
//!  billing's first tick   closes the subscription's period, charges: declined (1)
//!  dunning (every 5 s)    enrols the invoice; retry 1 at decline + 20 s: declined (2)
//!  this demo              sees two declines, tells the fake provider to accept the card
//!  dunning                retry 2 at decline + 40 s: paid, the run recovered
//! ```
//!
//! Dunning charges the provider billing is given: the one configured, or the
//! fake provider `dev/billing.rs` starts in this process (with the
//! `dev-provider` feature). The card's behaviour is set through the fake's
//! `POST /_test/behaviour`, so the demo also works against the `fake_provider`
//! binary; against any other provider, or with none, it is skipped.

use std::time::Duration;

use anyhow::Result;
use db::{Db, Row, sql};
use tokio_util::sync::CancellationToken;

use crate::settings::{ServeSettings, non_empty};

const CUSTOMER: &str = "cus_demo_dunning";

/// What [`prepare`] found; [`Demo::seed`] uses it once the database is migrated.
pub struct Demo {
    base_url: Option<String>,
}

/// Before the service's configuration is built, after billing's provider is
/// set (`billing::start_provider`): note the provider dunning will charge, and
/// tick dunning every 5 s unless told otherwise.
pub fn prepare(serve: &mut ServeSettings) -> Demo {
    if non_empty(&serve.dunning_interval).is_none() {
        serve.dunning_interval = Some("5s".to_owned());
    }
    let base_url = non_empty(&serve.billing_provider_url);
    Demo { base_url }
}

impl Demo {
    /// Seed the policy and the subscription (once per database) as the
    /// `owner`, make the card decline, and watch for the second decline (as
    /// the `app`) to make it succeed.
    pub async fn seed(&self, owner: &Db, app: &Db, shutdown: CancellationToken) -> Result<()> {
        let Some(base_url) = self.base_url.clone() else {
            return Ok(());
        };
        let seeded = owner
            .fetch_optional(
                sql("SELECT id FROM customers WHERE tenant_id = $1 AND provider_customer_id = $2")
                    .bind(super::demo::TENANT)
                    .bind(CUSTOMER),
            )
            .await?
            .is_some();
        if seeded {
            println!("dunning demo: already seeded (customer {CUSTOMER})");
            return Ok(());
        }
        let http = reqwest::Client::new();
        if behave(&http, &base_url, "decline").await.is_err() {
            println!("dunning demo: the provider at {base_url} is not the fake; skipped");
            return Ok(());
        }
        let mut tx = owner.begin().await?;
        let tenant = super::demo::TENANT;
        tx.execute(
            sql(
                "INSERT INTO dunning_policies (tenant_id, name, retry_offsets_secs, final_action, \
                                               warn_after, final_notice, is_default) \
                 VALUES ($1, 'Demo', '{20, 40, 60}', 'pause_collection', '{1}', true, true) \
                 ON CONFLICT (tenant_id) WHERE is_default DO NOTHING",
            )
            .bind(tenant),
        )
        .await?;
        let subscription: i64 = tx
            .fetch_one(
                sql("WITH c AS (INSERT INTO customers (tenant_id, email, name, provider_customer_id, \
                                                       payment_method_id) \
                                VALUES ($1, 'dunning@demo.example', 'Dana', $2, 'pm_card_visa') \
                                RETURNING id), \
                          p AS (INSERT INTO plans (tenant_id, name, amount, currency, interval_unit, \
                                                   interval_count) \
                                VALUES ($1, 'Demo monthly', 1200, 'EUR', 'month', 1) RETURNING id) \
                     INSERT INTO subscriptions (tenant_id, customer_id, plan_id, status, billing_anchor, \
                                                current_period_start, current_period_end, next_billing_at) \
                     SELECT $1, c.id, p.id, 'active', now() - interval '1 month', \
                            now() - interval '1 month', now(), now() FROM c, p RETURNING id")
                .bind(tenant)
                .bind(CUSTOMER),
            )
            .await?
            .get("id");
        tx.commit().await?;
        println!(
            "dunning demo: subscription #{subscription} is due now; its card declines twice, then succeeds"
        );
        tokio::spawn(watch(app.clone(), http, base_url, subscription, shutdown));
        Ok(())
    }
}

async fn behave(http: &reqwest::Client, base_url: &str, behaviour: &str) -> Result<()> {
    http.post(format!("{base_url}/_test/behaviour"))
        .header("content-type", "application/x-www-form-urlencoded")
        // Fixed ASCII words: nothing to percent-encode.
        .body(format!(
            "customer={CUSTOMER}&behaviour={behaviour}&decline_code=insufficient_funds"
        ))
        .send()
        .await?
        .error_for_status()?;
    Ok(())
}

/// Print the run's progress; after the second decline, accept the card.
async fn watch(
    db: Db,
    http: reqwest::Client,
    base_url: String,
    subscription: i64,
    shutdown: CancellationToken,
) {
    let mut last = String::new();
    let mut accepted = false;
    while shutdown
        .run_until_cancelled(tokio::time::sleep(Duration::from_secs(2)))
        .await
        .is_some()
    {
        let row = db
            .fetch_optional(
                sql("SELECT i.id, i.status AS invoice, \
                            (SELECT count(*) FROM payment_attempts a \
                             WHERE a.invoice_id = i.id AND a.provider_status = 'declined') AS declines, \
                            r.status AS run, r.attempt_count \
                     FROM invoices i LEFT JOIN dunning_runs r ON r.invoice_id = i.id \
                     WHERE i.subscription_id = $1 ORDER BY i.id LIMIT 1")
                .bind(subscription),
            )
            .await;
        let Ok(Some(r)) = row else { continue };
        let declines: i64 = r.get("declines");
        let run: Option<String> = r.get("run");
        let now = format!(
            "dunning demo: invoice #{} {}, {declines} declined attempt(s), run {}",
            r.get::<i64, _>("id"),
            r.get::<String, _>("invoice"),
            run.as_deref().unwrap_or("not enrolled yet"),
        );
        if now != last {
            println!("{now}");
            last = now;
        }
        if declines >= 2 && !accepted {
            accepted = behave(&http, &base_url, "succeed").await.is_ok();
            if accepted {
                println!("dunning demo: the card now succeeds; the next retry recovers the run");
            }
        }
        if run.as_deref() == Some("recovered") {
            return;
        }
    }
}
