//! Long-running operations on PostgreSQL: [`PgLease`], the owner's proof of
//! ownership, and [`FencedTx`], the transaction its writes go through.
//! Its fenced transaction is the protocol's (`protocol::owner`).

use std::{fmt, sync::Arc};

use super::{PgStore, PgTx, TxError};
use crate::protocol::identity::{lease_accessors, LeaseIdentity};

/// The lease of a long-running operation's owner, in the handler's request
/// extensions (with the `axum` feature also an extractor).
///
/// It proves ownership by its attempt token: every write of the work goes
/// through [`transaction`](Self::transaction), which holds the operation's
/// record at this token until the commit, so a takeover by a newer owner
/// cannot slip in between; a stale owner gets [`TxErrorKind::Fenced`](super::TxErrorKind::Fenced)
/// and must stop. The layer renews the lease with heartbeats while the
/// handler runs, and stores the handler's answer by a compare-and-swap on
/// the token.
///
/// Pass [`operation_id`](Self::operation_id) (stable across takeovers) to
/// downstream calls as their idempotency key, through
/// [`derive_key`](crate::outbox::derive_key), and
/// [`attempt_token`](Self::attempt_token) as a fencing token, so a
/// downstream service can refuse calls from a stale attempt.
///
/// ```no_run
/// # async fn handler(lease: tower_idempotency::postgres::PgLease) -> Result<(), tower_idempotency::postgres::TxError> {
/// use tower_idempotency::outbox::derive_key;
///
/// let shipment_key = derive_key(&lease.operation_id().to_string(), "warehouse.ship");
/// // … the slow call, carrying `shipment_key` and `lease.attempt_token()` …
/// let tx = lease.transaction().await?; // Fenced if another owner took over
/// tx.execute("UPDATE orders SET fulfilment = 'shipped' WHERE tenant_id = $1", &[&lease.tenant()])
///     .await?;
/// tx.commit().await?;
/// # Ok(()) }
/// ```
#[derive(Clone)]
pub struct PgLease {
    inner: Arc<Shared>,
}

struct Shared {
    store: PgStore,
    id: LeaseIdentity,
}

impl PgLease {
    pub(super) fn new(store: PgStore, id: LeaseIdentity) -> Self {
        PgLease {
            inner: Arc::new(Shared { store, id }),
        }
    }

    lease_accessors!();

    /// Opens a fenced transaction: the operation's record is held (`FOR
    /// SHARE`) at this lease's token until [`FencedTx::commit`], so the
    /// writes commit only if no newer owner exists, and none can appear
    /// before they do.
    ///
    /// Keep it short: while it is open, heartbeats and takeovers wait for
    /// it. Never hold one across a slow external call; PostgreSQL ends one
    /// left idle for longer than the lease, and a lock wait inside it gives
    /// up after half the lease (at most 5 s) with `55P03`.
    ///
    /// [`TxErrorKind::Fenced`](super::TxErrorKind::Fenced) if another owner
    /// took the operation over.
    pub async fn transaction(&self) -> Result<FencedTx, TxError> {
        let tx = crate::protocol::owner::open_fenced(&self.inner.store, &self.inner.id).await?;
        Ok(FencedTx { tx })
    }

    pub(super) fn identity(&self) -> &LeaseIdentity {
        &self.inner.id
    }
}

impl fmt::Debug for PgLease {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        self.inner.id.fmt_debug("PgLease", f)
    }
}

#[cfg(feature = "axum")]
crate::macros::from_extensions! {
    #[cfg_attr(docsrs, doc(cfg(all(feature = "axum", feature = "postgres"))))]
    PgLease,
}

/// A fenced transaction of a long-running operation's owner, from
/// [`PgLease::transaction`]: a [`PgTx`] (it dereferences to one) that the
/// handler commits itself.
///
/// [`commit`](Self::commit) commits only if the transaction is intact (no
/// statement failed) and the lease still holds the newest token. Dropped
/// without a commit, it rolls back (its connection is closed).
#[derive(Debug)]
pub struct FencedTx {
    tx: PgTx,
}

impl FencedTx {
    /// Commits the writes. [`TxErrorKind::Store`](super::TxErrorKind::Store)
    /// with [`StoreErrorKind::OutcomeUnknown`](crate::store::StoreErrorKind::OutcomeUnknown)
    /// if the connection was lost during the commit.
    pub async fn commit(self) -> Result<(), TxError> {
        Ok(crate::protocol::owner::commit_fenced(self.tx).await?)
    }

    /// Rolls the writes back.
    pub async fn rollback(self) -> Result<(), TxError> {
        Ok(crate::protocol::owner::abort(self.tx).await?)
    }
}

impl std::ops::Deref for FencedTx {
    type Target = PgTx;

    fn deref(&self) -> &PgTx {
        &self.tx
    }
}
