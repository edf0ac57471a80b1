//! Versioned, idempotent schema migrations, safe to run from many processes.

use tokio_postgres::types::Type;

use super::{
    session::{Committed, Session},
    statements::Sql,
};
use crate::pg::migrations::{LATEST, MIGRATIONS, MIGRATION_LOCK};
use crate::pg::statements::BEGIN;
use crate::store::{StoreError, StoreErrorKind};

const APPLIED: &str = "SELECT version FROM tower_idempotency_migrations";

pub(super) const RECORD_SQL: Sql<'static> = Sql::new(
    "INSERT INTO tower_idempotency_migrations (version, name) VALUES ($1::int4, $2::text)",
    &[Type::INT4, Type::TEXT],
);

/// Applies what is missing, in one transaction; the caller marks `session`
/// dirty first and clean with the returned [`Committed`].
pub(super) async fn run(session: &Session) -> Result<Committed, StoreError> {
    // On error the caller's session stays marked dirty and is closed, which
    // rolls back.
    apply(session).await
}

async fn apply(session: &Session) -> Result<Committed, StoreError> {
    session
        .batch_execute(&format!(
            "{BEGIN};
         SELECT pg_advisory_xact_lock({MIGRATION_LOCK});
         CREATE TABLE IF NOT EXISTS tower_idempotency_migrations (
             version    integer PRIMARY KEY,
             name       text NOT NULL,
             applied_at timestamptz NOT NULL DEFAULT now()
         );"
        ))
        .await?;
    let applied: Vec<i32> = session
        .query(Sql::new(APPLIED, &[]), &[])
        .await?
        .iter()
        .map(|row| row.get(0))
        .collect();
    if let Some(newer) = applied.iter().find(|v| **v > LATEST) {
        return Err(StoreError::new(
            StoreErrorKind::Schema,
            format!("the database has schema version {newer}, newer than this build's {LATEST}"),
        ));
    }
    for (version, name, sql) in MIGRATIONS {
        if applied.contains(version) {
            continue;
        }
        session.batch_execute(sql).await?;
        session.execute(RECORD_SQL, &[version, name]).await?;
        tracing::info!(version, name, "applied idempotency migration");
    }
    session.commit().await
}
