//! Long-running operations on a `sqlx` pool: [`SqlxLease`], the owner's
//! proof of ownership, and its fenced transaction (`protocol::owner`).
//! [`LeaseStore`](crate::store::LeaseStore) for [`SqlxStore`] is the
//! protocol's (`protocol::lease`), as [`PgStore`](crate::postgres::PgStore)'s
//! is: the same table, the same decisions, one statement on the key's row
//! each, guarded by the attempt token.

use std::{fmt, sync::Arc};

use super::{SqlxStore, SqlxTx};
use crate::{
    protocol::identity::{lease_accessors, LeaseIdentity},
    protocol::owner,
    store::StoreError,
};

/// The lease of a long-running operation's owner on a [`SqlxStore`], in the
/// handler's request extensions.
///
/// It proves ownership by its attempt token. Every write of the work goes
/// through a fenced transaction from [`transaction`](Self::transaction),
/// which holds the operation's record at this token until
/// [`commit`](Self::commit): a takeover by a newer owner cannot come in
/// between, and a stale owner gets
/// [`StoreErrorKind::Fenced`](crate::store::StoreErrorKind::Fenced) and
/// must stop. The layer renews the lease with heartbeats while the handler
/// runs and stores its answer by a compare-and-swap on the token.
///
/// ```no_run
/// # async fn handler(lease: tower_idempotency::sqlx::SqlxLease) -> Result<(), Box<dyn std::error::Error>> {
/// // … the slow call, keyed by `lease.operation_id()`, carrying `lease.attempt_token()` …
/// let tx = lease.transaction().await?; // Fenced if another owner took over
/// {
///     let mut conn = tx.conn().await?;
///     sqlx::query("UPDATE orders SET fulfilment = 'shipped' WHERE tenant_id = $1")
///         .bind(lease.tenant())
///         .execute(&mut *conn)
///         .await?;
/// }
/// lease.commit(tx).await?;
/// # Ok(()) }
/// ```
#[derive(Clone)]
pub struct SqlxLease {
    inner: Arc<Shared>,
}

struct Shared {
    store: SqlxStore,
    id: LeaseIdentity,
}

impl SqlxLease {
    pub(super) fn new(store: SqlxStore, id: LeaseIdentity) -> Self {
        SqlxLease {
            inner: Arc::new(Shared { store, id }),
        }
    }

    lease_accessors!();

    /// Opens a fenced transaction: the operation's record is held (`FOR
    /// SHARE`) at this lease's token until [`commit`](Self::commit) (or
    /// [`Store::abort`](crate::store::Store::abort), or the handle is
    /// dropped: it rolls back). Write through [`SqlxTx::conn`].
    ///
    /// Keep it short: while it is open, heartbeats and takeovers wait for
    /// it. Never hold one across a slow external call; PostgreSQL ends one
    /// left idle for longer than the lease.
    ///
    /// [`StoreErrorKind::Fenced`](crate::store::StoreErrorKind::Fenced) if
    /// another owner took the operation over.
    pub async fn transaction(&self) -> Result<SqlxTx, StoreError> {
        owner::open_fenced(&self.inner.store, &self.inner.id).await
    }

    /// Commits a fenced transaction of this lease (as
    /// [`LeaseStore::commit_fenced`](crate::store::LeaseStore::commit_fenced)).
    pub async fn commit(&self, tx: SqlxTx) -> Result<(), StoreError> {
        owner::commit_fenced(tx).await
    }

    pub(super) fn identity(&self) -> &LeaseIdentity {
        &self.inner.id
    }
}

impl fmt::Debug for SqlxLease {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        self.inner.id.fmt_debug("SqlxLease", f)
    }
}

#[cfg(feature = "axum")]
crate::macros::from_extensions! {
    #[cfg_attr(docsrs, doc(cfg(all(feature = "axum", feature = "sqlx"))))]
    SqlxLease,
}
