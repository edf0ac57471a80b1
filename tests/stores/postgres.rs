//! PostgreSQL-specific guarantees: the stored row, the transaction handle's
//! safety under panics, leaks and misuse, and failures of the database itself.

use crate::common;

use std::{sync::Arc, time::Duration};

use common::*;
use http::StatusCode;
use tokio::sync::Notify;
use tower::Layer;
use tower_idempotency::{
    postgres::{PgStore, PgTx, TxErrorKind},
    testing::conformance,
};

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn pg_store_passes_the_conformance_suite() {
    let pg = Postgres::new().await;
    let writes = PgWrites::new(&pg).await;
    let report = conformance::run_all_with(pg.store.clone(), writes).await;
    report.assert_all_passed();
    assert_eq!(
        pg.idle_in_transaction().await,
        0,
        "no transaction left open"
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn pg_store_passes_the_one_commit_conformance_suite() {
    let pg = Postgres::new().await;
    let writes = PgWrites::new(&pg).await;
    let report = conformance::run_at_commit_with(pg.store.clone(), writes).await;
    report.assert_all_passed();
    assert_eq!(
        pg.idle_in_transaction().await,
        0,
        "no transaction left open"
    );
}

#[tokio::test]
async fn memory_store_passes_the_conformance_suite() {
    let store = tower_idempotency::memory::MemoryStore::new();
    let report = conformance::run_all_with(store.clone(), store).await;
    report.assert_passed();
    assert_eq!(report.failed_names(), Vec::<&str>::new());
    report.assert_all_passed();
}

/// The suite's handler writes for `PgStore`: rows of a table of the test's
/// own, a failing statement, and a look from another connection.
pub(crate) struct PgWrites {
    client: tokio_postgres::Client,
}

impl PgWrites {
    pub(crate) async fn new(pg: &Postgres) -> Self {
        pg.exec("CREATE TABLE IF NOT EXISTS conformance_writes (marker text PRIMARY KEY)")
            .await;
        PgWrites {
            client: pg.db.client().await,
        }
    }
}

impl conformance::Writes<PgTx> for PgWrites {
    async fn write(&self, tx: &PgTx, marker: &str) -> Result<(), conformance::BoxError> {
        tx.execute(
            "INSERT INTO conformance_writes (marker) VALUES ($1)",
            &[&marker],
        )
        .await?;
        Ok(())
    }

    async fn fail(&self, tx: &PgTx) -> Result<(), conformance::BoxError> {
        match tx.batch_execute("SELECT 1 / 0").await {
            Err(e) if e.kind() == TxErrorKind::Database => Ok(()),
            Err(e) => Err(e.into()),
            Ok(()) => Err("a division by zero succeeded".into()),
        }
    }

    async fn is_committed(&self, marker: &str) -> Result<bool, conformance::BoxError> {
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

/// The development schema of before the first release (its migrations
/// recorded under their own versions and names), and a schema newer than
/// this build, are refused by both stores, and left as they are.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_development_schema_and_a_newer_one_are_refused() {
    use tower_idempotency::store::{StoreError, StoreErrorKind};
    const DEVELOPMENT: &str = "INSERT INTO tower_idempotency_migrations (version, name) VALUES \
         (1, 'idempotency_requests'), (2, 'outbox_and_inbox'), (3, 'retention'), \
         (4, 'attempt_token_sequence'), (5, 'long_running_operations'), (6, 'resource_id'), \
         (7, 'operation_attempts'), (8, 'tenant_in_every_key'), (9, 'hot_completion')";
    const NEWER: &str = "INSERT INTO tower_idempotency_migrations (version, name) VALUES \
         (1, 'baseline'), (1000, 'from_a_later_release')";
    for (recorded, expected) in [
        (DEVELOPMENT, "development schema"),
        (NEWER, "newer than this build"),
    ] {
        let db = tower_idempotency::testing::TestDatabase::create().await;
        let client = db.client().await;
        client
            .batch_execute(&format!(
                "CREATE TABLE tower_idempotency_migrations (
                     version    integer PRIMARY KEY,
                     name       text NOT NULL,
                     applied_at timestamptz NOT NULL DEFAULT now()
                 );
                 {recorded}"
            ))
            .await
            .unwrap();
        let before = migration_versions(&client).await;
        let pg = PgStore::builder(db.config()).build().unwrap();
        let sqlx = tower_idempotency::sqlx::SqlxStore::new(sqlx_pool(&db, 2).await);
        let refusals: [StoreError; 2] = [
            pg.migrate().await.unwrap_err(),
            sqlx.migrate().await.unwrap_err(),
        ];
        for e in refusals {
            assert_eq!(e.kind(), StoreErrorKind::Schema, "{e}");
            assert!(e.to_string().contains(expected), "{e}");
            if expected == "development schema" {
                assert!(e.to_string().contains("fresh database"), "{e}");
            }
        }
        assert_eq!(
            migration_versions(&client).await,
            before,
            "nothing recorded"
        );
        let table: Option<String> = client
            .query_one("SELECT to_regclass('idempotency_requests')::text", &[])
            .await
            .unwrap()
            .get(0);
        assert_eq!(table, None, "nothing created");
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn stores_the_response_and_its_metadata() {
    let pg = Postgres::new().await;
    let service = layer(pg.store.clone()).layer(order_handler::<Postgres>(Default::default()));
    let answer = send(service, tenant_a_post("k1")).await;
    let row = pg
        .row(
            "SELECT tenant_id, endpoint, idempotency_key, request_fingerprint, state, attempt_token, response_status, \
                    response_headers, response_body, extract(epoch from expires_at - created_at)::float8, completed_at IS NOT NULL \
             FROM idempotency_requests",
        )
        .await;
    assert_eq!(row.get::<_, &str>(0), "tenant-a");
    assert_eq!(row.get::<_, &str>(1), "POST /orders v1");
    assert_eq!(row.get::<_, &str>(2), "k1");
    assert_eq!(row.get::<_, &[u8]>(3).len(), 32);
    assert_eq!(row.get::<_, &str>(4), "completed");
    assert_eq!(row.get::<_, i64>(5), 1);
    assert_eq!(row.get::<_, i16>(6), 201);
    let headers = String::from_utf8(row.get::<_, Vec<u8>>(7)).unwrap();
    assert!(headers.contains("location: /orders/"), "{headers}");
    assert!(!headers.contains("set-cookie"), "{headers}");
    assert_eq!(row.get::<_, &[u8]>(8), &answer.body[..]);
    // Retention counts from the claim (the row's created_at).
    assert_eq!(row.get::<_, f64>(9), 86_400.0);
    assert!(row.get::<_, bool>(10));
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn backdated_record_is_taken_over_with_a_new_attempt_token() {
    let pg = Postgres::new().await;
    // The retention is cut short behind the layer's back, which a replay
    // cache cannot see (see the replay cache tests).
    let service = layer(pg.store.clone())
        .without_replay_cache()
        .layer(order_handler::<Postgres>(Default::default()));
    let first = send(service.clone(), tenant_a_post("k1")).await;
    let first_token: i64 = pg
        .value("SELECT attempt_token FROM idempotency_requests")
        .await;
    let replay = send(service.clone(), tenant_a_post("k1")).await;
    assert!(replay.replayed(), "before expiry the key replays");
    // Time passes: the retention ends.
    pg.exec("UPDATE idempotency_requests SET expires_at = now() - interval '1 second'")
        .await;
    let other_body = r#"{"checkout_id":"chk_2","amount":1}"#;
    let again = send(service, post(Some("tenant-a"), Some("k1"), other_body)).await;
    assert!(!again.replayed());
    assert_ne!(again.body, first.body);
    assert_eq!(pg.orders().await.len(), 2);
    let token: i64 = pg
        .value("SELECT attempt_token FROM idempotency_requests")
        .await;
    assert!(
        token > first_token,
        "a new attempt: {token} > {first_token}"
    );
}

/// With a pool of one connection, a transaction leaked back to the pool would
/// be reused by the next request and commit the panicked handler's write.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn panicking_handler_rolls_back_and_never_leaks_its_transaction() {
    let pg = Postgres::with_pool(1).await;
    let panicking = layer(pg.store.clone()).layer(handler(|tx: PgTx| async move {
        tx.execute(
            "INSERT INTO orders (id, tenant_id) VALUES ('from-panic', 'tenant-a')",
            &[],
        )
        .await?;
        panic!("handler bug");
    }));
    let outcome = spawn_send(panicking, tenant_a_post("k1")).await;
    assert!(
        outcome.unwrap_err().is_panic(),
        "the panic propagates like without the layer"
    );
    let working = layer(pg.store.clone()).layer(order_handler::<Postgres>(Default::default()));
    let retry = send(working, tenant_a_post("k1")).await;
    assert_eq!(retry.status, StatusCode::CREATED);
    let orders = pg.orders().await;
    assert_eq!(orders.len(), 1);
    assert_ne!(orders[0].0, "from-panic");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn handle_kept_by_a_spawned_task_is_finished_after_the_response() {
    let pg = Postgres::new().await;
    let release = Arc::new(Notify::new());
    let (late_tx, late_rx) = Report::channel();
    let service = layer(pg.store.clone()).layer(handler({
        let release = release.clone();
        move |tx: PgTx| {
            let (release, late_tx) = (release.clone(), late_tx.clone());
            async move {
                tx.execute(
                    "INSERT INTO orders (id, tenant_id) VALUES ('in-handler', 'tenant-a')",
                    &[],
                )
                .await?;
                let leaked = tx.clone();
                tokio::spawn(async move {
                    release.notified().await;
                    let late = leaked
                        .execute(
                            "INSERT INTO orders (id, tenant_id) VALUES ('too-late', 'tenant-a')",
                            &[],
                        )
                        .await;
                    late_tx.send(late.map_err(|e| e.kind()));
                });
                Ok(created("{}"))
            }
        }
    }));
    let answer = send(service, tenant_a_post("k1")).await;
    assert_eq!(answer.status, StatusCode::CREATED);
    release.notify_one();
    assert_eq!(late_rx.await.unwrap(), Err(TxErrorKind::Finished));
    assert_eq!(
        pg.orders().await,
        [("in-handler".to_owned(), "tenant-a".to_owned())]
    );
    assert_eq!(pg.idle_in_transaction().await, 0);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn swallowed_database_error_cannot_commit() {
    let pg = Postgres::new().await;
    let careless = layer(pg.store.clone()).layer(handler(|tx: PgTx| async move {
        tx.execute(
            "INSERT INTO orders (id, tenant_id) VALUES ('dup', 'tenant-a')",
            &[],
        )
        .await?;
        // A unique violation aborts the transaction; the handler ignores it.
        let _ = tx
            .execute(
                "INSERT INTO orders (id, tenant_id) VALUES ('dup', 'tenant-a')",
                &[],
            )
            .await;
        Ok(created("{}"))
    }));
    let answer = send(careless, tenant_a_post("k1")).await;
    // Not "unavailable": a retry runs into the same handler bug.
    assert_eq!(answer.status, StatusCode::INTERNAL_SERVER_ERROR);
    assert_eq!(answer.json()["code"], "commit_rejected");
    assert!(answer.headers.get("retry-after").is_none());
    assert!(pg.orders().await.is_empty());
    assert!(pg.records().await.is_empty(), "the key stays free");
    let working = layer(pg.store.clone()).layer(order_handler::<Postgres>(Default::default()));
    assert_eq!(
        send(working, tenant_a_post("k1")).await.status,
        StatusCode::CREATED
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn transaction_control_through_the_handle_is_refused() {
    let pg = Postgres::new().await;
    let (seen_tx, seen_rx) = Report::channel();
    let service = layer(pg.store.clone()).layer(handler(move |tx: PgTx| {
        let seen_tx = seen_tx.clone();
        async move {
            tx.execute(
                "INSERT INTO orders (id, tenant_id) VALUES ('o1', 'tenant-a')",
                &[],
            )
            .await?;
            let commit = tx.batch_execute("COMMIT").await.map_err(|e| e.kind());
            let hidden_commit = tx
                .execute("/* done */ COMMIT;", &[])
                .await
                .map(|_| ())
                .map_err(|e| e.kind());
            let session_set = tx
                .batch_execute("SET default_transaction_read_only = on")
                .await
                .map_err(|e| e.kind());
            let savepoint = tx
                .batch_execute("SAVEPOINT s1; RELEASE SAVEPOINT s1")
                .await
                .map_err(|e| e.kind());
            let quoted = tx
                .execute(
                    "INSERT INTO orders (id, tenant_id) VALUES ('done; commit', 'tenant-a')",
                    &[],
                )
                .await
                .map(|_| ())
                .map_err(|e| e.kind());
            let seen = (commit, hidden_commit, session_set, savepoint, quoted);
            seen_tx.send(seen);
            Ok(created("{}"))
        }
    }));
    assert_eq!(
        send(service, tenant_a_post("k1")).await.status,
        StatusCode::CREATED
    );
    let (commit, hidden_commit, session_set, savepoint, quoted) = seen_rx.await.unwrap();
    assert_eq!(commit, Err(TxErrorKind::TransactionControl));
    assert_eq!(hidden_commit, Err(TxErrorKind::TransactionControl));
    assert_eq!(session_set, Err(TxErrorKind::SessionState));
    assert_eq!(savepoint, Ok(()));
    assert_eq!(
        quoted,
        Ok(()),
        "a semicolon inside a string is not a statement boundary"
    );
    assert_eq!(pg.orders().await.len(), 2);
    assert_eq!(pg.records().await[0].2, "completed");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn unreachable_database_answers_503_and_writes_nothing() {
    let store = unreachable_store(Duration::from_millis(200));
    let calls = Arc::new(std::sync::atomic::AtomicU64::new(0));
    let service = layer(store).layer(order_handler::<Postgres>(calls.clone()));
    let answer = send(service, tenant_a_post("k1")).await;
    assert_eq!(answer.status, StatusCode::SERVICE_UNAVAILABLE);
    assert_eq!(answer.json()["code"], "store_unavailable");
    assert_eq!(answer.headers["retry-after"], "1");
    assert_eq!(calls.load(std::sync::atomic::Ordering::SeqCst), 0);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn exhausted_pool_answers_503_without_touching_other_keys() {
    let pg = Postgres::with_store(|builder| {
        builder
            .max_connections(1)
            .acquire_timeout(Duration::from_millis(100))
    })
    .await;
    let (started, release) = (Arc::new(Notify::new()), Arc::new(Notify::new()));
    let service = layer(pg.store.clone()).layer(handler({
        let (started, release) = (started.clone(), release.clone());
        move |_tx: PgTx| {
            let (started, release) = (started.clone(), release.clone());
            async move {
                started.notify_one();
                release.notified().await;
                Ok(created("{\"first\":true}"))
            }
        }
    }));
    let holder = spawn_send(service.clone(), tenant_a_post("k1"));
    started.notified().await;
    let starved = send(service.clone(), tenant_a_post("k2")).await;
    assert_eq!(starved.status, StatusCode::SERVICE_UNAVAILABLE);
    assert_eq!(starved.json()["code"], "store_unavailable");
    release.notify_one();
    assert_eq!(holder.await.unwrap().status, StatusCode::CREATED);
    let keys: Vec<String> = pg
        .column("SELECT idempotency_key FROM idempotency_requests")
        .await;
    assert_eq!(keys, ["k1"], "the starved request left no row");
}

/// A claim future dropped mid-flight (here: while it waits on the owner's
/// row lock) must not hand its open transaction to the next request.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn cancelled_claim_never_leaks_its_transaction() {
    use tower_idempotency::store::{Claim, Store};
    let pg = Postgres::with_pool(2).await;
    let store = pg.store.clone();
    let request = |key: &str| claim_request(key, Duration::from_secs(30));
    let Ok(Claim::Owned(owner)) = store.claim(&request("k")).await else {
        panic!("owner")
    };
    let cancelled =
        tokio::time::timeout(Duration::from_millis(200), store.claim(&request("k"))).await;
    assert!(
        cancelled.is_err(),
        "the second claim was still waiting when it was dropped"
    );
    store.abort(owner).await.unwrap();
    let response = stored(b"x");
    for key in ["x1", "x2", "x3"] {
        let Ok(Claim::Owned(tx)) = store.claim(&request(key)).await else {
            panic!("{key}")
        };
        store.complete(tx, &response).await.unwrap();
    }
    let keys: Vec<(String, String, String, Option<i16>)> = pg.records().await;
    let keys: Vec<(&str, &str)> = keys
        .iter()
        .map(|(_, k, state, _)| (k.as_str(), state.as_str()))
        .collect();
    assert_eq!(
        keys,
        [
            ("x1", "completed"),
            ("x2", "completed"),
            ("x3", "completed")
        ],
        "no orphan claim committed"
    );
}

/// Duplicates of a hot key wait in the process, not on pooled connections:
/// other keys keep being served by a small pool.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn hot_key_duplicates_do_not_starve_other_keys() {
    let pg = Postgres::with_pool(2).await;
    let (started, release) = (Arc::new(Notify::new()), Arc::new(Notify::new()));
    let hot_service =
        layer(pg.store.clone()).layer(gated::<Postgres>(started.clone(), release.clone()));
    let first = spawn_send(hot_service.clone(), tenant_a_post("hot"));
    started.notified().await;
    let duplicates: Vec<_> = (0..10)
        .map(|_| spawn_send(hot_service.clone(), tenant_a_post("hot")))
        .collect();
    let cold_service = layer(pg.store.clone()).layer(order_handler::<Postgres>(Default::default()));
    let cold = send(cold_service, tenant_a_post("cold")).await;
    assert_eq!(
        cold.status,
        StatusCode::CREATED,
        "a cold key is served while the hot one is held"
    );
    release.notify_one();
    let first = first.await.unwrap();
    for duplicate in duplicates {
        let duplicate = duplicate.await.unwrap();
        assert!(duplicate.replayed());
        assert_eq!(duplicate.body, first.body);
    }
    assert_eq!(pg.orders().await.len(), 2);
}

/// The wait limit bounds the claim only: the handler runs under the
/// session's own lock_timeout.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn handler_statements_are_not_bound_by_the_duplicate_wait() {
    let pg = Postgres::new().await;
    // The database's own default for its sessions.
    let store = pg.store_with_database_setting("lock_timeout", "7s").await;
    let (seen_tx, seen_rx) = Report::channel();
    let service = layer(store)
        .wait(WAIT_SHORT)
        .layer(handler(move |tx: PgTx| {
            let seen_tx = seen_tx.clone();
            async move {
                let row = tx
                    .query_one("SELECT current_setting('lock_timeout')", &[])
                    .await?;
                seen_tx.send(row.get::<_, String>(0));
                Ok(created("{}"))
            }
        }));
    assert_eq!(
        send(service, tenant_a_post("k1")).await.status,
        StatusCode::CREATED
    );
    assert_eq!(
        seen_rx.await.unwrap(),
        "7s",
        "the session's default, not the 200ms wait"
    );
}

/// A lock on the whole key table (a migration building an index, say) is
/// waited for no longer than the duplicate wait, like a row lock.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn table_lock_is_bounded_by_the_wait() {
    let pg = Postgres::new().await;
    let mut blocker = pg.db.client().await;
    let lock = blocker.transaction().await.unwrap();
    lock.batch_execute("LOCK TABLE idempotency_requests IN SHARE MODE")
        .await
        .unwrap();
    let service = layer(pg.store.clone())
        .wait(WAIT_SHORT)
        .layer(order_handler::<Postgres>(Default::default()));
    let answer = tokio::time::timeout(
        Duration::from_secs(10),
        send(service.clone(), tenant_a_post("k1")),
    )
    .await
    .expect("the claim gave up after its wait");
    assert_eq!(answer.json()["code"], "idempotency_in_progress");
    lock.rollback().await.unwrap();
    assert_eq!(
        send(service, tenant_a_post("k1")).await.status,
        StatusCode::CREATED
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_wait_beyond_postgres_limit_is_clamped() {
    let pg = Postgres::new().await;
    let service = layer(pg.store.clone())
        .wait(Duration::from_secs(60 * 86_400))
        .retention(Duration::from_secs(u64::MAX / 4))
        .layer(order_handler::<Postgres>(Default::default()));
    assert_eq!(
        send(service, tenant_a_post("k1")).await.status,
        StatusCode::CREATED
    );
    assert_eq!(pg.orders().await.len(), 1);
}

/// When the request that led a hot key rolls back, one of its waiting
/// duplicates leads next; the others keep waiting without connections.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn duplicates_of_a_rolled_back_leader_do_not_stampede() {
    let pg = Postgres::with_store(|builder| {
        builder
            .max_connections(3)
            .acquire_timeout(Duration::from_millis(500))
    })
    .await;
    let store = pg.store.clone();
    let calls = Arc::new(std::sync::atomic::AtomicUsize::new(0));
    let gates: Arc<[Notify; 4]> = Arc::new(Default::default());
    // gates: 0 first call started, 1 let it fail, 2 second call started, 3 let it succeed
    let service = layer(store.clone()).layer(handler({
        let (calls, gates) = (calls.clone(), gates.clone());
        move |tx: PgTx| {
            let (calls, gates) = (calls.clone(), gates.clone());
            async move {
                match calls.fetch_add(1, std::sync::atomic::Ordering::SeqCst) {
                    0 => {
                        gates[0].notify_one();
                        gates[1].notified().await;
                        Ok(response(StatusCode::BAD_GATEWAY, ""))
                    }
                    1 => {
                        tx.execute(
                            "INSERT INTO orders (id, tenant_id) VALUES ('second', 'tenant-a')",
                            &[],
                        )
                        .await?;
                        gates[2].notify_one();
                        gates[3].notified().await;
                        Ok(created("{\"id\":\"second\"}"))
                    }
                    n => Err(format!("the handler ran a {}th time", n + 1).into()),
                }
            }
        }
    }));
    let leader = spawn_send(service.clone(), tenant_a_post("hot"));
    gates[0].notified().await;
    let duplicates: Vec<_> = (0..7)
        .map(|_| spawn_send(service.clone(), tenant_a_post("hot")))
        .collect();
    // Let the duplicates line up behind the leader before it fails.
    tokio::task::yield_now().await;
    gates[1].notify_one();
    assert_eq!(leader.await.unwrap().status, StatusCode::BAD_GATEWAY);
    gates[2].notified().await;
    let other = layer(store.clone()).layer(order_handler::<Postgres>(Default::default()));
    let unrelated = send(other, tenant_a_post("cold")).await;
    assert_eq!(
        unrelated.status,
        StatusCode::CREATED,
        "a small pool still serves other keys"
    );
    gates[3].notify_one();
    let mut statuses = Vec::new();
    for duplicate in duplicates {
        let answer = duplicate.await.unwrap();
        statuses.push((answer.status, answer.replayed()));
    }
    assert_eq!(
        statuses
            .iter()
            .filter(|(s, r)| *s == StatusCode::CREATED && !r)
            .count(),
        1,
        "{statuses:?}"
    );
    assert_eq!(
        statuses
            .iter()
            .filter(|(s, r)| *s == StatusCode::CREATED && *r)
            .count(),
        6,
        "{statuses:?}"
    );
    assert_eq!(calls.load(std::sync::atomic::Ordering::SeqCst), 2);
}

/// After the server closed the pool's connections (a restart, a failover),
/// the next request is served, not answered 503.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn connections_the_server_closed_are_replaced_transparently() {
    let pg = Postgres::with_pool(1).await;
    let service = layer(pg.store.clone()).layer(order_handler::<Postgres>(Default::default()));
    served_after_the_server_closed_its_connections(&pg, service).await;
}

/// The same in the one-commit mode, whose transaction begins with the
/// handler's first statement: that statement meets the dead connection.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn connections_the_server_closed_are_replaced_transparently_in_the_one_commit_mode() {
    let pg = Postgres::with_pool(1).await;
    let service = layer(pg.store.clone())
        .claim_at_commit()
        .layer(order_handler::<Postgres>(Default::default()));
    served_after_the_server_closed_its_connections(&pg, service).await;
}

/// Four creates, the pool's one connection terminated by the server before
/// each of the last three: every one is `201`, four orders.
async fn served_after_the_server_closed_its_connections<S, B>(pg: &Postgres, service: S)
where
    S: tower::Service<
            http::Request<http_body_util::Full<bytes::Bytes>>,
            Response = http::Response<tower_idempotency::ResponseBody<B>>,
        > + Clone
        + Send,
    S::Future: Send,
    S::Error: std::fmt::Debug,
    B: http_body::Body<Data = bytes::Bytes> + Send + 'static,
    B::Error: Into<conformance::BoxError>,
{
    assert_eq!(
        send(service.clone(), tenant_a_post("k1")).await.status,
        StatusCode::CREATED
    );
    for round in 2..5 {
        let terminated: Vec<i32> = pg
            .column(
                "WITH others AS MATERIALIZED (SELECT pid FROM pg_stat_activity \
                     WHERE datname = current_database() AND pid <> pg_backend_pid()) \
                 SELECT pid FROM others WHERE pg_terminate_backend(pid)",
            )
            .await;
        assert_eq!(
            terminated.len(),
            1,
            "the pool's one connection was closed by the server"
        );
        // Termination is a signal: wait until that backend is gone, so that
        // the next round counts only the pool's new connection.
        let deadline = tokio::time::Instant::now() + Duration::from_secs(10);
        while pg
            .client
            .query_one(
                "SELECT count(*) FROM pg_stat_activity WHERE pid = $1",
                &[&terminated[0]],
            )
            .await
            .unwrap()
            .get::<_, i64>(0)
            > 0
        {
            assert!(
                tokio::time::Instant::now() < deadline,
                "the backend never exited"
            );
            tokio::time::sleep(Duration::from_millis(10)).await;
        }
        let answer = send(service.clone(), tenant_a_post(&format!("k{round}"))).await;
        assert_eq!(
            answer.status,
            StatusCode::CREATED,
            "round {round}: {:?}",
            answer.body
        );
    }
    assert_eq!(pg.orders().await.len(), 4);
}

// The replay cache.

/// A retry of a record this process committed is answered from memory: the
/// row deleted behind the layer's back proves the database was not asked.
/// A different request and another tenant are not answered from it.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn replay_cache_answers_a_retry_from_memory_within_its_scope() {
    let pg = Postgres::new().await;
    let service = layer(pg.store.clone()).layer(order_handler::<Postgres>(Default::default()));
    let first = send(service.clone(), tenant_a_post("k1")).await;
    pg.exec("DELETE FROM idempotency_requests").await;
    let replay = send(service.clone(), tenant_a_post("k1")).await;
    assert!(replay.replayed());
    assert_eq!(replay.body, first.body);
    assert_eq!(pg.orders().await.len(), 1);
    let other = send(
        service.clone(),
        post(
            Some("tenant-a"),
            Some("k1"),
            r#"{"checkout_id":"chk_2","amount":1}"#,
        ),
    )
    .await;
    assert_eq!(other.json()["code"], "idempotency_key_reused");
    let tenant_b = send(service, post(Some("tenant-b"), Some("k1"), BODY)).await;
    assert!(
        !tenant_b.replayed(),
        "another tenant's key is its own operation"
    );
    assert_eq!(pg.orders().await.len(), 2);

    // Without the cache the same retry reads the store, which has no record.
    let pg = Postgres::new().await;
    let service = layer(pg.store.clone())
        .without_replay_cache()
        .layer(order_handler::<Postgres>(Default::default()));
    send(service.clone(), tenant_a_post("k1")).await;
    pg.exec("DELETE FROM idempotency_requests").await;
    assert!(!send(service, tenant_a_post("k1")).await.replayed());
    assert_eq!(pg.orders().await.len(), 2);
}

/// A cached record never outlives its retention: once it ends, the key is
/// a new operation even though the cache's own TTL is far off.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn replay_cache_never_outlives_the_retention() {
    let pg = Postgres::new().await;
    // The retention a layer keeps at the least: the handler's deadline
    // plus 5 s (see `retention`).
    let deadline = Duration::from_millis(100);
    let service = layer(pg.store.clone())
        .handler_timeout(deadline)
        .retention(Duration::from_millis(600))
        .replay_cache(tower_idempotency::ReplayCache::default().ttl(Duration::from_secs(3600)))
        .layer(order_handler::<Postgres>(Default::default()));
    send(service.clone(), tenant_a_post("k1")).await;
    assert!(send(service.clone(), tenant_a_post("k1")).await.replayed());
    // The retention passes (the behaviour under test is time itself).
    tokio::time::sleep(deadline + Duration::from_millis(5300)).await;
    let after = send(service, tenant_a_post("k1")).await;
    assert!(!after.replayed(), "expired: a new operation");
    assert_eq!(pg.orders().await.len(), 2);
}

/// What an operator's `remove_key` means with a cache: the process that
/// cached the record replays it until the cache's TTL, then the key is a
/// new operation.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_removed_key_leaves_a_caching_process_after_the_ttl() {
    let pg = Postgres::new().await;
    let service = layer(pg.store.clone())
        .replay_cache(tower_idempotency::ReplayCache::default().ttl(Duration::from_millis(400)))
        .layer(order_handler::<Postgres>(Default::default()));
    send(service.clone(), tenant_a_post("k1")).await;
    let scope = tower_idempotency::scope::Scope::new(
        tower_idempotency::scope::TenantId::new("tenant-a"),
        "POST /orders v1",
    );
    let key = tower_idempotency::key::IdempotencyKey::parse(b"k1").unwrap();
    assert!(pg.store.remove_key(&scope, &key, "test").await.unwrap());
    assert!(
        send(service.clone(), tenant_a_post("k1")).await.replayed(),
        "still cached here"
    );
    tokio::time::sleep(Duration::from_millis(500)).await;
    assert!(!send(service, tenant_a_post("k1")).await.replayed());
    assert_eq!(pg.orders().await.len(), 2);
}

/// A duplicate that waits out its wait on the owner's row answers in
/// progress and gives its connection back to the pool: a lock wait that ran
/// out is no broken connection, to be closed and replaced.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_duplicate_that_waits_out_its_wait_keeps_its_connection() {
    use tower_idempotency::store::{Claim, Store};
    let pg = Postgres::with_pool(2).await;
    let store = pg.store.clone();
    let Ok(Claim::Owned(held)) = store
        .claim(&claim_request("held", Duration::from_secs(2)))
        .await
    else {
        panic!("a new key is owned")
    };
    // The pool's second connection, used once and idle again.
    let Ok(Claim::Owned(other)) = store
        .claim(&claim_request("other", Duration::from_secs(2)))
        .await
    else {
        panic!("a new key is owned")
    };
    store.abort(other).await.unwrap();
    // The pool's own count: `PgStore { max_connections: 2, connections: N, … }`.
    let pooled = |store: &PgStore| format!("{store:?}");
    assert!(pooled(&store).contains(" connections: 2,"), "{store:?}");
    let duplicate = claim_request("held", Duration::from_millis(200));
    assert!(matches!(
        store.claim(&duplicate).await,
        Ok(Claim::InProgress)
    ));
    assert!(
        pooled(&store).contains(" connections: 2,"),
        "the duplicate's connection was closed: {store:?}"
    );
    store.abort(held).await.unwrap();
}

/// An acquire that waits out its wait on a row another transaction holds
/// (a takeover of an expired lease, behind an operator's lock) answers in
/// progress and gives its connection back to the pool.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_acquire_that_waits_out_its_wait_keeps_its_connection() {
    use tower_idempotency::{
        lease::OperationId,
        store::{Acquired, Claim, LeaseRequest, LeaseStore, Store, StoredRequest},
    };
    let pg = Postgres::with_pool(2).await;
    let store = pg.store.clone();
    let lease = |millis| {
        LeaseRequest::new(
            Duration::from_millis(millis),
            OperationId::random(),
            StoredRequest::new(http::Method::POST, "/x", vec![], bytes::Bytes::new()),
        )
    };
    let claim = claim_request("op", Duration::from_millis(200));
    let Ok(Acquired::Owned(_dead)) = store.acquire(&claim, &lease(100)).await else {
        panic!("a new operation is owned")
    };
    // The pool's second connection, used once and idle again.
    let Ok(Claim::Owned(held)) = store
        .claim(&claim_request("other", Duration::from_secs(2)))
        .await
    else {
        panic!("a new key is owned")
    };
    let Ok(Claim::Owned(other)) = store
        .claim(&claim_request("another", Duration::from_secs(2)))
        .await
    else {
        panic!("a new key is owned")
    };
    store.abort(other).await.unwrap();
    store.abort(held).await.unwrap();
    let mut locker = pg.db.client().await;
    let lock = locker.transaction().await.unwrap();
    lock.execute(
        "SELECT 1 FROM idempotency_requests WHERE idempotency_key = 'op' FOR SHARE",
        &[],
    )
    .await
    .unwrap();
    pg.exec("SELECT pg_sleep(0.2)").await;
    let pooled = |store: &PgStore| format!("{store:?}");
    assert!(pooled(&store).contains(" connections: 2,"), "{store:?}");
    let second = store.acquire(&claim, &lease(300)).await;
    assert!(matches!(second, Ok(Acquired::InProgress)), "{second:?}");
    assert!(
        pooled(&store).contains(" connections: 2,"),
        "the acquire's connection was closed: {store:?}"
    );
    lock.rollback().await.unwrap();
}

/// Migration 2 stores large bodies compressed with lz4 (on a server built
/// with it, as this one is), and what is stored reads back the same.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn stored_bodies_are_compressed_with_lz4() {
    let pg = Postgres::new().await;
    let methods: Vec<String> = pg
        .column(
            "SELECT attname || '=' || attcompression::text FROM pg_attribute \
             WHERE attrelid = 'idempotency_requests'::regclass \
               AND attname IN ('request_body', 'response_body') ORDER BY attname",
        )
        .await;
    assert_eq!(methods, ["request_body=l", "response_body=l"]);
    // A 64 KB answer goes to TOAST compressed with lz4 and comes back whole.
    let body: String = (0..2000)
        .map(|i| format!("{{\"sku\":\"SKU-{i}\",\"n\":2}},"))
        .collect();
    pg.exec(&format!(
        "INSERT INTO idempotency_requests (tenant_id, endpoint, idempotency_key, request_fingerprint, \
         state, response_status, response_headers, response_body, completed_at, expires_at) \
         VALUES ('t', 'e', 'big', '\\x00', 'completed', 201, '', convert_to('{body}', 'UTF8'), now(), \
         now() + interval '1 day')"
    ))
    .await;
    let row = pg
        .row(
            "SELECT pg_column_compression(response_body), octet_length(response_body), \
             pg_column_size(response_body) FROM idempotency_requests WHERE idempotency_key = 'big'",
        )
        .await;
    assert_eq!(row.get::<_, Option<String>>(0).as_deref(), Some("lz4"));
    assert_eq!(row.get::<_, i32>(1) as usize, body.len());
    assert!(
        row.get::<_, i32>(2) < row.get::<_, i32>(1) / 4,
        "compressed"
    );
}
