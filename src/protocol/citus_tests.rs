//! Every statement the crate sends, planned by a Citus coordinator on the
//! crate's distributed tables: each is valid there, and each statement of a
//! request runs on one shard (every task of its plan is a single-shard
//! task), so that a request's transaction stays on one worker. A new
//! statement that would not route fails here, and so does one that Citus
//! plans in several steps unless it is listed in [`IN_STEPS`].
// Against PostgreSQL through `PgStore` and the throwaway cluster: with
// `postgres` only (`test-util` alone builds the conformance suite).
#![cfg(feature = "postgres")]

use tokio_postgres::types::{ToSql, Type};

use crate::postgres::prepared::pg_type;

use super::{
    sql::{Sql, Ty},
    tests::{all_statements, ACROSS_TENANTS, UNPARAMETERISED},
};
use crate::testing::TempCitus;

/// A value of type `ty` for parameter `n` of `text`: a text parameter cast
/// on to a uuid or an xid8 gets one of those.
fn value(text: &str, n: usize, ty: Ty) -> Box<dyn ToSql + Sync + Send> {
    const UUID: &str = "00000000-0000-4000-8000-000000000001";
    let cast_to = |target: &str| text.contains(&format!("${n}::text::{target}"));
    match ty {
        Ty::Text if cast_to("uuid") => Box::new(UUID),
        Ty::Text if cast_to("xid8") => Box::new("1"),
        Ty::Text if cast_to("regclass") => Box::new("idempotency_requests"),
        Ty::Text => Box::new("tenant-a"),
        Ty::Bytea => Box::new(vec![0u8]),
        Ty::Int2 => Box::new(200i16),
        Ty::Int4 => Box::new(1i32),
        Ty::Int8 => Box::new(1i64),
        Ty::Float8 => Box::new(1.0f64),
        Ty::Jsonb => Box::new(serde_json::json!({})),
        Ty::TextArray => Box::new(vec![UUID]),
        Ty::Float8Array => Box::new(vec![1.0f64]),
    }
}

/// The plan of `sql` with values for its parameters, as the coordinator
/// gives it (one line per row).
async fn explain(client: &tokio_postgres::Client, sql: Sql<'static>) -> Result<String, String> {
    let text = sql.text();
    let values: Vec<_> = sql
        .types()
        .iter()
        .enumerate()
        .map(|(i, ty)| (value(text, i + 1, *ty), pg_type(*ty)))
        .collect();
    let params: Vec<(&(dyn ToSql + Sync), Type)> = values
        .iter()
        .map(|(v, t)| (&**v as &(dyn ToSql + Sync), t.clone()))
        .collect();
    let rows = client
        .query_typed(&format!("EXPLAIN (COSTS OFF) {text}"), &params)
        .await
        .map_err(|e| match e.as_db_error() {
            Some(db) => format!("{} ({})", db.message(), db.code().code()),
            None => e.to_string(),
        })?;
    Ok(rows
        .iter()
        .map(|row| row.get::<_, String>(0))
        .collect::<Vec<_>>()
        .join("\n"))
}

/// Statements Citus plans in steps, each step a single-shard task on the
/// same worker or work on the coordinator: correct, and slower than one
/// router query (see the deploying guide's Citus cost). An `INSERT` inside
/// a `WITH` runs first on the shard and its rows come back as an
/// intermediate result; a subquery drawing from the sequence runs first on
/// the coordinator; a locking `WITH` runs first on the shard.
const IN_STEPS: &[&str] = &[
    // INSERT in a WITH: every claim (the one-commit mode's is one plain
    // INSERT, a router query).
    "CLAIM",
    // INSERT in a WITH: the takeover of an expired key (once per key per
    // retention at most).
    "TAKE_OVER",
    // The sequence in a subquery: a long-running attempt that ends
    // without an answer.
    "RELEASE",
    // A locking WITH and the sequence: a recovery worker's takeover.
    "RECOVER",
];

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn every_statement_is_valid_on_citus_and_a_requests_route_to_one_shard() {
    let citus = tokio::task::spawn_blocking(|| TempCitus::start(2))
        .await
        .unwrap()
        .unwrap_or_else(|e| panic!("{e}"));
    let db = citus.database().await.unwrap_or_else(|e| panic!("{e}"));
    let store = crate::postgres::PgStore::builder(db.config())
        .build()
        .unwrap();
    store.migrate().await.unwrap();
    let client = db.client().await;
    let distributed: i64 = client
        .query_one("SELECT count(*) FROM pg_dist_partition", &[])
        .await
        .unwrap()
        .get(0);
    assert_eq!(distributed, 3, "the crate's three tables are distributed");
    let mut failures = Vec::new();
    let statements = all_statements()
        .into_iter()
        .chain(UNPARAMETERISED.iter().copied());
    for (name, sql) in statements {
        if name == "migration RECORD" {
            continue;
        }
        let plan = match explain(&client, sql).await {
            Err(e) => {
                failures.push(format!("{name}: refused: {e}"));
                continue;
            }
            Ok(plan) => plan,
        };
        if ACROSS_TENANTS.contains(&name) {
            continue;
        }
        let tasks: Vec<_> = plan
            .lines()
            .filter_map(|line| line.trim().strip_prefix("Task Count: "))
            .collect();
        if tasks.is_empty() || tasks.iter().any(|count| *count != "1") {
            failures.push(format!("{name}: not routed to one shard:\n{plan}"));
        }
        if plan.contains("Distributed Subplan") != IN_STEPS.contains(&name) {
            failures.push(format!(
                "{name}: planned in steps ({}), which IN_STEPS does not say:\n{plan}",
                plan.contains("Distributed Subplan")
            ));
        }
    }
    assert!(failures.is_empty(), "{}", failures.join("\n\n"));
}
