//! The example order server's contract where it is deployed: as processes
//! whose `DATABASE_URL` names something other than one PostgreSQL
//! (PgBouncer in transaction pooling mode, a Citus coordinator), checked
//! with the same row assertions as its direct tests: an order and its
//! replay, 50 concurrent duplicates, the outbox delivering the charges, and
//! a fulfilment answered 202 and then shipped; with `POST /orders` in each
//! of its modes. Requests alternate between the instances. No log may
//! mention a prepared statement.

use std::{
    process::Stdio,
    sync::{Arc, Mutex},
    time::Duration,
};

use bytes::Bytes;
use http::{Method, Request, StatusCode};
use http_body_util::{BodyExt, Full};
use hyper_util::{client::legacy::Client, rt::TokioExecutor};
use serde_json::json;
use tokio::{
    io::{AsyncBufReadExt, BufReader},
    process::{Child, Command},
};
use tower_idempotency::{outbox::derive_tenant_key, testing::TestDatabase};

use crate::common::example_binary::{example_binary, Answer, Mode};

const TOKEN_A: &str = "demo-token-a";
const DEADLINE: Duration = Duration::from_secs(30);

pub(crate) struct Server {
    child: Child,
    base: String,
    /// Everything the server wrote to stderr so far.
    log: Arc<Mutex<String>>,
    http: Client<hyper_util::client::legacy::connect::HttpConnector, Full<Bytes>>,
}

impl Server {
    pub(crate) async fn start(database_url: &str, mode: Mode) -> Server {
        Self::start_with(database_url, mode, &[]).await
    }

    /// As [`start`](Self::start), with `env` on top of the defaults.
    pub(crate) async fn start_with(database_url: &str, mode: Mode, env: &[(&str, &str)]) -> Server {
        let mut child = Command::new(example_binary())
            .env("DATABASE_URL", database_url)
            .envs([mode.env()])
            .env("ORDER_SERVER_ADDR", "127.0.0.1:0")
            .env("RUST_LOG", "warn")
            .env("FULFILMENT_DELAY", "2s")
            .envs(env.iter().copied())
            .stdin(Stdio::null())
            .stdout(Stdio::piped())
            .stderr(Stdio::piped())
            .kill_on_drop(true)
            .spawn()
            .expect("the example server starts");
        let log = Arc::new(Mutex::new(String::new()));
        let stderr = child.stderr.take().expect("stderr");
        tokio::spawn({
            let log = log.clone();
            async move {
                let mut lines = BufReader::new(stderr).lines();
                while let Ok(Some(line)) = lines.next_line().await {
                    eprintln!("{line}");
                    let mut log = log.lock().unwrap();
                    log.push_str(&line);
                    log.push('\n');
                }
            }
        });
        let stdout = child.stdout.take().expect("stdout");
        let mut line = String::new();
        BufReader::new(stdout)
            .read_line(&mut line)
            .await
            .expect("reads stdout");
        let base = line
            .trim()
            .strip_prefix("listening on ")
            .unwrap_or_else(|| {
                panic!(
                    "unexpected first line: {line:?}; log:\n{}",
                    log.lock().unwrap()
                )
            })
            .to_owned();
        let server = Server {
            child,
            base,
            log,
            http: Client::builder(TokioExecutor::new()).build_http(),
        };
        let metrics = server.call(Method::GET, "/metrics", None, "").await;
        mode.assert_serves(&String::from_utf8_lossy(&metrics.body));
        server
    }

    pub(crate) async fn call(
        &self,
        method: Method,
        path: &str,
        key: Option<&str>,
        body: &str,
    ) -> Answer {
        let mut request = Request::builder()
            .method(method)
            .uri(format!("{}{path}", self.base))
            .header("authorization", format!("Bearer {TOKEN_A}"))
            .header("content-type", "application/json");
        if let Some(key) = key {
            request = request.header("idempotency-key", key);
        }
        let request = request
            .body(Full::new(Bytes::copy_from_slice(body.as_bytes())))
            .unwrap();
        let response = self.http.request(request).await.expect("server answers");
        let (parts, body) = response.into_parts();
        Answer {
            status: parts.status,
            headers: parts.headers,
            body: body.collect().await.expect("body").to_bytes(),
        }
    }

    pub(crate) async fn stop(mut self) -> (std::process::ExitStatus, String) {
        let pid = self.child.id().expect("running").to_string();
        let killed = Command::new("kill")
            .args(["-TERM", &pid])
            .status()
            .await
            .unwrap();
        assert!(killed.success());
        let status = tokio::time::timeout(Duration::from_secs(20), self.child.wait())
            .await
            .expect("the server exits after SIGTERM")
            .unwrap();
        let log = self.log.lock().unwrap().clone();
        (status, log)
    }
}

pub(crate) fn order(checkout: &str) -> String {
    json!({
        "checkout_id": checkout,
        "currency": "JPY",
        "items": [{"sku": "SKU-1", "quantity": 2, "unit_price": 1200}],
        "shipping_address_id": "addr_1"
    })
    .to_string()
}

/// Polls `probe` until it holds, failing the test after [`DEADLINE`].
async fn eventually<Fut: std::future::Future<Output = bool>>(
    what: &str,
    mut probe: impl FnMut() -> Fut,
) {
    let deadline = tokio::time::Instant::now() + DEADLINE;
    while !probe().await {
        assert!(
            tokio::time::Instant::now() < deadline,
            "timed out waiting for {what}"
        );
        tokio::time::sleep(Duration::from_millis(25)).await;
    }
}

/// Instances of the server, each on its URL; requests go round them.
struct Servers {
    instances: Vec<Server>,
    next: std::sync::atomic::AtomicUsize,
}

impl Servers {
    async fn call(&self, method: Method, path: &str, key: Option<&str>, body: &str) -> Answer {
        let at = self.next.fetch_add(1, std::sync::atomic::Ordering::Relaxed);
        let server = &self.instances[at % self.instances.len()];
        server.call(method, path, key, body).await
    }
}

/// The contract, with one instance of the server per URL in `urls`, all on
/// `db` (which the assertions read directly).
pub(crate) async fn keeps_its_contract(db: &TestDatabase, urls: &[String], mode: Mode) {
    let mut instances = Vec::new();
    for url in urls {
        instances.push(Server::start(url, mode).await);
    }
    let server = Arc::new(Servers {
        instances,
        next: Default::default(),
    });
    let sql = db.client().await;
    let count = |query: &'static str, params: Vec<String>| {
        let sql = &sql;
        async move {
            let params: Vec<&(dyn tokio_postgres::types::ToSql + Sync)> = params
                .iter()
                .map(|p| p as &(dyn tokio_postgres::types::ToSql + Sync))
                .collect();
            sql.query_one(query, &params)
                .await
                .unwrap()
                .get::<_, i64>(0)
        }
    };

    // An order, and its replay: the first answer, one order, one event,
    // one remembered record.
    let created = server
        .call(Method::POST, "/orders", Some("key-1"), &order("chk_1"))
        .await;
    assert_eq!(created.status, StatusCode::CREATED, "{created:?}");
    let first_id = created.json()["id"].as_str().unwrap().to_owned();
    let replay = server
        .call(Method::POST, "/orders", Some("key-1"), &order("chk_1"))
        .await;
    assert_eq!(replay.status, StatusCode::CREATED);
    assert!(replay.replayed());
    assert_eq!(replay.body, created.body);
    let read = server
        .call(Method::GET, &format!("/orders/{first_id}"), None, "")
        .await;
    assert_eq!(read.status, StatusCode::OK, "{read:?}");
    assert_eq!(read.json()["id"], first_id.as_str());
    assert_eq!(count("SELECT count(*) FROM orders", vec![]).await, 1);
    assert_eq!(count("SELECT count(*) FROM outbox_events", vec![]).await, 1);
    assert_eq!(
        count(
            "SELECT count(*) FROM idempotency_requests WHERE idempotency_key = 'key-1' AND response_status = 201",
            vec![]
        )
        .await,
        1
    );

    // 50 concurrent duplicates: all 201, one of them original; one order,
    // one event, one record.
    let body = order("chk_hot");
    let tasks: Vec<_> = (0..50)
        .map(|_| {
            let (server, body) = (server.clone(), body.clone());
            tokio::spawn(async move {
                server
                    .call(Method::POST, "/orders", Some("hot-key"), &body)
                    .await
            })
        })
        .collect();
    let mut answers = Vec::new();
    for task in tasks {
        answers.push(task.await.unwrap());
    }
    let statuses: Vec<_> = answers.iter().map(|a| a.status).collect();
    assert!(
        answers.iter().all(|a| a.status == StatusCode::CREATED),
        "every duplicate is answered 201 through the pooler: {statuses:?}"
    );
    assert!(answers.iter().all(|a| a.body == answers[0].body));
    assert_eq!(answers.iter().filter(|a| !a.replayed()).count(), 1);
    let hot_id = answers[0].json()["id"].as_str().unwrap().to_owned();
    assert_eq!(
        count(
            "SELECT count(*) FROM orders WHERE checkout_id = 'chk_hot'",
            vec![]
        )
        .await,
        1
    );
    assert_eq!(
        count(
            "SELECT count(*) FROM outbox_events WHERE aggregate_id = $1",
            vec![hot_id.clone()]
        )
        .await,
        1
    );
    assert_eq!(
        count(
            "SELECT count(*) FROM idempotency_requests WHERE idempotency_key = 'hot-key'",
            vec![]
        )
        .await,
        1
    );

    // The outbox relay (polling: no LISTEN through the pooler) delivers
    // both events: one charge per order, under its derived key.
    for id in [&first_id, &hot_id] {
        eventually("the order's charge", || async {
            count(
                "SELECT count(*) FROM payment_charges WHERE order_id = $1",
                vec![id.clone()],
            )
            .await
                == 1
        })
        .await;
        let key: String = sql
            .query_one(
                "SELECT idempotency_key FROM payment_charges WHERE order_id = $1",
                &[id],
            )
            .await
            .unwrap()
            .get(0);
        assert_eq!(key, derive_tenant_key("tenant-a", id, "payment.charge"));
    }
    // The relay marks an event published after the provider committed its
    // effect: the charge can be seen a moment before the mark.
    eventually("every event marked published", || async {
        count(
            "SELECT count(*) FROM outbox_events WHERE published_at IS NULL",
            vec![],
        )
        .await
            == 0
    })
    .await;

    // Fulfilment, the long-running operation: 202 after 1 s (the
    // warehouse takes 2 s), then shipped; one shipment.
    let accepted = server
        .call(
            Method::POST,
            &format!("/orders/{first_id}/fulfilment"),
            Some("ship-1"),
            r#"{"warehouse":"tokyo-1"}"#,
        )
        .await;
    assert_eq!(accepted.status, StatusCode::ACCEPTED, "{accepted:?}");
    let operation_id = accepted.json()["operation_id"].as_str().unwrap().to_owned();
    let status_path = format!("/operations/{operation_id}");
    let deadline = tokio::time::Instant::now() + DEADLINE;
    let status = loop {
        let answer = server.call(Method::GET, &status_path, None, "").await;
        assert_eq!(answer.status, StatusCode::OK, "{answer:?}");
        let status = answer.json();
        if status["state"] == "completed" {
            break status;
        }
        assert!(
            tokio::time::Instant::now() < deadline,
            "timed out waiting for the fulfilment to complete"
        );
        tokio::time::sleep(Duration::from_millis(25)).await;
    };
    assert_eq!(status["result"]["status"], 200);
    assert_eq!(status["result"]["body"]["status"], "shipped");
    assert_eq!(
        count(
            "SELECT count(*) FROM warehouse_shipments WHERE order_id = $1",
            vec![first_id.clone()]
        )
        .await,
        1
    );
    assert_eq!(
        count(
            "SELECT count(*) FROM orders WHERE id = $1::text::uuid AND fulfilment = 'shipped'",
            vec![first_id.clone()]
        )
        .await,
        1
    );
    let replayed = server
        .call(
            Method::POST,
            &format!("/orders/{first_id}/fulfilment"),
            Some("ship-1"),
            r#"{"warehouse":"tokyo-1"}"#,
        )
        .await;
    assert_eq!(replayed.status, StatusCode::OK);
    assert!(replayed.replayed());

    let servers = Arc::into_inner(server).expect("no request in flight");
    for server in servers.instances {
        let (exit, log) = server.stop().await;
        assert!(exit.success(), "graceful shutdown exits 0");
        assert!(
            !log.contains("prepared statement") && !log.contains("26000"),
            "nothing of the server's reached a server connection that lacked its statement:\n{log}"
        );
    }
}
