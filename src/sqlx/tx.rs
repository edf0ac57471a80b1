//! [`SqlxTx`]: the claim's transaction, which the handler writes through
//! and the store commits with the remembered response.

use std::{
    fmt,
    ops::{Deref, DerefMut},
    sync::Arc,
    time::Duration,
};

use ::sqlx::{Connection as _, Executor as _, PgConnection, PgPool};
use tokio::sync::{MappedMutexGuard, Mutex, MutexGuard};

use super::{
    conn::GuardedConnection,
    error::{map_commit_error, map_error},
    query,
};
use crate::{
    key::IdempotencyKey,
    pg::statements::{COMPLETE, FENCED_CHECK},
    record::StoredResponse,
    scope::Scope,
    store::{StoreError, StoreErrorKind},
};

/// The transaction handle of a [`SqlxStore`](super::SqlxStore) owner: the
/// claim's own `sqlx` transaction, in which the key's row is inserted.
///
/// The layer puts it in the request extensions. The handler takes the
/// connection with [`conn`](Self::conn) and runs its statements on it; they
/// commit together with the remembered response when the layer completes
/// the request, or roll back with the claim. Clones share the transaction;
/// statements through them run one at a time.
///
/// ```no_run
/// # async fn handler(tx: tower_idempotency::sqlx::SqlxTx) -> Result<(), Box<dyn std::error::Error>> {
/// let mut conn = tx.conn().await?;
/// let (id,): (i64,) = sqlx::query_as(
///     "INSERT INTO orders (tenant_id, total) VALUES ($1, $2) RETURNING id",
/// )
/// .bind(tx.tenant())
/// .bind(2400_i64)
/// .fetch_one(&mut *conn)
/// .await?;
/// # Ok(()) }
/// ```
///
/// The connection is guarded as [`PgTx`](crate::postgres::PgTx) is: a
/// statement that would end the transaction (`COMMIT`, `ROLLBACK`) or
/// change the pooled session beyond this request is refused before it
/// reaches the server (see [`GuardedConnection`]), and the session is reset
/// behind the `COMMIT` or `ROLLBACK`. Dropped unfinished (every clone gone:
/// a panicking handler, a cancelled request), the connection is closed
/// instead of going back to the pool, and PostgreSQL rolls back.
#[derive(Clone)]
pub struct SqlxTx {
    inner: Arc<Shared>,
}

struct Shared {
    tx: Mutex<Option<GuardedConnection>>,
    // For a cancel request: the pool, and the process id of the
    // transaction's session.
    pool: PgPool,
    pid: i32,
    transaction_pooling: bool,
    scope: Scope,
    key: IdempotencyKey,
    token: i64,
    xid: String,
    retention: Duration,
    // A long-running owner's fenced transaction (LeaseStore::fenced), not
    // a claim's.
    fenced: bool,
}

/// The claim's connection, borrowed from a [`SqlxTx`] for the handler's
/// statements: `&mut *conn` is a `sqlx` executor, behind the statement
/// guard ([`GuardedConnection`]). Other clones of the handle wait while it
/// is held.
pub struct SqlxConn<'a> {
    conn: MappedMutexGuard<'a, GuardedConnection>,
}

impl Deref for SqlxConn<'_> {
    type Target = GuardedConnection;

    fn deref(&self) -> &GuardedConnection {
        &self.conn
    }
}

impl DerefMut for SqlxConn<'_> {
    fn deref_mut(&mut self) -> &mut GuardedConnection {
        &mut self.conn
    }
}

impl fmt::Debug for SqlxConn<'_> {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("SqlxConn").finish_non_exhaustive()
    }
}

impl SqlxTx {
    #[allow(clippy::too_many_arguments)]
    pub(super) fn new(
        tx: GuardedConnection,
        pool: PgPool,
        pid: i32,
        transaction_pooling: bool,
        scope: Scope,
        key: IdempotencyKey,
        token: i64,
        xid: String,
        retention: Duration,
        fenced: bool,
    ) -> Self {
        SqlxTx {
            inner: Arc::new(Shared {
                tx: Mutex::new(Some(tx)),
                pool,
                pid,
                transaction_pooling,
                scope,
                key,
                token,
                xid,
                retention,
                fenced,
            }),
        }
    }

    /// The transaction's connection, for the handler's statements.
    ///
    /// [`StoreErrorKind::TransactionAborted`] once the layer completed or
    /// aborted the transaction (e.g. a task spawned by the handler writes
    /// after the handler returned).
    pub async fn conn(&self) -> Result<SqlxConn<'_>, StoreError> {
        let guard = self.inner.tx.lock().await;
        let conn = MutexGuard::try_map(guard, Option::as_mut).map_err(|_| finished())?;
        Ok(SqlxConn { conn })
    }

    /// The tenant the request acts for.
    pub fn tenant(&self) -> &str {
        self.inner.scope.tenant().as_str()
    }

    /// The tenant and endpoint of the claimed key.
    pub fn scope(&self) -> &Scope {
        &self.inner.scope
    }

    /// The claim's attempt token: larger than every earlier one for this key.
    pub fn attempt_token(&self) -> i64 {
        self.inner.token
    }

    /// The idempotency key the request carried.
    pub fn idempotency_key(&self) -> &str {
        self.inner.key.as_str()
    }

    /// Takes the transaction out to end it; `None` if it already ended.
    /// Waits for a statement running through a clone.
    /// Takes the transaction to end it. A task the handler spawned may
    /// still hold the connection in a statement: after
    /// [`ROLLBACK_PATIENCE`] that statement is cancelled, and after
    /// [`CANCEL_GRACE`] more the store gives up (`Unavailable`; the
    /// transaction is rolled back once the statement ends and the last
    /// handle is dropped).
    pub(super) async fn take(&self) -> Result<Option<GuardedConnection>, StoreError> {
        if let Ok(mut held) = tokio::time::timeout(ROLLBACK_PATIENCE, self.inner.tx.lock()).await {
            return Ok(held.take());
        }
        self.cancel_running().await;
        match tokio::time::timeout(CANCEL_GRACE, self.inner.tx.lock()).await {
            Ok(mut held) => Ok(held.take()),
            Err(_) => Err(StoreError::new(
                StoreErrorKind::Unavailable,
                "a statement left running on the connection did not end",
            )),
        }
    }

    /// Cancels whatever statement runs on this transaction's session, from
    /// another pooled connection.
    ///
    /// Behind a transaction pooler too: the process id was read inside this
    /// transaction, which is still open (its `ROLLBACK` waits for the
    /// statement), so the pooler still lends this client that server
    /// connection. The statement is a simple query (the id is a number of
    /// ours, not client data): one round trip, nothing prepared.
    async fn cancel_running(&self) {
        let cancel = format!("SELECT pg_cancel_backend({})", self.inner.pid);
        let cancelled = (&self.inner.pool).execute(cancel.as_str()).await;
        if let Err(e) = cancelled {
            tracing::debug!(error = %e, "cancelling a statement left running failed");
        }
    }
}

impl fmt::Debug for SqlxTx {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("SqlxTx")
            .field("scope", &self.inner.scope)
            .field("key", &self.inner.key)
            .field("attempt_token", &self.inner.token)
            .finish_non_exhaustive()
    }
}

impl Drop for Shared {
    fn drop(&mut self) {
        if self.tx.get_mut().is_some() {
            // The connection closes instead of going back to the pool
            // (`GuardedConnection`'s drop); PostgreSQL rolls back.
            tracing::warn!(
                endpoint = self.scope.endpoint(),
                key_hash = %self.key.short_hash(),
                "idempotency transaction dropped unfinished; closing its connection (rolled back)"
            );
        }
    }
}

fn finished() -> StoreError {
    StoreError::new(
        StoreErrorKind::TransactionAborted,
        "the transaction has already finished",
    )
}

/// [`Store::complete`](crate::store::Store::complete): the response, checked
/// against the claim's token and transaction, then `COMMIT` and the session
/// reset.
pub(super) async fn complete(tx: SqlxTx, response: &StoredResponse) -> Result<(), StoreError> {
    let Some(mut transaction) = tx.take().await? else {
        return Err(finished());
    };
    if tx.inner.fenced {
        if let Err(e) = transaction.end("ROLLBACK", true).await {
            tracing::debug!(error = %e, "rolling back a misused fenced transaction failed");
        }
        return Err(StoreError::new(
            StoreErrorKind::TransactionAborted,
            "a fenced transaction commits with LeaseStore::commit_fenced; rolled back",
        ));
    }
    let shared = &tx.inner;
    let remembered = query(COMPLETE, shared.transaction_pooling)
        .bind(shared.scope.tenant().as_str())
        .bind(shared.scope.endpoint())
        .bind(shared.key.as_str())
        .bind(shared.token)
        .bind(response.status.as_u16() as i16)
        .bind(response.encode_headers())
        .bind(response.body.as_ref())
        .bind(shared.retention.as_secs_f64())
        .bind(shared.xid.as_str())
        .bind(response.resource_id.as_ref().map(|id| id.as_str()))
        .execute(transaction.raw())
        .await;
    if let Err(e) = remembered {
        let error = map_error(e);
        // Should the rollback fail, the connection is closed, and the
        // server rolls back.
        if let Err(rollback) = transaction.end("ROLLBACK", true).await {
            tracing::debug!(error = %rollback, "rolling back a failed completion failed");
        }
        return Err(error);
    }
    transaction
        .end("COMMIT", true)
        .await
        .map_err(map_commit_error)
}

/// [`LeaseStore::commit_fenced`](crate::store::LeaseStore::commit_fenced):
/// the check that the transaction is intact and still holds the record at
/// its token (it cannot have lost it while holding the row `FOR SHARE`,
/// unless the handler ended the transaction), then `COMMIT` and the session
/// reset.
pub(super) async fn commit_fenced(tx: SqlxTx) -> Result<(), StoreError> {
    if !tx.inner.fenced {
        return Err(StoreError::new(
            StoreErrorKind::TransactionAborted,
            "a claim's transaction commits with Store::complete",
        ));
    }
    let Some(mut transaction) = tx.take().await? else {
        return Err(finished());
    };
    let shared = &tx.inner;
    let checked = query(FENCED_CHECK, shared.transaction_pooling)
        .bind(shared.scope.tenant().as_str())
        .bind(shared.scope.endpoint())
        .bind(shared.key.as_str())
        .bind(shared.token)
        .bind(shared.xid.as_str())
        .execute(transaction.raw())
        .await;
    if let Err(e) = checked {
        let error = map_error(e);
        if let Err(rollback) = transaction.end("ROLLBACK", true).await {
            tracing::debug!(error = %rollback, "rolling back a failed fenced commit failed");
        }
        return Err(error);
    }
    transaction
        .end("COMMIT", true)
        .await
        .map_err(map_commit_error)
}

/// How long a `ROLLBACK` may queue behind a statement still running on the
/// connection (a handler cut off at its deadline) before that statement is
/// cancelled, and how long the cancelled statement then has to end.
const ROLLBACK_PATIENCE: Duration = Duration::from_millis(500);
const CANCEL_GRACE: Duration = Duration::from_secs(5);

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
                tx.cancel_running().await;
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
    transaction.end("ROLLBACK", true).await.map_err(map_error)
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
