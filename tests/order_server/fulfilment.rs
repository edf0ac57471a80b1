//! `POST /orders/{id}/fulfilment`, the example order server's long-running
//! operation, checked as a process against a throwaway PostgreSQL: the 202
//! and status resource, the contract table, and what happens when an owner
//! is killed (SIGKILL) or stalls (SIGSTOP) mid-fulfilment while another
//! server process takes over or the recovery worker re-drives it. Every
//! wait is a poll of the database, the status resource or `/metrics` with
//! a bounded deadline, never a sleep standing in for a condition.

use crate::common::example_binary;

use example_binary::{example_binary, Answer};

use std::{future::Future, process::Stdio, time::Duration};

use bytes::Bytes;
use http::{Method, Request, StatusCode};
use http_body_util::{BodyExt, Full};
use hyper_util::{client::legacy::Client, rt::TokioExecutor};
use serde_json::{json, Value};
use tokio::{
    io::{AsyncBufReadExt, BufReader},
    process::{Child, Command},
};
use tokio_postgres::types::{FromSql, ToSql};
use tower_idempotency::{
    fingerprint::Fingerprint,
    outbox::derive_key,
    scope::{Scope, TenantId},
    testing::TestDatabase,
};

const TOKEN_A: &str = "demo-token-a";
const TOKEN_B: &str = "demo-token-b";
const ENDPOINT: &str = "POST /orders/{id}/fulfilment v1";
const TOKYO: &str = r#"{"warehouse":"tokyo-1"}"#;
/// How long any awaited condition may take before the test fails.
const DEADLINE: Duration = Duration::from_secs(30);

/// The test's database, shared by every server process of a test.
struct Db {
    db: TestDatabase,
    sql: tokio_postgres::Client,
}

impl Db {
    async fn create() -> Db {
        let db = TestDatabase::create().await;
        let sql = db.client().await;
        Db { db, sql }
    }

    async fn row(&self, sql: &str, params: &[&(dyn ToSql + Sync)]) -> tokio_postgres::Row {
        self.sql.query_one(sql, params).await.unwrap()
    }

    async fn value<T: for<'a> FromSql<'a>>(&self, sql: &str, params: &[&(dyn ToSql + Sync)]) -> T {
        self.row(sql, params).await.get(0)
    }

    async fn count(&self, sql: &str, params: &[&(dyn ToSql + Sync)]) -> i64 {
        self.value(sql, params).await
    }

    /// The attempt token of the fulfilment record under `key` (tenant A).
    async fn token(&self, key: &str) -> i64 {
        self.value(
            "SELECT attempt_token FROM idempotency_requests WHERE endpoint = $1 AND idempotency_key = $2",
            &[&ENDPOINT, &key],
        )
        .await
    }

    async fn state(&self, key: &str) -> Option<String> {
        self.sql
            .query_opt(
                "SELECT state FROM idempotency_requests WHERE endpoint = $1 AND idempotency_key = $2",
                &[&ENDPOINT, &key],
            )
            .await
            .unwrap()
            .map(|row| row.get(0))
    }

    /// Waits until the lease of the record under `key` has run out.
    async fn lease_expired(&self, key: &str) {
        eventually("the lease to expire", || async {
            self.count(
                "SELECT count(*) FROM idempotency_requests WHERE endpoint = $1 AND idempotency_key = $2 \
                 AND state = 'in_progress' AND lease_expires_at <= now()",
                &[&ENDPOINT, &key],
            )
            .await
                == 1
        })
        .await;
    }

    /// Holds the record under `key` `FOR SHARE` on a connection of the test's own.
    ///
    /// A recovery worker (`FOR UPDATE SKIP LOCKED`) then passes the record
    /// by, while a request's takeover (an `INSERT … ON CONFLICT DO UPDATE`)
    /// queues behind the hold and is first in line once it is released:
    /// the test decides that the request takes the operation over, not
    /// the worker of whichever server process polls first.
    async fn hold_record(&self, key: &str) -> tokio_postgres::Client {
        let hold = self.db.client().await;
        hold.batch_execute("BEGIN").await.unwrap();
        let held = hold
            .query(
                "SELECT 1 FROM idempotency_requests WHERE endpoint = $1 AND idempotency_key = $2 FOR SHARE",
                &[&ENDPOINT, &key],
            )
            .await
            .unwrap();
        assert_eq!(held.len(), 1);
        hold
    }

    /// Waits until a statement starting with `prefix` waits for a row lock.
    async fn blocked(&self, prefix: &str) {
        let pattern = format!("{prefix}%");
        eventually("a statement to wait for the test's lock", || async {
            self.count(
                "SELECT count(*) FROM pg_stat_activity WHERE wait_event_type = 'Lock' AND query LIKE $1",
                &[&pattern],
            )
            .await
                > 0
        })
        .await;
    }

    /// The warehouse's idempotency key for the fulfilment under `key`
    /// (tenant A): derived from the operation (tenant, endpoint, key and
    /// the request's fingerprint, read from its record), so that a
    /// fulfilment lost in an asynchronous failover and started again by the
    /// client's retry ships under the same key.
    async fn shipment_key(&self, key: &str) -> String {
        let stored: Vec<u8> = self
            .value(
                "SELECT request_fingerprint FROM idempotency_requests WHERE endpoint = $1 AND idempotency_key = $2",
                &[&ENDPOINT, &key],
            )
            .await;
        let fingerprint = Fingerprint::from_slice(&stored).expect("a 32-byte fingerprint");
        let scope = Scope::new(TenantId::new("tenant-a"), ENDPOINT);
        derive_key(
            &scope.derived_id(key, &fingerprint, "shipment"),
            "warehouse.ship",
        )
    }

    /// The shipments of `order_id`: (shipment_id, idempotency_key, fencing_token).
    async fn shipments(&self, order_id: &str) -> Vec<(String, String, i64)> {
        self.sql
            .query(
                "SELECT shipment_id, idempotency_key, fencing_token FROM warehouse_shipments WHERE order_id = $1",
                &[&order_id],
            )
            .await
            .unwrap()
            .iter()
            .map(|r| (r.get(0), r.get(1), r.get(2)))
            .collect()
    }
}

/// Polls `probe` until it holds, failing the test after [`DEADLINE`].
async fn eventually<F, Fut>(what: &str, mut probe: F)
where
    F: FnMut() -> Fut,
    Fut: Future<Output = bool>,
{
    let deadline = tokio::time::Instant::now() + DEADLINE;
    while !probe().await {
        assert!(
            tokio::time::Instant::now() < deadline,
            "timed out waiting for {what}"
        );
        tokio::time::sleep(Duration::from_millis(25)).await;
    }
}

impl Answer {
    /// The operation id of a `202`, checked against its `Location`.
    fn operation_id(&self) -> String {
        assert_eq!(self.status, StatusCode::ACCEPTED, "{self:?}");
        let id = self.json()["operation_id"].as_str().unwrap().to_owned();
        assert_eq!(self.headers["location"], format!("/operations/{id}"));
        assert_eq!(
            self.body,
            format!(r#"{{"operation_id":"{id}","state":"running"}}"#).as_bytes(),
            "the 202 body"
        );
        id
    }
}

/// One server process.
struct Server {
    child: Child,
    base: String,
    http: Client<hyper_util::client::legacy::connect::HttpConnector, Full<Bytes>>,
}

impl Server {
    async fn start(db: &Db, env: &[(&str, &str)]) -> Server {
        let mut child = Command::new(example_binary())
            .env("DATABASE_URL", db.db.connection_string())
            .env("ORDER_SERVER_ADDR", "127.0.0.1:0")
            .env("RUST_LOG", "warn")
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
        Server {
            child,
            base,
            http: Client::builder(TokioExecutor::new()).build_http(),
        }
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

    /// Creates an order as tenant A and returns the answer.
    async fn create_order(&self, checkout: &str) -> Answer {
        let body = json!({
            "checkout_id": checkout,
            "currency": "JPY",
            "items": [{"sku": "SKU-1", "quantity": 2, "unit_price": 1200}],
            "shipping_address_id": "addr_1"
        })
        .to_string();
        let key = format!("order-{checkout}");
        let auth = format!("Bearer {TOKEN_A}");
        let headers = [
            ("authorization", auth.as_str()),
            ("content-type", "application/json"),
            ("idempotency-key", key.as_str()),
        ];
        let created = self.call(Method::POST, "/orders", &headers, &body).await;
        assert_eq!(created.status, StatusCode::CREATED);
        created
    }

    /// Creates an order as tenant A and returns its id.
    async fn order(&self, checkout: &str) -> String {
        self.create_order(checkout).await.json()["id"]
            .as_str()
            .unwrap()
            .to_owned()
    }

    /// `POST /orders/{order_id}/fulfilment` as `token` under `key`.
    async fn fulfil_as(&self, token: &str, key: &str, order_id: &str, body: &str) -> Answer {
        let auth = format!("Bearer {token}");
        let headers = [
            ("authorization", auth.as_str()),
            ("content-type", "application/json"),
            ("idempotency-key", key),
        ];
        let path = format!("/orders/{order_id}/fulfilment");
        self.call(Method::POST, &path, &headers, body).await
    }

    /// `POST /orders/{order_id}/fulfilment` as tenant A under `key`.
    async fn fulfil(&self, key: &str, order_id: &str, body: &str) -> Answer {
        self.fulfil_as(TOKEN_A, key, order_id, body).await
    }

    async fn get_as(&self, token: &str, path: &str) -> Answer {
        let auth = format!("Bearer {token}");
        self.call(Method::GET, path, &[("authorization", auth.as_str())], "")
            .await
    }

    /// Polls `GET /operations/{id}` (tenant A) until completed; its body.
    async fn completed(&self, operation_id: &str) -> Value {
        let path = format!("/operations/{operation_id}");
        let deadline = tokio::time::Instant::now() + DEADLINE;
        loop {
            let answer = self.get_as(TOKEN_A, &path).await;
            assert_eq!(answer.status, StatusCode::OK, "{answer:?}");
            let status = answer.json();
            assert_eq!(status["operation_id"], operation_id);
            if status["state"] == "completed" {
                return status;
            }
            assert_eq!(status["state"], "running");
            assert!(
                tokio::time::Instant::now() < deadline,
                "timed out waiting for the operation to complete"
            );
            tokio::time::sleep(Duration::from_millis(25)).await;
        }
    }

    async fn metrics(&self) -> String {
        let answer = self.call(Method::GET, "/metrics", &[], "").await;
        String::from_utf8(answer.body.to_vec()).unwrap()
    }

    fn pid(&self) -> String {
        self.child.id().expect("running").to_string()
    }

    async fn signal(&self, signal: &str) {
        let sent = Command::new("kill")
            .args([signal, &self.pid()])
            .status()
            .await
            .unwrap();
        assert!(sent.success(), "kill {signal}");
    }

    /// SIGKILL: the process dies on the spot, mid-work.
    async fn kill(mut self) {
        self.child.start_kill().unwrap();
        tokio::time::timeout(DEADLINE, self.child.wait())
            .await
            .expect("the killed server exits")
            .unwrap();
    }

    /// SIGTERM, and the exit status.
    async fn stop(mut self) -> std::process::ExitStatus {
        self.signal("-TERM").await;
        tokio::time::timeout(DEADLINE, self.child.wait())
            .await
            .expect("the server exits after SIGTERM")
            .unwrap()
    }
}

/// The sum of every series of the metric `name` in a Prometheus text.
fn metric(text: &str, name: &str) -> f64 {
    text.lines()
        .filter(|line| {
            line.strip_prefix(name)
                .is_some_and(|rest| rest.starts_with('{') || rest.starts_with(' '))
        })
        .filter_map(|line| line.rsplit(' ').next()?.parse::<f64>().ok())
        .sum()
}

/// [`metric`], of the series whose labels contain `labels`.
fn metric_where(text: &str, name: &str, labels: &str) -> f64 {
    let lines: Vec<&str> = text.lines().filter(|l| l.contains(labels)).collect();
    metric(&lines.join("\n"), name)
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn fulfilment_runs_as_a_long_running_operation() {
    let db = Db::create().await;
    // The warehouse takes longer than the 1 s the first request waits.
    let server = Server::start(
        &db,
        &[("IDEMPOTENCY_LEASE", "1s"), ("FULFILMENT_DELAY", "3s")],
    )
    .await;
    let created = server.create_order("chk_ship").await;
    let order_id = created.json()["id"].as_str().unwrap().to_owned();

    // Work still running after 1 s: 202, Location, {"operation_id", "state": "running"}.
    let accepted = server.fulfil("ship-1", &order_id, TOKYO).await;
    let operation_id = accepted.operation_id();
    assert!(!accepted.replayed());
    assert_eq!(accepted.headers["content-type"], "application/json");
    let record = db
        .row(
            "SELECT state, operation_id::text, tenant_id FROM idempotency_requests WHERE endpoint = $1 AND idempotency_key = 'ship-1'",
            &[&ENDPOINT],
        )
        .await;
    assert_eq!(
        record.get::<_, &str>(0),
        "in_progress",
        "committed before the work ends"
    );
    assert_eq!(record.get::<_, &str>(1), operation_id);
    assert_eq!(record.get::<_, &str>(2), "tenant-a");

    // A duplicate while it runs: the same 202, marked replayed, and no second execution.
    let duplicate = server.fulfil("ship-1", &order_id, TOKYO).await;
    assert_eq!(duplicate.status, StatusCode::ACCEPTED);
    assert!(duplicate.replayed());
    assert_eq!(duplicate.body, accepted.body);
    assert_eq!(duplicate.headers["location"], accepted.headers["location"]);
    let status_path = format!("/operations/{operation_id}");
    let running = server.get_as(TOKEN_A, &status_path).await;
    if running.json()["state"] == "running" {
        assert_eq!(
            running.json(),
            json!({"operation_id": operation_id, "state": "running", "attempts": 1}),
            "no result while it runs"
        );
    }

    // Completed: the status resource shows the final answer.
    let status = server.completed(&operation_id).await;
    let result = &status["result"];
    assert_eq!(result["status"], 200);
    let shipment_id = result["body"]["shipment_id"].as_str().unwrap().to_owned();
    assert!(shipment_id.starts_with("shp_"));
    let resource: String = db
        .value(
            "SELECT resource_id FROM idempotency_requests WHERE idempotency_key = 'ship-1'",
            &[],
        )
        .await;
    assert_eq!(
        resource, shipment_id,
        "the record names the shipment it created"
    );
    assert_eq!(
        result["body"],
        json!({"order_id": order_id, "warehouse": "tokyo-1", "shipment_id": shipment_id, "status": "shipped"})
    );

    // A duplicate now: the final answer byte for byte, fields in the documented order.
    let replay = server.fulfil("ship-1", &order_id, TOKYO).await;
    assert_eq!(replay.status, StatusCode::OK);
    assert!(replay.replayed());
    assert_eq!(replay.headers["content-type"], "application/json");
    assert_eq!(replay.json(), result["body"], "the status result's body");
    assert_eq!(
        replay.body,
        format!(
            r#"{{"order_id":"{order_id}","warehouse":"tokyo-1","shipment_id":"{shipment_id}","status":"shipped"}}"#
        )
        .as_bytes()
    );
    let again = server.fulfil("ship-1", &order_id, TOKYO).await;
    assert_eq!(again.body, replay.body);

    // The database: one shipment, keyed by the operation, fenced by the record's token.
    let record = db
        .row(
            "SELECT attempt_token, response_status, state FROM idempotency_requests WHERE endpoint = $1 AND idempotency_key = 'ship-1'",
            &[&ENDPOINT],
        )
        .await;
    assert_eq!(record.get::<_, i16>(1), 200);
    assert_eq!(record.get::<_, &str>(2), "completed");
    let shipments = db.shipments(&order_id).await;
    assert_eq!(
        shipments,
        [(
            shipment_id.clone(),
            db.shipment_key("ship-1").await,
            record.get::<_, i64>(0)
        )],
        "exactly one shipment, with the operation's derived key and the attempt's token"
    );
    assert_eq!(
        db.count("SELECT count(*) FROM warehouse_shipments", &[])
            .await,
        1
    );

    // The order shows it, and its answer is otherwise unchanged.
    let order = server.get_as(TOKEN_A, &format!("/orders/{order_id}")).await;
    assert_eq!(order.status, StatusCode::OK);
    assert_eq!(order.json()["fulfilment"], "shipped");
    let created_text = std::str::from_utf8(&created.body).unwrap();
    assert_eq!(
        std::str::from_utf8(&order.body).unwrap(),
        format!(
            "{},\"fulfilment\":\"shipped\"}}",
            created_text.strip_suffix('}').unwrap()
        ),
        "the order as created, with the fulfilment last"
    );
    let (fulfilment, shipped_as): (String, String) = {
        let row = db
            .row(
                "SELECT fulfilment, shipment_id FROM orders WHERE id = $1::text::uuid",
                &[&order_id],
            )
            .await;
        (row.get(0), row.get(1))
    };
    assert_eq!(
        (fulfilment.as_str(), shipped_as.as_str()),
        ("shipped", shipment_id.as_str())
    );

    // The status resource is the starting tenant's only; ids cannot be probed.
    let foreign = server.get_as(TOKEN_B, &status_path).await;
    assert_eq!(
        foreign.status_and_code(),
        (StatusCode::NOT_FOUND, json!("not_found"))
    );
    let malformed = server.get_as(TOKEN_A, "/operations/not-an-id").await;
    assert_eq!(
        malformed.status_and_code(),
        (StatusCode::NOT_FOUND, json!("not_found"))
    );
    let unknown = server
        .get_as(TOKEN_A, "/operations/2b7e1516-28ae-4d2a-a6ab-f7158809cf4f")
        .await;
    assert_eq!(
        unknown.status_and_code(),
        (StatusCode::NOT_FOUND, json!("not_found"))
    );
    assert_eq!(
        unknown.body, foreign.body,
        "the same 404 for every stranger"
    );
    let anonymous = server.call(Method::GET, &status_path, &[], "").await;
    assert_eq!(
        anonymous.status_and_code(),
        (StatusCode::UNAUTHORIZED, json!("unauthorized"))
    );

    let metrics = server.metrics().await;
    for name in [
        "idempotency_operations_running",
        "idempotency_lease_takeovers_total",
        "idempotency_fenced_total",
        "warehouse_stale_refusals_total",
    ] {
        assert!(metrics.contains(name), "{name} missing from:\n{metrics}");
    }
    assert!(server.stop().await.success(), "graceful shutdown exits 0");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn fulfilment_answers_the_contract_table() {
    let db = Db::create().await;
    // A warehouse without delay: every fulfilment finishes within 1 s and
    // is answered directly.
    let server = Server::start(&db, &[("FULFILMENT_DELAY", "0s")]).await;
    let order_id = server.order("chk_table").await;
    let other_order = server.order("chk_table_2").await;

    let first = server.fulfil("ship-t", &order_id, TOKYO).await;
    assert_eq!(
        first.status,
        StatusCode::OK,
        "finished within 1 s: the final answer directly"
    );
    assert!(!first.replayed());
    let shipment_id = first.json()["shipment_id"].as_str().unwrap().to_owned();

    // Same key, different request: another body, or the same body for another order.
    let reused = server
        .fulfil("ship-t", &order_id, r#"{"warehouse":"osaka-1"}"#)
        .await;
    assert_eq!(
        reused.status_and_code(),
        (StatusCode::CONFLICT, json!("idempotency_key_reused"))
    );
    let other_path = server.fulfil("ship-t", &other_order, TOKYO).await;
    assert_eq!(
        other_path.status_and_code(),
        (StatusCode::CONFLICT, json!("idempotency_key_reused")),
        "the target is part of the request"
    );
    // Same request in another spelling: replayed.
    let spelled = server
        .fulfil(
            "ship-t",
            &order_id,
            r#"{ "trace": 1, "warehouse" : "tokyo-1" }"#,
        )
        .await;
    assert!(spelled.replayed());
    assert_eq!(spelled.body, first.body);

    // Invalid bodies: 422 with the field, not remembered; a corrected body may reuse the key.
    let too_long = json!({"warehouse": "w".repeat(65)}).to_string();
    for invalid in [
        r#"{"warehouse":""}"#,
        r#"{"warehouse":"  "}"#,
        r#"{"warehouse":7}"#,
        r#"{"warehouse":"tokyo\u0000"}"#,
        too_long.as_str(),
        "{}",
        "not json",
    ] {
        let rejected = server.fulfil("ship-v", &other_order, invalid).await;
        assert_eq!(
            rejected.status_and_code(),
            (StatusCode::UNPROCESSABLE_ENTITY, json!("validation_failed")),
            "{invalid}"
        );
        if invalid.contains("warehouse") {
            assert_eq!(
                rejected.json()["errors"][0]["field"],
                "warehouse",
                "{invalid}"
            );
        }
    }
    let longest = json!({"warehouse": "w".repeat(64)}).to_string();
    assert_eq!(
        db.state("ship-v").await,
        None,
        "no invalid body is remembered"
    );
    // Too large, and no key: refused before anything is remembered.
    let huge = format!("{{\"warehouse\":\"{}\"}}", "x".repeat(1024 * 1024 + 1));
    let too_large = server.fulfil("ship-huge", &other_order, &huge).await;
    assert_eq!(
        too_large.status_and_code(),
        (StatusCode::PAYLOAD_TOO_LARGE, json!("payload_too_large"))
    );
    let auth = format!("Bearer {TOKEN_A}");
    let keyless = server
        .call(
            Method::POST,
            &format!("/orders/{other_order}/fulfilment"),
            &[
                ("authorization", auth.as_str()),
                ("content-type", "application/json"),
            ],
            TOKYO,
        )
        .await;
    assert_eq!(
        keyless.status_and_code(),
        (StatusCode::BAD_REQUEST, json!("idempotency_key_missing"))
    );
    let anonymous = server
        .call(
            Method::POST,
            &format!("/orders/{other_order}/fulfilment"),
            &[("idempotency-key", "ship-anon")],
            TOKYO,
        )
        .await;
    assert_eq!(
        anonymous.status_and_code(),
        (StatusCode::UNAUTHORIZED, json!("unauthorized"))
    );
    assert_eq!(db.state("ship-huge").await, None);
    let corrected = server.fulfil("ship-v", &other_order, &longest).await;
    assert_eq!(corrected.status, StatusCode::OK, "64 characters are fine");
    assert_eq!(corrected.json()["warehouse"], "w".repeat(64));

    // Unknown, malformed and other tenants' orders: 404, remembered (final) and replayed.
    for (key, token, path_id) in [
        (
            "ship-unknown",
            TOKEN_A,
            "2b7e1516-28ae-4d2a-a6ab-f7158809cf4f",
        ),
        ("ship-malformed", TOKEN_A, "not-a-uuid"),
        // Not UTF-8 once decoded: no order has such an id.
        ("ship-not-utf8", TOKEN_A, "%FF"),
        ("ship-foreign", TOKEN_B, order_id.as_str()),
    ] {
        let missing = server.fulfil_as(token, key, path_id, TOKYO).await;
        assert_eq!(
            missing.status_and_code(),
            (StatusCode::NOT_FOUND, json!("not_found")),
            "{key}"
        );
        assert!(!missing.replayed());
        let again = server.fulfil_as(token, key, path_id, TOKYO).await;
        assert!(again.replayed(), "{key}: a final answer is remembered");
        assert_eq!(again.body, missing.body);
        let status: i16 = db
            .value(
                "SELECT response_status FROM idempotency_requests WHERE endpoint = $1 AND idempotency_key = $2",
                &[&ENDPOINT, &key],
            )
            .await;
        assert_eq!(status, 404);
        assert_eq!(missing.headers["content-type"], "application/problem+json");
        let read = server.get_as(token, &format!("/orders/{path_id}")).await;
        assert_eq!(
            read.status_and_code(),
            (StatusCode::NOT_FOUND, json!("not_found")),
            "GET {path_id}"
        );
    }

    // The order fulfilled under another key: 409 naming the shipment, remembered.
    let second = server.fulfil("ship-t2", &order_id, TOKYO).await;
    assert_eq!(
        second.status_and_code(),
        (StatusCode::CONFLICT, json!("already_fulfilled"))
    );
    assert_eq!(second.json()["shipment_id"], shipment_id.as_str());
    assert_eq!(second.headers["content-type"], "application/problem+json");
    let second_again = server.fulfil("ship-t2", &order_id, TOKYO).await;
    assert!(second_again.replayed());
    assert_eq!(second_again.body, second.body);

    // One shipment per order whatever was asked; tenant B's attempt shipped nothing.
    assert_eq!(db.shipments(&order_id).await.len(), 1);
    assert_eq!(db.shipments(&other_order).await.len(), 1);
    assert_eq!(
        db.count("SELECT count(*) FROM warehouse_shipments", &[])
            .await,
        2
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn owner_killed_mid_fulfilment_is_taken_over_by_the_retry() {
    let db = Db::create().await;
    // A is killed well inside its warehouse delay; B's warehouse is quick.
    let a = Server::start(
        &db,
        &[("IDEMPOTENCY_LEASE", "1s"), ("FULFILMENT_DELAY", "4s")],
    )
    .await;
    let order_id = a.order("chk_kill").await;
    let accepted = a.fulfil("ship-k", &order_id, TOKYO).await;
    let operation_id = accepted.operation_id();
    let first_token = db.token("ship-k").await;

    // A dies mid-fulfilment, inside the warehouse's delay: nothing shipped.
    a.kill().await;
    assert!(db.shipments(&order_id).await.is_empty());
    let b = Server::start(
        &db,
        &[("IDEMPOTENCY_LEASE", "1s"), ("FULFILMENT_DELAY", "1s")],
    )
    .await;
    // The retry, not B's recovery worker, is to take over: hold the record
    // until the retry waits for it.
    let hold = db.hold_record("ship-k").await;
    db.lease_expired("ship-k").await;
    let (taken_over, ()) = tokio::join!(b.fulfil("ship-k", &order_id, TOKYO), async {
        db.blocked("INSERT INTO idempotency_requests").await;
        hold.batch_execute("ROLLBACK").await.unwrap();
    });

    // Taken over: the same operation, a 202 that is no replay, a larger token.
    assert_eq!(taken_over.operation_id(), operation_id);
    assert!(!taken_over.replayed(), "a takeover runs the work again");
    let second_token = db.token("ship-k").await;
    assert!(second_token > first_token, "{second_token} > {first_token}");
    let metrics = b.metrics().await;
    assert_eq!(
        metric_where(
            &metrics,
            "idempotency_lease_takeovers_total",
            "by=\"request\""
        ),
        1.0,
        "{metrics}"
    );

    let status = b.completed(&operation_id).await;
    assert_eq!(status["result"]["status"], 200);
    let shipment_id = status["result"]["body"]["shipment_id"].as_str().unwrap();
    assert_eq!(
        db.shipments(&order_id).await,
        [(
            shipment_id.to_owned(),
            db.shipment_key("ship-k").await,
            second_token
        )],
        "exactly one shipment, by the attempt that took over"
    );
    assert_eq!(db.token("ship-k").await, second_token);
    let replay = b.fulfil("ship-k", &order_id, TOKYO).await;
    assert!(replay.replayed());
    assert_eq!(replay.json(), status["result"]["body"]);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn stale_owner_resumes_after_a_takeover_and_changes_nothing() {
    let db = Db::create().await;
    // A's warehouse call is slow enough to be frozen well inside it; B's is quick.
    let a = Server::start(
        &db,
        &[("IDEMPOTENCY_LEASE", "1s"), ("FULFILMENT_DELAY", "6s")],
    )
    .await;
    let b = Server::start(
        &db,
        &[("IDEMPOTENCY_LEASE", "1s"), ("FULFILMENT_DELAY", "2s")],
    )
    .await;
    let order_id = a.order("chk_stale").await;
    let accepted = a.fulfil("ship-s", &order_id, TOKYO).await;
    let operation_id = accepted.operation_id();
    let stale_token = db.token("ship-s").await;

    // A's warehouse call is in flight (the warehouse has seen its token): freeze A.
    eventually("A's warehouse call", || async {
        db.count(
            "SELECT count(*) FROM warehouse_tokens WHERE order_id = $1 AND highest_token = $2",
            &[&order_id, &stale_token],
        )
        .await
            == 1
    })
    .await;
    a.signal("-STOP").await;
    let hold = db.hold_record("ship-s").await;
    db.lease_expired("ship-s").await;

    // The same key at B: taken over under a larger token.
    let (taken_over, ()) = tokio::join!(b.fulfil("ship-s", &order_id, TOKYO), async {
        db.blocked("INSERT INTO idempotency_requests").await;
        hold.batch_execute("ROLLBACK").await.unwrap();
    });
    assert_eq!(taken_over.operation_id(), operation_id);
    assert!(!taken_over.replayed());
    let token = db.token("ship-s").await;
    assert!(token > stale_token);
    let status = b.completed(&operation_id).await;
    let shipment_id = status["result"]["body"]["shipment_id"]
        .as_str()
        .unwrap()
        .to_owned();

    // A wakes up mid-call with its stale token: refused, and it stops.
    a.signal("-CONT").await;
    eventually("A to find itself fenced", || async {
        let metrics = a.metrics().await;
        metric(&metrics, "idempotency_fenced_total") > 0.0
    })
    .await;

    // Nothing A did after the takeover counts.
    assert_eq!(
        db.shipments(&order_id).await,
        [(shipment_id.clone(), db.shipment_key("ship-s").await, token)],
        "one shipment, with B's token"
    );
    let record = db
        .row(
            "SELECT state, attempt_token, response_status, convert_from(response_body, 'UTF8') \
             FROM idempotency_requests WHERE endpoint = $1 AND idempotency_key = 'ship-s'",
            &[&ENDPOINT],
        )
        .await;
    assert_eq!(record.get::<_, &str>(0), "completed");
    assert_eq!(record.get::<_, i64>(1), token, "B's completion stands");
    assert_eq!(record.get::<_, i16>(2), 200);
    let stored: Value = serde_json::from_str(record.get(3)).unwrap();
    assert_eq!(
        stored["shipment_id"],
        shipment_id.as_str(),
        "B's answer is the stored one"
    );
    let order = db
        .row(
            "SELECT fulfilment, shipment_id FROM orders WHERE id = $1::text::uuid",
            &[&order_id],
        )
        .await;
    assert_eq!(order.get::<_, &str>(0), "shipped");
    assert_eq!(order.get::<_, &str>(1), shipment_id);
    let highest: i64 = db
        .value(
            "SELECT highest_token FROM warehouse_tokens WHERE order_id = $1",
            &[&order_id],
        )
        .await;
    assert_eq!(highest, token);
    let replay = a.fulfil("ship-s", &order_id, TOKYO).await;
    assert!(replay.replayed(), "A, too, now replays B's answer");
    assert_eq!(replay.json()["shipment_id"], shipment_id.as_str());
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn recovery_worker_redrives_an_abandoned_fulfilment() {
    let db = Db::create().await;
    let env = [("IDEMPOTENCY_LEASE", "1s"), ("FULFILMENT_DELAY", "2s")];
    let a = Server::start(&db, &env).await;
    let order_id = a.order("chk_recover").await;
    let operation_id = a.fulfil("ship-r", &order_id, TOKYO).await.operation_id();
    let first_token = db.token("ship-r").await;
    a.kill().await;

    // Nobody retries: B's recovery worker takes the operation over and finishes it.
    let b = Server::start(&db, &env).await;
    eventually("the recovery worker to complete the operation", || async {
        db.state("ship-r").await.as_deref() == Some("completed")
    })
    .await;
    let token = db.token("ship-r").await;
    assert!(token > first_token, "{token} > {first_token}");
    let shipments = db.shipments(&order_id).await;
    assert_eq!(shipments.len(), 1, "exactly one shipment");
    assert_eq!(shipments[0].1, db.shipment_key("ship-r").await);
    assert_eq!(shipments[0].2, token);
    let status = b.completed(&operation_id).await;
    assert_eq!(status["result"]["status"], 200);
    assert_eq!(
        status["result"]["body"]["shipment_id"],
        shipments[0].0.as_str()
    );
    let metrics = b.metrics().await;
    assert_eq!(
        metric(&metrics, "idempotency_recoveries_total"),
        1.0,
        "{metrics}"
    );
    // The client comes back later: the answer the worker stored.
    let replay = b.fulfil("ship-r", &order_id, TOKYO).await;
    assert!(replay.replayed());
    assert_eq!(replay.json(), status["result"]["body"]);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn takeover_after_the_shipment_resumes_from_the_recovery_point() {
    let db = Db::create().await;
    let env = [("IDEMPOTENCY_LEASE", "1s"), ("FULFILMENT_DELAY", "1s")];
    let a = Server::start(&db, &env).await;
    let order_id = a.order("chk_resume").await;
    // Hold the order row so that A ships but stops at marking the order.
    let hold = db.db.client().await;
    hold.batch_execute("BEGIN").await.unwrap();
    hold.query(
        "SELECT 1 FROM orders WHERE id = $1::text::uuid FOR UPDATE",
        &[&order_id],
    )
    .await
    .unwrap();
    let (accepted, ()) = tokio::join!(
        a.fulfil("ship-p", &order_id, TOKYO),
        db.blocked("UPDATE orders SET fulfilment")
    );
    let operation_id = accepted.operation_id();
    let first_token = db.token("ship-p").await;
    let shipped = db.shipments(&order_id).await;
    assert_eq!(shipped.len(), 1, "A shipped before it died");
    assert_eq!(shipped[0].2, first_token);
    a.kill().await;
    hold.batch_execute("ROLLBACK").await.unwrap();

    // B's recovery worker re-drives: the warehouse recognises the key and
    // answers with A's shipment; the order is marked with it.
    let b = Server::start(&db, &env).await;
    let status = b.completed(&operation_id).await;
    assert_eq!(status["result"]["status"], 200);
    assert_eq!(
        status["result"]["body"]["shipment_id"],
        shipped[0].0.as_str()
    );
    assert!(db.token("ship-p").await > first_token);
    assert_eq!(
        db.shipments(&order_id).await,
        shipped,
        "still the one shipment A made"
    );
    let order = b.get_as(TOKEN_A, &format!("/orders/{order_id}")).await;
    assert_eq!(order.json()["fulfilment"], "shipped");
    let marked: String = db
        .value(
            "SELECT shipment_id FROM orders WHERE id = $1::text::uuid",
            &[&order_id],
        )
        .await;
    assert_eq!(marked, shipped[0].0);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn shutdown_lets_a_running_fulfilment_finish() {
    let db = Db::create().await;
    let server = Server::start(&db, &[("FULFILMENT_DELAY", "2s")]).await;
    let order_id = server.order("chk_shutdown").await;
    server.fulfil("ship-d", &order_id, TOKYO).await;
    // SIGTERM while the warehouse call runs: the server stops taking
    // requests, but the operation it owns completes before it exits.
    assert_eq!(db.state("ship-d").await.as_deref(), Some("in_progress"));
    assert!(server.stop().await.success(), "graceful shutdown exits 0");
    assert_eq!(db.state("ship-d").await.as_deref(), Some("completed"));
    let shipments = db.shipments(&order_id).await;
    assert_eq!(shipments.len(), 1);
    assert_eq!(shipments[0].1, db.shipment_key("ship-d").await);
    let fulfilment: String = db
        .value(
            "SELECT fulfilment FROM orders WHERE id = $1::text::uuid",
            &[&order_id],
        )
        .await;
    assert_eq!(fulfilment, "shipped");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn concurrent_fulfilments_of_one_order_ship_once() {
    let db = Db::create().await;
    // Both finish well within the 1 s a request waits: answered directly.
    let server = Server::start(&db, &[("FULFILMENT_DELAY", "500ms")]).await;
    let order_id = server.order("chk_race").await;
    // Two operations (two keys) on one order at once: both reach the
    // warehouse within its delay, and it lets only the newer token ship.
    let (x, y) = tokio::join!(
        server.fulfil("race-x", &order_id, TOKYO),
        server.fulfil("race-y", &order_id, r#"{"warehouse":"osaka-1"}"#)
    );
    let ((winner, winner_key), (loser, loser_key)) = if x.status == StatusCode::OK {
        ((x, "race-x"), (y, "race-y"))
    } else {
        ((y, "race-y"), (x, "race-x"))
    };
    assert_eq!(winner.status, StatusCode::OK, "{winner:?}");
    assert_eq!(
        loser.status_and_code(),
        (
            StatusCode::SERVICE_UNAVAILABLE,
            json!("fulfilment_in_progress")
        ),
        "{loser:?}"
    );
    assert!(loser.headers.contains_key("retry-after"));
    // Not remembered, and not forgotten: the loser's operation keeps its
    // identity for its next attempt (its retry, or the recovery worker).
    assert_ne!(
        db.state(loser_key).await.as_deref(),
        None,
        "the operation stays for its next attempt"
    );
    let metrics = server.metrics().await;
    assert_eq!(
        metric(&metrics, "warehouse_stale_refusals_total"),
        1.0,
        "{metrics}"
    );

    // One shipment, by the newer token, which the warehouse remembers.
    let shipment_id = winner.json()["shipment_id"].as_str().unwrap().to_owned();
    let token = db.token(winner_key).await;
    let shipments = db.shipments(&order_id).await;
    assert_eq!(shipments.len(), 1);
    assert_eq!(
        (shipments[0].0.as_str(), shipments[0].2),
        (shipment_id.as_str(), token)
    );
    let highest: i64 = db
        .value(
            "SELECT highest_token FROM warehouse_tokens WHERE order_id = $1",
            &[&order_id],
        )
        .await;
    assert_eq!(highest, token);

    // The loser's retry: a final answer now.
    let retry = if loser_key == "race-x" {
        server.fulfil(loser_key, &order_id, TOKYO).await
    } else {
        server
            .fulfil(loser_key, &order_id, r#"{"warehouse":"osaka-1"}"#)
            .await
    };
    assert_eq!(
        retry.status_and_code(),
        (StatusCode::CONFLICT, json!("already_fulfilled"))
    );
    assert_eq!(retry.json()["shipment_id"], shipment_id.as_str());
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_flaky_warehouse_ships_once_and_the_retry_resumes_the_same_operation() {
    let db = Db::create().await;
    let env = [("FULFILMENT_DELAY", "0s"), ("IDEMPOTENCY_LEASE", "2s")];
    let a = Server::start(&db, &env).await;
    let order_id = a.order("chk_flaky").await;
    let flaky = r#"{"warehouse":"flaky-osaka"}"#;

    // The warehouse ships, then its answer is lost: the attempt fails.
    let lost = a.fulfil("ship-f", &order_id, flaky).await;
    assert_eq!(lost.status, StatusCode::SERVICE_UNAVAILABLE, "{lost:?}");
    assert_eq!(lost.json()["code"], "warehouse_unavailable");
    assert!(lost.headers.contains_key("retry-after"));
    let detail = lost.json()["detail"]
        .as_str()
        .unwrap_or_default()
        .to_owned();
    assert!(!detail.contains("nothing was changed"), "{detail}");
    let shipments = db.shipments(&order_id).await;
    assert_eq!(shipments.len(), 1, "the warehouse shipped once");
    // The operation stays, its status resource answers, its attempt counted.
    assert_eq!(db.state("ship-f").await.as_deref(), Some("in_progress"));
    let operation_id: String = db
        .value(
            "SELECT operation_id::text FROM idempotency_requests WHERE endpoint = $1 AND idempotency_key = $2",
            &[&ENDPOINT, &"ship-f"],
        )
        .await;
    let status = a
        .get_as(TOKEN_A, &format!("/operations/{operation_id}"))
        .await;
    assert_eq!(status.status, StatusCode::OK);
    assert_eq!(status.json()["state"], "running");
    assert_eq!(status.json()["attempts"], 1);
    assert_eq!(
        shipments[0].1,
        db.shipment_key("ship-f").await,
        "shipped under the operation's derived key"
    );

    // The client's retry resumes the same operation: the same warehouse
    // key finds that one shipment, and the order is marked shipped.
    let retry = a.fulfil("ship-f", &order_id, flaky).await;
    assert_eq!(retry.status, StatusCode::OK, "{retry:?}");
    assert_eq!(retry.json()["shipment_id"], shipments[0].0.as_str());
    assert_eq!(
        db.shipments(&order_id).await.len(),
        1,
        "never shipped twice"
    );
    assert_eq!(db.state("ship-f").await.as_deref(), Some("completed"));
    let attempts: i32 = db
        .value(
            "SELECT attempts FROM idempotency_requests WHERE endpoint = $1 AND idempotency_key = $2",
            &[&ENDPOINT, &"ship-f"],
        )
        .await;
    assert_eq!(attempts, 2);
    let status = a.completed(&operation_id).await;
    assert_eq!(status["attempts"], 2);
    assert_eq!(status["result"]["status"], 200);
    let order = a.get_as(TOKEN_A, &format!("/orders/{order_id}")).await;
    assert_eq!(order.json()["fulfilment"], "shipped");
    // A later retry replays the answer.
    let replay = a.fulfil("ship-f", &order_id, flaky).await;
    assert!(replay.replayed());
    assert_eq!(replay.body, retry.body);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_poison_warehouse_ends_the_operation_failed_after_max_attempts() {
    let db = Db::create().await;
    let env = [
        ("FULFILMENT_DELAY", "0s"),
        ("IDEMPOTENCY_LEASE", "1s"),
        ("IDEMPOTENCY_MAX_ATTEMPTS", "3"),
    ];
    let a = Server::start(&db, &env).await;
    let order_id = a.order("chk_poison").await;
    let poison = r#"{"warehouse":"poison-kobe"}"#;
    let first = a.fulfil("ship-p", &order_id, poison).await;
    assert_eq!(first.status, StatusCode::SERVICE_UNAVAILABLE, "{first:?}");
    let operation_id: String = db
        .value(
            "SELECT operation_id::text FROM idempotency_requests WHERE endpoint = $1 AND idempotency_key = $2",
            &[&ENDPOINT, &"ship-p"],
        )
        .await;
    // Nobody retries: the recovery worker re-drives it, backing off, until
    // the third attempt fails it.
    eventually("the operation to end failed", || async {
        db.state("ship-p").await.as_deref() == Some("failed")
    })
    .await;
    let attempts: i32 = db
        .value(
            "SELECT attempts FROM idempotency_requests WHERE endpoint = $1 AND idempotency_key = $2",
            &[&ENDPOINT, &"ship-p"],
        )
        .await;
    assert_eq!(attempts, 3);
    assert!(db.shipments(&order_id).await.is_empty(), "nothing shipped");
    let status = a
        .get_as(TOKEN_A, &format!("/operations/{operation_id}"))
        .await;
    assert_eq!(status.status, StatusCode::OK);
    let status = status.json();
    assert_eq!(status["state"], "failed");
    assert_eq!(status["attempts"], 3);
    assert_eq!(status["error"]["code"], "operation_failed");
    // A retry of the POST replays the remembered failure.
    let retry = a.fulfil("ship-p", &order_id, poison).await;
    assert_eq!(retry.status, StatusCode::INTERNAL_SERVER_ERROR);
    assert!(retry.replayed());
    assert_eq!(retry.json()["code"], "operation_failed");
    let metrics = a.metrics().await;
    assert_eq!(
        metric(&metrics, "idempotency_operations_failed_total"),
        1.0,
        "{metrics}"
    );
    let order = a.get_as(TOKEN_A, &format!("/orders/{order_id}")).await;
    assert_ne!(order.json()["fulfilment"], "shipped");
}
