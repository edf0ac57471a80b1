//! The servers under load: the handlers (bare and layered, with two and with
//! five statements; the hand-written claim-at-commit experiment), the schema
//! they write to, and one axum server per store.

use std::net::SocketAddr;

use axum::{
    body::Bytes, extract::State, response::IntoResponse, response::Response, routing::post, Json,
    Router,
};
use http::StatusCode;
use serde::{Deserialize, Serialize};
use tokio_postgres::types::{ToSql, Type};
use tower_idempotency::{
    fingerprint::{TypedFingerprinter, Validated},
    outbox,
    postgres::{PgStore, PgTx, TxError},
    scope::SingleTenant,
    IdempotencyLayer,
};

use crate::load::CUSTOMERS;

/// Connections per server's pool.
pub(crate) const POOL: usize = 16;

#[derive(Debug, Serialize, Deserialize)]
pub(crate) struct NewOrder {
    pub(crate) checkout_id: String,
    pub(crate) total: i64,
}

/// The five-statement handlers' order: the customer is read first.
#[derive(Debug, Serialize, Deserialize)]
pub(crate) struct FullOrder {
    checkout_id: String,
    customer_id: i64,
    total: i64,
}

const INSERT_ORDER: &str =
    "INSERT INTO orders (tenant_id, checkout_id, total) VALUES ($1, $2, $3) RETURNING id::text";
/// The layered handlers' event, `outbox::enqueue`'s own statement: the
/// same text, with its `RETURNING`, for every handler here.
pub(crate) const ENQUEUE: &str = tower_idempotency::testing::statements::ENQUEUE;
const READ_CUSTOMER: &str =
    "SELECT name, credit_limit FROM customers WHERE tenant_id = $1 AND id = $2";
const INSERT_FULL_ORDER: &str = "INSERT INTO orders (tenant_id, checkout_id, customer_id, total) VALUES ($1, $2, $3, $4) RETURNING id::text";
const INSERT_LINE: &str = "INSERT INTO order_lines (tenant_id, order_id, line_no, sku, quantity, unit_price) VALUES ($1, $2::text::uuid, $3, $4, $5, $6)";

/// The tables the handlers write besides the layer's own, and the rows the
/// pgbench replay variants and the five-statement handlers read.
pub(crate) const SCHEMA: &str = "
    CREATE TABLE orders (id uuid PRIMARY KEY DEFAULT gen_random_uuid(), tenant_id text NOT NULL,
                         checkout_id text NOT NULL, total bigint NOT NULL, created_at timestamptz NOT NULL DEFAULT now(),
                         customer_id bigint, UNIQUE (tenant_id, checkout_id));
    CREATE TABLE customers (tenant_id text NOT NULL, id bigint NOT NULL, name text NOT NULL, email text NOT NULL,
                            credit_limit bigint NOT NULL, PRIMARY KEY (tenant_id, id));
    CREATE TABLE order_lines (tenant_id text NOT NULL, order_id uuid NOT NULL, line_no int NOT NULL, sku text NOT NULL,
                              quantity int NOT NULL, unit_price bigint NOT NULL, PRIMARY KEY (tenant_id, order_id, line_no));
    INSERT INTO customers SELECT 'bench', n, 'Customer ' || n, 'customer-' || n || '@example.com', 1000000
    FROM generate_series(1, CUSTOMERS) n;
    -- No relay runs here: measure the layer, not NOTIFY.
    DROP TRIGGER outbox_events_notify_insert ON outbox_events;
    -- Completed keys for the pgbench replay variants.
    INSERT INTO idempotency_requests (tenant_id, endpoint, idempotency_key, request_fingerprint, state,
                                      response_status, response_headers, response_body, completed_at, expires_at)
    SELECT 'pgb', 'e', 'rp' || n, '\\x00', 'completed', 201, '', '{}', now(), now() + interval '1 day'
    FROM generate_series(1, 20000) n;
    ANALYZE customers;";

pub(crate) fn schema() -> String {
    SCHEMA.replace("CUSTOMERS", &CUSTOMERS.to_string())
}

/// The bare servers' pool: deadpool-postgres as an application without the
/// layer would configure it (statements cached per connection, a fast
/// recycle), not the store's, which checks and resets every connection an
/// application borrows (two round trips and seven statements more than a
/// bare handler needs).
pub(crate) type BarePool = deadpool_postgres::Pool;

pub(crate) fn bare_pool(config: &tokio_postgres::Config) -> BarePool {
    let manager = deadpool_postgres::Manager::from_config(
        config.clone(),
        tokio_postgres::NoTls,
        deadpool_postgres::ManagerConfig {
            recycling_method: deadpool_postgres::RecyclingMethod::Fast,
        },
    );
    deadpool_postgres::Pool::builder(manager)
        .max_size(POOL)
        .build()
        .expect("pool")
}

pub(crate) fn store(config: &tokio_postgres::Config) -> PgStore {
    PgStore::builder(config.clone())
        .max_connections(POOL)
        .build()
        .expect("store")
}

pub(crate) fn created(id: String, checkout_id: &str, total: i64) -> Response {
    (
        StatusCode::CREATED,
        Json(serde_json::json!({"id": id, "checkout_id": checkout_id, "total": total})),
    )
        .into_response()
}

fn params<const N: usize>(p: [&(dyn ToSql + Sync); N]) -> [&(dyn ToSql + Sync); N] {
    p
}

/// The same writes in the handler's own transaction, no layer.
async fn bare(State(pool): State<BarePool>, body: Bytes) -> Response {
    let Ok(order) = serde_json::from_slice::<NewOrder>(&body) else {
        return StatusCode::UNPROCESSABLE_ENTITY.into_response();
    };
    let Ok(client) = pool.get().await else {
        return StatusCode::SERVICE_UNAVAILABLE.into_response();
    };
    let result = async {
        let insert = client.prepare_cached(INSERT_ORDER).await?;
        let enqueue = client.prepare_cached(ENQUEUE).await?;
        let p = params([&"bench", &order.checkout_id, &order.total]);
        let (_, row) =
            tokio::try_join!(biased; client.batch_execute("BEGIN"), client.query_one(&insert, &p))?;
        let id: String = row.get(0);
        let payload = serde_json::json!({"id": id, "total": order.total});
        let _event: String = client
            .query_one(&enqueue, &[&"bench", &id, &"OrderCreated", &payload])
            .await?
            .get(0);
        client.batch_execute("COMMIT").await?;
        Ok::<_, tokio_postgres::Error>(id)
    }
    .await;
    match result {
        Ok(id) => created(id, &order.checkout_id, order.total),
        Err(_) => {
            let _ = client.batch_execute("ROLLBACK").await;
            StatusCode::SERVICE_UNAVAILABLE.into_response()
        }
    }
}

/// The same writes through the layer's transaction.
pub(crate) async fn layered(tx: PgTx, order: Validated<NewOrder>) -> Response {
    let result = async {
        let row = tx
            .query_one(
                INSERT_ORDER,
                &[&tx.tenant(), &order.checkout_id, &order.total],
            )
            .await?;
        let id: String = row.get(0);
        let payload = serde_json::json!({"id": id, "total": order.total});
        outbox::enqueue(&tx, &id, "OrderCreated", &payload).await?;
        Ok::<_, TxError>(id)
    }
    .await;
    match result {
        Ok(id) => created(id, &order.checkout_id, order.total),
        Err(_) => StatusCode::SERVICE_UNAVAILABLE.into_response(),
    }
}

/// [`layered`] with its own statement sent unnamed with its parameter types
/// (`PgTx::query_typed`), as behind a transaction pooler: with
/// `transaction_pooling(true)` the layer's statements go out the same way.
async fn layered_typed(tx: PgTx, order: Validated<NewOrder>) -> Response {
    let result = async {
        let p = [
            (&tx.tenant() as &(dyn ToSql + Sync), Type::TEXT),
            (&order.checkout_id, Type::TEXT),
            (&order.total, Type::INT8),
        ];
        let rows = tx.query_typed(INSERT_ORDER, &p).await?;
        let id: String = rows.first().map(|r| r.get(0)).unwrap_or_default();
        let payload = serde_json::json!({"id": id, "total": order.total});
        outbox::enqueue(&tx, &id, "OrderCreated", &payload).await?;
        Ok::<_, TxError>(id)
    }
    .await;
    match result {
        Ok(id) => created(id, &order.checkout_id, order.total),
        Err(_) => StatusCode::SERVICE_UNAVAILABLE.into_response(),
    }
}

/// A more realistic handler, bare: read the customer, insert the order, its
/// two lines and the outbox event (five statements), each awaited in turn.
async fn bare_five(State(pool): State<BarePool>, body: Bytes) -> Response {
    let Ok(order) = serde_json::from_slice::<FullOrder>(&body) else {
        return StatusCode::UNPROCESSABLE_ENTITY.into_response();
    };
    let Ok(client) = pool.get().await else {
        return StatusCode::SERVICE_UNAVAILABLE.into_response();
    };
    let result = async {
        let read = client.prepare_cached(READ_CUSTOMER).await?;
        let insert = client.prepare_cached(INSERT_FULL_ORDER).await?;
        let line = client.prepare_cached(INSERT_LINE).await?;
        let enqueue = client.prepare_cached(ENQUEUE).await?;
        let p = params([&"bench", &order.customer_id]);
        let (_, customer) =
            tokio::try_join!(biased; client.batch_execute("BEGIN"), client.query_one(&read, &p))?;
        let _name: String = customer.get(0);
        let p = params([
            &"bench",
            &order.checkout_id,
            &order.customer_id,
            &order.total,
        ]);
        let id: String = client.query_one(&insert, &p).await?.get(0);
        for (no, sku, quantity, price) in LINES {
            let p = params([&"bench", &id, &no, &sku, &quantity, &price]);
            client.execute(&line, &p).await?;
        }
        let payload = serde_json::json!({"id": id, "total": order.total});
        let _event: String = client
            .query_one(&enqueue, &[&"bench", &id, &"OrderCreated", &payload])
            .await?
            .get(0);
        client.batch_execute("COMMIT").await?;
        Ok::<_, tokio_postgres::Error>(id)
    }
    .await;
    match result {
        Ok(id) => created(id, &order.checkout_id, order.total),
        Err(_) => {
            let _ = client.batch_execute("ROLLBACK").await;
            StatusCode::SERVICE_UNAVAILABLE.into_response()
        }
    }
}

const LINES: [(i32, &str, i32, i64); 2] = [(1, "SKU-1001", 2, 800), (2, "SKU-2002", 1, 800)];

/// [`bare_five`]'s five statements through the layer's transaction.
async fn layered_five(tx: PgTx, order: Validated<FullOrder>) -> Response {
    let result = async {
        let tenant = tx.tenant();
        let customer = tx
            .query_one(READ_CUSTOMER, &[&tx.tenant(), &order.customer_id])
            .await?;
        let _name: String = customer.get(0);
        let p = params([
            &tenant,
            &order.checkout_id,
            &order.customer_id,
            &order.total,
        ]);
        let id: String = tx.query_one(INSERT_FULL_ORDER, &p).await?.get(0);
        for (no, sku, quantity, price) in LINES {
            let p = params([&tenant, &id, &no, &sku, &quantity, &price]);
            tx.execute(INSERT_LINE, &p).await?;
        }
        let payload = serde_json::json!({"id": id, "total": order.total});
        outbox::enqueue(&tx, &id, "OrderCreated", &payload).await?;
        Ok::<_, TxError>(id)
    }
    .await;
    match result {
        Ok(id) => created(id, &order.checkout_id, order.total),
        Err(_) => StatusCode::SERVICE_UNAVAILABLE.into_response(),
    }
}

pub(crate) async fn serve(app: Router) -> SocketAddr {
    let listener = tokio::net::TcpListener::bind("127.0.0.1:0")
        .await
        .expect("bind");
    let addr = listener.local_addr().expect("addr");
    tokio::spawn(async move { axum::serve(listener, app).await });
    addr
}

/// The layer as every layered server here has it: the orders endpoint, the
/// typed fingerprint, one tenant.
pub(crate) fn layer(
    store: PgStore,
) -> IdempotencyLayer<PgStore, TypedFingerprinter<NewOrder>, SingleTenant> {
    IdempotencyLayer::new(
        store,
        "POST /orders v1",
        TypedFingerprinter::<NewOrder>::new("orders.v1"),
    )
    .tenant_resolver(SingleTenant::new("bench"))
}

pub(crate) async fn bare_server(pool: BarePool) -> SocketAddr {
    serve(Router::new().route("/orders", post(bare)).with_state(pool)).await
}

/// The claim-first mode, statements prepared and cached.
pub(crate) async fn layered_server(store: PgStore) -> SocketAddr {
    serve(Router::new().route("/orders", post(layered).layer(layer(store)))).await
}

/// The claim-first mode without the replay cache: every replay reads the table.
pub(crate) async fn uncached_server(store: PgStore) -> SocketAddr {
    let layer = layer(store).without_replay_cache();
    serve(Router::new().route("/orders", post(layered).layer(layer))).await
}

/// The claim-first mode on a store built with `transaction_pooling(true)`.
pub(crate) async fn typed_server(config: &tokio_postgres::Config) -> SocketAddr {
    let store = PgStore::builder(config.clone())
        .max_connections(POOL)
        .transaction_pooling(true)
        .build()
        .expect("store");
    serve(Router::new().route("/orders", post(layered_typed).layer(layer(store)))).await
}

pub(crate) async fn bare_five_server(pool: BarePool) -> SocketAddr {
    serve(
        Router::new()
            .route("/orders", post(bare_five))
            .with_state(pool),
    )
    .await
}

pub(crate) async fn layered_five_server(store: PgStore) -> SocketAddr {
    let layer = IdempotencyLayer::new(
        store,
        "POST /orders5 v1",
        TypedFingerprinter::<FullOrder>::new("orders5.v1"),
    )
    .tenant_resolver(SingleTenant::new("bench"));
    serve(Router::new().route("/orders", post(layered_five).layer(layer))).await
}

/// The HTTP floor a replay from the cache is measured against: the same
/// axum stack and route, the request's body read, a static `201` with a
/// body and headers of a replay's size, no layer and no database.
pub(crate) async fn echo_server() -> SocketAddr {
    async fn echo(_body: Bytes) -> Response {
        (
            StatusCode::CREATED,
            [
                ("content-type", "application/json"),
                ("idempotent-replayed", "true"),
            ],
            r#"{"id":"6f1c0f5e-5b7e-4c41-9d0a-2f4f7f0e9a11","checkout_id":"chk-0","total":2400}"#,
        )
            .into_response()
    }
    serve(Router::new().route("/orders", post(echo))).await
}
