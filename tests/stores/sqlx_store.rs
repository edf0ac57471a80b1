//! `SqlxStore` against a real PostgreSQL: the conformance suites (with the
//! handler's writes, and of the long-running mode), fenced writes, the
//! shared schema with `PgStore`, what the handler's connection looks like,
//! and transactions that never stay open. (The
//! layer's behaviour scenarios run against it in `tests/stores/behaviour.rs`.)

use crate::common;

use std::time::Duration;

use bytes::Bytes;
use common::*;
use http::Method;
use sqlx::Executor as _;
use tower::Layer;
use tower_idempotency::{
    lease::OperationId,
    postgres::PgStore,
    sqlx::{SqlxStore, SqlxTx},
    store::{Acquired, Claim, LeaseRequest, LeaseStore, Store, StoreErrorKind, StoredRequest},
    testing::conformance::{self, BoxError, Writes},
};

/// The suite's handler writes: rows of a table of the test's own, written
/// through the claim's connection, and looked for from another connection.
pub(crate) struct SqlxWrites {
    client: tokio_postgres::Client,
}

impl SqlxWrites {
    pub(crate) async fn new(backend: &Sqlx) -> Self {
        backend
            .client
            .batch_execute(
                "CREATE TABLE IF NOT EXISTS conformance_writes (marker text PRIMARY KEY)",
            )
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

pub(crate) async fn idle_in_transaction(backend: &Sqlx) -> i64 {
    backend
        .count(
            "SELECT count(*) FROM pg_stat_activity WHERE datname = current_database() \
             AND state LIKE 'idle in transaction%'",
        )
        .await
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn sqlx_store_passes_the_one_commit_conformance_suite() {
    let backend = Sqlx::new().await;
    let writes = SqlxWrites::new(&backend).await;
    let report = conformance::run_at_commit_with(backend.store.clone(), writes).await;
    report.assert_passed();
    report.assert_all_passed();
    assert_eq!(
        idle_in_transaction(&backend).await,
        0,
        "no transaction left open"
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn sqlx_store_passes_the_conformance_suite() {
    let backend = Sqlx::new().await;
    let writes = SqlxWrites::new(&backend).await;
    let report = conformance::run_all_with(backend.store.clone(), writes).await;
    println!("{report}");
    report.assert_passed();
    report.assert_all_passed();
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

/// A `COMMIT` through the handler's connection never reaches the server:
/// the claim's transaction stays whole, and the completion commits the
/// write with the response.
#[tokio::test]
async fn a_commit_through_the_connection_is_refused_and_the_claim_completes() {
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
        let commit = sqlx::query("COMMIT").execute(&mut *conn).await;
        assert!(
            matches!(commit, Err(sqlx::Error::InvalidArgument(_))),
            "{commit:?}"
        );
    }
    store.complete(tx, &stored(b"done")).await.unwrap();
    assert_eq!(
        backend
            .count("SELECT count(*) FROM idempotency_requests WHERE state = 'completed'")
            .await,
        1,
        "the response is remembered with the write"
    );
    assert_eq!(backend.orders().await.len(), 1);
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
        10,
        "the baseline, lz4_stored_bodies, session_reset_function, \
         session_reset_keeps_hold_limit, session_reset_static, the four bytewise \
         migrations and request_trace_ids, once each"
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

/// The answer of the handlers below.
type Answered = Result<http::Response<http_body_util::Full<Bytes>>, BoxError>;

/// The layer's service around a handler that runs `f` on the `SqlxTx` the
/// layer passes.
fn sqlx_handler<F, Fut>(f: F) -> Handler
where
    F: Fn(SqlxTx) -> Fut + Clone + Send + Sync + 'static,
    Fut: std::future::Future<Output = Answered> + Send + 'static,
{
    tower::util::BoxCloneService::new(tower::service_fn(
        move |request: http::Request<tower_idempotency::RequestBody>| {
            let tx = request.extensions().get::<SqlxTx>().cloned();
            let f = f.clone();
            async move { f(tx.ok_or("the layer passes a SqlxTx")?).await }
        },
    ))
}

/// Whether `result` is the guard's refusal, not anything the server said.
fn refused<T>(result: Result<T, sqlx::Error>) -> bool {
    matches!(result, Err(sqlx::Error::InvalidArgument(ref m)) if m.contains("idempotency"))
}

/// Writes an order, then tries `plain` (ignoring the answers, as a careless
/// handler would) and `leak_session()`; reports its session's process id
/// and which of `plain` were refused.
async fn leave_session_state(
    tx: SqlxTx,
    plain: Vec<String>,
    report: Report<(i32, Vec<bool>)>,
) -> Answered {
    let mut conn = tx.conn().await?;
    sqlx::query("INSERT INTO orders (id, tenant_id) VALUES ('o1', 'tenant-a')")
        .execute(&mut *conn)
        .await?;
    let pid: i32 = sqlx::query_scalar("SELECT pg_backend_pid()")
        .fetch_one(&mut *conn)
        .await?;
    let mut answers = Vec::new();
    for sql in plain {
        answers.push(refused(
            (&mut *conn).execute(sqlx::AssertSqlSafe(sql)).await,
        ));
    }
    sqlx::query("SELECT leak_session()")
        .execute(&mut *conn)
        .await?;
    report.send((pid, answers));
    Ok(created("{}"))
}

/// The session state a request finds: process id, search_path, `x.y`,
/// `x.hidden`, current and session user, advisory locks held, and whether
/// no temporary table is there.
type Observed = (i32, String, String, String, String, String, i64, bool);

/// Writes an order and reports the session state it finds.
async fn observe_session_state(tx: SqlxTx, report: Report<Observed>) -> Answered {
    let mut conn = tx.conn().await?;
    sqlx::query("INSERT INTO orders (id, tenant_id) VALUES ('o2', 'tenant-a')")
        .execute(&mut *conn)
        .await?;
    let observed: Observed = sqlx::query_as(
        "SELECT pg_backend_pid(), current_setting('search_path'), \
             coalesce(current_setting('x.y', true), ''), \
             coalesce(current_setting('x.hidden', true), ''), \
             current_user::text, session_user::text, \
             (SELECT count(*) FROM pg_locks \
                 WHERE locktype = 'advisory' AND pid = pg_backend_pid()), \
             to_regclass('pg_temp.scratch') IS NULL \
                 AND to_regclass('pg_temp.hidden_scratch') IS NULL",
    )
    .fetch_one(&mut *conn)
    .await?;
    report.send(observed);
    Ok(created("{}"))
}

/// What a handler leaves on its session must not reach the next request on
/// the pooled connection (perhaps another tenant's): the plain statements
/// are refused, and what a function hides is reset behind the commit, as
/// `PgStore` does. A pool of one: the next request surely gets the same
/// connection.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn session_state_a_handler_sets_does_not_reach_the_next_request() {
    let backend = Sqlx::with_pool(1).await;
    let role = format!("{}_r", backend.db.name());
    backend
        .client
        .batch_execute(&format!(
            "CREATE ROLE \"{role}\"; \
             GRANT ALL ON ALL TABLES IN SCHEMA public TO \"{role}\"; \
             GRANT ALL ON ALL SEQUENCES IN SCHEMA public TO \"{role}\"; \
             CREATE SCHEMA elsewhere; \
             GRANT USAGE ON SCHEMA elsewhere TO \"{role}\"; \
             CREATE FUNCTION leak_session() RETURNS void LANGUAGE plpgsql AS $$ BEGIN \
                 PERFORM set_config('search_path', 'elsewhere, public', false); \
                 PERFORM set_config('x.hidden', 'v', false); \
                 PERFORM pg_advisory_lock(43); \
                 CREATE TEMP TABLE hidden_scratch (x int); \
                 PERFORM set_config('role', '{role}', false); \
             END $$;"
        ))
        .await
        .unwrap();
    let plain = vec![
        "SET search_path = elsewhere, public".to_owned(),
        "SELECT set_config('x.y', 'v', false)".to_owned(),
        "SELECT pg_advisory_lock(42)".to_owned(),
        "CREATE TEMP TABLE scratch (x int)".to_owned(),
        format!("SET ROLE \"{role}\""),
    ];
    let (report, seen) = Report::channel();
    let leaving = sqlx_handler(move |tx| leave_session_state(tx, plain.clone(), report.clone()));
    let first = send(
        layer(backend.store.clone()).layer(leaving),
        tenant_a_post("k1"),
    )
    .await;
    assert_eq!(first.status, http::StatusCode::CREATED, "{:?}", first.body);
    let (first_pid, refusals) = seen.await.unwrap();

    let (report, seen) = Report::channel();
    let looking = sqlx_handler(move |tx| observe_session_state(tx, report.clone()));
    let second = send(
        layer(backend.store.clone()).layer(looking),
        tenant_a_post("k2"),
    )
    .await;
    assert_eq!(
        second.status,
        http::StatusCode::CREATED,
        "{:?}",
        second.body
    );
    let (pid, search_path, setting, hidden, current, session, advisory, no_temp) =
        seen.await.unwrap();
    assert_eq!(pid, first_pid, "the same pooled connection");
    assert!(
        !search_path.contains("elsewhere"),
        "search_path reset: {search_path}"
    );
    assert_eq!(setting, "", "x.y reset");
    assert_eq!(hidden, "", "x.hidden reset");
    assert_eq!(current, session, "the role reset");
    assert_eq!(advisory, 0, "no session advisory lock held");
    assert!(no_temp, "no temporary table left");
    assert_eq!(
        refusals, [true; 5],
        "the plain session statements are refused, as PgStore refuses them"
    );
    assert_eq!(backend.orders().await.len(), 2);
    assert_eq!(
        backend
            .count("SELECT count(*) FROM idempotency_requests WHERE state = 'completed'")
            .await,
        2
    );
}

/// Writes an order, tries to end the transaction in several ways (and
/// what is allowed: a savepoint, a semicolon in a string), and records
/// which attempts answered as expected.
async fn try_transaction_control(
    tx: SqlxTx,
    calls: std::sync::Arc<std::sync::atomic::AtomicU64>,
    seen: std::sync::Arc<std::sync::Mutex<Vec<[bool; 7]>>>,
) -> Answered {
    calls.fetch_add(1, std::sync::atomic::Ordering::SeqCst);
    let mut conn = tx.conn().await?;
    sqlx::query("INSERT INTO orders (id, tenant_id) VALUES ($1, 'tenant-a')")
        .bind(new_order_id())
        .execute(&mut *conn)
        .await?;
    let answers = [
        refused(sqlx::query("COMMIT").execute(&mut *conn).await),
        refused((&mut *conn).execute("/* done */ COMMIT;").await),
        refused((&mut *conn).execute("END").await),
        refused((&mut *conn).execute("ROLLBACK").await),
        refused((&mut *conn).execute("--\rCOMMIT").await),
        (&mut *conn)
            .execute("SAVEPOINT s1; RELEASE SAVEPOINT s1")
            .await
            .is_ok(),
        sqlx::query("INSERT INTO orders (id, tenant_id) VALUES ('done; commit', 'tenant-a')")
            .execute(&mut *conn)
            .await
            .is_ok(),
    ];
    seen.lock().unwrap().push(answers);
    Ok(created("{}"))
}

/// A `COMMIT` (or any statement that ends the transaction) sent through the
/// connection is refused before it reaches the server, as `PgStore`'s handle
/// refuses it (`tests/stores/postgres.rs`,
/// `transaction_control_through_the_handle_is_refused`): the request
/// completes, and a retry is a replay, not a second run of the handler.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn transaction_control_through_the_connection_is_refused() {
    let backend = Sqlx::new().await;
    let calls = std::sync::Arc::new(std::sync::atomic::AtomicU64::new(0));
    let seen = std::sync::Arc::new(std::sync::Mutex::new(Vec::new()));
    let service = layer(backend.store.clone()).layer(sqlx_handler({
        let (calls, seen) = (calls.clone(), seen.clone());
        move |tx| try_transaction_control(tx, calls.clone(), seen.clone())
    }));
    let first = send(service.clone(), tenant_a_post("k1")).await;
    assert_eq!(first.status, http::StatusCode::CREATED, "{:?}", first.body);
    let retry = send(service, tenant_a_post("k1")).await;
    assert_eq!(retry.status, http::StatusCode::CREATED);
    assert!(retry.replayed(), "the retry is answered from the record");
    assert_eq!(
        calls.load(std::sync::atomic::Ordering::SeqCst),
        1,
        "the handler ran once"
    );
    assert_eq!(seen.lock().unwrap()[0], [true; 7]);
    assert_eq!(
        backend.orders().await.len(),
        2,
        "both orders, committed once"
    );
    assert_eq!(
        backend
            .count("SELECT count(*) FROM idempotency_requests")
            .await,
        1
    );
    assert_eq!(
        backend
            .count("SELECT count(*) FROM idempotency_requests WHERE state = 'completed'")
            .await,
        1
    );
    assert_eq!(idle_in_transaction(&backend).await, 0);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_failed_attempt_on_sqlx_store_keeps_the_operation_for_the_retry() {
    use std::sync::{
        atomic::{AtomicU64, Ordering},
        Arc,
    };

    use http::{Request, Response, StatusCode};
    use http_body_util::Full;
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
    let calls = Arc::new(AtomicU64::new(0));
    // The first attempt commits an order named by its operation, then its
    // answer is lost (502); the next one answers with the operation id.
    let handler = {
        let calls = calls.clone();
        tower::util::BoxCloneService::new(tower::service_fn(
            move |request: Request<RequestBody>| {
                let calls = calls.clone();
                async move {
                    let lease = request
                        .extensions()
                        .get::<SqlxLease>()
                        .cloned()
                        .ok_or("no lease")?;
                    let id = format!("ord-{}", lease.operation_id());
                    let mut response = Response::new(Full::new(Bytes::from(id.clone())));
                    if calls.fetch_add(1, Ordering::SeqCst) == 0 {
                        let tx = lease.transaction().await?;
                        Sqlx::insert_order(&tx, &id, lease.tenant()).await?;
                        lease.commit(tx).await?;
                        *response.status_mut() = StatusCode::BAD_GATEWAY;
                    } else {
                        *response.status_mut() = StatusCode::CREATED;
                    }
                    Ok::<_, BoxError>(response)
                }
            },
        ))
    };
    let service = layer.layer(handler);
    let first = send(service.clone(), tenant_a_post("k-fail")).await;
    assert_eq!(first.status, StatusCode::BAD_GATEWAY);
    assert_eq!(
        backend
            .count(
                "SELECT count(*) FROM idempotency_requests WHERE state = 'in_progress' \
                 AND attempts = 1 AND lease_expires_at <= now()"
            )
            .await,
        1,
        "the operation stays, its lease given up"
    );
    let retry = send(service.clone(), tenant_a_post("k-fail")).await;
    assert_eq!(retry.status, StatusCode::CREATED);
    assert_eq!(retry.body, first.body, "the same operation id");
    assert_eq!(calls.load(Ordering::SeqCst), 2);
    let orders = backend.orders().await;
    assert_eq!(orders.len(), 1);
    assert_eq!(orders[0].0.as_bytes(), &retry.body[..]);
    assert_eq!(
        backend
            .count(
                "SELECT count(*) FROM idempotency_requests WHERE state = 'completed' AND attempts = 2"
            )
            .await,
        1
    );
    assert_eq!(idle_in_transaction(&backend).await, 0);
}

/// A long-running operation that ran out of attempts is remembered like a
/// completion: a short-mode claim of the same key (an endpoint moved back
/// to the claim-first mode) replays the failure, on both stores, instead of
/// answering "in progress" until the retention ends.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_short_claim_replays_a_failed_operation_on_both_stores() {
    let backend = Sqlx::new().await;
    let pg = PgStore::builder(backend.db.config()).build().unwrap();
    let failure = stored(br#"{"code":"operation_failed"}"#);
    for (key, via_pg) in [("failed-sqlx", false), ("failed-pg", true)] {
        let claim = claim_request(key, Duration::from_secs(2));
        let request = LeaseRequest::new(
            Duration::from_secs(60),
            OperationId::random(),
            StoredRequest::new(Method::POST, "/x", vec![], Bytes::new()),
        );
        let Acquired::Owned(owned) = backend.store.acquire(&claim, &request).await.unwrap() else {
            panic!("a new operation is owned");
        };
        backend.store.fail(&owned.lease, &failure, 5).await.unwrap();
        let replayed = if via_pg {
            match pg.claim(&claim).await.unwrap() {
                Claim::Completed(record) => Some(record.response),
                _ => None,
            }
        } else {
            match backend.store.claim(&claim).await.unwrap() {
                Claim::Completed(record) => Some(record.response),
                _ => None,
            }
        };
        assert_eq!(
            replayed.as_ref(),
            Some(&failure),
            "{key}: a failed operation must replay its failure"
        );
    }
    assert_eq!(
        backend
            .count("SELECT count(*) FROM idempotency_requests WHERE state = 'failed'")
            .await,
        2
    );
}
