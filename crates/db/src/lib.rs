//! The one way this service runs SQL.
//!
//! The app pool may sit behind PgBouncer in transaction mode, where a server
//! connection belongs to a client only between `BEGIN` and `COMMIT`. sqlx sends
//! an extended-protocol statement in two round trips (Parse+Describe+Sync, then
//! Bind+Execute+Sync); outside a transaction PgBouncer may hand the server
//! connection to another client between them, and the second client's unnamed
//! statement then runs with our parameters. Named prepared statements do not
//! survive a connection change at all.
//!
//! So every statement here runs unnamed (`persistent(false)`) inside an explicit
//! transaction, which pins one server connection from `BEGIN` to `COMMIT`
//! (docs/adr/0001-pooler-safe-access-path.md). [`Stmt`] is the only statement
//! type [`Db`] and [`Tx`] accept, and neither hands out the pool or the raw
//! connection, so a crate cannot run SQL on the app pool any other way.
//! Migrations are the exception: they need a session ([`migrate`]).

mod connect;
mod fair;
mod listen;
mod migrate;
mod redact;
mod schema;

use std::sync::Arc;
use std::time::Duration;

use sqlx::pool::PoolConnection;
use sqlx::postgres::{PgArguments, PgPoolOptions};
use sqlx::query::Query;
use sqlx::{Encode, PgPool, Postgres, Type};

pub use connect::{SSL_MODES, check_url};
pub use fair::{TENANTS_PER_CLAIM, TenantCursor, Walk};
pub use listen::{LISTEN_APPLICATION_NAME, Listener};
pub use migrate::{MigrateError, MigrationReport, migrate};
pub use redact::{
    REDACTED, UNPARSEABLE, is_secret_parameter, redact_error, redacted, redacted_url,
};
pub use schema::{SchemaError, check_schema_ready};
pub use sqlx::Row;
pub use sqlx::postgres::PgRow;
pub use sqlx::types::Json;

/// The planner settings of [`Db::begin_index_driven`], appended to its
/// `BEGIN` message (each preceded by `; `).
macro_rules! index_driven {
    () => {
        "; SET LOCAL enable_bitmapscan = off; SET LOCAL enable_hashjoin = off; \
         SET LOCAL enable_mergejoin = off; SET LOCAL enable_material = off; \
         SET LOCAL jit = off"
    };
}

/// The one setting [`Db::begin_index_driven_as_written`] adds (see
/// [`AS_WRITTEN`]).
macro_rules! as_written {
    () => {
        "SET LOCAL join_collapse_limit = 1"
    };
}

/// Errors from the access path.
#[derive(Debug, thiserror::Error)]
pub enum Error {
    /// The URL does not parse as a Postgres URL, or its TLS settings
    /// (`sslmode`, `sslrootcert`) cannot be used; the URL is shown redacted.
    #[error("invalid database URL: {0}")]
    BadUrl(String),
    /// The TLS handshake failed (a certificate the URL's `sslmode` and
    /// `sslrootcert` do not accept), or the server has no TLS and the URL
    /// requires it.
    #[error(
        "TLS to Postgres at {url} failed: {detail} (the URL's sslmode and sslrootcert say what is verified)"
    )]
    Tls { url: String, detail: String },
    /// A statement or connection failed; the message is the server's or the driver's.
    #[error(transparent)]
    Sql(#[from] sqlx::Error),
}

impl Error {
    /// The SQLSTATE of a server error, if this is one.
    pub fn code(&self) -> Option<String> {
        match self {
            Error::Sql(sqlx::Error::Database(e)) => e.code().map(|c| c.into_owned()),
            _ => None,
        }
    }

    /// The server's own message of a server error (a definer function's
    /// refusal, say), without the SQL; None for any other error.
    pub fn server_message(&self) -> Option<&str> {
        match self {
            Error::Sql(sqlx::Error::Database(e)) => Some(e.message()),
            _ => None,
        }
    }

    /// The constraint a server error names, if any (map it to a domain error).
    pub fn constraint(&self) -> Option<&str> {
        match self {
            Error::Sql(sqlx::Error::Database(e)) => e.constraint(),
            _ => None,
        }
    }

    /// True when the server cancelled the statement for `statement_timeout`.
    pub fn is_statement_timeout(&self) -> bool {
        self.code().as_deref() == Some("57014")
    }
}

pub type Result<T, E = Error> = std::result::Result<T, E>;

/// One SQL statement with its parameters, always sent unnamed.
#[must_use = "a statement does nothing until a Db or Tx runs it"]
pub struct Stmt<'q>(Query<'q, Postgres, PgArguments>);

/// Start a statement. The text must be a literal: values go through [`Stmt::bind`].
pub fn sql(text: &'static str) -> Stmt<'static> {
    Stmt(sqlx::query(text).persistent(false))
}

impl<'q> Stmt<'q> {
    /// Bind the next `$n` parameter.
    pub fn bind<T>(self, value: T) -> Self
    where
        T: 'q + Encode<'q, Postgres> + Type<Postgres> + Send,
    {
        Stmt(self.0.bind(value))
    }
}

/// The app pool. Cloning is cheap and shares the pool.
#[derive(Clone)]
pub struct Db {
    pool: PgPool,
    /// The URL, for connection errors; used only through `redacted_url`.
    url: Arc<str>,
}

impl std::fmt::Debug for Db {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        // Never print options: they hold the password.
        f.debug_struct("Db")
            .field("size", &self.pool.size())
            .finish()
    }
}

impl Db {
    /// The database this pool connects to (tests derive another role's pool
    /// on the same database from it).
    pub fn database_name(&self) -> Option<String> {
        self.pool
            .connect_options()
            .get_database()
            .map(str::to_owned)
    }

    /// Open a lazy pool of at most `max_connections` to `url`.
    ///
    /// # Errors
    /// [`Error::BadUrl`] if the URL does not parse or its TLS settings cannot
    /// be used ([`check_url`]); nothing connects until first use, and a failed
    /// TLS handshake then is [`Error::Tls`].
    pub fn connect_lazy(url: &str, max_connections: u32) -> Result<Db> {
        let options = connect::connect_options(url)?
            // Named statements break on a pooled server connection.
            .statement_cache_capacity(0)
            // PgBouncer 1.18 refuses this startup parameter unless told to ignore it.
            .extra_float_digits(None)
            .application_name("hardcount");
        let pool = PgPoolOptions::new()
            .max_connections(max_connections)
            .acquire_timeout(Duration::from_secs(5))
            // A checkout ping is a round trip on every statement; a dead
            // connection fails its statement instead, which every caller handles.
            .test_before_acquire(false)
            .connect_lazy_with(options);
        Ok(Db {
            pool,
            url: url.into(),
        })
    }

    /// Begin a transaction on one server connection.
    ///
    /// # Cancel safety
    /// Cancel-safe: see [`Db::begin_with_timeout`].
    pub async fn begin(&self) -> Result<Tx> {
        Tx::begin(self, "BEGIN".to_owned()).await
    }

    /// Begin a transaction whose statements the server cancels after `limit`,
    /// and which the server ends if the client leaves it idle for longer than
    /// `limit` (at least [`MIN_IDLE_IN_TRANSACTION`]) between two statements.
    ///
    /// `SET LOCAL` lives and dies with the transaction, so no session state
    /// leaks to the next client of the pooled server connection. The idle
    /// bound is what stops a stalled client (SIGSTOP, a VM pause, a partition)
    /// from holding a row lock until its session ends (docs/adr/0008).
    ///
    /// # Cancel safety
    /// Cancel-safe: dropping the future at any point never returns a
    /// connection to the pool inside a transaction it did not finish. Once
    /// `BEGIN` may have been sent and its reply has not been read, the
    /// connection's state is unknown and it is closed instead (docs/adr/0008).
    pub async fn begin_with_timeout(&self, limit: Duration) -> Result<Tx> {
        self.begin_bounded(limit, "").await
    }

    /// [`Db::begin_with_timeout`] whose first statement, in the same
    /// simple-protocol message (one round trip), is `SELECT function(arg)`:
    /// its text result, or `None` for NULL. `function` is a name fixed in
    /// code and `arg` is sent as a hex `bytea` literal, so nothing from
    /// outside reaches the SQL text but hex digits. The tenant API
    /// authenticates each request's transaction this way.
    ///
    /// # Cancel safety
    /// As [`Db::begin_with_timeout`].
    pub async fn begin_calling(
        &self,
        limit: Duration,
        function: &'static str,
        arg: &[u8],
    ) -> Result<(Tx, Option<String>)> {
        debug_assert!(
            function
                .bytes()
                .all(|b| b.is_ascii_lowercase() || b == b'_'),
            "a function name fixed in code"
        );
        let text = bounded_begin(limit, &format!("; SELECT {function}({})", hex_bytea(arg)));
        let (tx, rows) = Tx::begin_fetching(self, text).await?;
        let value = match rows.first() {
            Some(row) => row.try_get::<Option<String>, _>(0)?,
            None => None,
        };
        Ok((tx, value))
    }

    /// Run `statements` as one transaction in one simple-protocol message
    /// (one round trip, one server connection for that message only): the
    /// server runs a message of several statements without BEGIN as one
    /// implicit transaction, commits it after the last and rolls it all back
    /// at the first error. Each statement is bounded by `limit` as
    /// [`Db::begin_with_timeout`] bounds it. Every row of every statement, in
    /// order.
    ///
    /// The text is sent as it is: build it from SQL fixed in code and values
    /// rendered by [`hex_bytea`] or [`hex_text`] only, so nothing from
    /// outside reaches it but hex digits. The tenant API publishes an event
    /// this way (authenticate, insert, commit: one message instead of four).
    ///
    /// # Cancel safety
    /// Cancel-safe: a connection whose reply was not read to the end is
    /// closed, not pooled.
    pub async fn run_once(&self, limit: Duration, statements: &str) -> Result<Vec<PgRow>> {
        let ms = limit.as_millis().max(1);
        let text = format!("SET LOCAL statement_timeout = {ms}; {statements}");
        let conn = self
            .pool
            .acquire()
            .await
            .map_err(|e| connect::connect_error(e, &self.url))?;
        let mut conn = Pooled::new(conn);
        conn.state = State::Unknown;
        let rows = sqlx::raw_sql(sqlx::AssertSqlSafe(text))
            .fetch_all(conn.raw())
            .await;
        // Answered to the end, with or without an error: the implicit
        // transaction is over (committed or rolled back).
        if matches!(&rows, Ok(_) | Err(sqlx::Error::Database(_))) {
            conn.state = State::Idle;
        }
        Ok(rows?)
    }

    /// [`Db::begin_with_timeout`] for a queue statement that must reach its
    /// rows through their keys and ordered indexes whatever the table
    /// statistics say (docs/adr/0023): bitmap scans, hash and merge joins and
    /// materialized inner sides are off for this transaction. A queue table's statistics lag its
    /// contents (a fresh table has none; a burst is not in them until the next
    /// ANALYZE), and with too few rows expected the planner reads and sorts
    /// every pending row to claim a batch, or hashes (or materializes) them to
    /// write one group of outcomes: work that grows with the backlog instead
    /// of the batch. The plans the planner then prefers are an ordered index
    /// scan for a claim and an index lookup per row for a join to a batch
    /// (sequential scans and sorts stay allowed; the plan tests check these
    /// statements' plans).
    ///
    /// JIT compilation is off too. These statements touch a batch and run in
    /// milliseconds, but a claim's cost estimate can pass `jit_above_cost`
    /// (the fair claims' loose scan is estimated over the whole index,
    /// docs/adr/0048), and compiling it took 600 ms of a 20 ms statement:
    /// measured on the outbox claim with a million events queued.
    ///
    /// # Cancel safety
    /// As [`Db::begin_with_timeout`].
    pub async fn begin_index_driven(&self, limit: Duration) -> Result<Tx> {
        self.begin_bounded(limit, index_driven!()).await
    }

    /// [`Db::begin_index_driven`], with [`AS_WRITTEN`] as well: for
    /// a statement of many joins written so that each joins its table by a
    /// key of the rows before it. The planner then takes the joins in the
    /// order written instead of searching the orders: it neither spends
    /// milliseconds on that search at every call (nothing is prepared through
    /// PgBouncer, so every call is planned) nor picks an order from the
    /// statistics of tables that were never analyzed.
    ///
    /// # Cancel safety
    /// As [`Db::begin_with_timeout`].
    pub async fn begin_index_driven_as_written(&self, limit: Duration) -> Result<Tx> {
        self.begin_bounded(limit, concat!(index_driven!(), "; ", as_written!()))
            .await
    }

    async fn begin_bounded(&self, limit: Duration, planner: &str) -> Result<Tx> {
        Tx::begin(self, bounded_begin(limit, planner)).await
    }

    /// Run one statement in its own transaction and return its one row.
    pub async fn fetch_one(&self, stmt: Stmt<'_>) -> Result<PgRow> {
        let mut tx = self.begin().await?;
        let row = tx.fetch_one(stmt).await?;
        tx.commit().await?;
        Ok(row)
    }

    /// Run one statement in its own transaction and return its row, if any.
    pub async fn fetch_optional(&self, stmt: Stmt<'_>) -> Result<Option<PgRow>> {
        let mut tx = self.begin().await?;
        let row = tx.fetch_optional(stmt).await?;
        tx.commit().await?;
        Ok(row)
    }

    /// Run one statement in its own transaction and return all its rows.
    pub async fn fetch_all(&self, stmt: Stmt<'_>) -> Result<Vec<PgRow>> {
        let mut tx = self.begin().await?;
        let rows = tx.fetch_all(stmt).await?;
        tx.commit().await?;
        Ok(rows)
    }

    /// Run one statement in its own transaction and return the rows it affected.
    pub async fn execute(&self, stmt: Stmt<'_>) -> Result<u64> {
        let mut tx = self.begin().await?;
        let n = tx.execute(stmt).await?;
        tx.commit().await?;
        Ok(n)
    }

    /// Close the pool, waiting for connections in use to come back.
    pub async fn close(&self) {
        self.pool.close().await;
    }
}

/// `BEGIN` with its statement and idle-in-transaction bounds for `limit`,
/// then `tail`: one simple-protocol message, one round trip. The only values
/// spliced in are integers and text fixed in code (or hex digits), so
/// nothing from outside reaches the SQL text.
fn bounded_begin(limit: Duration, tail: &str) -> String {
    let ms = limit.as_millis().max(1);
    let idle_ms = limit.max(MIN_IDLE_IN_TRANSACTION).as_millis();
    format!(
        "BEGIN; SET LOCAL statement_timeout = {ms}; \
         SET LOCAL idle_in_transaction_session_timeout = {idle_ms}{tail}"
    )
}

/// `bytes` as a `bytea` literal of hex digits (`'\\x…'::bytea`), for
/// [`Db::run_once`]'s text.
pub fn hex_bytea(bytes: &[u8]) -> String {
    use std::fmt::Write as _;
    let mut out = String::with_capacity(bytes.len() * 2 + 16);
    out.push_str("'\\x");
    for b in bytes {
        let _ = write!(out, "{b:02x}");
    }
    out.push_str("'::bytea");
    out
}

/// `text` as a `text` value built from hex digits only
/// (`convert_from('\\x…'::bytea, 'UTF8')`), for [`Db::run_once`]'s text.
pub fn hex_text(text: &str) -> String {
    format!("convert_from({}, 'UTF8')", hex_bytea(text.as_bytes()))
}

/// What [`Db::begin_index_driven_as_written`] adds to
/// [`Db::begin_index_driven`]'s settings; a plan test runs it before its
/// EXPLAIN in an index-driven transaction.
pub const AS_WRITTEN: &str = as_written!();

/// Run first in an index-driven transaction whose statement walks a partial
/// index in order up to a limit, where statistics that do not know how few
/// rows qualify (a table never analyzed, or analyzed before a burst) make a
/// whole read and a sort of the table look cheaper: without sequential scans
/// the planner walks the index and stops at the limit. Billing's raw-answer
/// clearing and the event prune use it (docs/adr/0040, docs/adr/0108).
pub const NO_SEQUENTIAL_SCAN: &str = "SELECT set_config('enable_seqscan', 'off', true)";

/// How long a dropped transaction's `ROLLBACK` waits for its replies (a
/// statement still running, then the rollback's own) before the connection
/// is closed instead of returned to the pool.
pub const ROLLBACK_LIMIT: Duration = Duration::from_secs(10);

/// The floor of the idle-in-transaction bound [`Db::begin_with_timeout`]
/// sets: a loaded client's scheduling gap between two statements of a short
/// transaction is not a stall.
pub const MIN_IDLE_IN_TRANSACTION: Duration = Duration::from_secs(1);

/// A transaction on the app pool. Dropped without [`Tx::commit`], it rolls back.
///
/// sqlx 0.9.0 counts a transaction as begun only once `BEGIN`'s reply has
/// arrived, so a dropped `begin` future queues no `ROLLBACK` and the pool
/// takes the connection back "idle in transaction" (sqlx issues 4385, 4393).
/// `Tx` therefore tracks the transaction itself, on a [`Pooled`] connection
/// that goes back to the pool only when it is known to be outside a
/// transaction, and is closed otherwise.
pub struct Tx {
    conn: Pooled,
}

impl Tx {
    async fn begin(db: &Db, begin: String) -> Result<Tx> {
        Ok(Tx::begin_fetching(db, begin).await?.0)
    }

    /// Send `begin` (which opens the transaction) and read its rows, if
    /// any: the transaction and those rows.
    async fn begin_fetching(db: &Db, begin: String) -> Result<(Tx, Vec<PgRow>)> {
        let conn = db
            .pool
            .acquire()
            .await
            .map_err(|e| connect::connect_error(e, &db.url))?;
        let mut conn = Pooled::new(conn);
        // From the first poll of the BEGIN the connection's state is unknown:
        // until its reply is read, a drop closes the connection.
        conn.state = State::Unknown;
        let rows = sqlx::raw_sql(sqlx::AssertSqlSafe(begin))
            .fetch_all(conn.raw())
            .await?;
        conn.state = State::InTransaction;
        Ok((Tx { conn }, rows))
    }

    pub async fn fetch_one(&mut self, stmt: Stmt<'_>) -> Result<PgRow> {
        Ok(stmt.0.fetch_one(self.conn.raw()).await?)
    }

    pub async fn fetch_optional(&mut self, stmt: Stmt<'_>) -> Result<Option<PgRow>> {
        Ok(stmt.0.fetch_optional(self.conn.raw()).await?)
    }

    pub async fn fetch_all(&mut self, stmt: Stmt<'_>) -> Result<Vec<PgRow>> {
        Ok(stmt.0.fetch_all(self.conn.raw()).await?)
    }

    pub async fn execute(&mut self, stmt: Stmt<'_>) -> Result<u64> {
        Ok(stmt.0.execute(self.conn.raw()).await?.rows_affected())
    }

    /// Act for `tenant` for the rest of this transaction: row-level security
    /// (migration 0024) then holds every statement of the API role
    /// (`hardcount_api`) to that tenant's rows. The setting is
    /// transaction-local (`set_config(…, true)`), so a server connection
    /// PgBouncer hands on keeps nothing. The HTTP API never calls this: it
    /// sets the tenant from the caller's key (`api_authenticate`). A producer
    /// linked into the process calls it with the tenant it writes for.
    pub async fn act_for_tenant(&mut self, tenant: &str) -> Result<()> {
        self.execute(
            sql("SELECT set_config('hardcount.tenant_id', $1, true)").bind(tenant.to_owned()),
        )
        .await?;
        Ok(())
    }

    /// # Cancel safety
    /// Dropped before `COMMIT`'s reply, the connection is closed: the server
    /// rolls back unless the `COMMIT` already ran.
    pub async fn commit(mut self) -> Result<()> {
        self.conn.finish("COMMIT").await
    }

    pub async fn rollback(mut self) -> Result<()> {
        self.conn.finish("ROLLBACK").await
    }

    /// Commit after `written` succeeded; after its error, roll back at once
    /// (a drop would roll back only when the connection is next used) and
    /// return that error. A write tried again then does not wait for this
    /// transaction's rows.
    pub async fn commit_if_ok<T, E: From<Error>>(
        self,
        written: std::result::Result<T, E>,
    ) -> std::result::Result<T, E> {
        match written {
            Ok(v) => {
                self.commit().await?;
                Ok(v)
            }
            Err(e) => {
                let _ = self.rollback().await;
                Err(e)
            }
        }
    }
}

/// What is known of a pooled connection's transaction state.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum State {
    /// Outside any transaction, every reply read: safe to pool.
    Idle,
    /// A transaction we began and have not ended.
    InTransaction,
    /// A statement that may open or close a transaction is in flight.
    Unknown,
}

/// A pooled connection that returns to the pool only when [`State::Idle`].
///
/// Dropped in a transaction, it is rolled back on a task of its own when a
/// runtime is there to run one (and closed if that task is dropped or the
/// `ROLLBACK` fails); dropped in an unknown state, it is detached from the
/// pool and its socket closed, which ends any transaction on the server
/// (through PgBouncer, the server connection it held is closed).
struct Pooled {
    conn: Option<PoolConnection<Postgres>>,
    state: State,
}

impl Pooled {
    fn new(conn: PoolConnection<Postgres>) -> Pooled {
        Pooled {
            conn: Some(conn),
            state: State::Idle,
        }
    }

    fn raw(&mut self) -> &mut sqlx::PgConnection {
        self.conn
            .as_mut()
            .expect("a Pooled connection is present until dropped")
    }

    /// Send `COMMIT` or `ROLLBACK`; the connection is idle once its reply is read.
    async fn finish(&mut self, end: &'static str) -> Result<()> {
        self.state = State::Unknown;
        sqlx::raw_sql(end).execute(self.raw()).await?;
        self.state = State::Idle;
        Ok(())
    }
}

impl Drop for Pooled {
    fn drop(&mut self) {
        let Some(conn) = self.conn.take() else { return };
        match self.state {
            State::Idle => drop(conn),
            State::InTransaction => match tokio::runtime::Handle::try_current() {
                Ok(rt) => {
                    // Unknown until the ROLLBACK's reply: a task dropped
                    // before that (a runtime shutting down) closes it.
                    let mut conn = Pooled {
                        conn: Some(conn),
                        state: State::Unknown,
                    };
                    rt.spawn(async move {
                        // Drains any reply still pending from a dropped
                        // statement, then ends the transaction. A link gone
                        // silent never answers: past the bound the
                        // connection, still Unknown, is closed, so it does
                        // not hold its pool slot for ever (docs/adr/0111).
                        let _ = tokio::time::timeout(ROLLBACK_LIMIT, conn.finish("ROLLBACK")).await;
                    });
                }
                Err(_) => drop(conn.detach()),
            },
            State::Unknown => drop(conn.detach()),
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_bad_url_is_a_clear_error_without_the_password() {
        let err = Db::connect_lazy("postgres://u:hunter2@h:notaport/x", 1).unwrap_err();
        let text = err.to_string();
        assert!(text.starts_with("invalid database URL"), "{text}");
        assert!(!text.contains("hunter2"), "{text}");
    }
}
