//! The switches from the default mode to another, and what only a
//! long-running layer offers.

use super::IdempotencyLayer;
use crate::{
    fingerprint::Fingerprinter,
    scope::ResolveTenant,
    server::{
        lease_config::LeaseConfig,
        mode::{ClaimAtCommit, LongRunning, ShortTransaction},
        recovery::Recovery,
        status::StatusService,
    },
    store::{CommitStore, LeaseStore},
};

impl<St, F, R> IdempotencyLayer<St, F, R, ShortTransaction>
where
    St: LeaseStore,
{
    /// Switches the endpoint to the long-running mode (see [`lease`](crate::lease)):
    /// the first short transaction commits an `in_progress` record with a
    /// lease and an attempt token, the work runs outside any claim
    /// transaction with heartbeats renewing the lease, its writes go through
    /// fenced transactions, and a request whose work takes longer than
    /// [`LeaseConfig::respond_within`] is answered `202 Accepted` with the
    /// operation's status resource.
    ///
    /// The handler finds the store's lease handle (for [`PgStore`](crate::postgres::PgStore):
    /// [`PgLease`](crate::postgres::PgLease)) in its request extensions, instead of a
    /// transaction. [`handler_timeout`](Self::handler_timeout) bounds the
    /// whole work; raise it for work that takes longer than 30 s.
    pub fn long_running(self, config: LeaseConfig) -> IdempotencyLayer<St, F, R, LongRunning> {
        crate::metrics::register_long_running(&self.setup.config.endpoint);
        self.with_mode(LongRunning::new(config))
    }
}

impl<St, F, R> IdempotencyLayer<St, F, R, ShortTransaction>
where
    St: CommitStore,
{
    /// Switches the endpoint to the one-commit mode ([`ClaimAtCommit`]):
    /// nothing is claimed before the handler runs; its writes come first,
    /// and the key's record goes in with the response in the same
    /// transaction, pipelined with the `COMMIT`, so that the key's
    /// uniqueness decides at commit. A request costs about what the bare
    /// handler costs (no claim round trip, no completion `UPDATE`).
    ///
    /// The guarantee changes from "one owner runs" to "one commit wins":
    /// duplicates in this process are still coalesced (one handler run),
    /// but duplicates that reach two processes at once may each run the
    /// handler, and every loser's transaction rolls back and answers the
    /// winner's response. Choose it only when **every effect of the
    /// handler is in its transaction** (rows, outbox events; calls to
    /// other systems go through the outbox): see
    /// [choosing a mode](crate::guide::modes). A long-running endpoint
    /// cannot use it: the two switches exist only on a default-mode layer.
    ///
    /// ```
    /// use tower_idempotency::{fingerprint::JsonFingerprinter, memory::MemoryStore, IdempotencyLayer};
    ///
    /// let layer = IdempotencyLayer::new(MemoryStore::new(), "POST /orders v1", JsonFingerprinter::new("orders.v1"))
    ///     .claim_at_commit();
    /// # let _ = layer;
    /// ```
    pub fn claim_at_commit(self) -> IdempotencyLayer<St, F, R, ClaimAtCommit> {
        crate::metrics::register_at_commit(&self.setup.config.endpoint);
        self.with_mode(ClaimAtCommit)
    }
}

impl<St, F, R> IdempotencyLayer<St, F, R, ShortTransaction> {
    /// The same layer in another mode.
    fn with_mode<M>(self, mode: M) -> IdempotencyLayer<St, F, R, M> {
        IdempotencyLayer {
            setup: self.setup.swap(|resolver, _| (resolver, mode)),
        }
    }
}

impl<St, F, R> IdempotencyLayer<St, F, R, LongRunning>
where
    St: LeaseStore,
    F: Fingerprinter,
    R: ResolveTenant,
{
    /// The status resource of this endpoint's operations, to mount at the
    /// configured [`status_path`](LeaseConfig::status_path) (e.g.
    /// `GET /operations/{id}`). It resolves tenants as this layer does, and
    /// answers `404 not_found` for other tenants' and unknown operations.
    pub fn status_service(&self) -> StatusService<St, R> {
        StatusService::new(self.setup.store.clone(), self.setup.resolver.clone())
    }

    /// A worker that re-drives this endpoint's operations whose lease
    /// expired with nobody retrying, through `inner`: the service this
    /// layer wraps, without the layer (see [`Recovery`]).
    pub fn recovery<S>(&self, inner: S) -> Recovery<S, St, F, R> {
        Recovery::new(inner, self.setup.clone())
    }
}
