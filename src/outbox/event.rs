//! Writing events in the owner's transaction, and the event the relay delivers.

use serde_json::Value;

use crate::{
    postgres::{PgTx, TxError},
    protocol::outbox::ENQUEUE,
};

/// Adds an event to `outbox_events` inside the request's transaction: it
/// commits with the business rows and the remembered response, or not at all.
///
/// Returns the event id. The tenant is the transaction's.
///
/// ```no_run
/// # async fn handler(tx: tower_idempotency::postgres::PgTx) -> Result<(), tower_idempotency::postgres::TxError> {
/// use tower_idempotency::outbox;
///
/// let order_id = "3f1c…";
/// outbox::enqueue(&tx, order_id, "OrderCreated", &serde_json::json!({"total": 2400})).await?;
/// # Ok(()) }
/// ```
pub async fn enqueue(
    tx: &PgTx,
    aggregate_id: &str,
    event_type: &str,
    payload: &Value,
) -> Result<String, TxError> {
    let row = tx
        .query_one_sql(
            ENQUEUE,
            &[&tx.tenant(), &aggregate_id, &event_type, payload],
        )
        .await?;
    Ok(row.get(0))
}

/// An event as the relay hands it to a [`Sink`](super::Sink).
#[derive(Debug, Clone, PartialEq)]
#[non_exhaustive]
pub struct OutboxEvent {
    /// The event's id (a UUID).
    pub id: String,
    /// The tenant whose transaction wrote it.
    pub tenant_id: String,
    /// The entity it is about, e.g. the order id.
    pub aggregate_id: String,
    /// What happened, e.g. `OrderCreated`.
    pub event_type: String,
    /// The event's data.
    pub payload: Value,
    /// Delivery attempts before this one.
    pub attempts: i32,
}

impl OutboxEvent {
    /// The downstream idempotency key for `operation` on this event's entity
    /// in its tenant: the same on every redelivery, and another for the same
    /// `aggregate_id` in another tenant (entity ids such as order numbers are
    /// often unique only within a tenant):
    /// [`derive_tenant_key`](super::derive_tenant_key)`(tenant_id, aggregate_id, operation)`.
    pub fn derived_key(&self, operation: &str) -> String {
        super::derive_tenant_key(&self.tenant_id, &self.aggregate_id, operation)
    }
}
