//! `orders.v1.Orders`: the `Orders` trait tonic generated, implemented on
//! PostgreSQL, and the two layers that go in front of the generated
//! server. Authentication (a tonic interceptor) puts the caller's tenant in
//! the request's extensions; the idempotency layer guards `CreateOrder`
//! alone, chosen by its path, and passes `GetOrder` (a read) through
//! untouched.

use std::{collections::HashMap, sync::Arc, time::Duration};

use bytes::Bytes;
use http::{request, response, HeaderMap};
use prost::Message;
use tonic::{codec::CompressionEncoding, Code, Status};
use tower_idempotency::{
    classify::{Classifier, GrpcErrorsAsFailures, Verdict},
    fingerprint::Fingerprint,
    key::grpc_message,
    outbox,
    postgres::{PgStore, PgTx, TxError},
    problem::{codes, Problem},
    record::ResourceId,
    scope::TenantId,
    IdempotencyLayer, OnPaths,
};

use crate::proto::{orders_server, CreateOrderRequest, GetOrderRequest, Order, CREATE_ORDER};

/// The example's tables: the stock each tenant sells, and its orders.
pub(crate) const SCHEMA: &str = "
CREATE TABLE IF NOT EXISTS grpc_stock (
    tenant_id   text   NOT NULL,
    sku         text   NOT NULL,
    unit_price  bigint NOT NULL,
    available   int    NOT NULL CHECK (available >= 0),
    PRIMARY KEY (tenant_id, sku)
);
CREATE TABLE IF NOT EXISTS grpc_orders (
    id          uuid        PRIMARY KEY DEFAULT gen_random_uuid(),
    tenant_id   text        NOT NULL,
    sku         text        NOT NULL,
    quantity    int         NOT NULL,
    total       bigint      NOT NULL,
    created_at  timestamptz NOT NULL DEFAULT now()
);";

/// The order at its SKU's price (`$1` tenant, `$2` SKU, `$3` quantity); no
/// row when the tenant sells no such SKU.
pub(crate) const INSERT_ORDER: &str = "INSERT INTO grpc_orders (tenant_id, sku, quantity, total) \
     SELECT tenant_id, sku, $3::int, unit_price * $3::int FROM grpc_stock \
     WHERE tenant_id = $1 AND sku = $2 \
     RETURNING id::text, total, created_at";

/// How long the stock's row lock is waited for before `UNAVAILABLE`.
pub(crate) const LOCK_TIMEOUT: &str = "SET LOCAL lock_timeout = '1s'";

/// Takes `$3` units of SKU `$2` from tenant `$1`'s stock: one row, or none
/// when too few are left.
pub(crate) const TAKE_STOCK: &str = "UPDATE grpc_stock SET available = available - $3 \
     WHERE tenant_id = $1 AND sku = $2 AND available >= $3";

/// Bearer tokens and the tenants they stand for.
pub(crate) type Tokens = Arc<HashMap<String, TenantId>>;

/// The generated server, gzip on both ways: messages compressed or not are
/// read, and an answer is compressed when the client accepts gzip.
pub(crate) fn server(store: PgStore) -> orders_server::OrdersServer<Orders> {
    orders_server::OrdersServer::new(Orders { store })
        .accept_compressed(CompressionEncoding::Gzip)
        .send_compressed(CompressionEncoding::Gzip)
}

/// How `CreateOrder` calls are fingerprinted: a plain function.
type FingerprintFn = fn(&mut request::Parts, &Bytes) -> Result<Fingerprint, Problem>;

/// The idempotency layer for the server's `CreateOrder`, by its path: keys,
/// metrics and spans under the endpoint `orders.v1.Orders/CreateOrder`
/// (the method's full name). Every other method passes through.
pub(crate) fn idempotency(store: PgStore, wait: Duration) -> OnPaths<PgStore, FingerprintFn> {
    IdempotencyLayer::new(store, "orders.v1.Orders", fingerprint as FingerprintFn)
        // gRPC's rule, with INVALID_ARGUMENT remembered: see `Remembered`.
        .classify(Remembered)
        // AIP-155: the key is the message's request_id, unless the call
        // carries an idempotency-key metadata entry.
        .key_from_body(request_id)
        .wait(wait)
        .on_paths([CREATE_ORDER])
}

/// The caller's tenant, from its bearer token, put in the request's
/// extensions for the layer and the handlers: nothing else a client sends
/// can choose it. A tonic interceptor: `UNAUTHENTICATED` without a valid
/// token.
pub(crate) fn authenticate(
    tokens: Tokens,
) -> impl FnMut(tonic::Request<()>) -> Result<tonic::Request<()>, Status> + Clone {
    move |mut request| {
        let tenant = request
            .metadata()
            .get("authorization")
            .and_then(|v| v.to_str().ok())
            .and_then(|v| v.split_once(' '))
            .filter(|(scheme, _)| scheme.eq_ignore_ascii_case("bearer"))
            .and_then(|(_, token)| tokens.get(token.trim()))
            .cloned()
            .ok_or_else(|| Status::unauthenticated("a valid bearer token is required"))?;
        request.extensions_mut().insert(tenant);
        Ok(request)
    }
}

/// gRPC's rule (`grpc-status` decides: `OK` is remembered, an error rolls
/// back and frees the key), except `INVALID_ARGUMENT` (an unknown SKU):
/// it says the request itself is wrong, the same on every retry, so it is
/// the operation's answer, remembered and replayed.
#[derive(Debug, Clone, Copy)]
struct Remembered;

impl Remembered {
    fn invalid_argument(headers: &HeaderMap) -> bool {
        let code = (Code::InvalidArgument as i32).to_string();
        headers
            .get("grpc-status")
            .is_some_and(|status| status.as_bytes() == code.as_bytes())
    }
}

impl Classifier for Remembered {
    fn classify_head(&self, head: &response::Parts) -> Verdict {
        // tonic answers an `Err(Status)` trailers-only: its status is in
        // the head.
        if head.status == http::StatusCode::OK && Self::invalid_argument(&head.headers) {
            return Verdict::Remember;
        }
        GrpcErrorsAsFailures.classify_head(head)
    }

    fn classify_end(&self, head: &response::Parts, trailers: Option<&HeaderMap>) -> bool {
        trailers.is_some_and(Self::invalid_argument)
            || GrpcErrorsAsFailures.classify_end(head, trailers)
    }
}

/// `orders.v1.Orders` on PostgreSQL. tonic decodes each message
/// (decompressing it: the layer hands the body on as the client sent it),
/// calls these and encodes the answer.
pub(crate) struct Orders {
    store: PgStore,
}

#[tonic::async_trait]
impl orders_server::Orders for Orders {
    async fn create_order(
        &self,
        request: tonic::Request<CreateOrderRequest>,
    ) -> Result<tonic::Response<Order>, Status> {
        let tx = request
            .extensions()
            .get::<PgTx>()
            .cloned()
            .ok_or_else(|| Status::internal("CreateOrder runs behind the idempotency layer"))?;
        create_order(tx, request.into_inner()).await
    }

    async fn get_order(
        &self,
        request: tonic::Request<GetOrderRequest>,
    ) -> Result<tonic::Response<Order>, Status> {
        get_order(&self.store, request).await
    }
}

/// The fingerprint of a `CreateOrder` call: its fields but the key, under
/// a versioned name; a message that is not valid is refused here, before
/// a key is claimed (the layer answers `INVALID_ARGUMENT`).
fn fingerprint(_: &mut http::request::Parts, body: &Bytes) -> Result<Fingerprint, Problem> {
    let order = decode(body).map_err(|detail| {
        Problem::new(
            http::StatusCode::BAD_REQUEST,
            codes::BODY_UNREADABLE,
            detail,
        )
    })?;
    if order.sku.is_empty() || !(1..=1000).contains(&order.quantity) {
        return Err(Problem::new(
            http::StatusCode::UNPROCESSABLE_ENTITY,
            codes::VALIDATION_FAILED,
            "sku must be set and quantity between 1 and 1000",
        ));
    }
    let canonical = CreateOrderRequest {
        request_id: String::new(),
        ..order
    };
    Ok(Fingerprint::digest(
        "orders.v1.CreateOrder",
        &canonical.encode_to_vec(),
    ))
}

/// The key of a `CreateOrder` call: its `request_id`, if set.
fn request_id(_: &http::request::Parts, body: &Bytes) -> Result<Option<String>, String> {
    let order = decode(body)?;
    Ok(Some(order.request_id).filter(|id| !id.is_empty()))
}

/// The message off its frame. A compressed call is read here too: the
/// layer hands the fingerprint and the key the message decompressed, in an
/// uncompressed frame.
fn decode(body: &Bytes) -> Result<CreateOrderRequest, String> {
    let message = grpc_message(body).ok_or("not one gRPC message")?;
    CreateOrderRequest::decode(message).map_err(|e| format!("not a CreateOrderRequest: {e}"))
}

/// Writes only through the layer's transaction: the order, its outbox
/// event and the stock it takes commit together with the remembered
/// answer, or not at all.
async fn create_order(
    tx: PgTx,
    order: CreateOrderRequest,
) -> Result<tonic::Response<Order>, Status> {
    let quantity =
        i32::try_from(order.quantity).map_err(|_| Status::invalid_argument("quantity"))?;
    // The order at the SKU's price; no row: the tenant sells no such SKU.
    let row = tx
        .query_opt(INSERT_ORDER, &[&tx.tenant(), &order.sku, &quantity])
        .await
        .map_err(database)?
        .ok_or_else(|| Status::invalid_argument(format!("unknown sku {:?}", order.sku)))?;
    let created_at: time::OffsetDateTime = row.get(2);
    let created = Order {
        id: row.get(0),
        sku: order.sku,
        quantity: order.quantity,
        total: row.get(1),
        created_at: created_at
            .format(&time::format_description::well_known::Rfc3339)
            .map_err(|e| Status::internal(e.to_string()))?,
    };
    let payload = serde_json::json!({
        "id": created.id, "sku": created.sku, "quantity": created.quantity, "total": created.total,
    });
    outbox::enqueue(&tx, &created.id, "OrderCreated", &payload)
        .await
        .map_err(database)?;
    // The stock last, and without queueing behind a busy SKU for long: a
    // lock not had within a second is UNAVAILABLE, which rolls the order
    // and its event back and frees the key for the client's retry.
    tx.execute(LOCK_TIMEOUT, &[]).await.map_err(database)?;
    let reserved = tx
        .execute(TAKE_STOCK, &[&tx.tenant(), &created.sku, &quantity])
        .await
        .map_err(database)?;
    if reserved == 0 {
        // Not remembered: stock may come back, and the retry may succeed.
        return Err(Status::failed_precondition(format!(
            "{} is out of stock",
            created.sku
        )));
    }
    tracing::info!(order_id = created.id, tenant = tx.tenant(), "order created");
    let id = created.id.clone();
    let mut response = tonic::Response::new(created);
    // Remembered with the answer: which order did this key create?
    response.extensions_mut().insert(ResourceId::new(id));
    Ok(response)
}

/// A database error as the status a client should act on: a lock not had
/// in time or a connection lost is worth a retry, the rest is internal.
fn database(e: TxError) -> Status {
    use tokio_postgres::error::SqlState;
    match e.code() {
        Some(&SqlState::LOCK_NOT_AVAILABLE) => {
            Status::unavailable("the stock of this SKU is busy; retry")
        }
        _ => {
            tracing::error!(error = %e, "CreateOrder failed");
            Status::internal("the order could not be written")
        }
    }
}

/// `GetOrder`: one of the caller's orders, outside any idempotency.
async fn get_order(
    store: &PgStore,
    request: tonic::Request<GetOrderRequest>,
) -> Result<tonic::Response<Order>, Status> {
    let tenant = request
        .extensions()
        .get::<TenantId>()
        .cloned()
        .ok_or_else(|| Status::unauthenticated("no tenant"))?;
    let client = store
        .client()
        .await
        .map_err(|_| Status::unavailable("the database is unavailable"))?;
    let row = client
        .query_opt(
            "SELECT id::text, sku, quantity, total, created_at FROM grpc_orders \
             WHERE tenant_id = $1 AND id::text = $2",
            &[&tenant.as_str(), &request.get_ref().id],
        )
        .await
        .map_err(|_| Status::unavailable("the database is unavailable"))?
        .ok_or_else(|| Status::not_found("no such order"))?;
    let created_at: time::OffsetDateTime = row.get(4);
    Ok(tonic::Response::new(Order {
        id: row.get(0),
        sku: row.get(1),
        quantity: row.get::<_, i32>(2) as u32,
        total: row.get(3),
        created_at: created_at
            .format(&time::format_description::well_known::Rfc3339)
            .map_err(|e| Status::internal(e.to_string()))?,
    }))
}
