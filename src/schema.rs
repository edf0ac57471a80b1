//! The schema as SQL, for operators who review it and apply it with their
//! own tool (psql, Flyway, sqlx-cli, Atlas) instead of calling `migrate()`.
//!
//! [`migration_sql`] lists the migrations that `PgStore::migrate` and
//! `SqlxStore::migrate` apply, in order, each with the statements it runs and
//! the row of `tower_idempotency_migrations` that records it. Apply them as
//! the runner does and `migrate()` finds the schema current afterwards (it
//! then only looks, records nothing and changes nothing):
//!
//! 1. [`migration_table_sql`] once, first.
//! 2. For each migration, in order:
//!    - when [`MigrationSql::in_transaction`]: `BEGIN`, its statements, its
//!      [`record`](MigrationSql::record), `COMMIT`, all or nothing;
//!    - otherwise (`CREATE INDEX CONCURRENTLY`, which PostgreSQL refuses
//!      inside a transaction block): each statement alone, outside any
//!      transaction, then the record once every index is valid. A build
//!      that fails or is interrupted leaves an invalid index that the
//!      statement's `IF NOT EXISTS` would then skip: find it with
//!      `SELECT indexrelid::regclass FROM pg_index WHERE NOT indisvalid`,
//!      `DROP INDEX CONCURRENTLY` it, and run the statement again.
//!
//! A migration is never a mix of both kinds (the runner refuses such a
//! list), so each one maps to one migration of your tool: sqlx-cli's
//! `-- no-transaction`, Atlas's `-- atlas:txmode none` and Flyway's
//! `executeInTransaction=false` go on the files of those that are not
//! [`in_transaction`](MigrationSql::in_transaction). Send their statements
//! one at a time: several in one query string are an implicit transaction
//! block, where PostgreSQL refuses them too.
//! Keep the records in the same files: they are what tells a later
//! `migrate()` (an instance of a newer release, say) where the database
//! stands.
//!
//! A migration's statements must be applied as released, never edited: a
//! later migration of the crate may depend on the exact names they create.
//! The runner's extras are not in these statements: its `lock_timeout` and
//! retries (set a `lock_timeout` of your own on a table that serves claims;
//! the migration guide says why), and, on a Citus coordinator, the
//! distribution of the tables by tenant, which `migrate()` does when it
//! finds them undistributed. The migration guide: [applying the schema with
//! your own tool](crate::guide::migrations#applying-the-schema-with-your-own-tool).
//!
//! ```
//! use tower_idempotency::schema;
//!
//! let mut script = format!("{};\n", schema::migration_table_sql());
//! for migration in schema::migration_sql() {
//!     let (begin, commit) = if migration.in_transaction() {
//!         ("BEGIN;\n", "COMMIT;\n")
//!     } else {
//!         ("", "")
//!     };
//!     script += &format!("-- version {}: {}\n{begin}", migration.version, migration.name);
//!     for statement in &migration.statements {
//!         script += &format!("{};\n", statement.sql.trim_end().trim_end_matches(';'));
//!     }
//!     script += &format!("{};\n{commit}", migration.record);
//! }
//! assert!(script.contains("CREATE TABLE idempotency_requests"));
//! ```

use crate::protocol::migrations::{Step, MIGRATIONS, MIGRATION_TABLE};

/// One migration of the schema, as SQL: what `migrate()` runs for it and
/// the row it records.
#[derive(Debug, Clone, PartialEq, Eq)]
#[non_exhaustive]
pub struct MigrationSql {
    /// The version: 1, 2, 3, … in the order they apply.
    pub version: u32,
    /// The migration's name, as recorded (`tower_idempotency_migrations.name`).
    pub name: &'static str,
    /// The statements, in order. All of them run in one transaction, or
    /// each outside any ([`MigrationStatement::in_transaction`]).
    pub statements: Vec<MigrationStatement>,
    /// The `INSERT` into `tower_idempotency_migrations` that records the
    /// migration as applied: run it after the statements (in their
    /// transaction, when they have one), and `migrate()` never runs them
    /// again.
    pub record: String,
}

impl MigrationSql {
    /// Whether the statements run in one transaction with the
    /// [`record`](Self::record). When false, each statement runs alone,
    /// outside any transaction (a `CREATE INDEX CONCURRENTLY`), and the
    /// record after the last.
    pub fn in_transaction(&self) -> bool {
        self.statements.iter().all(|s| s.in_transaction)
    }
}

/// One step of a [`MigrationSql`].
#[derive(Debug, Clone, PartialEq, Eq)]
#[non_exhaustive]
pub struct MigrationStatement {
    /// SQL text without parameters, to send as it is (as one simple-query
    /// string, or `psql -c`). Usually one statement; the baseline's is a
    /// script of many, separated by `;`, with `--` comments and
    /// dollar-quoted function bodies, which psql and the migration tools
    /// split themselves.
    pub sql: &'static str,
    /// Whether it may run inside a transaction block. False for `CREATE
    /// INDEX CONCURRENTLY`, which PostgreSQL refuses in one: send it alone,
    /// in autocommit.
    pub in_transaction: bool,
}

/// Every migration of this build, in the order they apply.
pub fn migration_sql() -> Vec<MigrationSql> {
    MIGRATIONS
        .iter()
        .map(|migration| MigrationSql {
            // Versions are 1, 2, 3, … (the runner's `check_list` refuses
            // anything else, and a test keeps it so).
            version: migration.version.unsigned_abs(),
            name: migration.name,
            statements: migration
                .steps
                .iter()
                .map(|step| match *step {
                    Step::Transactional(sql) => MigrationStatement {
                        sql,
                        in_transaction: true,
                    },
                    Step::ConcurrentIndex { sql, .. } => MigrationStatement {
                        sql,
                        in_transaction: false,
                    },
                })
                .collect(),
            // The names are identifiers of this crate's, without quotes;
            // doubled anyway, as SQL escapes a quote.
            record: format!(
                "INSERT INTO tower_idempotency_migrations (version, name) VALUES ({}, '{}')",
                migration.version,
                migration.name.replace('\'', "''")
            ),
        })
        .collect()
}

/// The `CREATE TABLE IF NOT EXISTS` of `tower_idempotency_migrations`, the
/// table the records go to: run it once, before the first migration.
pub fn migration_table_sql() -> &'static str {
    MIGRATION_TABLE
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn every_migration_is_listed_in_order_with_its_record() {
        let list = migration_sql();
        assert_eq!(list.len(), MIGRATIONS.len());
        for (i, migration) in list.iter().enumerate() {
            assert_eq!(migration.version as usize, i + 1);
            assert_eq!(migration.name, MIGRATIONS[i].name);
            assert_eq!(migration.statements.len(), MIGRATIONS[i].steps.len());
            assert!(
                migration.statements.iter().all(|s| s.in_transaction)
                    || migration.statements.iter().all(|s| !s.in_transaction),
                "{migration:?} mixes both kinds"
            );
            assert_eq!(
                migration.record,
                format!(
                    "INSERT INTO tower_idempotency_migrations (version, name) VALUES ({}, '{}')",
                    i + 1,
                    migration.name
                )
            );
            for statement in &migration.statements {
                assert_eq!(
                    statement.sql.contains("CONCURRENTLY"),
                    !statement.in_transaction,
                    "{statement:?}"
                );
            }
        }
        assert!(!list[5].in_transaction(), "version 6 builds indexes");
        assert!(list[0].in_transaction());
        assert!(migration_table_sql().contains("tower_idempotency_migrations"));
    }
}
