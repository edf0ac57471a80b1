//! POST /orders and GET /orders/{id}.

use axum::{
    extract::{rejection::PathRejection, Path, State},
    response::{IntoResponse, Response},
    Extension,
};
use http::{header, StatusCode};
use serde::{Deserialize, Serialize};
use serde_json::{json, Value};
use tokio_postgres::types::{ToSql, Type};
use tower_idempotency::{
    fingerprint::{FieldError, TypedFingerprinter, Validated},
    outbox,
    postgres::{PgStore, PgTx},
    problem::Problem,
    record::{FinalResponse, ResourceId},
    scope::TenantId,
};

/// The business fields of POST /orders. Unknown fields (`trace_id`,
/// `client_sent_at`, …) are not business fields: serde ignores them, so they
/// never reach the fingerprint.
#[derive(Debug, Serialize, Deserialize)]
pub(crate) struct NewOrder {
    checkout_id: String,
    currency: String,
    items: Vec<Item>,
    shipping_address_id: String,
    #[serde(default)]
    coupon: Option<String>,
}

#[derive(Debug, Serialize, Deserialize)]
pub(crate) struct Item {
    sku: String,
    #[serde(default = "one")]
    quantity: i64,
    unit_price: i64,
}

fn one() -> i64 {
    1
}

impl NewOrder {
    fn total(&self) -> Option<i64> {
        self.items.iter().try_fold(0_i64, |sum, item| {
            sum.checked_add(item.quantity.checked_mul(item.unit_price)?)
        })
    }
}

/// Why a required string field is refused, if it is: PostgreSQL keeps no
/// U+0000 in `text` or `jsonb`, so it is the client's error, not an outage.
pub(crate) fn text_error(value: &str) -> Option<&'static str> {
    if value.trim().is_empty() {
        Some("must be a non-empty string")
    } else {
        nul_error(value)
    }
}

fn nul_error(value: &str) -> Option<&'static str> {
    value.contains('\0').then_some("must not contain U+0000")
}

/// The longest `checkout_id`, in bytes: `UNIQUE (tenant_id, checkout_id)`
/// is a B-tree index, whose entries hold at most about 2.7 kB.
const MAX_CHECKOUT_ID: usize = 1024;

fn validate(order: &NewOrder) -> Result<(), Vec<FieldError>> {
    let mut errors = Vec::new();
    if let Some(error) = text_error(&order.checkout_id) {
        errors.push(FieldError::new("checkout_id", error));
    } else if order.checkout_id.len() > MAX_CHECKOUT_ID {
        errors.push(FieldError::new(
            "checkout_id",
            format!("must be at most {MAX_CHECKOUT_ID} bytes (UTF-8)"),
        ));
    }
    if order.currency.len() != 3 || !order.currency.bytes().all(|b| b.is_ascii_uppercase()) {
        errors.push(FieldError::new("currency", "must be 3 upper-case letters"));
    }
    if let Some(error) = text_error(&order.shipping_address_id) {
        errors.push(FieldError::new("shipping_address_id", error));
    }
    if let Some(error) = order.coupon.as_deref().and_then(nul_error) {
        errors.push(FieldError::new("coupon", error));
    }
    if order.items.is_empty() || order.items.len() > 100 {
        errors.push(FieldError::new("items", "must hold 1 to 100 items"));
    }
    for (i, item) in order.items.iter().enumerate() {
        if let Some(error) = text_error(&item.sku) {
            errors.push(FieldError::new(format!("items[{i}].sku"), error));
        }
        if item.quantity < 1 {
            errors.push(FieldError::new(
                format!("items[{i}].quantity"),
                "must be at least 1",
            ));
        }
        if item.unit_price < 0 {
            errors.push(FieldError::new(
                format!("items[{i}].unit_price"),
                "must be at least 0",
            ));
        }
    }
    if errors.is_empty() && order.total().is_none() {
        errors.push(FieldError::new("items", "the order total is too large"));
    }
    if errors.is_empty() {
        Ok(())
    } else {
        Err(errors)
    }
}

pub(crate) fn fingerprinter() -> TypedFingerprinter<NewOrder> {
    TypedFingerprinter::new("orders.v1").with_validator(validate)
}

/// Immutable expressions only: Citus refuses anything else in a
/// `RETURNING` (`created_at` is formatted here, not with `to_char`).
const ORDER_COLUMNS: &str = "id::text, checkout_id, status, currency, items, total, created_at";

/// The order as the API shows it (field order as documented).
#[derive(Debug, Serialize)]
struct OrderBody {
    id: String,
    checkout_id: String,
    status: String,
    currency: String,
    items: Vec<Item>,
    total: i64,
    created_at: String,
    /// `"shipped"` once a fulfilment shipped it; absent before (and always
    /// absent in the POST /orders answer and the `OrderCreated` payload,
    /// which stay as they were).
    #[serde(skip_serializing_if = "Option::is_none")]
    fulfilment: Option<String>,
}

fn order_body(row: &tokio_postgres::Row) -> Result<OrderBody, String> {
    let items: Value = row.try_get(4).map_err(|e| e.to_string())?;
    Ok(OrderBody {
        id: row.try_get(0).map_err(|e| e.to_string())?,
        checkout_id: row.try_get(1).map_err(|e| e.to_string())?,
        status: row.try_get(2).map_err(|e| e.to_string())?,
        currency: row.try_get(3).map_err(|e| e.to_string())?,
        items: serde_json::from_value(items).map_err(|e| e.to_string())?,
        total: row.try_get(5).map_err(|e| e.to_string())?,
        created_at: created_at(row.try_get(6).map_err(|e| e.to_string())?)?,
        fulfilment: None,
    })
}

/// `created_at` as the API shows it: UTC, whole seconds
/// (`2026-01-02T03:04:05Z`).
fn created_at(at: time::OffsetDateTime) -> Result<String, String> {
    let format =
        time::macros::format_description!("[year]-[month]-[day]T[hour]:[minute]:[second]Z");
    at.to_offset(time::UtcOffset::UTC)
        .format(format)
        .map_err(|e| e.to_string())
}

fn final_problem(problem: Problem) -> Response {
    let mut response = crate::problem(problem);
    // A deterministic business answer: remember it and replay it.
    response.extensions_mut().insert(FinalResponse);
    response
}

fn db_failure(e: tower_idempotency::postgres::TxError) -> Response {
    tracing::error!(error = %e, "order transaction failed");
    crate::unavailable()
}

/// Writes only through the layer's transaction: the order, its outbox event
/// and the remembered response commit together.
pub(crate) async fn create(tx: PgTx, order: Validated<NewOrder>) -> Response {
    if order
        .coupon
        .as_deref()
        .is_some_and(|c| c.starts_with("EXPIRED"))
    {
        return final_problem(
            Problem::new(
                StatusCode::UNPROCESSABLE_ENTITY,
                "coupon_expired",
                "The coupon has expired",
            )
            .with_member("coupon", order.coupon.clone().unwrap_or_default()),
        );
    }
    let items: Value = order
        .items
        .iter()
        .map(|i| json!({"sku": i.sku, "quantity": i.quantity, "unit_price": i.unit_price}))
        .collect();
    let total = order.total().unwrap_or_default();
    // The order's id follows from the operation (tenant, endpoint, key and
    // the request's fingerprint), not from a generator: an order lost with
    // its transaction in an asynchronous failover and created again by the
    // client's retry is the same order, and the keys derived from its id
    // downstream (the charge, the reservation) are the same keys, so nothing
    // is done twice there. A new request under a key whose retention ended
    // is a new operation, with a new id.
    let order_id = tx.derived_id("order");
    let inserted = tx
        .query_opt(
            &format!(
                "INSERT INTO orders (id, tenant_id, checkout_id, currency, items, total, coupon, shipping_address_id) \
                 VALUES ($8::text::uuid, $1, $2, $3, $4, $5, $6, $7) \
                 ON CONFLICT DO NOTHING \
                 RETURNING {ORDER_COLUMNS}"
            ),
            &[&tx.tenant(), &order.checkout_id, &order.currency, &items, &total, &order.coupon, &order.shipping_address_id, &order_id],
        )
        .await;
    let row = match inserted {
        Ok(Some(row)) => row,
        Ok(None) => {
            // The checkout has an order: made under another key, or by this
            // same request under this key before its retention ended (the
            // same request derives the same id, and carries the same
            // checkout).
            let existing = tx
                .query_one(
                    "SELECT id::text FROM orders WHERE tenant_id = $1 AND checkout_id = $2",
                    &[&tx.tenant(), &order.checkout_id],
                )
                .await;
            return match existing {
                Ok(row) => final_problem(
                    Problem::new(
                        StatusCode::CONFLICT,
                        "checkout_already_ordered",
                        "This checkout already has an order",
                    )
                    .with_member("order_id", row.get::<_, String>(0)),
                ),
                Err(e) => db_failure(e),
            };
        }
        Err(e) => return db_failure(e),
    };
    let body = match order_body(&row) {
        Ok(body) => body,
        Err(e) => {
            tracing::error!(error = %e, "cannot read back the new order");
            return crate::unavailable();
        }
    };
    let order_id = body.id.clone();
    let payload = serde_json::to_value(&body).unwrap_or(Value::Null);
    if let Err(e) = outbox::enqueue(&tx, &order_id, "OrderCreated", &payload).await {
        return db_failure(e);
    }
    tracing::info!(order_id, tenant = tx.tenant(), total, "order created");
    let mut response = (
        StatusCode::CREATED,
        [(header::LOCATION, format!("/orders/{order_id}"))],
        axum::Json(body),
    )
        .into_response();
    // Remembered with the response: "which order did key X create?" is one
    // query on idempotency_requests.resource_id.
    response.extensions_mut().insert(ResourceId::new(order_id));
    response
}

pub(crate) async fn get(
    State(store): State<PgStore>,
    Extension(tenant): Extension<TenantId>,
    id: Result<Path<String>, PathRejection>,
) -> Response {
    // An id that does not even decode (`%FF`) names no order either.
    let id = id.map(|Path(id)| id).unwrap_or_default();
    let not_found = || {
        crate::problem(Problem::new(
            StatusCode::NOT_FOUND,
            "not_found",
            "No such order",
        ))
    };
    if !is_uuid(&id) {
        return not_found();
    }
    // A database that stops answering (a network partition) must not hold
    // the request: the lookup is given 5 s, then answered 503 and its
    // connection closed (a `PooledClient` dropped mid-statement is reset
    // or closed, never pooled as it is).
    let client = match tokio::time::timeout(LOOKUP_DEADLINE, store.client()).await {
        Ok(Ok(client)) => client,
        Ok(Err(e)) => {
            tracing::error!(error = %e, "cannot reach the database");
            return crate::unavailable();
        }
        Err(_) => {
            tracing::error!("the database did not lend a connection within 5 s");
            return crate::unavailable();
        }
    };
    let sql = format!(
        "SELECT {ORDER_COLUMNS}, fulfilment FROM orders WHERE id = $1::text::uuid AND tenant_id = $2"
    );
    let read = |row: &tokio_postgres::Row| -> Result<OrderBody, String> {
        let mut body = order_body(row)?;
        body.fulfilment = row.try_get(7).map_err(|e| e.to_string())?;
        Ok(body)
    };
    // One round trip, no prepared statement: DATABASE_URL may name a
    // transaction pooler, which would not keep one between round trips.
    let params: [(&(dyn ToSql + Sync), Type); 2] =
        [(&id, Type::TEXT), (&tenant.as_str(), Type::TEXT)];
    let found = tokio::time::timeout(LOOKUP_DEADLINE, client.query_typed_opt(&sql, &params)).await;
    let Ok(found) = found else {
        tracing::error!("the database did not answer the order lookup within 5 s");
        return crate::unavailable();
    };
    match found {
        Ok(Some(row)) => match read(&row) {
            Ok(body) => axum::Json(body).into_response(),
            Err(e) => {
                tracing::error!(error = %e, "cannot read the order");
                crate::unavailable()
            }
        },
        Ok(None) => not_found(),
        Err(e) => {
            tracing::error!(error = %e, "order lookup failed");
            crate::unavailable()
        }
    }
}

/// How long `GET /orders/{id}` waits for the database.
const LOOKUP_DEADLINE: std::time::Duration = std::time::Duration::from_secs(5);

pub(crate) fn is_uuid(id: &str) -> bool {
    id.len() == 36
        && id.char_indices().all(|(i, c)| match i {
            8 | 13 | 18 | 23 => c == '-',
            _ => c.is_ascii_hexdigit(),
        })
}
