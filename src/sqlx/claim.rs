//! The claim on a [`SqlxStore`]: a new transaction, its waits, and the
//! protocol's claim (`protocol::claim`), within the request's wait.

use super::{
    conn::GuardedConnection,
    error::map_error,
    transport::{timed_out, SqlxLink},
    SqlxStore, SqlxTx,
};
use crate::{
    protocol::{
        claim::{claim_params, settle, Claimed, CLAIM},
        errors::LOCK_NOT_AVAILABLE,
        transport::Link,
        waits::{GRACE, MIN_WAIT},
    },
    store::{Claim, ClaimRequest, StoreError},
};

/// [`Store::claim`](crate::store::Store::claim) for [`SqlxStore`].
pub(super) async fn claim(
    store: &SqlxStore,
    request: &ClaimRequest,
) -> Result<Claim<SqlxTx>, StoreError> {
    // Taking a connection is bounded by the pool's acquire timeout.
    let pooling = store.transaction_pooling;
    let mut tx = GuardedConnection::begin(&store.pool, pooling)
        .await
        .map_err(map_error)?;
    let wait = request.wait.max(MIN_WAIT);
    let claimed = tokio::time::timeout(wait + GRACE, async {
        let mut link = SqlxLink {
            conn: tx.raw(),
            transaction_pooling: pooling,
        };
        // Should the owner's process freeze between two statements, the
        // server ends the session (and frees the key) after the hold limit.
        let pid = link.set_waits(Some(wait), request.hold_limit).await?;
        let rows = link.query(CLAIM, &claim_params(request)).await?;
        Ok::<_, StoreError>((settle(&mut link, request, rows).await?, pid))
    })
    .await;
    // Cut off mid-statement, `tx` is dropped: its connection is closed, and
    // the server rolls back.
    match claimed {
        Err(_) => Err(timed_out()),
        Ok(Ok((Claimed::Owned(token, xid), pid))) => Ok(Claim::Owned(SqlxTx::of_request(
            tx, store, pid, request, token, xid,
        ))),
        Ok(Ok((Claimed::Completed(record), _))) => {
            tx.rollback_quietly().await;
            Ok(Claim::Completed(record))
        }
        Ok(Ok((Claimed::InProgress, _))) => {
            tx.rollback_quietly().await;
            Ok(Claim::InProgress)
        }
        Ok(Err(e)) if e.sql_state() == Some(LOCK_NOT_AVAILABLE) => {
            tx.rollback_quietly().await;
            Ok(Claim::InProgress)
        }
        Ok(Err(e)) => {
            tx.rollback_quietly().await;
            Err(e)
        }
    }
}
