//! [`SqlxTx`]: the claim's transaction, which the handler writes through
//! and the store commits with the remembered response.

use std::{
    fmt,
    ops::{Deref, DerefMut},
    sync::Arc,
};

use tokio::sync::MappedMutexGuard;

use super::conn::GuardedConnection;
use crate::{
    protocol::identity::{tx_accessors, TxIdentity},
    protocol::owner::{finished, Handle, Slot},
    store::StoreError,
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
    inner: Arc<Slot<GuardedConnection>>,
}

impl Handle for SqlxTx {
    type Conn = GuardedConnection;

    fn of(slot: Arc<Slot<GuardedConnection>>) -> Self {
        SqlxTx { inner: slot }
    }

    fn slot(&self) -> &Slot<GuardedConnection> {
        &self.inner
    }
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
    /// The transaction's connection, for the handler's statements.
    ///
    /// [`StoreErrorKind::TransactionAborted`](crate::store::StoreErrorKind::TransactionAborted) once the layer completed or
    /// aborted the transaction (e.g. a task spawned by the handler writes
    /// after the handler returned).
    pub async fn conn(&self) -> Result<SqlxConn<'_>, StoreError> {
        let conn = self.inner.lock().await.ok_or_else(finished)?;
        Ok(SqlxConn { conn })
    }

    tx_accessors!();

    /// Who owns the key.
    fn identity(&self) -> &TxIdentity {
        self.inner.identity()
    }
}

impl fmt::Debug for SqlxTx {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        self.inner.identity().fmt_debug("SqlxTx", f)
    }
}

#[cfg(feature = "axum")]
crate::macros::from_extensions! {
    #[cfg_attr(docsrs, doc(cfg(all(feature = "axum", feature = "sqlx"))))]
    SqlxTx,
}
