//! Shared by the integration tests: one behavioural scenario runs against
//! both stores through the `Backend` trait.
#![allow(dead_code)]

pub(crate) mod fault_proxy;
pub(crate) mod pgbouncer;
pub(crate) mod proxy;

use std::{
    future::Future,
    sync::{
        atomic::{AtomicU64, Ordering},
        Arc, Mutex,
    },
    time::Duration,
};

use bytes::Bytes;
use http::{Request, Response, StatusCode};
use http_body_util::{BodyExt, Full};
use serde_json::{json, Value};
use tokio::sync::{oneshot, Notify};
use tokio_postgres::types::FromSql;
use tower::{Layer, Service, ServiceExt};
use tower_idempotency::{
    fingerprint::{Fingerprint, JsonFingerprinter},
    key::IdempotencyKey,
    memory::{MemoryStore, MemoryTx},
    postgres::{PgStore, PgStoreBuilder, PgTx},
    record::StoredResponse,
    scope::{Scope, TenantId},
    sqlx::{SqlxStore, SqlxTx},
    store::{Claim, ClaimRequest, Store},
    testing::TestDatabase,
    Idempotency, IdempotencyLayer, RequestBody, ResponseBody,
};

pub(crate) type BoxError = Box<dyn std::error::Error + Send + Sync>;

/// The boxed inner service the tests put behind a layer.
pub(crate) type Handler =
    tower::util::BoxCloneService<Request<RequestBody>, Response<Full<Bytes>>, BoxError>;

/// The order body most requests of the tests carry.
pub(crate) const BODY: &str = r#"{"checkout_id":"chk_1","amount":1200}"#;

/// A store plus the business table its handler writes through the transaction.
pub(crate) trait Backend: Send + Sync + 'static {
    type Store: Store;
    fn store(&self) -> Self::Store;
    /// Inserts one order row through the owner's transaction.
    fn insert_order(
        tx: &<Self::Store as Store>::Tx,
        id: &str,
        tenant: &str,
    ) -> impl Future<Output = Result<(), String>> + Send;
    /// Committed orders as (id, tenant).
    fn orders(&self) -> impl Future<Output = Vec<(String, String)>> + Send;
    /// Completed records remembered by the store.
    fn remembered(&self) -> impl Future<Output = usize> + Send;
}

pub(crate) struct Memory(pub(crate) MemoryStore);

impl Memory {
    pub(crate) async fn new() -> Self {
        Memory(MemoryStore::new())
    }
}

impl Backend for Memory {
    type Store = MemoryStore;
    fn store(&self) -> MemoryStore {
        self.0.clone()
    }
    async fn insert_order(tx: &MemoryTx, id: &str, tenant: &str) -> Result<(), String> {
        tx.insert("orders", json!({"id": id, "tenant": tenant}))
            .map_err(|e| e.to_string())
    }
    async fn orders(&self) -> Vec<(String, String)> {
        self.0
            .rows("orders")
            .iter()
            .map(|row| {
                (
                    row["id"].as_str().unwrap().to_owned(),
                    row["tenant"].as_str().unwrap().to_owned(),
                )
            })
            .collect()
    }
    async fn remembered(&self) -> usize {
        self.0.completed_records()
    }
}

pub(crate) struct Postgres {
    pub(crate) db: TestDatabase,
    pub(crate) store: PgStore,
    pub(crate) client: tokio_postgres::Client,
}

impl Postgres {
    pub(crate) async fn new() -> Self {
        Self::with_pool(16).await
    }

    pub(crate) async fn with_pool(max_connections: usize) -> Self {
        Self::with_store(|builder| builder.max_connections(max_connections)).await
    }

    /// A fresh database with the store that `configure` makes of the default builder.
    pub(crate) async fn with_store(
        configure: impl FnOnce(PgStoreBuilder) -> PgStoreBuilder,
    ) -> Self {
        let db = TestDatabase::create().await;
        let store = configure(PgStore::builder(db.config()))
            .build()
            .expect("store builds");
        store.migrate().await.expect("migrations apply");
        let client = db.client().await;
        client
            .batch_execute("CREATE TABLE orders (id text PRIMARY KEY, tenant_id text NOT NULL)")
            .await
            .expect("orders table");
        Postgres { db, store, client }
    }

    /// Rows of idempotency_requests as (tenant, key, state, status).
    pub(crate) async fn records(&self) -> Vec<(String, String, String, Option<i16>)> {
        self.client
            .query(
                "SELECT tenant_id, idempotency_key, state, response_status FROM idempotency_requests ORDER BY 1, 2",
                &[],
            )
            .await
            .unwrap()
            .iter()
            .map(|r| (r.get(0), r.get(1), r.get(2), r.get(3)))
            .collect()
    }

    /// A new store whose sessions get `name = value` as their database default.
    pub(crate) async fn store_with_database_setting(&self, name: &str, value: &str) -> PgStore {
        set_database_default(&self.client, &self.db, name, value).await;
        PgStore::builder(self.db.config()).build().unwrap()
    }

    /// Sessions of this database left inside a transaction.
    pub(crate) async fn idle_in_transaction(&self) -> i64 {
        self.count(
            "SELECT count(*) FROM pg_stat_activity WHERE datname = current_database() AND state LIKE 'idle in transaction%'",
        )
        .await
    }

    /// Runs `sql` (one or more statements) on the test's own connection.
    pub(crate) async fn exec(&self, sql: &str) {
        self.client.batch_execute(sql).await.unwrap();
    }

    /// The one row `sql` selects.
    pub(crate) async fn row(&self, sql: &str) -> tokio_postgres::Row {
        self.client.query_one(sql, &[]).await.unwrap()
    }

    /// The single value `sql` selects.
    pub(crate) async fn value<T: for<'a> FromSql<'a>>(&self, sql: &str) -> T {
        self.row(sql).await.get(0)
    }

    /// The count `sql` selects.
    pub(crate) async fn count(&self, sql: &str) -> i64 {
        self.value(sql).await
    }

    /// The first column of every row `sql` selects.
    pub(crate) async fn column<T: for<'a> FromSql<'a>>(&self, sql: &str) -> Vec<T> {
        let rows = self.client.query(sql, &[]).await.unwrap();
        rows.iter().map(|r| r.get(0)).collect()
    }

    /// Claims `request` and returns the owner's handle; any other outcome panics with `expected`.
    pub(crate) async fn own(&self, request: &ClaimRequest, expected: &str) -> PgTx {
        let Claim::Owned(tx) = self.store.claim(request).await.unwrap() else {
            panic!("{expected}")
        };
        tx
    }
}

impl Backend for Postgres {
    type Store = PgStore;
    fn store(&self) -> PgStore {
        self.store.clone()
    }
    async fn insert_order(tx: &PgTx, id: &str, tenant: &str) -> Result<(), String> {
        tx.execute(
            "INSERT INTO orders (id, tenant_id) VALUES ($1, $2)",
            &[&id, &tenant],
        )
        .await
        .map(|_| ())
        .map_err(|e| e.to_string())
    }
    async fn orders(&self) -> Vec<(String, String)> {
        self.client
            .query("SELECT id, tenant_id FROM orders ORDER BY id", &[])
            .await
            .unwrap()
            .iter()
            .map(|r| (r.get(0), r.get(1)))
            .collect()
    }
    async fn remembered(&self) -> usize {
        self.count("SELECT count(*) FROM idempotency_requests WHERE state = 'completed'")
            .await as usize
    }
}

/// [`SqlxStore`] on a fresh database, with the same orders table.
pub(crate) struct Sqlx {
    pub(crate) db: TestDatabase,
    pub(crate) store: SqlxStore,
    pub(crate) client: tokio_postgres::Client,
}

impl Sqlx {
    pub(crate) async fn new() -> Self {
        Self::with_pool(16).await
    }

    /// A fresh database with a store on a pool of at most `max_connections`.
    pub(crate) async fn with_pool(max_connections: u32) -> Self {
        let db = TestDatabase::create().await;
        let store = SqlxStore::new(sqlx_pool(&db, max_connections).await);
        store.migrate().await.expect("migrations apply");
        let client = db.client().await;
        client
            .batch_execute("CREATE TABLE orders (id text PRIMARY KEY, tenant_id text NOT NULL)")
            .await
            .expect("orders table");
        Sqlx { db, store, client }
    }

    /// The count `sql` selects.
    pub(crate) async fn count(&self, sql: &str) -> i64 {
        self.client.query_one(sql, &[]).await.unwrap().get(0)
    }

    /// A store on a new pool, whose sessions start with the database's
    /// default `name = value` (set here).
    pub(crate) async fn store_with_database_setting(&self, name: &str, value: &str) -> SqlxStore {
        set_database_default(&self.client, &self.db, name, value).await;
        SqlxStore::new(sqlx_pool(&self.db, 16).await)
    }
}

/// `ALTER DATABASE … SET name = 'value'`: the default of the database's
/// sessions from their next connection on.
pub(crate) async fn set_database_default(
    client: &tokio_postgres::Client,
    db: &TestDatabase,
    name: &str,
    value: &str,
) {
    client
        .batch_execute(&format!(
            "ALTER DATABASE \"{}\" SET {name} = '{value}'",
            db.name()
        ))
        .await
        .unwrap();
}

/// A sqlx pool of at most `max_connections` on `db`.
pub(crate) async fn sqlx_pool(db: &TestDatabase, max_connections: u32) -> sqlx::PgPool {
    sqlx::postgres::PgPoolOptions::new()
        .max_connections(max_connections)
        .connect_with(sqlx_options(db))
        .await
        .expect("the pool connects")
}

/// sqlx's connection options for `db` (a Unix socket, as the test cluster listens).
pub(crate) fn sqlx_options(db: &TestDatabase) -> sqlx::postgres::PgConnectOptions {
    sqlx_options_for(&db.config(), db.name())
}

/// sqlx's connection options for database `name` at what `config` names.
pub(crate) fn sqlx_options_for(
    config: &tokio_postgres::Config,
    name: &str,
) -> sqlx::postgres::PgConnectOptions {
    let mut options = sqlx::postgres::PgConnectOptions::new().database(name);
    match config.get_hosts().first() {
        Some(tokio_postgres::config::Host::Unix(path)) => options = options.socket(path),
        Some(tokio_postgres::config::Host::Tcp(host)) => options = options.host(host),
        None => {}
    }
    if let Some(port) = config.get_ports().first() {
        options = options.port(*port);
    }
    if let Some(user) = config.get_user() {
        options = options.username(user);
    }
    if let Some(password) = config.get_password() {
        options = options.password(&String::from_utf8_lossy(password));
    }
    options
}

impl Backend for Sqlx {
    type Store = SqlxStore;
    fn store(&self) -> SqlxStore {
        self.store.clone()
    }
    async fn insert_order(tx: &SqlxTx, id: &str, tenant: &str) -> Result<(), String> {
        let mut conn = tx.conn().await.map_err(|e| e.to_string())?;
        sqlx::query("INSERT INTO orders (id, tenant_id) VALUES ($1, $2)")
            .bind(id)
            .bind(tenant)
            .execute(&mut *conn)
            .await
            .map(|_| ())
            .map_err(|e| e.to_string())
    }
    async fn orders(&self) -> Vec<(String, String)> {
        self.client
            .query("SELECT id, tenant_id FROM orders ORDER BY id", &[])
            .await
            .unwrap()
            .iter()
            .map(|r| (r.get(0), r.get(1)))
            .collect()
    }
    async fn remembered(&self) -> usize {
        self.count("SELECT count(*) FROM idempotency_requests WHERE state = 'completed'")
            .await as usize
    }
}

/// A fresh, unique order id (so two executions never produce the same body).
pub(crate) fn new_order_id() -> String {
    static NEXT: AtomicU64 = AtomicU64::new(1);
    let nanos = std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .unwrap()
        .as_nanos();
    format!("ord_{nanos:x}_{}", NEXT.fetch_add(1, Ordering::Relaxed))
}

pub(crate) type TestService<St> = Idempotency<Handler, St, JsonFingerprinter>;

/// The default test layer for `POST /orders v1`.
pub(crate) fn layer<St: Store>(store: St) -> IdempotencyLayer<St, JsonFingerprinter> {
    IdempotencyLayer::new(
        store,
        "POST /orders v1",
        JsonFingerprinter::new("orders.v1").ignore_field("trace_id"),
    )
}

/// The backend's transaction handle the layer passed along with `request`.
pub(crate) fn tx_of<B: Backend>(request: &Request<RequestBody>) -> Option<<B::Store as Store>::Tx> {
    request
        .extensions()
        .get::<<B::Store as Store>::Tx>()
        .cloned()
}

/// A response with `status` and `body`.
pub(crate) fn response(status: StatusCode, body: impl Into<Bytes>) -> Response<Full<Bytes>> {
    let mut response = Response::new(Full::new(body.into()));
    *response.status_mut() = status;
    response
}

/// A 201 response with `body`.
pub(crate) fn created(body: impl Into<Bytes>) -> Response<Full<Bytes>> {
    response(StatusCode::CREATED, body)
}

/// A handler that runs `f` on the `PgTx` the layer passes.
pub(crate) fn handler<F, Fut>(f: F) -> Handler
where
    F: Fn(PgTx) -> Fut + Clone + Send + Sync + 'static,
    Fut: Future<Output = Result<Response<Full<Bytes>>, BoxError>> + Send + 'static,
{
    tower::util::BoxCloneService::new(tower::service_fn(move |request: Request<RequestBody>| {
        let tx = request
            .extensions()
            .get::<PgTx>()
            .cloned()
            .expect("the layer passes a PgTx");
        f(tx)
    }))
}

/// Writes one order under a fresh id through the request's transaction, for
/// the request's tenant: the order's id and tenant. (The future holds the
/// handle and the tenant, not the request, whose body is not `Sync`.)
pub(crate) fn write_order<B: Backend>(
    request: &Request<RequestBody>,
) -> impl Future<Output = Result<(String, TenantId), BoxError>> + Send + 'static {
    let tx = tx_of::<B>(request).ok_or("no transaction handle");
    let tenant = request.extensions().get::<TenantId>().cloned();
    async move {
        let (tx, tenant) = (tx?, tenant.ok_or("no tenant")?);
        let id = new_order_id();
        B::insert_order(&tx, &id, tenant.as_str()).await?;
        Ok((id, tenant))
    }
}

/// A handler that writes one order through the transaction and answers 201
/// with the order, counting its calls.
pub(crate) fn order_handler<B: Backend>(calls: Arc<AtomicU64>) -> Handler {
    tower::util::BoxCloneService::new(tower::service_fn(move |request: Request<RequestBody>| {
        let calls = calls.clone();
        async move {
            calls.fetch_add(1, Ordering::SeqCst);
            let (id, tenant) = write_order::<B>(&request).await?;
            let body = json!({"id": id, "tenant": tenant.as_str()}).to_string();
            Ok::<_, BoxError>(
                Response::builder()
                    .status(StatusCode::CREATED)
                    .header("content-type", "application/json")
                    .header("location", format!("/orders/{id}"))
                    .header("link", "</a>; rel=a")
                    .header("link", "</b>; rel=b")
                    .header("set-cookie", "session=1")
                    .body(Full::new(Bytes::from(body)))
                    .unwrap(),
            )
        }
    }))
}

pub(crate) fn post(tenant: Option<&str>, key: Option<&str>, body: &str) -> Request<Full<Bytes>> {
    let mut builder = Request::post("/orders").header("content-type", "application/json");
    if let Some(key) = key {
        builder = builder.header("idempotency-key", key);
    }
    let mut request = builder
        .body(Full::new(Bytes::copy_from_slice(body.as_bytes())))
        .unwrap();
    if let Some(tenant) = tenant {
        request.extensions_mut().insert(TenantId::new(tenant));
    }
    request
}

/// The usual request: tenant-a posts [`BODY`] under the idempotency key `key`.
pub(crate) fn tenant_a_post(key: &str) -> Request<Full<Bytes>> {
    post(Some("tenant-a"), Some(key), BODY)
}

/// Status, headers and body of an answer.
#[derive(Debug)]
pub(crate) struct Answer {
    pub(crate) status: StatusCode,
    pub(crate) headers: http::HeaderMap,
    pub(crate) body: Bytes,
}

impl Answer {
    pub(crate) fn json(&self) -> Value {
        serde_json::from_slice(&self.body).expect("JSON body")
    }
    pub(crate) fn replayed(&self) -> bool {
        self.headers
            .get("idempotent-replayed")
            .is_some_and(|v| v == "true")
    }
}

pub(crate) async fn send<S, B>(service: S, request: Request<Full<Bytes>>) -> Answer
where
    S: Service<Request<Full<Bytes>>, Response = Response<ResponseBody<B>>> + Send,
    S::Future: Send,
    S::Error: std::fmt::Debug,
    B: http_body::Body<Data = Bytes> + Send + 'static,
    B::Error: Into<BoxError>,
{
    let response = service.oneshot(request).await.expect("service answers");
    let (parts, body) = response.into_parts();
    let body = body.collect().await.expect("body reads").to_bytes();
    Answer {
        status: parts.status,
        headers: parts.headers,
        body,
    }
}

pub(crate) const WAIT_SHORT: Duration = Duration::from_millis(200);

/// [`send`] on a task of its own. (Spawning here, with explicit bounds, keeps
/// generic callers clear of rustc's auto-trait inference limits.)
pub(crate) fn spawn_send<S, B>(
    service: S,
    request: Request<Full<Bytes>>,
) -> tokio::task::JoinHandle<Answer>
where
    S: Service<Request<Full<Bytes>>, Response = Response<ResponseBody<B>>> + Send + 'static,
    S::Future: Send,
    S::Error: std::fmt::Debug,
    B: http_body::Body<Data = Bytes> + Send + 'static,
    B::Error: Into<BoxError>,
{
    tokio::spawn(send(service, request))
}

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

/// A handler that writes, tells the test it started, and waits for `release`.
pub(crate) fn gated<B: Backend>(started: Arc<Notify>, release: Arc<Notify>) -> Handler {
    tower::util::BoxCloneService::new(tower::service_fn(move |request: Request<RequestBody>| {
        let (started, release) = (started.clone(), release.clone());
        async move {
            let tx = tx_of::<B>(&request).unwrap();
            let id = new_order_id();
            B::insert_order(&tx, &id, "tenant-a").await?;
            started.notify_one();
            release.notified().await;
            Ok::<_, BoxError>(created(format!("{{\"id\":\"{id}\"}}")))
        }
    }))
}

/// The sending half of a oneshot channel that the clones of a handler share.
pub(crate) struct Report<T>(Arc<Mutex<Option<oneshot::Sender<T>>>>);

impl<T> Clone for Report<T> {
    fn clone(&self) -> Self {
        Report(self.0.clone())
    }
}

impl<T> Report<T> {
    /// A report and the receiver that gets what it sends.
    pub(crate) fn channel() -> (Report<T>, oneshot::Receiver<T>) {
        let (sender, receiver) = oneshot::channel();
        (Report(Arc::new(Mutex::new(Some(sender)))), receiver)
    }

    /// Sends `value`; a report is made once.
    pub(crate) fn send(&self, value: T) {
        let sender = self.0.lock().unwrap().take().expect("reported once");
        let _ = sender.send(value);
    }
}

/// A store whose database cannot be reached; connecting gives up after `connect_timeout`.
pub(crate) fn unreachable_store(connect_timeout: Duration) -> PgStore {
    let mut config = tokio_postgres::Config::new();
    config
        .host_path("/nonexistent-socket-dir")
        .port(1)
        .user("nobody")
        .dbname("none");
    PgStore::builder(config)
        .connect_timeout(connect_timeout)
        .build()
        .unwrap()
}

/// A claim by tenant `t` on `key` of `POST /x`, kept a minute, waiting at most `wait`.
pub(crate) fn claim_request(key: &str, wait: Duration) -> ClaimRequest {
    ClaimRequest::new(
        Scope::new(TenantId::new("t"), "POST /x"),
        IdempotencyKey::parse(key.as_bytes()).unwrap(),
        Fingerprint::from_bytes([1; 32]),
    )
    .with_retention(Duration::from_secs(60))
    .with_wait(wait)
}

/// A stored 200 answer with `body`.
pub(crate) fn stored(body: &'static [u8]) -> StoredResponse {
    StoredResponse {
        status: StatusCode::OK,
        headers: vec![],
        body: Bytes::from_static(body),
        resource_id: None,
    }
}

/// The migration versions recorded in the database, in order.
pub(crate) async fn migration_versions(client: &tokio_postgres::Client) -> Vec<i32> {
    client
        .query(
            "SELECT version FROM tower_idempotency_migrations ORDER BY version",
            &[],
        )
        .await
        .expect("the migration table can be read")
        .iter()
        .map(|row| row.get(0))
        .collect()
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

/// Runs every conformance suite on `store` (the short mode's with the
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
