//! `orders.v1.Orders` as one tower service, as tonic's generated servers
//! are: `CreateOrder` behind the idempotency layer, `GetOrder` (a read)
//! without it. The layer is per method, because the key is scoped by the
//! method it guards and a read has none.

use std::{
    collections::HashMap,
    convert::Infallible,
    future::Future,
    pin::Pin,
    sync::Arc,
    task::{Context, Poll},
    time::Duration,
};

use bytes::Bytes;
use prost::Message;
use tonic::{
    body::Body,
    codec::CompressionEncoding,
    server::{Grpc, NamedService},
    Code, Status,
};
use tonic_prost::ProstCodec;
use tower::{util::BoxCloneSyncService, Layer, Service, ServiceExt};
use tower_idempotency::{
    classify::GrpcErrorsAsFailures,
    fingerprint::Fingerprint,
    key::grpc_message,
    outbox,
    postgres::{PgStore, PgTx, TxError},
    problem::{codes, Problem},
    record::{FinalResponse, ResourceId},
    scope::TenantId,
    IdempotencyLayer, RequestBody,
};

use crate::proto::{self, CreateOrderRequest, GetOrderRequest, Order};

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

type Method = BoxCloneSyncService<http::Request<Body>, http::Response<Body>, Infallible>;

/// The server of `orders.v1.Orders`; give it to `tonic::transport::Server`.
#[derive(Clone)]
pub(crate) struct OrdersServer {
    tokens: Tokens,
    create_order: Method,
    store: PgStore,
}

impl OrdersServer {
    pub(crate) fn new(store: PgStore, tokens: Tokens, wait: Duration) -> Self {
        let idempotency =
            IdempotencyLayer::new(store.clone(), "orders.v1.Orders/CreateOrder", fingerprint)
                // gRPC's rule: grpc-status decides what is remembered.
                .classify(GrpcErrorsAsFailures)
                // AIP-155: the key is the message's request_id, unless the
                // call carries an idempotency-key metadata entry.
                .key_from_body(request_id)
                .wait(wait);
        let create_order = idempotency.layer(tower::service_fn(create_order_call));
        OrdersServer {
            tokens,
            create_order: BoxCloneSyncService::new(
                ServiceExt::<http::Request<Body>>::map_response(create_order, |response| {
                    response.map(Body::new)
                }),
            ),
            store,
        }
    }

    /// The caller's tenant, from its bearer token; nothing else a client
    /// sends can choose it.
    fn authenticate<B>(&self, request: &mut http::Request<B>) -> Result<(), Status> {
        request.extensions_mut().remove::<TenantId>();
        let tenant = request
            .headers()
            .get(http::header::AUTHORIZATION)
            .and_then(|v| v.to_str().ok())
            .and_then(|v| v.split_once(' '))
            .filter(|(scheme, _)| scheme.eq_ignore_ascii_case("bearer"))
            .and_then(|(_, token)| self.tokens.get(token.trim()))
            .cloned()
            .ok_or_else(|| Status::unauthenticated("a valid bearer token is required"))?;
        request.extensions_mut().insert(tenant);
        Ok(())
    }
}

impl std::fmt::Debug for OrdersServer {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("OrdersServer").finish_non_exhaustive()
    }
}

impl NamedService for OrdersServer {
    const NAME: &'static str = proto::SERVICE;
}

impl Service<http::Request<Body>> for OrdersServer {
    type Response = http::Response<Body>;
    type Error = Infallible;
    type Future = Pin<Box<dyn Future<Output = Result<Self::Response, Infallible>> + Send>>;

    fn poll_ready(&mut self, _cx: &mut Context<'_>) -> Poll<Result<(), Infallible>> {
        Poll::Ready(Ok(()))
    }

    fn call(&mut self, mut request: http::Request<Body>) -> Self::Future {
        if let Err(status) = self.authenticate(&mut request) {
            return Box::pin(async move { Ok(status.into_http()) });
        }
        match request.uri().path() {
            proto::CREATE_ORDER => Box::pin(self.create_order.clone().oneshot(request)),
            proto::GET_ORDER => {
                let store = self.store.clone();
                let get = tower::service_fn(move |request| get_order(store.clone(), request));
                Box::pin(async move { Ok(grpc().unary(get, request).await) })
            }
            _ => Box::pin(async { Ok(Status::unimplemented("no such method").into_http()) }),
        }
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

/// tonic's unary server for one method: messages gzip-compressed or not
/// are read, and an answer is compressed when the client accepts gzip.
fn grpc<M: Message + Default + 'static>() -> Grpc<ProstCodec<Order, M>> {
    Grpc::new(ProstCodec::default())
        .accept_compressed(CompressionEncoding::Gzip)
        .send_compressed(CompressionEncoding::Gzip)
}

/// `CreateOrder` under the layer: tonic decodes the message (decompressing
/// it: the layer hands on the body as the client sent it), runs the handler
/// and encodes its answer; the deterministic rejection is marked to be
/// remembered.
async fn create_order_call(
    request: http::Request<RequestBody>,
) -> Result<http::Response<Body>, Infallible> {
    let mut response = grpc().unary(tower::service_fn(create_order), request).await;
    // tonic answers an `Err(Status)` with the status in the response's
    // extensions. INVALID_ARGUMENT says the request itself is wrong: the
    // same on every retry, so it is the operation's answer, remembered and
    // replayed. Any other error rolls back and frees the key.
    if response
        .extensions()
        .get::<Status>()
        .is_some_and(|status| status.code() == Code::InvalidArgument)
    {
        response.extensions_mut().insert(FinalResponse);
    }
    Ok(response)
}

/// Writes only through the layer's transaction: the order, its outbox
/// event and the stock it takes commit together with the remembered
/// answer, or not at all.
async fn create_order(
    request: tonic::Request<CreateOrderRequest>,
) -> Result<tonic::Response<Order>, Status> {
    let tx = request
        .extensions()
        .get::<PgTx>()
        .cloned()
        .ok_or_else(|| Status::internal("CreateOrder runs behind the idempotency layer"))?;
    let order = request.into_inner();
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
    store: PgStore,
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
