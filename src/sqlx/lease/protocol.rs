//! [`LeaseStore`] for [`SqlxStore`]: acquire (insert or take over),
//! heartbeat, the fenced transaction, finish, release, the status lookup
//! and recovery, each with the statement `PgStore` uses.

use std::time::Duration;

use super::SqlxLease;
use crate::{
    fingerprint::Fingerprint,
    protocol::lease::{
        acquired, answered, attempt_of, operation_state, recovered, running, stored_response,
        RecoverRow, ACQUIRE, FAIL, FINISH, HEARTBEAT, HOLD, LOOKUP, OPERATION, RECOVER, RELEASE,
    },
    protocol::statements::BEGIN,
    protocol::waits::{GRACE, MIN_WAIT, ROW_WAIT},
    record::{Record, StoredResponse},
    scope::TenantId,
    sqlx::{
        claim::set_waits,
        conn::GuardedConnection,
        error::{map_error, sql_state, LOCK_NOT_AVAILABLE},
        finish, query, SqlxStore, SqlxTx,
    },
    store::OperationId,
    store::{
        Acquired, Backoff, ClaimRequest, LeaseRequest, LeaseStore, Operation, Recovered,
        StoreError, StoreErrorKind,
    },
};
use ::sqlx::{postgres::PgRow, Postgres, Row, Transaction};

impl LeaseStore for SqlxStore {
    type Lease = SqlxLease;

    async fn acquire(
        &self,
        claim: &ClaimRequest,
        request: &LeaseRequest,
    ) -> Result<Acquired<SqlxLease>, StoreError> {
        let wait = claim.wait.max(MIN_WAIT);
        let deadline = tokio::time::Instant::now() + wait;
        if let Some(found) = self.lookup(claim).await? {
            return Ok(found);
        }
        let remaining = deadline
            .saturating_duration_since(tokio::time::Instant::now())
            .max(MIN_WAIT);
        let mut tx = self.short(remaining).await?;
        let taken = tokio::time::timeout(
            remaining + GRACE,
            query(ACQUIRE, self.transaction_pooling)
                .bind(claim.scope.tenant().as_str())
                .bind(claim.scope.endpoint())
                .bind(claim.key.as_str())
                .bind(claim.fingerprint.as_bytes().as_slice())
                .bind(claim.retention.as_secs_f64())
                .bind(request.lease.as_secs_f64())
                .bind(request.operation_id.to_string())
                .bind(request.request.method.as_str())
                .bind(request.request.target.as_str())
                .bind(request.request.encode_headers())
                .bind(request.request.body.as_ref())
                .fetch_optional(&mut *tx),
        )
        .await;
        let row = match taken {
            Err(_) => return Err(timed_out()),
            Ok(Err(e)) if sql_state(&e).as_deref() == Some(LOCK_NOT_AVAILABLE) => {
                rollback(tx).await;
                return Ok(Acquired::InProgress);
            }
            Ok(Err(e)) => {
                let error = map_error(e);
                rollback(tx).await;
                return Err(error);
            }
            Ok(Ok(row)) => row,
        };
        tx.commit().await.map_err(map_error)?;
        let Some(row) = row else {
            // Held by someone whose lease is live, or by another request:
            // say where it stands.
            return Ok(self.lookup(claim).await?.unwrap_or(Acquired::InProgress));
        };
        let columns = (
            row.try_get(0).map_err(map_error)?,
            row.try_get(1).map_err(map_error)?,
            row.try_get(2).map_err(map_error)?,
        );
        let owned = acquired(claim, request, columns, |id| {
            SqlxLease::new(self.clone(), id)
        })?;
        Ok(Acquired::Owned(owned))
    }

    async fn heartbeat(&self, lease: &SqlxLease, extend: Duration) -> Result<(), StoreError> {
        let query = keyed(HEARTBEAT, lease)
            .bind(extend.min(crate::store::MAX_WAIT).as_secs_f64())
            .bind(lease.identity().retention().as_secs_f64());
        self.guarded(query, lease).await
    }

    async fn fenced(&self, lease: &SqlxLease) -> Result<SqlxTx, StoreError> {
        open_fenced(lease).await
    }

    async fn commit_fenced(&self, tx: SqlxTx) -> Result<(), StoreError> {
        finish::commit_fenced(tx).await
    }

    async fn finish(&self, lease: &SqlxLease, response: &StoredResponse) -> Result<(), StoreError> {
        let query = with_response(keyed(FINISH, lease), lease, response)
            .bind(response.resource_id.as_ref().map(|id| id.as_str()));
        self.guarded(query, lease).await
    }

    async fn release(&self, lease: &SqlxLease) -> Result<(), StoreError> {
        self.guarded(keyed(RELEASE, lease), lease).await
    }

    async fn fail(
        &self,
        lease: &SqlxLease,
        response: &StoredResponse,
        attempts: u32,
    ) -> Result<(), StoreError> {
        let query = with_response(keyed(FAIL, lease), lease, response)
            .bind(i32::try_from(attempts).unwrap_or(i32::MAX));
        self.guarded(query, lease).await
    }

    async fn operation(
        &self,
        tenant: &TenantId,
        id: OperationId,
    ) -> Result<Option<Operation>, StoreError> {
        let row = self
            .read_optional(
                query(OPERATION, self.transaction_pooling)
                    .bind(id.to_string())
                    .bind(tenant.as_str()),
            )
            .await?;
        let Some(row) = row else { return Ok(None) };
        let state: &str = row.try_get(0).map_err(map_error)?;
        let attempts = attempt_of(row.try_get(5).map_err(map_error)?);
        let state = operation_state(state, || response_at(&row, 1))?;
        Ok(Some(Operation::new(id, state, attempts)))
    }

    async fn recover(
        &self,
        endpoint: &str,
        lease: Duration,
        retention: Duration,
        backoff: Backoff,
    ) -> Result<Option<Recovered<SqlxLease>>, StoreError> {
        let (lease, retention) = crate::store::bounded(lease, retention);
        within(self.recover_within(endpoint, lease, retention, backoff)).await
    }
}

impl SqlxStore {
    /// [`LeaseStore::recover`], unbounded.
    async fn recover_within(
        &self,
        endpoint: &str,
        lease: Duration,
        retention: Duration,
        backoff: Backoff,
    ) -> Result<Option<Recovered<SqlxLease>>, StoreError> {
        let mut tx = self.short(ROW_WAIT).await?;
        let row = query(RECOVER, self.transaction_pooling)
            .bind(endpoint)
            .bind(lease.as_secs_f64())
            .bind(backoff.first.as_secs_f64())
            .bind(backoff.max.as_secs_f64())
            .bind(retention.as_secs_f64())
            .fetch_optional(&mut *tx)
            .await;
        let row = match row {
            Ok(row) => row,
            Err(e) => {
                let error = map_error(e);
                rollback(tx).await;
                return Err(error);
            }
        };
        tx.commit().await.map_err(map_error)?;
        let Some(row) = row else { return Ok(None) };
        let column = |e: ::sqlx::Error| map_error(e);
        let row = RecoverRow {
            tenant: row.try_get(0).map_err(column)?,
            key: row.try_get(1).map_err(column)?,
            token: row.try_get(2).map_err(column)?,
            operation_id: row.try_get(3).map_err(column)?,
            method: row.try_get(4).map_err(column)?,
            target: row.try_get(5).map_err(column)?,
            headers: row.try_get(6).map_err(column)?,
            body: row.try_get(7).map_err(column)?,
            attempts: row.try_get(8).map_err(column)?,
        };
        let recovered = recovered(row, endpoint, lease, retention, |id| {
            SqlxLease::new(self.clone(), id)
        })?;
        Ok(Some(recovered))
    }

    /// Where a key stands, without a lock or a write: `None` when an
    /// acquire may own it (no record, an expired one, an orphan, or an
    /// expired lease of the same request).
    async fn lookup(
        &self,
        claim: &ClaimRequest,
    ) -> Result<Option<Acquired<SqlxLease>>, StoreError> {
        let row = self
            .read_optional(
                query(LOOKUP, self.transaction_pooling)
                    .bind(claim.scope.tenant().as_str())
                    .bind(claim.scope.endpoint())
                    .bind(claim.key.as_str()),
            )
            .await?;
        let Some(row) = row else { return Ok(None) };
        let state: &str = row.try_get(1).map_err(map_error)?;
        let fingerprint: &[u8] = row.try_get(0).map_err(map_error)?;
        let fingerprint = Fingerprint::from_slice(fingerprint)
            .ok_or_else(|| corrupt("stored record has an invalid fingerprint"))?;
        // A failure after the last attempt is remembered as a completion is.
        if answered(state) {
            return Ok(Some(Acquired::Completed(Record {
                fingerprint,
                response: response_at(&row, 2)?,
            })));
        }
        let id: Option<&str> = row.try_get(6).map_err(map_error)?;
        let live: Option<bool> = row.try_get(7).map_err(map_error)?;
        running(claim, fingerprint, id, live)
    }

    /// Reads at most one row outside the store's transactions: on the pool,
    /// or, behind a transaction pooler, in a transaction of its own (sqlx
    /// prepares in a round trip of its own, which outside a transaction the
    /// pooler may send to another server connection than the execution).
    async fn read_optional(
        &self,
        statement: ::sqlx::query::Query<'_, Postgres, ::sqlx::postgres::PgArguments>,
    ) -> Result<Option<PgRow>, StoreError> {
        within(async {
            if !self.transaction_pooling {
                return statement
                    .fetch_optional(&self.pool)
                    .await
                    .map_err(map_error);
            }
            // Dropped on an error, the transaction rolls back.
            let mut tx = self.pool.begin_with(BEGIN).await.map_err(map_error)?;
            let row = statement
                .fetch_optional(&mut *tx)
                .await
                .map_err(map_error)?;
            tx.commit().await.map_err(map_error)?;
            Ok(row)
        })
        .await
    }

    /// A short transaction whose lock waits last at most `wait`.
    async fn short(&self, wait: Duration) -> Result<Transaction<'static, Postgres>, StoreError> {
        let mut tx = self.pool.begin_with(BEGIN).await.map_err(map_error)?;
        if let Err(e) = set_waits(&mut tx, wait, None, self.transaction_pooling).await {
            let error = map_error(e);
            rollback(tx).await;
            return Err(error);
        }
        Ok(tx)
    }

    /// Runs a statement guarded by the lease's token in a short transaction
    /// and commits it if it changed the row (see [`end_short`](Self::end_short)).
    async fn guarded(&self, query: Keyed<'_>, lease: &SqlxLease) -> Result<(), StoreError> {
        within(async {
            let mut tx = self.short(ROW_WAIT).await?;
            let done = query.execute(&mut *tx).await;
            self.end_short(tx, done, lease).await
        })
        .await
    }

    /// Commits a heartbeat, finish or release that changed one row; no row
    /// changed: the lease's token is not the record's, and the owner is
    /// fenced.
    async fn end_short(
        &self,
        tx: Transaction<'static, Postgres>,
        done: Result<::sqlx::postgres::PgQueryResult, ::sqlx::Error>,
        lease: &SqlxLease,
    ) -> Result<(), StoreError> {
        match done {
            Err(e) => {
                let error = map_error(e);
                rollback(tx).await;
                Err(error)
            }
            Ok(done) if done.rows_affected() == 0 => {
                rollback(tx).await;
                Err(lease.fenced_error())
            }
            Ok(_) => tx.commit().await.map_err(map_error),
        }
    }
}

/// Begins a fenced transaction and holds the record at the lease's token.
pub(super) async fn open_fenced(lease: &SqlxLease) -> Result<SqlxTx, StoreError> {
    let store = lease.store();
    let id = lease.identity();
    let mut tx = GuardedConnection::begin(&store.pool, store.transaction_pooling)
        .await
        .map_err(map_error)?;
    let (tenant, endpoint, key, token) = id.columns();
    let held = tokio::time::timeout(ROW_WAIT + GRACE, async {
        // A lock wait inside gives up after half a lease (at most the row
        // wait); left idle for a whole lease, the server ends it.
        let pid = set_waits(
            tx.raw(),
            ROW_WAIT.min(id.lease() / 2),
            Some(id.lease()),
            store.transaction_pooling,
        )
        .await?;
        let row = query(HOLD, store.transaction_pooling)
            .bind(tenant)
            .bind(endpoint)
            .bind(key)
            .bind(token)
            .fetch_optional(tx.raw())
            .await?;
        Ok::<_, ::sqlx::Error>(row.map(|row| (row, pid)))
    })
    .await;
    let row = match held {
        Err(_) => return Err(timed_out()),
        Ok(Err(e)) => {
            let error = map_error(e);
            tx.rollback_quietly().await;
            return Err(error);
        }
        Ok(Ok(row)) => row,
    };
    let Some((row, pid)) = row else {
        tx.rollback_quietly().await;
        crate::metrics::fenced(endpoint, crate::metrics::FencedAt::Write);
        return Err(lease.fenced_error());
    };
    let xid: String = row.try_get(0).map_err(map_error)?;
    Ok(SqlxTx::new(
        tx,
        store.pool.clone(),
        pid,
        store.transaction_pooling,
        id.scope().clone(),
        id.key().clone(),
        token,
        xid,
        id.retention(),
        true,
    ))
}

type Keyed<'q> = ::sqlx::query::Query<'q, Postgres, ::sqlx::postgres::PgArguments>;

/// `sql` with the parameters every token-guarded statement starts with:
/// tenant, endpoint, key, token.
fn keyed<'q>(sql: &'q str, lease: &'q SqlxLease) -> Keyed<'q> {
    let (tenant, endpoint, key, token) = lease.identity().columns();
    query(sql, lease.store().transaction_pooling)
        .bind(tenant)
        .bind(endpoint)
        .bind(key)
        .bind(token)
}

/// The answer's parameters of finish and fail: status, headers, body and
/// the retention.
fn with_response<'q>(
    query: Keyed<'q>,
    lease: &SqlxLease,
    response: &'q StoredResponse,
) -> Keyed<'q> {
    query
        .bind(response.status.as_u16() as i16)
        .bind(response.encode_headers())
        .bind(response.body.as_ref())
        .bind(lease.identity().retention().as_secs_f64())
}

async fn rollback(tx: Transaction<'static, Postgres>) {
    if let Err(e) = tx.rollback().await {
        tracing::debug!(error = %e, "rolling back a lease statement's transaction failed");
    }
}

/// The response stored in columns `at..at + 4` (status, headers, body,
/// resource id).
fn response_at(row: &PgRow, at: usize) -> Result<StoredResponse, StoreError> {
    stored_response(
        row.try_get(at).map_err(map_error)?,
        row.try_get(at + 1).map_err(map_error)?,
        row.try_get(at + 2).map_err(map_error)?,
        row.try_get(at + 3).map_err(map_error)?,
    )
}

fn corrupt(message: &str) -> StoreError {
    StoreError::new(StoreErrorKind::Corrupt, message)
}

/// `work`, answered within [`ROW_WAIT`] and [`GRACE`] whatever the database
/// does, as `PgStore`'s lease calls are. Cut off, its connection is dropped
/// mid-statement, and the server rolls back.
async fn within<T>(
    work: impl std::future::Future<Output = Result<T, StoreError>>,
) -> Result<T, StoreError> {
    tokio::time::timeout(ROW_WAIT + GRACE, work)
        .await
        .unwrap_or_else(|_| Err(timed_out()))
}

fn timed_out() -> StoreError {
    StoreError::new(
        StoreErrorKind::Unavailable,
        "the database did not answer within the wait",
    )
}
