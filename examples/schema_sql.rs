//! Prints the crate's schema as one SQL script, for a DBA to review and
//! apply with psql or to cut into the files of a migration tool.
//!
//! ```text
//! cargo run --example schema_sql > tower_idempotency.sql
//! psql -v ON_ERROR_STOP=1 -f tower_idempotency.sql "$DATABASE_URL"
//! cargo run --example schema_sql -- --after 5   # only versions 6 and later
//! ```
//!
//! Each migration that runs in a transaction is printed between `BEGIN` and
//! `COMMIT`, with the row that records it; the statements that cannot run in
//! a transaction (`CREATE INDEX CONCURRENTLY`) are printed bare, for psql's
//! autocommit, with their record after them. So run the script as it is,
//! never with `psql --single-transaction` (`-1`), which would put them in a
//! transaction block that PostgreSQL refuses. `PgStore::migrate()` then
//! finds the schema current. The migration guide (docs/migrations.md,
//! "Applying the schema with your own tool") has the rest.

use std::process::ExitCode;

use tower_idempotency::schema::{self, MigrationSql};

fn main() -> ExitCode {
    let args: Vec<String> = std::env::args().skip(1).collect();
    let after = match args.as_slice() {
        [] => 0,
        [flag, version] if flag == "--after" => match version.parse::<u32>() {
            Ok(version) => version,
            Err(_) => return usage(&format!("--after wants a version number, not {version:?}")),
        },
        _ => return usage("unexpected arguments"),
    };
    print!("{}", script(after));
    ExitCode::SUCCESS
}

fn usage(problem: &str) -> ExitCode {
    eprintln!("schema_sql: {problem}\nusage: schema_sql [--after VERSION]");
    ExitCode::from(2)
}

/// The script of the migrations after version `after` (all of them for 0).
fn script(after: u32) -> String {
    let migrations: Vec<MigrationSql> = schema::migration_sql()
        .into_iter()
        .filter(|m| m.version > after)
        .collect();
    let latest = migrations.last().map_or(after, |m| m.version);
    let mut out = format!(
        "-- tower-idempotency {}: the schema, versions {} to {latest}.\n\
         -- Run in order, in autocommit (psql -v ON_ERROR_STOP=1 -f FILE; never\n\
         -- --single-transaction): each transactional migration carries its own\n\
         -- BEGIN and COMMIT, and CREATE INDEX CONCURRENTLY must run outside any\n\
         -- transaction. The INSERTs into tower_idempotency_migrations record\n\
         -- each version, so that migrate() finds them applied.\n\n",
        env!("CARGO_PKG_VERSION"),
        after + 1,
    );
    // Read by the runner at its start too; IF NOT EXISTS, so a database
    // that has it already is left as it is.
    out += &format!("{};\n", schema::migration_table_sql());
    for migration in &migrations {
        out += &format!("\n-- Version {}: {}.\n", migration.version, migration.name);
        if migration.in_transaction() {
            out += "BEGIN;\n";
            for statement in &migration.statements {
                out += &format!("{};\n", terminated(statement.sql));
            }
            out += &format!("{};\nCOMMIT;\n", migration.record);
        } else {
            out += "-- Outside any transaction, one statement at a time. A build that\n\
                    -- fails leaves an invalid index (pg_index.indisvalid = false) that\n\
                    -- IF NOT EXISTS skips: DROP INDEX CONCURRENTLY it and run the\n\
                    -- statement again before the INSERT that records the version.\n";
            for statement in &migration.statements {
                out += &format!("{};\n", terminated(statement.sql));
            }
            out += &format!("{};\n", migration.record);
        }
    }
    out
}

/// `sql` without its trailing `;` and whitespace (the script adds one).
fn terminated(sql: &str) -> &str {
    sql.trim_end().trim_end_matches(';').trim_end()
}
