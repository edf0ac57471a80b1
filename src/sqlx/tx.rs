//! [`SqlxTx`]: the claim's transaction, which the handler writes through
//! and the store commits with the remembered response.

use std::{
    fmt,
    ops::{Deref, DerefMut},
    sync::Arc,
    time::Duration,
};

use ::sqlx::{Executor as _, PgPool};
use tokio::sync::{MappedMutexGuard, Mutex, MutexGuard};

use super::{conn::GuardedConnection, end::finished};
use crate::{
    key::IdempotencyKey,
    protocol::cancel::cancel_backend,
    protocol::identity::{tx_accessors, Identity, Tx, TxIdentity},
    protocol::waits::{commit_gave_up, CANCEL_GRACE, COMMIT_PATIENCE, ROLLBACK_PATIENCE},
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
    id: TxIdentity,
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
        fingerprint: crate::fingerprint::Fingerprint,
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
                id: Identity::new(scope, key, fingerprint, token, retention, Tx::new(xid)),
                fenced,
            }),
        }
    }

    /// The handle of a transaction that owns (or, in the one-commit mode,
    /// will claim) `request`'s key in `store`'s pool.
    pub(super) fn of_request(
        tx: GuardedConnection,
        store: &super::SqlxStore,
        pid: i32,
        request: &crate::store::ClaimRequest,
        token: i64,
        xid: String,
    ) -> Self {
        Self::new(
            tx,
            store.pool.clone(),
            pid,
            store.transaction_pooling,
            request.scope.clone(),
            request.key.clone(),
            request.fingerprint,
            token,
            xid,
            request.retention,
            false,
        )
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

    tx_accessors!();

    /// Who owns the key, for the statements that end the transaction.
    pub(super) fn identity(&self) -> &TxIdentity {
        &self.inner.id
    }

    /// Whether this is a long-running owner's fenced transaction
    /// ([`SqlxLease::transaction`](super::SqlxLease::transaction)) rather
    /// than a claim's.
    pub(super) fn is_fenced(&self) -> bool {
        self.inner.fenced
    }

    /// Whether the store sends unnamed statements (behind a transaction
    /// pooler).
    pub(super) fn transaction_pooling(&self) -> bool {
        self.inner.transaction_pooling
    }

    /// Takes the transaction out to commit it; `None` if it already ended.
    /// A statement a task of the handler started through a clone and that
    /// still runs is part of the work the response describes: this waits
    /// for it, as [`PgTx`](crate::postgres::PgTx) does, and the commit
    /// decides; but at most [`COMMIT_PATIENCE`]. Past it (a statement that
    /// does not end, an [`SqlxConn`](super::SqlxConn) a task keeps) the
    /// statement is cancelled, the transaction rolled back as soon as the
    /// connection is free, and the commit refused (`Unavailable`).
    pub(super) async fn take_to_commit(&self) -> Result<Option<GuardedConnection>, StoreError> {
        if let Ok(mut held) = tokio::time::timeout(COMMIT_PATIENCE, self.inner.tx.lock()).await {
            return Ok(held.take());
        }
        self.cancel_running().await;
        if let Ok(mut held) = tokio::time::timeout(CANCEL_GRACE, self.inner.tx.lock()).await {
            if let Some(transaction) = held.take() {
                transaction.rollback_quietly().await;
            }
        }
        // Not free within the grace: the last handle to go closes the
        // connection, and the server rolls back.
        Err(commit_gave_up())
    }

    /// Takes the transaction out to roll it back; `None` if it already
    /// ended. A task the handler spawned may still hold the connection in a
    /// statement: after [`ROLLBACK_PATIENCE`] that statement is cancelled,
    /// and after [`CANCEL_GRACE`] more the store gives up (`Unavailable`;
    /// the transaction is rolled back once the statement ends and the last
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
    ///
    /// Whether the cancel was delivered: one that could not be (within
    /// [`CANCEL_DEADLINE`](crate::protocol::waits::CANCEL_DEADLINE)) says
    /// the database is not answering.
    pub(super) async fn cancel_running(&self) -> bool {
        let cancel = cancel_backend(self.inner.pid);
        let cancelled = tokio::time::timeout(
            crate::protocol::waits::CANCEL_DEADLINE,
            (&self.inner.pool).execute(::sqlx::AssertSqlSafe(cancel)),
        )
        .await;
        match cancelled {
            Ok(Ok(_)) => true,
            Ok(Err(e)) => {
                tracing::debug!(error = %e, "cancelling a statement left running failed");
                false
            }
            Err(_) => {
                tracing::debug!("cancelling a statement left running took too long");
                false
            }
        }
    }
}

impl fmt::Debug for SqlxTx {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        self.inner.id.fmt_debug("SqlxTx", f)
    }
}

#[cfg(feature = "axum")]
crate::macros::from_extensions! {
    #[cfg_attr(docsrs, doc(cfg(all(feature = "axum", feature = "sqlx"))))]
    SqlxTx,
}

impl Drop for Shared {
    fn drop(&mut self) {
        if self.tx.get_mut().is_some() {
            // The connection closes instead of going back to the pool
            // (`GuardedConnection`'s drop); PostgreSQL rolls back.
            self.id.warn_dropped_unfinished();
        }
    }
}
