//! Everything the crate sends, through PgBouncer in transaction pooling mode
//! (a server connection belongs to a client for one transaction only), with
//! a server pool smaller than the application's: claims and replays under 50
//! concurrent duplicates, the outbox relay, the long-running mode and its
//! recovery, retention cleanup, the operator API and migrations. Every test
//! asserts on rows read directly, not through the pooler.

use crate::common;

/// The example server's contract through PgBouncer (a server pool of 4
/// under the server's pool of 32).
mod order_server {
    use tower_idempotency::testing::TestDatabase;

    use crate::common::{
        example_binary::{both_modes, Mode},
        pgbouncer::PgBouncer,
    };
    use crate::server_contract::keeps_its_contract;

    async fn the_order_server_keeps_its_contract_through_pgbouncer(mode: Mode) {
        let db = TestDatabase::create().await;
        let bouncer = PgBouncer::start(&db.config());
        keeps_its_contract(&db, &[bouncer.url(db.name())], mode).await;
        drop(bouncer);
    }

    both_modes!(the_order_server_keeps_its_contract_through_pgbouncer);
}

use std::{
    sync::{
        atomic::{AtomicBool, AtomicU64, Ordering},
        Arc,
    },
    time::Duration,
};

use bytes::Bytes;
use common::{pgbouncer::PgBouncer, *};
use http::{Request, Response, StatusCode};
use http_body_util::Full;
use serde_json::json;
use tokio::sync::Barrier;
use tower::Layer;
use tower_idempotency::{
    fingerprint::JsonFingerprinter,
    key::IdempotencyKey,
    lease::{LeaseConfig, OperationId},
    outbox::{self, DeliveryError, OutboxEvent, Relay, Sink},
    postgres::{KeyState, PgLease, PgStore, PgStoreBuilder, PgTx},
    retention::Cleanup,
    scope::{Scope, TenantId},
    sqlx::{SqlxStore, SqlxTx},
    store::{Acquired, ClaimRequest, LeaseRequest, LeaseStore, StoredRequest},
    testing::TestDatabase,
    IdempotencyLayer, RequestBody,
};

/// The application's pool: larger than PgBouncer's server pool, so that
/// clients really share server connections.
const APP_POOL: usize = 16;

/// A test database, PgBouncer in front of it, a store that reaches the
/// database only through PgBouncer, and a direct client for assertions.
struct Pooled {
    pg: Postgres,
    /// Runs as long as the store needs it.
    _bouncer: PgBouncer,
}

impl Pooled {
    async fn new() -> Self {
        Self::with_store(|builder| builder).await
    }

    async fn with_store(configure: impl FnOnce(PgStoreBuilder) -> PgStoreBuilder) -> Self {
        let db = TestDatabase::create().await;
        let bouncer = PgBouncer::start(&db.config());
        let store = pooled_store(&bouncer, &db, configure);
        store
            .migrate()
            .await
            .expect("migrations apply through the pooler");
        let client = db.client().await;
        client
            .batch_execute(
                "CREATE TABLE orders (id text PRIMARY KEY, tenant_id text NOT NULL); \
                 CREATE TABLE charges (idempotency_key text PRIMARY KEY, order_id text NOT NULL)",
            )
            .await
            .expect("tables");
        Pooled {
            pg: Postgres { db, store, client },
            _bouncer: bouncer,
        }
    }

    fn store(&self) -> PgStore {
        self.pg.store.clone()
    }
}

/// A store on `db` through `bouncer`, set up for a transaction pooler.
fn pooled_store(
    bouncer: &PgBouncer,
    db: &TestDatabase,
    configure: impl FnOnce(PgStoreBuilder) -> PgStoreBuilder,
) -> PgStore {
    configure(
        PgStore::builder(bouncer.config(db.name()))
            .max_connections(APP_POOL)
            .transaction_pooling(true),
    )
    .build()
    .expect("store builds")
}

/// A store that opens its own connections through a PgBouncer in session
/// pooling mode, which refuses the `options` startup parameter or drops it
/// unread: the first connection is opened again without it (or starts
/// without the limit), the hold limit is set with `SET` on every
/// connection instead, and the reset after each owner sets it again. Both
/// modes work, with the limit in place after a function took it away.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_session_pooler_that_does_not_pass_options_gets_the_hold_limit_set() {
    use common::pgbouncer::Pooling;
    const LIMIT: &str = "SELECT pg_backend_pid(), setting || ' ' || source \
         FROM pg_settings WHERE name = 'idle_in_transaction_session_timeout'";
    for pooling in [
        Pooling::SessionRefusingOptions,
        Pooling::SessionIgnoringOptions,
    ] {
        let db = TestDatabase::create().await;
        let bouncer = PgBouncer::start_with(&db.config(), pooling);
        let store = PgStore::builder(bouncer.config(db.name()))
            .max_connections(1)
            .build()
            .expect("store builds");
        store.migrate().await.expect("migrations apply");
        let client = db.client().await;
        client
            .batch_execute(
                "CREATE TABLE orders (id text PRIMARY KEY, tenant_id text NOT NULL); \
                 CREATE FUNCTION unlimit() RETURNS text LANGUAGE sql AS \
                 $$ SELECT set_config('idle_in_transaction_session_timeout', '0', false) $$",
            )
            .await
            .expect("tables");
        let borrowed = || async {
            let conn = store.client().await.expect("a connection");
            let row = conn.query_one(LIMIT, &[]).await.expect("the limit");
            (row.get::<_, i32>(0), row.get::<_, String>(1))
        };
        let (pid, seen) = borrowed().await;
        assert_eq!(
            seen, "35000 session",
            "{pooling:?}: set, not from the start"
        );
        for (i, one_commit) in [false, true].into_iter().enumerate() {
            let handler = handler(|tx: PgTx| async move {
                tx.execute(
                    "INSERT INTO orders (id, tenant_id) VALUES ($1, $2)",
                    &[&new_order_id(), &tx.tenant()],
                )
                .await?;
                tx.query_one("SELECT unlimit()", &[]).await?;
                Ok(created("{}"))
            });
            let layer = layer(store.clone());
            let key = format!("k{i}");
            let answer = if one_commit {
                send(layer.claim_at_commit().layer(handler), tenant_a_post(&key)).await
            } else {
                send(layer.layer(handler), tenant_a_post(&key)).await
            };
            assert_eq!(
                answer.status,
                StatusCode::CREATED,
                "{:?}: {:?}",
                pooling,
                answer.body
            );
            assert_eq!(
                borrowed().await,
                (pid, "35000 session".to_owned()),
                "{pooling:?}, one-commit {one_commit}: the reset set it again"
            );
        }
        let orders: i64 = client
            .query_one("SELECT count(*) FROM orders", &[])
            .await
            .unwrap()
            .get(0);
        let completed: i64 = client
            .query_one(
                "SELECT count(*) FROM idempotency_requests WHERE state = 'completed'",
                &[],
            )
            .await
            .unwrap()
            .get(0);
        assert_eq!((orders, completed), (2, 2), "{pooling:?}");
        drop(bouncer);
    }
}

/// The order handler: an order row and its outbox event, through the layer's
/// transaction.
fn ordering(calls: Arc<AtomicU64>) -> Handler {
    handler(move |tx: PgTx| {
        let calls = calls.clone();
        async move {
            calls.fetch_add(1, Ordering::SeqCst);
            let id = new_order_id();
            tx.execute(
                "INSERT INTO orders (id, tenant_id) VALUES ($1, $2)",
                &[&id, &tx.tenant()],
            )
            .await?;
            outbox::enqueue(&tx, &id, "OrderCreated", &json!({"order_id": id})).await?;
            Ok(created(id))
        }
    })
}

// Each start waits at the barrier, then hands back the spawned request.
#[allow(clippy::async_yields_async)]
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn fifty_concurrent_duplicates_through_the_pooler_commit_once_and_never_503() {
    let pooled = Pooled::new().await;
    let calls = Arc::new(AtomicU64::new(0));
    let service = layer(pooled.store()).layer(ordering(calls.clone()));
    // Warm the pool: rounds of concurrent requests, so that every
    // application connection has been used before, through whichever of
    // PgBouncer's few server connections it got each time (a statement
    // cache would now be full, and wrong for the next server).
    for round in 0..3 {
        let warm: Vec<_> = (0..APP_POOL)
            .map(|i| spawn_send(service.clone(), tenant_a_post(&format!("warm-{round}-{i}"))))
            .collect();
        for answer in warm {
            let answer = answer.await.unwrap();
            assert_eq!(answer.status, StatusCode::CREATED, "{}", text(&answer));
        }
    }
    let barrier = Arc::new(Barrier::new(50));
    let tasks: Vec<_> = (0..50)
        .map(|_| {
            let (service, barrier) = (service.clone(), barrier.clone());
            // Hands back the spawned request once all 50 are lined up.
            tokio::spawn(async move {
                barrier.wait().await;
                spawn_send(service, tenant_a_post("key-50"))
            })
        })
        .collect();
    let mut answers = Vec::new();
    for task in tasks {
        answers.push(task.await.unwrap().await.unwrap());
    }
    let statuses: Vec<_> = answers.iter().map(|a| a.status).collect();
    for answer in &answers {
        assert_eq!(
            answer.status,
            StatusCode::CREATED,
            "every duplicate is answered 201, first or replayed, never 503: {statuses:?}\n{}",
            text(answer)
        );
    }
    let first: Vec<_> = answers.iter().filter(|a| !a.replayed()).collect();
    assert_eq!(first.len(), 1, "one original answer: {statuses:?}");
    for answer in answers.iter().filter(|a| a.replayed()) {
        assert_eq!(
            answer.body, first[0].body,
            "a replay carries the first body"
        );
    }
    let pg = &pooled.pg;
    assert_eq!(calls.load(Ordering::SeqCst), 3 * APP_POOL as u64 + 1);
    assert_eq!(
        pg.count("SELECT count(*) FROM idempotency_requests WHERE idempotency_key = 'key-50'")
            .await,
        1,
        "one key row"
    );
    let order: Vec<u8> = pg
        .value("SELECT response_body FROM idempotency_requests WHERE idempotency_key = 'key-50'")
        .await;
    let order = String::from_utf8(order).unwrap();
    assert_eq!(
        pg.count(&format!("SELECT count(*) FROM orders WHERE id = '{order}'"))
            .await,
        1,
        "one order row for the key"
    );
    assert_eq!(
        pg.count("SELECT count(*) FROM orders").await,
        3 * APP_POOL as i64 + 1
    );
    assert_eq!(
        pg.idle_in_transaction().await,
        0,
        "no transaction left open"
    );
}

/// An answer's body, for assertion messages.
fn text(answer: &Answer) -> String {
    String::from_utf8_lossy(&answer.body).into_owned()
}

/// A payment provider keyed by the derived key (one `charges` row per key),
/// reached through the store's pool, that is through the pooler.
#[derive(Clone)]
struct Payments {
    store: PgStore,
}

impl Sink for Payments {
    async fn deliver(&self, event: &OutboxEvent) -> Result<(), DeliveryError> {
        let key = event.derived_key("payment.charge");
        let client = self
            .store
            .client()
            .await
            .map_err(|e| DeliveryError::retryable(e.to_string()))?;
        // Typed: one unnamed statement, which a transaction pooler keeps.
        client
            .execute_typed(
                "INSERT INTO charges (idempotency_key, order_id) VALUES ($1, $2) \
                 ON CONFLICT (idempotency_key) DO NOTHING",
                &[
                    (&key, tokio_postgres::types::Type::TEXT),
                    (&event.aggregate_id, tokio_postgres::types::Type::TEXT),
                ],
            )
            .await
            .map_err(|e| DeliveryError::retryable(e.to_string()))?;
        Ok(())
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_outbox_relay_delivers_through_the_pooler() {
    let pooled = Pooled::new().await;
    let service = layer(pooled.store()).layer(ordering(Default::default()));
    for i in 0..20 {
        let answer = send(service.clone(), tenant_a_post(&format!("k{i}"))).await;
        assert_eq!(answer.status, StatusCode::CREATED, "{}", text(&answer));
    }
    let payments = Payments {
        store: pooled.store(),
    };
    // Several relays at once, in small batches: their transactions share
    // PgBouncer's few server connections.
    let relays: Vec<_> = (0..3)
        .map(|_| {
            let relay = Relay::new(pooled.store(), payments.clone()).batch_size(3);
            tokio::spawn(async move {
                let mut delivered = 0;
                loop {
                    let report = relay.run_once().await.expect("a batch through the pooler");
                    delivered += report.delivered;
                    if report.claimed == 0 {
                        return delivered;
                    }
                }
            })
        })
        .collect();
    let mut delivered = 0;
    for relay in relays {
        delivered += relay.await.unwrap();
    }
    assert_eq!(delivered, 20);
    let pg = &pooled.pg;
    assert_eq!(
        pg.count(
            "SELECT count(*) FROM outbox_events WHERE published_at IS NOT NULL AND attempts = 1"
        )
        .await,
        20
    );
    assert_eq!(
        pg.count("SELECT count(*) FROM charges c JOIN orders o ON o.id = c.order_id")
            .await,
        20,
        "one charge per order"
    );
    let relay = Relay::new(pooled.store(), payments);
    let status = relay
        .refresh_backlog()
        .await
        .expect("the backlog through the pooler");
    assert_eq!(status.backlog, 0);
    // The running relay (its wake-up listener cannot work through a
    // transaction pooler) still delivers by polling.
    let (stop, stopped) = tokio::sync::oneshot::channel::<()>();
    let running = tokio::spawn(async move {
        let relay = relay.poll_interval(Duration::from_millis(50));
        relay.run(async { drop(stopped.await) }).await
    });
    let answer = send(service.clone(), tenant_a_post("late")).await;
    assert_eq!(answer.status, StatusCode::CREATED);
    let deadline = tokio::time::Instant::now() + Duration::from_secs(10);
    while pg.count("SELECT count(*) FROM charges").await < 21 {
        assert!(
            tokio::time::Instant::now() < deadline,
            "the late event was never delivered"
        );
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
    stop.send(()).unwrap();
    running.await.unwrap().unwrap();
    assert_eq!(pg.idle_in_transaction().await, 0);
}

const LEASE: Duration = Duration::from_millis(600);

/// A long-running handler: one order through a fenced transaction.
fn fenced_orders(calls: Arc<AtomicU64>) -> Handler {
    tower::util::BoxCloneService::new(tower::service_fn(move |request: Request<RequestBody>| {
        let calls = calls.clone();
        async move {
            calls.fetch_add(1, Ordering::SeqCst);
            let lease = request
                .extensions()
                .get::<PgLease>()
                .cloned()
                .ok_or("no lease")?;
            let id = new_order_id();
            let tx = lease.transaction().await?;
            tx.execute(
                "INSERT INTO orders (id, tenant_id) VALUES ($1, $2)",
                &[&id, &lease.tenant()],
            )
            .await?;
            tx.commit().await?;
            Ok::<_, BoxError>(
                Response::builder()
                    .status(StatusCode::CREATED)
                    .header("content-type", "application/json")
                    .body(Full::new(Bytes::from(format!(r#"{{"id":"{id}"}}"#))))
                    .unwrap(),
            )
        }
    }))
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_long_running_mode_works_through_the_pooler() {
    let pooled = Pooled::new().await;
    let (store, pg) = (pooled.store(), &pooled.pg);
    let layer = IdempotencyLayer::new(
        store.clone(),
        "POST /orders v1",
        JsonFingerprinter::new("orders.v1"),
    )
    .wait(Duration::from_millis(500))
    .long_running(
        LeaseConfig::new(LEASE)
            .heartbeat(Duration::from_millis(100))
            .respond_within(Duration::from_secs(5))
            .recovery_backoff(Duration::ZERO, Duration::ZERO),
    );
    let calls = Arc::new(AtomicU64::new(0));
    // Acquire, heartbeat, fenced write, finish; then the replay.
    let first = send(
        layer.layer(fenced_orders(calls.clone())),
        tenant_a_post("k1"),
    )
    .await;
    assert_eq!(first.status, StatusCode::CREATED, "{}", text(&first));
    let again = send(
        layer.layer(fenced_orders(calls.clone())),
        tenant_a_post("k1"),
    )
    .await;
    assert!(again.replayed());
    assert_eq!(again.body, first.body);
    assert_eq!(calls.load(Ordering::SeqCst), 1);
    let operation: String = pg
        .value("SELECT operation_id::text FROM idempotency_requests WHERE idempotency_key = 'k1'")
        .await;
    // The status resource.
    let status = store
        .operation(&TenantId::new("tenant-a"), operation.parse().unwrap())
        .await
        .expect("the status through the pooler")
        .expect("the operation is known");
    assert!(format!("{status:?}").contains("Completed"), "{status:?}");

    // An owner that dies after acquiring: recovery takes it over through
    // the pooler, with a larger token, and completes it.
    let fingerprint: Vec<u8> = pg
        .value("SELECT request_fingerprint FROM idempotency_requests WHERE idempotency_key = 'k1'")
        .await;
    let claim = ClaimRequest::new(
        Scope::new(TenantId::new("tenant-a"), "POST /orders v1"),
        IdempotencyKey::parse(b"k2").unwrap(),
        tower_idempotency::fingerprint::Fingerprint::from_slice(&fingerprint).unwrap(),
    )
    .with_wait(Duration::from_millis(500));
    let request = LeaseRequest::new(
        LEASE,
        OperationId::random(),
        StoredRequest::new(
            http::Method::POST,
            "/orders",
            vec![(
                http::header::CONTENT_TYPE,
                http::HeaderValue::from_static("application/json"),
            )],
            Bytes::from_static(BODY.as_bytes()),
        ),
    );
    let dead = match store.acquire(&claim, &request).await {
        Ok(Acquired::Owned(owned)) => owned,
        other => panic!("the first owner must own the key: {other:?}"),
    };
    store
        .heartbeat(&dead.lease, LEASE)
        .await
        .expect("a heartbeat through the pooler");
    let deadline = tokio::time::Instant::now() + Duration::from_secs(10);
    let recovery = layer.recovery(fenced_orders(calls.clone()));
    loop {
        if recovery
            .run_once()
            .await
            .expect("recovery through the pooler")
            == 1
        {
            break;
        }
        assert!(tokio::time::Instant::now() < deadline, "never recovered");
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
    let row = pg
        .row("SELECT state, attempt_token FROM idempotency_requests WHERE idempotency_key = 'k2'")
        .await;
    assert_eq!(row.get::<_, &str>(0), "completed");
    assert!(row.get::<_, i64>(1) > dead.token);
    assert_eq!(calls.load(Ordering::SeqCst), 2);
    assert_eq!(pg.count("SELECT count(*) FROM orders").await, 2);
    // The dead owner's fenced transaction is refused: a larger token owns it.
    let fenced = dead.lease.transaction().await;
    assert!(
        fenced.is_err(),
        "a stale owner is fenced through the pooler too"
    );
    assert_eq!(pg.idle_in_transaction().await, 0);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn cleanup_and_the_operator_api_work_through_the_pooler() {
    let pooled = Pooled::new().await;
    let (store, pg) = (pooled.store(), &pooled.pg);
    let service = layer(store.clone()).layer(ordering(Default::default()));
    for key in ["k1", "k2", "k3"] {
        assert_eq!(
            send(service.clone(), tenant_a_post(key)).await.status,
            StatusCode::CREATED
        );
    }
    let scope = Scope::new(TenantId::new("tenant-a"), "POST /orders v1");
    let key = IdempotencyKey::parse(b"k1").unwrap();
    let record = store
        .inspect_key(&scope, &key)
        .await
        .expect("inspect_key through the pooler")
        .expect("k1 is remembered");
    assert_eq!(record.state, KeyState::Completed);
    assert_eq!(record.response_status, Some(StatusCode::CREATED));
    assert!(store.remove_key(&scope, &key, "test").await.unwrap());
    assert!(store.inspect_key(&scope, &key).await.unwrap().is_none());
    pg.exec("UPDATE idempotency_requests SET expires_at = now() - interval '1 second' WHERE idempotency_key = 'k2'")
        .await;
    let cleanup = Cleanup::new(store.clone()).batch_size(1);
    assert_eq!(
        cleanup
            .run_once()
            .await
            .expect("cleanup through the pooler"),
        1
    );
    let gauges = cleanup
        .refresh_gauges()
        .await
        .expect("gauges through the pooler");
    assert_eq!(gauges.cleanup_backlog, 0);
    assert_eq!(
        pg.column::<String>("SELECT idempotency_key FROM idempotency_requests")
            .await,
        ["k3"]
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_store_lease_and_one_commit_conformance_suites_pass_through_the_pooler() {
    let pooled = Pooled::new().await;
    tower_idempotency::testing::conformance::run_all(pooled.store())
        .await
        .assert_passed();
    tower_idempotency::testing::conformance::run_leases(pooled.store())
        .await
        .assert_passed();
    tower_idempotency::testing::conformance::run_at_commit(pooled.store())
        .await
        .assert_passed();
    assert_eq!(pooled.pg.idle_in_transaction().await, 0);
}

/// `SqlxStore` on a sqlx pool whose connections go through PgBouncer.
async fn pooled_sqlx(bouncer: &PgBouncer, db: &TestDatabase) -> SqlxStore {
    let options = sqlx::postgres::PgConnectOptions::new()
        .host("127.0.0.1")
        .port(bouncer.port())
        .username("postgres")
        .database(db.name());
    let pool = sqlx::postgres::PgPoolOptions::new()
        .max_connections(APP_POOL as u32)
        .connect_with(options)
        .await
        .expect("the pool connects through the pooler");
    let store = SqlxStore::new(pool).transaction_pooling(true);
    store
        .migrate()
        .await
        .expect("migrations apply through the pooler");
    store
}

/// The order handler for `SqlxStore`: its statement unnamed
/// (`persistent(false)`), as the pooler needs.
fn sqlx_ordering(calls: Arc<AtomicU64>) -> Handler {
    tower::util::BoxCloneService::new(tower::service_fn(move |request: Request<RequestBody>| {
        let calls = calls.clone();
        async move {
            calls.fetch_add(1, Ordering::SeqCst);
            let tx = request
                .extensions()
                .get::<SqlxTx>()
                .cloned()
                .ok_or("no transaction")?;
            let id = new_order_id();
            let mut conn = tx.conn().await?;
            sqlx::query("INSERT INTO orders (id, tenant_id) VALUES ($1, $2)")
                .persistent(false)
                .bind(&id)
                .bind(tx.tenant())
                .execute(&mut *conn)
                .await?;
            Ok::<_, BoxError>(created(id))
        }
    }))
}

// Each start waits at the barrier, then hands back the spawned request.
#[allow(clippy::async_yields_async)]
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_sqlx_store_works_through_the_pooler() {
    let db = TestDatabase::create().await;
    let bouncer = PgBouncer::start(&db.config());
    let store = pooled_sqlx(&bouncer, &db).await;
    let client = db.client().await;
    client
        .batch_execute("CREATE TABLE orders (id text PRIMARY KEY, tenant_id text NOT NULL)")
        .await
        .unwrap();
    let calls = Arc::new(AtomicU64::new(0));
    let service = layer(store.clone()).layer(sqlx_ordering(calls.clone()));
    for round in 0..3 {
        let warm: Vec<_> = (0..APP_POOL)
            .map(|i| spawn_send(service.clone(), tenant_a_post(&format!("warm-{round}-{i}"))))
            .collect();
        for answer in warm {
            let answer = answer.await.unwrap();
            assert_eq!(answer.status, StatusCode::CREATED, "{}", text(&answer));
        }
    }
    let barrier = Arc::new(Barrier::new(50));
    let tasks: Vec<_> = (0..50)
        .map(|_| {
            let (service, barrier) = (service.clone(), barrier.clone());
            tokio::spawn(async move {
                barrier.wait().await;
                spawn_send(service, tenant_a_post("key-50"))
            })
        })
        .collect();
    let mut answers = Vec::new();
    for task in tasks {
        answers.push(task.await.unwrap().await.unwrap());
    }
    let statuses: Vec<_> = answers.iter().map(|a| a.status).collect();
    assert!(
        answers.iter().all(|a| a.status == StatusCode::CREATED),
        "every duplicate is answered 201, never 503: {statuses:?}"
    );
    assert_eq!(answers.iter().filter(|a| !a.replayed()).count(), 1);
    assert_eq!(calls.load(Ordering::SeqCst), 3 * APP_POOL as u64 + 1);
    let count = |sql: &'static str| {
        let client = &client;
        async move { client.query_one(sql, &[]).await.unwrap().get::<_, i64>(0) }
    };
    assert_eq!(
        count("SELECT count(*) FROM orders").await,
        3 * APP_POOL as i64 + 1
    );
    assert_eq!(
        count("SELECT count(*) FROM idempotency_requests WHERE idempotency_key = 'key-50'").await,
        1
    );
    // Every guarantee of the three contracts, through the pooler.
    tower_idempotency::testing::conformance::run_all(store.clone())
        .await
        .assert_passed();
    tower_idempotency::testing::conformance::run_leases(store.clone())
        .await
        .assert_passed();
    tower_idempotency::testing::conformance::run_at_commit(store)
        .await
        .assert_passed();
    assert_eq!(
        count("SELECT count(*) FROM pg_stat_activity WHERE state LIKE 'idle in transaction%' AND datname = current_database()").await,
        0
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_runaway_handler_statement_is_cancelled_through_the_pooler() {
    let pooled = Pooled::new().await;
    let pg = &pooled.pg;
    let service = layer(pooled.store())
        .handler_timeout(Duration::from_millis(300))
        .layer(handler(|tx: PgTx| async move {
            tx.execute(
                "INSERT INTO orders (id, tenant_id) VALUES ('runaway', $1)",
                &[&tx.tenant()],
            )
            .await?;
            tx.batch_execute("SELECT pg_sleep(30)").await?;
            Ok(created("never"))
        }));
    let started = tokio::time::Instant::now();
    let answer = send(service, tenant_a_post("runaway")).await;
    assert_eq!(
        answer.status,
        StatusCode::SERVICE_UNAVAILABLE,
        "{}",
        text(&answer)
    );
    // The statement is cancelled with the connection's cancel key, which
    // PgBouncer forwards to the server connection the open transaction
    // holds: it ends in a moment, not in 30 s, and its writes roll back.
    let sleeping = "SELECT count(*) FROM pg_stat_activity \
                    WHERE query = 'SELECT pg_sleep(30)' AND state = 'active'";
    while pg.count(sleeping).await > 0 {
        assert!(
            started.elapsed() < Duration::from_secs(10),
            "the runaway statement was not cancelled through the pooler"
        );
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
    assert_eq!(pg.count("SELECT count(*) FROM orders").await, 0);
    assert_eq!(
        pg.count("SELECT count(*) FROM idempotency_requests").await,
        0
    );
    assert_eq!(pg.idle_in_transaction().await, 0);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn migrations_run_through_the_pooler_and_concurrently() {
    let db = TestDatabase::create().await;
    let bouncer = PgBouncer::start(&db.config());
    // Eight processes' worth of stores migrating at once: they serialise on
    // a transaction-scoped advisory lock, which a transaction pooler keeps.
    let stores: Vec<_> = (0..8)
        .map(|_| pooled_store(&bouncer, &db, |b| b.max_connections(2)))
        .collect();
    let runs: Vec<_> = stores
        .iter()
        .map(|store| {
            let store = store.clone();
            tokio::spawn(async move { store.migrate().await })
        })
        .collect();
    for run in runs {
        run.await.unwrap().expect("a migration through the pooler");
    }
    let client = db.client().await;
    let versions = migration_versions(&client).await;
    assert_eq!(
        versions,
        (1..=10).collect::<Vec<i32>>(),
        "every migration applied once"
    );
    // Again: nothing to do, nothing doubled.
    stores[0].migrate().await.expect("migrating again");
    drop(bouncer);
}

/// Types the driver does not know (an enum, a domain, `citext`) in a
/// handler's statements, through the pooler. Each driver looks such a type
/// up once per connection with a statement of its own, prepared under a name
/// on whichever server connection the transaction had: a name later reused
/// on another server connection (`26000`), or left behind where another
/// client prepares the same name (`42P05`), must not fail requests. A type
/// created after the connections opened costs each connection at most one
/// failed request.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn custom_types_in_handler_statements_work_through_the_pooler() {
    let db = TestDatabase::create().await;
    let client = db.client().await;
    client.batch_execute(CUSTOM_TYPES).await.expect("the types");
    let bouncer = PgBouncer::start(&db.config());
    let store = pooled_store(&bouncer, &db, |builder| builder);
    store.migrate().await.expect("migrations");
    let late = Arc::new(AtomicBool::new(false));
    let reads = late.clone();
    let service = layer(store).layer(handler(move |tx: PgTx| {
        let reads = reads.clone();
        async move {
            let id = new_order_id();
            let read = async {
                tx.execute(
                    "INSERT INTO typed_orders (id, tenant_id) VALUES ($1, $2)",
                    &[&id, &tx.tenant()],
                )
                .await
                .map_err(|e| format!("INSERT {e:?}"))?;
                let sql = typed_read(&reads);
                tx.query_one(&sql, &[&id])
                    .await
                    .map_err(|e| format!("{sql} {e:?}"))
            };
            Ok(match read.await {
                Ok(_) => created(id),
                Err(e) => response(StatusCode::SERVICE_UNAVAILABLE, e),
            })
        }
    }));
    custom_types_scenario(service, &client, Some(&*late)).await;
}

/// The same for `SqlxStore`, whose pool loads the types into each new
/// connection with `tower_idempotency::sqlx::load_types`.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn custom_types_in_sqlx_handler_statements_work_through_the_pooler() {
    let db = TestDatabase::create().await;
    let client = db.client().await;
    client.batch_execute(CUSTOM_TYPES).await.expect("the types");
    let bouncer = PgBouncer::start(&db.config());
    let options = sqlx::postgres::PgConnectOptions::new()
        .host("127.0.0.1")
        .port(bouncer.port())
        .username("postgres")
        .database(db.name());
    let pool = sqlx::postgres::PgPoolOptions::new()
        .max_connections(APP_POOL as u32)
        .after_connect(|conn, _| Box::pin(tower_idempotency::sqlx::load_types(conn)))
        .connect_with(options)
        .await
        .expect("the pool connects through the pooler");
    let store = SqlxStore::new(pool).transaction_pooling(true);
    store.migrate().await.expect("migrations");
    let late = Arc::new(AtomicBool::new(false));
    let reads = late.clone();
    let service = layer(store).layer(tower::util::BoxCloneService::new(tower::service_fn(
        move |request: Request<RequestBody>| {
            let reads = reads.clone();
            async move {
                let tx = request
                    .extensions()
                    .get::<SqlxTx>()
                    .cloned()
                    .ok_or("no transaction")?;
                let id = new_order_id();
                let mut conn = tx.conn().await?;
                let read = async {
                    sqlx::query("INSERT INTO typed_orders (id, tenant_id) VALUES ($1, $2)")
                        .persistent(false)
                        .bind(&id)
                        .bind(tx.tenant())
                        .execute(&mut *conn)
                        .await?;
                    sqlx::query(sqlx::AssertSqlSafe(typed_read(&reads)))
                        .persistent(false)
                        .bind(&id)
                        .fetch_one(&mut *conn)
                        .await
                };
                Ok::<_, BoxError>(match read.await {
                    Ok(_) => created(id),
                    Err(e) => response(StatusCode::SERVICE_UNAVAILABLE, e.to_string()),
                })
            }
        },
    )));
    // A type made after a connection opened is looked up as sqlx does it:
    // the connections must be replaced (`load_types` says so); not run here.
    custom_types_scenario(service, &client, None).await;
}

const CUSTOM_TYPES: &str = "CREATE EXTENSION IF NOT EXISTS citext; \
     CREATE TYPE order_state AS ENUM ('new', 'paid'); \
     CREATE DOMAIN positive_amount AS bigint CHECK (VALUE > 0); \
     CREATE TABLE typed_orders (id text PRIMARY KEY, tenant_id text NOT NULL, \
         state order_state NOT NULL DEFAULT 'new', amount positive_amount NOT NULL DEFAULT 1, \
         email citext NOT NULL DEFAULT 'A@Example.com')";

/// A read of one of the custom types' columns, each in turn, so that a
/// connection meets them in different transactions; with `late`, also the
/// column of a type made after the pools opened.
fn typed_read(late: &AtomicBool) -> String {
    static NEXT: AtomicU64 = AtomicU64::new(0);
    let columns: &[&str] = match late.load(Ordering::SeqCst) {
        false => &["state", "amount", "email"],
        true => &["state", "amount", "email", "late"],
    };
    let column = columns[(NEXT.fetch_add(1, Ordering::Relaxed) as usize) % columns.len()];
    format!("SELECT {column} FROM typed_orders WHERE id = $1")
}

/// Rounds of concurrent requests of `service`: none fails while the types
/// stay as they were; after a new type is created, each connection fails
/// at most one request, and the rounds after that none.
async fn custom_types_scenario<S, B>(
    service: S,
    client: &tokio_postgres::Client,
    late: Option<&AtomicBool>,
) where
    S: tower::Service<
            Request<Full<Bytes>>,
            Response = Response<tower_idempotency::ResponseBody<B>>,
        > + Clone
        + Send
        + 'static,
    S::Future: Send,
    S::Error: std::fmt::Debug,
    B: http_body::Body<Data = Bytes> + Send + 'static,
    B::Error: Into<BoxError>,
{
    let rounds = |name: &'static str, count: usize| {
        let service = service.clone();
        async move {
            let mut failed = Vec::new();
            for round in 0..count {
                let requests: Vec<_> = (0..2 * APP_POOL)
                    .map(|i| {
                        spawn_send(
                            service.clone(),
                            tenant_a_post(&format!("{name}-{round}-{i}")),
                        )
                    })
                    .collect();
                for answer in requests {
                    let answer = answer.await.unwrap();
                    if answer.status != StatusCode::CREATED {
                        failed.push(text(&answer));
                    }
                }
            }
            failed
        }
    };
    let failed = rounds("typed", 4).await;
    assert!(
        failed.is_empty(),
        "{} failed: {:?}",
        failed.len(),
        failed.first()
    );
    let count = || async {
        client
            .query_one("SELECT count(*) FROM typed_orders", &[])
            .await
            .unwrap()
            .get::<_, i64>(0)
    };
    assert_eq!(count().await, 4 * 2 * APP_POOL as i64, "a row per 201");
    let Some(late) = late else {
        return;
    };
    client
        .batch_execute(
            "CREATE TYPE late_state AS ENUM ('x'); \
             ALTER TABLE typed_orders ADD COLUMN late late_state NOT NULL DEFAULT 'x'",
        )
        .await
        .unwrap();
    late.store(true, Ordering::SeqCst);
    // A connection that meets the new type fails that request once and is
    // then replaced; one that met it already never fails again.
    let mut failed = rounds("late", 5).await;
    let late_failures = failed.len() as i64;
    assert!(
        failed.len() <= APP_POOL,
        "more than one failure per connection: {} {:?}",
        failed.len(),
        failed.first()
    );
    failed.retain(|f| !f.contains("26000") && !f.contains("does not exist"));
    assert!(failed.is_empty(), "other failures: {failed:?}");
    assert_eq!(
        count().await,
        (4 + 5) * 2 * APP_POOL as i64 - late_failures,
        "a row per 201"
    );
}
