//! The client layer against the real example order server (run as a
//! process on a throwaway PostgreSQL), through hyper's client: lost answers,
//! an outage and a running duplicate end in exactly one order.

use crate::common::example_binary;

use std::{
    future::Future,
    pin::Pin,
    process::Stdio,
    sync::{Arc, Mutex},
    time::Duration,
};

use bytes::Bytes;
use example_binary::example_binary;
use http::{Request, Response, StatusCode};
use http_body_util::{BodyExt, Full};
use hyper::body::Incoming;
use hyper_util::{
    client::legacy::{connect::HttpConnector, Client},
    rt::TokioExecutor,
};
use serde_json::json;
use tokio::{
    io::{AsyncBufReadExt, BufReader},
    process::{Child, Command},
    time::Instant,
};
use tower::{Layer, Service, ServiceExt};
use tower_idempotency::{
    client::{CallReport, IdempotentClientLayer, RetryReason},
    testing::TestDatabase,
};

type BoxError = Box<dyn std::error::Error + Send + Sync>;
type Http = Client<HttpConnector, Full<Bytes>>;

struct Server {
    _child: Child,
    base: String,
    db: TestDatabase,
    sql: tokio_postgres::Client,
}

impl Server {
    async fn start(env: &[(&str, &str)]) -> Server {
        let db = TestDatabase::create().await;
        let mut child = Command::new(example_binary())
            .env("DATABASE_URL", db.connection_string())
            .env("ORDER_SERVER_ADDR", "127.0.0.1:0")
            .env("RUST_LOG", "warn")
            .envs(env.iter().copied())
            .stdin(Stdio::null())
            .stdout(Stdio::piped())
            .stderr(Stdio::inherit())
            .kill_on_drop(true)
            .spawn()
            .expect("the example server starts");
        let mut line = String::new();
        BufReader::new(child.stdout.take().expect("stdout"))
            .read_line(&mut line)
            .await
            .expect("reads stdout");
        let base = line
            .trim()
            .strip_prefix("listening on ")
            .unwrap_or_else(|| panic!("unexpected first line: {line:?}"))
            .to_owned();
        let sql = db.client().await;
        Server {
            _child: child,
            base,
            db,
            sql,
        }
    }

    async fn count(&self, sql: &str) -> i64 {
        self.sql.query_one(sql, &[]).await.unwrap().get(0)
    }

    /// A POST /orders for tenant A; `key` set only when given.
    fn order(&self, checkout: &str, key: Option<&str>) -> Request<Full<Bytes>> {
        let body = json!({
            "checkout_id": checkout,
            "currency": "JPY",
            "items": [{"sku": "SKU-1", "quantity": 2, "unit_price": 1200}],
            "shipping_address_id": "addr_1"
        })
        .to_string();
        let mut request = Request::post(format!("{}/orders", self.base))
            .header("authorization", "Bearer demo-token-a")
            .header("content-type", "application/json");
        if let Some(key) = key {
            request = request.header("idempotency-key", key);
        }
        request.body(Full::new(Bytes::from(body))).unwrap()
    }
}

fn http() -> Http {
    Client::builder(TokioExecutor::new()).build_http()
}

/// One attempt as it went over the wire.
#[derive(Debug, Clone)]
struct Wire {
    key: String,
    sent: Instant,
    status: Option<StatusCode>,
    answered: Option<Instant>,
}

type Hook = Arc<
    dyn Fn(usize, &Response<Incoming>) -> Pin<Box<dyn Future<Output = bool> + Send>> + Send + Sync,
>;

/// hyper's client, recording every attempt; after each answer `hook(n,
/// answer)` runs, and when it says `false` the answer is never delivered
/// (lost on the way back, as when a connection drops after the server committed).
#[derive(Clone)]
struct Recorded {
    http: Http,
    wire: Arc<Mutex<Vec<Wire>>>,
    hook: Hook,
}

impl Recorded {
    fn new(hook: Hook) -> Recorded {
        Recorded {
            http: http(),
            wire: Arc::default(),
            hook,
        }
    }

    fn wire(&self) -> Vec<Wire> {
        self.wire.lock().unwrap().clone()
    }
}

impl Service<Request<Full<Bytes>>> for Recorded {
    type Response = Response<Incoming>;
    type Error = BoxError;
    type Future = Pin<Box<dyn Future<Output = Result<Response<Incoming>, BoxError>> + Send>>;

    fn poll_ready(
        &mut self,
        cx: &mut std::task::Context<'_>,
    ) -> std::task::Poll<Result<(), BoxError>> {
        Service::<Request<Full<Bytes>>>::poll_ready(&mut self.http, cx).map_err(Into::into)
    }

    fn call(&mut self, request: Request<Full<Bytes>>) -> Self::Future {
        let n = {
            let mut wire = self.wire.lock().unwrap();
            wire.push(Wire {
                key: request.headers()["idempotency-key"]
                    .to_str()
                    .unwrap()
                    .to_owned(),
                sent: Instant::now(),
                status: None,
                answered: None,
            });
            wire.len() - 1
        };
        let (future, wire, hook) = (
            self.http.request(request),
            self.wire.clone(),
            self.hook.clone(),
        );
        Box::pin(async move {
            let response = future.await?;
            {
                let mut wire = wire.lock().unwrap();
                wire[n].status = Some(response.status());
                wire[n].answered = Some(Instant::now());
            }
            if !hook(n, &response).await {
                return std::future::pending().await;
            }
            Ok(response)
        })
    }
}

fn deliver_all() -> Hook {
    Arc::new(|_, _| Box::pin(async { true }))
}

/// Sends `request` through the client layer over `service`: status, report, body.
async fn send(
    layer: IdempotentClientLayer,
    service: Recorded,
    request: Request<Full<Bytes>>,
) -> (StatusCode, CallReport, Bytes) {
    let response = layer
        .layer(service)
        .oneshot(request)
        .await
        .expect("an answer");
    let report = response.extensions().get::<CallReport>().cloned().unwrap();
    let status = response.status();
    let body = response.into_body().collect().await.unwrap().to_bytes();
    (status, report, body)
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_answer_lost_after_the_commit_is_retried_with_the_same_key_and_replayed() {
    let server = Server::start(&[]).await;
    // The first answer is read off the wire and then lost: the server committed.
    let first_status = Arc::new(Mutex::new(None));
    let service = Recorded::new(Arc::new({
        let first_status = first_status.clone();
        move |n, response| {
            let lost = n == 0;
            let status = response.status();
            let first_status = first_status.clone();
            Box::pin(async move {
                if lost {
                    *first_status.lock().unwrap() = Some(status);
                }
                !lost
            })
        }
    }));
    let layer = IdempotentClientLayer::new().attempt_timeout(Duration::from_secs(2));
    let (status, report, body) = send(layer, service.clone(), server.order("chk_lost", None)).await;

    assert_eq!(status, StatusCode::CREATED);
    assert_eq!(
        *first_status.lock().unwrap(),
        Some(StatusCode::CREATED),
        "the first attempt was committed and answered"
    );
    assert_eq!(report.attempts(), 2);
    assert_eq!(report.retries(), [RetryReason::Timeout]);
    assert!(report.replayed(), "the retry got the first answer back");
    let wire = service.wire();
    assert_eq!(wire.len(), 2);
    assert_eq!(wire[0].key, wire[1].key, "one key for both attempts");
    assert_eq!(wire[0].key, report.key().as_str());

    assert_eq!(
        server.count("SELECT count(*) FROM orders").await,
        1,
        "one order"
    );
    let order: serde_json::Value = serde_json::from_slice(&body).unwrap();
    let id: String = server
        .sql
        .query_one(
            "SELECT id::text FROM orders WHERE checkout_id = 'chk_lost'",
            &[],
        )
        .await
        .unwrap()
        .get(0);
    assert_eq!(order["id"], id.as_str());
    let remembered: i64 = server
        .sql
        .query_one(
            "SELECT count(*) FROM idempotency_requests WHERE idempotency_key = $1 AND response_status = 201",
            &[&report.key().as_str()],
        )
        .await
        .unwrap()
        .get(0);
    assert_eq!(remembered, 1);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_503_during_an_outage_is_retried_until_the_order_is_placed() {
    let server = Server::start(&[]).await;
    let name = server.db.name().to_owned();
    let admin = Arc::new({
        let mut config = server.db.config();
        config.dbname("postgres");
        let (client, connection) = config.connect(tokio_postgres::NoTls).await.unwrap();
        tokio::spawn(connection);
        client
    });
    admin
        .batch_execute(&format!(
            "ALTER DATABASE \"{name}\" ALLOW_CONNECTIONS false"
        ))
        .await
        .unwrap();
    admin
        .execute(
            "SELECT pg_terminate_backend(pid) FROM pg_stat_activity WHERE datname = $1 AND pid <> pg_backend_pid()",
            &[&name],
        )
        .await
        .unwrap();
    // The outage ends once the first attempt has been answered 503.
    let service = Recorded::new(Arc::new({
        let (admin, name) = (admin.clone(), name.clone());
        move |_, response| {
            let unavailable = response.status() == StatusCode::SERVICE_UNAVAILABLE;
            let (admin, name) = (admin.clone(), name.clone());
            Box::pin(async move {
                if unavailable {
                    admin
                        .batch_execute(&format!("ALTER DATABASE \"{name}\" ALLOW_CONNECTIONS true"))
                        .await
                        .unwrap();
                }
                true
            })
        }
    }));
    let (status, report, _) = send(
        IdempotentClientLayer::new(),
        service.clone(),
        server.order("chk_outage", None),
    )
    .await;

    assert_eq!(status, StatusCode::CREATED);
    assert!(
        !report.replayed(),
        "nothing was remembered during the outage"
    );
    let wire = service.wire();
    assert_eq!(wire[0].status, Some(StatusCode::SERVICE_UNAVAILABLE));
    assert_eq!(report.attempts(), 2);
    assert_eq!(report.retries(), [RetryReason::Unavailable]);
    assert_eq!(wire[0].key, wire[1].key);
    assert!(
        wire[1].sent - wire[0].answered.unwrap() >= Duration::from_secs(1),
        "Retry-After: 1 was honoured"
    );
    // The server answers again; the client's connection is a fresh one.
    let sql = server.db.client().await;
    let orders: i64 = sql
        .query_one(
            "SELECT count(*) FROM orders WHERE checkout_id = 'chk_outage'",
            &[],
        )
        .await
        .unwrap()
        .get(0);
    assert_eq!(orders, 1, "one order");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_running_duplicate_waits_retry_after_and_gets_the_result() {
    let server = Server::start(&[("IDEMPOTENCY_WAIT", "300ms")]).await;
    // Hold the orders table so that the first request stops inside its transaction.
    let blocker = Arc::new(server.db.client().await);
    blocker
        .batch_execute("BEGIN; LOCK TABLE orders IN ACCESS EXCLUSIVE MODE")
        .await
        .unwrap();
    let first = tokio::spawn(http().request(server.order("chk_running", Some("running-key"))));
    // Synchronise on the database: the first request waits for our lock, owning its key.
    let waiting = "SELECT count(*) FROM pg_locks l JOIN pg_class c ON c.oid = l.relation \
                   WHERE c.relname = 'orders' AND NOT l.granted";
    for _ in 0..500 {
        if server.count(waiting).await > 0 {
            break;
        }
        tokio::time::sleep(Duration::from_millis(10)).await;
    }
    assert_eq!(
        server.count(waiting).await,
        1,
        "the first request holds its key"
    );

    // The duplicate is told the first still runs; then the first is let go.
    let service = Recorded::new(Arc::new({
        let blocker = blocker.clone();
        move |n, response| {
            let release = n == 0 && response.status() == StatusCode::CONFLICT;
            let blocker = blocker.clone();
            Box::pin(async move {
                if release {
                    blocker.batch_execute("ROLLBACK").await.unwrap();
                }
                true
            })
        }
    }));
    let (status, report, body) = send(
        IdempotentClientLayer::new(),
        service.clone(),
        server.order("chk_running", Some("running-key")),
    )
    .await;

    let first = first.await.unwrap().unwrap();
    assert_eq!(first.status(), StatusCode::CREATED);
    let first_body = first.into_body().collect().await.unwrap().to_bytes();
    assert_eq!(status, StatusCode::CREATED);
    assert!(report.replayed());
    assert_eq!(body, first_body, "the first answer, byte for byte");
    let wire = service.wire();
    assert_eq!(wire[0].status, Some(StatusCode::CONFLICT));
    assert!(report.attempts() >= 2);
    assert!(report
        .retries()
        .iter()
        .all(|r| *r == RetryReason::InProgress));
    assert!(
        wire[1].sent - wire[0].answered.unwrap() >= Duration::from_secs(1),
        "Retry-After: 1 was honoured"
    );
    assert!(
        wire.iter().all(|w| w.key == "running-key"),
        "the caller's key on every attempt"
    );
    assert_eq!(
        server.count("SELECT count(*) FROM orders").await,
        1,
        "one order"
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_reused_key_is_returned_at_once() {
    let server = Server::start(&[]).await;
    let first = http()
        .request(server.order("chk_first", Some("reused-key")))
        .await
        .unwrap();
    assert_eq!(first.status(), StatusCode::CREATED);
    let service = Recorded::new(deliver_all());
    let (status, report, body) = send(
        IdempotentClientLayer::new(),
        service.clone(),
        server.order("chk_other", Some("reused-key")),
    )
    .await;
    assert_eq!(status, StatusCode::CONFLICT);
    let problem: serde_json::Value = serde_json::from_slice(&body).unwrap();
    assert_eq!(problem["code"], "idempotency_key_reused");
    assert_eq!(report.attempts(), 1, "not retried");
    assert_eq!(service.wire().len(), 1);
    assert_eq!(server.count("SELECT count(*) FROM orders").await, 1);
}
