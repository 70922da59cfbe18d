//! Reading a statement's plan as a role's transaction would plan it
//! (docs/adr/0023): the plan tests of the queue statements.

use std::time::Duration;

use db::{Db, Row, Stmt, sql};

/// EXPLAIN `statement` (text format) in a `Db::begin_index_driven`
/// transaction, `bind` applying its parameters; the plan as one string.
pub async fn explain_index_driven(
    db: &Db,
    statement: &str,
    bind: impl FnOnce(Stmt<'static>) -> Stmt<'static>,
) -> String {
    explain_index_driven_after(db, None, statement, bind).await
}

/// [`explain_index_driven`], with `setting` (a `SET LOCAL` the role runs
/// before the statement) run first in the same transaction.
pub async fn explain_index_driven_after(
    db: &Db,
    setting: Option<&'static str>,
    statement: &str,
    bind: impl FnOnce(Stmt<'static>) -> Stmt<'static>,
) -> String {
    // `sql` takes a literal; a test's EXPLAIN text lives for the process.
    let text: &'static str = format!("EXPLAIN {statement}").leak();
    let mut tx = db.begin_index_driven(Duration::from_secs(5)).await.unwrap();
    if let Some(setting) = setting {
        tx.fetch_all(sql(setting)).await.unwrap();
    }
    let rows = tx.fetch_all(bind(sql(text))).await.unwrap();
    tx.commit().await.unwrap();
    rows.iter()
        .map(|r| r.get::<String, _>(0))
        .collect::<Vec<_>>()
        .join("\n")
}

/// The plans a role's own calls ran with, as Postgres's `auto_explain`
/// reported them: what pins the planner settings a role's transaction runs a
/// statement under, where an EXPLAIN in the test applies the settings itself
/// and so cannot see them go missing from the role.
///
/// [`crate::TestDb::with_plans_noticed`] sets the database up so that every
/// statement's plan, with the planner settings in effect that differ from
/// the defaults (`Settings:`), comes back to the client as a NOTICE; sqlx
/// hands notices to `tracing` (target `sqlx::postgres::notice`), and
/// [`PlansNoticed::start`] collects them on this thread.
pub struct PlansNoticed {
    seen: std::sync::Arc<std::sync::Mutex<Vec<String>>>,
    _guard: tracing::subscriber::DefaultGuard,
    _second: tracing::Dispatch,
}

impl PlansNoticed {
    /// Collect the notices of the statements this thread runs from now until
    /// the value is dropped (a `#[tokio::test]` runs its futures on one
    /// thread).
    pub fn start() -> PlansNoticed {
        use tracing_subscriber::layer::SubscriberExt as _;
        let seen = std::sync::Arc::new(std::sync::Mutex::new(Vec::new()));
        // tracing decides whether a log line is enabled when it is first
        // hit, and with one dispatcher registered it asks only the hitting
        // thread's: another test's thread could hit sqlx's notice line first
        // and cache it as disabled (seen: no plan noticed when these tests ran
        // side by side). With two registered it asks them all.
        let second = tracing::Dispatch::new(tracing::subscriber::NoSubscriber::default());
        let subscriber = tracing_subscriber::registry().with(Notices(seen.clone()));
        let guard = tracing::subscriber::set_default(subscriber);
        tracing::callsite::rebuild_interest_cache();
        PlansNoticed {
            seen,
            _guard: guard,
            _second: second,
        }
    }

    /// The plans noticed for `statement` (its whole text), in the order run.
    pub fn plans_of(&self, statement: &str) -> Vec<String> {
        self.plans_where(|text| text.starts_with(statement))
    }

    /// The plans noticed for the statements whose text contains `marker`
    /// (for a statement written inline in the role's code), in the order run.
    pub fn plans_containing(&self, marker: &str) -> Vec<String> {
        self.plans_where(|text| text.contains(marker))
    }

    /// The plans whose statement's text (the line after `Query Text: `)
    /// passes `keep`.
    fn plans_where(&self, keep: impl Fn(&str) -> bool) -> Vec<String> {
        self.seen
            .lock()
            .unwrap()
            .iter()
            .filter(|m| {
                m.split_once("Query Text: ")
                    .is_some_and(|(_, text)| keep(text.lines().next().unwrap_or("")))
            })
            .cloned()
            .collect()
    }

    /// The plan of `statement` (its whole text), which ran once.
    ///
    /// # Panics
    /// If it ran never or more than once.
    pub fn plan_of(&self, statement: &str) -> String {
        let mut plans = self.plans_of(statement);
        assert!(
            plans.len() == 1,
            "{} plans noticed for {statement:?} among {} notices",
            plans.len(),
            self.seen.lock().unwrap().len()
        );
        plans.remove(0)
    }
}

/// The settings of `Db::begin_index_driven`, as a plan's `Settings:` line
/// names them.
pub const INDEX_DRIVEN_SETTINGS: [&str; 5] = [
    "enable_bitmapscan = 'off'",
    "enable_hashjoin = 'off'",
    "enable_mergejoin = 'off'",
    "enable_material = 'off'",
    "jit = 'off'",
];

/// Asserts that there is at least one plan in `plans` and that each was
/// planned with every one of `settings` (its `Settings:` line names them).
///
/// # Panics
/// If `plans` is empty or a plan lacks a setting.
pub fn assert_planned_with(plans: &[String], settings: &[&str]) {
    assert!(!plans.is_empty(), "no plan noticed");
    for plan in plans {
        let line = planner_settings(plan);
        for set in settings {
            assert!(line.contains(set), "{set} not in {line:?}\n{plan}");
        }
    }
}

/// A noticed plan's `Settings:` line: the planner settings in effect that
/// differ from the defaults; empty when none did.
pub fn planner_settings(plan: &str) -> &str {
    plan.lines()
        .map(str::trim_start)
        .find(|l| l.starts_with("Settings:"))
        .unwrap_or("")
}

/// The `tracing` layer of [`PlansNoticed`].
struct Notices(std::sync::Arc<std::sync::Mutex<Vec<String>>>);

impl<S: tracing::Subscriber> tracing_subscriber::Layer<S> for Notices {
    fn on_event(&self, event: &tracing::Event<'_>, _: tracing_subscriber::layer::Context<'_, S>) {
        if event.metadata().target() == "sqlx::postgres::notice" {
            let mut message = Message(String::new());
            event.record(&mut message);
            self.0.lock().unwrap().push(message.0);
        }
    }
}

/// An event's `message` field.
struct Message(String);

impl tracing::field::Visit for Message {
    fn record_str(&mut self, field: &tracing::field::Field, value: &str) {
        if field.name() == "message" {
            value.clone_into(&mut self.0);
        }
    }

    fn record_debug(&mut self, field: &tracing::field::Field, value: &dyn std::fmt::Debug) {
        if field.name() == "message" && self.0.is_empty() {
            self.0 = format!("{value:?}");
        }
    }
}

/// Turn autovacuum off on every table of the database `su` is connected to,
/// so that none is analyzed while a test or benchmark runs: the planner then
/// sees the tables as a first import or a restore leaves them (Postgres 15
/// restores no statistics; docs/adr/0065, 0066).
///
/// # Errors
/// A table that cannot be altered (`su` is not the superuser).
pub async fn keep_tables_unanalyzed(su: &mut sqlx::PgConnection) -> sqlx::Result<()> {
    let tables: Vec<String> =
        sqlx::query_scalar("SELECT format('%I.%I', schemaname, relname) FROM pg_stat_user_tables")
            .fetch_all(&mut *su)
            .await?;
    for table in tables {
        sqlx::raw_sql(sqlx::AssertSqlSafe(format!(
            "ALTER TABLE {table} SET (autovacuum_enabled = false)"
        )))
        .execute(&mut *su)
        .await?;
    }
    Ok(())
}

/// The tables of `su`'s database that have been analyzed, by hand or by
/// autovacuum: empty is what a run after [`keep_tables_unanalyzed`] must end
/// with.
///
/// # Errors
/// The statistics view cannot be read.
pub async fn tables_analyzed(su: &mut sqlx::PgConnection) -> sqlx::Result<Vec<String>> {
    sqlx::query_scalar(
        "SELECT relname::text FROM pg_stat_user_tables \
         WHERE last_analyze IS NOT NULL OR last_autoanalyze IS NOT NULL ORDER BY relname",
    )
    .fetch_all(su)
    .await
}
