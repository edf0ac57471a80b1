//! A fake warehouse, in-process like the payment provider, reached the way a
//! remote shipping API would be: `POST /shipments` with an `Idempotency-Key`
//! (derived from the fulfilment's operation id, so every attempt of one
//! operation sends the same key) and a `Fencing-Token` (the attempt token).
//!
//! A lease cannot take back a call a stale attempt already sent, so the
//! warehouse itself refuses stale attempts: it remembers the highest token
//! seen per order and refuses anything lower, both when a call arrives and
//! again, under a row lock, just before it ships. It ships at most once per
//! order (`UNIQUE (order_id)`); the same key asking again gets the same
//! shipment back, another key is told the order already shipped.

use std::{sync::Arc, time::Duration};

use axum::{
    body::Body,
    extract::State,
    response::{IntoResponse, Response},
    routing::post,
    Json, Router,
};
use http::{HeaderMap, Request, StatusCode};
use http_body_util::BodyExt;
use serde::{Deserialize, Serialize};
use serde_json::Value;
use tokio_postgres::types::Type;
use tower::ServiceExt;
use tower_idempotency::{postgres::PgStore, problem::Problem, store::StoreError};

/// Refusals of a call that carried a fencing token lower than the highest
/// the warehouse has seen for the order, by where it was caught.
pub(crate) const STALE_REFUSALS_TOTAL: &str = "warehouse_stale_refusals_total";
const FENCING_TOKEN: &str = "fencing-token";
/// A warehouse whose name starts with this ships on the first call and then
/// loses that call's answer (the caller sees a `5xx`); a repeated call with
/// the same key returns the shipment.
pub(crate) const FLAKY: &str = "flaky-";
/// A warehouse whose name starts with this fails every call, shipping nothing.
pub(crate) const POISON: &str = "poison-";

// Raises the order's highest seen token to the call's if that is higher,
// and returns the highest: one statement, so no read-then-write race, and
// it locks the row until the transaction ends.
const RAISE_TOKEN: &str =
    "INSERT INTO warehouse_tokens AS t (order_id, highest_token, tenant_id) VALUES ($1, $2, $3) \
     ON CONFLICT (tenant_id, order_id) DO UPDATE SET \
         highest_token = GREATEST(t.highest_token, EXCLUDED.highest_token), \
         updated_at = EXCLUDED.updated_at \
     RETURNING highest_token";

/// What the order service asks the warehouse to ship.
#[derive(Debug, Clone, Serialize, Deserialize)]
pub(crate) struct ShipmentRequest {
    pub(crate) order_id: String,
    pub(crate) warehouse: String,
    pub(crate) tenant_id: String,
}

/// A shipment the warehouse made (or had made under the same key).
#[derive(Debug, Clone, Serialize, Deserialize)]
pub(crate) struct Shipment {
    pub(crate) shipment_id: String,
    pub(crate) order_id: String,
    pub(crate) warehouse: String,
}

/// Why the warehouse did not ship.
#[derive(Debug)]
pub(crate) enum ShipError {
    /// The call's fencing token is lower than one the warehouse has seen for
    /// the order: the attempt was taken over (or another operation on the
    /// order is newer).
    Stale,
    /// The order already shipped under another idempotency key.
    AlreadyShipped { shipment_id: String },
    /// The warehouse could not answer; nothing is known to have shipped.
    Unavailable(String),
}

struct Warehouse {
    store: PgStore,
    delay: Duration,
}

/// The warehouse's own router (not exposed on the public listener).
fn router(store: PgStore, delay: Duration) -> Router {
    Router::new()
        .route("/shipments", post(ship))
        .with_state(Arc::new(Warehouse { store, delay }))
}

fn warehouse_problem(status: StatusCode, code: &'static str, title: &str) -> Response {
    crate::problem(Problem::new(status, code, title))
}

/// `POST /shipments`: refuse a stale token, take the time a real warehouse
/// takes, then ship once per order under a row lock that also re-checks
/// the token.
async fn ship(
    State(warehouse): State<Arc<Warehouse>>,
    headers: HeaderMap,
    Json(request): Json<ShipmentRequest>,
) -> Response {
    let header = |name: &str| headers.get(name).and_then(|v| v.to_str().ok());
    let Some(key) = header("idempotency-key").filter(|k| !k.is_empty()) else {
        return warehouse_problem(
            StatusCode::BAD_REQUEST,
            "idempotency_key_missing",
            "Shipments need an Idempotency-Key",
        );
    };
    let Some(token) = header(FENCING_TOKEN).and_then(|t| t.parse::<i64>().ok()) else {
        return warehouse_problem(
            StatusCode::BAD_REQUEST,
            "fencing_token_missing",
            "Shipments need a numeric Fencing-Token",
        );
    };
    // Record the token at once, atomically: from here on, any attempt with a
    // lower token is refused even while this call is still on its way.
    let highest = match warehouse
        .observe_token(&request.tenant_id, &request.order_id, token)
        .await
    {
        Ok(highest) => highest,
        Err(e) => return unavailable(&e),
    };
    if highest > token {
        return stale(&request.order_id, token, highest, "arrival");
    }
    if request.warehouse.starts_with(POISON) {
        tracing::warn!(order_id = %request.order_id, token, "warehouse: a poison- warehouse refuses every call; nothing shipped");
        return warehouse_problem(
            StatusCode::SERVICE_UNAVAILABLE,
            "warehouse_failed",
            "This warehouse fails every call; nothing was shipped",
        );
    }
    tokio::time::sleep(warehouse.delay).await;
    match warehouse.ship_once(&request, key, token).await {
        Ok(Shipped::Stale { highest }) => stale(&request.order_id, token, highest, "shipping"),
        Ok(Shipped::Created(shipment)) if request.warehouse.starts_with(FLAKY) => {
            // Shipped and committed, and then the answer is lost on the way
            // back: the caller cannot tell, and must ask again with the
            // same key to learn the shipment.
            tracing::warn!(order_id = %shipment.order_id, shipment_id = %shipment.shipment_id, token, "warehouse: shipped, and lost the answer (flaky- warehouse)");
            warehouse_problem(
                StatusCode::BAD_GATEWAY,
                "warehouse_answer_lost",
                "The warehouse's answer was lost",
            )
        }
        Ok(Shipped::Created(shipment)) => {
            tracing::info!(order_id = %shipment.order_id, shipment_id = %shipment.shipment_id, token, "warehouse: shipped");
            (StatusCode::CREATED, Json(shipment)).into_response()
        }
        Ok(Shipped::Existing {
            shipment,
            same_key: true,
        }) => (StatusCode::OK, Json(shipment)).into_response(),
        Ok(Shipped::Existing {
            shipment,
            same_key: false,
        }) => crate::problem(
            Problem::new(
                StatusCode::CONFLICT,
                "already_shipped",
                "The order already shipped under another idempotency key",
            )
            .with_member("shipment_id", shipment.shipment_id),
        ),
        Err(e) => unavailable(&e),
    }
}

fn stale(order_id: &str, token: i64, highest: i64, at: &'static str) -> Response {
    metrics::counter!(STALE_REFUSALS_TOTAL, "at" => at).increment(1);
    tracing::warn!(
        order_id,
        token,
        highest,
        at,
        "warehouse: refused a call with a stale fencing token"
    );
    crate::problem(
        Problem::new(
            StatusCode::CONFLICT,
            "stale_fencing_token",
            "A newer attempt for this order has been seen; this one is refused",
        )
        .with_member("highest_token", highest),
    )
}

fn unavailable(e: &DbError) -> Response {
    // A lost COMMIT leaves it unknown whether the shipment was made; the
    // caller asks again with the same key and gets it either way.
    tracing::error!(error = %e, "warehouse: database failure");
    crate::unavailable()
}

/// What [`Warehouse::ship_once`] found.
enum Shipped {
    Created(Shipment),
    Existing { shipment: Shipment, same_key: bool },
    Stale { highest: i64 },
}

impl Warehouse {
    /// Raises the order's highest seen token to `token` if it is higher,
    /// and returns the highest.
    async fn observe_token(
        &self,
        tenant: &str,
        order_id: &str,
        token: i64,
    ) -> Result<i64, DbError> {
        let client = self.store.client().await?;
        // Outside a transaction: one round trip, no prepared statement (a
        // transaction pooler would not keep one between round trips).
        let row = client
            .query_typed_one(
                RAISE_TOKEN,
                &[
                    (&order_id, Type::TEXT),
                    (&token, Type::INT8),
                    (&tenant, Type::TEXT),
                ],
            )
            .await?;
        Ok(row.try_get(0)?)
    }

    /// Ships in one transaction: the order's token row is locked (and the
    /// token checked again: a newer attempt may have arrived during the
    /// delay), then the shipment inserted unless the order has one. The
    /// lock also orders concurrent shippers of one order, so the read of an
    /// existing shipment always sees the one that won.
    async fn ship_once(
        &self,
        request: &ShipmentRequest,
        key: &str,
        token: i64,
    ) -> Result<Shipped, DbError> {
        let client = self.store.client().await?;
        // An error below leaves the transaction open or aborted; the pooled
        // client rolls it back when it is dropped.
        client
            .batch_execute("BEGIN; SET LOCAL lock_timeout = '5s'")
            .await?;
        let highest: i64 = client
            .query_one(
                RAISE_TOKEN,
                &[&request.order_id, &token, &request.tenant_id],
            )
            .await?
            .try_get(0)?;
        if highest > token {
            client.batch_execute("ROLLBACK").await?;
            return Ok(Shipped::Stale { highest });
        }
        let row = client
            .query_one(
                "WITH new AS ( \
                     INSERT INTO warehouse_shipments (order_id, idempotency_key, fencing_token, warehouse, tenant_id) \
                     VALUES ($1, $2, $3, $4, $5) ON CONFLICT (tenant_id, order_id) DO NOTHING \
                     RETURNING shipment_id, idempotency_key, warehouse, true AS created) \
                 SELECT * FROM new UNION ALL \
                 SELECT shipment_id, idempotency_key, warehouse, false FROM warehouse_shipments \
                 WHERE tenant_id = $5 AND order_id = $1 AND NOT EXISTS (SELECT 1 FROM new)",
                &[&request.order_id, &key, &token, &request.warehouse, &request.tenant_id],
            )
            .await?;
        client.batch_execute("COMMIT").await?;
        let shipment = Shipment {
            shipment_id: row.try_get(0)?,
            order_id: request.order_id.clone(),
            warehouse: row.try_get(2)?,
        };
        let shipped_key: String = row.try_get(1)?;
        Ok(if row.try_get(3)? {
            Shipped::Created(shipment)
        } else {
            Shipped::Existing {
                shipment,
                same_key: shipped_key == key,
            }
        })
    }
}

/// A database failure inside the warehouse: only ever logged.
#[derive(Debug)]
struct DbError(String);

impl From<tokio_postgres::Error> for DbError {
    fn from(e: tokio_postgres::Error) -> Self {
        DbError(e.to_string())
    }
}

impl From<StoreError> for DbError {
    fn from(e: StoreError) -> Self {
        DbError(e.to_string())
    }
}

impl std::fmt::Display for DbError {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(&self.0)
    }
}

/// The order service's client of the warehouse.
#[derive(Clone)]
pub(crate) struct WarehouseClient {
    router: Router,
}

impl WarehouseClient {
    pub(crate) fn new(store: PgStore, delay: Duration) -> Self {
        // At zero from the start, so an alert on its increase works before the first refusal.
        for at in ["arrival", "shipping"] {
            metrics::counter!(STALE_REFUSALS_TOTAL, "at" => at).increment(0);
        }
        WarehouseClient {
            router: router(store, delay),
        }
    }

    /// Asks the warehouse to ship `request` under `key`, carrying `token`.
    pub(crate) async fn ship(
        &self,
        request: &ShipmentRequest,
        key: &str,
        token: i64,
    ) -> Result<Shipment, ShipError> {
        let body =
            serde_json::to_vec(request).map_err(|e| ShipError::Unavailable(e.to_string()))?;
        let call = Request::post("/shipments")
            .header("content-type", "application/json")
            .header("idempotency-key", key)
            .header(FENCING_TOKEN, token.to_string())
            .body(Body::from(body))
            .map_err(|e| ShipError::Unavailable(e.to_string()))?;
        let response = self
            .router
            .clone()
            .oneshot(call)
            .await
            .map_err(|e| ShipError::Unavailable(e.to_string()))?;
        let status = response.status();
        let body = response
            .into_body()
            .collect()
            .await
            .map_err(|e| ShipError::Unavailable(e.to_string()))?
            .to_bytes();
        if status.is_success() {
            return serde_json::from_slice(&body)
                .map_err(|e| ShipError::Unavailable(e.to_string()));
        }
        let problem: Value = serde_json::from_slice(&body).unwrap_or_default();
        match problem["code"].as_str() {
            Some("stale_fencing_token") => Err(ShipError::Stale),
            Some("already_shipped") => match problem["shipment_id"].as_str() {
                Some(id) => Err(ShipError::AlreadyShipped {
                    shipment_id: id.to_owned(),
                }),
                None => Err(ShipError::Unavailable(
                    "already_shipped without a shipment_id".into(),
                )),
            },
            code => Err(ShipError::Unavailable(format!(
                "the warehouse answered {} {}",
                status.as_u16(),
                code.unwrap_or("")
            ))),
        }
    }
}
