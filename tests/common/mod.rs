//! Shared by the integration tests: one behavioural scenario runs against
//! both stores through the `Backend` trait.
#![allow(dead_code)]

pub mod proxy;

use std::{
    future::Future,
    sync::{
        atomic::{AtomicU64, Ordering},
        Arc,
    },
    time::Duration,
};

use bytes::Bytes;
use http::{Request, Response, StatusCode};
use http_body_util::{BodyExt, Full};
use serde_json::{json, Value};
use tokio::sync::Notify;
use tower::{Service, ServiceExt};
use tower_idempotency::{
    testing::TestDatabase, Idempotency, IdempotencyLayer, JsonFingerprinter, MemoryStore, MemoryTx,
    PgStore, PgTx, RequestBody, ResponseBody, Store, TenantId,
};

pub type BoxError = Box<dyn std::error::Error + Send + Sync>;

/// A store plus the business table its handler writes through the transaction.
pub trait Backend: Send + Sync + 'static {
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

pub struct Memory(pub MemoryStore);

impl Memory {
    pub async fn new() -> Self {
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

pub struct Postgres {
    pub db: TestDatabase,
    pub store: PgStore,
    pub client: tokio_postgres::Client,
}

impl Postgres {
    pub async fn new() -> Self {
        Self::with_pool(16).await
    }

    pub async fn with_pool(max_connections: usize) -> Self {
        let db = TestDatabase::create().await;
        let store = PgStore::builder(db.config())
            .max_connections(max_connections)
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
    pub async fn records(&self) -> Vec<(String, String, String, Option<i16>)> {
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
    pub async fn store_with_database_setting(&self, name: &str, value: &str) -> PgStore {
        self.client
            .batch_execute(&format!(
                "ALTER DATABASE \"{}\" SET {name} = '{value}'",
                self.db.name()
            ))
            .await
            .unwrap();
        PgStore::builder(self.db.config()).build().unwrap()
    }

    /// Sessions of this database left inside a transaction.
    pub async fn idle_in_transaction(&self) -> i64 {
        self.client
            .query_one(
                "SELECT count(*) FROM pg_stat_activity WHERE datname = current_database() AND state LIKE 'idle in transaction%'",
                &[],
            )
            .await
            .unwrap()
            .get(0)
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
        let n: i64 = self
            .client
            .query_one(
                "SELECT count(*) FROM idempotency_requests WHERE state = 'completed'",
                &[],
            )
            .await
            .unwrap()
            .get(0);
        n as usize
    }
}

/// A fresh, unique order id (so two executions never produce the same body).
pub fn new_order_id() -> String {
    static NEXT: AtomicU64 = AtomicU64::new(1);
    let nanos = std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .unwrap()
        .as_nanos();
    format!("ord_{nanos:x}_{}", NEXT.fetch_add(1, Ordering::Relaxed))
}

pub type TestService<St> = Idempotency<
    tower::util::BoxCloneService<Request<RequestBody>, Response<Full<Bytes>>, BoxError>,
    St,
    JsonFingerprinter,
>;

/// The default test layer for `POST /orders v1`.
pub fn layer<St: Store>(store: St) -> IdempotencyLayer<St, JsonFingerprinter> {
    IdempotencyLayer::new(
        store,
        "POST /orders v1",
        JsonFingerprinter::new("orders.v1").ignore_field("trace_id"),
    )
}

/// A handler that writes one order through the transaction and answers 201
/// with the order, counting its calls.
pub fn order_handler<B: Backend>(
    calls: Arc<AtomicU64>,
) -> tower::util::BoxCloneService<Request<RequestBody>, Response<Full<Bytes>>, BoxError> {
    tower::util::BoxCloneService::new(tower::service_fn(move |request: Request<RequestBody>| {
        let calls = calls.clone();
        async move {
            calls.fetch_add(1, Ordering::SeqCst);
            let tx = request
                .extensions()
                .get::<<B::Store as Store>::Tx>()
                .cloned()
                .ok_or("no transaction handle")?;
            let tenant = request
                .extensions()
                .get::<TenantId>()
                .cloned()
                .ok_or("no tenant")?;
            let id = new_order_id();
            B::insert_order(&tx, &id, tenant.as_str()).await?;
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

pub fn post(tenant: Option<&str>, key: Option<&str>, body: &str) -> Request<Full<Bytes>> {
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

/// Status, headers and body of an answer.
#[derive(Debug)]
pub struct Answer {
    pub status: StatusCode,
    pub headers: http::HeaderMap,
    pub body: Bytes,
}

impl Answer {
    pub fn json(&self) -> Value {
        serde_json::from_slice(&self.body).expect("JSON body")
    }
    pub fn replayed(&self) -> bool {
        self.headers
            .get("idempotent-replayed")
            .is_some_and(|v| v == "true")
    }
}

pub async fn send<S, B>(service: S, request: Request<Full<Bytes>>) -> Answer
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

pub const WAIT_SHORT: Duration = Duration::from_millis(200);

/// [`send`] on a task of its own. (Spawning here, with explicit bounds, keeps
/// generic callers clear of rustc's auto-trait inference limits.)
pub fn spawn_send<S, B>(
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
pub fn gated<B: Backend>(
    started: Arc<Notify>,
    release: Arc<Notify>,
) -> tower::util::BoxCloneService<Request<RequestBody>, Response<Full<Bytes>>, BoxError> {
    tower::util::BoxCloneService::new(tower::service_fn(move |request: Request<RequestBody>| {
        let (started, release) = (started.clone(), release.clone());
        async move {
            let tx = request
                .extensions()
                .get::<<B::Store as Store>::Tx>()
                .cloned()
                .unwrap();
            let id = new_order_id();
            B::insert_order(&tx, &id, "tenant-a").await?;
            started.notify_one();
            release.notified().await;
            let mut response =
                Response::new(Full::new(Bytes::from(format!("{{\"id\":\"{id}\"}}"))));
            *response.status_mut() = StatusCode::CREATED;
            Ok::<_, BoxError>(response)
        }
    }))
}
