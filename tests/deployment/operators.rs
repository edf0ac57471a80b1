//! What operators and DBAs run themselves: the schema applied by hand from
//! `tower_idempotency::schema` (as the `schema_sql` example prints it), which
//! `migrate()` then finds current, and the `keys` example tool as a process
//! against a database.

use std::process::{Command, Output};

use tokio_postgres::{Client, SimpleQueryMessage};
use tower_idempotency::{postgres::PgStore, schema, testing::TestDatabase};

use crate::common::example_binary::example;

/// The crate's tables.
const TABLES: &str =
    "('idempotency_requests', 'outbox_events', 'inbox_events', 'tower_idempotency_migrations')";

/// Every row of `sql`, its columns as text joined by ` | `.
async fn rows(client: &Client, sql: &str) -> Vec<String> {
    client
        .simple_query(sql)
        .await
        .unwrap_or_else(|e| panic!("{sql}: {e}"))
        .iter()
        .filter_map(|message| match message {
            SimpleQueryMessage::Row(row) => Some(
                (0..row.len())
                    .map(|i| row.get(i).unwrap_or("NULL"))
                    .collect::<Vec<_>>()
                    .join(" | "),
            ),
            _ => None,
        })
        .collect()
}

/// What the schema is: the tables' columns, indexes, constraints, triggers,
/// storage settings, and the crate's functions and sequence.
async fn schema_of(client: &Client) -> Vec<String> {
    let queries = [
        format!(
            "SELECT table_name, column_name, ordinal_position, data_type, collation_name, \
                 column_default, is_nullable \
             FROM information_schema.columns \
             WHERE table_schema = current_schema() AND table_name IN {TABLES} \
             ORDER BY table_name, ordinal_position"
        ),
        format!(
            "SELECT tablename, indexname, indexdef FROM pg_indexes \
             WHERE schemaname = current_schema() AND tablename IN {TABLES} \
             ORDER BY tablename, indexname"
        ),
        format!(
            "SELECT conrelid::regclass::text, conname, pg_get_constraintdef(oid) \
             FROM pg_constraint WHERE conrelid::regclass::text IN {TABLES} \
             ORDER BY 1, 2"
        ),
        format!(
            "SELECT tgrelid::regclass::text, tgname, pg_get_triggerdef(oid) FROM pg_trigger \
             WHERE NOT tgisinternal AND tgrelid::regclass::text IN {TABLES} ORDER BY 1, 2"
        ),
        format!(
            "SELECT attrelid::regclass::text, attname, attcompression::text FROM pg_attribute \
             WHERE attrelid::regclass::text IN {TABLES} AND attnum > 0 AND NOT attisdropped \
             ORDER BY 1, 2"
        ),
        format!(
            "SELECT relname, reloptions::text FROM pg_class \
             WHERE relname IN {TABLES} ORDER BY 1"
        ),
        "SELECT p.oid::regprocedure::text, pg_get_functiondef(p.oid) FROM pg_proc p \
         WHERE p.proname LIKE 'tower_idempotency%' ORDER BY 1"
            .to_owned(),
        "SELECT sequence_name, data_type FROM information_schema.sequences \
         WHERE sequence_schema = current_schema() ORDER BY 1"
            .to_owned(),
        "SELECT version, name FROM tower_idempotency_migrations ORDER BY version".to_owned(),
    ];
    let mut schema = Vec::new();
    for sql in &queries {
        schema.extend(rows(client, sql).await);
    }
    schema
}

/// Applies every migration of `schema::migration_sql()` as a DBA's tool
/// would: the migration table, then each migration in order, the
/// transactional ones with their record in `BEGIN … COMMIT`, the others a
/// statement at a time in autocommit and then their record.
async fn apply_by_hand(client: &Client) {
    client
        .batch_execute(schema::migration_table_sql())
        .await
        .expect("the migration table");
    for migration in schema::migration_sql() {
        let label = format!("version {} ({})", migration.version, migration.name);
        if migration.in_transaction() {
            client.batch_execute("BEGIN").await.expect("BEGIN");
            for statement in &migration.statements {
                client
                    .batch_execute(statement.sql)
                    .await
                    .unwrap_or_else(|e| panic!("{label}: {e}\n{}", statement.sql));
            }
            client
                .batch_execute(&migration.record)
                .await
                .unwrap_or_else(|e| panic!("{label}'s record: {e}"));
            client.batch_execute("COMMIT").await.expect("COMMIT");
        } else {
            for statement in &migration.statements {
                assert!(!statement.in_transaction);
                client
                    .batch_execute(statement.sql)
                    .await
                    .unwrap_or_else(|e| panic!("{label}: {e}\n{}", statement.sql));
            }
            client
                .batch_execute(&migration.record)
                .await
                .unwrap_or_else(|e| panic!("{label}'s record: {e}"));
        }
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_schema_applied_by_hand_is_what_migrate_makes_and_migrate_finds_it_current() {
    let by_hand = TestDatabase::create().await;
    let hand = by_hand.client().await;
    apply_by_hand(&hand).await;
    let applied_at = rows(
        &hand,
        "SELECT version, applied_at FROM tower_idempotency_migrations ORDER BY version",
    )
    .await;
    assert_eq!(applied_at.len(), schema::migration_sql().len());
    let before = schema_of(&hand).await;

    PgStore::builder(by_hand.config())
        .build()
        .unwrap()
        .migrate()
        .await
        .expect("migrate() on the schema applied by hand");
    assert_eq!(
        rows(
            &hand,
            "SELECT version, applied_at FROM tower_idempotency_migrations ORDER BY version",
        )
        .await,
        applied_at,
        "migrate() recorded nothing: it found every version applied"
    );
    assert_eq!(schema_of(&hand).await, before, "migrate() changed nothing");

    let by_runner = TestDatabase::create().await;
    PgStore::builder(by_runner.config())
        .build()
        .unwrap()
        .migrate()
        .await
        .expect("migrate() on a fresh database");
    let runner = schema_of(&by_runner.client().await).await;
    assert!(
        runner
            .iter()
            .any(|row| row.contains("idempotency_requests_pkey")),
        "the snapshot reads the catalog: {runner:#?}"
    );
    assert_eq!(before, runner, "by hand and by migrate(), the same schema");
}

#[test]
fn the_schema_sql_example_prints_every_migration_with_its_record() {
    let binary = example("schema_sql", &["examples/schema_sql.rs"]);
    let output = Command::new(&binary).output().expect("runs");
    assert!(output.status.success(), "{output:?}");
    let script = String::from_utf8(output.stdout).expect("UTF-8");
    for migration in schema::migration_sql() {
        assert!(
            script.contains(&format!("{};\n", migration.record)),
            "{script}"
        );
    }
    // The index builds are outside BEGIN … COMMIT: the nearest transaction
    // keyword before each is a COMMIT.
    let builds: Vec<usize> = script
        .match_indices("\nCREATE ")
        .map(|(at, _)| at)
        .filter(|&at| {
            script[at..]
                .lines()
                .nth(1)
                .is_some_and(|l| l.contains("CONCURRENTLY"))
        })
        .collect();
    assert_eq!(builds.len(), 3, "version 6's three builds");
    for at in builds {
        let before = &script[..at];
        assert!(
            before.rfind("COMMIT;") > before.rfind("BEGIN;"),
            "an index build inside a transaction block"
        );
    }
    let later = Command::new(&binary)
        .args(["--after", "5"])
        .output()
        .expect("runs");
    let later = String::from_utf8(later.stdout).expect("UTF-8");
    assert!(!later.contains("CREATE TABLE idempotency_requests"));
    assert!(later.contains("VALUES (6, 'bytewise_key_indexes')"));
    let wrong = Command::new(&binary).arg("--after").output().expect("runs");
    assert_eq!(wrong.status.code(), Some(2));
}

/// Runs the keys tool with `args` against `db` (none: `DATABASE_URL` unset).
fn keys(db: Option<&TestDatabase>, args: &[&str]) -> Output {
    let binary = example("keys", &["examples/keys.rs"]);
    let mut command = Command::new(binary);
    command
        .args(args)
        .env_remove("DATABASE_URL")
        .env("RUST_LOG", "warn");
    if let Some(db) = db {
        command.env("DATABASE_URL", db.connection_string());
    }
    command.output().expect("the keys tool runs")
}

fn stdout(output: &Output) -> String {
    String::from_utf8_lossy(&output.stdout).into_owned()
}

fn stderr(output: &Output) -> String {
    String::from_utf8_lossy(&output.stderr).into_owned()
}

async fn count(client: &Client, sql: &str) -> i64 {
    client.query_one(sql, &[]).await.expect(sql).get(0)
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_keys_tool_inspects_removes_counts_and_cleans_up() {
    // Without DATABASE_URL, or with a wrong command line: one line, exit 2.
    let unset = keys(None, &["expired"]);
    assert_eq!(unset.status.code(), Some(2), "{unset:?}");
    assert_eq!(stderr(&unset).lines().count(), 1, "{}", stderr(&unset));
    assert!(
        stderr(&unset).contains("DATABASE_URL"),
        "{}",
        stderr(&unset)
    );
    for wrong in [
        &[][..],
        &["frobnicate"],
        &["inspect", "tenant-a"],
        &["remove", "tenant-a", "POST /orders v1", "k-1"],
        &[
            "remove",
            "tenant-a",
            "POST /orders v1",
            "k-1",
            "--reason",
            " ",
        ],
        &["expired", "now"],
    ] {
        let output = keys(None, wrong);
        assert_eq!(output.status.code(), Some(2), "{wrong:?}: {output:?}");
    }

    let db = TestDatabase::create().await;
    PgStore::builder(db.config())
        .build()
        .unwrap()
        .migrate()
        .await
        .unwrap();
    let client = db.client().await;
    // One live completed key, one live key to remove, two expired keys
    // (one of another tenant).
    client
        .batch_execute(
            "INSERT INTO idempotency_requests \
                 (tenant_id, endpoint, idempotency_key, request_fingerprint, state, \
                  response_status, resource_id, completed_at, expires_at) VALUES \
             ('tenant-a', 'POST /orders v1', 'k-live', decode(repeat('ab', 32), 'hex'), \
              'completed', 201, 'order-17', now(), now() + interval '1 day'), \
             ('tenant-a', 'POST /orders v1', 'k-remove', decode(repeat('cd', 32), 'hex'), \
              'completed', 201, NULL, now(), now() + interval '1 day'), \
             ('tenant-a', 'POST /orders v1', 'k-old-1', decode(repeat('ef', 32), 'hex'), \
              'completed', 201, NULL, now() - interval '2 days', now() - interval '1 day'), \
             ('tenant-b', 'POST /orders v1', 'k-old-2', decode(repeat('01', 32), 'hex'), \
              'completed', 422, NULL, now() - interval '2 days', now() - interval '1 hour')",
        )
        .await
        .unwrap();

    let found = keys(
        Some(&db),
        &["inspect", "tenant-a", "POST /orders v1", "k-live"],
    );
    assert_eq!(found.status.code(), Some(0), "{found:?}");
    let shown = stdout(&found);
    for line in [
        "tenant: tenant-a",
        "endpoint: POST /orders v1",
        "state: completed",
        "response_status: 201",
        "resource_id: order-17",
        &format!("fingerprint: {}", "ab".repeat(32)),
    ] {
        assert!(shown.lines().any(|l| l == line), "{line:?} in:\n{shown}");
    }
    // The trace of the request that did the work, when it carried one.
    assert!(shown.lines().any(|l| l == "trace_id: -"), "{shown}");
    client
        .batch_execute(
            "UPDATE idempotency_requests SET trace_id = '4bf92f3577b34da6a3ce929d0e0e4736' \
             WHERE idempotency_key = 'k-live'",
        )
        .await
        .unwrap();
    let traced = stdout(&keys(
        Some(&db),
        &["inspect", "tenant-a", "POST /orders v1", "k-live"],
    ));
    assert!(
        traced
            .lines()
            .any(|l| l == "trace_id: 4bf92f3577b34da6a3ce929d0e0e4736"),
        "{traced}"
    );

    let missing = keys(
        Some(&db),
        &["inspect", "tenant-a", "POST /orders v1", "k-none"],
    );
    assert_eq!(missing.status.code(), Some(3), "{missing:?}");
    assert!(stderr(&missing).contains("no record"), "{missing:?}");
    let other_tenant = keys(
        Some(&db),
        &["inspect", "tenant-b", "POST /orders v1", "k-live"],
    );
    assert_eq!(other_tenant.status.code(), Some(3), "{other_tenant:?}");

    let removed = keys(
        Some(&db),
        &[
            "remove",
            "tenant-a",
            "POST /orders v1",
            "k-remove",
            "--reason",
            "ticket 4521: the client reused a key for a new order",
        ],
    );
    assert_eq!(removed.status.code(), Some(0), "{removed:?}");
    assert!(
        stderr(&removed).contains("ticket 4521"),
        "the audit line names the reason: {}",
        stderr(&removed)
    );
    assert_eq!(
        count(
            &client,
            "SELECT count(*) FROM idempotency_requests WHERE idempotency_key = 'k-remove'"
        )
        .await,
        0
    );
    assert_eq!(
        count(&client, "SELECT count(*) FROM idempotency_requests").await,
        3,
        "only that key went"
    );
    let again = keys(
        Some(&db),
        &[
            "remove",
            "tenant-a",
            "POST /orders v1",
            "k-remove",
            "--reason",
            "again",
        ],
    );
    assert_eq!(again.status.code(), Some(3), "{again:?}");

    let expired = keys(Some(&db), &["expired"]);
    assert_eq!(expired.status.code(), Some(0), "{expired:?}");
    assert_eq!(stdout(&expired).trim(), "2");

    let cleanup = keys(Some(&db), &["cleanup"]);
    assert_eq!(cleanup.status.code(), Some(0), "{cleanup:?}");
    assert_eq!(stdout(&cleanup).trim(), "2");
    assert_eq!(
        rows(
            &client,
            "SELECT tenant_id, idempotency_key FROM idempotency_requests ORDER BY 1, 2"
        )
        .await,
        ["tenant-a | k-live"],
        "the expired rows went, the live one stayed"
    );
    let none = keys(Some(&db), &["expired"]);
    assert_eq!(stdout(&none).trim(), "0", "{none:?}");

    let unreachable = Command::new(example("keys", &["examples/keys.rs"]))
        .arg("expired")
        .env(
            "DATABASE_URL",
            "host=127.0.0.1 port=1 user=nobody connect_timeout=2",
        )
        .output()
        .unwrap();
    assert_eq!(unreachable.status.code(), Some(1), "{unreachable:?}");
}
