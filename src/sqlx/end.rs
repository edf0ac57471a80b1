//! The end of an owner's transaction on a [`SqlxStore`](super::SqlxStore):
//! committed with its remembered response (or, for a fenced transaction,
//! after the check that it still holds the record) or rolled back, with the
//! session reset behind it.

use ::sqlx::{postgres::PgQueryResult, Connection as _, PgConnection};

use super::{
    conn::GuardedConnection,
    error::{map_commit_error, map_error},
    transport::query,
    SqlxTx,
};
use crate::{
    protocol::complete::{complete_params, fenced_check_params, COMPLETE, FENCED_CHECK},
    protocol::errors::{claim_given_to_commit_fenced, fenced_given_to_complete},
    protocol::transaction::{COMMIT, ROLLBACK},
    protocol::waits::{CANCEL_GRACE, ROLLBACK_PATIENCE},
    record::StoredResponse,
    store::{StoreError, StoreErrorKind},
};

pub(super) fn finished() -> StoreError {
    StoreError::new(
        StoreErrorKind::TransactionAborted,
        "the transaction has already finished",
    )
}

/// [`Store::complete`](crate::store::Store::complete): the response, checked
/// against the claim's token and transaction, then `COMMIT` and the session
/// reset.
pub(super) async fn complete(tx: SqlxTx, response: &StoredResponse) -> Result<(), StoreError> {
    let Some(mut transaction) = tx.take_to_commit().await? else {
        return Err(finished());
    };
    if tx.is_fenced() {
        return Err(fenced_given_to_complete(
            transaction.end(ROLLBACK, true).await,
        ));
    }
    let headers = response.encode_headers();
    let params = complete_params(tx.identity(), response, &headers);
    let remembered = query(COMPLETE, &params, tx.transaction_pooling())
        .execute(transaction.raw())
        .await;
    commit_unless_failed(transaction, remembered, "completion").await
}

/// [`LeaseStore::commit_fenced`](crate::store::LeaseStore::commit_fenced):
/// the check that the transaction is intact and still holds the record at
/// its token (it cannot have lost it while holding the row `FOR SHARE`,
/// unless the handler ended the transaction), then `COMMIT` and the session
/// reset.
pub(super) async fn commit_fenced(tx: SqlxTx) -> Result<(), StoreError> {
    if !tx.is_fenced() {
        return Err(claim_given_to_commit_fenced());
    }
    let Some(mut transaction) = tx.take_to_commit().await? else {
        return Err(finished());
    };
    let params = fenced_check_params(tx.identity());
    let checked = query(FENCED_CHECK, &params, tx.transaction_pooling())
        .execute(transaction.raw())
        .await;
    commit_unless_failed(transaction, checked, "fenced commit").await
}

/// `COMMIT` and the session reset behind the statement that decides the
/// commit (`written`); if it failed, `ROLLBACK` and its error. `what` names
/// the step in the log line of a failed rollback.
async fn commit_unless_failed(
    transaction: GuardedConnection,
    written: Result<PgQueryResult, ::sqlx::Error>,
    what: &str,
) -> Result<(), StoreError> {
    if let Err(e) = written {
        let error = map_error(e);
        // Should the rollback fail, the connection is closed, and the
        // server rolls back.
        if let Err(rollback) = transaction.end(ROLLBACK, true).await {
            tracing::debug!(error = %rollback, "rolling back a failed {what} failed");
        }
        return Err(error);
    }
    transaction
        .end(COMMIT, true)
        .await
        .map_err(map_commit_error)
}

/// [`Store::abort`](crate::store::Store::abort): rolls back and resets the
/// session; a no-op once the transaction ended.
///
/// A statement the handler started may still run on the connection (its
/// future was dropped at the layer's deadline, which released the handle):
/// the `ROLLBACK` then waits behind it, and the key stays held. If it does
/// not end soon, it is cancelled (`pg_cancel_backend` from another pooled
/// connection: this session's transaction is ours until the rollback, so
/// nothing else runs on it).
pub(super) async fn abort(tx: SqlxTx) -> Result<(), StoreError> {
    let Some(mut transaction) = tx.take().await? else {
        return Ok(());
    };
    let drained = {
        let mut drain = std::pin::pin!(drain(transaction.raw()));
        match tokio::time::timeout(ROLLBACK_PATIENCE, &mut drain).await {
            Ok(drained) => drained,
            Err(_) => {
                if !tx.cancel_running().await {
                    // The cancel went unanswered: so would the statement.
                    return Err(StoreError::new(
                        StoreErrorKind::Unavailable,
                        "the database did not answer; the connection was closed",
                    ));
                }
                match tokio::time::timeout(CANCEL_GRACE, drain).await {
                    Ok(drained) => drained,
                    // Dropped, the connection is closed; the server rolls
                    // back once the statement ends.
                    Err(_) => {
                        return Err(StoreError::new(
                            StoreErrorKind::Unavailable,
                            "a statement left running on the connection did not end",
                        ))
                    }
                }
            }
        }
    };
    // The connection itself failed: dropped, the transaction ends with it.
    drained.map_err(map_error)?;
    transaction.end(ROLLBACK, true).await.map_err(map_error)
}

/// Waits until nothing runs on the connection any more. The answer of a
/// statement whose future was dropped may still be on its way: an error in
/// it (a cancelled statement) comes back once, then the connection is idle.
async fn drain(conn: &mut PgConnection) -> Result<(), ::sqlx::Error> {
    match conn.ping().await {
        Err(::sqlx::Error::Database(_)) => conn.ping().await,
        other => other,
    }
}
