//! Shared by the integration tests: one behavioural scenario runs against
//! both stores through the `Backend` trait.
#![allow(dead_code)]

pub(crate) mod citus;
pub(crate) mod example_binary;
pub(crate) mod fault_proxy;
pub(crate) mod partition;
pub(crate) mod patroni;
pub(crate) mod pgbouncer;
pub(crate) mod proxy;
pub(crate) mod standby;
pub(crate) mod tls_server;

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
use tower::{Service, ServiceExt};
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
    /// Sessions left idle in a transaction, once the transactions that end
    /// behind an answer (a replay's read-only transaction is rolled back on
    /// a task of its own) have had 5 s to end: the count when it reaches 0,
    /// or the last count.
    pub(crate) async fn idle_in_transaction(&self) -> i64 {
        let deadline = tokio::time::Instant::now() + Duration::from_secs(5);
        loop {
            let idle = self
                .count(
                    "SELECT count(*) FROM pg_stat_activity WHERE datname = current_database() AND state LIKE 'idle in transaction%'",
                )
                .await;
            if idle == 0 || tokio::time::Instant::now() >= deadline {
                return idle;
            }
            tokio::time::sleep(Duration::from_millis(25)).await;
        }
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
        trailers: Vec::new(),
        trace_id: None,
        span_id: None,
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
