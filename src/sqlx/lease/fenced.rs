//! The fenced transaction of the long-running mode on
//! [`SqlxStore`](crate::sqlx::SqlxStore)'s connections: `BEGIN`, the
//! waits, and the record held at the lease's token. The mode's other calls
//! are the protocol's (`protocol::lease`), sent through the store's
//! [`Transport`](crate::protocol::transport::Transport).

use super::SqlxLease;
use crate::{
    protocol::{
        lease::{token_params, HOLD},
        transport::Link,
        waits::{GRACE, ROW_WAIT},
    },
    sqlx::{
        conn::GuardedConnection,
        error::map_error,
        transport::{timed_out, SqlxLink},
        SqlxTx,
    },
    store::StoreError,
};
use ::sqlx::Row as _;

/// Begins a fenced transaction and holds the record at the lease's token.
pub(in crate::sqlx) async fn open_fenced(lease: &SqlxLease) -> Result<SqlxTx, StoreError> {
    let store = lease.store();
    let id = lease.identity();
    let mut tx = GuardedConnection::begin(&store.pool, store.transaction_pooling)
        .await
        .map_err(map_error)?;
    let held = tokio::time::timeout(ROW_WAIT + GRACE, async {
        let mut link = SqlxLink {
            conn: tx.raw(),
            transaction_pooling: store.transaction_pooling,
        };
        // A lock wait inside gives up after half a lease (at most the row
        // wait); left idle for a whole lease, the server ends it.
        let pid = link
            .set_waits(Some(ROW_WAIT.min(id.lease() / 2)), Some(id.lease()))
            .await?;
        let rows = link.query(HOLD, &token_params(id)).await?;
        Ok::<_, StoreError>(rows.into_iter().next().map(|row| (row, pid)))
    })
    .await;
    let row = match held {
        Err(_) => return Err(timed_out()),
        Ok(Err(e)) => {
            tx.rollback_quietly().await;
            return Err(e);
        }
        Ok(Ok(row)) => row,
    };
    let Some((row, pid)) = row else {
        tx.rollback_quietly().await;
        crate::metrics::fenced(id.endpoint(), crate::metrics::FencedAt::Write);
        return Err(lease.fenced_error());
    };
    let xid: String = row.try_get(0).map_err(map_error)?;
    let (.., token) = id.columns();
    Ok(SqlxTx::new(
        tx,
        store.pool.clone(),
        pid,
        store.transaction_pooling,
        id.scope().clone(),
        id.key().clone(),
        *id.fingerprint(),
        token,
        xid,
        id.retention(),
        true,
    ))
}
