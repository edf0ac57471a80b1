//! `SqlxStore` against a real PostgreSQL: the conformance suites (with the
//! handler's writes, and of the long-running mode), fenced writes, the
//! shared schema with `PgStore`, what the handler's connection looks like,
//! and transactions that never stay open. (The
//! layer's behaviour scenarios run against it in `tests/behaviour.rs`.)

mod common;

use std::time::Duration;

use bytes::Bytes;
use common::*;
use http::Method;
use tower_idempotency::{
    lease::OperationId,
    postgres::PgStore,
    sqlx::{SqlxStore, SqlxTx},
    store::{Acquired, Claim, LeaseRequest, LeaseStore, Store, StoreErrorKind, StoredRequest},
    testing::conformance::{self, BoxError, Outcome, Writes},
};

/// The suite's handler writes: rows of a table of the test's own, written
/// through the claim's connection, and looked for from another connection.
struct SqlxWrites {
    client: tokio_postgres::Client,
}

impl SqlxWrites {
    async fn new(backend: &Sqlx) -> Self {
        backend
            .client
            .batch_execute("CREATE TABLE conformance_writes (marker text PRIMARY KEY)")
            .await
            .unwrap();
        SqlxWrites {
            client: backend.db.client().await,
        }
    }
}

impl Writes<SqlxTx> for SqlxWrites {
    async fn write(&self, tx: &SqlxTx, marker: &str) -> Result<(), BoxError> {
        let mut conn = tx.conn().await?;
        sqlx::query("INSERT INTO conformance_writes (marker) VALUES ($1)")
            .bind(marker)
            .execute(&mut *conn)
            .await?;
        Ok(())
    }

    async fn fail(&self, tx: &SqlxTx) -> Result<(), BoxError> {
        let mut conn = tx.conn().await?;
        match sqlx::query("SELECT 1 / 0").execute(&mut *conn).await {
            Err(sqlx::Error::Database(e)) if e.code().as_deref() == Some("22012") => Ok(()),
            Err(e) => Err(e.into()),
            Ok(_) => Err("a division by zero succeeded".into()),
        }
    }

    async fn is_committed(&self, marker: &str) -> Result<bool, BoxError> {
        let row = self
            .client
            .query_one(
                "SELECT count(*) FROM conformance_writes WHERE marker = $1",
                &[&marker],
            )
            .await?;
        Ok(row.get::<_, i64>(0) == 1)
    }
}

async fn idle_in_transaction(backend: &Sqlx) -> i64 {
    backend
        .count(
            "SELECT count(*) FROM pg_stat_activity WHERE datname = current_database() \
             AND state LIKE 'idle in transaction%'",
        )
        .await
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn sqlx_store_passes_the_conformance_suite() {
    let backend = Sqlx::new().await;
    let writes = SqlxWrites::new(&backend).await;
    let report = conformance::run_all_with(backend.store.clone(), writes).await;
    println!("{report}");
    report.assert_passed();
    assert!(
        report
            .checks()
            .iter()
            .all(|c| *c.outcome() == Outcome::Passed),
        "every check ran, none skipped:\n{report}"
    );
    assert_eq!(
        idle_in_transaction(&backend).await,
        0,
        "no transaction left open"
    );
    assert_eq!(
        backend
            .count("SELECT count(*) FROM idempotency_requests WHERE state = 'in_progress'")
            .await,
        0,
        "no claim left behind"
    );
}

#[tokio::test]
async fn the_handler_writes_through_the_claims_transaction_with_the_default_lock_timeout() {
    let backend = Sqlx::new().await;
    let store = backend.store.clone();
    let Claim::Owned(tx) = store
        .claim(&claim_request("k1", Duration::from_secs(2)))
        .await
        .unwrap()
    else {
        panic!("a new key is owned");
    };
    {
        let mut conn = tx.conn().await.unwrap();
        // The claim's wait applies to the claim only, not to the handler.
        let (lock_timeout,): (String,) = sqlx::query_as("SHOW lock_timeout")
            .fetch_one(&mut *conn)
            .await
            .unwrap();
        assert_eq!(lock_timeout, "0");
        // The handler sees the claim's own row: the same transaction.
        let (state,): (String,) =
            sqlx::query_as("SELECT state FROM idempotency_requests WHERE idempotency_key = 'k1'")
                .fetch_one(&mut *conn)
                .await
                .unwrap();
        assert_eq!(state, "in_progress");
    }
    SqlxStore::complete(&store, tx.clone(), &stored(b"done"))
        .await
        .unwrap();
    let err = tx.conn().await.unwrap_err();
    assert_eq!(
        err.kind(),
        StoreErrorKind::TransactionAborted,
        "a finished transaction takes no more statements"
    );
}

#[tokio::test]
async fn a_handler_that_ends_the_transaction_gets_no_response_remembered() {
    let backend = Sqlx::new().await;
    let store = backend.store.clone();
    let Claim::Owned(tx) = store
        .claim(&claim_request("k1", Duration::from_secs(2)))
        .await
        .unwrap()
    else {
        panic!("a new key is owned");
    };
    {
        let mut conn = tx.conn().await.unwrap();
        sqlx::query("INSERT INTO orders (id, tenant_id) VALUES ('o1', 'tenant-a')")
            .execute(&mut *conn)
            .await
            .unwrap();
        sqlx::query("COMMIT").execute(&mut *conn).await.unwrap();
    }
    let err = store.complete(tx, &stored(b"done")).await.unwrap_err();
    assert_eq!(err.kind(), StoreErrorKind::TransactionAborted);
    assert_eq!(
        backend
            .count("SELECT count(*) FROM idempotency_requests WHERE state = 'completed'")
            .await,
        0,
        "no response remembered for a transaction the handler ended"
    );
    // The committed in-progress row is an orphan: the next claim takes it over.
    let Claim::Owned(tx) = store
        .claim(&claim_request("k1", Duration::from_secs(2)))
        .await
        .unwrap()
    else {
        panic!("an orphaned key is taken over");
    };
    store.abort(tx).await.unwrap();
    assert_eq!(idle_in_transaction(&backend).await, 0);
}

#[tokio::test]
async fn a_dropped_handle_rolls_back_and_leaves_no_open_transaction() {
    let backend = Sqlx::new().await;
    let store = backend.store.clone();
    let request = claim_request("k1", Duration::from_secs(5));
    let Claim::Owned(tx) = store.claim(&request).await.unwrap() else {
        panic!("a new key is owned");
    };
    Sqlx::insert_order(&tx, "o1", "tenant-a").await.unwrap();
    drop(tx);
    // Owning the key again means the dropped transaction was rolled back.
    let Claim::Owned(tx) = store.claim(&request).await.unwrap() else {
        panic!("the key is free again");
    };
    store.abort(tx).await.unwrap();
    assert_eq!(backend.orders().await, vec![], "the dropped write is gone");
    assert_eq!(idle_in_transaction(&backend).await, 0);
}

#[tokio::test]
async fn records_are_shared_with_pg_store() {
    let backend = Sqlx::new().await;
    // PgStore's migrations find the schema SqlxStore migrated: nothing to do.
    let pg = PgStore::builder(backend.db.config()).build().unwrap();
    pg.migrate().await.unwrap();
    backend.store.migrate().await.unwrap();
    assert_eq!(
        backend
            .count("SELECT count(*) FROM tower_idempotency_migrations")
            .await,
        7
    );
    let request = claim_request("k1", Duration::from_secs(2));
    let Claim::Owned(tx) = backend.store.claim(&request).await.unwrap() else {
        panic!("a new key is owned");
    };
    backend.store.complete(tx, &stored(b"sqlx")).await.unwrap();
    match pg.claim(&request).await.unwrap() {
        Claim::Completed(record) => assert_eq!(&record.response.body[..], b"sqlx"),
        other => panic!("PgStore replays SqlxStore's record, got {other:?}"),
    }
}

#[tokio::test]
async fn migrate_runs_from_a_spawned_task_and_concurrently() {
    let backend = Sqlx::new().await;
    let runs: Vec<_> = (0..4)
        .map(|_| {
            let store = backend.store.clone();
            tokio::spawn(async move { store.migrate().await })
        })
        .collect();
    for run in runs {
        run.await.unwrap().expect("concurrent migrations succeed");
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn sqlx_store_passes_the_lease_conformance_suite() {
    let backend = Sqlx::new().await;
    let report = conformance::run_leases(backend.store.clone()).await;
    println!("{report}");
    report.assert_passed();
    assert_eq!(
        idle_in_transaction(&backend).await,
        0,
        "no transaction left open"
    );
}

#[tokio::test]
async fn fenced_writes_commit_at_the_current_token_only() {
    let backend = Sqlx::new().await;
    let store = backend.store.clone();
    let claim = claim_request("op-1", Duration::from_secs(2));
    let lease = |ms| {
        LeaseRequest::new(
            Duration::from_millis(ms),
            OperationId::random(),
            StoredRequest::new(Method::POST, "/x", vec![], Bytes::new()),
        )
    };
    let Acquired::Owned(first) = store.acquire(&claim, &lease(300)).await.unwrap() else {
        panic!("a new operation is owned");
    };
    // The owner's fenced write commits.
    let tx = first.lease.transaction().await.unwrap();
    Sqlx::insert_order(&tx, "o1", "t").await.unwrap();
    first.lease.commit(tx).await.unwrap();
    // A write rolled back leaves nothing.
    let tx = first.lease.transaction().await.unwrap();
    Sqlx::insert_order(&tx, "o2", "t").await.unwrap();
    store.abort(tx).await.unwrap();
    assert_eq!(backend.orders().await, vec![("o1".into(), "t".into())]);
    // Sleeping past the lease is the behaviour under test: it expires.
    tokio::time::sleep(Duration::from_millis(500)).await;
    let Acquired::Owned(second) = store.acquire(&claim, &lease(60_000)).await.unwrap() else {
        panic!("the expired operation is taken over");
    };
    assert!(second.taken_over && second.token > first.token);
    let stale = first.lease.transaction().await.unwrap_err();
    assert_eq!(stale.kind(), StoreErrorKind::Fenced);
    assert!(first.lease.is_fenced());
    let tx = second.lease.transaction().await.unwrap();
    Sqlx::insert_order(&tx, "o3", "t").await.unwrap();
    second.lease.commit(tx).await.unwrap();
    assert_eq!(backend.orders().await.len(), 2, "o1 and o3");
    // A fenced transaction is no claim: complete refuses it and rolls back.
    let tx = second.lease.transaction().await.unwrap();
    Sqlx::insert_order(&tx, "o4", "t").await.unwrap();
    let err = store.complete(tx, &stored(b"no")).await.unwrap_err();
    assert_eq!(err.kind(), StoreErrorKind::TransactionAborted);
    assert_eq!(backend.orders().await.len(), 2);
    store.release(&second.lease).await.unwrap();
    assert_eq!(idle_in_transaction(&backend).await, 0);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_long_running_mode_runs_on_sqlx_store() {
    use http::{Request, Response, StatusCode};
    use http_body_util::Full;
    use tower::Layer;
    use tower_idempotency::{
        fingerprint::JsonFingerprinter, lease::LeaseConfig, sqlx::SqlxLease, IdempotencyLayer,
        RequestBody,
    };

    let backend = Sqlx::new().await;
    let layer = IdempotencyLayer::new(
        backend.store.clone(),
        "POST /orders v1",
        JsonFingerprinter::new("orders.v1"),
    )
    .long_running(
        LeaseConfig::new(Duration::from_secs(10))
            .heartbeat(Duration::from_millis(100))
            .respond_within(Duration::from_secs(5)),
    );
    let handler = tower::util::BoxCloneService::new(tower::service_fn(
        |request: Request<RequestBody>| async move {
            let lease = request
                .extensions()
                .get::<SqlxLease>()
                .cloned()
                .ok_or("no lease")?;
            let id = format!("ord-{}", lease.operation_id());
            let tx = lease.transaction().await?;
            Sqlx::insert_order(&tx, &id, lease.tenant()).await?;
            lease.commit(tx).await?;
            let mut response = Response::new(Full::new(Bytes::from(id)));
            *response.status_mut() = StatusCode::CREATED;
            Ok::<_, BoxError>(response)
        },
    ));
    let service = layer.layer(handler);
    let first = send(service.clone(), tenant_a_post("k-long")).await;
    assert_eq!(first.status, StatusCode::CREATED);
    assert!(!first.replayed());
    let retry = send(service.clone(), tenant_a_post("k-long")).await;
    assert_eq!(retry.status, StatusCode::CREATED);
    assert!(retry.replayed());
    assert_eq!(retry.body, first.body, "the first answer, byte for byte");
    let orders = backend.orders().await;
    assert_eq!(orders.len(), 1, "one fenced write committed");
    assert_eq!(orders[0].0.as_bytes(), &first.body[..]);
    assert_eq!(
        backend
            .count(
                "SELECT count(*) FROM idempotency_requests WHERE state = 'completed' \
                 AND lease_expires_at IS NULL AND operation_id IS NOT NULL"
            )
            .await,
        1,
        "the operation's record, finished by compare-and-swap"
    );
    assert_eq!(idle_in_transaction(&backend).await, 0);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn abort_cancels_a_statement_left_running_on_the_connection() {
    let backend = Sqlx::new().await;
    let store = backend.store.clone();
    let request = claim_request("k1", Duration::from_secs(2));
    let Claim::Owned(tx) = store.claim(&request).await.unwrap() else {
        panic!("a new key is owned");
    };
    // A handler cut off at its deadline in the middle of a long statement:
    // its future (and with it the borrowed connection) is dropped, the
    // statement still runs on the server.
    let handler = {
        let tx = tx.clone();
        tokio::spawn(async move {
            let mut conn = tx.conn().await.unwrap();
            sqlx::query("SELECT pg_sleep(60)")
                .execute(&mut *conn)
                .await
                .map(|_| ())
        })
    };
    let sleeping = "SELECT count(*) FROM pg_stat_activity \
                    WHERE query = 'SELECT pg_sleep(60)' AND state = 'active'";
    let deadline = tokio::time::Instant::now() + Duration::from_secs(10);
    while backend.count(sleeping).await == 0 {
        assert!(
            tokio::time::Instant::now() < deadline,
            "the statement never started"
        );
        tokio::task::yield_now().await;
    }
    handler.abort();
    let _ = handler.await;
    let started = std::time::Instant::now();
    store.abort(tx).await.expect("the rollback succeeds");
    assert!(
        started.elapsed() < Duration::from_secs(5),
        "the statement was cancelled, not waited for ({:?})",
        started.elapsed()
    );
    assert_eq!(backend.count(sleeping).await, 0, "nothing runs any more");
    let Claim::Owned(tx) = store.claim(&request).await.unwrap() else {
        panic!("the key is free again");
    };
    store.abort(tx).await.unwrap();
    assert_eq!(idle_in_transaction(&backend).await, 0);
}
