//! The downstream side: a fake payment provider and a fake inventory service,
//! each protected by its own `IdempotencyLayer`, and the outbox sink that
//! calls them after the order committed.
//!
//! The relay reaches them as a tower service (in-process), exactly as it
//! would reach a remote API over HTTP: through the crate's client layer
//! (`IdempotentClientLayer`), a request with a bearer token (the provider's
//! tenant is the calling service) and an `Idempotency-Key` derived from the
//! order id and the operation, which the layer sends on every retry.
//! However often an `OrderCreated` event is delivered, the provider charges once.

use std::{collections::HashMap, sync::Arc, time::Duration};

use axum::{
    middleware,
    response::{IntoResponse, Response},
    routing::post,
    Json, Router,
};
use bytes::Bytes;
use http::{Request, StatusCode};
use http_body_util::{BodyExt, Full};
use serde::{Deserialize, Serialize};
use serde_json::{json, Value};
use tower::{Layer, ServiceExt};
use tower_idempotency::{
    client::{ClientErrorKind, IdempotentClient, IdempotentClientLayer},
    fingerprint::{TypedFingerprinter, Validated},
    outbox::{DeliveryError, OutboxEvent, Sink},
    postgres::{PgStore, PgTx},
    scope::TenantId,
    IdempotencyLayer,
};

/// The token the relay presents; the providers know it as `order-service`.
const RELAY_TOKEN: &str = "internal-relay-token";
pub(crate) const PAYMENT_CHARGE: &str = "payment.charge";
pub(crate) const INVENTORY_RESERVE: &str = "inventory.reserve";

#[derive(Debug, Serialize, Deserialize)]
struct Charge {
    order_id: String,
    amount: i64,
    currency: String,
}

#[derive(Debug, Serialize, Deserialize)]
struct Reservation {
    order_id: String,
    items: Value,
}

/// A provider remembers charges by key for good, longer than its layer's
/// retention: a redelivery after the key expired finds the charge and
/// answers with it instead of charging again.
async fn charge(tx: PgTx, charge: Validated<Charge>) -> Response {
    let key = tx.idempotency_key().to_owned();
    let charged = tx
        .query_one(
            "WITH new AS ( \
                 INSERT INTO payment_charges (tenant_id, idempotency_key, order_id, amount, currency) \
                 VALUES ($1, $2, $3, $4, $5) ON CONFLICT (tenant_id, idempotency_key) DO NOTHING RETURNING id::text) \
             SELECT id FROM new UNION ALL \
             SELECT id::text FROM payment_charges \
             WHERE tenant_id = $1 AND idempotency_key = $2 AND NOT EXISTS (SELECT 1 FROM new)",
            &[&tx.tenant(), &key, &charge.order_id, &charge.amount, &charge.currency],
        )
        .await;
    match charged {
        Ok(row) => {
            tracing::info!(order_id = %charge.order_id, amount = charge.amount, "payment provider: charged");
            (
                StatusCode::CREATED,
                Json(json!({"charge_id": row.get::<_, String>(0), "order_id": charge.order_id})),
            )
                .into_response()
        }
        Err(e) => {
            tracing::error!(error = %e, "payment provider: charge failed");
            crate::unavailable()
        }
    }
}

async fn reserve(tx: PgTx, reservation: Validated<Reservation>) -> Response {
    let key = tx.idempotency_key().to_owned();
    let reserved = tx
        .execute(
            "INSERT INTO inventory_reservations (tenant_id, idempotency_key, order_id, items) VALUES ($1, $2, $3, $4) \
             ON CONFLICT (tenant_id, idempotency_key) DO NOTHING",
            &[&tx.tenant(), &key, &reservation.order_id, &reservation.items],
        )
        .await;
    match reserved {
        Ok(_) => (
            StatusCode::CREATED,
            Json(json!({"order_id": reservation.order_id})),
        )
            .into_response(),
        Err(e) => {
            tracing::error!(error = %e, "inventory: reservation failed");
            crate::unavailable()
        }
    }
}

/// The providers' router (not exposed on the public listener).
pub(crate) fn providers(store: PgStore) -> Router {
    let tokens: crate::auth::Tokens = Arc::new(HashMap::from([(
        RELAY_TOKEN.to_owned(),
        TenantId::new("order-service"),
    )]));
    Router::new()
        .route(
            "/charges",
            post(charge).layer(
                IdempotencyLayer::new(
                    store.clone(),
                    "POST /charges v1",
                    TypedFingerprinter::<Charge>::new("charges.v1"),
                )
                // These providers keep their rows in the order server's own
                // database. After a failover to an asynchronous standby that
                // lost a charge (while the order and its event survived), the
                // relay delivers the event again; a replay cache would answer
                // that delivery from memory with the lost charge's 201, and
                // the event would be marked delivered with no charge in the
                // database (seen in tests/order_server/failover.rs). A real provider's
                // cache matches its own database; this one's must not outlive
                // ours.
                .without_replay_cache(),
            ),
        )
        .route(
            "/reservations",
            post(reserve).layer(
                IdempotencyLayer::new(
                    store,
                    "POST /reservations v1",
                    TypedFingerprinter::<Reservation>::new("reservations.v1"),
                )
                // As for charges.
                .without_replay_cache(),
            ),
        )
        .route_layer(middleware::from_fn_with_state(
            tokens,
            crate::auth::authenticate,
        ))
}

/// Where the relay's calls go: the in-process providers, or for
/// `/charges` a payment provider outside this server and its database
/// (`PAYMENT_PROVIDER_URL`), over HTTP with the same request.
type Downstream = tower::util::BoxCloneSyncService<Request<Full<Bytes>>, Response, DownstreamError>;

/// The outside provider could not be reached (or its URL not built).
#[derive(Debug)]
struct DownstreamError(String);

impl std::fmt::Display for DownstreamError {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(f, "the payment provider could not be reached: {}", self.0)
    }
}

impl std::error::Error for DownstreamError {}

fn downstream(store: PgStore, payment_provider: Option<http::Uri>) -> Downstream {
    let local = providers(store);
    let http = hyper_util::client::legacy::Client::builder(hyper_util::rt::TokioExecutor::new())
        .build_http::<Full<Bytes>>();
    tower::util::BoxCloneSyncService::new(tower::service_fn(
        move |request: Request<Full<Bytes>>| {
            let (local, http) = (local.clone(), http.clone());
            let external = payment_provider
                .clone()
                .filter(|_| request.uri().path() == "/charges");
            call_downstream(local, http, external, request)
        },
    ))
}

async fn call_downstream(
    local: Router,
    http: hyper_util::client::legacy::Client<
        hyper_util::client::legacy::connect::HttpConnector,
        Full<Bytes>,
    >,
    external: Option<http::Uri>,
    mut request: Request<Full<Bytes>>,
) -> Result<Response, DownstreamError> {
    let Some(base) = external else {
        return match local.oneshot(request).await {
            Ok(response) => Ok(response),
            Err(never) => match never {},
        };
    };
    let mut parts = base.into_parts();
    parts.path_and_query = request.uri().path_and_query().cloned();
    *request.uri_mut() =
        http::Uri::from_parts(parts).map_err(|e| DownstreamError(e.to_string()))?;
    let response = http
        .request(request)
        .await
        .map_err(|e| DownstreamError(e.to_string()))?;
    Ok(response.map(axum::body::Body::new))
}

/// Delivers `OrderCreated` to both providers, each call with its own derived key.
pub(crate) struct Providers {
    client: IdempotentClient<Downstream>,
}

impl Providers {
    pub(crate) fn new(store: PgStore, payment_provider: Option<http::Uri>) -> Self {
        // Both calls of a delivery fit in the relay's 10 s per delivery; what
        // still fails is retried by the relay later, with the same derived keys.
        let client = IdempotentClientLayer::new()
            .name("order-relay")
            .max_attempts(3)
            .attempt_timeout(Duration::from_secs(3))
            .total_timeout(Duration::from_secs(4))
            .backoff(Duration::from_millis(100), Duration::from_secs(1))
            .layer(downstream(store, payment_provider));
        Providers { client }
    }

    /// One provider call with the derived `key`: the client layer retries
    /// timeouts, `503` and `idempotency_in_progress` with that key.
    async fn call(&self, path: &str, key: &str, body: Value) -> Result<(), DeliveryError> {
        let request = Request::post(path)
            .header("authorization", format!("Bearer {RELAY_TOKEN}"))
            .header("content-type", "application/json")
            .header("idempotency-key", key)
            .body(Full::new(Bytes::from(body.to_string())))
            .map_err(|e| DeliveryError::permanent(e.to_string()))?;
        let response = self
            .client
            .clone()
            .oneshot(request)
            .await
            .map_err(|e| match e.kind() {
                ClientErrorKind::KeyInvalid => DeliveryError::permanent(e.to_string()),
                _ => DeliveryError::retryable(e.to_string()),
            })?;
        let status = response.status();
        if status.is_success() {
            return Ok(());
        }
        let body = response
            .into_body()
            .collect()
            .await
            .map(|b| b.to_bytes())
            .unwrap_or_default();
        let code = serde_json::from_slice::<Value>(&body)
            .ok()
            .and_then(|v| v["code"].as_str().map(str::to_owned))
            .unwrap_or_default();
        let message = format!("{path} answered {} {code}", status.as_u16());
        // In progress, unavailable, 5xx: try again later. Anything else will not change.
        if status.is_server_error()
            || code == "idempotency_in_progress"
            || status == StatusCode::TOO_MANY_REQUESTS
        {
            Err(DeliveryError::retryable(message))
        } else {
            Err(DeliveryError::permanent(message))
        }
    }
}

impl Sink for Providers {
    async fn deliver(&self, event: &OutboxEvent) -> Result<(), DeliveryError> {
        if event.event_type != "OrderCreated" {
            return Ok(());
        }
        let order = &event.payload;
        let charge = json!({"order_id": event.aggregate_id, "amount": order["total"], "currency": order["currency"]});
        self.call("/charges", &event.derived_key(PAYMENT_CHARGE), charge)
            .await?;
        let reservation = json!({"order_id": event.aggregate_id, "items": order["items"]});
        self.call(
            "/reservations",
            &event.derived_key(INVENTORY_RESERVE),
            reservation,
        )
        .await
    }
}
