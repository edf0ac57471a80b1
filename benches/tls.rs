//! What TLS costs: the layer's create (claim, the handler's insert,
//! completion and commit) over TCP with `sslmode=disable` and with
//! `sslmode=verify-full`, on one server (durable) that accepts both, rounds
//! alternating, medians and their ratio reported from one run; and a new
//! connection's cost (TCP, TLS handshake, SCRAM authentication, `SELECT 1`)
//! each way, which a pool pays once per connection.
//!
//!     cargo bench --bench tls
//!
//! Environment: `TLS_SECONDS` (per run, default 3), `TLS_ROUNDS` (default
//! 3), `TLS_CONNECTIONS` (new connections timed each way, default 200).

#[path = "support/create.rs"]
mod create;
#[path = "../tests/common/tls_server.rs"]
mod tls_server;

use std::{
    sync::atomic::{AtomicU64, Ordering},
    time::{Duration, Instant},
};

use bytes::Bytes;
use create::{layered, Service};
use http::{Request, StatusCode};
use http_body_util::{BodyExt, Full};
use tls_server::{TlsServer, EITHER};
use tower::ServiceExt;
use tower_idempotency::postgres::PgStore;

const POOL: usize = 16;
const CONCURRENCY: usize = 16;

fn main() {
    let seconds = env("TLS_SECONDS", 3);
    let rounds = env("TLS_ROUNDS", 3) as usize;
    let connections = env("TLS_CONNECTIONS", 200) as usize;
    let runtime = tokio::runtime::Builder::new_multi_thread()
        .worker_threads(2)
        .enable_all()
        .build()
        .expect("runtime");
    runtime.block_on(run(Duration::from_secs(seconds), rounds, connections));
}

fn env(name: &str, default: u64) -> u64 {
    std::env::var(name)
        .ok()
        .and_then(|s| s.parse().ok())
        .unwrap_or(default)
}

async fn run(duration: Duration, rounds: usize, connections: usize) {
    let server = tokio::task::spawn_blocking(|| TlsServer::start(EITHER, true))
        .await
        .expect("start");
    let db = server.database().await;
    let plain = server.url("127.0.0.1", &db, "sslmode=disable");
    let tls = server.url(
        "127.0.0.1",
        &db,
        &format!("sslmode=verify-full&sslrootcert={}", server.ca()),
    );
    let setup = PgStore::connect(&plain).expect("store");
    setup.migrate().await.expect("migrate");
    setup
        .client()
        .await
        .expect("client")
        .batch_execute(
            "CREATE TABLE orders (id bigint GENERATED ALWAYS AS IDENTITY PRIMARY KEY, \
                                  tenant_id text NOT NULL, total bigint NOT NULL)",
        )
        .await
        .expect("schema");

    let variants = [("plain", &plain), ("TLS verify-full", &tls)];
    let services: Vec<Service> = variants
        .iter()
        .map(|(_, url)| {
            let store = tower_idempotency::postgres::PgStoreBuilder::from_conninfo(url)
                .expect("url")
                .max_connections(POOL)
                .build()
                .expect("store");
            layered(store)
        })
        .collect();
    let keys = AtomicU64::new(0);
    for service in &services {
        load(service, Duration::from_millis(500), &keys).await;
    }
    let mut rates = vec![Vec::new(); variants.len()];
    for round in 1..=rounds {
        for (i, service) in services.iter().enumerate() {
            let rate = load(service, duration, &keys).await;
            println!(
                "round {round} create {:<16} {rate:>8.0} req/s",
                variants[i].0
            );
            rates[i].push(rate);
        }
    }
    let median = |runs: &mut Vec<f64>| {
        runs.sort_by(f64::total_cmp);
        runs[runs.len() / 2]
    };
    let create_plain = median(&mut rates[0]);
    let create_tls = median(&mut rates[1]);

    // New connections, alternating plain and TLS, one at a time.
    let mut took = [Duration::ZERO; 2];
    for _ in 0..connections {
        for (i, (_, url)) in variants.iter().enumerate() {
            let store = PgStore::connect(url).expect("store");
            let started = Instant::now();
            let client = store.client().await.expect("connects");
            client.simple_query("SELECT 1").await.expect("query");
            took[i] += started.elapsed();
        }
    }
    let per = |d: Duration| d.as_secs_f64() * 1000.0 / connections as f64;
    println!();
    println!("| | plain | TLS verify-full |");
    println!("| --- | ---: | ---: |");
    println!("| create, req/s (median of {rounds}) | {create_plain:.0} | {create_tls:.0} |");
    println!(
        "| new connection + SELECT 1, ms (mean of {connections}) | {:.2} | {:.2} |",
        per(took[0]),
        per(took[1])
    );
    println!();
    println!(
        "RATIOS tls_create_vs_plain={:.2} tls_connection_ms_extra={:.2}",
        create_tls / create_plain,
        per(took[1]) - per(took[0])
    );
}

/// `CONCURRENCY` workers creating under fresh keys for `duration`: created
/// per second. Anything but `201` stops the bench.
async fn load(service: &Service, duration: Duration, keys: &AtomicU64) -> f64 {
    let deadline = Instant::now() + duration;
    let started = Instant::now();
    let workers: Vec<_> = (0..CONCURRENCY)
        .map(|_| {
            let service = service.clone();
            let first = keys.fetch_add(1 << 32, Ordering::Relaxed);
            tokio::spawn(async move {
                let mut created = 0u64;
                while Instant::now() < deadline {
                    let key = format!("k{}", first + created);
                    let request = Request::post("/orders")
                        .header("content-type", "application/json")
                        .header("idempotency-key", key)
                        .body(Full::new(Bytes::from_static(b"{\"total\":2400}")))
                        .expect("request");
                    let response = service.clone().oneshot(request).await.expect("answer");
                    assert_eq!(response.status(), StatusCode::CREATED);
                    response.into_body().collect().await.expect("body");
                    created += 1;
                }
                created
            })
        })
        .collect();
    let mut created = 0;
    for worker in workers {
        created += worker.await.expect("worker");
    }
    created as f64 / started.elapsed().as_secs_f64()
}
