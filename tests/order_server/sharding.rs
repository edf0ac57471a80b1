//! Ready to shard by tenant: every primary key and unique index of the
//! crate's tables and of the example server's includes `tenant_id`, read
//! from the catalog of a database both have migrated. (That every statement
//! of a request names one tenant is checked on the statements themselves:
//! `protocol::tests`.)

use crate::common::example_binary;

use std::process::Stdio;

use example_binary::example_binary;
use tokio::{
    io::{AsyncBufReadExt, BufReader},
    process::Command,
};
use tower_idempotency::{postgres::PgStore, testing::TestDatabase};

/// A reference table (the same on every node), not distributed.
const REFERENCE_TABLES: &[&str] = &["tower_idempotency_migrations"];

/// Unique indexes (primary keys and unique constraints included) of the
/// current schema whose columns do not include `tenant_id`.
const WITHOUT_TENANT: &str = "\
    SELECT t.relname || '.' || i.relname \
    FROM pg_index x \
    JOIN pg_class i ON i.oid = x.indexrelid \
    JOIN pg_class t ON t.oid = x.indrelid \
    JOIN pg_namespace n ON n.oid = t.relnamespace \
    WHERE x.indisunique AND n.nspname = current_schema() \
      AND t.relname <> ALL($1::text[]) \
      AND NOT EXISTS ( \
          SELECT 1 FROM pg_attribute a \
          WHERE a.attrelid = t.oid AND a.attname = 'tenant_id' AND a.attnum = ANY(x.indkey)) \
    ORDER BY 1";

const UNIQUE_INDEXES: &str = "\
    SELECT count(*) FROM pg_index x \
    JOIN pg_class t ON t.oid = x.indrelid \
    JOIN pg_namespace n ON n.oid = t.relnamespace \
    WHERE x.indisunique AND n.nspname = current_schema()";

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn every_key_of_every_table_includes_the_tenant() {
    let db = TestDatabase::create().await;
    // The crate's migrations...
    let store = PgStore::builder(db.config()).build().unwrap();
    store.migrate().await.unwrap();
    // ...and the example server's tables, which it creates as it starts.
    let mut server = Command::new(example_binary())
        .env("DATABASE_URL", db.connection_string())
        .env("ORDER_SERVER_ADDR", "127.0.0.1:0")
        .env("RUST_LOG", "warn")
        .stdin(Stdio::null())
        .stdout(Stdio::piped())
        .stderr(Stdio::inherit())
        .kill_on_drop(true)
        .spawn()
        .expect("the example server starts");
    let mut line = String::new();
    BufReader::new(server.stdout.take().expect("stdout"))
        .read_line(&mut line)
        .await
        .expect("reads stdout");
    assert!(line.starts_with("listening on "), "{line:?}");
    server.kill().await.unwrap();

    let sql = db.client().await;
    let unique: i64 = sql.query_one(UNIQUE_INDEXES, &[]).await.unwrap().get(0);
    // The crate's and the example's keys, so that an empty schema cannot pass.
    assert!(
        unique >= 12,
        "only {unique} unique indexes: were both schemas applied?"
    );
    let offenders: Vec<String> = sql
        .query(WITHOUT_TENANT, &[&REFERENCE_TABLES])
        .await
        .unwrap()
        .iter()
        .map(|row| row.get(0))
        .collect();
    assert!(
        offenders.is_empty(),
        "unique indexes without tenant_id (a table distributed by tenant cannot keep them): {offenders:?}"
    );
}
