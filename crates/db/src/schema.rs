//! The boot check that the schema is at least as new as this binary (docs/design.md §2.5).

use crate::migrate::MIGRATOR;
use crate::{Db, sql};

#[derive(Debug, thiserror::Error)]
pub enum SchemaError {
    #[error("the database has no migrations applied; run `hardcount migrate` first")]
    NotMigrated,
    #[error(
        "the schema is behind this binary: migration {missing} is not applied; run `hardcount migrate`"
    )]
    Behind { missing: String },
    #[error("migration {version} failed part-way; fix it and rerun `hardcount migrate`")]
    Dirty { version: i64 },
    /// The message holds the cause's, so the cause is not also its source
    /// (an error chain would print it twice).
    #[error("cannot check the schema: {0}")]
    Unreachable(crate::Error),
}

impl From<crate::Error> for SchemaError {
    fn from(e: crate::Error) -> SchemaError {
        SchemaError::Unreachable(e)
    }
}

/// Ok when every migration this binary embeds has been applied successfully.
pub async fn check_schema_ready(db: &Db) -> Result<(), SchemaError> {
    let row = db
        .fetch_one(sql(
            "SELECT to_regclass('_sqlx_migrations') IS NOT NULL AS present",
        ))
        .await?;
    let present: bool = sqlx::Row::try_get(&row, "present").map_err(crate::Error::from)?;
    if !present {
        return Err(SchemaError::NotMigrated);
    }
    let rows = db
        .fetch_all(sql("SELECT version, success FROM _sqlx_migrations"))
        .await?;
    let mut applied = std::collections::HashMap::new();
    for row in &rows {
        let version: i64 = sqlx::Row::try_get(row, "version").map_err(crate::Error::from)?;
        let success: bool = sqlx::Row::try_get(row, "success").map_err(crate::Error::from)?;
        applied.insert(version, success);
    }
    for m in MIGRATOR.iter() {
        match applied.get(&m.version) {
            None => {
                return Err(SchemaError::Behind {
                    missing: format!("{:04}_{}", m.version, m.description.replace(' ', "_")),
                });
            }
            Some(false) => return Err(SchemaError::Dirty { version: m.version }),
            Some(true) => {}
        }
    }
    Ok(())
}
