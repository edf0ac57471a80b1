//! The claim-first mode's completion is a heap-only-tuple (HOT) update, against a
//! real PostgreSQL: no index names a column it changes (the catalog), and
//! PostgreSQL counts every completion of creates through the layer as HOT
//! (its statistics), with both stores. Retention counts from the claim,
//! which is what lets the completion leave `expires_at` alone.

use crate::common;

use std::{
    collections::BTreeSet,
    sync::{atomic::AtomicU64, Arc},
    time::Duration,
};

use common::*;
use tower::Layer;
use tower_idempotency::store::{Claim, Store};

/// Creates sent through the layer in each statistics test.
const CREATES: i64 = 200;

/// How long PostgreSQL gets to publish a closed backend's statistics.
const STATS_DEADLINE: Duration = Duration::from_secs(30);

/// The columns the completion's `SET` list assigns, read from the statement
/// itself (the `completion!` text that `COMPLETE` and `COMPLETE_AND_RESET` share,
/// in `src/protocol/complete.rs`), so that a column added to it later is
/// checked too.
fn completion_sets() -> BTreeSet<String> {
    let source = include_str!("../../src/protocol/complete.rs");
    let start = source
        .find("macro_rules! completion {")
        .expect("the completion's text is in complete.rs");
    let text = &source[start..];
    let text = &text[text.find('"').expect("COMPLETE's text") + 1..];
    let text = &text[..text.find("\",").expect("COMPLETE's text ends")];
    // The Rust string's line continuations, then SQL's whitespace.
    let text = text.replace("\\\n", " ");
    let text = text.split_whitespace().collect::<Vec<_>>().join(" ");
    let set = &text[text.find(" SET ").expect("an UPDATE … SET") + 5..];
    let set = &set[..set.find(" WHERE ").expect("a WHERE after the SET list")];
    // Split at the commas outside parentheses: `col = expr, col = expr`.
    let (mut depth, mut item, mut items) = (0i32, String::new(), Vec::new());
    for c in set.chars() {
        match c {
            '(' => depth += 1,
            ')' => depth -= 1,
            ',' if depth == 0 => {
                items.push(std::mem::take(&mut item));
                continue;
            }
            _ => {}
        }
        item.push(c);
    }
    items.push(item);
    let columns: BTreeSet<String> = items
        .iter()
        .map(|item| {
            let (column, _) = item.split_once('=').expect("`column = value`");
            column.trim().to_owned()
        })
        .collect();
    // The parse itself is checked: these are certainly in the list.
    for column in ["state", "response_body", "completed_at"] {
        assert!(columns.contains(column), "parsed {columns:?}");
    }
    columns
}

/// Every (index, column) of `idempotency_requests` where the index names the
/// column: as a key column, in an expression or in its predicate (the two
/// latter are recorded as column dependencies of the index).
const INDEXED_COLUMNS: &str = "SELECT c.relname::text, a.attname::text \
     FROM pg_index x \
     JOIN pg_class c ON c.oid = x.indexrelid \
     JOIN pg_attribute a ON a.attrelid = x.indrelid AND a.attnum > 0 \
     WHERE x.indrelid = 'idempotency_requests'::regclass \
       AND (a.attnum = ANY (x.indkey::int2[]) \
            OR EXISTS (SELECT FROM pg_depend d \
                       WHERE d.classid = 'pg_class'::regclass AND d.objid = x.indexrelid \
                         AND d.refclassid = 'pg_class'::regclass AND d.refobjid = x.indrelid \
                         AND d.refobjsubid = a.attnum)) \
     ORDER BY 1, 2";

async fn indexed_columns(client: &impl tokio_postgres::GenericClient) -> Vec<(String, String)> {
    client
        .query(INDEXED_COLUMNS, &[])
        .await
        .unwrap()
        .iter()
        .map(|row| (row.get(0), row.get(1)))
        .collect()
}

/// PostgreSQL 15 makes an UPDATE HOT only if it changes no column that an
/// index names, as a key or in its predicate.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn no_index_names_a_column_the_completion_sets() {
    let pg = Postgres::new().await;
    let sets = completion_sets();
    let indexed = indexed_columns(&pg.client).await;
    let offending: Vec<_> = indexed
        .iter()
        .filter(|(_, column)| sets.contains(column))
        .collect();
    assert!(
        offending.is_empty(),
        "the completion sets {sets:?}; these indexes name some of them, so it is no HOT update: {offending:?}"
    );

    // The catalog query sees a column named only in a predicate: an index
    // on in-progress rows (`WHERE state = 'in_progress'`) would be found.
    let mut client = pg.db.client().await;
    let probe = client.transaction().await.unwrap();
    probe
        .batch_execute(
            "CREATE INDEX hot_probe_idx ON idempotency_requests (created_at) WHERE state = 'in_progress'",
        )
        .await
        .unwrap();
    let with_probe = indexed_columns(&probe).await;
    assert!(
        with_probe.contains(&("hot_probe_idx".to_owned(), "state".to_owned())),
        "{with_probe:?}"
    );
    probe.rollback().await.unwrap();
}

/// `idempotency_requests`' (updates, HOT updates) once PostgreSQL has
/// counted at least `updates` updates, by the deadline.
async fn updates_counted(client: &tokio_postgres::Client, updates: i64) -> (i64, i64) {
    let deadline = tokio::time::Instant::now() + STATS_DEADLINE;
    loop {
        // Each statement is its own transaction: a fresh statistics snapshot.
        let row = client
            .query_one(
                "SELECT n_tup_upd, n_tup_hot_upd FROM pg_stat_user_tables WHERE relname = 'idempotency_requests'",
                &[],
            )
            .await
            .unwrap();
        let counted: (i64, i64) = (row.get(0), row.get(1));
        if counted.0 >= updates {
            return counted;
        }
        assert!(
            tokio::time::Instant::now() < deadline,
            "after {STATS_DEADLINE:?} PostgreSQL counts {counted:?} (updates, HOT updates), not {updates} updates"
        );
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
}

fn assert_all_hot((updates, hot): (i64, i64)) {
    assert_eq!(updates, CREATES, "one completion UPDATE per create");
    assert_eq!(
        hot, updates,
        "{hot} of {updates} completions were HOT updates"
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn every_completion_through_pg_store_is_a_hot_update() {
    let Postgres { db, store, client } = Postgres::new().await;
    let service = layer(store.clone())
        .without_replay_cache()
        .layer(order_handler::<Postgres>(Arc::new(AtomicU64::new(0))));
    for i in 0..CREATES {
        let answer = send(service.clone(), tenant_a_post(&format!("hot-{i}"))).await;
        assert_eq!(answer.status, http::StatusCode::CREATED, "create {i}");
    }
    // Backends publish their statistics when they exit: close the pool's
    // connections (every clone of the store goes).
    drop(service);
    drop(store);
    assert_all_hot(updates_counted(&client, CREATES).await);
    drop(db);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn every_completion_through_sqlx_store_is_a_hot_update() {
    let backend = Sqlx::new().await;
    let service = layer(backend.store())
        .without_replay_cache()
        .layer(order_handler::<Sqlx>(Arc::new(AtomicU64::new(0))));
    for i in 0..CREATES {
        let answer = send(service.clone(), tenant_a_post(&format!("hot-{i}"))).await;
        assert_eq!(answer.status, http::StatusCode::CREATED, "create {i}");
    }
    drop(service);
    backend.store.pool().close().await;
    assert_all_hot(updates_counted(&backend.client, CREATES).await);
}

/// `expires_at - created_at` and whether the completion came later, of the
/// only record.
const RETENTION_OF_THE_RECORD: &str =
    "SELECT EXTRACT(EPOCH FROM expires_at - created_at)::float8, \
     completed_at > created_at FROM idempotency_requests";

/// A claim, some work, the completion: the record's retention counts from
/// the claim (its `created_at`), not from the completion.
async fn retention_counts_from_the_claim<St: Store>(store: &St, client: &tokio_postgres::Client) {
    let request = claim_request("k", Duration::from_secs(5));
    let Claim::Owned(tx) = store.claim(&request).await.unwrap() else {
        panic!("a new key is owned")
    };
    // The owner's work takes a while.
    tokio::time::sleep(Duration::from_millis(20)).await;
    store.complete(tx, &stored(b"done")).await.unwrap();
    let row = client
        .query_one(RETENTION_OF_THE_RECORD, &[])
        .await
        .unwrap();
    let (retention, completed_later): (f64, bool) = (row.get(0), row.get(1));
    assert!(completed_later);
    assert_eq!(
        retention,
        request.retention.as_secs_f64(),
        "expires_at is the claim's time plus the retention"
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn pg_store_counts_retention_from_the_claim() {
    let pg = Postgres::new().await;
    retention_counts_from_the_claim(&pg.store, &pg.client).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn sqlx_store_counts_retention_from_the_claim() {
    let backend = Sqlx::new().await;
    retention_counts_from_the_claim(&backend.store, &backend.client).await;
}
