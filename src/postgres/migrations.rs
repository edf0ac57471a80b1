//! Versioned, idempotent schema migrations, safe to run from many processes.

use tokio_postgres::types::Type;

use super::{
    session::{Committed, Session},
    statements::Sql,
};
use crate::store::{StoreError, StoreErrorKind};

/// Serialises concurrent migrators (any constant unique to this crate).
pub(crate) const MIGRATION_LOCK: i64 = 0x7469_6465_6d70_0001;

/// `(version, name, sql)`: append only; never edit an applied migration.
pub(crate) const MIGRATIONS: &[(i32, &str, &str)] = &[
    (
        1,
        "idempotency_requests",
        include_str!("schema/0001_idempotency_requests.sql"),
    ),
    (
        2,
        "outbox_and_inbox",
        include_str!("schema/0002_outbox_and_inbox.sql"),
    ),
    (3, "retention", include_str!("schema/0003_retention.sql")),
    (
        4,
        "attempt_token_sequence",
        include_str!("schema/0004_attempt_token_sequence.sql"),
    ),
    (
        5,
        "long_running_operations",
        include_str!("schema/0005_long_running_operations.sql"),
    ),
    (
        6,
        "resource_id",
        include_str!("schema/0006_resource_id.sql"),
    ),
    (
        7,
        "operation_attempts",
        include_str!("schema/0007_operation_attempts.sql"),
    ),
];

const APPLIED: &str = "SELECT version FROM tower_idempotency_migrations";

pub(super) const RECORD_SQL: Sql<'static> = Sql::new(
    "INSERT INTO tower_idempotency_migrations (version, name) VALUES ($1::int4, $2::text)",
    &[Type::INT4, Type::TEXT],
);

/// The newest schema version this build knows.
pub(crate) const LATEST: i32 = MIGRATIONS[MIGRATIONS.len() - 1].0;

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
            "BEGIN;
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
