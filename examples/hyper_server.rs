//! The layer on plain hyper 1, without axum: a `tower::Service` stack
//! (a tenant from the bearer token, then the idempotency layer, then the
//! handler) served over HTTP/1 with hyper-util.
//!
//!     cargo run --example hyper_server
//!     curl -i -X POST http://127.0.0.1:3001/orders -H 'authorization: Bearer demo-token-a' \
//!          -H 'idempotency-key: k1' -H 'content-type: application/json' -d '{"checkout_id":"c1","total":1200}'
//!
//! With `DATABASE_URL` unset it starts a private, temporary PostgreSQL and
//! removes it on exit; `HYPER_SERVER_ADDR` sets the address. Ctrl-C stops
//! it after the requests in flight.

use std::{convert::Infallible, future::Future, time::Duration};

use bytes::Bytes;
use http::{header::CONTENT_TYPE, HeaderValue, Request, Response, StatusCode};
use http_body_util::Full;
use hyper::server::conn::http1;
use hyper_util::{rt::TokioIo, server::graceful::GracefulShutdown, service::TowerToHyperService};
use serde::Deserialize;
use tower::ServiceBuilder;
use tower_idempotency::{
    fingerprint::{TypedFingerprinter, Validated},
    postgres::{PgStore, PgTx, TxError},
    scope::TenantId,
    testing::TempPostgres,
    IdempotencyLayer, RequestBody,
};

#[derive(Deserialize, serde::Serialize)]
struct NewOrder {
    checkout_id: String,
    total: i64,
}

/// Stands in for real authentication: the layer scopes keys by the tenant
/// it finds here, and answers `401` without one.
fn authenticate(mut request: Request<hyper::body::Incoming>) -> Request<hyper::body::Incoming> {
    if request
        .headers()
        .get("authorization")
        .is_some_and(|v| v == "Bearer demo-token-a")
    {
        request.extensions_mut().insert(TenantId::new("tenant-a"));
    }
    request
}

/// The handler: one row through the layer's transaction. A failed
/// statement answers its problem (`TxError::to_problem`), and the layer
/// rolls the transaction back.
fn create_order(
    request: Request<RequestBody>,
) -> impl Future<Output = Result<Response<Full<Bytes>>, Infallible>> {
    // The layer puts both in the extensions. The future keeps them, not the
    // request, whose body is not `Sync`.
    let tx = request.extensions().get::<PgTx>().cloned();
    let order = request.extensions().get::<Validated<NewOrder>>().cloned();
    async move {
        let answer = async {
            // Missing, the route is not behind the layer: a server
            // misconfiguration, answered 500 below.
            let (Some(tx), Some(order)) = (tx, order) else {
                return Ok(None);
            };
            let row = tx
                .query_one(
                    "INSERT INTO hyper_orders (tenant_id, checkout_id, total) VALUES ($1, $2, $3) RETURNING id",
                    &[&tx.tenant(), &order.checkout_id, &order.total],
                )
                .await?;
            Ok::<_, TxError>(Some(row.get::<_, i64>(0)))
        };
        Ok(match answer.await {
            Ok(Some(id)) => {
                let mut response =
                    Response::new(Full::new(Bytes::from(format!(r#"{{"id":{id}}}"#))));
                *response.status_mut() = StatusCode::CREATED;
                response
                    .headers_mut()
                    .insert(CONTENT_TYPE, HeaderValue::from_static("application/json"));
                response
            }
            Ok(None) => {
                let mut response = Response::new(Full::new(Bytes::new()));
                *response.status_mut() = StatusCode::INTERNAL_SERVER_ERROR;
                response
            }
            Err(e) => e.to_problem().to_response().map(Full::new),
        })
    }
}

#[tokio::main]
async fn main() -> Result<(), Box<dyn std::error::Error>> {
    // Kept alive until the server stops; dropping it removes the cluster.
    let mut _private_cluster = None;
    let store = match std::env::var("DATABASE_URL") {
        Ok(url) => PgStore::connect(&url)?,
        Err(_) => {
            let cluster = tokio::task::spawn_blocking(TempPostgres::start).await??;
            let store = PgStore::builder(cluster.config()).build()?;
            _private_cluster = Some(cluster);
            store
        }
    };
    store.migrate().await?;
    store
        .client()
        .await?
        .batch_execute(
            "CREATE TABLE IF NOT EXISTS hyper_orders (id bigserial PRIMARY KEY, \
             tenant_id text NOT NULL, checkout_id text NOT NULL, total bigint NOT NULL)",
        )
        .await?;

    let idempotency = IdempotencyLayer::new(
        store,
        "POST /orders v1",
        TypedFingerprinter::<NewOrder>::new("orders.v1"),
    );
    // Outermost first: the tenant is known before the layer scopes the key.
    let service = ServiceBuilder::new()
        .map_request(authenticate)
        .layer(idempotency.clone())
        .service_fn(create_order);

    let addr = std::env::var("HYPER_SERVER_ADDR").unwrap_or_else(|_| "127.0.0.1:3001".into());
    let listener = tokio::net::TcpListener::bind(&addr).await?;
    println!("listening on http://{}", listener.local_addr()?);

    let connections = GracefulShutdown::new();
    let mut stop = std::pin::pin!(tokio::signal::ctrl_c());
    loop {
        tokio::select! {
            accepted = listener.accept() => {
                let Ok((stream, _)) = accepted else { continue };
                let connection = http1::Builder::new()
                    .serve_connection(TokioIo::new(stream), TowerToHyperService::new(service.clone()));
                tokio::spawn(connections.watch(connection));
            }
            _ = &mut stop => break,
        }
    }
    // Answer the requests in flight, then let owners whose clients left
    // commit before the database goes.
    let _ = tokio::time::timeout(Duration::from_secs(10), async {
        connections.shutdown().await;
        idempotency.drained().await;
    })
    .await;
    Ok(())
}
