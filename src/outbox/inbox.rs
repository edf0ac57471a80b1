//! Consumer-side deduplication: process each event once.

use tokio_postgres::GenericClient;

use crate::{
    postgres::{PgTx, TxError},
    protocol::outbox::INBOX_INSERT,
};

/// Records that `consumer` processes `event_id` of `tenant` (the event's
/// [`tenant_id`](super::OutboxEvent::tenant_id)), inside the caller's own
/// transaction; `true` the first time, `false` for every redelivery. The
/// record's key includes the tenant, so the table can be distributed by it.
///
/// Call it first in the transaction that applies the event's effect and skip
/// the effect on `false`: the record and the effect commit together, so a
/// crash between them cannot make the event count as processed without its
/// effect (or the reverse).
///
/// ```no_run
/// # async fn consume(client: &mut tokio_postgres::Client, event_id: &str) -> Result<(), tokio_postgres::Error> {
/// use tower_idempotency::outbox::inbox;
///
/// let tx = client.transaction().await?;
/// if inbox::first_delivery(&tx, "tenant-a", "inventory", event_id).await? {
///     tx.execute("UPDATE stock SET reserved = reserved + 1 WHERE sku = 'SKU-1'", &[]).await?;
/// }
/// tx.commit().await?;
/// # Ok(()) }
/// ```
pub async fn first_delivery<C: GenericClient + Sync>(
    client: &C,
    tenant: &str,
    consumer: &str,
    event_id: &str,
) -> Result<bool, tokio_postgres::Error> {
    let inserted = client
        .execute(INBOX_INSERT.text(), &[&tenant, &consumer, &event_id])
        .await?;
    Ok(inserted == 1)
}

/// [`first_delivery`] inside the transaction of a request that owns its key.
pub async fn first_delivery_in(
    tx: &PgTx,
    tenant: &str,
    consumer: &str,
    event_id: &str,
) -> Result<bool, TxError> {
    Ok(tx
        .execute_sql(INBOX_INSERT, &[&tenant, &consumer, &event_id])
        .await?
        == 1)
}
