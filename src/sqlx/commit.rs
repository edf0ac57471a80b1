//! The one-commit mode ([`CommitStore`]) for [`SqlxStore`]: the handler's
//! transaction is begun without a claim, and the key's record goes in with
//! the response just before the `COMMIT`.

use ::sqlx::Row;

use super::{
    claim::{decode, LOOKUP},
    conn::GuardedConnection,
    error::{map_commit_error, map_error, sql_state},
    query, SqlxStore, SqlxTx,
};
use crate::{
    protocol::statements::{CLAIM_AT_COMMIT, LOST_AT_COMMIT},
    record::StoredResponse,
    store::{ClaimRequest, CommitStore, Committed, StoreError, StoreErrorKind},
};

/// The one-commit mode: see [`CommitStore`] and
/// [`IdempotencyLayer::claim_at_commit`](crate::IdempotencyLayer::claim_at_commit).
/// The handler writes through [`SqlxTx`] as in the default mode; its
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
        let idle = request
            .hold_limit
            .map(|d| format!("{}ms", d.as_millis().clamp(1, i32::MAX as u128)));
        let pid = query(
            "SELECT pg_backend_pid(), CASE WHEN $1::text IS NOT NULL \
                 THEN set_config('idle_in_transaction_session_timeout', $1, true) END",
            pooling,
        )
        .bind(idle)
        .fetch_one(tx.raw())
        .await
        .and_then(|row| row.try_get::<i32, _>(0));
        let pid = match pid {
            Ok(pid) => pid,
            Err(e) => {
                let error = map_error(e);
                tx.rollback_quietly().await;
                return Err(error);
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
        let claimed = query(CLAIM_AT_COMMIT, self.transaction_pooling)
            .bind(request.scope.tenant().as_str())
            .bind(request.scope.endpoint())
            .bind(request.key.as_str())
            .bind(request.fingerprint.as_bytes().as_slice())
            .bind(response.status.as_u16() as i16)
            .bind(response.encode_headers())
            .bind(response.body.as_ref())
            .bind(response.resource_id.as_ref().map(|id| id.as_str()))
            .bind(request.retention.as_secs_f64())
            .execute(transaction.raw())
            .await;
        match claimed {
            Ok(_) => transaction
                .end("COMMIT", true)
                .await
                .map(|()| Committed::Won)
                .map_err(map_commit_error),
            Err(e) => {
                let lost = sql_state(&e).as_deref() == Some(LOST_AT_COMMIT);
                let error = map_error(e);
                // Should the rollback fail, the connection is closed, and
                // the server rolls back.
                if let Err(rollback) = transaction.end("ROLLBACK", true).await {
                    tracing::debug!(error = %rollback, "rolling back a lost commit failed");
                }
                if !lost {
                    return Err(error);
                }
                self.winner(request).await
            }
        }
    }
}

impl SqlxStore {
    /// The record a lost commit lost to, with a fresh snapshot. Read inside
    /// a transaction of its own, as every statement of this store is (behind
    /// a transaction pooler an unnamed statement outside one may reach
    /// another server connection than its own preparation).
    async fn winner(&self, request: &ClaimRequest) -> Result<Committed, StoreError> {
        let pooling = self.transaction_pooling;
        let mut tx = GuardedConnection::begin(&self.pool, pooling)
            .await
            .map_err(map_error)?;
        let row = query(LOOKUP, pooling)
            .bind(request.scope.tenant().as_str())
            .bind(request.scope.endpoint())
            .bind(request.key.as_str())
            .fetch_optional(tx.raw())
            .await;
        let record = row.and_then(|row| row.as_ref().map(decode).transpose());
        tx.rollback_quietly().await;
        Ok(match record.map_err(map_error)?.flatten() {
            Some(record) => Committed::Lost(record),
            // An operation of the long-running mode under its lease, or a
            // record already gone: this transaction is over either way.
            None => Committed::Held,
        })
    }
}
