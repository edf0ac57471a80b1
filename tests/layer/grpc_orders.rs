//! The gRPC example (`examples/grpc_orders`) as a process, called by a real
//! tonic client over HTTP/2: a create and its replay (the same message and
//! trailers), a retry after the connection was cut mid-call, a reused
//! `request_id`, an `UNAVAILABLE` that rolls back and its retry,
//! concurrent duplicates, gzip-compressed calls and their replays, and the
//! answers that are not the handler's. Each
//! test has its own database and checks its rows: orders, outbox events,
//! stock and the key's record.

use std::{process::Stdio, time::Duration};

use bytes::{BufMut, Bytes, BytesMut};
use http::uri::PathAndQuery;
use http_body_util::BodyExt;
use prost::Message;
use tokio::{
    io::{AsyncBufReadExt, BufReader},
    net::{TcpListener, TcpStream},
    process::{Child, Command},
};
use tonic::{
    body::Body,
    client::Grpc,
    codec::CompressionEncoding,
    metadata::MetadataValue,
    transport::{Channel, Endpoint},
    Code, Status,
};
use tonic_prost::ProstCodec;
use tower::ServiceExt;
use tower_idempotency::testing::TestDatabase;

#[allow(dead_code)]
#[path = "../../examples/grpc_orders/proto.rs"]
mod proto;

use proto::{orders_client::OrdersClient, CreateOrderRequest, GetOrderRequest, Order};

const TOKEN_A: &str = "demo-token-a";

/// The example's process on its own database.
struct Server {
    _child: Child,
    address: String,
    db: TestDatabase,
    sql: tokio_postgres::Client,
}

impl Server {
    async fn start() -> Server {
        let binary = crate::common::example_binary::example(
            "grpc_orders",
            &["examples/grpc_orders", "Cargo.toml"],
        );
        let db = TestDatabase::create().await;
        let mut child = Command::new(binary)
            .env("DATABASE_URL", db.connection_string())
            .env("GRPC_ORDERS_ADDR", "127.0.0.1:0")
            .env("RUST_LOG", "warn")
            .stdin(Stdio::null())
            .stdout(Stdio::piped())
            .stderr(Stdio::inherit())
            .kill_on_drop(true)
            .spawn()
            .expect("the gRPC example starts");
        let mut line = String::new();
        BufReader::new(child.stdout.take().expect("stdout"))
            .read_line(&mut line)
            .await
            .expect("reads stdout");
        let address = line
            .trim()
            .strip_prefix("listening on ")
            .unwrap_or_else(|| panic!("unexpected first line: {line:?}"))
            .to_owned();
        let sql = db.client().await;
        Server {
            _child: child,
            address,
            db,
            sql,
        }
    }

    async fn channel(&self) -> Channel {
        connect(&self.address).await
    }

    async fn count(&self, sql: &str) -> i64 {
        self.sql.query_one(sql, &[]).await.unwrap().get(0)
    }

    async fn stock(&self, sku: &str) -> i32 {
        self.sql
            .query_one(
                "SELECT available FROM grpc_stock WHERE tenant_id = 'tenant-a' AND sku = $1",
                &[&sku],
            )
            .await
            .unwrap()
            .get(0)
    }

    /// The key's record: its state and remembered gRPC status.
    async fn key_record(&self, key: &str) -> Option<(String, Option<String>)> {
        self.sql
            .query_opt(
                "SELECT state, resource_id FROM idempotency_requests WHERE idempotency_key = $1",
                &[&key],
            )
            .await
            .unwrap()
            .map(|row| (row.get(0), row.get(1)))
    }

    /// Polls (bounded) until a statement waits for a lock on `table`.
    async fn wait_until_blocked_on(&self, table: &str) {
        let waiting = format!(
            "SELECT count(*) FROM pg_locks l JOIN pg_class c ON c.oid = l.relation \
             WHERE c.relname = '{table}' AND NOT l.granted"
        );
        for _ in 0..500 {
            if self.count(&waiting).await > 0 {
                return;
            }
            tokio::time::sleep(Duration::from_millis(10)).await;
        }
        panic!("no statement waits on {table}");
    }
}

async fn connect(address: &str) -> Channel {
    Endpoint::from_shared(format!("http://{address}"))
        .unwrap()
        .connect()
        .await
        .expect("connects over HTTP/2")
}

fn create_request(
    request_id: &str,
    sku: &str,
    quantity: u32,
) -> tonic::Request<CreateOrderRequest> {
    let mut request = tonic::Request::new(CreateOrderRequest {
        request_id: request_id.into(),
        sku: sku.into(),
        quantity,
    });
    request.metadata_mut().insert(
        "authorization",
        MetadataValue::try_from(format!("Bearer {TOKEN_A}")).unwrap(),
    );
    request
}

/// `CreateOrder` through the client tonic generated from the proto.
async fn create(
    channel: &Channel,
    request: tonic::Request<CreateOrderRequest>,
) -> Result<tonic::Response<Order>, Status> {
    OrdersClient::new(channel.clone())
        .create_order(request)
        .await
}

/// `CreateOrder` with gzip on, through the generated client configured
/// with `send_compressed(Gzip)` and `accept_compressed(Gzip)`: the message
/// goes compressed, and the answer may come back compressed.
async fn create_gzip(
    channel: &Channel,
    request: tonic::Request<CreateOrderRequest>,
) -> Result<tonic::Response<Order>, Status> {
    OrdersClient::new(channel.clone())
        .send_compressed(CompressionEncoding::Gzip)
        .accept_compressed(CompressionEncoding::Gzip)
        .create_order(request)
        .await
}

async fn get(channel: &Channel, id: &str) -> Result<Order, Status> {
    let mut request = tonic::Request::new(GetOrderRequest { id: id.into() });
    request.metadata_mut().insert(
        "authorization",
        MetadataValue::try_from(format!("Bearer {TOKEN_A}")).unwrap(),
    );
    OrdersClient::new(channel.clone())
        .get_order(request)
        .await
        .map(tonic::Response::into_inner)
}

fn replayed(metadata: &tonic::metadata::MetadataMap) -> bool {
    metadata
        .get("idempotent-replayed")
        .is_some_and(|v| v == "true")
}

/// What the wire carried: the framed message and the trailers.
struct Wire {
    headers: http::HeaderMap,
    body: Bytes,
    trailers: Option<http::HeaderMap>,
}

/// A `CreateOrder` sent as HTTP/2 frames over the channel, read as they
/// arrive: the body and the trailers as the server sent them.
async fn create_on_the_wire(channel: &Channel, request_id: &str) -> Wire {
    let message = CreateOrderRequest {
        request_id: request_id.into(),
        sku: "coffee".into(),
        quantity: 1,
    }
    .encode_to_vec();
    let mut framed = BytesMut::new();
    framed.put_u8(0);
    framed.put_u32(message.len() as u32);
    framed.put_slice(&message);
    let request = http::Request::post(proto::CREATE_ORDER)
        .header("content-type", "application/grpc")
        .header("te", "trailers")
        .header("authorization", format!("Bearer {TOKEN_A}"))
        .body(Body::new(http_body_util::Full::new(framed.freeze())))
        .unwrap();
    let response = channel.clone().oneshot(request).await.expect("answers");
    assert_eq!(response.status(), http::StatusCode::OK);
    let (parts, body) = response.into_parts();
    let collected = body.collect().await.expect("the whole body");
    Wire {
        headers: parts.headers,
        trailers: collected.trailers().cloned(),
        body: collected.to_bytes(),
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn create_commits_order_event_stock_and_answer_and_a_retry_replays_them() {
    let server = Server::start().await;
    let channel = server.channel().await;

    let first = create(&channel, create_request("req-1", "tea", 2))
        .await
        .expect("created");
    assert!(!replayed(first.metadata()));
    let order = first.get_ref().clone();
    assert_eq!(
        (order.sku.as_str(), order.quantity, order.total),
        ("tea", 2, 900)
    );

    // In the database: one order, its event, the stock taken, and the key
    // naming the order it created.
    let row = server
        .sql
        .query_one(
            "SELECT id::text, tenant_id, sku, quantity, total FROM grpc_orders",
            &[],
        )
        .await
        .unwrap();
    assert_eq!(row.get::<_, String>(0), order.id);
    assert_eq!(row.get::<_, String>(1), "tenant-a");
    assert_eq!(row.get::<_, String>(2), "tea");
    assert_eq!(row.get::<_, i32>(3), 2);
    assert_eq!(row.get::<_, i64>(4), 900);
    let events = server
        .sql
        .query("SELECT aggregate_id, event_type FROM outbox_events", &[])
        .await
        .unwrap();
    assert_eq!(events.len(), 1);
    assert_eq!(events[0].get::<_, String>(0), order.id);
    assert_eq!(events[0].get::<_, String>(1), "OrderCreated");
    assert_eq!(server.stock("tea").await, 998);
    assert_eq!(
        server.key_record("req-1").await,
        Some(("completed".into(), Some(order.id.clone())))
    );

    // The retry, on another connection: the same message, marked, nothing
    // written again.
    let again = create(&server.channel().await, create_request("req-1", "tea", 2))
        .await
        .expect("replayed");
    assert!(replayed(again.metadata()));
    assert_eq!(again.get_ref(), &order);
    assert_eq!(server.count("SELECT count(*) FROM grpc_orders").await, 1);
    assert_eq!(server.count("SELECT count(*) FROM outbox_events").await, 1);
    assert_eq!(server.stock("tea").await, 998);

    // The key from the idempotency-key metadata entry instead: it wins
    // over the message's request_id.
    let mut by_metadata = create_request("", "tea", 1);
    by_metadata
        .metadata_mut()
        .insert("idempotency-key", MetadataValue::from_static("meta-1"));
    let by_metadata = create(&channel, by_metadata).await.expect("created");
    assert_eq!(
        server.key_record("meta-1").await,
        Some(("completed".into(), Some(by_metadata.get_ref().id.clone())))
    );

    // GetOrder passes the layer untouched and reads the order; the keys
    // are CreateOrder's alone, under the method's full name.
    assert_eq!(get(&channel, &order.id).await.expect("found"), order);
    assert_eq!(
        get(&channel, "no-such-order").await.unwrap_err().code(),
        Code::NotFound
    );
    assert_eq!(
        server
            .count(
                "SELECT count(*) FROM idempotency_requests \
                 WHERE endpoint = 'orders.v1.Orders/CreateOrder'"
            )
            .await,
        2
    );
    assert_eq!(
        server
            .count("SELECT count(*) FROM idempotency_requests")
            .await,
        2
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_replay_carries_the_same_frames_and_trailers() {
    let server = Server::start().await;
    let channel = server.channel().await;
    let first = create_on_the_wire(&channel, "wire-1").await;
    let replay = create_on_the_wire(&server.channel().await, "wire-1").await;

    let trailers = first
        .trailers
        .clone()
        .expect("the first answer ends with trailers");
    assert_eq!(trailers["grpc-status"], "0");
    assert_eq!(replay.body, first.body, "the same framed message");
    assert_eq!(replay.trailers, first.trailers, "the same trailers");
    assert_eq!(replay.headers["idempotent-replayed"], "true");
    assert_eq!(replay.headers["content-type"], "application/grpc");
    assert!(!first.headers.contains_key("idempotent-replayed"));
    let message = tower_idempotency::key::grpc_message(&first.body).expect("one frame");
    let order = Order::decode(message).expect("an Order");
    assert_eq!(server.count("SELECT count(*) FROM grpc_orders").await, 1);
    assert_eq!(
        server.key_record("wire-1").await,
        Some(("completed".into(), Some(order.id)))
    );
}

/// A relay between the client and the server whose connection the test
/// can cut: the client's request reaches the server, the answer never
/// reaches the client.
struct CuttableLink {
    address: String,
    cut: tokio::sync::watch::Sender<bool>,
}

impl CuttableLink {
    async fn to(server: &str) -> CuttableLink {
        let listener = TcpListener::bind("127.0.0.1:0").await.unwrap();
        let address = listener.local_addr().unwrap().to_string();
        let (cut, cut_seen) = tokio::sync::watch::channel(false);
        let server = server.to_owned();
        tokio::spawn(async move {
            while let Ok((mut client, _)) = listener.accept().await {
                let mut upstream = TcpStream::connect(&server).await.unwrap();
                let mut cut_seen = cut_seen.clone();
                tokio::spawn(async move {
                    tokio::select! {
                        _ = tokio::io::copy_bidirectional(&mut client, &mut upstream) => {}
                        // Both sockets are dropped: the connection is gone.
                        _ = cut_seen.wait_for(|cut| *cut) => {}
                    }
                });
            }
        });
        CuttableLink { address, cut }
    }

    fn cut(&self) {
        self.cut.send_replace(true);
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_retry_after_the_connection_was_cut_gets_the_order_the_first_call_created() {
    let server = Server::start().await;
    let link = CuttableLink::to(&server.address).await;
    // The order's insert waits for this lock: the call is inside its
    // transaction, owning its key, when its connection is cut.
    let blocker = server.db.client().await;
    blocker
        .batch_execute("BEGIN; LOCK TABLE grpc_orders IN ACCESS EXCLUSIVE MODE")
        .await
        .unwrap();
    let through_link = connect(&link.address).await;
    let first =
        tokio::spawn(async move { create(&through_link, create_request("cut-1", "tea", 3)).await });
    server.wait_until_blocked_on("grpc_orders").await;
    link.cut();
    let first = first.await.unwrap();
    assert!(
        first.is_err(),
        "the first call lost its connection: {first:?}"
    );

    // The retry on a new connection waits for the first call's commit and
    // gets its order.
    let channel = server.channel().await;
    let retry =
        tokio::spawn(async move { create(&channel, create_request("cut-1", "tea", 3)).await });
    blocker.batch_execute("COMMIT").await.unwrap();
    let retry = retry.await.unwrap().expect("the retry is answered");
    assert!(
        replayed(retry.metadata()),
        "the first call committed; the retry replays it"
    );
    assert_eq!(server.count("SELECT count(*) FROM grpc_orders").await, 1);
    assert_eq!(server.count("SELECT count(*) FROM outbox_events").await, 1);
    assert_eq!(server.stock("tea").await, 997, "the stock taken once");
    let id: String = server
        .sql
        .query_one("SELECT id::text FROM grpc_orders", &[])
        .await
        .unwrap()
        .get(0);
    assert_eq!(retry.get_ref().id, id);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_reused_request_id_is_refused_with_failed_precondition() {
    let server = Server::start().await;
    let channel = server.channel().await;
    create(&channel, create_request("reused", "tea", 1))
        .await
        .expect("created");
    let other = create(&channel, create_request("reused", "tea", 5))
        .await
        .expect_err("another order under the same request_id");
    assert_eq!(other.code(), Code::FailedPrecondition, "{other:?}");
    // The stable code, for a client that branches on it: an ErrorInfo in
    // the status details (AIP-193), as tonic hands them over.
    let status = rpc::Status::decode(other.details()).expect("a google.rpc.Status");
    assert_eq!(status.code, Code::FailedPrecondition as i32);
    assert_eq!(status.message, other.message());
    let info = status
        .details
        .iter()
        .find(|any| any.type_url == "type.googleapis.com/google.rpc.ErrorInfo")
        .map(|any| rpc::ErrorInfo::decode(any.value.as_slice()).expect("an ErrorInfo"))
        .expect("an ErrorInfo among the details");
    assert_eq!(
        (info.reason.as_str(), info.domain.as_str()),
        ("IDEMPOTENCY_KEY_REUSED", "tower-idempotency")
    );
    assert_eq!(info.metadata["code"], "idempotency_key_reused");
    assert_eq!(server.count("SELECT count(*) FROM grpc_orders").await, 1);
    assert_eq!(server.stock("tea").await, 999);
}

/// `google.rpc.Status` and `ErrorInfo` as protobuf declares them.
mod rpc {
    #[derive(Clone, PartialEq, prost::Message)]
    pub(super) struct Status {
        #[prost(int32, tag = "1")]
        pub(super) code: i32,
        #[prost(string, tag = "2")]
        pub(super) message: String,
        #[prost(message, repeated, tag = "3")]
        pub(super) details: Vec<Any>,
    }
    #[derive(Clone, PartialEq, prost::Message)]
    pub(super) struct Any {
        #[prost(string, tag = "1")]
        pub(super) type_url: String,
        #[prost(bytes = "vec", tag = "2")]
        pub(super) value: Vec<u8>,
    }
    #[derive(Clone, PartialEq, prost::Message)]
    pub(super) struct ErrorInfo {
        #[prost(string, tag = "1")]
        pub(super) reason: String,
        #[prost(string, tag = "2")]
        pub(super) domain: String,
        #[prost(map = "string, string", tag = "3")]
        pub(super) metadata: std::collections::HashMap<String, String>,
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn unavailable_rolls_the_order_back_and_its_retry_creates_it() {
    let server = Server::start().await;
    let channel = server.channel().await;
    // The SKU's stock row is locked past the handler's lock timeout, after
    // the order and its event were written.
    let blocker = server.db.client().await;
    blocker
        .batch_execute(
            "BEGIN; SELECT * FROM grpc_stock WHERE tenant_id = 'tenant-a' AND sku = 'tea' FOR UPDATE",
        )
        .await
        .unwrap();
    let failed = create(&channel, create_request("busy-1", "tea", 4))
        .await
        .expect_err("the stock is busy");
    assert_eq!(failed.code(), Code::Unavailable, "{failed:?}");
    assert!(!replayed(failed.metadata()));
    // Rolled back: no order, no event, no key.
    assert_eq!(server.count("SELECT count(*) FROM grpc_orders").await, 0);
    assert_eq!(server.count("SELECT count(*) FROM outbox_events").await, 0);
    assert_eq!(server.key_record("busy-1").await, None, "the key is free");

    blocker.batch_execute("COMMIT").await.unwrap();
    let retry = create(&channel, create_request("busy-1", "tea", 4))
        .await
        .expect("the retry runs again and creates the order");
    assert!(!replayed(retry.metadata()));
    assert_eq!(server.count("SELECT count(*) FROM grpc_orders").await, 1);
    assert_eq!(server.count("SELECT count(*) FROM outbox_events").await, 1);
    assert_eq!(server.stock("tea").await, 996);
    assert_eq!(
        server.key_record("busy-1").await,
        Some(("completed".into(), Some(retry.get_ref().id.clone())))
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn concurrent_duplicates_create_one_order_and_all_get_it() {
    let server = Server::start().await;
    let mut calls = Vec::new();
    for _ in 0..8 {
        let channel = server.channel().await;
        calls.push(tokio::spawn(async move {
            create(&channel, create_request("dup-1", "coffee", 2)).await
        }));
    }
    let mut ids = Vec::new();
    let mut replays = 0;
    for call in calls {
        let answer = call
            .await
            .unwrap()
            .expect("every duplicate is answered with the order");
        replays += usize::from(replayed(answer.metadata()));
        ids.push(answer.into_inner().id);
    }
    ids.dedup();
    assert_eq!(ids.len(), 1, "one order id for all: {ids:?}");
    assert_eq!(replays, 7, "one ran, seven replayed");
    assert_eq!(server.count("SELECT count(*) FROM grpc_orders").await, 1);
    assert_eq!(server.count("SELECT count(*) FROM outbox_events").await, 1);
    assert_eq!(server.stock("coffee").await, 998);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn refusals_are_grpc_statuses_and_only_the_deterministic_one_is_remembered() {
    let server = Server::start().await;
    let channel = server.channel().await;

    // An unknown SKU: the handler's INVALID_ARGUMENT, the same on every
    // retry, remembered and replayed.
    let unknown = create(&channel, create_request("unknown-sku", "caviar", 1))
        .await
        .expect_err("no such SKU");
    assert_eq!(unknown.code(), Code::InvalidArgument);
    assert!(unknown.message().contains("caviar"), "{unknown:?}");
    let again = create(&channel, create_request("unknown-sku", "caviar", 1))
        .await
        .expect_err("replayed");
    assert_eq!(
        (again.code(), again.message()),
        (unknown.code(), unknown.message())
    );
    assert!(replayed(again.metadata()));
    assert_eq!(
        server
            .key_record("unknown-sku")
            .await
            .map(|(state, _)| state),
        Some("completed".into())
    );

    // Out of stock: not remembered (stock may come back).
    let greedy = create(&channel, create_request("greedy", "tea", 1000)).await;
    assert!(greedy.is_ok(), "{greedy:?}");
    let empty = create(&channel, create_request("none-left", "tea", 1))
        .await
        .expect_err("out of stock");
    assert_eq!(empty.code(), Code::FailedPrecondition);
    assert_eq!(server.key_record("none-left").await, None);

    // The layer's own answers: no key, an invalid message, no tenant.
    let no_key = create(&channel, create_request("", "tea", 1))
        .await
        .expect_err("no key");
    assert_eq!(no_key.code(), Code::InvalidArgument, "{no_key:?}");
    let invalid = create(&channel, create_request("zero", "tea", 0))
        .await
        .expect_err("quantity 0");
    assert_eq!(invalid.code(), Code::InvalidArgument, "{invalid:?}");
    assert_eq!(server.key_record("zero").await, None);
    let mut anonymous = create_request("anon", "tea", 1);
    anonymous.metadata_mut().remove("authorization");
    let anonymous = create(&channel, anonymous).await.expect_err("no token");
    assert_eq!(anonymous.code(), Code::Unauthenticated);
    assert_eq!(server.key_record("anon").await, None);
    assert_eq!(
        server.count("SELECT count(*) FROM grpc_orders").await,
        1,
        "only the greedy one"
    );
}

/// A gzip-compressed call: the layer reads the key (`request_id`) and the
/// fingerprint from the decompressed message, the handler creates one
/// order, and the server answers compressed; the compressed retry replays
/// it without writing again.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_gzip_call_creates_one_order_and_its_retry_replays_it() {
    let server = Server::start().await;
    let channel = server.channel().await;

    let first = create_gzip(&channel, create_request("gz-1", "tea", 2))
        .await
        .expect("a compressed call is created");
    assert!(!replayed(first.metadata()));
    assert_eq!(
        first
            .metadata()
            .get("grpc-encoding")
            .map(|v| v.to_str().unwrap()),
        Some("gzip"),
        "the example answers compressed to a client that accepts gzip"
    );
    let order = first.get_ref().clone();
    assert_eq!((order.quantity, order.total), (2, 900));
    assert_eq!(server.count("SELECT count(*) FROM grpc_orders").await, 1);
    assert_eq!(server.count("SELECT count(*) FROM outbox_events").await, 1);
    assert_eq!(
        server
            .count("SELECT count(*) FROM idempotency_requests")
            .await,
        1
    );
    assert_eq!(
        server.key_record("gz-1").await,
        Some(("completed".into(), Some(order.id.clone())))
    );
    assert_eq!(server.stock("tea").await, 998);

    let again = create_gzip(&server.channel().await, create_request("gz-1", "tea", 2))
        .await
        .expect("replayed");
    assert!(replayed(again.metadata()));
    assert_eq!(again.get_ref(), &order);
    assert_eq!(server.count("SELECT count(*) FROM grpc_orders").await, 1);
    assert_eq!(server.count("SELECT count(*) FROM outbox_events").await, 1);
    assert_eq!(
        server
            .count("SELECT count(*) FROM idempotency_requests")
            .await,
        1
    );
    assert_eq!(server.stock("tea").await, 998);

    // Another order under the same request_id, compressed: the fingerprint
    // is the decompressed message's, so the reuse is seen.
    let reused = create_gzip(&channel, create_request("gz-1", "tea", 3))
        .await
        .expect_err("another order under the same request_id");
    assert_eq!(reused.code(), Code::FailedPrecondition, "{reused:?}");
    assert_eq!(server.count("SELECT count(*) FROM grpc_orders").await, 1);
}

/// Compression is a per-call client option: an uncompressed call retried
/// compressed, and a compressed call retried uncompressed, are the same
/// operation (the same key, the same fingerprint) and replay the first
/// answer.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_retry_compressed_otherwise_than_the_first_call_replays_it() {
    let server = Server::start().await;
    let channel = server.channel().await;

    let plain = create(&channel, create_request("mixed-1", "coffee", 1))
        .await
        .expect("created uncompressed");
    let gzip_retry = create_gzip(&channel, create_request("mixed-1", "coffee", 1))
        .await
        .expect("the compressed retry is answered");
    assert!(replayed(gzip_retry.metadata()));
    assert_eq!(gzip_retry.get_ref(), plain.get_ref());
    assert_eq!(server.count("SELECT count(*) FROM grpc_orders").await, 1);
    assert_eq!(
        server
            .count("SELECT count(*) FROM idempotency_requests")
            .await,
        1
    );

    // The other way round; the first call sends gzip but reads only
    // uncompressed answers, as the plain retry does.
    let mut send_only = Grpc::new(channel.clone()).send_compressed(CompressionEncoding::Gzip);
    send_only.ready().await.expect("the channel is ready");
    let compressed = send_only
        .unary(
            create_request("mixed-2", "coffee", 2),
            PathAndQuery::from_static(proto::CREATE_ORDER),
            ProstCodec::default(),
        )
        .await
        .expect("created compressed");
    assert!(!replayed(compressed.metadata()));
    let plain_retry = create(&channel, create_request("mixed-2", "coffee", 2))
        .await
        .expect("the uncompressed retry is answered");
    assert!(replayed(plain_retry.metadata()));
    assert_eq!(plain_retry.get_ref(), compressed.get_ref());
    assert_eq!(server.count("SELECT count(*) FROM grpc_orders").await, 2);
    assert_eq!(
        server
            .count("SELECT count(*) FROM idempotency_requests")
            .await,
        2
    );
    assert_eq!(server.stock("coffee").await, 997);
}
