//! Billing in the local run: the fake payment provider in this process, and a
//! demo plan billed every two minutes with three subscriptions, one of which
//! declines, so a newcomer sees invoices, charges, receipts and `invoice.*`
//! webhooks within a few minutes.
//!
//! The fake provider is built in with the `dev-provider` feature (on by
//! default); a build without it says so and leaves the demo invoices
//! uncharged unless `BILLING_PROVIDER_URL` is set.
//!
//! Each run cancels the previous run's demo subscriptions and seeds new ones
//! whose first periods end 30, 60 and 90 seconds after the start (a fresh
//! fake provider knows none of the old charges). Unless set, billing ticks
//! every 10 seconds (`HARDCOUNT_BILLING_INTERVAL`).
//!
//! With `BILLING_PROVIDER_URL` set, none of this happens: the provider's
//! customers are real, so no demo subscription is seeded for it to charge,
//! and billing keeps its own interval.

use anyhow::{Context, Result};
use db::{Db, Row, sql};

use super::demo::TENANT;
use crate::settings::{ServeSettings, non_empty};

const PLAN: &str = "Demo (every 2 minutes)";

/// The billing events the demo's second endpoint receives (the first, the
/// demo's own, already receives `invoice.finalized`).
const EVENTS: [&str; 5] = [
    "invoice.paid",
    "payment.succeeded",
    "payment.failed",
    "subscription.trial_ended",
    "subscription.collection_resumed",
];

/// (name, email, provider customer, how the fake answers its charges)
const CUSTOMERS: [(&str, &str, &str, Option<&str>); 3] = [
    ("Ada", "ada@example.org", "cus_demo_ada", None),
    ("Grace", "grace@example.org", "cus_demo_grace", None),
    (
        "Mallory",
        "mallory@example.org",
        "cus_demo_mallory",
        Some("insufficient_funds"),
    ),
];

/// The payment provider this run started, kept alive as long as it is held.
#[cfg(feature = "dev-provider")]
pub type LocalProvider = fake_provider::FakeProvider;
/// None can be started: this build has no fake provider.
#[cfg(not(feature = "dev-provider"))]
pub enum LocalProvider {}

/// What a build without the fake provider says when none is configured.
#[cfg(not(feature = "dev-provider"))]
pub const NO_PROVIDER: &str = "no fake payment provider is built in (hardcount was built without \
     its dev-provider feature), so billing charges nothing unless BILLING_PROVIDER_URL (and \
     BILLING_PROVIDER_SECRET_KEY) is set; the webhook and email demos run without it";

/// What the local run does for billing, decided from the settings as given.
#[derive(Debug, PartialEq, Eq)]
pub struct Demo {
    /// No BILLING_PROVIDER_URL was given: start the fake provider (in a build
    /// that has it), tick billing every 10 s and seed the demo subscriptions.
    /// With one given, its customers are real: nothing is seeded to charge.
    demo_provider: bool,
}

/// Before the provider starts: decide from BILLING_PROVIDER_URL whether this
/// is the demo, and then tick billing every 10 s unless its interval is set.
pub fn prepare(serve: &mut ServeSettings) -> Demo {
    let demo_provider = non_empty(&serve.billing_provider_url).is_none();
    if demo_provider && non_empty(&serve.billing_interval).is_none() {
        serve.billing_interval = Some("10s".to_owned());
    }
    Demo { demo_provider }
}

impl Demo {
    /// Start the fake provider for the demo and point billing (and dunning,
    /// which charges through billing) at it; None with a provider configured.
    pub async fn start_provider(&self, serve: &mut ServeSettings) -> Result<Option<LocalProvider>> {
        if !self.demo_provider {
            return Ok(None);
        }
        #[cfg(not(feature = "dev-provider"))]
        {
            let _ = serve;
            println!("{NO_PROVIDER}");
            Ok(None)
        }
        #[cfg(feature = "dev-provider")]
        start_fake(serve).await.map(Some)
    }

    /// [`seed`], for the demo only.
    pub async fn seed(
        &self,
        db: &Db,
        keyring: &webhook_delivery::Keyring,
        receiver_url: &str,
    ) -> Result<()> {
        if !self.demo_provider {
            println!(
                "demo billing: not seeded, BILLING_PROVIDER_URL is set (a real provider's \
                 customers are not charged for a demo)"
            );
            return Ok(());
        }
        seed(db, keyring, receiver_url).await
    }
}

#[cfg(feature = "dev-provider")]
async fn start_fake(serve: &mut ServeSettings) -> Result<LocalProvider> {
    use fake_provider::{Behaviour, FakeProvider, TEST_SECRET_KEY};
    let provider = FakeProvider::start()
        .await
        .context("start the fake payment provider")?;
    for (_, _, customer, decline) in CUSTOMERS {
        if let Some(code) = decline {
            provider.set_behaviour(customer, Behaviour::Decline(code.to_owned()));
        }
    }
    serve.billing_provider_url = Some(provider.base_url());
    serve.billing_provider_secret_key = Some(TEST_SECRET_KEY.into());
    println!(
        "fake payment provider on {} (charges of {} decline)",
        provider.base_url(),
        CUSTOMERS
            .iter()
            .filter(|c| c.3.is_some())
            .map(|c| c.0)
            .collect::<Vec<_>>()
            .join(", ")
    );
    Ok(provider)
}

/// The demo plan, its customers and three fresh subscriptions, and an
/// endpoint on `receiver_url` for the billing events. `db` is the owner's:
/// only the owner writes an endpoint's sealed secret here (docs/adr/0015).
async fn seed(db: &Db, keyring: &webhook_delivery::Keyring, receiver_url: &str) -> Result<()> {
    let mut tx = db.begin().await?;
    let plan: i64 = match tx
        .fetch_optional(
            sql("SELECT id FROM plans WHERE tenant_id = $1 AND name = $2 ORDER BY id LIMIT 1")
                .bind(TENANT)
                .bind(PLAN),
        )
        .await?
    {
        Some(r) => r.try_get("id")?,
        None => tx
            .fetch_one(
                sql("INSERT INTO plans (tenant_id, name, amount, currency, interval_unit, interval_count) \
                     VALUES ($1, $2, 1200, 'EUR', 'minute', 2) RETURNING id")
                .bind(TENANT)
                .bind(PLAN),
            )
            .await?
            .try_get("id")?,
    };
    let canceled = tx
        .execute(
            sql("UPDATE subscriptions SET status = 'canceled', canceled_at = now(), updated_at = now() \
                 WHERE tenant_id = $1 AND plan_id = $2 AND status <> 'canceled'")
            .bind(TENANT)
            .bind(plan),
        )
        .await?;
    for (i, (name, email, customer, _)) in CUSTOMERS.iter().enumerate() {
        let id: i64 = match tx
            .fetch_optional(
                sql("SELECT id FROM customers WHERE tenant_id = $1 AND provider_customer_id = $2")
                    .bind(TENANT)
                    .bind(*customer),
            )
            .await?
        {
            Some(r) => r.try_get("id")?,
            None => tx
                .fetch_one(
                    sql("INSERT INTO customers (tenant_id, email, name, provider_customer_id, payment_method_id) \
                         VALUES ($1, $2, $3, $4, 'pm_card_visa') RETURNING id")
                    .bind(TENANT)
                    .bind(*email)
                    .bind(*name)
                    .bind(*customer),
                )
                .await?
                .try_get("id")?,
        };
        // First periods end 30, 60 and 90 s from now; then every 2 minutes.
        let ends_in = 30.0 * (i as f64 + 1.0);
        tx.execute(
            sql("INSERT INTO subscriptions (tenant_id, customer_id, plan_id, status, billing_anchor, \
                                            current_period_start, current_period_end, next_billing_at) \
                 SELECT $1, $2, $3, 'active', a, a, a + interval '2 minutes', a + interval '2 minutes' \
                 FROM (SELECT now() + make_interval(secs => $4) - interval '2 minutes' AS a) t")
            .bind(TENANT)
            .bind(id)
            .bind(plan)
            .bind(ends_in),
        )
        .await?;
    }
    let endpoint = tx
        .fetch_optional(
            sql(
                "SELECT id FROM webhook_endpoints WHERE tenant_id = $1 AND event_types @> $2 \
                 ORDER BY id LIMIT 1",
            )
            .bind(TENANT)
            .bind(vec!["invoice.paid".to_owned()]),
        )
        .await?;
    if let Some(r) = &endpoint {
        let id: i64 = r.try_get("id")?;
        tx.execute(
            sql("UPDATE webhook_endpoints SET url = $2 WHERE id = $1")
                .bind(id)
                .bind(receiver_url.to_owned()),
        )
        .await?;
    }
    tx.commit().await?;
    if endpoint.is_none() {
        webhook_delivery::create_endpoint(db, keyring, TENANT, receiver_url, &EVENTS)
            .await
            .context("create the demo billing endpoint")?;
    }
    println!(
        "demo billing: plan {PLAN:?} (12.00 EUR), subscriptions for {} billed from 30 s on{}",
        CUSTOMERS.map(|c| c.0).join(", "),
        if canceled > 0 {
            format!(" ({canceled} from the last run canceled)")
        } else {
            String::new()
        }
    );
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::settings::tests::serve_settings as settings;

    /// README: dev starts the fake provider, ticks billing every 10 s and
    /// seeds the demo subscriptions only when BILLING_PROVIDER_URL is unset.
    /// Fails if dev, given a real provider, seeds made-up customers for it to
    /// charge (the seed would reach for the database, which does not
    /// answer), starts the fake in its place, or overrides billing's interval.
    #[tokio::test]
    async fn a_real_provider_gets_no_demo_subscriptions_and_keeps_billing_s_interval() {
        let url = "https://api.stripe.com";
        let mut real = settings(&[
            "--billing-provider-url",
            url,
            "--billing-provider-secret-key",
            "sk_live_x",
        ]);
        let demo = prepare(&mut real);
        assert_eq!(
            demo,
            Demo {
                demo_provider: false
            }
        );
        assert_eq!(real.billing_interval, None);
        assert!(demo.start_provider(&mut real).await.unwrap().is_none());
        assert_eq!(real.billing_provider_url.as_deref(), Some(url));
        let nowhere = Db::connect_lazy("postgres://hardcount_app@127.0.0.1:1/none", 1).unwrap();
        let entry = webhook_delivery::Keyring::generate_entry("t").unwrap();
        let keyring = webhook_delivery::Keyring::parse(&entry).unwrap();
        demo.seed(&nowhere, &keyring, "http://127.0.0.1:1/webhooks")
            .await
            .unwrap();

        for args in [&[][..], &["--billing-provider-url", " "]] {
            let mut unset = settings(args);
            assert_eq!(
                prepare(&mut unset),
                Demo {
                    demo_provider: true
                }
            );
            assert_eq!(unset.billing_interval.as_deref(), Some("10s"));
        }
        let mut set = settings(&["--billing-interval", "30m"]);
        assert!(prepare(&mut set).demo_provider);
        assert_eq!(set.billing_interval.as_deref(), Some("30m"));
    }
}
