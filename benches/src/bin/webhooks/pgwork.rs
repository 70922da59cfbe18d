//! Postgres work per delivery (issue 13, point 4): WAL bytes, transactions,
//! tuples written, updates that were not HOT (each adds an entry to every
//! index whose predicate the new row matches), and dead tuples left, read
//! from `pg_current_wal_lsn()`, `pg_stat_database` and `pg_stat_user_tables`
//! around a phase. A backend publishes its table counters at transaction end
//! at most once a second, after 10 s idle, and when it exits; PgBouncer keeps
//! its server connections, so each reading first closes every other backend
//! of the phase's database (the callers close their pools first).

use anyhow::Result;
use sqlx::PgConnection;

use crate::report::{Figure, Report};

/// The counters at one moment.
#[derive(Debug, Clone, Copy, Default)]
pub struct PgWork {
    wal_bytes: f64,
    commits: f64,
    inserted: f64,
    updated: f64,
    hot_updated: f64,
    dead: f64,
}

impl PgWork {
    /// Read the counters (the three webhook tables, this database).
    pub async fn take(su: &mut PgConnection) -> Result<PgWork> {
        // Exiting backends publish their counters.
        sqlx::query(
            "SELECT pg_terminate_backend(pid) FROM pg_stat_activity \
             WHERE datname = current_database() AND pid <> pg_backend_pid()",
        )
        .execute(&mut *su)
        .await?;
        tokio::time::sleep(std::time::Duration::from_millis(200)).await;
        // Make this backend's view of the shared counters fresh.
        sqlx::query("SELECT pg_stat_clear_snapshot()")
            .execute(&mut *su)
            .await?;
        let (wal_bytes, commits, inserted, updated, hot_updated, dead): (
            f64,
            f64,
            f64,
            f64,
            f64,
            f64,
        ) = sqlx::query_as(
            "SELECT pg_wal_lsn_diff(pg_current_wal_lsn(), '0/0')::float8, \
                    (SELECT xact_commit FROM pg_stat_database WHERE datname = current_database())::float8, \
                    sum(n_tup_ins)::float8, sum(n_tup_upd)::float8, sum(n_tup_hot_upd)::float8, \
                    sum(n_dead_tup)::float8 \
             FROM pg_stat_user_tables \
             WHERE relname IN ('webhook_events', 'webhook_deliveries', 'webhook_endpoints')",
        )
        .fetch_one(&mut *su)
        .await?;
        Ok(PgWork {
            wal_bytes,
            commits,
            inserted,
            updated,
            hot_updated,
            dead,
        })
    }

    /// What happened between `self` and `later`, per delivery.
    pub fn per_delivery(&self, later: &PgWork, deliveries: usize) -> PgWork {
        let n = deliveries.max(1) as f64;
        PgWork {
            wal_bytes: (later.wal_bytes - self.wal_bytes) / n,
            commits: (later.commits - self.commits) / n,
            inserted: (later.inserted - self.inserted) / n,
            updated: (later.updated - self.updated) / n,
            hot_updated: (later.hot_updated - self.hot_updated) / n,
            dead: (later.dead - self.dead) / n,
        }
    }

    pub fn figures(&self, what: &str, report: &mut Report) {
        let f = &mut report.figures;
        f.push(Figure::new(
            format!("{what}: WAL bytes per delivery"),
            self.wal_bytes,
            "bytes",
        ));
        f.push(Figure::new(
            format!("{what}: transactions committed per delivery (every client of the database)"),
            self.commits,
            "transactions",
        ));
        report.detail(
            &format!("{what}: webhook table rows per delivery"),
            format!(
                "{:.2} inserted, {:.2} updated of which {:.2} HOT, {:.2} dead tuples left (before vacuum)",
                self.inserted, self.updated, self.hot_updated, self.dead
            ),
        );
    }
}
