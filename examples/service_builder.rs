//! Where the idempotency layer goes in a `tower::ServiceBuilder`, on an
//! axum route. Outermost first: compression, authentication, idempotency,
//! the handler.
//!
//!     cargo run --example service_builder
//!     curl -i --compressed -X POST http://127.0.0.1:3002/orders -H 'authorization: Bearer demo-token-a' \
//!          -H 'idempotency-key: k1' -H 'content-type: application/json' -d '{"checkout_id":"c1","total":1200}'
//!
//! With `DATABASE_URL` unset it starts a private, temporary PostgreSQL and
//! removes it on exit; `SERVICE_BUILDER_ADDR` sets the address. Ctrl-C
//! stops it after the requests in flight.

use std::time::Duration;

use axum::{
    extract::Request,
    middleware::{self, Next},
    response::Response,
    routing::post,
    Json, Router,
};
use http::StatusCode;
use serde::{Deserialize, Serialize};
use serde_json::{json, Value};
use tower::ServiceBuilder;
use tower_http::compression::CompressionLayer;
use tower_idempotency::{
    fingerprint::{TypedFingerprinter, Validated},
    postgres::{PgStore, PgTx, TxError},
    scope::TenantId,
    testing::TempPostgres,
    IdempotencyLayer,
};

#[derive(Serialize, Deserialize)]
struct NewOrder {
    checkout_id: String,
    total: i64,
}

/// Stands in for real authentication: the tenant the layer scopes keys by.
async fn authenticate(mut request: Request, next: Next) -> Response {
    if request
        .headers()
        .get("authorization")
        .is_some_and(|v| v == "Bearer demo-token-a")
    {
        request.extensions_mut().insert(TenantId::new("tenant-a"));
    }
    next.run(request).await
}

/// A failed statement answers its problem (503 or 500, never the SQL) and
/// the layer rolls the work back.
async fn create(
    tx: PgTx,
    order: Validated<NewOrder>,
) -> Result<(StatusCode, Json<Value>), TxError> {
    let row = tx
        .query_one(
            "INSERT INTO builder_orders (tenant_id, checkout_id, total) VALUES ($1, $2, $3) RETURNING id",
            &[&tx.tenant(), &order.checkout_id, &order.total],
        )
        .await?;
    Ok((
        StatusCode::CREATED,
        Json(json!({ "id": row.get::<_, i64>(0) })),
    ))
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
            "CREATE TABLE IF NOT EXISTS builder_orders (id bigserial PRIMARY KEY, \
             tenant_id text NOT NULL, checkout_id text NOT NULL, total bigint NOT NULL)",
        )
        .await?;

    let idempotency = IdempotencyLayer::new(
        store,
        "POST /orders v1",
        TypedFingerprinter::<NewOrder>::new("orders.v1"),
    );
    let stack = ServiceBuilder::new()
        // 1. Compression, outermost: it encodes what leaves the server for
        //    the client at hand. Inside the layer it would remember one
        //    client's gzip and replay it to a retry that accepts none.
        .layer(CompressionLayer::new())
        // 2. Authentication: the layer scopes keys by the tenant it puts in
        //    the request, and answers 401 without one.
        .layer(middleware::from_fn(authenticate))
        // 3. Idempotency, next to the handler: what it remembers and
        //    replays is the handler's own answer.
        .layer(idempotency.clone());
    let app = Router::new().route("/orders", post(create).layer(stack));

    let addr = std::env::var("SERVICE_BUILDER_ADDR").unwrap_or_else(|_| "127.0.0.1:3002".into());
    let listener = tokio::net::TcpListener::bind(&addr).await?;
    println!("listening on http://{}", listener.local_addr()?);
    axum::serve(listener, app)
        .with_graceful_shutdown(async {
            let _ = tokio::signal::ctrl_c().await;
        })
        .await?;
    // Owners whose clients left commit before the database goes.
    let _ = tokio::time::timeout(Duration::from_secs(10), idempotency.drained()).await;
    Ok(())
}
