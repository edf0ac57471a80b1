//! The one-commit mode ([`CommitStore`]) for [`SqlxStore`]: the handler's
//! transaction is begun without a claim, and the key's record goes in with
//! the response just before the `COMMIT`.

use super::{
    conn::GuardedConnection,
    error::{map_commit_error, map_error, sql_state},
    transport::{query, SqlxLink},
    SqlxStore, SqlxTx,
};
use crate::{
    protocol::{
        at_commit::{at_commit_params, CLAIM_AT_COMMIT, LOST_AT_COMMIT},
        claim::winner,
        transaction::{COMMIT, ROLLBACK},
    },
    record::StoredResponse,
    store::{ClaimRequest, CommitStore, Committed, StoreError, StoreErrorKind},
};

/// The one-commit mode: see [`CommitStore`] and
/// [`IdempotencyLayer::claim_at_commit`](crate::IdempotencyLayer::claim_at_commit).
/// The handler writes through [`SqlxTx`] as in the claim-first mode; its
/// [`attempt_token`](SqlxTx::attempt_token) is `0`, as no claim drew one.
/// sqlx sends one statement at a time: the claim and the `COMMIT` are two
/// round trips here (one in [`PgStore`](crate::postgres::PgStore)).
impl CommitStore for SqlxStore {
    async fn begin(&self, request: &ClaimRequest) -> Result<SqlxTx, StoreError> {
        let pooling = self.transaction_pooling;
        let mut tx = GuardedConnection::begin(&self.pool, pooling)
            .await
            .map_err(map_error)?;
        // The session's process id, which a cancel request names, and
        // (with a hold limit) how long the session may sit idle in the
        // transaction before the server ends it.
        let pid = SqlxLink {
            conn: tx.raw(),
            transaction_pooling: pooling,
        }
        .set_waits(None, request.hold_limit)
        .await;
        let pid = match pid {
            Ok(pid) => pid,
            Err(e) => {
                tx.rollback_quietly().await;
                return Err(e);
            }
        };
        Ok(SqlxTx::of_request(tx, self, pid, request, 0, String::new()))
    }

    async fn commit(
        &self,
        tx: SqlxTx,
        request: &ClaimRequest,
        response: &StoredResponse,
    ) -> Result<Committed, StoreError> {
        let Some(mut transaction) = tx.take_to_commit().await? else {
            return Err(StoreError::new(
                StoreErrorKind::TransactionAborted,
                "the transaction has already finished",
            ));
        };
        let headers = response.encode_headers();
        let params = at_commit_params(request, response, &headers);
        let claimed = query(CLAIM_AT_COMMIT, &params, self.transaction_pooling)
            .execute(transaction.raw())
            .await;
        match claimed {
            Ok(_) => transaction
                .end(COMMIT, true)
                .await
                .map(|()| Committed::Won)
                .map_err(map_commit_error),
            Err(e) => {
                let lost = sql_state(&e).as_deref() == Some(LOST_AT_COMMIT);
                let error = map_error(e);
                // Should the rollback fail, the connection is closed, and
                // the server rolls back.
                if let Err(rollback) = transaction.end(ROLLBACK, true).await {
                    tracing::debug!(error = %rollback, "rolling back a lost commit failed");
                }
                if !lost {
                    return Err(error);
                }
                self.lost_to(request).await
            }
        }
    }
}

impl SqlxStore {
    /// The record a lost commit lost to, with a fresh snapshot, or the key
    /// freed (see `protocol::claim::winner`). In a transaction of its own,
    /// as every statement of this store is (behind a transaction pooler an
    /// unnamed statement outside one may reach another server connection
    /// than its own preparation), committed if it freed the key.
    async fn lost_to(&self, request: &ClaimRequest) -> Result<Committed, StoreError> {
        let pooling = self.transaction_pooling;
        let mut tx = GuardedConnection::begin(&self.pool, pooling)
            .await
            .map_err(map_error)?;
        let winner = winner(
            &mut SqlxLink {
                conn: tx.raw(),
                transaction_pooling: pooling,
            },
            request,
        )
        .await;
        match winner {
            // Should the COMMIT fail, only the removal of the expired row is
            // in doubt (the handler's writes were rolled back before): an
            // error of the removal, not an unknown outcome.
            Ok(Committed::Freed) => tx
                .end(COMMIT, false)
                .await
                .map(|()| Committed::Freed)
                .map_err(map_error),
            other => {
                tx.rollback_quietly().await;
                other
            }
        }
    }
}
