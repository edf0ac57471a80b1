//! Hostile input against a real PostgreSQL: malformed and adversarial keys,
//! bodies and headers, and bodies that trickle in. Each gets the contract's
//! status and `code`, nothing panics, and no `idempotency_requests` row and
//! no order is written (counted with SQL).

use crate::common;

use std::{
    pin::Pin,
    sync::{
        atomic::{AtomicU64, Ordering},
        Arc,
    },
    task::{Context, Poll},
    time::Duration,
};

use bytes::Bytes;
use common::*;
use http::{HeaderName, HeaderValue, Request, StatusCode};
use http_body::Frame;
use http_body_util::{BodyExt, Full};
use proptest::prelude::*;
use serde_json::Value;
use tokio::sync::mpsc;
use tower::{Layer, Service, ServiceExt};
use tower_idempotency::{
    fingerprint::TypedFingerprinter, key::IdempotencyKey, scope::TenantId, IdempotencyLayer,
    ResponseBody,
};

/// A DTO for the typed fingerprinter's cases.
#[derive(serde::Deserialize, serde::Serialize)]
struct NewOrder {
    checkout_id: String,
    amount: i64,
    #[serde(default)]
    metadata: Option<Value>,
}

/// Rows the layer or the handler wrote: (idempotency_requests, orders).
async fn written(pg: &Postgres) -> (i64, i64) {
    (
        pg.count("SELECT count(*) FROM idempotency_requests").await,
        pg.count("SELECT count(*) FROM orders").await,
    )
}

/// Sends a request with any body; the answer.
async fn send_any<S, ReqB, ResB>(service: S, request: Request<ReqB>) -> Answer
where
    S: Service<Request<ReqB>, Response = http::Response<ResponseBody<ResB>>>,
    S::Error: std::fmt::Debug,
    ResB: http_body::Body<Data = Bytes> + Send + 'static,
    ResB::Error: Into<BoxError>,
{
    let response = service.oneshot(request).await.expect("service answers");
    let (parts, body) = response.into_parts();
    Answer {
        status: parts.status,
        headers: parts.headers,
        body: body.collect().await.expect("body reads").to_bytes(),
    }
}

#[track_caller]
fn assert_problem(answer: &Answer, status: StatusCode, code: &str, case: &str) {
    assert_eq!(answer.status, status, "{case}: {:?}", answer.body);
    assert_eq!(
        answer.headers["content-type"], "application/problem+json",
        "{case}"
    );
    let json = answer.json();
    assert_eq!(json["code"], code, "{case}");
    assert_eq!(json["status"], status.as_u16(), "{case}");
}

/// The hostile bodies and what the contract answers to each.
fn hostile_bodies() -> Vec<(&'static str, Vec<u8>, StatusCode, &'static str)> {
    let unprocessable = StatusCode::UNPROCESSABLE_ENTITY;
    let invalid = "validation_failed";
    vec![
        (
            "10,000 nested arrays",
            ("[".repeat(10_000) + &"]".repeat(10_000)).into_bytes(),
            unprocessable,
            invalid,
        ),
        (
            "10,000 nested objects",
            (r#"{"a":"#.repeat(10_000) + "1" + &"}".repeat(10_000)).into_bytes(),
            unprocessable,
            invalid,
        ),
        (
            "100,000 opening brackets",
            "[".repeat(100_000).into_bytes(),
            unprocessable,
            invalid,
        ),
        (
            "not UTF-8 inside a string",
            b"{\"checkout_id\":\"chk_\xff\xfe\",\"amount\":1200}".to_vec(),
            unprocessable,
            invalid,
        ),
        (
            "not UTF-8 at all",
            vec![0x80, 0xc3, 0x28, 0xff],
            unprocessable,
            invalid,
        ),
        (
            "a duplicate member",
            br#"{"checkout_id":"chk_1","amount":1,"amount":1200}"#.to_vec(),
            unprocessable,
            invalid,
        ),
        (
            "a duplicate member spelled with an escape",
            br#"{"checkout_id":"chk_1","amount":1,"\u0061mount":1200}"#.to_vec(),
            unprocessable,
            invalid,
        ),
        (
            "a nested duplicate member",
            br#"{"checkout_id":"chk_1","amount":1200,"items":[{"sku":"a","sku":"b"}]}"#.to_vec(),
            unprocessable,
            invalid,
        ),
        (
            "an integer past u64",
            br#"{"checkout_id":"chk_1","amount":18446744073709551617}"#.to_vec(),
            unprocessable,
            invalid,
        ),
        (
            "a number past the double range",
            br#"{"checkout_id":"chk_1","amount":1e309}"#.to_vec(),
            unprocessable,
            invalid,
        ),
        (
            "a number that rounds to zero",
            br#"{"checkout_id":"chk_1","amount":1e-400}"#.to_vec(),
            unprocessable,
            invalid,
        ),
        (
            "a 10,000-digit number",
            format!(
                r#"{{"checkout_id":"chk_1","amount":1{}}}"#,
                "0".repeat(10_000)
            )
            .into_bytes(),
            unprocessable,
            invalid,
        ),
        (
            "a body one byte over the limit",
            vec![b' '; 1024 * 1024 + 1],
            StatusCode::PAYLOAD_TOO_LARGE,
            "payload_too_large",
        ),
        (
            "a body of 8 MiB",
            vec![b'['; 8 * 1024 * 1024],
            StatusCode::PAYLOAD_TOO_LARGE,
            "payload_too_large",
        ),
    ]
}

fn post_bytes(key: &str, body: Vec<u8>) -> Request<Full<Bytes>> {
    let mut request = Request::post("/orders")
        .header("content-type", "application/json")
        .header("idempotency-key", key)
        .body(Full::new(Bytes::from(body)))
        .unwrap();
    request.extensions_mut().insert(TenantId::new("tenant-a"));
    request
}

#[tokio::test]
async fn hostile_bodies_get_the_contracts_answer_and_write_nothing() {
    let pg = Postgres::new().await;
    let calls = Arc::new(AtomicU64::new(0));
    let json = layer(pg.store()).layer(order_handler::<Postgres>(calls.clone()));
    let typed = IdempotencyLayer::new(
        pg.store(),
        "POST /orders v1",
        TypedFingerprinter::<NewOrder>::new("orders.v1"),
    )
    .layer(order_handler::<Postgres>(calls.clone()));
    for (case, body, status, code) in hostile_bodies() {
        let answer = send(json.clone(), post_bytes("k1", body.clone())).await;
        assert_problem(&answer, status, code, case);
        let answer = send(typed.clone(), post_bytes("k1", body)).await;
        assert_problem(&answer, status, code, case);
    }
    // What only the typed fingerprinter sees: its DTO's types and the
    // members it ignores.
    for (case, body) in [
        (
            "a duplicate member the DTO ignores",
            r#"{"checkout_id":"chk_1","amount":1200,"note":"a","note":"b"}"#,
        ),
        (
            "a duplicate member inside a Value field",
            r#"{"checkout_id":"chk_1","amount":1200,"metadata":{"k":1,"k":2}}"#,
        ),
        (
            "an amount past i64",
            r#"{"checkout_id":"chk_1","amount":9223372036854775808}"#,
        ),
        (
            "a fractional amount",
            r#"{"checkout_id":"chk_1","amount":1.5}"#,
        ),
    ] {
        let answer = send(typed.clone(), post_bytes("k1", body.into())).await;
        assert_problem(
            &answer,
            StatusCode::UNPROCESSABLE_ENTITY,
            "validation_failed",
            case,
        );
    }
    assert_eq!(calls.load(Ordering::SeqCst), 0, "the handler never ran");
    assert_eq!(written(&pg).await, (0, 0), "nothing was written");
    // The key was never taken: a good body may use it.
    let good = send(json.clone(), tenant_a_post("k1")).await;
    assert_eq!(good.status, StatusCode::CREATED);
    assert_eq!(written(&pg).await, (1, 1));
}

#[tokio::test]
async fn header_floods_get_the_contracts_answer_and_write_nothing() {
    let pg = Postgres::new().await;
    let calls = Arc::new(AtomicU64::new(0));
    let service = layer(pg.store()).layer(order_handler::<Postgres>(calls.clone()));
    let invalid = |request: Request<Full<Bytes>>, case: &'static str| {
        let service = service.clone();
        async move {
            let answer = send(service, request).await;
            assert_problem(
                &answer,
                StatusCode::BAD_REQUEST,
                "idempotency_key_invalid",
                case,
            );
        }
    };

    // The key header more than once (same value or not) is malformed.
    let mut same = tenant_a_post("k1");
    let mut different = tenant_a_post("k1");
    for i in 0..1_000 {
        same.headers_mut()
            .append("idempotency-key", HeaderValue::from_static("k1"));
        different
            .headers_mut()
            .append("idempotency-key", format!("k{i}").parse().unwrap());
    }
    invalid(same, "1,001 copies of the key header").await;
    invalid(different, "1,001 different key headers").await;
    let mut empty_second = tenant_a_post("k1");
    empty_second
        .headers_mut()
        .append("idempotency-key", HeaderValue::from_static(""));
    invalid(empty_second, "a second, empty key header").await;

    // Bytes HTTP allows in a header value but a key does not.
    for (case, raw) in [
        ("obs-text bytes", &b"k\xff\xfe1"[..]),
        ("a tab", b"k\t1"),
        ("a space in the quoted form", b"\"k 1\""),
        ("64 KiB", &[b'k'; 64 * 1024][..]),
    ] {
        let mut request = tenant_a_post("placeholder");
        request
            .headers_mut()
            .insert("idempotency-key", HeaderValue::from_bytes(raw).unwrap());
        invalid(request, case).await;
    }
    assert_eq!(calls.load(Ordering::SeqCst), 0);
    assert_eq!(written(&pg).await, (0, 0));

    // 10,000 other headers change nothing about the request.
    let mut flooded = tenant_a_post("k1");
    for i in 0..10_000 {
        let name = HeaderName::from_bytes(format!("x-flood-{i}").as_bytes()).unwrap();
        flooded
            .headers_mut()
            .insert(name, HeaderValue::from_static("v"));
        flooded
            .headers_mut()
            .append("x-flood", HeaderValue::from_static("w"));
    }
    let answer = send(service.clone(), flooded).await;
    assert_eq!(answer.status, StatusCode::CREATED);
    assert_eq!(written(&pg).await, (1, 1));
}

/// A request body the test feeds chunk by chunk, as a slow client would.
struct Trickle(mpsc::Receiver<Result<Bytes, BoxError>>);

impl http_body::Body for Trickle {
    type Data = Bytes;
    type Error = BoxError;

    fn poll_frame(
        mut self: Pin<&mut Self>,
        cx: &mut Context<'_>,
    ) -> Poll<Option<Result<Frame<Bytes>, BoxError>>> {
        self.0
            .poll_recv(cx)
            .map(|chunk| chunk.map(|r| r.map(Frame::data)))
    }
}

/// A POST of `tenant-a` under `key` whose body arrives through the returned
/// sender. The channel holds one chunk: once a second send returns, the
/// layer has taken the first.
fn trickling_post(key: &str) -> (Request<Trickle>, mpsc::Sender<Result<Bytes, BoxError>>) {
    let (tx, rx) = mpsc::channel(1);
    let mut request = Request::post("/orders")
        .header("content-type", "application/json")
        .header("idempotency-key", key)
        .body(Trickle(rx))
        .unwrap();
    request.extensions_mut().insert(TenantId::new("tenant-a"));
    (request, tx)
}

/// Sessions of the test database doing anything but waiting idle outside a
/// transaction, this test's own connection left out.
async fn busy_sessions(pg: &Postgres) -> i64 {
    pg.count(
        "SELECT count(*) FROM pg_stat_activity WHERE datname = current_database() \
         AND backend_type = 'client backend' AND pid <> pg_backend_pid() \
         AND state IS DISTINCT FROM 'idle'",
    )
    .await
}

/// Feeds `chunks` one by one and returns once the layer has taken them all
/// but the last (which waits in the channel).
async fn feed(sender: &mpsc::Sender<Result<Bytes, BoxError>>, chunks: &[&'static str]) {
    for chunk in chunks {
        sender
            .send(Ok(Bytes::from_static(chunk.as_bytes())))
            .await
            .expect("the layer still reads");
    }
}

#[tokio::test]
async fn a_slow_body_holds_no_claim_no_connection_and_no_row() {
    let pg = Postgres::new().await;
    let calls = Arc::new(AtomicU64::new(0));
    let service = layer(pg.store()).layer(order_handler::<Postgres>(calls.clone()));
    // Warm the pool, so that a connection is there to be (wrongly) taken.
    assert_eq!(
        send(service.clone(), tenant_a_post("warm")).await.status,
        StatusCode::CREATED
    );

    let (request, body) = trickling_post("slow");
    let slow = tokio::spawn(send_any(service.clone(), request));
    feed(
        &body,
        &[r#"{"checkout_id":"#, r#""chk_1","#, r#""amount":"#],
    )
    .await;
    // Half a body is in: the request holds nothing in the database.
    assert_eq!(busy_sessions(&pg).await, 0, "no connection is in use");
    assert_eq!(
        pg.count("SELECT count(*) FROM idempotency_requests WHERE idempotency_key = 'slow'")
            .await,
        0,
        "no claim"
    );
    assert_eq!(
        pg.count(
            "SELECT count(*) FROM pg_locks l JOIN pg_class c ON c.oid = l.relation \
             WHERE c.relname = 'idempotency_requests' AND l.pid <> pg_backend_pid()"
        )
        .await,
        0,
        "no lock on the key table"
    );
    // So the same key is free for a request that is complete.
    let fast = send(service.clone(), tenant_a_post("slow")).await;
    assert_eq!(fast.status, StatusCode::CREATED);
    assert!(!fast.replayed());

    // The slow body completes: it is the same request, so it replays.
    feed(&body, &["1200}"]).await;
    drop(body);
    let slow = slow.await.unwrap();
    assert_eq!(slow.status, StatusCode::CREATED);
    assert!(slow.replayed());
    assert_eq!(slow.body, fast.body);
    assert_eq!(calls.load(Ordering::SeqCst), 2, "warm + fast");
    assert_eq!(written(&pg).await, (2, 2));
}

#[tokio::test]
async fn a_client_that_gives_up_mid_body_writes_nothing() {
    let pg = Postgres::new().await;
    let calls = Arc::new(AtomicU64::new(0));
    let service = layer(pg.store()).layer(order_handler::<Postgres>(calls.clone()));

    // The connection breaks mid-body (hyper reports an error frame).
    let (request, body) = trickling_post("k1");
    let broken = tokio::spawn(send_any(service.clone(), request));
    feed(&body, &[r#"{"checkout_id":"#, r#""chk_1","#]).await;
    body.send(Err("connection reset".into())).await.unwrap();
    let answer = broken.await.unwrap();
    assert_problem(
        &answer,
        StatusCode::BAD_REQUEST,
        "request_body_unreadable",
        "broken",
    );

    // The body ends early: what arrived is not JSON.
    let (request, body) = trickling_post("k1");
    let truncated = tokio::spawn(send_any(service.clone(), request));
    feed(&body, &[r#"{"checkout_id":"#, r#""chk_1","#]).await;
    drop(body);
    let answer = truncated.await.unwrap();
    assert_problem(
        &answer,
        StatusCode::UNPROCESSABLE_ENTITY,
        "validation_failed",
        "truncated",
    );

    // The server's own deadline gives up on the request (as a
    // `tower_http::timeout` layer outside this one would): the request
    // future is dropped while the body still trickles.
    let (request, body) = trickling_post("k1");
    let gave_up = tokio::time::timeout(
        Duration::from_millis(200),
        send_any(service.clone(), request),
    );
    let sending = feed(&body, &[r#"{"checkout_id":"#]);
    let (gave_up, ()) = tokio::join!(gave_up, sending);
    assert!(gave_up.is_err(), "the deadline passed mid-body");
    assert!(body.is_closed(), "the dropped request let go of the body");

    assert_eq!(calls.load(Ordering::SeqCst), 0);
    assert_eq!(written(&pg).await, (0, 0));
    assert_eq!(busy_sessions(&pg).await, 0);
    // The key is free.
    assert_eq!(
        send(service.clone(), tenant_a_post("k1")).await.status,
        StatusCode::CREATED
    );
}

#[tokio::test]
async fn a_huge_declared_length_is_refused_before_the_body_arrives() {
    let pg = Postgres::new().await;
    let calls = Arc::new(AtomicU64::new(0));
    let service = layer(pg.store()).layer(order_handler::<Postgres>(calls.clone()));
    let (mut request, body) = trickling_post("k1");
    request
        .headers_mut()
        .insert("content-length", HeaderValue::from_static("10737418240"));
    // Nothing is ever sent: the answer cannot wait for the body. (The
    // timeout only turns a layer that would wait forever into a failure.)
    let answer = tokio::time::timeout(Duration::from_secs(10), send_any(service.clone(), request))
        .await
        .expect("answered without waiting for the body");
    assert_problem(
        &answer,
        StatusCode::PAYLOAD_TOO_LARGE,
        "payload_too_large",
        "10 GiB",
    );
    drop(body);
    assert_eq!(calls.load(Ordering::SeqCst), 0);
    assert_eq!(written(&pg).await, (0, 0));
}

/// Key header bytes and body bytes, through the whole layer: every request
/// gets an answer from the contract, and only a valid key with a valid body
/// reaches the handler and writes.
fn any_request_gets_a_contract_answer(cases: Vec<(Vec<u8>, Vec<u8>)>) -> Result<(), TestCaseError> {
    let runtime = tokio::runtime::Builder::new_current_thread()
        .enable_all()
        .build()
        .unwrap();
    runtime.block_on(async {
        let pg = Postgres::new().await;
        let calls = Arc::new(AtomicU64::new(0));
        let service = layer(pg.store())
            .request_body_limit(256)
            .layer(order_handler::<Postgres>(calls.clone()));
        let mut created = 0;
        for (key, body) in cases {
            let Ok(value) = HeaderValue::from_bytes(&key) else {
                continue; // the HTTP stack never delivers such a header
            };
            let valid_key = IdempotencyKey::parse(&key).is_ok();
            let mut request = post_bytes("placeholder", body.clone());
            request.headers_mut().insert("idempotency-key", value);
            let answer = send(service.clone(), request).await;
            let code = answer.json()["code"].as_str().map(str::to_owned);
            match (valid_key, answer.status) {
                (false, StatusCode::BAD_REQUEST) => {
                    prop_assert_eq!(code.as_deref(), Some("idempotency_key_invalid"));
                }
                (true, StatusCode::CREATED) if !answer.replayed() => created += 1,
                (true, StatusCode::CREATED) => {}
                // A key drawn twice with another body.
                (true, StatusCode::CONFLICT) => {
                    prop_assert_eq!(code.as_deref(), Some("idempotency_key_reused"));
                }
                (true, StatusCode::UNPROCESSABLE_ENTITY) => {
                    prop_assert_eq!(code.as_deref(), Some("validation_failed"));
                }
                (true, StatusCode::PAYLOAD_TOO_LARGE) => {
                    prop_assert!(body.len() > 256);
                    prop_assert_eq!(code.as_deref(), Some("payload_too_large"));
                }
                other => prop_assert!(false, "unexpected answer {:?}: {:?}", other, answer.body),
            }
        }
        prop_assert_eq!(calls.load(Ordering::SeqCst), created);
        prop_assert_eq!(written(&pg).await, (created as i64, created as i64));
        Ok(())
    })
}

proptest! {
    // One database for a batch of requests: a few seconds in all.
    #![proptest_config(ProptestConfig { cases: 4, ..ProptestConfig::default() })]

    #[test]
    fn any_key_and_body_bytes_get_a_contract_answer_and_write_only_when_valid(
        cases in proptest::collection::vec(
            (
                prop_oneof![
                    proptest::collection::vec(any::<u8>(), 0..40),
                    "[!-~]{1,20}".prop_map(String::into_bytes),
                    "\"[ -~]{0,20}\"".prop_map(String::into_bytes),
                ],
                prop_oneof![
                    proptest::collection::vec(any::<u8>(), 0..300),
                    "\\{\"checkout_id\":\"[a-z]{1,5}\",\"amount\":-?[0-9]{1,25}(\\.[0-9]{1,5})?(e-?[0-9]{1,3})?\\}"
                        .prop_map(String::into_bytes),
                    "[\\[\\]{}\",:0-9a ]{0,300}".prop_map(String::into_bytes),
                ],
            ),
            40,
        ),
    ) {
        any_request_gets_a_contract_answer(cases)?;
    }
}

// ---- the example order server, over TCP ----

use crate::common::example_binary;

/// The example order server on a fresh database, and its address.
struct OrderServer {
    _child: tokio::process::Child,
    addr: String,
    db: tower_idempotency::testing::TestDatabase,
}

impl OrderServer {
    async fn start() -> OrderServer {
        use tokio::io::AsyncBufReadExt;
        let db = tower_idempotency::testing::TestDatabase::create().await;
        let mut child = tokio::process::Command::new(example_binary::example_binary())
            .env("DATABASE_URL", db.connection_string())
            .env("ORDER_SERVER_ADDR", "127.0.0.1:0")
            .env("RUST_LOG", "error")
            .stdin(std::process::Stdio::null())
            .stdout(std::process::Stdio::piped())
            .kill_on_drop(true)
            .spawn()
            .expect("the example server starts");
        let mut line = String::new();
        tokio::io::BufReader::new(child.stdout.take().unwrap())
            .read_line(&mut line)
            .await
            .unwrap();
        let addr = line
            .trim()
            .strip_prefix("listening on http://")
            .unwrap_or_else(|| panic!("unexpected first line: {line:?}"))
            .to_owned();
        OrderServer {
            _child: child,
            addr,
            db,
        }
    }

    /// Sends `head` (request line and headers, without the blank line) and
    /// `body` on a connection of its own; the status and body of the answer.
    async fn raw(&self, head: &str, body: &[u8]) -> (u16, Bytes) {
        use tokio::io::{AsyncReadExt, AsyncWriteExt};
        let mut stream = tokio::net::TcpStream::connect(&self.addr).await.unwrap();
        let head = format!(
            "{head}\r\nHost: test\r\nConnection: close\r\nContent-Length: {}\r\n\r\n",
            body.len()
        );
        let mut request = head.into_bytes();
        request.extend_from_slice(body);
        // The server may answer (and close) before it has read everything.
        let _ = stream.write_all(&request).await;
        let mut response = Vec::new();
        let _ = stream.read_to_end(&mut response).await;
        let text = String::from_utf8_lossy(&response);
        let status = text
            .split(' ')
            .nth(1)
            .and_then(|s| s.parse().ok())
            .unwrap_or_else(|| panic!("no HTTP answer: {text:?}"));
        let body = response
            .windows(4)
            .position(|w| w == b"\r\n\r\n")
            .map_or_else(Bytes::new, |at| Bytes::copy_from_slice(&response[at + 4..]));
        (status, body)
    }

    async fn post_order(&self, key: &str, extra_headers: &str, body: &[u8]) -> (u16, Bytes) {
        let head = format!(
            "POST /orders HTTP/1.1\r\nAuthorization: Bearer demo-token-a\r\n\
             Content-Type: application/json\r\nIdempotency-Key: {key}{extra_headers}"
        );
        self.raw(&head, body).await
    }

    /// Every remembered key, to say what was written when a count is off.
    async fn records(&self) -> Vec<String> {
        let sql = self.db.client().await;
        let rows = sql
            .query(
                "SELECT tenant_id, endpoint, idempotency_key, state, response_status \
                 FROM idempotency_requests ORDER BY created_at",
                &[],
            )
            .await
            .unwrap();
        rows.iter()
            .map(|r| {
                let (tenant, endpoint, key, state): (String, String, String, String) =
                    (r.get(0), r.get(1), r.get(2), r.get(3));
                let status: Option<i16> = r.get(4);
                format!("{tenant} {endpoint} {key} {state} {status:?}")
            })
            .collect()
    }

    /// Rows written for `POST /orders`: (idempotency_requests, orders).
    async fn written(&self) -> (i64, i64) {
        let sql = self.db.client().await;
        let count = |table: &'static str| {
            let sql = &sql;
            async move {
                sql.query_one(&format!("SELECT count(*) FROM {table}"), &[])
                    .await
                    .unwrap()
                    .get::<_, i64>(0)
            }
        };
        // The outbox relay's downstream calls remember their own keys (under
        // `order-service`) once an order exists: count the endpoint's.
        (
            count("idempotency_requests WHERE endpoint = 'POST /orders v1'").await,
            count("orders").await,
        )
    }
}

fn order_body(items: &str) -> Vec<u8> {
    format!(
        r#"{{"checkout_id":"chk_1","currency":"JPY","items":{items},"shipping_address_id":"addr_1"}}"#
    )
    .into_bytes()
}

#[tokio::test]
async fn the_order_server_answers_hostile_requests_by_its_contract() {
    let server = OrderServer::start().await;
    let item = r#"[{"sku":"SKU-1","quantity":2,"unit_price":1200}]"#;
    let cases: Vec<(&str, String, Vec<u8>, u16, &str)> = vec![
        (
            "a duplicate member",
            String::new(),
            br#"{"checkout_id":"chk_1","checkout_id":"chk_2","currency":"JPY","items":[{"sku":"SKU-1","unit_price":1}],"shipping_address_id":"addr_1"}"#.to_vec(),
            422,
            "validation_failed",
        ),
        (
            "a duplicate member in an ignored field",
            String::new(),
            [&order_body(item)[..order_body(item).len() - 1], br#","trace_id":"a","trace_id":"b"}"#].concat(),
            422,
            "validation_failed",
        ),
        (
            "a duplicate member inside an item",
            String::new(),
            order_body(r#"[{"sku":"SKU-1","unit_price":1200,"unit_price":0}]"#),
            422,
            "validation_failed",
        ),
        (
            "10,000 nested arrays",
            String::new(),
            ("[".repeat(10_000) + &"]".repeat(10_000)).into_bytes(),
            422,
            "validation_failed",
        ),
        (
            "10,000 nested objects in an ignored field",
            String::new(),
            [
                &order_body(item)[..order_body(item).len() - 1],
                (r#","trace_id":"#.to_owned() + &r#"{"a":"#.repeat(10_000) + "1" + &"}".repeat(10_001)).as_bytes(),
            ]
            .concat(),
            422,
            "validation_failed",
        ),
        (
            "not UTF-8",
            String::new(),
            order_body("[{\"sku\":\"SKU-\u{1}\",\"unit_price\":1}]")
                .into_iter()
                .map(|b| if b == 1 { 0xff } else { b })
                .collect(),
            422,
            "validation_failed",
        ),
        (
            "a quantity past i64",
            String::new(),
            order_body(r#"[{"sku":"SKU-1","quantity":9223372036854775808,"unit_price":1}]"#),
            422,
            "validation_failed",
        ),
        (
            "a price past the double range",
            String::new(),
            order_body(r#"[{"sku":"SKU-1","unit_price":1e400}]"#),
            422,
            "validation_failed",
        ),
        (
            "a total past i64",
            String::new(),
            order_body(r#"[{"sku":"SKU-1","quantity":9223372036854775807,"unit_price":2}]"#),
            422,
            "validation_failed",
        ),
        // PostgreSQL stores no U+0000 in text or jsonb: refused as a field
        // error, never a 503 that clients would retry for ever.
        (
            "a NUL in the checkout id",
            String::new(),
            br#"{"checkout_id":"chk\u0000x","currency":"JPY","items":[{"sku":"SKU-1","unit_price":1}],"shipping_address_id":"addr_1"}"#.to_vec(),
            422,
            "validation_failed",
        ),
        (
            "a NUL in the address",
            String::new(),
            br#"{"checkout_id":"chk_1","currency":"JPY","items":[{"sku":"SKU-1","unit_price":1}],"shipping_address_id":"\u0000"}"#.to_vec(),
            422,
            "validation_failed",
        ),
        (
            "a NUL in the coupon",
            String::new(),
            br#"{"checkout_id":"chk_1","coupon":"SAVE\u0000","currency":"JPY","items":[{"sku":"SKU-1","unit_price":1}],"shipping_address_id":"addr_1"}"#.to_vec(),
            422,
            "validation_failed",
        ),
        (
            "a NUL in a SKU",
            String::new(),
            order_body(r#"[{"sku":"SKU\u0000","unit_price":1}]"#),
            422,
            "validation_failed",
        ),
        // A checkout id the unique index cannot hold (an index entry holds
        // at most about 2.7 kB): refused as a field error, not a 503.
        (
            "a checkout id of 3,000 random characters",
            String::new(),
            format!(
                r#"{{"checkout_id":"{}","currency":"JPY","items":[{{"sku":"SKU-1","unit_price":1}}],"shipping_address_id":"addr_1"}}"#,
                random_text(3000)
            )
            .into_bytes(),
            422,
            "validation_failed",
        ),
        (
            "a body over 1 MiB",
            String::new(),
            vec![b' '; 1024 * 1024 + 1],
            413,
            "payload_too_large",
        ),
        (
            "the key header twice",
            "\r\nIdempotency-Key: k2".to_owned(),
            order_body(item),
            400,
            "idempotency_key_invalid",
        ),
        (
            "the key header 90 times",
            "\r\nIdempotency-Key: k1".repeat(89),
            order_body(item),
            400,
            "idempotency_key_invalid",
        ),
    ];
    for (case, extra, body, status, code) in cases {
        let (answered, answer) = server.post_order("k1", &extra, &body).await;
        assert_eq!(answered, status, "{case}: {answer:?}");
        let answer: Value = serde_json::from_slice(&answer).unwrap_or_default();
        assert_eq!(answer["code"], code, "{case}");
    }
    // A key of bytes outside visible ASCII.
    let (status, answer) = server.post_order("k\u{e9}1", "", &order_body(item)).await;
    assert_eq!(status, 400);
    assert_eq!(
        serde_json::from_slice::<Value>(&answer).unwrap()["code"],
        "idempotency_key_invalid"
    );
    // More headers than the HTTP server reads: refused by hyper before any
    // layer runs (431).
    let flood: String = (0..200).map(|i| format!("\r\nX-Flood-{i}: v")).collect();
    let (status, _) = server.post_order("k1", &flood, &order_body(item)).await;
    assert_eq!(status, 431, "too many headers");
    assert_eq!(server.written().await, (0, 0), "nothing was written");
    assert_eq!(
        server.records().await,
        Vec::<String>::new(),
        "no key of any endpoint"
    );

    // A client that sends half a body and gives up holds nothing: the same
    // key then creates its order at once.
    {
        use tokio::io::AsyncWriteExt;
        let mut slow = tokio::net::TcpStream::connect(&server.addr).await.unwrap();
        let body = order_body(item);
        let head = format!(
            "POST /orders HTTP/1.1\r\nHost: test\r\nAuthorization: Bearer demo-token-a\r\n\
             Content-Type: application/json\r\nIdempotency-Key: k1\r\nContent-Length: {}\r\n\r\n",
            body.len()
        );
        slow.write_all(head.as_bytes()).await.unwrap();
        slow.write_all(&body[..body.len() / 2]).await.unwrap();
        let (status, _) = server.post_order("k1", "", &body).await;
        assert_eq!(status, 201, "the half-sent request holds no claim");
        drop(slow);
    }
    // The key answers what it created; nothing else was written.
    let (status, _) = server.post_order("k1", "", &order_body(item)).await;
    assert_eq!(status, 201);
    assert_eq!(
        server.written().await,
        (1, 1),
        "{:?}",
        server.records().await
    );
    // The longest checkout id is stored.
    let longest = format!(
        r#"{{"checkout_id":"{}","currency":"JPY","items":[{{"sku":"SKU-1","unit_price":1}}],"shipping_address_id":"addr_1"}}"#,
        random_text(1024)
    );
    let (status, answer) = server.post_order("k-longest", "", longest.as_bytes()).await;
    assert_eq!(status, 201, "{answer:?}");
}

/// `n` characters of incompressible text (PostgreSQL compresses a long
/// repetitive value, which would then fit where this must not).
fn random_text(n: usize) -> String {
    let mut state = 0x2545_f491_4f6c_dd1d_u64;
    (0..n)
        .map(|_| {
            state ^= state << 13;
            state ^= state >> 7;
            state ^= state << 17;
            char::from(b'a' + (state % 26) as u8)
        })
        .collect()
}
