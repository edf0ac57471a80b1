//! The example order server, run as a process against a throwaway PostgreSQL,
//! checked row by row against its HTTP contract (README, "The example order
//! server"), asserting on the database as well as on the answers.

use crate::common::example_binary;

use example_binary::{both_modes, example_binary, Answer, Mode};

use std::{process::Stdio, time::Duration};

use bytes::Bytes;
use http::{Method, Request, StatusCode};
use http_body_util::{BodyExt, Full};
use hyper_util::{client::legacy::Client, rt::TokioExecutor};
use serde_json::json;
use tokio::{
    io::{AsyncBufReadExt, AsyncWriteExt, BufReader},
    process::{Child, Command},
};
use tokio_postgres::types::FromSql;
use tower_idempotency::{outbox::derive_tenant_key, testing::TestDatabase};

const TOKEN_A: &str = "demo-token-a";
const TOKEN_B: &str = "demo-token-b";

struct Server {
    child: Child,
    base: String,
    db: TestDatabase,
    sql: tokio_postgres::Client,
    http: Client<hyper_util::client::legacy::connect::HttpConnector, Full<Bytes>>,
}

impl Answer {
    /// The id of the order in the body.
    fn order_id(&self) -> String {
        self.json()["id"].as_str().unwrap().to_owned()
    }
}

impl Server {
    /// Starts the server on a fresh database, with `POST /orders` in
    /// `mode` and `env` on top of the defaults.
    async fn start(mode: Mode, env: &[(&str, &str)]) -> Server {
        let db = TestDatabase::create().await;
        let mut child = Command::new(example_binary())
            .env("DATABASE_URL", db.connection_string())
            .env("ORDER_SERVER_ADDR", "127.0.0.1:0")
            .env("RUST_LOG", "warn")
            .envs([mode.env()])
            .envs(env.iter().copied())
            .stdin(Stdio::null())
            .stdout(Stdio::piped())
            .stderr(Stdio::inherit())
            .kill_on_drop(true)
            .spawn()
            .expect("the example server starts");
        let stdout = child.stdout.take().expect("stdout");
        let mut line = String::new();
        BufReader::new(stdout)
            .read_line(&mut line)
            .await
            .expect("reads stdout");
        let base = line
            .trim()
            .strip_prefix("listening on ")
            .unwrap_or_else(|| panic!("unexpected first line: {line:?}"))
            .to_owned();
        let sql = db.client().await;
        let server = Server {
            child,
            base,
            db,
            sql,
            http: Client::builder(TokioExecutor::new()).build_http(),
        };
        mode.assert_serves(&server.metrics().await);
        server
    }

    async fn call(
        &self,
        method: Method,
        path: &str,
        headers: &[(&str, &str)],
        body: &str,
    ) -> Answer {
        let mut request = Request::builder()
            .method(method)
            .uri(format!("{}{path}", self.base));
        for (name, value) in headers {
            request = request.header(*name, *value);
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

    async fn post_order(&self, token: &str, key: Option<&str>, body: &str) -> Answer {
        let auth = format!("Bearer {token}");
        let mut headers = vec![
            ("authorization", auth.as_str()),
            ("content-type", "application/json"),
        ];
        if let Some(key) = key {
            headers.push(("idempotency-key", key));
        }
        self.call(Method::POST, "/orders", &headers, body).await
    }

    /// Posts `order(checkout)` as tenant A under `key`.
    async fn place_order(&self, key: &str, checkout: &str) -> Answer {
        self.post_order(TOKEN_A, Some(key), &order(checkout)).await
    }

    /// GETs `path` with `headers`.
    async fn get(&self, path: &str, headers: &[(&str, &str)]) -> Answer {
        self.call(Method::GET, path, headers, "").await
    }

    /// The text of `/metrics`.
    async fn metrics(&self) -> String {
        String::from_utf8(self.get("/metrics", &[]).await.body.to_vec()).unwrap()
    }

    /// Runs `sql` (one or more statements) on the test's own connection.
    async fn exec(&self, sql: &str) {
        self.sql.batch_execute(sql).await.unwrap();
    }

    /// The one row `sql` selects.
    async fn row(&self, sql: &str) -> tokio_postgres::Row {
        self.sql.query_one(sql, &[]).await.unwrap()
    }

    /// The single value `sql` selects.
    async fn value<T: for<'a> FromSql<'a>>(&self, sql: &str) -> T {
        self.row(sql).await.get(0)
    }

    /// The first column of every row `sql` selects.
    async fn column<T: for<'a> FromSql<'a>>(&self, sql: &str) -> Vec<T> {
        let rows = self.sql.query(sql, &[]).await.unwrap();
        rows.iter().map(|row| row.get(0)).collect()
    }

    async fn count(&self, sql: &str) -> i64 {
        self.value(sql).await
    }

    /// Sends the server SIGTERM.
    async fn terminate(&self) {
        let pid = self.child.id().expect("running").to_string();
        let killed = Command::new("kill")
            .args(["-TERM", &pid])
            .status()
            .await
            .unwrap();
        assert!(killed.success());
    }

    /// Waits (bounded by `limit`) for the server process to exit.
    async fn exit_status(&mut self, limit: Duration) -> std::process::ExitStatus {
        tokio::time::timeout(limit, self.child.wait())
            .await
            .expect("the server exits after SIGTERM")
            .unwrap()
    }

    async fn stop(mut self) -> std::process::ExitStatus {
        self.terminate().await;
        self.exit_status(Duration::from_secs(20)).await
    }
}

fn order(checkout: &str) -> String {
    json!({
        "checkout_id": checkout,
        "currency": "JPY",
        "items": [{"sku": "SKU-1", "quantity": 2, "unit_price": 1200}],
        "shipping_address_id": "addr_1"
    })
    .to_string()
}

async fn serves_the_contract_table(mode: Mode) {
    let server = Server::start(mode, &[]).await;

    // New order: 201, Location, the order body; order + outbox event + memory in the database.
    let created = server.place_order("key-1", "chk_123").await;
    assert_eq!(created.status, StatusCode::CREATED);
    let body = created.json();
    let id = created.order_id();
    assert_eq!(created.headers["location"], format!("/orders/{id}"));
    assert_eq!(created.headers["content-type"], "application/json");
    assert_eq!(body["checkout_id"], "chk_123");
    assert_eq!(body["status"], "created");
    assert_eq!(body["total"], 2400);
    assert_eq!(
        body["items"],
        json!([{"sku": "SKU-1", "quantity": 2, "unit_price": 1200}])
    );
    assert!(body["created_at"].as_str().unwrap().ends_with('Z'));
    assert_eq!(server.count("SELECT count(*) FROM orders").await, 1);
    let event = server
        .row("SELECT tenant_id, aggregate_id::text, event_type FROM outbox_events")
        .await;
    assert_eq!(event.get::<_, &str>(0), "tenant-a");
    assert_eq!(event.get::<_, &str>(1), id);
    assert_eq!(event.get::<_, &str>(2), "OrderCreated");
    let record = server.row("SELECT tenant_id, endpoint, idempotency_key, response_status, expires_at > created_at + interval '23 hours' FROM idempotency_requests WHERE endpoint = 'POST /orders v1'").await;
    assert_eq!(record.get::<_, &str>(0), "tenant-a");
    assert_eq!(record.get::<_, &str>(2), "key-1");
    assert_eq!(record.get::<_, i16>(3), 201);
    assert!(record.get::<_, bool>(4), "retention defaults to 24h");

    // Same key, same request (other spelling): the first answer byte for byte.
    let same = r#"{ "trace_id": "t-9", "client_sent_at": "2026-11-30T12:00:00Z", "shipping_address_id": "addr_1",
        "items": [{"unit_price": 1200, "quantity": 2, "sku": "SKU-1"}], "currency": "JPY", "checkout_id": "chk_123", "coupon": null }"#;
    let replay = server.post_order(TOKEN_A, Some("\"key-1\""), same).await;
    assert_eq!(replay.status, StatusCode::CREATED);
    assert!(replay.replayed());
    assert_eq!(replay.body, created.body);
    assert_eq!(replay.headers["location"], created.headers["location"]);

    // Same key, different request: 409, nothing changes.
    let reused = server.place_order("key-1", "chk_other").await;
    assert_eq!(reused.status, StatusCode::CONFLICT);
    assert_eq!(reused.json()["code"], "idempotency_key_reused");
    assert_eq!(reused.headers["content-type"], "application/problem+json");

    // Bad input: clear answers, nothing remembered.
    let missing = server.post_order(TOKEN_A, None, &order("chk_2")).await;
    assert_eq!(
        missing.status_and_code(),
        (StatusCode::BAD_REQUEST, json!("idempotency_key_missing"))
    );
    let malformed = server.place_order("bad key", "chk_2").await;
    assert_eq!(
        malformed.status_and_code(),
        (StatusCode::BAD_REQUEST, json!("idempotency_key_invalid"))
    );
    let huge = format!("{{\"checkout_id\":\"{}\"}}", "x".repeat(1024 * 1024 + 1));
    let too_large = server.post_order(TOKEN_A, Some("key-huge"), &huge).await;
    assert_eq!(
        too_large.status_and_code(),
        (StatusCode::PAYLOAD_TOO_LARGE, json!("payload_too_large"))
    );
    let invalid = r#"{"checkout_id":"","currency":"yen","items":[],"shipping_address_id":"a"}"#;
    let rejected = server.post_order(TOKEN_A, Some("key-2"), invalid).await;
    assert_eq!(rejected.status, StatusCode::UNPROCESSABLE_ENTITY);
    let problem = rejected.json();
    assert_eq!(problem["code"], "validation_failed");
    let fields: Vec<&str> = problem["errors"]
        .as_array()
        .unwrap()
        .iter()
        .map(|e| e["field"].as_str().unwrap())
        .collect();
    assert_eq!(fields, ["checkout_id", "currency", "items"]);
    let unauthorized = server
        .post_order("wrong-token", Some("key-3"), &order("chk_3"))
        .await;
    assert_eq!(
        unauthorized.status_and_code(),
        (StatusCode::UNAUTHORIZED, json!("unauthorized"))
    );
    assert_eq!(
        server
            .count("SELECT count(*) FROM idempotency_requests WHERE endpoint = 'POST /orders v1'")
            .await,
        1,
        "none of these is remembered"
    );
    // A corrected body may reuse the key of the invalid one.
    let corrected = server.place_order("key-2", "chk_2").await;
    assert_eq!(corrected.status, StatusCode::CREATED);

    // Deterministic business rejections are remembered and replayed.
    let expired =
        json!({"checkout_id": "chk_c", "currency": "JPY", "items": [{"sku": "S", "unit_price": 1}],
                         "shipping_address_id": "a", "coupon": "EXPIRED-2025"})
        .to_string();
    let coupon = server
        .post_order(TOKEN_A, Some("key-coupon"), &expired)
        .await;
    assert_eq!(
        coupon.status_and_code(),
        (StatusCode::UNPROCESSABLE_ENTITY, json!("coupon_expired"))
    );
    let coupon_again = server
        .post_order(TOKEN_A, Some("key-coupon"), &expired)
        .await;
    assert!(coupon_again.replayed());
    assert_eq!(coupon_again.body, coupon.body);
    let again = server.place_order("key-again", "chk_123").await;
    assert_eq!(again.status, StatusCode::CONFLICT);
    assert_eq!(again.json()["code"], "checkout_already_ordered");
    assert_eq!(again.json()["order_id"], id.as_str());
    let again_replay = server.place_order("key-again", "chk_123").await;
    assert!(again_replay.replayed());
    let statuses: Vec<i16> = server
        .sql
        .query("SELECT response_status FROM idempotency_requests WHERE idempotency_key IN ('key-coupon', 'key-again') ORDER BY idempotency_key", &[])
        .await
        .unwrap()
        .iter()
        .map(|r| r.get(0))
        .collect();
    assert_eq!(statuses, [409, 422]);
    assert_eq!(
        server.count("SELECT count(*) FROM orders").await,
        2,
        "chk_123 and chk_2 only"
    );
    assert_eq!(server.count("SELECT count(*) FROM outbox_events").await, 2);

    // Another tenant with the same raw key: its own operation.
    let other = server
        .post_order(TOKEN_B, Some("key-1"), &order("chk_123"))
        .await;
    assert_eq!(other.status, StatusCode::CREATED);
    assert!(!other.replayed());
    assert_ne!(other.json()["id"], body["id"]);

    // Reads are scoped by tenant.
    let auth_a = [("authorization", "Bearer demo-token-a")];
    let auth_b = [("authorization", "Bearer demo-token-b")];
    let own = server.get(&format!("/orders/{id}"), &auth_a).await;
    assert_eq!(own.status, StatusCode::OK);
    assert_eq!(own.json(), body);
    let foreign = server.get(&format!("/orders/{id}"), &auth_b).await;
    assert_eq!(
        foreign.status_and_code(),
        (StatusCode::NOT_FOUND, json!("not_found"))
    );
    let unknown = server.get("/orders/not-a-uuid", &auth_a).await;
    assert_eq!(unknown.status, StatusCode::NOT_FOUND);

    // Health and metrics need no token.
    assert_eq!(server.get("/healthz", &[]).await.status, StatusCode::OK);
    // The relay's first delivery (by notification, or by its poll when the
    // server is built for a transaction pooler) makes its counter appear.
    let deadline = tokio::time::Instant::now() + Duration::from_secs(30);
    let metrics = loop {
        let metrics = server.metrics().await;
        if metrics.contains("idempotency_outbox_delivered_total") {
            break metrics;
        }
        assert!(
            tokio::time::Instant::now() < deadline,
            "the relay never delivered:\n{metrics}"
        );
        tokio::time::sleep(Duration::from_millis(50)).await;
    };
    for name in [
        "idempotency_claim_duration_seconds",
        "idempotency_key_held_seconds",
        "idempotency_cleanup_backlog",
        "idempotency_oldest_in_progress_seconds",
        "idempotency_outbox_backlog_events",
        "idempotency_outbox_lag_seconds",
        "idempotency_outbox_delivered_total",
        "idempotency_outbox_relay_restarts_total",
    ] {
        assert!(metrics.contains(name), "{name} missing from:\n{metrics}");
    }
    // Latencies are histograms with the documented buckets, not summaries
    // (a fleet's quantile needs every instance's counts).
    for bucket in ["0.001", "0.0025", "0.1", "1", "30", "+Inf"] {
        let le = format!("le=\"{bucket}\"");
        assert!(
            metrics.lines().any(|line| {
                line.starts_with("idempotency_claim_duration_seconds_bucket{") && line.contains(&le)
            }),
            "the bucket {le} missing from:\n{metrics}"
        );
    }
    assert!(!metrics.contains("quantile="), "no summaries:\n{metrics}");
    // Every metric is described: `# HELP` lines, the names unchanged by units.
    for help in [
        "# HELP idempotency_requests_total Idempotent requests by endpoint and outcome.",
        "# HELP idempotency_claim_duration_seconds ",
        "# HELP idempotency_outbox_delivered_total ",
        "# HELP idempotency_outbox_relay_restarts_total ",
    ] {
        assert!(
            metrics.lines().any(|line| line.starts_with(help)),
            "{help} missing from:\n{metrics}"
        );
    }
    for outcome in ["new", "replayed", "key_reused", "rejected"] {
        assert!(
            metrics.contains(&format!(
                "idempotency_requests_total{{endpoint=\"POST /orders v1\",outcome=\"{outcome}\"}}"
            )),
            "{outcome} missing from:\n{metrics}"
        );
    }
    assert!(server.stop().await.success(), "graceful shutdown exits 0");
}

async fn fifty_concurrent_identical_requests_make_one_order(mode: Mode) {
    let server = std::sync::Arc::new(Server::start(mode, &[]).await);
    let body = order("chk_hot");
    let tasks: Vec<_> = (0..50)
        .map(|_| {
            let (server, body) = (server.clone(), body.clone());
            tokio::spawn(async move { server.post_order(TOKEN_A, Some("hot-key"), &body).await })
        })
        .collect();
    let mut answers = Vec::new();
    for task in tasks {
        answers.push(task.await.unwrap());
    }
    assert!(
        answers.iter().all(|a| a.status == StatusCode::CREATED),
        "{:?}",
        answers.iter().map(|a| a.status).collect::<Vec<_>>()
    );
    assert!(answers.iter().all(|a| a.body == answers[0].body));
    assert_eq!(answers.iter().filter(|a| !a.replayed()).count(), 1);
    assert_eq!(server.count("SELECT count(*) FROM orders").await, 1);
    assert_eq!(server.count("SELECT count(*) FROM outbox_events").await, 1);
    assert_eq!(
        server
            .count("SELECT count(*) FROM idempotency_requests WHERE endpoint = 'POST /orders v1'")
            .await,
        1
    );
    // The key's record names the order it created.
    let order_id: String = server.value("SELECT id::text FROM orders").await;
    let resource: String = server
        .value("SELECT resource_id FROM idempotency_requests WHERE idempotency_key = 'hot-key'")
        .await;
    assert_eq!(resource, order_id);
    assert_eq!(answers[0].json()["id"], order_id);
}

async fn client_that_disconnects_after_sending_gets_its_order_on_retry(mode: Mode) {
    let server = Server::start(mode, &[]).await;
    let body = order("chk_gone");
    let stream = server.send_raw("gone-key", &body).await;
    drop(stream);
    // Whether the server got to claim the key before it noticed the client
    // had gone or not, there is one order and the retry is answered with it.
    let retry = server.post_order(TOKEN_A, Some("gone-key"), &body).await;
    assert_eq!(retry.status, StatusCode::CREATED);
    assert_eq!(
        server.count("SELECT count(*) FROM orders").await,
        1,
        "exactly one order"
    );
    let order_id: String = server.value("SELECT id::text FROM orders").await;
    assert_eq!(
        retry.json()["id"],
        order_id.as_str(),
        "the retry is answered with that order"
    );
}

/// Waits (bounded) until a request is blocked on the test's lock on `orders`.
async fn wait_for_blocked_insert(server: &Server) {
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
        "the first request holds its key and waits on the table"
    );
}

async fn request_abandoned_mid_flight_commits_and_its_retry_replays(mode: Mode) {
    let server = std::sync::Arc::new(Server::start(mode, &[]).await);
    let lock = server.lock_orders().await;
    let body = order("chk_abandoned");
    // The client goes away while its request owns the key.
    server.abandon_while_blocked("abandoned", &body).await;
    let retry = tokio::spawn({
        let server = server.clone();
        async move {
            let auth = format!("Bearer {TOKEN_A}");
            let headers = [
                ("authorization", auth.as_str()),
                ("idempotency-key", "abandoned"),
            ];
            server.call(Method::POST, "/orders", &headers, &body).await
        }
    });
    lock.release().await;
    let retry = retry.await.unwrap();
    assert_eq!(retry.status, StatusCode::CREATED);
    assert!(
        retry.headers.contains_key("idempotent-replayed"),
        "the abandoned request committed; the retry waited for it and replays it"
    );
    assert_eq!(server.count("SELECT count(*) FROM orders").await, 1);
    let order_id: String = server.value("SELECT id::text FROM orders").await;
    assert_eq!(retry.json()["id"], order_id.as_str());
}

async fn duplicate_of_a_running_request_is_told_in_progress(mode: Mode) {
    let server = std::sync::Arc::new(Server::start(mode, &[("IDEMPOTENCY_WAIT", "300ms")]).await);
    // Hold the orders table so the first request stops inside its transaction.
    let lock = server.lock_orders().await;
    let first = tokio::spawn({
        let server = server.clone();
        async move { server.place_order("slow-key", "chk_slow").await }
    });
    // Synchronise on the database: the first request is waiting for our lock.
    wait_for_blocked_insert(&server).await;
    let duplicate = server.place_order("slow-key", "chk_slow").await;
    assert_eq!(duplicate.status, StatusCode::CONFLICT);
    assert_eq!(duplicate.json()["code"], "idempotency_in_progress");
    assert!(duplicate.headers.contains_key("retry-after"));
    lock.release().await;
    let first = first.await.unwrap();
    assert_eq!(first.status, StatusCode::CREATED);
    let later = server.place_order("slow-key", "chk_slow").await;
    assert!(later.replayed());
    assert_eq!(later.body, first.body);
    assert_eq!(server.count("SELECT count(*) FROM orders").await, 1);
}

async fn database_outage_answers_503_and_the_retry_starts_afresh(mode: Mode) {
    let server = Server::start(mode, &[]).await;
    assert_eq!(
        server.place_order("warm", "chk_warm").await.status,
        StatusCode::CREATED
    );
    let name = server.db.name().to_owned();
    let admin = {
        let mut config = server.db.config();
        config.dbname("postgres");
        let (client, connection) = config.connect(tokio_postgres::NoTls).await.unwrap();
        tokio::spawn(connection);
        client
    };
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
    let down = server.place_order("during-outage", "chk_down").await;
    assert_eq!(down.status, StatusCode::SERVICE_UNAVAILABLE);
    assert_eq!(down.json()["code"], "store_unavailable");
    assert!(down.headers.contains_key("retry-after"));
    assert_eq!(
        server.get("/healthz", &[]).await.status,
        StatusCode::SERVICE_UNAVAILABLE
    );
    admin
        .batch_execute(&format!("ALTER DATABASE \"{name}\" ALLOW_CONNECTIONS true"))
        .await
        .unwrap();
    let retry = server.place_order("during-outage", "chk_down").await;
    assert_eq!(retry.status, StatusCode::CREATED);
    assert!(!retry.replayed());
    let sql = server.db.client().await;
    let orders: i64 = sql
        .query_one("SELECT count(*) FROM orders", &[])
        .await
        .unwrap()
        .get(0);
    assert_eq!(orders, 2);
}

/// A transaction of the test's own that holds `orders` locked until released.
struct OrdersLock(tokio_postgres::Client);

impl OrdersLock {
    /// Rolls the locking transaction back, letting the blocked inserts through.
    async fn release(self) {
        self.0.batch_execute("ROLLBACK").await.unwrap();
    }
}

impl Server {
    /// Locks `orders`, so that a request stops inside its transaction at its insert.
    async fn lock_orders(&self) -> OrdersLock {
        let blocker = self.db.client().await;
        blocker
            .batch_execute("BEGIN; LOCK TABLE orders IN ACCESS EXCLUSIVE MODE")
            .await
            .unwrap();
        OrdersLock(blocker)
    }

    /// Sends a POST /orders on a raw connection, waits until it is blocked on
    /// the test's lock (so it owns its key), then goes away like a client.
    async fn abandon_while_blocked(&self, key: &str, body: &str) {
        let stream = self.send_raw(key, body).await;
        wait_for_blocked_insert(self).await;
        drop(stream);
    }

    /// Writes a whole POST /orders on a raw connection and hands the
    /// connection back, so the test can drop it: a client that goes away.
    async fn send_raw(&self, key: &str, body: &str) -> tokio::net::TcpStream {
        let address = self.base.trim_start_matches("http://");
        let mut stream = tokio::net::TcpStream::connect(address).await.unwrap();
        let raw = format!(
            "POST /orders HTTP/1.1\r\nhost: {address}\r\nauthorization: Bearer {TOKEN_A}\r\n\
             content-type: application/json\r\nidempotency-key: {key}\r\ncontent-length: {}\r\n\r\n{body}",
            body.len()
        );
        stream.write_all(raw.as_bytes()).await.unwrap();
        stream
    }

    /// Waits (bounded) until the relay has published `n` events.
    async fn wait_published(&self, n: i64) {
        let published = "SELECT count(*) FROM outbox_events WHERE published_at IS NOT NULL";
        for _ in 0..1000 {
            if self.count(published).await == n {
                return;
            }
            tokio::time::sleep(Duration::from_millis(10)).await;
        }
        panic!(
            "the relay published {} of {n} events",
            self.count(published).await
        );
    }
}

async fn each_order_is_charged_once_whatever_the_deliveries(mode: Mode) {
    let server = Server::start(mode, &[]).await;
    let mut orders = Vec::new();
    for i in 0..3 {
        let created = server
            .place_order(&format!("pay-{i}"), &format!("chk_pay_{i}"))
            .await;
        assert_eq!(created.status, StatusCode::CREATED);
        orders.push(created.order_id());
    }
    server.wait_published(3).await;
    let check = |expected_attempts: i32| {
        let (server, orders) = (&server, &orders);
        async move {
            for order_id in orders {
                let charges = server
                    .sql
                    .query("SELECT idempotency_key, amount, currency, tenant_id FROM payment_charges WHERE order_id = $1", &[order_id])
                    .await
                    .unwrap();
                assert_eq!(charges.len(), 1, "one charge for order {order_id}");
                let tenant: String = server
                    .sql
                    .query_one(
                        "SELECT tenant_id FROM outbox_events WHERE aggregate_id = $1",
                        &[order_id],
                    )
                    .await
                    .unwrap()
                    .get(0);
                let derived = |operation| derive_tenant_key(&tenant, order_id, operation);
                assert_eq!(charges[0].get::<_, &str>(0), derived("payment.charge"));
                assert_eq!(charges[0].get::<_, i64>(1), 2400);
                assert_eq!(charges[0].get::<_, &str>(2), "JPY");
                assert_eq!(
                    charges[0].get::<_, &str>(3),
                    "order-service",
                    "the provider's tenant is the caller"
                );
                let reservation: String = server
                    .sql
                    .query_one(
                        "SELECT idempotency_key FROM inventory_reservations WHERE order_id = $1",
                        &[order_id],
                    )
                    .await
                    .unwrap()
                    .get(0);
                assert_eq!(reservation, derived("inventory.reserve"));
                assert_ne!(
                    reservation,
                    derived("payment.charge"),
                    "two operations, two keys"
                );
                let attempts: i32 = server
                    .sql
                    .query_one(
                        "SELECT attempts FROM outbox_events WHERE aggregate_id = $1",
                        &[order_id],
                    )
                    .await
                    .unwrap()
                    .get(0);
                assert_eq!(attempts, expected_attempts);
            }
        }
    };
    check(1).await;
    // An operator forces redelivery of everything.
    server
        .exec("UPDATE outbox_events SET published_at = NULL")
        .await;
    server.wait_published(3).await;
    check(2).await;
    assert_eq!(
        server.count("SELECT count(*) FROM payment_charges").await,
        3
    );
    assert_eq!(
        server.count("SELECT count(*) FROM idempotency_requests WHERE endpoint = 'POST /charges v1' AND tenant_id = 'order-service'").await,
        3,
        "the provider remembered one operation per derived key and replayed the redeliveries"
    );
}

async fn expired_key_is_a_new_operation_but_the_checkout_rule_stands(mode: Mode) {
    let server = Server::start(mode, &[("IDEMPOTENCY_RETENTION", "1h")]).await;
    let first = server.place_order("retained", "chk_retained").await;
    assert_eq!(first.status, StatusCode::CREATED);
    // The retention counts from when the key's record is written
    // (`created_at`): the claim in the claim-first mode, the commit in the
    // one-commit mode (docs/modes.md: the record goes in with the COMMIT).
    let window: f64 = server
        .value("SELECT extract(epoch from expires_at - created_at)::float8 FROM idempotency_requests WHERE idempotency_key = 'retained'")
        .await;
    assert_eq!(window, 3600.0, "IDEMPOTENCY_RETENTION sets expires_at");
    let created_first: bool = server
        .value("SELECT created_at <= completed_at AND completed_at < expires_at FROM idempotency_requests WHERE idempotency_key = 'retained'")
        .await;
    assert!(created_first, "created, completed, then expires");
    assert!(
        server
            .place_order("retained", "chk_retained")
            .await
            .replayed(),
        "not yet expired: replay"
    );
    let first_token: i64 = server
        .value("SELECT attempt_token FROM idempotency_requests WHERE idempotency_key = 'retained'")
        .await;
    // The retention passes.
    server.exec("UPDATE idempotency_requests SET expires_at = now() - interval '1 second' WHERE idempotency_key = 'retained'").await;
    let after = server.place_order("retained", "chk_retained").await;
    assert!(!after.replayed(), "an expired key is a new operation");
    assert_eq!(after.status, StatusCode::CONFLICT);
    assert_eq!(
        after.json()["code"],
        "checkout_already_ordered",
        "the domain rule outlives the retention"
    );
    assert_eq!(after.json()["order_id"], first.json()["id"]);
    assert_eq!(server.count("SELECT count(*) FROM orders").await, 1);
    let row = server.row("SELECT attempt_token, response_status FROM idempotency_requests WHERE idempotency_key = 'retained'").await;
    // Tokens come from one sequence shared with the providers' keys: larger, not necessarily next.
    assert!(
        row.get::<_, i64>(0) > first_token,
        "a new attempt gets a larger token"
    );
    assert_eq!(row.get::<_, i16>(1), 409);
}

async fn redelivery_after_the_providers_keys_expired_still_charges_once(mode: Mode) {
    let server = Server::start(mode, &[]).await;
    let created = server.place_order("late", "chk_late").await;
    let order_id = created.order_id();
    server.wait_published(1).await;
    // A day later the providers' keys have expired; then an operator re-drives.
    server
        .exec(
            "UPDATE idempotency_requests SET expires_at = now() - interval '1 second' WHERE endpoint <> 'POST /orders v1';
             UPDATE outbox_events SET published_at = NULL;",
        )
        .await;
    server.wait_published(1).await;
    let row = server
        .row("SELECT attempts, last_error IS NULL FROM outbox_events")
        .await;
    assert_eq!(
        (row.get::<_, i32>(0), row.get::<_, bool>(1)),
        (2, true),
        "the re-drive was delivered"
    );
    assert_eq!(
        server.count("SELECT count(*) FROM payment_charges").await,
        1
    );
    let charged: String = server.value("SELECT order_id FROM payment_charges").await;
    assert_eq!(charged, order_id);
}

async fn shutdown_lets_an_abandoned_request_commit(mode: Mode) {
    let mut server = Server::start(mode, &[]).await;
    let lock = server.lock_orders().await;
    server
        .abandon_while_blocked("at-shutdown", &order("chk_shutdown"))
        .await;
    server.terminate().await;
    lock.release().await;
    let status = server.exit_status(Duration::from_secs(30)).await;
    assert!(status.success());
    let orders = server.count("SELECT count(*) FROM orders").await;
    assert_eq!(
        orders, 1,
        "the request owned its key, so it committed before the server exited"
    );
    let state: String = server
        .value("SELECT state FROM idempotency_requests WHERE idempotency_key = 'at-shutdown'")
        .await;
    assert_eq!(state, "completed");
}

async fn every_route_but_health_and_metrics_needs_a_token(mode: Mode) {
    let server = Server::start(mode, &[]).await;
    let unknown = server.get("/nope", &[]).await;
    assert_eq!(
        unknown.status_and_code(),
        (StatusCode::UNAUTHORIZED, json!("unauthorized"))
    );
    let known = server
        .get("/nope", &[("authorization", "Bearer demo-token-a")])
        .await;
    assert_eq!(
        known.status_and_code(),
        (StatusCode::NOT_FOUND, json!("not_found"))
    );
    let lower = server.place_order("lower", "chk_lower").await;
    assert_eq!(lower.status, StatusCode::CREATED);
    let scheme = server
        .call(
            Method::POST,
            "/orders",
            &[
                ("authorization", "bearer demo-token-a"),
                ("idempotency-key", "lower-2"),
            ],
            &order("chk_lower_2"),
        )
        .await;
    assert_eq!(
        scheme.status,
        StatusCode::CREATED,
        "the auth scheme is case-insensitive"
    );
    let metrics = server.metrics().await;
    assert!(
        metrics.contains(
            "idempotency_requests_total{endpoint=\"POST /orders v1\",outcome=\"in_progress\"} 0"
        ),
        "every outcome's series exists from the start:\n{metrics}"
    );
}

/// Starts the server with `env` and a database it never reaches (refused
/// before connecting); it must exit 1 without listening, having said why
/// in one line, returned.
async fn refused_at_start(env: &[(&str, &str)]) -> String {
    let out = Command::new(example_binary())
        .env("DATABASE_URL", "postgres://nobody@127.0.0.1:9/nothing")
        .env("ORDER_SERVER_ADDR", "127.0.0.1:0")
        .env("RUST_LOG", "off")
        .envs(env.iter().copied())
        .stdin(Stdio::null())
        .kill_on_drop(true)
        .output()
        .await
        .unwrap();
    assert_eq!(out.status.code(), Some(1));
    assert!(out.stdout.is_empty(), "it never listened");
    let stderr = String::from_utf8_lossy(&out.stderr).into_owned();
    let lines: Vec<&str> = stderr.lines().collect();
    assert_eq!(lines.len(), 1, "{stderr}");
    stderr
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_unknown_idempotency_mode_stops_the_start_in_one_line() {
    let line = refused_at_start(&[("IDEMPOTENCY_MODE", "claim-later")]).await;
    assert!(
        line.contains("IDEMPOTENCY_MODE=\"claim-later\"")
            && line.contains("claim-first")
            && line.contains("one-commit"),
        "names the variable, the value and the modes: {line}"
    );
}

/// A retention shorter than the claim-first mode's work may take is
/// refused at start, in one line naming both values, never raised behind
/// the operator's back; the one-commit mode (retention from the commit)
/// takes it.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_retention_shorter_than_the_work_is_refused_at_start_in_the_claim_first_mode() {
    let line = refused_at_start(&[("IDEMPOTENCY_RETENTION", "2s")]).await;
    assert!(
        line.contains("IDEMPOTENCY_RETENTION=2s")
            && line.contains("IDEMPOTENCY_HANDLER_TIMEOUT=30s"),
        "names both values: {line}"
    );
    let server = Server::start(Mode::OneCommit, &[("IDEMPOTENCY_RETENTION", "2s")]).await;
    assert_eq!(
        server.place_order("short", "chk_short").await.status,
        StatusCode::CREATED
    );
    let window: f64 = server
        .value("SELECT extract(epoch from expires_at - created_at)::float8 FROM idempotency_requests WHERE idempotency_key = 'short'")
        .await;
    assert_eq!(window, 2.0, "the one-commit mode keeps 2s as given");
}

/// The retention is what was configured, to the second: with a 2 s handler
/// timeout an 8 s retention is allowed, a key replays before 8 s and is a
/// new operation after 9 s (its new request creates a new order, under a
/// new id; its old request meets the checkout rule).
async fn the_configured_retention_is_what_is_remembered(mode: Mode) {
    let server = Server::start(
        mode,
        &[
            ("IDEMPOTENCY_HANDLER_TIMEOUT", "2s"),
            ("IDEMPOTENCY_RETENTION", "8s"),
        ],
    )
    .await;
    let first = server.place_order("eight", "chk_eight").await;
    assert_eq!(first.status, StatusCode::CREATED);
    let started = std::time::Instant::now();
    let window: f64 = server
        .value("SELECT extract(epoch from expires_at - created_at)::float8 FROM idempotency_requests WHERE idempotency_key = 'eight'")
        .await;
    assert_eq!(window, 8.0, "IDEMPOTENCY_RETENTION sets expires_at exactly");
    let replay = server.place_order("eight", "chk_eight").await;
    assert!(
        started.elapsed() < Duration::from_secs(8),
        "the replay was sent within the retention"
    );
    assert!(replay.replayed(), "within 8 s: replayed");
    assert_eq!(replay.body, first.body);
    // The retention passes on the clock (nothing is changed by hand here):
    // this waits for time itself, not for another task.
    let expired_at: f64 = server
        .value("SELECT extract(epoch from expires_at - now())::float8 FROM idempotency_requests WHERE idempotency_key = 'eight'")
        .await;
    tokio::time::sleep(Duration::from_secs_f64(expired_at.max(0.0) + 1.0)).await;
    let again = server.place_order("eight", "chk_eight_b").await;
    assert_eq!(again.status, StatusCode::CREATED, "{:?}", again.json());
    assert!(!again.replayed(), "after 9 s: a new operation");
    assert_ne!(
        again.order_id(),
        first.order_id(),
        "a new request, a new order id"
    );
    let orders: Vec<String> = server
        .column("SELECT checkout_id FROM orders ORDER BY created_at")
        .await;
    assert_eq!(orders, ["chk_eight", "chk_eight_b"]);
    let row = server
        .row("SELECT response_status, extract(epoch from expires_at - created_at)::float8 FROM idempotency_requests WHERE idempotency_key = 'eight'")
        .await;
    assert_eq!((row.get::<_, i16>(0), row.get::<_, f64>(1)), (201, 8.0));
}

/// Once a key expired, a new request under it creates a new order with a
/// new id (the id derives from the request too, not from the key alone),
/// in both modes; the first request again under the key meets the checkout
/// rule, naming the first order.
async fn an_expired_key_with_a_new_request_creates_a_new_order(mode: Mode) {
    let server = Server::start(mode, &[]).await;
    let first = server.place_order("kk1", "chk_kk1_a").await;
    assert_eq!(first.status, StatusCode::CREATED);
    server.exec("UPDATE idempotency_requests SET expires_at = now() - interval '1 second' WHERE idempotency_key = 'kk1'").await;
    let second = server.place_order("kk1", "chk_kk1_b").await;
    assert_eq!(second.status, StatusCode::CREATED, "{:?}", second.json());
    assert_ne!(second.order_id(), first.order_id());
    assert_eq!(second.json()["checkout_id"], "chk_kk1_b");
    let orders: Vec<String> = server
        .column("SELECT id::text FROM orders ORDER BY created_at")
        .await;
    assert_eq!(orders, [first.order_id(), second.order_id()]);
    let events: i64 = server
        .count("SELECT count(DISTINCT aggregate_id) FROM outbox_events WHERE event_type = 'OrderCreated'")
        .await;
    assert_eq!(events, 2, "one event per order");
    // The first request again, after the second's record expired too.
    server.exec("UPDATE idempotency_requests SET expires_at = now() - interval '1 second' WHERE idempotency_key = 'kk1'").await;
    let third = server.place_order("kk1", "chk_kk1_a").await;
    assert_eq!(third.status, StatusCode::CONFLICT);
    assert_eq!(third.json()["code"], "checkout_already_ordered");
    assert_eq!(third.json()["order_id"], first.json()["id"]);
    assert_eq!(server.count("SELECT count(*) FROM orders").await, 2);
}

// Every test above posts orders: each runs in both modes of POST /orders.
both_modes!(
    serves_the_contract_table,
    fifty_concurrent_identical_requests_make_one_order,
    client_that_disconnects_after_sending_gets_its_order_on_retry,
    request_abandoned_mid_flight_commits_and_its_retry_replays,
    duplicate_of_a_running_request_is_told_in_progress,
    database_outage_answers_503_and_the_retry_starts_afresh,
    each_order_is_charged_once_whatever_the_deliveries,
    expired_key_is_a_new_operation_but_the_checkout_rule_stands,
    the_configured_retention_is_what_is_remembered,
    an_expired_key_with_a_new_request_creates_a_new_order,
    redelivery_after_the_providers_keys_expired_still_charges_once,
    shutdown_lets_an_abandoned_request_commit,
    every_route_but_health_and_metrics_needs_a_token,
);
