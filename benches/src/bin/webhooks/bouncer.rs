//! PgBouncer's counters over a phase (only on the PgBouncer path) and the
//! figures they give.

use std::collections::HashMap;
use std::time::Duration;

use testbed::Leg;
use tokio_util::sync::CancellationToken;

use crate::report::Figure;

/// PgBouncer's counters for `database`, if its admin console answers (only on
/// the PgBouncer path).
pub async fn snapshot(leg: Leg, database: &str) -> Option<HashMap<String, i64>> {
    if leg != Leg::PgBouncer {
        return None;
    }
    let mut admin = benches::bouncer_admin().await.ok()?;
    benches::bouncer_stats(&mut admin, database).await.ok()
}

/// PgBouncer counters over a phase.
pub struct Bouncer {
    transactions: i64,
    queries: i64,
    /// Microseconds clients waited for a server connection.
    wait_us: i64,
    /// Sampled from `SHOW POOLS`: mean server connections in use, mean clients waiting.
    mean_active: f64,
    mean_waiting: f64,
}

impl Bouncer {
    /// The counters' change between two snapshots, with the sampled pool means.
    pub fn delta(
        before: Option<HashMap<String, i64>>,
        after: Option<HashMap<String, i64>>,
        sampled: Option<(f64, f64)>,
    ) -> Option<Bouncer> {
        let (b, a) = (before?, after?);
        let d = |k: &str| a.get(k).copied().unwrap_or(0) - b.get(k).copied().unwrap_or(0);
        let (mean_active, mean_waiting) = sampled.unwrap_or((f64::NAN, f64::NAN));
        Some(Bouncer {
            transactions: d("total_xact_count"),
            queries: d("total_query_count"),
            wait_us: d("total_wait_time"),
            mean_active,
            mean_waiting,
        })
    }

    pub fn figures(&self, phase: &str, deliveries: usize, figures: &mut Vec<Figure>) {
        let pool_size: Option<f64> = benches::bed_bouncer_pool_size().parse().ok();
        figures.push(Figure::new(
            format!(
                "{phase}: PgBouncer transactions per delivery (each sqlx release ping counts as one)"
            ),
            self.transactions as f64 / deliveries as f64,
            "transactions",
        ));
        figures.push(Figure::new(
            format!("{phase}: PgBouncer queries (round trips) per delivery"),
            self.queries as f64 / deliveries as f64,
            "queries",
        ));
        figures.push(Figure::new(
            format!("{phase}: PgBouncer mean wait for a server connection, per transaction"),
            self.wait_us as f64 / self.transactions.max(1) as f64 / 1e3,
            "ms",
        ));
        let of = pool_size.map_or_else(String::new, |n| format!(" (of {n})"));
        figures.push(Figure::new(
            format!("{phase}: PgBouncer server connections in use, sampled mean{of}"),
            self.mean_active,
            "connections",
        ));
        figures.push(Figure::new(
            format!("{phase}: PgBouncer clients waiting for a server connection, sampled mean"),
            self.mean_waiting,
            "clients",
        ));
    }
}

/// Mean `sv_active` and `cl_waiting` of `hardcount_app`'s pool for `database`,
/// sampled every 50 ms until stopped.
pub struct PoolSampler {
    stop: CancellationToken,
    handle: tokio::task::JoinHandle<Option<(f64, f64)>>,
}

impl PoolSampler {
    pub fn start(leg: Leg, database: &str) -> PoolSampler {
        let stop = CancellationToken::new();
        let (until, database) = (stop.clone(), database.to_owned());
        let handle = tokio::spawn(async move {
            if leg != Leg::PgBouncer {
                return None;
            }
            let mut admin = benches::bouncer_admin().await.ok()?;
            let (mut active, mut waiting, mut n) = (0i64, 0i64, 0u32);
            while !until.is_cancelled() {
                if let Ok(Some((a, w))) =
                    benches::bouncer_pool(&mut admin, &database, "hardcount_app").await
                {
                    active += a;
                    waiting += w;
                    n += 1;
                }
                until
                    .run_until_cancelled(tokio::time::sleep(Duration::from_millis(50)))
                    .await;
            }
            (n > 0).then(|| (active as f64 / f64::from(n), waiting as f64 / f64::from(n)))
        });
        PoolSampler { stop, handle }
    }

    pub async fn stop(self) -> Option<(f64, f64)> {
        self.stop.cancel();
        self.handle.await.ok().flatten()
    }
}
