//! Step 4 of the protocol (see the [module docs](super)): the owner's
//! transaction ends, committed with its remembered response or rolled back,
//! with the session reset behind it, in one round trip.

use tokio_postgres::types::ToSql;

use super::{
    conn::{Conn, ResetArguments},
    error::map_error,
    prepared::{dyn_params, Prepared, Sql},
    tx::Take,
    PgTx,
};
use crate::{
    protocol::complete::{
        complete_params, fenced_check_params, COMPLETE, COMPLETE_AND_RESET, FENCED_CHECK,
    },
    protocol::errors::ends_only_the_statement,
    protocol::errors::{claim_given_to_commit_fenced, fenced_given_to_complete},
    protocol::sql::Param,
    protocol::transaction::{COMMIT, ROLLBACK},
    protocol::waits::{
        commit_gave_up, CANCEL_DEADLINE, CANCEL_GRACE, COMMIT_PATIENCE, ROLLBACK_PATIENCE,
    },
    record::StoredResponse,
    store::{StoreError, StoreErrorKind},
};

/// [`Store::complete`](crate::store::Store::complete) for
/// [`PgStore`](super::PgStore).
pub(super) async fn complete(tx: PgTx, response: &StoredResponse) -> Result<(), StoreError> {
    if tx.is_fenced_transaction() {
        return Err(fenced_given_to_complete(abort(tx).await));
    }
    let headers = response.encode_headers();
    let params = complete_params(tx.identity(), response, &headers);
    commit_behind(&tx, COMPLETE, Some(COMPLETE_AND_RESET), &params).await
}

/// [`LeaseStore::commit_fenced`](crate::store::LeaseStore::commit_fenced)
/// for [`PgStore`](super::PgStore).
pub(super) async fn commit_fenced(tx: PgTx) -> Result<(), StoreError> {
    if !tx.is_fenced_transaction() {
        return Err(claim_given_to_commit_fenced());
    }
    let params = fenced_check_params(tx.identity());
    commit_behind(&tx, FENCED_CHECK, None, &params).await
}

/// Ends the transaction of `tx` with `COMMIT` behind `sql`, the statement
/// that decides whether it may commit (the completion's UPDATE, the fenced
/// check), or behind `resetting`, the same statement with the session reset
/// as its last parameter, where the connection lets the reset ride in it.
/// Should the statement not even prepare, the transaction rolls back.
async fn commit_behind(
    tx: &PgTx,
    sql: Sql<'static>,
    resetting: Option<Sql<'static>>,
    params: &[Param<'_>],
) -> Result<(), StoreError> {
    let Some(conn) = take_to_commit(tx).await? else {
        return Err(StoreError::new(
            StoreErrorKind::TransactionAborted,
            "the transaction has already finished",
        ));
    };
    let (sql, arguments) = match resetting {
        Some(resetting) => conn.deciding(sql, resetting),
        None => (sql, None),
    };
    let params = ResetArguments::after(&arguments, params);
    let statement = match conn.prepare_sql(sql).await {
        Ok(statement) => statement,
        Err(e) => {
            // The transaction is still open (or aborted): roll it back.
            let _ = end(conn, None, ROLLBACK).await;
            return Err(map_error(e));
        }
    };
    let params = dyn_params(&params);
    let update = Some((&statement, params.as_slice()));
    let ended = if arguments.is_some() {
        commit_resetting(conn, update).await
    } else {
        end(conn, update, COMMIT).await
    };
    ended.map_err(completion_error)
}

/// The connection of `tx`, taken out to commit; `None` if the transaction
/// already ended. A statement a task of the handler still runs through a
/// clone commits with the response, so the commit waits for it, up to
/// [`COMMIT_PATIENCE`]; then the statement is cancelled, the transaction
/// rolled back, and the commit refused (retryable).
pub(super) async fn take_to_commit(tx: &PgTx) -> Result<Option<Conn>, StoreError> {
    match tx.try_take() {
        Take::Taken(conn) => return Ok(Some(*conn)),
        Take::Finished => return Ok(None),
        Take::Busy => {}
    }
    if let Ok(taken) = tokio::time::timeout(COMMIT_PATIENCE, tx.take()).await {
        return Ok(taken);
    }
    cancel_running(tx).await;
    if let Ok(Some(conn)) = tokio::time::timeout(CANCEL_GRACE, tx.take()).await {
        let _ = end(conn, None, ROLLBACK).await;
    }
    // Not taken within the grace: the last handle to go closes the
    // connection, and the server rolls back.
    Err(commit_gave_up())
}

/// [`Store::abort`](crate::store::Store::abort) for [`PgStore`](super::PgStore).
pub(super) async fn abort(tx: PgTx) -> Result<(), StoreError> {
    // Busy: a statement still runs through a clone of the handle (a task
    // the handler spawned); it would hold the transaction until it ends.
    let conn = match tx.try_take() {
        Take::Taken(conn) => Some(*conn),
        Take::Finished => None,
        Take::Busy => {
            cancel_running(&tx).await;
            tx.take().await
        }
    };
    let Some(conn) = conn else { return Ok(()) };
    // A statement the handler started may still be running on the
    // connection (its future was dropped at the deadline): the ROLLBACK
    // waits behind it. Cancel it if it does not end soon.
    let mut rollback = std::pin::pin!(end(conn, None, ROLLBACK));
    let ended = match tokio::time::timeout(ROLLBACK_PATIENCE, &mut rollback).await {
        Ok(ended) => Some(ended),
        Err(_) if cancel_running(&tx).await => {
            tokio::time::timeout(CANCEL_GRACE, rollback).await.ok()
        }
        // The cancel went unanswered: so would the rollback.
        Err(_) => None,
    };
    match ended {
        Some(Ok(())) => Ok(()),
        // The server rolls back when a connection whose ROLLBACK failed is closed.
        Some(Err(Finished::Update(e) | Finished::End(e))) => Err(map_error(e)),
        None => Err(StoreError::new(
            StoreErrorKind::Unavailable,
            "the rollback did not finish; the connection was closed",
        )),
    }
}

/// Ends the owner's transaction with `end` (`COMMIT` or `ROLLBACK`),
/// pipelined behind `update` when there is one, with the session reset
/// behind it (none behind a transaction pooler): one round trip. The connection goes back to the pool only
/// if all of it is known to have worked.
pub(super) async fn end(
    mut conn: Conn,
    update: Option<(&Prepared<'_>, &[&(dyn ToSql + Sync)])>,
    end: &'static str,
) -> Result<(), Finished> {
    let ended = pipelined_end(&conn, update, end);
    let reset = conn.reset_session();
    let (ended, reset) = tokio::join!(biased; ended, reset);
    if ended.is_ok() && reset.is_ok() {
        conn.mark_clean();
    }
    ended
}

/// Sends `update`, if any, and `end` behind it without waiting.
async fn pipelined_end(
    conn: &Conn,
    update: Option<(&Prepared<'_>, &[&(dyn ToSql + Sync)])>,
    end: &'static str,
) -> Result<(), Finished> {
    // `try_join!` and `biased`: the UPDATE goes out first, and should it
    // fail before it was sent (an encoding error), the COMMIT never goes
    // out at all. Once both were sent, a failed UPDATE has aborted the
    // transaction and the COMMIT rolls back.
    match update {
        Some((statement, params)) => tokio::try_join!(
            biased;
            async { conn.query_one_prepared(statement, params).await.map_err(Finished::Update) },
            async { conn.batch_execute(end).await.map_err(Finished::End) },
        )
        .map(|_| ()),
        None => conn.batch_execute(end).await.map_err(Finished::End),
    }
}

/// As [`end`] with `COMMIT`, for an `update` that carries the session
/// reset itself (`COMPLETE_AND_RESET`): nothing behind the `COMMIT`. The
/// connection goes back to the pool only if both worked (as with [`end`],
/// a failed update closes it: whether its `COMMIT` went out is not known).
pub(super) async fn commit_resetting(
    mut conn: Conn,
    update: Option<(&Prepared<'_>, &[&(dyn ToSql + Sync)])>,
) -> Result<(), Finished> {
    let ended = pipelined_end(&conn, update, COMMIT).await;
    if ended.is_ok() {
        conn.mark_clean();
    }
    ended
}

/// Cancels whatever statement runs on the connection of `tx` (a handler
/// cut off at its deadline, a task it spawned), so that its locks and
/// its connection come back now rather than when the statement ends.
/// Whether the cancel request was delivered: one that could not be (the
/// server unreachable within [`CANCEL_DEADLINE`]) says the database is not
/// answering, and nothing is gained by waiting for the statement.
async fn cancel_running(tx: &PgTx) -> bool {
    match tokio::time::timeout(CANCEL_DEADLINE, tx.canceller().cancel()).await {
        Ok(Ok(())) => true,
        Ok(Err(e)) => {
            tracing::warn!(error = %e, "could not cancel the statement still running for an abandoned owner");
            false
        }
        Err(_) => {
            tracing::warn!(
                "cancelling the statement still running for an abandoned owner took too long; its connection is closed instead"
            );
            false
        }
    }
}

/// Which part of ending a transaction failed.
pub(super) enum Finished {
    /// The statement before the end (the completion's UPDATE).
    Update(tokio_postgres::Error),
    /// The `COMMIT` or `ROLLBACK` itself.
    End(tokio_postgres::Error),
}

/// What a failed completion means for the operation.
///
/// - Lost before or with the `COMMIT` (a connection closed or terminated):
///   the commit may or may not have happened ([`StoreErrorKind::OutcomeUnknown`]).
/// - The UPDATE failed in the server: the transaction was already aborted
///   (the handler swallowed a failed statement) or is no longer the claim's;
///   the `COMMIT` rolled back, and a retry fails the same way
///   ([`StoreErrorKind::TransactionAborted`]). Likewise an UPDATE that could
///   not even be sent: the `COMMIT` never was. But a statement cancelled or
///   a lock wait run out ([`StoreErrorKind::Unavailable`]) and the server's
///   own trouble, such as a full disk ([`StoreErrorKind::Backend`]), are
///   rolled back too, and a retry may succeed.
/// - The `COMMIT` failed in the server: a deferred constraint
///   ([`StoreErrorKind::TransactionAborted`]) or a serialization failure
///   ([`StoreErrorKind::Conflict`]); rolled back either way.
pub(super) fn completion_error(failed: Finished) -> StoreError {
    let (e, what) = match failed {
        Finished::Update(e) => (
            e,
            "remembering the response failed; the transaction was rolled back",
        ),
        Finished::End(e) => (e, "the commit failed; the transaction was rolled back"),
    };
    let error = map_error(e);
    let answered = error.sql_state().is_some();
    match error.kind() {
        // A statement cancelled or a lock wait run out in the server: the
        // transaction is rolled back for certain.
        StoreErrorKind::Unavailable if error.sql_state().is_some_and(ends_only_the_statement) => {
            error
        }
        StoreErrorKind::Unavailable => StoreError::new(
            StoreErrorKind::OutcomeUnknown,
            "the connection was lost while committing; whether the commit happened is unknown",
        )
        .with_sql_state(error.sql_state().map(str::to_owned))
        .with_source(error),
        StoreErrorKind::Conflict => error,
        // The server's own trouble (disk full, out of memory): rolled
        // back, and a retry may well succeed.
        StoreErrorKind::Backend if answered => error,
        _ => StoreError::new(StoreErrorKind::TransactionAborted, what)
            .with_sql_state(error.sql_state().map(str::to_owned))
            .with_source(error),
    }
}
