//! The one-commit mode ([`CommitStore`]) for [`PgStore`]: the handler's
//! transaction is opened without a claim, and the key's record goes in
//! with the response, pipelined with the `COMMIT`.

use std::{future::Future, pin::pin, task::Poll};

use super::{
    claim::connection_fault,
    conn::{behind, Conn, ResetArguments},
    end::{completion_error, Finished},
    error::map_error,
    prepared::dyn_params,
    PgStore, PgTx,
};
use crate::{
    protocol::{
        at_commit::{at_commit_params, CLAIM_AT_COMMIT, CLAIM_AT_COMMIT_AND_RESET, LOST_AT_COMMIT},
        claim::{begin_with_waits, winner},
        transaction::{COMMIT, ROLLBACK},
    },
    record::StoredResponse,
    store::{ClaimRequest, CommitStore, Committed, StoreError, StoreErrorKind},
};

/// The one-commit mode: see [`CommitStore`] and
/// [`IdempotencyLayer::claim_at_commit`](crate::IdempotencyLayer::claim_at_commit).
/// The handler writes through [`PgTx`] as in the claim-first mode; its
/// [`attempt_token`](PgTx::attempt_token) is `0`, as no claim drew one.
/// The `BEGIN` goes out with the handler's first statement, and the key's
/// record with the `COMMIT`: a create costs the handler's own round trips
/// (behind a transaction pooler, one more: the `BEGIN` is sent first).
impl CommitStore for PgStore {
    async fn begin(&self, request: &ClaimRequest) -> Result<PgTx, StoreError> {
        let mut conn = self.conn().await?;
        // Whether the session reset may ride in the claim (asked once per
        // store); unanswered, it goes as a message of its own.
        self.learn_citus(&mut conn).await;
        // No lock wait of its own (the handler's statements keep the
        // session's); should this process freeze, the server ends the
        // transaction by itself after the hold limit (the session's, or
        // one set for this transaction).
        let begin = begin_with_waits(None, conn.hold_limit_to_set(request.hold_limit));
        // Until the handler's first statement is answered, a lost
        // connection costs nothing: the transaction starts over on another.
        conn.restartable(begin.clone());
        if conn.unnamed() {
            // Behind a transaction pooler, a statement prepared before the
            // BEGIN may reach another server connection than the
            // transaction: begin now.
            conn.mark_dirty();
            if let Err(e) = conn.batch_pipelined(&begin).await {
                let error = map_error(e);
                if !connection_fault(&error) {
                    return Err(error);
                }
                conn.replace(begin).await?;
            }
        } else {
            // Sent with the handler's first statement (or with the claim,
            // if the handler sends none): no round trip of its own.
            conn.defer_begin(begin);
        }
        Ok(PgTx::of_request(conn, request, 0, String::new()))
    }

    async fn commit(
        &self,
        tx: PgTx,
        request: &ClaimRequest,
        response: &StoredResponse,
    ) -> Result<Committed, StoreError> {
        // A statement of the handler still running through a clone: the
        // commit queues behind it, as in the claim-first mode, for a while.
        let mut conn = super::end::take_to_commit(&tx)
            .await?
            .ok_or_else(finished)?;
        // The session reset rides in the claim where the connection lets it.
        let (sql, arguments) = conn.deciding(CLAIM_AT_COMMIT, CLAIM_AT_COMMIT_AND_RESET);
        let statement = match conn.prepare_sql(sql).await {
            Ok(statement) => statement,
            Err(e) => {
                let _ = super::end::end(conn, None, ROLLBACK).await;
                return Err(map_error(e));
            }
        };
        let headers = response.encode_headers();
        let params = at_commit_params(request, response, &headers);
        let params = ResetArguments::after(&arguments, &params);
        let params = dyn_params(&params);
        // A handler that sent no statement left the BEGIN to go out here.
        let begin = conn.take_begin();
        let claimed = behind(&conn, begin, conn.query_one_prepared(&statement, &params));
        let (ended, clean) = pipelined(&conn, claimed, arguments.is_some()).await;
        if clean {
            conn.mark_clean();
        }
        match ended {
            Ok(()) => Ok(Committed::Won),
            // Lost: the COMMIT rolled everything back.
            Err(Finished::Update(e))
                if e.as_db_error()
                    .is_some_and(|db| db.code().code() == LOST_AT_COMMIT) =>
            {
                lost(self, conn, clean, request).await
            }
            Err(failed) => Err(completion_error(failed)),
        }
    }
}

/// Sends the claim, the `COMMIT` behind it without waiting, and the session
/// reset behind that (unless the claim carries it, `reset_in_claim`; then
/// only if the transaction did not commit): one round trip. The `COMMIT`
/// goes out only once the claim was sent (its first poll pending): a claim
/// that could not even be sent must not let the handler's writes commit
/// without it. Also says whether the connection is clean (its transaction
/// over, its session reset).
async fn pipelined<F>(conn: &Conn, claimed: F, reset_in_claim: bool) -> (Result<(), Finished>, bool)
where
    F: Future<Output = Result<tokio_postgres::Row, tokio_postgres::Error>>,
{
    let mut claimed = pin!(claimed);
    let first = std::future::poll_fn(|cx| match claimed.as_mut().poll(cx) {
        Poll::Ready(done) => Poll::Ready(Some(done)),
        Poll::Pending => Poll::Ready(None),
    })
    .await;
    let end = match &first {
        Some(Err(_)) => ROLLBACK,
        _ => COMMIT,
    };
    let claim = async {
        match first {
            Some(done) => done,
            None => claimed.await,
        }
    };
    let reset = async {
        if reset_in_claim {
            return Ok(());
        }
        conn.reset_session().await
    };
    let (claim, ended, reset) = tokio::join!(biased; claim, conn.batch_execute(end), reset);
    let mut clean = ended.is_ok() && reset.is_ok();
    if clean && reset_in_claim && claim.is_err() {
        // Rolled back before the claim's reset ran: the session advisory
        // locks a handler's function took are still held.
        clean = conn.reset_session().await.is_ok();
    }
    let result = match (claim, ended) {
        (Err(e), _) => Err(Finished::Update(e)),
        (Ok(_), Err(e)) => Err(Finished::End(e)),
        (Ok(_), Ok(())) => Ok(()),
    };
    (result, clean)
}

/// A lost commit: the winner's record, read with a fresh snapshot on the
/// same connection when its transaction is known to be over, else on
/// another one.
async fn lost(
    store: &PgStore,
    conn: Conn,
    clean: bool,
    request: &ClaimRequest,
) -> Result<Committed, StoreError> {
    let mut conn = if clean {
        conn
    } else {
        drop(conn);
        store.conn().await?
    };
    winner(&mut conn, request).await
}

fn finished() -> StoreError {
    StoreError::new(
        StoreErrorKind::TransactionAborted,
        "the transaction has already finished",
    )
}
