//! gRPC: the example's `orders.v1.Orders` (examples/grpc_orders), the
//! server tonic generated on tonic's HTTP/2 server with `CreateOrder`
//! behind the layer, against the same generated server whose `CreateOrder`
//! runs the same statements (order, outbox event, stock) in a transaction
//! of its own, without the layer.
//! Tonic clients over loopback (32 calls at a time over 4 HTTP/2
//! connections), closed loop, rounds alternating, medians reported.

use std::{
    collections::HashMap,
    net::SocketAddr,
    sync::{
        atomic::{AtomicUsize, Ordering},
        Arc,
    },
    time::{Duration, Instant},
};

use tokio::net::TcpListener;
use tonic::{
    metadata::MetadataValue,
    service::InterceptorLayer,
    transport::{server::TcpIncoming, Channel, Endpoint, Server},
    Status,
};
use tower_idempotency::{postgres::PgStore, scope::TenantId};

use crate::{
    grpc_service::{
        authenticate, idempotency, server, INSERT_ORDER, LOCK_TIMEOUT, SCHEMA, TAKE_STOCK,
    },
    load::{percentile, CONCURRENCY},
    proto::{
        orders_client::OrdersClient,
        orders_server::{Orders, OrdersServer},
        CreateOrderRequest, GetOrderRequest, Order,
    },
    servers, Settings,
};

const TOKEN: &str = "bench-token";
const CONNECTIONS: usize = 4;
/// Keys created before the rounds, replayed by the replay scenario.
const REPLAY_KEYS: usize = 1000;
/// SKUs the calls spread over, so that the stock's row locks do not
/// serialise them (one hot row would measure its lock, not the layer).
const SKUS: usize = 64;

#[derive(Clone, Copy, Debug, PartialEq, Eq)]
enum Kind {
    /// The server without the layer: no key.
    Bare,
    /// A new `request_id` every call.
    Create,
    /// A `request_id` created before the rounds.
    Replay,
}

/// What the section measured: the layered create's and the replay's
/// throughput against the bare server's.
#[derive(Clone, Copy, Debug)]
pub(crate) struct GrpcRatios {
    pub(crate) create_vs_bare: f64,
    pub(crate) replay_vs_create: f64,
    pub(crate) p99_create_vs_bare: f64,
}

pub(crate) async fn run(config: &tokio_postgres::Config, s: &Settings) -> GrpcRatios {
    let setup = PgStore::builder(config.clone()).build().expect("store");
    let client = setup.client().await.expect("client");
    client.batch_execute(SCHEMA).await.expect("schema");
    client
        .batch_execute(
            "INSERT INTO grpc_stock (tenant_id, sku, unit_price, available) \
             SELECT 'bench', 'sku-' || n, 450, 2000000000 FROM generate_series(0, 63) AS n \
             ON CONFLICT DO NOTHING",
        )
        .await
        .expect("stock");
    drop(client);
    let tokens = Arc::new(HashMap::from([(TOKEN.to_owned(), TenantId::new("bench"))]));
    // Both servers are the generated one behind the same authentication;
    // the layered one has the example's idempotency layer too.
    let store = servers::store(config);
    let (incoming, layered) = listen().await;
    tokio::spawn(
        Server::builder()
            .layer(InterceptorLayer::new(authenticate(tokens.clone())))
            .layer(idempotency(store.clone(), Duration::from_secs(10)))
            .add_service(server(store))
            .serve_with_incoming(incoming),
    );
    let (incoming, bare) = listen().await;
    tokio::spawn(
        Server::builder()
            .layer(InterceptorLayer::new(authenticate(tokens)))
            .add_service(OrdersServer::new(BareOrders {
                pool: servers::bare_pool(config),
            }))
            .serve_with_incoming(incoming),
    );
    let scenarios = [
        ("grpc bare", bare, Kind::Bare),
        ("grpc create", layered, Kind::Create),
        ("grpc replay", layered, Kind::Replay),
    ];
    let clients: Vec<Vec<Channel>> = futures_util::future::join_all(
        scenarios
            .iter()
            .map(|(_, addr, _)| async move { channels(*addr).await }),
    )
    .await;
    // The keys the replays ask for, created once.
    for n in 0..REPLAY_KEYS {
        call(&clients[1][0], Kind::Create, &format!("replay-{n}"), n)
            .await
            .expect("created");
    }
    let next = AtomicUsize::new(0);
    for ((name, _, kind), channels) in scenarios.iter().zip(&clients) {
        let _ = round(channels, *kind, Duration::from_secs(1), &next).await;
        let _ = name;
    }
    let mut runs: Vec<Vec<(f64, f64, f64)>> = vec![Vec::new(); scenarios.len()];
    for round_no in 1..=s.rounds {
        for (i, ((name, _, kind), channels)) in scenarios.iter().zip(&clients).enumerate() {
            let (tput, p50, p99, unexpected) = round(channels, *kind, s.duration, &next).await;
            println!(
                "round {round_no} {name}: {tput:.0} req/s, p50 {p50:.2} ms, p99 {p99:.2} ms{}",
                if unexpected > 0 {
                    format!(", {unexpected} unexpected answers")
                } else {
                    String::new()
                }
            );
            runs[i].push((tput, p50, p99));
        }
    }
    let median = |values: &mut Vec<f64>| {
        values.sort_by(f64::total_cmp);
        values[values.len() / 2]
    };
    let stats: Vec<(f64, f64, f64)> = runs
        .iter()
        .map(|r| {
            (
                median(&mut r.iter().map(|x| x.0).collect()),
                median(&mut r.iter().map(|x| x.1).collect()),
                median(&mut r.iter().map(|x| x.2).collect()),
            )
        })
        .collect();
    println!(
        "\n| gRPC scenario (median of {} rounds) | req/s | p50 ms | p99 ms |",
        s.rounds
    );
    println!("| --- | ---: | ---: | ---: |");
    for ((name, _, _), (tput, p50, p99)) in scenarios.iter().zip(&stats) {
        println!("| {name} | {tput:.0} | {p50:.2} | {p99:.2} |");
    }
    GrpcRatios {
        create_vs_bare: stats[1].0 / stats[0].0,
        replay_vs_create: stats[2].0 / stats[1].0,
        p99_create_vs_bare: stats[1].2 / stats[0].2,
    }
}

/// A listener on a port of loopback the system picks.
async fn listen() -> (TcpIncoming, SocketAddr) {
    let listener = TcpListener::bind("127.0.0.1:0").await.expect("bind");
    let addr = listener.local_addr().expect("address");
    (TcpIncoming::from(listener), addr)
}

async fn channels(addr: SocketAddr) -> Vec<Channel> {
    let mut channels = Vec::new();
    for _ in 0..CONNECTIONS {
        channels.push(
            Endpoint::from_shared(format!("http://{addr}"))
                .expect("uri")
                .connect()
                .await
                .expect("connects"),
        );
    }
    channels
}

async fn call(channel: &Channel, kind: Kind, request_id: &str, n: usize) -> Result<Order, Status> {
    let mut request = tonic::Request::new(CreateOrderRequest {
        request_id: if kind == Kind::Bare {
            String::new()
        } else {
            request_id.to_owned()
        },
        sku: format!("sku-{}", n % SKUS),
        quantity: 1,
    });
    request.metadata_mut().insert(
        "authorization",
        MetadataValue::from_static("Bearer bench-token"),
    );
    OrdersClient::new(channel.clone())
        .create_order(request)
        .await
        .map(tonic::Response::into_inner)
}

/// One closed-loop run: throughput, p50 and p99 in ms, unexpected answers.
async fn round(
    channels: &[Channel],
    kind: Kind,
    duration: Duration,
    next: &AtomicUsize,
) -> (f64, f64, f64, usize) {
    let start = Instant::now();
    let deadline = start + duration;
    let tasks = (0..CONCURRENCY).map(|i| {
        let channel = channels[i % channels.len()].clone();
        async move {
            let mut latencies = Vec::new();
            let mut unexpected = 0;
            while Instant::now() < deadline {
                let n = next.fetch_add(1, Ordering::Relaxed);
                let (key, n) = match kind {
                    Kind::Replay => (format!("replay-{}", n % REPLAY_KEYS), n % REPLAY_KEYS),
                    _ => (format!("key-{n}"), n),
                };
                let sent = Instant::now();
                match call(&channel, kind, &key, n).await {
                    Ok(_) => latencies.push(sent.elapsed().as_micros() as u64),
                    Err(_) => unexpected += 1,
                }
            }
            (latencies, unexpected)
        }
    });
    let results = futures_util::future::join_all(tasks).await;
    let seconds = start.elapsed().as_secs_f64();
    let mut latencies: Vec<u64> = Vec::new();
    let mut unexpected = 0;
    for (l, u) in results {
        latencies.extend(l);
        unexpected += u;
    }
    latencies.sort_unstable();
    (
        latencies.len() as f64 / seconds,
        percentile(&latencies, 0.50) as f64 / 1000.0,
        percentile(&latencies, 0.99) as f64 / 1000.0,
        unexpected,
    )
}

/// The same tonic server without the layer: `CreateOrder` opens its own
/// transaction and runs the example's statements in it.
#[derive(Clone)]
struct BareOrders {
    pool: servers::BarePool,
}

#[tonic::async_trait]
impl Orders for BareOrders {
    async fn create_order(
        &self,
        request: tonic::Request<CreateOrderRequest>,
    ) -> Result<tonic::Response<Order>, Status> {
        bare_create(self.pool.clone(), request).await
    }

    async fn get_order(
        &self,
        _: tonic::Request<GetOrderRequest>,
    ) -> Result<tonic::Response<Order>, Status> {
        Err(Status::unimplemented("not measured"))
    }
}

async fn bare_create(
    pool: servers::BarePool,
    request: tonic::Request<CreateOrderRequest>,
) -> Result<tonic::Response<Order>, Status> {
    let order = request.into_inner();
    let quantity = order.quantity as i32;
    let client = pool
        .get()
        .await
        .map_err(|_| Status::unavailable("no connection"))?;
    let result = async {
        let insert = client.prepare_cached(INSERT_ORDER).await?;
        let enqueue = client
            .prepare_cached(
                "INSERT INTO outbox_events (tenant_id, aggregate_id, event_type, payload) \
                 VALUES ($1::text, $2::text, $3::text, $4::jsonb) RETURNING id::text",
            )
            .await?;
        let take = client.prepare_cached(TAKE_STOCK).await?;
        let params: [&(dyn tokio_postgres::types::ToSql + Sync); 3] =
            [&"bench", &order.sku, &quantity];
        let (_, row) = tokio::try_join!(biased;
            client.batch_execute("BEGIN"),
            client.query_one(&insert, &params))?;
        let id: String = row.get(0);
        let total: i64 = row.get(1);
        let created_at: time::OffsetDateTime = row.get(2);
        let payload = serde_json::json!({"id": id, "sku": order.sku, "quantity": order.quantity, "total": total});
        client
            .query_one(&enqueue, &[&"bench", &id, &"OrderCreated", &payload])
            .await?;
        client.batch_execute(LOCK_TIMEOUT).await?;
        client
            .execute(&take, &[&"bench", &order.sku, &quantity])
            .await?;
        client.batch_execute("COMMIT").await?;
        Ok::<_, tokio_postgres::Error>(Order {
            id,
            sku: order.sku.clone(),
            quantity: order.quantity,
            total,
            created_at: created_at
                .format(&time::format_description::well_known::Rfc3339)
                .unwrap_or_default(),
        })
    }
    .await;
    match result {
        Ok(order) => Ok(tonic::Response::new(order)),
        Err(_) => {
            let _ = client.batch_execute("ROLLBACK").await;
            Err(Status::unavailable("the order could not be written"))
        }
    }
}
