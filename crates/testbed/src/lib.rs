//! Test-only helpers for the cluster that `scripts/bed test` starts.
//!
//! The script exports `HARDCOUNT_TEST_PG` (Postgres, direct) and
//! `HARDCOUNT_TEST_BOUNCER` (PgBouncer in transaction mode in front of it), both
//! `host:port`, and runs the suite twice with `HARDCOUNT_TEST_LEG` set to
//! `direct` and then `pgbouncer`. Every [`TestDb`] is a new database, migrated
//! over a direct superuser session, reached by the app as `hardcount_app`
//! through the leg under test, and dropped when the value is dropped.

pub mod bouncer;
pub mod cluster;
pub mod leadership;
pub mod payments;
pub mod plans;
pub mod proxy;
pub mod receiver;
mod smtp;
pub mod sockets;
pub mod tls_postgres;
pub mod webhook_verify;

use std::sync::atomic::{AtomicU32, Ordering};

use db::Db;
use sqlx::Connection;
use sqlx::postgres::PgConnection;

pub use smtp::{MinimalSink, SmtpSink, TestCa, free_port};

/// How the app reaches Postgres in this run of the suite.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Leg {
    Direct,
    PgBouncer,
}

impl Leg {
    /// The leg this run of the suite tests.
    pub fn current() -> Leg {
        match std::env::var("HARDCOUNT_TEST_LEG").as_deref() {
            Ok("pgbouncer") => Leg::PgBouncer,
            Ok("direct") | Err(_) => Leg::Direct,
            Ok(other) => panic!("HARDCOUNT_TEST_LEG={other}: expected direct or pgbouncer"),
        }
    }

    pub fn addr(self) -> String {
        match self {
            Leg::Direct => required("HARDCOUNT_TEST_PG"),
            Leg::PgBouncer => required("HARDCOUNT_TEST_BOUNCER"),
        }
    }
}

fn required(var: &str) -> String {
    std::env::var(var).unwrap_or_else(|_| {
        panic!("{var} is not set: run the suite with `scripts/bed test`, which starts Postgres and PgBouncer")
    })
}

/// A fresh, migrated database for one test.
pub struct TestDb {
    name: String,
    /// The app pool as `hardcount_app` through the current leg.
    pub db: Db,
}

impl TestDb {
    /// Create and migrate a new database; connect the app pool (5 connections) through the current leg.
    pub async fn new() -> TestDb {
        Self::with_pool(5).await
    }

    pub async fn with_pool(max_connections: u32) -> TestDb {
        let t = Self::unmigrated(max_connections).await;
        db::migrate(&superuser_url(&t.name))
            .await
            .expect("migrate test database");
        t
    }

    /// [`TestDb::new`], on a database whose every session loads Postgres's
    /// `auto_explain` and sends each statement's plan, with the planner
    /// settings in effect that differ from the defaults, to the client as a
    /// NOTICE ([`plans::PlansNoticed`] collects them). Set before the app
    /// pool's first connection, so through PgBouncer as well every server
    /// connection of this database has it.
    pub async fn with_plans_noticed() -> TestDb {
        let t = Self::new().await;
        let mut admin = admin_connection(&t.name).await;
        sqlx::raw_sql(sqlx::AssertSqlSafe(format!(
            "ALTER DATABASE {name} SET session_preload_libraries = 'auto_explain'; \
             ALTER DATABASE {name} SET auto_explain.log_min_duration = 0; \
             ALTER DATABASE {name} SET auto_explain.log_settings = on; \
             ALTER DATABASE {name} SET auto_explain.log_level = 'notice'",
            name = t.name
        )))
        .execute(&mut admin)
        .await
        .expect("set auto_explain on the test database");
        let _ = admin.close().await;
        t
    }

    /// A new, empty database: nothing migrated. Its app pool cannot do much.
    pub async fn unmigrated(max_connections: u32) -> TestDb {
        static SEQ: AtomicU32 = AtomicU32::new(0);
        let name = format!(
            "t_{}_{}_{:08x}",
            std::process::id(),
            SEQ.fetch_add(1, Ordering::Relaxed),
            rand::random::<u32>()
        );
        let mut admin = admin_connection("postgres").await;
        sqlx::raw_sql(sqlx::AssertSqlSafe(format!("CREATE DATABASE {name}")))
            .execute(&mut admin)
            .await
            .expect("create test database");
        let _ = admin.close().await;
        let db = Db::connect_lazy(&app_url(Leg::current(), &name), max_connections).unwrap();
        TestDb { name, db }
    }

    pub fn name(&self) -> &str {
        &self.name
    }

    /// `hardcount_app`'s URL for this database through `leg`.
    pub fn app_url(&self, leg: Leg) -> String {
        app_url(leg, &self.name)
    }

    /// The API role's pool (`hardcount_api`: creates endpoints, rotates
    /// secrets, writes customers, plans and subscriptions) through the
    /// current leg.
    pub fn api(&self) -> Db {
        Db::connect_lazy(&role_url("hardcount_api", Leg::current(), &self.name), 2).unwrap()
    }

    /// [`tenant_writer`] on this database: the API role acting for `tenant`.
    pub fn api_as(&self, tenant: &str) -> TenantWriter {
        TenantWriter {
            db: self.api(),
            tenant: tenant.to_owned(),
        }
    }

    /// The operator role's pool (`hardcount_operator`: `leader_status`,
    /// `leader_pause`, `leader_unpause`) through the current leg.
    pub fn operator(&self) -> Db {
        Db::connect_lazy(&self.operator_url(Leg::current()), 1).unwrap()
    }

    /// `hardcount_operator`'s URL for this database through `leg`.
    pub fn operator_url(&self, leg: Leg) -> String {
        role_url("hardcount_operator", leg, &self.name)
    }

    /// `role`'s URL for this database through `leg` (no password: the bed trusts).
    pub fn role_url(&self, role: &str, leg: Leg) -> String {
        role_url(role, leg, &self.name)
    }

    /// A direct superuser URL for this database (setup and inspection only).
    pub fn superuser_url(&self) -> String {
        superuser_url(&self.name)
    }

    /// A direct superuser session on this database, for setup and for holding
    /// locks or transactions open the way another client would.
    pub async fn superuser(&self) -> PgConnection {
        admin_connection(&self.name).await
    }

    /// A trigger `name` on `table` that makes each UPDATE of a row meeting
    /// `when` (a condition on `OLD` and `NEW`) raise "refused for the test":
    /// a statement that fails where the test wants it to, to see what
    /// survives it. [`TestDb::allow_updates`] takes it away.
    pub async fn refuse_updates(&self, table: &str, name: &str, when: &str) {
        let mut su = self.superuser().await;
        for ddl in [
            format!(
                "CREATE FUNCTION {name}() RETURNS trigger LANGUAGE plpgsql AS $$ \
                 BEGIN IF {when} THEN RAISE EXCEPTION 'refused for the test'; END IF; \
                 RETURN NEW; END $$"
            ),
            format!(
                "CREATE TRIGGER {name} BEFORE UPDATE ON {table} \
                 FOR EACH ROW EXECUTE FUNCTION {name}()"
            ),
        ] {
            sqlx::raw_sql(sqlx::AssertSqlSafe(ddl))
                .execute(&mut su)
                .await
                .unwrap();
        }
    }

    /// Take away the trigger [`TestDb::refuse_updates`] made.
    pub async fn allow_updates(&self, table: &str, name: &str) {
        let mut su = self.superuser().await;
        sqlx::raw_sql(sqlx::AssertSqlSafe(format!(
            "DROP TRIGGER {name} ON {table}"
        )))
        .execute(&mut su)
        .await
        .unwrap();
    }
}

impl Drop for TestDb {
    fn drop(&mut self) {
        // Drop runs outside any runtime guarantee; do the cleanup on a thread of its own.
        let name = self.name.clone();
        let _ = std::thread::spawn(move || {
            let rt = tokio::runtime::Builder::new_current_thread()
                .enable_all()
                .build();
            if let Ok(rt) = rt {
                rt.block_on(async {
                    let mut admin = admin_connection("postgres").await;
                    let _ = sqlx::raw_sql(sqlx::AssertSqlSafe(format!(
                        "DROP DATABASE IF EXISTS {name} WITH (FORCE)"
                    )))
                    .execute(&mut admin)
                    .await;
                });
            }
        })
        .join();
    }
}

/// The API role (`hardcount_api`) on the database `db` reaches, through the
/// current leg, acting for `tenant`: what tests seed tenants' rows with
/// (customers, plans, subscriptions), as the tenant API writes them; the
/// role loops' own role may not. Each statement runs in its own transaction
/// with the tenant set for row-level security (transaction-local, as the
/// API sets it), so it reads and writes only that tenant's rows.
///
/// # Panics
/// If `db` names no database.
pub fn tenant_writer(db: &Db, tenant: &str) -> TenantWriter {
    let name = db.database_name().expect("a test pool names its database");
    TenantWriter {
        db: Db::connect_lazy(&role_url("hardcount_api", Leg::current(), &name), 2).unwrap(),
        tenant: tenant.to_owned(),
    }
}

/// See [`tenant_writer`].
pub struct TenantWriter {
    db: Db,
    tenant: String,
}

impl TenantWriter {
    /// A transaction acting for the writer's tenant.
    pub async fn begin(&self) -> db::Result<db::Tx> {
        let mut tx = self.db.begin().await?;
        tx.act_for_tenant(&self.tenant).await?;
        Ok(tx)
    }

    pub async fn fetch_one(&self, stmt: db::Stmt<'_>) -> db::Result<db::PgRow> {
        let mut tx = self.begin().await?;
        let row = tx.fetch_one(stmt).await?;
        tx.commit().await?;
        Ok(row)
    }

    pub async fn execute(&self, stmt: db::Stmt<'_>) -> db::Result<u64> {
        let mut tx = self.begin().await?;
        let n = tx.execute(stmt).await?;
        tx.commit().await?;
        Ok(n)
    }
}

pub fn app_url(leg: Leg, database: &str) -> String {
    role_url("hardcount_app", leg, database)
}

fn role_url(role: &str, leg: Leg, database: &str) -> String {
    format!("postgres://{role}@{}/{database}", leg.addr())
}

/// The application key tests seal webhook secrets with
/// (`HARDCOUNT_SECRETS_KEY`'s syntax: `<id>:<base64 of 32 bytes>`). A test key
/// only: production keys come from `hardcount secrets generate-key`.
pub const SECRETS_KEY: &str = "test:dGhpcyBpcyB0aGUgdGVzdCBiZWQncyBvbmx5IGtleSE=";

pub fn superuser_url(database: &str) -> String {
    format!("postgres://postgres@{}/{database}", Leg::Direct.addr())
}

async fn admin_connection(database: &str) -> PgConnection {
    PgConnection::connect(&superuser_url(database))
        .await
        .unwrap_or_else(|e| panic!("connect to the test cluster as postgres: {e}"))
}
