//! A tonic gRPC service whose `CreateOrder` is idempotent: `orders.v1.Orders`
//! (`orders.proto` beside this file), the server tonic-prost-build generates
//! from it on tonic's HTTP/2 server, and the idempotency layer in front of
//! it guarding `CreateOrder` by its path (`IdempotencyLayer::on_paths`):
//! no router of our own.
//!
//!     cargo run --example grpc_orders
//!
//! With `DATABASE_URL` unset it starts a private, temporary PostgreSQL and
//! removes it on exit. It listens on `GRPC_ORDERS_ADDR` (default
//! `127.0.0.1:50051`) and prints `listening on ADDR` once it serves.
//! `GRPC_ORDERS_TOKENS` maps bearer tokens to tenants (default
//! `demo-token-a=tenant-a,demo-token-b=tenant-b`); each tenant sells `tea`
//! (450 a unit) and `coffee` (1200), 1000 units of each to start with.
//!
//! `CreateOrder` takes its key from the message's `request_id` (AIP-155),
//! or from an `idempotency-key` metadata entry. Its order row, the order's
//! `OrderCreated` outbox event, the stock it takes and the remembered
//! answer commit in one transaction; a retry gets the same message and
//! trailers back, marked `idempotent-replayed: true`. `grpc-status`
//! decides what is remembered: `OK`, and `INVALID_ARGUMENT` for an unknown
//! SKU (the same on every retry); `UNAVAILABLE` (the SKU's stock row stayed
//! locked for a second) and `FAILED_PRECONDITION` (out of stock) roll back
//! and free the key. The layer's own answers are gRPC statuses: a reused
//! `request_id` is `FAILED_PRECONDITION`, one still running `ABORTED` with
//! `grpc-retry-pushback-ms`. Calls may be gzip-compressed (the layer reads
//! the key and the fingerprint from the decompressed message, so a
//! compressed retry of an uncompressed call replays it), and a client that
//! accepts gzip gets its answer compressed. Try it with grpcurl:
//!
//! ```text
//! grpcurl -plaintext -proto examples/grpc_orders/orders.proto \
//!   -H 'authorization: Bearer demo-token-a' \
//!   -d '{"request_id": "9f1c2d0e-order-1", "sku": "tea", "quantity": 2}' \
//!   127.0.0.1:50051 orders.v1.Orders/CreateOrder
//! ```

mod proto;
mod service;

use std::{collections::HashMap, sync::Arc, time::Duration};

use tokio::net::TcpListener;
use tonic::{
    service::InterceptorLayer,
    transport::{server::TcpIncoming, Server},
};
use tower_idempotency::{postgres::PgStore, scope::TenantId, testing::TempPostgres};

type Error = Box<dyn std::error::Error + Send + Sync>;

#[tokio::main]
async fn main() {
    tracing_subscriber::fmt()
        .with_env_filter(
            tracing_subscriber::EnvFilter::try_from_default_env()
                .unwrap_or_else(|_| tracing_subscriber::EnvFilter::new("info")),
        )
        .with_writer(std::io::stderr)
        .with_ansi(std::io::IsTerminal::is_terminal(&std::io::stderr()))
        .init();
    if let Err(e) = run().await {
        eprintln!("grpc_orders: {e}");
        std::process::exit(1);
    }
}

async fn run() -> Result<(), Error> {
    let var = |name| {
        std::env::var(name)
            .ok()
            .filter(|v: &String| !v.trim().is_empty())
    };
    let addr = var("GRPC_ORDERS_ADDR").unwrap_or_else(|| "127.0.0.1:50051".into());
    let tokens = tokens(
        &var("GRPC_ORDERS_TOKENS")
            .unwrap_or_else(|| "demo-token-a=tenant-a,demo-token-b=tenant-b".into()),
    )?;

    // Kept alive until the server stops; dropping it removes the cluster.
    let _private_cluster;
    let store = match var("DATABASE_URL") {
        Some(url) => PgStore::connect(&url)?,
        None => {
            let cluster = tokio::task::spawn_blocking(TempPostgres::start).await??;
            let store = PgStore::builder(cluster.config()).build()?;
            _private_cluster = cluster;
            store
        }
    };
    store.migrate().await?;
    let client = store.client().await?;
    client.batch_execute(service::SCHEMA).await?;
    for tenant in tokens.values() {
        client
            .execute(
                "INSERT INTO grpc_stock (tenant_id, sku, unit_price, available) \
                 VALUES ($1, 'tea', 450, 1000), ($1, 'coffee', 1200, 1000) \
                 ON CONFLICT DO NOTHING",
                &[&tenant.as_str()],
            )
            .await?;
    }
    drop(client);

    let listener = TcpListener::bind(&addr)
        .await
        .map_err(|e| format!("cannot listen on GRPC_ORDERS_ADDR={addr}: {e}"))?;
    let local = listener.local_addr()?;
    println!("listening on {local}");
    // Outermost first: the tenant from the bearer token, then the
    // idempotency of CreateOrder, then the server tonic generated.
    Server::builder()
        .layer(InterceptorLayer::new(service::authenticate(Arc::new(
            tokens,
        ))))
        .layer(service::idempotency(store.clone(), Duration::from_secs(10)))
        .add_service(service::server(store))
        .serve_with_incoming_shutdown(TcpIncoming::from(listener), stopped())
        .await?;
    Ok(())
}

/// `token=tenant,token=tenant`.
fn tokens(spec: &str) -> Result<HashMap<String, TenantId>, String> {
    spec.split(',')
        .map(str::trim)
        .filter(|pair| !pair.is_empty())
        .map(|pair| match pair.split_once('=') {
            Some((token, tenant)) if !token.trim().is_empty() && !tenant.trim().is_empty() => {
                Ok((token.trim().to_owned(), TenantId::new(tenant.trim())))
            }
            _ => Err(format!("GRPC_ORDERS_TOKENS: {pair:?} is not token=tenant")),
        })
        .collect()
}

/// Resolves on SIGINT or SIGTERM.
async fn stopped() {
    use tokio::signal::unix::{signal, SignalKind};
    let (Ok(mut interrupt), Ok(mut terminate)) = (
        signal(SignalKind::interrupt()),
        signal(SignalKind::terminate()),
    ) else {
        return std::future::pending().await;
    };
    tokio::select! {
        _ = interrupt.recv() => {}
        _ = terminate.recv() => {}
    }
}
