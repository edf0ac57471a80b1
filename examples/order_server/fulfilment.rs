//! POST /orders/{id}/fulfilment: shipping an order through a slow warehouse,
//! as a long-running operation (tower-idempotency's lease mode).
//!
//! The handler holds no transaction across the warehouse call. It writes
//! only through fenced transactions ([`PgLease::transaction`]), which commit
//! only while this attempt's token is the newest, and it is re-drivable: a
//! takeover (a retry after the lease expired, or the recovery worker) runs
//! it again from the start, so every step first looks at what an earlier
//! attempt already did.
//!
//! 1. Fenced read: the order (404 if it is not the tenant's), and whether it
//!    is already shipped: by this operation (an earlier attempt got that far:
//!    answer with its shipment) or by another (409 `already_fulfilled`).
//! 2. The warehouse call, outside any transaction, keyed by the operation id
//!    (the same for every attempt, so the warehouse ships once) and carrying
//!    the attempt token (so the warehouse refuses an attempt taken over).
//! 3. Fenced write: the order marked shipped.
//!
//! An attempt that fails (the warehouse unreachable, its answer lost, the
//! database gone) answers a `5xx` that says what is known, never "nothing
//! was changed" once the warehouse may have shipped. The operation stays:
//! a retry with the same key, or the recovery worker, resumes it under the
//! same operation id, so the warehouse key is the same and it ships once.
//! After `IDEMPOTENCY_MAX_ATTEMPTS` attempts the layer ends it `failed`.

use axum::{
    extract::{rejection::PathRejection, Path, State},
    response::{IntoResponse, Response},
    routing::{post, MethodRouter},
    Json,
};
use http::StatusCode;
use serde::{Deserialize, Serialize};
use tower_idempotency::{
    fingerprint::{FieldError, TypedFingerprinter, Validated},
    outbox::derive_key,
    postgres::{PgLease, TxError, TxErrorKind},
    problem::Problem,
    record::{FinalResponse, ResourceId},
};
use tracing::Instrument;

use crate::warehouse::{ShipError, ShipmentRequest, WarehouseClient};

/// The endpoint's name in the idempotency store.
pub(crate) const ENDPOINT: &str = "POST /orders/{id}/fulfilment v1";
/// The operation name the warehouse key is derived with.
pub(crate) const WAREHOUSE_SHIP: &str = "warehouse.ship";
const MAX_WAREHOUSE_CHARS: usize = 64;

/// The business fields of a fulfilment request.
#[derive(Debug, Serialize, Deserialize)]
pub(crate) struct FulfilmentRequest {
    warehouse: String,
}

fn validate(request: &FulfilmentRequest) -> Result<(), Vec<FieldError>> {
    if let Some(error) = crate::orders::text_error(&request.warehouse) {
        return Err(vec![FieldError::new("warehouse", error)]);
    }
    if request.warehouse.chars().count() > MAX_WAREHOUSE_CHARS {
        return Err(vec![FieldError::new(
            "warehouse",
            format!("must be at most {MAX_WAREHOUSE_CHARS} characters"),
        )]);
    }
    Ok(())
}

/// The layer adds the method and target to the fingerprint, so the same
/// key and body sent for another order is another request.
pub(crate) fn fingerprinter() -> TypedFingerprinter<FulfilmentRequest> {
    TypedFingerprinter::new("fulfilment.v1").with_validator(validate)
}

/// The fulfilment as the API shows it (field order as documented).
#[derive(Debug, Serialize)]
struct Fulfilment<'a> {
    order_id: &'a str,
    warehouse: &'a str,
    shipment_id: &'a str,
    status: &'static str,
}

/// The route's method router, with the warehouse as its state: mounted
/// behind the idempotency layer for clients, and without it (under the same
/// path, so that `Path` extracts the same id) for the recovery worker.
pub(crate) fn routes<S: Clone + Send + Sync + 'static>(
    warehouse: WarehouseClient,
) -> MethodRouter<S> {
    post(fulfil).with_state(warehouse)
}

fn final_problem(problem: Problem) -> Response {
    let mut response = crate::problem(problem);
    // A deterministic business answer: remember it and replay it.
    response.extensions_mut().insert(FinalResponse);
    response
}

fn not_found() -> Response {
    final_problem(Problem::new(
        StatusCode::NOT_FOUND,
        "not_found",
        "No such order",
    ))
}

fn already_fulfilled(shipment_id: &str) -> Response {
    final_problem(
        Problem::new(
            StatusCode::CONFLICT,
            "already_fulfilled",
            "The order was already fulfilled under another idempotency key",
        )
        .with_member("shipment_id", shipment_id),
    )
}

/// This attempt was taken over. The answer is never remembered (the
/// layer's completion is fenced too) and nobody waits for it; the newer
/// attempt answers the client.
fn taken_over() -> Response {
    crate::problem(
        Problem::new(
            StatusCode::SERVICE_UNAVAILABLE,
            "operation_taken_over",
            "Another attempt took this operation over; this one stopped",
        )
        .with_retry_after(1),
    )
}

/// A fenced transaction failed: fenced (stop, changing nothing) or the
/// database is unavailable. Not remembered: the operation stays, and a
/// retry with the same key resumes it. Once the warehouse shipped, the
/// answer says so.
fn tx_failure(e: TxError, step: Step<'_>) -> Response {
    if e.kind() == TxErrorKind::Fenced {
        tracing::warn!(
            step = step.name(),
            "fulfilment: this attempt was taken over; stopping"
        );
        return taken_over();
    }
    tracing::error!(error = %e, step = step.name(), "fulfilment: transaction failed");
    let problem = match step {
        Step::Read => Problem::new(
            StatusCode::SERVICE_UNAVAILABLE,
            "store_unavailable",
            "The database is unavailable; retry with the same key",
        )
        .with_detail("this attempt stopped before calling the warehouse; a retry resumes the fulfilment where it stands"),
        Step::MarkShipped { shipment_id } => Problem::new(
            StatusCode::SERVICE_UNAVAILABLE,
            "fulfilment_incomplete",
            "The warehouse shipped the order, but recording it failed; retry with the same key",
        )
        .with_detail("a retry resumes the same operation: it finds the shipment and records it, shipping nothing twice")
        .with_member("shipment_id", shipment_id),
    };
    crate::problem(problem.with_retry_after(1))
}

/// Where a fenced transaction failed.
enum Step<'a> {
    Read,
    MarkShipped { shipment_id: &'a str },
}

impl Step<'_> {
    fn name(&self) -> &'static str {
        match self {
            Step::Read => "read the order",
            Step::MarkShipped { .. } => "mark the order shipped",
        }
    }
}

/// What the first fenced transaction found.
enum Found {
    NoSuchOrder,
    /// Not shipped yet: the order id in its canonical form.
    Open(String),
    Shipped {
        order_id: String,
        shipment_id: String,
        by_this_operation: bool,
    },
}

async fn fulfil(
    State(warehouse): State<WarehouseClient>,
    lease: PgLease,
    id: Result<Path<String>, PathRejection>,
    request: Validated<FulfilmentRequest>,
) -> Response {
    // An id that does not even decode (`%FF`) names no order: `not_found`,
    // as a malformed one, not axum's plain-text rejection (which the
    // long-running mode would take for a failed attempt and retry).
    let id = id.map(|Path(id)| id).unwrap_or_default();
    let span = tracing::info_span!(
        "fulfilment",
        operation_id = %lease.operation_id(),
        token = lease.attempt_token(),
    );
    run(warehouse, lease, id, request).instrument(span).await
}

async fn run(
    warehouse: WarehouseClient,
    lease: PgLease,
    id: String,
    request: Validated<FulfilmentRequest>,
) -> Response {
    // Stable across attempts: the warehouse recognises a repeated call.
    // From the operation (tenant, endpoint, the client's key), not from
    // its operation id, which is drawn anew if an asynchronous failover
    // loses the operation and the client's retry starts it again.
    let key = derive_key(&lease.derived_id("shipment"), WAREHOUSE_SHIP);
    if !crate::orders::is_uuid(&id) {
        return not_found();
    }

    // 1. The recovery point: what earlier attempts (or other operations)
    // already committed.
    let order_id = match find(&lease, &id, &key).await {
        Err(e) => return tx_failure(e, Step::Read),
        Ok(Found::NoSuchOrder) => return not_found(),
        Ok(Found::Shipped {
            order_id,
            shipment_id,
            by_this_operation: true,
        }) => {
            tracing::info!(
                %order_id,
                "fulfilment: an earlier attempt already shipped; answering with it"
            );
            return shipped(&order_id, &request.warehouse, &shipment_id);
        }
        Ok(Found::Shipped {
            shipment_id,
            by_this_operation: false,
            ..
        }) => return already_fulfilled(&shipment_id),
        Ok(Found::Open(order_id)) => order_id,
    };

    // 2. The slow call, outside any transaction: a fenced transaction held
    // across it would block heartbeats and takeovers for its whole length.
    if lease.is_fenced() {
        return taken_over();
    }
    let shipment_request = ShipmentRequest {
        order_id: order_id.clone(),
        warehouse: request.warehouse.clone(),
        tenant_id: lease.tenant().to_owned(),
    };
    let shipment = match warehouse
        .ship(&shipment_request, &key, lease.attempt_token())
        .await
    {
        Ok(shipment) => shipment,
        Err(ShipError::AlreadyShipped { shipment_id }) => return already_fulfilled(&shipment_id),
        Err(ShipError::Stale) => return stale(&lease).await,
        Err(ShipError::Unavailable(reason)) => {
            tracing::error!(reason, "fulfilment: the warehouse call failed");
            // Whether it shipped is unknown: the call may have got through
            // and only its answer been lost.
            return crate::problem(
                Problem::new(
                    StatusCode::SERVICE_UNAVAILABLE,
                    "warehouse_unavailable",
                    "The warehouse call failed; retry with the same key",
                )
                .with_detail("whether the warehouse shipped is not known yet; a retry resumes the same operation with the same warehouse key, so it ships at most once")
                .with_retry_after(1),
            );
        }
    };

    // 3. The order side, fenced: a stale attempt cannot mark it.
    if let Err(e) = mark_shipped(&lease, &order_id, &shipment.shipment_id, &key).await {
        let step = Step::MarkShipped {
            shipment_id: &shipment.shipment_id,
        };
        return tx_failure(e, step);
    }
    tracing::info!(%order_id, shipment_id = %shipment.shipment_id, "fulfilment: order shipped");
    shipped(&order_id, &shipment.warehouse, &shipment.shipment_id)
}

fn shipped(order_id: &str, warehouse: &str, shipment_id: &str) -> Response {
    let body = Fulfilment {
        order_id,
        warehouse,
        shipment_id,
        status: "shipped",
    };
    let mut response = (StatusCode::OK, Json(body)).into_response();
    // The operation's resource: the shipment it created.
    response
        .extensions_mut()
        .insert(ResourceId::new(shipment_id));
    response
}

async fn find(lease: &PgLease, id: &str, key: &str) -> Result<Found, TxError> {
    let tx = lease.transaction().await?;
    let row = tx
        .query_opt(
            "SELECT id::text, fulfilment = 'shipped', shipment_id, fulfilment_key \
             FROM orders WHERE id = $1::text::uuid AND tenant_id = $2",
            &[&id, &lease.tenant()],
        )
        .await?;
    tx.commit().await?;
    let Some(row) = row else {
        return Ok(Found::NoSuchOrder);
    };
    let order_id: String = row.try_get(0)?;
    let is_shipped: Option<bool> = row.try_get(1)?;
    let shipment_id: Option<String> = row.try_get(2)?;
    let shipped_by: Option<String> = row.try_get(3)?;
    Ok(match (is_shipped, shipment_id) {
        (Some(true), Some(shipment_id)) => Found::Shipped {
            order_id,
            shipment_id,
            by_this_operation: shipped_by.as_deref() == Some(key),
        },
        _ => Found::Open(order_id),
    })
}

async fn mark_shipped(
    lease: &PgLease,
    order_id: &str,
    shipment_id: &str,
    key: &str,
) -> Result<(), TxError> {
    let tx = lease.transaction().await?;
    tx.execute(
        "UPDATE orders SET fulfilment = 'shipped', shipment_id = $3, fulfilment_key = $4 \
         WHERE id = $1::text::uuid AND tenant_id = $2",
        &[&order_id, &lease.tenant(), &shipment_id, &key],
    )
    .await?;
    tx.commit().await
}

/// The warehouse refused this attempt's token: either this operation was
/// taken over (a fenced transaction says so), or another operation on the
/// same order carries a newer token and is shipping it right now.
async fn stale(lease: &PgLease) -> Response {
    match lease.transaction().await {
        Err(e) if e.kind() == TxErrorKind::Fenced => {
            tracing::warn!("fulfilment: the warehouse refused this attempt's token: it was taken over; stopping");
            taken_over()
        }
        Err(e) => tx_failure(e, Step::Read),
        Ok(tx) => {
            if let Err(e) = tx.rollback().await {
                tracing::warn!(error = %e, "fulfilment: rollback of the lease check failed");
            }
            tracing::warn!("fulfilment: another operation on this order holds a newer token");
            crate::problem(
                Problem::new(
                    StatusCode::SERVICE_UNAVAILABLE,
                    "fulfilment_in_progress",
                    "Another fulfilment of this order is in progress; retry",
                )
                .with_retry_after(1),
            )
        }
    }
}
