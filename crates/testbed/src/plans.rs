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
