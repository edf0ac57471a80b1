//! The scenarios every store must pass, written once and run on each store
//! that has what they test: the store's side of a claim (a duplicate from
//! another process, each transaction handle ending its own way, statements
//! a handler left running, a completion the server refuses, durations past
//! a store's limits, lease calls when the database stalls), every
//! conformance suite whatever the database's default isolation, and
//! migrations run concurrently. The layer's flow on every store is
//! `behaviour`.

use std::{future::Future, sync::Arc, time::Duration};

use bytes::Bytes;
use http::{Request, StatusCode};
use tokio::sync::Notify;
use tower::Layer;
use tower_idempotency::{
    postgres::PgStore,
    sqlx::SqlxStore,
    store::{Claim, Store},
    testing::TestDatabase,
    RequestBody,
};

use crate::common::{self, *};

/// Two layers on `store` are two processes: while the first runs its
/// handler, a duplicate with a short wait gets `409 idempotency_in_progress`,
/// and one with the default wait waits on the key's row lock in PostgreSQL
/// (seen through `client`), then replays the first's answer; one order.
pub(crate) async fn a_duplicate_from_another_process_waits_and_replays<B: Backend>(
    backend: &B,
    store: B::Store,
    client: &tokio_postgres::Client,
) {
    let (started, release) = (Arc::new(Notify::new()), Arc::new(Notify::new()));
    let process_a = layer(store.clone()).layer(gated::<B>(started.clone(), release.clone()));
    let process_b = layer(store.clone()).layer(order_handler::<B>(Default::default()));
    let first = spawn_send(process_a, tenant_a_post("k1"));
    started.notified().await;
    let short = layer(store)
        .wait(WAIT_SHORT)
        .layer(order_handler::<B>(Default::default()));
    let timed_out = send(short, tenant_a_post("k1")).await;
    assert_eq!(timed_out.json()["code"], "idempotency_in_progress");
    let duplicate = spawn_send(process_b, tenant_a_post("k1"));
    // Synchronise on the database: the duplicate is waiting for the key's lock.
    let waiting = "SELECT count(*) FROM pg_stat_activity WHERE datname = current_database() AND wait_event_type = 'Lock'";
    for _ in 0..500 {
        let row = client.query_one(waiting, &[]).await.unwrap();
        if row.get::<_, i64>(0) > 0 {
            break;
        }
        tokio::time::sleep(Duration::from_millis(10)).await;
    }
    release.notify_one();
    let first = first.await.unwrap();
    let duplicate = duplicate.await.unwrap();
    assert_eq!(
        duplicate.status,
        StatusCode::CREATED,
        "{}",
        duplicate.json()
    );
    assert!(duplicate.replayed());
    assert_eq!(duplicate.body, first.body);
    assert_eq!(backend.orders().await.len(), 1);
}

/// A claim's handle and a fenced transaction each end their own way only:
/// `commit_fenced` refuses a claim's transaction (it would commit the
/// handler's writes with the key still in progress, for a retry to run the
/// handler again) and leaves it to `complete`; `complete` refuses a fenced
/// transaction and rolls it back, leaving the operation running.
pub(crate) async fn each_transaction_handle_ends_only_its_own_way<B>(backend: &B)
where
    B: Backend<Store: tower_idempotency::store::LeaseStore>,
{
    use tower_idempotency::{
        lease::OperationId,
        store::{Acquired, LeaseRequest, LeaseStore, StoreErrorKind, StoredRequest},
    };
    let store = backend.store();
    let claim = claim_request("handle-kinds", Duration::from_secs(2));
    let Ok(Claim::Owned(tx)) = store.claim(&claim).await else {
        panic!("a new key is owned")
    };
    B::insert_order(&tx, "by-claim", "t").await.unwrap();
    let refused = LeaseStore::commit_fenced(&store, tx.clone())
        .await
        .expect_err("a claim's transaction is no fenced one");
    assert_eq!(refused.kind(), StoreErrorKind::TransactionAborted);
    assert!(backend.orders().await.is_empty(), "nothing was committed");
    store.complete(tx, &stored(b"done")).await.unwrap();
    assert_eq!(backend.orders().await.len(), 1, "the claim completes");
    assert_eq!(backend.remembered().await, 1);

    let operation = claim_request("operation", Duration::from_secs(2));
    let lease = LeaseRequest::new(
        Duration::from_secs(60),
        OperationId::random(),
        StoredRequest::new(http::Method::POST, "/x", vec![], Bytes::new()),
    );
    let Ok(Acquired::Owned(owned)) = store.acquire(&operation, &lease).await else {
        panic!("a new operation is owned")
    };
    let tx = store.fenced(&owned.lease).await.unwrap();
    B::insert_order(&tx, "by-lease", "t").await.unwrap();
    let refused = store
        .complete(tx, &stored(b"no"))
        .await
        .expect_err("a fenced transaction is no claim");
    assert_eq!(refused.kind(), StoreErrorKind::TransactionAborted);
    assert_eq!(backend.orders().await.len(), 1, "rolled back");
    assert_eq!(backend.remembered().await, 1, "the operation still runs");
    let tx = store.fenced(&owned.lease).await.unwrap();
    B::insert_order(&tx, "by-lease", "t").await.unwrap();
    store.commit_fenced(tx).await.unwrap();
    store.finish(&owned.lease, &stored(b"done")).await.unwrap();
    assert_eq!(backend.orders().await.len(), 2);
    assert_eq!(backend.remembered().await, 2);
}

/// Runs every conformance suite on `store` (the claim-first mode's with the
/// handler's writes, the one-commit mode's, the lease protocol's) and
/// asserts that each check ran and passed.
pub(crate) async fn assert_every_suite_passes<St, W, Fut>(store: St, writes: impl Fn() -> Fut)
where
    St: tower_idempotency::store::CommitStore + tower_idempotency::store::LeaseStore + Clone,
    W: tower_idempotency::testing::conformance::Writes<St::Tx>,
    Fut: Future<Output = W>,
{
    use tower_idempotency::testing::conformance;
    conformance::run_all_with(store.clone(), writes().await)
        .await
        .assert_all_passed();
    conformance::run_at_commit_with(store.clone(), writes().await)
        .await
        .assert_all_passed();
    conformance::run_leases(store).await.assert_all_passed();
}

/// Starts `migrate` from four tasks at once and expects each to succeed.
pub(crate) async fn migrate_from_four_tasks<F, Fut, E>(migrate: F)
where
    F: Fn() -> Fut,
    Fut: Future<Output = Result<(), E>> + Send + 'static,
    E: std::fmt::Debug + Send + 'static,
{
    let runs: Vec<_> = (0..4).map(|_| tokio::spawn(migrate())).collect();
    for run in runs {
        run.await.unwrap().expect("concurrent migrations succeed");
    }
}

/// A statement the handler started through a clone of its handle, still
/// running when the handler answers, is part of the work: the completion
/// (or the one-commit mode's commit) waits for it and commits it with the
/// response; it is not cancelled, and the answer is the handler's, then
/// replayed.
pub(crate) async fn a_statement_running_when_the_handler_answers_commits_with_it<B>(
    backend: &B,
    db: &TestDatabase,
) where
    B: Backend<Store: tower_idempotency::store::CommitStore>,
{
    let setup = db.client().await;
    setup
        .batch_execute(
            "CREATE FUNCTION slow_order() RETURNS trigger LANGUAGE plpgsql AS \
             $$ BEGIN PERFORM pg_sleep(1.5); RETURN NEW; END $$; \
             CREATE TRIGGER slow_order BEFORE INSERT ON orders FOR EACH ROW \
             WHEN (NEW.id LIKE 'slow%') EXECUTE FUNCTION slow_order()",
        )
        .await
        .unwrap();
    let watcher = Arc::new(db.client().await);
    for (one_commit, id) in [(false, "slow-1"), (true, "slow-2")] {
        let (late_tx, late_rx) = Report::channel();
        let handler = slow_insert_handler::<B>(watcher.clone(), late_tx, id);
        let (first, retry) = if one_commit {
            let service = layer(backend.store()).claim_at_commit().layer(handler);
            let first = send(service.clone(), tenant_a_post(id)).await;
            (first, send(service, tenant_a_post(id)).await)
        } else {
            let service = layer(backend.store()).layer(handler);
            let first = send(service.clone(), tenant_a_post(id)).await;
            (first, send(service, tenant_a_post(id)).await)
        };
        assert_eq!(first.status, StatusCode::CREATED, "{id}: {:?}", first.body);
        assert!(!first.replayed());
        assert_eq!(
            late_rx.await.unwrap(),
            Ok(()),
            "{id}: the insert was not cancelled"
        );
        assert!(retry.replayed(), "{id}");
        assert_eq!(retry.body, first.body);
    }
    let mut orders = backend.orders().await;
    orders.sort();
    assert_eq!(
        orders,
        [
            ("slow-1".to_owned(), "tenant-a".to_owned()),
            ("slow-2".to_owned(), "tenant-a".to_owned())
        ]
    );
    assert_eq!(backend.remembered().await, 2);
}

/// A handler that answers while a task it spawned still runs a statement
/// through a clone of the handle (an insert a trigger holds for an hour):
/// the commit waits for that statement, which would commit with the
/// response, but not without bound. Past the commit's patience (5 s) the
/// statement is cancelled and the transaction rolled back: `503
/// store_unavailable`, nothing committed, the key free; in both modes.
pub(crate) async fn a_statement_left_running_past_the_commits_patience_is_cancelled<B>(
    backend: &B,
    db: &TestDatabase,
) where
    B: Backend<Store: tower_idempotency::store::CommitStore>,
{
    let setup = db.client().await;
    setup
        .batch_execute(
            "CREATE FUNCTION stuck_order() RETURNS trigger LANGUAGE plpgsql AS \
             $$ BEGIN PERFORM pg_sleep(3600); RETURN NEW; END $$; \
             CREATE TRIGGER stuck_order BEFORE INSERT ON orders FOR EACH ROW \
             WHEN (NEW.id LIKE 'stuck%') EXECUTE FUNCTION stuck_order()",
        )
        .await
        .unwrap();
    let watcher = Arc::new(db.client().await);
    for (one_commit, id) in [(false, "stuck-1"), (true, "stuck-2")] {
        let (late_tx, late_rx) = Report::channel();
        let handler = slow_insert_handler::<B>(watcher.clone(), late_tx, id);
        let started = std::time::Instant::now();
        let answered = if one_commit {
            let service = layer(backend.store()).claim_at_commit().layer(handler);
            tokio::time::timeout(Duration::from_secs(30), send(service, tenant_a_post(id))).await
        } else {
            let service = layer(backend.store()).layer(handler);
            tokio::time::timeout(Duration::from_secs(30), send(service, tenant_a_post(id))).await
        };
        let answer = answered.expect("answered, not held by the statement left running");
        assert_eq!(
            answer.status,
            StatusCode::SERVICE_UNAVAILABLE,
            "{id}: {:?}",
            answer.body
        );
        assert_eq!(answer.json()["code"], "store_unavailable", "{id}");
        assert!(
            started.elapsed() < Duration::from_secs(20),
            "{id}: {:?}",
            started.elapsed()
        );
        assert!(
            late_rx.await.unwrap().is_err(),
            "{id}: the insert was cancelled"
        );
        let sleeping: i64 = watcher
            .query_one(
                "SELECT count(*) FROM pg_stat_activity \
                 WHERE wait_event = 'PgSleep' AND datname = current_database()",
                &[],
            )
            .await
            .unwrap()
            .get(0);
        assert_eq!(sleeping, 0, "{id}: nothing left sleeping");
    }
    assert!(backend.orders().await.is_empty(), "nothing committed");
    assert_eq!(backend.remembered().await, 0);
    let retry = send(
        layer(backend.store()).layer(order_handler::<B>(Default::default())),
        tenant_a_post("stuck-1"),
    )
    .await;
    assert_eq!(
        retry.status,
        StatusCode::CREATED,
        "the key is free: {:?}",
        retry.body
    );
}

/// A handler that starts inserting the order `id` from a task of its own,
/// and answers once the insert runs in the database (its trigger sleeps);
/// the task reports how the insert ended.
fn slow_insert_handler<B: Backend>(
    watcher: Arc<tokio_postgres::Client>,
    late: Report<Result<(), String>>,
    id: &'static str,
) -> Handler {
    tower::util::BoxCloneService::new(tower::service_fn(move |request: Request<RequestBody>| {
        let (watcher, late) = (watcher.clone(), late.clone());
        async move {
            let leaked = tx_of::<B>(&request).ok_or("no transaction handle")?;
            tokio::spawn(async move { late.send(B::insert_order(&leaked, id, "tenant-a").await) });
            let running = "SELECT count(*) FROM pg_stat_activity \
                           WHERE wait_event = 'PgSleep' AND datname = current_database()";
            while watcher.query_one(running, &[]).await?.get::<_, i64>(0) == 0 {
                tokio::task::yield_now().await;
            }
            Ok::<_, BoxError>(created(format!("{{\"id\":\"{id}\"}}")))
        }
    }))
}

/// A completion the server refuses for a reason of its own (disk full,
/// `53100`) is retryable (`Backend`, answered `503`), not "fails the same
/// way" (`TransactionAborted`, `500 commit_rejected`); and one cancelled
/// in the server (`57014`) is rolled back for certain (`Unavailable`), not
/// of unknown outcome. Nothing is committed either way.
pub(crate) async fn a_completion_the_server_refuses_is_sorted_by_its_cause<B: Backend>(
    backend: &B,
    client: &tokio_postgres::Client,
) {
    use tower_idempotency::store::StoreErrorKind;
    client
        .batch_execute(
            "CREATE FUNCTION refuse_completion() RETURNS trigger LANGUAGE plpgsql AS $$ BEGIN \
               IF NEW.idempotency_key = 'disk-full' THEN RAISE EXCEPTION 'no space' USING ERRCODE = '53100'; END IF; \
               IF NEW.idempotency_key = 'cancelled' THEN RAISE EXCEPTION 'cancelled' USING ERRCODE = '57014'; END IF; \
               RETURN NEW; END $$; \
             CREATE TRIGGER refuse_completion BEFORE UPDATE ON idempotency_requests FOR EACH ROW \
               WHEN (NEW.state = 'completed') EXECUTE FUNCTION refuse_completion()",
        )
        .await
        .unwrap();
    let store = backend.store();
    for (key, kind) in [
        ("disk-full", StoreErrorKind::Backend),
        ("cancelled", StoreErrorKind::Unavailable),
    ] {
        let claim = claim_request(key, Duration::from_secs(2));
        let Ok(Claim::Owned(tx)) = store.claim(&claim).await else {
            panic!("{key}: a new key is owned")
        };
        B::insert_order(&tx, key, "t").await.unwrap();
        let refused = store
            .complete(tx, &stored(b"done"))
            .await
            .expect_err("the completion is refused");
        assert_eq!(refused.kind(), kind, "{key}: {refused}");
        let Ok(Claim::Owned(again)) = store.claim(&claim).await else {
            panic!("{key}: rolled back, the key is free again")
        };
        store.abort(again).await.unwrap();
    }
    assert!(backend.orders().await.is_empty(), "nothing was committed");
    assert_eq!(backend.remembered().await, 0);
}

/// Durations past what a store can hold are held to their limits by the
/// store API's constructors: a claim that would wait for ever, a backoff of
/// ages, a lease and a retention of `Duration::MAX` neither panic nor fail.
pub(crate) async fn extreme_durations_are_held_to_their_limits<B>(backend: &B)
where
    B: Backend<Store: tower_idempotency::store::LeaseStore>,
{
    use tower_idempotency::{
        lease::OperationId,
        store::{Acquired, Backoff, LeaseRequest, LeaseStore, StoredRequest},
    };
    let store = backend.store();
    let claim = claim_request("forever", Duration::MAX).with_retention(Duration::MAX);
    let Ok(Claim::Owned(tx)) = store.claim(&claim).await else {
        panic!("a new key is owned")
    };
    store.complete(tx, &stored(b"kept")).await.unwrap();
    let Ok(Claim::Completed(record)) = store.claim(&claim).await else {
        panic!("and remembered")
    };
    assert_eq!(&record.response.body[..], b"kept");
    let lease = LeaseRequest::new(
        Duration::MAX,
        OperationId::random(),
        StoredRequest::new(http::Method::POST, "/x", vec![], Bytes::new()),
    );
    let operation = claim_request("ages", Duration::MAX).with_retention(Duration::MAX);
    let Ok(Acquired::Owned(owned)) = store.acquire(&operation, &lease).await else {
        panic!("a new operation is owned")
    };
    store.heartbeat(&owned.lease, Duration::MAX).await.unwrap();
    let recovered = store
        .recover(
            "POST /x",
            Duration::MAX,
            Duration::MAX,
            Backoff::new(Duration::MAX, Duration::MAX),
        )
        .await
        .expect("a recovery with a backoff of ages looks and finds nothing");
    assert!(recovered.is_none());
    store.finish(&owned.lease, &stored(b"done")).await.unwrap();
}

/// A store whose database stops answering (`proxy` holds every answer back
/// for a minute) answers its lease calls within their bound, `Unavailable`,
/// instead of waiting for ever: a finish, a heartbeat, a recovery.
pub(crate) async fn lease_calls_are_bounded_when_the_database_stalls<St>(
    store: St,
    proxy: &proxy::SlowProxy,
) where
    St: tower_idempotency::store::LeaseStore,
{
    use tower_idempotency::{
        lease::OperationId,
        store::{Acquired, Backoff, LeaseRequest, StoreErrorKind, StoredRequest},
    };
    let lease = LeaseRequest::new(
        Duration::from_secs(30),
        OperationId::random(),
        StoredRequest::new(http::Method::POST, "/x", vec![], Bytes::new()),
    );
    let claim = claim_request("stalled", Duration::from_secs(2));
    let Ok(Acquired::Owned(owned)) = store.acquire(&claim, &lease).await else {
        panic!("a new operation is owned")
    };
    proxy.set_delay(Duration::from_secs(60));
    let bound = Duration::from_secs(8);
    let finished = tokio::time::timeout(bound, store.finish(&owned.lease, &stored(b"done")))
        .await
        .expect("the finish answers within its bound");
    assert_eq!(
        finished.map_err(|e| e.kind()),
        Err(StoreErrorKind::Unavailable)
    );
    let recovered = tokio::time::timeout(
        bound,
        store.recover(
            "POST /x",
            Duration::from_secs(30),
            Duration::from_secs(60),
            Backoff::NONE,
        ),
    )
    .await
    .expect("the recovery answers within its bound");
    assert_eq!(
        recovered.map(|found| found.is_some()).map_err(|e| e.kind()),
        Err(StoreErrorKind::Unavailable)
    );
}

/// Each scenario on `PgStore`.
mod pg_store {
    use super::*;
    use crate::postgres::PgWrites;

    /// The isolation level is the store's, not the database default's: under
    /// REPEATABLE READ and SERIALIZABLE defaults every suite passes as under READ
    /// COMMITTED (a duplicate waits on the row lock and replays, a loser loses,
    /// a takeover takes over) instead of failing with a serialization error.
    #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
    async fn pg_store_passes_every_suite_whatever_the_database_default_isolation() {
        let pg = Postgres::new().await;
        for isolation in ["repeatable read", "serializable"] {
            let store = pg
                .store_with_database_setting("default_transaction_isolation", isolation)
                .await;
            assert_every_suite_passes(store, || PgWrites::new(&pg)).await;
        }
        assert_eq!(
            pg.idle_in_transaction().await,
            0,
            "no transaction left open"
        );
    }

    #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
    async fn migrations_are_idempotent_under_concurrency() {
        let db = tower_idempotency::testing::TestDatabase::create().await;
        let store = PgStore::builder(db.config()).build().unwrap();
        migrate_from_four_tasks(|| {
            let store = store.clone();
            async move { store.migrate().await }
        })
        .await;
        store.migrate().await.expect("a rerun is a no-op");
        let client = db.client().await;
        let versions = migration_versions(&client).await;
        assert_eq!(
            versions,
            [1, 2, 3, 4, 5, 6, 7, 8, 9, 10],
            "every migration of the crate, once"
        );
        // A migrator that waited for another's lock reads what it committed,
        // also when the database defaults to a snapshot per transaction.
        let later = tower_idempotency::testing::TestDatabase::create().await;
        set_database_default(
            &client,
            &later,
            "default_transaction_isolation",
            "repeatable read",
        )
        .await;
        let store = PgStore::builder(later.config()).build().unwrap();
        migrate_from_four_tasks(|| {
            let store = store.clone();
            async move { store.migrate().await }
        })
        .await;
        let versions = migration_versions(&later.client().await).await;
        assert_eq!(
            versions,
            [1, 2, 3, 4, 5, 6, 7, 8, 9, 10],
            "every migration of the crate, once"
        );
        let fillfactor: String = client
            .query_one("SELECT array_to_string(reloptions, ',') FROM pg_class WHERE relname = 'idempotency_requests'", &[])
            .await
            .unwrap()
            .get(0);
        assert_eq!(fillfactor, "fillfactor=80");
    }

    /// Two layers are two processes: the duplicate waits on the row lock in
    /// PostgreSQL, then replays; even when the database defaults to REPEATABLE READ.
    #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
    async fn duplicate_from_another_process_waits_on_the_row_lock() {
        let pg = Postgres::new().await;
        let store = pg
            .store_with_database_setting("default_transaction_isolation", "repeatable read")
            .await;
        a_duplicate_from_another_process_waits_and_replays(&pg, store, &pg.client).await;
    }

    #[tokio::test]
    async fn each_transaction_handle_ends_only_its_own_way() {
        super::each_transaction_handle_ends_only_its_own_way(&Postgres::new().await).await;
    }

    #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
    async fn a_statement_running_when_the_handler_answers_is_waited_for_and_committed() {
        let pg = Postgres::new().await;
        a_statement_running_when_the_handler_answers_commits_with_it(&pg, &pg.db).await;
        assert_eq!(pg.idle_in_transaction().await, 0);
    }

    #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
    async fn a_statement_left_running_past_the_commits_patience_is_cancelled_pg_store() {
        let pg = Postgres::new().await;
        a_statement_left_running_past_the_commits_patience_is_cancelled(&pg, &pg.db).await;
    }

    #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
    async fn a_completion_the_server_refuses_is_sorted_by_its_cause() {
        let pg = Postgres::new().await;
        super::a_completion_the_server_refuses_is_sorted_by_its_cause(&pg, &pg.client).await;
        assert_eq!(pg.idle_in_transaction().await, 0);
    }

    #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
    async fn pg_store_holds_extreme_durations_to_their_limits() {
        super::extreme_durations_are_held_to_their_limits(&Postgres::new().await).await;
    }

    #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
    async fn pg_store_lease_calls_are_bounded_when_the_database_stalls() {
        let pg = Postgres::new().await;
        let proxy = common::proxy::SlowProxy::start(pg.db.config()).await;
        let store = PgStore::builder(proxy.config()).build().unwrap();
        super::lease_calls_are_bounded_when_the_database_stalls(store, &proxy).await;
    }
}

/// Each scenario on `SqlxStore`.
mod sqlx_store {
    use super::*;
    use crate::sqlx_store::{idle_in_transaction, SqlxWrites};

    /// The isolation level is the store's, not the database default's: under
    /// REPEATABLE READ and SERIALIZABLE defaults every suite passes as under READ
    /// COMMITTED (a duplicate waits on the row lock and replays, a loser loses,
    /// a takeover takes over) instead of failing with a serialization error.
    #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
    async fn sqlx_store_passes_every_suite_whatever_the_database_default_isolation() {
        let backend = Sqlx::new().await;
        for isolation in ["repeatable read", "serializable"] {
            let store = backend
                .store_with_database_setting("default_transaction_isolation", isolation)
                .await;
            assert_every_suite_passes(store, || SqlxWrites::new(&backend)).await;
        }
        assert_eq!(
            idle_in_transaction(&backend).await,
            0,
            "no transaction left open"
        );
    }

    /// Migrators that start together all succeed, also when the database
    /// defaults to a snapshot per transaction (the one that waited for the lock
    /// reads what the first committed).
    #[tokio::test]
    async fn migrate_runs_from_a_spawned_task_and_concurrently() {
        let backend = Sqlx::new().await;
        let later = tower_idempotency::testing::TestDatabase::create().await;
        set_database_default(
            &backend.client,
            &later,
            "default_transaction_isolation",
            "repeatable read",
        )
        .await;
        for store in [
            backend.store.clone(),
            SqlxStore::new(sqlx_pool(&later, 4).await),
        ] {
            migrate_from_four_tasks(|| {
                let store = store.clone();
                async move { store.migrate().await }
            })
            .await;
        }
        let versions = migration_versions(&later.client().await).await;
        assert_eq!(
            versions,
            [1, 2, 3, 4, 5, 6, 7, 8, 9, 10],
            "every migration of the crate, once"
        );
    }

    /// Two layers are two processes: the duplicate waits on the row lock in
    /// PostgreSQL, then replays; even when the database defaults to REPEATABLE READ.
    #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
    async fn duplicate_from_another_process_waits_on_the_row_lock() {
        let backend = Sqlx::new().await;
        let store = backend
            .store_with_database_setting("default_transaction_isolation", "repeatable read")
            .await;
        a_duplicate_from_another_process_waits_and_replays(&backend, store, &backend.client).await;
    }

    #[tokio::test]
    async fn each_transaction_handle_ends_only_its_own_way() {
        super::each_transaction_handle_ends_only_its_own_way(&Sqlx::new().await).await;
    }

    #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
    async fn a_statement_running_when_the_handler_answers_is_waited_for_and_committed() {
        let backend = Sqlx::new().await;
        a_statement_running_when_the_handler_answers_commits_with_it(&backend, &backend.db).await;
        assert_eq!(idle_in_transaction(&backend).await, 0);
    }

    #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
    async fn a_statement_left_running_past_the_commits_patience_is_cancelled_sqlx_store() {
        let backend = Sqlx::new().await;
        a_statement_left_running_past_the_commits_patience_is_cancelled(&backend, &backend.db)
            .await;
    }

    #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
    async fn a_completion_the_server_refuses_is_sorted_by_its_cause() {
        let backend = Sqlx::new().await;
        super::a_completion_the_server_refuses_is_sorted_by_its_cause(&backend, &backend.client)
            .await;
        assert_eq!(idle_in_transaction(&backend).await, 0);
    }

    #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
    async fn sqlx_store_holds_extreme_durations_to_their_limits() {
        super::extreme_durations_are_held_to_their_limits(&Sqlx::new().await).await;
    }

    #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
    async fn sqlx_store_lease_calls_are_bounded_when_the_database_stalls() {
        let backend = Sqlx::new().await;
        let proxy = common::proxy::SlowProxy::start(backend.db.config()).await;
        let pool = sqlx::postgres::PgPoolOptions::new()
            .max_connections(4)
            .connect_with(sqlx_options_for(&proxy.config(), backend.db.name()))
            .await
            .expect("the pool connects through the proxy");
        super::lease_calls_are_bounded_when_the_database_stalls(SqlxStore::new(pool), &proxy).await;
    }
}

/// The scenarios `MemoryStore` can run (it has no database to stall or refuse).
mod memory_store {
    use super::*;

    #[tokio::test]
    async fn memory_store_holds_extreme_durations_to_their_limits() {
        super::extreme_durations_are_held_to_their_limits(&common::Memory::new().await).await;
    }
}
